//! New connections per endpoint in the eBPF mode (`--service-traffic-endpoints`,
//! `kubeproxy_rs_endpoint_new_connections_total{endpoint}`): counted where the datapath picks
//! the backend — the socket hooks for a node process dialling the ClusterIP, tc for a client
//! outside dialling the NodePort — each connection once, for the endpoint that answered it.
//! Needs root.

use std::{
    collections::BTreeMap,
    net::{SocketAddr, SocketAddrV4},
    time::Duration,
};

use anyhow::ensure;
use proxy_tests::{
    http::metric_sum,
    scenario::{
        BACKEND_PORT, CLUSTER_IP, NODE_PORT, Scenario, cluster_addr, http_service, http_slice,
        is_pod, pod_endpoint,
    },
    service_scenarios::ServiceSpec,
    topology::Topology,
    wait,
};

const CONNECTIONS: u32 = 12;

/// `web`'s new connections by endpoint (`pod1`, `pod2`), all frontends summed.
fn by_endpoint(exposition: &str) -> BTreeMap<&'static str, f64> {
    by_endpoint_of(exposition, "web")
}

/// Service `name`'s new connections by endpoint (`pod1`, `pod2`), all frontends summed.
fn by_endpoint_of(exposition: &str, name: &str) -> BTreeMap<&'static str, f64> {
    let name = format!("name=\"{name}\"");
    [("pod1", 1), ("pod2", 2)]
        .into_iter()
        .map(|(pod, i)| {
            let endpoint = format!("endpoint=\"{}:{BACKEND_PORT}\"", Topology::pod_ip(i));
            let labels = [name.as_str(), endpoint.as_str()];
            let count = metric_sum(
                exposition,
                "kubeproxy_rs_endpoint_new_connections_total",
                &labels,
            );
            (pod, count)
        })
        .collect()
}

#[test]
fn each_connection_counts_once_for_the_endpoint_that_answered_it() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    s.start_agent_with_args(
        "ebpf",
        &["--interfaces", "vext", "--service-traffic-endpoints"],
    )?;
    let node_port: SocketAddr = SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT).into();
    let outside = s.external_client();
    let node = s.cgroup_client();
    s.wait_for_datapath_with(&outside, node_port, "NodePort answered", is_pod)?;
    s.wait_for_datapath_with(&node, cluster_addr(), "ClusterIP answered", is_pod)?;
    // The agent reads its counters every 3 s: what the readiness traffic counted is in.
    std::thread::sleep(Duration::from_secs(4));
    let before = by_endpoint(&s.agent()?.metrics()?);
    let mut answered: BTreeMap<&'static str, f64> = [("pod1", 0.0), ("pod2", 0.0)].into();
    for (client, target) in [(&node, cluster_addr()), (&outside, node_port)] {
        for attempt in client.run(target, CONNECTIONS)? {
            let pod = match attempt.backend() {
                Some(name) if name.starts_with("pod1") => "pod1",
                Some(name) if name.starts_with("pod2") => "pod2",
                _ => anyhow::bail!("{target}: {attempt:?}"),
            };
            *answered.entry(pod).or_default() += 1.0;
        }
    }
    let agent = s.agent()?;
    let mut grown = BTreeMap::new();
    let exact = wait::try_wait_until(
        "web's endpoint counters grown by the connections each endpoint answered",
        Duration::from_secs(20),
        Duration::from_millis(500),
        || {
            let now = by_endpoint(&agent.metrics()?);
            grown = now
                .iter()
                .map(|(pod, count)| (*pod, count - before.get(pod).copied().unwrap_or(0.0)))
                .collect();
            Ok(grown == answered)
        },
    );
    ensure!(
        exact.is_ok(),
        "new connections per endpoint grew by {grown:?}, the endpoints answered {answered:?}"
    );
    Ok(())
}

/// A Service removed gives its service ids back, and the next Service takes them (the lowest
/// free ones): its endpoint counts start from zero, not from what the removed one counted
/// under the same ids, which the map writer deletes when it hands an id out again.
#[test]
fn a_service_given_a_removed_ones_ids_counts_only_its_own_connections() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    let both = [pod_endpoint(1), pod_endpoint(2)];
    s.write_web(&both)?;
    s.start_agent_with_args(
        "ebpf",
        &["--interfaces", "vext", "--service-traffic-endpoints"],
    )?;
    let node = s.cgroup_client();
    s.wait_for_datapath_with(&node, cluster_addr(), "web answered", is_pod)?;
    for attempt in node.run(cluster_addr(), CONNECTIONS)? {
        ensure!(is_pod(&attempt), "web: {attempt:?}");
    }
    let agent = s.agent()?;
    wait::try_wait_until(
        "web's connections counted",
        Duration::from_secs(20),
        Duration::from_millis(500),
        || Ok(by_endpoint(&agent.metrics()?).values().sum::<f64>() >= f64::from(CONNECTIONS)),
    )?;

    s.manifests.remove("web-svc.yaml")?;
    s.manifests.remove("web-slice.yaml")?;
    s.wait_for_datapath_with(&node, cluster_addr(), "web gone (the decoy answers)", |a| {
        !is_pod(a) && a.backend().is_some()
    })?;
    // Its ids go free when its last generation is deleted, a second (the generation grace)
    // after the removal.
    std::thread::sleep(Duration::from_secs(3));
    s.manifests.write(
        "web2-svc.yaml",
        &http_service("default", "web2", CLUSTER_IP),
    )?;
    s.manifests.write(
        "web2-slice.yaml",
        &http_slice("default", "web2-1", "web2", &both),
    )?;
    s.wait_for_datapath_with(&node, cluster_addr(), "web2 answered", is_pod)?;
    let mut answered = 0.0;
    for attempt in node.run(cluster_addr(), 5)? {
        ensure!(is_pod(&attempt), "web2: {attempt:?}");
        answered += 1.0;
    }
    // The readiness wait's connections count too: at least the ones sent here, and no more
    // than those plus the few the wait made, far below what web left under the ids.
    let agent = s.agent()?;
    let mut counted = 0.0;
    let settled = wait::try_wait_until(
        "web2's connections counted",
        Duration::from_secs(20),
        Duration::from_millis(500),
        || {
            counted = by_endpoint_of(&agent.metrics()?, "web2")
                .values()
                .sum::<f64>();
            Ok(counted >= answered)
        },
    );
    ensure!(
        settled.is_ok(),
        "web2 counted {counted} of its {answered} connections"
    );
    // Another reading, so that a late one cannot add web's counts after the check.
    std::thread::sleep(Duration::from_secs(4));
    let counted = by_endpoint_of(&agent.metrics()?, "web2")
        .values()
        .sum::<f64>();
    let web_left = by_endpoint(&agent.metrics()?).values().sum::<f64>();
    ensure!(
        counted < answered + f64::from(CONNECTIONS),
        "web2 counted {counted} connections for the {answered} it was sent (plus its readiness \
         wait's): web's counts under the same ids were not reset (web's series: {web_left})"
    );
    Ok(())
}
