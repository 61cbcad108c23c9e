//! The rate of real packets a node forwards to a NodePort's backend on one
//! core, through XDP, tc, the eBPF mode's netfilter path and the iptables mode, with plain
//! routing as the floor and plain routing with the eBPF programs attached (the tax on traffic
//! that is not a Service's), side by side in one run.
//!
//! The rig, three namespaces: `client` (eth0 10.10.0.2) ─veth─ `node` (ext0 10.10.0.1, ext1
//! 10.20.0.1) ─veth─ `sink` (eth0 10.20.0.2, the backend: a pod on another node). The
//! generator is `BPF_PROG_TEST_RUN` with live frames (`BPF_F_TEST_XDP_LIVE_FRAMES`) of an XDP
//! program that returns `XDP_TX` on the client's eth0: each frame really leaves the client's
//! veth and arrives on the node's ext0 through the veth driver, where the node's datapath of
//! the mode under test takes it — the XDP program in the driver, the tc program on the skb
//! (redirecting it with `--tc-fast-path`; by default translating it for the kernel's FORWARD,
//! with the source NAT at ext1's egress), or netfilter's DNAT/SNAT — and forwards it out by
//! ext1 to the sink, whose eth0 counts and
//! drops it in an XDP program (`rx_queue_0_xdp_drops`), so that the sink's own work, common to
//! every mode, stays small. Every frame is one small UDP packet
//! (60 bytes on the wire) of one flow: client 10.10.0.2:40000 → NodePort 10.10.0.1:30090
//! (the routing modes: straight to the sink's address). The generator thread is pinned to one
//! CPU, and
//! the veth NAPI polls that carry the frames run on that CPU too (softirqs of the CPU that
//! queued them): the whole path runs on one core.
//!
//! The rate is what arrived at the sink over the time from the generator's start until the
//! last frame arrived; frames the node dropped (a full veth ring when a stage is slower than
//! the generator) count as not delivered, so the rate is the bottleneck's.
//!
//! Two more rows put the backend on the node itself, as a pod wired by the CNI reference
//! plugin `bridge` with `host-local` (flannel's and kubenet's wiring, [`crate::cni`], run as a
//! container runtime runs it): the sink is then a pod on the node's bridge `cni0` instead of a
//! pod behind `ext1`, and the node forwards the frames into the bridge, which hands them to the
//! pod's veth (the iptables mode, and the eBPF mode's tc program; XDP cannot redirect into a
//! bridge, so there is no XDP row for it). The neighbour and the bridge's forwarding entry of
//! the pod are static too, so the bridge never floods.
//!
//! Then, on the same rig, TCP round trips (TCP_RR: one connection, a line and its echo) from
//! the client to an echo server on the sink through the same path, client and server on the
//! same CPU.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proxy_dataplane_ebpf::{EbpfDataplane, EbpfOptions, TcOptions, XdpSetting};
use proxy_dataplane_iptables::{IptablesConfig, IptablesDataplane};
use proxy_model::desired::Snapshot;
use proxy_model::objects::{ObjectKey, Objects};

use super::stats::Spread;
use crate::cni::{CniAttachment, CniNetwork, CniPlugin};
use crate::in_process::on_netns_thread;
use crate::netns::{Netns, parse_mac};
use crate::packet::{L4, build};
use crate::{Result, RigError};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 1);
const SINK: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 2);
const NODE_PORT: u16 = 30090;
const SINK_PORT: u16 = 9;
/// The TCP port of the same Service (round trips), and its echo server's port on the sink.
const TCP_NODE_PORT: u16 = 30091;
const ECHO_PORT: u16 = 8080;
const CLIENT_PORT: u16 = 40_000;
const NODE: &str = "pps-node";

/// How the node forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PpsMode {
    /// No proxy: frames addressed to the sink, routed by the kernel (the floor).
    Routing,
    /// The same frames with the eBPF mode's programs attached to the node's interfaces as by
    /// default (as [`Self::EbpfDefault`]): what a node running the eBPF mode costs traffic
    /// that is not a Service's.
    RoutingWithPrograms,
    /// kube-proxy's iptables rules (the agent's iptables mode): DNAT + MASQUERADE, conntrack.
    Iptables,
    /// The eBPF mode's netfilter path, as a user's node with a forwarding policy runs it by
    /// default (`--tc-fast-path=auto` finds the policy, or `=false`; `--bpf-xdp auto` then
    /// attaches no XDP): DNAT in the tc program at ext0's ingress, the kernel's FORWARD, SNAT
    /// in the tc program at ext1's egress. (A node without forwarding policy takes [`Self::Xdp`]
    /// by default.)
    EbpfDefault,
    /// The eBPF mode's tc program (`--tc-fast-path --bpf-xdp off`): redirect from tc.
    Tc,
    /// The eBPF mode's XDP program (`--tc-fast-path`, `--bpf-xdp auto`): redirect from the
    /// driver.
    Xdp,
    /// The iptables mode with the backend a pod on the node's CNI bridge.
    IptablesBridge,
    /// The eBPF mode's tc program with the backend a pod on the node's CNI bridge.
    TcBridge,
    /// The least any tc redirect does: a raw tc program at ext0's ingress that writes the next
    /// hop's MACs and redirects to ext1 (no parsing, lookup or NAT; the frames are addressed to
    /// the sink). What no tc program on this path can beat, so the ceiling of [`Self::Tc`].
    TcFloor,
    /// The least any XDP redirect does: the same in a raw XDP program at ext0 (`XDP_REDIRECT`
    /// to ext1). The ceiling of [`Self::Xdp`].
    XdpFloor,
    /// Plain routing with raw tc programs that only pass the packet on (`TCX_NEXT`) where the
    /// eBPF mode's netfilter path attaches its own on the frames' way (ext0's ingress, ext1's
    /// egress): what having any tc program there costs, the ceiling of
    /// [`Self::RoutingWithPrograms`].
    RoutingWithEmptyPrograms,
}

impl PpsMode {
    pub const ALL: [Self; 11] = [
        Self::Routing,
        Self::RoutingWithPrograms,
        Self::RoutingWithEmptyPrograms,
        Self::Iptables,
        Self::EbpfDefault,
        Self::Tc,
        Self::TcFloor,
        Self::Xdp,
        Self::XdpFloor,
        Self::IptablesBridge,
        Self::TcBridge,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Routing => "plain routing (no proxy; the floor)",
            Self::RoutingWithPrograms => {
                "plain routing, eBPF mode's programs attached (not a Service's traffic)"
            }
            Self::Iptables => "iptables mode (DNAT + MASQUERADE)",
            Self::EbpfDefault => {
                "eBPF, netfilter path (tc DNAT, kernel FORWARD, tc SNAT; the default where a forwarding policy is)"
            }
            Self::Tc => "eBPF, tc (--tc-fast-path --bpf-xdp off)",
            Self::Xdp => "eBPF, XDP (--tc-fast-path; the default without a forwarding policy)",
            Self::IptablesBridge => "iptables mode, backend a pod on the node's CNI bridge",
            Self::TcBridge => "eBPF, tc, backend a pod on the node's CNI bridge",
            Self::TcFloor => {
                "floor of tc: a raw tc program that only writes the MACs and redirects"
            }
            Self::XdpFloor => {
                "floor of XDP: a raw XDP program that only writes the MACs and redirects"
            }
            Self::RoutingWithEmptyPrograms => {
                "plain routing, raw tc programs that only pass the packet on attached"
            }
        }
    }

    /// The floor this mode is bounded by: the same redirect or attachment without any of the
    /// mode's work.
    pub fn floor(self) -> Option<Self> {
        match self {
            Self::Tc => Some(Self::TcFloor),
            Self::Xdp => Some(Self::XdpFloor),
            Self::RoutingWithPrograms => Some(Self::RoutingWithEmptyPrograms),
            _ => None,
        }
    }

    /// Whether the backend is a pod on the node's bridge (not behind `ext1`).
    pub fn bridge(self) -> bool {
        matches!(self, Self::IptablesBridge | Self::TcBridge)
    }

    /// Whether the client addresses the sink itself (no Service on the way).
    pub fn routed(self) -> bool {
        matches!(
            self,
            Self::Routing
                | Self::RoutingWithPrograms
                | Self::RoutingWithEmptyPrograms
                | Self::TcFloor
                | Self::XdpFloor
        )
    }
}

/// How much to measure.
#[derive(Debug, Clone, Copy)]
pub struct PpsLoops {
    /// Interleaved rounds over all modes (a fresh rig per mode and round).
    pub runs: usize,
    /// Frames the generator sends per measurement.
    pub frames: u32,
    /// TCP round trips per measurement (one connection, request and echo: TCP_RR).
    pub round_trips: u32,
}

/// One mode's figures over the runs.
#[derive(Debug, Clone)]
pub struct PpsModeResult {
    pub mode: PpsMode,
    /// Packets per second that reached the sink.
    pub pps: Spread,
    /// Share of the generated frames that reached the sink.
    pub delivered: Spread,
    /// TCP round trips through the same path: median latency (ns) and rate per second.
    pub rr_p50_ns: Spread,
    pub rr_rate: Spread,
}

#[derive(Debug, Clone)]
pub struct PpsResult {
    pub loops: PpsLoops,
    pub modes: Vec<PpsModeResult>,
    /// Each round's packet rate per mode (for same-round ratios).
    pub runs: Vec<std::collections::BTreeMap<PpsMode, f64>>,
    /// Each round's TCP round-trip rate per mode.
    pub rr_runs: Vec<std::collections::BTreeMap<PpsMode, f64>>,
    /// The CPU the generator (and the forwarding) ran on.
    pub cpu: usize,
}

impl PpsResult {
    pub fn of(&self, mode: PpsMode) -> Option<&PpsModeResult> {
        self.modes.iter().find(|m| m.mode == mode)
    }
}

/// Runs every mode `loops.runs` times, interleaved, on `cpu`.
pub fn packet_rate(loops: PpsLoops, cpu: usize) -> Result<PpsResult> {
    let mut measured: Vec<(PpsMode, Vec<Measured>)> =
        PpsMode::ALL.iter().map(|m| (*m, Vec::new())).collect();
    let mut runs = Vec::with_capacity(loops.runs);
    let mut rr_runs = Vec::with_capacity(loops.runs);
    for _ in 0..loops.runs {
        let mut round = std::collections::BTreeMap::new();
        let mut rr_round = std::collections::BTreeMap::new();
        for (mode, list) in &mut measured {
            let m = one_run(*mode, loops, cpu)?;
            eprintln!(
                "pps: {:<54} {:>10.0} packets/s ({:.1} % of {} frames delivered); TCP round \
                 trip p50 {:.1} µs, {:.0}/s",
                mode.label(),
                m.pps,
                m.delivered * 100.0,
                loops.frames,
                m.rr_p50_ns / 1000.0,
                m.rr_rate
            );
            round.insert(*mode, m.pps);
            rr_round.insert(*mode, m.rr_rate);
            list.push(m);
        }
        runs.push(round);
        rr_runs.push(rr_round);
    }
    let spread = |list: &[Measured], f: fn(&Measured) -> f64| Spread::of(list.iter().map(f));
    Ok(PpsResult {
        loops,
        modes: measured
            .iter()
            .map(|(mode, list)| PpsModeResult {
                mode: *mode,
                pps: spread(list, |m| m.pps),
                delivered: spread(list, |m| m.delivered),
                rr_p50_ns: spread(list, |m| m.rr_p50_ns),
                rr_rate: spread(list, |m| m.rr_rate),
            })
            .collect(),
        runs,
        rr_runs,
        cpu,
    })
}

fn other(what: impl Into<String>) -> RigError {
    RigError::Other(what.into())
}

/// The three namespaces and their links. Drop order (fields): the sink's CNI attachment
/// (`DEL`) and network before the namespaces.
struct Rig {
    cni_sink: Option<CniAttachment>,
    cni: Option<CniNetwork>,
    client: Netns,
    node: Netns,
    sink: Netns,
    /// The sink's address: behind `ext1`, or the one the bridge plugin's IPAM gave it.
    sink_ip: Ipv4Addr,
    /// The node's interface towards the sink (`ext1`, or the bridge).
    sink_dev: &'static str,
}

impl Rig {
    /// The rig; with `bridge`, the sink is a pod on the node's CNI bridge instead of behind
    /// `ext1`.
    fn new(bridge: bool) -> Result<Self> {
        let mut rig = Self {
            cni_sink: None,
            cni: None,
            client: Netns::new("ppsc")?,
            node: Netns::new("ppsn")?,
            sink: Netns::new("ppss")?,
            sink_ip: SINK,
            sink_dev: "ext1",
        };
        rig.node.sysctl("net.ipv4.ip_forward", "1")?;
        let mut links = vec![(&rig.client, "ext0", "10.10.0.1/24", "10.10.0.2/24")];
        if !bridge {
            links.push((&rig.sink, "ext1", "10.20.0.1/24", "10.20.0.2/24"));
        }
        for (outer, dev, node_addr, peer_addr) in links {
            rig.node
                .ip(&["link", "add", dev, "type", "veth", "peer", "name", "eth0"])?;
            rig.node
                .ip(&["link", "set", "eth0", "netns", outer.name()])?;
            rig.node.ip(&["addr", "add", node_addr, "dev", dev])?;
            rig.node.ip(&["link", "set", dev, "up"])?;
            outer.ip(&["addr", "add", peer_addr, "dev", "eth0"])?;
            outer.ip(&["link", "set", "eth0", "up"])?;
            // NAPI on both ends of each link: a veth takes XDP frames (the generator's
            // `XDP_TX`, the XDP program's redirect) only with it.
            rig.node.exec("ethtool", &["-K", dev, "gro", "on"])?;
            outer.exec("ethtool", &["-K", "eth0", "gro", "on"])?;
        }
        if bridge {
            let cni = CniNetwork::new(CniPlugin::Bridge, &rig.node)?;
            let attachment = cni.add(&rig.sink)?;
            rig.sink_ip = attachment.addresses().0;
            rig.sink_dev = crate::cni::BRIDGE_NAME;
            rig.cni = Some(cni);
            rig.cni_sink = Some(attachment);
            rig.sink.exec("ethtool", &["-K", "eth0", "gro", "on"])?;
        }
        // Static neighbours: no ARP in the measurement.
        let sink_mac = rig.sink.mac("eth0")?;
        let client_mac = rig.client.mac("eth0")?;
        rig.node.ip(&[
            "neigh",
            "replace",
            &rig.sink_ip.to_string(),
            "lladdr",
            &sink_mac,
            "dev",
            rig.sink_dev,
            "nud",
            "permanent",
        ])?;
        if bridge {
            // The bridge learns a MAC from the frames it receives, and the sink (dropping
            // everything in XDP) sends none: a static entry on the pod's port, so the bridge
            // forwards to that port instead of flooding.
            let port = bridge_port(&rig.node)?;
            rig.node.exec(
                "bridge",
                &[
                    "fdb", "replace", &sink_mac, "dev", &port, "master", "static",
                ],
            )?;
        }
        rig.node.ip(&[
            "neigh",
            "replace",
            "10.10.0.2",
            "lladdr",
            &client_mac,
            "dev",
            "ext0",
            "nud",
            "permanent",
        ])?;
        rig.client
            .ip(&["route", "add", "10.20.0.0/24", "via", "10.10.0.1"])?;
        if !bridge {
            // (The bridge plugin gave the pod its default route, via the bridge's address.)
            rig.sink
                .ip(&["route", "add", "default", "via", "10.20.0.1"])?;
        }
        Ok(rig)
    }

    /// Attaches an `XDP_DROP` program to the sink's eth0 (native mode, a BPF link held by the
    /// returned fd): the sink counts a packet (`rx_queue_0_xdp_drops`) and drops it before
    /// building an skb, so its own cost, common to every mode, stays small.
    fn sink_drop(&self) -> Result<(OwnedFd, OwnedFd)> {
        let program = super::tc::raw_program(super::tc::BPF_PROG_TYPE_XDP, 1)?;
        let prog_fd = program.as_raw_fd();
        let link = crate::netns::on_thread_in(&self.sink.path(), move || {
            link_create(prog_fd, "eth0", BPF_XDP, XDP_FLAGS_DRV_MODE)
        })??;
        Ok((program, link))
    }

    /// Packets the sink's XDP program dropped (all it received).
    fn sink_rx(&self) -> Result<u64> {
        veth_counter(&self.sink, "eth0", "rx_queue_0_xdp_drops")
    }
}

/// `enum bpf_attach_type`: XDP, and tcx's ingress and egress hooks.
const BPF_XDP: u32 = 37;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// `XDP_FLAGS_DRV_MODE`: in the driver (veth's native XDP), as the agent attaches.
const XDP_FLAGS_DRV_MODE: u32 = 4;
/// `BPF_FUNC_redirect`.
const BPF_FUNC_REDIRECT: i32 = 23;

/// Attaches the program `prog_fd` to `interface` of the calling thread's namespace at
/// `attach_type` (a BPF link; the returned fd holds it).
fn link_create(prog_fd: i32, interface: &str, attach_type: u32, flags: u32) -> Result<OwnedFd> {
    let ifindex = nix::net::if_::if_nametoindex(interface)
        .map_err(|e| RigError::nix(format!("ifindex of {interface}"), e))?;
    // union bpf_attr, BPF_LINK_CREATE: prog_fd, target_ifindex, attach_type, flags; tcx's
    // relative fd and expected revision stay 0 (anywhere in the chain, any revision).
    let mut attr = [0u8; 64];
    let fd = u32::try_from(prog_fd).map_err(|_| other("negative program fd"))?;
    attr[0..4].copy_from_slice(&fd.to_ne_bytes());
    attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    attr[8..12].copy_from_slice(&attach_type.to_ne_bytes());
    attr[12..16].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: attr is a valid bpf_attr prefix without pointers.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, 28, attr.as_ptr(), attr.len()) };
    if rc < 0 {
        return Err(RigError::io(
            format!("attaching a program to {interface} (BPF_LINK_CREATE, type {attach_type})"),
            std::io::Error::last_os_error(),
        ));
    }
    let rc = i32::try_from(rc).map_err(|_| other("link fd"))?;
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(rc) })
}

/// The floor programs' instructions: if the frame is IPv4, write `dst` and `src` as its MACs
/// and return `bpf_redirect(ifindex, 0)` (`TC_ACT_REDIRECT` from tc, `XDP_REDIRECT` from
/// XDP); otherwise (ARP among them) return `pass`. `data` and `data_end` are the offsets of
/// the context's packet pointers (`__sk_buff`: 76 and 80; `xdp_md`: 0 and 4).
fn redirect_floor(
    data: i16,
    data_end: i16,
    dst: [u8; 6],
    src: [u8; 6],
    ifindex: u32,
    pass: i32,
) -> Result<Vec<u64>> {
    let word = |b: [u8; 4]| i32::from_le_bytes(b);
    let half = |b: [u8; 2]| i32::from(i16::from_le_bytes(b));
    let ifindex = i32::try_from(ifindex).map_err(|_| other("ifindex"))?;
    Ok(vec![
        insn(0x61, 2, 1, data, 0),     // r2 = ctx->data
        insn(0x61, 3, 1, data_end, 0), // r3 = ctx->data_end
        insn(0xbf, 4, 2, 0, 0),        // r4 = r2
        insn(0x07, 4, 0, 0, 14),       // r4 += ETH_HLEN
        insn(0x2d, 4, 3, 10, 0),       // if r4 > r3 goto pass
        insn(0x69, 5, 2, 12, 0),       // r5 = *(u16 *)(r2 + 12): the ethertype
        insn(0x55, 5, 0, 8, 0x0008),   // if r5 != ETH_P_IP (as loaded) goto pass
        insn(0x62, 2, 0, 0, word([dst[0], dst[1], dst[2], dst[3]])), // *(u32 *)(r2 + 0)
        insn(0x6a, 2, 0, 4, half([dst[4], dst[5]])), // *(u16 *)(r2 + 4)
        insn(0x6a, 2, 0, 6, half([src[0], src[1]])), // *(u16 *)(r2 + 6)
        insn(0x62, 2, 0, 8, word([src[2], src[3], src[4], src[5]])), // *(u32 *)(r2 + 8)
        insn(0xb7, 1, 0, 0, ifindex),  // r1 = ifindex
        insn(0xb7, 2, 0, 0, 0),        // r2 = 0 (flags)
        insn(0x85, 0, 0, 0, BPF_FUNC_REDIRECT),
        insn(0x95, 0, 0, 0, 0),    // exit (r0: the helper's verdict)
        insn(0xb7, 0, 0, 0, pass), // pass: r0 = pass
        insn(0x95, 0, 0, 0, 0),
    ])
}

/// The one port of the node's bridge (the sink pod's host-side veth): `ip -o link show
/// master cni0` prints `<index>: <name>@<peer>: <flags> ...`.
fn bridge_port(node: &Netns) -> Result<String> {
    let text = node.ip(&["-o", "link", "show", "master", crate::cni::BRIDGE_NAME])?;
    let mut names = text.lines().filter_map(|line| {
        let name = line.split(": ").nth(1)?;
        Some(name.split('@').next().unwrap_or(name).to_owned())
    });
    match (names.next(), names.next()) {
        (Some(name), None) => Ok(name),
        _ => Err(other(format!("not one port on the bridge: {text}"))),
    }
}

/// A veth driver counter of `interface` in `netns` (`ethtool -S`).
fn veth_counter(netns: &Netns, interface: &str, counter: &str) -> Result<u64> {
    let text = netns.exec("ethtool", &["-S", interface])?;
    text.lines()
        .find_map(|line| {
            let (name, value) = line.trim().split_once(':')?;
            (name == counter).then(|| value.trim().parse().ok())?
        })
        .ok_or_else(|| other(format!("no {counter} in {text}")))
}

/// Datagrams the IP stack of `netns` forwarded (`Ip: ForwDatagrams` of `/proc/net/snmp`,
/// which is per namespace).
fn ip_forwarded(netns: &Netns) -> Result<u64> {
    let text = netns.exec("cat", &["/proc/net/snmp"])?;
    let mut ip = text.lines().filter(|line| line.starts_with("Ip: "));
    let (Some(names), Some(values)) = (ip.next(), ip.next()) else {
        return Err(other(format!("no Ip lines in /proc/net/snmp: {text}")));
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find_map(|(name, value)| (name == "ForwDatagrams").then(|| value.parse().ok())?)
        .ok_or_else(|| other(format!("no Ip ForwDatagrams in /proc/net/snmp: {text}")))
}

/// What one measurement of a mode gives.
struct Measured {
    pps: f64,
    delivered: f64,
    rr_p50_ns: f64,
    rr_rate: f64,
}

/// One measurement of `mode` on a fresh rig: the packet rate, then TCP round trips.
fn one_run(mode: PpsMode, loops: PpsLoops, cpu: usize) -> Result<Measured> {
    let frames = loops.frames;
    let rig = Rig::new(mode.bridge())?;
    let sink = rig.sink_drop()?;
    let forwarded_before = ip_forwarded(&rig.node)?;
    let destination = if mode.routed() {
        SocketAddr::new(IpAddr::V4(SINK), SINK_PORT)
    } else {
        SocketAddr::new(IpAddr::V4(NODE_IP), NODE_PORT)
    };
    let mut frame = build(
        SocketAddr::new(IpAddr::V4(CLIENT), CLIENT_PORT),
        destination,
        L4::Udp,
        &[0u8; 18],
    );
    frame[0..6].copy_from_slice(&parse_mac(&rig.node.mac("ext0")?)?);
    frame[6..12].copy_from_slice(&parse_mac(&rig.client.mac("eth0")?)?);
    let client_path = rig.client.path();
    let sink_ip = rig.sink_ip;
    // The sink's MAC and the node's on the link to it: what the floors write.
    let next_hop = (
        parse_mac(&rig.sink.mac("eth0")?)?,
        parse_mac(&rig.node.mac(rig.sink_dev)?)?,
    );
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    // The node's dataplane lives on a thread in the node namespace until the measurement is
    // over.
    let node_thread = {
        let path = rig.node.path();
        std::thread::spawn(move || -> Result<()> {
            on_netns_thread(path, move |parts| -> Result<()> {
                let _dataplane = start_dataplane(mode, sink_ip, next_hop, &parts)?;
                let _ = ready_tx.send(());
                let _ = done_rx.recv_timeout(Duration::from_secs(600));
                Ok(())
            })?
        })
    };
    let ready = ready_rx.recv_timeout(Duration::from_secs(120));
    let measured = match ready {
        Ok(()) => measure(&rig, client_path, frame, frames, cpu).and_then(|(pps, delivered)| {
            // The netfilter path's figure is only that path's if the kernel forwarded
            // the frames: a flow the tc program bypassed netfilter for (`ct_flags::BYPASS`)
            // would measure the fast path instead.
            if mode == PpsMode::EbpfDefault {
                let forwarded = ip_forwarded(&rig.node)?.saturating_sub(forwarded_before);
                if (forwarded as f64) < delivered * f64::from(frames) {
                    return Err(other(format!(
                        "{}: the kernel forwarded only {forwarded} of the {:.0} frames \
                         delivered",
                        mode.label(),
                        delivered * f64::from(frames)
                    )));
                }
            }
            drop(sink);
            let (rr_p50_ns, rr_rate) = round_trips(&rig, mode, loops.round_trips, cpu)?;
            Ok(Measured {
                pps,
                delivered,
                rr_p50_ns,
                rr_rate,
            })
        }),
        Err(_) => Err(other(format!(
            "{}: the dataplane did not start",
            mode.label()
        ))),
    };
    let _ = done_tx.send(());
    let started = node_thread
        .join()
        .map_err(|_| other("the node thread panicked"))?;
    started?;
    measured
}

/// TCP round trips (`rig-helper bench-connect --workload rr`: one connection, a line written
/// and its echo read) from the client to an echo server on the sink, through the NodePort
/// (routing: the sink's address), with client and server on `cpu`; both ends send complete
/// checksums, as hosts behind wires do (veth would leave them to an offload XDP cannot see).
/// (p50 ns, round trips per second).
fn round_trips(rig: &Rig, mode: PpsMode, count: u32, cpu: usize) -> Result<(f64, f64)> {
    for netns in [&rig.client, &rig.sink] {
        netns.exec("ethtool", &["-K", "eth0", "tx", "off"])?;
    }
    let echo = crate::echo::EchoServer::start(
        &rig.sink.path(),
        "pod-sink",
        SocketAddr::new(IpAddr::V4(rig.sink_ip), ECHO_PORT),
    )?;
    super::client::pin_process(echo.pid(), cpu)?;
    let target = if mode.routed() {
        SocketAddr::new(IpAddr::V4(SINK), ECHO_PORT)
    } else {
        SocketAddr::new(IpAddr::V4(NODE_IP), TCP_NODE_PORT)
    };
    let place = super::client::Place {
        netns: rig.client.path(),
        cgroup: None,
    };
    // (Read in the XDP mode only: in the bridge modes there is no `ext1`.)
    let redirected = |rig: &Rig| -> Result<[u64; 2]> {
        if mode != PpsMode::Xdp {
            return Ok([0, 0]);
        }
        Ok([
            veth_counter(&rig.node, "ext0", "rx_queue_0_xdp_redirect")?,
            veth_counter(&rig.node, "ext1", "rx_queue_0_xdp_redirect")?,
        ])
    };
    let before = redirected(rig)?;
    let samples = super::client::run_bench(
        &place,
        target,
        super::client::Workload::Rr,
        count,
        Duration::from_secs(20),
    )?;
    // Through XDP indeed: every request redirected from ext0, every answer from ext1.
    let after = redirected(rig)?;
    let through_xdp = [after[0] - before[0], after[1] - before[1]];
    if mode == PpsMode::Xdp && through_xdp.iter().any(|n| *n < u64::from(count)) {
        return Err(other(format!(
            "{}: only {through_xdp:?} packets redirected by XDP (ext0, ext1) for {count} round \
             trips",
            mode.label()
        )));
    }
    if samples.errors > 0 || samples.ns.is_empty() {
        return Err(other(format!(
            "{}: TCP round trips: {} errors (first: {})",
            mode.label(),
            samples.errors,
            samples.first_error
        )));
    }
    let mut ns = samples.ns.clone();
    ns.sort_unstable();
    Ok((super::stats::quantile(&ns, 0.5) as f64, samples.rate))
}

/// Warms the path up (first frames: the flow is started, the neighbours resolved), then sends
/// `frames` and waits for the sink's counter to settle.
fn measure(
    rig: &Rig,
    client: PathBuf,
    frame: Vec<u8>,
    frames: u32,
    cpu: usize,
) -> Result<(f64, f64)> {
    let generator = crate::netns::on_thread_in(&client, move || -> Result<Generator> {
        Generator::load(&frame)
    })??;
    generator.send_from(&client, 10_000, cpu)?;
    settle(rig)?;
    let before = rig.sink_rx()?;
    let started = Instant::now();
    generator.send_from(&client, frames, cpu)?;
    let last = settle(rig)?;
    let delivered = rig.sink_rx()?.saturating_sub(before);
    let elapsed = last
        .saturating_duration_since(started)
        .as_secs_f64()
        .max(1e-6);
    Ok((
        delivered as f64 / elapsed,
        f64::from(u32::try_from(delivered).unwrap_or(u32::MAX)) / f64::from(frames),
    ))
}

/// Polls the sink's counter until it has not moved for 50 ms (bounded); returns when it last
/// moved.
fn settle(rig: &Rig) -> Result<Instant> {
    let mut last_value = rig.sink_rx()?;
    let mut last_change = Instant::now();
    let bound = Instant::now() + Duration::from_secs(10);
    while Instant::now() < bound {
        std::thread::sleep(Duration::from_millis(5));
        let value = rig.sink_rx()?;
        if value != last_value {
            last_value = value;
            last_change = Instant::now();
        } else if last_change.elapsed() > Duration::from_millis(50) {
            break;
        }
    }
    Ok(last_change)
}

/// Starts the node's dataplane of `mode` and programs `pps`: NodePort UDP 30090 → 9 on the sink
/// at `sink_ip` (a pod on another node, or on the node's bridge). With the programs attached to
/// routed traffic the Service is programmed too, as on any node: the programs then look up a
/// populated map and miss, as they do for a real node's traffic that is not a Service's.
fn start_dataplane(
    mode: PpsMode,
    sink_ip: Ipv4Addr,
    next_hop: ([u8; 6], [u8; 6]),
    parts: &crate::in_process::InProcess,
) -> Result<Option<Node>> {
    let snapshot = snapshot(sink_ip, mode.bridge())?;
    match mode {
        PpsMode::Routing => Ok(None),
        PpsMode::TcFloor | PpsMode::XdpFloor => {
            let ifindex = nix::net::if_::if_nametoindex("ext1")
                .map_err(|e| RigError::nix("ifindex of ext1", e))?;
            let (dst, src) = next_hop;
            let (prog_type, data, data_end, pass, attach, flags) = if mode == PpsMode::TcFloor {
                // TC_ACT_UNSPEC: the next program, or the stack.
                (
                    super::tc::BPF_PROG_TYPE_SCHED_CLS,
                    76,
                    80,
                    -1,
                    BPF_TCX_INGRESS,
                    0,
                )
            } else {
                // XDP_PASS.
                (
                    super::tc::BPF_PROG_TYPE_XDP,
                    0,
                    4,
                    2,
                    BPF_XDP,
                    XDP_FLAGS_DRV_MODE,
                )
            };
            let program = super::tc::raw_program_of(
                prog_type,
                &redirect_floor(data, data_end, dst, src, ifindex, pass)?,
            )?;
            let link = link_create(program.as_raw_fd(), "ext0", attach, flags)?;
            Ok(Some(Node::Raw(vec![program, link])))
        }
        PpsMode::RoutingWithEmptyPrograms => {
            // TC_ACT_UNSPEC (TCX_NEXT), as the eBPF mode's programs return for such traffic.
            let program = super::tc::raw_program_of(
                super::tc::BPF_PROG_TYPE_SCHED_CLS,
                &[insn(0xb7, 0, 0, 0, -1), insn(0x95, 0, 0, 0, 0)],
            )?;
            let ingress = link_create(program.as_raw_fd(), "ext0", BPF_TCX_INGRESS, 0)?;
            let egress = link_create(program.as_raw_fd(), "ext1", BPF_TCX_EGRESS, 0)?;
            Ok(Some(Node::Raw(vec![program, ingress, egress])))
        }
        PpsMode::Iptables | PpsMode::IptablesBridge => {
            let mut dataplane = IptablesDataplane::start(IptablesConfig::default())
                .map_err(|e| other(format!("starting the iptables dataplane: {e}")))?;
            for result in dataplane.apply(&snapshot, None) {
                result.map_err(|e| other(format!("iptables sync: {e}")))?;
            }
            Ok(Some(Node::Iptables(Box::new(dataplane))))
        }
        PpsMode::RoutingWithPrograms
        | PpsMode::EbpfDefault
        | PpsMode::Tc
        | PpsMode::Xdp
        | PpsMode::TcBridge => {
            // The fast-path modes set the flag; the netfilter path keeps `TcOptions`' defaults
            // (fast path off, `--bpf-xdp auto`), what the agent's `--tc-fast-path=auto` starts
            // with on a node with a forwarding policy.
            let fast_path = matches!(mode, PpsMode::Tc | PpsMode::Xdp | PpsMode::TcBridge);
            let options = EbpfOptions {
                cgroup_path: parts.cgroup_path(),
                bpf_root: parts.bpf_root(),
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
                    // The links to other hosts (without a bridge, the interfaces `--interfaces`'
                    // default, every one with a global address, picks); a pod's bridge is not
                    // one.
                    interfaces: if mode.bridge() {
                        vec!["ext0".into()]
                    } else {
                        vec!["ext0".into(), "ext1".into()]
                    },
                    fast_path,
                    xdp: match mode {
                        PpsMode::Tc | PpsMode::TcBridge => XdpSetting::Off,
                        _ => XdpSetting::Auto,
                    },
                    ..TcOptions::default()
                },
                disabled_features: Default::default(),
                icmp_ratelimit: None,
                snat_ports: proxy_dataplane_ebpf::conntrack::reserved_ports::DEFAULT_RANGE,
            };
            let mut dataplane = EbpfDataplane::start(&options)
                .map_err(|e| other(format!("loading the eBPF dataplane: {e}")))?;
            let (_, errors) = dataplane.apply(&snapshot, None);
            if !errors.is_empty() {
                return Err(other(format!("apply errors: {errors:?}")));
            }
            // `--bpf-xdp auto` attaches only with the fast path: none on the netfilter path.
            let attached = dataplane.xdp_interfaces().len();
            if attached != if mode == PpsMode::Xdp { 2 } else { 0 } {
                return Err(other(format!(
                    "{}: XDP on {attached} interfaces",
                    mode.label()
                )));
            }
            Ok(Some(Node::Ebpf(Box::new(dataplane))))
        }
    }
}

/// A started dataplane, kept alive for the measurement.
enum Node {
    Iptables(#[expect(dead_code, reason = "kept for its rules")] Box<IptablesDataplane>),
    Ebpf(#[expect(dead_code, reason = "kept for its links")] Box<EbpfDataplane>),
    /// A floor's raw program and links.
    Raw(#[expect(dead_code, reason = "kept for the links")] Vec<OwnedFd>),
}

/// The Service and its one endpoint, `sink_ip`: on this node (`local`) or another.
fn snapshot(sink_ip: Ipv4Addr, local: bool) -> Result<Snapshot> {
    let key = |name: &str| ObjectKey {
        namespace: "bench".into(),
        name: name.into(),
    };
    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "pps", "namespace": "bench"},
        "spec": {"type": "NodePort", "clusterIP": "10.96.0.30",
            "ports": [{"name": "udp", "port": 53, "protocol": "UDP",
                "targetPort": SINK_PORT, "nodePort": NODE_PORT},
                {"name": "tcp", "port": 80, "protocol": "TCP",
                "targetPort": ECHO_PORT, "nodePort": TCP_NODE_PORT}]}
    }))
    .map_err(|e| other(format!("Service: {e}")))?;
    let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "pps-1", "namespace": "bench",
            "labels": {"kubernetes.io/service-name": "pps"}},
        "addressType": "IPv4",
        "ports": [{"name": "udp", "port": SINK_PORT, "protocol": "UDP"},
            {"name": "tcp", "port": ECHO_PORT, "protocol": "TCP"}],
        "endpoints": [{"addresses": [sink_ip.to_string()],
            "nodeName": if local { NODE } else { "other-node" },
            "conditions": {"ready": true}}]
    }))
    .map_err(|e| other(format!("EndpointSlice: {e}")))?;
    let snapshot = Snapshot::compute(
        &Objects::new(
            [(key("pps"), service.into())].into(),
            [(key("pps-1"), slice.into())].into(),
            None,
        ),
        NODE,
    );
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    if errors.is_empty() {
        Ok(snapshot)
    } else {
        Err(other(format!("snapshot errors: {errors:?}")))
    }
}

/// The packet generator: an XDP program test-run with live frames on the client's eth0 that
/// writes the frame (all of its 60 bytes, from immediates) and returns `XDP_TX`. Live mode
/// initialises a page with the frame only when its page pool first hands it out; a recycled
/// page keeps what the last user left in it (a forwarded packet's rewritten MACs, TTL and NAT),
/// so the program writes every frame afresh.
struct Generator {
    program: OwnedFd,
    frame: Vec<u8>,
}

/// One BPF instruction: opcode, registers, offset, immediate.
fn insn(opcode: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    let mut b = [0u8; 8];
    b[0] = opcode;
    b[1] = (src << 4) | dst;
    b[2..4].copy_from_slice(&off.to_le_bytes());
    b[4..8].copy_from_slice(&imm.to_le_bytes());
    u64::from_le_bytes(b)
}

/// The generator's instructions: bounds check, the frame stored 4 bytes at a time (BPF_ST
/// immediates), `XDP_TX` (`XDP_DROP` for a buffer shorter than the frame).
fn writer(frame: &[u8]) -> Result<Vec<u64>> {
    if !frame.len().is_multiple_of(4) || frame.len() > 128 {
        return Err(other(format!("generator frame of {} bytes", frame.len())));
    }
    let words = frame.len() / 4;
    let len = i32::try_from(frame.len()).map_err(|_| other("frame length"))?;
    let mut p = vec![
        insn(0x61, 2, 1, 0, 0),   // r2 = ctx->data
        insn(0x61, 3, 1, 4, 0),   // r3 = ctx->data_end
        insn(0xbf, 4, 2, 0, 0),   // r4 = r2
        insn(0x07, 4, 0, 0, len), // r4 += len
        // if r4 > r3 goto drop (past the stores and the XDP_TX exit)
        insn(
            0x2d,
            4,
            3,
            i16::try_from(words + 2).map_err(|_| other("jump"))?,
            0,
        ),
    ];
    for (i, word) in frame.chunks(4).enumerate() {
        let imm = i32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        let off = i16::try_from(i * 4).map_err(|_| other("offset"))?;
        p.push(insn(0x62, 2, 0, off, imm)); // *(u32 *)(r2 + off) = imm
    }
    p.push(insn(0xb7, 0, 0, 0, i32::from(XDP_TX))); // r0 = XDP_TX
    p.push(insn(0x95, 0, 0, 0, 0)); // exit
    p.push(insn(0xb7, 0, 0, 0, 1)); // drop: r0 = XDP_DROP
    p.push(insn(0x95, 0, 0, 0, 0)); // exit
    Ok(p)
}

/// `BPF_F_TEST_XDP_LIVE_FRAMES`.
const LIVE_FRAMES: u32 = 1 << 1;
const XDP_TX: u8 = 3;

impl Generator {
    fn load(frame: &[u8]) -> Result<Self> {
        let program = super::tc::raw_program_of(super::tc::BPF_PROG_TYPE_XDP, &writer(frame)?)?;
        Ok(Self {
            program,
            frame: frame.to_vec(),
        })
    }

    /// Sends `count` copies of the frame out of the client's eth0, from a thread in the client
    /// namespace pinned to `cpu`.
    fn send_from(&self, client: &std::path::Path, count: u32, cpu: usize) -> Result<()> {
        let fd = self.program.as_raw_fd();
        let frame = self.frame.clone();
        crate::netns::on_thread_in(client, move || -> Result<()> {
            let mut set = nix::sched::CpuSet::new();
            set.set(cpu).map_err(|e| RigError::nix("CPU set", e))?;
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                .map_err(|e| RigError::nix("sched_setaffinity", e))?;
            let ifindex = nix::net::if_::if_nametoindex("eth0")
                .map_err(|e| RigError::nix("ifindex of eth0", e))?;
            // `struct xdp_md`: data 0, data_end the frame's length, ingress_ifindex.
            let mut ctx = [0u8; 24];
            let len = u32::try_from(frame.len()).unwrap_or(u32::MAX);
            ctx[4..8].copy_from_slice(&len.to_ne_bytes());
            ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
            // union bpf_attr, the test part: prog_fd 0, data_size_in 8, data_in 16, repeat
            // 32, ctx_size_in 40, ctx_in 48, flags 64, batch_size 72 (0: the kernel's 64).
            let mut attr = [0u8; 80];
            let fd = u32::try_from(fd).map_err(|_| other("negative program fd"))?;
            attr[0..4].copy_from_slice(&fd.to_ne_bytes());
            attr[8..12].copy_from_slice(&len.to_ne_bytes());
            attr[16..24].copy_from_slice(&(frame.as_ptr() as u64).to_ne_bytes());
            attr[32..36].copy_from_slice(&count.to_ne_bytes());
            attr[40..44].copy_from_slice(&(ctx.len() as u32).to_ne_bytes());
            attr[48..56].copy_from_slice(&(ctx.as_ptr() as u64).to_ne_bytes());
            attr[64..68].copy_from_slice(&LIVE_FRAMES.to_ne_bytes());
            // SAFETY: data_in and ctx_in point to buffers of the given sizes that outlive the
            // call, which only reads them (live frames take no output buffers).
            unsafe { super::tc::prog_test_run(&mut attr, "generating live frames") }
        })?
    }
}
