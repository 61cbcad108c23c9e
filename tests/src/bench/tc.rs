//! Item 4: the per-packet cost of the tc programs, measured with `BPF_PROG_TEST_RUN` on the
//! real object loaded through the agent's library ([`EbpfDataplane`], maps programmed from
//! Services by the real snapshot and map_writer), against an empty tc program as the floor.
//!
//! What is measured: the kernel's own timing of the program run (`ktime_get_ns` around the
//! run, divided by `repeat`). With `repeat` the kernel runs the program again on the *same*
//! skb, so a program that rewrites the packet (DNAT, reverse NAT) would be measured on its own
//! output from the second run on. Every path is therefore measured as many single runs
//! (`repeat = 1`, one syscall each, the median taken), which includes one clock read; the
//! empty program measured the same way is that floor, and the table shows both the raw figure
//! and the figure minus the floor. Paths that leave the packet alone (pass-through, drop, the
//! floor itself) are also measured with a large `repeat`, which amortises the clock read.
//!
//! The XDP program (`kpr_xdp_external`) is measured the same way against an empty XDP program:
//! its pass-through (no flow, no frontend), a new flow, and the established flow and reverse
//! NAT of a NodePort flow to a backend on another node (reached through `ext0`, an XDP
//! redirect target), beside tc's figures for the same flows.
//!
//! A new flow is a different tuple every run (the client port and address change), so each
//! sample is a conntrack miss that inserts the forward and reply entries and picks an SNAT
//! port; the Service has 16 endpoints so that the SNAT port space (per backend) stays mostly
//! free over every run and a sample rarely pays for a port collision.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proxy_dataplane_ebpf::{EbpfDataplane, EbpfOptions, TcOptions};
use proxy_model::desired::Snapshot;
use proxy_model::objects::{ObjectKey, Objects};

use super::stats::Spread;
use crate::in_process::on_netns_thread;
use crate::netns::Netns;
use crate::packet::{
    L4, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, XDP_PASS, XDP_REDIRECT, build,
};
use crate::{Result, RigError};

const TC_EXTERNAL: &str = "kpr_tc_external";
const TC_REPLY: &str = "kpr_tc_reply";
const TC_EXTERNAL4: &str = "kpr_tc_external4";
const NODE: &str = "bench-node";
const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 1);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const NODE_PORT: u16 = 30080;
/// NodePort of `remote`, whose one endpoint is on the external network behind `ext0`.
const REMOTE_NODE_PORT: u16 = 30090;
const REMOTE: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 9);
/// NodePort of `spread`, whose endpoints are on the external network behind `ext0`
/// ([`spread_backend`]): the new flows of both programs to a backend XDP redirects to.
const SPREAD_NODE_PORT: u16 = 30091;
const BACKEND_PORT: u16 = 8080;
/// Endpoints of the measured NodePort Service (10.244.1.2 ..).
const BACKENDS: u8 = 16;
/// `__sk_buff` prefix the kernel accepts as ctx: up to `ifindex` (offset 40).
const SKB_CTX_LEN: usize = 44;

/// One path through a tc program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TcPath {
    /// An empty tc program (`r0 = TC_ACT_OK; exit`): test_run and clock overhead.
    Floor,
    /// An ARP frame on the external interface: parsed, not IP, passed.
    NonIp,
    /// TCP to the node's own address on a port that is no Service: frontend miss, passed.
    PassThrough,
    /// The same packet given to the IPv4 program directly: what the attached program's hand-off
    /// to its family's program (a tail call, `tc::family`) adds is the difference.
    PassThroughIpv4Program,
    /// A LoadBalancer source-range miss: dropped before any NAT.
    Drop,
    /// A SYN of a new flow to a NodePort: conntrack miss, backend choice, DNAT + SNAT, both
    /// conntrack entries written, fib lookup, redirect.
    NodePortNewFlow,
    /// [`Self::NodePortNewFlow`] into a full new-flow table: each SYN's entries evict others,
    /// as under a SYN flood (the new-flow paths above measure a table with room, as a node's
    /// is otherwise: a flow's entries leave it with the client's first segment after the SYN).
    NodePortNewFlowFullTable,
    /// The same flow's next packet: conntrack hit, DNAT + SNAT, the next hop its entry keeps
    /// (the backend's neighbour behind `pod0` is resolved, as on a node that talks to it),
    /// redirect.
    NodePortEstablished,
    /// The same packet with the per-Service packet and byte counting off
    /// (`node_flags::NO_PACKET_COUNTS`, as with `--service-traffic-max-series 0`): what
    /// counting costs is the difference ([`PacketCostResult::counting`]).
    NodePortEstablishedUncounted,
    /// The backend's reply on the pod interface: reverse NAT from conntrack, redirect.
    ReverseNat,
    /// Pod traffic on the pod interface that is no reply of a translated flow: passed.
    PodNotReply,
    /// A NodePort flow to a backend on another node (next hop through `ext0`): tc, conntrack
    /// hit, DNAT + SNAT, the next hop its entry keeps, redirect.
    RemoteEstablished,
    /// That backend's reply arriving on `ext0`: tc, reverse NAT from conntrack, redirect.
    RemoteReverseNat,
    /// An empty XDP program (`r0 = XDP_PASS; exit`): the XDP paths' floor.
    XdpFloor,
    /// `kpr_xdp_external` on the pass-through packet: no flow, passed to tc.
    XdpPassThrough,
    /// `kpr_xdp_external` on [`Self::RemoteEstablished`]'s packet: translated, redirected.
    XdpEstablished,
    /// `kpr_xdp_external` on [`Self::RemoteReverseNat`]'s packet: translated, redirected.
    XdpReverseNat,
    /// A SYN of a new flow to a NodePort whose backends are on other nodes (next hop through
    /// `ext0`): tc, as [`Self::NodePortNewFlow`].
    RemoteNewFlow,
    /// The same through `kpr_xdp_external`: conntrack miss, tail call to the family's new-flow
    /// program, tc's `new_flow`, return-route and next-hop fib lookups, rewrite, redirect.
    XdpNewFlow,
}

impl TcPath {
    pub const ALL: [Self; 19] = [
        Self::Floor,
        Self::NonIp,
        Self::PassThrough,
        Self::PassThroughIpv4Program,
        Self::Drop,
        Self::NodePortNewFlow,
        Self::NodePortNewFlowFullTable,
        Self::NodePortEstablished,
        Self::NodePortEstablishedUncounted,
        Self::ReverseNat,
        Self::PodNotReply,
        Self::RemoteEstablished,
        Self::RemoteReverseNat,
        Self::XdpFloor,
        Self::XdpPassThrough,
        Self::XdpEstablished,
        Self::XdpReverseNat,
        Self::RemoteNewFlow,
        Self::XdpNewFlow,
    ];

    /// Whether this is an XDP path (its floor is [`Self::XdpFloor`]).
    pub fn is_xdp(self) -> bool {
        matches!(
            self,
            Self::XdpFloor
                | Self::XdpPassThrough
                | Self::XdpEstablished
                | Self::XdpReverseNat
                | Self::XdpNewFlow
        )
    }

    /// The tc path an XDP path replaces (for the XDP ÷ tc ratio).
    pub fn tc_counterpart(self) -> Option<Self> {
        match self {
            Self::XdpPassThrough => Some(Self::PassThrough),
            Self::XdpEstablished => Some(Self::RemoteEstablished),
            Self::XdpReverseNat => Some(Self::RemoteReverseNat),
            Self::XdpNewFlow => Some(Self::RemoteNewFlow),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Floor => "empty tc program (floor)",
            Self::NonIp => "kpr_tc_external: ARP frame (not IP)",
            Self::PassThrough => "kpr_tc_external: no frontend (pass-through)",
            Self::PassThroughIpv4Program => {
                "kpr_tc_external4 run directly: no frontend (the family program the port filter spares such a packet)"
            }
            Self::Drop => "kpr_tc_external: source-range miss (drop)",
            Self::NodePortNewFlow => "kpr_tc_external: NodePort, new flow (DNAT+SNAT, CT insert)",
            Self::NodePortNewFlowFullTable => {
                "kpr_tc_external: NodePort, new flow into a full new-flow table (CT insert evicts)"
            }
            Self::NodePortEstablished => "kpr_tc_external: NodePort, established (CT hit)",
            Self::NodePortEstablishedUncounted => {
                "kpr_tc_external: NodePort, established, packets not counted (CT hit)"
            }
            Self::ReverseNat => "kpr_tc_reply: backend reply (reverse NAT)",
            Self::PodNotReply => "kpr_tc_reply: pod traffic, not a reply (pass)",
            Self::RemoteEstablished => {
                "kpr_tc_external: NodePort, established, backend on another node (CT hit)"
            }
            Self::RemoteReverseNat => {
                "kpr_tc_external: reply of a backend on another node (reverse NAT)"
            }
            Self::XdpFloor => "empty XDP program (XDP floor)",
            Self::XdpPassThrough => "kpr_xdp_external: no flow (passed to tc)",
            Self::XdpEstablished => {
                "kpr_xdp_external: NodePort, established, backend on another node (CT hit)"
            }
            Self::XdpReverseNat => {
                "kpr_xdp_external: reply of a backend on another node (reverse NAT)"
            }
            Self::RemoteNewFlow => {
                "kpr_tc_external: NodePort, new flow, backends on other nodes (CT insert)"
            }
            Self::XdpNewFlow => {
                "kpr_xdp_external: NodePort, new flow, backends on other nodes (CT insert)"
            }
        }
    }

    /// Whether each sample is a new flow into a table with room (see [`NewFlowTable`]).
    fn new_flow_with_room(self) -> bool {
        matches!(
            self,
            Self::NodePortNewFlow | Self::RemoteNewFlow | Self::XdpNewFlow
        )
    }

    /// Whether the program leaves the packet as it was, so `repeat` measures it as given.
    fn unmodified(self) -> bool {
        matches!(
            self,
            Self::Floor
                | Self::NonIp
                | Self::PassThrough
                | Self::PassThroughIpv4Program
                | Self::Drop
                | Self::PodNotReply
                | Self::XdpFloor
                | Self::XdpPassThrough
        )
    }
}

/// How much to measure.
#[derive(Debug, Clone, Copy)]
pub struct TcLoops {
    /// Interleaved runs over all paths.
    pub runs: usize,
    /// Single-run syscalls per path and run (the median is the run's figure).
    pub samples: u32,
    /// `repeat` of the amortised measurement (unmodified packets only).
    pub repeat: u32,
}

/// One path's figures over the runs, in ns per packet.
#[derive(Debug, Clone)]
pub struct TcPathResult {
    pub path: TcPath,
    /// Per run: median of `samples` single runs (clock read included).
    pub single: Spread,
    /// Per run: the single-run median minus the floor's of the same run.
    pub over_floor: Spread,
    /// Per run: mean of `repeat` runs in one syscall; None when the packet is rewritten.
    pub repeated: Option<Spread>,
    /// The action the program returned (checked against the path's expectation).
    pub action: i32,
}

#[derive(Debug, Clone)]
pub struct PacketCostResult {
    pub loops: TcLoops,
    pub paths: Vec<TcPathResult>,
    /// Where the time of the costliest paths goes (Markdown), when `perf` could profile them.
    pub profile: Option<String>,
    /// Per run: the established path's program cost with the per-Service packet counting
    /// over its cost without (the same program, `node_flags::NO_PACKET_COUNTS` set just for
    /// those samples).
    pub counting: Spread,
}

impl PacketCostResult {
    pub fn of(&self, path: TcPath) -> Option<&TcPathResult> {
        self.paths.iter().find(|p| p.path == path)
    }
}

/// Builds the node namespace, loads and programs the dataplane on a thread inside it, and
/// measures every path (see the module docs).
pub fn per_packet_cost(loops: TcLoops) -> Result<PacketCostResult> {
    let ns = Netns::new("tccost")?;
    for (dev, v4) in [("ext0", "10.10.0.1/24"), ("pod0", "10.244.1.1/24")] {
        // veth: the kernel here has no dummy driver; the peer stays unaddressed.
        let peer = format!("{dev}p");
        ns.ip(&["link", "add", dev, "type", "veth", "peer", "name", &peer])?;
        ns.ip(&["link", "set", &peer, "up"])?;
        ns.ip(&["addr", "add", v4, "dev", dev])?;
        ns.ip(&["link", "set", dev, "up"])?;
    }
    ns.sysctl("net.ipv4.ip_forward", "1")?;
    let path = ns.path();
    let measured = on_netns_thread(path, move |node| -> Result<PacketCostResult> {
        let options = EbpfOptions {
            cgroup_path: node.cgroup_path(),
            bpf_root: node.bpf_root(),
            frontends_capacity: 1024,
            max_frontends_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_FRONTENDS_PER_SERVICE,
            max_endpoints_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_ENDPOINTS_PER_SERVICE,
            backends_capacity: 1024,
            conntrack_capacity: Some(proxy_dataplane_ebpf::DEFAULT_CONNTRACK_CAPACITY),
            lru_budget: proxy_dataplane_ebpf::maps::map_sizes::LruBudget::MemoryShare(
                proxy_dataplane_ebpf::maps::map_sizes::DEFAULT_DYNAMIC_SIZE_RATIO,
            ),
            lb: proxy_dataplane_ebpf::LbOptions::default(),
            tc: TcOptions {
                interfaces: vec!["ext0".into()],
                cluster_cidrs: vec![
                    "10.244.0.0/16"
                        .parse()
                        .map_err(|e| RigError::Other(format!("cluster CIDR: {e}")))?,
                ],
                fast_path: true,
                ..TcOptions::default()
            },
            disabled_features: Default::default(),
            // Every REJECT answered: the rate limit has its own test.
            icmp_ratelimit: Some(std::time::Duration::ZERO),
            snat_ports: proxy_dataplane_ebpf::conntrack::reserved_ports::DEFAULT_RANGE,
        };
        let mut dataplane = EbpfDataplane::start(&options)
            .map_err(|e| RigError::Other(format!("loading the eBPF dataplane: {e}")))?;
        program(&mut dataplane)?;
        let floor = EmptyProgram::load()?;
        let pin_dir = options.bpf_root.join(proxy_dataplane_ebpf::PIN_DIR_NAME);
        let result = measure(&mut dataplane, &floor, &pin_dir, loops);
        // Before the node's parts (cgroup, bpffs) go.
        drop(dataplane);
        result
    })?;
    drop(ns);
    measured
}

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "bench".into(),
        name: name.into(),
    }
}

fn from_json<T: serde::de::DeserializeOwned>(what: &str, v: serde_json::Value) -> Result<T> {
    serde_json::from_value(v).map_err(|e| RigError::Other(format!("{what}: {e}")))
}

/// `web`: NodePort TCP 30080 → 8080, eTP Cluster, 16 endpoints; `lb`: LoadBalancer on
/// `LB_IP`:80 with source range 203.0.113.0/24 (the client is outside it).
fn program(dataplane: &mut EbpfDataplane) -> Result<()> {
    let web: Service = from_json(
        "web Service",
        serde_json::json!({
            "metadata": {"name": "web", "namespace": "bench"},
            "spec": {"type": "NodePort", "clusterIP": "10.96.0.20",
                "externalTrafficPolicy": "Cluster",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP",
                    "targetPort": BACKEND_PORT, "nodePort": NODE_PORT}]}
        }),
    )?;
    let lb: Service = from_json(
        "lb Service",
        serde_json::json!({
            "metadata": {"name": "lb", "namespace": "bench"},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.22",
                "loadBalancerSourceRanges": ["203.0.113.0/24"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP",
                    "targetPort": BACKEND_PORT, "nodePort": 30082}]},
            "status": {"loadBalancer": {"ingress": [{"ip": LB_IP.to_string()}]}}
        }),
    )?;
    let endpoints: Vec<serde_json::Value> = (0..BACKENDS)
        .map(|i| {
            serde_json::json!({"addresses": [backend(i).to_string()], "nodeName": NODE,
                "conditions": {"ready": true}})
        })
        .collect();
    let slice = |name: &str, service: &str, endpoints: &[serde_json::Value]| {
        from_json::<EndpointSlice>(
            "EndpointSlice",
            serde_json::json!({
                "metadata": {"name": name, "namespace": "bench",
                    "labels": {"kubernetes.io/service-name": service}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": BACKEND_PORT, "protocol": "TCP"}],
                "endpoints": endpoints
            }),
        )
    };
    let remote = node_port_service("remote", "10.96.0.24", REMOTE_NODE_PORT)?;
    let remote_endpoint = [serde_json::json!({"addresses": [REMOTE.to_string()],
        "nodeName": "other-node", "conditions": {"ready": true}})];
    let spread = node_port_service("spread", "10.96.0.26", SPREAD_NODE_PORT)?;
    let spread_endpoints: Vec<serde_json::Value> = (0..BACKENDS)
        .map(|i| {
            serde_json::json!({"addresses": [spread_backend(i).to_string()],
                "nodeName": "other-node", "conditions": {"ready": true}})
        })
        .collect();
    // XDP redirects only to resolved neighbours: the remote backends' and the client's. The
    // local backends' behind `pod0` are resolved too, as a node's are for the pods it sends
    // traffic to: an established flow then takes the next hop its entry keeps, not a route
    // lookup per packet.
    let mut neighbours = vec![
        (REMOTE, "02:00:00:00:00:09".to_owned(), "ext0"),
        (CLIENT, "02:00:00:00:00:02".to_owned(), "ext0"),
    ];
    neighbours.extend(
        (0..BACKENDS).map(|i| (spread_backend(i), format!("02:00:00:00:01:{i:02x}"), "ext0")),
    );
    neighbours
        .extend((0..BACKENDS).map(|i| (backend(i), format!("02:00:00:00:02:{i:02x}"), "pod0")));
    for (addr, mac, dev) in &neighbours {
        // This thread is in the node namespace; the child inherits it.
        let status = std::process::Command::new("ip")
            .args([
                "neigh",
                "replace",
                &addr.to_string(),
                "lladdr",
                mac.as_str(),
            ])
            .args(["dev", dev, "nud", "permanent"])
            .status()
            .map_err(|e| RigError::io("ip neigh", e))?;
        if !status.success() {
            return Err(RigError::Other(format!("ip neigh {addr}: {status}")));
        }
    }
    let services = BTreeMap::from([
        (key("web"), web.into()),
        (key("lb"), lb.into()),
        (key("remote"), remote.into()),
        (key("spread"), spread.into()),
    ]);
    let slices = BTreeMap::from([
        (key("web-1"), slice("web-1", "web", &endpoints)?.into()),
        (key("lb-1"), slice("lb-1", "lb", &endpoints[..1])?.into()),
        (
            key("remote-1"),
            slice("remote-1", "remote", &remote_endpoint)?.into(),
        ),
        (
            key("spread-1"),
            slice("spread-1", "spread", &spread_endpoints)?.into(),
        ),
    ]);
    let snapshot = Snapshot::compute(&Objects::new(services, slices, None), NODE);
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    if !errors.is_empty() {
        return Err(RigError::Other(format!("snapshot errors: {errors:?}")));
    }
    let (_, errors) = dataplane.apply(&snapshot, None);
    if !errors.is_empty() {
        return Err(RigError::Other(format!("apply errors: {errors:?}")));
    }
    Ok(())
}

/// A NodePort Service `name` (eTP Cluster) with one TCP port 80 → [`BACKEND_PORT`].
fn node_port_service(name: &str, cluster_ip: &str, node_port: u16) -> Result<Service> {
    from_json(
        &format!("{name} Service"),
        serde_json::json!({
            "metadata": {"name": name, "namespace": "bench"},
            "spec": {"type": "NodePort", "clusterIP": cluster_ip,
                "ports": [{"name": "http", "port": 80, "protocol": "TCP",
                    "targetPort": BACKEND_PORT, "nodePort": node_port}]}
        }),
    )
}

fn backend(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 1, 2 + i)
}

/// The endpoints of `spread`, on other nodes reached through `ext0` (10.10.0.100 ..).
fn spread_backend(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 10, 0, 100 + i)
}

/// The SYN of new flow `n` to `spread`'s NodePort, from a tuple never used before.
fn spread_new_flow(n: u32) -> Vec<u8> {
    build(
        fresh_client(n),
        sa(NODE_IP, SPREAD_NODE_PORT),
        L4::TcpSyn,
        b"",
    )
}

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), port)
}

/// A client tuple that was never used before in this process: port and address walk through
/// 10.10.0.3.. (on ext0's subnet like the fixed client 10.10.0.2, whose established flow must
/// never be hit by a "new" one).
fn fresh_client(n: u32) -> SocketAddr {
    let port = 10_000 + (n % 50_000) as u16;
    let host = 3 + (n / 50_000) % 200;
    sa(Ipv4Addr::new(10, 10, 0, host as u8), port)
}

/// An ARP request (who-has 10.10.0.1 tell 10.10.0.2).
fn arp_frame() -> Vec<u8> {
    let mut f = vec![0xffu8; 6];
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]);
    f.extend_from_slice(&0x0806u16.to_be_bytes());
    f.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]);
    f.extend_from_slice(&CLIENT.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&NODE_IP.octets());
    f
}

/// Source and destination IPv4 addresses and ports of a test_run output frame.
fn tuple(frame: &[u8]) -> Option<(SocketAddr, SocketAddr)> {
    let ip = frame.get(14..34)?;
    let ihl = usize::from(ip.first()? & 0x0f) * 4;
    let l4 = frame.get(14 + ihl..14 + ihl + 4)?;
    let addr = |b: &[u8]| Ipv4Addr::new(b[0], b[1], b[2], b[3]);
    Some((
        sa(addr(&ip[12..16]), u16::from_be_bytes([l4[0], l4[1]])),
        sa(addr(&ip[16..20]), u16::from_be_bytes([l4[2], l4[3]])),
    ))
}

/// The frames of the fixed paths, and the check of what the program did with them.
struct Frames {
    non_ip: Vec<u8>,
    pass: Vec<u8>,
    drop: Vec<u8>,
    established: Vec<u8>,
    reply: Vec<u8>,
    pod_not_reply: Vec<u8>,
    remote_established: Vec<u8>,
    remote_reply: Vec<u8>,
    ext0: u32,
    pod0: u32,
}

fn ifindex(name: &str) -> Result<u32> {
    nix::net::if_::if_nametoindex(name).map_err(|e| RigError::Other(format!("ifindex {name}: {e}")))
}

fn wrong(path: TcPath, detail: String) -> RigError {
    RigError::Other(format!("{}: {detail}", path.label()))
}

/// Builds the fixed frames; the established flow is created (and its translation checked) by a
/// first run, and its reply frame is what the chosen backend would send.
fn frames(dp: &mut EbpfDataplane) -> Result<Frames> {
    let ext0 = ifindex("ext0")?;
    let pod0 = ifindex("pod0")?;
    let client = sa(CLIENT, 40_000);
    let frontend = sa(NODE_IP, NODE_PORT);
    let established = build(client, frontend, L4::TcpSyn, b"");
    let first = dp
        .test_run_tc(TC_EXTERNAL, &established, ext0)
        .map_err(|e| RigError::Other(format!("test_run: {e}")))?;
    let (snat, backend) = tuple(&first.packet).ok_or_else(|| {
        wrong(
            TcPath::NodePortEstablished,
            "output is not IPv4/L4".to_owned(),
        )
    })?;
    if first.action != TC_ACT_REDIRECT || backend.port() != BACKEND_PORT || snat.ip() != NODE_IP {
        return Err(wrong(
            TcPath::NodePortEstablished,
            format!(
                "first packet: action {}, {snat} → {backend}; expected a redirect to a backend \
                 with SNAT to {NODE_IP}",
                first.action
            ),
        ));
    }
    // The remote flow: started by tc (as on an interface without XDP), then both programs see the
    // same established packet and the same reply.
    let remote_client = sa(CLIENT, 40_001);
    let remote_established = build(
        remote_client,
        sa(NODE_IP, REMOTE_NODE_PORT),
        L4::TcpAck,
        b"",
    );
    let first = dp
        .test_run_tc(
            TC_EXTERNAL,
            &build(
                remote_client,
                sa(NODE_IP, REMOTE_NODE_PORT),
                L4::TcpSyn,
                b"",
            ),
            ext0,
        )
        .map_err(|e| RigError::Other(format!("test_run: {e}")))?;
    let remote_tuple = tuple(&first.packet).filter(|(_, b)| *b == sa(REMOTE, BACKEND_PORT));
    let Some((remote_snat, remote_backend)) = remote_tuple else {
        return Err(wrong(
            TcPath::RemoteEstablished,
            format!("first packet: action {}, not to {REMOTE}", first.action),
        ));
    };
    Ok(Frames {
        remote_established,
        remote_reply: build(remote_backend, remote_snat, L4::TcpAck, b""),
        non_ip: arp_frame(),
        pass: build(client, sa(NODE_IP, 22), L4::TcpSyn, b""),
        drop: build(client, sa(LB_IP, 80), L4::TcpSyn, b""),
        established,
        reply: build(backend, snat, L4::TcpSyn, b""),
        pod_not_reply: build(
            SocketAddr::new(backend.ip(), 33_000),
            sa(Ipv4Addr::new(10, 10, 0, 9), 443),
            L4::TcpSyn,
            b"",
        ),
        ext0,
        pod0,
    })
}

/// Runs `path` once (`repeat` 1) or `repeat` times; the action and the kernel's ns per run.
fn run_once(
    dp: &mut EbpfDataplane,
    floor: &EmptyProgram,
    f: &Frames,
    path: TcPath,
    new_flow: &mut u32,
    repeat: u32,
) -> Result<(i32, u64, Vec<u8>)> {
    let xdp_frame = match path {
        TcPath::XdpFloor => {
            let (action, ns) = floor.test_run_xdp(&f.pass, f.ext0, repeat)?;
            return Ok((action, ns, Vec::new()));
        }
        TcPath::XdpPassThrough => Some(f.pass.clone()),
        TcPath::XdpEstablished => Some(f.remote_established.clone()),
        TcPath::XdpReverseNat => Some(f.remote_reply.clone()),
        TcPath::XdpNewFlow => {
            *new_flow += 1;
            Some(spread_new_flow(*new_flow))
        }
        _ => None,
    };
    if let Some(frame) = xdp_frame {
        let (out, duration) = dp
            .test_run_xdp_timed(&frame, f.ext0, repeat)
            .map_err(|e| wrong(path, format!("test_run: {e}")))?;
        let ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        return Ok((i32::try_from(out.action).unwrap_or(-1), ns, out.packet));
    }
    let (program, frame, ifindex) = match path {
        TcPath::Floor => {
            let (action, ns) = floor.test_run(&f.pass, f.ext0, repeat)?;
            return Ok((action, ns, Vec::new()));
        }
        TcPath::RemoteEstablished => (TC_EXTERNAL, f.remote_established.clone(), f.ext0),
        TcPath::RemoteReverseNat => (TC_EXTERNAL, f.remote_reply.clone(), f.ext0),
        TcPath::XdpFloor
        | TcPath::XdpPassThrough
        | TcPath::XdpEstablished
        | TcPath::XdpReverseNat
        | TcPath::XdpNewFlow => unreachable!("XDP paths returned above"),
        TcPath::RemoteNewFlow => {
            *new_flow += 1;
            (TC_EXTERNAL, spread_new_flow(*new_flow), f.ext0)
        }
        TcPath::NonIp => (TC_EXTERNAL, f.non_ip.clone(), f.ext0),
        TcPath::PassThrough => (TC_EXTERNAL, f.pass.clone(), f.ext0),
        TcPath::PassThroughIpv4Program => (TC_EXTERNAL4, f.pass.clone(), f.ext0),
        TcPath::Drop => (TC_EXTERNAL, f.drop.clone(), f.ext0),
        TcPath::NodePortNewFlow | TcPath::NodePortNewFlowFullTable => {
            *new_flow += 1;
            let frame = build(
                fresh_client(*new_flow),
                sa(NODE_IP, NODE_PORT),
                L4::TcpSyn,
                b"",
            );
            (TC_EXTERNAL, frame, f.ext0)
        }
        TcPath::NodePortEstablished | TcPath::NodePortEstablishedUncounted => {
            (TC_EXTERNAL, f.established.clone(), f.ext0)
        }
        TcPath::ReverseNat => (TC_REPLY, f.reply.clone(), f.pod0),
        TcPath::PodNotReply => (TC_REPLY, f.pod_not_reply.clone(), f.pod0),
    };
    let uncounted = path == TcPath::NodePortEstablishedUncounted;
    if uncounted {
        dp.set_packet_counts(false);
    }
    let run = dp.test_run_tc_timed(program, &frame, ifindex, repeat);
    if uncounted {
        dp.set_packet_counts(true);
    }
    let (out, duration) = run.map_err(|e| wrong(path, format!("test_run: {e}")))?;
    let ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
    Ok((out.action, ns, out.packet))
}

/// Checks that `path` took the branch it is named after (once per path, before timing).
fn check(path: TcPath, action: i32, out: &[u8], input: &Frames) -> Result<()> {
    let expected = match path {
        TcPath::XdpFloor | TcPath::XdpPassThrough => XDP_PASS as i32,
        TcPath::XdpEstablished | TcPath::XdpReverseNat | TcPath::XdpNewFlow => XDP_REDIRECT as i32,
        TcPath::RemoteEstablished | TcPath::RemoteReverseNat | TcPath::RemoteNewFlow => {
            TC_ACT_REDIRECT
        }
        TcPath::Floor => TC_ACT_OK,
        TcPath::NonIp
        | TcPath::PassThrough
        | TcPath::PassThroughIpv4Program
        | TcPath::PodNotReply => TC_ACT_UNSPEC,
        TcPath::Drop => TC_ACT_SHOT,
        TcPath::NodePortNewFlow
        | TcPath::NodePortNewFlowFullTable
        | TcPath::NodePortEstablished
        | TcPath::NodePortEstablishedUncounted
        | TcPath::ReverseNat => TC_ACT_REDIRECT,
    };
    if action != expected {
        return Err(wrong(path, format!("action {action}, expected {expected}")));
    }
    let translated = tuple(out);
    let ok = match path {
        TcPath::NodePortNewFlow
        | TcPath::NodePortNewFlowFullTable
        | TcPath::NodePortEstablished
        | TcPath::NodePortEstablishedUncounted => {
            translated.is_some_and(|(s, d)| s.ip() == NODE_IP && d.port() == BACKEND_PORT)
        }
        TcPath::ReverseNat => translated.is_some_and(|(s, d)| {
            s == sa(NODE_IP, NODE_PORT) && tuple(&input.established).is_some_and(|(c, _)| c == d)
        }),
        TcPath::RemoteEstablished | TcPath::XdpEstablished => {
            translated.is_some_and(|(s, d)| s.ip() == NODE_IP && d == sa(REMOTE, BACKEND_PORT))
        }
        TcPath::RemoteNewFlow | TcPath::XdpNewFlow => translated.is_some_and(|(s, d)| {
            s.ip() == NODE_IP
                && d.port() == BACKEND_PORT
                && (0..BACKENDS).any(|i| d.ip() == IpAddr::V4(spread_backend(i)))
        }),
        TcPath::RemoteReverseNat | TcPath::XdpReverseNat => translated
            .is_some_and(|(s, d)| s == sa(NODE_IP, REMOTE_NODE_PORT) && d == sa(CLIENT, 40_001)),
        TcPath::XdpPassThrough => out == input.pass,
        TcPath::Floor | TcPath::XdpFloor => true,
        TcPath::NonIp => out == input.non_ip,
        TcPath::PassThrough | TcPath::PassThroughIpv4Program => out == input.pass,
        TcPath::Drop => out == input.drop,
        TcPath::PodNotReply => out == input.pod_not_reply,
    };
    if ok {
        Ok(())
    } else {
        Err(wrong(path, format!("unexpected output {translated:?}")))
    }
}

/// The forward packets and bytes `KPR_SERVICE_PACKETS` holds for `web`'s NodePort.
fn web_forward_counts(
    reader: &mut proxy_dataplane_ebpf::traffic::TrafficReader,
) -> Result<(u64, u64)> {
    let reading = reader
        .read()
        .map_err(|e| RigError::Other(format!("reading the per-Service counters: {e}")))?;
    Ok(reading
        .services
        .iter()
        .filter(|s| s.key.service.name == "web")
        .filter_map(|s| s.counts.packets)
        .fold((0, 0), |(packets, bytes), c| {
            (packets + c.forward_packets, bytes + c.forward_bytes)
        }))
}

/// `KPR_CT4_NEW`, where a SYN's two entries go. Its entries leave with the client's first
/// segment after the SYN, so outside a SYN flood a node's has room: the new-flow paths measure
/// SYNs into a table with room, the entries of earlier fresh clients removed before each batch;
/// [`TcPath::NodePortNewFlowFullTable`] fills it first, so each of its SYNs evicts.
struct NewFlowTable {
    map: aya::maps::HashMap<aya::maps::MapData, proxy_common::CtKey4, proxy_common::CtValue4>,
    capacity: u32,
}

/// New-flow samples between two clearings (two entries each: far below the table's size).
const NEW_FLOWS_PER_CLEARING: u64 = 2_000;

impl NewFlowTable {
    fn open(pin_dir: &std::path::Path) -> Result<Self> {
        let name = proxy_common::map_names::CT4_NEW;
        let fail = |e: &dyn std::fmt::Display| RigError::Other(format!("{name}: {e}"));
        let data = aya::maps::MapData::from_pin(pin_dir.join(name)).map_err(|e| fail(&e))?;
        let capacity = data.info().map_err(|e| fail(&e))?.max_entries();
        let map =
            aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(data)).map_err(|e| fail(&e))?;
        Ok(Self { map, capacity })
    }

    /// Removes the entries of fresh clients' flows: forward entries from one, reply entries
    /// translated to one (the fixed client's established flow keeps its own).
    fn clear(&mut self) {
        let fresh = |addr: u32| {
            let [a, b, c, d] = addr.to_ne_bytes();
            [a, b, c] == [10, 10, 0] && (3..=202).contains(&d)
        };
        let stale: Vec<proxy_common::CtKey4> = self
            .map
            .iter()
            .filter_map(std::result::Result::ok)
            .filter(|(key, value)| fresh(key.src) || fresh(value.dst))
            .map(|(key, _)| key)
            .collect();
        for key in &stale {
            // An entry the LRU evicted meanwhile is gone already.
            let _ = self.map.remove(key);
        }
    }

    /// Prepares the table for `path`'s samples: room for the new-flow paths, full (new flows
    /// until every entry is taken) for the full-table path.
    fn prepare(
        &mut self,
        path: TcPath,
        dp: &mut EbpfDataplane,
        floor: &EmptyProgram,
        f: &Frames,
        new_flow: &mut u32,
    ) -> Result<()> {
        if path.new_flow_with_room() {
            self.clear();
        } else if path == TcPath::NodePortNewFlowFullTable {
            for _ in 0..self.capacity / 2 + 1_000 {
                run_once(dp, floor, f, path, new_flow, 1)?;
            }
        }
        Ok(())
    }
}

fn measure(
    dp: &mut EbpfDataplane,
    floor: &EmptyProgram,
    pin_dir: &std::path::Path,
    loops: TcLoops,
) -> Result<PacketCostResult> {
    let f = frames(dp)?;
    let mut new_flow = 0u32;
    let mut table = NewFlowTable::open(pin_dir)?;
    let mut reader = proxy_dataplane_ebpf::traffic::TrafficReader::open(pin_dir)
        .map_err(|e| RigError::Other(format!("opening the per-Service counters: {e}")))?;
    for path in TcPath::ALL {
        let before = web_forward_counts(&mut reader)?;
        let (action, _, out) = run_once(dp, floor, &f, path, &mut new_flow, 1)?;
        check(path, action, &out, &f)?;
        // The comparison is only what it says if one path counts and the other does not.
        let after = web_forward_counts(&mut reader)?;
        let ip_bytes = (f.established.len() - 14) as u64;
        let want = match path {
            TcPath::NodePortEstablished => (before.0 + 1, before.1 + ip_bytes),
            TcPath::NodePortEstablishedUncounted => before,
            _ => after,
        };
        if after != want {
            return Err(wrong(
                path,
                format!(
                    "web's forward packets and bytes went {before:?} → {after:?}, not to {want:?}"
                ),
            ));
        }
    }
    let mut counting = Vec::new();
    let started = Instant::now();
    let bound = Duration::from_secs(120);
    let mut single: BTreeMap<TcPath, Vec<f64>> = BTreeMap::new();
    let mut over: BTreeMap<TcPath, Vec<f64>> = BTreeMap::new();
    let mut repeated: BTreeMap<TcPath, Vec<f64>> = BTreeMap::new();
    let mut actions: BTreeMap<TcPath, i32> = BTreeMap::new();
    for _ in 0..loops.runs {
        if started.elapsed() > bound {
            break;
        }
        let mut medians = BTreeMap::new();
        for path in TcPath::ALL {
            table.prepare(path, dp, floor, &f, &mut new_flow)?;
            let mut ns = Vec::with_capacity(loops.samples as usize);
            for _ in 0..loops.samples {
                let (action, t, _) = run_once(dp, floor, &f, path, &mut new_flow, 1)?;
                actions.insert(path, action);
                ns.push(t);
            }
            ns.sort_unstable();
            let median = super::stats::quantile(&ns, 0.5) as f64;
            medians.insert(path, median);
            single.entry(path).or_default().push(median);
            if path.unmodified() {
                let (_, t, _) = run_once(dp, floor, &f, path, &mut new_flow, loops.repeat)?;
                repeated.entry(path).or_default().push(t as f64);
            }
        }
        let floor_ns = medians.get(&TcPath::Floor).copied().unwrap_or(0.0);
        let xdp_floor_ns = medians.get(&TcPath::XdpFloor).copied().unwrap_or(0.0);
        if let (Some(counted), Some(uncounted)) = (
            medians.get(&TcPath::NodePortEstablished),
            medians.get(&TcPath::NodePortEstablishedUncounted),
        ) {
            counting.push((counted - floor_ns) / (uncounted - floor_ns));
        }
        for (path, median) in medians {
            let floor = if path.is_xdp() {
                xdp_floor_ns
            } else {
                floor_ns
            };
            over.entry(path).or_default().push(median - floor);
        }
    }
    let paths = TcPath::ALL
        .iter()
        .map(|&path| TcPathResult {
            path,
            single: Spread::of(single.get(&path).cloned().unwrap_or_default()),
            over_floor: Spread::of(over.get(&path).cloned().unwrap_or_default()),
            repeated: repeated.get(&path).map(|v| Spread::of(v.iter().copied())),
            action: actions.get(&path).copied().unwrap_or_default(),
        })
        .collect::<Vec<_>>();
    for p in &paths {
        eprintln!(
            "tc cost: {:<62} single {:>6.0} ns (min {:.0}), over floor {:>6.0} ns, repeat {}",
            p.path.label(),
            p.single.median,
            p.single.min,
            p.over_floor.median,
            p.repeated
                .map_or("-".to_owned(), |r| format!("{:.1} ns", r.median))
        );
    }
    let loop_ns: BTreeMap<TcPath, f64> = paths
        .iter()
        .map(|p| (p.path, p.repeated.map_or(p.single.median, |r| r.median)))
        .collect();
    let profile = match profile(dp, floor, &f, &mut new_flow, &mut table, loops, &loop_ns) {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("tc cost: no profile: {e}");
            Some(format!("No profile: {e}."))
        }
    };
    Ok(PacketCostResult {
        loops,
        paths,
        profile,
        counting: Spread::of(counting),
    })
}

/// Empty `BPF_PROG_TYPE_SCHED_CLS` and `BPF_PROG_TYPE_XDP` programs loaded with the raw
/// `bpf(2)` syscall (aya only loads programs from an ELF object): `r0 = 0 (TC_ACT_OK); exit`
/// and `r0 = 2 (XDP_PASS); exit`.
#[derive(Debug)]
struct EmptyProgram {
    fd: OwnedFd,
    xdp: OwnedFd,
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
pub(super) const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
pub(super) const BPF_PROG_TYPE_XDP: u32 = 6;

impl EmptyProgram {
    fn load() -> Result<Self> {
        Ok(Self {
            fd: raw_program(BPF_PROG_TYPE_SCHED_CLS, 0)?,
            xdp: raw_program(BPF_PROG_TYPE_XDP, XDP_PASS as u8)?,
        })
    }

    /// `BPF_PROG_TEST_RUN` of the empty tc program with the same skb ctx as the agent's
    /// helper; (action, ns per run).
    fn test_run(&self, packet: &[u8], ifindex: u32, repeat: u32) -> Result<(i32, u64)> {
        let mut ctx = [0u8; SKB_CTX_LEN];
        ctx[36..40].copy_from_slice(&ifindex.to_ne_bytes());
        ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        Self::run(&self.fd, packet, &ctx, repeat)
    }

    /// The same for the empty XDP program, with the agent's `xdp_md` (data_end, ingress
    /// interface).
    fn test_run_xdp(&self, packet: &[u8], ifindex: u32, repeat: u32) -> Result<(i32, u64)> {
        let mut ctx = [0u8; 24];
        let len = u32::try_from(packet.len()).unwrap_or(u32::MAX);
        ctx[4..8].copy_from_slice(&len.to_ne_bytes());
        ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        Self::run(&self.xdp, packet, &ctx, repeat)
    }

    fn run(fd: &OwnedFd, packet: &[u8], ctx: &[u8], repeat: u32) -> Result<(i32, u64)> {
        let mut out = vec![0u8; packet.len() + 256];
        let fd = u32::try_from(fd.as_raw_fd())
            .map_err(|_| RigError::Other("negative program fd".into()))?;
        let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_ne_bytes();
        // union bpf_attr, the test part: prog_fd, retval, data_size_in, data_size_out,
        // data_in, data_out, repeat, duration, ctx_size_in, ctx_size_out, ctx_in, ctx_out.
        let mut attr = [0u8; 80];
        attr[0..4].copy_from_slice(&fd.to_ne_bytes());
        attr[8..12].copy_from_slice(&len(packet.len()));
        attr[12..16].copy_from_slice(&len(out.len()));
        attr[16..24].copy_from_slice(&(packet.as_ptr() as u64).to_ne_bytes());
        attr[24..32].copy_from_slice(&(out.as_mut_ptr() as u64).to_ne_bytes());
        attr[32..36].copy_from_slice(&repeat.max(1).to_ne_bytes());
        attr[40..44].copy_from_slice(&len(ctx.len()));
        attr[48..56].copy_from_slice(&(ctx.as_ptr() as u64).to_ne_bytes());
        // SAFETY: data_in/ctx_in point to buffers of the given sizes that the kernel reads,
        // data_out to one of the given size it writes; all outlive the call.
        unsafe { prog_test_run(&mut attr, "running an empty program")? };
        let word =
            |at: usize| u32::from_ne_bytes([attr[at], attr[at + 1], attr[at + 2], attr[at + 3]]);
        Ok((word(4) as i32, u64::from(word(36))))
    }
}

/// `BPF_PROG_TEST_RUN` with `attr` (the `test` part of `union bpf_attr`); the kernel writes its
/// results back into `attr`.
///
/// # Safety
/// Every pointer in `attr` must point to a buffer of the size `attr` gives, alive across the
/// call (written to for the output buffers).
pub(super) unsafe fn prog_test_run(attr: &mut [u8; 80], what: &str) -> Result<()> {
    // SAFETY: a valid bpf_attr prefix by the caller's contract.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            attr.as_mut_ptr(),
            attr.len(),
        )
    };
    if rc < 0 {
        return Err(RigError::io(
            format!("{what} (BPF_PROG_TEST_RUN)"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// `r0 = ret; exit` as a program of `prog_type`, loaded with the raw `bpf(2)` syscall.
pub(super) fn raw_program(prog_type: u32, ret: u8) -> Result<OwnedFd> {
    // mov64 r0, ret (BPF_ALU64 | BPF_MOV | BPF_K); exit (BPF_JMP | BPF_EXIT).
    raw_program_of(
        prog_type,
        &[u64::from_le_bytes([0xb7, 0, 0, 0, ret, 0, 0, 0]), 0x95],
    )
}

/// A program of `prog_type` made of `insns`, loaded with the raw `bpf(2)` syscall.
pub(super) fn raw_program_of(prog_type: u32, insns: &[u64]) -> Result<OwnedFd> {
    let count = u32::try_from(insns.len()).map_err(|_| RigError::Other("program size".into()))?;
    let license = c"GPL";
    // union bpf_attr, the BPF_PROG_LOAD part: prog_type, insn_cnt, insns, license; the
    // rest (no log, no flags, no name) stays zero as the kernel requires.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&prog_type.to_ne_bytes());
    attr[4..8].copy_from_slice(&count.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    // SAFETY: attr is a valid bpf_attr prefix of the given size whose pointers (insns,
    // license) outlive the call; the kernel only reads them.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_ptr(), attr.len()) };
    if fd < 0 {
        return Err(RigError::io(
            "loading a raw two-instruction program (BPF_PROG_LOAD)",
            std::io::Error::last_os_error(),
        ));
    }
    let fd =
        i32::try_from(fd).map_err(|_| RigError::Other(format!("BPF_PROG_LOAD returned {fd}")))?;
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Paths profiled: every path with a goal except the non-IP frame (met) and the IPv4 program
/// run directly (the pass-through without its hand-off): a goal missed is shown with where its
/// time goes.
const PROFILED: [TcPath; 14] = [
    TcPath::PassThrough,
    TcPath::Drop,
    TcPath::NodePortNewFlow,
    TcPath::NodePortNewFlowFullTable,
    TcPath::NodePortEstablished,
    TcPath::ReverseNat,
    TcPath::PodNotReply,
    TcPath::RemoteEstablished,
    TcPath::RemoteReverseNat,
    TcPath::RemoteNewFlow,
    TcPath::XdpPassThrough,
    TcPath::XdpEstablished,
    TcPath::XdpReverseNat,
    TcPath::XdpNewFlow,
];

/// Samples this thread with `perf record` (cpu-clock, call graphs) while it runs each path
/// in [`PROFILED`] for about a second, and returns where the samples inside `bpf_test_run`
/// (the program, its BPF functions, the kernel helpers it calls, and the harness's timing)
/// land, by self time, as Markdown. `loop_ns`: each path's measured ns per run inside
/// `bpf_test_run` (what the shares are scaled to).
fn profile(
    dp: &mut EbpfDataplane,
    floor: &EmptyProgram,
    f: &Frames,
    new_flow: &mut u32,
    table: &mut NewFlowTable,
    loops: TcLoops,
    loop_ns: &BTreeMap<TcPath, f64>,
) -> Result<String> {
    let tid = nix::unistd::gettid().as_raw();
    let names = program_names_by_symbol();
    let result_ns = |path: TcPath| loop_ns.get(&path).copied();
    let mut md = String::from(
        "**Where the time goes** (`perf record -e cpu-clock -F 20000 -g` of the benchmark \
         thread while it runs one path for about a second; of the samples whose call chain is \
         inside `bpf_test_run` — the program run and the harness's clock reads, not the \
         syscall and skb set-up around it — the share of each function by self time. \
         `bpf_prog_<tag>_F` are the program's BPF functions (the entry program and the \
         object's `#[inline(never)]` pieces, named by tag), the others kernel helpers the \
         program calls (`read_tsc` is mostly the harness's clock read). \
         *≈ ns* scales the share to the single-run median of §4 (the repeat figure for \
         pass-through).):\n",
    );
    for path in PROFILED {
        let data = std::env::temp_dir().join(crate::unique_name("perf.data"));
        let mut recorder = std::process::Command::new("perf")
            .args(["record", "-q", "-e", "cpu-clock", "-F", "20000", "-g", "-t"])
            .arg(tid.to_string())
            .arg("-o")
            .arg(&data)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| RigError::io("starting perf record", e))?;
        // perf needs a moment to attach before the loop starts.
        std::thread::sleep(Duration::from_millis(300));
        let mut looped = table.prepare(path, dp, floor, f, new_flow);
        let started = Instant::now();
        let mut runs = 0u64;
        while looped.is_ok() && started.elapsed() < Duration::from_secs(1) && runs < 100_000_000 {
            let repeat = if path.unmodified() { loops.repeat } else { 1 };
            looped = run_once(dp, floor, f, path, new_flow, repeat).map(drop);
            runs += u64::from(repeat);
            // (Outside `bpf_test_run`: not in the shares.)
            if path.new_flow_with_room() && runs.is_multiple_of(NEW_FLOWS_PER_CLEARING) {
                table.clear();
            }
        }
        // SIGINT makes perf write its file and exit.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(recorder.id()).unwrap_or(0)),
            nix::sys::signal::Signal::SIGINT,
        );
        if !matches!(
            crate::process::wait_bounded(&mut recorder, Duration::from_secs(20)),
            Ok(Some(_))
        ) {
            crate::process::kill_and_reap(&mut recorder);
        }
        looped?;
        let script = std::process::Command::new("perf")
            .args(["script", "-F", "ip,sym", "-i"])
            .arg(&data)
            .output();
        let _ = std::fs::remove_file(&data);
        let _ = std::fs::remove_file(data.with_extension("data.old"));
        let script = script.map_err(|e| RigError::io("running perf script", e))?;
        let (total, shares) = leaf_shares(&String::from_utf8_lossy(&script.stdout));
        if total == 0 {
            return Err(RigError::Other(format!(
                "perf recorded no sample inside bpf_test_run: {}",
                String::from_utf8_lossy(&script.stderr).trim()
            )));
        }
        let ns = result_ns(path);
        md.push_str(&format!(
            "\n*{}* ({runs} program runs, {total} samples inside `bpf_test_run`):\n\n\
             | function (self time) | share | ≈ ns per packet |\n|---|---|---|\n",
            path.label(),
        ));
        for (symbol, count) in shares.iter().take(10) {
            let share = *count as f64 / total as f64;
            let symbol = names
                .get(symbol.as_str())
                .map_or(symbol.as_str(), |n| n.as_str());
            md.push_str(&format!(
                "| `{symbol}` | {:.0}% | {} |\n",
                share * 100.0,
                ns.map_or("–".to_owned(), |ns| format!("{:.0}", share * ns))
            ));
        }
    }
    Ok(md)
}

/// From `perf script -F ip,sym` output (one call chain per sample, leaf first, blank line
/// between samples): the samples whose chain contains `bpf_test_run`, and their leaf symbols
/// by count, most first.
fn leaf_shares(script: &str) -> (usize, Vec<(String, usize)>) {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut total = 0;
    for sample in script.split("\n\n") {
        let symbols: Vec<&str> = sample
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .map(|s| s.split("+0x").next().unwrap_or(s))
            .collect();
        if !symbols.contains(&"bpf_test_run") {
            continue;
        }
        if let Some(leaf) = symbols.first() {
            total += 1;
            *counts.entry((*leaf).to_owned()).or_default() += 1;
        }
    }
    let mut shares: Vec<(String, usize)> = counts.into_iter().collect();
    shares.sort_by_key(|s| std::cmp::Reverse(s.1));
    (total, shares)
}

/// `bpf_prog_<tag>_<name>` symbol → `bpf_prog_<tag>_<program name>` for the loaded programs
/// (`bpftool prog show`); the kernel's symbol carries a truncated name.
fn program_names_by_symbol() -> BTreeMap<String, String> {
    let Ok(out) = std::process::Command::new("bpftool")
        .args(["prog", "show"])
        .output()
    else {
        return BTreeMap::new();
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut names = BTreeMap::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let after = |key: &str| {
            words
                .iter()
                .position(|w| *w == key)
                .and_then(|i| words.get(i + 1))
                .copied()
        };
        if let (Some(name), Some(tag)) = (after("name"), after("tag"))
            && (name.starts_with("kpr_tc") || name.starts_with("kpr_xdp"))
        {
            names.insert(format!("bpf_prog_{tag}_F"), format!("{name} ({tag})"));
        }
    }
    names
}
