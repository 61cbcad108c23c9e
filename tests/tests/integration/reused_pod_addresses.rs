//! A pod address handed out again while the pod that held it is still stuck terminating: the
//! Service's slices list the address twice, once for the ghost (terminating, neither ready nor
//! serving) and once for the new pod (ready). Whichever comes first, in one slice or across
//! two, and whichever node each is on, the new pod's copy is the endpoint: real traffic reaches
//! the pod and the health check node port counts it. Both modes; needs root.

use std::net::{SocketAddr, SocketAddrV4};

use proxy_tests::{
    client::{Attempt, tally},
    http::Response,
    manifests::Endpoint,
    scenario::{DATAPATH_TIMEOUT, HOSTNAME, NODE_PORT, Scenario, cluster_addr, http_slice},
    topology::Topology,
    wait::try_wait_until,
};

const HEALTH_CHECK_PORT: u16 = 30999;
const ATTEMPTS: u32 = 20;

/// Pod 1's address, as the ghost holding it still has it listed.
fn ghost(node: &str) -> Endpoint {
    Endpoint {
        terminating: true,
        node_name: Some(node.into()),
        ..Endpoint::not_ready(Topology::pod_ip(1))
    }
}

/// Pod 1's address for the pod that holds it now (the one answering as `pod1`).
fn new_pod(node: &str) -> Endpoint {
    Endpoint {
        node_name: Some(node.into()),
        ..Endpoint::ready(Topology::pod_ip(1))
    }
}

/// Polls the health check node port until it answers `status`; returns that answer.
fn wait_for_health(s: &Scenario, status: u16) -> anyhow::Result<Response> {
    let node = s.topo.node().path();
    let addr = SocketAddr::from(SocketAddrV4::new(
        Topology::node_ext_ip(),
        HEALTH_CHECK_PORT,
    ));
    let mut last = None;
    let waited = try_wait_until(
        &format!("health check node port {addr} → {status}"),
        DATAPATH_TIMEOUT,
        std::time::Duration::from_millis(200),
        || {
            let response = proxy_tests::http::get(&node, addr, "/");
            let done = matches!(&response, Ok(r) if r.status == status);
            last = Some(response);
            Ok(done)
        },
    );
    if let Err(e) = waited {
        return Err(s.agent_error(format!("{e}; last answer: {last:?}")).into());
    }
    Ok(last.ok_or_else(|| anyhow::anyhow!("no answer"))??)
}

fn scenario(mode: &str) -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(1)?;
    // A LoadBalancer: only its kind has a health check node port (its NodePort is tested).
    s.manifests.write(
        "web-svc.yaml",
        &proxy_tests::scenario::health_checked_web_service_yaml(HEALTH_CHECK_PORT),
    )?;

    // Seen from the ghost's node, the ghost listed first: kube-proxy used to keep it (first,
    // and local), leaving the ClusterIP without a usable endpoint. The new pod's copy (on
    // another node) is the endpoint: the ClusterIP reaches it, and this node has no local
    // endpoint to count.
    s.manifests.write(
        "web-slice.yaml",
        &http_slice(
            "default",
            "web-1",
            "web",
            &[ghost(HOSTNAME), new_pod("other-node")],
        ),
    )?;
    let client = s.start_serving(mode, &[])?;
    let attempts = client.run(cluster_addr(), ATTEMPTS)?;
    eprintln!(
        "[{mode}] ClusterIP, ghost first in the slice: {:?}",
        tally(&attempts)
    );
    s.ensure(attempts.iter().all(|a| a.backend() == Some("pod1")), || {
        format!("the new pod must answer every connection: {attempts:?}")
    })?;
    let health = wait_for_health(&s, 503)?;
    s.ensure(health.body.contains("\"localEndpoints\": 0"), || {
        format!(
            "the ghost on this node is not a local endpoint: {}",
            health.body
        )
    })?;

    // The address reused on this node, the ghost listed last, in a slice of its own (written
    // first, so that no state in between has the new pod without its ghost): kube-proxy used
    // to keep the last local copy, the ghost. The new pod's copy is the endpoint: a local,
    // ready one, so the health check node port counts it and external traffic reaches it with
    // the client's address kept.
    s.manifests.write(
        "web-slice-2.yaml",
        &http_slice("default", "web-2", "web", &[ghost(HOSTNAME)]),
    )?;
    s.manifests.write(
        "web-slice.yaml",
        &http_slice("default", "web-1", "web", &[new_pod(HOSTNAME)]),
    )?;
    let health = wait_for_health(&s, 200)?;
    eprintln!("[{mode}] health check, ghost last: {}", health.body);
    s.ensure(health.body.contains("\"localEndpoints\": 1"), || {
        format!("the new pod is the one local endpoint: {}", health.body)
    })?;
    let node_port = SocketAddr::from(SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT));
    let external = s.external_client();
    s.wait_for_datapath_with(&external, node_port, "NodePort answered by pod1", |a| {
        a.backend() == Some("pod1")
    })?;
    let attempts = external.run(node_port, ATTEMPTS)?;
    eprintln!(
        "[{mode}] NodePort eTP=Local, ghost last: {:?}",
        tally(&attempts)
    );
    for attempt in &attempts {
        let seen = match attempt {
            Attempt::Ok {
                backend, client, ..
            } if backend == "pod1" => client.ip(),
            other => return Err(s.agent_error(format!("not the new pod: {other:?}")).into()),
        };
        s.ensure(seen == std::net::IpAddr::from(Topology::ext_ip()), || {
            format!("pod1 saw {seen}: eTP=Local keeps the client's address")
        })?;
    }
    Ok(())
}

#[test]
fn the_new_pod_of_a_reused_address_is_served_not_its_ghost_ebpf() -> anyhow::Result<()> {
    scenario("ebpf")
}

#[test]
fn the_new_pod_of_a_reused_address_is_served_not_its_ghost_iptables() -> anyhow::Result<()> {
    scenario("iptables")
}
