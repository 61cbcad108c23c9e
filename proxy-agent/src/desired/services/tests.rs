use std::net::IpAddr;

use super::*;
use crate::objects::Objects;

/// Builds the object view from a multi-document YAML string, as the manifests source would.
fn objects(yaml: &str) -> Objects {
    let mut objects = Objects::default();
    for document in serde_yaml::Deserializer::from_str(yaml) {
        let value: serde_yaml::Value = serde::Deserialize::deserialize(document).expect("yaml");
        let kind = value.get("kind").and_then(|k| k.as_str()).expect("kind");
        let key = |meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| ObjectKey {
            namespace: meta.namespace.clone().unwrap_or_else(|| "default".into()),
            name: meta.name.clone().expect("name"),
        };
        match kind {
            "Service" => {
                let svc: Service = serde_yaml::from_value(value).expect("service");
                objects.services.insert(key(&svc.metadata), svc);
            }
            "EndpointSlice" => {
                let slice: EndpointSlice = serde_yaml::from_value(value).expect("slice");
                objects.endpoint_slices.insert(key(&slice.metadata), slice);
            }
            other => panic!("unexpected kind {other}"),
        }
    }
    objects
}

fn node() -> NodeContext {
    NodeContext {
        name: "node-a".into(),
    }
}

fn frontend(ip: &str, port: u16, protocol: Protocol) -> FrontendKey {
    FrontendKey {
        addr: ip.parse().expect("ip"),
        port,
        protocol,
    }
}

fn backends(snapshot: &Snapshot, key: &FrontendKey) -> Vec<String> {
    snapshot
        .frontends
        .get(key)
        .unwrap_or_else(|| panic!("no frontend {key}"))
        .backends
        .iter()
        .map(ToString::to_string)
        .collect()
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
fn cluster_ip_gets_ready_endpoints_per_named_port() {
    let (snapshot, errors) = compute(&objects(WEB), &node());
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(snapshot.frontends.len(), 2);
    assert_eq!(
        backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)),
        ["10.244.1.2:8080", "10.244.2.2:8080"]
    );
    assert_eq!(
        backends(&snapshot, &frontend("10.96.0.10", 53, Protocol::Udp)),
        ["10.244.1.2:5353", "10.244.2.2:5353"]
    );
    let http = &snapshot.frontends[&frontend("10.96.0.10", 80, Protocol::Tcp)];
    assert_eq!(http.service_port.to_string(), "shop/web:http");
}

#[test]
fn terminating_serving_endpoints_are_used_only_when_none_is_ready() {
    let yaml = WEB
        .replace("- addresses: [10.244.1.2]\n  nodeName", "- addresses: [10.244.1.2]\n  conditions: {ready: false, serving: true, terminating: true}\n  nodeName")
        .replace("conditions: {ready: true}", "conditions: {ready: false, serving: false, terminating: true}");
    let (snapshot, _) = compute(&objects(&yaml), &node());
    assert_eq!(
        backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)),
        ["10.244.1.2:8080"]
    );
}

#[test]
fn service_without_endpoints_still_has_a_frontend_that_rejects() {
    let yaml = WEB.split("---").next().expect("service part");
    let (snapshot, errors) = compute(&objects(yaml), &node());
    assert!(errors.is_empty());
    assert!(backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)).is_empty());
}

#[test]
fn internal_traffic_policy_local_keeps_only_this_nodes_endpoints() {
    let yaml = WEB.replace(
        "  clusterIP: 10.96.0.10",
        "  clusterIP: 10.96.0.10\n  internalTrafficPolicy: Local",
    );
    let (snapshot, _) = compute(&objects(&yaml), &node());
    assert_eq!(
        backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)),
        ["10.244.1.2:8080"]
    );
}

#[test]
fn slice_ports_match_by_name_and_protocol() {
    let yaml = WEB.replace(
        "{name: dns, port: 5353, protocol: UDP}",
        "{name: dns, port: 5353, protocol: TCP}",
    );
    let (snapshot, _) = compute(&objects(&yaml), &node());
    assert!(backends(&snapshot, &frontend("10.96.0.10", 53, Protocol::Udp)).is_empty());
    assert_eq!(
        backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)).len(),
        2
    );
}

#[test]
fn endpoints_from_several_slices_merge_and_duplicates_count_once() {
    let yaml = format!(
        "{WEB}---\n{}",
        r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-b, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.1.2]
- addresses: [10.244.4.2]
"#
    );
    let (snapshot, _) = compute(&objects(&yaml), &node());
    assert_eq!(
        backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)),
        ["10.244.1.2:8080", "10.244.2.2:8080", "10.244.4.2:8080"]
    );
}

#[test]
fn slices_of_another_namespace_are_not_used() {
    let yaml = WEB.replace(
        "name: web-a, namespace: shop",
        "name: web-a, namespace: other",
    );
    let (snapshot, _) = compute(&objects(&yaml), &node());
    assert!(backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)).is_empty());
}

#[test]
fn headless_and_external_name_services_have_no_frontends() {
    let headless = WEB.replace("clusterIP: 10.96.0.10", "clusterIP: None");
    assert!(compute(&objects(&headless), &node()).0.frontends.is_empty());
    let external = WEB.replace(
        "clusterIP: 10.96.0.10",
        "type: ExternalName\n  externalName: example.org",
    );
    assert!(compute(&objects(&external), &node()).0.frontends.is_empty());
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
  clusterIPs: [10.96.0.300]
  ports:
  - {name: a, port: 70000}
  - {name: b, port: 81, protocol: QUIC}
"#
    );
    let (snapshot, errors) = compute(&objects(&yaml), &node());
    let messages: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        messages,
        [
            r#"Service shop/broken: spec.clusterIPs[0]: invalid IP address "10.96.0.300""#,
            "Service shop/broken: spec.ports[0].port: port 70000 is outside 1-65535",
            r#"Service shop/broken: spec.ports[1].protocol: unsupported protocol "QUIC" (TCP, UDP or SCTP)"#,
        ]
    );
    assert_eq!(snapshot.frontends.len(), 2, "shop/web is still programmed");
}

#[test]
fn a_frontend_claimed_twice_is_reported_and_the_first_owner_keeps_it() {
    let yaml = format!(
        "{WEB}---\n{}",
        r#"
apiVersion: v1
kind: Service
metadata: {name: zzz-copy, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80}]
"#
    );
    let (snapshot, errors) = compute(&objects(&yaml), &node());
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0]
            .to_string()
            .contains("already used by shop/web:http"),
        "{}",
        errors[0]
    );
    assert_eq!(
        backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)).len(),
        2
    );
}

#[test]
fn dual_stack_services_get_one_frontend_per_family_with_matching_endpoints() {
    let yaml = format!(
        "{}---\n{}",
        WEB.replace(
            "  clusterIP: 10.96.0.10",
            "  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, 'fd00::10']"
        ),
        r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v6, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: ['fd00:244::2']
"#
    );
    let (snapshot, errors) = compute(&objects(&yaml), &node());
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        backends(&snapshot, &frontend("fd00::10", 80, Protocol::Tcp)),
        ["[fd00:244::2]:8080"]
    );
    assert_eq!(
        backends(&snapshot, &frontend("10.96.0.10", 80, Protocol::Tcp)).len(),
        2
    );
    assert!(
        snapshot
            .frontends
            .keys()
            .all(|k| k.addr != IpAddr::from([0, 0, 0, 0])),
        "no unspecified addresses"
    );
}

#[test]
fn compute_is_deterministic() {
    let objects = objects(WEB);
    assert_eq!(compute(&objects, &node()), compute(&objects, &node()));
}
