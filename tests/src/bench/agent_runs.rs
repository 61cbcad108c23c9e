//! Measurements through the real agent process on the rig's node: cold start (agent start →
//! first "sync applied" log line, and → first translated connection), end-to-end programming
//! (manifest file written → first connection reaching the new endpoint), and memory.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::client::{Place, Probe, monotonic_ns};
use super::sysinfo::{MapMemory, bpf_maps, rss_kib};
use super::workload::{LiveSet, Workload, live_slice, write_live_slice};
use crate::apiserver::ApiServer;
use crate::client::Attempt;
use crate::scenario::{Scenario, cluster_addr};
use crate::topology::DECOY_NAME;
use crate::{Result, RigError};

/// The xtables backend the iptables mode uses in the benchmark's namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum IptablesBackend {
    /// What the agent picks in an empty namespace (as kube-proxy's image does).
    Nft,
    /// Chosen through the kubelet's hint chain, which the benchmark creates first.
    Legacy,
}

impl IptablesBackend {
    pub fn label(self) -> &'static str {
        match self {
            Self::Nft => "nft",
            Self::Legacy => "legacy",
        }
    }

    /// The command that makes the agent's backend detection (kube-proxy's iptables-wrapper
    /// logic) choose this backend in an empty namespace: kubelet's `KUBE-IPTABLES-HINT` chain
    /// in the legacy mangle table. Nothing for nft, the default there.
    pub fn hint_command(self) -> Option<(&'static str, &'static [&'static str])> {
        match self {
            Self::Nft => None,
            Self::Legacy => Some((
                "iptables-legacy",
                &["-w", "5", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
            )),
        }
    }
}

/// The two proxy modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProxyMode {
    Ebpf,
    Iptables,
}

impl ProxyMode {
    pub fn as_arg(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
        }
    }
}

/// A rig node for benchmarks: the scenario's node with the three echo pods, the ClusterIP
/// decoy and a child cgroup. The node and external namespaces get `tcp_tw_reuse` so that tens of thousands of
/// short connections to the same backend never run out of ports to TIME_WAIT.
///
/// With pinning on ([`super::client::set_client_cpu`]) the echo servers run on the clients'
/// CPU: every wakeup of a round trip is then local, instead of sometimes local (about 5 µs per
/// round trip here) and sometimes an inter-processor wakeup of an idle vCPU (about 60 µs),
/// which made results bimodal and ratios between paths compare different things.
pub fn bench_node(backend: IptablesBackend) -> Result<Scenario> {
    let s = Scenario::new(super::workload::LIVE_PODS)?;
    if let Some((program, args)) = backend.hint_command() {
        s.topo.node().exec(program, args)?;
    }
    if let Some(cpu) = super::client::client_cpu() {
        for pid in s.topo.echo_pids() {
            super::client::pin_process(pid, cpu)?;
        }
    }
    // The external namespace runs item 3's clients.
    for ns in [s.topo.node(), s.topo.ext()] {
        ns.sysctl("net.ipv4.tcp_tw_reuse", "1")?;
        ns.sysctl("net.ipv4.ip_local_port_range", "10000 65000")?;
    }
    Ok(s)
}

/// A client in the node namespace inside the agent's cgroup (a pod-like process).
pub fn in_cgroup(s: &Scenario) -> Place {
    Place {
        netns: s.topo.node().path(),
        cgroup: Some(s.cgroup.path().to_path_buf()),
    }
}

/// A client in the external namespace (beyond the node's `vext`, like a client on another
/// machine).
pub fn external(s: &Scenario) -> Place {
    Place {
        netns: s.topo.ext().path(),
        cgroup: None,
    }
}

/// A client in the node namespace outside the agent's cgroup (no socket hook runs).
pub fn outside(s: &Scenario) -> Place {
    Place {
        netns: s.topo.node().path(),
        cgroup: None,
    }
}

/// Agent start-up at one size.
#[derive(Debug, Clone, Copy)]
pub struct ColdStart {
    /// Agent process started → first "sync applied" line in its log (polled every 2 ms).
    pub to_sync_log: Duration,
    /// Agent process started → the first connection to the ClusterIP reaching a pod starts.
    pub to_first_connection: Duration,
    /// Where the time went, from the agent's own log.
    pub phases: StartPhases,
}

/// A cold start's phases, from the timestamps of the agent's log lines, each counted from its
/// "starting proxy-agent" line. The source is read while the dataplane loads its programs;
/// the first sync waits for both. `None`: the line is not in the log.
#[derive(Debug, Clone, Copy, Default)]
pub struct StartPhases {
    /// → the dataplane is ready ("eBPF socket and tc programs loaded", or the iptables mode's
    /// "iptables dataplane ready" of its second family).
    pub dataplane_ready: Option<Duration>,
    /// → the source has everything ("manifests read", or the last kind's first "listed").
    pub source_read: Option<Duration>,
    /// The first sync's dataplane part (its `elapsed_us`: map writes, or the restore).
    pub first_sync: Option<Duration>,
    /// What the first sync took before that (its `snapshot_us`: the store's changes and the
    /// snapshot).
    pub first_snapshot: Option<Duration>,
}

impl StartPhases {
    pub fn of_log(log: &str) -> Self {
        let mut start = None;
        let mut phases = Self::default();
        let mut listed = Vec::new();
        for line in log.lines() {
            let Some(at) = line.get(..27).and_then(log_time) else {
                continue;
            };
            let since = |start: Option<Duration>| {
                start.map(|s: Duration| at.checked_sub(s).unwrap_or_default())
            };
            if line.contains("starting proxy-agent") {
                start = Some(at);
                phases = Self::default();
                listed.clear();
            } else if line.contains("eBPF socket and tc programs loaded")
                || line.contains("iptables dataplane ready")
            {
                phases.dataplane_ready = since(start);
            } else if line.contains("manifests read") && phases.source_read.is_none() {
                phases.source_read = since(start);
            } else if line.contains(" listed ") && line.contains("kind=") {
                let kind = line.split("kind=").nth(1).and_then(|k| k.split(' ').next());
                if let Some(kind) = kind
                    && !listed.contains(&kind)
                {
                    listed.push(kind);
                    phases.source_read = since(start);
                }
            } else if line.contains("sync applied") && phases.first_sync.is_none() {
                phases.first_sync = elapsed_us(line);
                phases.first_snapshot = field_us(line, "snapshot_us=");
            }
        }
        phases
    }
}

/// A `sync applied` line's `elapsed_us` field: the sync's own duration.
fn elapsed_us(line: &str) -> Option<Duration> {
    field_us(line, "elapsed_us=")
}

/// A log line's field of microseconds (`name` with its `=`).
fn field_us(line: &str, name: &str) -> Option<Duration> {
    line.split(name)
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
        .map(Duration::from_micros)
}

/// The time of day of a log line's RFC 3339 timestamp (`2026-11-29T09:34:53.687876Z`). A start
/// across midnight gives no phases (the subtraction saturates); nothing else is compared.
fn log_time(stamp: &str) -> Option<Duration> {
    let time = stamp.get(11..26)?;
    let hours: u64 = time.get(0..2)?.parse().ok()?;
    let minutes: u64 = time.get(3..5)?.parse().ok()?;
    let seconds: u64 = time.get(6..8)?.parse().ok()?;
    let micros: u64 = time.get(9..15)?.parse().ok()?;
    Some(Duration::from_micros(
        ((hours * 60 + minutes) * 60 + seconds) * 1_000_000 + micros,
    ))
}

/// Peak and current memory of the agent, and its BPF maps.
#[derive(Debug, Clone, Default)]
pub struct AgentMemory {
    pub vm_hwm_kib: u64,
    pub vm_rss_kib: u64,
    pub maps: Vec<MapMemory>,
    /// Entries of each map the agent programs (`kubeproxy_ebpf_map_entries`, by map name; eBPF
    /// mode only), as of its last sync.
    pub entries: Vec<(String, u64)>,
}

impl AgentMemory {
    pub fn map_memlock(&self) -> u64 {
        self.maps.iter().map(|m| m.memlock).sum()
    }

    /// The maps holding programmed entries (frontends, backends, slots, source ranges, Maglev
    /// tables), each with its entry count.
    pub fn programmed_maps(&self) -> Vec<(&MapMemory, u64)> {
        self.maps
            .iter()
            .filter_map(|m| {
                let entries = self
                    .entries
                    .iter()
                    .find(|(name, _)| same_map_name(&m.name, name))?
                    .1;
                Some((m, entries))
            })
            .collect()
    }

    /// What the programmed entries need: Σ entries × (key size + value size) over the
    /// programmed maps — the payload alone, without the kernel's per-element header, buckets
    /// or per-CPU allocator slack, which is what the 1.5× allowance is for.
    pub fn needed_bytes(&self) -> u64 {
        self.programmed_maps()
            .iter()
            .map(|(m, entries)| entries * payload(m))
            .sum()
    }

    /// Kernel memory of the programmed maps (`memlock`; for maps that are not preallocated
    /// it follows the elements in them).
    pub fn programmed_memlock(&self) -> u64 {
        self.programmed_maps().iter().map(|(m, _)| m.memlock).sum()
    }
}

/// The payload of one entry the agent's `kubeproxy_ebpf_map_entries` counts in `map`: its key
/// and value, except in the slot map, which keeps `SLOT_BLOCK_SLOTS` slots to an element and
/// whose count is of slots (what `--bpf-map-backends` bounds): a slot needs its backend id
/// and the key a map of one slot per element gave it.
pub fn payload(map: &MapMemory) -> u64 {
    if same_map_name(&map.name, proxy_common::map_names::BACKEND_SLOTS) {
        map.key_size + map.value_size / u64::from(proxy_common::SLOT_BLOCK_SLOTS)
    } else {
        map.key_size + map.value_size
    }
}

/// Whether the kernel's map name (cut to 15 bytes, `BPF_OBJ_NAME_LEN` − 1) is `full`.
fn same_map_name(kernel: &str, full: &str) -> bool {
    !kernel.is_empty() && (kernel == full || (kernel.len() == 15 && full.starts_with(kernel)))
}

/// `kubeproxy_ebpf_map_entries{map="NAME"} N` lines of a metrics exposition.
fn map_entries(exposition: &str) -> Vec<(String, u64)> {
    exposition
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("kubeproxy_ebpf_map_entries{")?;
            let name = rest.split_once("map=\"")?.1.split_once('"')?.0;
            let value = line.rsplit_once(' ')?.1.parse::<f64>().ok()?;
            Some((name.to_owned(), value as u64))
        })
        .collect()
}

/// Agent flags a workload needs: map capacities with room for every frontend and endpoint
/// (the defaults where they suffice), and (eBPF) the
/// tc programs on the node's external link only, as the rig's tests run them (the pod veths
/// carry addresses that auto-detection would also take).
pub fn agent_args(mode: ProxyMode, w: Workload) -> Vec<String> {
    match mode {
        ProxyMode::Ebpf => vec![
            "--bpf-map-backends".into(),
            super::inprocess::backends_capacity(w).to_string(),
            "--bpf-map-frontends".into(),
            super::inprocess::frontends_capacity(w).to_string(),
            "--interfaces".into(),
            "vext".into(),
        ],
        ProxyMode::Iptables => Vec::new(),
    }
}

/// Fails unless the ClusterIP is answered by the decoy, i.e. nothing translates it (a previous
/// agent's datapath is gone), waiting up to 10 s for that.
pub fn ensure_untranslated(s: &Scenario) -> Result<()> {
    let client = s.cgroup_client();
    let start = Instant::now();
    loop {
        let attempt = client.once(cluster_addr())?;
        if attempt.backend() == Some(DECOY_NAME) {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err(RigError::Other(format!(
                "the ClusterIP is still translated after the agent stopped: {attempt:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Removes the iptables mode's rules from the node namespace (what `proxy-agent --cleanup`
/// does), so that the next iptables start is a cold one. Runs on a thread that entered the
/// node namespace: the iptables tools it spawns inherit it, the host's tables are never touched.
pub fn clear_iptables_rules(s: &Scenario) -> Result<()> {
    let node = s.topo.node().path();
    let worker = std::thread::spawn(move || -> Result<Vec<String>> {
        crate::netns::enter_netns(&node)?;
        Ok(proxy_dataplane_iptables::cleanup()
            .iter()
            .map(ToString::to_string)
            .collect())
    });
    let problems = worker
        .join()
        .map_err(|_| RigError::Other("the iptables cleanup thread panicked".into()))??;
    match problems.first() {
        None => Ok(()),
        Some(first) => Err(RigError::Other(format!(
            "removing the iptables rules from the node namespace: {first}"
        ))),
    }
}

/// Where the agent reads the cluster from.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// The scenario's manifests folder (`--manifests`).
    Manifests,
    /// The API test server (`--kubeconfig`), already holding the workload's objects.
    Api(&'a ApiServer),
}

impl Source<'_> {
    pub fn name(self) -> &'static str {
        match self {
            Self::Manifests => "manifests",
            Self::Api(_) => "API server",
        }
    }

    /// Sets the live Service's endpoints to `live`: the slice file renamed into place, or the
    /// slice object updated in the API server (which sends the watch event at once).
    fn set_live(self, s: &Scenario, live: LiveSet) -> Result<()> {
        match self {
            Self::Manifests => write_live_slice(&s.manifests, live),
            Self::Api(api) => api.apply(&live_slice(live)).map(|_| ()),
        }
    }
}

/// Starts the agent in `mode` on `source` (already holding the workload, live Service set to
/// `live`) and measures its cold start.
pub fn start_measured(
    s: &mut Scenario,
    source: Source<'_>,
    mode: ProxyMode,
    w: Workload,
    live: LiveSet,
    timeout: Duration,
) -> Result<ColdStart> {
    ensure_untranslated(s)?;
    let probe = Probe::start(&in_cgroup(s), cluster_addr(), live.names(), timeout)?;
    let t0 = monotonic_ns();
    let started = Instant::now();
    let args = agent_args(mode, w);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = match source {
        Source::Manifests => s.start_agent_with_args(mode.as_arg(), &args)?,
        Source::Api(api) => {
            s.start_agent_with_kubeconfig_args(api.kubeconfig(), mode.as_arg(), &args)?
        }
    };
    let to_sync_log = loop {
        if agent.log_contents().contains("sync applied") {
            break started.elapsed();
        }
        if !agent.is_running() {
            return Err(agent.error("the agent exited during start-up"));
        }
        if started.elapsed() > timeout {
            return Err(agent.error(format!("no sync applied within {timeout:?}")));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let hit = probe.wait().map_err(|e| agent.error(e.to_string()))?;
    Ok(ColdStart {
        to_sync_log,
        to_first_connection: Duration::from_nanos(hit.start_ns.saturating_sub(t0)),
        phases: StartPhases::of_log(&agent.log_contents()),
    })
}

/// Time between one change's first answer from the new set and the next change.
pub const CHANGE_SPACING: Duration =
    Duration::from_millis(proxy_dataplane_ebpf::GENERATION_GRACE.as_millis() as u64 + 150);

/// `n` end-to-end changes of the live Service's EndpointSlice (file or API object), flipping
/// between the two backend sets; each sample is change made → first connection reaching the
/// new set. `live` is updated to the current set.
pub fn e2e_changes(
    s: &mut Scenario,
    source: Source<'_>,
    live: &mut LiveSet,
    n: usize,
    timeout: Duration,
) -> Result<Vec<Duration>> {
    Ok(e2e_changes_split(s, source, live, n, timeout)?
        .into_iter()
        .map(|c| c.total)
        .collect())
}

/// One end-to-end change, and where its time went when the agent's log shows the sync that
/// programmed it.
#[derive(Debug, Clone, Copy)]
pub struct ChangeSample {
    /// Change made → first connection reaching the new set.
    pub total: Duration,
    pub split: Option<ChangeSplit>,
}

/// A change's time in three consecutive parts, on the wall clock the agent's log lines carry
/// (the same system clock as the bench's): the first `sync applied` line that starts after the
/// write is the sync that programmed it (its start is the line's time minus its `elapsed_us`).
#[derive(Debug, Clone, Copy)]
pub struct ChangeSplit {
    /// Write → that sync starts: the source (API server, watch event, decoding), the agent's
    /// event loop and sync runner.
    pub to_sync: Duration,
    /// The sync itself (snapshot and map writes).
    pub sync: Duration,
    /// Sync logged → the probe's first connection to the new set starts.
    pub to_answer: Duration,
}

/// [`e2e_changes`] with each change's [`ChangeSplit`].
pub fn e2e_changes_split(
    s: &mut Scenario,
    source: Source<'_>,
    live: &mut LiveSet,
    n: usize,
    timeout: Duration,
) -> Result<Vec<ChangeSample>> {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let next = live.other();
        let probe = Probe::start(&in_cgroup(s), cluster_addr(), next.names(), timeout)?;
        let log_before = s.agent()?.log_contents().len();
        let t0 = monotonic_ns();
        let t0_wall = time_of_day();
        source.set_live(s, next)?;
        let hit = probe.wait().map_err(|e| s.agent_error(e.to_string()))?;
        *live = next;
        let total = Duration::from_nanos(hit.start_ns.saturating_sub(t0));
        // The next change of the same Service must not come within the eBPF map writer's
        // generation grace (1 s): the agent defers a frontend's second switch until its
        // previous generation is deleted, so a change 200 ms after the last measured that
        // deferral (about 800 ms), not one change. kube-proxy's iptables `minSyncPeriod` is
        // the same second. Plus a little for the agent to finish the sync (log line, stats).
        std::thread::sleep(CHANGE_SPACING);
        let split = t0_wall.and_then(|written| {
            let log = s.agent().ok()?.log_contents();
            let (at, elapsed) = first_sync_after(log.get(log_before..)?, written)?;
            Some(ChangeSplit {
                to_sync: at.checked_sub(elapsed)?.checked_sub(written)?,
                sync: elapsed,
                to_answer: (written + total).saturating_sub(at),
            })
        });
        samples.push(ChangeSample { total, split });
    }
    Ok(samples)
}

/// Now as the time of day (UTC), as [`log_time`] reads the agent's lines.
fn time_of_day() -> Option<Duration> {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?;
    Some(Duration::from_micros(
        (since_epoch.as_micros() % (86_400 * 1_000_000)) as u64,
    ))
}

/// The first `sync applied` line of `log` whose sync started at or after `written` (time of
/// day): its time and its `elapsed_us`.
fn first_sync_after(log: &str, written: Duration) -> Option<(Duration, Duration)> {
    log.lines()
        .filter(|line| line.contains("sync applied"))
        .filter_map(|line| Some((line.get(..27).and_then(log_time)?, elapsed_us(line)?)))
        .find(|&(at, elapsed)| {
            at.checked_sub(elapsed)
                .is_some_and(|start| start >= written)
        })
}

/// The agent's memory now (VmHWM is the peak since it started).
pub fn memory(s: &mut Scenario) -> Result<AgentMemory> {
    let pid = s
        .agent()?
        .pid()
        .ok_or_else(|| RigError::Other("agent not running".into()))?;
    let (vm_hwm_kib, vm_rss_kib) =
        rss_kib(pid).ok_or_else(|| RigError::Other(format!("cannot read /proc/{pid}/status")))?;
    let maps = bpf_maps(pid);
    // Only the eBPF mode has map metrics; the iptables mode holds no maps.
    let entries = if maps.is_empty() {
        Vec::new()
    } else {
        map_entries(&s.agent()?.metrics()?)
    };
    Ok(AgentMemory {
        vm_hwm_kib,
        vm_rss_kib,
        maps,
        entries,
    })
}

/// SIGSTOPs the agent while the datapath is measured (its datapath works without it: the
/// programs and maps, or the rules, stay in the kernel), so that its periodic manifest rescans
/// do not compete for the two cores; Drop sends SIGCONT.
#[derive(Debug)]
pub struct Paused {
    pid: Pid,
}

impl Paused {
    pub fn new(s: &mut Scenario) -> Result<Self> {
        let pid = s
            .agent()?
            .pid()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| RigError::Other("agent not running".into()))?;
        let pid = Pid::from_raw(pid);
        kill(pid, Signal::SIGSTOP).map_err(|e| RigError::Nix {
            context: "SIGSTOP to the agent".into(),
            source: e,
        })?;
        Ok(Self { pid })
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if let Err(e) = kill(self.pid, Signal::SIGCONT) {
            eprintln!("bench: SIGCONT to the agent: {e}");
        }
    }
}

/// Waits until the ClusterIP answers from a pod of `live` (after a start or change).
pub fn wait_for_live(s: &mut Scenario, live: LiveSet) -> Result<Attempt> {
    s.wait_for_datapath(cluster_addr(), "answered by the live set", |a| {
        a.backend().is_some_and(|b| live.names().contains(&b))
    })
}

/// The direct target: pod1's echo server.
pub fn pod1_addr() -> SocketAddr {
    SocketAddr::new(
        crate::topology::Topology::pod_ip(1).into(),
        crate::scenario::BACKEND_PORT,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_map_entries_and_matches_cut_names() {
        let exposition = "# HELP kubeproxy_ebpf_map_entries x\n\
                          kubeproxy_ebpf_map_entries{map=\"KPR_FRONTENDS4\"} 12\n\
                          kubeproxy_ebpf_map_entries{map=\"KPR_BACKEND_SLOTS\"} 30\n\
                          kubeproxy_ebpf_map_capacity{map=\"KPR_FRONTENDS4\"} 99\n";
        assert_eq!(
            map_entries(exposition),
            vec![
                ("KPR_FRONTENDS4".to_owned(), 12),
                ("KPR_BACKEND_SLOTS".to_owned(), 30)
            ]
        );
        assert!(same_map_name("KPR_BACKEND_SLO", "KPR_BACKEND_SLOTS"));
        assert!(!same_map_name("KPR_BACKENDS", "KPR_BACKENDS4"));
        assert!(!same_map_name("", "KPR_BACKENDS4"));
    }

    #[test]
    fn a_change_is_matched_to_the_first_sync_that_started_after_it() {
        let log = "\
2026-11-29T09:00:00.100000Z  INFO proxy_agent::run::report: sync applied reason=Changes elapsed_us=200000\n\
2026-11-29T09:00:00.400000Z  INFO proxy_agent::run::report: sync applied reason=Changes elapsed_us=1500\n\
2026-11-29T09:00:00.900000Z  INFO proxy_agent::run::report: sync applied reason=Changes elapsed_us=10\n";
        let at = |s: &str| log_time(s).unwrap_or_default();
        // The first line's sync started before the write (09:00:00.000 - 0.1 s).
        assert_eq!(
            first_sync_after(log, at("2026-11-29T09:00:00.000000Z")),
            Some((
                at("2026-11-29T09:00:00.400000Z"),
                Duration::from_micros(1500)
            ))
        );
        assert_eq!(
            first_sync_after(log, at("2026-11-29T09:00:00.399000Z")),
            Some((at("2026-11-29T09:00:00.900000Z"), Duration::from_micros(10)))
        );
        assert_eq!(
            first_sync_after(log, at("2026-11-29T09:00:01.000000Z")),
            None
        );
    }

    #[test]
    fn start_phases_are_read_from_the_log_of_the_last_start() {
        let log = "\
2026-11-29T09:00:00.000000Z  INFO proxy_agent::run: starting proxy-agent node=n mode=Ebpf\n\
2026-11-29T09:00:09.000000Z  INFO proxy_agent::run::report: sync applied elapsed_us=1\n\
2026-11-29T09:34:53.500000Z  INFO proxy_agent::run: starting proxy-agent node=n mode=Ebpf\n\
2026-11-29T09:34:54.000000Z  INFO proxy_agent::source::kubernetes: listed kind=Node objects=1\n\
2026-11-29T09:34:55.250000Z  INFO proxy_dataplane_ebpf::dataplane: eBPF socket and tc programs loaded, maps pinned\n\
2026-11-29T09:34:56.000000Z  INFO proxy_agent::source::kubernetes: listed kind=Service objects=9\n\
2026-11-29T09:34:57.500000Z  INFO proxy_agent::source::kubernetes: listed kind=EndpointSlice objects=9\n\
2026-11-29T09:34:59.000000Z  INFO proxy_agent::source::kubernetes: listed kind=Service objects=9\n\
2026-11-29T09:34:59.100000Z  INFO proxy_agent::run::report: sync applied reason=Changes written=2 snapshot_us=450000 elapsed_us=1234567\n\
2026-11-29T09:35:00.100000Z  INFO proxy_agent::run::report: sync applied reason=Changes written=2 elapsed_us=7\n";
        let phases = StartPhases::of_log(log);
        assert_eq!(phases.dataplane_ready, Some(Duration::from_millis(1750)));
        // The last kind's first list (a relist later does not count).
        assert_eq!(phases.source_read, Some(Duration::from_secs(4)));
        assert_eq!(phases.first_sync, Some(Duration::from_micros(1_234_567)));
        assert_eq!(phases.first_snapshot, Some(Duration::from_millis(450)));

        let manifests = "\
2026-11-29T23:59:59.000000Z  INFO proxy_agent::run: starting proxy-agent node=n\n\
2026-11-29T23:59:59.400000Z  INFO proxy_agent::source::manifests: manifests read files_parsed=3 elapsed_ms=399\n";
        let phases = StartPhases::of_log(manifests);
        assert_eq!(phases.source_read, Some(Duration::from_millis(400)));
        assert_eq!(phases.dataplane_ready, None);
        assert_eq!(phases.first_sync, None);
    }
}
