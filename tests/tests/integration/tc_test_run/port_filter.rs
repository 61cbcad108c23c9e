//! The tc entry programs' port filter (`KPR_PORT_FILTER`): a packet whose ports no frontend,
//! backend or live conntrack entry uses is passed on before any hash lookup or tail call, and
//! nothing a Service's flows need is ever left out of it. The oracle is the programs' own
//! conntrack: an entry the family program would translate by is not consulted for a packet the
//! filter passes on.

use aya::maps::{Array, MapData};
use proxy_common::PortFilter;

use super::*;

const EXTERNAL4: &str = "kpr_tc_external4";

/// The filter through its pin, as another process would open it.
fn pinned_filter(node: &Node) -> Array<MapData, PortFilter> {
    let path = node
        .parts
        .bpf
        .path()
        .join(PIN_DIR_NAME)
        .join(map_names::PORT_FILTER);
    let data = MapData::from_pin(path).expect("pinned port filter");
    Array::try_from(Map::Array(data)).expect("port filter array")
}

fn filter(node: &Node) -> PortFilter {
    node.dataplane
        .port_filter()
        .expect("the dataplane maps the filter")
}

/// A UDP flow to the `dns` NodePort (`web`, 30053 → 5353) and the value of its forward
/// entry, copied under the key of the same client's datagrams to `NODE_IP`:`port`, a port no
/// Service uses: a packet there would be translated to the backend if the programs looked.
fn entry_for_unused_port(node: &mut Node, client: SocketAddr, port: u16) {
    let dns = sa(NODE_IP, 30053);
    first_packet(node, client, dns, L4::Udp, b"q");
    let value = ct_entry(node, &ct_key(client, dns, PROTO_UDP)).expect("forward entry");
    pinned_ct(node)
        .insert(&ct_key(client, sa(NODE_IP, port), PROTO_UDP), &value, 0)
        .expect("copy the entry");
}

/// Every frontend's port and every backend's port are in the filter once the Services are
/// programmed, and nothing else; a packet of another port is passed on by the entry program
/// even when a conntrack entry would translate it (the family program, run directly, does).
/// Until a full apply arms it (a map an upgrade created, before the new agent's first sync),
/// the filter lets every packet in: the old programs' flows keep their translation.
#[test]
fn packets_of_ports_no_service_uses_are_passed_on_before_any_lookup() {
    with_node(|node| {
        program_services(node);
        let ports = filter(node);
        assert_ne!(ports.armed, 0, "armed by the full apply");
        // NodePorts, and the ClusterIP and LB IP service ports.
        for port in [
            30080, 30053, 30868, 30081, 30870, 30082, 30083, 30869, 80, 53, 3868,
        ] {
            assert!(ports.has_destination(port), "frontend port {port}");
        }
        for port in [8080, 5353, 3869] {
            assert!(ports.has_source(port), "backend port {port}");
        }
        for port in [22, 443, 8080, 5353] {
            assert!(!ports.has_destination(port), "not a frontend port: {port}");
        }
        for port in [22, 80, 30080] {
            assert!(!ports.has_source(port), "not a backend port: {port}");
        }

        let client = sa(CLIENT, 42_200);
        entry_for_unused_port(node, client, 2222);
        let datagram = build(client, sa(NODE_IP, 2222), L4::Udp, b"x");
        let (action, out) = run(node, EXTERNAL4, &datagram, node.ext0);
        assert_eq!(
            action, TC_ACT_REDIRECT,
            "the family program finds the entry"
        );
        assert_eq!(out.destination(), sa(BACKEND, 5353));
        let (action, out) = run(node, program_names::TC_EXTERNAL, &datagram, node.ext0);
        assert_eq!(action, TC_ACT_UNSPEC, "passed on by the filter");
        assert_eq!(out.destination(), sa(NODE_IP, 2222), "untouched");

        // Unarmed, as a map an upgrade just created: every packet goes to the family program.
        let mut pinned = pinned_filter(node);
        let mut unarmed = pinned.get(&0, 0).expect("filter value");
        unarmed.armed = 0;
        pinned.set(0, unarmed, 0).expect("disarm");
        let (action, out) = run(node, program_names::TC_EXTERNAL, &datagram, node.ext0);
        assert_eq!(action, TC_ACT_REDIRECT, "unarmed: looked at");
        assert_eq!(out.destination(), sa(BACKEND, 5353));
        // The next full apply arms it again.
        let (_, errors) = node.dataplane.apply(&services_snapshot(), None);
        assert!(errors.is_empty(), "{errors:?}");
        assert_ne!(filter(node).armed, 0);
        let (action, _) = run(node, program_names::TC_EXTERNAL, &datagram, node.ext0);
        assert_eq!(action, TC_ACT_UNSPEC, "armed again: passed on");

        // A pod's packet between ports no Service uses, on the pod side: passed on too.
        let (action, out) = run(
            node,
            program_names::TC_REPLY,
            &build(sa(BACKEND, 40_000), sa("10.244.1.3", 9000), L4::TcpSyn, b""),
            node.pod0,
        );
        assert_eq!(action, TC_ACT_UNSPEC);
        assert_eq!(out.destination(), sa("10.244.1.3", 9000));
    });
}

/// A flow keeps its translation after its Service is gone, as netfilter's conntrack keeps it
/// for kube-proxy: its ports stay in the filter while its entries live, and leave it two
/// garbage collection rounds after the last entry (and the last frontend and backend) that
/// used them went, after which its packets are passed on.
#[test]
fn a_flows_ports_stay_in_the_filter_while_its_entries_live() {
    with_node(|node| {
        program_services(node);
        // TCP: a removed backend's UDP entries are purged at once (kube-proxy's rule), TCP
        // flows drain.
        let client = sa(CLIENT, 42_300);
        let frontend = sa(NODE_IP, 30080);
        first_packet(node, client, frontend, L4::TcpSyn, b"");
        let segment = build(client, frontend, L4::TcpAck, b"data");

        // Every Service goes; the removed generations' grace passes.
        let (_, errors) = node.dataplane.apply(&Snapshot::default(), None);
        assert!(errors.is_empty(), "{errors:?}");
        std::thread::sleep(std::time::Duration::from_millis(1_100));
        node.dataplane.retire_generations();
        assert!(
            filter(node).has_destination(30080),
            "kept until a GC round settles"
        );

        for round in 0..3 {
            node.dataplane.conntrack_gc().expect("conntrack gc");
            let ports = filter(node);
            assert!(
                ports.has_destination(30080),
                "round {round}: the flow's frontend port"
            );
            assert!(
                ports.has_source(8080),
                "round {round}: the flow's backend port"
            );
            // Unused at the first settle, cleared at the second.
            assert_eq!(
                ports.has_destination(30053),
                round == 0,
                "round {round}: no flow, no frontend"
            );
            let (action, out) = run(node, program_names::TC_EXTERNAL, &segment, node.ext0);
            assert_eq!(action, TC_ACT_REDIRECT, "round {round}: still translated");
            assert_eq!(out.destination(), sa(BACKEND, 8080));
        }

        // The flow's entries go (expired, evicted): the ports go two rounds later.
        node.dataplane.clear_conntrack().expect("clear conntrack");
        node.dataplane.conntrack_gc().expect("conntrack gc");
        assert!(
            filter(node).has_destination(30080),
            "one round without it is not enough"
        );
        node.dataplane.conntrack_gc().expect("conntrack gc");
        let ports = filter(node);
        assert!(!ports.has_destination(30080));
        assert!(!ports.has_source(8080));
        let (action, out) = run(node, program_names::TC_EXTERNAL, &segment, node.ext0);
        assert_eq!(action, TC_ACT_UNSPEC, "no Service, no flow: passed on");
        assert_eq!(out.destination(), frontend);
    });
}
