//! Issue 16 (first transition): established TCP connections survive the node moving from
//! kube-proxy-shaped iptables rules (our iptables mode stands in for kube-proxy: its rules are
//! kube-proxy's, checked by the parity vectors) to the eBPF mode. Needs root.
//!
//! Why it holds: the kernel's conntrack keeps the NAT of every connection the rules set up, and
//! an established connection needs no rule, only its conntrack entry. The eBPF mode's tc
//! programs start a TCP flow only on a SYN and hand any other segment without an entry of
//! theirs to the stack unchanged (`tc_midstream_passed`), and the socket hooks only act at
//! connect time, so connections made before the takeover keep the kernel's translation while
//! every new one gets the eBPF mode's.

use std::net::{SocketAddr, SocketAddrV4};
use std::time::Duration;

use proxy_tests::RigError;
use proxy_tests::client::{Attempt, Mode, tally};
use proxy_tests::scenario::{Scenario, cluster_addr, is_pod, pod_endpoint};
use proxy_tests::service_scenarios::ServiceSpec;
use proxy_tests::topology::Topology;
use proxy_tests::wait::try_wait_until;

const NODE_PORT: u16 = 30080;

fn node_port_addr() -> SocketAddr {
    SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT).into()
}

/// 10 TCP streams from outside through the NodePort and 4 from a node process to the
/// ClusterIP, opened under the iptables mode, run while that agent stops and an eBPF-mode agent
/// takes the node over and removes the iptables rules after its first sync, all while the
/// streams run. Every stream
/// keeps its one connection and is answered throughout (goal of the issue: 0 resets, 0 stalls),
/// new connections made after the takeover are answered by the pods, and the iptables rules are
/// gone.
#[test]
fn established_tcp_connections_survive_the_takeover_from_iptables_rules() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    s.start_agent_with_args("iptables", &[])?;
    let outside = s.external_client();
    let node = s.cgroup_client();
    s.wait_for_datapath_with(&outside, node_port_addr(), "NodePort answered", is_pod)?;
    s.wait_for_datapath_with(&node, cluster_addr(), "ClusterIP answered", is_pod)?;

    // 100 exchanges 100 ms apart: about 10 s per stream, across the whole takeover (an eBPF
    // agent start takes 2-4 s on a loaded machine).
    let streams: Vec<_> = (0..14)
        .map(|i| {
            let (client, target) = if i < 10 {
                (outside.clone(), node_port_addr())
            } else {
                (node.clone(), cluster_addr())
            };
            let client = client
                .mode(Mode::TcpStream)
                .interval(Duration::from_millis(100))
                .timeout(Duration::from_millis(1000));
            std::thread::spawn(move || client.run(target, 100))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    s.stop_agent()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    // The eBPF mode translates new connections: its socket hooks for the node's, its tc
    // program for the outside's (the iptables rules go after its first sync).
    let fresh_node = s.wait_for_batch(
        &node,
        cluster_addr(),
        6,
        "new ClusterIP connections",
        is_pod,
    )?;
    let fresh_outside = s.wait_for_batch(
        &outside,
        node_port_addr(),
        6,
        "new NodePort connections",
        is_pod,
    )?;

    // The iptables rules go after the eBPF mode's first sync.
    try_wait_until(
        "the iptables mode's rules removed",
        Duration::from_secs(5),
        Duration::from_millis(50),
        || {
            Ok(!s
                .topo
                .node()
                .exec("iptables-save", &["-t", "nat"])?
                .contains("KUBE-SERVICES"))
        },
    )?;
    let running = streams.iter().filter(|t| !t.is_finished()).count();
    s.ensure(running == streams.len(), || {
        format!(
            "the takeover must complete while the streams run: only {running} of {} still ran",
            streams.len()
        )
    })?;
    let mut broken = Vec::new();
    for (i, stream) in streams.into_iter().enumerate() {
        let attempts = stream
            .join()
            .map_err(|_| RigError::Other(format!("stream {i}: client thread panicked")))??;
        let counts = tally(&attempts);
        eprintln!("stream {i} across the takeover: {counts:?}");
        let kept = counts.len() == 1
            && attempts.iter().all(|a| {
                matches!(a, Attempt::Ok { .. }) && a.backend().is_some_and(|b| b.ends_with("#1"))
            });
        if !kept {
            broken.push((i, counts));
        }
    }
    eprintln!(
        "takeover: {} of 14 streams broken; new connections: node {:?}, outside {:?}",
        broken.len(),
        tally(&fresh_node),
        tally(&fresh_outside)
    );
    s.ensure(broken.is_empty(), || {
        format!("every stream keeps its one connection, answered throughout: broken {broken:?}")
    })?;
    Ok(())
}

/// The other direction: 10 TCP streams from outside through the NodePort and 4 from a node
/// process to the ClusterIP, opened under the eBPF mode, run while that agent stops and an
/// iptables-mode agent takes the node over. The eBPF mode's programs carry the streams they
/// know until they end (`--mode-switch-drain-period`, 60 s here), new connections meet the
/// iptables rules at once, and the programs and maps are removed once no flow of theirs is
/// live (the streams' entries idle out 10 s after their FIN), well before the period.
#[test]
fn established_tcp_connections_survive_the_hand_back_to_iptables_rules() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    let bpf_root = s.agent()?.bpf_root().to_path_buf();
    let pin_dir = bpf_root.join("kubeproxy-rs");
    let outside = s.external_client();
    let node = s.cgroup_client();
    s.wait_for_datapath_with(&outside, node_port_addr(), "NodePort answered", is_pod)?;
    s.wait_for_datapath_with(&node, cluster_addr(), "ClusterIP answered", is_pod)?;

    let streams: Vec<_> = (0..14)
        .map(|i| {
            let (client, target) = if i < 10 {
                (outside.clone(), node_port_addr())
            } else {
                (node.clone(), cluster_addr())
            };
            let client = client
                .mode(Mode::TcpStream)
                .interval(Duration::from_millis(100))
                .timeout(Duration::from_millis(1000));
            std::thread::spawn(move || client.run(target, 60))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    // The same agent (its bpffs root, where the eBPF mode's pins are) restarted in the other
    // mode, as a DaemonSet's new pod would be on the host's /sys/fs/bpf.
    let agent = s.agent()?;
    agent.stop()?;
    agent.restart_in_mode_with_args("iptables", &["--mode-switch-drain-period", "60s"])?;
    // New connections are the iptables rules' while the eBPF programs drain.
    try_wait_until(
        "the iptables mode's rules",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            Ok(s.topo
                .node()
                .exec("iptables-save", &["-t", "nat"])?
                .contains("KUBE-SERVICES"))
        },
    )
    .map_err(|e| s.agent_error(e.to_string()))?;
    let fresh_node = s.wait_for_batch(
        &node,
        cluster_addr(),
        6,
        "new ClusterIP connections",
        is_pod,
    )?;
    let fresh_outside = s.wait_for_batch(
        &outside,
        node_port_addr(),
        6,
        "new NodePort connections",
        is_pod,
    )?;
    s.ensure(pin_dir.exists(), || {
        "the eBPF mode's pins stay while its streams run".into()
    })?;

    let mut broken = Vec::new();
    for (i, stream) in streams.into_iter().enumerate() {
        let attempts = stream
            .join()
            .map_err(|_| RigError::Other(format!("stream {i}: client thread panicked")))??;
        let counts = tally(&attempts);
        eprintln!("stream {i} across the hand-back: {counts:?}");
        let kept = counts.len() == 1
            && attempts.iter().all(|a| {
                matches!(a, Attempt::Ok { .. }) && a.backend().is_some_and(|b| b.ends_with("#1"))
            });
        if !kept {
            broken.push((i, counts));
        }
    }
    eprintln!(
        "hand-back: {} of 14 streams broken; new connections: node {:?}, outside {:?}",
        broken.len(),
        tally(&fresh_node),
        tally(&fresh_outside)
    );
    s.ensure(broken.is_empty(), || {
        format!("every stream keeps its one connection, answered throughout: broken {broken:?}")
    })?;
    // Drained: the last streams' entries idle out 10 s after their FIN (polled every second).
    let drained = std::time::Instant::now();
    try_wait_until(
        "the eBPF mode's pins removed once its flows drained",
        Duration::from_secs(25),
        Duration::from_millis(200),
        || Ok(!pin_dir.exists()),
    )
    .map_err(|e| s.agent_error(e.to_string()))?;
    eprintln!(
        "pins removed {:?} after the streams ended",
        drained.elapsed()
    );
    Ok(())
}
