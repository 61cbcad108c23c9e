//! The first transition: established TCP connections survive the node moving from
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
use proxy_tests::client::{Attempt, Client, Mode, Proto, tally};
use proxy_tests::manifests::{Protocol, SlicePort, endpoint_slice_yaml_family};
use proxy_tests::scenario::{
    BACKEND_PORT, CLUSTER_IP, Scenario, cluster_addr, is_pod, pod_endpoint, pod_endpoint_family,
};
use proxy_tests::service_scenarios::ServiceSpec;
use proxy_tests::takeover::{load_nft_ruleset, wait_for_kube_proxy_tables_removed};
use proxy_tests::topology::{Place, Topology};
use proxy_tests::wait::try_wait_until;

const NODE_PORT: u16 = 30080;

fn node_port_addr() -> SocketAddr {
    SocketAddrV4::new(Topology::node_ext_ip(), NODE_PORT).into()
}

type Streams = Vec<std::thread::JoinHandle<proxy_tests::Result<Vec<Attempt>>>>;

/// `default/web` as a NodePort Service on pods 1 and 2, in a fresh two-pod scenario.
fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = Scenario::new(2)?;
    let spec = ServiceSpec {
        type_: "NodePort",
        ..ServiceSpec::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2)])?;
    Ok(s)
}

/// Waits until the NodePort (from outside) and the ClusterIP (from a node process in the
/// agent's cgroup) are answered, then opens 10 TCP streams through the first and 4 to the
/// second, each `exchanges` request/answer exchanges 100 ms apart on one connection; returns
/// them and the two clients.
fn open_streams(s: &mut Scenario, exchanges: u32) -> anyhow::Result<(Streams, Client, Client)> {
    let outside = s.external_client();
    let node = s.cgroup_client();
    s.wait_for_datapath_with(&outside, node_port_addr(), "NodePort answered", is_pod)?;
    s.wait_for_datapath_with(&node, cluster_addr(), "ClusterIP answered", is_pod)?;
    let streams = (0..14)
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
            std::thread::spawn(move || client.run(target, exchanges))
        })
        .collect();
    // Every stream connected before the transition starts.
    s.wait_for_tcp_streams(14)?;
    Ok((streams, outside, node))
}

/// Waits until the nat table `save` (`iptables-save` or `ip6tables-save`) lists has
/// (`present`), or no longer has, the Service rules (`KUBE-SERVICES`).
fn wait_for_service_rules(
    s: &Scenario,
    save: &str,
    present: bool,
    timeout: Duration,
) -> anyhow::Result<()> {
    let what = if present {
        "the iptables mode's rules"
    } else {
        "the iptables mode's rules removed"
    };
    // The rules come, or go, with the starting agent's first sync: the bound counts from it,
    // not from the spawn (loading the programs alone takes seconds on a loaded machine).
    s.wait_for_first_sync()?;
    try_wait_until(what, timeout, Duration::from_millis(50), || {
        let rules = s.topo.node().exec(save, &["-t", "nat"])?;
        Ok(rules.contains("KUBE-SERVICES") == present)
    })
    .map_err(|e| s.agent_error(e.to_string()))?;
    Ok(())
}

/// New connections after a transition: batches of 6 to the ClusterIP from the node and to the
/// NodePort from outside, until every one is answered by a pod.
fn fresh_connections(
    s: &Scenario,
    outside: &Client,
    node: &Client,
) -> anyhow::Result<[Vec<Attempt>; 2]> {
    let fresh_node =
        s.wait_for_batch(node, cluster_addr(), 6, "new ClusterIP connections", is_pod)?;
    let fresh_outside = s.wait_for_batch(
        outside,
        node_port_addr(),
        6,
        "new NodePort connections",
        is_pod,
    )?;
    Ok([fresh_node, fresh_outside])
}

/// Joins the streams and fails unless every one kept its one connection (`#1`) and was
/// answered every time (goal of the issue: 0 resets, 0 stalls).
fn ensure_streams_kept(
    s: &Scenario,
    streams: Streams,
    transition: &str,
    fresh: &[Vec<Attempt>; 2],
) -> anyhow::Result<()> {
    let mut broken = Vec::new();
    for (i, stream) in streams.into_iter().enumerate() {
        let attempts = stream
            .join()
            .map_err(|_| RigError::Other(format!("stream {i}: client thread panicked")))??;
        let counts = tally(&attempts);
        eprintln!("stream {i} across the {transition}: {counts:?}");
        let kept = counts.len() == 1
            && attempts.iter().all(|a| {
                matches!(a, Attempt::Ok { .. }) && a.backend().is_some_and(|b| b.ends_with("#1"))
            });
        if !kept {
            broken.push((i, counts));
        }
    }
    eprintln!(
        "{transition}: {} of 14 streams broken; new connections: node {:?}, outside {:?}",
        broken.len(),
        tally(&fresh[0]),
        tally(&fresh[1])
    );
    s.ensure(broken.is_empty(), || {
        format!("{transition}: every stream keeps its one connection, answered throughout: broken {broken:?}")
    })?;
    Ok(())
}

/// 10 TCP streams from outside through the NodePort and 4 from a node process to the
/// ClusterIP, opened under the iptables mode, run while that agent stops and an eBPF-mode agent
/// takes the node over and removes the iptables rules after its first sync, all while the
/// streams run. Every stream keeps its one connection and is answered throughout, and new
/// connections made after the takeover are answered by the pods.
#[test]
fn established_tcp_connections_survive_the_takeover_from_iptables_rules() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.start_agent_with_args("iptables", &[])?;
    // 100 exchanges: about 10 s per stream, across the whole takeover (an eBPF agent start
    // takes 2-4 s on a loaded machine).
    let (streams, outside, node) = open_streams(&mut s, 100)?;
    s.stop_agent()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    // The eBPF mode translates new connections: its socket hooks for the node's, its tc
    // program for the outside's.
    let fresh = fresh_connections(&s, &outside, &node)?;
    // The iptables rules go after the eBPF mode's first sync.
    wait_for_service_rules(&s, "iptables-save", false, Duration::from_secs(20))?;
    let running = streams.iter().filter(|t| !t.is_finished()).count();
    s.ensure(running == streams.len(), || {
        format!(
            "the takeover must complete while the streams run: only {running} of {} still ran",
            streams.len()
        )
    })?;
    ensure_streams_kept(&s, streams, "takeover", &fresh)
}

/// The other direction: the 14 streams opened under the eBPF mode run while that agent stops
/// and an iptables-mode agent takes the node over. The eBPF mode's programs carry the streams
/// they know until they end (`--mode-switch-drain-period`, 60 s here), new connections meet the
/// iptables rules at once, and the programs and maps are removed once no flow of theirs is
/// live (the streams' entries idle out 10 s after their FIN), well before the period. With
/// `0s` (removed at the first sync) the 10 NodePort streams were reset.
#[test]
fn established_tcp_connections_survive_the_hand_back_to_iptables_rules() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    let pin_dir = s.agent()?.bpf_root().join("kubeproxy-rs");
    let (streams, outside, node) = open_streams(&mut s, 60)?;
    // The same agent (its bpffs root, where the eBPF mode's pins are) restarted in the other
    // mode, as a DaemonSet's new pod would be on the host's /sys/fs/bpf.
    let agent = s.agent()?;
    agent.stop()?;
    agent.restart_in_mode_with_args("iptables", &["--mode-switch-drain-period", "60s"])?;
    // New connections are the iptables rules' while the eBPF programs drain.
    wait_for_service_rules(&s, "iptables-save", true, Duration::from_secs(10))?;
    let fresh = fresh_connections(&s, &outside, &node)?;
    s.ensure(pin_dir.exists(), || {
        "the eBPF mode's pins stay while its streams run".into()
    })?;
    ensure_streams_kept(&s, streams, "hand-back", &fresh)?;
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

/// kube-proxy nftables-mode shaped rules for `default/web` (NodePort 30080 and ClusterIP:80 →
/// pods 1 and 2 on 8080, chosen by `numgen` as kube-proxy's vmaps do; NodePort traffic marked
/// and masqueraded), in its table `ip kube-proxy`.
fn kube_proxy_nftables_rules(s: &Scenario) -> anyhow::Result<()> {
    let (pod1, pod2) = (Topology::pod_ip(1), Topology::pod_ip(2));
    let node_ip = Topology::node_ext_ip();
    let ruleset = format!(
        "table ip kube-proxy {{\n\
         \tchain endpoints {{ meta l4proto tcp numgen inc mod 2 0 dnat to {pod1}:8080; meta l4proto tcp dnat to {pod2}:8080; }}\n\
         \tchain services {{\n\
         \t\tip daddr {CLUSTER_IP} tcp dport 80 jump endpoints\n\
         \t\tip daddr {node_ip} tcp dport {NODE_PORT} meta mark set mark or 0x4000 jump endpoints\n\
         \t}}\n\
         \tchain nat-output {{ type nat hook output priority -100; policy accept; jump services; }}\n\
         \tchain nat-prerouting {{ type nat hook prerouting priority -100; policy accept; jump services; }}\n\
         \tchain nat-postrouting {{ type nat hook postrouting priority 100; policy accept; \
         meta mark & 0x4000 == 0x4000 masquerade; }}\n\
         }}\n"
    );
    load_nft_ruleset(s, &ruleset)?;
    Ok(())
}

/// kube-proxy's nftables mode as the previous owner: the same 14 streams, opened on its rules
/// (no agent), run while an eBPF-mode agent takes the node over. Its tables stay until the
/// drain period is over (the streams' TIME_WAIT entries keep them): removed at the start, or
/// only emptied, they took the kernel's conntrack and NAT of these connections with them and
/// all 14 streams were reset.
#[test]
fn established_tcp_connections_survive_the_takeover_from_nftables_rules() -> anyhow::Result<()> {
    let mut s = setup()?;
    kube_proxy_nftables_rules(&s)?;
    let (streams, outside, node) = open_streams(&mut s, 100)?;
    s.start_agent_with_args(
        "ebpf",
        &["--interfaces", "vext", "--mode-switch-drain-period", "15s"],
    )?;
    let fresh = fresh_connections(&s, &outside, &node)?;
    ensure_streams_kept(&s, streams, "nftables takeover", &fresh)?;
    // The streams' TIME_WAIT entries in the kernel's conntrack outlive them: the period ends
    // the drain, 15 s after the agent decided to keep the tables.
    wait_for_kube_proxy_tables_removed(&mut s, Duration::from_secs(15))?;
    Ok(())
}

/// The UDP Service of the UDP takeover: `default/dns`, ClusterIP `UDP_CLUSTER_IP`:53 and
/// NodePort `UDP_NODE_PORT` → pods 1 and 2 on 8080/UDP.
const UDP_CLUSTER_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 96, 0, 53);
const UDP_NODE_PORT: u16 = 30053;

fn write_udp_service(s: &Scenario) -> anyhow::Result<()> {
    // The node's own clients route a packet to the ClusterIP (no decoy address holds it here)
    // before the iptables mode's OUTPUT DNAT rewrites it, as on a real node.
    s.topo.route_node_via_ext()?;
    let port = SlicePort {
        name: "dns".into(),
        port: BACKEND_PORT,
        protocol: Protocol::Udp,
    };
    s.manifests.write(
        "dns-slice.yaml",
        &endpoint_slice_yaml_family(
            "default",
            "dns-1",
            "dns",
            std::slice::from_ref(&port),
            &[pod_endpoint_family(1, false), pod_endpoint_family(2, false)],
            false,
        ),
    )?;
    s.manifests.write(
        "dns-svc.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: dns, namespace: default}}\nspec:\n  \
             type: NodePort\n  clusterIP: {UDP_CLUSTER_IP}\n  ports:\n  - {{name: dns, port: 53, \
             targetPort: {BACKEND_PORT}, protocol: UDP, nodePort: {UDP_NODE_PORT}}}\n"
        ),
    )?;
    Ok(())
}

fn udp_node_port_addr() -> SocketAddr {
    SocketAddrV4::new(Topology::node_ext_ip(), UDP_NODE_PORT).into()
}

fn udp_cluster_addr() -> SocketAddr {
    SocketAddrV4::new(UDP_CLUSTER_IP, 53).into()
}

/// Waits until the UDP NodePort (from outside) and ClusterIP (from a node process in the
/// agent's cgroup) are answered, then opens 8 UDP flows through the first and 4 to the second,
/// each one connected socket (a resolver's, a game's) sending 200 datagrams 100 ms apart;
/// returns them and the two clients.
fn open_udp_streams(s: &mut Scenario) -> anyhow::Result<(Streams, Client, Client)> {
    let outside = s.external_client().proto(Proto::Udp);
    let node = s.cgroup_client().proto(Proto::Udp);
    s.wait_for_datapath_with(
        &outside,
        udp_node_port_addr(),
        "UDP NodePort answered",
        is_pod,
    )?;
    s.wait_for_datapath_with(&node, udp_cluster_addr(), "UDP ClusterIP answered", is_pod)?;
    let streams = (0..12)
        .map(|i| {
            let (client, target) = if i < 8 {
                (outside.clone(), udp_node_port_addr())
            } else {
                (node.clone(), udp_cluster_addr())
            };
            let client = client
                .mode(Mode::Stream)
                .interval(Duration::from_millis(100))
                .timeout(Duration::from_millis(1000));
            std::thread::spawn(move || client.run(target, 200))
        })
        .collect();
    // Every flow has started before the transition starts.
    s.wait_for_udp_flows(&[Place::Ext, Place::Node], 12)?;
    Ok((streams, outside, node))
}

/// Joins UDP streams (one connected socket each, `Mode::Stream`) and fails unless every one
/// was answered every time, always by the one backend it had at the start.
fn ensure_udp_streams_kept(s: &Scenario, streams: Streams, transition: &str) -> anyhow::Result<()> {
    let mut broken = Vec::new();
    let total = streams.len();
    for (i, stream) in streams.into_iter().enumerate() {
        let attempts = stream
            .join()
            .map_err(|_| RigError::Other(format!("UDP flow {i}: client thread panicked")))??;
        let counts = tally(&attempts);
        eprintln!("UDP flow {i} across the {transition}: {counts:?}");
        let kept = counts.len() == 1 && attempts.iter().all(is_pod);
        if !kept {
            broken.push((i, counts));
        }
    }
    eprintln!(
        "{transition}: {} of {total} UDP flows moved or stalled",
        broken.len()
    );
    s.ensure(broken.is_empty(), || {
        format!("{transition}: every UDP flow keeps its backend, answered throughout: {broken:?}")
    })?;
    Ok(())
}

/// After a transition: new UDP flows to the ClusterIP from the node and to the NodePort from
/// outside are answered by the pods, every flow of `streams` still ran when the transition
/// completed, and each kept its backend.
fn ensure_new_udp_flows_and_streams(
    s: &Scenario,
    outside: &Client,
    node: &Client,
    streams: Streams,
    transition: &str,
) -> anyhow::Result<()> {
    s.wait_for_batch(
        node,
        udp_cluster_addr(),
        6,
        "new UDP ClusterIP flows",
        is_pod,
    )?;
    s.wait_for_batch(
        outside,
        udp_node_port_addr(),
        6,
        "new UDP NodePort flows",
        is_pod,
    )?;
    let running = streams.iter().filter(|t| !t.is_finished()).count();
    s.ensure(running == streams.len(), || {
        format!(
            "the {transition} must complete while the UDP flows run: only {running} of {} still ran",
            streams.len()
        )
    })?;
    ensure_udp_streams_kept(s, streams, transition)
}

/// UDP flows across the takeover from iptables rules (`open_udp_streams`), opened under the
/// iptables mode. A UDP packet carries nothing that
/// tells a flow's first datagram from its hundredth, so the eBPF mode adopts the flows the
/// kernel's conntrack NATs at its start (`ct_flags::KERNEL_NAT`) and leaves them to that
/// NAT: every flow keeps its backend (before, each NodePort flow's next datagram was a new
/// flow with a random backend: about half moved), and new flows get the eBPF mode's.
#[test]
fn udp_flows_keep_their_backends_across_the_takeover_from_iptables_rules() -> anyhow::Result<()> {
    let mut s = setup()?;
    write_udp_service(&s)?;
    s.start_agent_with_args("iptables", &[])?;
    let (streams, outside, node) = open_udp_streams(&mut s)?;
    s.stop_agent()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    // The rules go after the eBPF mode's first sync (its start takes seconds on a loaded
    // machine: the verifier); from then on new flows are the eBPF mode's.
    wait_for_service_rules(&s, "iptables-save", false, Duration::from_secs(15))?;
    ensure_new_udp_flows_and_streams(&s, &outside, &node, streams, "takeover")?;
    let passed = proxy_tests::http::metric_sum(
        &s.agent()?.metrics()?,
        "kubeproxy_ebpf_datapath_events_total",
        &["reason=\"tc_kernel_nat_passed\""],
    );
    eprintln!("datagrams of adopted flows left to the kernel's NAT: {passed}");
    s.ensure(passed > 0.0, || {
        "the NodePort flows' datagrams must have been left to the kernel's NAT (tc_kernel_nat_passed)".into()
    })?;
    Ok(())
}

/// UDP flows across the hand-back: opened under the eBPF mode, they run while an iptables-mode
/// agent takes over. The draining eBPF programs keep translating the flows they track, so each
/// keeps its backend, and new flows meet the iptables rules.
#[test]
fn udp_flows_keep_their_backends_across_the_hand_back_to_iptables_rules() -> anyhow::Result<()> {
    let mut s = setup()?;
    write_udp_service(&s)?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    let (streams, outside, node) = open_udp_streams(&mut s)?;
    let agent = s.agent()?;
    agent.stop()?;
    agent.restart_in_mode_with_args("iptables", &["--mode-switch-drain-period", "60s"])?;
    wait_for_service_rules(&s, "iptables-save", true, Duration::from_secs(10))?;
    ensure_new_udp_flows_and_streams(&s, &outside, &node, streams, "hand-back")
}

/// IPv6 across the takeover from iptables rules: 8 TCP streams from outside through a dual-stack
/// NodePort's IPv6 address. The ip6tables rules are the only IPv6 conntrack user in the node's
/// namespace (the IPv4 side keeps `KUBE-FIREWALL`'s conntrack match), so with them removed the
/// kernel stopped tracking IPv6 and every stream was reset (a dual-stack run of the issue's
/// scenario: 100 of 100 IPv6 streams). The eBPF mode's NAT hold (`iptables::nat_hold`) keeps
/// the kernel tracking and NATing them until they drain: every stream keeps its connection.
#[test]
fn established_ipv6_tcp_connections_survive_the_takeover_from_iptables_rules() -> anyhow::Result<()>
{
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::with_families(2, true)?;
    let port = SlicePort {
        name: "http".into(),
        port: BACKEND_PORT,
        protocol: Protocol::Tcp,
    };
    for ipv6 in [false, true] {
        let name = if ipv6 { "np-v6" } else { "np-v4" };
        s.manifests.write(
            &format!("{name}.yaml"),
            &endpoint_slice_yaml_family(
                "default",
                name,
                "np",
                std::slice::from_ref(&port),
                &[pod_endpoint_family(1, ipv6), pod_endpoint_family(2, ipv6)],
                ipv6,
            ),
        )?;
    }
    s.manifests.write(
        "np.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: np, namespace: default}}\nspec:\n  \
             type: NodePort\n  clusterIP: 10.96.0.12\n  clusterIPs: [10.96.0.12, 'fd00:96::12']\n  \
             ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  \
             - {{name: http, port: 80, targetPort: {BACKEND_PORT}, protocol: TCP, nodePort: {NODE_PORT}}}\n"
        ),
    )?;
    s.start_agent_with_args("iptables", &[])?;
    let target = SocketAddr::new(Topology::node_ext_ip6().into(), NODE_PORT);
    let outside = s.external_client();
    s.wait_for_datapath_with(&outside, target, "IPv6 NodePort answered", is_pod)?;
    let streams: Streams = (0..8)
        .map(|_| {
            let client = outside
                .clone()
                .mode(Mode::TcpStream)
                .interval(Duration::from_millis(100))
                .timeout(Duration::from_millis(1000));
            std::thread::spawn(move || client.run(target, 150))
        })
        .collect();
    s.wait_for_tcp_streams(8)?;
    s.stop_agent()?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    wait_for_service_rules(&s, "ip6tables-save", false, Duration::from_secs(15))?;
    s.wait_for_batch(&outside, target, 6, "new IPv6 NodePort connections", is_pod)?;
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
        eprintln!("IPv6 stream {i} across the takeover: {counts:?}");
        let kept = counts.len() == 1
            && attempts.iter().all(|a| {
                matches!(a, Attempt::Ok { .. }) && a.backend().is_some_and(|b| b.ends_with("#1"))
            });
        if !kept {
            broken.push((i, counts));
        }
    }
    s.ensure(broken.is_empty(), || {
        format!("IPv6 takeover: every stream keeps its one connection, answered throughout: broken {broken:?}")
    })?;
    Ok(())
}
