//! `cargo xtask demo`: shows ClusterIP socket load balancing by the real agent on a throwaway
//! node (network namespaces, veth pairs, a child cgroup), then an endpoint removal.
//!
//! This binary is also its own rig helper (`demo echo ...`, `demo client ...`), so the demo
//! needs nothing but itself and the agent binary.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use clap::Parser;
use proxy_tests::client::{Attempt, tally};
use proxy_tests::scenario::{
    CLUSTER_IP, SERVICE_PORT, Scenario, cluster_addr, http_service, http_slice, pod_endpoint,
};
use proxy_tests::topology::Topology;

const NAMESPACE: &str = "demo";
const SERVICE: &str = "web";
const SLICE_FILE: &str = "web-slice.yaml";
const REQUESTS: u32 = 30;

fn main() -> anyhow::Result<()> {
    let arg1 = std::env::args().nth(1);
    if matches!(arg1.as_deref(), Some("echo" | "client")) {
        proxy_tests::helper::run(proxy_tests::helper::Cli::parse())?;
        return Ok(());
    }
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "the demo needs root (network namespaces, cgroups, eBPF): run `cargo xtask demo` as root"
        );
    }
    proxy_tests::set_helper_binary(std::env::current_exe().context("locating the demo binary")?);
    run()
}

fn run() -> anyhow::Result<()> {
    println!("== kubeproxy-rs demo: ClusterIP load balancing in the socket connect hook ==\n");
    let mut s = Scenario::new(3)?;
    println!(
        "Built a throwaway node (network namespace {}):",
        s.topo.node().name()
    );
    for i in 1..=3 {
        println!(
            "  pod{i}: {}:8080, echo server answering \"pod{i}\"",
            Topology::pod_ip(i)
        );
    }
    println!(
        "  decoy \"untranslated\" on {} itself: what an untranslated connection reaches",
        cluster_addr()
    );
    println!("  clients run in cgroup {}\n", s.cgroup.path().display());

    s.manifests.write(
        "web-svc.yaml",
        &http_service(NAMESPACE, SERVICE, CLUSTER_IP),
    )?;
    s.manifests.write(
        SLICE_FILE,
        &http_slice(
            NAMESPACE,
            "web-1",
            SERVICE,
            &[pod_endpoint(1), pod_endpoint(2), pod_endpoint(3)],
        ),
    )?;
    println!("Wrote manifests to {}:", s.manifests.path().display());
    println!("  Service {NAMESPACE}/{SERVICE} ClusterIP {CLUSTER_IP}:{SERVICE_PORT}/TCP");
    println!("  EndpointSlice web-1: pod1, pod2, pod3 on port 8080\n");

    println!(
        "Starting proxy-agent (log: {}) ...",
        s.start_agent()?.log_path().display()
    );
    s.wait_for_datapath(cluster_addr(), "answered by a pod", |a| {
        a.backend().is_some_and(|b| b.starts_with("pod"))
    })?;
    println!("Datapath programmed.\n");

    println!("Round 1: {REQUESTS} requests to {}", cluster_addr());
    let first = requests(&s)?;
    s.ensure(
        ["pod1", "pod2", "pod3"]
            .iter()
            .all(|p| first.contains_key(*p))
            && first.len() == 3,
        || format!("expected answers from exactly pod1, pod2 and pod3, got {first:?}"),
    )?;
    println!("  -> all three backends answered\n");

    println!("Removing pod3 from the EndpointSlice ...");
    s.manifests.write(
        SLICE_FILE,
        &http_slice(
            NAMESPACE,
            "web-1",
            SERVICE,
            &[pod_endpoint(1), pod_endpoint(2)],
        ),
    )?;
    // Applied once a batch of new connections no longer meets pod3.
    s.wait_for_batch(
        &s.cgroup_client(),
        cluster_addr(),
        10,
        "pod3's removal",
        |a| {
            a.backend()
                .is_some_and(|b| b.starts_with("pod") && b != "pod3")
        },
    )?;

    println!("Round 2: {REQUESTS} requests to {}", cluster_addr());
    let second = requests(&s)?;
    s.ensure(
        !second.contains_key("pod3") && second.keys().all(|k| k.starts_with("pod")),
        || format!("pod3 (or a non-pod answer) after removal: {second:?}"),
    )?;
    println!("  -> pod3 no longer receives connections\n");

    let status = s.agent()?.stop()?;
    println!("Summary:");
    println!("  round 1 (pod1..pod3): {}", summary(&first));
    println!("  round 2 (pod3 removed): {}", summary(&second));
    println!("  agent stopped with {status}; cleaning up namespaces, cgroup and files.");
    s.ensure(status.success(), || format!("agent exited with {status}"))?;
    Ok(())
}

/// Sends the requests, printing one line each; returns the per-backend tally.
fn requests(s: &Scenario) -> anyhow::Result<BTreeMap<String, usize>> {
    let attempts = s.cgroup_client().run(cluster_addr(), REQUESTS)?;
    for (n, a) in attempts.iter().enumerate() {
        match a {
            Attempt::Ok {
                backend, client, ..
            } => println!("request {:>2} -> {backend} (client {client})", n + 1),
            Attempt::Err(reason) => println!("request {:>2} -> error {reason}", n + 1),
        }
    }
    let counts = tally(&attempts);
    println!("per backend: {}", summary(&counts));
    Ok(counts)
}

fn summary(counts: &BTreeMap<String, usize>) -> String {
    counts
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}
