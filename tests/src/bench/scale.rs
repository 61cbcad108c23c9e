//! The scale goals through the real agent in eBPF mode: BPF map memory on a small node;
//! and at the largest size (50k Services × 2 endpoints), besides the agent runs of §5/§6 that
//! `programming_size` makes there, EndpointSlice changes through the API server source (enough
//! for a p99) and the longest gap a probe connecting every millisecond sees through an agent
//! restart over its pinned maps and through periodic full resyncs.

use std::time::{Duration, Instant};

use super::agent_runs::{self, AgentMemory, ChangeSample, ProxyMode, Source, StartPhases};
use super::client::{GapProbe, Gaps};
use super::workload::{LiveSet, Workload};
use super::{Outcome, ProgrammingSize, Runner, step};
use crate::Result;
use crate::apiserver::ApiServer;
use crate::scenario::{Scenario, cluster_addr};

/// The probe's pace: one new connection per millisecond.
const GAP_INTERVAL: Duration = Duration::from_millis(1);

/// The sync period the agent is restarted with for the resync measurement: every period the
/// eBPF mode reconciles every map entry (`SyncReason::Periodic`), the agent's full resync;
/// nothing triggers one from outside, so a short period makes several happen while the probe
/// runs.
pub(super) const RESYNC_PERIOD: &str = "2s";

/// Periodic full resyncs the resync probe waits through.
pub(super) const RESYNCS: usize = 3;

/// Everything the scale section measured.
#[derive(Debug, Clone)]
pub struct ScaleResult {
    /// Map memory on a node with few Services.
    pub small: Outcome<SmallNode>,
    /// The agent runs at the scale size (both sources, both modes), as §5/§6 report them.
    pub size: ProgrammingSize,
    /// EndpointSlice changes through the API server source at the scale size.
    pub changes: Outcome<Vec<ChangeSample>>,
    /// The probe through an agent restart (SIGINT, start again on the same pins).
    pub restart: Outcome<GapRun>,
    /// The probe through periodic full resyncs.
    pub resync: Outcome<GapRun>,
}

/// The eBPF agent on a node with `workload` (manifests source).
#[derive(Debug, Clone)]
pub struct SmallNode {
    pub workload: Workload,
    pub memory: AgentMemory,
    /// The node's `MemTotal` (what the agent sized its LRU maps from), in bytes.
    pub mem_total: Option<u64>,
}

/// One gap-probe run.
#[derive(Debug, Clone, Copy)]
pub struct GapRun {
    pub gaps: Gaps,
    /// How long the probe ran.
    pub duration: Duration,
    /// Syncs the agent applied while the probe ran (restart: the new process's first;
    /// resync: the periodic ones).
    pub syncs: usize,
    /// Restart: from starting the new process (the old one stopped) to its first `sync
    /// applied` line, seen by polling the log every 5 ms — restart to ready, apart from a
    /// fresh node's cold start (§5).
    pub to_ready: Option<Duration>,
    /// Restart: where the time to ready went, from the new process's log.
    pub phases: Option<StartPhases>,
}

/// The eBPF agent's BPF map memory on a node with `w` (manifests source: the maps do not
/// depend on where the objects come from).
pub(super) fn small_node(runner: &mut Runner, w: Workload) -> Outcome<SmallNode> {
    step(
        &format!(
            "scale: BPF map memory with {} Services (eBPF agent)",
            w.services
        ),
        runner,
    );
    let run = (|| -> Result<SmallNode> {
        let mut s = agent_runs::bench_node(runner.config.iptables_backend)?;
        w.write_manifests(&s.manifests, LiveSet::A)?;
        agent_runs::start_measured(
            &mut s,
            Source::Manifests,
            ProxyMode::Ebpf,
            w,
            LiveSet::A,
            super::agent_timeout(ProxyMode::Ebpf, None),
        )?;
        let memory = agent_runs::memory(&mut s)?;
        s.stop_agent()?;
        Ok(SmallNode {
            workload: w,
            memory,
            mem_total: proxy_dataplane_ebpf::maps::map_sizes::mem_total(),
        })
    })();
    match run {
        Ok(small) => Outcome::Done(small),
        Err(e) => runner.failed("BPF map memory on a small node", e),
    }
}

/// What runs at the scale size after the API-source runs of `programming_size`, with the API
/// server still holding the workload: a fresh eBPF agent on it, `changes` slice changes, then
/// the restart and resync probes.
pub(super) fn api_extras(
    runner: &mut Runner,
    s: &mut Scenario,
    api: &ApiServer,
    w: Workload,
    live: &mut LiveSet,
) -> (Outcome<Vec<ChangeSample>>, Outcome<GapRun>, Outcome<GapRun>) {
    let not_run = || Outcome::Failed("not run: the eBPF agent did not start".into());
    step("  scale: eBPF agent on the API server source", runner);
    let timeout = super::agent_timeout(ProxyMode::Ebpf, None);
    let started =
        agent_runs::start_measured(s, Source::Api(api), ProxyMode::Ebpf, w, *live, timeout);
    if let Err(e) = started {
        let failed = runner.failed("scale: starting the eBPF agent", e);
        return (failed, not_run(), not_run());
    }
    let n = runner.config.scale_changes;
    step(
        &format!("  scale: {n} EndpointSlice changes through the API server"),
        runner,
    );
    let changes = match agent_runs::e2e_changes_split(s, Source::Api(api), live, n, timeout) {
        Ok(samples) => Outcome::Done(samples),
        Err(e) => runner.failed("scale: EndpointSlice changes", e),
    };
    step("  scale: probe every 1 ms through an agent restart", runner);
    let restart = match restart_gaps(s, w, *live, timeout) {
        Ok(run) => Outcome::Done(run),
        Err(e) => runner.failed("scale: probe through a restart", e),
    };
    step(
        &format!("  scale: probe every 1 ms through {RESYNCS} periodic full resyncs"),
        runner,
    );
    let resync = if restart.done().is_some() {
        match resync_gaps(s, *live, timeout) {
            Ok(run) => Outcome::Done(run),
            Err(e) => runner.failed("scale: probe through full resyncs", e),
        }
    } else {
        Outcome::Failed("not run: the restart before it failed".into())
    };
    if let Err(e) = s.stop_agent() {
        runner.failed::<()>("scale: stopping the agent", e);
    }
    (changes, restart, resync)
}

fn start_probe(s: &Scenario, live: LiveSet, timeout: Duration) -> Result<GapProbe> {
    GapProbe::start(
        &agent_runs::in_cgroup(s),
        cluster_addr(),
        live.names(),
        GAP_INTERVAL,
        timeout + Duration::from_secs(60),
    )
}

/// How many times `needle` is in the agent's log so far.
fn log_count(s: &mut Scenario, needle: &str) -> Result<usize> {
    Ok(s.agent()?.log_contents().matches(needle).count())
}

/// Waits until `needle` is in the agent's log at least `count` times; returns how many.
fn wait_log_count(
    s: &mut Scenario,
    needle: &str,
    count: usize,
    timeout: Duration,
) -> Result<usize> {
    wait_log_count_every(s, needle, count, timeout, Duration::from_millis(20))
}

/// [`wait_log_count`], looking every `poll`.
fn wait_log_count_every(
    s: &mut Scenario,
    needle: &str,
    count: usize,
    timeout: Duration,
    poll: Duration,
) -> Result<usize> {
    let started = Instant::now();
    loop {
        let agent = s.agent()?;
        let seen = agent.log_contents().matches(needle).count();
        if seen >= count {
            return Ok(seen);
        }
        if !agent.is_running() {
            return Err(agent.error("the agent exited"));
        }
        if started.elapsed() > timeout {
            return Err(agent.error(format!(
                "{seen} of {count} `{needle}` log lines after {timeout:?}"
            )));
        }
        std::thread::sleep(poll);
    }
}

/// The probe runs while the agent is stopped (SIGINT: it leaves programs and maps pinned) and
/// started again on the same pins, with `--iptables-sync-period` short for the resync run that
/// follows; it ends a second after the new process's first `sync applied`.
fn restart_gaps(s: &mut Scenario, w: Workload, live: LiveSet, timeout: Duration) -> Result<GapRun> {
    let probe = start_probe(s, live, timeout)?;
    let started = Instant::now();
    // A second of steady state first, so a gap at the stop is not confused with the start.
    std::thread::sleep(Duration::from_secs(1));
    let before = log_count(s, "sync applied")?;
    let mut args = agent_runs::agent_args(ProxyMode::Ebpf, w);
    args.extend([
        "--iptables-sync-period".to_owned(),
        RESYNC_PERIOD.to_owned(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = s.agent()?;
    agent.stop()?;
    let restarted = Instant::now();
    agent.restart_with_args(&args)?;
    wait_log_count_every(
        s,
        "sync applied",
        before + 1,
        timeout,
        Duration::from_millis(5),
    )?;
    let to_ready = restarted.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    let gaps = probe.finish()?;
    let phases = StartPhases::of_log(&s.agent()?.log_contents());
    Ok(GapRun {
        gaps,
        duration: started.elapsed(),
        syncs: 1,
        to_ready: Some(to_ready),
        phases: Some(phases),
    })
}

/// The probe runs through [`RESYNCS`] periodic full resyncs of the agent restarted by
/// [`restart_gaps`].
fn resync_gaps(s: &mut Scenario, live: LiveSet, timeout: Duration) -> Result<GapRun> {
    const PERIODIC: &str = "reason=Periodic";
    let probe = start_probe(s, live, timeout)?;
    let started = Instant::now();
    let before = log_count(s, PERIODIC)?;
    let seen = wait_log_count(s, PERIODIC, before + RESYNCS, timeout)?;
    // The last resync's writes are done when its line is logged; a little more for the probe
    // to see what follows it.
    std::thread::sleep(Duration::from_millis(500));
    let gaps = probe.finish()?;
    Ok(GapRun {
        gaps,
        duration: started.elapsed(),
        syncs: seen - before,
        to_ready: None,
        phases: None,
    })
}
