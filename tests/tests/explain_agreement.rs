//! `inspect explain` agrees with real packets: for each client location (the node, a pod,
//! the external client) and destination (a ClusterIP, a NodePort, a Service without endpoints)
//! the test asks `explain` for the decision, then makes real connections — 1 000 in all over
//! both modes, each with its own kernel-chosen source port — and checks every outcome: the
//! answering backend is a predicted candidate, the source the backend saw is the client's
//! exactly when `explain` says it is kept, a predicted refusal is ECONNREFUSED. Needs root.
//!
//! The prediction is made once per (location, destination), not per source port: without
//! Maglev or affinity (not used here) the decision does not depend on it.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
    process::Command,
    time::Duration,
};

use proxy_tests::{
    agent::agent_binary,
    client::{Attempt, Client},
    scenario::{Scenario, cluster_addr, http_service, http_slice, pod_endpoint},
    service_scenarios::{NODE_PORT, ServiceSpec, service_yaml},
    topology::Topology,
};

/// Connections per (location, destination); five pairs per mode, two modes.
const PER_PAIR: u32 = 100;
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);

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

struct Pair {
    label: &'static str,
    from: &'static str,
    client_ip: Option<IpAddr>,
    client: Client,
    target: SocketAddr,
}

fn agreement(mode: &str) -> anyhow::Result<usize> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(3)?;
    // web: NodePort (eTP Cluster) on pods 1 and 2; pod 3 is a client that is no backend (no
    // hairpin masquerade to tell apart).
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.manifests.write("web-svc.yaml", &service_yaml(&spec))?;
    s.manifests.write(
        "web-slice.yaml",
        &http_slice(
            "default",
            "web-1",
            "web",
            &[pod_endpoint(1), pod_endpoint(2)],
        ),
    )?;
    s.manifests.write(
        "empty-svc.yaml",
        &http_service("default", "empty", EMPTY_IP),
    )?;
    s.manifests.write(
        "empty-slice.yaml",
        &http_slice("default", "empty-1", "empty", &[]),
    )?;
    // The node's route to the empty ClusterIP (iptables' nat OUTPUT comes after routing).
    s.topo.add_decoy(IpAddr::V4(EMPTY_IP), 80)?;
    let node_client = s.start_serving(mode, &[])?;
    let netns = s.topo.node().path();
    let bpf_root = if mode == "ebpf" {
        s.agent()?.bpf_root().to_path_buf()
    } else {
        std::env::temp_dir().join(format!("kpr-agreement-none-{}", std::process::id()))
    };
    let node_port = SocketAddr::from((Topology::node_ext_ip(), NODE_PORT));
    let external = s.external_client();
    s.wait_for_datapath_with(&external, node_port, "NodePort from outside", |a| {
        a.backend().is_some_and(|b| b.starts_with("pod"))
    })?;
    let pod3 = Client::new(s.topo.pod(3)?.path());
    let pod3 = if mode == "ebpf" {
        pod3.in_cgroup(s.cgroup.path())
    } else {
        pod3
    };
    let pairs = [
        Pair {
            label: "node → ClusterIP",
            from: "node",
            client_ip: None,
            client: node_client.clone(),
            target: cluster_addr(),
        },
        Pair {
            label: "pod → ClusterIP",
            from: "pod",
            client_ip: Some(IpAddr::V4(Topology::pod_ip(3))),
            client: pod3,
            target: cluster_addr(),
        },
        Pair {
            label: "external → NodePort",
            from: "external",
            client_ip: Some(IpAddr::V4(Topology::ext_ip())),
            client: external,
            target: node_port,
        },
        Pair {
            label: "node → NodePort",
            from: "node",
            client_ip: None,
            client: node_client.clone(),
            target: node_port,
        },
        Pair {
            label: "node → Service without endpoints",
            from: "node",
            client_ip: None,
            client: node_client,
            target: SocketAddr::from((EMPTY_IP, 80)),
        },
    ];
    let mut checked = 0;
    for pair in &pairs {
        let to = format!("{}/tcp", pair.target);
        let client_arg = pair.client_ip.map(|ip| ip.to_string());
        let mut args = vec!["--from", pair.from, "--to", to.as_str()];
        if let Some(ip) = &client_arg {
            args.extend(["--client", ip.as_str()]);
        }
        let e = explain(&netns, &bpf_root, &args)?;
        let verdict = e["verdict"].as_str().unwrap_or_default().to_owned();
        let candidates: Vec<String> = e["candidates"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c.as_str().and_then(pod_name))
            .collect();
        let kept = e["source"].as_str().is_some_and(|s| s.ends_with("(kept)"));
        eprintln!(
            "[{mode}] {}: {verdict} {candidates:?} kept={kept}",
            pair.label
        );
        // iptables REJECTs with ICMP errors, which the kernel rate-limits (icmp_msgs_per_sec
        // 1000, burst 50): back to back, the 51st refusal would be a timeout. Paced below it.
        let client = if verdict == "refuse" {
            pair.client.clone().interval(Duration::from_millis(25))
        } else {
            pair.client.clone()
        };
        let attempts = client.run(pair.target, PER_PAIR)?;
        for attempt in &attempts {
            match (verdict.as_str(), attempt) {
                (
                    "translate",
                    Attempt::Ok {
                        backend, client, ..
                    },
                ) => {
                    anyhow::ensure!(
                        candidates.contains(backend),
                        "[{mode}] {}: {backend} answered, explain predicted {candidates:?}",
                        pair.label
                    );
                    // Node clients: kept or masqueraded both show a node address, so only
                    // clients with an address of their own are checked.
                    if let Some(ip) = pair.client_ip {
                        anyhow::ensure!(
                            (client.ip() == ip) == kept,
                            "[{mode}] {}: the backend saw {client}, explain said kept={kept}",
                            pair.label
                        );
                    }
                }
                ("refuse", Attempt::Err(reason)) if reason == "ECONNREFUSED" => {}
                (verdict, attempt) => anyhow::bail!(
                    "[{mode}] {}: explain predicted {verdict}, the connection got {attempt:?}\n{e:#}",
                    pair.label
                ),
            }
            checked += 1;
        }
    }
    Ok(checked)
}

#[test]
fn explain_agrees_with_real_connections_in_both_modes() -> anyhow::Result<()> {
    let mut total = 0;
    for mode in ["ebpf", "iptables"] {
        total += agreement(mode)?;
    }
    eprintln!("{total} connections agreed with explain");
    assert!(total >= 1000, "{total}");
    Ok(())
}
