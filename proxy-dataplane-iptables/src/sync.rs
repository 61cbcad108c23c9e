//! [`IptablesDataplane`]: makes each family's tables match the snapshot, with kube-proxy's sync
//! policy — partial syncs for changed Services, a full sync (jump rules re-ensured, every chain
//! rewritten) at start, after any failure, after a canary flush and at least every
//! `full_sync_period`, and stale-chain deletion (deferred in large clusters).

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use tracing::{debug, warn};

use super::{
    canary,
    chains::KUBE_PROXY_CANARY,
    config::{FamilyRules, HostFeatures, IptablesConfig},
    jumps::{JUMP_RULES, KUBELET_JUMP_RULES},
    rules::{SyncInput, generate, is_large_cluster},
    traffic::{self, TrafficContext},
};
use proxy_kernel::iptables::{
    detect::{self, RANDOM_FULLY_MIN},
    exec::{ExecError, Iptables},
    nfacct,
};
use proxy_kernel::{
    conntrack::{self, CleanupReport},
    node::NodeSettings,
};
use proxy_model::{
    desired::{FamilySnapshot, IpFamily, Protocol, ServicePortName, Snapshot},
    objects::ObjectKey,
    traffic::TrafficReading,
};

#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    #[error("{family}: {source}")]
    Exec {
        family: &'static str,
        #[source]
        source: ExecError,
    },
    #[error("IPv4 iptables is not usable: {0}")]
    Unusable(#[source] ExecError),
}

impl IptablesError {
    fn exec(family: IpFamily) -> impl FnOnce(ExecError) -> Self {
        move |source| IptablesError::Exec {
            family: family.as_k8s(),
            source,
        }
    }
}

/// What one family's sync did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncReport {
    pub family: IpFamily,
    pub full: bool,
    pub filter_rules: usize,
    /// nat rules after this sync (`sync_proxy_rules_iptables_total`).
    pub nat_rules: usize,
    /// nat rules in this sync's restore input, less deleted chains
    /// (`sync_proxy_rules_iptables_last`; smaller than the total in a partial sync).
    pub nat_rules_written: usize,
    pub deleted_chains: usize,
    pub large_cluster: bool,
    pub elapsed: Duration,
    /// The conntrack cleanup after this sync; `None` when no UDP/SCTP service port of the family
    /// was in the sync's scope (TCP flows are never cut: they drain as with kube-proxy).
    pub conntrack: Option<ConntrackCleanup>,
}

/// kube-proxy's `conntrack.CleanStaleEntries`, run after a successful restore: UDP/SCTP flows
/// DNATed to endpoints that went away must not stay pinned to them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConntrackCleanup {
    pub elapsed: Duration,
    /// The error as text, so that a report stays comparable.
    pub result: Result<CleanupReport, String>,
}

#[derive(Debug)]
struct Family {
    iptables: Iptables,
    rules: FamilyRules,
    need_full_sync: bool,
    last_full_sync: Option<Instant>,
    last_stale_cleanup: Option<Instant>,
    /// The UDP and SCTP frontends the rules served after the last successful sync.
    datagram_frontends: conntrack::GoneFrontends,
    /// Frontends that went since the last successful conntrack cleanup: their entries are
    /// deleted with it (a failed cleanup keeps them for the next one).
    gone_frontends: conntrack::GoneFrontends,
    /// The TCP frontend addresses the rules served (with a serving endpoint) after the last
    /// sync that could change them.
    served_streams: conntrack::ServedStreams,
    /// TCP frontends served since the last successful conntrack cleanup: their untranslated
    /// entries are deleted with it (a failed cleanup keeps them for the next one).
    newly_served: conntrack::ServedStreams,
    /// The last sync counted more endpoints than `large_cluster_threshold` (upstream's
    /// `largeClusterMode`, which its next sync reads before counting again).
    large_cluster: bool,
    /// `route_localnet` was set by us: only once localhost NodePorts are really served
    /// (upstream sets it in NewProxier under the same condition). Never unset: other
    /// components may rely on it.
    route_localnet: bool,
    /// Counts what changes the family's rules or what they are compared with: each restore
    /// (even a failed one), a change of its node settings, a recreated canary. A drift check
    /// compares the rules generated at one count with the rules listed later; if the count
    /// moved meanwhile, the two may straddle a write and the result is stale.
    generation: u64,
    /// What reading the rules' counters needs: which restore last restarted each chain's
    /// counters, the LB frontends.
    traffic: TrafficContext,
}

#[derive(Debug)]
pub struct IptablesDataplane {
    config: IptablesConfig,
    families: Vec<Family>,
}

impl IptablesDataplane {
    /// Probes the host (backend, versions, sysctls, addresses) and creates the canaries. IPv6 is
    /// skipped with a warning when ip6tables does not work; IPv4 must.
    pub fn start(config: IptablesConfig) -> Result<Self, IptablesError> {
        let backend = detect::detect_backend();
        let addresses = detect::interface_addresses();
        // Once for both families, as upstream's NewDualStackProxier.
        let (nfacct_invalid, nfacct_localhost) = nfacct::ensure_kube_proxy_counters();
        let mut families = Vec::new();
        for family in IpFamily::ALL {
            let iptables = Iptables {
                family,
                backend,
                version: detect::version(family, backend),
            };
            if let Err(error) = iptables.save_chains("nat") {
                if family == IpFamily::V4 {
                    return Err(IptablesError::Unusable(error));
                }
                warn!(%error, "ip6tables is not usable; IPv6 services are not programmed");
                continue;
            }
            let host = HostFeatures {
                random_fully: iptables.version.is_some_and(|v| v >= RANDOM_FULLY_MIN),
                conntrack_tcp_liberal: detect::conntrack_tcp_liberal(),
                // A counter that could not be created loses its `-m nfacct` match, as upstream.
                nfacct_invalid,
                nfacct_localhost,
            };
            // Until the agent's node settings arrive (`set_node`, before the first sync).
            let node_ip = detect::primary_address(&addresses, family);
            let rules = FamilyRules::new(&config, family, node_ip, &addresses, &host);
            canary::ensure(&iptables).map_err(IptablesError::exec(family))?;
            tracing::info!(
                family = family.as_k8s(),
                backend = ?backend,
                version = ?iptables.version,
                mark = %rules.mark,
                node_ip = ?node_ip,
                "iptables dataplane ready"
            );
            families.push(Family {
                iptables,
                rules,
                need_full_sync: true,
                last_full_sync: None,
                last_stale_cleanup: None,
                datagram_frontends: conntrack::GoneFrontends::default(),
                gone_frontends: conntrack::GoneFrontends::default(),
                served_streams: conntrack::ServedStreams::default(),
                newly_served: conntrack::ServedStreams::default(),
                large_cluster: false,
                route_localnet: false,
                generation: 0,
                traffic: TrafficContext::default(),
            });
        }
        Ok(Self { config, families })
    }

    pub fn families(&self) -> impl Iterator<Item = IpFamily> + '_ {
        self.families.iter().map(|f| f.iptables.family)
    }

    pub fn config(&self) -> &IptablesConfig {
        &self.config
    }

    /// Syncs every family. `changed`: the service ports changed since the last call (a partial
    /// sync when possible); `None` forces a full sync (first sync, node change). A failed
    /// family makes its next sync a full one.
    pub fn apply(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Vec<Result<SyncReport, IptablesError>> {
        let services: Option<BTreeSet<ObjectKey>> =
            changed.map(|c| c.iter().map(|name| name.service.clone()).collect());
        let config = &self.config;
        self.families
            .iter_mut()
            .map(|family| {
                let mut report = family.sync(config, snapshot, services.as_ref())?;
                let scope = if report.full { None } else { changed };
                let cleanup_needed = needs_conntrack_cleanup(snapshot, scope, report.family);
                // A UDP/SCTP frontend can only go with a full sync or a changed UDP/SCTP port:
                // other partial syncs leave the set as it was, and skip the walk of every port.
                if report.full || cleanup_needed {
                    let now = conntrack::GoneFrontends::of(snapshot.family(report.family));
                    family
                        .gone_frontends
                        .add_gone(&family.datagram_frontends, &now);
                    family.datagram_frontends = now;
                }
                // A TCP frontend can only become served with a full sync or a changed TCP port.
                if report.full || tcp_changed(scope) {
                    let now = conntrack::ServedStreams::of(snapshot.family(report.family));
                    family.newly_served.add_newly(&family.served_streams, &now);
                    family.served_streams = now;
                }
                if cleanup_needed
                    || !family.gone_frontends.is_empty()
                    || !family.newly_served.is_empty()
                {
                    let cleanup = clean_conntrack(
                        report.family,
                        snapshot,
                        &family.gone_frontends,
                        &family.newly_served,
                    );
                    if cleanup.result.is_ok() {
                        family.gone_frontends = conntrack::GoneFrontends::default();
                        family.newly_served = conntrack::ServedStreams::default();
                    }
                    report.conntrack = Some(cleanup);
                }
                Ok(report)
            })
            .collect()
    }

    /// Checks the canaries; after a flush, recreates them and makes the next sync a full one.
    /// Returns whether a resync is needed now. In this thread: the agent's loop reads them on
    /// another ([`IptablesDataplane::canary_reader`]).
    pub fn check_canaries(&mut self) -> bool {
        let reading = self.canary_reader().run();
        self.settle_canaries(&reading)
    }

    /// What reading the canaries needs, for a thread of its own: each family's tools. Listing
    /// a chain is a process per family and table (and after a flush, polls while the other
    /// tables catch up); nothing the loop writes meanwhile touches the canaries (restores
    /// leave chains they do not name alone).
    pub fn canary_reader(&self) -> CanaryReader {
        CanaryReader {
            tools: self.families.iter().map(|f| f.iptables.clone()).collect(),
        }
    }

    /// A reading of [`IptablesDataplane::canary_reader`]'s: after a flush, recreates the
    /// canaries and makes the next sync a full one. Returns whether a resync is needed now.
    pub fn settle_canaries(&mut self, reading: &CanaryReading) -> bool {
        let mut flushed = false;
        for family in &mut self.families {
            let ip_family = family.iptables.family;
            if !reading.flushed.contains(&ip_family) {
                continue;
            }
            warn!(
                family = ip_family.as_k8s(),
                "KUBE-PROXY-CANARY is gone: iptables was flushed; resyncing everything"
            );
            if let Err(error) = canary::ensure(&family.iptables) {
                warn!(%error, "cannot recreate the canary chains");
            }
            family.generation += 1;
            family.need_full_sync = true;
            flushed = true;
        }
        flushed
    }

    /// The node settings (Node object, host addresses): a family whose rules context changes
    /// gets a full sync next (its NodePort jumps, masquerade and source-range rules all depend
    /// on it). Returns whether any family changed.
    pub fn set_node(&mut self, settings: &NodeSettings) -> bool {
        let mut changed = false;
        for family in &mut self.families {
            let mut rules = family.rules.clone();
            rules.set_node(
                settings.family(family.iptables.family),
                &settings.detect_local,
            );
            if rules != family.rules {
                debug!(
                    family = family.iptables.family.as_k8s(),
                    "node settings changed; next sync is a full one"
                );
                family.rules = rules;
                family.generation += 1;
                family.need_full_sync = true;
                changed = true;
            }
        }
        changed
    }

    /// Compares the live ruleset with what a full sync of `snapshot` writes (see `drift`).
    /// With `repair`, a family that differs gets its canary back and a full sync next time.
    /// A family whose rules cannot be listed is skipped with a warning. Lists the rules in this
    /// thread; the agent's loop lists them on another ([`Self::drift_inputs`]).
    pub fn check_drift(
        &mut self,
        snapshot: &Snapshot,
        repair: bool,
    ) -> Vec<(IpFamily, super::rules_drift::ChainDrift)> {
        let results = self
            .drift_inputs(snapshot)
            .into_iter()
            .map(DriftInput::run)
            .collect();
        self.finish_drift(results, repair).drift
    }

    /// What a drift check compares, per family, for [`DriftInput::run`] on another thread
    /// (the rules are generated and listed there, not in the agent's loop).
    pub fn drift_inputs(&self, snapshot: &Snapshot) -> Vec<DriftInput> {
        self.families
            .iter()
            .map(|family| DriftInput {
                iptables: family.iptables.clone(),
                rules: family.rules.clone(),
                snapshot: snapshot.family(family.iptables.family).clone(),
                generation: family.generation,
            })
            .collect()
    }

    /// Takes the results of [`DriftInput::run`]: a family whose rules were written since its
    /// input was taken is stale (left out: its result may straddle the write); with `repair`,
    /// a family that differs gets its canary back and a full sync next time.
    pub fn finish_drift(&mut self, results: Vec<FamilyDrift>, repair: bool) -> SettledDrift {
        let settled = settle(results, |family| {
            self.families
                .iter()
                .find(|f| f.iptables.family == family)
                .map(|f| f.generation)
        });
        if repair {
            for (family, canary) in &settled.to_repair {
                let Some(family) = self
                    .families
                    .iter_mut()
                    .find(|f| f.iptables.family == *family)
                else {
                    continue;
                };
                if !canary && let Err(error) = canary::ensure(&family.iptables) {
                    warn!(%error, "cannot recreate the canary chains");
                }
                family.generation += 1;
                family.need_full_sync = true;
            }
        }
        settled
    }

    /// Per-Service traffic from the packet counters of each Service's rules, both families (see
    /// `traffic.rs`): `iptables-save -c` of the nat and filter tables of each.
    pub fn read_service_traffic(&self) -> Result<TrafficReading, IptablesError> {
        Ok(self.settle_traffic(self.traffic_input().read()?))
    }

    /// What a per-Service traffic reading needs, to take it off the agent's loop (the dump of a
    /// large node's tables takes long): [`TrafficInput::read`] there, then
    /// [`Self::settle_traffic`].
    pub fn traffic_input(&self) -> TrafficInput {
        TrafficInput {
            families: self
                .families
                .iter()
                .map(|family| (family.iptables.clone(), family.traffic.clone()))
                .collect(),
        }
    }

    /// A reading of [`TrafficInput::read`], without the samples of chains a restore rewrote
    /// since its input was taken (their counters restarted; the next reading has them).
    pub fn settle_traffic(&self, read: TrafficRead) -> TrafficReading {
        let mut reading = TrafficReading::default();
        for (ip_family, family_read) in read.families {
            let Some(family) = self
                .families
                .iter()
                .find(|f| f.iptables.family == ip_family)
            else {
                continue;
            };
            let settled = family_read.settle(&family.traffic);
            reading.services.extend(settled.services);
            reading.endpoints.extend(settled.endpoints);
        }
        reading
    }

    /// Whether a family's periodic full sync is due (`full_sync_period` elapsed).
    pub fn full_sync_due(&self) -> bool {
        self.families.iter().any(|f| f.full_sync_due(&self.config))
    }
}

/// A per-Service traffic reading, detached from the dataplane (see
/// [`IptablesDataplane::traffic_input`]).
#[derive(Debug, Clone)]
pub struct TrafficInput {
    families: Vec<(Iptables, TrafficContext)>,
}

/// What [`TrafficInput::read`] found, per family, with each sample's epoch.
#[derive(Debug, Clone, Default)]
pub struct TrafficRead {
    families: Vec<(IpFamily, traffic::EpochReading)>,
}

impl TrafficInput {
    /// `iptables-save -c` of each family's nat and filter tables, read with the rule epochs of
    /// when the input was taken.
    pub fn read(&self) -> Result<TrafficRead, IptablesError> {
        let mut read = TrafficRead::default();
        for (iptables, context) in &self.families {
            let ip_family = iptables.family;
            let mut text = String::new();
            for table in ["nat", "filter"] {
                let saved = iptables
                    .save_with_counters(table)
                    .map_err(IptablesError::exec(ip_family))?;
                text.push_str(&saved);
            }
            read.families
                .push((ip_family, traffic::epoch_reading(ip_family, &text, context)));
        }
        Ok(read)
    }
}

/// One family's drift check, detached from the dataplane: it repairs nothing.
#[derive(Debug, Clone)]
pub struct DriftInput {
    iptables: Iptables,
    rules: FamilyRules,
    snapshot: FamilySnapshot,
    /// The family's generation when the input was taken.
    generation: u64,
}

/// What [`DriftInput::run`] found for one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyDrift {
    pub family: IpFamily,
    /// The family's generation its expected rules were generated at.
    pub generation: u64,
    /// The drift and whether the canary is there; `None` when the rules could not be listed.
    pub found: Option<(Vec<super::rules_drift::ChainDrift>, bool)>,
}

/// The drift check's results once stale ones are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SettledDrift {
    pub drift: Vec<(IpFamily, super::rules_drift::ChainDrift)>,
    /// Families that differ, with whether their canary is there.
    pub to_repair: Vec<(IpFamily, bool)>,
    /// Families whose rules were written while their check ran: nothing is known of them.
    pub stale: Vec<IpFamily>,
}

/// Sorts results into current and stale by the family's generation now (`current`; `None`
/// for a family the dataplane no longer has, which is stale too).
pub fn settle(
    results: Vec<FamilyDrift>,
    current: impl Fn(IpFamily) -> Option<u64>,
) -> SettledDrift {
    let mut settled = SettledDrift::default();
    for result in results {
        if current(result.family) != Some(result.generation) {
            settled.stale.push(result.family);
            continue;
        }
        let Some((drift, canary)) = result.found else {
            continue;
        };
        if !drift.is_empty() {
            settled.to_repair.push((result.family, canary));
        }
        settled
            .drift
            .extend(drift.into_iter().map(|chain| (result.family, chain)));
    }
    settled
}

impl DriftInput {
    /// Generates what a full sync writes, lists the live rules and compares them (see
    /// [`FamilyDrift`]); a failure to list is logged.
    pub fn run(self) -> FamilyDrift {
        FamilyDrift {
            family: self.iptables.family,
            generation: self.generation,
            found: self.compare(),
        }
    }

    /// Generates what a full sync writes, lists the live rules and compares them: the drift
    /// and whether the canary is there; `None` (with a warning) when the rules cannot be
    /// listed.
    pub fn compare(&self) -> Option<(Vec<super::rules_drift::ChainDrift>, bool)> {
        let expected = generate(
            &self.rules,
            &self.snapshot,
            SyncInput {
                changed_services: None,
                existing_nat_chains: None,
            },
        );
        let expected = super::rules_drift::parse(&String::from_utf8_lossy(&expected.restore));
        let mut live_text = String::new();
        for table in super::rules_drift::TABLES {
            match self.iptables.save(table) {
                Ok(text) => live_text.push_str(&text),
                Err(error) => {
                    warn!(%error, "cannot list rules for the drift check");
                    return None;
                }
            }
        }
        let canary = self.iptables.chain_exists("mangle", KUBE_PROXY_CANARY);
        let drift =
            super::rules_drift::diff(&expected, &super::rules_drift::parse(&live_text), canary);
        Some((drift, canary))
    }

    pub fn family(&self) -> IpFamily {
        self.iptables.family
    }
}

impl Family {
    fn full_sync_due(&self, config: &IptablesConfig) -> bool {
        full_sync_due(
            self.need_full_sync,
            self.last_full_sync.map(|t| t.elapsed()),
            self.large_cluster,
            config.full_sync_period,
        )
    }

    fn sync(
        &mut self,
        config: &IptablesConfig,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ObjectKey>>,
    ) -> Result<SyncReport, IptablesError> {
        let started = Instant::now();
        let family = self.iptables.family;
        let full = changed.is_none() || self.full_sync_due(config);
        // Before the restore: a drift check that lists the rules from now on may see it.
        self.generation += 1;
        let result = self.try_sync(config, snapshot, if full { None } else { changed }, started);
        if result.is_err() {
            // The change set is consumed: only a full sync can recover the lost state.
            self.need_full_sync = true;
        }
        result.map_err(IptablesError::exec(family))
    }

    fn try_sync(
        &mut self,
        config: &IptablesConfig,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ObjectKey>>,
        started: Instant,
    ) -> Result<SyncReport, ExecError> {
        let family = self.iptables.family;
        let full = changed.is_none();
        if full {
            self.ensure_jump_rules()?;
        }
        if self.rules.localhost_node_ports && !self.route_localnet {
            enable_route_localnet();
            self.route_localnet = true;
        }
        let family_snapshot = snapshot.family(family);
        let large_cluster = is_large_cluster(&self.rules, family_snapshot);
        // Upstream records the mode before the restore, so a failed sync still counts.
        self.large_cluster = large_cluster;
        // Listing nat can take seconds on big hosts; large clusters do it once per sync period.
        let cleanup_due = !large_cluster
            || self
                .last_stale_cleanup
                .is_none_or(|t| t.elapsed() > config.sync_period);
        let existing = if cleanup_due {
            match self.iptables.save_chains("nat") {
                Ok(chains) => Some(chains),
                Err(error) => {
                    warn!(%error, "cannot list nat chains; stale chains are not deleted this time");
                    None
                }
            }
        } else {
            None
        };
        let ruleset = generate(
            &self.rules,
            family_snapshot,
            SyncInput {
                changed_services: changed,
                existing_nat_chains: existing.as_ref(),
            },
        );
        self.iptables.restore(&ruleset.restore, None)?;
        // A failed restore records nothing: whether it committed a table is unknown, and a
        // chain counted as rewritten when it was not would count its packets twice.
        self.traffic
            .record_restore(family_snapshot, changed, existing.is_some());
        let now = Instant::now();
        self.need_full_sync = false;
        if full {
            self.last_full_sync = Some(now);
        }
        if existing.is_some() {
            self.last_stale_cleanup = Some(now);
        }
        debug!(
            family = family.as_k8s(),
            full,
            bytes = ruleset.restore.len(),
            "iptables-restore applied"
        );
        Ok(SyncReport {
            family,
            full,
            filter_rules: ruleset.filter_rules,
            nat_rules: ruleset.nat_rules_total,
            nat_rules_written: ruleset.nat_rules_written,
            deleted_chains: ruleset.deleted_chains.len(),
            large_cluster: ruleset.large_cluster,
            elapsed: started.elapsed(),
            conntrack: None,
        })
    }

    /// The jumps from the built-in chains, ensured one by one so other rules there stay.
    fn ensure_jump_rules(&self) -> Result<(), ExecError> {
        for jump in JUMP_RULES.iter().chain(KUBELET_JUMP_RULES) {
            self.iptables.ensure_chain(jump.table, jump.target)?;
            self.iptables
                .ensure_rule_first(jump.table, jump.source, &jump.args())?;
        }
        Ok(())
    }
}

/// kube-proxy's `doFullSync`: a full sync after a failure, a canary flush or at start
/// (`need_full_sync`), and otherwise once `period` has passed since the last one — except in
/// large-cluster mode, where kube-proxy (1.37, and the 1.34–1.36 patch releases) skips the
/// periodic one because rewriting every chain of a big node disrupted its traffic: there only
/// drift (the canary, the drift check) or a failure brings a full sync.
fn full_sync_due(
    need_full_sync: bool,
    since_last_full_sync: Option<Duration>,
    large_cluster: bool,
    period: Duration,
) -> bool {
    need_full_sync
        || (!large_cluster && since_last_full_sync.is_none_or(|elapsed| elapsed > period))
}

/// Whether a sync may have left stale UDP/SCTP conntrack entries: a full sync, or a changed
/// UDP/SCTP service port of this family.
fn needs_conntrack_cleanup(
    snapshot: &Snapshot,
    changed: Option<&BTreeSet<ServicePortName>>,
    family: IpFamily,
) -> bool {
    let stateful_datagrams =
        |name: &ServicePortName| matches!(name.protocol, Protocol::Udp | Protocol::Sctp);
    match changed {
        None => snapshot
            .family(family)
            .service_ports
            .keys()
            .any(stateful_datagrams),
        Some(changed) => changed.iter().any(stateful_datagrams),
    }
}

/// Whether a TCP port is among the `changed` ones (`None`: every port may have changed).
fn tcp_changed(changed: Option<&BTreeSet<ServicePortName>>) -> bool {
    changed.is_none_or(|changed| changed.iter().any(|name| name.protocol == Protocol::Tcp))
}

fn clean_conntrack(
    family: IpFamily,
    snapshot: &Snapshot,
    gone: &conntrack::GoneFrontends,
    newly_served: &conntrack::ServedStreams,
) -> ConntrackCleanup {
    let started = Instant::now();
    let result = conntrack::reconcile(family, snapshot.family(family), gone, newly_served)
        .map_err(|e| e.to_string());
    ConntrackCleanup {
        elapsed: started.elapsed(),
        result,
    }
}

/// Localhost NodePorts need the kernel to route 127/8 destinations off `lo`
/// (`net.ipv4.conf.all.route_localnet`, kubernetes#90259).
fn enable_route_localnet() {
    const PATH: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";
    if let Err(error) = std::fs::write(PATH, "1") {
        warn!(%error, path = PATH, "cannot enable route_localnet; localhost NodePorts will not work");
    }
}

/// Removes everything the iptables mode created, in both families (`kube-proxy --cleanup`):
/// our jump rules (not kubelet's), our top-level chains, every service chain and the canaries.
/// Best effort: returns the problems met.
pub fn cleanup() -> Vec<IptablesError> {
    let backend = detect::detect_backend();
    let mut errors = Vec::new();
    for family in IpFamily::ALL {
        let iptables = Iptables {
            family,
            backend,
            version: detect::version(family, backend),
        };
        errors.extend(
            super::cleanup::family(&iptables)
                .into_iter()
                .map(|e| IptablesError::exec(family)(e)),
        );
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules_drift::ChainDrift;

    const HOUR: Duration = Duration::from_secs(3600);

    /// The periodic full sync of kube-proxy's iptables proxier, with and without the
    /// large-cluster exception of its `doFullSync`.
    #[test]
    fn the_hourly_full_sync_is_skipped_in_large_cluster_mode_only() {
        let past = Some(HOUR + Duration::from_secs(1));
        let recent = Some(Duration::from_secs(10));
        // Small cluster: due once the period has passed, and at start.
        assert!(full_sync_due(false, past, false, HOUR));
        assert!(!full_sync_due(false, recent, false, HOUR));
        assert!(full_sync_due(false, None, false, HOUR));
        // Large cluster: never for the period alone.
        assert!(!full_sync_due(false, past, true, HOUR));
        assert!(!full_sync_due(false, Some(100 * HOUR), true, HOUR));
        // Start, a failure, a canary flush or drift force one in either mode.
        assert!(full_sync_due(true, recent, true, HOUR));
        assert!(full_sync_due(true, recent, false, HOUR));
    }

    fn chain(name: &str) -> ChainDrift {
        ChainDrift {
            table: "nat",
            kind: "changed",
            chain: name.to_owned(),
            expected: None,
            found: None,
        }
    }

    fn result(family: IpFamily, generation: u64, drift: &[&str], canary: bool) -> FamilyDrift {
        FamilyDrift {
            family,
            generation,
            found: Some((drift.iter().map(|name| chain(name)).collect(), canary)),
        }
    }

    #[test]
    fn a_family_written_during_its_check_is_stale_and_not_repaired() {
        // IPv4 was restored (generation 4 → 5) while its rules were listed: the drift it
        // shows may be that very sync, half seen. IPv6 was not: its drift stands.
        let results = vec![
            result(IpFamily::V4, 4, &["KUBE-SERVICES"], true),
            result(IpFamily::V6, 2, &["KUBE-SVC-X"], false),
        ];
        let settled = settle(results, |family| match family {
            IpFamily::V4 => Some(5),
            IpFamily::V6 => Some(2),
        });
        assert_eq!(settled.stale, [IpFamily::V4]);
        assert_eq!(settled.to_repair, [(IpFamily::V6, false)]);
        assert_eq!(settled.drift, [(IpFamily::V6, chain("KUBE-SVC-X"))]);
    }

    #[test]
    fn current_results_without_drift_or_unlisted_repair_nothing() {
        let results = vec![
            result(IpFamily::V4, 1, &[], true),
            FamilyDrift {
                family: IpFamily::V6,
                generation: 1,
                found: None,
            },
        ];
        let settled = settle(results, |_| Some(1));
        assert_eq!(settled, SettledDrift::default());
    }

    #[test]
    fn a_family_the_dataplane_no_longer_has_is_stale() {
        let settled = settle(vec![result(IpFamily::V6, 0, &["KUBE-SVC-X"], true)], |_| {
            None
        });
        assert_eq!(settled.stale, [IpFamily::V6]);
        assert!(settled.drift.is_empty() && settled.to_repair.is_empty());
    }
}

/// The canaries' check without the dataplane (see [`IptablesDataplane::canary_reader`]).
#[derive(Debug, Clone)]
pub struct CanaryReader {
    tools: Vec<Iptables>,
}

/// What [`CanaryReader::run`] found: the families whose canary was flushed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CanaryReading {
    pub flushed: Vec<IpFamily>,
}

impl CanaryReader {
    pub fn run(self) -> CanaryReading {
        CanaryReading {
            flushed: self
                .tools
                .iter()
                .filter(|tools| canary::flushed(tools))
                .map(|tools| tools.family)
                .collect(),
        }
    }
}
