//! The benchmark clients: tight loops that run inside one process entered into the node
//! namespace (and the agent's cgroup), so that a sample measures the socket calls and the
//! datapath, not a fork/exec per connection; and the orchestrator side that runs them.
//!
//! Output of `rig-helper bench-connect`: a `summary ok=N errors=E elapsed_ns=T first_error=...`
//! line, then one latency sample in nanoseconds per line. `rig-helper bench-probe` prints
//! `probe attempts=N start_ns=S end_ns=E answer=NAME` (CLOCK_MONOTONIC, comparable across
//! processes) or `probe timeout attempts=N last=...`. `rig-helper bench-gaps` connects every
//! millisecond until its stdin closes and prints `gaps attempts=N ok=O wrong=W errors=E
//! max_gap_ns=G first_wrong=NAME`.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};

pub use crate::cpu::{pin, pin_process};
use crate::process::{describe, kill_and_reap, run_ok_within};
use crate::{Result, RigError, helper_binary};

/// Per-socket-call timeout: a benchmark connection normally takes well under a millisecond.
const IO_TIMEOUT: Duration = Duration::from_secs(1);

/// What the benchmark loop measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// A new connection per sample: connect, read the greeting line, close.
    Connect,
    /// One connection; a sample is one request line written and its echo read (TCP_RR).
    Rr,
}

impl Workload {
    fn as_arg(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Rr => "rr",
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct BenchConnectArgs {
    #[arg(long)]
    pub target: SocketAddr,
    #[arg(long, value_enum, default_value_t = Workload::Connect)]
    pub workload: Workload,
    /// Samples to take (after the warm-up).
    #[arg(long)]
    pub count: u32,
    /// Samples taken first and discarded (cache and ARP warm-up).
    #[arg(long, default_value_t = 50)]
    pub warmup: u32,
    /// Stop early after this long, whatever `count` says.
    #[arg(long, default_value_t = 20_000)]
    pub max_ms: u64,
    /// Greetings must start with this (e.g. `pod`): an answer from anything else (the decoy
    /// on the ClusterIP, i.e. an untranslated connection) is counted as an error.
    #[arg(long, default_value = "pod")]
    pub expect: String,
    #[arg(long)]
    pub netns: Option<PathBuf>,
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// Run on this CPU only (sched_setaffinity before the first sample).
    #[arg(long)]
    pub cpu: Option<usize>,
}

#[derive(Debug, Clone, Args)]
pub struct BenchProbeArgs {
    #[arg(long)]
    pub target: SocketAddr,
    /// Backend names that count as "reached" (comma-separated, e.g. `pod3` or `pod1,pod2`).
    #[arg(long, value_delimiter = ',')]
    pub expect: Vec<String>,
    #[arg(long, default_value_t = 60_000)]
    pub max_ms: u64,
    /// Bound on attempts, besides the time bound.
    #[arg(long, default_value_t = 5_000_000)]
    pub max_attempts: u64,
    #[arg(long)]
    pub netns: Option<PathBuf>,
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct BenchGapsArgs {
    #[arg(long)]
    pub target: SocketAddr,
    /// Backend names that count as a correct answer (comma-separated); any other answer is a
    /// wrong one.
    #[arg(long, value_delimiter = ',')]
    pub expect: Vec<String>,
    /// One connection attempt starts every this many microseconds (a slower attempt delays
    /// the next one; attempts are never bunched up to catch up).
    #[arg(long, default_value_t = 1_000)]
    pub interval_us: u64,
    /// Stop after this long even if stdin stays open.
    #[arg(long, default_value_t = 120_000)]
    pub max_ms: u64,
    #[arg(long)]
    pub netns: Option<PathBuf>,
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the machine, so the
/// orchestrator and a probe can compare their timestamps.
pub fn monotonic_ns() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(ts) => {
            let secs = u64::try_from(ts.tv_sec()).unwrap_or_default();
            let nanos = u64::try_from(ts.tv_nsec()).unwrap_or_default();
            secs * 1_000_000_000 + nanos
        }
        // Cannot fail for CLOCK_MONOTONIC on Linux; 0 makes a broken sample obvious.
        Err(_) => 0,
    }
}

/// Reads until a newline; returns the bytes read (the first line plus anything after it).
fn read_line(conn: &mut TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    loop {
        let Some(free) = buf.get_mut(filled..).filter(|b| !b.is_empty()) else {
            return Err(io::Error::other("line longer than the buffer"));
        };
        let n = conn.read(free)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "EOF"));
        }
        filled += n;
        if buf.get(..filled).is_some_and(|b| b.contains(&b'\n')) {
            return Ok(filled);
        }
    }
}

/// The backend's name: the greeting's first word.
fn greeting_name(buf: &[u8]) -> String {
    let text = String::from_utf8_lossy(buf);
    text.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}

fn connect(target: SocketAddr) -> io::Result<TcpStream> {
    let conn = TcpStream::connect_timeout(&target, IO_TIMEOUT)?;
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(conn)
}

/// One new-connection sample: connect, read the greeting, close. Returns the backend name.
fn connect_once(target: SocketAddr, buf: &mut [u8]) -> io::Result<String> {
    let mut conn = connect(target)?;
    let n = read_line(&mut conn, buf)?;
    Ok(greeting_name(buf.get(..n).unwrap_or_default()))
    // Dropping closes: the close is part of the sample, as for a short-lived client.
}

/// `rig-helper bench-connect`.
pub fn bench_connect(args: &BenchConnectArgs) -> Result<()> {
    if let Some(cpu) = args.cpu {
        pin(0, cpu)?;
    }
    let mut buf = [0u8; 256];
    let mut samples: Vec<u64> = Vec::with_capacity(args.count as usize);
    let mut errors = 0u64;
    let mut first_error = String::from("-");
    let mut note = |e: String, errors: &mut u64| {
        if *errors == 0 {
            first_error = e.replace(' ', "_");
        }
        *errors += 1;
    };
    let max = Duration::from_millis(args.max_ms);
    let started = Instant::now();
    match args.workload {
        Workload::Connect => {
            for i in 0..args.warmup + args.count {
                if started.elapsed() > max {
                    break;
                }
                let t0 = Instant::now();
                let result = connect_once(args.target, &mut buf);
                let elapsed = t0.elapsed();
                match result {
                    Ok(name) if name.starts_with(&args.expect) => {
                        if i >= args.warmup {
                            samples.push(duration_ns(elapsed));
                        }
                    }
                    Ok(name) => note(format!("answer from {name}"), &mut errors),
                    Err(e) => note(e.to_string(), &mut errors),
                }
            }
        }
        Workload::Rr => {
            let mut conn = connect(args.target).map_err(|e| RigError::io("bench connect", e))?;
            conn.set_nodelay(true)
                .map_err(|e| RigError::io("TCP_NODELAY", e))?;
            let n = read_line(&mut conn, &mut buf).map_err(|e| RigError::io("greeting", e))?;
            let name = greeting_name(buf.get(..n).unwrap_or_default());
            if !name.starts_with(&args.expect) {
                return Err(RigError::Other(format!(
                    "the connection was answered by {name}, not {}*",
                    args.expect
                )));
            }
            for i in 0..args.warmup + args.count {
                if started.elapsed() > max {
                    break;
                }
                let t0 = Instant::now();
                let result = conn
                    .write_all(b"ping\n")
                    .and_then(|()| read_line(&mut conn, &mut buf));
                let elapsed = t0.elapsed();
                match result {
                    Ok(_) if i >= args.warmup => samples.push(duration_ns(elapsed)),
                    Ok(_) => {}
                    // The connection is unusable after an error: stop with what we have.
                    Err(e) => {
                        note(e.to_string(), &mut errors);
                        break;
                    }
                }
            }
        }
    }
    let elapsed = duration_ns(started.elapsed());
    let mut out = io::BufWriter::new(io::stdout().lock());
    let mut text = format!(
        "summary ok={} errors={errors} elapsed_ns={elapsed} first_error={first_error}\n",
        samples.len()
    );
    for s in &samples {
        text.push_str(&s.to_string());
        text.push('\n');
    }
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| RigError::io("printing samples", e))
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `rig-helper bench-probe`: prints `ready`, then connects in a tight loop (no pause: the
/// resolution is one connection's duration) until a connection reaches an expected backend.
pub fn bench_probe(args: &BenchProbeArgs) -> Result<()> {
    let mut out = io::stdout();
    writeln!(out, "ready")
        .and_then(|()| out.flush())
        .map_err(|e| RigError::io("printing ready", e))?;
    let mut buf = [0u8; 256];
    let max = Duration::from_millis(args.max_ms);
    let started = Instant::now();
    let mut last = String::from("-");
    let mut attempts = 0u64;
    while attempts < args.max_attempts && started.elapsed() < max {
        attempts += 1;
        let start_ns = monotonic_ns();
        match connect_once(args.target, &mut buf) {
            Ok(name) if args.expect.contains(&name) => {
                let end_ns = monotonic_ns();
                return writeln!(
                    out,
                    "probe attempts={attempts} start_ns={start_ns} end_ns={end_ns} answer={name}"
                )
                .map_err(|e| RigError::io("printing probe result", e));
            }
            Ok(name) => last = name,
            Err(e) => last = e.to_string().replace(' ', "_"),
        }
    }
    writeln!(out, "probe timeout attempts={attempts} last={last}")
        .map_err(|e| RigError::io("printing probe result", e))
}

/// `rig-helper bench-gaps`: prints `ready`, then starts a connection every `interval_us` until
/// stdin closes (or a line arrives) or `max_ms` passes, and prints `gaps attempts=N ok=O
/// wrong=W errors=E max_gap_ns=G first_wrong=NAME`. The gap is the longest time between two
/// consecutive correct answers (counting from the start and to the end as well), so a stretch
/// of refused, timed-out or wrong connections shows up as one long gap.
pub fn bench_gaps(args: &BenchGapsArgs) -> Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut out = io::stdout();
    writeln!(out, "ready")
        .and_then(|()| out.flush())
        .map_err(|e| RigError::io("printing ready", e))?;
    // The orchestrator ends the run by closing our stdin; a thread waits for that so the loop
    // never blocks on it.
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = io::stdin().read_line(&mut line);
            stop.store(true, Ordering::Relaxed);
        });
    }
    let mut buf = [0u8; 256];
    let interval = Duration::from_micros(args.interval_us.max(1));
    let max = Duration::from_millis(args.max_ms);
    let started = Instant::now();
    let (mut attempts, mut ok, mut wrong, mut errors) = (0u64, 0u64, 0u64, 0u64);
    let mut first_wrong = String::from("-");
    let mut last_ok = started;
    let mut max_gap = Duration::ZERO;
    let mut next = started;
    while !stop.load(Ordering::Relaxed) && started.elapsed() < max {
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        }
        next = Instant::now() + interval;
        attempts += 1;
        match connect_once(args.target, &mut buf) {
            Ok(name) if args.expect.contains(&name) => {
                let now = Instant::now();
                max_gap = max_gap.max(now - last_ok);
                last_ok = now;
                ok += 1;
            }
            Ok(name) => {
                if wrong == 0 {
                    first_wrong = name;
                }
                wrong += 1;
            }
            Err(_) => errors += 1,
        }
    }
    max_gap = max_gap.max(last_ok.elapsed());
    writeln!(
        out,
        "gaps attempts={attempts} ok={ok} wrong={wrong} errors={errors} max_gap_ns={} first_wrong={first_wrong}",
        duration_ns(max_gap)
    )
    .map_err(|e| RigError::io("printing the gaps", e))
}

/// CPU every benchmark client is pinned to (`usize::MAX`: not pinned), see [`set_client_cpu`].
static CLIENT_CPU: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// Pins every `bench-connect` client started from now on to `cpu` (None: no pinning). A
/// process-wide setting because every path of a run must be pinned alike for the ratios to
/// compare like with like.
pub fn set_client_cpu(cpu: Option<usize>) {
    CLIENT_CPU.store(
        cpu.unwrap_or(usize::MAX),
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// The CPU set by [`set_client_cpu`]; the benchmark pins the echo servers there too.
pub fn client_cpu() -> Option<usize> {
    Some(CLIENT_CPU.load(std::sync::atomic::Ordering::Relaxed)).filter(|&c| c != usize::MAX)
}

/// Where a benchmark client runs: the node namespace, inside the agent's cgroup or not.
#[derive(Debug, Clone)]
pub struct Place {
    pub netns: PathBuf,
    pub cgroup: Option<PathBuf>,
}

impl Place {
    fn args(&self, cmd: &mut Command) {
        cmd.arg("--netns").arg(&self.netns);
        if let Some(cg) = &self.cgroup {
            cmd.arg("--cgroup").arg(cg);
        }
    }
}

/// One run of `bench-connect`.
#[derive(Debug, Clone)]
pub struct Samples {
    /// Latencies in ns, in the order taken.
    pub ns: Vec<u64>,
    pub errors: u64,
    pub first_error: String,
    /// Wall time of the whole loop (warm-up included), for the rate.
    pub elapsed: Duration,
    /// Samples per second over the measured part: count / sum of sample times.
    pub rate: f64,
}

/// Runs `rig-helper bench-connect` (bounded by its own `max_ms` plus slack) and parses it.
pub fn run_bench(
    place: &Place,
    target: SocketAddr,
    workload: Workload,
    count: u32,
    max: Duration,
) -> Result<Samples> {
    let mut cmd = Command::new(helper_binary()?);
    cmd.arg("bench-connect")
        .args(["--target", &target.to_string()])
        .args(["--workload", workload.as_arg()])
        .args(["--count", &count.to_string()])
        .args(["--max-ms", &max.as_millis().to_string()]);
    if let Some(cpu) = client_cpu() {
        cmd.args(["--cpu", &cpu.to_string()]);
    }
    place.args(&mut cmd);
    let stdout = run_ok_within(&mut cmd, max + Duration::from_secs(15))?;
    parse_samples(&stdout)
}

fn parse_samples(stdout: &str) -> Result<Samples> {
    let mut lines = stdout.lines();
    let summary = lines.next().unwrap_or_default();
    let bad = || RigError::Parse {
        what: "bench-connect summary",
        line: summary.to_owned(),
    };
    let field = |name: &str| -> Option<&str> {
        summary
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    };
    let errors = field("errors")
        .and_then(|v| v.parse().ok())
        .ok_or_else(bad)?;
    let elapsed_ns: u64 = field("elapsed_ns")
        .and_then(|v| v.parse().ok())
        .ok_or_else(bad)?;
    let first_error = field("first_error").unwrap_or("-").to_owned();
    let ns = lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.trim().parse().map_err(|_| RigError::Parse {
                what: "bench-connect sample",
                line: l.to_owned(),
            })
        })
        .collect::<Result<Vec<u64>>>()?;
    let total: u64 = ns.iter().sum();
    let rate = if total == 0 {
        0.0
    } else {
        ns.len() as f64 / (total as f64 / 1e9)
    };
    Ok(Samples {
        ns,
        errors,
        first_error,
        elapsed: Duration::from_nanos(elapsed_ns),
        rate,
    })
}

/// A running `bench-probe`. Drop kills it.
#[derive(Debug)]
pub struct Probe {
    child: Child,
    stdout: Option<io::Lines<io::BufReader<ChildStdout>>>,
    what: String,
}

/// What a probe saw.
#[derive(Debug, Clone, Copy)]
pub struct ProbeHit {
    pub attempts: u64,
    /// CLOCK_MONOTONIC when the first connection reaching an expected backend started.
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Probe {
    /// Starts a probe and waits until it is in place (namespace and cgroup entered).
    pub fn start(
        place: &Place,
        target: SocketAddr,
        expect: &[&str],
        max: Duration,
    ) -> Result<Self> {
        let mut cmd = Command::new(helper_binary()?);
        cmd.arg("bench-probe")
            .args(["--target", &target.to_string()])
            .args(["--expect", &expect.join(",")])
            .args(["--max-ms", &max.as_millis().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        place.args(&mut cmd);
        let (child, stdout, what) = spawn_ready(cmd)?;
        Ok(Self {
            child,
            stdout,
            what,
        })
    }

    /// Waits for the probe's result (the probe bounds itself by `max`).
    pub fn wait(mut self) -> Result<ProbeHit> {
        let line = self
            .stdout
            .as_mut()
            .and_then(Iterator::next)
            .and_then(io::Result::ok)
            .unwrap_or_default();
        let _ = self.child.wait();
        let field = |name: &str| -> Option<u64> {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
        };
        match (field("attempts"), field("start_ns"), field("end_ns")) {
            (Some(attempts), Some(start_ns), Some(end_ns)) => Ok(ProbeHit {
                attempts,
                start_ns,
                end_ns,
            }),
            _ => Err(RigError::Other(format!("`{}`: {line}", self.what))),
        }
    }
}

/// Spawns a probe helper and waits for its `ready` line (namespace and cgroup entered);
/// returns it with its remaining output lines and its command line for messages.
#[expect(
    clippy::type_complexity,
    reason = "the probe types' own fields, returned as they store them"
)]
fn spawn_ready(
    mut cmd: Command,
) -> Result<(Child, Option<io::Lines<io::BufReader<ChildStdout>>>, String)> {
    use std::io::BufRead as _;
    let what = describe(&cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| RigError::io(format!("spawning `{what}`"), e))?;
    let mut lines = child
        .stdout
        .take()
        .map(|out| io::BufReader::new(out).lines());
    let ready = lines
        .as_mut()
        .and_then(Iterator::next)
        .and_then(io::Result::ok);
    if ready.as_deref() != Some("ready") {
        kill_and_reap(&mut child);
        return Err(RigError::Other(format!(
            "`{what}` did not start: {ready:?}"
        )));
    }
    Ok((child, lines, what))
}

/// What a gap probe saw (see [`bench_gaps`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gaps {
    pub attempts: u64,
    pub ok: u64,
    pub wrong: u64,
    pub errors: u64,
    pub max_gap: Duration,
}

/// A running `bench-gaps`. Drop kills it; [`GapProbe::finish`] ends it and reads its result.
#[derive(Debug)]
pub struct GapProbe {
    child: Child,
    stdout: Option<io::Lines<io::BufReader<ChildStdout>>>,
    what: String,
}

impl GapProbe {
    /// Starts a gap probe (one connection every `interval`) and waits until it is in place.
    pub fn start(
        place: &Place,
        target: SocketAddr,
        expect: &[&str],
        interval: Duration,
        max: Duration,
    ) -> Result<Self> {
        let mut cmd = Command::new(helper_binary()?);
        cmd.arg("bench-gaps")
            .args(["--target", &target.to_string()])
            .args(["--expect", &expect.join(",")])
            .args(["--interval-us", &interval.as_micros().to_string()])
            .args(["--max-ms", &max.as_millis().to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // Not pinned to the clients' CPU: the probe must keep its 1 ms pace while the agent
        // works, and sharing one CPU with the echo servers would add the scheduler's gaps.
        place.args(&mut cmd);
        let (child, stdout, what) = spawn_ready(cmd)?;
        Ok(Self {
            child,
            stdout,
            what,
        })
    }

    /// Ends the probe (closes its stdin) and returns what it saw.
    pub fn finish(mut self) -> Result<Gaps> {
        drop(self.child.stdin.take());
        let line = self
            .stdout
            .as_mut()
            .and_then(Iterator::next)
            .and_then(io::Result::ok)
            .unwrap_or_default();
        let _ = self.child.wait();
        parse_gaps(&line).ok_or_else(|| RigError::Other(format!("`{}`: {line}", self.what)))
    }
}

impl Drop for GapProbe {
    fn drop(&mut self) {
        kill_and_reap(&mut self.child);
    }
}

fn parse_gaps(line: &str) -> Option<Gaps> {
    let rest = line.strip_prefix("gaps ")?;
    let field = |name: &str| -> Option<u64> {
        rest.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
    };
    Some(Gaps {
        attempts: field("attempts")?,
        ok: field("ok")?,
        wrong: field("wrong")?,
        errors: field("errors")?,
        max_gap: Duration::from_nanos(field("max_gap_ns")?),
    })
}

impl Drop for Probe {
    fn drop(&mut self) {
        kill_and_reap(&mut self.child);
    }
}

/// Helper for callers that only have a namespace path.
pub fn place(netns: &Path, cgroup: Option<&Path>) -> Place {
    Place {
        netns: netns.to_path_buf(),
        cgroup: cgroup.map(Path::to_path_buf),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bench_output() -> Result<()> {
        let s = parse_samples(
            "summary ok=3 errors=1 elapsed_ns=5000 first_error=EOF\n100\n200\n300\n",
        )?;
        assert_eq!(s.ns, vec![100, 200, 300]);
        assert_eq!(s.errors, 1);
        assert_eq!(s.first_error, "EOF");
        assert!((s.rate - 5e6).abs() < 1.0, "{}", s.rate);
        assert!(parse_samples("garbage").is_err());
        Ok(())
    }

    #[test]
    fn parses_gaps() {
        assert_eq!(
            parse_gaps(
                "gaps attempts=10 ok=8 wrong=1 errors=1 max_gap_ns=3000000 first_wrong=decoy"
            ),
            Some(Gaps {
                attempts: 10,
                ok: 8,
                wrong: 1,
                errors: 1,
                max_gap: Duration::from_millis(3)
            })
        );
        assert_eq!(parse_gaps("probe timeout"), None);
    }
}
