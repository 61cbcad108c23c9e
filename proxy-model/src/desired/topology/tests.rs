//! Table tests of CategorizeEndpoints: ready/serving/terminating combinations, both traffic
//! policies, zone and node hints and their fallbacks.

use std::net::IpAddr;

use super::*;

/// Endpoint shorthand: `e(last_octet, "RST", local)` where R=ready, S=serving, T=terminating.
fn e(last: u8, conditions: &str, is_local: bool) -> RawEndpoint {
    RawEndpoint {
        addr: IpAddr::from([10, 0, 0, last]),
        port: 80,
        is_local,
        ready: conditions.contains('R'),
        serving: conditions.contains('S'),
        terminating: conditions.contains('T'),
        zone_hints: Vec::new(),
        node_hints: Vec::new(),
    }
}

fn zones(mut endpoint: RawEndpoint, zones: &[&str]) -> RawEndpoint {
    endpoint.zone_hints = zones.iter().map(|z| z.to_string()).collect();
    endpoint
}

fn nodes(mut endpoint: RawEndpoint, nodes: &[&str]) -> RawEndpoint {
    endpoint.node_hints = nodes.iter().map(|n| n.to_string()).collect();
    endpoint
}

const CLUSTER: Usage = Usage {
    cluster: true,
    local: false,
};
const LOCAL: Usage = Usage {
    cluster: false,
    local: true,
};
const BOTH: Usage = Usage {
    cluster: true,
    local: true,
};

fn node(zone: Option<&str>) -> NodeContext {
    NodeContext {
        name: "node-a".into(),
        zone: zone.map(str::to_owned),
    }
}

struct Case {
    name: &'static str,
    endpoints: Vec<RawEndpoint>,
    usage: Usage,
    zone: Option<&'static str>,
    cluster: &'static [u8],
    local: &'static [u8],
    has_any: bool,
}

fn run(case: Case) {
    let (endpoints, has_any) = categorize(case.endpoints, case.usage, &node(case.zone));
    let pick = |f: fn(&Endpoint) -> bool| -> Vec<u8> {
        endpoints
            .iter()
            .filter(|e| f(e))
            .map(|e| match e.addr {
                IpAddr::V4(v4) => v4.octets()[3],
                IpAddr::V6(_) => 0,
            })
            .collect()
    };
    assert_eq!(pick(|e| e.cluster), case.cluster, "{}: cluster", case.name);
    assert_eq!(pick(|e| e.local), case.local, "{}: local", case.name);
    assert_eq!(has_any, case.has_any, "{}: has_any", case.name);
}

#[test]
fn categorize_endpoints_table() {
    let cases = vec![
        Case {
            name: "cluster: ready endpoints only",
            endpoints: vec![e(1, "RS", false), e(2, "", false), e(3, "ST", true)],
            usage: CLUSTER,
            zone: None,
            cluster: &[1],
            local: &[],
            has_any: true,
        },
        Case {
            name: "cluster: no ready → serving+terminating, any node",
            endpoints: vec![
                e(1, "T", false),
                e(2, "ST", false),
                e(3, "ST", true),
                e(4, "S", false),
            ],
            usage: CLUSTER,
            zone: None,
            cluster: &[2, 3],
            local: &[],
            has_any: true,
        },
        Case {
            name: "cluster: nothing usable",
            endpoints: vec![e(1, "", false), e(2, "T", false), e(3, "S", false)],
            usage: CLUSTER,
            zone: None,
            cluster: &[],
            local: &[],
            has_any: false,
        },
        Case {
            name: "local: local ready only",
            endpoints: vec![e(1, "RS", false), e(2, "RS", true), e(3, "ST", true)],
            usage: LOCAL,
            zone: None,
            cluster: &[],
            local: &[2],
            has_any: true,
        },
        Case {
            name: "local: no local ready → local serving+terminating (not remote ready)",
            endpoints: vec![e(1, "RS", false), e(2, "ST", true), e(3, "T", true)],
            usage: LOCAL,
            zone: None,
            cluster: &[],
            local: &[2],
            has_any: true,
        },
        Case {
            name: "local: no local endpoint at all, but remote ones exist",
            endpoints: vec![e(1, "RS", false)],
            usage: LOCAL,
            zone: None,
            cluster: &[],
            local: &[],
            has_any: true,
        },
        Case {
            name: "local: remote serving+terminating still counts as any",
            endpoints: vec![e(1, "ST", false)],
            usage: LOCAL,
            zone: None,
            cluster: &[],
            local: &[],
            has_any: true,
        },
        Case {
            name: "both policies (eTP=Local with external access)",
            endpoints: vec![e(1, "RS", false), e(2, "RS", true)],
            usage: BOTH,
            zone: None,
            cluster: &[1, 2],
            local: &[2],
            has_any: true,
        },
        Case {
            name: "zone hints honoured",
            endpoints: vec![
                zones(e(1, "RS", false), &["z1"]),
                zones(e(2, "RS", false), &["z2"]),
                zones(e(3, "RS", true), &["z1"]),
            ],
            usage: CLUSTER,
            zone: Some("z1"),
            cluster: &[1, 3],
            local: &[],
            has_any: true,
        },
        Case {
            name: "zone hints ignored when one ready endpoint lacks them",
            endpoints: vec![zones(e(1, "RS", false), &["z1"]), e(2, "RS", false)],
            usage: CLUSTER,
            zone: Some("z1"),
            cluster: &[1, 2],
            local: &[],
            has_any: true,
        },
        Case {
            name: "zone hints ignored when none is for this zone",
            endpoints: vec![
                zones(e(1, "RS", false), &["z2"]),
                zones(e(2, "RS", false), &["z3"]),
            ],
            usage: CLUSTER,
            zone: Some("z1"),
            cluster: &[1, 2],
            local: &[],
            has_any: true,
        },
        Case {
            name: "zone hints ignored when the node has no zone label",
            endpoints: vec![
                zones(e(1, "RS", false), &["z1"]),
                zones(e(2, "RS", false), &["z2"]),
            ],
            usage: CLUSTER,
            zone: None,
            cluster: &[1, 2],
            local: &[],
            has_any: true,
        },
        Case {
            name: "not-ready endpoints without hints do not disable hints",
            endpoints: vec![
                zones(e(1, "RS", false), &["z1"]),
                zones(e(2, "RS", false), &["z2"]),
                e(3, "", false),
            ],
            usage: CLUSTER,
            zone: Some("z1"),
            cluster: &[1],
            local: &[],
            has_any: true,
        },
        Case {
            name: "node hints (PreferSameNode) win over zone hints",
            endpoints: vec![
                nodes(zones(e(1, "RS", false), &["z1"]), &["node-b"]),
                nodes(zones(e(2, "RS", true), &["z1"]), &["node-a"]),
            ],
            usage: CLUSTER,
            zone: Some("z1"),
            cluster: &[2],
            local: &[],
            has_any: true,
        },
        Case {
            name: "node hints for other nodes only → fall back to zone hints",
            endpoints: vec![
                nodes(zones(e(1, "RS", false), &["z1"]), &["node-b"]),
                nodes(zones(e(2, "RS", false), &["z2"]), &["node-c"]),
            ],
            usage: CLUSTER,
            zone: Some("z1"),
            cluster: &[1],
            local: &[],
            has_any: true,
        },
        Case {
            name: "topology does not apply to the terminating fallback",
            endpoints: vec![
                zones(e(1, "ST", false), &["z2"]),
                zones(e(2, "ST", false), &["z1"]),
            ],
            usage: CLUSTER,
            zone: Some("z1"),
            cluster: &[1, 2],
            local: &[],
            has_any: true,
        },
    ];
    for case in cases {
        run(case);
    }
}

/// `--feature-gates=PreferSameTrafficDistribution=false`: upstream's topologyModeFromHints
/// skips node hints entirely and uses the zone hints.
#[test]
fn node_hints_need_the_prefer_same_traffic_distribution_gate() {
    let endpoints = vec![
        nodes(zones(e(1, "RS", false), &["z1"]), &["node-b"]),
        nodes(zones(e(2, "RS", true), &["z1"]), &["node-a"]),
    ];
    let node = node(Some("z1"));
    assert_eq!(
        topology_mode(&endpoints, &node, true),
        TopologyMode::SameNode
    );
    assert_eq!(
        topology_mode(&endpoints, &node, false),
        TopologyMode::SameZone
    );
}
