//! `proxy-agent inspect explain` against a running eBPF agent, checked against real traffic:
//! what it predicts (verdict, candidate backends, kept source) is what connections from the
//! node's cgroup get. Needs root.

use std::{path::Path, process::Command};

use proxy_tests::{
    agent::agent_binary,
    client::Attempt,
    scenario::{Scenario, cluster_addr},
};

/// `proxy-agent --bpf-root R inspect explain ARGS --json` in the node's namespace (an empty
/// bpf root: iptables mode).
fn explain(netns: &Path, bpf_root: &Path, args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?)
        .arg("--bpf-root")
        .arg(bpf_root)
        .args(["inspect", "explain", "--json"])
        .args(args)
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect explain failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// The echo server name of a backend address (`10.244.<i>.2:8080` is `pod<i>`).
fn pod_name(backend: &str) -> Option<String> {
    let rest = backend.strip_prefix("10.244.")?;
    let (i, _) = rest.split_once('.')?;
    Some(format!("pod{i}"))
}

#[test]
fn explain_predicts_what_connections_from_the_node_get() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    let client = s.start_serving("ebpf", &[])?;
    let netns = s.topo.node().path();
    let bpf_root = s.agent()?.bpf_root().to_path_buf();

    let e = explain(
        &netns,
        &bpf_root,
        &["--from", "node", "--to", "10.96.0.10:80/tcp"],
    )?;
    eprintln!("explain: {e:#}");
    assert_eq!(e["verdict"], "translate", "{e}");
    let candidates: Vec<String> = e["candidates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str().and_then(pod_name))
        .collect();
    assert_eq!(candidates, ["pod1", "pod2"], "{e}");
    assert!(
        e["source"].as_str().is_some_and(|s| s.ends_with("(kept)")),
        "{e}"
    );

    // Every connection lands on a predicted candidate, with the node's own address as source
    // (nothing SNATed by the datapath: the socket connects to the backend directly).
    let attempts = client.run(cluster_addr(), 100)?;
    for attempt in &attempts {
        match attempt {
            Attempt::Ok {
                backend, client, ..
            } => {
                assert!(candidates.contains(backend), "{backend} not predicted");
                assert!(!client.ip().is_unspecified(), "the backend saw {client}");
            }
            Attempt::Err(reason) => panic!("predicted translate, got {reason}"),
        }
    }

    // A destination with no frontend: predicted untranslated.
    let none = explain(
        &netns,
        &bpf_root,
        &["--from", "pod", "--to", "10.96.0.99:80/udp"],
    )?;
    assert_eq!(none["verdict"], "pass", "{none}");

    // The readable form names the Service.
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?)
        .arg("--bpf-root")
        .arg(&bpf_root)
        .args(["inspect", "explain", "--to", "10.96.0.10:80/tcp"])
        .output()?;
    let table = String::from_utf8(output.stdout)?;
    eprintln!("{table}");
    assert!(table.contains("default/web:http"), "{table}");
    assert!(
        table.contains("candidates: 10.244.1.2:8080 10.244.2.2:8080"),
        "{table}"
    );
    Ok(())
}

#[test]
fn explain_walks_the_live_iptables_rules_as_connections_do() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    let client = s.start_serving("iptables", &[])?;
    let netns = s.topo.node().path();
    // No pins there: inspect reads the rules.
    let empty = std::env::temp_dir().join(format!("kpr-explain-none-{}", std::process::id()));

    let e = explain(
        &netns,
        &empty,
        &["--from", "node", "--to", "10.96.0.10:80/tcp"],
    )?;
    eprintln!("explain (iptables): {e:#}");
    assert_eq!(e["verdict"], "translate", "{e}");
    let candidates: Vec<String> = e["candidates"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str().and_then(pod_name))
        .collect();
    assert_eq!(candidates, ["pod1", "pod2"], "{e}");
    let walked: Vec<&str> = e["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_str())
        .collect();
    assert!(walked.contains(&"chain nat/KUBE-SERVICES"), "{walked:?}");
    for attempt in client.run(cluster_addr(), 60)? {
        match attempt {
            Attempt::Ok { backend, .. } => {
                assert!(candidates.contains(&backend), "{backend} not predicted");
            }
            Attempt::Err(reason) => panic!("predicted translate, got {reason}"),
        }
    }
    let none = explain(
        &netns,
        &empty,
        &["--from", "node", "--to", "10.96.0.99:80/tcp"],
    )?;
    assert_eq!(none["verdict"], "pass", "{none}");
    Ok(())
}
