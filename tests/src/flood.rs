//! Floods from outside the node: crafted frames written as fast as one thread can into an
//! `AF_PACKET` socket on an interface of a namespace (batches of `sendmmsg`, past the qdisc),
//! and the legitimate clients that must still be served meanwhile.
//!
//! On a veth the frames are received by the peer in the writer's own softirq, so the rate the
//! writer reaches is the rate the node takes them at (the node's work is done on the writer's
//! CPU); frames the peer's backlog had no room for are counted as the sender's `tx_dropped`
//! and left out of [`FloodReport::accepted`].
//!
//! The frames come from [`spoofed_syn`] (TCP SYNs from random sources in a network the
//! namespace does not hold) and [`junk_fragment`] (IPv4 UDP fragments of datagrams nobody
//! sent). Every flood is bounded in time and in frames; the writer's socket is closed when its
//! thread ends.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns::{Netns, spawn_in};
use crate::packet::{L4, build, fragment};
use crate::{Result, RigError};

/// Frames per `sendmmsg`.
const BATCH: usize = 256;

/// What a flood did.
#[derive(Debug, Clone, Copy, Default)]
pub struct FloodReport {
    /// Frames the socket took.
    pub written: u64,
    /// Of those, frames the interface passed on to its peer (not counted in its `tx_dropped`,
    /// which counts those the receiving end had no room for).
    pub accepted: u64,
    pub elapsed: Duration,
}

impl FloodReport {
    /// Frames per second the node took.
    pub fn accepted_rate(&self) -> f64 {
        self.accepted as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Frames per second written.
    pub fn written_rate(&self) -> f64 {
        self.written as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

impl std::fmt::Display for FloodReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} frames in {:.1} s: {:.0}/s written, {:.0}/s taken by the node ({} dropped at \
             the link)",
            self.written,
            self.elapsed.as_secs_f64(),
            self.written_rate(),
            self.accepted_rate(),
            self.written.saturating_sub(self.accepted)
        )
    }
}

/// The flood thread's answer: frames written and the time it took (the outer result: whether
/// the thread entered its namespace).
type FloodThread = JoinHandle<Result<Result<(u64, Duration)>>>;

/// A flood running on its own thread.
#[derive(Debug)]
pub struct Flood {
    thread: Option<FloodThread>,
    stop: Arc<AtomicBool>,
    netns: std::path::PathBuf,
    interface: String,
    dropped_before: u64,
}

impl Flood {
    /// Starts writing the frames `frame(i)` returns (i = 0, 1, …) out of `interface` of the
    /// namespace `netns`, until `duration` has passed, `max_frames` are written or
    /// [`Flood::stop`] is called.
    pub fn start(
        netns: &Netns,
        interface: &str,
        duration: Duration,
        max_frames: u64,
        mut frame: impl FnMut(u64) -> Vec<u8> + Send + 'static,
    ) -> Result<Self> {
        let dropped_before = tx_dropped(&netns.path(), interface)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let name = interface.to_owned();
        let thread = spawn_in(&netns.path(), move || -> Result<(u64, Duration)> {
            let socket = packet_socket(&name)?;
            let started = Instant::now();
            let mut written = 0u64;
            let mut frames: Vec<Vec<u8>> = Vec::with_capacity(BATCH);
            while written < max_frames
                && started.elapsed() < duration
                && !stopped.load(Ordering::Relaxed)
            {
                frames.clear();
                let room = (max_frames - written).min(BATCH as u64);
                frames.extend((written..written + room).map(&mut frame));
                written += send_batch(&socket, &frames)?;
            }
            Ok((written, started.elapsed()))
        })?;
        Ok(Self {
            thread: Some(thread),
            stop,
            netns: netns.path(),
            interface: interface.to_owned(),
            dropped_before,
        })
    }

    /// Ends the flood now.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Whether the flood is still running.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Waits for the flood's end; what it did.
    pub fn join(mut self) -> Result<FloodReport> {
        let thread = self
            .thread
            .take()
            .ok_or_else(|| RigError::Other("the flood was joined already".into()))?;
        let (written, elapsed) = thread
            .join()
            .map_err(|_| RigError::Other("the flood thread panicked".into()))???;
        let dropped = tx_dropped(&self.netns, &self.interface)?.saturating_sub(self.dropped_before);
        Ok(FloodReport {
            written,
            accepted: written.saturating_sub(dropped),
            elapsed,
        })
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `tx_dropped` of `interface` in `netns`.
fn tx_dropped(netns: &Path, interface: &str) -> Result<u64> {
    let name = interface.to_owned();
    crate::netns::on_thread_in(netns, move || -> Result<u64> {
        // A thread in the namespace sees its interfaces through netlink and ioctls, but
        // /sys shows the mounter's: read the counters through `ip -s`.
        let out = std::process::Command::new("ip")
            .args(["-s", "-j", "link", "show", &name])
            .output()
            .map_err(|e| RigError::io("running ip -s link", e))?;
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| RigError::Other(format!("ip -s -j link show {name}: {e}")))?;
        json[0]["stats64"]["tx"]["dropped"]
            .as_u64()
            .ok_or_else(|| RigError::Other(format!("no tx dropped for {name} in {json}")))
    })?
}

/// An `AF_PACKET` socket bound to `interface` of the calling thread's namespace, sending
/// complete Ethernet frames past the qdisc (`PACKET_QDISC_BYPASS`), receiving nothing.
fn packet_socket(interface: &str) -> Result<OwnedFd> {
    let ifindex = nix::net::if_::if_nametoindex(interface)
        .map_err(|e| RigError::nix(format!("ifindex of {interface}"), e))?;
    // SAFETY: plain socket(2); protocol 0 binds no receive handler.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(RigError::io(
            "socket(AF_PACKET)",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: a valid socket and a c_int option of the size given.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_QDISC_BYPASS,
            (&raw const one).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(RigError::io(
            "setsockopt(PACKET_QDISC_BYPASS)",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: sockaddr_ll is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_ifindex = i32::try_from(ifindex).map_err(|_| RigError::Other("ifindex".into()))?;
    // SAFETY: a valid socket and a sockaddr_ll of the size given.
    let rc = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&raw const addr).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(RigError::io(
            format!("binding AF_PACKET to {interface}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(socket)
}

/// A writer of whole Ethernet frames on an interface: the same socket a [`Flood`] writes with,
/// for a client that crafts its own packets.
#[derive(Debug)]
pub struct FrameWriter {
    socket: OwnedFd,
}

impl FrameWriter {
    /// Opens it on `interface` of the calling thread's namespace.
    pub fn open(interface: &str) -> Result<Self> {
        Ok(Self {
            socket: packet_socket(interface)?,
        })
    }

    /// Writes `frames`; how many went.
    pub fn send(&self, frames: &[Vec<u8>]) -> Result<u64> {
        send_batch(&self.socket, frames)
    }
}

/// Writes `frames` with `sendmmsg` (again from where it stopped, until all went or the
/// socket refuses); how many went.
fn send_batch(socket: &OwnedFd, frames: &[Vec<u8>]) -> Result<u64> {
    let mut iovs: Vec<libc::iovec> = frames
        .iter()
        .map(|f| libc::iovec {
            iov_base: f.as_ptr().cast_mut().cast(),
            iov_len: f.len(),
        })
        .collect();
    // SAFETY: mmsghdr is plain data; all zeroes is a valid value (no name, no control).
    let mut msgs: Vec<libc::mmsghdr> = iovs
        .iter_mut()
        .map(|iov| {
            // SAFETY: as above.
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = iov;
            m.msg_hdr.msg_iovlen = 1;
            m
        })
        .collect();
    let mut sent = 0usize;
    while sent < msgs.len() {
        let rest = msgs.get_mut(sent..).unwrap_or_default();
        let count = u32::try_from(rest.len()).unwrap_or(u32::MAX);
        // SAFETY: every header points to one iovec over a frame that outlives the call (the
        // kernel only reads them); the socket is bound.
        let n = unsafe { libc::sendmmsg(socket.as_raw_fd(), rest.as_mut_ptr(), count, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) {
                // The device is busy: the frames are dropped as a wire would.
                std::thread::yield_now();
                break;
            }
            return Err(RigError::io("sendmmsg on AF_PACKET", e));
        }
        sent += usize::try_from(n).unwrap_or(0);
        if n == 0 {
            break;
        }
    }
    Ok(sent as u64)
}

/// A xorshift step: the flood's sources and ports, cheap and reproducible.
pub fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// `198.18.0.0/15` (RFC 2544's benchmarking network): where the flood's spoofed sources come
/// from. The node routes it back towards the flooder, whose namespace drops what it does not
/// hold (it does not forward): a spoofed client's SYN-ACK goes nowhere, as on the Internet.
pub const SPOOFED_NET: &str = "198.18.0.0/15";

/// A source in [`SPOOFED_NET`] and a port ≥ 1024 from `r`.
fn spoofed_source(r: u64) -> SocketAddr {
    let host = u32::try_from(r & 0x1_ffff).unwrap_or(0);
    let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) | host);
    let port = 1024 + u16::try_from((r >> 20) % 64_000).unwrap_or(0);
    SocketAddr::V4(SocketAddrV4::new(ip, port))
}

/// The MACs of a link's two ends: `(destination, source)` of a frame sent from `from`'s
/// `from_if` to `to`'s `to_if`.
pub fn link_macs(from: &Netns, from_if: &str, to: &Netns, to_if: &str) -> Result<[[u8; 6]; 2]> {
    Ok([
        crate::netns::parse_mac(&to.mac(to_if)?)?,
        crate::netns::parse_mac(&from.mac(from_if)?)?,
    ])
}

/// `frame` with the MACs of [`link_macs`].
pub fn with_macs(mut frame: Vec<u8>, macs: [[u8; 6]; 2]) -> Vec<u8> {
    if let Some(eth) = frame.get_mut(0..12) {
        eth[0..6].copy_from_slice(&macs[0]);
        eth[6..12].copy_from_slice(&macs[1]);
    }
    frame
}

/// Frame `i` of a spoofed SYN flood to `target`: a SYN from a random source of
/// [`SPOOFED_NET`] and port (`seed` picks the sequence).
pub fn spoofed_syn(
    seed: u64,
    macs: [[u8; 6]; 2],
    target: SocketAddr,
) -> impl FnMut(u64) -> Vec<u8> {
    let mut state = seed | 1;
    move |_| {
        state = xorshift(state);
        with_macs(build(spoofed_source(state), target, L4::TcpSyn, b""), macs)
    }
}

/// Frame `i` of a junk fragment flood: first fragments (more fragments to come, none ever
/// does) of UDP datagrams from random sources of [`SPOOFED_NET`] with random IP IDs, to
/// `targets` in turn (an address and port without a frontend, a frontend's).
pub fn junk_fragment(
    seed: u64,
    macs: [[u8; 6]; 2],
    targets: Vec<SocketAddr>,
) -> impl FnMut(u64) -> Vec<u8> {
    let mut state = seed | 1;
    move |i| {
        state = xorshift(state);
        let count = targets.len().max(1) as u64;
        let target = targets
            .get(usize::try_from(i % count).unwrap_or(0))
            .copied()
            .unwrap_or_else(|| SocketAddr::from(([10, 10, 0, 1], 9)));
        let datagram = build(spoofed_source(state), target, L4::Udp, &[0x5a; 96]);
        let id = u32::try_from(state >> 40).unwrap_or(0);
        let first = fragment(&datagram, 64, id)
            .into_iter()
            .next()
            .unwrap_or_default();
        with_macs(first, macs)
    }
}

/// What one legitimate new connection got: the backend that greeted it, or why not.
pub type Served = std::result::Result<String, String>;

/// Legitimate clients from the namespace at `netns`, one new TCP connection after the other
/// to `target` (connect, read the backend's greeting line, close) until `stop` is set or
/// `max` were made; each waits up to `timeout` (longer than the first SYN retransmission, so
/// a client whose SYN was dropped still counts as served when the retransmission is).
pub fn legit_clients(
    netns: &Path,
    target: SocketAddr,
    stop: Arc<AtomicBool>,
    max: u32,
    timeout: Duration,
) -> Result<JoinHandle<Result<Vec<Served>>>> {
    spawn_in(netns, move || {
        let mut served = Vec::new();
        while !stop.load(Ordering::Relaxed) && served.len() < max as usize {
            served.push(greeting(target, timeout).map_err(|e| e.to_string()));
        }
        served
    })
}

fn greeting(target: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let conn = TcpStream::connect_timeout(&target, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    Ok(line
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// Share of `served` that a backend (`pod…`) answered.
pub fn served_share(served: &[Served]) -> f64 {
    let ok = served
        .iter()
        .filter(|s| s.as_ref().is_ok_and(|b| b.starts_with("pod")))
        .count();
    ok as f64 / served.len().max(1) as f64
}

/// An idle connection opened before a flood: the backend that greeted it.
#[derive(Debug)]
pub struct IdleConnection {
    conn: TcpStream,
    reader: BufReader<TcpStream>,
    pub backend: String,
}

impl IdleConnection {
    /// Opens `count` connections from `netns` to `target`, each greeted by a backend.
    pub fn open(netns: &Path, target: SocketAddr, count: usize) -> Result<Vec<Self>> {
        crate::netns::on_thread_in(netns, move || -> Result<Vec<Self>> {
            (0..count)
                .map(|_| {
                    let conn = TcpStream::connect_timeout(&target, Duration::from_secs(2))
                        .map_err(|e| RigError::io(format!("connecting to {target}"), e))?;
                    conn.set_read_timeout(Some(Duration::from_secs(3)))
                        .map_err(|e| RigError::io("SO_RCVTIMEO", e))?;
                    let mut reader =
                        BufReader::new(conn.try_clone().map_err(|e| RigError::io("dup", e))?);
                    let mut line = String::new();
                    reader
                        .read_line(&mut line)
                        .map_err(|e| RigError::io("reading the greeting", e))?;
                    let backend = line
                        .split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_owned();
                    Ok(Self {
                        conn,
                        reader,
                        backend,
                    })
                })
                .collect()
        })?
    }

    /// Sends a line and reads its echo: whether the connection still reaches the backend that
    /// greeted it (any other would not know it and reset it).
    pub fn speak(&mut self, line: &str) -> std::result::Result<(), String> {
        (&self.conn)
            .write_all(format!("{line}\n").as_bytes())
            .map_err(|e| format!("write: {e}"))?;
        let mut echo = String::new();
        match self.reader.read_line(&mut echo) {
            Ok(0) => Err("closed".into()),
            Ok(_) if echo.trim_end() == line => Ok(()),
            Ok(_) => Err(format!("echo {echo:?}")),
            Err(e) => Err(format!("read: {e}")),
        }
    }
}

/// The SYN flood scenario of `tests/tests/integration/floods.rs` and `cargo xtask bench`'s SYN flood
/// section: idle connections opened before, then a spoofed SYN flood from the external
/// namespace to the NodePort while a legitimate client makes new connections, more new
/// connections after it, and the idle connections speaking again.
#[derive(Debug, Clone, Copy)]
pub struct SynFloodPlan {
    /// Idle connections opened before the flood.
    pub idle: usize,
    /// How long the flood lasts at most, and its frames at most.
    pub duration: Duration,
    pub max_frames: u64,
    /// New connections after the flood.
    pub after: u32,
    /// Pause between the legitimate client's connections, and the timeout of each.
    pub client_interval: Duration,
    pub client_timeout: Duration,
}

/// What [`syn_flood`] saw.
#[derive(Debug, Clone)]
pub struct SynFloodOutcome {
    pub flood: FloodReport,
    /// The legitimate client's new connections during the flood, and after it.
    pub during: Vec<Served>,
    pub after: Vec<Served>,
    /// Each idle connection's backend and whether it still answered after the flood.
    pub idle: Vec<(String, std::result::Result<(), String>)>,
    /// eBPF mode: datapath counters over the run (the flood and the clients).
    pub counters: Vec<(proxy_common::StatIndex, u64)>,
    /// eBPF mode: flows rebuilt from the client's tuple (`tc_ct_midstream_recovered`,
    /// `_recreated`, `tc_ct_forward_rebuilt`) while the idle connections spoke again: 0 when
    /// their entries were all still there.
    pub idle_rebuilt: Option<u64>,
}

impl SynFloodOutcome {
    /// Share of the idle connections that answered after the flood.
    pub fn idle_share(&self) -> f64 {
        let ok = self.idle.iter().filter(|(_, r)| r.is_ok()).count();
        ok as f64 / self.idle.len().max(1) as f64
    }

    pub fn counter(&self, index: proxy_common::StatIndex) -> Option<u64> {
        self.counters
            .iter()
            .find(|(i, _)| *i == index)
            .map(|(_, n)| *n)
    }
}

impl std::fmt::Display for SynFloodOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "spoofed SYN flood: {}; new connections served during it {}/{} ({:.1} %), after it \
             {}/{} ({:.1} %); idle connections answering after it {}/{}",
            self.flood,
            self.during.iter().filter(|s| s.is_ok()).count(),
            self.during.len(),
            served_share(&self.during) * 100.0,
            self.after.iter().filter(|s| s.is_ok()).count(),
            self.after.len(),
            served_share(&self.after) * 100.0,
            self.idle.iter().filter(|(_, r)| r.is_ok()).count(),
            self.idle.len()
        )?;
        for (index, n) in &self.counters {
            write!(f, "; {} {n}", index.name())?;
        }
        if let Some(n) = self.idle_rebuilt {
            write!(f, "; idle flows rebuilt when they spoke again {n}")?;
        }
        Ok(())
    }
}

/// The datapath counters a SYN flood run reports.
const FLOOD_COUNTERS: [proxy_common::StatIndex; 9] = [
    proxy_common::StatIndex::TcSnat,
    proxy_common::StatIndex::TcSnatPortExhausted,
    proxy_common::StatIndex::TcSnatPortReclaimed,
    proxy_common::StatIndex::TcCtFailed,
    proxy_common::StatIndex::TcMidstreamRecovered,
    proxy_common::StatIndex::TcMidstreamRecreated,
    proxy_common::StatIndex::TcMidstreamPassed,
    proxy_common::StatIndex::TcForwardRebuilt,
    proxy_common::StatIndex::TcOrphanSegmentDropped,
];

/// The NodePort `default/web` (30080, externalTrafficPolicy Cluster: masqueraded) of the
/// [`crate::scenario::Scenario`] pods 1–3, from outside.
pub fn web_node_port() -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(
        crate::topology::Topology::node_ext_ip(),
        crate::service_scenarios::NODE_PORT,
    ))
}

/// A node for [`syn_flood`]: three pods behind the NodePort [`web_node_port`], the spoofed
/// network routed back towards the flooder; the agent not started yet.
pub fn syn_flood_scenario() -> Result<crate::scenario::Scenario> {
    use crate::scenario::{Scenario, pod_endpoint};
    let s = Scenario::new(3)?;
    let spec = crate::service_scenarios::ServiceSpec {
        type_: "NodePort",
        ..Default::default()
    };
    s.write_web_spec(&spec, &[pod_endpoint(1), pod_endpoint(2), pod_endpoint(3)])?;
    s.topo.node().ip(&[
        "route",
        "add",
        SPOOFED_NET,
        "via",
        &crate::topology::Topology::ext_ip().to_string(),
    ])?;
    Ok(s)
}

/// Starts the agent of a [`syn_flood_scenario`] in `mode` with `args` (eBPF: tc on `vext`);
/// returns once the NodePort answers from outside.
pub fn start_syn_flood_agent(
    s: &mut crate::scenario::Scenario,
    mode: &str,
    args: &[&str],
) -> Result<()> {
    let mut all = args.to_vec();
    if mode == "ebpf" {
        all.extend(["--interfaces", "vext"]);
    }
    s.start_agent_with_args(mode, &all)?;
    let outside = s.external_client();
    s.wait_for_datapath_with(
        &outside,
        web_node_port(),
        "NodePort answered",
        crate::scenario::is_pod,
    )?;
    Ok(())
}

/// [`syn_flood_scenario`] with its agent started.
pub fn syn_flood_node(mode: &str, args: &[&str]) -> Result<crate::scenario::Scenario> {
    let mut s = syn_flood_scenario()?;
    start_syn_flood_agent(&mut s, mode, args)?;
    Ok(s)
}

/// Runs `plan` on a node from [`syn_flood_node`] (`ebpf`: read the datapath's counters).
pub fn syn_flood(
    s: &mut crate::scenario::Scenario,
    plan: SynFloodPlan,
    ebpf: bool,
) -> Result<SynFloodOutcome> {
    let target = web_node_port();
    let ext = s.topo.ext().path();
    let read = |s: &mut crate::scenario::Scenario| -> Result<Vec<u64>> {
        if !ebpf {
            return Ok(Vec::new());
        }
        let agent = s.agent()?;
        FLOOD_COUNTERS
            .iter()
            .map(|i| agent.datapath_counter(*i))
            .collect()
    };
    let mut idle = IdleConnection::open(&ext, target, plan.idle)?;
    let before = read(s)?;
    let macs = link_macs(s.topo.ext(), "eth0", s.topo.node(), "vext")?;
    let stop = Arc::new(AtomicBool::new(false));
    let interval = plan.client_interval;
    let clients = {
        let stop = Arc::clone(&stop);
        spawn_in(&ext, move || {
            let mut served = Vec::new();
            while !stop.load(Ordering::Relaxed) && served.len() < 100_000 {
                served.push(greeting(target, plan.client_timeout).map_err(|e| e.to_string()));
                std::thread::sleep(interval);
            }
            served
        })?
    };
    let flood = Flood::start(
        s.topo.ext(),
        "eth0",
        plan.duration,
        plan.max_frames,
        spoofed_syn(0x2545_f491_4f6c_dd1d, macs, target),
    )
    .and_then(Flood::join);
    stop.store(true, Ordering::Relaxed);
    let during = clients
        .join()
        .map_err(|_| RigError::Other("the client thread panicked".into()))??;
    let flood = flood?;
    let after = legit_clients(
        &ext,
        target,
        Arc::new(AtomicBool::new(false)),
        plan.after,
        plan.client_timeout,
    )?
    .join()
    .map_err(|_| RigError::Other("the client thread panicked".into()))??;
    let over = read(s)?;
    let mut answers = Vec::with_capacity(idle.len());
    for (i, conn) in idle.iter_mut().enumerate() {
        answers.push((
            conn.backend.clone(),
            conn.speak(&format!("still there {i}")),
        ));
    }
    let spoke = read(s)?;
    let delta = |a: &[u64], b: &[u64], i: usize| {
        a.get(i)
            .copied()
            .unwrap_or(0)
            .saturating_sub(b.get(i).copied().unwrap_or(0))
    };
    let counters = if ebpf {
        FLOOD_COUNTERS
            .iter()
            .enumerate()
            .map(|(i, index)| (*index, delta(&over, &before, i)))
            .collect()
    } else {
        Vec::new()
    };
    let idle_rebuilt = ebpf.then(|| {
        FLOOD_COUNTERS
            .iter()
            .enumerate()
            .filter(|(_, index)| {
                matches!(
                    index,
                    proxy_common::StatIndex::TcMidstreamRecovered
                        | proxy_common::StatIndex::TcMidstreamRecreated
                        | proxy_common::StatIndex::TcForwardRebuilt
                )
            })
            .map(|(i, _)| delta(&spoke, &over, i))
            .sum()
    });
    Ok(SynFloodOutcome {
        flood,
        during,
        after,
        idle: answers,
        counters,
        idle_rebuilt,
    })
}
