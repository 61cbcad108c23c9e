//! `--tc-fast-path=auto` (the default) with real packets: an external client reaches a NodePort
//! whose only endpoint is a pod on a second node, so every packet crosses the node's FORWARD.
//!
//! - The node namespace's forward chains are empty: the agent takes the fast path, and XDP
//!   (`--bpf-xdp auto`) serves the flows, which its counters show. A `FORWARD -j DROP` added
//!   while XDP serves (iptables-nft, announced over nfnetlink) sends external traffic back to
//!   the netfilter path within a second: the client's next connection is dropped, and the
//!   node config's flag (`inspect explain`), the metric and `inspect features` show the
//!   netfilter path and the rule. Once the rule is gone,
//!   XDP takes the flows again.
//! - A CNI's conditional ACCEPT (flannel's) in FORWARD at start: the netfilter path from the
//!   first packet, no XDP attached.
//! - A drop in iptables-legacy's FORWARD, which sends no notification, is found by the poll.
//!
//! The rules are added inside the rig's node namespace only (iptables state is per
//! namespace), which the rig deletes with everything in it. Needs root.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use proxy_common::StatIndex;
use proxy_tests::agent::agent_binary;
use proxy_tests::client::{Attempt, Client, Proto};
use proxy_tests::manifests::{Endpoint, endpoint_slice_yaml};
use proxy_tests::scenario::{BACKEND_PORT, Scenario, http_and_dns_slice_ports};
use proxy_tests::topology::{Place, Topology};

const NODE_PORT: u16 = 30080;
/// How long the switch to the netfilter path may take once a FORWARD drop is added (the
/// issue's bound).
const SWITCH_BOUND: Duration = Duration::from_secs(1);
/// Connection attempts per check.
const ATTEMPTS: u32 = 5;

fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::with_families(1, false)?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    s.manifests.write(
        "svc.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\n\
             spec:\n  type: NodePort\n  clusterIP: \"10.96.0.20\"\n\
             \x20 externalTrafficPolicy: Cluster\n\
             \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
             \x20   nodePort: {NODE_PORT}\n  - name: dns\n    port: 53\n    protocol: UDP\n\
             \x20   targetPort: 8080\n    nodePort: 30053\n"
        ),
    )?;
    let remote = Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(Topology::remote_pod_addr(1, false))
    };
    s.manifests.write(
        "web-4.yaml",
        &endpoint_slice_yaml(
            "default",
            "web-4",
            "web",
            &http_and_dns_slice_ports(),
            &[remote],
        ),
    )?;
    // Wire-like traffic (complete checksums, NAPI on the veths), which XDP takes.
    for place in [Place::Ext, Place::RemoteNode] {
        s.topo
            .netns(place)?
            .exec("ethtool", &["-K", "eth0", "tx", "off", "gro", "on"])?;
    }
    Ok(s)
}

fn target() -> SocketAddr {
    SocketAddr::new(IpAddr::from(Topology::node_ext_ip()), NODE_PORT)
}

fn client(s: &Scenario, timeout: Duration) -> Client {
    Client::new(s.topo.ext().path())
        .proto(Proto::Tcp)
        .timeout(timeout)
}

fn is_remote(attempt: &Attempt) -> bool {
    attempt.backend() == Some("rpod1")
}

/// `ATTEMPTS` connections from the external client, every one answered by the remote pod.
fn serve(s: &mut Scenario) -> anyhow::Result<()> {
    let client = client(s, Duration::from_secs(2));
    s.wait_for_datapath_with(&client, target(), "remote pod answered", is_remote)?;
    let attempts = client.run(target(), ATTEMPTS)?;
    s.ensure(attempts.iter().all(is_remote), || {
        format!("every connection answered by rpod1: {attempts:?}")
    })?;
    Ok(())
}

fn counter(s: &mut Scenario, index: StatIndex) -> anyhow::Result<u64> {
    Ok(s.agent()?.datapath_counter(index)?)
}

/// Packets XDP translated (first packets, later ones, replies).
fn xdp_translated(s: &mut Scenario) -> anyhow::Result<u64> {
    Ok(counter(s, StatIndex::XdpTranslated)?
        + counter(s, StatIndex::XdpEstablished)?
        + counter(s, StatIndex::XdpReplyTranslated)?)
}

/// `kubeproxy_ebpf_fast_path_active` (`None` while the metrics do not answer).
fn fast_path_metric(s: &mut Scenario) -> anyhow::Result<Option<f64>> {
    let agent = s.agent()?;
    Ok(agent.metrics().ok().map(|exposition| {
        proxy_tests::http::metric_sum(&exposition, "kubeproxy_ebpf_fast_path_active", &[])
    }))
}

/// Waits (bounded) until the metric reads `want`.
fn wait_for_metric(s: &mut Scenario, want: f64, bound: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        let now = fast_path_metric(s)?;
        if now == Some(want) {
            return Ok(());
        }
        if start.elapsed() > bound {
            return Err(s
                .agent()?
                .error(format!(
                    "kubeproxy_ebpf_fast_path_active {now:?} after {bound:?}, wanted {want}"
                ))
                .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `iptables ARGS` in the node namespace (the rig's iptables is iptables-nft).
fn node_iptables(s: &Scenario, args: &[&str]) -> anyhow::Result<()> {
    s.topo.node().exec("iptables", args)?;
    Ok(())
}

/// `proxy-agent inspect features --json`'s fast-path row, in the node namespace.
fn fast_path_row(s: &Scenario) -> anyhow::Result<serde_json::Value> {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", s.topo.node().path().display()))
        .arg(agent_binary()?)
        .args(["inspect", "features", "--json"])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect features failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&output.stdout)?;
    rows.into_iter()
        .find(|row| row["feature"] == "fast-path")
        .ok_or_else(|| anyhow::anyhow!("no fast-path row in inspect features"))
}

/// The node config's path flag (`node_flags::FAST_PATH` in the pinned `KPR_NODE_CONFIG`), as
/// `inspect explain` reads it for the external client's NodePort connection: `"netfilter
/// path: …"` or `"--tc-fast-path: …"`.
fn explained_netfilter(s: &mut Scenario) -> anyhow::Result<String> {
    let client = Topology::ext_ip().to_string();
    let to = format!("{}/tcp", target());
    let e = s.inspect_json(&[
        "explain", "--json", "--from", "external", "--client", &client, "--to", &to,
    ])?;
    Ok(e["netfilter"].as_str().unwrap_or_default().to_owned())
}

/// Whether XDP is attached to `vext` (`inspect interfaces`).
fn xdp_on_vext(s: &mut Scenario) -> anyhow::Result<bool> {
    let rows = s.inspect_json(&["interfaces", "--json"])?;
    Ok(rows.as_array().is_some_and(|rows| {
        rows.iter()
            .any(|row| row["interface"] == "vext" && row["hook"] == "xdp")
    }))
}

/// Starts the agent with `--tc-fast-path=auto`, the default, named because the rig pins the
/// netfilter path for tests that do not name it (`proxy_tests::agent`), and waits for its
/// first sync.
fn start_auto(s: &mut Scenario) -> anyhow::Result<()> {
    s.start_agent_with_args(
        "ebpf",
        &["--interfaces", "vext,vnode2", "--tc-fast-path=auto"],
    )?;
    s.wait_for_first_sync()?;
    Ok(())
}

#[test]
fn xdp_serves_until_a_forward_drop_appears_and_again_once_it_is_gone() -> anyhow::Result<()> {
    let mut s = setup()?;
    start_auto(&mut s)?;
    wait_for_metric(&mut s, 1.0, Duration::from_secs(10))?;
    let before = xdp_translated(&mut s)?;
    serve(&mut s)?;
    let after = xdp_translated(&mut s)?;
    let attached = xdp_on_vext(&mut s)?;
    s.ensure(after > before && attached, || {
        format!("XDP serves an empty FORWARD: xdp translated {before} → {after}")
    })?;
    let row = fast_path_row(&s)?;
    s.ensure(
        row["used"] == true && row["agent"] == true && row["kernel"] == true,
        || format!("inspect features: {row}"),
    )?;
    let flag = explained_netfilter(&mut s)?;
    s.ensure(flag.starts_with("--tc-fast-path"), || {
        format!("the node config's flag: {flag}")
    })?;

    // A forwarding policy appears while XDP serves: the next connection is dropped by it
    // within the bound (attempts with a short timeout, one after the other).
    node_iptables(&s, &["-A", "FORWARD", "-j", "DROP"])?;
    let added = Instant::now();
    let probe = client(&s, Duration::from_millis(200));
    let blocked_after = loop {
        if !matches!(probe.once(target())?, Attempt::Ok { .. }) {
            break added.elapsed();
        }
        if added.elapsed() > SWITCH_BOUND {
            return Err(s
                .agent()?
                .error(format!(
                    "connections still answered {SWITCH_BOUND:?} after FORWARD -j DROP"
                ))
                .into());
        }
    };
    eprintln!("blocked {blocked_after:?} after the FORWARD drop was added");
    wait_for_metric(&mut s, 0.0, SWITCH_BOUND)?;
    let attempts = client(&s, Duration::from_millis(500)).run(target(), ATTEMPTS)?;
    s.ensure(
        attempts.iter().all(|a| !matches!(a, Attempt::Ok { .. })),
        || format!("every connection dropped by FORWARD: {attempts:?}"),
    )?;
    let attached = xdp_on_vext(&mut s)?;
    s.ensure(!attached, || {
        "XDP detached on the netfilter path".to_owned()
    })?;
    let flag = explained_netfilter(&mut s)?;
    s.ensure(flag.starts_with("netfilter path"), || {
        format!("the node config's flag: {flag}")
    })?;
    let row = fast_path_row(&s)?;
    s.ensure(
        row["used"] == false
            && row["agent"] == false
            && row["path"]
                .as_str()
                .is_some_and(|p| p.contains("netfilter path") && p.contains("-j DROP")),
        || format!("inspect features names the rule: {row}"),
    )?;

    // The rule goes: back to the fast path, and XDP takes the flows again.
    node_iptables(&s, &["-D", "FORWARD", "-j", "DROP"])?;
    wait_for_metric(&mut s, 1.0, Duration::from_secs(5))?;
    let before = xdp_translated(&mut s)?;
    serve(&mut s)?;
    let after = xdp_translated(&mut s)?;
    s.ensure(after > before, || {
        format!("XDP serves again once FORWARD is empty: {before} → {after}")
    })?;
    Ok(())
}

#[test]
fn a_cni_accept_rule_at_start_keeps_the_netfilter_path() -> anyhow::Result<()> {
    let mut s = setup()?;
    // flannel's rule: conditional, so a CNI manages FORWARD.
    node_iptables(
        &s,
        &["-A", "FORWARD", "-s", "10.244.0.0/16", "-j", "ACCEPT"],
    )?;
    start_auto(&mut s)?;
    let xdp_before = xdp_translated(&mut s)?;
    let tc_before = counter(&mut s, StatIndex::TcTranslated)?;
    serve(&mut s)?;
    let xdp_after = xdp_translated(&mut s)?;
    let tc_after = counter(&mut s, StatIndex::TcTranslated)?;
    s.ensure(xdp_after == xdp_before && tc_after > tc_before, || {
        format!("tc, not XDP: xdp {xdp_before} → {xdp_after}, tc {tc_before} → {tc_after}")
    })?;
    let metric = fast_path_metric(&mut s)?;
    s.ensure(metric == Some(0.0), || {
        format!("kubeproxy_ebpf_fast_path_active {metric:?}, wanted 0")
    })?;
    let attached = xdp_on_vext(&mut s)?;
    s.ensure(!attached, || "no XDP attached".to_owned())?;
    let row = fast_path_row(&s)?;
    s.ensure(
        row["path"]
            .as_str()
            .is_some_and(|p| p.contains("-s 10.244.0.0/16 -j ACCEPT")),
        || format!("inspect features names the rule: {row}"),
    )?;
    Ok(())
}

/// iptables-legacy announces nothing: its FORWARD is polled every second. A drop added there
/// while XDP serves sends traffic back to the netfilter path within the poll and a read.
#[test]
fn a_legacy_forward_drop_is_found_by_the_poll() -> anyhow::Result<()> {
    let mut s = setup()?;
    start_auto(&mut s)?;
    wait_for_metric(&mut s, 1.0, Duration::from_secs(10))?;
    serve(&mut s)?;
    s.topo
        .node()
        .exec("iptables-legacy", &["-A", "FORWARD", "-j", "DROP"])?;
    // The poll's period, a read of every ruleset, and slack for a loaded machine.
    wait_for_metric(&mut s, 0.0, Duration::from_secs(3))?;
    let attempts = client(&s, Duration::from_millis(500)).run(target(), ATTEMPTS)?;
    s.ensure(
        attempts.iter().all(|a| !matches!(a, Attempt::Ok { .. })),
        || format!("every connection dropped by the legacy FORWARD: {attempts:?}"),
    )?;
    let row = fast_path_row(&s)?;
    s.ensure(
        row["path"]
            .as_str()
            .is_some_and(|p| p.contains("iptables-legacy (IPv4) filter chain FORWARD")),
        || format!("inspect features names the legacy chain: {row}"),
    )?;
    s.topo
        .node()
        .exec("iptables-legacy", &["-D", "FORWARD", "-j", "DROP"])?;
    wait_for_metric(&mut s, 1.0, Duration::from_secs(3))?;
    serve(&mut s)?;
    Ok(())
}
