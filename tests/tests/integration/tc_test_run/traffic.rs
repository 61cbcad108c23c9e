//! The per-Service traffic counters the tc programs keep (`KPR_SERVICE_TRAFFIC`), read as the
//! agent reads them (`TrafficReader`, from the pins): a new connection counts once, when its
//! flow's conntrack entries are written — not again when the client's SYN comes again before
//! an answer (a retransmission finds the entries), and not for the datapath self-test's probe,
//! a synthetic SYN the agent runs through the live program.

use proxy_dataplane_ebpf::{ProbeOutcome, traffic::TrafficReader};
use proxy_model::traffic::{FrontendKind, TrafficReading};

use super::*;

fn reader(node: &Node) -> TrafficReader {
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
