//! The shared service scenario table (tests/src/service_scenarios.rs) with `--proxy-mode ebpf`:
//! socket-level LB for the node's own clients and the tc programs for traffic from the external
//! client namespace. Needs root.

use proxy_tests::service_scenarios as scenarios;

const MODE: &str = "ebpf";

fn init() {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
}

#[test]
fn node_port_cluster_policy() -> anyhow::Result<()> {
    init();
    Ok(scenarios::node_port_cluster_policy(MODE)?)
}

#[test]
fn node_port_local_policy_preserves_the_client() -> anyhow::Result<()> {
    init();
    Ok(scenarios::node_port_local_policy_preserves_the_client(
        MODE,
    )?)
}

#[test]
fn node_port_local_policy_without_local_endpoints_drops() -> anyhow::Result<()> {
    init();
    Ok(scenarios::node_port_local_policy_without_local_endpoints_drops(MODE)?)
}

#[test]
fn node_port_without_endpoints_is_refused() -> anyhow::Result<()> {
    init();
    Ok(scenarios::node_port_without_endpoints_is_refused(MODE)?)
}

#[test]
fn external_ip_and_load_balancer_ip_reach_pods() -> anyhow::Result<()> {
    init();
    Ok(scenarios::external_ip_and_load_balancer_ip_reach_pods(
        MODE,
    )?)
}

#[test]
fn source_ranges_admit_only_listed_clients() -> anyhow::Result<()> {
    init();
    Ok(scenarios::source_ranges_admit_only_listed_clients(MODE)?)
}

#[test]
fn node_port_to_a_pod_on_another_node() -> anyhow::Result<()> {
    init();
    Ok(scenarios::node_port_to_a_pod_on_another_node(MODE)?)
}

#[test]
fn client_ip_affinity_keeps_the_backend() -> anyhow::Result<()> {
    init();
    Ok(scenarios::client_ip_affinity_keeps_the_backend(MODE)?)
}
