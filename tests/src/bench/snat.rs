//! New connections per second per backend through one node before the first
//! SNAT failure, eBPF mode beside iptables mode.
//!
//! A NodePort Service (externalTrafficPolicy Cluster) has ONE endpoint (pod3), so every flow
//! from the external namespace is source-NATed to the node's address towards one backend
//! address and port: the SNAT port space per backend is what fills. The client
//! (`rig-helper snat-load`, an open-loop generator: connections are started on a schedule, not
//! one after the other, so a stalled connection does not slow the offered rate) makes short
//! connections (connect, read the greeting, one request line and its echo, close) at a stepped
//! rate that doubles, each step held longer than the tc conntrack's 10 s close timeout. Each
//! mode runs on a fresh node; the section stops at the first step with a failure, or when the
//! client cannot start connections at the offered rate.
//!
//! Both sides live here: the helper's load loop ([`snat_load`]) and the orchestrator
//! ([`run_mode`]).

use std::collections::BTreeMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Args;

use super::IptablesBackend;
use super::agent_runs::{ProxyMode, agent_args, bench_node, external};
use super::client::{Place, client_cpu, pin};
use super::workload::{LIVE_NODE_PORT, LiveSet, Workload};
use crate::process::run_ok_within;
use crate::scenario::Scenario;
use crate::topology::Topology;
use crate::{Result, RigError, helper_binary};

/// Sizes of the stepped load.
#[derive(Debug, Clone, Copy)]
pub struct SnatLoops {
    /// Offered rate of the first step (new connections per second); each step doubles it.
    pub first_rate: u32,
    /// Steps at most per mode.
    pub max_steps: usize,
    /// How long each step offers its rate.
    pub step: Duration,
    /// Client source addresses the connections are spread over (round robin).
    pub sources: usize,
    /// Connect timeout, and again the timeout of the exchange after it: 1 s is the first SYN
    /// retransmission, so a SYN the datapath dropped shows as a connect timeout.
    pub timeout: Duration,
}

// ---------------------------------------------------------------------------------------------
// The helper side: `rig-helper snat-load`.

#[derive(Debug, Clone, Args)]
pub struct SnatLoadArgs {
    #[arg(long)]
    pub target: SocketAddr,
    /// Source addresses to spread the connections over, round robin (each socket is bound
    /// with `IP_BIND_ADDRESS_NO_PORT`, so the port is chosen at connect time per 4-tuple).
    #[arg(long, value_delimiter = ',')]
    pub sources: Vec<Ipv4Addr>,
    /// New connections to start per second.
    #[arg(long)]
    pub rate: u32,
    /// How long to offer the rate.
    #[arg(long)]
    pub duration_ms: u64,
    /// Connect timeout, and the timeout of the exchange after it.
    #[arg(long, default_value_t = 1000)]
    pub timeout_ms: u64,
    /// Connections in flight at most; a start beyond it is skipped and counted (a client
    /// limit, not a datapath failure).
    #[arg(long, default_value_t = 8000)]
    pub max_in_flight: usize,
    /// Greetings must start with this (the backend's name).
    #[arg(long, default_value = "pod")]
    pub expect: String,
    #[arg(long)]
    pub netns: Option<PathBuf>,
    /// Run on this CPU only.
    #[arg(long)]
    pub cpu: Option<usize>,
}

/// How one connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Conn {
    /// Answered by the expected backend; connect to echo read, in ns.
    Ok(u64),
    Failed(Failure, String),
}

/// Why a connection failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Failure {
    /// No SYN-ACK within the timeout (the SYN was dropped somewhere).
    ConnectTimeout,
    /// ECONNREFUSED: a RST (or ICMP unreachable) answered the SYN.
    Refused,
    /// ECONNRESET/ECONNABORTED/EPIPE after the connection was made.
    Reset,
    /// Connected, but the greeting or the echo did not come within the timeout.
    AnswerTimeout,
    /// Connected, but the peer closed before answering.
    Closed,
    /// Answered by something else than the expected backend.
    WrongBackend,
    /// Anything else the datapath could cause (unreachable, ...).
    Other,
    /// The client's own limit: no local port (EADDRNOTAVAIL), no file descriptor.
    Client,
}

impl Failure {
    const ALL: [Self; 8] = [
        Self::ConnectTimeout,
        Self::Refused,
        Self::Reset,
        Self::AnswerTimeout,
        Self::Closed,
        Self::WrongBackend,
        Self::Other,
        Self::Client,
    ];

    fn key(self) -> &'static str {
        match self {
            Self::ConnectTimeout => "connect_timeout",
            Self::Refused => "refused",
            Self::Reset => "reset",
            Self::AnswerTimeout => "answer_timeout",
            Self::Closed => "closed",
            Self::WrongBackend => "wrong_backend",
            Self::Other => "other",
            Self::Client => "client",
        }
    }

    /// For the report.
    pub fn label(self) -> &'static str {
        match self {
            Self::ConnectTimeout => "connect timeout",
            Self::Refused => "refused",
            Self::Reset => "reset",
            Self::AnswerTimeout => "answer timeout",
            Self::Closed => "closed before answering",
            Self::WrongBackend => "wrong backend",
            Self::Other => "other",
            Self::Client => "client-side (ports, fds)",
        }
    }

    fn of(e: &io::Error) -> Self {
        use io::ErrorKind as K;
        match e.kind() {
            K::ConnectionRefused => Self::Refused,
            K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => Self::Reset,
            K::TimedOut => Self::ConnectTimeout,
            K::UnexpectedEof => Self::Closed,
            K::AddrNotAvailable | K::AddrInUse => Self::Client,
            _ if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => Self::Client,
            _ => Self::Other,
        }
    }
}

/// Reads until a newline (tokio's `io-util` extension traits are not built here, so with
/// `readable` + `try_read`).
async fn read_line(stream: &tokio::net::TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    loop {
        let Some(free) = buf.get_mut(filled..).filter(|b| !b.is_empty()) else {
            return Err(io::Error::other("line longer than the buffer"));
        };
        stream.readable().await?;
        let n = match stream.try_read(free) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "EOF"));
        }
        filled += n;
        if buf.get(..filled).is_some_and(|b| b.contains(&b'\n')) {
            return Ok(filled);
        }
    }
}

async fn write_all(stream: &tokio::net::TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        stream.writable().await?;
        match stream.try_write(data) {
            Ok(n) => data = data.get(n..).unwrap_or_default(),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One short connection: connect, greeting, one request line and its echo, close.
async fn one(target: SocketAddr, source: Ipv4Addr, expect: &str, timeout: Duration) -> Conn {
    let failed = |kind: Failure, what: &str, e: &dyn std::fmt::Display| {
        Conn::Failed(kind, format!("{what}: {e}"))
    };
    let t0 = Instant::now();
    let socket = match tokio::net::TcpSocket::new_v4() {
        Ok(s) => s,
        Err(e) => return failed(Failure::of(&e), "socket", &e),
    };
    if let Err(e) = nix::sys::socket::setsockopt(
        &socket,
        nix::sys::socket::sockopt::IpBindAddressNoPort,
        &true,
    ) {
        return failed(Failure::Client, "IP_BIND_ADDRESS_NO_PORT", &e);
    }
    if let Err(e) = socket.bind(SocketAddr::new(source.into(), 0)) {
        return failed(Failure::of(&e), "bind", &e);
    }
    let stream = match tokio::time::timeout(timeout, socket.connect(target)).await {
        Err(_) => return failed(Failure::ConnectTimeout, "connect", &"timed out"),
        Ok(Err(e)) => return failed(Failure::of(&e), "connect", &e),
        Ok(Ok(s)) => s,
    };
    let mut buf = [0u8; 256];
    let exchange = async {
        let n = read_line(&stream, &mut buf).await?;
        let name = String::from_utf8_lossy(buf.get(..n).unwrap_or_default())
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned();
        write_all(&stream, b"ping\n").await?;
        read_line(&stream, &mut buf).await?;
        Ok::<_, io::Error>(name)
    };
    match tokio::time::timeout(timeout, exchange).await {
        Err(_) => failed(Failure::AnswerTimeout, "answer", &"timed out"),
        Ok(Err(e)) => failed(Failure::of(&e), "answer", &e),
        Ok(Ok(name)) if name.starts_with(expect) => {
            Conn::Ok(u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX))
        }
        Ok(Ok(name)) => failed(Failure::WrongBackend, "answer from", &name),
    }
    // Dropping the stream closes it: the client closes first, as a short-lived client does.
}

/// What one step of the load did.
#[derive(Debug, Clone, Default)]
pub struct LoadStep {
    /// Connections the step was to start (rate × duration).
    pub offered: u64,
    pub started: u64,
    /// Not started: too many in flight (a client limit).
    pub skipped: u64,
    pub ok: u64,
    pub failures: BTreeMap<Failure, u64>,
    pub first_error: String,
    /// First start → last start, plus one interval: the time over which `started` went out.
    pub start_span: Duration,
    /// Median and 99th percentile of the successful connections (connect → echo read).
    pub p50_ns: u64,
    pub p99_ns: u64,
}

impl LoadStep {
    /// Failures the datapath (or the backend) caused, i.e. all but the client's own.
    pub fn datapath_failures(&self) -> u64 {
        self.failures
            .iter()
            .filter(|(f, _)| **f != Failure::Client)
            .map(|(_, n)| n)
            .sum()
    }

    pub fn client_failures(&self) -> u64 {
        self.failures.get(&Failure::Client).copied().unwrap_or(0)
    }

    /// Connections started per second.
    pub fn started_rate(&self) -> f64 {
        self.started as f64 / self.start_span.as_secs_f64().max(1e-9)
    }

    /// Connections that completed per second over the same span.
    pub fn completed_rate(&self) -> f64 {
        self.ok as f64 / self.start_span.as_secs_f64().max(1e-9)
    }

    fn line(&self) -> String {
        let mut line = format!(
            "snat-load offered={} started={} skipped={} ok={} span_ns={} p50_ns={} p99_ns={}",
            self.offered,
            self.started,
            self.skipped,
            self.ok,
            self.start_span.as_nanos(),
            self.p50_ns,
            self.p99_ns
        );
        for f in Failure::ALL {
            let n = self.failures.get(&f).copied().unwrap_or(0);
            line.push_str(&format!(" {}={n}", f.key()));
        }
        line.push_str(&format!(
            " first_error={}",
            self.first_error.replace(' ', "_")
        ));
        line
    }

    fn parse(line: &str) -> Result<Self> {
        let bad = || RigError::Parse {
            what: "snat-load summary",
            line: line.to_owned(),
        };
        let rest = line.strip_prefix("snat-load ").ok_or_else(bad)?;
        let fields: BTreeMap<&str, &str> = rest
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let num = |name: &str| -> Result<u64> {
            fields
                .get(name)
                .and_then(|v| v.parse().ok())
                .ok_or_else(bad)
        };
        let mut failures = BTreeMap::new();
        for f in Failure::ALL {
            let n = num(f.key())?;
            if n > 0 {
                failures.insert(f, n);
            }
        }
        Ok(Self {
            offered: num("offered")?,
            started: num("started")?,
            skipped: num("skipped")?,
            ok: num("ok")?,
            failures,
            first_error: fields.get("first_error").unwrap_or(&"-").replace('_', " "),
            start_span: Duration::from_nanos(num("span_ns")?),
            p50_ns: num("p50_ns")?,
            p99_ns: num("p99_ns")?,
        })
    }
}

/// `rig-helper snat-load`: starts `rate` connections per second for `duration_ms` on a fixed
/// schedule (open loop), waits for the last ones, prints one summary line.
pub fn snat_load(args: &SnatLoadArgs) -> Result<()> {
    if let Some(cpu) = args.cpu {
        pin(0, cpu)?;
    }
    if args.sources.is_empty() || args.rate == 0 {
        return Err(RigError::Other(
            "snat-load needs --sources and a rate above 0".into(),
        ));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| RigError::io("building the tokio runtime", e))?;
    let step = runtime.block_on(load(args));
    println!("{}", step.line());
    Ok(())
}

async fn load(args: &SnatLoadArgs) -> LoadStep {
    let interval = Duration::from_secs(1) / args.rate;
    let offered = u64::from(args.rate) * args.duration_ms / 1000;
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut step = LoadStep {
        offered,
        first_error: "-".into(),
        ..LoadStep::default()
    };
    let mut samples = Vec::with_capacity(usize::try_from(offered).unwrap_or(0));
    let mut tally = |conn: Option<Conn>, step: &mut LoadStep| match conn {
        Some(Conn::Ok(ns)) => {
            step.ok += 1;
            samples.push(ns);
        }
        Some(Conn::Failed(kind, what)) => {
            if step.failures.values().sum::<u64>() == 0 {
                step.first_error = format!("{}: {what}", kind.label());
            }
            *step.failures.entry(kind).or_default() += 1;
        }
        None => *step.failures.entry(Failure::Other).or_default() += 1,
    };
    let mut set = tokio::task::JoinSet::new();
    let t0 = Instant::now();
    let mut last_start = t0;
    for i in 0..offered {
        let due = t0 + interval * u32::try_from(i).unwrap_or(u32::MAX);
        // Sleep only when ahead: a timer that is already due would still wait for the
        // timer wheel's next 1 ms tick, which would cap the rate at 1000/s.
        if due > Instant::now() + Duration::from_micros(200) {
            tokio::time::sleep_until(due.into()).await;
        } else {
            tokio::task::yield_now().await;
        }
        while let Some(done) = set.try_join_next() {
            tally(done.ok(), &mut step);
        }
        if set.len() >= args.max_in_flight {
            step.skipped += 1;
            continue;
        }
        let source = args
            .sources
            .get(usize::try_from(i).unwrap_or(0) % args.sources.len())
            .copied()
            .unwrap_or(Ipv4Addr::UNSPECIFIED);
        let expect = args.expect.clone();
        let target = args.target;
        set.spawn(async move { one(target, source, &expect, timeout).await });
        step.started += 1;
        last_start = Instant::now();
    }
    while let Some(done) = set.join_next().await {
        tally(done.ok(), &mut step);
    }
    step.start_span = last_start.duration_since(t0) + interval;
    samples.sort_unstable();
    let at = |q: f64| -> u64 {
        let i = ((samples.len() as f64 - 1.0) * q).round().max(0.0) as usize;
        samples.get(i).copied().unwrap_or(0)
    };
    step.p50_ns = at(0.5);
    step.p99_ns = at(0.99);
    step
}

// ---------------------------------------------------------------------------------------------
// The orchestrator side.

/// Kernel conntrack statistics of a namespace: `/proc/net/stat/nf_conntrack` summed over CPUs.
pub type KernelCtStats = BTreeMap<String, u64>;

/// Counters that matter for SNAT failures, read before and after a step.
#[derive(Debug, Clone, Default)]
struct Counters {
    snat_exhausted: Option<u64>,
    snat: Option<u64>,
    ct_failed: Option<u64>,
    kernel: Option<KernelCtStats>,
}

/// One step of one mode, with the counters' changes over it.
#[derive(Debug, Clone)]
pub struct SnatStep {
    /// Offered rate, new connections per second.
    pub rate: u32,
    pub load: LoadStep,
    /// `tc_snat_port_exhausted` over the step (eBPF mode).
    pub snat_exhausted: Option<u64>,
    /// `tc_snat`: new flows source-NATed over the step (eBPF mode).
    pub snat: Option<u64>,
    /// `tc_ct_failed`: conntrack entries that could not be written (eBPF mode).
    pub ct_failed: Option<u64>,
    /// Kernel conntrack statistics over the step (`insert_failed`, `drop`, `early_drop`, ...);
    /// None when not readable.
    pub kernel: Option<KernelCtStats>,
    /// Kernel conntrack entries in the node namespace after the step.
    pub kernel_entries: Option<u64>,
}

impl SnatStep {
    pub fn kernel_delta(&self, name: &str) -> Option<u64> {
        self.kernel
            .as_ref()
            .map(|k| k.get(name).copied().unwrap_or(0))
    }
}

/// Why a mode's steps ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A step had a failure the datapath (or backend) caused.
    Failure,
    /// The client could not start connections at the offered rate (or hit its own limits).
    ClientLimit,
    /// Every step ran without failure.
    LastStep,
}

/// One mode's run.
#[derive(Debug, Clone)]
pub struct SnatModeRun {
    pub steps: Vec<SnatStep>,
    pub stop: Stop,
    /// `nf_conntrack_tcp_timeout_time_wait` in the node namespace (seconds).
    pub kernel_time_wait: Option<u64>,
    /// `KPR_CT`'s capacity (eBPF mode).
    pub ct_capacity: Option<u64>,
    /// Wall time of the mode's run, node setup and agent start included.
    pub elapsed: Duration,
}

impl SnatModeRun {
    /// The highest step without any failure (before the first failing one).
    pub fn last_clean(&self) -> Option<&SnatStep> {
        self.steps
            .iter()
            .take_while(|s| s.load.datapath_failures() == 0)
            .last()
    }

    pub fn first_failing(&self) -> Option<&SnatStep> {
        self.steps.iter().find(|s| s.load.datapath_failures() > 0)
    }
}

/// The section's result.
#[derive(Debug, Clone)]
pub struct SnatResult {
    pub loops: SnatLoops,
    pub ebpf: super::Outcome<SnatModeRun>,
    pub iptables: super::Outcome<SnatModeRun>,
    pub elapsed: Duration,
}

/// The client's source addresses: 10.10.0.100 on, in the external link's subnet.
pub fn client_sources(n: usize) -> Vec<Ipv4Addr> {
    (0..n)
        .map(|i| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 10, 0, 100)) + i as u32))
        .collect()
}

fn nodeport() -> SocketAddr {
    SocketAddr::new(Topology::node_ext_ip().into(), LIVE_NODE_PORT)
}

/// The one backend every flow reaches.
const BACKEND: &str = "pod3";

fn read_kernel_stats(s: &Scenario) -> Option<KernelCtStats> {
    let text = s
        .topo
        .node()
        .exec("cat", &["/proc/net/stat/nf_conntrack"])
        .ok()?;
    parse_kernel_stats(&text)
}

/// Parses `/proc/net/stat/nf_conntrack`: a header of names, then one row of hex numbers per
/// CPU; summed over CPUs (`entries` is global, so it is taken from the first row).
pub fn parse_kernel_stats(text: &str) -> Option<KernelCtStats> {
    let mut lines = text.lines();
    let names: Vec<&str> = lines.next()?.split_whitespace().collect();
    let mut sums = KernelCtStats::new();
    for (row, line) in lines.filter(|l| !l.trim().is_empty()).enumerate() {
        for (name, value) in names.iter().zip(line.split_whitespace()) {
            let value = u64::from_str_radix(value, 16).ok()?;
            if *name == "entries" && row > 0 {
                continue;
            }
            *sums.entry((*name).to_owned()).or_default() += value;
        }
    }
    (!sums.is_empty()).then_some(sums)
}

fn read_node_number(s: &Scenario, path: &str) -> Option<u64> {
    s.topo.node().exec("cat", &[path]).ok()?.trim().parse().ok()
}

fn counters(s: &Scenario, mode: ProxyMode) -> Counters {
    use proxy_common::StatIndex;
    let agent = s.agent_ref().filter(|_| mode == ProxyMode::Ebpf);
    let read = |index| agent.and_then(|a| a.datapath_counter(index).ok());
    Counters {
        snat_exhausted: read(StatIndex::TcSnatPortExhausted),
        snat: read(StatIndex::TcSnat),
        ct_failed: read(StatIndex::TcCtFailed),
        kernel: read_kernel_stats(s),
    }
}

fn delta(after: Option<u64>, before: Option<u64>) -> Option<u64> {
    Some(after?.saturating_sub(before?))
}

/// Runs one `rig-helper snat-load` step from `place`.
fn run_step(place: &Place, sources: &[Ipv4Addr], rate: u32, loops: SnatLoops) -> Result<LoadStep> {
    let sources: Vec<String> = sources.iter().map(ToString::to_string).collect();
    let mut cmd = Command::new(helper_binary()?);
    cmd.arg("snat-load")
        .args(["--target", &nodeport().to_string()])
        .args(["--sources", &sources.join(",")])
        .args(["--rate", &rate.to_string()])
        .args(["--duration-ms", &loops.step.as_millis().to_string()])
        .args(["--timeout-ms", &loops.timeout.as_millis().to_string()])
        .args(["--expect", BACKEND])
        .arg("--netns")
        .arg(&place.netns);
    if let Some(cpu) = client_cpu() {
        cmd.args(["--cpu", &cpu.to_string()]);
    }
    // The step, the last connections' two timeouts, and slack for a loaded machine.
    let stdout = run_ok_within(
        &mut cmd,
        loops.step + 2 * loops.timeout + Duration::from_secs(30),
    )?;
    let line = stdout
        .lines()
        .find(|l| l.starts_with("snat-load "))
        .unwrap_or_default();
    LoadStep::parse(line)
}

/// Waits (bounded) until the NodePort answers from the backend, from the external namespace.
fn wait_for_nodeport(s: &mut Scenario) -> Result<()> {
    let client = s.external_client();
    let started = Instant::now();
    loop {
        let attempt = client.once(nodeport())?;
        if attempt.backend() == Some(BACKEND) {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(s.agent_error(format!(
                "the NodePort {} is not answered by {BACKEND} 60 s after the agent started: {attempt:?}",
                nodeport()
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn ct_capacity(s: &Scenario) -> Option<u64> {
    let pin = s
        .agent_ref()?
        .bpf_root()
        .join(proxy_dataplane_ebpf::PIN_DIR_NAME)
        .join(proxy_common::map_names::CT4);
    aya::maps::MapInfo::from_pin(&pin)
        .ok()
        .map(|info| u64::from(info.max_entries()))
}

/// One mode on a fresh node: the agent, then the steps until the first failure.
pub fn run_mode(
    mode: ProxyMode,
    backend: IptablesBackend,
    loops: SnatLoops,
    mut progress: impl FnMut(&str),
) -> Result<SnatModeRun> {
    let started = Instant::now();
    let mut s = bench_node(backend)?;
    // One Service with one endpoint: pod3 (the live set B).
    let w = Workload {
        services: 1,
        endpoints: 2,
    };
    w.write_manifests(&s.manifests, LiveSet::B)?;
    let sources = client_sources(loops.sources);
    for source in &sources {
        s.topo
            .ext()
            .ip(&["addr", "add", &format!("{source}/24"), "dev", "eth0"])?;
    }
    let args = agent_args(mode, w);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    s.start_agent_with_args(mode.as_arg(), &args)?;
    wait_for_nodeport(&mut s)?;
    let kernel_time_wait = read_node_number(
        &s,
        "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_time_wait",
    );
    let ct_capacity = (mode == ProxyMode::Ebpf).then(|| ct_capacity(&s)).flatten();
    let place = external(&s);
    let mut steps = Vec::new();
    let mut stop = Stop::LastStep;
    let mut rate = loops.first_rate;
    for _ in 0..loops.max_steps {
        progress(&format!(
            "    {} at {rate} new connections/s",
            mode.as_arg()
        ));
        let before = counters(&s, mode);
        let load = run_step(&place, &sources, rate, loops)?;
        let after = counters(&s, mode);
        let kernel = match (&before.kernel, &after.kernel) {
            (Some(b), Some(a)) => Some(
                a.iter()
                    .map(|(k, v)| (k.clone(), v.saturating_sub(b.get(k).copied().unwrap_or(0))))
                    .collect(),
            ),
            _ => None,
        };
        let step = SnatStep {
            rate,
            snat_exhausted: delta(after.snat_exhausted, before.snat_exhausted),
            snat: delta(after.snat, before.snat),
            ct_failed: delta(after.ct_failed, before.ct_failed),
            kernel,
            kernel_entries: read_node_number(&s, "/proc/sys/net/netfilter/nf_conntrack_count"),
            load,
        };
        let failed = step.load.datapath_failures() > 0;
        let client_short = step.load.client_failures() > 0
            || step.load.skipped > 0
            || step.load.started_rate() < 0.9 * f64::from(rate);
        steps.push(step);
        if failed {
            stop = Stop::Failure;
            break;
        }
        if client_short {
            stop = Stop::ClientLimit;
            break;
        }
        rate = rate.saturating_mul(2);
    }
    s.stop_agent()?;
    Ok(SnatModeRun {
        steps,
        stop,
        kernel_time_wait,
        ct_capacity,
        elapsed: started.elapsed(),
    })
}

/// Conntrack entry sizes, computed from the types the datapath uses: (key, value, kernel
/// bytes per entry with the LRU map's per-element overhead), IPv4 (`KPR_CT4`) then IPv6
/// (`KPR_CT6`).
pub fn ct_entry_sizes() -> [(usize, usize, u64); 2] {
    use proxy_common::{CtKey, CtKey4, CtValue, CtValue4};
    use proxy_dataplane_ebpf::maps::map_sizes::entry_bytes;
    [
        (
            size_of::<CtKey4>(),
            size_of::<CtValue4>(),
            entry_bytes::<CtKey4, CtValue4>(),
        ),
        (
            size_of::<CtKey>(),
            size_of::<CtValue>(),
            entry_bytes::<CtKey, CtValue>(),
        ),
    ]
}

/// Conntrack entries one flow takes: without SNAT or on the fast path, and SNATed on the
/// netfilter path (plus its two egress entries).
pub const ENTRIES_PER_FLOW: usize = 2;
pub const ENTRIES_PER_SNAT_FLOW_NETFILTER_PATH: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_line_round_trips() -> Result<()> {
        let mut step = LoadStep {
            offered: 100,
            started: 99,
            skipped: 1,
            ok: 90,
            first_error: "connect timeout: connect: timed out".into(),
            start_span: Duration::from_millis(1000),
            p50_ns: 150_000,
            p99_ns: 900_000,
            ..LoadStep::default()
        };
        step.failures.insert(Failure::ConnectTimeout, 8);
        step.failures.insert(Failure::Client, 1);
        let parsed = LoadStep::parse(&step.line())?;
        assert_eq!(parsed.started, 99);
        assert_eq!(parsed.failures, step.failures);
        assert_eq!(parsed.datapath_failures(), 8);
        assert_eq!(parsed.client_failures(), 1);
        assert_eq!(parsed.first_error, step.first_error);
        assert!((parsed.started_rate() - 99.0).abs() < 1e-6);
        assert!(LoadStep::parse("garbage").is_err());
        Ok(())
    }

    #[test]
    fn kernel_stats_are_summed_over_cpus() {
        let text = "entries  clashres found new invalid ignore delete delete_list insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart\n\
                    0000000a  00000000 00000000 00000000 00000001 00000000 00000000 00000000 00000000 00000002 00000003 00000000 00000000  00000000 00000000 00000000 00000000\n\
                    0000000a  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000010 00000001 00000000 00000000  00000000 00000000 00000000 00000000\n";
        let stats = parse_kernel_stats(text);
        assert_eq!(stats.as_ref().and_then(|s| s.get("entries")), Some(&10));
        assert_eq!(
            stats.as_ref().and_then(|s| s.get("insert_failed")),
            Some(&18)
        );
        assert_eq!(stats.as_ref().and_then(|s| s.get("drop")), Some(&4));
        assert!(parse_kernel_stats("").is_none());
    }
}
