//! `cargo xtask bench`: each benchmark runs with its baselines side by side in one run, and the
//! results become `docs/benchmarks.md` (tables) and SVG plots.
//!
//! - `datapath`: items 1 and 2 (new connections, request/response) for direct, eBPF and
//!   iptables paths through the real agent on the rig's node.
//! - `agent_runs`: cold start, end-to-end programming and memory through the real agent.
//! - `inprocess`: programming latency with the agent's library (item 5, in-process).
//! - `tc`: item 4, per-packet cost of the tc programs (`BPF_PROG_TEST_RUN`).
//! - `snat`: the new connections per second per backend through one node before the
//!   first SNAT failure, eBPF beside iptables.
//! - `syn_flood`: the spoofed SYN flood against a NodePort, eBPF beside iptables.
//! - `scale`: the scale goals (map memory on a small node; at 50k Services × 2
//!   endpoints, API-source changes for a p99 and a 1 ms probe through a restart and resyncs).
//! - `report`, `plot`: the Markdown and the SVGs.
//!
//! Everything runs inside namespaces and cgroups the rig creates; every loop is bounded in count
//! and time; every resource has a Drop guard.

pub mod agent_runs;
pub mod client;
pub mod datapath;
pub mod inprocess;
pub mod memory;
pub mod plot;
pub mod pps;
pub mod report;
pub mod scale;
pub mod snat;
pub mod stats;
pub mod syn_flood;
pub mod sysinfo;
pub mod tc;
pub mod workload;

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use agent_runs::IptablesBackend;
use agent_runs::{AgentMemory, ColdStart, ProxyMode, Source};
use datapath::{Loops, Path, PathRuns};
use workload::{LiveSet, Workload};

use crate::Result;
use crate::apiserver::ApiServer;
use crate::scenario::Scenario;

/// What to run and how long each loop may take.
#[derive(Debug, Clone)]
pub struct Config {
    pub quick: bool,
    /// Where `benchmarks.md` and the SVGs go.
    pub out_dir: PathBuf,
    /// Services for items 1 and 2 (2 endpoints per decoy).
    pub datapath_sizes: Vec<usize>,
    pub datapath_endpoints: usize,
    /// Services for items 5 and 6 (10 endpoints per decoy).
    pub programming_sizes: Vec<usize>,
    pub programming_endpoints: usize,
    pub loops: Loops,
    /// The scale size: agent runs as for `programming_sizes`, plus `scale_changes`
    /// API-source changes and the gap probes (section `scale`).
    pub scale_workload: Workload,
    pub scale_changes: usize,
    /// Agent starts per source and mode at the scale size (a 50k start takes tens of seconds).
    pub scale_cold_starts: usize,
    /// The small node of the map-memory goal (Services, `programming_endpoints` each).
    pub small_node_services: usize,
    /// Agent starts per size and mode for the cold-start figures (eBPF; iptables see below).
    pub cold_starts: usize,
    /// End-to-end manifest changes per size and mode.
    pub e2e_changes: usize,
    /// In-process runs per size and the changes in each.
    pub inprocess_repeats: usize,
    pub inprocess_ebpf_changes: usize,
    pub inprocess_iptables_changes: usize,
    /// An iptables run whose full sync is estimated to take longer than this is skipped and
    /// reported with the estimate.
    pub iptables_cap: Duration,
    /// The whole run should end within this; iptables runs that would not fit are skipped.
    pub budget: Duration,
    /// Item 4 (per-packet tc cost).
    pub tc_loops: tc::TcLoops,
    /// Packet rate through XDP, tc, iptables and routing.
    pub pps_loops: pps::PpsLoops,
    /// The SNAT section's stepped load.
    pub snat_loops: snat::SnatLoops,
    /// The SYN flood section's run.
    pub syn_flood_plan: crate::flood::SynFloodPlan,
    /// Backend of every iptables-mode run; with legacy, the in-process iptables figures are
    /// also taken with nft at the smallest programming size, for comparison.
    pub iptables_backend: IptablesBackend,
    /// CPU that every benchmark client and echo server is pinned to (None: not pinned).
    pub pin_cpu: Option<usize>,
    /// Sections to run; empty: all (`--only`, for working on one benchmark).
    pub only: Vec<Section>,
    /// The command line, for the report.
    pub command: String,
}

/// A part of the benchmark that `--only` can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    /// Items 1 and 2 (and the cold starts that go with them).
    Datapath,
    /// Item 3: NodePort forwarding through tc vs iptables vs routing.
    Nodeport,
    /// Item 4: per-packet cost of the tc programs.
    TcCost,
    /// Items 5 and 6 through the agent.
    Programming,
    /// Item 5 in-process.
    Inprocess,
    /// New connections per second per backend before the first SNAT failure.
    Snat,
    /// Packets per second forwarded to a NodePort's backend on one core
    /// through XDP, tc, iptables and plain routing.
    Pps,
    /// Map memory on a small node; agent runs at 50k Services × 2 endpoints with
    /// API-source changes and gap probes through a restart and full resyncs.
    Scale,
    /// A spoofed SYN flood against a NodePort: the rate the node took, new
    /// connections served and idle connections kept, eBPF beside iptables.
    SynFlood,
}

impl Config {
    pub fn runs(&self, section: Section) -> bool {
        self.only.is_empty() || self.only.contains(&section)
    }
}

impl Config {
    pub fn full(out_dir: PathBuf) -> Self {
        Self {
            quick: false,
            out_dir,
            datapath_sizes: vec![1, 1_000, 10_000, 30_000],
            datapath_endpoints: 2,
            programming_sizes: vec![1_000, 10_000, 30_000],
            programming_endpoints: 10,
            scale_workload: Workload {
                services: 50_000,
                endpoints: 2,
            },
            scale_changes: 100,
            scale_cold_starts: 2,
            small_node_services: 10,
            // More, shorter runs interleave the paths more finely: on a shared 2-core machine
            // the load changes within seconds, and interleaving is what keeps ratios honest.
            loops: Loops {
                repeats: 5,
                connections: 1_500,
                external_connections: 500,
                round_trips: 3_000,
                max: Duration::from_secs(10),
            },
            cold_starts: 3,
            e2e_changes: 6,
            inprocess_repeats: 3,
            inprocess_ebpf_changes: 1_000,
            inprocess_iptables_changes: 5,
            iptables_cap: Duration::from_secs(400),
            budget: Duration::from_secs(16 * 60),
            tc_loops: tc::TcLoops {
                runs: 5,
                samples: 2_000,
                repeat: 100_000,
            },
            pps_loops: pps::PpsLoops {
                runs: 3,
                frames: 1_000_000,
                round_trips: 3_000,
            },
            // Doubling from 250/s: 250, 500, …, 8000. 15 s per step: longer than the tc
            // conntrack's 10 s close timeout, so each step reaches its steady state of entries.
            snat_loops: snat::SnatLoops {
                first_rate: 250,
                max_steps: 6,
                step: Duration::from_secs(15),
                sources: 16,
                timeout: Duration::from_secs(1),
            },
            syn_flood_plan: crate::flood::SynFloodPlan {
                idle: 20,
                duration: Duration::from_secs(10),
                max_frames: 20_000_000,
                after: 200,
                client_interval: Duration::from_millis(10),
                client_timeout: Duration::from_millis(2500),
            },
            // The last CPU: one CPU for client, server and the softirq work between them (veth
            // delivers in the sender's context), away from CPU 0 where most device interrupts
            // land.
            // iptables-nft 1.8's `--noflush` restore (kube-proxy's flags) spends its time in
            // chain-name lookups that grow with chains × rules (92 s for 10k Services × 2
            // endpoints here); legacy restores the same input in under a second, which lets the
            // 30k Services run fit. nft is measured in-process at the smallest size.
            iptables_backend: IptablesBackend::Legacy,
            pin_cpu: std::thread::available_parallelism()
                .ok()
                .map(|n| n.get() - 1),
            only: Vec::new(),
            command: "cargo xtask bench".into(),
        }
    }

    /// A short smoke run of every code path.
    pub fn quick(out_dir: PathBuf) -> Self {
        Self {
            quick: true,
            datapath_sizes: vec![1, 1_000],
            programming_sizes: vec![1_000],
            scale_workload: Workload {
                services: 2_000,
                endpoints: 2,
            },
            scale_changes: 20,
            loops: Loops {
                repeats: 1,
                connections: 300,
                external_connections: 300,
                round_trips: 500,
                max: Duration::from_secs(3),
            },
            cold_starts: 1,
            e2e_changes: 2,
            inprocess_repeats: 1,
            inprocess_ebpf_changes: 100,
            inprocess_iptables_changes: 2,
            iptables_cap: Duration::from_secs(60),
            budget: Duration::from_secs(4 * 60),
            tc_loops: tc::TcLoops {
                runs: 2,
                samples: 200,
                repeat: 10_000,
            },
            pps_loops: pps::PpsLoops {
                runs: 1,
                frames: 100_000,
                round_trips: 500,
            },
            snat_loops: snat::SnatLoops {
                first_rate: 1_000,
                max_steps: 3,
                step: Duration::from_secs(3),
                sources: 16,
                timeout: Duration::from_secs(1),
            },
            syn_flood_plan: crate::flood::SynFloodPlan {
                duration: Duration::from_secs(3),
                after: 50,
                ..Self::full(out_dir.clone()).syn_flood_plan
            },
            command: "cargo xtask bench --quick".into(),
            ..Self::full(out_dir)
        }
    }
}

/// A run that happened, was skipped because it would not fit, or failed.
#[derive(Debug, Clone)]
pub enum Outcome<T> {
    Done(T),
    Skipped { estimate: Duration, reason: String },
    Failed(String),
}

impl<T> Outcome<T> {
    pub fn done(&self) -> Option<&T> {
        match self {
            Self::Done(t) => Some(t),
            _ => None,
        }
    }
}

/// Items 1 and 2 at one size.
#[derive(Debug, Clone)]
pub struct DatapathSize {
    pub workload: Workload,
    pub connect: PathRuns,
    pub rr: PathRuns,
    pub ebpf_start: Outcome<ColdStart>,
    pub iptables_start: Outcome<ColdStart>,
}

/// One mode through the agent at one size (items 5 end-to-end, and 6).
#[derive(Debug, Clone)]
pub struct AgentModeRun {
    pub cold_starts: Vec<ColdStart>,
    pub e2e: Vec<Duration>,
    pub memory: AgentMemory,
}

#[derive(Debug, Clone)]
pub struct ProgrammingSize {
    pub workload: Workload,
    /// Bytes of YAML in the manifests folder.
    pub manifests_bytes: u64,
    /// The first `proxy_decode::manifests::FolderReader::read` of the folder, in-process: what the
    /// agent's source does on start (read + parse every file).
    pub manifests_load: Option<Duration>,
    /// What the library's structures keep alive at this size (in-process, trimmed RSS).
    pub memory: memory::MemoryBreakdown,
    /// Through the agent, manifests source.
    pub ebpf: Outcome<AgentModeRun>,
    pub iptables: Outcome<AgentModeRun>,
    /// Through the agent, Kubernetes API source (the API test server).
    pub api_ebpf: Outcome<AgentModeRun>,
    pub api_iptables: Outcome<AgentModeRun>,
}

#[derive(Debug, Clone)]
pub struct InprocessSize {
    pub workload: Workload,
    pub ebpf: Outcome<Vec<inprocess::EbpfResult>>,
    pub iptables: Outcome<Vec<inprocess::IptablesResult>>,
    /// The nft backend for comparison (smallest size, when the runs above use legacy).
    pub iptables_nft: Option<Outcome<Vec<inprocess::IptablesResult>>>,
}

/// Everything one run measured.
#[derive(Debug, Clone)]
pub struct Results {
    pub config: Config,
    pub machine: sysinfo::Machine,
    pub started_utc: String,
    pub commit: String,
    pub elapsed: Duration,
    pub datapath: Vec<DatapathSize>,
    pub programming: Vec<ProgrammingSize>,
    pub inprocess: Vec<InprocessSize>,
    /// Item 4; None when not selected.
    pub tc_cost: Option<Outcome<tc::PacketCostResult>>,
    /// The packet rate section; None when not selected.
    pub pps: Option<Outcome<pps::PpsResult>>,
    /// The SNAT benchmark; None when not selected.
    pub snat: Option<snat::SnatResult>,
    /// The SYN flood; None when not selected.
    pub syn_flood: Option<syn_flood::SynFloodResult>,
    /// The scale section; None when not selected.
    pub scale: Option<scale::ScaleResult>,
    /// iptables full-sync times seen (objects = Services + endpoints, seconds), for estimates.
    pub iptables_syncs: Vec<(usize, f64)>,
    /// What failed and the first line of its error, in the order it happened: the report
    /// lists them all, since some (stopping an agent, cleaning up) have no table cell.
    pub failures: Vec<String>,
}

/// Predicts iptables full-sync times from the ones measured so far.
#[derive(Debug, Default)]
struct Estimator {
    points: Vec<(usize, f64)>,
}

impl Estimator {
    /// Below this many objects a sync is dominated by fixed costs (process start, probing the
    /// host), which would make any extrapolation from it meaningless.
    const MIN_OBJECTS: usize = 1_000;

    fn record(&mut self, w: Workload, seconds: f64) {
        if objects(w) >= Self::MIN_OBJECTS {
            self.points.push((objects(w), seconds));
        }
    }

    /// A power law through the two largest measured sizes (exponent clamped to 1..2); linear
    /// from one point; None without points.
    fn estimate(&self, w: Workload) -> Option<Duration> {
        let mut points = self.points.clone();
        points.sort_by_key(|p| p.0);
        points.dedup_by_key(|p| p.0);
        let &(x1, t1) = points.last()?;
        let exponent = match points.len() {
            0 | 1 => 1.0,
            n => {
                let (x0, t0) = points.get(n - 2).copied().unwrap_or((x1, t1));
                ((t1 / t0).ln() / (x1 as f64 / x0 as f64).ln()).clamp(1.0, 2.0)
            }
        };
        let t = t1 * (objects(w) as f64 / x1 as f64).powf(exponent);
        Some(Duration::from_secs_f64(t.max(0.0)))
    }
}

fn objects(w: Workload) -> usize {
    w.services + w.total_endpoints()
}

struct Runner {
    config: Config,
    started: Instant,
    estimator: Estimator,
    failures: Vec<String>,
    /// Skip iptables runs that cannot be estimated (the scale size when no smaller iptables
    /// sync was measured in this run, e.g. `--only scale`): unbounded otherwise.
    require_estimate: bool,
}

impl Runner {
    fn remaining(&self) -> Duration {
        self.config.budget.saturating_sub(self.started.elapsed())
    }

    /// Whether an iptables run at `w` fits; `multiplier`: full syncs the run needs.
    fn iptables_fits(&self, w: Workload, multiplier: f64) -> std::result::Result<(), Outcome<()>> {
        let Some(estimate) = self.estimator.estimate(w) else {
            if self.require_estimate {
                return Err(Outcome::Skipped {
                    estimate: Duration::ZERO,
                    reason: "no iptables full sync of 1k objects or more was measured in this \
                             run to estimate this one from"
                        .into(),
                });
            }
            return Ok(());
        };
        let cost = estimate.mul_f64(multiplier);
        if estimate > self.config.iptables_cap {
            return Err(Outcome::Skipped {
                estimate,
                reason: format!(
                    "estimated full sync {:.0} s exceeds the {} s cap per iptables run",
                    estimate.as_secs_f64(),
                    self.config.iptables_cap.as_secs()
                ),
            });
        }
        if cost > self.remaining() {
            return Err(Outcome::Skipped {
                estimate,
                reason: format!(
                    "estimated {:.0} s does not fit the {:.0} s left of the {} min budget",
                    cost.as_secs_f64(),
                    self.remaining().as_secs_f64(),
                    self.config.budget.as_secs() / 60
                ),
            });
        }
        Ok(())
    }

    fn failed<T>(&mut self, what: &str, error: impl std::fmt::Display) -> Outcome<T> {
        let message = format!("{error}");
        println!("  FAILED {what}: {message}");
        let first = message.lines().next().unwrap_or_default().to_owned();
        self.failures.push(format!("{what}: {first}"));
        Outcome::Failed(first)
    }

    fn note_skip<T>(skipped: Outcome<()>, what: &str) -> Outcome<T> {
        match skipped {
            Outcome::Skipped { estimate, reason } => {
                println!("  skipped {what}: {reason}");
                Outcome::Skipped { estimate, reason }
            }
            Outcome::Failed(e) => Outcome::Failed(e),
            Outcome::Done(()) => Outcome::Failed("internal: not skipped".into()),
        }
    }
}

fn step(what: &str, runner: &Runner) {
    println!(
        "[{:>4.0} s, load {}] {what}",
        runner.started.elapsed().as_secs_f64(),
        sysinfo::load_now()
    );
}

/// Runs every benchmark and returns the results (the report is written by the caller).
pub fn run(config: Config) -> Results {
    let machine = sysinfo::Machine::detect();
    let started_utc = command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let commit = command_output("git", &["rev-parse", "--short", "HEAD"]);
    client::set_client_cpu(config.pin_cpu);
    let mut runner = Runner {
        config,
        started: Instant::now(),
        estimator: Estimator::default(),
        failures: Vec::new(),
        require_estimate: false,
    };
    let tc_cost = runner.config.runs(Section::TcCost).then(|| {
        step("per-packet cost of the tc programs", &runner);
        match tc::per_packet_cost(runner.config.tc_loops) {
            Ok(r) => Outcome::Done(r),
            Err(e) => runner.failed("tc per-packet cost", e),
        }
    });
    let pps = runner.config.runs(Section::Pps).then(|| {
        step(
            "packet rate through XDP, tc, the eBPF default path, iptables and routing (with and \
             without the eBPF programs; and a CNI bridge)",
            &runner,
        );
        let cpu = runner.config.pin_cpu.unwrap_or(0);
        match pps::packet_rate(runner.config.pps_loops, cpu) {
            Ok(r) => Outcome::Done(r),
            Err(e) => runner.failed("packet rate", e),
        }
    });
    let mut datapath = Vec::new();
    let datapath_sizes =
        if runner.config.runs(Section::Datapath) || runner.config.runs(Section::Nodeport) {
            runner.config.datapath_sizes.clone()
        } else {
            Vec::new()
        };
    for &services in &datapath_sizes {
        let w = Workload {
            services,
            endpoints: runner.config.datapath_endpoints,
        };
        step(&format!("datapath: {services} Services"), &runner);
        datapath.push(datapath_size(&mut runner, w));
    }
    let snat = runner
        .config
        .runs(Section::Snat)
        .then(|| snat_section(&mut runner));
    let syn_flood = runner.config.runs(Section::SynFlood).then(|| {
        step("spoofed SYN flood against a NodePort", &runner);
        let (plan, backend) = (runner.config.syn_flood_plan, runner.config.iptables_backend);
        syn_flood::section(plan, backend, |what, e| runner.failed(what, e))
    });
    let mut programming = Vec::new();
    let programming_sizes = |section| {
        if runner.config.runs(section) {
            runner.config.programming_sizes.clone()
        } else {
            Vec::new()
        }
    };
    let (agent_sizes, inprocess_sizes) = (
        programming_sizes(Section::Programming),
        programming_sizes(Section::Inprocess),
    );
    for &services in &agent_sizes {
        let w = Workload {
            services,
            endpoints: runner.config.programming_endpoints,
        };
        step(
            &format!("programming through the agent: {services} Services"),
            &runner,
        );
        programming.push(programming_size(&mut runner, w, |_, _, _, _, _| {}));
    }
    let mut inprocess = Vec::new();
    for &services in &inprocess_sizes {
        let w = Workload {
            services,
            endpoints: runner.config.programming_endpoints,
        };
        step(
            &format!("programming in-process: {services} Services"),
            &runner,
        );
        inprocess.push(inprocess_size(&mut runner, w));
    }
    // Last: its iptables runs are skipped once the budget is spent, and coming after
    // everything else it never takes budget from the runs the report had before it.
    let scale = runner.config.runs(Section::Scale).then(|| {
        let small = Workload {
            services: runner.config.small_node_services,
            endpoints: runner.config.programming_endpoints,
        };
        let small = scale::small_node(&mut runner, small);
        let w = runner.config.scale_workload;
        step(
            &format!(
                "scale: {} Services × {} endpoints through the agent",
                w.services, w.endpoints
            ),
            &runner,
        );
        runner.require_estimate = true;
        let cold_starts = runner.config.cold_starts;
        runner.config.cold_starts = runner.config.scale_cold_starts.min(cold_starts);
        let mut extras = None;
        let size = programming_size(&mut runner, w, |runner, s, api, w, live| {
            extras = Some(scale::api_extras(runner, s, api, w, live));
        });
        runner.require_estimate = false;
        runner.config.cold_starts = cold_starts;
        let (changes, restart, resync) = extras.unwrap_or_else(|| {
            let why = "not run: the API server did not start";
            (
                Outcome::Failed(why.into()),
                Outcome::Failed(why.into()),
                Outcome::Failed(why.into()),
            )
        });
        scale::ScaleResult {
            small,
            size,
            changes,
            restart,
            resync,
        }
    });
    let elapsed = runner.started.elapsed();
    println!("benchmarks done in {:.0} s", elapsed.as_secs_f64());
    Results {
        machine,
        started_utc,
        commit,
        elapsed,
        datapath,
        programming,
        inprocess,
        tc_cost,
        pps,
        snat,
        syn_flood,
        scale,
        iptables_syncs: runner.estimator.points.clone(),
        failures: runner.failures,
        config: runner.config,
    }
}

fn command_output(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// Timeout for an agent start or a change to show up, generous for iptables at scale.
fn agent_timeout(mode: ProxyMode, estimate: Option<Duration>) -> Duration {
    match mode {
        ProxyMode::Ebpf => Duration::from_secs(120),
        ProxyMode::Iptables => estimate
            .map_or(Duration::from_secs(300), |e| e.mul_f64(3.0))
            .max(Duration::from_secs(120)),
    }
}

fn datapath_size(runner: &mut Runner, w: Workload) -> DatapathSize {
    let mut result = DatapathSize {
        workload: w,
        connect: PathRuns::default(),
        rr: PathRuns::default(),
        ebpf_start: Outcome::Failed("not run".into()),
        iptables_start: Outcome::Failed("not run".into()),
    };
    let setup = agent_runs::bench_node(runner.config.iptables_backend).and_then(|s| {
        w.write_manifests(&s.manifests, LiveSet::A)?;
        Ok(s)
    });
    let mut s = match setup {
        Ok(s) => s,
        Err(e) => {
            result.ebpf_start = runner.failed("building the node", e);
            return result;
        }
    };
    let loops = runner.config.loops;
    let nodeport = runner.config.runs(Section::Nodeport);
    // Item 3's floor: plain routing through the node before any agent touched it.
    if nodeport {
        step("  routed from outside, no agent", runner);
        if let Err(e) = datapath::measure(
            &s,
            &[Path::ExtRouted],
            loops,
            &mut result.connect,
            &mut result.rr,
        ) {
            runner.failed::<()>("routed from outside", e);
        }
    }
    let with_nodeport = |paths: &[Path], extra: &[Path]| -> Vec<Path> {
        let mut all = paths.to_vec();
        if nodeport {
            all.extend_from_slice(extra);
        }
        all
    };
    let ebpf_paths = with_nodeport(
        &[Path::Direct, Path::DirectInCgroup, Path::Ebpf],
        &[
            Path::ExtRoutedUnderTc,
            Path::NodePortEbpf,
            Path::NodePortEbpfFastPath,
        ],
    );
    let iptables_paths = with_nodeport(
        &[Path::DirectUnderIptables, Path::Iptables],
        &[Path::ExtRoutedUnderIptables, Path::NodePortIptables],
    );
    // eBPF first: its start removes nothing, and the iptables agent that follows removes the
    // eBPF pins (mode switch) while the eBPF agent's own stop already detached them.
    step("  eBPF agent", runner);
    let ebpf = (|| -> Result<ColdStart> {
        let cold = agent_runs::start_measured(
            &mut s,
            Source::Manifests,
            ProxyMode::Ebpf,
            w,
            LiveSet::A,
            agent_timeout(ProxyMode::Ebpf, None),
        )?;
        let _paused = agent_runs::Paused::new(&mut s)?;
        datapath::measure(&s, &ebpf_paths, loops, &mut result.connect, &mut result.rr)?;
        Ok(cold)
    })();
    result.ebpf_start = match ebpf {
        Ok(cold) => Outcome::Done(cold),
        Err(e) => runner.failed("eBPF datapath", e),
    };
    if let Err(e) = s.stop_agent() {
        runner.failed::<()>("stopping the eBPF agent", e);
    }

    if let Err(skip) = runner.iptables_fits(w, 1.2) {
        result.iptables_start = Runner::note_skip(skip, "iptables datapath");
        return result;
    }
    step("  iptables agent", runner);
    let estimate = runner.estimator.estimate(w);
    let iptables = (|| -> Result<ColdStart> {
        let cold = agent_runs::start_measured(
            &mut s,
            Source::Manifests,
            ProxyMode::Iptables,
            w,
            LiveSet::A,
            agent_timeout(ProxyMode::Iptables, estimate),
        )?;
        let _paused = agent_runs::Paused::new(&mut s)?;
        datapath::measure(
            &s,
            &iptables_paths,
            loops,
            &mut result.connect,
            &mut result.rr,
        )?;
        Ok(cold)
    })();
    result.iptables_start = match iptables {
        Ok(cold) => {
            runner.estimator.record(w, cold.to_sync_log.as_secs_f64());
            Outcome::Done(cold)
        }
        Err(e) => runner.failed("iptables datapath", e),
    };
    if let Err(e) = s.stop_agent() {
        runner.failed::<()>("stopping the iptables agent", e);
    }
    result
}

/// The SNAT benchmark: each mode on a fresh node, eBPF first.
fn snat_section(runner: &mut Runner) -> snat::SnatResult {
    step("SNAT: new connections per second per backend", runner);
    let started = Instant::now();
    let loops = runner.config.snat_loops;
    let backend = runner.config.iptables_backend;
    let outcome = |mode: ProxyMode, runner: &mut Runner| {
        step(&format!("  {} agent", mode.as_arg()), runner);
        let progress = |what: &str| step(what, runner);
        match snat::run_mode(mode, backend, loops, progress) {
            Ok(run) => Outcome::Done(run),
            Err(e) => runner.failed(&format!("SNAT benchmark, {} mode", mode.as_arg()), e),
        }
    };
    let ebpf = outcome(ProxyMode::Ebpf, runner);
    let iptables = outcome(ProxyMode::Iptables, runner);
    snat::SnatResult {
        loops,
        ebpf,
        iptables,
        elapsed: started.elapsed(),
    }
}

/// The agent runs at `w` on both sources; `api_extras` runs after the API-source runs, with
/// the API server still holding the workload (no agent running).
fn programming_size(
    runner: &mut Runner,
    w: Workload,
    api_extras: impl FnOnce(&mut Runner, &mut Scenario, &ApiServer, Workload, &mut LiveSet),
) -> ProgrammingSize {
    let mut result = ProgrammingSize {
        workload: w,
        manifests_bytes: 0,
        manifests_load: None,
        memory: memory::MemoryBreakdown::default(),
        ebpf: Outcome::Failed("not run".into()),
        iptables: Outcome::Failed("not run".into()),
        api_ebpf: Outcome::Failed("not run".into()),
        api_iptables: Outcome::Failed("not run".into()),
    };
    let setup = agent_runs::bench_node(runner.config.iptables_backend).and_then(|s| {
        w.write_manifests(&s.manifests, LiveSet::A)?;
        Ok(s)
    });
    let mut s = match setup {
        Ok(s) => s,
        Err(e) => {
            result.ebpf = runner.failed("building the node", e);
            return result;
        }
    };
    result.manifests_bytes = folder_bytes(s.manifests.path());
    result.memory = memory::breakdown(w, crate::scenario::HOSTNAME);
    // What the agent's source does on start: the first read of the folder (timed alone, not
    // with the memory breakdown before it).
    let t0 = Instant::now();
    let mut reader = proxy_decode::manifests::FolderReader::new(
        s.manifests.path().to_path_buf(),
        crate::scenario::HOSTNAME,
    );
    let read = reader.read(&Default::default());
    let elapsed = t0.elapsed();
    let services = read.updates.iter().find_map(|u| match u {
        proxy_model::objects::Update::ReplaceServices(all) => Some(all.len()),
        _ => None,
    });
    if read.errors.is_empty() && services == Some(w.services) {
        result.manifests_load = Some(elapsed);
    } else {
        runner.failed::<()>(
            "reading the manifests in-process",
            format!("{services:?} Services read, {} errors", read.errors.len()),
        );
    }
    drop(read);
    let mut live = LiveSet::A;
    (result.ebpf, result.iptables) =
        agent_mode_runs(runner, &mut s, Source::Manifests, w, &mut live);

    // The same through the Kubernetes API source: the API test server in the node namespace
    // holds the same objects; a change is one EndpointSlice update sent as a watch event.
    step("  API server source", runner);
    let api = ApiServer::start(Some(&s.topo.node().path())).and_then(|api| {
        let (services, slices) = w.api_objects(live);
        api.batch(|b| -> Result<()> {
            for service in services.values() {
                b.apply(service)?;
            }
            for slice in slices.values() {
                b.apply(slice)?;
            }
            Ok(())
        })?;
        Ok(api)
    });
    match api {
        Ok(api) => {
            (result.api_ebpf, result.api_iptables) =
                agent_mode_runs(runner, &mut s, Source::Api(&api), w, &mut live);
            api_extras(runner, &mut s, &api, w, &mut live);
        }
        Err(e) => {
            result.api_ebpf = runner.failed("starting the API test server", e);
        }
    }
    result
}

/// Cold starts, end-to-end changes and memory of the agent in each mode on `source`.
fn agent_mode_runs(
    runner: &mut Runner,
    s: &mut Scenario,
    source: Source<'_>,
    w: Workload,
    live: &mut LiveSet,
) -> (Outcome<AgentModeRun>, Outcome<AgentModeRun>) {
    let mut ebpf = Outcome::Failed("not run".into());
    let mut iptables = Outcome::Failed("not run".into());
    for mode in [ProxyMode::Ebpf, ProxyMode::Iptables] {
        let estimate = runner.estimator.estimate(w);
        // iptables: one cold start only when a sync is slow; every change is a sync as well.
        let starts = match mode {
            ProxyMode::Ebpf => runner.config.cold_starts,
            ProxyMode::Iptables if estimate.is_some_and(|e| e > Duration::from_secs(20)) => 1,
            ProxyMode::Iptables => runner.config.cold_starts,
        };
        let what = format!("iptables through the agent ({} source)", source.name());
        // Every change is a sync too; on the legacy backend a partial sync still reads and
        // replaces whole tables, so count it as half a full one.
        let syncs = starts as f64 + 0.5 * runner.config.e2e_changes as f64;
        if mode == ProxyMode::Iptables
            && let Err(skip) = runner.iptables_fits(w, syncs)
        {
            iptables = Runner::note_skip(skip, &what);
            break;
        }
        step(&format!("  {} agent", mode.as_arg()), runner);
        let timeout = agent_timeout(mode, estimate);
        let run = (|| -> Result<AgentModeRun> {
            let mut cold_starts = Vec::new();
            for i in 0..starts {
                if i > 0 {
                    s.stop_agent()?;
                    // The iptables mode leaves its rules in place on exit, as kube-proxy does.
                    if mode == ProxyMode::Iptables {
                        agent_runs::clear_iptables_rules(s)?;
                    }
                }
                cold_starts.push(agent_runs::start_measured(
                    s, source, mode, w, *live, timeout,
                )?);
            }
            let e2e = agent_runs::e2e_changes(s, source, live, runner.config.e2e_changes, timeout)?;
            let memory = agent_runs::memory(s)?;
            Ok(AgentModeRun {
                cold_starts,
                e2e,
                memory,
            })
        })();
        let outcome = match run {
            Ok(run) => {
                if mode == ProxyMode::Iptables
                    && let Some(first) = run.cold_starts.first()
                {
                    runner.estimator.record(w, first.to_sync_log.as_secs_f64());
                }
                Outcome::Done(run)
            }
            Err(e) => runner.failed(
                &format!(
                    "{} through the agent ({} source)",
                    mode.as_arg(),
                    source.name()
                ),
                e,
            ),
        };
        if let Err(e) = s.stop_agent() {
            runner.failed::<()>("stopping the agent", e);
        }
        // The next start (the other mode, or the other source) must be cold as well.
        if mode == ProxyMode::Iptables
            && let Err(e) = agent_runs::clear_iptables_rules(s)
        {
            runner.failed::<()>("removing the iptables rules", e);
        }
        match mode {
            ProxyMode::Ebpf => ebpf = outcome,
            ProxyMode::Iptables => iptables = outcome,
        }
    }
    (ebpf, iptables)
}

fn folder_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or_default()
}

fn inprocess_size(runner: &mut Runner, w: Workload) -> InprocessSize {
    let mut ebpf = Vec::new();
    let mut ebpf_outcome = None;
    for _ in 0..runner.config.inprocess_repeats {
        match inprocess::ebpf(w, runner.config.inprocess_ebpf_changes) {
            Ok(r) => ebpf.push(r),
            Err(e) => {
                ebpf_outcome = Some(runner.failed("eBPF in-process", e));
                break;
            }
        }
    }
    let ebpf = ebpf_outcome.unwrap_or(Outcome::Done(ebpf));

    let estimate = runner.estimator.estimate(w);
    let repeats = if estimate.is_some_and(|e| e > Duration::from_secs(20)) {
        1
    } else {
        runner.config.inprocess_repeats
    };
    let syncs = 1.2 + 0.5 * runner.config.inprocess_iptables_changes as f64;
    let iptables = match runner.iptables_fits(w, repeats as f64 * syncs) {
        Err(skip) => Runner::note_skip(skip, "iptables in-process"),
        Ok(()) => {
            let mut runs = Vec::new();
            let mut failed = None;
            for _ in 0..repeats {
                match inprocess::iptables(
                    w,
                    runner.config.inprocess_iptables_changes,
                    runner.config.iptables_backend,
                ) {
                    Ok(r) => runs.push(r),
                    Err(e) => {
                        failed = Some(runner.failed("iptables in-process", e));
                        break;
                    }
                }
            }
            failed.unwrap_or(Outcome::Done(runs))
        }
    };
    let smallest = runner.config.programming_sizes.iter().min() == Some(&w.services);
    let iptables_nft =
        (runner.config.iptables_backend != IptablesBackend::Nft && smallest).then(|| {
            step("  iptables in-process, nft backend for comparison", runner);
            match inprocess::iptables(
                w,
                runner.config.inprocess_iptables_changes,
                IptablesBackend::Nft,
            ) {
                Ok(r) => Outcome::Done(vec![r]),
                Err(e) => runner.failed("iptables (nft) in-process", e),
            }
        });
    InprocessSize {
        workload: w,
        ebpf,
        iptables,
        iptables_nft,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_follow_a_power_law() {
        let mut e = Estimator::default();
        let w = |services| Workload {
            services,
            endpoints: 2,
        };
        assert!(e.estimate(w(10)).is_none());
        e.record(w(1), 0.2); // fixed costs only: ignored
        assert!(e.estimate(w(10)).is_none());
        e.record(w(1_000), 1.0);
        let linear = e.estimate(w(10_000)).map(|d| d.as_secs_f64());
        assert!(linear.is_some_and(|t| (t - 10.0).abs() < 0.1), "{linear:?}");
        e.record(w(10_000), 100.0); // quadratic
        let quadratic = e.estimate(w(30_000)).map(|d| d.as_secs_f64());
        assert!(
            quadratic.is_some_and(|t| (t - 900.0).abs() < 5.0),
            "{quadratic:?}"
        );
    }
}
