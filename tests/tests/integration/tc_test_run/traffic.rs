//! The per-Service traffic counters the tc programs keep (`KPR_SERVICE_TRAFFIC`), read as the
//! agent reads them (`TrafficReader`, from the pins): a new connection counts once, when its
//! flow's conntrack entries are written — not again when the client's SYN comes again before
//! an answer (a retransmission finds the entries), and not for the datapath self-test's probe,
//! a synthetic SYN the agent runs through the live program.

use proxy_dataplane_ebpf::{ProbeOutcome, traffic::TrafficReader};
use proxy_model::traffic::{FrontendKind, TrafficReading};

use super::*;

pub(super) fn reader(node: &Node) -> TrafficReader {
    TrafficReader::open(&node.parts.bpf.path().join(PIN_DIR_NAME)).expect("pinned counters")
}

/// New connections counted for Service `name`'s `kind` frontends, all ports summed.
fn new_connections(reading: &TrafficReading, name: &str, kind: FrontendKind) -> u64 {
    reading
        .services
        .iter()
        .filter(|s| s.key.service.name == name && s.key.frontend == kind)
        .map(|s| s.counts.new_connections)
        .sum()
}

/// Every Service's new connections, all frontends summed.
fn all_new_connections(reading: &TrafficReading) -> u64 {
    reading
        .services
        .iter()
        .map(|s| s.counts.new_connections)
        .sum()
}

/// The client's SYN twice, unanswered in between (a retransmission: the same segment), then a
/// SYN from another port: two connections, whichever path the node takes. Then the self-test,
/// whose probe the program translates like a client's SYN: still two.
fn a_syn_sent_twice_is_one_connection(node: &mut Node, path: &str) {
    program_services(node);
    let mut counters = reader(node);
    assert_eq!(
        all_new_connections(&counters.read().expect("read")),
        0,
        "{path}: nothing counted before any traffic"
    );
    let frontend = sa(NODE_IP, 30080);
    let backend = sa(BACKEND, 8080);
    let client = sa(CLIENT, 41_000);
    let syn = build(client, frontend, L4::TcpSyn, b"");
    let mut translated = Vec::new();
    for attempt in 1..=2 {
        let (action, out) = run(node, program_names::TC_EXTERNAL, &syn, node.ext0);
        assert_ne!(action, TC_ACT_SHOT, "{path}: SYN {attempt}");
        assert_eq!(out.destination(), backend, "{path}: SYN {attempt} DNAT");
        translated.push(out.source());
        let reading = counters.read().expect("read");
        assert_eq!(
            new_connections(&reading, "web", FrontendKind::NodePort),
            1,
            "{path}: after SYN {attempt} of the one connection: {reading:?}"
        );
    }
    assert_eq!(
        translated[0], translated[1],
        "{path}: the second SYN took the first one's flow (same SNAT source)"
    );
    let other = build(sa(CLIENT, 41_001), frontend, L4::TcpSyn, b"");
    let (action, _) = run(node, program_names::TC_EXTERNAL, &other, node.ext0);
    assert_ne!(action, TC_ACT_SHOT, "{path}: the second connection's SYN");
    let reading = counters.read().expect("read");
    assert_eq!(
        new_connections(&reading, "web", FrontendKind::NodePort),
        2,
        "{path}: a SYN from another port is another connection: {reading:?}"
    );

    let test = node.dataplane.self_test();
    assert!(
        test.probes
            .iter()
            .any(|probe| probe.outcome == ProbeOutcome::Passed),
        "{path}: the self-test's probe went through the program: {test:?}"
    );
    let reading = counters.read().expect("read");
    assert_eq!(
        all_new_connections(&reading),
        2,
        "{path}: the self-test's probe is no connection: {test:?} {reading:?}"
    );
}

#[test]
fn a_syn_sent_twice_counts_one_connection_and_the_self_test_none_netfilter_path() {
    with_netfilter_node(|node| a_syn_sent_twice_is_one_connection(node, "netfilter path"));
}

#[test]
fn a_syn_sent_twice_counts_one_connection_and_the_self_test_none_fast_path() {
    with_node(|node| a_syn_sent_twice_is_one_connection(node, "fast path"));
}

/// The forward and reply packets and bytes of Service `name`'s `kind` frontends, all ports
/// summed (`KPR_SERVICE_PACKETS`, the CPUs summed).
pub(super) fn packets(reading: &TrafficReading, name: &str, kind: FrontendKind) -> [u64; 4] {
    reading
        .services
        .iter()
        .filter(|s| s.key.service.name == name && s.key.frontend == kind)
        .filter_map(|s| s.counts.packets)
        .fold([0; 4], |sum, c| {
            [
                sum[0] + c.forward_packets,
                sum[1] + c.forward_bytes,
                sum[2] + c.reply_packets,
                sum[3] + c.reply_bytes,
            ]
        })
}

/// A NodePort flow's packets through tc, each counted once in its direction with its IP bytes
/// (the frame past the Ethernet header): the client's first and second packet forward, the
/// backend's answer back. With the counting off (`node_flags::NO_PACKET_COUNTS`, what
/// `--service-traffic-max-series 0` sets) another flow's packets count nothing, and with it on
/// again a third flow's count as the first's did.
#[test]
fn a_flows_packets_and_bytes_count_by_direction_and_not_while_counting_is_off() {
    with_node(|node| {
        program_services(node);
        let mut counters = reader(node);
        let web = |counters: &mut TrafficReader| {
            packets(
                &counters.read().expect("read"),
                "web",
                FrontendKind::NodePort,
            )
        };
        assert_eq!(web(&mut counters), [0; 4], "nothing before any traffic");
        let frontend = sa(NODE_IP, 30080);
        let backend = sa(BACKEND, 8080);
        // `round_trip`'s frames: "ping" twice from the client, "pong" once from the backend.
        let ip_bytes = |payload: &[u8]| {
            (build(sa(CLIENT, 1), frontend, L4::TcpSyn, payload).len() - 14) as u64
        };
        let one_flow = [2, 2 * ip_bytes(b"ping"), 1, ip_bytes(b"pong")];
        round_trip(
            node,
            sa(CLIENT, 41_200),
            frontend,
            backend,
            L4::TcpSyn,
            false,
        );
        assert_eq!(
            web(&mut counters),
            one_flow,
            "[forward packets, bytes, reply packets, bytes]"
        );
        node.dataplane.set_packet_counts(false);
        round_trip(
            node,
            sa(CLIENT, 41_201),
            frontend,
            backend,
            L4::TcpSyn,
            false,
        );
        assert_eq!(
            web(&mut counters),
            one_flow,
            "nothing counted while counting is off"
        );
        node.dataplane.set_packet_counts(true);
        round_trip(
            node,
            sa(CLIENT, 41_202),
            frontend,
            backend,
            L4::TcpSyn,
            false,
        );
        assert_eq!(
            web(&mut counters),
            one_flow.map(|n| 2 * n),
            "counted again once it is on"
        );
    });
}

/// The agent's way (`write_names_later`): a first full sync of 400 Services leaves their names
/// out of the pinned `KPR_SERVICE_NAMES`; then they are written a bounded step at a time, in
/// several steps, until every frontend's name is in the map and a name a previous agent left
/// under an id no frontend holds is gone.
#[test]
fn a_first_syncs_names_are_written_after_it_in_bounded_steps() {
    with_node(|node| {
        let pin_dir = node.parts.bpf.path().join(PIN_DIR_NAME);
        let stale_id = 65_000;
        {
            let map = MapData::from_pin(pin_dir.join(map_names::SERVICE_NAMES)).expect("pin");
            let mut names: AyaHashMap<MapData, u32, proxy_common::ServiceName> =
                AyaHashMap::try_from(Map::HashMap(map)).expect("names map");
            let stale = proxy_common::ServiceName::new("default/gone:http", 0, proto::TCP)
                .expect("a short name");
            names
                .insert(stale_id, stale, 0)
                .expect("stale name written");
        }
        node.dataplane.write_names_later();
        let count = 400;
        // Spread over namespaces: each namespace's share of the frontend map stays far off.
        let namespace = |i: usize| format!("ns{}", i % 8);
        let services: BTreeMap<ObjectKey, ServiceInfo> = (0..count)
            .map(|i| {
                let yaml = format!(
                    "apiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: {}}}\n\
                     spec: {{clusterIP: 10.97.{}.{}, \
                     ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]}}\n",
                    namespace(i),
                    i / 250,
                    i % 250 + 1
                );
                let service: Service = serde_yaml::from_str(&yaml).expect("service yaml");
                let key = ObjectKey {
                    namespace: namespace(i).into(),
                    name: format!("s{i}").into(),
                };
                (key, service.into())
            })
            .collect();
        let objects = Objects::new(services, BTreeMap::new(), None);
        let snapshot = Snapshot::compute(&objects, NODE);
        let (summary, errors) = node.dataplane.apply(&snapshot, None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        assert_eq!(summary.frontends_written, 2 * count, "{summary:?}");
        let wanted = |i: usize| format!("{}/s{i}:http", namespace(i));
        let names = proxy_dataplane_ebpf::traffic::service_names(&pin_dir).expect("names");
        assert!(node.dataplane.names_pending(), "the sync left the names");
        assert!(
            !names.values().any(|name| *name == wanted(0)),
            "no name written by the sync itself: {} names",
            names.len()
        );
        let mut steps = 0;
        while node.dataplane.names_pending() && steps < 100_000 {
            node.dataplane.write_pending_names(&snapshot);
            steps += 1;
        }
        assert!(!node.dataplane.names_pending(), "done after {steps} steps");
        eprintln!("{count} Services' names written in {steps} steps");
        assert!(steps > 1, "{count} Services' names took {steps} step(s)");
        let names = proxy_dataplane_ebpf::traffic::service_names(&pin_dir).expect("names");
        for i in 0..count {
            assert!(
                names.values().any(|name| *name == wanted(i)),
                "{} missing",
                wanted(i)
            );
        }
        assert!(!names.contains_key(&stale_id), "the stale name is removed");
        assert_eq!(
            names.len(),
            2 * count,
            "one name per frontend (ClusterIP, in and out)"
        );
    });
}
