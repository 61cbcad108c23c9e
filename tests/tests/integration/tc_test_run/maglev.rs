//! `--lb-algorithm maglev`: flows keep their backends, affinity comes first, both families.

use super::*;

/// `--lb-algorithm maglev`: removing one of five backends moves only the flows that were on it
/// (and a few more, from the table refill), where random choice moves most flows; new flows are
/// spread evenly over the backends either way.
#[test]
fn maglev_keeps_most_flows_on_their_backend_when_one_leaves() {
    let maglev = measure_disruption(LbOptions {
        maglev: true,
        ..LbOptions::default()
    });
    let random = measure_disruption(LbOptions::default());
    for (name, d) in [("maglev", &maglev), ("random", &random)] {
        eprintln!(
            "{name}: {:.1}% of the flows of surviving backends moved; first round per backend \
             {:?}; the removed backend's flows went to {:?}",
            d.survivors_moved * 100.0,
            d.first.values().collect::<Vec<_>>(),
            d.leaving_spread.values().collect::<Vec<_>>(),
        );
        assert_eq!(
            d.first.len(),
            SPREAD_BACKENDS.len(),
            "{name}: {:?}",
            d.first
        );
        let even = f64::from(FLOWS) / SPREAD_BACKENDS.len() as f64;
        for (backend, &n) in &d.first {
            let ratio = n as f64 / even;
            assert!(
                (0.75..=1.25).contains(&ratio),
                "{name}: backend {backend} got {n} of {FLOWS} flows"
            );
        }
    }
    assert!(
        maglev.survivors_moved < 0.10,
        "maglev moved {:.1}% of surviving flows",
        maglev.survivors_moved * 100.0
    );
    assert!(
        random.survivors_moved > 0.5,
        "random moved only {:.1}% of surviving flows",
        random.survivors_moved * 100.0
    );
    // The removed backend's flows (about 400) are shared by all four others, none left out.
    let leaving_flows: usize = maglev.leaving_spread.values().sum();
    assert_eq!(maglev.leaving_spread.len(), SPREAD_BACKENDS.len() - 1);
    for (backend, &n) in &maglev.leaving_spread {
        assert!(
            n * 10 >= leaving_flows,
            "maglev: {backend} took only {n} of the removed backend's {leaving_flows} flows"
        );
    }
}

/// Session affinity goes before Maglev: flows of one client with different source ports (which
/// Maglev alone spreads over the backends) all go to the backend of its first flow.
#[test]
fn session_affinity_keeps_priority_over_maglev() {
    let lb = LbOptions {
        maglev: true,
        ..LbOptions::default()
    };
    let backends = with_node_lb(lb, |node| {
        program_spread_with(node, &SPREAD_BACKENDS, "ClientIP");
        let frontend = sa(NODE_IP, 30090);
        (0..50u16)
            .map(|i| {
                let frame = build(sa(CLIENT, 30_000 + i), frontend, L4::TcpSyn, b"");
                let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                assert_eq!(action, TC_ACT_REDIRECT);
                out.dst
            })
            .collect::<std::collections::BTreeSet<IpAddr>>()
    });
    eprintln!("50 flows of one client with affinity and maglev went to {backends:?}");
    assert_eq!(backends.len(), 1, "{backends:?}");
}

/// Maglev over IPv6: a dual-stack NodePort's IPv6 flows spread over the backends, and the same
/// tuples get the same backends again after conntrack is cleared (random would not).
#[test]
fn maglev_ipv6_flows_keep_their_backend_for_the_same_tuple() {
    let lb = LbOptions {
        maglev: true,
        ..LbOptions::default()
    };
    let (first, second) = with_node_lb(lb, |node| {
        let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: spread6, namespace: default}\n\
                    spec: {type: NodePort, clusterIP: 'fd00:96::30', clusterIPs: ['fd00:96::30'], \
                    ipFamilies: [IPv6], ipFamilyPolicy: SingleStack, ports: [\
                    {name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30091}]}\n";
        let service: Service = serde_yaml::from_str(yaml).expect("service yaml");
        let yaml = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                    metadata: {name: spread6-1, namespace: default, labels: {kubernetes.io/service-name: spread6}}\n\
                    addressType: IPv6\nports: [{name: http, port: 8080, protocol: TCP}]\n\
                    endpoints: [{addresses: ['fd00:244:1::2']}, {addresses: ['fd00:244:1::3']}, \
                    {addresses: ['fd00:244:1::4']}]\n";
        let slice: EndpointSlice = serde_yaml::from_str(yaml).expect("slice yaml");
        let objects = Objects::new(
            BTreeMap::from([(key("spread6"), service.into())]),
            BTreeMap::from([(key("spread6-1"), slice.into())]),
            None,
        );
        let (_, errors) = node
            .dataplane
            .apply(&Snapshot::compute(&objects, NODE), None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        let frontend = sa(NODE_IP6, 30091);
        let round = |node: &mut Node| -> Vec<IpAddr> {
            node.dataplane.clear_conntrack().expect("clear conntrack");
            (0..200u16)
                .map(|i| {
                    let frame = build(sa(CLIENT6, 30_000 + i), frontend, L4::TcpSyn, b"");
                    let (action, out) = run(node, program_names::TC_EXTERNAL, &frame, node.ext0);
                    assert_eq!(action, TC_ACT_REDIRECT);
                    out.dst
                })
                .collect()
        };
        let first = round(node);
        let second = round(node);
        (first, second)
    });
    let mut counts = BTreeMap::new();
    for backend in &first {
        *counts.entry(*backend).or_insert(0usize) += 1;
    }
    let same = first.iter().zip(&second).filter(|(a, b)| a == b).count();
    eprintln!("IPv6 maglev: flows per backend {counts:?}; {same} of 200 on the same backend again");
    assert_eq!(counts.len(), 3, "{counts:?}");
    assert_eq!(same, first.len());
}
