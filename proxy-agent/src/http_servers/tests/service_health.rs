//! Health check node ports (reference §12.2, misc-vectors TestHealthCheckNodePortWhenTerminating).

use std::{collections::BTreeSet, net::SocketAddr};

use super::*;
use crate::http_servers::service_health::{
    ServiceHealthServers, health_check_node_ports, local_ready_endpoints, service_health_body,
};
use proxy_model::desired::{IpFamily, ServicePortName};

/// ns1/svc1, LoadBalancer with eTP=Local, health check node port `hcnp`, and one slice with the
/// given endpoints (`ip, ready, serving, terminating`), all on this node.
fn service(hcnp: u16, endpoints: &[(&str, bool, bool, bool)]) -> String {
    let mut yaml = format!(
        r#"
kind: Service
metadata: {{name: svc1, namespace: ns1}}
spec:
  type: LoadBalancer
  clusterIP: 172.30.1.1
  externalTrafficPolicy: Local
  healthCheckNodePort: {hcnp}
  ports:
  - {{port: 80, targetPort: 80, protocol: TCP, nodePort: 30001}}
---
kind: EndpointSlice
metadata:
  name: svc1-1
  namespace: ns1
  labels: {{kubernetes.io/service-name: svc1}}
addressType: IPv4
ports:
- {{name: "", port: 80, protocol: TCP}}
endpoints:
"#
    );
    for (ip, ready, serving, terminating) in endpoints {
        yaml.push_str(&format!(
            "- {{addresses: [{ip}], nodeName: {NODE}, conditions: {{ready: {ready}, serving: {serving}, terminating: {terminating}}}}}\n"
        ));
    }
    yaml
}

/// Step 1 of TestHealthCheckNodePortWhenTerminating: three ready local endpoints, one not ready.
const STEP1: &[(&str, bool, bool, bool)] = &[
    ("10.0.1.1", true, true, false),
    ("10.0.1.2", true, true, false),
    ("10.0.1.3", true, true, false),
    ("10.0.1.4", false, false, false),
];

/// Step 2: serving but terminating (or not ready) only.
const STEP2: &[(&str, bool, bool, bool)] = &[
    ("10.0.1.1", false, true, false),
    ("10.0.1.2", false, true, true),
    ("10.0.1.3", false, true, true),
    ("10.0.1.4", false, false, true),
];

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

#[tokio::test]
async fn counts_local_ready_endpoints_and_answers_every_path() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let port = free_port();
    let snapshot = snapshot(&service(port, STEP1));
    services.synced(&[IpFamily::V4], &snapshot, None, Duration::from_millis(1));
    let svc = key("ns1", "svc1");
    assert_eq!(
        services.service_health().open_ports(),
        BTreeMap::from([(svc.clone(), (port, vec![loopback(port)]))])
    );

    for (method, path) in [
        ("GET", "/healthz"),
        ("GET", "/"),
        ("POST", "/anything/at/all"),
    ] {
        let reply = request(loopback(port), method, path).await;
        assert_eq!(reply.status_line, "HTTP/1.1 200 OK", "{method} {path}");
        assert_eq!(reply.header("Content-Type"), Some("application/json"));
        assert_eq!(reply.header("X-Content-Type-Options"), Some("nosniff"));
        assert_eq!(reply.header("X-Load-Balancing-Endpoint-Weight"), Some("3"));
        assert_eq!(
            reply.body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns1\",\n\t\t\"name\": \"svc1\"\n\t},\n\t\"localEndpoints\": 3,\n\t\"serviceProxyHealthy\": true\n}"
        );
        let json: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(json["localEndpoints"], 3);
    }

    // The pods start terminating: serving-terminating endpoints do not count.
    let snapshot = super::snapshot(&service(port, STEP2));
    services.synced(&[IpFamily::V4], &snapshot, None, Duration::from_millis(1));
    let reply = get(loopback(port), "/healthz").await;
    assert_eq!(reply.status_line, "HTTP/1.1 503 Service Unavailable");
    assert_eq!(reply.header("X-Load-Balancing-Endpoint-Weight"), Some("0"));
    assert_eq!(reply.body, service_health_body(&svc, 0, true));
    assert!(reply.body.contains("\"localEndpoints\": 0,"));
}

#[tokio::test]
async fn an_unhealthy_proxy_fails_every_health_check() {
    let (services, clock) = start(ProxyMode::Ebpf);
    let port = free_port();
    let snapshot = snapshot(&service(port, STEP1));
    services.synced(&[IpFamily::V4], &snapshot, None, Duration::from_millis(1));
    services.queued(IpFamily::V4);
    clock.advance(TIMEOUT);
    let reply = get(loopback(port), "/").await;
    assert_eq!(reply.status(), 503);
    assert_eq!(reply.header("X-Load-Balancing-Endpoint-Weight"), Some("3"));
    assert_eq!(
        reply.body,
        service_health_body(&key("ns1", "svc1"), 3, false)
    );
    assert!(reply.body.ends_with("\t\"serviceProxyHealthy\": false\n}"));
}

#[tokio::test]
async fn servers_follow_the_services() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let (first, second) = (free_port(), free_port());
    services.synced(
        &[IpFamily::V4],
        &snapshot(&service(first, STEP1)),
        None,
        Duration::ZERO,
    );
    assert!(is_open(loopback(first)).await);

    // The health check node port changes: the old port closes, the new one opens.
    services.synced(
        &[IpFamily::V4],
        &snapshot(&service(second, STEP1)),
        None,
        Duration::ZERO,
    );
    assert!(!is_open(loopback(first)).await);
    assert_eq!(get(loopback(second), "/").await.status(), 200);

    // The Service goes away (or stops being eTP=Local): the port closes.
    services.synced(&[IpFamily::V4], &Snapshot::default(), None, Duration::ZERO);
    assert!(!is_open(loopback(second)).await);
    assert!(services.service_health().open_ports().is_empty());
}

#[tokio::test]
async fn a_port_in_use_is_reported_and_retried_not_fatal() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = squatter.local_addr().unwrap().port();
    let snapshot = snapshot(&service(port, STEP1));
    let errors = services.service_health().sync(&snapshot, None);
    assert_eq!(errors.len(), 1);
    let message = errors[0].to_string();
    assert!(
        message.starts_with(&format!(
            "node {NODE} failed to start healthcheck \"ns1/svc1\" on port {port}: "
        )),
        "{message}"
    );
    assert!(services.service_health().open_ports().is_empty());
    // The rest of the agent carries on; the next sync retries and succeeds once the port is free.
    drop(squatter);
    services.synced(&[IpFamily::V4], &snapshot, None, Duration::ZERO);
    assert_eq!(get(loopback(port), "/").await.status(), 200);
}

/// ns1/svc1 of [`service`] and a second Service like it, ns1/svc2.
fn two_services(hcnp1: u16, eps1: &[(&str, bool, bool, bool)], hcnp2: u16) -> Snapshot {
    let second = service(hcnp2, STEP1)
        .replace("svc1", "svc2")
        .replace("172.30.1.1", "172.30.1.9")
        .replace("30001", "30002");
    snapshot(&format!("{}---\n{second}", service(hcnp1, eps1)))
}

/// The service ports of `service` in the snapshot: a sync's scope when only it changed.
fn ports_of(snapshot: &Snapshot, service: &ObjectKey) -> BTreeSet<ServicePortName> {
    snapshot
        .v4
        .of_service(service)
        .map(|port| port.name.clone())
        .collect()
}

/// A sync that names the changed service ports looks at their Services only, and ends where a
/// sync of everything would; a port that failed to open is retried by the next sync whatever
/// it names.
#[tokio::test]
async fn a_sync_of_changed_services_ends_where_a_full_one_would() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let (first, second) = (free_port(), free_port());
    let (svc1, svc2) = (key("ns1", "svc1"), key("ns1", "svc2"));
    let both = two_services(first, STEP1, second);
    services.synced(&[IpFamily::V4], &both, None, Duration::ZERO);
    assert_eq!(get(loopback(first), "/").await.status(), 200);
    assert_eq!(get(loopback(second), "/").await.status(), 200);

    // svc1's pods terminate: only its ports are in scope; svc2 keeps its server as it was.
    let terminating = two_services(first, STEP2, second);
    let scope = ports_of(&terminating, &svc1);
    services.synced(&[IpFamily::V4], &terminating, Some(&scope), Duration::ZERO);
    assert_eq!(get(loopback(first), "/").await.status(), 503);
    assert_eq!(get(loopback(second), "/").await.status(), 200);

    // svc1's health check node port moves to a port someone else holds: reported, and retried
    // by the next sync although that one changes svc2 only.
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = squatter.local_addr().unwrap().port();
    let moved = two_services(taken, STEP1, second);
    let errors = services
        .service_health()
        .sync(&moved, Some(&ports_of(&moved, &svc1)));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(!is_open(loopback(first)).await);
    drop(squatter);
    let svc2_gone = snapshot(&service(taken, STEP1));
    let scope = ports_of(&moved, &svc2);
    assert!(
        services
            .service_health()
            .sync(&svc2_gone, Some(&scope))
            .is_empty()
    );
    assert_eq!(get(loopback(taken), "/").await.status(), 200);
    assert!(!is_open(loopback(second)).await);
    assert_eq!(
        services.service_health().open_ports(),
        BTreeMap::from([(svc1.clone(), (taken, vec![loopback(taken)]))])
    );
    assert_eq!(
        health_check_node_ports(&svc2_gone),
        BTreeMap::from([(svc1, taken)])
    );
}

/// `LocalReadyEndpoints` counts distinct IPs per Service over all its ports (TestUpdateEndpointsMap
/// "ns1/ep1 with local 10.1.1.2 on p11 and p12 counts 1"), only local and ready ones.
#[test]
fn local_ready_endpoints_are_distinct_ips_per_service() {
    let yaml = format!(
        r#"
kind: Service
metadata: {{name: ep1, namespace: ns1}}
spec:
  type: LoadBalancer
  clusterIP: 172.30.1.2
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports:
  - {{name: p11, port: 11, protocol: UDP}}
  - {{name: p12, port: 12, protocol: UDP}}
---
kind: EndpointSlice
metadata:
  name: ep1-1
  namespace: ns1
  labels: {{kubernetes.io/service-name: ep1}}
addressType: IPv4
ports:
- {{name: p11, port: 11, protocol: UDP}}
- {{name: p12, port: 12, protocol: UDP}}
endpoints:
- {{addresses: [10.1.1.1], nodeName: other-node}}
- {{addresses: [10.1.1.2], nodeName: {NODE}}}
- {{addresses: [10.1.1.3], nodeName: {NODE}, conditions: {{ready: false}}}}
"#
    );
    let snapshot = snapshot(&yaml);
    let ports = health_check_node_ports(&snapshot);
    assert_eq!(ports, BTreeMap::from([(key("ns1", "ep1"), 32000)]));
    assert_eq!(
        local_ready_endpoints(&snapshot, &ports),
        BTreeMap::from([(key("ns1", "ep1"), 1)])
    );
}

#[test]
fn only_load_balancers_with_local_policy_get_a_port() {
    let cluster_policy = service(32001, STEP1).replace("externalTrafficPolicy: Local", "");
    assert!(health_check_node_ports(&snapshot(&cluster_policy)).is_empty());
    let node_port = service(32001, STEP1).replace("type: LoadBalancer", "type: NodePort");
    assert!(health_check_node_ports(&snapshot(&node_port)).is_empty());
}

#[tokio::test]
async fn close_all_closes_every_port() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let port = free_port();
    let servers = ServiceHealthServers::new(
        NODE,
        vec!["127.0.0.1".parse().unwrap()],
        Arc::clone(services.health()),
    );
    assert!(
        servers
            .sync_services(&BTreeMap::from([(key("a", "b"), port)]))
            .is_empty()
    );
    assert!(is_open(loopback(port)).await);
    servers.close_all();
    assert!(!is_open(loopback(port)).await);
}

#[tokio::test]
async fn changed_listen_addresses_move_open_ports() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let port = free_port();
    let servers = ServiceHealthServers::new(
        NODE,
        vec!["127.0.0.1".parse().unwrap()],
        Arc::clone(services.health()),
    );
    let wanted = BTreeMap::from([(key("a", "b"), port)]);
    assert!(servers.sync_services(&wanted).is_empty());
    let other = SocketAddr::from(([127, 0, 0, 2], port));
    assert!(is_open(loopback(port)).await);
    assert!(!is_open(other).await, "only the listed address");
    // The same addresses: nothing is closed.
    servers.set_listen_ips(vec!["127.0.0.1".parse().unwrap()]);
    assert!(is_open(loopback(port)).await);
    // New addresses: closed now, reopened there by the next sync.
    servers.set_listen_ips(vec!["127.0.0.2".parse().unwrap()]);
    assert!(!is_open(loopback(port)).await);
    assert!(servers.sync_services(&wanted).is_empty());
    assert!(is_open(other).await);
    assert!(!is_open(loopback(port)).await);
    let (_, bound) = servers.open_ports()[&key("a", "b")].clone();
    assert_eq!(bound, vec![other]);
}
