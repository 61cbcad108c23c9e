//! The expected outcome of every cell: a pure function of (client, shape, frontend, family).
//!
//! The oracle is upstream kube-proxy's iptables proxier (`pkg/proxy/iptables/proxier.go`;
//! summarised with the exact rule strings in `shared/reference/kube-proxy.md` §2–§6), plus
//! `CategorizeEndpoints` (`pkg/proxy/topology.go`, reference §5a) for which endpoints a chain
//! holds. Each branch names the rule that decides it. Nothing here is derived from our own
//! output. The less obvious rules were re-read in proxier.go's `syncProxyRules`: the
//! "Capture nodeports" block (the no-(local-)endpoints filter rule matches `-m addrtype
//! --dst-type LOCAL`, not nodePortAddresses), the nodeports tail call (loopback node IPs
//! skipped for IPv6), the firewall-chain block (`allowFromNode` only when a source range
//! holds the node IP) and the EXT chain ("pod traffic" / "masquerade LOCAL traffic" /
//! "route LOCAL traffic" short circuits for eTP=Local).
//!
//! What the rig adds to the rules: MASQUERADE picks the address of the interface the packet
//! leaves by, so "masqueraded" means the backend sees *some* address of this node (the table
//! prints which); a packet the node routes out to an address nobody holds reaches the
//! external namespace, which does not forward and drops it (the client times out).

use super::cells::{Backend, Cell, Client, Family, Frontend, LB_PROXY_NAME, SOURCE_RANGES, Shape};

/// How a connection fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FailKind {
    /// ECONNREFUSED: a TCP RST (nothing listens) or kube-proxy's REJECT
    /// (icmp-port-unreachable).
    Refused,
    /// EHOSTUNREACH / ENETUNREACH: an ICMP host/net unreachable, or the socket layer saying so.
    Unreachable,
    /// No answer within the client's timeout: dropped.
    Timeout,
}

impl FailKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Refused => "refused",
            Self::Unreachable => "unreachable",
            Self::Timeout => "timeout",
        }
    }
}

/// The source address a backend saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    /// The client's own address (for host clients, which use a node address anyway, see
    /// [`Source::Node`]).
    Client,
    /// An address of this node: masqueraded (or a host client's own).
    Node,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Node => "node",
        }
    }
}

/// Which backends answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backends {
    /// Every one of these answers (over the cell's connections), and no other.
    All(Vec<&'static str>),
    /// Exactly one of these answers every connection (session affinity).
    OneOf(Vec<&'static str>),
}

/// An expected outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    Answer { backends: Backends, source: Source },
    Fail(FailKind),
}

impl Expect {
    /// Compact text for the table, e.g. `pod2,rpod2 ← node`, `one of pod2,pod3 ← client`,
    /// `timeout`.
    pub fn render(&self) -> String {
        match self {
            Self::Answer { backends, source } => {
                let (prefix, names) = match backends {
                    Backends::All(n) => ("", n),
                    Backends::OneOf(n) => ("one of ", n),
                };
                format!("{prefix}{} ← {}", names.join(","), source.name())
            }
            Self::Fail(kind) => kind.name().to_owned(),
        }
    }
}

/// A deliberate difference of the eBPF mode from upstream in one cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub expect: Expect,
    pub reason: &'static str,
}

/// The expected outcome of a cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expectation {
    /// Upstream kube-proxy's outcome; the iptables mode must match it exactly.
    pub upstream: Expect,
    /// The upstream rule (or test) that decides the cell.
    pub rule: String,
    /// Where the eBPF mode deliberately differs (else it must match `upstream`).
    pub ebpf: Option<Difference>,
}

impl Expectation {
    /// What a mode must show.
    pub fn for_mode(&self, ebpf: bool) -> &Expect {
        match (&self.ebpf, ebpf) {
            (Some(diff), true) => &diff.expect,
            _ => &self.upstream,
        }
    }
}

/// Reason for intended difference (1).
pub const SOCKET_LB_KEEPS_POD_SOURCE: &str = "socket-level translation: a local pod dialling a NodePort, externalIP or LB IP of an \
     eTP=Cluster Service is connected to the backend before a packet exists, so nothing \
     masquerades and the backend sees the pod's own address (Cilium's socket LB does the same)";
/// Reason for intended difference (2).
pub const SOCKET_LB_ITP_LOCAL_UNREACHABLE: &str = "iTP=Local without a local endpoint: upstream DROPs (the client times out); at the \
     socket level the connect fails at once with EHOSTUNREACH";

/// Reason for intended difference (3).
pub const SOCKET_LB_NO_ENDPOINTS_REFUSED: &str = "a host process dialling an externalIP or LB IP of a Service without endpoints: \
     upstream's REJECT for these IPs is in KUBE-EXTERNAL-SERVICES, hooked from INPUT and \
     FORWARD only, so the host's packet leaves the node to wherever the network routes the IP \
     (in the rig: dropped, a timeout); the socket hook sees every local connect to a Service \
     address and refuses it at once, as upstream refuses the same connect from a pod \
     (design.md: no endpoints → ECONNREFUSED)";

/// Reason for intended difference (4).
pub const SOCKET_LB_SOURCE_RANGE_UNREACHABLE: &str = "a host process dialling an LB IP whose \
     loadBalancerSourceRanges do not admit the node: upstream DROPs in KUBE-PROXY-FIREWALL \
     (the client times out); the socket hook judges the node address at connect() and fails it \
     at once with EHOSTUNREACH (a socket hook has no packet to drop)";
/// Reason for intended difference (5).
pub const UNLISTED_ADDRESSES_UNTOUCHED: &str = "an address outside nodePortAddresses (and ::1, \
     never a NodePort address): upstream's eTP=Local \"has no local endpoints\" DROP matches \
     the node port with `--dst-type LOCAL`, so it also black-holes the port on addresses it \
     never serves; the eBPF datapath acts on the configured NodePort addresses only, so there \
     the kernel answers as for any closed port (refused)";

/// Reason for intended difference (6).
pub const SOCKET_LB_HAIRPIN_KEEPS_POD_SOURCE: &str = "hairpin: a pod dialling a Service \
     whose chosen endpoint is itself; upstream's KUBE-SEP `-s <endpoint IP> -j KUBE-MARK-MASQ` \
     masquerades so the reply comes back through the node (on a bridge, out of the port it \
     came in by: the bridge's hairpin mode); the socket hook connects the pod to its own \
     address before a packet exists, so nothing leaves the pod and the backend sees the pod's \
     own address";

/// The expected outcome of `cell` (pure).
pub fn expected(cell: Cell) -> Expectation {
    let (upstream, rule) = upstream(cell);
    let ebpf = ebpf_difference(cell, &upstream);
    Expectation {
        upstream,
        rule,
        ebpf,
    }
}

/// CategorizeEndpoints' cluster endpoints (reference §5a): the ready ones; if none, every
/// serving+terminating one (any node).
pub fn cluster_backends(shape: Shape) -> Vec<&'static str> {
    pick(shape.endpoints(), |_| true)
}

/// CategorizeEndpoints' local endpoints (reference §5a): this node's ready ones; if none,
/// this node's serving+terminating ones.
pub fn local_backends(shape: Shape) -> Vec<&'static str> {
    pick(shape.endpoints(), |b| !b.remote)
}

fn pick(endpoints: &[Backend], keep: impl Fn(&Backend) -> bool) -> Vec<&'static str> {
    let ready: Vec<_> = endpoints
        .iter()
        .filter(|b| keep(b) && !b.terminating)
        .map(|b| b.name)
        .collect();
    if !ready.is_empty() {
        return ready;
    }
    endpoints
        .iter()
        .filter(|b| keep(b) && b.terminating)
        .map(|b| b.name)
        .collect()
}

fn answer(shape: Shape, names: Vec<&'static str>, source: Source) -> Expect {
    let backends = if shape.affinity() {
        // writeServiceToEndpointRules: `-m recent --rcheck` per endpoint first, so every
        // connection after the first sticks to the same SEP.
        Backends::OneOf(names)
    } else {
        Backends::All(names)
    };
    Expect::Answer { backends, source }
}

/// The ClusterCIDR local-traffic detector (reference §8): only this node's pods are inside
/// `--cluster-cidr`; node2's pods, the external client and node addresses are not.
fn in_cluster_cidr(client: Client) -> bool {
    client.local_pod().is_some()
}

fn upstream(cell: Cell) -> (Expect, String) {
    use Expect::Fail;
    use FailKind::{Refused, Timeout};
    let Cell {
        shape,
        frontend,
        client,
        family,
    } = cell;

    if shape == Shape::LbProxy {
        // Upstream only captures ingress IPs whose ipMode is VIP (proxier.go LB VIP loop,
        // KEP-1860; reference §4 item 3c and misc-vectors "LB ingress ipMode=Proxy").
        let source = if client.own_address(family).is_some() {
            Source::Client
        } else {
            Source::Node
        };
        return (
            Expect::Answer {
                backends: Backends::All(vec![LB_PROXY_NAME]),
                source,
            },
            "ipMode: Proxy ingress IPs are not LB VIPs for kube-proxy (proxier.go captures \
             only ipMode VIP; KEP-1860): no rule matches, the packet is routed to the load \
             balancer itself"
                .into(),
        );
    }

    if shape == Shape::NoEndpoints {
        return match frontend {
            Frontend::ClusterIp => (
                Fail(Refused),
                "filter KUBE-SERVICES `<svc> has no endpoints` -d <clusterIP> -j REJECT, \
                 hooked from FORWARD and OUTPUT (reference §6)"
                    .into(),
            ),
            Frontend::ExternalIp | Frontend::LoadBalancer if client == Client::Host => (
                Fail(Timeout),
                "filter KUBE-EXTERNAL-SERVICES (the externalIP/LB IP REJECT) is hooked from \
                 INPUT and FORWARD only (reference §2): a host process's packet to a \
                 non-local IP passes OUTPUT untouched and leaves by the default route; the \
                 rig's outside world drops it"
                    .into(),
            ),
            Frontend::ExternalIp | Frontend::LoadBalancer => (
                Fail(Refused),
                "filter KUBE-EXTERNAL-SERVICES `<svc> has no endpoints` -d <ip> -j REJECT \
                 (FORWARD; reference §4 items 3b/3c, §6)"
                    .into(),
            ),
            _ => (
                Fail(Refused),
                "filter KUBE-EXTERNAL-SERVICES `<svc> has no endpoints` -m addrtype \
                 --dst-type LOCAL --dport <np> -j REJECT from INPUT (reference §4 item 3d); \
                 a local client's packet to a local address passes INPUT too"
                    .into(),
            ),
        };
    }

    if client == Client::Hairpin {
        return (
            answer(shape, cluster_backends(shape), Source::Node),
            "the endpoint's own chain KUBE-SEP `-s <endpoint IP> -j KUBE-MARK-MASQ` \
             (hairpin, reference §4 item 3j) before its DNAT: the pod reaching itself is \
             masqueraded, whatever the frontend (a NodePort of an eTP=Cluster Service \
             masquerades in KUBE-EXT anyway)"
                .into(),
        );
    }

    // Node addresses kube-proxy does not serve NodePorts on: one outside nodePortAddresses,
    // and ::1 (a loopback node IP is skipped for IPv6; only IPv4 with localhostNodePorts
    // serves 127.0.0.1 — reference §4 item 5).
    let unserved = frontend == Frontend::NodePortUnlisted
        || (frontend == Frontend::NodePortLoopback && family == Family::V6);
    if unserved {
        return if shape.etp_local() && local_backends(shape).is_empty() {
            (
                Fail(Timeout),
                "filter KUBE-EXTERNAL-SERVICES `<svc> has no local endpoints` matches the \
                 nodePort with -m addrtype --dst-type LOCAL, not the nodePortAddresses \
                 (reference §4 item 3d): DROP in INPUT on every local address, even one \
                 kube-proxy does not DNAT (a local client's packet passes INPUT too)"
                    .into(),
            )
        } else {
            (
                Fail(Refused),
                "nat KUBE-SERVICES jumps to KUBE-NODEPORTS only for `-d <node IP>` within \
                 nodePortAddresses, never ::1 (reference §4 item 5); the address is not \
                 DNATed and nothing listens: TCP RST"
                    .into(),
            )
        };
    }

    if frontend == Frontend::ClusterIp {
        let backends = if shape.itp_local() {
            local_backends(shape)
        } else {
            cluster_backends(shape)
        };
        if backends.is_empty() {
            return (
                Fail(Timeout),
                "iTP=Local, no local endpoint: filter KUBE-SERVICES `<svc> has no local \
                 endpoints` -j DROP, hooked from FORWARD and OUTPUT (reference §6)"
                    .into(),
            );
        }
        let source = if in_cluster_cidr(client) {
            Source::Client
        } else {
            Source::Node
        };
        let chain = if shape.itp_local() {
            "KUBE-SVL (local endpoints)"
        } else {
            "KUBE-SVC"
        };
        return (
            answer(shape, backends, source),
            format!(
                "nat KUBE-SERVICES `<svc> cluster IP` -j {chain}; that chain's `-d \
                 <clusterIP> ! -s <clusterCIDR> -j KUBE-MARK-MASQ` masquerades all but \
                 this node's pods (reference §4 item 3f, §8)"
            ),
        );
    }

    // External frontends: a listed NodePort address (127.0.0.1 included: localhostNodePorts,
    // with route_localnet), an externalIP or an LB VIP — all jump to KUBE-EXT (LB VIPs with
    // source ranges through KUBE-FW first).
    let via = match frontend {
        Frontend::NodePortLoopback => {
            "nat KUBE-SERVICES `-d 127.0.0.1 -j KUBE-NODEPORTS` (IPv4, localhostNodePorts) → "
        }
        f if f.is_node_port() => "nat KUBE-SERVICES `-d <node IP> -j KUBE-NODEPORTS` → ",
        Frontend::ExternalIp => "nat KUBE-SERVICES `<svc> external IP` → ",
        _ => "nat KUBE-SERVICES `<svc> loadbalancer IP` → ",
    };

    if shape == Shape::SourceRanges && frontend == Frontend::LoadBalancer {
        let allowed = client == Client::External;
        debug_assert!(SOURCE_RANGES.len() == 2);
        if !allowed {
            return (
                Fail(Timeout),
                format!(
                    "{via}KUBE-FW: only `-s <range> -j KUBE-EXT`; no range holds the node IP, \
                     so no allowFromNode `-s <lbIP>` rule; the rest falls through to filter \
                     KUBE-PROXY-FIREWALL `-d <lbIP> -j DROP` (INPUT, FORWARD, OUTPUT; \
                     reference §4 items 3c, 3h)"
                ),
            );
        }
    }

    if !shape.etp_local() {
        return (
            answer(shape, cluster_backends(shape), Source::Node),
            format!(
                "{via}KUBE-EXT (eTP=Cluster): `masquerade traffic for <svc> external \
                 destinations` -j KUBE-MARK-MASQ, -j KUBE-SVC (reference §4 item 3g)"
            ),
        );
    }

    match client {
        // (A hairpin client returned above.)
        Client::Pod | Client::Hairpin => (
            answer(shape, cluster_backends(shape), Source::Client),
            format!(
                "{via}KUBE-EXT (eTP=Local): `pod traffic for <svc> external destinations` -s \
                 <clusterCIDR> -j KUBE-SVC: all endpoints, not masqueraded (reference §4 item \
                 3g, §8)"
            ),
        ),
        Client::Host | Client::Localhost => (
            answer(shape, cluster_backends(shape), Source::Node),
            format!(
                "{via}KUBE-EXT (eTP=Local): `masquerade LOCAL traffic` --src-type LOCAL -j \
                 KUBE-MARK-MASQ + `route LOCAL traffic` -j KUBE-SVC (reference §4 item 3g)"
            ),
        ),
        Client::RemotePod | Client::External | Client::ExternalOutsideRanges => {
            let local = local_backends(shape);
            if local.is_empty() {
                (
                    Fail(Timeout),
                    format!(
                        "{via}KUBE-EXT (eTP=Local) has no -j KUBE-SVL without local \
                         endpoints; filter KUBE-EXTERNAL-SERVICES `<svc> has no local \
                         endpoints` -j DROP (INPUT/FORWARD; reference §6)"
                    ),
                )
            } else {
                let why = if shape == Shape::Terminating {
                    " (the local serving+terminating endpoint: CategorizeEndpoints' local \
                     fallback, reference §5a)"
                } else {
                    ""
                };
                (
                    answer(shape, local, Source::Client),
                    format!(
                        "{via}KUBE-EXT (eTP=Local) -j KUBE-SVL: local endpoints only{why}, \
                         the client address kept (no KUBE-MARK-MASQ; reference §4 item 3g)"
                    ),
                )
            }
        }
    }
}

/// The eBPF mode's deliberate differences (the only ones; every other cell must equal
/// upstream).
fn ebpf_difference(cell: Cell, upstream: &Expect) -> Option<Difference> {
    if cell.client == Client::Hairpin
        && let Expect::Answer {
            backends,
            source: Source::Node,
        } = upstream
    {
        return Some(Difference {
            expect: Expect::Answer {
                backends: backends.clone(),
                source: Source::Client,
            },
            reason: SOCKET_LB_HAIRPIN_KEEPS_POD_SOURCE,
        });
    }
    let external = cell.frontend != Frontend::ClusterIp
        && cell.frontend != Frontend::NodePortUnlisted
        && cell.shape != Shape::LbProxy;
    if cell.client == Client::Pod
        && external
        && !cell.shape.etp_local()
        && let Expect::Answer {
            backends,
            source: Source::Node,
        } = upstream
    {
        return Some(Difference {
            expect: Expect::Answer {
                backends: backends.clone(),
                source: Source::Client,
            },
            reason: SOCKET_LB_KEEPS_POD_SOURCE,
        });
    }
    if cell.shape == Shape::ItpLocalNoLocal
        && cell.frontend == Frontend::ClusterIp
        && matches!(cell.client, Client::Pod | Client::Host)
    {
        return Some(Difference {
            expect: Expect::Fail(FailKind::Unreachable),
            reason: SOCKET_LB_ITP_LOCAL_UNREACHABLE,
        });
    }
    if cell.shape == Shape::SourceRanges
        && cell.frontend == Frontend::LoadBalancer
        && cell.client == Client::Host
        && *upstream == Expect::Fail(FailKind::Timeout)
    {
        return Some(Difference {
            expect: Expect::Fail(FailKind::Unreachable),
            reason: SOCKET_LB_SOURCE_RANGE_UNREACHABLE,
        });
    }
    if cell.shape == Shape::EtpLocalNoLocal
        && matches!(
            cell.frontend,
            Frontend::NodePortUnlisted | Frontend::NodePortLoopback
        )
        && *upstream == Expect::Fail(FailKind::Timeout)
        && (cell.frontend == Frontend::NodePortUnlisted || cell.family == Family::V6)
    {
        return Some(Difference {
            expect: Expect::Fail(FailKind::Refused),
            reason: UNLISTED_ADDRESSES_UNTOUCHED,
        });
    }
    if cell.shape == Shape::NoEndpoints
        && matches!(cell.frontend, Frontend::ExternalIp | Frontend::LoadBalancer)
        && cell.client == Client::Host
    {
        return Some(Difference {
            expect: Expect::Fail(FailKind::Refused),
            reason: SOCKET_LB_NO_ENDPOINTS_REFUSED,
        });
    }
    None
}

/// The cells whose packets cross this node's pod wiring — a pod of this node is the client,
/// or a pod of this node answers (in either mode) — and the hairpin cells: what a node whose
/// pods a CNI plugin wires runs. The rest (outside clients answered by node2's pods, or
/// refused and dropped before any pod) do not depend on how the pods are wired.
pub fn wiring_cells() -> Vec<Cell> {
    let local_answer = |e: &Expect| match e {
        Expect::Answer { backends, .. } => {
            let (Backends::All(names) | Backends::OneOf(names)) = backends;
            names.iter().any(|n| n.starts_with("pod"))
        }
        Expect::Fail(_) => false,
    };
    let mut cells: Vec<Cell> = super::cells::all_cells()
        .into_iter()
        .filter(|c| {
            let e = expected(*c);
            c.client.local_pod().is_some()
                || local_answer(e.for_mode(false))
                || local_answer(e.for_mode(true))
        })
        .collect();
    cells.extend(super::cells::hairpin_cells());
    cells
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reachability::cells::{all_cells, hairpin_cells};

    fn cell(shape: Shape, frontend: Frontend, client: Client) -> Cell {
        Cell {
            shape,
            frontend,
            client,
            family: Family::V4,
        }
    }

    #[test]
    fn endpoint_categories_follow_categorize_endpoints() {
        assert_eq!(cluster_backends(Shape::Terminating), ["pod3", "rpod3"]);
        assert_eq!(local_backends(Shape::Terminating), ["pod3"]);
        assert!(local_backends(Shape::EtpLocalNoLocal).is_empty());
        assert_eq!(local_backends(Shape::ItpLocal), ["pod2"]);
    }

    #[test]
    fn key_cells() {
        // eTP=Local from outside keeps the client and uses local endpoints only.
        let e = expected(cell(
            Shape::EtpLocal,
            Frontend::NodePortExternal,
            Client::External,
        ));
        assert_eq!(e.upstream.render(), "pod2 ← client");
        assert!(e.ebpf.is_none());
        // ...and drops without a local endpoint, but not for the node's own pods.
        let e = expected(cell(
            Shape::EtpLocalNoLocal,
            Frontend::LoadBalancer,
            Client::External,
        ));
        assert_eq!(e.upstream, Expect::Fail(FailKind::Timeout));
        let e = expected(cell(
            Shape::EtpLocalNoLocal,
            Frontend::LoadBalancer,
            Client::Pod,
        ));
        assert_eq!(e.upstream.render(), "rpod2 ← client");
        // The two intended eBPF differences.
        let e = expected(cell(
            Shape::EtpCluster,
            Frontend::NodePortExternal,
            Client::Pod,
        ));
        assert_eq!(e.upstream.render(), "pod2,rpod2 ← node");
        assert_eq!(e.for_mode(true).render(), "pod2,rpod2 ← client");
        let e = expected(cell(
            Shape::ItpLocalNoLocal,
            Frontend::ClusterIp,
            Client::Host,
        ));
        assert_eq!(e.for_mode(false), &Expect::Fail(FailKind::Timeout));
        assert_eq!(e.for_mode(true), &Expect::Fail(FailKind::Unreachable));
        // d3: upstream's REJECT for an externalIP is not hooked from OUTPUT.
        let e = expected(cell(Shape::NoEndpoints, Frontend::ExternalIp, Client::Host));
        assert_eq!(e.for_mode(false), &Expect::Fail(FailKind::Timeout));
        assert_eq!(e.for_mode(true), &Expect::Fail(FailKind::Refused));
        let e = expected(cell(Shape::NoEndpoints, Frontend::ExternalIp, Client::Pod));
        assert_eq!(e.upstream, Expect::Fail(FailKind::Refused));
        assert!(e.ebpf.is_none());
        // Affinity: one backend.
        let e = expected(cell(Shape::Affinity, Frontend::ClusterIp, Client::Pod));
        assert!(matches!(
            e.upstream,
            Expect::Answer {
                backends: Backends::OneOf(_),
                ..
            }
        ));
    }

    #[test]
    fn hairpin_is_masqueraded_upstream_and_kept_at_the_socket() {
        for frontend in [Frontend::ClusterIp, Frontend::NodePortExternal] {
            let e = expected(cell(Shape::Hairpin, frontend, Client::Hairpin));
            assert_eq!(e.upstream.render(), "pod2 ← node");
            assert_eq!(e.for_mode(true).render(), "pod2 ← client");
        }
    }

    #[test]
    fn the_wiring_subset_keeps_every_cell_a_local_pod_is_in() {
        let all = all_cells();
        let hairpin = hairpin_cells();
        let wiring = wiring_cells();
        for c in all.iter().chain(&hairpin) {
            if c.client.local_pod().is_some() {
                assert!(wiring.contains(c), "{}", c.id());
            }
        }
        // eTP=Cluster from outside: pod2 answers (through the pod wiring), so it stays.
        let outside = cell(
            Shape::EtpCluster,
            Frontend::NodePortExternal,
            Client::External,
        );
        assert!(wiring.contains(&outside));
        // Refused before any pod: left out, and the subset is a proper one.
        let refused = cell(Shape::NoEndpoints, Frontend::ClusterIp, Client::External);
        assert!(!wiring.contains(&refused));
        assert!(
            wiring
                .iter()
                .all(|c| all.contains(c) || hairpin.contains(c))
        );
        assert!(wiring.len() < all.len() + hairpin.len());
    }

    #[test]
    fn every_cell_has_a_rule() {
        for c in all_cells().into_iter().chain(hairpin_cells()) {
            let e = expected(c);
            assert!(!e.rule.is_empty(), "{}", c.id());
        }
    }
}
