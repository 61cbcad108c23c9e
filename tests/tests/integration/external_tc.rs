//! External traffic through the tc programs with the real agent: clients in the `ext`
//! namespace reach NodePorts, externalIPs and LoadBalancer IPs on the node; the echo servers
//! report which pod answered and which client address it saw. Needs root.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use proxy_tests::client::{Attempt, Client, tally};
use proxy_tests::manifests::{Endpoint, Protocol, SlicePort, endpoint_slice_yaml};
use proxy_tests::netns::spawn_in;
use proxy_tests::scenario::{
    BACKEND_PORT, DATAPATH_TIMEOUT, Scenario, http_service, http_slice, is_pod, pod_endpoint,
    pod_endpoint_family,
};
use proxy_tests::topology::Topology;

const NAMESPACE: &str = "default";
const SERVICE: &str = "web";
const NODE_PORT: u16 = 30080;
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);

fn setup(pods: usize) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = Scenario::new(pods)?;
    // The external client reaches the externalIP and LB IP through the node, as a router
    // would send them.
    for vip in [EXTERNAL_IP, LB_IP] {
        s.topo.ext().ip(&[
            "route",
            "add",
            &format!("{vip}/32"),
            "via",
            &Topology::node_ext_ip().to_string(),
        ])?;
    }
    Ok(s)
}

/// A LoadBalancer Service `web` (port 80 → 8080) with NodePort, an externalIP and an LB IP.
fn lb_service(policy: &str, source_ranges: &[&str]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE}\n  namespace: {NAMESPACE}\n\
         spec:\n  type: LoadBalancer\n  clusterIP: \"{CLUSTER_IP}\"\n  clusterIPs: [\"{CLUSTER_IP}\"]\n\
         \x20 externalTrafficPolicy: {policy}\n  externalIPs: [\"{EXTERNAL_IP}\"]\n\
         \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
         \x20   nodePort: {NODE_PORT}\n"
    );
    if !source_ranges.is_empty() {
        y.push_str("  loadBalancerSourceRanges:\n");
        for r in source_ranges {
            y.push_str(&format!("  - \"{r}\"\n"));
        }
    }
    y.push_str(&format!(
        "status:\n  loadBalancer:\n    ingress:\n    - ip: \"{LB_IP}\"\n"
    ));
    y
}

fn remote_endpoint(ip: Ipv4Addr) -> Endpoint {
    Endpoint {
        node_name: Some("other-node".into()),
        ..Endpoint::ready(ip)
    }
}

fn ext_client() -> impl Fn(&Scenario) -> Client {
    |s: &Scenario| Client::new(s.topo.ext().path()).timeout(Duration::from_millis(1500))
}

fn node_port_addr() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Topology::node_ext_ip()), NODE_PORT)
}

fn start(s: &mut Scenario) -> anyhow::Result<()> {
    s.start_agent_with_args("ebpf", &["--interfaces", "vext"])?;
    Ok(())
}

fn client_seen(a: &Attempt) -> Option<IpAddr> {
    match a {
        Attempt::Ok { client, .. } => Some(client.ip()),
        Attempt::Err(_) => None,
    }
}

#[test]
fn node_port_external_ip_and_lb_ip_reach_pods_with_snat() -> anyhow::Result<()> {
    let mut s = setup(2)?;
    s.manifests.write("svc.yaml", &lb_service("Cluster", &[]))?;
    s.manifests.write(
        "slice.yaml",
        &http_slice(
            NAMESPACE,
            "web-1",
            SERVICE,
            &[pod_endpoint(1), pod_endpoint(2)],
        ),
    )?;
    start(&mut s)?;
    let client = ext_client()(&s);
    let first = s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    eprintln!("first NodePort answer: {first:?}");
    for target in [
        node_port_addr(),
        SocketAddr::new(EXTERNAL_IP.into(), 80),
        SocketAddr::new(LB_IP.into(), 80),
    ] {
        let attempts = client.run(target, 20)?;
        let counts = tally(&attempts);
        eprintln!("{target}: {counts:?}");
        s.ensure(attempts.iter().all(is_pod), || {
            format!("{target}: {counts:?}")
        })?;
        s.ensure(counts.len() == 2, || {
            format!("{target}: both pods should answer: {counts:?}")
        })?;
        // eTP Cluster: the pods see the node's address (SNAT), not the client's.
        let seen: Vec<_> = attempts.iter().filter_map(client_seen).collect();
        s.ensure(
            seen.iter()
                .all(|ip| *ip == IpAddr::V4(Topology::node_ext_ip())),
            || format!("{target}: client addresses seen: {seen:?}"),
        )?;
    }
    Ok(())
}

#[test]
fn local_policy_preserves_the_client_and_drops_without_local_endpoints() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    s.manifests.write("svc.yaml", &lb_service("Local", &[]))?;
    s.manifests.write(
        "slice.yaml",
        &http_slice(NAMESPACE, "web-1", SERVICE, &[pod_endpoint(1)]),
    )?;
    start(&mut s)?;
    let client = ext_client()(&s);
    let first = s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    s.ensure(
        client_seen(&first) == Some(IpAddr::V4(Topology::ext_ip())),
        || format!("eTP Local must preserve the client address: {first:?}"),
    )?;

    // The only endpoint moves to another node: kube-proxy DROPs (no answer at all).
    s.manifests.write(
        "slice.yaml",
        &http_slice(
            NAMESPACE,
            "web-1",
            SERVICE,
            &[remote_endpoint(Topology::pod_ip(1))],
        ),
    )?;
    let dropped = s.wait_for_datapath_with(
        &client,
        node_port_addr(),
        "NodePort dropped",
        |a| matches!(a, Attempt::Err(reason) if reason.contains("TIMEOUT")),
    )?;
    eprintln!("eTP Local without local endpoints: {dropped:?}");
    Ok(())
}

#[test]
fn service_without_endpoints_is_refused() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    s.manifests.write("svc.yaml", &lb_service("Cluster", &[]))?;
    s.manifests
        .write("slice.yaml", &http_slice(NAMESPACE, "web-1", SERVICE, &[]))?;
    start(&mut s)?;
    let client = ext_client()(&s);
    for target in [node_port_addr(), SocketAddr::new(EXTERNAL_IP.into(), 80)] {
        let refused = s.wait_for_datapath_with(
            &client,
            target,
            "refused",
            |a| matches!(a, Attempt::Err(reason) if reason.contains("ECONNREFUSED")),
        )?;
        eprintln!("{target}: {refused:?}");
    }
    Ok(())
}

#[test]
fn source_ranges_drop_other_clients() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    // The client (10.10.0.2) is outside 203.0.113.0/24: the LB IP must not answer it, while
    // the NodePort (no source ranges in kube-proxy) still does.
    s.manifests
        .write("svc.yaml", &lb_service("Cluster", &["203.0.113.0/24"]))?;
    s.manifests.write(
        "slice.yaml",
        &http_slice(NAMESPACE, "web-1", SERVICE, &[pod_endpoint(1)]),
    )?;
    start(&mut s)?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    let lb = client.once(SocketAddr::new(LB_IP.into(), 80))?;
    s.ensure(
        matches!(&lb, Attempt::Err(reason) if reason.contains("TIMEOUT")),
        || format!("LB IP from outside the source ranges: {lb:?}"),
    )?;
    s.manifests
        .write("svc.yaml", &lb_service("Cluster", &["10.10.0.0/24"]))?;
    let allowed = s.wait_for_datapath_with(
        &client,
        SocketAddr::new(LB_IP.into(), 80),
        "LB IP answered inside the source ranges",
        is_pod,
    )?;
    eprintln!("inside the ranges: {allowed:?}");
    Ok(())
}

const UDP_NODE_PORT: u16 = 30053;

/// A NodePort Service `dns` (UDP 53 → 8080, the echo servers' UDP port) on `UDP_NODE_PORT`.
fn udp_service() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: dns\n  namespace: {NAMESPACE}\n\
         spec:\n  type: NodePort\n  clusterIP: \"10.96.0.53\"\n  clusterIPs: [\"10.96.0.53\"]\n\
         \x20 ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n    targetPort: 8080\n\
         \x20   nodePort: {UDP_NODE_PORT}\n"
    )
}

fn udp_slice(endpoints: &[Endpoint]) -> String {
    endpoint_slice_yaml(
        NAMESPACE,
        "dns-1",
        "dns",
        &[SlicePort {
            name: "dns".into(),
            port: BACKEND_PORT,
            protocol: Protocol::Udp,
        }],
        endpoints,
    )
}

/// One long-lived UDP flow from `ext` (one socket, one source port, never reconnected — what a
/// resolver or a QUIC client does): sends a datagram every `INTERVAL` and reports who answered.
struct UdpFlow {
    stop: Arc<AtomicBool>,
    replies: mpsc::Receiver<(Instant, Option<String>)>,
    thread: Option<std::thread::JoinHandle<proxy_tests::Result<()>>>,
}

impl UdpFlow {
    const INTERVAL: Duration = Duration::from_millis(50);

    fn start(netns: PathBuf, target: SocketAddr) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, replies) = mpsc::channel();
        let stopped = Arc::clone(&stop);
        let thread = spawn_in(&netns, move || {
            let run = || -> anyhow::Result<()> {
                let sock = UdpSocket::bind("0.0.0.0:0")?;
                sock.connect(target)?;
                sock.set_read_timeout(Some(Self::INTERVAL * 4))?;
                // Bounded by the stop flag, which the guard sets on drop.
                while !stopped.load(Ordering::Relaxed) {
                    sock.send(b"x")?;
                    let mut buf = [0u8; 256];
                    let reply = sock.recv(&mut buf).ok().map(|n| {
                        let text = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
                        text.split_whitespace()
                            .next()
                            .unwrap_or_default()
                            .to_owned()
                    });
                    if tx.send((Instant::now(), reply)).is_err() {
                        break;
                    }
                    std::thread::sleep(Self::INTERVAL);
                }
                Ok(())
            };
            if let Err(e) = run() {
                eprintln!("udp flow: {e}");
            }
        })?;
        Ok(Self {
            stop,
            replies,
            thread: Some(thread),
        })
    }

    /// Waits (bounded) for a reply from `backend`; returns when it came.
    fn wait_for(&self, backend: &str, within: Duration) -> Option<Instant> {
        let deadline = Instant::now() + within;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.replies.recv_timeout(left) {
                Ok((at, Some(name))) if name == backend => return Some(at),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        None
    }
}

impl Drop for UdpFlow {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take()
            && let Ok(Err(e)) = thread.join()
        {
            eprintln!("udp flow: {e}");
        }
    }
}

/// A UDP flow that never pauses keeps its conntrack entry alive: only the purge of a removed
/// backend's entries can move it, so its moving at all (within the datapath bound) is the
/// purge's proof; how fast it moved is printed, and measured by the benchmarks.
#[test]
fn udp_flow_leaves_a_removed_backend() -> anyhow::Result<()> {
    let mut s = setup(2)?;
    s.manifests.write("svc.yaml", &udp_service())?;
    s.manifests
        .write("slice.yaml", &udp_slice(&[pod_endpoint(2)]))?;
    start(&mut s)?;
    let target = SocketAddr::new(IpAddr::V4(Topology::node_ext_ip()), UDP_NODE_PORT);
    let flow = UdpFlow::start(s.topo.ext().path(), target)?;
    let on_pod2 = flow.wait_for("pod2", DATAPATH_TIMEOUT);
    s.ensure(on_pod2.is_some(), || {
        "the UDP flow never reached pod2".to_owned()
    })?;
    // pod2 leaves the Service (its server keeps running: without the purge the flow's
    // conntrack entry would keep it on pod2 for as long as it sends).
    s.manifests
        .write("slice.yaml", &udp_slice(&[pod_endpoint(1)]))?;
    let removed = Instant::now();
    let on_pod1 = flow.wait_for("pod1", DATAPATH_TIMEOUT);
    let Some(at) = on_pod1 else {
        return Err(s
            .agent_error(format!(
                "the UDP flow stayed off pod1 for {DATAPATH_TIMEOUT:?} after pod2 was removed"
            ))
            .into());
    };
    let took = at.saturating_duration_since(removed);
    eprintln!("UDP flow moved to pod1 {took:?} after pod2 was removed");
    Ok(())
}

/// A dual-stack NodePort Service `web6` (TCP 80 → 8080) on `NODE_PORT`.
fn dual_stack_service(policy: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE}\n  namespace: {NAMESPACE}\n\
         spec:\n  type: NodePort\n  clusterIP: \"{CLUSTER_IP}\"\n\
         \x20 clusterIPs: [\"{CLUSTER_IP}\", \"fd00:96::20\"]\n  ipFamilies: [IPv4, IPv6]\n\
         \x20 ipFamilyPolicy: RequireDualStack\n  externalTrafficPolicy: {policy}\n\
         \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
         \x20   nodePort: {NODE_PORT}\n"
    )
}

#[test]
fn ipv6_node_port_reaches_pods_with_snat_and_preserves_with_local() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::with_families(2, true)?;
    s.manifests
        .write("svc.yaml", &dual_stack_service("Cluster"))?;
    let v6 = [pod_endpoint_family(1, true), pod_endpoint_family(2, true)];
    s.manifests
        .write("slice6.yaml", &http_slice(NAMESPACE, "web-6", SERVICE, &v6))?;
    s.manifests.write(
        "slice4.yaml",
        &http_slice(NAMESPACE, "web-4", SERVICE, &[pod_endpoint(1)]),
    )?;
    start(&mut s)?;
    let node6: IpAddr = "fd00:10::1".parse()?;
    let ext6: IpAddr = "fd00:10::2".parse()?;
    let target = SocketAddr::new(node6, NODE_PORT);
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, target, "IPv6 NodePort answered", is_pod)?;
    let attempts = client.run(target, 20)?;
    let counts = tally(&attempts);
    eprintln!("[{node6}]:{NODE_PORT}: {counts:?}");
    s.ensure(attempts.iter().all(is_pod) && counts.len() == 2, || {
        format!("IPv6 NodePort: both pods should answer: {counts:?}")
    })?;
    let seen: Vec<_> = attempts.iter().filter_map(client_seen).collect();
    s.ensure(seen.iter().all(|ip| *ip == node6), || {
        format!("eTP Cluster over IPv6 must SNAT to the node: {seen:?}")
    })?;

    s.manifests
        .write("svc.yaml", &dual_stack_service("Local"))?;
    let local = s.wait_for_datapath_with(&client, target, "IPv6 eTP Local", |a| {
        client_seen(a) == Some(ext6)
    })?;
    eprintln!("IPv6 eTP Local: {local:?}");
    Ok(())
}

#[test]
fn node_port_forwards_to_a_pod_on_another_node() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    s.topo.add_remote_node(1, BACKEND_PORT)?;
    s.manifests.write("svc.yaml", &lb_service("Cluster", &[]))?;
    s.manifests.write(
        "slice.yaml",
        &http_slice(
            NAMESPACE,
            "web-1",
            SERVICE,
            &[remote_endpoint(Topology::remote_pod_ip(1))],
        ),
    )?;
    start(&mut s)?;
    let client = ext_client()(&s);
    let is_remote = |a: &Attempt| a.backend() == Some("rpod1");
    let first =
        s.wait_for_datapath_with(&client, node_port_addr(), "remote pod answered", is_remote)?;
    eprintln!("NodePort on node A → pod on node B: {first:?}");
    let attempts = client.run(node_port_addr(), 10)?;
    s.ensure(attempts.iter().all(is_remote), || {
        format!("all through node A to rpod1: {:?}", tally(&attempts))
    })?;
    // SNAT to node A's address: the reply goes back through A (and is translated there),
    // and the client sees the NodePort as its peer.
    let seen: Vec<_> = attempts.iter().filter_map(client_seen).collect();
    s.ensure(
        seen.iter()
            .all(|ip| *ip == IpAddr::V4(Topology::node_ext_ip())),
        || format!("client addresses seen by the remote pod: {seen:?}"),
    )?;
    // Real TCP closes (FIN both ways through node A) mark the flows' forward entries closing,
    // so their SNAT ports are free again 10 s later. Polled: the last close may still be on
    // its way.
    let bpf_root = s.agent()?.bpf_root().to_path_buf();
    let mut counts = (0, 0);
    proxy_tests::wait::try_wait_until(
        "the 10 closed connections' conntrack entries closing",
        DATAPATH_TIMEOUT,
        Duration::from_millis(100),
        || {
            counts = closing_forward_entries(&bpf_root, Topology::remote_pod_ip(1))
                .map_err(|e| proxy_tests::RigError::Other(e.to_string()))?;
            Ok(counts.0 >= attempts.len())
        },
    )
    .map_err(|e| anyhow::anyhow!("{e}; (closing, forward) {counts:?}"))?;
    eprintln!(
        "forward entries to rpod1: {} closing of {}",
        counts.0, counts.1
    );
    Ok(())
}

/// (closing, all) forward TCP entries of the tc conntrack that rewrite to `backend`, through
/// the pins.
fn closing_forward_entries(
    bpf_root: &std::path::Path,
    backend: Ipv4Addr,
) -> anyhow::Result<(usize, usize)> {
    use proxy_common::{ct_flags, proto};
    let ct = proxy_dataplane_ebpf::ConntrackMaps::open_pinned(
        &bpf_root.join(proxy_dataplane_ebpf::PIN_DIR_NAME),
    )?;
    let backend = u32::from_ne_bytes(backend.octets());
    let mut counts = (0, 0);
    for (key, value) in ct.entries() {
        if key.proto == proto::TCP && value.flags & ct_flags::REPLY == 0 && value.dst[0] == backend
        {
            counts.1 += 1;
            counts.0 += usize::from(value.flags & ct_flags::CLOSING != 0);
        }
    }
    Ok(counts)
}

/// How many of `count` attempts at each of the Service's external addresses (NodePort,
/// externalIP, LB IP) a pod answered.
fn answered(s: &Scenario, count: u32) -> anyhow::Result<Vec<(SocketAddr, usize)>> {
    let client = Client::new(s.topo.ext().path()).timeout(Duration::from_millis(700));
    let mut out = Vec::new();
    for target in [
        node_port_addr(),
        SocketAddr::new(EXTERNAL_IP.into(), 80),
        SocketAddr::new(LB_IP.into(), 80),
    ] {
        let attempts = client.run(target, count)?;
        out.push((target, attempts.iter().filter(|a| is_pod(a)).count()));
    }
    Ok(out)
}

/// Deletes every entry of the node namespace's kernel conntrack (both families).
fn forget_kernel_flows(s: &Scenario) -> anyhow::Result<()> {
    use proxy_kernel::conntrack::Ctnetlink;
    use proxy_model::ip_family::IpFamily;
    proxy_tests::netns::on_thread_in(&s.topo.node().path(), || -> anyhow::Result<()> {
        let mut ctnetlink = Ctnetlink::open()?;
        for family in [IpFamily::V4, IpFamily::V6] {
            for entry in ctnetlink.dump(family)? {
                // An entry that expired since the dump is already what we want.
                let _ = ctnetlink.delete(&entry.original);
            }
        }
        Ok(())
    })?
}

/// A netfilter rule of the host drops one external client (the `ext` namespace's address) in
/// FORWARD: once as an iptables rule, once as an nftables chain in a table of its own (as a
/// CNI's would be). Returns what each address answered without the rule, with the iptables
/// rule, with the nft rule. The rules are removed again before returning.
fn answered_under_forward_policy(s: &Scenario) -> anyhow::Result<[Vec<(SocketAddr, usize)>; 3]> {
    let node = s.topo.node();
    let client = Topology::ext_ip().to_string();
    let open = answered(s, 3)?;
    // The open connections stay in the kernel's conntrack (TIME_WAIT): a later connection that
    // happens to reuse one's client port to the same backend shares its tuple and takes the
    // fast path, which skips FORWARD by design (`client_port_reuse.rs` tests that case). The
    // policy phases are about new tuples.
    forget_kernel_flows(s)?;
    node.exec("iptables", &["-I", "FORWARD", "-s", &client, "-j", "DROP"])?;
    let iptables = answered(s, 3);
    node.exec("iptables", &["-D", "FORWARD", "-s", &client, "-j", "DROP"])?;
    forget_kernel_flows(s)?;
    node.exec("nft", &["add", "table", "inet", "foreign_policy"])?;
    node.exec(
        "nft",
        &[
            "add chain inet foreign_policy policy_forward { type filter hook forward priority 0; policy accept; }",
        ],
    )?;
    node.exec(
        "nft",
        &[
            "add",
            "rule",
            "inet",
            "foreign_policy",
            "policy_forward",
            "ip",
            "saddr",
            &client,
            "drop",
        ],
    )?;
    let nft = answered(s, 3);
    node.exec("nft", &["delete", "table", "inet", "foreign_policy"])?;
    Ok([open, iptables?, nft?])
}

/// What `proxy-agent inspect explain` says about netfilter for the external client's NodePort
/// connection (eBPF mode): `"netfilter path: …"` or `"--tc-fast-path: …"`.
fn explained_netfilter(s: &mut Scenario) -> anyhow::Result<String> {
    let client = Topology::ext_ip().to_string();
    let to = format!("{}/tcp", node_port_addr());
    let e = s.inspect_json(&[
        "explain", "--json", "--from", "external", "--client", &client, "--to", &to,
    ])?;
    Ok(e["netfilter"].as_str().unwrap_or_default().to_owned())
}

fn all_answered(results: &[(SocketAddr, usize)], count: usize) -> bool {
    results.iter().all(|(_, n)| *n == count)
}

/// The host's FORWARD policy applies to NodePort, externalIP and LB IP traffic to
/// local pods in both modes, as with kube-proxy — an iptables FORWARD drop or a foreign nft
/// table's forward chain blocks the client; removing the rule lets it through again.
#[test]
fn host_forward_policy_applies_to_external_traffic_in_both_modes() -> anyhow::Result<()> {
    for mode in ["ebpf", "iptables"] {
        let mut s = setup(1)?;
        write_lb_on_pod1(&s)?;
        s.start_agent_with_args(mode, &["--interfaces", "vext"])?;
        let client = ext_client()(&s);
        s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
        if mode == "ebpf" {
            // explain predicts what the FORWARD drops below show.
            let path = explained_netfilter(&mut s)?;
            s.ensure(path.starts_with("netfilter path"), || {
                format!("explain must say FORWARD applies: {path:?}")
            })?;
        }
        let [open, iptables, nft] = answered_under_forward_policy(&s)?;
        eprintln!("{mode}: open {open:?}, iptables drop {iptables:?}, nft drop {nft:?}");
        s.ensure(all_answered(&open, 3), || {
            format!("{mode}: without a rule: {open:?}")
        })?;
        s.ensure(all_answered(&iptables, 0), || {
            format!("{mode}: an iptables FORWARD drop must block the client: {iptables:?}")
        })?;
        s.ensure(all_answered(&nft, 0), || {
            format!("{mode}: a foreign nft forward drop must block the client: {nft:?}")
        })?;
        s.ensure(all_answered(&answered(&s, 3)?, 3), || {
            format!("{mode}: answered again once the rules are gone")
        })?;
    }
    Ok(())
}

/// `--tc-fast-path` keeps the redirect that skips FORWARD: its documented consequence is that
/// the same drop does not apply (measured here so that the documentation stays true).
#[test]
fn fast_path_skips_the_host_forward_policy() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    write_lb_on_pod1(&s)?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext", "--tc-fast-path"])?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    let path = explained_netfilter(&mut s)?;
    s.ensure(path.starts_with("--tc-fast-path"), || {
        format!("explain must say FORWARD does not apply: {path:?}")
    })?;
    let [open, iptables, nft] = answered_under_forward_policy(&s)?;
    eprintln!("fast path: open {open:?}, iptables drop {iptables:?}, nft drop {nft:?}");
    s.ensure(all_answered(&open, 3), || {
        format!("without a rule: {open:?}")
    })?;
    s.ensure(all_answered(&iptables, 3), || {
        format!("the fast path bypasses FORWARD: {iptables:?}")
    })?;
    s.ensure(all_answered(&nft, 3), || {
        format!("the fast path bypasses FORWARD: {nft:?}")
    })?;
    Ok(())
}

/// Packets the foreign TCX program marked, by the nft counter in the node namespace.
fn marked_packets(s: &Scenario) -> anyhow::Result<u64> {
    let out = s
        .topo
        .node()
        .exec("nft", &["list", "chain", "inet", "foreign_count", "pre"])?;
    let count = out
        .split("packets ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok());
    count.ok_or_else(|| anyhow::anyhow!("no counter in {out}"))
}

/// Good neighbour: a TCX program attached to the external interface after ours (so
/// behind it in the chain) keeps seeing the interface's traffic — Service traffic we translate
/// and traffic that is not ours — across an agent restart and after `--cleanup`, which leave
/// it attached. It marks what it sees; an nft counter in a foreign table counts the mark.
/// With our programs ending the chain (`TC_ACT_OK` = `TCX_PASS`) it saw nothing.
/// The LoadBalancer Service (eTP Cluster, no source ranges) with pod 1 as its endpoint.
fn write_lb_on_pod1(s: &Scenario) -> anyhow::Result<()> {
    s.manifests.write("svc.yaml", &lb_service("Cluster", &[]))?;
    s.manifests.write(
        "slice.yaml",
        &http_slice(NAMESPACE, "web-1", SERVICE, &[pod_endpoint(1)]),
    )?;
    Ok(())
}

/// A NodePort Service on pod 1 served by the agent (answered from outside), and a foreign TCX
/// program behind ours on `vext` that marks what it sees, counted by an nft rule in a foreign
/// table. The guard detaches the foreign program.
fn serve_with_a_foreign_tcx_program(
    s: &mut Scenario,
) -> anyhow::Result<proxy_tests::foreign_tc::ForeignTcx> {
    use proxy_tests::foreign_tc::ForeignTcx;
    write_lb_on_pod1(s)?;
    start(s)?;
    let client = ext_client()(s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    let node = s.topo.node();
    count_foreign_marks(node)?;
    Ok(ForeignTcx::attach(&node.path(), "vext")?)
}

/// An nft counter in a table of its own in the node's PREROUTING (read by [`marked_packets`])
/// of the packets that carry the foreign program's mark bits.
fn count_foreign_marks(node: &proxy_tests::netns::Netns) -> anyhow::Result<()> {
    let mark = proxy_tests::foreign_tc::FOREIGN_MARK;
    node.exec("nft", &["add", "table", "inet", "foreign_count"])?;
    node.exec(
        "nft",
        &["add chain inet foreign_count pre { type filter hook prerouting priority -300; }"],
    )?;
    node.exec(
        "nft",
        &[&format!(
            "add rule inet foreign_count pre meta mark and {mark:#x} == {mark:#x} counter"
        )],
    )?;
    Ok(())
}

/// 3 × 3 exchanges answered, and the foreign program saw them: each answered TCP exchange is
/// at least SYN, ACK and the request from the client.
fn foreign_program_sees_served_traffic(s: &Scenario, when: &str) -> anyhow::Result<()> {
    let before = marked_packets(s)?;
    let answered = answered(s, 3)?;
    let seen = marked_packets(s)? - before;
    eprintln!("{when}: answered {answered:?}, foreign program saw {seen} packets");
    s.ensure(all_answered(&answered, 3), || {
        format!("{when}: Service traffic must still be served: {answered:?}")
    })?;
    s.ensure(seen >= 27, || {
        format!("{when}: the foreign program saw only {seen} packets of 9 connections")
    })?;
    Ok(())
}

#[test]
fn a_foreign_tcx_program_behind_ours_keeps_seeing_traffic() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    let _foreign = serve_with_a_foreign_tcx_program(&mut s)?;
    let client = ext_client()(&s);

    let check = foreign_program_sees_served_traffic;
    check(&s, "behind the running agent")?;
    s.stop_agent()?;
    start(&mut s)?;
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    check(&s, "after an agent restart")?;

    let status = s.agent()?.run_cleanup()?;
    s.ensure(status.success(), || {
        format!("--cleanup exited with {status}")
    })?;
    let before = marked_packets(&s)?;
    let _ = client.run(node_port_addr(), 2)?;
    let seen = marked_packets(&s)? - before;
    s.ensure(seen >= 2, || {
        format!("after --cleanup the foreign program must still be attached: saw {seen}")
    })?;
    Ok(())
}

/// `tc filter show` of `vext`'s ingress hook in the node namespace.
fn ingress_filters(s: &Scenario) -> anyhow::Result<String> {
    Ok(s.topo
        .node()
        .exec("tc", &["filter", "show", "dev", "vext", "ingress"])?)
}

/// The program id of our filter on `vext`'s ingress hook (`… name kpr_tc_external … id N`).
fn our_program_id_in(filters: &str) -> Option<u32> {
    let line = filters.lines().find(|l| l.contains("kpr_tc_external"))?;
    let mut words = line.split_whitespace();
    words.find(|w| *w == "id")?;
    words.next()?.parse().ok()
}

fn our_program_id(s: &Scenario) -> anyhow::Result<Option<u32>> {
    Ok(our_program_id_in(&ingress_filters(s)?))
}

/// Waits (bounded by [`DATAPATH_TIMEOUT`]) until `vext`'s ingress filters satisfy `ready`.
fn wait_for_filters(s: &Scenario, what: &str, ready: impl Fn(&str) -> bool) -> anyhow::Result<()> {
    proxy_tests::wait::try_wait_until(what, DATAPATH_TIMEOUT, Duration::from_millis(50), || {
        Ok(ready(&s.topo.node().exec(
            "tc",
            &["filter", "show", "dev", "vext", "ingress"],
        )?))
    })?;
    Ok(())
}

/// Kernel floor: with TCX forced off (`--bpf-disable-feature tcx`, the path of
/// kernels older than 6.6) the tc programs attach as legacy clsact filters in our slot
/// (priority 27504 = 0x6b70), serve external traffic, and a foreign legacy filter behind ours
/// (priority 40000, another component's `cls_bpf` program that marks what it sees) keeps seeing
/// the interface's traffic: after our attach, across a restart (our filter replaced in place,
/// the foreign one untouched), a restart onto TCX (our legacy filters removed, the foreign one
/// kept) and `--cleanup`.
#[test]
fn legacy_tc_attach_serves_external_traffic_next_to_a_foreign_filter() -> anyhow::Result<()> {
    use proxy_tests::foreign_tc::ForeignLegacyFilter;
    let mut s = setup(1)?;
    write_lb_on_pod1(&s)?;
    let node = s.topo.node();
    count_foreign_marks(node)?;
    let _foreign = ForeignLegacyFilter::attach(node, "vext", 40000)?;
    let legacy = ["--interfaces", "vext", "--bpf-disable-feature", "tcx"];
    s.start_agent_with_args("ebpf", &legacy)?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;

    let check = |s: &Scenario, when: &str, ours_legacy: bool| -> anyhow::Result<()> {
        let filters = ingress_filters(s)?;
        s.ensure(
            filters.contains("pref 40000") && filters.contains("pref 27504") == ours_legacy,
            || format!("{when}: ingress filters:\n{filters}"),
        )?;
        s.ensure(filters.contains("kpr_tc_external") == ours_legacy, || {
            format!("{when}: our filter should be there: {ours_legacy}:\n{filters}")
        })?;
        let before = marked_packets(s)?;
        let answered = answered(s, 3)?;
        let seen = marked_packets(s)? - before;
        eprintln!("{when}: answered {answered:?}, foreign filter saw {seen} packets");
        s.ensure(all_answered(&answered, 3), || {
            format!("{when}: Service traffic must be served: {answered:?}")
        })?;
        s.ensure(seen >= 27, || {
            format!("{when}: the filter behind ours saw only {seen} packets of 9 connections")
        })?;
        Ok(())
    };
    check(&s, "legacy attach", true)?;
    let first_program = our_program_id(&s)?;
    // Same bpffs, object and options: the new agent reuses the pinned program (no load) and
    // attaches it again in our slot, so the filter keeps the same program.
    s.agent()?.stop()?;
    s.agent()?.restart()?;
    let agent = s.agent()?;
    proxy_tests::wait::wait_until(
        "the restarted agent's first sync",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || agent.syncs() >= 1,
    )?;
    let reused = our_program_id(&s)?;
    s.ensure(reused.is_some() && reused == first_program, || {
        format!(
            "a restart on the legacy path reuses the pinned program: {first_program:?} → {reused:?}"
        )
    })?;
    check(&s, "after a restart on the legacy path", true)?;
    let filters = ingress_filters(&s)?;
    s.ensure(
        filters.lines().filter(|l| l.contains("kpr_tc")).count() == 1,
        || format!("a restart replaces our filter in place, it does not add one:\n{filters}"),
    )?;

    s.agent()?.stop()?;
    s.agent()?.restart_with_args(&["--interfaces", "vext"])?;
    wait_for_filters(&s, "our legacy filter removed", |filters| {
        !filters.contains("kpr_tc")
    })?;
    check(&s, "after a restart onto TCX", false)?;

    s.agent()?.stop()?;
    s.agent()?.restart_with_args(&legacy)?;
    wait_for_filters(&s, "our legacy filter back", |filters| {
        filters.contains("kpr_tc")
    })?;
    let status = s.agent()?.run_cleanup()?;
    s.ensure(status.success(), || {
        format!("--cleanup exited with {status}")
    })?;
    let filters = ingress_filters(&s)?;
    s.ensure(
        filters.contains("pref 40000") && !filters.contains("kpr_tc"),
        || format!("--cleanup removes our filters only:\n{filters}"),
    )?;
    let before = marked_packets(&s)?;
    let _ = client.run(node_port_addr(), 2)?;
    let seen = marked_packets(&s)? - before;
    s.ensure(seen >= 2, || {
        format!("after --cleanup the foreign filter must still see traffic: saw {seen}")
    })?;
    Ok(())
}

/// A foreign filter in our slot (priority 27504, handle 0x6b70) is not ours to replace: the
/// agent leaves it there, says so naming it, and keeps running (ClusterIP still works).
#[test]
fn legacy_tc_attach_never_replaces_a_foreign_filter_in_our_slot() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    write_lb_on_pod1(&s)?;
    let node = s.topo.node();
    node.exec("tc", &["qdisc", "add", "dev", "vext", "clsact"])?;
    node.exec(
        "tc",
        &[
            "filter",
            "add",
            "dev",
            "vext",
            "ingress",
            "prio",
            "27504",
            "handle",
            "0x6b70",
            "protocol",
            "all",
            "bpf",
            "bytecode",
            "1,6 0 0 4294967295,",
        ],
    )?;
    s.start_agent_with_args(
        "ebpf",
        &["--interfaces", "vext", "--bpf-disable-feature", "tcx"],
    )?;
    let cluster_ip = SocketAddr::new(CLUSTER_IP.into(), 80);
    // Still running and serving: the socket programs are not the tc filter's business.
    s.wait_for_datapath(cluster_ip, "ClusterIP answered", is_pod)?;
    let log = s.agent()?.log_contents();
    s.ensure(
        log.contains("belongs to another component") && log.contains("vext ingress"),
        || "the agent must say which filter it left alone".to_owned(),
    )?;
    let filters = ingress_filters(&s)?;
    s.ensure(
        filters.contains("bytecode") && !filters.contains("kpr_tc_external"),
        || format!("the foreign filter must stay as it was:\n{filters}"),
    )?;
    Ok(())
}

/// `max_entries` of the pinned tc conntrack maps (IPv4, IPv6) under the agent's bpffs root
/// `root`.
fn conntrack_capacity(root: &std::path::Path) -> anyhow::Result<(u32, u32)> {
    use aya::maps::MapInfo;
    let pin = |name: &str| MapInfo::from_pin(root.join("kubeproxy-rs").join(name));
    Ok((pin("KPR_CT4")?.max_entries(), pin("KPR_CT6")?.max_entries()))
}

/// Hygiene: `--bpf-map-conntrack` sizes the tc conntrack map like the other
/// `--bpf-map-*` flags, also across a restart with another size (aya would reuse the pin at
/// its old size; the agent replaces it), and external traffic is served with it.
#[test]
fn conntrack_map_size_follows_its_flag_across_restarts() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    write_lb_on_pod1(&s)?;
    s.start_agent_with_args(
        "ebpf",
        &["--interfaces", "vext", "--bpf-map-conntrack", "4096"],
    )?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    let root = s.agent()?.bpf_root().to_path_buf();
    let first = conntrack_capacity(&root)?;
    s.agent()?.stop()?;
    s.agent()?
        .restart_with_args(&["--interfaces", "vext", "--bpf-map-conntrack", "8192"])?;
    proxy_tests::wait::try_wait_until(
        "the conntrack map resized",
        DATAPATH_TIMEOUT,
        Duration::from_millis(50),
        || Ok(conntrack_capacity(&root).is_ok_and(|n| n == (8192, 8192))),
    )?;
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    s.ensure(first == (4096, 4096), || format!("first sizes {first:?}"))?;
    Ok(())
}

/// Good neighbour across a mode switch: a foreign TCX program behind ours keeps
/// seeing the external interface's traffic when the agent switches to the iptables mode (which
/// removes our links and pins: their directory is gone) and back to eBPF (ours attached again,
/// appended behind it — it still sees everything, ours pass it on).
#[test]
fn a_foreign_tcx_program_keeps_seeing_traffic_across_mode_switches() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    let _foreign = serve_with_a_foreign_tcx_program(&mut s)?;
    let client = ext_client()(&s);
    let check = foreign_program_sees_served_traffic;
    check(&s, "eBPF mode")?;
    let pins = s.agent()?.bpf_root().join("kubeproxy-rs");
    s.agent()?.stop()?;
    // Removed at the first sync, without draining the flows `check` left (closed, they would
    // hold the eBPF mode for their 10 s close timeout: `takeover.rs` tests the drain).
    s.agent()?.restart_in_mode_with_args(
        "iptables",
        &["--interfaces", "vext", "--mode-switch-drain-period", "0s"],
    )?;
    proxy_tests::wait::wait_until(
        "the eBPF mode's pins removed by the iptables mode",
        DATAPATH_TIMEOUT,
        Duration::from_millis(50),
        || !pins.exists(),
    )?;
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    check(&s, "iptables mode, after the switch")?;
    s.agent()?.stop()?;
    s.agent()?.restart_in_mode("ebpf")?;
    proxy_tests::wait::wait_until(
        "our tc links pinned again",
        DATAPATH_TIMEOUT,
        Duration::from_millis(50),
        || {
            pins.join(format!("kpr_tc_external_if{}_link", ifindex_in(&s, "vext")))
                .exists()
        },
    )?;
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    check(&s, "eBPF mode again")?;
    Ok(())
}

/// The index of `interface` in the node namespace.
fn ifindex_in(s: &Scenario, interface: &str) -> u32 {
    s.topo
        .node()
        .exec("cat", &[&format!("/sys/class/net/{interface}/ifindex")])
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(0)
}

/// Links of interfaces that go away are detached and their pins removed. A veth
/// with an address appears on the node (a pod's): it gets our reply and egress programs,
/// pinned per ifindex; once it is deleted (its address goes with it, which triggers a sync)
/// both pins are removed, and the other interfaces keep theirs.
#[test]
fn links_of_deleted_interfaces_are_unpinned() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    write_lb_on_pod1(&s)?;
    start(&mut s)?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    s.topo.node().ip(&[
        "link", "add", "vgone", "type", "veth", "peer", "name", "vgonep",
    ])?;
    s.topo
        .node()
        .ip(&["addr", "add", "10.250.0.1/24", "dev", "vgone"])?;
    s.topo.node().ip(&["link", "set", "vgone", "up"])?;
    let index = ifindex_in(&s, "vgone");
    let pins = s.agent()?.bpf_root().join("kubeproxy-rs");
    let ours = |pins: &std::path::Path| -> Vec<String> {
        std::fs::read_dir(pins)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|name| name.ends_with(&format!("_if{index}_link")))
                    .collect()
            })
            .unwrap_or_default()
    };
    // A sync happens when an address appears (netlink watch); touching the manifests too.
    s.manifests.write("svc.yaml", &lb_service("Cluster", &[]))?;
    proxy_tests::wait::wait_until(
        "the new interface's links pinned",
        DATAPATH_TIMEOUT,
        Duration::from_millis(50),
        || ours(&pins).len() == 2,
    )?;
    eprintln!("pinned for vgone (ifindex {index}): {:?}", ours(&pins));
    s.topo.node().ip(&["link", "del", "vgone"])?;
    proxy_tests::wait::wait_until(
        "the deleted interface's pins removed",
        DATAPATH_TIMEOUT,
        Duration::from_millis(50),
        || ours(&pins).is_empty(),
    )?;
    let vext = ifindex_in(&s, "vext");
    s.ensure(
        pins.join(format!("kpr_tc_external_if{vext}_link")).exists(),
        || "the external interface keeps its link".to_owned(),
    )?;
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    Ok(())
}

/// The MAC address of `interface` in `netns`.
fn mac_of(netns: &proxy_tests::netns::Netns, interface: &str) -> anyhow::Result<String> {
    let out = netns.ip(&["-br", "link", "show", "dev", interface])?;
    out.split_whitespace()
        .nth(2)
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("no MAC for {interface} in {out:?}"))
}

/// A datapath counter by reason, read from the pinned counters with `inspect counters` (the
/// metric follows the counters only at each sync).
fn datapath_events(s: &mut Scenario, reason: &str) -> anyhow::Result<u64> {
    let bpf_root = s.agent()?.bpf_root().to_path_buf();
    let output = std::process::Command::new("nsenter")
        .arg(format!("--net={}", s.topo.node().path().display()))
        .arg(proxy_tests::agent::agent_binary()?)
        .arg("--bpf-root")
        .arg(bpf_root)
        .args(["inspect", "counters"])
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect counters: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8(output.stdout)?;
    Ok(table
        .lines()
        .find(|line| line.split_whitespace().next() == Some(reason))
        .and_then(|line| line.split_whitespace().last())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0))
}

/// A hardware-stripped VLAN tag (`skb->vlan_tci`, as a NIC with VLAN offload
/// delivers it; made here by a tagging program on the client's egress, which veth carries
/// across) is never redirected with the packet. A priority tag (VLAN 0, which the stack
/// serves on the interface itself) is served and popped before the redirect; a packet of
/// another VLAN belongs to the VLAN device stacked on the interface (whose own program serves
/// it), so the program leaves it untranslated to the stack (this kernel has no 802.1Q
/// devices, so the stack then drops it, as a node without that VLAN would) and counts it.
#[test]
fn vlan_tagged_packets_are_never_redirected_with_their_tag() -> anyhow::Result<()> {
    use proxy_tests::foreign_tc::ForeignTcx;
    let mut s = setup(1)?;
    write_lb_on_pod1(&s)?;
    s.start_agent_with_args("ebpf", &["--interfaces", "vext", "--tc-fast-path"])?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    // Tagged ARP would go unanswered: static neighbours both ways.
    let node_mac = mac_of(s.topo.node(), "vext")?;
    let ext_mac = mac_of(s.topo.ext(), "eth0")?;
    let node_ip = Topology::node_ext_ip().to_string();
    let ext_ip = Topology::ext_ip().to_string();
    s.topo.ext().ip(&[
        "neigh",
        "replace",
        &node_ip,
        "lladdr",
        &node_mac,
        "dev",
        "eth0",
        "nud",
        "permanent",
    ])?;
    s.topo.node().ip(&[
        "neigh",
        "replace",
        &ext_ip,
        "lladdr",
        &ext_mac,
        "dev",
        "vext",
        "nud",
        "permanent",
    ])?;
    let ext = s.topo.ext().path();

    let priority = ForeignTcx::attach_vlan_tagger(&ext, "eth0", 0)?;
    let attempts = client.run(node_port_addr(), 5)?;
    s.ensure(attempts.iter().all(is_pod), || {
        format!(
            "priority-tagged (VLAN 0) connections are served: {:?}",
            tally(&attempts)
        )
    })?;
    drop(priority);

    let left_before = datapath_events(&mut s, "tc_vlan_left_to_stack")?;
    let translated_before = datapath_events(&mut s, "tc_translated")?;
    let _vlan = ForeignTcx::attach_vlan_tagger(&ext, "eth0", 100)?;
    let attempts = Client::new(s.topo.ext().path())
        .timeout(Duration::from_millis(500))
        .run(node_port_addr(), 3)?;
    let left = datapath_events(&mut s, "tc_vlan_left_to_stack")? - left_before;
    let translated = datapath_events(&mut s, "tc_translated")? - translated_before;
    eprintln!(
        "VLAN 100: {:?}, left to the stack {left}, translated {translated}",
        tally(&attempts)
    );
    s.ensure(!attempts.iter().any(is_pod), || {
        format!(
            "VLAN 100 packets must not reach the pod: {:?}",
            tally(&attempts)
        )
    })?;
    s.ensure(left >= 3, || {
        format!("each VLAN 100 SYN is counted as left to the stack: {left}")
    })?;
    s.ensure(translated == 0, || {
        format!("no VLAN 100 packet is translated: {translated}")
    })?;
    Ok(())
}

/// Another tool detaches our program from the external interface (`bpftool link detach`, what
/// a careless upgrade of another tc tool does): NodePort goes at once, and the next sync finds
/// the link's program missing from the hook and attaches it again.
#[test]
fn a_tc_program_detached_behind_the_agents_back_is_attached_again_at_the_next_sync()
-> anyhow::Result<()> {
    let mut s = setup(1)?;
    write_lb_on_pod1(&s)?;
    start(&mut s)?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    let ifindex = s
        .topo
        .node()
        .exec("cat", &["/sys/class/net/vext/ifindex"])?;
    let pin = s
        .agent()?
        .bpf_root()
        .join("kubeproxy-rs")
        .join(format!("kpr_tc_external_if{}_link", ifindex.trim()));
    s.topo.node().exec(
        "bpftool",
        &["link", "detach", "pinned", &pin.to_string_lossy()],
    )?;
    let detached = client
        .clone()
        .timeout(Duration::from_millis(500))
        .once(node_port_addr())?;
    s.ensure(!is_pod(&detached), || {
        format!("with our program detached, the NodePort reaches no pod: {detached:?}")
    })?;
    // A sync: another Service appears.
    let syncs = s.agent()?.syncs();
    s.manifests.write(
        "other.yaml",
        &http_service(NAMESPACE, "other", Ipv4Addr::new(10, 96, 0, 21)),
    )?;
    let agent = s.agent()?;
    proxy_tests::wait::wait_until(
        "a sync after the detach",
        Duration::from_secs(20),
        Duration::from_millis(100),
        || agent.syncs() > syncs,
    )?;
    let answered = client.run(node_port_addr(), 6)?;
    s.ensure(answered.iter().all(is_pod), || {
        format!("after the next sync the NodePort reaches the pod again: {answered:?}")
    })?;
    Ok(())
}

/// The program in the IPv6 external slot of the pinned `KPR_TC_FAMILY`, by the name the kernel
/// keeps (its first 15 bytes); `None` when the slot is empty.
fn ipv6_family_program(s: &mut Scenario) -> anyhow::Result<Option<String>> {
    use std::os::fd::AsFd as _;
    let pin = s
        .agent()?
        .bpf_root()
        .join(proxy_dataplane_ebpf::PIN_DIR_NAME)
        .join(proxy_common::map_names::TC_FAMILY);
    let map = aya::maps::MapData::from_pin(&pin)?;
    let slot = proxy_common::TcFamilyProgram::External6 as u32;
    let Some(id) = proxy_kernel::bpf::bpf_syscall::program_array_slot(map.fd().as_fd(), slot)?
    else {
        return Ok(None);
    };
    Ok(aya::programs::loaded_programs()
        .flatten()
        .find(|info| info.id() == id)
        .and_then(|info| info.name_as_str().map(str::to_owned)))
}

/// An IPv4-only cluster gets no IPv6 tc programs (the idle one holds their slots, and the
/// verifier never sees them); the first IPv6 Service loads them before its frontends are
/// written, so its NodePort answers from its pods, and a restart that reuses the pinned
/// programs finds them in their slots and loads nothing again.
#[test]
fn ipv6_programs_wait_for_the_first_ipv6_service_and_a_restart_keeps_them() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    const LOADED: &str = "IPv6 tc programs loaded for the node's first IPv6 Service";
    let mut s = Scenario::with_families(2, true)?;
    s.manifests.write(
        "svc.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {SERVICE}\n  namespace: {NAMESPACE}\n\
             spec:\n  type: NodePort\n  clusterIP: \"{CLUSTER_IP}\"\n  clusterIPs: [\"{CLUSTER_IP}\"]\n\
             \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
             \x20   nodePort: {NODE_PORT}\n"
        ),
    )?;
    s.manifests.write(
        "slice4.yaml",
        &http_slice(NAMESPACE, "web-4", SERVICE, &[pod_endpoint(1)]),
    )?;
    start(&mut s)?;
    let client = ext_client()(&s);
    s.wait_for_datapath_with(&client, node_port_addr(), "IPv4 NodePort answered", is_pod)?;
    let log = s.agent()?.log_contents();
    s.ensure(log.contains("ipv6_programs=false"), || {
        "a start without IPv6 state leaves the IPv6 programs out".into()
    })?;
    let idle = ipv6_family_program(&mut s)?;
    s.ensure(idle.as_deref() == Some("kpr_tc_idle"), || {
        format!("the IPv6 slot holds the idle program: {idle:?}")
    })?;
    let node6: IpAddr = "fd00:10::1".parse()?;
    let target = SocketAddr::new(node6, NODE_PORT);
    let before = client.run(target, 3)?;
    s.ensure(!before.iter().any(is_pod), || {
        format!("no IPv6 Service, no pod behind [{node6}]:{NODE_PORT}: {before:?}")
    })?;

    s.manifests
        .write("svc.yaml", &dual_stack_service("Cluster"))?;
    let v6 = [pod_endpoint_family(1, true), pod_endpoint_family(2, true)];
    s.manifests
        .write("slice6.yaml", &http_slice(NAMESPACE, "web-6", SERVICE, &v6))?;
    s.wait_for_datapath_with(&client, target, "IPv6 NodePort answered", is_pod)?;
    let attempts = client.run(target, 20)?;
    let counts = tally(&attempts);
    s.ensure(attempts.iter().all(is_pod) && counts.len() == 2, || {
        format!("IPv6 NodePort after the lazy load: both pods answer: {counts:?}")
    })?;
    let log = s.agent()?.log_contents();
    s.ensure(log.matches(LOADED).count() == 1, || {
        "the IPv6 programs were loaded once, for the IPv6 Service".into()
    })?;
    let loaded = ipv6_family_program(&mut s)?;
    s.ensure(
        loaded
            .as_deref()
            .is_some_and(|name| name.starts_with("kpr_tc_extern")),
        || format!("the IPv6 slot holds the IPv6 external program: {loaded:?}"),
    )?;

    // A restart on the same object reuses the programs, the IPv6 ones in their slots too.
    s.agent()?.stop()?;
    s.agent()?.restart()?;
    proxy_tests::wait::try_wait_until(
        "the restarted agent's first sync",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || {
            let agent = s.agent()?;
            Ok(agent.log_contents().contains("ipv6_programs=true") && agent.syncs() >= 1)
        },
    )
    .map_err(|e| s.agent_error(format!("{e}: the restart did not find the IPv6 programs")))?;
    let log = s.agent()?.log_contents();
    s.ensure(
        log.contains("reused the pinned eBPF programs") && log.matches(LOADED).count() == 1,
        || "the restart reused the programs and loaded no IPv6 program again".into(),
    )?;
    let attempts = client.run(target, 20)?;
    let counts = tally(&attempts);
    s.ensure(attempts.iter().all(is_pod) && counts.len() == 2, || {
        format!("IPv6 NodePort after the restart: both pods answer: {counts:?}")
    })?;
    Ok(())
}
