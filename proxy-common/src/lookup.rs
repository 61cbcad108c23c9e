//! Which frontend a destination meets, and whether a client may use it: the order of the
//! socket hooks' and the tc programs' frontend lookups and the `loadBalancerSourceRanges` rule.
//! The programs run these over the maps, `proxy-agent inspect explain` over the pinned maps, so
//! an explanation cannot follow an order the datapath does not.

use crate::{FrontendValue, NodeConfig, SourceRangeKey, frontend_flags, node_flags, scope};

/// How a frontend matched the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matched {
    /// The frontend of the destination address itself.
    Exact,
    /// The NodePort wildcard (the unspecified address): the destination is a NodePort address
    /// of the node (`KPR_NODE_ADDRS`).
    NodePort,
    /// The NodePort wildcard for an IPv4 loopback destination, localhost NodePorts being on
    /// ([`node_flags::LOCALHOST_NODEPORTS`]).
    LocalhostNodePort,
}

/// A frontend found for a destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub frontend: FrontendValue,
    pub matched: Matched,
    /// An internal (socket-scope) frontend found by a tc program: load-balanced as the socket
    /// hooks do, without SNAT.
    pub internal: bool,
}

/// The reads a lookup needs, for one destination (address, port, protocol) of one family.
pub trait FrontendMaps {
    /// The frontend in `scope` for the destination's port and protocol, at the destination's
    /// address or, with `wildcard`, at the unspecified address (a NodePort).
    fn frontend(&mut self, wildcard: bool, scope: u8) -> Option<FrontendValue>;
    /// Whether the destination is a NodePort address of this node (`KPR_NODE_ADDRS`).
    fn node_port_address(&mut self) -> bool;
    /// `KPR_NODE_CONFIG`, if the agent wrote it. By reference: the tc programs have no stack
    /// to spare for a copy.
    fn node_config(&mut self) -> Option<&NodeConfig>;
}

/// Whether `addr` (an IPv4 address in network order, as the maps hold it) is in 127/8.
#[inline(always)]
pub fn is_loopback4(addr: u32) -> bool {
    addr.to_ne_bytes()[0] == 127
}

/// The socket hooks (connect, sendmsg): the exact internal frontend, else — kube-proxy's
/// `KUBE-SERVICES ... -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS` for local sockets — the
/// NodePort wildcard when the destination is a NodePort address, or an IPv4 loopback address
/// with localhost NodePorts. IPv6 NodePorts are never on `::1` (kube-proxy's `! -d ::1/128`;
/// the agent never lists it). `dst` is the destination in map words (IPv4 in word 0).
#[inline(always)]
pub fn socket_frontend(maps: &mut impl FrontendMaps, dst: &[u32; 4], v6: bool) -> Option<Found> {
    if let Some(frontend) = maps.frontend(false, scope::INTERNAL) {
        return Some(Found {
            frontend,
            matched: Matched::Exact,
            internal: true,
        });
    }
    // The loopback test first: it costs no lookup.
    let matched = if !v6
        && is_loopback4(dst[0])
        && maps
            .node_config()
            .is_some_and(|c| c.flags & node_flags::LOCALHOST_NODEPORTS != 0)
    {
        Matched::LocalhostNodePort
    } else if maps.node_port_address() {
        Matched::NodePort
    } else {
        return None;
    };
    let frontend = maps.frontend(true, scope::INTERNAL)?;
    Some(Found {
        frontend,
        matched,
        internal: true,
    })
}

/// `--bpf-socket-lb-host-namespace-only` ([`node_flags::HOST_NAMESPACE_ONLY`]): whether a socket
/// outside the node's namespace (`is_host` false, given the node config) keeps the address it
/// dialled, for the tc program on the pod's interface to load-balance its packets instead.
/// Without the node namespace's cookie nothing is left.
#[inline(always)]
pub fn left_to_tc(config: Option<&NodeConfig>, is_host: impl FnOnce(&NodeConfig) -> bool) -> bool {
    let Some(config) = config else {
        return false;
    };
    config.flags & node_flags::HOST_NAMESPACE_ONLY != 0
        && config.host_netns_cookie != 0
        && !is_host(config)
}

/// Where a tc program runs: which new flows it may start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcSide {
    /// The node's external interfaces: every external frontend.
    External,
    /// Pod veths: only LB IPs guarded by `loadBalancerSourceRanges`. Pods reach every other
    /// frontend through the socket hooks, which leave these alone because only a packet carries
    /// the pod's source address (kube-proxy's KUBE-FW chain checks it for pod traffic too).
    /// With [`node_flags::HOST_NAMESPACE_ONLY`] also the internal frontends, which the socket
    /// hooks then leave alone for pods.
    Pod,
}

/// The tc programs' frontend for a packet's destination. External side: the exact external
/// frontend (externalIP, LB IP, ClusterIP), else the NodePort wildcard if the destination is a
/// NodePort address; the wildcard is looked up before the address check, so a port that is
/// no NodePort (most of what reaches a node that is no Service's) costs one lookup, not two.
/// Pod side: an LB IP's external frontend guarded by source ranges (tc judges the pod's
/// address, which a socket hook cannot), else with host-namespace-only socket LB
/// ([`node_flags::HOST_NAMESPACE_ONLY`]) the frontend the socket hooks would have used (exact,
/// else the wildcard at a NodePort address) unless it is guarded.
#[inline(always)]
pub fn tc_frontend(maps: &mut impl FrontendMaps, side: TcSide) -> Option<Found> {
    if side == TcSide::Pod {
        if let Some(frontend) = maps.frontend(false, scope::EXTERNAL)
            && frontend.flags & frontend_flags::SOURCE_RANGES != 0
        {
            return Some(Found {
                frontend,
                matched: Matched::Exact,
                internal: false,
            });
        }
        return internal_frontend(maps);
    }
    if let Some(frontend) = maps.frontend(false, scope::EXTERNAL) {
        return Some(Found {
            frontend,
            matched: Matched::Exact,
            internal: false,
        });
    }
    let frontend = maps.frontend(true, scope::EXTERNAL)?;
    maps.node_port_address().then_some(Found {
        frontend,
        matched: Matched::NodePort,
        internal: false,
    })
}

/// A pod's packet with host-namespace-only socket LB: see [`tc_frontend`].
#[inline(always)]
fn internal_frontend(maps: &mut impl FrontendMaps) -> Option<Found> {
    let config = maps.node_config()?;
    if config.flags & node_flags::HOST_NAMESPACE_ONLY == 0 || config.host_netns_cookie == 0 {
        return None;
    }
    let (frontend, matched) = match maps.frontend(false, scope::INTERNAL) {
        Some(frontend) => (frontend, Matched::Exact),
        None if maps.node_port_address() => {
            (maps.frontend(true, scope::INTERNAL)?, Matched::NodePort)
        }
        None => return None,
    };
    (frontend.flags & frontend_flags::SOURCE_RANGES == 0).then_some(Found {
        frontend,
        matched,
        internal: true,
    })
}

/// The `KPR_SOURCE_RANGES` key for a client address (map words) of a frontend's service: the
/// prefix length (the 32 service-id bits and the whole address) and the key's data.
#[inline(always)]
pub fn source_range_key(service_id: u32, addr: &[u32; 4], v6: bool) -> (u32, SourceRangeKey) {
    let bits = if v6 { 128 } else { 32 };
    (
        32 + bits,
        SourceRangeKey {
            service_id,
            addr: *addr,
        },
    )
}

/// What a socket hook does with a connection to a frontend, as far as source ranges go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Not guarded, or the client is inside the ranges: translate.
    Translate,
    /// Left untranslated: a pod's socket, whose packets the tc program on the pod's veth
    /// judges by the pod's address (or no node facts yet to judge by).
    Leave,
    /// A host socket outside the ranges: refused (`EHOSTUNREACH`) where kube-proxy drops.
    Refuse,
}

/// `loadBalancerSourceRanges` for local sockets (frontends with
/// [`frontend_flags::SOURCE_RANGES`]). A socket of the node's own namespace (`is_host`, given
/// the node config) is judged by the node address (`NodeConfig::snat4/6`, the source such a
/// connection gets), as kube-proxy's KUBE-FW chain judges node-originated packets by their
/// source; `inside` answers the source-range lookup for a key from [`source_range_key`].
#[inline(always)]
pub fn socket_admit(
    frontend: &FrontendValue,
    config: Option<&NodeConfig>,
    is_host: impl FnOnce(&NodeConfig) -> bool,
    v6: bool,
    inside: impl FnOnce(u32, &SourceRangeKey) -> bool,
) -> Admit {
    if frontend.flags & frontend_flags::SOURCE_RANGES == 0 {
        return Admit::Translate;
    }
    let Some(config) = config else {
        return Admit::Leave;
    };
    if config.host_netns_cookie == 0 || !is_host(config) {
        return Admit::Leave;
    }
    let addr = if v6 {
        config.snat6
    } else {
        [config.snat4, 0, 0, 0]
    };
    let (prefix, key) = source_range_key(frontend.service_id, &addr, v6);
    if addr != [0; 4] && inside(prefix, &key) {
        Admit::Translate
    } else {
        Admit::Refuse
    }
}

/// Whether a translated connection to a frontend with the flags `frontend` is source-NATed to the node (kube-proxy's
/// KUBE-MARK-MASQ): never for a frontend that preserves the client (`externalTrafficPolicy:
/// Local`), always for the external frontends, and for a ClusterIP only with masqueradeAll or
/// a client from outside the cluster CIDR (`node`: the node config's flags). The flags come as copies and the cluster CIDR test
/// as a closure called last: the tc programs read the node config late and the verifier
/// follows scalars better than references into map values.
#[inline(always)]
pub fn masquerades(frontend: u8, node: u32, client_outside_cluster: impl FnOnce() -> bool) -> bool {
    if frontend & frontend_flags::PRESERVE_CLIENT != 0 {
        return false;
    }
    frontend & frontend_flags::CLUSTER_IP == 0
        || node & node_flags::MASQUERADE_ALL != 0
        || client_outside_cluster()
}

/// Whether the client `src` is outside a configured cluster CIDR (kube-proxy's local detector;
/// no CIDR for the family means no detection, so no masquerade). With interface-based detection
/// ([`node_flags::LOCAL_BY_INTERFACE`]) nothing the external programs see is local: pod
/// interfaces never get it.
#[inline(always)]
pub fn outside_cluster_cidr(src: &[u32; 4], v6: bool, config: &NodeConfig) -> bool {
    if config.flags & node_flags::LOCAL_BY_INTERFACE != 0 {
        return true;
    }
    // A copy: read through the reference, LLVM compiled the tc programs' use of it to a read
    // of a register a call had clobbered, which the verifier rejects.
    let src = *src;
    if v6 {
        let m = config.cluster6_mask;
        let c = config.cluster6;
        config.flags & node_flags::CLUSTER_CIDR6 != 0
            && (src[0] & m[0] != c[0]
                || src[1] & m[1] != c[1]
                || src[2] & m[2] != c[2]
                || src[3] & m[3] != c[3])
    } else {
        config.flags & node_flags::CLUSTER_CIDR4 != 0
            && src[0] & config.cluster4_mask != config.cluster4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frontends by (wildcard, scope), the NodePort address answer and a node config.
    #[derive(Default)]
    struct Fake {
        frontends: [(bool, u8, Option<FrontendValue>); 4],
        node_port_address: bool,
        config: Option<NodeConfig>,
        lookups: usize,
    }

    impl FrontendMaps for Fake {
        fn frontend(&mut self, wildcard: bool, scope: u8) -> Option<FrontendValue> {
            self.lookups += 1;
            self.frontends
                .iter()
                .find(|(w, s, _)| *w == wildcard && *s == scope)
                .and_then(|(_, _, f)| *f)
        }
        fn node_port_address(&mut self) -> bool {
            self.node_port_address
        }
        fn node_config(&mut self) -> Option<&NodeConfig> {
            self.config.as_ref()
        }
    }

    fn value(service_id: u32, flags: u8) -> Option<FrontendValue> {
        Some(FrontendValue {
            service_id,
            flags,
            ..FrontendValue::default()
        })
    }

    fn fake(exact_internal: u32, wild_internal: u32, exact_ext: u32, wild_ext: u32) -> Fake {
        let v = |id| if id == 0 { None } else { value(id, 0) };
        Fake {
            frontends: [
                (false, scope::INTERNAL, v(exact_internal)),
                (true, scope::INTERNAL, v(wild_internal)),
                (false, scope::EXTERNAL, v(exact_ext)),
                (true, scope::EXTERNAL, v(wild_ext)),
            ],
            ..Fake::default()
        }
    }

    const LOOPBACK: [u32; 4] = [u32::from_ne_bytes([127, 0, 0, 1]), 0, 0, 0];
    const OTHER: [u32; 4] = [u32::from_ne_bytes([10, 0, 0, 1]), 0, 0, 0];

    #[test]
    fn sockets_take_the_exact_frontend_then_the_node_port_at_a_node_port_address() {
        let mut maps = fake(1, 2, 0, 0);
        let found = socket_frontend(&mut maps, &OTHER, false).map(|f| f.frontend.service_id);
        assert_eq!(found, Some(1));
        let mut maps = fake(0, 2, 0, 0);
        assert_eq!(socket_frontend(&mut maps, &OTHER, false), None);
        maps.node_port_address = true;
        let found = socket_frontend(&mut maps, &OTHER, false).expect("node port");
        assert_eq!(
            (found.frontend.service_id, found.matched),
            (2, Matched::NodePort)
        );
    }

    #[test]
    fn ipv4_loopback_reaches_node_ports_only_with_localhost_node_ports() {
        let mut maps = fake(0, 2, 0, 0);
        assert_eq!(socket_frontend(&mut maps, &LOOPBACK, false), None);
        maps.config = Some(NodeConfig {
            flags: node_flags::LOCALHOST_NODEPORTS,
            ..NodeConfig::default()
        });
        let found = socket_frontend(&mut maps, &LOOPBACK, false).expect("localhost");
        assert_eq!(found.matched, Matched::LocalhostNodePort);
        // IPv6 has no localhost NodePorts, whatever the first word holds.
        assert_eq!(socket_frontend(&mut maps, &LOOPBACK, true), None);
    }

    #[test]
    fn external_tc_looks_up_the_wildcard_before_the_node_address() {
        let mut maps = fake(0, 0, 0, 0);
        assert_eq!(tc_frontend(&mut maps, TcSide::External), None);
        // No NodePort on the port: two lookups and no address check decided it.
        assert_eq!(maps.lookups, 2);
        let mut maps = fake(0, 0, 0, 4);
        assert_eq!(tc_frontend(&mut maps, TcSide::External), None);
        maps.node_port_address = true;
        let found = tc_frontend(&mut maps, TcSide::External).expect("node port");
        assert_eq!(found.matched, Matched::NodePort);
        assert!(!found.internal);
        let mut maps = fake(0, 0, 3, 4);
        let found = tc_frontend(&mut maps, TcSide::External).expect("exact");
        assert_eq!(
            (found.frontend.service_id, found.matched),
            (3, Matched::Exact)
        );
    }

    #[test]
    fn pod_tc_takes_guarded_frontends_then_internal_ones_with_host_namespace_only() {
        let mut maps = fake(1, 0, 3, 0);
        // Unguarded external frontend, no host-namespace-only: nothing for tc.
        assert_eq!(tc_frontend(&mut maps, TcSide::Pod), None);
        maps.frontends[2].2 = value(3, frontend_flags::SOURCE_RANGES);
        let found = tc_frontend(&mut maps, TcSide::Pod).expect("guarded");
        assert_eq!((found.frontend.service_id, found.internal), (3, false));
        maps.frontends[2].2 = None;
        maps.config = Some(NodeConfig {
            flags: node_flags::HOST_NAMESPACE_ONLY,
            host_netns_cookie: 7,
            ..NodeConfig::default()
        });
        let found = tc_frontend(&mut maps, TcSide::Pod).expect("internal");
        assert_eq!((found.frontend.service_id, found.internal), (1, true));
        // A guarded internal frontend is not the pod-side tc's to balance.
        maps.frontends[0].2 = value(1, frontend_flags::SOURCE_RANGES);
        assert_eq!(tc_frontend(&mut maps, TcSide::Pod), None);
    }

    #[test]
    fn host_sockets_are_judged_by_the_node_address_and_pods_left_to_tc() {
        let guarded = FrontendValue {
            service_id: 9,
            flags: frontend_flags::SOURCE_RANGES,
            ..FrontendValue::default()
        };
        let config = NodeConfig {
            snat4: OTHER[0],
            host_netns_cookie: 5,
            ..NodeConfig::default()
        };
        let open = FrontendValue {
            flags: 0,
            ..guarded
        };
        let never = |_: u32, _: &SourceRangeKey| -> bool { panic!("not looked up") };
        assert_eq!(
            socket_admit(&open, None, |_| true, false, never),
            Admit::Translate
        );
        assert_eq!(
            socket_admit(&guarded, None, |_| true, false, never),
            Admit::Leave
        );
        assert_eq!(
            socket_admit(&guarded, Some(&config), |_| false, false, never),
            Admit::Leave
        );
        let inside = |prefix: u32, key: &SourceRangeKey| {
            assert_eq!((prefix, key.service_id, key.addr), (64, 9, OTHER));
            true
        };
        assert_eq!(
            socket_admit(&guarded, Some(&config), |_| true, false, inside),
            Admit::Translate
        );
        assert_eq!(
            socket_admit(&guarded, Some(&config), |_| true, false, |_, _| false),
            Admit::Refuse
        );
        // No node address of the family: nothing to judge by, refused.
        assert_eq!(
            socket_admit(&guarded, Some(&config), |_| true, true, |_, _| true),
            Admit::Refuse
        );
        assert_eq!(source_range_key(1, &[1, 2, 3, 4], true).0, 160);
    }

    #[test]
    fn clients_outside_the_cluster_cidr_are_told_apart() {
        let mut config = NodeConfig {
            cluster4: u32::from_ne_bytes([10, 244, 0, 0]),
            cluster4_mask: u32::from_ne_bytes([255, 255, 0, 0]),
            flags: node_flags::CLUSTER_CIDR4,
            ..NodeConfig::default()
        };
        let pod = [u32::from_ne_bytes([10, 244, 3, 2]), 0, 0, 0];
        let outside = [u32::from_ne_bytes([192, 0, 2, 1]), 0, 0, 0];
        assert!(!outside_cluster_cidr(&pod, false, &config));
        assert!(outside_cluster_cidr(&outside, false, &config));
        // No IPv6 cluster CIDR: no detection, nobody outside.
        assert!(!outside_cluster_cidr(&[1, 2, 3, 4], true, &config));
        config.flags |= node_flags::LOCAL_BY_INTERFACE;
        assert!(outside_cluster_cidr(&pod, false, &config));
    }

    #[test]
    fn only_pod_sockets_are_left_to_tc_and_only_with_host_namespace_only() {
        let mut config = NodeConfig {
            host_netns_cookie: 3,
            ..NodeConfig::default()
        };
        assert!(!left_to_tc(None, |_| false));
        assert!(!left_to_tc(Some(&config), |_| false));
        config.flags = node_flags::HOST_NAMESPACE_ONLY;
        assert!(left_to_tc(Some(&config), |_| false));
        assert!(!left_to_tc(Some(&config), |_| true));
        config.host_netns_cookie = 0;
        assert!(!left_to_tc(Some(&config), |_| false));
    }

    #[test]
    fn masquerading_follows_kube_proxys_mark_masq() {
        let outside = || true;
        let inside = || false;
        // externalTrafficPolicy: Local keeps the client whatever else holds.
        assert!(!masquerades(
            frontend_flags::PRESERVE_CLIENT,
            node_flags::MASQUERADE_ALL,
            outside
        ));
        // External frontends always.
        assert!(masquerades(0, 0, inside));
        // A ClusterIP: only with masqueradeAll or a client from outside the cluster CIDR.
        assert!(!masquerades(frontend_flags::CLUSTER_IP, 0, inside));
        assert!(masquerades(frontend_flags::CLUSTER_IP, 0, outside));
        assert!(masquerades(
            frontend_flags::CLUSTER_IP,
            node_flags::MASQUERADE_ALL,
            inside
        ));
    }
}
