//! `proxy-agent inspect explain`: the decision the eBPF datapath would take for one packet (or
//! connect) and why, read from the live pinned maps. The lookup order, the source-range rule
//! and the backend choice are the programs' own (`proxy_common::lookup`,
//! `proxy_common::select`), run here over the pinned maps:
//!
//! - a local client (`--from node|pod`) meets the socket hooks (`proxy-ebpf/src/sock.rs`): the
//!   exact INTERNAL frontend, else the NodePort frontend when the destination is a NodePort
//!   address (`KPR_NODE_ADDRS`, or 127/8 with localhost NodePorts); a frontend guarded by source
//!   ranges is judged for host sockets by the node's SNAT address and left to tc for pods (then
//!   the pod veth's tc program judges the pod's address); no backends → ECONNREFUSED, or
//!   EHOSTUNREACH where kube-proxy drops. The client address is kept.
//! - an external client meets tc (`proxy-ebpf/src/tc.rs`): a conntrack entry (with `--sport`)
//!   carries the flow; else the exact EXTERNAL frontend, else the NodePort wildcard on a node
//!   address; source ranges before NAT; REJECT (ICMP port unreachable) or DROP without
//!   backends; SNAT to the node address unless the client is preserved.
//!
//! Random choices are not predictable: the candidates are listed, and the chosen backend is
//! named only where it is determined — tc with a full tuple (`--sport`: its hash picks the slot
//! or Maglev entry), a live tc affinity entry, an existing conntrack entry.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::Path,
};

use anyhow::{Context as _, bail};
use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, lpm_trie::Key};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, BackendEntry, BackendSlotKey,
    CtKey, CtValue, Frontend4Key, Frontend6Key, FrontendValue, MaglevBlock, MaglevKey, NodeAddrKey,
    NodeConfig, SlotBlock, SourceRangeKey, StatIndex, ct_flags, family, frontend_flags,
    lookup::{self, Admit, FrontendMaps, Matched, TcSide},
    map_names, node_flags, proto, scope,
    select::{self, BackendMaps, Chosen, Decision},
};
use serde::Serialize;

use proxy_dataplane_ebpf::{ConntrackMaps, ip4_from_map, ip6_from_map};

/// Where the client is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum From {
    /// A process in the node's own network namespace.
    Node,
    /// A process in a pod (in the agent's cgroup, behind a veth).
    Pod,
    /// A packet arriving on an external interface.
    External,
}

/// What to explain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Query {
    pub from: From,
    pub client: IpAddr,
    pub dest: SocketAddr,
    pub protocol: u8,
    pub sport: Option<u16>,
}

/// The datapath's decision.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Explanation {
    /// The program that decides (`socket connect/sendmsg`, `tc external`, `tc pod veth`).
    pub program: String,
    /// What each lookup found, in order.
    pub steps: Vec<String>,
    /// The frontend that matched (`addr:port/PROTO scope`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frontend: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_id: Option<u32>,
    /// Every backend the decision may pick (empty when not translated or refused).
    pub candidates: Vec<String>,
    /// The backend, where it is determined.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chosen: Option<String>,
    /// `translate`, `pass` (not translated), `refuse`, `drop`.
    pub verdict: String,
    /// Why, in words (`ECONNREFUSED: no endpoints`, …).
    pub reason: String,
    /// The source address the backend sees: the client's, or the SNAT address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Unconnected UDP sockets that keep a backend of this frontend (`KPR_UDP_STICKY`, live
    /// entries whose backend is still a member): the socket cookie and its backend.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sticky_sockets: Vec<Pinned>,
    /// Live session-affinity entries of this Service: the client (a client network namespace
    /// cookie for the socket hooks, an address for tc) and its backend.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub affinity_entries: Vec<Pinned>,
    /// For packets tc translates: whether the host's netfilter FORWARD and POSTROUTING still
    /// see them (the default) or `--tc-fast-path` redirects them past netfilter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netfilter: Option<String>,
}

/// A client pinned to a backend: an affinity entry or an unconnected UDP socket's backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pinned {
    pub client: String,
    pub backend: String,
    /// Seconds since the entry was last used.
    pub idle_s: u64,
}

/// The map reads `explain` needs; over the pinned maps, or plain collections in tests.
pub trait Maps {
    fn frontend(&self, addr: IpAddr, port: u16, protocol: u8, scope: u8) -> Option<FrontendValue>;
    /// The backend id at `index` of the `KPR_BACKEND_SLOTS` block entry `key`.
    fn slot(&self, key: BackendSlotKey, index: usize) -> Option<u32>;
    fn backend(&self, id: u32, v6: bool) -> Option<SocketAddr>;
    fn node_address(&self, addr: IpAddr) -> bool;
    fn node_config(&self) -> Option<NodeConfig>;
    /// Whether `addr` is inside one of `service_id`'s source ranges.
    fn source_allowed(&self, service_id: u32, addr: IpAddr) -> bool;
    fn maglev(&self, key: MaglevKey) -> Option<MaglevBlock>;
    fn conntrack(&self, key: CtKey) -> Option<CtValue>;
    fn affinity(&self, key: AffinityKey) -> Option<AffinityValue>;
    fn affinity_match(&self, key: AffinityMatchKey) -> bool;
    /// Every `KPR_AFFINITY` entry (tc: client address words; sockets: netns cookie).
    fn affinity_entries(&self) -> Vec<(AffinityKey, AffinityValue)>;
    /// Every `KPR_UDP_STICKY` entry (keyed by socket cookie).
    fn sticky_entries(&self) -> Vec<(AffinityKey, AffinityValue)>;
    /// `bpf_ktime_get_ns()` now (CLOCK_MONOTONIC).
    fn now_ns(&self) -> u64;
}

fn words(addr: IpAddr) -> [u32; 4] {
    match addr {
        IpAddr::V4(a) => [u32::from_ne_bytes(a.octets()), 0, 0, 0],
        IpAddr::V6(a) => {
            let o = a.octets();
            [0, 4, 8, 12].map(|i| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]))
        }
    }
}

fn unspecified(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// One destination as `proxy_common::lookup` reads the maps for it, noting what it read.
struct Destination<'a, M> {
    maps: &'a M,
    addr: IpAddr,
    port: u16,
    protocol: u8,
    config: Option<NodeConfig>,
    /// Whether the NodePort wildcard was looked up.
    wildcard_read: bool,
    /// The NodePort address check's answer, if it was made.
    node_port_address: Option<bool>,
}

impl<'a, M: Maps> Destination<'a, M> {
    fn new(maps: &'a M, addr: IpAddr, port: u16, protocol: u8) -> Self {
        Self {
            maps,
            addr,
            port,
            protocol,
            config: maps.node_config(),
            wildcard_read: false,
            node_port_address: None,
        }
    }
}

impl<M: Maps> FrontendMaps for Destination<'_, M> {
    fn frontend(&mut self, wildcard: bool, scope: u8) -> Option<FrontendValue> {
        let addr = if wildcard {
            self.wildcard_read = true;
            unspecified(self.addr)
        } else {
            self.addr
        };
        self.maps.frontend(addr, self.port, self.protocol, scope)
    }
    fn node_port_address(&mut self) -> bool {
        let answer = self.maps.node_address(self.addr);
        self.node_port_address = Some(answer);
        answer
    }
    fn node_config(&mut self) -> Option<&NodeConfig> {
        self.config.as_ref()
    }
}

/// The backend choice over the pinned maps: reads only (the datapath's writes are its own),
/// backends as addresses; a random pick is reported as such by `Chosen`, never named.
struct Choice<'a, M> {
    maps: &'a M,
    v6: bool,
}

impl<M: Maps> BackendMaps for Choice<'_, M> {
    type Backend = SocketAddr;
    fn backend(&mut self, id: u32) -> Option<SocketAddr> {
        self.maps.backend(id, self.v6)
    }
    fn slot(&mut self, key: &BackendSlotKey, index: usize) -> Option<u32> {
        self.maps.slot(*key, index)
    }
    fn maglev(&mut self, key: &MaglevKey, index: usize) -> Option<u32> {
        self.maps.maglev(*key)?.backend_ids.get(index).copied()
    }
    fn affinity(&mut self, key: &AffinityKey) -> Option<AffinityValue> {
        self.maps.affinity(*key)
    }
    fn sticky(&mut self, _key: &AffinityKey) -> Option<AffinityValue> {
        // Keyed by a socket cookie, which a query has none of.
        None
    }
    fn member(&mut self, key: &AffinityMatchKey) -> bool {
        self.maps.affinity_match(*key)
    }
    fn remember_affinity(&mut self, _key: &AffinityKey, _value: &AffinityValue) {}
    fn remember_sticky(&mut self, _key: &AffinityKey, _value: &AffinityValue) {}
    fn now_ns(&mut self) -> u64 {
        self.maps.now_ns()
    }
    fn random(&mut self) -> u32 {
        0
    }
    fn count(&mut self, _stat: StatIndex) {}
}

fn protocol_name(number: u8) -> &'static str {
    match number {
        proto::TCP => "TCP",
        proto::UDP => "UDP",
        proto::SCTP => "SCTP",
        _ => "?",
    }
}

/// Parses `IP:PORT/PROTO` (PROTO: tcp, udp, sctp; default tcp).
pub fn parse_destination(text: &str) -> anyhow::Result<(SocketAddr, u8)> {
    let (addr, protocol) = text.rsplit_once('/').unwrap_or((text, "tcp"));
    let protocol = match protocol.to_ascii_lowercase().as_str() {
        "tcp" => proto::TCP,
        "udp" => proto::UDP,
        "sctp" => proto::SCTP,
        other => bail!("unknown protocol {other:?} (tcp, udp or sctp)"),
    };
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("{addr:?} is not IP:PORT (IPv6 as [addr]:port)"))?;
    Ok((addr, protocol))
}

/// The decision for `query` over `maps`.
pub fn explain(maps: &impl Maps, query: &Query) -> Explanation {
    let mut query = *query;
    let mut e = Explanation::default();
    // The socket hooks translate IPv4-mapped IPv6 destinations as IPv4 (Java/.NET sockets).
    if let IpAddr::V6(v6) = query.dest.ip()
        && let Some(v4) = v6.to_ipv4_mapped()
        && query.from != From::External
    {
        e.steps
            .push(format!("IPv4-mapped destination: explained as {v4}"));
        query.dest = SocketAddr::new(IpAddr::V4(v4), query.dest.port());
        if let IpAddr::V6(c) = query.client
            && let Some(c4) = c.to_ipv4_mapped()
        {
            query.client = IpAddr::V4(c4);
        }
    }
    match query.from {
        From::Node | From::Pod => socket(maps, &query, &mut e),
        From::External => tc(maps, &query, TcSide::External, &mut e),
    }
    e
}

fn describe_frontend(addr: IpAddr, port: u16, protocol: u8, scope_value: u8) -> String {
    let addr = if addr.is_unspecified() {
        format!("*:{port}")
    } else {
        SocketAddr::new(addr, port).to_string()
    };
    let scope_name = if scope_value == scope::EXTERNAL {
        "external"
    } else {
        "internal"
    };
    format!("{addr}/{} ({scope_name})", protocol_name(protocol))
}

fn socket(maps: &impl Maps, q: &Query, e: &mut Explanation) {
    e.program = "socket connect/sendmsg (cgroup hook)".to_owned();
    let (ip, port, protocol) = (q.dest.ip(), q.dest.port(), q.protocol);
    let mut dest = Destination::new(maps, ip, port, protocol);
    let found = lookup::socket_frontend(&mut dest, &words(ip), ip.is_ipv6());
    let exact = found.is_some_and(|f| f.matched == Matched::Exact);
    e.steps.push(format!(
        "exact internal frontend: {}",
        if exact { "found" } else { "none" }
    ));
    if !exact && dest.wildcard_read {
        // The NodePort address check is only made when localhost NodePorts did not apply.
        let why = if dest.node_port_address == Some(true) {
            "a NodePort address"
        } else {
            "a loopback address with localhost NodePorts"
        };
        e.steps.push(format!(
            "{ip} is {why}: NodePort frontend {}",
            if found.is_some() { "found" } else { "none" }
        ));
    }
    let found = found.map(|f| {
        let addr = if f.matched == Matched::Exact {
            ip
        } else {
            unspecified(ip)
        };
        (f.frontend, addr)
    });
    let Some((frontend, addr)) = found else {
        e.verdict = "pass".to_owned();
        e.reason =
            "no frontend: not translated, the connection goes to the address as given".to_owned();
        e.source = Some(kept(q.client));
        return;
    };
    e.frontend = Some(describe_frontend(addr, port, protocol, scope::INTERNAL));
    e.service_id = Some(frontend.service_id);
    // `--bpf-socket-lb-host-namespace-only`: the same frontend, backends and verdicts, applied
    // per packet by the pod veth's tc program (`tc::internal_frontend` in the datapath).
    let in_tc = frontend.flags & frontend_flags::SOURCE_RANGES == 0
        && lookup::left_to_tc(maps.node_config().as_ref(), |_| q.from == From::Node);
    if in_tc {
        e.program = "tc (pod veth; socket LB for the host namespace only)".to_owned();
        e.steps.push(
            "socket LB for the host namespace only: the pod's socket keeps the Service address \
             and the pod veth's tc program load-balances its packets with this frontend (no \
             SNAT, except a pod reaching itself)"
                .to_owned(),
        );
    }
    let v6 = addr.is_ipv6();
    let config = maps.node_config();
    let admit = lookup::socket_admit(
        &frontend,
        config.as_ref(),
        |_| q.from == From::Node,
        v6,
        |_, key| maps.source_allowed(key.service_id, addr_of(key.addr, v6, 0).ip()),
    );
    if frontend.flags & frontend_flags::SOURCE_RANGES != 0 {
        if q.from == From::Pod {
            e.steps.push(
                "guarded by source ranges: a pod's socket is left untranslated; the pod veth's \
                 tc program judges the pod's address"
                    .to_owned(),
            );
            tc(maps, q, TcSide::Pod, e);
            return;
        }
        if admit == Admit::Leave {
            e.steps
                .push("guarded by source ranges: no node facts to tell host sockets by".to_owned());
            e.verdict = "pass".to_owned();
            e.reason = "left untranslated: the socket hook cannot judge the source".to_owned();
            e.source = Some(kept(q.client));
            return;
        }
        let snat = config.as_ref().and_then(|c| snat_of(c, addr));
        e.steps.push(format!(
            "guarded by source ranges: a host socket is judged by the node address {}: {}",
            snat.map_or_else(|| "(none)".to_owned(), |a| a.to_string()),
            if admit == Admit::Translate {
                "inside"
            } else {
                "outside"
            }
        ));
        if admit == Admit::Refuse {
            e.verdict = "drop".to_owned();
            e.reason = "EHOSTUNREACH: the node address is outside loadBalancerSourceRanges \
                        (kube-proxy drops)"
                .to_owned();
            return;
        }
    }
    if frontend.backend_count == 0 {
        no_backends(&frontend, true, e);
        return;
    }
    candidates(maps, &frontend, addr.is_ipv6(), e);
    e.verdict = "translate".to_owned();
    e.reason = if in_tc {
        "backend among the candidates at the slot the flow's 5-tuple hashes to (its first \
         packet; tc conntrack keeps it)"
    } else {
        "random backend among the candidates (socket-level load balancing)"
    }
    .to_owned();
    e.source = Some(kept(q.client));
    if in_tc {
        e.netfilter = Some(netfilter_path(maps));
    }
    if frontend.flags & frontend_flags::AFFINITY != 0 {
        let timeout = select::affinity_timeout_ns(&frontend);
        e.affinity_entries = live_entries(maps, &frontend, v6, maps.affinity_entries(), timeout)
            .into_iter()
            .map(|(client, p)| Pinned {
                // The tc programs key it by the client address (folded to one word).
                client: if in_tc {
                    format!("client address word {client:#x}")
                } else {
                    format!("netns cookie {client}")
                },
                ..p
            })
            .collect();
        e.steps.push(format!(
            "session affinity ({}s) per client {}: a client with a live entry (listed) keeps \
             its backend; a new one picks at random",
            frontend.affinity_timeout,
            if in_tc {
                "address (pod-side tc)"
            } else {
                "network namespace"
            }
        ));
    }
    // On the tc path a flow keeps its backend by its conntrack entry, not per socket.
    if frontend.flags & frontend_flags::STICKY_SOCKET != 0 && !in_tc {
        // No timeout: the entry lives as long as the LRU keeps it and its backend stays.
        e.sticky_sockets = live_entries(maps, &frontend, v6, maps.sticky_entries(), u64::MAX)
            .into_iter()
            .map(|(cookie, p)| Pinned {
                client: format!("socket cookie {cookie}"),
                ..p
            })
            .collect();
        e.steps.push(format!(
            "UDP: a connected socket picks once at connect; an unconnected socket picks at its \
             first sendmsg and keeps that backend while it stays a member ({} socket(s) listed)",
            e.sticky_sockets.len()
        ));
    }
}

/// The entries of `frontend`'s Service that the datapath would still follow: used within
/// `timeout_ns`, with a backend that is still a member (`KPR_AFFINITY_MATCH`). Keyed by the
/// entry's client word.
fn live_entries(
    maps: &impl Maps,
    frontend: &FrontendValue,
    v6: bool,
    entries: Vec<(AffinityKey, AffinityValue)>,
    timeout_ns: u64,
) -> Vec<(u64, Pinned)> {
    let now = maps.now_ns();
    let mut out: Vec<(u64, Pinned)> = entries
        .into_iter()
        .filter(|(key, value)| {
            key.service_id == frontend.service_id
                && select::fresh(value.last_used_ns, now, timeout_ns)
                && maps.affinity_match(AffinityMatchKey {
                    service_id: frontend.service_id,
                    backend_id: value.backend_id,
                })
        })
        .filter_map(|(key, value)| {
            let backend = maps.backend(value.backend_id, v6)?;
            Some((
                key.client,
                Pinned {
                    client: String::new(),
                    backend: backend.to_string(),
                    idle_s: now.saturating_sub(value.last_used_ns) / 1_000_000_000,
                },
            ))
        })
        .collect();
    out.sort_by_key(|(client, _)| *client);
    out
}

/// The node's SNAT address of `addr`'s family, if any.
fn snat_of(config: &NodeConfig, addr: IpAddr) -> Option<IpAddr> {
    match addr {
        IpAddr::V4(_) => (config.snat4 != 0).then(|| IpAddr::V4(ip4_from_map(config.snat4))),
        IpAddr::V6(_) => (config.snat6 != [0; 4]).then(|| IpAddr::V6(ip6_from_map(config.snat6))),
    }
}

fn no_backends(frontend: &FrontendValue, socket: bool, e: &mut Explanation) {
    if frontend.flags & frontend_flags::DROP_NO_BACKENDS != 0 {
        e.verdict = "drop".to_owned();
        e.reason = if socket {
            "EHOSTUNREACH: no local endpoints (traffic policy Local; kube-proxy drops)"
        } else {
            "DROP: no local endpoints (traffic policy Local)"
        }
        .to_owned();
    } else {
        e.verdict = "refuse".to_owned();
        e.reason = if socket {
            "ECONNREFUSED: the Service has no endpoints (kube-proxy REJECT)"
        } else {
            "REJECT: ICMP port unreachable, the Service has no endpoints"
        }
        .to_owned();
    }
}

/// Lists the live generation's backends.
fn candidates(maps: &impl Maps, frontend: &FrontendValue, v6: bool, e: &mut Explanation) {
    for slot in 0..frontend.backend_count {
        let (key, index, _) = select::slot_entry(frontend, u32::from(slot));
        match maps.slot(key, index).and_then(|id| maps.backend(id, v6)) {
            Some(backend) => e.candidates.push(backend.to_string()),
            None => e
                .steps
                .push(format!("slot {slot}: missing (the datapath refuses there)")),
        }
    }
    e.candidates.sort();
}

fn tc(maps: &impl Maps, q: &Query, side: TcSide, e: &mut Explanation) {
    e.program = match side {
        TcSide::External => "tc (external interface)",
        TcSide::Pod => "tc (pod veth)",
    }
    .to_owned();
    let (ip, port, protocol) = (q.dest.ip(), q.dest.port(), q.protocol);
    let fam = if ip.is_ipv6() { family::V6 } else { family::V4 };
    if let Some(sport) = q.sport {
        let key = CtKey {
            src: words(q.client),
            dst: words(ip),
            sport: sport.to_be(),
            dport: port.to_be(),
            proto: protocol,
            family: fam,
            _pad: 0,
        };
        if let Some(entry) = maps.conntrack(key)
            && entry.flags & ct_flags::REPLY == 0
        {
            let backend = addr_of(entry.dst, ip.is_ipv6(), entry.dport);
            let source = addr_of(entry.src, ip.is_ipv6(), entry.sport);
            let idle = maps.now_ns().saturating_sub(entry.last_seen_ns) / 1_000_000_000;
            e.steps.push(format!(
                "conntrack: an entry for this tuple (idle {idle}s{})",
                if entry.flags & ct_flags::CLOSING != 0 {
                    ", closing"
                } else {
                    ""
                }
            ));
            e.candidates = vec![backend.to_string()];
            e.chosen = Some(backend.to_string());
            e.verdict = "translate".to_owned();
            e.reason = "existing flow: conntrack carries it to its backend".to_owned();
            e.netfilter = Some(netfilter_path(maps));
            e.source = Some(if entry.flags & ct_flags::SNAT != 0 {
                format!("{source} (SNAT)")
            } else {
                kept(q.client)
            });
            return;
        }
        e.steps
            .push("conntrack: no entry for this tuple".to_owned());
    }
    let mut dest = Destination::new(maps, ip, port, protocol);
    let found = lookup::tc_frontend(&mut dest, side);
    if found.is_some_and(|f| f.matched == Matched::NodePort) {
        e.steps.push(format!(
            "no exact external frontend; {ip} is a NodePort address"
        ));
    }
    let internal = found.is_some_and(|f| f.internal);
    let found = found.map(|f| {
        let addr = if f.matched == Matched::Exact {
            ip
        } else {
            unspecified(ip)
        };
        (f.frontend, addr)
    });
    let scope = if internal {
        scope::INTERNAL
    } else {
        scope::EXTERNAL
    };
    let Some((frontend, addr)) = found else {
        e.steps.push("external frontend: none".to_owned());
        e.verdict = "pass".to_owned();
        e.reason = "no external frontend: passed to the stack untranslated".to_owned();
        e.source = Some(kept(q.client));
        return;
    };
    e.frontend = Some(describe_frontend(addr, port, protocol, scope));
    e.service_id = Some(frontend.service_id);
    if protocol == proto::TCP {
        e.steps.push(
            "TCP: only a SYN starts a flow; other segments without an entry pass untranslated"
                .to_owned(),
        );
    }
    if frontend.flags & frontend_flags::SOURCE_RANGES != 0 {
        let allowed = maps.source_allowed(frontend.service_id, q.client);
        e.steps.push(format!(
            "source ranges: {} is {}",
            q.client,
            if allowed { "inside" } else { "outside" }
        ));
        if !allowed {
            e.verdict = "drop".to_owned();
            e.reason = "DROP: the client is outside loadBalancerSourceRanges".to_owned();
            return;
        }
    }
    if frontend.backend_count == 0 {
        no_backends(&frontend, false, e);
        return;
    }
    candidates(maps, &frontend, ip.is_ipv6(), e);
    e.verdict = "translate".to_owned();
    let v6 = ip.is_ipv6();
    // The programs hash every new flow's tuple: with the client port it is known here too.
    let hash = q.sport.map(|sport| {
        let ports = (u32::from(sport.to_be()) << 16) | u32::from(port.to_be());
        proxy_common::maglev::flow_hash(&words(q.client), &words(ip), ports, protocol)
    });
    let mut choice = Choice { maps, v6 };
    let decision = select::select_backend(
        &mut choice,
        &frontend,
        || select::address_client(&words(q.client), v6),
        || hash,
        None,
    );
    let affinity = frontend.flags & frontend_flags::AFFINITY != 0;
    let maglev = frontend.flags & frontend_flags::MAGLEV != 0;
    if affinity && !matches!(decision, Decision::Backend(_, Chosen::Affinity)) {
        e.steps
            .push("session affinity: no live entry (a new one is made)".to_owned());
    }
    match decision {
        Decision::Backend(backend, Chosen::Affinity) | Decision::Kept(backend) => {
            e.steps.push("session affinity: a live entry".to_owned());
            e.chosen = Some(backend.to_string());
            e.reason = "session affinity: the client's live entry".to_owned();
        }
        Decision::Backend(backend, Chosen::Maglev { slot }) => {
            e.steps
                .push(format!("Maglev: slot {slot} of {}", frontend.maglev_size));
            e.chosen = Some(backend.to_string());
            e.reason = "Maglev: the tuple's table slot".to_owned();
        }
        Decision::Backend(backend, Chosen::Slot { slot, random }) => {
            if maglev {
                e.steps.push(
                    if random {
                        "Maglev: give --sport for the slot of the full tuple"
                    } else {
                        "Maglev: table entry missing, the flow hash's backend slot instead"
                    }
                    .to_owned(),
                );
            }
            if random {
                e.reason = "the backend at the slot the flow's tuple hashes to (give --sport \
                            to name it)"
                    .to_owned();
            } else {
                e.chosen = Some(backend.to_string());
                e.reason = format!("the flow's tuple hashes to backend slot {slot}");
            }
        }
        Decision::BackendMissing if hash.is_some() => {
            e.verdict = "drop".to_owned();
            e.reason = "DROP: the flow's backend slot or backend is missing".to_owned();
            return;
        }
        Decision::BackendMissing | Decision::NoBackends => {}
    }
    if internal {
        e.source = Some(kept(q.client));
        e.netfilter = Some(netfilter_path(maps));
        return;
    }
    e.source = Some(match snat(maps, q, &frontend) {
        Some(node) => format!("{node} (SNAT to the node address)"),
        None => kept(q.client),
    });
    e.netfilter = Some(netfilter_path(maps));
}

/// Whether netfilter FORWARD/POSTROUTING see what tc translated (`node_flags::FAST_PATH`).
fn netfilter_path(maps: &impl Maps) -> String {
    if maps
        .node_config()
        .is_some_and(|c| c.flags & node_flags::FAST_PATH != 0)
    {
        "--tc-fast-path: ingress translates both halves and redirects to the backend's \
         interface; netfilter FORWARD and POSTROUTING do not apply"
            .to_owned()
    } else {
        "netfilter path: ingress rewrites the destination and returns the packet to the stack; \
         FORWARD and POSTROUTING apply, the egress program rewrites the source after them"
            .to_owned()
    }
}

/// The client's address, unchanged by the datapath (unknown for a local socket: the kernel
/// picks it).
fn kept(client: IpAddr) -> String {
    if client.is_unspecified() {
        "the socket's own address (kept)".to_owned()
    } else {
        format!("{client} (kept)")
    }
}

fn addr_of(words: [u32; 4], v6: bool, port_be: u16) -> SocketAddr {
    let ip = if v6 {
        IpAddr::V6(ip6_from_map(words))
    } else {
        IpAddr::V4(ip4_from_map(words[0]))
    };
    SocketAddr::new(ip, u16::from_be(port_be))
}

/// `tc.rs`'s `snat_address`: none with a preserved client; a ClusterIP from outside only with
/// masqueradeAll or a client outside the cluster CIDR; else the node address (the programs take
/// the egress interface's address where the route to the backend leaves by an external
/// interface, which this does not resolve).
fn snat(maps: &impl Maps, q: &Query, frontend: &FrontendValue) -> Option<IpAddr> {
    let config = maps.node_config()?;
    if !lookup::masquerades(frontend.flags, config.flags, || {
        lookup::outside_cluster_cidr(&words(q.client), q.client.is_ipv6(), &config)
    }) {
        return None;
    }
    snat_of(&config, q.dest.ip())
}

/// iptables mode: `tracer` holds the live ruleset (`iptables-save` of nat and filter); the walk
/// has the parity tests' rule semantics (upstream's `tracePacket`), entered at nat `OUTPUT` for
/// the node's own connections and at `PREROUTING` for pods' and external packets, then the
/// filter chains of the hook the packet meets
/// ([`proxy_dataplane_iptables::tracer::Tracer::trace_hooked`]). Every DNAT
/// destination a probabilistic jump may reach is a candidate; `-m recent` affinity is state the
/// rules do not hold: [`iptables_affinity`] reads it.
pub fn explain_iptables(
    tracer: &proxy_dataplane_iptables::tracer::Tracer,
    q: &Query,
) -> Explanation {
    let start = if q.from == From::Node {
        "OUTPUT"
    } else {
        "PREROUTING"
    };
    let trace = tracer.trace_hooked(
        start,
        &q.client.to_string(),
        &protocol_name(q.protocol).to_ascii_lowercase(),
        &q.dest.ip().to_string(),
        &q.dest.port().to_string(),
    );
    let mut e = Explanation {
        program: format!("iptables (nat {start}, then the filter service chains)"),
        steps: trace.chains.iter().map(|c| format!("chain {c}")).collect(),
        ..Explanation::default()
    };
    let outputs: Vec<&str> = trace.output.split(", ").filter(|o| !o.is_empty()).collect();
    match outputs.as_slice() {
        [] => {
            e.verdict = "pass".to_owned();
            e.reason = "no rule matched: not translated".to_owned();
        }
        terminal if terminal.contains(&"REJECT") => {
            e.verdict = "refuse".to_owned();
            e.reason = if q.from == From::Node && q.protocol != proto::TCP {
                // The REJECT in filter OUTPUT sends the ICMP error and drops the datagram,
                // and a dropped locally generated packet fails its send() with EPERM.
                "REJECT in filter OUTPUT: the Service has no endpoints; a node socket's send() \
                 fails with EPERM (netfilter dropped the datagram) after the ICMP port \
                 unreachable"
            } else {
                "REJECT: the Service has no endpoints (ECONNREFUSED / ICMP port unreachable)"
            }
            .to_owned();
        }
        terminal if terminal.contains(&"DROP") => {
            e.verdict = "drop".to_owned();
            e.reason = "DROP (no local endpoints, or outside loadBalancerSourceRanges)".to_owned();
        }
        ["ACCEPT"] => {
            e.verdict = "pass".to_owned();
            e.reason = "ACCEPT: not translated".to_owned();
        }
        destinations => {
            e.candidates = destinations.iter().map(|d| (*d).to_owned()).collect();
            e.candidates.sort();
            if let [only] = destinations {
                e.chosen = Some((*only).to_owned());
            }
            e.verdict = "translate".to_owned();
            e.reason = "DNAT: a statistic (random) jump picks among the candidates".to_owned();
        }
    }
    if e.verdict == "translate" {
        e.source = Some(if trace.masq {
            "the node address (KUBE-MARK-MASQ: masqueraded)".to_owned()
        } else {
            kept(q.client)
        });
    }
    e
}

/// iptables mode, session affinity: kube-proxy's `-m recent --rcheck` rules pick the endpoint
/// whose `recent` list (`/proc/net/xt_recent/KUBE-SEP-…`, read by `recent`) holds the client's
/// address. When one endpoint chain the walk entered lists it, that endpoint is the chosen
/// one and the entry is shown. The list's age against the rule's `--seconds` is not checked
/// (the kernel keeps entries in jiffies).
pub fn iptables_affinity(
    tracer: &proxy_dataplane_iptables::tracer::Tracer,
    q: &Query,
    e: &mut Explanation,
    recent: impl Fn(&str) -> Option<String>,
) {
    if e.verdict != "translate" || q.client.is_unspecified() {
        return;
    }
    let seps: Vec<String> = e
        .steps
        .iter()
        .filter_map(|step| step.strip_prefix("chain nat/"))
        .filter(|chain| chain.starts_with("KUBE-SEP-"))
        .map(str::to_owned)
        .collect();
    for sep in seps {
        let Some(list) = recent(&sep) else { continue };
        let listed = list.lines().any(|line| {
            line.split_whitespace()
                .find_map(|word| word.strip_prefix("src="))
                .and_then(|ip| ip.parse::<IpAddr>().ok())
                .is_some_and(|ip| ip == q.client)
        });
        if !listed {
            continue;
        }
        if let Some(backend) = tracer.dnat_of("nat", &sep) {
            e.affinity_entries.push(Pinned {
                client: q.client.to_string(),
                backend: backend.clone(),
                idle_s: 0,
            });
            e.steps.push(format!(
                "session affinity: {} is in {sep}'s recent list",
                q.client
            ));
            if e.chosen.is_none() {
                e.chosen = Some(backend);
                e.reason = "session affinity: `-m recent --rcheck` sends the client to the \
                            endpoint whose list holds it"
                    .to_owned();
            }
        }
    }
    if e.affinity_entries.len() > 1 {
        // Several lists hold the client (entries of an earlier endpoint set): the first
        // `--rcheck` rule in the chain wins, which the walk does not order; name none.
        e.chosen = None;
        e.reason = "session affinity: several endpoints' recent lists hold the client".to_owned();
    }
}

/// The pinned maps of a running agent.
pub struct PinnedMaps {
    frontends4: HashMap<MapData, Frontend4Key, FrontendValue>,
    frontends6: HashMap<MapData, Frontend6Key, FrontendValue>,
    slots: HashMap<MapData, BackendSlotKey, SlotBlock>,
    backends4: Array<MapData, Backend4>,
    backends6: Array<MapData, Backend6>,
    node_addrs: HashMap<MapData, NodeAddrKey, u8>,
    node_config: Array<MapData, NodeConfig>,
    source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    maglev: Option<HashMap<MapData, MaglevKey, MaglevBlock>>,
    conntrack: ConntrackMaps<MapData>,
    affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    affinity_match: HashMap<MapData, AffinityMatchKey, u8>,
    udp_sticky: Option<HashMap<MapData, AffinityKey, AffinityValue>>,
}

impl std::fmt::Debug for PinnedMaps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedMaps").finish_non_exhaustive()
    }
}

fn open(pin_dir: &Path, name: &str) -> anyhow::Result<Map> {
    let path = pin_dir.join(name);
    let data =
        MapData::from_pin(&path).with_context(|| format!("cannot open {}", path.display()))?;
    Ok(Map::from_map_data(data)?)
}

impl PinnedMaps {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            frontends4: HashMap::try_from(open(pin_dir, map_names::FRONTENDS4)?)?,
            frontends6: HashMap::try_from(open(pin_dir, map_names::FRONTENDS6)?)?,
            slots: HashMap::try_from(open(pin_dir, map_names::BACKEND_SLOTS)?)?,
            backends4: Array::try_from(open(pin_dir, map_names::BACKENDS4)?)?,
            backends6: Array::try_from(open(pin_dir, map_names::BACKENDS6)?)?,
            node_addrs: HashMap::try_from(open(pin_dir, map_names::NODE_ADDRS)?)?,
            node_config: Array::try_from(open(pin_dir, map_names::NODE_CONFIG)?)?,
            source_ranges: LpmTrie::try_from(open(pin_dir, map_names::SOURCE_RANGES)?)?,
            // Only allocated with --lb-algorithm maglev.
            maglev: open(pin_dir, map_names::MAGLEV)
                .ok()
                .and_then(|m| HashMap::try_from(m).ok()),
            conntrack: ConntrackMaps::open_pinned(pin_dir)?,
            affinity: HashMap::try_from(open(pin_dir, map_names::AFFINITY)?)?,
            affinity_match: HashMap::try_from(open(pin_dir, map_names::AFFINITY_MATCH)?)?,
            // Pinned by agents since per-socket UDP stickiness; an older agent's pins lack it.
            udp_sticky: open(pin_dir, map_names::UDP_STICKY)
                .ok()
                .and_then(|m| HashMap::try_from(m).ok()),
        })
    }
}

impl Maps for PinnedMaps {
    fn frontend(&self, addr: IpAddr, port: u16, protocol: u8, scope: u8) -> Option<FrontendValue> {
        let w = words(addr);
        match addr {
            IpAddr::V4(_) => self
                .frontends4
                .get(
                    &Frontend4Key {
                        addr: w[0],
                        port: port.to_be(),
                        proto: protocol,
                        scope,
                    },
                    0,
                )
                .ok(),
            IpAddr::V6(_) => self
                .frontends6
                .get(
                    &Frontend6Key {
                        addr: w,
                        port: port.to_be(),
                        proto: protocol,
                        scope,
                    },
                    0,
                )
                .ok(),
        }
    }
    fn slot(&self, key: BackendSlotKey, index: usize) -> Option<u32> {
        self.slots
            .get(&key, 0)
            .ok()?
            .backend_ids
            .get(index)
            .copied()
    }
    fn backend(&self, id: u32, v6: bool) -> Option<SocketAddr> {
        // A removed backend is the zero value of its array element, a miss as in the programs.
        if v6 {
            let b = self
                .backends6
                .get(&id, 0)
                .ok()
                .filter(BackendEntry::in_use)?;
            Some(addr_of(b.addr, true, b.port))
        } else {
            let b = self
                .backends4
                .get(&id, 0)
                .ok()
                .filter(BackendEntry::in_use)?;
            Some(addr_of([b.addr, 0, 0, 0], false, b.port))
        }
    }
    fn node_address(&self, addr: IpAddr) -> bool {
        let key = NodeAddrKey {
            addr: words(addr),
            family: if addr.is_ipv6() {
                family::V6
            } else {
                family::V4
            },
            _pad: [0; 3],
        };
        self.node_addrs.get(&key, 0).is_ok()
    }
    fn node_config(&self) -> Option<NodeConfig> {
        self.node_config.get(&0, 0).ok()
    }
    fn source_allowed(&self, service_id: u32, addr: IpAddr) -> bool {
        let (prefix, key) = lookup::source_range_key(service_id, &words(addr), addr.is_ipv6());
        self.source_ranges.get(&Key::new(prefix, key), 0).is_ok()
    }
    fn maglev(&self, key: MaglevKey) -> Option<MaglevBlock> {
        self.maglev.as_ref()?.get(&key, 0).ok()
    }
    fn conntrack(&self, key: CtKey) -> Option<CtValue> {
        self.conntrack.get(&key)
    }
    fn affinity(&self, key: AffinityKey) -> Option<AffinityValue> {
        self.affinity.get(&key, 0).ok()
    }
    fn affinity_match(&self, key: AffinityMatchKey) -> bool {
        self.affinity_match.get(&key, 0).is_ok()
    }
    fn affinity_entries(&self) -> Vec<(AffinityKey, AffinityValue)> {
        self.affinity.iter().filter_map(Result::ok).collect()
    }
    fn sticky_entries(&self) -> Vec<(AffinityKey, AffinityValue)> {
        self.udp_sticky
            .iter()
            .flat_map(|m| m.iter().filter_map(Result::ok))
            .collect()
    }
    fn now_ns(&self) -> u64 {
        proxy_dataplane_ebpf::monotonic_ns().unwrap_or(0)
    }
}

/// The explanation for people.
pub fn table(query: &Query, e: &Explanation, service: Option<&str>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:?} client {}{} → {}/{}",
        query.from,
        query.client,
        query.sport.map(|p| format!(":{p}")).unwrap_or_default(),
        query.dest,
        protocol_name(query.protocol)
    );
    let _ = writeln!(out, "program:    {}", e.program);
    for step in &e.steps {
        let _ = writeln!(out, "  - {step}");
    }
    if let Some(frontend) = &e.frontend {
        let _ = writeln!(
            out,
            "frontend:   {frontend}  service {}{}",
            e.service_id.unwrap_or_default(),
            service.map(|s| format!(" ({s})")).unwrap_or_default()
        );
    }
    if !e.candidates.is_empty() {
        let _ = writeln!(out, "candidates: {}", e.candidates.join(" "));
    }
    if let Some(chosen) = &e.chosen {
        let _ = writeln!(out, "chosen:     {chosen}");
    }
    let _ = writeln!(out, "verdict:    {} — {}", e.verdict, e.reason);
    if let Some(source) = &e.source {
        let _ = writeln!(out, "source:     {source}");
    }
    if let Some(path) = &e.netfilter {
        let _ = writeln!(out, "netfilter:  {path}");
    }
    for (what, entries) in [
        ("affinity:  ", &e.affinity_entries),
        ("sticky:    ", &e.sticky_sockets),
    ] {
        for p in entries {
            let _ = writeln!(
                out,
                "{what} {} → {} (idle {}s)",
                p.client, p.backend, p.idle_s
            );
        }
    }
    out
}

#[cfg(test)]
mod tests;
