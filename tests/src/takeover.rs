//! The mode-switch scenario: on a dual-stack node, TCP streams and UDP flows through
//! every kind of Service frontend, in both families, run while the node changes hands (one
//! proxy mode to another), and new connections keep arriving throughout. [`Traffic::finish`]
//! computes the figures per family — streams reset, streams stalled (more than 1 s,
//! the client's timeout, without an answer), UDP flows moved or stalled, new connections
//! failed — and [`report`] prints them (past the test harness's capture, so `cargo xtask test`
//! shows them) and fails unless every one is 0.
//!
//! The paths, per family, each with [`TCP_PER_PATH`] TCP streams, [`UDP_PER_PATH`] connected
//! UDP flows, and one new-connection loop per protocol:
//! - from outside to the NodePort of `web` (LoadBalancer, `externalTrafficPolicy: Cluster`);
//! - from outside to the NodePort of `local` (NodePort, `externalTrafficPolicy: Local`, both
//!   endpoints on this node);
//! - from outside to the LB IP of `web`;
//! - from a pod (pod 3, not an endpoint) to the ClusterIP of `web`;
//! - from a node process (in the agent's cgroup) to the ClusterIP of `web`.

use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::client::{Attempt, Client, Mode, Proto, tally};
use crate::manifests::endpoint_slice_yaml_family;
use crate::scenario::{
    BACKEND_PORT, CLUSTER_IP, CLUSTER_IP6, PORT_NAME, SERVICE_PORT, Scenario,
    http_and_dns_slice_ports, is_pod, pod_endpoint_family,
};
use crate::topology::{Place, Topology};
use crate::{Result, RigError};

/// TCP streams per path and family: 5 paths × 2 families × 20 = 200, the figure.
pub const TCP_PER_PATH: usize = 20;
/// Connected UDP flows per path and family: 5 × 2 × 5 = 50, the figure.
pub const UDP_PER_PATH: usize = 5;
/// Pause between a stream's exchanges (and between a loop's new connections).
pub const INTERVAL: Duration = Duration::from_millis(200);
/// The most exchanges per stream: 120 s at [`INTERVAL`]. The traffic runs until the transition
/// is over and [`AFTER`] more ([`Traffic::finish`]), however long the transition takes (an
/// eBPF agent's start alone took over 30 s on a loaded machine, the verifier checking each
/// program); this only bounds a run whose test failed before finishing it.
pub const EXCHANGES: u32 = 600;
/// How long the traffic keeps running once the transition is over: what follows it (the first
/// periodic syncs, the adoption of the other mode's flows, draining) is measured too.
pub const AFTER: Duration = Duration::from_secs(10);
/// A stream that waits this long for an answer is stalled (the definition).
pub const STALL: Duration = Duration::from_millis(1000);

/// The UDP port of `web` and `local`.
const UDP_PORT: u16 = 53;
const WEB_NODE_PORT: u16 = 30080;
const WEB_UDP_NODE_PORT: u16 = 30053;
const LOCAL_NODE_PORT: u16 = 30081;
const LOCAL_UDP_NODE_PORT: u16 = 30054;
/// `local`'s ClusterIPs (not a target: its NodePort is).
const LOCAL_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const LOCAL_CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x11);
/// `web`'s LB IPs, routed to the node by the external namespace.
pub const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 20);
pub const LB_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x198, 0, 0, 0, 0, 0, 0x20);
/// The pod whose process is a client; pods 1 and 2 are the endpoints.
const CLIENT_POD: usize = 3;
const ENDPOINTS: [usize; 2] = [1, 2];

/// Where a client runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Outside,
    Pod,
    Node,
}

/// One path of the scenario: a client place and a frontend.
#[derive(Debug, Clone, Copy)]
struct Path {
    what: &'static str,
    from: Origin,
    /// The TCP and the UDP port of the frontend; its address comes from [`Path::addr`].
    ports: (u16, u16),
    frontend: Frontend,
}

#[derive(Debug, Clone, Copy)]
enum Frontend {
    Node,
    LoadBalancer,
    Cluster,
}

const PATHS: [Path; 5] = [
    Path {
        what: "NodePort eTP Cluster",
        from: Origin::Outside,
        ports: (WEB_NODE_PORT, WEB_UDP_NODE_PORT),
        frontend: Frontend::Node,
    },
    Path {
        what: "NodePort eTP Local",
        from: Origin::Outside,
        ports: (LOCAL_NODE_PORT, LOCAL_UDP_NODE_PORT),
        frontend: Frontend::Node,
    },
    Path {
        what: "LB IP",
        from: Origin::Outside,
        ports: (SERVICE_PORT, UDP_PORT),
        frontend: Frontend::LoadBalancer,
    },
    Path {
        what: "ClusterIP from a pod",
        from: Origin::Pod,
        ports: (SERVICE_PORT, UDP_PORT),
        frontend: Frontend::Cluster,
    },
    Path {
        what: "ClusterIP from the node",
        from: Origin::Node,
        ports: (SERVICE_PORT, UDP_PORT),
        frontend: Frontend::Cluster,
    },
];

impl Path {
    fn addr(&self, proto: Proto, ipv6: bool) -> SocketAddr {
        let ip: IpAddr = match (self.frontend, ipv6) {
            (Frontend::Node, false) => Topology::node_ext_ip().into(),
            (Frontend::Node, true) => Topology::node_ext_ip6().into(),
            (Frontend::LoadBalancer, false) => LB_IP.into(),
            (Frontend::LoadBalancer, true) => LB_IP6.into(),
            (Frontend::Cluster, false) => CLUSTER_IP.into(),
            (Frontend::Cluster, true) => CLUSTER_IP6.into(),
        };
        let port = match proto {
            Proto::Tcp => self.ports.0,
            Proto::Udp => self.ports.1,
        };
        SocketAddr::new(ip, port)
    }

    fn client(&self, s: &Scenario, proto: Proto) -> Result<Client> {
        let client = match self.from {
            Origin::Outside => s.external_client(),
            Origin::Pod => s.pod_client(CLIENT_POD)?,
            Origin::Node => s.cgroup_client(),
        };
        Ok(client.proto(proto).timeout(STALL))
    }
}

/// The NodePort of `web` (`externalTrafficPolicy: Cluster`: masqueraded).
pub fn web_node_port(proto: Proto, ipv6: bool) -> SocketAddr {
    PATHS[0].addr(proto, ipv6)
}

/// The NodePort of `local` (`externalTrafficPolicy: Local`: the client's address kept).
pub fn local_node_port(proto: Proto, ipv6: bool) -> SocketAddr {
    PATHS[1].addr(proto, ipv6)
}

/// `web`'s LB IP and port (`externalTrafficPolicy: Cluster`: masqueraded).
pub fn load_balancer(proto: Proto, ipv6: bool) -> SocketAddr {
    PATHS[2].addr(proto, ipv6)
}

fn family(ipv6: bool) -> &'static str {
    if ipv6 { "IPv6" } else { "IPv4" }
}

/// A dual-stack Service `name` of `type_` with TCP 80 and UDP 53 → 8080.
fn service_yaml(
    name: &str,
    type_: &str,
    ips: (Ipv4Addr, Ipv6Addr),
    policy: &str,
    node_ports: (u16, u16),
    lb: Option<(Ipv4Addr, Ipv6Addr)>,
) -> String {
    let (ip, ip6) = ips;
    let (tcp, udp) = node_ports;
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  \
         type: {type_}\n  clusterIP: \"{ip}\"\n  clusterIPs: [\"{ip}\", \"{ip6}\"]\n  \
         ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  \
         externalTrafficPolicy: {policy}\n  ports:\n  - {{name: {PORT_NAME}, port: {SERVICE_PORT}, \
         targetPort: {BACKEND_PORT}, protocol: TCP, nodePort: {tcp}}}\n  - {{name: dns, port: \
         {UDP_PORT}, targetPort: {BACKEND_PORT}, protocol: UDP, nodePort: {udp}}}\n"
    );
    if let Some((lb, lb6)) = lb {
        yaml.push_str(&format!(
            "status:\n  loadBalancer:\n    ingress: [{{ip: \"{lb}\"}}, {{ip: \"{lb6}\"}}]\n"
        ));
    }
    yaml
}

/// The dual-stack rig: 3 pods serving both families (1 and 2 the endpoints, 3 a client),
/// `web` and `local` written, the LB IPs routed to the node by the external namespace. No
/// agent yet.
pub fn setup() -> Result<Scenario> {
    setup_with_endpoints(&ENDPOINTS)
}

/// [`setup`] with pod 1 as the only endpoint, and an agent in `mode` (with `args`) that serves
/// every path of both families.
pub fn served_by_pod1(mode: &str, args: &[&str]) -> Result<Scenario> {
    let mut s = setup_with_endpoints(&[1])?;
    s.start_agent_with_args(mode, args)?;
    wait_served(&mut s)?;
    Ok(s)
}

/// The agent's arguments for the eBPF datapath on `vext` of [`served_by_pod1`]'s rig: the
/// netfilter path, the fast path, and XDP (native) in front of the fast path.
pub const EBPF_NETFILTER_PATH: &[&str] = &["--interfaces", "vext"];
pub const EBPF_FAST_PATH: &[&str] = &["--interfaces", "vext", "--tc-fast-path"];
pub const EBPF_XDP: &[&str] = &[
    "--interfaces",
    "vext",
    "--tc-fast-path",
    "--bpf-xdp",
    "native",
];

/// [`served_by_pod1`]; with `--bpf-xdp` also a wire-like client link ([`wire_like_client`])
/// and a check that XDP runs on `vext`.
pub fn served_by_pod1_on(mode: &str, args: &[&str]) -> Result<Scenario> {
    let s = served_by_pod1(mode, args)?;
    if args.contains(&"--bpf-xdp") {
        wire_like_client(&s)?;
        s.ensure(xdp_attached(&s, "vext")?, || {
            "kpr_xdp_external runs on vext".to_owned()
        })?;
    }
    Ok(s)
}

/// Whether an XDP program is attached to `interface` in the node's namespace (`ip link`
/// prints `xdp` after the MTU when one is, whatever its mode).
pub fn xdp_attached(s: &Scenario, interface: &str) -> Result<bool> {
    let shown = s
        .topo
        .node()
        .exec("ip", &["link", "show", "dev", interface])?;
    Ok(shown.split_whitespace().any(|word| word.starts_with("xdp")))
}

/// The external client sends complete checksums and takes redirected frames (NAPI), as a NIC
/// behind a wire does: what XDP could finish then reaches it (veth's default offloads leave
/// only the pseudo-header sum, which XDP hands to tc).
pub fn wire_like_client(s: &Scenario) -> Result<()> {
    s.topo
        .ext()
        .exec("ethtool", &["-K", "eth0", "tx", "off", "gro", "on"])?;
    Ok(())
}

/// [`setup`] with `endpoints` (pod numbers) as the endpoints of both Services.
pub fn setup_with_endpoints(endpoints: &[usize]) -> Result<Scenario> {
    crate::require_root();
    let s = Scenario::with_families(3, true)?;
    let ports = http_and_dns_slice_ports();
    for service in ["web", "local"] {
        for ipv6 in [false, true] {
            let endpoints: Vec<_> = endpoints
                .iter()
                .map(|&i| pod_endpoint_family(i, ipv6))
                .collect();
            let slice = format!("{service}-{}", if ipv6 { "v6" } else { "v4" });
            s.manifests.write(
                &format!("{slice}.yaml"),
                &endpoint_slice_yaml_family("default", &slice, service, &ports, &endpoints, ipv6),
            )?;
        }
    }
    s.manifests.write(
        "web.yaml",
        &service_yaml(
            "web",
            "LoadBalancer",
            (CLUSTER_IP, CLUSTER_IP6),
            "Cluster",
            (WEB_NODE_PORT, WEB_UDP_NODE_PORT),
            Some((LB_IP, LB_IP6)),
        ),
    )?;
    s.manifests.write(
        "local.yaml",
        &service_yaml(
            "local",
            "NodePort",
            (LOCAL_CLUSTER_IP, LOCAL_CLUSTER_IP6),
            "Local",
            (LOCAL_NODE_PORT, LOCAL_UDP_NODE_PORT),
            None,
        ),
    )?;
    for (lb, via) in [
        (IpAddr::from(LB_IP), IpAddr::from(Topology::node_ext_ip())),
        (LB_IP6.into(), Topology::node_ext_ip6().into()),
    ] {
        s.topo
            .ext()
            .ip(&["route", "add", &lb.to_string(), "via", &via.to_string()])?;
    }
    Ok(s)
}

/// kube-proxy nftables-mode shaped rules for `web` and `local` in both families, in its tables
/// `ip kube-proxy` and `ip6 kube-proxy`: every frontend jumps to an endpoints chain that
/// DNATs to pod 1 or 2 by `numgen` (as kube-proxy's vmaps do); the eTP Cluster NodePort and the
/// LB IP mark their packets for masquerade, the eTP Local NodePort keeps the client address.
pub fn kube_proxy_nftables_rules(s: &Scenario) -> Result<()> {
    let mut ruleset = String::new();
    for ipv6 in [false, true] {
        let (table, ip) = if ipv6 { ("ip6", "ip6") } else { ("ip", "ip") };
        let pod = |i: usize| match Topology::pod_addr(i, ipv6) {
            IpAddr::V4(a) => format!("{a}:{BACKEND_PORT}"),
            IpAddr::V6(a) => format!("[{a}]:{BACKEND_PORT}"),
        };
        let (cluster, lb, node): (IpAddr, IpAddr, IpAddr) = if ipv6 {
            (
                CLUSTER_IP6.into(),
                LB_IP6.into(),
                Topology::node_ext_ip6().into(),
            )
        } else {
            (
                CLUSTER_IP.into(),
                LB_IP.into(),
                Topology::node_ext_ip().into(),
            )
        };
        let (p1, p2) = (pod(1), pod(2));
        let masq = "meta mark set mark or 0x4000";
        ruleset.push_str(&format!(
            "table {table} kube-proxy {{\n\
             \tchain endpoints {{ meta l4proto {{ tcp, udp }} numgen inc mod 2 0 dnat to {p1}; \
             meta l4proto {{ tcp, udp }} dnat to {p2}; }}\n\
             \tchain services {{\n\
             \t\t{ip} daddr {cluster} tcp dport {SERVICE_PORT} jump endpoints\n\
             \t\t{ip} daddr {cluster} udp dport {UDP_PORT} jump endpoints\n\
             \t\t{ip} daddr {lb} tcp dport {SERVICE_PORT} {masq} jump endpoints\n\
             \t\t{ip} daddr {lb} udp dport {UDP_PORT} {masq} jump endpoints\n\
             \t\t{ip} daddr {node} tcp dport {WEB_NODE_PORT} {masq} jump endpoints\n\
             \t\t{ip} daddr {node} udp dport {WEB_UDP_NODE_PORT} {masq} jump endpoints\n\
             \t\t{ip} daddr {node} tcp dport {LOCAL_NODE_PORT} jump endpoints\n\
             \t\t{ip} daddr {node} udp dport {LOCAL_UDP_NODE_PORT} jump endpoints\n\
             \t}}\n\
             \tchain nat-output {{ type nat hook output priority -100; policy accept; jump services; }}\n\
             \tchain nat-prerouting {{ type nat hook prerouting priority -100; policy accept; jump services; }}\n\
             \tchain nat-postrouting {{ type nat hook postrouting priority 100; policy accept; \
             meta mark & 0x4000 == 0x4000 masquerade; }}\n\
             }}\n"
        ));
    }
    load_nft_ruleset(s, &ruleset)
}

/// Loads an nft ruleset into the node's namespace (`nft -f`), as kube-proxy's nftables mode
/// would have left it.
pub fn load_nft_ruleset(s: &Scenario, ruleset: &str) -> Result<()> {
    let node = s.topo.node();
    let file = std::env::temp_dir().join(format!("kube-proxy-nft-{}.nft", node.name()));
    std::fs::write(&file, ruleset).map_err(|e| RigError::io("writing the nft ruleset", e))?;
    let loaded = node.exec("nft", &["-f", file.to_str().unwrap_or_default()]);
    let _ = std::fs::remove_file(&file);
    loaded?;
    Ok(())
}

/// Waits until kube-proxy's nftables tables are gone, at most `drain` plus a margin after the
/// agent's first successful sync, right after which it takes them over for the drain: the
/// drain period ends their drain, the connections' TIME_WAIT entries in the kernel's conntrack
/// outliving them. That sync comes once the agent has loaded and attached its programs, seconds
/// after its start on a loaded machine, so the bound counts from it and not from the spawn.
pub fn wait_for_kube_proxy_tables_removed(s: &mut Scenario, drain: Duration) -> Result<()> {
    // The first successful sync starts the drain of kube-proxy's tables.
    s.wait_for_first_sync()?;
    crate::wait::try_wait_until(
        "kube-proxy's nftables tables removed after the drain period",
        drain + Duration::from_secs(10),
        Duration::from_millis(200),
        || {
            Ok(!s
                .topo
                .node()
                .exec("nft", &["list", "tables"])?
                .contains("kube-proxy"))
        },
    )
}

/// Waits until every path of both families answers from a pod over TCP and UDP (each bounded
/// by the scenario's datapath timeout).
pub fn wait_served(s: &mut Scenario) -> Result<()> {
    for ipv6 in [false, true] {
        for path in PATHS {
            for proto in [Proto::Tcp, Proto::Udp] {
                let client = path.client(s, proto)?;
                let target = path.addr(proto, ipv6);
                s.wait_for_datapath_with(&client, target, path.what, is_pod)?;
            }
        }
    }
    Ok(())
}

/// What a client thread measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    TcpStream,
    UdpFlow,
    /// New connections of one protocol, one after the other.
    New(Proto),
}

#[derive(Debug)]
struct Flow {
    ipv6: bool,
    path: &'static str,
    kind: Kind,
    target: SocketAddr,
    /// When the client started: its attempts' times are relative to it.
    started: std::time::SystemTime,
    handle: JoinHandle<Result<Vec<(Attempt, u64)>>>,
}

/// The scenario's traffic, running. Dropped without [`Traffic::finish`] (a failed test), it
/// stops its clients and waits for them.
#[derive(Debug)]
pub struct Traffic {
    flows: Vec<Flow>,
    /// The file whose creation stops every client before its next attempt (`Client::until`).
    stop: PathBuf,
}

impl Traffic {
    /// Stops every client before its next attempt.
    fn stop_clients(&self) -> Result<()> {
        std::fs::write(&self.stop, b"")
            .map_err(|e| RigError::io(format!("creating {}", self.stop.display()), e))
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        let _ = self.stop_clients();
        for flow in self.flows.drain(..) {
            let _ = flow.handle.join();
        }
        let _ = std::fs::remove_file(&self.stop);
    }
}

/// Starts every stream, flow and new-connection loop of both families, and returns once they
/// have connected (before the transition starts).
pub fn start_traffic(s: &Scenario) -> Result<Traffic> {
    let mut flows = Vec::new();
    let stop = std::env::temp_dir().join(crate::unique_name("traffic-stop"));
    for ipv6 in [false, true] {
        for path in PATHS {
            let mut spawn = |kind: Kind, client: Client, target: SocketAddr| {
                let started = std::time::SystemTime::now();
                let handle = std::thread::spawn(move || client.run_timed(target, EXCHANGES));
                flows.push(Flow {
                    ipv6,
                    path: path.what,
                    kind,
                    target,
                    started,
                    handle,
                });
            };
            let tcp = path.client(s, Proto::Tcp)?.interval(INTERVAL).until(&stop);
            let udp = path.client(s, Proto::Udp)?.interval(INTERVAL).until(&stop);
            for _ in 0..TCP_PER_PATH {
                let client = tcp.clone().mode(Mode::TcpStream);
                spawn(Kind::TcpStream, client, path.addr(Proto::Tcp, ipv6));
            }
            for _ in 0..UDP_PER_PATH {
                let client = udp.clone().mode(Mode::Stream);
                spawn(Kind::UdpFlow, client, path.addr(Proto::Udp, ipv6));
            }
            for (proto, client) in [(Proto::Tcp, tcp), (Proto::Udp, udp)] {
                let client = client.mode(Mode::Connect);
                spawn(Kind::New(proto), client, path.addr(proto, ipv6));
            }
        }
    }
    // Every stream connected and every flow started (250 client processes started on a
    // 2-core machine) before the transition starts.
    let traffic = Traffic { flows, stop };
    let per_path = PATHS.len() * 2;
    s.wait_for_tcp_streams(TCP_PER_PATH * per_path)?;
    s.wait_for_udp_flows(
        &[Place::Ext, Place::Pod(CLIENT_POD), Place::Node],
        UDP_PER_PATH * per_path,
    )?;
    Ok(traffic)
}

/// The figures for one family across one transition.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Figures {
    pub tcp_streams: usize,
    /// Streams whose connection broke (an error other than a timeout, or an answer from a
    /// second connection or from no pod).
    pub reset: usize,
    /// Streams that waited more than [`STALL`] for an answer at least once.
    pub stalled: usize,
    pub udp_flows: usize,
    /// UDP flows answered by more than one backend (or by no pod).
    pub udp_moved: usize,
    /// UDP flows that waited more than [`STALL`] for an answer at least once.
    pub udp_stalled: usize,
    /// Streams and flows whose socket showed another peer than the address dialled
    /// (getpeername(): the socket hooks' reverse NAT lost).
    pub wrong_peer: usize,
    pub new_connections: usize,
    pub new_failed: usize,
}

impl Figures {
    fn zero(&self) -> bool {
        self.reset == 0
            && self.stalled == 0
            && self.udp_moved == 0
            && self.udp_stalled == 0
            && self.wrong_peer == 0
            && self.new_failed == 0
    }
}

impl Traffic {
    /// Flows still running (all of them, if the transition completed in time).
    pub fn running(&self) -> (usize, usize) {
        let running = self
            .flows
            .iter()
            .filter(|f| !f.handle.is_finished())
            .count();
        (running, self.flows.len())
    }

    /// Lets the traffic run [`AFTER`] more, stops it, joins every flow and computes the
    /// figures of each family (IPv4 first); logs every broken stream or flow and failed
    /// connection loop. Called once the transition is over.
    pub fn finish(mut self, transition: &str) -> Result<[Figures; 2]> {
        std::thread::sleep(AFTER);
        self.stop_clients()?;
        let mut figures: [Figures; 2] = Default::default();
        for flow in std::mem::take(&mut self.flows) {
            let timed = flow
                .handle
                .join()
                .map_err(|_| RigError::Other(format!("{}: client thread panicked", flow.path)))??;
            let attempts: Vec<Attempt> = timed.iter().map(|(a, _)| a.clone()).collect();
            let f = &mut figures[usize::from(flow.ipv6)];
            let wrong_peer = !matches!(flow.kind, Kind::New(_))
                && attempts
                    .iter()
                    .any(|a| matches!(a, Attempt::Ok { peer, .. } if *peer != flow.target));
            f.wrong_peer += usize::from(wrong_peer);
            let timeouts = attempts
                .iter()
                .any(|a| *a == Attempt::Err("TIMEOUT".into()));
            let bad = match flow.kind {
                Kind::TcpStream => {
                    let broken = attempts.iter().any(|a| match a {
                        Attempt::Err(reason) => reason != "TIMEOUT",
                        Attempt::Ok { .. } => {
                            !is_pod(a) || !a.backend().is_some_and(|b| b.ends_with("#1"))
                        }
                    });
                    f.tcp_streams += 1;
                    f.reset += usize::from(broken);
                    f.stalled += usize::from(timeouts);
                    broken || timeouts
                }
                Kind::UdpFlow => {
                    let backends: std::collections::BTreeSet<_> =
                        attempts.iter().filter_map(Attempt::backend).collect();
                    let moved = backends.len() > 1
                        || attempts.iter().any(|a| a.backend().is_some() && !is_pod(a));
                    let stalled = attempts.iter().any(|a| matches!(a, Attempt::Err(_)));
                    f.udp_flows += 1;
                    f.udp_moved += usize::from(moved);
                    f.udp_stalled += usize::from(stalled);
                    moved || stalled
                }
                Kind::New(_) => {
                    let failed = attempts.iter().filter(|a| !is_pod(a)).count();
                    f.new_connections += attempts.len();
                    f.new_failed += failed;
                    failed > 0
                }
            };
            if bad || wrong_peer {
                eprintln!(
                    "{transition} {} {} {:?}: {:?}",
                    family(flow.ipv6),
                    flow.path,
                    flow.kind,
                    tally(&attempts)
                );
                for (attempt, at) in &timed {
                    if !is_pod(attempt)
                        || !matches!(attempt, Attempt::Ok { peer, .. } if *peer == flow.target)
                    {
                        eprintln!(
                            "  {} {attempt:?}",
                            time_of_day(flow.started + Duration::from_millis(*at))
                        );
                    }
                }
            }
        }
        Ok(figures)
    }
}

/// `HH:MM:SS.mmm` UTC, as the agent's log lines show it, to place an attempt among them.
fn time_of_day(at: std::time::SystemTime) -> String {
    let ms = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
        % 86_400_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

/// Prints the figures table of one transition (past the test harness's capture) and fails
/// unless every figure is 0.
pub fn report(s: &Scenario, transition: &str, figures: &[Figures; 2]) -> Result<()> {
    let mut table = format!(
        "\ntakeover figures, {transition}:\n  {:<7} {:>11} {:>6} {:>8} {:>9} {:>6} {:>8} {:>9} {:>7} {:>10}\n",
        "family",
        "TCP streams",
        "reset",
        "stalled",
        "UDP flows",
        "moved",
        "stalled",
        "new conns",
        "failed",
        "wrong peer"
    );
    for (i, f) in figures.iter().enumerate() {
        table.push_str(&format!(
            "  {:<7} {:>11} {:>6} {:>8} {:>9} {:>6} {:>8} {:>9} {:>7} {:>10}\n",
            family(i == 1),
            f.tcp_streams,
            f.reset,
            f.stalled,
            f.udp_flows,
            f.udp_moved,
            f.udp_stalled,
            f.new_connections,
            f.new_failed,
            f.wrong_peer
        ));
    }
    // Straight to the process's stderr: the harness captures only the print macros, and the
    // figures belong in every run's output.
    let _ = std::io::stderr().lock().write_all(table.as_bytes());
    s.ensure(figures.iter().all(Figures::zero), || {
        format!("{transition}: every figure must be 0:{table}")
    })
}
