//! Per-Service traffic of the iptables mode, read from the packet counters of each Service's own
//! rules in `iptables-save -c` (one sample per counting rule; `proxy_model::traffic`).
//!
//! The nat table sees only the first packet of each connection (later packets follow the
//! conntrack entry), so a nat rule's packet counter counts connections, and only at the rule
//! where a frontend's traffic enters the Service's chains: every chain after it (KUBE-EXT-*,
//! KUBE-SVC-*, KUBE-SVL-*, the KUBE-MARK-MASQ rules) sees the same packets again. The rules
//! counted, as `rules.rs` writes them after kube-proxy's `syncProxyRules`:
//!
//! | rule | counts |
//! |---|---|
//! | nat KUBE-SERVICES `"<svc> cluster IP"` → KUBE-SVC/KUBE-SVL | ClusterIP `new_connections` |
//! | nat KUBE-SERVICES `"<svc> external IP"` → KUBE-EXT | externalIP `new_connections` |
//! | nat KUBE-SERVICES `"<svc> loadbalancer IP"` → KUBE-EXT | LB `new_connections` |
//! | nat KUBE-FW-* `"<svc> loadbalancer IP"` `-s <range>` → KUBE-EXT | LB `new_connections` (behind `loadBalancerSourceRanges`) |
//! | nat KUBE-FW-* `"other traffic to <svc> will be dropped …"` | LB `dropped_source_range` |
//! | nat KUBE-NODEPORTS `<svc>` → KUBE-EXT | NodePort `new_connections` |
//! | filter KUBE-SERVICES / KUBE-EXTERNAL-SERVICES `"<svc> has no endpoints"` REJECT | `rejected` |
//! | filter KUBE-SERVICES / KUBE-EXTERNAL-SERVICES `"<svc> has no local endpoints"` DROP | `dropped_no_local` |
//! | nat KUBE-SEP-* DNAT | the endpoint's `new_connections` |
//!
//! An LB IP behind source ranges is counted in its KUBE-FW chain rather than at its
//! KUBE-SERVICES rule, so that refused clients are not also new connections; filter
//! KUBE-PROXY-FIREWALL's DROP sees the same refused packets as the KUBE-FW chain's last rule and
//! is not counted. A dropped or rejected packet never confirms its conntrack entry, so each
//! retry (a retransmitted SYN, every UDP packet) is counted again, in the filter table and in
//! nat alike. While a Service with `externalTrafficPolicy: Local` has no endpoint on this node,
//! its external frontends' nat rules are not counted: the KUBE-EXT chain sends only pods' and
//! the node's own connections on (those are still in the endpoints' counts) and the rest falls
//! through to the filter table's DROP, counted as `dropped_no_local` — or, behind source ranges,
//! to KUBE-PROXY-FIREWALL, counted as `dropped_source_range` since that is the rule dropping them.
//! Packets and bytes are not counted: no rule of a Service sees every packet of it.
//!
//! iptables-restore restarts the counters of every chain it writes. Every sync writes nat
//! KUBE-SERVICES and KUBE-NODEPORTS and the whole filter table; a Service's KUBE-FW and KUBE-SEP
//! chains only in a full sync or a partial one that changed the Service. A sample's unit
//! therefore includes the restore that last wrote its chain ([`RuleEpochs`]): counts made after
//! a unit's last reading and before its chain was rewritten are lost, but none is counted twice.
//! Chains no packet can reach from KUBE-SERVICES are not read (`live_chains`).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
};

use proxy_kernel::iptables::save::{self, SavedRule};
use proxy_model::{
    desired::{FamilySnapshot, IpFamily, Protocol},
    objects::ObjectKey,
    traffic::{
        EndpointTrafficSample, FrontendKind, ServicePortLabels, ServiceTrafficKey, TrafficCounts,
        TrafficReading, TrafficSample,
    },
};

use super::chains::{KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_SERVICES};

const SVC_PREFIX: &str = "KUBE-SVC-";
const SVL_PREFIX: &str = "KUBE-SVL-";
const EXT_PREFIX: &str = "KUBE-EXT-";
const FW_PREFIX: &str = "KUBE-FW-";
const SEP_PREFIX: &str = "KUBE-SEP-";

/// What the reader needs beyond the rules themselves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrafficContext {
    /// The load-balancer frontends (address, port, protocol) of the last sync. A Service
    /// without endpoints has only its filter REJECTs, written alike for its externalIPs and its
    /// LB IPs; this tells them apart (with endpoints, its nat rules' comments do).
    pub load_balancer_frontends: BTreeSet<(IpAddr, u16, Protocol)>,
    pub epochs: RuleEpochs,
}

/// Which restore last wrote each chain, and so restarted its counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleEpochs {
    /// Successful restores so far; each rewrites nat KUBE-SERVICES and KUBE-NODEPORTS and the
    /// whole filter table.
    pub shared: u64,
    /// The last full sync's restore, which rewrote every Service's chains.
    pub full: u64,
    /// Services whose chains a partial sync wrote after the last full one, with that restore.
    pub services: BTreeMap<ObjectKey, u64>,
}

impl RuleEpochs {
    /// The restore that last wrote the chains of the Service `namespace/name`.
    pub fn service(&self, namespace: &str, name: &str) -> u64 {
        if self.services.is_empty() {
            return self.full;
        }
        let key = ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        };
        self.services.get(&key).copied().unwrap_or(self.full)
    }
}

impl TrafficContext {
    /// Records a successful restore of `snapshot`: a full one (`changed` is `None`) or a
    /// partial one that wrote the chains of `changed`. `stale_chains_deleted`: it also deleted
    /// every chain no Service uses, so Services gone from the snapshot need no epoch any more.
    pub fn record_restore(
        &mut self,
        snapshot: &FamilySnapshot,
        changed: Option<&BTreeSet<ObjectKey>>,
        stale_chains_deleted: bool,
    ) {
        let epochs = &mut self.epochs;
        epochs.shared += 1;
        match changed {
            None => {
                epochs.full = epochs.shared;
                epochs.services.clear();
            }
            Some(changed) => {
                for service in changed {
                    epochs.services.insert(service.clone(), epochs.shared);
                }
                if stale_chains_deleted && !epochs.services.is_empty() {
                    let present: BTreeSet<&ObjectKey> = snapshot
                        .service_ports
                        .keys()
                        .map(|name| &name.service)
                        .collect();
                    epochs.services.retain(|key, _| present.contains(key));
                }
            }
        }
        self.load_balancer_frontends = snapshot
            .service_ports
            .values()
            .flat_map(|port| {
                port.load_balancer_ips
                    .iter()
                    .map(|ip| (*ip, port.port, port.protocol))
            })
            .collect();
    }
}

/// Which count a rule's packet counter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Count {
    NewConnections,
    Rejected,
    DroppedSourceRange,
    DroppedNoLocal,
}

impl Count {
    fn name(self) -> &'static str {
        match self {
            Count::NewConnections => "new_connections",
            Count::Rejected => "rejected",
            Count::DroppedSourceRange => "dropped_source_range",
            Count::DroppedNoLocal => "dropped_no_local",
        }
    }

    fn counts(self, packets: u64) -> TrafficCounts {
        let mut counts = TrafficCounts::default();
        match self {
            Count::NewConnections => counts.new_connections = packets,
            Count::Rejected => counts.rejected = packets,
            Count::DroppedSourceRange => counts.dropped_source_range = packets,
            Count::DroppedNoLocal => counts.dropped_no_local = packets,
        }
        counts
    }
}

/// The restore whose counters a sample holds: that of its Service's chains (`service`) or of
/// the chains every restore rewrites.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleEpoch {
    pub service: Option<ObjectKey>,
    pub epoch: u64,
}

impl SampleEpoch {
    /// Whether `context` (taken later) still has the chain unwritten since: no restore between
    /// the reading's context and `context` reset its counters.
    pub fn current_in(&self, context: &TrafficContext) -> bool {
        let now = match &self.service {
            Some(service) => context.epochs.service(&service.namespace, &service.name),
            None => context.epochs.shared,
        };
        now == self.epoch
    }
}

/// A [`TrafficReading`] with each sample's [`SampleEpoch`], for a reading taken off the
/// agent's loop: a restore may have rewritten a sample's chain between the context it was read
/// with and the dump, and such a sample is dropped rather than counted against the wrong epoch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EpochReading {
    pub services: Vec<(SampleEpoch, TrafficSample)>,
    pub endpoints: Vec<(SampleEpoch, EndpointTrafficSample)>,
}

impl EpochReading {
    /// The samples whose chains no restore rewrote after this reading's context, by `now`.
    pub fn settle(self, now: &TrafficContext) -> TrafficReading {
        TrafficReading {
            services: self
                .services
                .into_iter()
                .filter(|(epoch, _)| epoch.current_in(now))
                .map(|(_, sample)| sample)
                .collect(),
            endpoints: self
                .endpoints
                .into_iter()
                .filter(|(epoch, _)| epoch.current_in(now))
                .map(|(_, sample)| sample)
                .collect(),
        }
    }

    /// Every sample, as the context the reading was taken with sees them.
    pub fn into_reading(self) -> TrafficReading {
        TrafficReading {
            services: self.services.into_iter().map(|(_, s)| s).collect(),
            endpoints: self.endpoints.into_iter().map(|(_, s)| s).collect(),
        }
    }
}

/// One family's `iptables-save -c` output (its nat and filter tables, in any order) → a sample
/// per rule that counts a Service's traffic, and one per endpoint's DNAT rule. Rules without
/// counters and rules that are not a Service's counting rule are skipped; nothing in the text
/// can make it fail.
pub fn reading(family: IpFamily, save_text: &str, context: &TrafficContext) -> TrafficReading {
    epoch_reading(family, save_text, context).into_reading()
}

/// [`reading`] with each sample's epoch.
pub fn epoch_reading(family: IpFamily, save_text: &str, context: &TrafficContext) -> EpochReading {
    let tables = save::parse(save_text);
    let rules_of = |name: &'static str| {
        tables
            .iter()
            .filter(move |table| table.name == name)
            .flat_map(|table| &table.rules)
    };
    let facts = Facts::of(rules_of("nat"), rules_of("filter"), context);
    let mut units = Units::new(family);
    let mut out = EpochReading::default();
    for (table, rule) in rules_of("nat")
        .map(|rule| ("nat", rule))
        .chain(rules_of("filter").map(|rule| ("filter", rule)))
    {
        let Some(counters) = rule.counters else {
            continue;
        };
        if table == "nat"
            && let Some((service, endpoint)) = facts.endpoint(rule)
        {
            let epoch = context.epochs.service(&service.namespace, &service.name);
            let sample_epoch = SampleEpoch {
                service: Some(ObjectKey {
                    namespace: service.namespace.as_str().into(),
                    name: service.name.as_str().into(),
                }),
                epoch,
            };
            out.endpoints.push((
                sample_epoch,
                EndpointTrafficSample {
                    unit: units.unit(table, rule, "endpoint", epoch),
                    service,
                    endpoint,
                    new_connections: counters.packets,
                },
            ));
            continue;
        }
        let counted = match table {
            "nat" => facts.nat_count(rule),
            _ => facts.filter_count(rule),
        };
        let Some((service, frontend, count)) = counted else {
            continue;
        };
        let sample_epoch = if rule.chain.starts_with(FW_PREFIX) {
            SampleEpoch {
                epoch: context.epochs.service(&service.namespace, &service.name),
                service: Some(ObjectKey {
                    namespace: service.namespace.as_str().into(),
                    name: service.name.as_str().into(),
                }),
            }
        } else {
            SampleEpoch {
                service: None,
                epoch: context.epochs.shared,
            }
        };
        let tag = format!("{}/{}", frontend.label(), count.name());
        let unit = units.unit(table, rule, &tag, sample_epoch.epoch);
        out.services.push((
            sample_epoch,
            TrafficSample {
                unit,
                key: ServiceTrafficKey { service, frontend },
                counts: count.counts(counters.packets),
            },
        ));
    }
    out
}

/// What the counting rules' meaning depends on, gathered from the whole dump first.
#[derive(Debug, Default)]
struct Facts {
    /// Each Service port's chain hash (KUBE-SVC-<hash> …), from the rules that enter them.
    chain_services: HashMap<String, ServicePortLabels>,
    /// KUBE-SEP-* → the chain hash of the KUBE-SVC/KUBE-SVL chain that jumps to it, for
    /// endpoint rules without comments (large clusters).
    endpoint_chains: HashMap<String, String>,
    /// externalIPs and LB IPs the nat table names, with their kind.
    external_addresses: HashMap<(IpAddr, u16, Protocol), FrontendKind>,
    /// Service ports whose external traffic has no local endpoint to go to.
    no_local_external: BTreeSet<ServicePortLabels>,
    /// The nat chains a packet can reach from KUBE-SERVICES (see [`live_chains`]).
    live_chains: HashSet<String>,
    load_balancer_frontends: BTreeSet<(IpAddr, u16, Protocol)>,
}

impl Facts {
    fn of<'a>(
        nat: impl Iterator<Item = &'a SavedRule> + Clone,
        filter: impl Iterator<Item = &'a SavedRule>,
        context: &TrafficContext,
    ) -> Self {
        let mut facts = Facts {
            load_balancer_frontends: context.load_balancer_frontends.clone(),
            live_chains: live_chains(nat.clone()),
            ..Facts::default()
        };
        for rule in nat {
            let chain = rule.chain.as_str();
            let target = rule.arg("-j").unwrap_or_default();
            if chain == KUBE_SERVICES || chain == KUBE_NODEPORTS {
                let Some((service, what)) = service_comment(rule) else {
                    continue;
                };
                if let Some(hash) = [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX]
                    .iter()
                    .find_map(|prefix| target.strip_prefix(prefix))
                {
                    facts
                        .chain_services
                        .entry(hash.to_owned())
                        .or_insert_with(|| service.clone());
                }
                let kind = match what {
                    "external IP" => FrontendKind::ExternalIp,
                    "loadbalancer IP" => FrontendKind::LoadBalancer,
                    _ => continue,
                };
                if let Some(address) = destination(rule, service.protocol) {
                    facts.external_addresses.insert(address, kind);
                }
            } else if let Some(hash) = chain
                .strip_prefix(SVC_PREFIX)
                .or_else(|| chain.strip_prefix(SVL_PREFIX))
                && target.starts_with(SEP_PREFIX)
                && facts.live_chains.contains(chain)
            {
                facts
                    .endpoint_chains
                    .insert(target.to_owned(), hash.to_owned());
            }
        }
        for rule in filter {
            if rule.chain == KUBE_EXTERNAL_SERVICES
                && let Some((service, "has no local endpoints")) = service_comment(rule)
            {
                facts.no_local_external.insert(service);
            }
        }
        facts
    }

    /// A nat rule that counts: the entry of a frontend into a Service's chains, or a KUBE-FW
    /// chain's accept or drop.
    fn nat_count(&self, rule: &SavedRule) -> Option<(ServicePortLabels, FrontendKind, Count)> {
        let target = rule.arg("-j").unwrap_or_default();
        let chain = rule.chain.as_str();
        let (service, frontend, count) = if chain == KUBE_SERVICES {
            let (service, what) = service_comment(rule)?;
            let frontend = match what {
                "cluster IP"
                    if target.starts_with(SVC_PREFIX) || target.starts_with(SVL_PREFIX) =>
                {
                    return Some((service, FrontendKind::ClusterIp, Count::NewConnections));
                }
                "external IP" if target.starts_with(EXT_PREFIX) => FrontendKind::ExternalIp,
                // Behind source ranges (→ KUBE-FW-*) the KUBE-FW chain counts.
                "loadbalancer IP" if target.starts_with(EXT_PREFIX) => FrontendKind::LoadBalancer,
                _ => return None,
            };
            (service, frontend, Count::NewConnections)
        } else if chain == KUBE_NODEPORTS {
            // kube-proxy comments its NodePort rules with the Service port's name alone.
            let (service, what) = service_comment(rule)?;
            if !what.is_empty() || !target.starts_with(EXT_PREFIX) {
                return None;
            }
            (service, FrontendKind::NodePort, Count::NewConnections)
        } else if let Some(hash) = chain.strip_prefix(FW_PREFIX)
            && self.live_chains.contains(chain)
        {
            // Its rules carry no `-p`: the Service port comes from the chain's hash.
            let service = self.chain_services.get(hash)?.clone();
            let comment = rule.arg("--comment")?;
            let name = service_port_name(&service);
            if target.starts_with(EXT_PREFIX)
                && comment.strip_suffix(" loadbalancer IP") == Some(name.as_str())
            {
                (service, FrontendKind::LoadBalancer, Count::NewConnections)
            } else if target.is_empty()
                && comment
                    .strip_prefix("other traffic to ")
                    .and_then(|rest| rest.strip_prefix(name.as_str()))
                    .is_some_and(|rest| rest.starts_with(" will be dropped"))
            {
                return Some((
                    service,
                    FrontendKind::LoadBalancer,
                    Count::DroppedSourceRange,
                ));
            } else {
                return None;
            }
        } else {
            return None;
        };
        // Without a local endpoint the rule also counts what the filter table drops.
        (!self.no_local_external.contains(&service)).then_some((service, frontend, count))
    }

    /// A filter rule that counts: a REJECT for a Service without endpoints, a DROP for one
    /// without local endpoints.
    fn filter_count(&self, rule: &SavedRule) -> Option<(ServicePortLabels, FrontendKind, Count)> {
        let (service, what) = service_comment(rule)?;
        let count = match (what, rule.arg("-j")?) {
            ("has no endpoints", "REJECT") => Count::Rejected,
            ("has no local endpoints", "DROP") => Count::DroppedNoLocal,
            _ => return None,
        };
        let frontend = match rule.chain.as_str() {
            KUBE_SERVICES => FrontendKind::ClusterIp,
            KUBE_EXTERNAL_SERVICES => self.external_frontend(rule, service.protocol)?,
            _ => return None,
        };
        Some((service, frontend, count))
    }

    /// The frontend a KUBE-EXTERNAL-SERVICES rule matches: NodePorts match local
    /// destinations, externalIPs and LB IPs their address.
    fn external_frontend(&self, rule: &SavedRule, protocol: Protocol) -> Option<FrontendKind> {
        if rule.arg("-d").is_none() {
            return (rule.arg("--dst-type") == Some("LOCAL")).then_some(FrontendKind::NodePort);
        }
        let address = destination(rule, protocol)?;
        Some(match self.external_addresses.get(&address) {
            Some(kind) => *kind,
            None if self.load_balancer_frontends.contains(&address) => FrontendKind::LoadBalancer,
            None => FrontendKind::ExternalIp,
        })
    }

    /// A KUBE-SEP chain's DNAT: its Service port and endpoint.
    fn endpoint(&self, rule: &SavedRule) -> Option<(ServicePortLabels, SocketAddr)> {
        if !rule.chain.starts_with(SEP_PREFIX)
            || rule.arg("-j") != Some("DNAT")
            || !self.live_chains.contains(&rule.chain)
        {
            return None;
        }
        let endpoint: SocketAddr = rule.arg("--to-destination")?.parse().ok()?;
        let service = match rule
            .arg("--comment")
            .and_then(|c| labels(c, protocol(rule)?))
        {
            Some(service) => service,
            None => {
                let hash = self.endpoint_chains.get(&rule.chain)?;
                self.chain_services.get(hash)?.clone()
            }
        };
        Some((service, endpoint))
    }
}

/// The nat chains a packet can reach from KUBE-SERVICES (which also jumps to KUBE-NODEPORTS).
/// Until deferred stale-chain deletion (large clusters) removes them, a Service's chains that no
/// sync writes any more keep their old counters; their Service's epoch may still move (it
/// changed), so counting them would count their old packets again under new units. No packet
/// reaches them, so they are left out.
fn live_chains<'a>(nat: impl Iterator<Item = &'a SavedRule>) -> HashSet<String> {
    let mut jumps: HashMap<&str, Vec<&str>> = HashMap::new();
    for rule in nat {
        if let Some(target) = rule.arg("-j")
            && target.starts_with("KUBE-")
        {
            jumps.entry(rule.chain.as_str()).or_default().push(target);
        }
    }
    let mut live: HashSet<String> = HashSet::new();
    let mut pending = vec![KUBE_SERVICES];
    while let Some(chain) = pending.pop() {
        if !live.insert(chain.to_owned()) {
            continue;
        }
        pending.extend(jumps.get(chain).into_iter().flatten().copied());
    }
    live
}

/// A rule's Service port (`ns/name:port` at the start of its comment, protocol from `-p`) and
/// the rest of the comment after one space (empty when the comment is the name alone).
fn service_comment(rule: &SavedRule) -> Option<(ServicePortLabels, &str)> {
    let comment = rule.arg("--comment")?;
    let (name, what) = comment.split_once(' ').unwrap_or((comment, ""));
    Some((labels(name, protocol(rule)?)?, what))
}

/// `ns/name:port` or `ns/name` (kube-proxy's `ServicePortName.String()`).
fn labels(text: &str, protocol: Protocol) -> Option<ServicePortLabels> {
    let labels = ServicePortLabels::parse(text, protocol)?;
    // Kubernetes names and port names are DNS labels and IANA service names; anything else is
    // not a comment of ours.
    let name_chars = |part: &str| {
        part.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    };
    (name_chars(&labels.namespace) && name_chars(&labels.name) && name_chars(&labels.port))
        .then_some(labels)
}

/// The inverse of [`labels`], as the comments write it.
fn service_port_name(service: &ServicePortLabels) -> String {
    if service.port.is_empty() {
        format!("{}/{}", service.namespace, service.name)
    } else {
        format!("{}/{}:{}", service.namespace, service.name, service.port)
    }
}

fn protocol(rule: &SavedRule) -> Option<Protocol> {
    match rule.arg("-p")? {
        "tcp" => Some(Protocol::Tcp),
        "udp" => Some(Protocol::Udp),
        "sctp" => Some(Protocol::Sctp),
        _ => None,
    }
}

/// A rule's `-d <address>[/<full prefix>]` and `--dport`.
fn destination(rule: &SavedRule, protocol: Protocol) -> Option<(IpAddr, u16, Protocol)> {
    let destination = rule.arg("-d")?;
    let (address, prefix) = destination
        .split_once('/')
        .map_or((destination, None), |(a, p)| (a, Some(p)));
    let address: IpAddr = address.parse().ok()?;
    let full = if address.is_ipv4() { "32" } else { "128" };
    if prefix.is_some_and(|prefix| prefix != full) {
        return None;
    }
    let port = rule.arg("--dport")?.parse().ok()?;
    Some((address, port, protocol))
}

/// Unit ids: a hash of the family, table, chain and rule (its words, counters aside), what it
/// counts and the restore that last wrote its chain. A rule written twice alike (a Service
/// listing an externalIP twice) gets the copy's position mixed in, so no two samples share a
/// unit.
struct Units {
    family: IpFamily,
    seen: HashMap<u64, u64>,
}

impl Units {
    fn new(family: IpFamily) -> Self {
        Self {
            family,
            seen: HashMap::new(),
        }
    }

    fn unit(&mut self, table: &str, rule: &SavedRule, tag: &str, epoch: u64) -> u64 {
        let mut hash = Fnv1a::default();
        hash.field(self.family.as_k8s().as_bytes());
        hash.field(table.as_bytes());
        hash.field(rule.chain.as_bytes());
        for word in &rule.words {
            hash.field(word.as_bytes());
        }
        hash.field(tag.as_bytes());
        hash.field(&epoch.to_le_bytes());
        let unit = hash.0;
        let copies = self.seen.entry(unit).or_insert(0);
        *copies += 1;
        if *copies == 1 {
            return unit;
        }
        hash.field(&copies.to_le_bytes());
        hash.0
    }
}

/// 64-bit FNV-1a: the same ids in every run and every build, unlike std's `DefaultHasher`,
/// whose algorithm may change between Rust releases.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    /// Hashes `bytes`, then a 0xff byte (never in UTF-8) so that fields cannot run together.
    fn field(&mut self, bytes: &[u8]) {
        for byte in bytes.iter().chain(&[0xff]) {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests;
