//! `--lb-algorithm maglev` with the real agent and real packets: an agent switched from random
//! to maglev on the same pins (its Maglev map is recreated with the maglev capacity) sends UDP
//! flows from the `ext` namespace to a NodePort (the tc programs) to the backend their 5-tuple
//! hashes to, and the same tuples land on the same backends again after the whole datapath
//! state (conntrack, tables, pins) is removed with `--cleanup` and rebuilt by a new agent.
//! Random choice would keep all of 60 flows on their backends with probability 3^-60 (measured
//! with random when this test was written: 18 of 60). Before the first flow of each tuple,
//! `inspect explain --sport` must name the backend the flow then reaches (the Maglev slot of
//! its 5-tuple). Needs root.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use proxy_tests::manifests::{Protocol, SlicePort, endpoint_slice_yaml};
use proxy_tests::netns::on_thread_in;
use proxy_tests::scenario::{BACKEND_PORT, DATAPATH_TIMEOUT, Scenario, pod_endpoint};
use proxy_tests::topology::Topology;
use proxy_tests::wait::wait_until;

const NODE_PORT: u16 = 30053;
const PODS: usize = 3;
/// Client source ports of the measured flows, one flow each: below the namespace's ephemeral
/// range (32768-60999), so no socket given an ephemeral port there can hold one of them.
const FLOW_PORTS: std::ops::Range<u16> = 20_000..20_060;

fn udp_service() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: dns\n  namespace: default\n\
         spec:\n  type: NodePort\n  clusterIP: \"10.96.0.53\"\n  clusterIPs: [\"10.96.0.53\"]\n\
         \x20 ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n    targetPort: 8080\n\
         \x20   nodePort: {NODE_PORT}\n"
    )
}

fn udp_slice() -> String {
    let endpoints: Vec<_> = (1..=PODS).map(pod_endpoint).collect();
    endpoint_slice_yaml(
        "default",
        "dns-1",
        "dns",
        &[SlicePort {
            name: "dns".into(),
            port: BACKEND_PORT,
            protocol: Protocol::Udp,
        }],
        &endpoints,
    )
}

/// One datagram per source port in `ports` from the `ext` namespace to `target` (a fresh socket
/// bound to that port each time, so the 5-tuple is exactly the port's); the name of the pod
/// that answered each, `None` where nobody did within a few tries.
fn send_flows(
    netns: PathBuf,
    target: SocketAddr,
    ports: Vec<u16>,
) -> anyhow::Result<Vec<Option<String>>> {
    on_thread_in(&netns, move || -> anyhow::Result<Vec<Option<String>>> {
        let mut answers = Vec::with_capacity(ports.len());
        for port in ports {
            let sock = UdpSocket::bind(("0.0.0.0", port))?;
            sock.connect(target)?;
            sock.set_read_timeout(Some(Duration::from_millis(300)))?;
            let mut answer = None;
            // A lost datagram (the first of a flow may race an ARP resolution) is retried on
            // the same tuple, so the flow and its backend stay the same.
            for _ in 0..3 {
                sock.send(b"x")?;
                let mut buf = [0u8; 256];
                if let Ok(n) = sock.recv(&mut buf) {
                    let text = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
                    answer = text.split_whitespace().next().map(str::to_owned);
                    break;
                }
            }
            answers.push(answer);
        }
        Ok(answers)
    })?
}

/// Waits (bounded) until a probe flow (its own source port) gets an answer from a pod.
fn wait_for_datapath(s: &Scenario, target: SocketAddr, probe_port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + DATAPATH_TIMEOUT;
    loop {
        let answer = send_flows(s.topo.ext().path(), target, vec![probe_port])?;
        if answer
            .first()
            .is_some_and(|a| a.as_deref().is_some_and(|n| n.starts_with("pod")))
        {
            return Ok(());
        }
        s.ensure(Instant::now() < deadline, || {
            format!("no pod answered {target} within {DATAPATH_TIMEOUT:?}: {answer:?}")
        })?;
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `inspect explain --sport P` for each source port of the `ext` client: the pod (`pod<i>`)
/// it names as chosen.
fn predict(s: &mut Scenario, target: SocketAddr, ports: &[u16]) -> anyhow::Result<Vec<String>> {
    let bpf_root = s.agent()?.bpf_root().to_path_buf();
    let netns = s.topo.node().path();
    let mut chosen = Vec::with_capacity(ports.len());
    for port in ports {
        let output = std::process::Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .arg(proxy_tests::agent::agent_binary()?)
            .arg("--bpf-root")
            .arg(&bpf_root)
            .args(["inspect", "explain", "--json", "--from", "external"])
            .args(["--client", &Topology::ext_ip().to_string()])
            .args([
                "--to",
                &format!("{target}/udp"),
                "--sport",
                &port.to_string(),
            ])
            .output()?;
        anyhow::ensure!(
            output.status.success(),
            "inspect explain: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let e: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        let backend: SocketAddr = e["chosen"]
            .as_str()
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("explain named no backend for port {port}: {e}"))?;
        let IpAddr::V4(ip) = backend.ip() else {
            anyhow::bail!("not a pod address: {backend}");
        };
        chosen.push(format!("pod{}", ip.octets()[2]));
    }
    Ok(chosen)
}

fn tally(answers: &[Option<String>]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for answer in answers {
        let name = answer.clone().unwrap_or_else(|| "(none)".to_owned());
        *counts.entry(name).or_insert(0) += 1;
    }
    counts
}

#[test]
fn maglev_node_port_flows_keep_their_backend_across_a_datapath_rebuild() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(PODS)?;
    s.manifests.write("svc.yaml", &udp_service())?;
    s.manifests.write("slice.yaml", &udp_slice())?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    let target = SocketAddr::new(IpAddr::V4(Topology::node_ext_ip()), NODE_PORT);
    let ports: Vec<u16> = FLOW_PORTS.collect();
    wait_for_datapath(&s, target, 19_997)?;

    // Random → maglev on the same pins.
    let agent = s.agent()?;
    let maglev_pin = agent
        .bpf_root()
        .join(proxy_dataplane_ebpf::PIN_DIR_NAME)
        .join(proxy_common::map_names::MAGLEV);
    let capacity =
        |pin: &std::path::Path| aya::maps::MapInfo::from_pin(pin).map(|info| info.max_entries());
    // Random never uses the Maglev map: it is created with one entry.
    let random_capacity = capacity(&maglev_pin)?;
    agent.stop()?;
    agent.restart_with_args(&["--interfaces", "vext", "--lb-algorithm", "maglev"])?;
    // The old programs stay attached meanwhile: wait for the new agent's first sync.
    let agent = s.agent()?;
    wait_until(
        "the restarted agent's first sync",
        DATAPATH_TIMEOUT,
        Duration::from_millis(100),
        || agent.syncs() >= 1,
    )?;
    let maglev_capacity = capacity(&maglev_pin)?;
    eprintln!("KPR_MAGLEV capacity: {random_capacity} (random) → {maglev_capacity} (maglev)");
    s.ensure(
        random_capacity == 1 && maglev_capacity == proxy_common::default_sizes::MAGLEV,
        || "the Maglev map should be recreated with its capacity for maglev".into(),
    )?;
    wait_for_datapath(&s, target, 19_999)?;
    // `inspect explain` names each tuple's backend before any packet of it: the Maglev slot
    // of the full 5-tuple (`--sport`).
    let predicted = predict(&mut s, target, &ports)?;
    let first = send_flows(s.topo.ext().path(), target, ports.clone())?;
    let counts = tally(&first);
    eprintln!("first round, flows per pod: {counts:?}");
    let wrong: Vec<(u16, &Option<String>, &String)> = ports
        .iter()
        .zip(&first)
        .zip(&predicted)
        .filter(|((_, answer), chosen)| answer.as_ref() != Some(*chosen))
        .map(|((port, answer), chosen)| (*port, answer, chosen))
        .collect();
    s.ensure(wrong.is_empty(), || {
        format!("(source port, answered, explain's Maglev choice) that differ: {wrong:?}")
    })?;
    s.ensure(
        first
            .iter()
            .all(|a| a.as_deref().is_some_and(|n| n.starts_with("pod"))),
        || format!("every flow should reach a pod: {counts:?}"),
    )?;
    s.ensure(counts.len() == PODS, || {
        format!("the flows should spread over all {PODS} pods: {counts:?}")
    })?;

    // Remove every trace of the datapath (conntrack, tables, links), then start over: new
    // decisions for the same tuples.
    let agent = s.agent()?;
    agent.stop()?;
    let status = agent.run_cleanup()?;
    s.ensure(status.success(), || format!("--cleanup failed: {status}"))?;
    s.agent()?.restart()?;
    wait_for_datapath(&s, target, 19_998)?;
    let second = send_flows(s.topo.ext().path(), target, ports)?;
    let same = first.iter().zip(&second).filter(|(a, b)| a == b).count();
    eprintln!(
        "after --cleanup and a new agent: {same} of {} flows on the same pod; per pod {:?}",
        first.len(),
        tally(&second)
    );
    s.ensure(same == first.len(), || {
        format!("maglev: every flow should keep its pod: {first:?} → {second:?}")
    })?;
    Ok(())
}
