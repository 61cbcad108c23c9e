//! The packet-parser fuzz: arbitrary frames through the real tc programs (`kpr_tc_external` as if
//! arrived on the external link, `kpr_tc_reply` as if on a pod veth) under `BPF_PROG_TEST_RUN`,
//! with a few Services programmed through the real `EbpfDataplane`. Our packet parser is the
//! eBPF code itself (it runs in the kernel), so this is where malformed input must be proven
//! harmless. On every frame:
//! - the action is one the programs may return (`TC_ACT_UNSPEC`, `TC_ACT_OK`, `TC_ACT_SHOT`,
//!   `TC_ACT_REDIRECT`);
//! - a well-formed frame (every length and checksum valid, [`parse_checked`]) that comes back
//!   changed is still well-formed: every checksum the program touched was updated right;
//! - a well-formed frame unrelated to any Service (no frontend port or address as destination,
//!   not from a backend address) comes back byte for byte unchanged with `TC_ACT_UNSPEC` (the next
//!   program's, never `TC_ACT_OK`, which would end the TCX chain).
//!
//! The XDP program (`kpr_xdp_external`, first on the external link) gets every frame before tc:
//! it returns `XDP_PASS`, `XDP_DROP` or `XDP_REDIRECT` only, passes a frame byte for byte
//! unchanged (what it cannot finish is tc's, untouched), drops only frames tc drops too, and
//! redirects only well-formed frames, rewritten into well-formed ones.
//!
//! Used by `tests/tests/integration/tc_fuzz.rs` (bounded and deterministic, in `cargo xtask test`) and by the
//! cargo-fuzz target `tc_packets` (`tests/fuzz/`). Needs root and the real eBPF object.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_dataplane_ebpf::{EbpfDataplane, EbpfOptions, LbOptions, TcOptions};
use proxy_model::{
    desired::Snapshot,
    objects::{ObjectKey, Objects},
};

use crate::{
    Result, RigError,
    agent::TempBpfRoot,
    cgroup::ChildCgroup,
    netns::Netns,
    packet::{
        L4, PROTO_SCTP, PROTO_TCP, PROTO_UDP, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT,
        TC_ACT_UNSPEC, XDP_DROP, XDP_PASS, XDP_REDIRECT, build, parse_checked,
    },
};

/// The programs' names in the object (`proxy_common::program_names`).
pub const TC_EXTERNAL: &str = "kpr_tc_external";
pub const TC_REPLY: &str = "kpr_tc_reply";
pub const XDP_EXTERNAL: &str = "kpr_xdp_external";

const NODE: &str = "node";
/// Destination ports of the programmed frontends (service ports and NodePorts).
const FRONTEND_PORTS: [u16; 9] = [80, 53, 38412, 30080, 30053, 30412, 30081, 30082, 30083];
/// ClusterIPs and the LB IP.
const FRONTEND_ADDRS: [&str; 7] = [
    "10.96.0.20",
    "fd00:96::20",
    "10.96.0.21",
    "10.96.0.22",
    "10.96.0.23",
    "fd00:96::23",
    "198.51.100.10",
];
const BACKEND_ADDRS: [&str; 2] = ["10.244.1.2", "fd00:244:1::2"];
/// Addresses frames are built from: clients in and outside the LB source range, node and pod
/// side addresses, backends, frontends and strangers.
const ADDRS_V4: [&str; 10] = [
    "10.10.0.2",
    "203.0.113.5",
    "10.10.0.1",
    "10.244.1.1",
    "10.244.1.2",
    "10.96.0.20",
    "10.96.0.22",
    "10.96.0.23",
    "198.51.100.10",
    "192.0.2.77",
];
const ADDRS_V6: [&str; 6] = [
    "fd00:10::2",
    "fd00:10::1",
    "fd00:244:1::2",
    "fd00:96::20",
    "fd00:96::23",
    "2001:db8::7",
];
const PORTS: [u16; 14] = [
    80, 53, 38412, 8080, 5353, 30080, 30053, 30412, 30081, 30082, 30083, 40000, 61000, 65535,
];

/// A throwaway node namespace with `ext0` (external) and `pod0` (pod side) and the agent's
/// dataplane loaded into a private bpffs, the Services of [`TcNode::new`] programmed.
pub struct TcNode {
    // Drop order (see `Drop`): the dataplane inside the runtime, then the rest.
    dataplane: Option<EbpfDataplane>,
    runtime: Option<tokio::runtime::Runtime>,
    ext0: u32,
    pod0: u32,
    _bpf: TempBpfRoot,
    _cgroup: ChildCgroup,
    _netns: Netns,
}

impl std::fmt::Debug for TcNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcNode")
            .field("ext0", &self.ext0)
            .field("pod0", &self.pod0)
            .finish_non_exhaustive()
    }
}

/// What one program did with one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// No byte after the Ethernet header: the kernel refuses to test-run it (not run).
    TooShort,
    /// Malformed in a way `BPF_PROG_TEST_RUN` itself refuses (EINVAL): not run.
    Refused,
    /// Action and whether the packet came back changed; `checked` says the input was
    /// well-formed, so the invariants on the output were checked.
    Ran {
        program: &'static str,
        action: i32,
        rewritten: bool,
        checked: bool,
    },
}

fn other(what: String) -> RigError {
    RigError::Other(what)
}

fn ifindex(name: &str) -> Result<u32> {
    nix::net::if_::if_nametoindex(name).map_err(|e| other(format!("ifindex of {name}: {e}")))
}

impl TcNode {
    /// Builds the namespace, moves the calling thread into it for good (the test runs and their
    /// fib lookups use the caller's namespace, so call this on a thread that does nothing else),
    /// loads the dataplane and programs the Services:
    /// - `web`: dual-stack NodePort, eTP Cluster; TCP 80→8080 on 30080, UDP 53→5353 on 30053,
    ///   SCTP 38412 on 30412;
    /// - `local`: NodePort TCP 30081, eTP Local;
    /// - `lb`: LoadBalancer on 198.51.100.10:80, source range 203.0.113.0/24, NodePort 30082;
    /// - `empty`: dual-stack NodePort TCP 30083 without endpoints (ICMP reject).
    pub fn new() -> Result<Self> {
        let netns = Netns::new("tcfuzz")?;
        for (dev, v4, v6) in [
            ("ext0", "10.10.0.1/24", "fd00:10::1/64"),
            ("pod0", "10.244.1.1/24", "fd00:244:1::1/64"),
        ] {
            let peer = format!("{dev}p");
            netns.ip(&["link", "add", dev, "type", "veth", "peer", "name", &peer])?;
            netns.ip(&["link", "set", &peer, "up"])?;
            netns.ip(&["addr", "add", v4, "dev", dev])?;
            netns.ip(&["-6", "addr", "add", v6, "dev", dev, "nodad"])?;
            netns.ip(&["link", "set", dev, "up"])?;
        }
        netns.ip(&["route", "add", "203.0.113.0/24", "dev", "ext0"])?;
        netns.sysctl("net.ipv4.ip_forward", "1")?;
        netns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        let file = std::fs::File::open(netns.path())
            .map_err(|e| RigError::io(format!("opening {}", netns.path().display()), e))?;
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| other(format!("setns into {}: {e}", netns.name())))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| RigError::io("building a tokio runtime", e))?;
        let bpf = TempBpfRoot::new()?;
        let cgroup = ChildCgroup::new()?;
        let options = EbpfOptions {
            cgroup_path: Some(cgroup.path().to_path_buf()),
            bpf_root: PathBuf::from(bpf.path()),
            frontends_capacity: 1024,
            max_frontends_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_FRONTENDS_PER_SERVICE,
            max_endpoints_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_ENDPOINTS_PER_SERVICE,
            backends_capacity: 1024,
            conntrack_capacity: Some(proxy_dataplane_ebpf::DEFAULT_CONNTRACK_CAPACITY),
            lru_budget: proxy_dataplane_ebpf::maps::map_sizes::LruBudget::MemoryShare(
                proxy_dataplane_ebpf::maps::map_sizes::DEFAULT_DYNAMIC_SIZE_RATIO,
            ),
            lb: LbOptions::default(),
            tc: TcOptions {
                interfaces: vec!["ext0".into()],
                cluster_cidrs: vec![
                    "10.244.0.0/16"
                        .parse()
                        .map_err(|e| other(format!("cidr: {e}")))?,
                ],
                // The redirect fast path: what this exercises was written against it.
                fast_path: true,
                ..TcOptions::default()
            },
            disabled_features: Default::default(),
            // Every REJECT answered: the rate limit has its own test.
            icmp_ratelimit: Some(std::time::Duration::ZERO),
            snat_ports: proxy_dataplane_ebpf::conntrack::reserved_ports::DEFAULT_RANGE,
        };
        let dataplane = {
            let _entered = runtime.enter();
            EbpfDataplane::start(&options).map_err(|e| other(format!("dataplane: {e}")))?
        };
        let mut node = Self {
            dataplane: Some(dataplane),
            runtime: Some(runtime),
            ext0: ifindex("ext0")?,
            pod0: ifindex("pod0")?,
            _bpf: bpf,
            _cgroup: cgroup,
            _netns: netns,
        };
        node.program_services()?;
        Ok(node)
    }

    fn program_services(&mut self) -> Result<()> {
        let port = |name: &str, port: u16, protocol: &str, target: u16, node_port: u16| {
            serde_json::json!({"name": name, "port": port, "protocol": protocol,
                               "targetPort": target, "nodePort": node_port})
        };
        let http = |node_port| port("http", 80, "TCP", 8080, node_port);
        let dual = serde_json::json!({"ipFamilies": ["IPv4", "IPv6"],
                                      "ipFamilyPolicy": "RequireDualStack"});
        let services = [
            (
                "web",
                "NodePort",
                "10.96.0.20",
                Some("fd00:96::20"),
                "Cluster",
                vec![
                    http(30080),
                    port("dns", 53, "UDP", 5353, 30053),
                    port("sctp", 38412, "SCTP", 38412, 30412),
                ],
            ),
            (
                "local",
                "NodePort",
                "10.96.0.21",
                None,
                "Local",
                vec![http(30081)],
            ),
            (
                "lb",
                "LoadBalancer",
                "10.96.0.22",
                None,
                "Cluster",
                vec![http(30082)],
            ),
            (
                "empty",
                "NodePort",
                "10.96.0.23",
                Some("fd00:96::23"),
                "Cluster",
                vec![http(30083)],
            ),
        ];
        let key = |name: &str| ObjectKey {
            namespace: "default".into(),
            name: name.into(),
        };
        let mut service_map = BTreeMap::new();
        for (name, type_, v4, v6, policy, ports) in services {
            let mut spec = serde_json::json!({"type": type_, "clusterIP": v4,
                "clusterIPs": [v4], "externalTrafficPolicy": policy, "ports": ports});
            if let Some(v6) = v6 {
                spec["clusterIPs"] = serde_json::json!([v4, v6]);
                spec["ipFamilies"] = dual["ipFamilies"].clone();
                spec["ipFamilyPolicy"] = dual["ipFamilyPolicy"].clone();
            }
            let mut json = serde_json::json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": "default"}, "spec": spec});
            if name == "lb" {
                json["spec"]["loadBalancerSourceRanges"] = serde_json::json!(["203.0.113.0/24"]);
                json["status"] =
                    serde_json::json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.10"}]}});
            }
            let service: Service =
                serde_json::from_value(json).map_err(|e| other(format!("service {name}: {e}")))?;
            service_map.insert(key(name), service.into());
        }
        let mut slices = BTreeMap::new();
        for (name, service, family, addr) in [
            ("web-4", "web", "IPv4", BACKEND_ADDRS[0]),
            ("web-6", "web", "IPv6", BACKEND_ADDRS[1]),
            ("local-4", "local", "IPv4", BACKEND_ADDRS[0]),
            ("lb-4", "lb", "IPv4", BACKEND_ADDRS[0]),
        ] {
            let json = serde_json::json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"name": name, "namespace": "default",
                             "labels": {"kubernetes.io/service-name": service}},
                "addressType": family,
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                          {"name": "dns", "port": 5353, "protocol": "UDP"},
                          {"name": "sctp", "port": 38412, "protocol": "SCTP"}],
                "endpoints": [{"addresses": [addr], "nodeName": NODE,
                               "conditions": {"ready": true}}],
            });
            let slice: EndpointSlice =
                serde_json::from_value(json).map_err(|e| other(format!("slice {name}: {e}")))?;
            slices.insert(key(name), slice.into());
        }
        let objects = Objects::new(service_map, slices, None);
        let snapshot = Snapshot::compute(&objects, NODE);
        let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
        if !errors.is_empty() {
            return Err(other(format!("snapshot errors: {errors:?}")));
        }
        let dataplane = self
            .dataplane
            .as_mut()
            .ok_or_else(|| other("no dataplane".into()))?;
        let (_, errors) = dataplane.apply(&snapshot, None);
        if !errors.is_empty() {
            return Err(other(format!("apply errors: {errors:?}")));
        }
        Ok(())
    }

    /// Runs `frame` through both programs and checks the invariants; when `kpr_tc_external`
    /// translated a well-formed TCP/UDP/SCTP frame, the backend's answer to what it sent goes through
    /// `kpr_tc_reply` too (the reverse translation). An error describes the violated invariant
    /// with the frame in hex.
    pub fn check(&mut self, frame: &[u8]) -> Result<Vec<Outcome>> {
        let xdp = self.check_xdp(frame)?;
        let (external, translated) = self.check_one(TC_EXTERNAL, self.ext0, frame)?;
        // XDP drops only what tc drops (the drops before any NAT).
        if let (
            Outcome::Ran {
                action: xdp_action, ..
            },
            Outcome::Ran { action, .. },
        ) = (xdp, external)
            && xdp_action == XDP_DROP as i32
            && action != TC_ACT_SHOT
        {
            return Err(other(format!(
                "{XDP_EXTERNAL} dropped a frame tc answers with action {action}: {frame:02x?}"
            )));
        }
        let mut outcomes = vec![xdp, external, self.check_one(TC_REPLY, self.pod0, frame)?.0];
        if let Some(sent) = translated.and_then(|out| parse_checked(&out).ok()) {
            let l4 = match sent.proto {
                PROTO_TCP => Some(L4::TcpSyn),
                PROTO_UDP => Some(L4::Udp),
                PROTO_SCTP => Some(L4::SctpData),
                _ => None,
            };
            if let Some(l4) = l4 {
                let answer = build(sent.destination(), sent.source(), l4, b"pong");
                outcomes.push(self.check_one(TC_REPLY, self.pod0, &answer)?.0);
            }
        }
        Ok(outcomes)
    }

    /// One program on one frame; also returns the output of a well-formed frame it redirected.
    fn check_one(
        &mut self,
        program: &'static str,
        ifindex: u32,
        frame: &[u8],
    ) -> Result<(Outcome, Option<Vec<u8>>)> {
        // BPF_PROG_TEST_RUN refuses (EINVAL) a frame with nothing after the Ethernet header.
        if frame.len() <= crate::packet::ETH_HLEN {
            return Ok((Outcome::TooShort, None));
        }
        let dataplane = self
            .dataplane
            .as_mut()
            .ok_or_else(|| other("no dataplane".into()))?;
        let checked = parse_checked(frame).is_ok();
        let out = match dataplane.test_run_tc(program, frame, ifindex) {
            Ok(out) => out,
            // The kernel validates what it builds an skb from (e.g. an IPv6 ethertype with a
            // short header): EINVAL before the program runs, never for a well-formed frame.
            Err(e) if !checked && refused_by_kernel(&e) => return Ok((Outcome::Refused, None)),
            Err(e) => return Err(other(format!("{program}: test_run on {frame:02x?}: {e:?}"))),
        };
        let fail = |what: String| {
            Err(other(format!(
                "{program}: {what}\n  in:  {frame:02x?}\n  out: {:02x?}",
                out.packet
            )))
        };
        if ![TC_ACT_UNSPEC, TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT].contains(&out.action) {
            return fail(format!("unexpected action {}", out.action));
        }
        let rewritten = out.packet != frame;
        if checked {
            if rewritten && let Err(e) = parse_checked(&out.packet) {
                return fail(format!(
                    "rewrote a well-formed frame into a broken one: {e}"
                ));
            }
            if unrelated(frame) && (rewritten || out.action != TC_ACT_UNSPEC) {
                return fail(format!(
                    "a frame unrelated to any Service came back {} with action {}",
                    if rewritten { "changed" } else { "unchanged" },
                    out.action
                ));
            }
        }
        let outcome = Outcome::Ran {
            program,
            action: out.action,
            rewritten,
            checked,
        };
        let redirected = checked && rewritten && out.action == TC_ACT_REDIRECT;
        Ok((outcome, redirected.then_some(out.packet)))
    }
}

impl TcNode {
    /// The XDP program on one frame arriving on `ext0` (see the module's invariants).
    fn check_xdp(&mut self, frame: &[u8]) -> Result<Outcome> {
        if frame.len() <= crate::packet::ETH_HLEN {
            return Ok(Outcome::TooShort);
        }
        let dataplane = self
            .dataplane
            .as_mut()
            .ok_or_else(|| other("no dataplane".into()))?;
        let checked = parse_checked(frame).is_ok();
        let out = match dataplane.test_run_xdp(frame, self.ext0) {
            Ok(out) => out,
            Err(e) if !checked && refused_by_kernel(&e) => return Ok(Outcome::Refused),
            Err(e) => return Err(other(format!("XDP: test_run on {frame:02x?}: {e:?}"))),
        };
        let fail = |what: String| {
            Err(other(format!(
                "{XDP_EXTERNAL}: {what}\n  in:  {frame:02x?}\n  out: {:02x?}",
                out.packet
            )))
        };
        let rewritten = out.packet != frame;
        match out.action {
            XDP_PASS | XDP_DROP if rewritten => {
                return fail("passed or dropped a frame it changed".to_owned());
            }
            XDP_PASS | XDP_DROP => {}
            XDP_REDIRECT if !checked => {
                return fail("redirected a malformed frame".to_owned());
            }
            XDP_REDIRECT => {
                if let Err(e) = parse_checked(&out.packet) {
                    return fail(format!("redirected a broken rewrite: {e}"));
                }
                if unrelated(frame) {
                    return fail("redirected a frame unrelated to any Service".to_owned());
                }
            }
            action => return fail(format!("unexpected action {action}")),
        }
        Ok(Outcome::Ran {
            program: XDP_EXTERNAL,
            action: i32::try_from(out.action).unwrap_or(i32::MAX),
            rewritten,
            checked,
        })
    }
}

fn refused_by_kernel(error: &proxy_dataplane_ebpf::EbpfError) -> bool {
    let mut source: Option<&dyn std::error::Error> = Some(error);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return io.raw_os_error() == Some(libc::EINVAL);
        }
        source = e.source();
    }
    false
}

impl Drop for TcNode {
    fn drop(&mut self) {
        // The dataplane goes first, inside its runtime; bpffs, cgroup and namespace follow as
        // fields.
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        // As a thread-local of the cargo-fuzz target, this may run at exit after tokio's own
        // thread-local context is gone, where `enter()` would panic.
        let context_gone =
            tokio::runtime::Handle::try_current().is_err_and(|e| e.is_thread_local_destroyed());
        if context_gone {
            self.dataplane = None;
        } else {
            let _entered = runtime.enter();
            self.dataplane = None;
        }
    }
}

/// Whether a well-formed `frame` has nothing to do with the programmed Services: its
/// destination is no frontend port (for TCP/UDP/SCTP) and no frontend address, and its source
/// is no backend (whose replies the programs translate).
pub fn unrelated(frame: &[u8]) -> bool {
    let Ok(parsed) = parse_checked(frame) else {
        return false;
    };
    let is = |list: &[&str], addr: IpAddr| list.iter().any(|a| a.parse() == Ok(addr));
    let ported = matches!(parsed.proto, PROTO_TCP | PROTO_UDP | PROTO_SCTP);
    let port_related = ported && parsed.l4.len() >= 4 && FRONTEND_PORTS.contains(&parsed.dport());
    !port_related && !is(&FRONTEND_ADDRS, parsed.dst) && !is(&BACKEND_ADDRS, parsed.src)
}

/// A small deterministic generator (SplitMix64): the same seed gives the same frames on every
/// machine, so a failure is reproducible from its seed and index.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    fn pick<T: Copy>(&mut self, list: &[T]) -> T {
        list[self.below(list.len())]
    }
}

/// A well-formed frame (valid lengths and checksums) from the address and port pools: TCP SYN,
/// UDP, SCTP INIT or DATA, IPv4 or IPv6, a payload of 0..64 bytes.
pub fn structured_frame(rng: &mut Rng) -> Vec<u8> {
    let v6 = rng.below(4) == 0;
    let addr = |rng: &mut Rng| -> IpAddr {
        let text = if v6 {
            rng.pick(&ADDRS_V6)
        } else {
            rng.pick(&ADDRS_V4)
        };
        text.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
    };
    let port = |rng: &mut Rng| -> u16 {
        if rng.below(4) == 0 {
            (rng.next_u64() & 0xffff) as u16
        } else {
            rng.pick(&PORTS)
        }
    };
    let src = SocketAddr::new(addr(rng), port(rng));
    let dst = SocketAddr::new(addr(rng), port(rng));
    let l4 = rng.pick(&[L4::TcpSyn, L4::TcpSyn, L4::Udp, L4::Sctp, L4::SctpData]);
    let payload: Vec<u8> = (0..rng.below(65)).map(|_| rng.next_u64() as u8).collect();
    build(src, dst, l4, &payload)
}

/// `frame` damaged 1..8 times: a byte set at random, a bit flipped (mostly in the headers, where
/// the parser looks), cut short, or extended with junk.
pub fn mutate(rng: &mut Rng, mut frame: Vec<u8>) -> Vec<u8> {
    for _ in 0..=rng.below(8) {
        let headers = frame.len().min(14 + 40 + 20);
        let at = if rng.below(4) == 0 {
            rng.below(frame.len())
        } else {
            rng.below(headers)
        };
        match rng.below(6) {
            0 | 1 => {
                if let Some(b) = frame.get_mut(at) {
                    *b = rng.next_u64() as u8;
                }
            }
            2 | 3 => {
                if let Some(b) = frame.get_mut(at) {
                    *b ^= 1 << rng.below(8);
                }
            }
            // Mostly past the Ethernet header: a frame without L3 is not even run.
            4 if rng.below(8) == 0 => frame.truncate(at),
            4 => frame.truncate(14 + rng.below(frame.len().saturating_sub(14) + 1)),
            _ => frame.extend((0..rng.below(32)).map(|_| rng.next_u64() as u8)),
        }
    }
    frame
}
