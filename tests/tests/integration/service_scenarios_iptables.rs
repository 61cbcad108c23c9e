//! The shared service scenario table (tests/src/service_scenarios.rs) with `--proxy-mode
//! iptables`: kube-proxy's rules in the node namespace, real traffic from an external client
//! namespace and from the node. Needs root.

proxy_tests::service_scenario_tests!("iptables");

/// Run in the default path of each mode only: the gate changes what is programmed, not how a
/// programmed frontend is served.
mod external_ips_gate {
    proxy_tests::service_scenario_tests!("iptables": external_ips_are_not_served_with_their_gate_off);
}

/// In the default path of each mode: the deletion's cleanup is the mode's own.
mod deleted_udp_services {
    proxy_tests::service_scenario_tests!("iptables":
        a_udp_sender_leaves_a_deleted_service_and_follows_its_reused_address);
}

const MODE: &str = "iptables";

fn init() {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
}

/// What an administrator's `iptables -F; iptables -X` on the mangle and nat tables does. A
/// sync may write rules between the flush and the delete (a churn keeps the agent busy), and a
/// chain still referenced cannot go ("Device or resource busy"): flushed again, a few times.
fn flush_mangle_and_nat(node: &proxy_tests::netns::Netns) -> proxy_tests::Result<()> {
    for table in ["mangle", "nat"] {
        let mut deleted = Ok(String::new());
        for _ in 0..5 {
            node.exec("iptables", &["-w", "-t", table, "-F"])?;
            deleted = node.exec("iptables", &["-w", "-t", table, "-X"]);
            if deleted.is_ok() {
                break;
            }
        }
        deleted?;
    }
    Ok(())
}

/// Someone flushes and deletes the mangle and nat tables under a running agent (as firewalld
/// reloads do): the canary chain is gone from mangle, the agent notices within a sync period
/// and restores its rules. (Upstream's ipt.Monitor watches the mangle canary only, and its
/// iptables runner resyncs by itself only hourly: a flush of nat alone waits for that.)
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
    flush_mangle_and_nat(node)?;
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

/// ipt.Monitor checks the canary on a timer of its own every sync period, whatever else is
/// syncing: with a Service changing every 300 ms (a sync every min-sync-period, so the runner's
/// periodic sync never comes) a flushed nat table is still noticed and restored.
#[test]
fn canary_is_checked_while_services_churn() -> anyhow::Result<()> {
    use std::{
        net::Ipv4Addr,
        sync::{
            Arc,
            atomic::{AtomicBool, Ordering},
        },
        time::Duration,
    };

    use proxy_tests::scenario::{Scenario, cluster_addr, http_service, is_pod};
    init();
    proxy_tests::require_root();
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    let client = s.start_serving(MODE, &["--iptables-sync-period", "3s"])?;

    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let stop = Arc::clone(&stop);
        let dir = s.manifests.path().to_owned();
        std::thread::spawn(move || {
            let mut i = 0u8;
            while !stop.load(Ordering::Relaxed) {
                let ip = Ipv4Addr::new(10, 96, 7, 10 + i % 100);
                let tmp = dir.join(".churn.yaml.tmp");
                let _ = std::fs::write(&tmp, http_service("default", "churn", ip));
                let _ = std::fs::rename(&tmp, dir.join("churn.yaml"));
                i = i.wrapping_add(1);
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    // Let the churn drive syncs for longer than a sync period before the flush: a sync
    // period is time, so this is too.
    std::thread::sleep(Duration::from_secs(4));
    let node = s.topo.node();
    flush_mangle_and_nat(node)?;
    let started = std::time::Instant::now();
    // The partial syncs the churn causes do not look at the canary: only its own timer does,
    // and it recreates the canary chains when it finds them gone.
    let mut noticed = false;
    while started.elapsed() < Duration::from_secs(10) && !noticed {
        std::thread::sleep(Duration::from_millis(250));
        noticed = node
            .exec(
                "iptables",
                &["-w", "-t", "mangle", "-S", "KUBE-PROXY-CANARY"],
            )
            .is_ok();
    }
    let restored = s.wait_for_datapath_with(&client, cluster_addr(), "rules restored", is_pod);
    stop.store(true, Ordering::Relaxed);
    let _ = churn.join();
    s.ensure(noticed, || {
        format!(
            "the flush was not noticed within 10s ({:?})",
            started.elapsed()
        )
    })?;
    restored?;
    eprintln!("restored after {:?}", started.elapsed());
    Ok(())
}
