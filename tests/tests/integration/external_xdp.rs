//! XDP with real packets: the agent runs with `--tc-fast-path` (so
//! `--bpf-xdp auto` attaches `kpr_xdp_external` in native mode to the external interfaces
//! `vext` and `vnode2`), an external client reaches a dual-stack NodePort whose only endpoint
//! is a pod on a second node, over TCP and UDP. Every packet of a flow, its first included, and
//! every reply goes through XDP (driver → translated → redirected to the other veth), none
//! through tc, which the datapath counters show; the echo server reports which pod answered and
//! the client sees the NodePort as its peer.
//!
//! The client's and node2's veth ends first keep their default offloads: their packets arrive
//! with only the pseudo-header sum in the L4 checksum (`CHECKSUM_PARTIAL`), which XDP must
//! leave to tc (counted). Then they send complete checksums, as a NIC receiving from a wire
//! delivers them (`ethtool -K eth0 tx off`), and have NAPI on (`gro on`), which a veth needs to
//! take redirected XDP frames. Needs root.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use proxy_common::StatIndex;
use proxy_tests::agent::agent_binary;
use proxy_tests::client::{Attempt, Client, Proto, tally};
use proxy_tests::manifests::{Endpoint, endpoint_slice_yaml};
use proxy_tests::scenario::{BACKEND_PORT, Scenario, http_and_dns_slice_ports};
use proxy_tests::topology::{Place, Topology};

const NAMESPACE: &str = "default";
const SERVICE: &str = "web";
const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
/// Attempts per protocol and family in each phase.
const ATTEMPTS: u32 = 10;

fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::with_families(1, true)?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    s.topo.start_remote_pod_echoes6(BACKEND_PORT)?;
    s.manifests.write(
        "svc.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE}\n  namespace: {NAMESPACE}\n\
             spec:\n  type: NodePort\n  clusterIP: \"10.96.0.20\"\n\
             \x20 clusterIPs: [\"10.96.0.20\", \"fd00:96::20\"]\n  ipFamilies: [IPv4, IPv6]\n\
             \x20 ipFamilyPolicy: RequireDualStack\n  externalTrafficPolicy: Cluster\n\
             \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
             \x20   nodePort: {TCP_NODE_PORT}\n  - name: dns\n    port: 53\n    protocol: UDP\n\
             \x20   targetPort: 8080\n    nodePort: {UDP_NODE_PORT}\n"
        ),
    )?;
    for (slice, ipv6) in [("web-4", false), ("web-6", true)] {
        let remote = Endpoint {
            node_name: Some("other-node".into()),
            ..Endpoint::ready(Topology::remote_pod_addr(1, ipv6))
        };
        s.manifests.write(
            &format!("{slice}.yaml"),
            &endpoint_slice_yaml(
                NAMESPACE,
                slice,
                SERVICE,
                &http_and_dns_slice_ports(),
                &[remote],
            ),
        )?;
    }
    Ok(s)
}

fn node_port(proto: Proto, ipv6: bool) -> SocketAddr {
    let ip: IpAddr = if ipv6 {
        Topology::node_ext_ip6().into()
    } else {
        Topology::node_ext_ip().into()
    };
    let port = match proto {
        Proto::Udp => UDP_NODE_PORT,
        _ => TCP_NODE_PORT,
    };
    SocketAddr::new(ip, port)
}

fn is_remote(attempt: &Attempt) -> bool {
    attempt.backend() == Some("rpod1")
}

/// `ATTEMPTS` TCP connections and UDP exchanges per family from the external client: every one
/// answered by the remote pod, the NodePort as the peer. Returns how many.
fn serve_all(s: &mut Scenario) -> anyhow::Result<u64> {
    let mut failures = Vec::new();
    let mut answered = 0;
    for ipv6 in [false, true] {
        for proto in [Proto::Tcp, Proto::Udp] {
            let target = node_port(proto, ipv6);
            let client = Client::new(s.topo.ext().path())
                .proto(proto)
                .timeout(Duration::from_secs(2));
            s.wait_for_datapath_with(&client, target, "remote pod answered", is_remote)?;
            let attempts = client.run(target, ATTEMPTS)?;
            eprintln!("{target} {proto:?}: {:?}", tally(&attempts));
            let good = attempts
                .iter()
                .all(|a| is_remote(a) && matches!(a, Attempt::Ok { peer, .. } if *peer == target));
            if !good {
                failures.push(format!("{target} {proto:?}: {attempts:?}"));
            }
            answered += attempts.len() as u64;
        }
    }
    s.ensure(failures.is_empty(), || {
        format!("every attempt answered by rpod1 from the NodePort: {failures:#?}")
    })?;
    Ok(answered)
}

fn counter(s: &mut Scenario, index: StatIndex) -> anyhow::Result<u64> {
    Ok(s.agent()?.datapath_counter(index)?)
}

/// Wire-like traffic on the client's and node2's links: complete checksums, NAPI on.
fn complete_checksums(s: &Scenario) -> anyhow::Result<()> {
    for place in [Place::Ext, Place::RemoteNode] {
        s.topo
            .netns(place)?
            .exec("ethtool", &["-K", "eth0", "tx", "off", "gro", "on"])?;
    }
    Ok(())
}

/// `proxy-agent inspect interfaces --json` in the node's namespace: (interface, hook,
/// program) rows.
fn inspect_interfaces(s: &mut Scenario) -> anyhow::Result<Vec<(String, String, String)>> {
    let bpf_root = s.agent()?.bpf_root().to_path_buf();
    let output = Command::new("nsenter")
        .arg(format!("--net={}", s.topo.node().path().display()))
        .arg(agent_binary()?)
        .arg("--bpf-root")
        .arg(&bpf_root)
        .args(["inspect", "interfaces", "--json"])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect interfaces failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&output.stdout)?;
    Ok(rows
        .iter()
        .map(|row| {
            let field = |name: &str| row[name].as_str().unwrap_or_default().to_owned();
            (field("interface"), field("hook"), field("program"))
        })
        .collect())
}

#[test]
fn node_port_flows_to_a_remote_pod_run_through_xdp() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext,vnode2", "--tc-fast-path"])?;
    // Local-stack checksums: XDP leaves those packets to tc, and everything is served.
    serve_all(&mut s)?;
    // XDP on both external interfaces, each before its tc programs; none on the pod's veth.
    let rows = inspect_interfaces(&mut s)?;
    eprintln!("inspect interfaces: {rows:?}");
    for interface in ["vext", "vnode2"] {
        let hooks: Vec<(&str, &str)> = rows
            .iter()
            .filter(|(name, _, _)| name == interface)
            .map(|(_, hook, program)| (hook.as_str(), program.as_str()))
            .collect();
        s.ensure(
            hooks
                == [
                    ("xdp", "kpr_xdp_external"),
                    ("tc ingress", "kpr_tc_external"),
                    ("tc egress", "kpr_tc_egress"),
                ],
            || format!("{interface}: {hooks:?}"),
        )?;
    }
    s.ensure(
        rows.iter()
            .any(|(name, hook, _)| name == "vpod1" && hook == "tc ingress")
            && !rows
                .iter()
                .any(|(name, hook, _)| name == "vpod1" && hook == "xdp"),
        || format!("vpod1 has tc, not XDP: {rows:?}"),
    )?;

    let partial = counter(&mut s, StatIndex::XdpPassedChecksumPartial)?;
    s.ensure(partial > 0, || {
        "veth packets with partial checksums were left to tc (xdp_passed_checksum_partial 0)"
            .to_owned()
    })?;

    complete_checksums(&s)?;
    let counters = |s: &mut Scenario| -> anyhow::Result<[u64; 5]> {
        Ok([
            counter(s, StatIndex::XdpEstablished)?,
            counter(s, StatIndex::XdpReplyTranslated)?,
            counter(s, StatIndex::XdpTranslated)?,
            counter(s, StatIndex::TcTranslated)?,
            counter(s, StatIndex::TcEstablished)? + counter(s, StatIndex::TcReplyTranslated)?,
        ])
    };
    let before = counters(&mut s)?;
    let answered = serve_all(&mut s)?;
    let after = counters(&mut s)?;
    eprintln!(
        "answered {answered}: xdp_established +{}, xdp_reply_translated +{}, xdp_translated +{}, \
         tc_translated +{}, tc_established and tc_reply_translated +{}",
        after[0] - before[0],
        after[1] - before[1],
        after[2] - before[2],
        after[3] - before[3],
        after[4] - before[4],
    );
    // Every exchange's reply (a UDP answer, a TCP SYN-ACK and more) came back through XDP,
    // every TCP connection's later segments (ACK, data, FIN) went out through it, and every
    // flow's first packet: tc translated nothing.
    let tcp = u64::from(ATTEMPTS) * 2;
    s.ensure(after[1] - before[1] >= answered, || {
        format!(
            "replies through XDP: {} for {answered} answers",
            after[1] - before[1]
        )
    })?;
    s.ensure(after[0] - before[0] >= tcp, || {
        format!(
            "later client packets through XDP: {} for {tcp} TCP connections",
            after[0] - before[0]
        )
    })?;
    s.ensure(after[2] - before[2] >= answered, || {
        format!(
            "first packets through XDP: {} for {answered} answers",
            after[2] - before[2]
        )
    })?;
    s.ensure(after[3] == before[3] && after[4] == before[4], || {
        format!("tc translated nothing: {before:?} → {after:?}")
    })?;

    // A restart swaps the new agent's program into the pinned links: XDP stays and serves.
    s.agent()?.stop()?;
    let established = counter(&mut s, StatIndex::XdpEstablished)?;
    s.agent()?.restart()?;
    wait_synced(&mut s)?;
    serve_all(&mut s)?;
    let rows = inspect_interfaces(&mut s)?;
    s.ensure(has_xdp(&rows, "vext") && has_xdp(&rows, "vnode2"), || {
        format!("XDP kept across the restart: {rows:?}")
    })?;
    let now = counter(&mut s, StatIndex::XdpEstablished)?;
    s.ensure(now >= established + tcp, || {
        format!("XDP after the restart: xdp_established {established} → {now}")
    })?;

    // `--bpf-xdp off`: the links go, tc serves alone.
    s.agent()?.stop()?;
    s.agent()?.restart_with_args(&[
        "--interfaces",
        "vext,vnode2",
        "--tc-fast-path",
        "--bpf-xdp",
        "off",
    ])?;
    wait_synced(&mut s)?;
    let rows = inspect_interfaces(&mut s)?;
    s.ensure(!has_xdp(&rows, "vext") && !has_xdp(&rows, "vnode2"), || {
        format!("no XDP with --bpf-xdp off: {rows:?}")
    })?;
    let xdp_before = (
        counter(&mut s, StatIndex::XdpEstablished)?,
        counter(&mut s, StatIndex::XdpReplyTranslated)?,
        counter(&mut s, StatIndex::XdpTranslated)?,
    );
    serve_all(&mut s)?;
    let xdp_after = (
        counter(&mut s, StatIndex::XdpEstablished)?,
        counter(&mut s, StatIndex::XdpReplyTranslated)?,
        counter(&mut s, StatIndex::XdpTranslated)?,
    );
    s.ensure(xdp_before == xdp_after, || {
        format!("nothing through XDP once off: {xdp_before:?} → {xdp_after:?}")
    })?;
    Ok(())
}

/// Waits (bounded) until the restarted agent has synced once: its programs are attached by
/// then (the previous agent's pinned ones serve meanwhile, so traffic alone does not tell).
fn wait_synced(s: &mut Scenario) -> anyhow::Result<()> {
    let agent = s.agent()?;
    proxy_tests::wait::wait_until(
        "the restarted agent's first sync",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || agent.syncs() >= 1,
    )?;
    Ok(())
}

fn has_xdp(rows: &[(String, String, String)], interface: &str) -> bool {
    rows.iter()
        .any(|(name, hook, _)| name == interface && hook == "xdp")
}
