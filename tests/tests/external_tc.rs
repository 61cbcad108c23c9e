//! External traffic through the tc programs with the real agent: clients in the `ext`
//! namespace reach NodePorts, externalIPs and LoadBalancer IPs on the node; the echo servers
//! report which pod answered and which client address it saw. Needs root.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use proxy_tests::client::{Attempt, Client, tally};
use proxy_tests::manifests::Endpoint;
use proxy_tests::scenario::{Scenario, http_slice, pod_endpoint};
use proxy_tests::topology::Topology;

const NAMESPACE: &str = "default";
const SERVICE: &str = "web";
const NODE_PORT: u16 = 30080;
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);

fn setup(pods: usize) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = Scenario::new(pods)?;
    // The external client reaches the externalIP and LB IP through the node, as a router
    // would send them.
    for vip in [EXTERNAL_IP, LB_IP] {
        s.topo.ext().ip(&[
            "route",
            "add",
            &format!("{vip}/32"),
            "via",
            &Topology::node_ext_ip().to_string(),
        ])?;
    }
    Ok(s)
}

/// A LoadBalancer Service `web` (port 80 → 8080) with NodePort, an externalIP and an LB IP.
fn lb_service(policy: &str, source_ranges: &[&str]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE}\n  namespace: {NAMESPACE}\n\
         spec:\n  type: LoadBalancer\n  clusterIP: \"{CLUSTER_IP}\"\n  clusterIPs: [\"{CLUSTER_IP}\"]\n\
         \x20 externalTrafficPolicy: {policy}\n  externalIPs: [\"{EXTERNAL_IP}\"]\n\
         \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
         \x20   nodePort: {NODE_PORT}\n"
    );
    if !source_ranges.is_empty() {
        y.push_str("  loadBalancerSourceRanges:\n");
        for r in source_ranges {
            y.push_str(&format!("  - \"{r}\"\n"));
        }
    }
    y.push_str(&format!(
        "status:\n  loadBalancer:\n    ingress:\n    - ip: \"{LB_IP}\"\n"
    ));
    y
}

fn remote_endpoint(ip: Ipv4Addr) -> Endpoint {
    Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(ip)
    }
}

fn ext_client() -> impl Fn(&Scenario) -> Client {
    |s: &Scenario| Client::new(s.topo.ext().path()).timeout(Duration::from_millis(1500))
}

fn node_port_addr() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Topology::node_ext_ip()), NODE_PORT)
}

fn is_pod(a: &Attempt) -> bool {
    a.backend().is_some_and(|b| b.starts_with("pod"))
}

fn start(s: &mut Scenario) -> anyhow::Result<()> {
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    Ok(())
}

fn client_seen(a: &Attempt) -> Option<IpAddr> {
    match a {
        Attempt::Ok { client, .. } => Some(client.ip()),
        Attempt::Err(_) => None,
    }
}

#[test]
fn node_port_external_ip_and_lb_ip_reach_pods_with_snat() -> anyhow::Result<()> {
    let mut s = setup(2)?;
    s.manifests.write("svc.yaml", &lb_service("Cluster", &[]))?;
    s.manifests.write(
        "slice.yaml",
        &http_slice(
            NAMESPACE,
            "web-1",
            SERVICE,
            &[pod_endpoint(1), pod_endpoint(2)],
        ),
    )?;
    start(&mut s)?;
    let client = ext_client()(&s);
    let first = s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    eprintln!("first NodePort answer: {first:?}");
    for target in [
        node_port_addr(),
        SocketAddr::new(EXTERNAL_IP.into(), 80),
        SocketAddr::new(LB_IP.into(), 80),
    ] {
        let attempts = client.run(target, 20)?;
        let counts = tally(&attempts);
        eprintln!("{target}: {counts:?}");
        s.ensure(attempts.iter().all(is_pod), || {
            format!("{target}: {counts:?}")
        })?;
        s.ensure(counts.len() == 2, || {
            format!("{target}: both pods should answer: {counts:?}")
        })?;
        // eTP Cluster: the pods see the node's address (SNAT), not the client's.
        let seen: Vec<_> = attempts.iter().filter_map(client_seen).collect();
        s.ensure(
            seen.iter()
                .all(|ip| *ip == IpAddr::V4(Topology::node_ext_ip())),
            || format!("{target}: client addresses seen: {seen:?}"),
        )?;
    }
    Ok(())
}

#[test]
fn local_policy_preserves_the_client_and_drops_without_local_endpoints() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    s.manifests.write("svc.yaml", &lb_service("Local", &[]))?;
    s.manifests.write(
        "slice.yaml",
        &http_slice(NAMESPACE, "web-1", SERVICE, &[pod_endpoint(1)]),
    )?;
    start(&mut s)?;
    let client = ext_client()(&s);
    let first = s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    s.ensure(
        client_seen(&first) == Some(IpAddr::V4(Topology::ext_ip())),
        || format!("eTP Local must preserve the client address: {first:?}"),
    )?;

    // The only endpoint moves to another node: kube-proxy DROPs (no answer at all).
    s.manifests.write(
        "slice.yaml",
        &http_slice(
            NAMESPACE,
            "web-1",
            SERVICE,
            &[remote_endpoint(Topology::pod_ip(1))],
        ),
    )?;
    let dropped = s.wait_for_datapath_with(
        &client,
        node_port_addr(),
        "NodePort dropped",
        |a| matches!(a, Attempt::Err(reason) if reason.contains("TIMEOUT")),
    )?;
    eprintln!("eTP Local without local endpoints: {dropped:?}");
    Ok(())
}

#[test]
fn service_without_endpoints_is_refused() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    s.manifests.write("svc.yaml", &lb_service("Cluster", &[]))?;
    s.manifests
        .write("slice.yaml", &http_slice(NAMESPACE, "web-1", SERVICE, &[]))?;
    start(&mut s)?;
    let client = ext_client()(&s);
    for target in [node_port_addr(), SocketAddr::new(EXTERNAL_IP.into(), 80)] {
        let refused = s.wait_for_datapath_with(
            &client,
            target,
            "refused",
            |a| matches!(a, Attempt::Err(reason) if reason.contains("ECONNREFUSED")),
        )?;
        eprintln!("{target}: {refused:?}");
    }
    Ok(())
}

#[test]
fn source_ranges_drop_other_clients() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    // The client (10.10.0.2) is outside 203.0.113.0/24: the LB IP must not answer it, while
    // the NodePort (no source ranges in kube-proxy) still does.
    s.manifests
        .write("svc.yaml", &lb_service("Cluster", &["203.0.113.0/24"]))?;
    s.manifests.write(
        "slice.yaml",
        &http_slice(NAMESPACE, "web-1", SERVICE, &[pod_endpoint(1)]),
    )?;
    start(&mut s)?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    let lb = client.once(SocketAddr::new(LB_IP.into(), 80))?;
    s.ensure(
        matches!(&lb, Attempt::Err(reason) if reason.contains("TIMEOUT")),
        || format!("LB IP from outside the source ranges: {lb:?}"),
    )?;
    s.manifests
        .write("svc.yaml", &lb_service("Cluster", &["10.10.0.0/24"]))?;
    let allowed = s.wait_for_datapath_with(
        &client,
        SocketAddr::new(LB_IP.into(), 80),
        "LB IP answered inside the source ranges",
        is_pod,
    )?;
    eprintln!("inside the ranges: {allowed:?}");
    Ok(())
}
