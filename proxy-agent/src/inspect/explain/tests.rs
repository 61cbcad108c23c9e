//! The decision logic over in-memory maps: each branch of the socket hooks and of tc.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

#[derive(Default)]
struct FakeMaps {
    frontends: BTreeMap<(IpAddr, u16, u8, u8), FrontendValue>,
    /// Backend ids by (service id, slot, generation); read back per block entry and index.
    slots: BTreeMap<(u32, u16, u8), u32>,
    backends: BTreeMap<u32, SocketAddr>,
    node_addrs: BTreeSet<IpAddr>,
    config: Option<NodeConfig>,
    ranges: BTreeSet<(u32, IpAddr)>,
    members: BTreeSet<(u32, u32)>,
    sticky: Vec<(AffinityKey, AffinityValue)>,
}

impl Maps for FakeMaps {
    fn frontend(&self, addr: IpAddr, port: u16, protocol: u8, scope: u8) -> Option<FrontendValue> {
        self.frontends.get(&(addr, port, protocol, scope)).copied()
    }
    fn slot(&self, key: BackendSlotKey, index: usize) -> Option<u32> {
        let slot = u32::from(key.block) * proxy_common::SLOT_BLOCK_SLOTS + index as u32;
        self.slots
            .get(&(key.service_id, u16::try_from(slot).ok()?, key.generation))
            .copied()
    }
    fn backend(&self, id: u32, _v6: bool) -> Option<SocketAddr> {
        self.backends.get(&id).copied()
    }
    fn node_address(&self, addr: IpAddr) -> bool {
        self.node_addrs.contains(&addr)
    }
    fn node_config(&self) -> Option<NodeConfig> {
        self.config
    }
    fn source_allowed(&self, service_id: u32, addr: IpAddr) -> bool {
        self.ranges.contains(&(service_id, addr))
    }
    fn maglev(&self, _key: MaglevKey) -> Option<MaglevBlock> {
        None
    }
    fn conntrack(&self, _key: CtKey) -> Option<CtValue> {
        None
    }
    fn affinity(&self, _key: AffinityKey) -> Option<AffinityValue> {
        None
    }
    fn affinity_match(&self, key: AffinityMatchKey) -> bool {
        self.members.contains(&(key.service_id, key.backend_id))
    }
    fn affinity_entries(&self) -> Vec<(AffinityKey, AffinityValue)> {
        Vec::new()
    }
    fn sticky_entries(&self) -> Vec<(AffinityKey, AffinityValue)> {
        self.sticky.clone()
    }
    fn now_ns(&self) -> u64 {
        0
    }
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("address")
}

/// web: ClusterIP 10.96.0.10:80 (internal) and NodePort 30080 (internal wildcard + external
/// wildcard), backends 10.244.1.2:8080 and 10.244.2.2:8080; node address 192.168.0.1.
fn maps() -> FakeMaps {
    let mut m = FakeMaps::default();
    let value = |service_id, flags| FrontendValue {
        service_id,
        backend_count: 2,
        generation: 1,
        flags,
        affinity_timeout: 0,
        maglev_size: 0,
    };
    m.frontends.insert(
        (ip("10.96.0.10"), 80, proto::TCP, scope::INTERNAL),
        value(1, 0),
    );
    m.frontends.insert(
        (ip("0.0.0.0"), 30080, proto::TCP, scope::INTERNAL),
        value(2, 0),
    );
    m.frontends.insert(
        (ip("0.0.0.0"), 30080, proto::TCP, scope::EXTERNAL),
        value(3, 0),
    );
    for service in 1..=3 {
        m.slots.insert((service, 0, 1), 10);
        m.slots.insert((service, 1, 1), 11);
    }
    m.backends
        .insert(10, "10.244.1.2:8080".parse().expect("addr"));
    m.backends
        .insert(11, "10.244.2.2:8080".parse().expect("addr"));
    m.node_addrs.insert(ip("192.168.0.1"));
    m.config = Some(NodeConfig {
        snat4: u32::from_ne_bytes([192, 168, 0, 1]),
        ..NodeConfig::default()
    });
    m
}

fn query(from: From, client: &str, to: &str) -> Query {
    let (dest, protocol) = parse_destination(to).expect("destination");
    Query {
        from,
        client: ip(client),
        dest,
        protocol,
        sport: None,
    }
}

#[test]
fn a_cluster_ip_from_the_node_is_translated_keeping_the_client() {
    let e = explain(&maps(), &query(From::Node, "0.0.0.0", "10.96.0.10:80/tcp"));
    assert_eq!(e.verdict, "translate");
    assert_eq!(e.candidates, ["10.244.1.2:8080", "10.244.2.2:8080"]);
    assert_eq!(e.chosen, None, "random: not determined");
    assert_eq!(e.service_id, Some(1));
}

#[test]
fn a_node_port_on_a_node_address_uses_the_wildcard_frontend_and_snat_from_outside() {
    let local = explain(
        &maps(),
        &query(From::Pod, "10.244.1.2", "192.168.0.1:30080/tcp"),
    );
    assert_eq!(
        (local.verdict.as_str(), local.service_id),
        ("translate", Some(2))
    );
    let outside = explain(
        &maps(),
        &query(From::External, "192.168.100.5", "192.168.0.1:30080/tcp"),
    );
    assert_eq!(outside.service_id, Some(3));
    assert_eq!(
        outside.source.as_deref(),
        Some("192.168.0.1 (SNAT to the node address)")
    );
}

#[test]
fn unknown_destinations_pass_and_empty_services_refuse_or_drop() {
    let e = explain(&maps(), &query(From::Node, "0.0.0.0", "10.96.0.99:80/tcp"));
    assert_eq!(e.verdict, "pass");
    let mut m = maps();
    m.frontends
        .get_mut(&(ip("10.96.0.10"), 80, proto::TCP, scope::INTERNAL))
        .expect("web")
        .backend_count = 0;
    let e = explain(&m, &query(From::Node, "0.0.0.0", "10.96.0.10:80/tcp"));
    assert_eq!(e.verdict, "refuse");
    assert!(e.reason.starts_with("ECONNREFUSED"), "{}", e.reason);
    m.frontends
        .get_mut(&(ip("10.96.0.10"), 80, proto::TCP, scope::INTERNAL))
        .expect("web")
        .flags = frontend_flags::DROP_NO_BACKENDS;
    let e = explain(&m, &query(From::Node, "0.0.0.0", "10.96.0.10:80/tcp"));
    assert_eq!(e.verdict, "drop");
    assert!(e.reason.starts_with("EHOSTUNREACH"), "{}", e.reason);
}

#[test]
fn source_ranges_judge_external_clients_and_leave_pods_to_tc() {
    let mut m = maps();
    let guarded = FrontendValue {
        service_id: 4,
        backend_count: 2,
        generation: 1,
        flags: frontend_flags::SOURCE_RANGES | frontend_flags::PRESERVE_CLIENT,
        affinity_timeout: 0,
        maglev_size: 0,
    };
    let lb = ip("192.0.2.10");
    m.frontends
        .insert((lb, 80, proto::TCP, scope::EXTERNAL), guarded);
    m.frontends
        .insert((lb, 80, proto::TCP, scope::INTERNAL), guarded);
    m.slots.insert((4, 0, 1), 10);
    m.slots.insert((4, 1, 1), 11);
    m.ranges.insert((4, ip("203.0.113.7")));
    let inside = explain(
        &m,
        &query(From::External, "203.0.113.7", "192.0.2.10:80/tcp"),
    );
    assert_eq!(inside.verdict, "translate");
    assert_eq!(inside.source.as_deref(), Some("203.0.113.7 (kept)"));
    let outside = explain(
        &m,
        &query(From::External, "203.0.113.8", "192.0.2.10:80/tcp"),
    );
    assert_eq!(outside.verdict, "drop");
    let pod = explain(&m, &query(From::Pod, "10.244.1.2", "192.0.2.10:80/tcp"));
    assert_eq!(pod.program, "tc (pod veth)");
    assert_eq!(pod.verdict, "drop", "the pod is outside the ranges");
    // Without the node namespace's cookie the hooks cannot tell host sockets from pods' and
    // leave the socket alone, as the datapath does.
    let node = explain(&m, &query(From::Node, "0.0.0.0", "192.0.2.10:80/tcp"));
    assert_eq!(node.verdict, "pass");
    // The node's own sockets are judged by the node address.
    m.config = m.config.map(|c| NodeConfig {
        host_netns_cookie: 1,
        ..c
    });
    let node = explain(&m, &query(From::Node, "0.0.0.0", "192.0.2.10:80/tcp"));
    assert_eq!(node.verdict, "drop");
    assert!(node.reason.starts_with("EHOSTUNREACH"), "{}", node.reason);
    m.ranges.insert((4, ip("192.168.0.1")));
    let node = explain(&m, &query(From::Node, "0.0.0.0", "192.0.2.10:80/tcp"));
    assert_eq!(node.verdict, "translate");
}

#[test]
fn unconnected_udp_sockets_list_the_backend_they_keep_while_it_is_a_member() {
    let mut m = maps();
    let flags = frontend_flags::STICKY_SOCKET;
    m.frontends.insert(
        (ip("10.96.0.53"), 53, proto::UDP, scope::INTERNAL),
        FrontendValue {
            service_id: 4,
            backend_count: 2,
            generation: 1,
            flags,
            affinity_timeout: 0,
            maglev_size: 0,
        },
    );
    m.slots.insert((4, 0, 1), 10);
    m.slots.insert((4, 1, 1), 11);
    m.members.insert((4, 11));
    let entry = |client, backend_id| {
        (
            AffinityKey {
                client,
                service_id: 4,
                _pad: 0,
            },
            AffinityValue {
                backend_id,
                _pad: 0,
                last_used_ns: 0,
            },
        )
    };
    // Socket 7 keeps a member; socket 8's backend left the Service (it picks again).
    m.sticky = vec![entry(7, 11), entry(8, 10)];
    let e = explain(&m, &query(From::Pod, "10.244.1.2", "10.96.0.53:53/udp"));
    assert_eq!(e.verdict, "translate");
    assert_eq!(
        e.sticky_sockets,
        [Pinned {
            client: "socket cookie 7".into(),
            backend: "10.244.2.2:8080".into(),
            idle_s: 0,
        }]
    );
    assert!(e.netfilter.is_none(), "sockets never meet tc");
}

#[test]
fn tc_reports_whether_netfilter_sees_translated_packets() {
    let mut m = maps();
    let q = query(From::External, "192.168.100.5", "192.168.0.1:30080/tcp");
    let default = explain(&m, &q);
    assert!(
        default
            .netfilter
            .as_deref()
            .is_some_and(|n| n.starts_with("netfilter path")),
        "{default:?}"
    );
    if let Some(c) = m.config.as_mut() {
        c.flags |= node_flags::FAST_PATH;
    }
    let fast = explain(&m, &q);
    assert!(
        fast.netfilter
            .as_deref()
            .is_some_and(|n| n.starts_with("--tc-fast-path")),
        "{fast:?}"
    );
}

#[test]
fn iptables_affinity_names_the_endpoint_whose_recent_list_holds_the_client() {
    use proxy_dataplane_iptables::tracer::Tracer;
    let dump = "*nat\n\
        -A PREROUTING -j KUBE-SERVICES\n\
        -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-A\n\
        -A KUBE-SVC-A -m recent --name KUBE-SEP-1 --rcheck --seconds 10800 --reap -j KUBE-SEP-1\n\
        -A KUBE-SVC-A -m recent --name KUBE-SEP-2 --rcheck --seconds 10800 --reap -j KUBE-SEP-2\n\
        -A KUBE-SVC-A -m statistic --mode random --probability 0.5 -j KUBE-SEP-1\n\
        -A KUBE-SVC-A -j KUBE-SEP-2\n\
        -A KUBE-SEP-1 -p tcp -m recent --set --name KUBE-SEP-1 -j DNAT --to-destination 10.244.1.2:8080\n\
        -A KUBE-SEP-2 -p tcp -m recent --set --name KUBE-SEP-2 -j DNAT --to-destination 10.244.2.2:8080\n\
        COMMIT\n";
    let tracer = Tracer::new(dump, &[], &[]);
    let q = query(From::Pod, "10.244.3.2", "10.96.0.10:80/tcp");
    let mut e = explain_iptables(&tracer, &q);
    assert_eq!(e.candidates, ["10.244.1.2:8080", "10.244.2.2:8080"]);
    assert_eq!(e.chosen, None);
    let lists = |chain: &str| {
        (chain == "KUBE-SEP-2").then(|| {
            "src=10.244.9.9 ttl: 64 last_seen: 1 oldest_pkt: 1 1\n\
             src=10.244.3.2 ttl: 64 last_seen: 2 oldest_pkt: 1 2\n"
                .to_owned()
        })
    };
    iptables_affinity(&tracer, &q, &mut e, lists);
    assert_eq!(e.chosen.as_deref(), Some("10.244.2.2:8080"), "{e:?}");
    // Another client is in no list: random among the candidates.
    let other = query(From::Pod, "10.244.4.2", "10.96.0.10:80/tcp");
    let mut e = explain_iptables(&tracer, &other);
    iptables_affinity(&tracer, &other, &mut e, lists);
    assert_eq!(e.chosen, None);
}

#[test]
fn host_namespace_only_leaves_a_pods_cluster_ip_flow_to_the_pod_veth() {
    let mut m = maps();
    let q = query(From::Pod, "10.244.3.2", "10.96.0.10:80/tcp");
    assert_eq!(
        explain(&m, &q).program,
        "socket connect/sendmsg (cgroup hook)"
    );
    m.config = m.config.map(|c| NodeConfig {
        flags: c.flags | node_flags::HOST_NAMESPACE_ONLY,
        host_netns_cookie: 1,
        ..c
    });
    let e = explain(&m, &q);
    assert_eq!(
        e.program,
        "tc (pod veth; socket LB for the host namespace only)"
    );
    assert_eq!(e.verdict, "translate");
    assert_eq!(e.candidates, ["10.244.1.2:8080", "10.244.2.2:8080"]);
    assert!(e.netfilter.is_some(), "pod packets meet tc");
    // The node's own processes keep socket-level translation.
    let node = explain(&m, &query(From::Node, "0.0.0.0", "10.96.0.10:80/tcp"));
    assert_eq!(node.program, "socket connect/sendmsg (cgroup hook)");
}

#[test]
fn tc_names_the_backend_of_the_flow_hash_slot_given_the_client_port() {
    let m = maps();
    let mut q = query(From::External, "192.168.100.5", "192.168.0.1:30080/tcp");
    assert_eq!(
        explain(&m, &q).chosen,
        None,
        "no client port: the slot is unknown"
    );
    q.sport = Some(40_000);
    let e = explain(&m, &q);
    let chosen = e.chosen.expect("the tuple's slot is determined");
    assert!(
        e.candidates.contains(&chosen),
        "{chosen} in {:?}",
        e.candidates
    );
    // The same slot the programs compute (`proxy_common::select`).
    let ports = (u32::from(40_000u16.to_be()) << 16) | u32::from(30_080u16.to_be());
    let hash = proxy_common::maglev::flow_hash(
        &[u32::from_ne_bytes([192, 168, 100, 5]), 0, 0, 0],
        &[u32::from_ne_bytes([192, 168, 0, 1]), 0, 0, 0],
        ports,
        proto::TCP,
    );
    let expected = ["10.244.1.2:8080", "10.244.2.2:8080"][(hash % 2) as usize];
    assert_eq!(chosen, expected);
}
