//! Table-style tests of the whole desired-state function: Services + EndpointSlices (+ Node)
//! → service ports per family, with every field kube-proxy reads.

use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use super::*;
use crate::desired::{Endpoint, Protocol};

/// Builds the object view from a multi-document YAML string, as the sources would.
fn objects(yaml: &str) -> Objects {
    let mut services = BTreeMap::new();
    let mut slices = BTreeMap::new();
    let mut node = None;
    for document in serde_yaml::Deserializer::from_str(yaml) {
        let value: serde_yaml::Value = serde::Deserialize::deserialize(document).expect("yaml");
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .expect("kind")
            .to_owned();
        match kind.as_str() {
            "Service" => {
                let svc: Service = serde_yaml::from_value(value).expect("service");
                services.insert(ObjectKey::of(&svc.metadata).expect("key"), svc.into());
            }
            "EndpointSlice" => {
                let slice: EndpointSlice = serde_yaml::from_value(value).expect("slice");
                slices.insert(ObjectKey::of(&slice.metadata).expect("key"), slice.into());
            }
            "Node" => node = Some(serde_yaml::from_value::<Node>(value).expect("node").into()),
            other => panic!("unexpected kind {other}"),
        }
    }
    Objects::new(services, slices, node)
}

const NODE: &str = "node-a";

fn port<'a>(
    snapshot: &'a Snapshot,
    family: IpFamily,
    service: &str,
    port: &str,
    protocol: Protocol,
) -> &'a ServicePort {
    let (namespace, name) = service.split_once('/').expect("ns/name");
    let key = ServicePortName {
        service: ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        },
        port: port.into(),
        protocol,
    };
    snapshot
        .family(family)
        .service_ports
        .get(&key)
        .unwrap_or_else(|| panic!("no service port {key} in {family:?}"))
}

fn strings<'a>(endpoints: impl Iterator<Item = &'a Endpoint>) -> Vec<String> {
    endpoints.map(ToString::to_string).collect()
}

const WEB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, protocol: TCP}
  - {name: dns, port: 53, protocol: UDP}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-a, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports:
- {name: http, port: 8080, protocol: TCP}
- {name: dns, port: 5353, protocol: UDP}
endpoints:
- addresses: [10.244.1.2]
  nodeName: node-a
- addresses: [10.244.2.2]
  conditions: {ready: true}
  nodeName: node-b
- addresses: [10.244.3.2]
  conditions: {ready: false, serving: false}
  nodeName: node-a
"#;

#[test]
fn cluster_ip_ports_get_their_endpoints_by_port_name() {
    let snapshot = Snapshot::compute(&objects(WEB), NODE);
    assert_eq!(
        snapshot.errors().count(),
        0,
        "{:?}",
        snapshot.errors().collect::<Vec<_>>()
    );
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    assert_eq!(http.cluster_ip, IpAddr::from([10, 96, 0, 10]));
    assert_eq!(http.port, 80);
    assert_eq!(
        strings(http.endpoints.iter()),
        ["10.244.1.2:8080", "10.244.2.2:8080", "10.244.3.2:8080"]
    );
    assert_eq!(
        strings(http.cluster_endpoints()),
        ["10.244.1.2:8080", "10.244.2.2:8080"]
    );
    assert!(http.endpoints[0].is_local && !http.endpoints[1].is_local);
    let dns = port(&snapshot, IpFamily::V4, "shop/web", "dns", Protocol::Udp);
    assert_eq!(
        strings(dns.internal_endpoints()),
        ["10.244.1.2:5353", "10.244.2.2:5353"]
    );
    assert!(snapshot.v6.service_ports.is_empty());
    assert_eq!(http.name.to_string(), "shop/web:http");
}

#[test]
fn endpoints_are_sorted_by_endpoint_string_like_kube_proxy() {
    let yaml = WEB.replace("10.244.2.2", "10.244.1.11");
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    // String order: "10.244.1.11:8080" < "10.244.1.2:8080".
    assert_eq!(
        strings(http.endpoints.iter())[..2],
        ["10.244.1.11:8080", "10.244.1.2:8080"]
    );
}

#[test]
fn missing_conditions_mean_ready_and_serving() {
    let snapshot = Snapshot::compute(&objects(WEB), NODE);
    let first = &port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp).endpoints[0];
    assert!(first.ready && first.serving && !first.terminating);
}

#[test]
fn slice_ports_match_by_name_and_protocol_and_nameless_ports_are_ignored() {
    let yaml = WEB
        .replace(
            "{name: dns, port: 5353, protocol: UDP}",
            "{name: dns, port: 5353, protocol: TCP}",
        )
        .replace(
            "- {name: http, port: 8080, protocol: TCP}",
            "- {port: 8080, protocol: TCP}",
        );
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    assert!(
        port(&snapshot, IpFamily::V4, "shop/web", "dns", Protocol::Udp)
            .endpoints
            .is_empty()
    );
    assert!(
        port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp)
            .endpoints
            .is_empty()
    );
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        ["EndpointSlice shop/web-a: ports[0]: no name; ignored (kube-proxy ignores it too)"]
    );
}

const SECOND_SLICE: &str = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-b, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.2.2]
  conditions: {ready: false}
  nodeName: node-b
- addresses: [10.244.4.2]
"#;

#[test]
fn several_slices_merge_and_a_duplicate_endpoint_counts_once() {
    let yaml = format!("{WEB}---\n{SECOND_SLICE}");
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    assert_eq!(
        strings(http.endpoints.iter()),
        [
            "10.244.1.2:8080",
            "10.244.2.2:8080",
            "10.244.3.2:8080",
            "10.244.4.2:8080"
        ]
    );
    // Neither copy is terminating, so the later one (web-b's, not ready) replaces web-a's.
    assert!(!http.endpoints[1].ready);
}

#[test]
fn slices_of_another_namespace_are_not_used() {
    let yaml = WEB.replace(
        "name: web-a, namespace: shop",
        "name: web-a, namespace: other",
    );
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    assert!(
        port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp)
            .endpoints
            .is_empty()
    );
}

#[test]
fn headless_unallocated_and_external_name_services_are_skipped() {
    for replacement in [
        "clusterIP: None",
        "clusterIP: ''",
        "type: ExternalName\n  externalName: example.org",
    ] {
        let yaml = WEB.replace("clusterIP: 10.96.0.10", replacement);
        let snapshot = Snapshot::compute(&objects(&yaml), NODE);
        assert!(snapshot.v4.service_ports.is_empty(), "{replacement}");
    }
}

const LB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: edge}
spec:
  type: LoadBalancer
  clusterIP: 10.96.1.1
  clusterIPs: [10.96.1.1, 'fd00::1:1']
  ipFamilies: [IPv4, IPv6]
  externalIPs: [192.0.2.10, '2001:db8::10']
  externalTrafficPolicy: Local
  healthCheckNodePort: 30999
  loadBalancerSourceRanges: [' 203.0.113.0/24', '2001:db8:1::/48', 198.51.100.7/32]
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}
  trafficDistribution: PreferClose
  ports:
  - {name: https, port: 443, nodePort: 30443}
status:
  loadBalancer:
    ingress:
    - {ip: 198.51.100.1}
    - {ip: 198.51.100.2, ipMode: Proxy}
    - {ip: 198.51.100.3, ipMode: VIP}
    - {ip: '2001:db8::1'}
    - {hostname: lb.example.org}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-v4, namespace: edge, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: https, port: 8443}]
endpoints:
- {addresses: [10.244.1.5], nodeName: node-a}
- {addresses: [10.244.2.5], nodeName: node-b}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-v6, namespace: edge, labels: {kubernetes.io/service-name: lb}}
addressType: IPv6
ports: [{name: https, port: 8443}]
endpoints:
- {addresses: ['fd00:244::5'], nodeName: node-b}
"#;

#[test]
fn load_balancer_service_fields_per_family() {
    let snapshot = Snapshot::compute(&objects(LB), NODE);
    assert_eq!(
        snapshot.errors().count(),
        0,
        "{:?}",
        snapshot.errors().collect::<Vec<_>>()
    );
    let v4 = port(&snapshot, IpFamily::V4, "edge/lb", "https", Protocol::Tcp);
    assert_eq!(v4.node_port, Some(30443));
    assert_eq!(v4.external_ips, [IpAddr::from([192, 0, 2, 10])]);
    assert_eq!(
        v4.load_balancer_ips,
        [
            IpAddr::from([198, 51, 100, 1]),
            IpAddr::from([198, 51, 100, 3])
        ],
        "ipMode: Proxy and hostname-only ingress are not VIPs"
    );
    let ranges: Vec<String> = v4.source_ranges.iter().map(ToString::to_string).collect();
    assert_eq!(ranges, ["203.0.113.0/24", "198.51.100.7/32"]);
    assert_eq!(v4.affinity_timeout, Some(60));
    assert!(v4.external_policy_local && !v4.internal_policy_local);
    assert_eq!(v4.health_check_node_port, Some(30999));
    assert_eq!(v4.traffic_distribution.as_deref(), Some("PreferClose"));
    assert_eq!(strings(v4.external_endpoints()), ["10.244.1.5:8443"]);
    assert_eq!(
        strings(v4.internal_endpoints()),
        ["10.244.1.5:8443", "10.244.2.5:8443"]
    );

    let v6 = port(&snapshot, IpFamily::V6, "edge/lb", "https", Protocol::Tcp);
    assert_eq!(v6.cluster_ip, "fd00::1:1".parse::<IpAddr>().expect("ip"));
    assert_eq!(
        v6.external_ips,
        ["2001:db8::10".parse::<IpAddr>().expect("ip")]
    );
    assert_eq!(
        v6.load_balancer_ips,
        ["2001:db8::1".parse::<IpAddr>().expect("ip")]
    );
    assert_eq!(v6.source_ranges.len(), 1);
    assert_eq!(strings(v6.endpoints.iter()), ["[fd00:244::5]:8443"]);
    assert_eq!(v6.external_endpoints().count(), 0, "no local IPv6 endpoint");
    assert!(v6.has_any_endpoints);
}

/// Local sockets cannot be checked against `loadBalancerSourceRanges` by their own source
/// (none yet at connect()), so the socket frontends of guarded LB IPs carry the ranges and the
/// SOURCE_RANGES flag (the hooks judge host processes by the node address and leave pods' sockets
/// to the tc program on their veth); the NodePort, externalIPs and the ClusterIP stay plain.
#[test]
fn source_ranges_mark_the_socket_frontends_of_guarded_lb_ips() {
    use crate::desired::{external_frontends, socket_frontends};
    use proxy_common::frontend_flags;
    let snapshot = Snapshot::compute(&objects(LB), NODE);
    let v4 = port(&snapshot, IpFamily::V4, "edge/lb", "https", Protocol::Tcp);
    let socket: Vec<(String, bool, usize)> = socket_frontends(v4)
        .iter()
        .map(|(key, frontend)| {
            (
                key.addr.to_string(),
                frontend.flags & frontend_flags::SOURCE_RANGES != 0,
                frontend.source_ranges.len(),
            )
        })
        .collect();
    assert_eq!(
        socket,
        [
            (v4.cluster_ip.to_string(), false, 0),
            ("0.0.0.0".into(), false, 0),
            ("192.0.2.10".into(), false, 0),
            ("198.51.100.1".into(), true, 2),
            ("198.51.100.3".into(), true, 2),
        ]
    );
    let guarded: Vec<usize> = external_frontends(v4)
        .iter()
        .filter(|(key, _)| v4.load_balancer_ips.contains(&key.addr))
        .map(|(_, frontend)| frontend.source_ranges.len())
        .collect();
    assert_eq!(
        guarded,
        [2, 2],
        "each LB IP's tc frontend carries the ranges"
    );

    let open = LB.replace(
        "  loadBalancerSourceRanges: [' 203.0.113.0/24', '2001:db8:1::/48', 198.51.100.7/32]\n",
        "",
    );
    let snapshot = Snapshot::compute(&objects(&open), NODE);
    let v4 = port(&snapshot, IpFamily::V4, "edge/lb", "https", Protocol::Tcp);
    assert!(v4.source_ranges.is_empty());
    assert!(
        socket_frontends(v4)
            .iter()
            .all(|(_, frontend)| frontend.flags == 0 && frontend.source_ranges.is_empty()),
        "without ranges: ClusterIP, NodePort, externalIP and both LB IPs, all plain"
    );
}

/// Local clients dialling the NodePort, externalIPs or LB IPs of an `externalTrafficPolicy:
/// Local` Service reach every cluster endpoint (kube-proxy's KUBE-EXT "route LOCAL traffic" and
/// "pod traffic" rules jump to KUBE-SVC), while traffic from outside keeps to local endpoints.
/// The IPv6 family has only a remote endpoint: outside traffic is dropped, local clients are
/// still served.
#[test]
fn local_clients_short_circuit_external_policy_local_to_every_endpoint() {
    use crate::desired::{Scope, external_frontends, socket_frontends};
    let snapshot = Snapshot::compute(&objects(LB), NODE);
    for (family, all, outside) in [
        (
            IpFamily::V4,
            vec!["10.244.1.5:8443", "10.244.2.5:8443"],
            vec!["10.244.1.5:8443"],
        ),
        (IpFamily::V6, vec!["[fd00:244::5]:8443"], vec![]),
    ] {
        let lb = port(&snapshot, family, "edge/lb", "https", Protocol::Tcp);
        let socket = socket_frontends(lb);
        let node_port = socket
            .iter()
            .find(|(key, _)| key.addr.is_unspecified())
            .expect("a NodePort socket frontend");
        assert_eq!(
            (node_port.0.port, node_port.0.scope),
            (30443, Scope::Internal)
        );
        for (key, frontend) in &socket[1..] {
            let backends: Vec<String> = frontend.backends.iter().map(ToString::to_string).collect();
            assert_eq!(backends, all, "{family:?} {key}");
        }
        for (key, frontend) in external_frontends(lb)
            .iter()
            .filter(|(key, _)| key.addr != lb.cluster_ip)
        {
            let backends: Vec<String> = frontend.backends.iter().map(ToString::to_string).collect();
            assert_eq!(backends, outside, "{family:?} {key}");
        }
    }
}

/// `internalTrafficPolicy: Local` without a local endpoint: kube-proxy DROPs ClusterIP traffic
/// ("has no local endpoints"), with no endpoints at all it REJECTs ("has no endpoints").
#[test]
fn internal_policy_local_without_local_endpoints_drops_and_no_endpoints_rejects() {
    use crate::desired::socket_frontends;
    use proxy_common::frontend_flags;
    let yaml = WEB.replace(
        "  clusterIP: 10.96.0.10",
        "  clusterIP: 10.96.0.10\n  internalTrafficPolicy: Local",
    );
    let yaml = yaml.replace("nodeName: node-a", "nodeName: node-z");
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    assert!(http.has_any_endpoints);
    let (_, cluster_ip) = &socket_frontends(http)[0];
    assert!(cluster_ip.backends.is_empty());
    assert_eq!(cluster_ip.flags, frontend_flags::DROP_NO_BACKENDS);

    let without = WEB.split("---").next().expect("the Service").to_owned();
    let snapshot = Snapshot::compute(&objects(&without), NODE);
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    let (_, cluster_ip) = &socket_frontends(http)[0];
    assert!(cluster_ip.backends.is_empty());
    assert_eq!(cluster_ip.flags, 0, "REJECT: refused");
}

#[test]
fn external_policy_local_needs_external_access_and_health_check_needs_a_load_balancer() {
    let cluster_ip = WEB.replace(
        "  clusterIP: 10.96.0.10",
        "  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 30001",
    );
    let snapshot = Snapshot::compute(&objects(&cluster_ip), NODE);
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    assert!(
        !http.external_policy_local,
        "a plain ClusterIP Service is not externally accessible"
    );
    assert_eq!(http.health_check_node_port, None);

    let node_port = cluster_ip.replace(
        "  clusterIP: 10.96.0.10\n",
        "  clusterIP: 10.96.0.10\n  type: NodePort\n",
    );
    let snapshot = Snapshot::compute(&objects(&node_port), NODE);
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    assert!(http.external_policy_local);
    assert_eq!(
        http.health_check_node_port, None,
        "only LoadBalancer Services need health checks"
    );
}

#[test]
fn internal_traffic_policy_local_uses_local_endpoints_for_the_cluster_ip() {
    let yaml = WEB.replace(
        "  clusterIP: 10.96.0.10",
        "  clusterIP: 10.96.0.10\n  internalTrafficPolicy: Local",
    );
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    assert_eq!(strings(http.internal_endpoints()), ["10.244.1.2:8080"]);
    assert!(!http.uses_cluster_endpoints());
}

#[test]
fn default_affinity_timeout_is_three_hours() {
    let yaml = WEB.replace(
        "  clusterIP: 10.96.0.10",
        "  clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP",
    );
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    assert_eq!(
        port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp).affinity_timeout,
        Some(10_800)
    );
}

#[test]
fn zone_hints_follow_the_node_objects_zone_label() {
    let yaml = format!(
        "{}---\n{}",
        WEB.replace(
            "  nodeName: node-b",
            "  nodeName: node-b\n  hints: {forZones: [{name: z2}]}"
        )
        .replace(
            "- addresses: [10.244.1.2]\n  nodeName: node-a",
            "- addresses: [10.244.1.2]\n  nodeName: node-a\n  hints: {forZones: [{name: z1}]}"
        ),
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: z1}}\n"
    );
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    let http = port(&snapshot, IpFamily::V4, "shop/web", "http", Protocol::Tcp);
    assert_eq!(strings(http.cluster_endpoints()), ["10.244.1.2:8080"]);
}

#[test]
fn invalid_fields_are_reported_by_object_and_field_and_the_rest_is_kept() {
    let yaml = format!(
        "{WEB}---\n{}",
        r#"
apiVersion: v1
kind: Service
metadata: {name: broken, namespace: shop}
spec:
  clusterIPs: [10.96.0.20]
  externalIPs: [not-an-ip]
  loadBalancerSourceRanges: [10.0.0.0/33]
  ports:
  - {name: a, port: 70000}
  - {name: b, port: 81, protocol: QUIC}
  - {name: c, port: 82}
  - {name: d, port: 82}
"#
    );
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    let messages: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [
            r#"Service shop/broken: spec.externalIPs: invalid IP address "not-an-ip"; ignored"#,
            r#"Service shop/broken: spec.loadBalancerSourceRanges[0]: invalid CIDR "10.0.0.0/33"; ignored"#,
            "Service shop/broken: spec.ports[0].port: 70000 is outside 1-65535; port ignored",
            r#"Service shop/broken: spec.ports[1].protocol: unsupported protocol "QUIC" (TCP, UDP or SCTP); port ignored"#,
            "Service shop/broken: spec.ports[3].port: port 82/TCP is listed twice; ignoring this copy",
        ]
    );
    // The valid port of the broken Service and the whole of shop/web are still there.
    assert_eq!(snapshot.v4.service_ports.len(), 3);
    port(&snapshot, IpFamily::V4, "shop/broken", "c", Protocol::Tcp);
}

#[test]
fn an_invalid_cluster_ip_drops_the_service_with_one_error() {
    let yaml = WEB.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.300");
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    let messages: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [r#"Service shop/web: spec.clusterIP: invalid IP address "10.96.0.300"; ignored"#]
    );
    assert!(snapshot.v4.service_ports.is_empty());
}

#[test]
fn incremental_update_touches_only_the_changed_service_and_reports_what_changed() {
    let base = format!("{WEB}---\n{LB}");
    let mut objects_now = objects(&base);
    let mut snapshot = Snapshot::compute(&objects_now, NODE);
    let full = snapshot.clone();

    // Remove one endpoint of shop/web.
    let changed_yaml = base.replace(
        "- addresses: [10.244.2.2]\n  conditions: {ready: true}",
        "- addresses: [10.244.2.2]\n  conditions: {ready: false}",
    );
    objects_now = objects(&changed_yaml);
    let web = ObjectKey {
        namespace: "shop".into(),
        name: "web".into(),
    };
    let update = snapshot.update(&objects_now, NODE, Some(&BTreeSet::from([web.clone()])));
    let changed: Vec<String> = update.changed.iter().map(ToString::to_string).collect();
    assert_eq!(changed, ["shop/web:dns", "shop/web:http"]);
    assert_eq!(
        snapshot,
        Snapshot::compute(&objects_now, NODE),
        "incremental equals full"
    );
    assert_ne!(snapshot, full);

    // Deleting the Service removes its ports.
    let mut services = objects_now.services.clone();
    services.remove(&web);
    let without_web = Objects::new(services, objects_now.endpoint_slices().clone(), None);
    let update = snapshot.update(&without_web, NODE, Some(&BTreeSet::from([web])));
    assert_eq!(update.changed.len(), 2);
    assert!(
        snapshot
            .v4
            .service_ports
            .keys()
            .all(|k| &*k.service.name != "web")
    );
}

#[test]
fn a_problem_is_reported_once_not_on_every_sync() {
    let yaml = WEB.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.300");
    let objects = objects(&yaml);
    let mut snapshot = Snapshot::default();
    assert_eq!(snapshot.update(&objects, NODE, None).new_errors.len(), 1);
    assert_eq!(snapshot.update(&objects, NODE, None).new_errors.len(), 0);
}

#[test]
fn compute_is_deterministic() {
    let objects = objects(&format!("{WEB}---\n{LB}---\n{SECOND_SLICE}"));
    assert_eq!(
        Snapshot::compute(&objects, NODE),
        Snapshot::compute(&objects, NODE)
    );
}

/// misc-vectors TestUpdateEndpointsMap's key facts (its cases list results only): a service port
/// is keyed by the slice port's name and protocol (a rename makes a new key, a renumber keeps
/// it), endpoints are ordered by endpoint string, and locality follows the node name.
#[test]
fn update_endpoints_map_key_facts() {
    let yaml = |port_name: &str, port: u16| {
        format!(
            r#"
apiVersion: v1
kind: Service
metadata: {{name: ep1, namespace: ns1}}
spec:
  clusterIP: 172.30.0.1
  ports: [{{name: p11, port: 11, protocol: UDP}}, {{name: p11-2, port: 12, protocol: UDP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: ep1-1, namespace: ns1, labels: {{kubernetes.io/service-name: ep1}}}}
addressType: IPv4
ports: [{{name: {port_name}, port: {port}, protocol: UDP}}]
endpoints:
- {{addresses: [10.1.1.1]}}
- {{addresses: [10.1.1.11], nodeName: {NODE}}}
"#
        )
    };
    let p11 = |snapshot: &Snapshot| -> Vec<String> {
        strings(
            port(snapshot, IpFamily::V4, "ns1/ep1", "p11", Protocol::Udp)
                .endpoints
                .iter(),
        )
    };
    let snapshot = Snapshot::compute(&objects(&yaml("p11", 11)), NODE);
    // Case 13's order: "10.1.1.11:11" sorts before "10.1.1.1:11".
    assert_eq!(p11(&snapshot), ["10.1.1.11:11", "10.1.1.1:11"]);
    let endpoints = &port(&snapshot, IpFamily::V4, "ns1/ep1", "p11", Protocol::Udp).endpoints;
    assert!(endpoints[0].is_local && !endpoints[1].is_local);
    // Case 12, "renumber a port": same key, new port.
    let snapshot = Snapshot::compute(&objects(&yaml("p11", 22)), NODE);
    assert_eq!(p11(&snapshot), ["10.1.1.11:22", "10.1.1.1:22"]);
    // Case 11, "rename a port": the endpoints move to the other key.
    let snapshot = Snapshot::compute(&objects(&yaml("p11-2", 11)), NODE);
    assert!(p11(&snapshot).is_empty());
    let renamed = port(&snapshot, IpFamily::V4, "ns1/ep1", "p11-2", Protocol::Udp);
    assert_eq!(
        strings(renamed.endpoints.iter()),
        ["10.1.1.11:11", "10.1.1.1:11"]
    );
}

/// k8s.io/utils/net ParseIPSloppy / ParseCIDRSloppy, as kube-proxy reads Services and
/// EndpointSlices: IPv4 parts with leading zeros are decimal, and the addresses are canonical
/// afterwards. The Service is not dropped.
const SLOPPY: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: old, namespace: ns}
spec:
  type: LoadBalancer
  clusterIP: 010.096.001.001
  externalIPs: [192.000.002.010]
  loadBalancerSourceRanges: [203.000.113.000/024]
  ports:
  - {name: http, port: 80, nodePort: 30080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: old-1, namespace: ns, labels: {kubernetes.io/service-name: old}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [010.244.001.005], nodeName: node-a}
"#;

#[test]
fn leading_zeros_are_read_as_upstreams_sloppy_parsers_do() {
    let snapshot = Snapshot::compute(&objects(SLOPPY), NODE);
    assert_eq!(
        snapshot.errors().count(),
        0,
        "{:?}",
        snapshot.errors().collect::<Vec<_>>()
    );
    let v4 = port(&snapshot, IpFamily::V4, "ns/old", "http", Protocol::Tcp);
    assert_eq!(v4.cluster_ip, IpAddr::from([10, 96, 1, 1]));
    assert_eq!(v4.external_ips, [IpAddr::from([192, 0, 2, 10])]);
    let ranges: Vec<String> = v4.source_ranges.iter().map(ToString::to_string).collect();
    assert_eq!(ranges, ["203.0.113.0/24"]);
    assert_eq!(strings(v4.internal_endpoints()), ["10.244.1.5:8080"]);
}

fn key(service: &str) -> ObjectKey {
    let (namespace, name) = service.split_once('/').expect("ns/name");
    ObjectKey {
        namespace: namespace.into(),
        name: name.into(),
    }
}

/// Addresses that are never a Service's are left out of every frontend and endpoint list, in
/// both families, each reported once naming the object and field; the object's other
/// addresses are still programmed.
#[test]
fn unusable_addresses_are_never_programmed_and_the_rest_is() {
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: tenant}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20, "fd00::20"]
  externalIPs: [192.0.2.7, 127.0.0.1, "169.254.169.254", "::1", "2001:db8::7", "ff02::1"]
  ports:
  - {name: http, port: 80, protocol: TCP, nodePort: 30080}
status:
  loadBalancer:
    ingress: [{ip: 0.0.0.0}, {ip: 203.0.113.9}, {ip: "::"}, {ip: 255.255.255.255}, {ip: 224.0.0.5}, {ip: "fe80::1"}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: tenant, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.1.5]
- addresses: [169.254.169.254]
- addresses: [127.0.0.1]
"#;
    let objects = objects(yaml);
    let mut snapshot = Snapshot::default();
    let update = snapshot.update(&objects, NODE, None);
    let v4 = port(&snapshot, IpFamily::V4, "tenant/lb", "http", Protocol::Tcp);
    assert_eq!(
        v4.external_ips,
        ["192.0.2.7".parse::<IpAddr>().expect("ip")]
    );
    assert_eq!(
        v4.load_balancer_ips,
        ["203.0.113.9".parse::<IpAddr>().expect("ip")]
    );
    assert_eq!(strings(v4.endpoints.iter()), ["10.244.1.5:8080"]);
    let v6 = port(&snapshot, IpFamily::V6, "tenant/lb", "http", Protocol::Tcp);
    assert_eq!(
        v6.external_ips,
        ["2001:db8::7".parse::<IpAddr>().expect("ip")]
    );
    assert!(v6.load_balancer_ips.is_empty());
    let mut reasons: Vec<&str> = update
        .new_errors
        .iter()
        .filter_map(ServiceError::unusable_reason)
        .collect();
    reasons.sort_unstable();
    assert_eq!(
        reasons,
        [
            "broadcast",
            "link-local",
            "link-local",
            "link-local",
            "loopback",
            "loopback",
            "loopback",
            "multicast",
            "multicast",
            "unspecified",
            "unspecified",
        ]
    );
    let messages: Vec<String> = update.new_errors.iter().map(ToString::to_string).collect();
    for expected in [
        "Service tenant/lb: status.loadBalancer.ingress[].ip: 0.0.0.0 is unspecified, never a Service's address; ignored",
        "Service tenant/lb: spec.externalIPs: 169.254.169.254 is link-local, never a Service's address; ignored",
        "EndpointSlice tenant/lb-1: endpoints[1].addresses[0]: 169.254.169.254 is link-local, never a Service's endpoint; ignored",
    ] {
        assert!(
            messages.iter().any(|m| m == expected),
            "{expected} in {messages:?}"
        );
    }
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("EndpointSlice tenant/lb-1: endpoints[1]")
                && m.contains("169.254.169.254")),
        "{messages:?}"
    );
    // Reported once, not at every sync.
    assert!(snapshot.update(&objects, NODE, None).new_errors.is_empty());
}

fn claimant(name: &str, created: &str, uid: &str, external_ip: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {name}, creationTimestamp: "{created}", uid: {uid}}}
spec:
  clusterIP: 10.96.1.{octet}
  externalIPs: [{external_ip}]
  ports:
  - {{name: http, port: 80, protocol: TCP}}
"#,
        octet = name.len()
    )
}

/// Two Services naming the same external address, port and protocol: the older keeps it
/// whatever their names, the other is reported; when the owner goes, the other takes over in
/// an incremental update exactly as a full computation would.
#[test]
fn a_contested_external_ip_stays_with_the_older_service() {
    // `aaa` sorts first by name, but kube-system's Service is older.
    let yaml = claimant("kube-system", "2024-01-01T00:00:00Z", "b-uid", "192.0.2.50")
        + "---"
        + &claimant("aaa", "2025-06-01T00:00:00Z", "a-uid", "192.0.2.50");
    let objects_now = objects(&yaml);
    let mut snapshot = Snapshot::default();
    let update = snapshot.update(&objects_now, NODE, None);
    let owner = port(
        &snapshot,
        IpFamily::V4,
        "kube-system/kube-system",
        "http",
        Protocol::Tcp,
    );
    assert_eq!(
        owner.external_ips,
        ["192.0.2.50".parse::<IpAddr>().expect("ip")]
    );
    let loser = port(&snapshot, IpFamily::V4, "aaa/aaa", "http", Protocol::Tcp);
    assert!(
        loser.external_ips.is_empty(),
        "the younger Service keeps its cluster IP only"
    );
    assert_eq!(snapshot.conflicts(), 1);
    let conflicts: Vec<String> = update
        .new_errors
        .iter()
        .filter(|e| e.event().map(|(_, reason)| reason) == Some("FrontendConflict"))
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        conflicts,
        [
            "Service aaa/aaa: spec.externalIPs: 192.0.2.50 port 80/TCP belongs to Service kube-system/kube-system (its cluster IP, or its older claim); ignored here"
        ]
    );

    // The same with the document order swapped: the decision is the objects', not the order's.
    let swapped = claimant("aaa", "2025-06-01T00:00:00Z", "a-uid", "192.0.2.50")
        + "---"
        + &claimant("kube-system", "2024-01-01T00:00:00Z", "b-uid", "192.0.2.50");
    assert_eq!(Snapshot::compute(&objects(&swapped), NODE), snapshot);

    // Equal times: the smaller UID wins.
    let tie = claimant("kube-system", "2024-01-01T00:00:00Z", "b-uid", "192.0.2.50")
        + "---"
        + &claimant("aaa", "2024-01-01T00:00:00Z", "a-uid", "192.0.2.50");
    let tied = Snapshot::compute(&objects(&tie), NODE);
    assert_eq!(
        port(&tied, IpFamily::V4, "aaa/aaa", "http", Protocol::Tcp)
            .external_ips
            .len(),
        1
    );

    // The owner deleted: the other Service takes the address in the incremental update.
    let mut services = objects_now.services.clone();
    services.remove(&key("kube-system/kube-system"));
    let without_owner = Objects::new(services, objects_now.endpoint_slices().clone(), None);
    let update = snapshot.update(
        &without_owner,
        NODE,
        Some(&BTreeSet::from([key("kube-system/kube-system")])),
    );
    let changed: Vec<String> = update.changed.iter().map(ToString::to_string).collect();
    assert_eq!(changed, ["aaa/aaa:http", "kube-system/kube-system:http"]);
    assert_eq!(
        port(&snapshot, IpFamily::V4, "aaa/aaa", "http", Protocol::Tcp).external_ips,
        ["192.0.2.50".parse::<IpAddr>().expect("ip")]
    );
    assert_eq!(snapshot.conflicts(), 0);
    assert_eq!(snapshot, Snapshot::compute(&without_owner, NODE));

    // An older claimant arriving later takes the address back, again incrementally.
    let update = snapshot.update(
        &objects_now,
        NODE,
        Some(&BTreeSet::from([key("kube-system/kube-system")])),
    );
    assert!(update.changed.contains(&ServicePortName {
        service: key("aaa/aaa"),
        port: "http".into(),
        protocol: Protocol::Tcp,
    }));
    assert_eq!(snapshot, Snapshot::compute(&objects_now, NODE));
}

/// An external address that is another Service's cluster IP stays the cluster IP's, however
/// old the claimant: the API server allocated the cluster IP.
#[test]
fn a_cluster_ip_is_never_taken_by_an_external_ip() {
    let yaml = claimant("old", "2020-01-01T00:00:00Z", "a-uid", "10.96.1.5")
        + "---"
        + &claimant("newer", "2025-01-01T00:00:00Z", "b-uid", "192.0.2.9");
    let snapshot = Snapshot::compute(&objects(&yaml), NODE);
    // `newer` has cluster IP 10.96.1.5 (five letters), `old` names it as an external IP.
    let newer = port(
        &snapshot,
        IpFamily::V4,
        "newer/newer",
        "http",
        Protocol::Tcp,
    );
    assert_eq!(newer.cluster_ip, "10.96.1.5".parse::<IpAddr>().expect("ip"));
    let old = port(&snapshot, IpFamily::V4, "old/old", "http", Protocol::Tcp);
    assert!(old.external_ips.is_empty());
    assert_eq!(snapshot.conflicts(), 1);
}

/// A cluster IP allocated after another Service named it as an external IP takes it over in
/// the incremental update of the new Service alone, and gives it back when it goes.
#[test]
fn a_cluster_ip_that_comes_and_goes_moves_the_external_ip_incrementally() {
    let only_old = objects(&claimant(
        "old",
        "2020-01-01T00:00:00Z",
        "a-uid",
        "10.96.1.5",
    ));
    let both = objects(
        &(claimant("old", "2020-01-01T00:00:00Z", "a-uid", "10.96.1.5")
            + "---"
            + &claimant("newer", "2025-01-01T00:00:00Z", "b-uid", "192.0.2.9")),
    );
    let mut snapshot = Snapshot::compute(&only_old, NODE);
    let external = |snapshot: &Snapshot| {
        port(snapshot, IpFamily::V4, "old/old", "http", Protocol::Tcp)
            .external_ips
            .clone()
    };
    assert_eq!(external(&snapshot).len(), 1);
    let newer = BTreeSet::from([key("newer/newer")]);
    let update = snapshot.update(&both, NODE, Some(&newer));
    assert!(
        update
            .changed
            .iter()
            .any(|name| &*name.service.name == "old")
    );
    assert!(external(&snapshot).is_empty());
    assert_eq!(snapshot, Snapshot::compute(&both, NODE));
    snapshot.update(&only_old, NODE, Some(&newer));
    assert_eq!(external(&snapshot).len(), 1);
    assert_eq!(snapshot, Snapshot::compute(&only_old, NODE));
}

/// A full recompute walks the Services beside their computed ports and finds what changed in
/// one merge: at thousands of Services across namespaces, with problems among them, it
/// computes what one Service at a time gives.
#[test]
fn a_full_recompute_of_thousands_of_services_equals_one_service_at_a_time() {
    let services = 2149;
    let documents: Vec<String> = (0..services)
        .flat_map(|i| {
            let namespace = ["alpha", "beta", "gamma"][i % 3];
            // Every 500th an invalid cluster IP: a problem reported for that Service.
            let cluster_ip = if i % 500 == 7 {
                format!("10.96.300.{}", i % 250)
            } else {
                format!("10.96.{}.{}", i / 250, i % 250 + 1)
            };
            let node = if i % 2 == 0 { NODE } else { "node-b" };
            [
                format!(
                    "apiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}, namespace: \
                     {namespace}}}\nspec: {{clusterIP: {cluster_ip}, ports: [{{name: http, \
                     port: 80, protocol: TCP}}]}}\n"
                ),
                format!(
                    "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: \
                     svc-{i}-a, namespace: {namespace}, labels: {{kubernetes.io/service-name: \
                     svc-{i}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, \
                     protocol: TCP}}]\nendpoints:\n- addresses: [10.244.{}.{}]\n  nodeName: \
                     {node}\n- addresses: [10.245.{}.{}]\n  conditions: {{ready: false}}\n",
                    i / 250,
                    i % 250 + 1,
                    i / 250,
                    i % 250 + 1
                ),
            ]
        })
        .collect();
    let objects = objects(&documents.join("---\n"));
    let full = Snapshot::compute(&objects, NODE);
    let keys: BTreeSet<ObjectKey> = objects.services.keys().cloned().collect();
    let mut one_at_a_time = Snapshot::default();
    one_at_a_time.update(&objects, NODE, Some(&keys));
    assert_eq!(
        full.v4.service_ports.len(),
        services - services.div_ceil(500)
    );
    assert_eq!(full.errors().count(), services.div_ceil(500));
    assert_eq!(full, one_at_a_time);
}
