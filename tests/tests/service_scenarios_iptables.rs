//! The shared service scenario table (tests/src/service_scenarios.rs) with `--proxy-mode
//! iptables`: kube-proxy's rules in the node namespace, real traffic from an external client
//! namespace and from the node. Needs root.

proxy_tests::service_scenario_tests!("iptables");

const MODE: &str = "iptables";

fn init() {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
}

/// Someone flushes and deletes the nat table under a running agent (as firewalld reloads do):
/// the canary chain is gone, the agent notices within a sync period and restores its rules.
#[test]
fn flushed_nat_table_is_restored() -> anyhow::Result<()> {
    use proxy_tests::{
        client::tally,
        scenario::{Scenario, cluster_addr, is_pod},
        topology::DECOY_NAME,
    };
    init();
    proxy_tests::require_root();
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    let client = s.start_serving(MODE, &["--iptables-sync-period", "2s"])?;

    let node = s.topo.node();
    node.exec("iptables", &["-w", "-t", "nat", "-F"])?;
    node.exec("iptables", &["-w", "-t", "nat", "-X"])?;
    let broken = client.run(cluster_addr(), 5)?;
    eprintln!("right after the flush: {:?}", tally(&broken));
    s.ensure(
        broken.iter().all(|a| a.backend() == Some(DECOY_NAME)),
        || format!("the flush must have removed the DNAT rules: {broken:?}"),
    )?;

    let started = std::time::Instant::now();
    s.wait_for_datapath_with(&client, cluster_addr(), "rules restored", is_pod)?;
    let restored = client.run(cluster_addr(), 20)?;
    eprintln!(
        "restored after {:?}: {:?}",
        started.elapsed(),
        tally(&restored)
    );
    s.ensure(restored.iter().all(is_pod), || {
        format!("after the resync: {restored:?}")
    })?;
    Ok(())
}
