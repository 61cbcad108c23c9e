//! Which copy of an endpoint listed twice a Service gets. The first two tests transcribe
//! kube-proxy 1.36's own cases (named in each); the rest pin the same rule down for the orders
//! and places a reused pod address can come in.

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::*;

const NODE: &str = "host1";

/// `svc1-<suffix>` in `ns1` with TCP ports `port-<i>` (upstream's test slices' names) and the
/// given endpoints, each a YAML flow mapping.
fn slice(suffix: &str, ports: &[u16], endpoints: &[String]) -> (ObjectKey, EndpointSliceInfo) {
    let ports: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| format!("{{name: port-{i}, port: {port}, protocol: TCP}}"))
        .collect();
    let yaml = format!(
        "metadata: {{name: svc1-{suffix}, namespace: ns1, labels: {{kubernetes.io/service-name: svc1}}}}\n\
         addressType: IPv4\nports: [{}]\nendpoints: [{}]\n",
        ports.join(", "),
        endpoints.join(", ")
    );
    let slice: EndpointSlice = serde_yaml::from_str(&yaml).expect("slice yaml");
    let key = ObjectKey::of(&slice.metadata).expect("slice key");
    (key, slice.into())
}

/// An endpoint with explicit conditions, on `node`, with a zone hint naming `zone` when given
/// (what tells two copies apart beyond their conditions).
fn endpoint(
    ip: &str,
    node: &str,
    (ready, serving, terminating): (bool, bool, bool),
    zone: Option<&str>,
) -> String {
    let hints = zone
        .map(|zone| format!(", hints: {{forZones: [{{name: {zone}}}]}}"))
        .unwrap_or_default();
    format!(
        "{{addresses: [{ip}], nodeName: {node}, conditions: {{ready: {ready}, serving: {serving}, \
         terminating: {terminating}}}{hints}}}"
    )
}

const READY: (bool, bool, bool) = (true, true, false);
/// A pod stuck terminating that has stopped serving: the ghost of a reused address.
const GHOST: (bool, bool, bool) = (false, false, true);
/// A terminating pod still serving (its preStop hook running, say).
const TERMINATING_SERVING: (bool, bool, bool) = (false, true, true);

/// The slices merged on [`NODE`].
fn merge(slices: &[(ObjectKey, EndpointSliceInfo)]) -> EndpointsByPort {
    merge_on(NODE, slices)
}

/// The slices merged on `node` as the snapshot merges them: in slice-name order (the store's).
fn merge_on(node: &str, slices: &[(ObjectKey, EndpointSliceInfo)]) -> EndpointsByPort {
    let mut sorted: Vec<(&ObjectKey, &EndpointSliceInfo)> =
        slices.iter().map(|(key, slice)| (key, slice)).collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut warnings = Vec::new();
    let merged = endpoints_by_port(&sorted, IpFamily::V4, node, &mut warnings);
    assert!(warnings.is_empty(), "{warnings:?}");
    merged
}

/// The nodes a reused address is seen from: the new pod's, the ghost's, and a third.
const NEW_POD_NODE: &str = "node-new";
const VIEWPOINTS: [&str; 3] = [NEW_POD_NODE, "node-old", "node-other"];

fn raw(
    ip: [u8; 4],
    port: u16,
    is_local: bool,
    (ready, serving, terminating): (bool, bool, bool),
    zone: Option<&str>,
) -> RawEndpoint {
    RawEndpoint {
        addr: IpAddr::from(ip),
        port,
        is_local,
        ready,
        serving,
        terminating,
        zone_hints: zone.map(str::to_owned).into_iter().collect(),
        node_hints: Vec::new(),
    }
}

fn port_0(merged: &EndpointsByPort) -> &[RawEndpoint] {
    merged
        .get(&("port-0".to_owned(), Protocol::Tcp))
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// kube-proxy's `TestEndpointInfoByServicePort`, case "with duplicate Endpoints, prefer
/// non-terminating" (`pkg/proxy/endpointslicecache_test.go`): one slice lists 10.0.1.1 three
/// times on this node — terminating but serving, ready, terminating and not serving — and the
/// ready copy is the endpoint. (Before, the last local copy won: the one not serving, which
/// left the Service without a usable endpoint.)
#[test]
fn with_duplicate_endpoints_the_non_terminating_copy_wins() {
    let copies = [TERMINATING_SERVING, READY, GHOST].map(|c| endpoint("10.0.1.1", NODE, c, None));
    let merged = merge(&[slice("1", &[80], &copies)]);
    assert_eq!(merged.len(), 1, "{merged:?}");
    assert_eq!(port_0(&merged), [raw([10, 0, 1, 1], 80, true, READY, None)]);
}

/// kube-proxy's `TestEndpointSliceUpdate`, case "add a slice that overlaps with existing state
/// and partial ports" (`pkg/proxy/endpointschangetracker_test.go`), with every endpoint on
/// this node as upstream's case now has them: slice 3 lists 10.0.1.1–5 for `port-0` only, so
/// 10.0.1.1–3 are in slices 1 and 3 at once (an endpoint moving between slices). Each counts
/// once per port, and `port-1` keeps only what slices 1 and 2 list.
#[test]
fn an_endpoint_in_two_slices_counts_once_per_port() {
    let on_node = |third: u8, count: u8| -> Vec<String> {
        (1..=count)
            .map(|i| endpoint(&format!("10.0.{third}.{i}"), NODE, READY, None))
            .collect()
    };
    let merged = merge(&[
        slice("1", &[80, 443], &on_node(1, 3)),
        slice("2", &[80, 443], &on_node(2, 2)),
        slice("3", &[80], &on_node(1, 5)),
    ]);
    let expected = |port: u16, addresses: &[[u8; 4]]| -> Vec<RawEndpoint> {
        addresses
            .iter()
            .map(|&ip| raw(ip, port, true, READY, None))
            .collect()
    };
    assert_eq!(
        merged.get(&("port-0".to_owned(), Protocol::Tcp)),
        Some(&expected(
            80,
            &[
                [10, 0, 1, 1],
                [10, 0, 1, 2],
                [10, 0, 1, 3],
                [10, 0, 1, 4],
                [10, 0, 1, 5],
                [10, 0, 2, 1],
                [10, 0, 2, 2],
            ]
        ))
    );
    assert_eq!(
        merged.get(&("port-1".to_owned(), Protocol::Tcp)),
        Some(&expected(
            443,
            &[
                [10, 0, 1, 1],
                [10, 0, 1, 2],
                [10, 0, 1, 3],
                [10, 0, 2, 1],
                [10, 0, 2, 2]
            ]
        ))
    );
}

/// The reported case: a slice lists the address of a pod stuck terminating and, for the new
/// pod holding it now (on another node), the same address again. On every node — the new
/// pod's, the ghost's, any other — the new pod's copy, with its hints, is the endpoint
/// whichever comes first.
#[test]
fn the_ready_copy_of_a_reused_address_wins_in_either_order_within_a_slice() {
    let ghost = endpoint("10.0.1.1", "node-old", GHOST, Some("zone-old"));
    let new = endpoint("10.0.1.1", NEW_POD_NODE, READY, Some("zone-new"));
    for node in VIEWPOINTS {
        let expected = [raw(
            [10, 0, 1, 1],
            80,
            node == NEW_POD_NODE,
            READY,
            Some("zone-new"),
        )];
        for copies in [[&ghost, &new], [&new, &ghost]] {
            let copies = copies.map(String::clone);
            let merged = merge_on(node, &[slice("1", &[80], &copies)]);
            assert_eq!(port_0(&merged), expected, "on {node}: {copies:?}");
        }
    }
}

/// The same across two slices of the Service, in both arrangements: which slice holds the
/// ghost does not matter.
#[test]
fn the_ready_copy_of_a_reused_address_wins_in_either_order_across_slices() {
    let ghost = endpoint("10.0.1.1", "node-old", GHOST, Some("zone-old"));
    let new = endpoint("10.0.1.1", NEW_POD_NODE, READY, Some("zone-new"));
    for node in VIEWPOINTS {
        let expected = [raw(
            [10, 0, 1, 1],
            80,
            node == NEW_POD_NODE,
            READY,
            Some("zone-new"),
        )];
        for (a, b) in [(&ghost, &new), (&new, &ghost)] {
            let merged = merge_on(
                node,
                &[
                    slice("a", &[80], std::slice::from_ref(a)),
                    slice("b", &[80], std::slice::from_ref(b)),
                ],
            );
            assert_eq!(
                port_0(&merged),
                expected,
                "on {node}: svc1-a: {a}, svc1-b: {b}"
            );
        }
    }
}

/// A ghost on this node does not win for being local (kube-proxy used to keep a local copy
/// over any other): the ready copy on another node is the endpoint, so the Service is served
/// (by a remote endpoint) instead of not at all.
#[test]
fn a_local_ghost_does_not_beat_a_remote_ready_copy() {
    let ghost = endpoint("10.0.1.1", NODE, GHOST, None);
    let new = endpoint("10.0.1.1", "host2", READY, None);
    for copies in [[&ghost, &new], [&new, &ghost]] {
        let copies = copies.map(String::clone);
        let merged = merge(&[slice("1", &[80], &copies)]);
        assert_eq!(
            port_0(&merged),
            [raw([10, 0, 1, 1], 80, false, READY, None)],
            "{copies:?}"
        );
    }
}

/// An endpoint moving between slices as its pod starts terminating: the slice it moves to
/// (`svc1-b`, the newer) lists it terminating, the slice it leaves still lists it ready.
/// kube-proxy does not tell the newer slice apart; it keeps the copy that is not terminating
/// until the slice left behind is updated. The same holds with the slices' names swapped.
#[test]
fn a_moving_endpoint_keeps_its_non_terminating_copy_whichever_slice_is_newer() {
    let before = endpoint("10.0.1.1", NODE, READY, None);
    let after = endpoint("10.0.1.1", NODE, TERMINATING_SERVING, None);
    for (a, b) in [(&before, &after), (&after, &before)] {
        let merged = merge(&[
            slice("a", &[80], std::slice::from_ref(a)),
            slice("b", &[80], std::slice::from_ref(b)),
        ]);
        assert_eq!(
            port_0(&merged),
            [raw([10, 0, 1, 1], 80, true, READY, None)],
            "svc1-a: {a}, svc1-b: {b}"
        );
    }
    // Once the slice left behind drops it, the current conditions are the endpoint's.
    let merged = merge(&[
        slice("a", &[80], &[]),
        slice("b", &[80], std::slice::from_ref(&after)),
    ]);
    assert_eq!(
        port_0(&merged),
        [raw([10, 0, 1, 1], 80, true, TERMINATING_SERVING, None)]
    );
}

/// Between copies the rule does not order, ours is fixed (kube-proxy's follows Go's map order
/// over the slices): of two terminating copies the first stays, of two that are not
/// terminating the last wins — slices in name order, a slice's endpoints in its order.
#[test]
fn copies_the_rule_does_not_order_are_settled_by_position() {
    let serving = endpoint("10.0.1.1", NODE, TERMINATING_SERVING, None);
    let ghost = endpoint("10.0.1.1", NODE, GHOST, None);
    for (copies, first) in [
        ([&serving, &ghost], TERMINATING_SERVING),
        ([&ghost, &serving], GHOST),
    ] {
        let copies = copies.map(String::clone);
        let merged = merge(&[slice("1", &[80], &copies)]);
        assert_eq!(
            port_0(&merged),
            [raw([10, 0, 1, 1], 80, true, first, None)],
            "{copies:?}"
        );
    }
    let not_ready = endpoint("10.0.1.1", NODE, (false, false, false), None);
    let ready = endpoint("10.0.1.1", NODE, READY, None);
    let merged = merge(&[
        slice("a", &[80], std::slice::from_ref(&ready)),
        slice("b", &[80], std::slice::from_ref(&not_ready)),
    ]);
    assert_eq!(
        port_0(&merged),
        [raw([10, 0, 1, 1], 80, true, (false, false, false), None)]
    );
}

/// The stack-formatted key orders and matches exactly as the endpoint strings kube-proxy sorts
/// by, for both families, the longest IPv6 text and every port width included.
#[test]
fn endpoint_text_orders_as_the_endpoint_strings() {
    use std::net::{IpAddr, SocketAddr};
    let addrs: Vec<IpAddr> = [
        "10.0.0.2",
        "10.0.0.10",
        "10.0.0.1",
        "9.255.255.255",
        "100.64.0.1",
        "fd00::2",
        "fd00::10",
        "fd00:0:0:0:0:0:0:a",
        "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        "::ffff:255.255.255.255",
        "2001:db8::ffff:255.255.255.255",
    ]
    .iter()
    .map(|a| a.parse().expect("address"))
    .collect();
    let endpoints: Vec<SocketAddr> = addrs
        .iter()
        .flat_map(|addr| [1, 80, 8080, 9, 65535].map(|port| SocketAddr::new(*addr, port)))
        .collect();
    for a in &endpoints {
        let text = super::EndpointText::new(*a);
        assert_eq!(text.as_bytes(), a.to_string().as_bytes(), "{a}");
        for b in &endpoints {
            assert_eq!(
                super::EndpointText::new(*a).cmp(&super::EndpointText::new(*b)),
                a.to_string().cmp(&b.to_string()),
                "{a} vs {b}"
            );
        }
    }
}
