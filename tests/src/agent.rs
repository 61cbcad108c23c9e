//! The real `proxy-agent` process, run against a manifests directory or an API server
//! (kubeconfig), a child cgroup and a private bpffs root.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::process::{describe, kill_and_reap, wait_bounded};
use crate::{Result, RigError, profile_dir, unique_name};

/// How long the agent gets to shut down after SIGINT before it is SIGKILLed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of log included in rig error messages.
pub const LOG_TAIL_LINES: usize = 40;

/// Where the agent reads its objects from.
#[derive(Debug, Clone)]
pub enum AgentSource {
    /// `--manifests DIR`
    Manifests(PathBuf),
    /// `--kubeconfig FILE` (the Kubernetes API source)
    Kubeconfig(PathBuf),
}

impl Default for AgentSource {
    fn default() -> Self {
        Self::Manifests(PathBuf::new())
    }
}

/// How to run the agent.
#[derive(Debug, Clone, Default)]
pub struct AgentConfig {
    pub source: AgentSource,
    /// cgroup2 directory the agent attaches its socket programs to.
    pub cgroup_path: PathBuf,
    pub hostname: String,
    /// Network namespace to run the agent in (entered with `nsenter --net=`, which keeps the
    /// host mount namespace so cgroup2 and bpffs stay visible). None = the caller's namespace.
    pub netns: Option<PathBuf>,
    /// `--proxy-mode`; None = `ebpf`.
    pub proxy_mode: Option<String>,
    pub extra_args: Vec<String>,
    /// The executable to run instead of [`agent_binary`] (a wrapper, say).
    pub binary: Option<PathBuf>,
}

/// Path of the agent binary: `PROXY_AGENT_BIN`, else `target/<profile>/proxy-agent`.
pub fn agent_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PROXY_AGENT_BIN") {
        return Ok(PathBuf::from(p));
    }
    let path = profile_dir()?.join("proxy-agent");
    if path.is_file() {
        Ok(path)
    } else {
        Err(RigError::MissingBinary {
            path,
            hint: "run `cargo xtask test`, which builds the eBPF object and the agent \
                   (or set PROXY_AGENT_BIN)",
        })
    }
}

/// A running agent. Drop stops it (SIGINT, then SIGKILL after [`STOP_TIMEOUT`]), unmounts
/// its private bpffs (which releases the pinned links and maps the agent leaves in place) and
/// removes its temp directories.
#[derive(Debug)]
pub struct Agent {
    config: AgentConfig,
    child: Option<Child>,
    /// Private directory holding the log file; removed on drop.
    work_dir: PathBuf,
    log_path: PathBuf,
    bpf_root: PathBuf,
}

impl Agent {
    fn binary(&self) -> Result<PathBuf> {
        self.config.binary.clone().map_or_else(agent_binary, Ok)
    }

    pub fn start(config: &AgentConfig) -> Result<Self> {
        let work_dir = std::env::temp_dir().join(unique_name("agent"));
        let bpf_root = work_dir.join("bpf");
        fs::create_dir_all(&bpf_root)
            .map_err(|e| RigError::io(format!("creating {}", bpf_root.display()), e))?;
        let log_path = work_dir.join("agent.log");
        // From here on the guard owns the directories, even if spawning fails.
        let mut agent = Self {
            config: config.clone(),
            child: None,
            work_dir,
            log_path,
            bpf_root,
        };
        agent.spawn()?;
        Ok(agent)
    }

    /// Starts the agent process (again) with the same configuration, bpffs root and log file
    /// (appended to).
    fn spawn(&mut self) -> Result<()> {
        let bin = self.binary()?;
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| RigError::io(format!("opening {}", self.log_path.display()), e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| RigError::io("duplicating log file", e))?;
        let config = &self.config;
        let mut cmd = match &config.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", ns.display())).arg("--").arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        let (source_flag, source_path) = match &config.source {
            AgentSource::Manifests(dir) => ("--manifests", dir),
            AgentSource::Kubeconfig(file) => ("--kubeconfig", file),
        };
        cmd.args([
            "--proxy-mode",
            config.proxy_mode.as_deref().unwrap_or("ebpf"),
        ])
        .arg(source_flag)
        .arg(source_path)
        .args(["--hostname-override", &config.hostname])
        .arg("--cgroup-path")
        .arg(&config.cgroup_path)
        .arg("--bpf-root")
        .arg(&self.bpf_root)
        .arg("-v");
        // The rig's node namespaces have empty forward chains, so the default
        // `--tc-fast-path=auto` would put every test on the fast path (and XDP); the tests were
        // written for the path they name, the netfilter path unless they pass the flag, and keep
        // it. Those about `auto` pass `--tc-fast-path=auto`.
        if !config
            .extra_args
            .iter()
            .any(|arg| arg.starts_with("--tc-fast-path"))
        {
            cmd.arg("--tc-fast-path=false");
        }
        cmd.args(&config.extra_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        let what = describe(&cmd);
        // nsenter execs the agent in place, so the child's pid is the agent's pid.
        let child = cmd
            .spawn()
            .map_err(|e| RigError::io(format!("spawning `{what}`"), e))?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILLs the agent (no chance to clean anything up) and reaps it.
    pub fn kill(&mut self) -> Result<()> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| RigError::Other("agent not running".into()))?;
        kill_and_reap(&mut child);
        Ok(())
    }

    /// Starts a new agent process after [`Agent::stop`] or [`Agent::kill`], on the same pins.
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            return Err(RigError::Other("agent still running".into()));
        }
        self.spawn()
    }

    /// Like [`Agent::restart`], with another `--proxy-mode` (a mode switch on the same pins).
    pub fn restart_in_mode(&mut self, mode: &str) -> Result<()> {
        self.config.proxy_mode = Some(mode.to_owned());
        self.restart()
    }

    /// Like [`Agent::restart_in_mode`], with other extra command-line arguments.
    pub fn restart_in_mode_with_args(&mut self, mode: &str, args: &[&str]) -> Result<()> {
        self.config.proxy_mode = Some(mode.to_owned());
        self.restart_with_args(args)
    }

    /// Like [`Agent::restart`], with other extra command-line arguments (a flag change on the
    /// same pins).
    pub fn restart_with_args(&mut self, args: &[&str]) -> Result<()> {
        self.config.extra_args = args.iter().map(|a| (*a).to_owned()).collect();
        self.restart()
    }

    /// Runs `proxy-agent --cleanup` on this agent's bpffs root (bounded); returns its status.
    pub fn run_cleanup(&self) -> Result<ExitStatus> {
        // In the agent's namespace: `--cleanup` also removes iptables rules, and those of the
        // test process's namespace (the host's) must never be touched.
        let bin = self.binary()?;
        let mut cmd = match &self.config.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", ns.display())).arg("--").arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        cmd.arg("--cleanup").arg("--bpf-root").arg(&self.bpf_root);
        let out = crate::process::run_bounded(&mut cmd, STOP_TIMEOUT)?;
        let mut log = fs::OpenOptions::new()
            .append(true)
            .open(&self.log_path)
            .map_err(|e| RigError::io(format!("opening {}", self.log_path.display()), e))?;
        // Best effort: the cleanup's output only matters for diagnostics.
        let _ = std::io::Write::write_all(&mut log, &out.stderr);
        Ok(out.status)
    }

    /// Where the agent serves `/metrics`: `--metrics-bind-address` from the extra arguments,
    /// else kube-proxy's default, 127.0.0.1:10249 (in the agent's network namespace).
    pub fn metrics_address(&self) -> SocketAddr {
        let args = &self.config.extra_args;
        args.iter()
            .zip(args.iter().skip(1))
            .find(|(flag, _)| flag.as_str() == "--metrics-bind-address")
            .and_then(|(_, value)| value.parse().ok())
            .or_else(|| {
                args.iter()
                    .find_map(|a| a.strip_prefix("--metrics-bind-address="))
                    .and_then(|value| value.parse().ok())
            })
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 10249)))
    }

    /// The agent's `/metrics` exposition, fetched from inside its network namespace.
    pub fn metrics(&self) -> Result<String> {
        let netns = self.config.netns.as_deref().ok_or_else(|| {
            RigError::Other("metrics are fetched from the agent's own network namespace".into())
        })?;
        let response = crate::http::get(netns, self.metrics_address(), "/metrics")?;
        if response.status != 200 {
            return Err(self.error(format!("/metrics answered {}", response.status)));
        }
        Ok(response.body)
    }

    /// Successful syncs so far: the IPv4 observations of the sync duration histogram (one per
    /// successful sync, in both modes). 0 while the metrics server is not up yet.
    pub fn syncs(&self) -> u64 {
        self.metrics().map_or(0, |exposition| {
            crate::http::metric_sum(
                &exposition,
                "kubeproxy_sync_proxy_rules_duration_seconds_count",
                &["ip_family=\"IPv4\""],
            ) as u64
        })
    }

    /// True once the agent has synced successfully and no sync was requested after its last
    /// successful one (IPv4's `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds` not
    /// after its `..._last_timestamp_seconds`): every change it was given is programmed, and
    /// nothing is queued that would sync again. False while the metrics server is not up.
    pub fn settled(&self) -> bool {
        self.metrics().is_ok_and(|exposition| {
            let sample = |name| crate::http::metric_sum(&exposition, name, &["ip_family=\"IPv4\""]);
            let synced = sample("kubeproxy_sync_proxy_rules_duration_seconds_count") >= 1.0;
            synced
                && sample("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds")
                    <= sample("kubeproxy_sync_proxy_rules_last_timestamp_seconds")
        })
    }

    /// Everything the agent has logged so far.
    pub fn log_contents(&self) -> String {
        fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_else(|e| format!("(cannot read {}: {e})", self.log_path.display()))
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log_contents();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Wraps a message into an error carrying the log tail, for failures that may be the
    /// agent's fault.
    pub fn error(&self, message: impl Into<String>) -> RigError {
        RigError::Agent {
            message: message.into(),
            log_tail: self.log_tail(LOG_TAIL_LINES),
        }
    }

    /// Where the agent was told to put its bpffs pins.
    pub fn bpf_root(&self) -> &Path {
        &self.bpf_root
    }

    /// A datapath counter (eBPF mode), summed over CPUs, read from the pinned counter map:
    /// the metrics carry the counters as of the last sync only.
    pub fn datapath_counter(&self, index: proxy_common::StatIndex) -> Result<u64> {
        let pin = self
            .bpf_root
            .join(proxy_dataplane_ebpf::PIN_DIR_NAME)
            .join(proxy_common::map_names::STATS);
        let failed = |e: &dyn std::fmt::Display| {
            RigError::Other(format!("reading the counter map {}: {e}", pin.display()))
        };
        let data = aya::maps::MapData::from_pin(&pin).map_err(|e| failed(&e))?;
        let map = aya::maps::Map::from_map_data(data).map_err(|e| failed(&e))?;
        let stats: aya::maps::PerCpuArray<aya::maps::MapData, u64> =
            aya::maps::PerCpuArray::try_from(map).map_err(|e| failed(&e))?;
        Ok(stats
            .get(&(index as u32), 0)
            .map_err(|e| failed(&e))?
            .iter()
            .sum())
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The exit status if the process has exited on its own (None while running or after
    /// [`Agent::stop`]).
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Stops the agent with SIGINT (graceful shutdown), waiting up to [`STOP_TIMEOUT`] before
    /// SIGKILL. Returns the exit status; an error if it had to be killed.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(RigError::Other("agent already stopped".into()));
        };
        if let Ok(Some(status)) = child.try_wait() {
            return Ok(status);
        }
        let pid = i32::try_from(child.id())
            .map_err(|_| RigError::Other(format!("pid {} out of range", child.id())))?;
        kill(Pid::from_raw(pid), Signal::SIGINT)
            .map_err(|e| RigError::nix("sending SIGINT to the agent", e))?;
        match wait_bounded(&mut child, STOP_TIMEOUT)? {
            Some(status) => Ok(status),
            None => Err(self.error(format!(
                "agent did not exit within {STOP_TIMEOUT:?} of SIGINT and was killed"
            ))),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                if let Err(e) = self.stop() {
                    eprintln!("rig: stopping agent: {e}");
                }
            } else {
                kill_and_reap(child);
            }
        }
        unmount_if_mounted(&self.bpf_root);
        if let Err(e) = fs::remove_dir_all(&self.work_dir) {
            eprintln!("rig: removing {} failed: {e}", self.work_dir.display());
        }
    }
}

/// A private temporary bpffs root for in-process tests of the dataplane: the caller (or the
/// dataplane) mounts bpffs there; drop unmounts it (releasing every pin under it) and removes
/// the directory.
#[derive(Debug)]
pub struct TempBpfRoot {
    dir: PathBuf,
}

impl TempBpfRoot {
    pub fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(unique_name("bpf"));
        fs::create_dir_all(&dir)
            .map_err(|e| RigError::io(format!("creating {}", dir.display()), e))?;
        Ok(Self { dir })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TempBpfRoot {
    fn drop(&mut self) {
        unmount_if_mounted(&self.dir);
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("rig: removing {} failed: {e}", self.dir.display());
        }
    }
}

/// Lazily unmounts `dir` if something (the agent's bpffs) is mounted there; the pins of a
/// private bpffs instance disappear with its last mount.
pub(crate) fn unmount_if_mounted(dir: &Path) {
    let Ok(mounts) = fs::read_to_string("/proc/self/mounts") else {
        return;
    };
    let Ok(canon) = dir.canonicalize() else {
        return;
    };
    // A directory may be mounted over more than once; bounded by the mount count.
    let count = mounts
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some(&*canon.to_string_lossy()))
        .count();
    for _ in 0..count {
        if let Err(e) = nix::mount::umount2(&canon, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("rig: unmounting {} failed: {e}", canon.display());
            break;
        }
    }
}
