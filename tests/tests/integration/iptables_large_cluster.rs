//! The iptables mode's periodic full sync against real iptables in a private namespace:
//! kube-proxy (1.37, and the 1.34–1.36 patch releases) rewrites every chain once an hour in a
//! small cluster but not in large-cluster mode (more endpoints than the threshold), where that
//! rewrite disrupted big nodes; there only a failure, a flushed canary or drift brings a full
//! sync. The dataplane runs in this process with a short period and a low threshold so that
//! both modes are reached with a few endpoints. Needs root.

use std::net::Ipv4Addr;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proxy_dataplane_iptables::{IptablesConfig, IptablesDataplane, SyncReport};
use proxy_model::desired::{IpFamily, ServicePortName, Snapshot};
use proxy_model::objects::{ObjectKey, Objects};

use proxy_tests::netns::{Netns, on_thread_in};

const NODE: &str = "node-a";
/// More endpoints than this is large-cluster mode.
const THRESHOLD: usize = 2;
/// The periodic full sync's period, short enough to pass between two syncs of the test.
const PERIOD: Duration = Duration::from_millis(20);

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "default".into(),
        name: name.into(),
    }
}

/// `default/web` (ClusterIP, TCP 80) with `endpoints` ready endpoints on other nodes.
fn snapshot(endpoints: u8) -> anyhow::Result<Snapshot> {
    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.10",
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}
    }))?;
    let addresses: Vec<_> = (1..=endpoints)
        .map(|i| {
            serde_json::json!({"addresses": [Ipv4Addr::new(10, 244, 1, i).to_string()],
                "nodeName": "node-b", "conditions": {"ready": true}})
        })
        .collect();
    let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web-1", "namespace": "default",
            "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": addresses,
    }))?;
    let snapshot = Snapshot::compute(
        &Objects::new(
            [(key("web"), service.into())].into(),
            [(key("web-1"), slice.into())].into(),
            None,
        ),
        NODE,
    );
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    anyhow::ensure!(errors.is_empty(), "snapshot errors: {errors:?}");
    Ok(snapshot)
}

/// The IPv4 report of one apply.
fn apply_v4(
    dataplane: &mut IptablesDataplane,
    snapshot: &Snapshot,
    changed: Option<&std::collections::BTreeSet<ServicePortName>>,
) -> anyhow::Result<SyncReport> {
    for report in dataplane.apply(snapshot, changed) {
        let report = report?;
        if report.family == IpFamily::V4 {
            return Ok(report);
        }
    }
    anyhow::bail!("no IPv4 report")
}

#[test]
fn the_periodic_full_sync_is_skipped_in_large_cluster_mode() -> anyhow::Result<()> {
    proxy_tests::require_root();
    let netns = Netns::new("iptlarge")?;
    let path = netns.path();
    let netns_name = netns.name().to_owned();
    on_thread_in(&path, move || -> anyhow::Result<()> {
        let mut dataplane = IptablesDataplane::start(IptablesConfig {
            large_cluster_threshold: THRESHOLD,
            full_sync_period: PERIOD,
            ..IptablesConfig::default()
        })?;
        let nothing = std::collections::BTreeSet::new();
        let small = snapshot(1)?;
        let large = snapshot(3)?;
        // What the agent passes when the Service's endpoints change.
        let web: std::collections::BTreeSet<ServicePortName> = small
            .family(IpFamily::V4)
            .service_ports
            .keys()
            .cloned()
            .collect();
        anyhow::ensure!(web.len() == 1, "{web:?}");

        // A small cluster: the periodic sync (nothing changed) is a full one once the period
        // has passed, rewriting the Service's chains.
        let first = apply_v4(&mut dataplane, &small, None)?;
        anyhow::ensure!(first.full && !first.large_cluster, "{first:?}");
        std::thread::sleep(PERIOD * 2);
        let periodic = apply_v4(&mut dataplane, &small, Some(&nothing))?;
        anyhow::ensure!(
            periodic.full,
            "a small cluster's periodic sync is full: {periodic:?}"
        );
        anyhow::ensure!(
            periodic.nat_rules_written == periodic.nat_rules,
            "a full sync writes every nat rule: {periodic:?}"
        );

        // Large-cluster mode: the sync that finds it is still full (the mode is the one the
        // previous sync counted, as upstream reads it); the periodic ones after it are not,
        // and leave the Service's chains as they are.
        std::thread::sleep(PERIOD * 2);
        let grown = apply_v4(&mut dataplane, &large, Some(&web))?;
        anyhow::ensure!(grown.full && grown.large_cluster, "{grown:?}");
        for _ in 0..2 {
            std::thread::sleep(PERIOD * 2);
            let periodic = apply_v4(&mut dataplane, &large, Some(&nothing))?;
            anyhow::ensure!(
                !periodic.full && periodic.large_cluster,
                "a large cluster's periodic sync is partial: {periodic:?}"
            );
            // Only the top-level chains are written; the Service's chains keep their rules.
            anyhow::ensure!(
                periodic.nat_rules_written < periodic.nat_rules,
                "a partial sync of nothing leaves the service chains alone: {periodic:?}"
            );
        }

        // A flushed canary still brings a full sync in large-cluster mode.
        let deleted = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &netns_name,
                "iptables",
                "-t",
                "mangle",
                "-X",
            ])
            .args(["KUBE-PROXY-CANARY"])
            .status()?;
        anyhow::ensure!(deleted.success(), "deleting the canary chain: {deleted}");
        anyhow::ensure!(dataplane.check_canaries(), "the flushed canary is noticed");
        let repaired = apply_v4(&mut dataplane, &large, Some(&nothing))?;
        anyhow::ensure!(
            repaired.full,
            "a flushed canary forces a full sync: {repaired:?}"
        );

        // Back to a small cluster: the next periodic sync is full again.
        std::thread::sleep(PERIOD * 2);
        let shrunk = apply_v4(&mut dataplane, &small, Some(&web))?;
        anyhow::ensure!(
            !shrunk.full && !shrunk.large_cluster,
            "the change that ends large-cluster mode is partial: {shrunk:?}"
        );
        std::thread::sleep(PERIOD * 2);
        let periodic = apply_v4(&mut dataplane, &small, Some(&nothing))?;
        anyhow::ensure!(
            periodic.full,
            "small again, the periodic full sync is back: {periodic:?}"
        );
        Ok(())
    })??;
    drop(netns);
    Ok(())
}
