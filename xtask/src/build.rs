//! Building the eBPF object and running the checks, tests and demo.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use std::os::unix::process::CommandExt as _;

use anyhow::{Context as _, Result, bail};

use crate::commands::{run_cmd, step, workspace_root};

/// Where the eBPF build puts its artifacts: a target dir of its own, so the nightly build and the
/// stable host builds do not invalidate each other's caches.
const EBPF_TARGET_DIR: &str = "target/ebpf";
const EBPF_TARGET: &str = "bpfel-unknown-none";

/// A cargo command for the host toolchain, run in the workspace root.
fn cargo() -> Command {
    let mut command = Command::new("cargo");
    command.current_dir(workspace_root());
    command
}

/// `command` (a cargo build or test of the workspace) with clippy's driver as the workspace's
/// rustc wrapper and `-D warnings`, as `cargo clippy -- -D warnings` runs it: the workspace's
/// crates are compiled and linted at once, dependencies are compiled by rustc alone. Cargo
/// fingerprints the wrapper: every cargo run over the same target directory must use it too,
/// or the workspace's crates are compiled again.
fn linted_by_clippy(command: &mut Command) -> Result<&mut Command> {
    let driver = Command::new("rustup")
        .args(["which", "clippy-driver"])
        .current_dir(workspace_root())
        .output()
        .context("cannot run `rustup which clippy-driver`")?;
    if !driver.status.success() {
        bail!(
            "no clippy-driver in the host toolchain (`rustup component add clippy`): {}",
            String::from_utf8_lossy(&driver.stderr).trim()
        );
    }
    let driver = String::from_utf8(driver.stdout).context("clippy-driver's path")?;
    Ok(command
        .env("RUSTC_WORKSPACE_WRAPPER", driver.trim())
        // cargo-clippy's encoding of the arguments after `--`.
        .env(
            "CLIPPY_ARGS",
            "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
        ))
}

/// `cargo +NIGHTLY SUBCOMMAND` for the eBPF crate with the pinned nightly
/// ([`crate::toolchain::EBPF_NIGHTLY`]): release, bpfel target, build-std=core.
fn nightly_ebpf_cargo(subcommand: &str) -> Result<Command> {
    let toolchain = crate::toolchain::ebpf_nightly()?;
    let mut command = Command::new("cargo");
    command
        .current_dir(workspace_root())
        .arg(format!("+{toolchain}"))
        .args([subcommand, "--package", "proxy-ebpf", "--release"])
        .args(["--target", EBPF_TARGET, "-Z", "build-std=core"])
        .args(["--target-dir", EBPF_TARGET_DIR])
        // The outer `cargo xtask` pins the stable toolchain through these.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    Ok(command)
}

pub fn ebpf_object() -> PathBuf {
    workspace_root()
        .join(EBPF_TARGET_DIR)
        .join(EBPF_TARGET)
        .join("release/proxy-ebpf")
}

pub fn ebpf() -> Result<()> {
    step("build-ebpf: proxy-ebpf (nightly, build-std=core, bpf-linker)");
    run_cmd(&mut nightly_ebpf_cargo("build")?)?;
    let object = ebpf_object();
    if !object.is_file() {
        bail!(
            "the eBPF build succeeded but {} is missing",
            object.display()
        );
    }
    println!("  eBPF object: {}", object.display());
    Ok(())
}

pub fn test(quick: bool) -> Result<()> {
    let object = ebpf_object();
    // Prints each step's time as the next starts and, when `test` returns (a failed step
    // included), the table of them all.
    let mut timings = Timings::default();
    timings.start("fmt");
    step("fmt: cargo fmt --check");
    run_cmd(cargo().args(["fmt", "--all", "--check"]))?;
    timings.start("docs");
    crate::docs::check_links()?;
    timings.start("layers");
    crate::layers::check()?;
    if !quick {
        timings.start("deny");
        crate::deny::check()?;
    }
    // Started before the host builds, not after them: at the lowest priority it takes only the
    // CPU they leave, and a cargo build on two cores leaves some (one crate at a time at the
    // ends of the graph, links), as the integration tests leave much.
    let fuzz_build = if quick || !is_root() {
        None
    } else {
        timings.start("fuzz build (start)");
        step("fuzz: build every target in the background, at the lowest priority");
        Some(start_fuzz_build(&object)?)
    };
    if !quick {
        timings.start("clippy (eBPF)");
        step("clippy: eBPF programs");
        run_cmd(nightly_ebpf_cargo("clippy")?.args(["--", "-D", "warnings"]))?;
    }
    timings.start("build + clippy (host)");
    // One cargo run for the binaries the tests start (the agent, the rig's helper) and every
    // test harness: cargo keeps both cores busy across them, where two runs each ended on one
    // crate linking alone. Clippy lints the workspace's crates as they compile, as
    // `cargo clippy` does, but in the build that makes the test binaries: a separate
    // `cargo clippy` first compiled every dependency once more, as metadata only.
    step(
        "build: proxy-agent, test helpers and every test binary, each workspace crate linted by clippy",
    );
    run_cmd(
        linted_by_clippy(cargo().args(["test", "--workspace", "--no-run"]))?
            .env("PROXY_EBPF_OBJECT", &object),
    )?;
    for binary in ["proxy-agent", "rig-helper"] {
        let path = workspace_root().join("target/debug").join(binary);
        if !path.is_file() {
            bail!("the build made no {}", path.display());
        }
    }
    if !is_root() {
        println!(
            "  warning: not root — the integration tests will fail (they need namespaces, cgroups and BPF)"
        );
    }
    timings.start("tests");
    step("test: unit and integration tests (workspace)");
    let skipped_file = workspace_root().join("target/tests-skipped.txt");
    if skipped_file.exists() {
        std::fs::remove_file(&skipped_file)
            .with_context(|| format!("removing {}", skipped_file.display()))?;
    }
    let totals = run_tests(
        // Linted as they were built: another wrapper would build the workspace's crates again.
        linted_by_clippy(cargo().args(["test", "--workspace", "--no-fail-fast", "--"]))?
            // Most integration tests wait on namespaces, the agent and the network rather than
            // on a core: more of them at once than the machine has cores.
            .arg(format!("--test-threads={TEST_THREADS}"))
            .env("PROXY_EBPF_OBJECT", &object)
            .env(
                "PROXY_AGENT_BIN",
                workspace_root().join("target/debug/proxy-agent"),
            )
            .env("KPR_SKIPPED_FILE", &skipped_file)
            // A failed test's error is printed with `{:?}`: without this, a CI that sets
            // RUST_BACKTRACE has anyhow append a backtrace that pushes the message out of
            // the tail CI shows.
            .env("RUST_LIB_BACKTRACE", "0"),
    )?;
    timings.end();
    // One closing line for the whole run (the last per-binary line is often a doc-test run of 0).
    println!(
        "\ntests: {} passed, {} failed",
        totals.passed, totals.failed
    );
    for failed in &totals.failures {
        println!("\nfailed: {}", failed.name);
        for line in failed.summary() {
            println!("  | {line}");
        }
    }
    let skipped = std::fs::read_to_string(&skipped_file).unwrap_or_default();
    for line in skipped.lines() {
        println!("  skipped (this machine cannot): {line}");
    }
    if totals.failed > 0 || !totals.success {
        bail!("tests failed");
    }
    if totals.passed == 0 {
        bail!("no test ran");
    }
    let Some((mut fuzz_build, log)) = fuzz_build else {
        if quick {
            return Ok(());
        }
        bail!("the fuzz targets need root (tc_packets loads the eBPF programs)");
    };
    timings.start("fuzz build (wait)");
    let started = std::time::Instant::now();
    let status = fuzz_build.wait()?;
    println!(
        "  the background fuzz build ended {:.0?} after the tests",
        started.elapsed()
    );
    if !status.success() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        for line in tail.into_iter().rev() {
            println!("{line}");
        }
        bail!(
            "the fuzz build failed ({status}); its output: {}",
            log.display()
        );
    }
    timings.start("fuzz");
    fuzz(CI_FUZZ, &[], &object)
}

/// How long each step of [`test`] took. Each step's time is printed when it ends; the table
/// of them all is printed on drop, so a run that stops at a failed step still shows it.
#[derive(Debug)]
struct Timings {
    began: Instant,
    running: Option<(&'static str, Instant)>,
    done: Vec<(&'static str, Duration)>,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            began: Instant::now(),
            running: None,
            done: Vec::new(),
        }
    }
}

impl Timings {
    /// Ends the running step, if any, and starts timing `name`.
    fn start(&mut self, name: &'static str) {
        self.end();
        self.running = Some((name, Instant::now()));
    }

    /// Ends the running step, if any, printing its time.
    fn end(&mut self) {
        if let Some((name, since)) = self.running.take() {
            let took = since.elapsed();
            println!("  [{name}: {}]", seconds(took));
            self.done.push((name, took));
        }
    }
}

impl Drop for Timings {
    fn drop(&mut self) {
        self.end();
        if self.done.is_empty() {
            return;
        }
        let width = self
            .done
            .iter()
            .map(|(name, _)| name.len())
            .max()
            .unwrap_or(0);
        println!("\nstep times:");
        for (name, took) in &self.done {
            println!("  {name:<width$}  {:>8}", seconds(*took));
        }
        println!(
            "  {:<width$}  {:>8}",
            "total",
            seconds(self.began.elapsed())
        );
    }
}

/// A duration as seconds with one decimal (`12.3 s`).
fn seconds(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

#[derive(Debug, Default)]
struct TestTotals {
    passed: u64,
    failed: u64,
    success: bool,
    /// Each failed test's own output (libtest's `---- name stdout ----` block), for the summary
    /// printed last: CI shows only the tail of a run, where a failure's message must be.
    failures: Vec<FailedTest>,
    open_failure: Option<FailedTest>,
}

#[derive(Debug, Default)]
struct FailedTest {
    name: String,
    lines: Vec<String>,
}

impl FailedTest {
    /// How many lines of each failure the closing summary shows: its message sits at the end
    /// of its output, after what the test printed on the way.
    const SHOWN: usize = 12;

    /// The failure's last lines, without backtrace frames (which would crowd the message out).
    fn summary(&self) -> Vec<&str> {
        let kept: Vec<&str> = self
            .lines
            .iter()
            .map(String::as_str)
            .filter(|line| !is_backtrace_frame(line) && !line.trim().is_empty())
            .collect();
        kept[kept.len().saturating_sub(Self::SHOWN)..].to_vec()
    }
}

/// A line of a printed backtrace: `  12: symbol` or `             at path:line:col`.
fn is_backtrace_frame(line: &str) -> bool {
    let trimmed = line.trim_start();
    if trimmed.starts_with("at ") && line.len() - trimmed.len() >= 8 {
        return true;
    }
    trimmed
        .split_once(": ")
        .is_some_and(|(number, _)| !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()))
        || trimmed == "Stack backtrace:"
        || trimmed.starts_with("note: run with `RUST_BACKTRACE")
}

/// Runs `cargo test`, passing its output through, and adds up its `test result:` lines.
fn run_tests(command: &mut Command) -> Result<TestTotals> {
    use std::io::{BufRead as _, BufReader};
    let shown = format!("{command:?}");
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {shown}"))?;
    let mut totals = TestTotals::default();
    let started = std::time::Instant::now();
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            match test_outcome(&line) {
                // When each test ended, to see from a CI log where the run's time went.
                Some(_) => println!("{line}  [{:.0} s]", started.elapsed().as_secs_f64()),
                None => println!("{line}"),
            }
            totals.read(&line);
        }
    }
    totals.close_failure();
    totals.success = child.wait()?.success();
    Ok(totals)
}

/// The outcome of libtest's line for one test (`test <name> ... ok`), if `line` is one.
fn test_outcome(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("test ")?;
    let (_, outcome) = rest.rsplit_once(" ... ")?;
    ["ok", "FAILED", "ignored"]
        .into_iter()
        .find(|&known| outcome == known)
}

impl TestTotals {
    /// Counts a `test result:` line and collects the lines of each failure block.
    fn read(&mut self, line: &str) {
        if let Some(name) = line
            .strip_prefix("---- ")
            .and_then(|rest| rest.strip_suffix(" stdout ----"))
        {
            self.close_failure();
            self.open_failure = Some(FailedTest {
                name: name.to_owned(),
                lines: Vec::new(),
            });
        } else if line == "failures:" || line.starts_with("test result: ") {
            self.close_failure();
        } else if let Some(failure) = self.open_failure.as_mut() {
            failure.lines.push(line.to_owned());
        }
        if let Some(result) = line.strip_prefix("test result: ") {
            self.passed += count_before(result, " passed");
            self.failed += count_before(result, " failed");
        }
    }

    fn close_failure(&mut self) {
        self.failures.extend(self.open_failure.take());
    }
}

/// The number in front of `label` in "ok. 37 passed; 0 failed; ...".
fn count_before(result: &str, label: &str) -> u64 {
    result
        .split(';')
        .find_map(|part| part.trim().strip_suffix(label))
        .and_then(|number| number.rsplit(' ').next())
        .and_then(|number| number.parse().ok())
        .unwrap_or(0)
}

pub fn demo() -> Result<()> {
    let object = ebpf_object();
    step("build: proxy-agent and the demo");
    build_binaries(&object, false)?;
    if !is_root() {
        bail!("the demo needs root (network namespaces, cgroups, BPF)");
    }
    step("demo");
    run_cmd(
        Command::new(workspace_root().join("target/debug/demo")).env(
            "PROXY_AGENT_BIN",
            workspace_root().join("target/debug/proxy-agent"),
        ),
    )
}

/// The cargo-fuzz targets in `tests/fuzz/` (a workspace of its own). `tc_packets` needs root
/// and the real eBPF object (it test-runs the tc programs).
const FUZZ_TARGETS: [&str; 6] = [
    "manifests",
    "config",
    "ctnetlink",
    "sockdiag",
    "api_protobuf",
    "tc_packets",
];
/// The cargo-fuzz release installed when `cargo fuzz` is missing (the lock file of that release
/// pins its dependencies).
const CARGO_FUZZ_VERSION: &str = "0.13.2";
const FUZZ_CODEGEN_UNITS: &str = "16";
/// Test threads per test binary (libtest's default is one per core).
const TEST_THREADS: u32 = 4;
/// How long each target runs.
#[derive(Debug, Clone, Copy)]
pub enum FuzzBudget {
    /// By hand: this many seconds, random seed, the corpus kept in `tests/fuzz/corpus/`.
    Seconds(u32),
    /// `cargo xtask test` (CI): a fixed seed and number of inputs from the committed seeds
    /// only, so that every run tries the same inputs (a red CI is a reproducible finding, not
    /// the luck of the draw), bounded in time as well.
    Replay {
        runs: u32,
        seed: u32,
        max_seconds: u32,
    },
}

/// The fuzzers' share of `cargo xtask test`: long enough to get through the seed corpus and
/// explore around it, short enough to keep CI within its budget.
pub const CI_FUZZ: FuzzBudget = FuzzBudget::Replay {
    runs: 100_000,
    seed: 1,
    max_seconds: 30,
};

/// `cargo +nightly fuzz run` for each target, bounded by `seconds`: the first build compiles
/// the agent with sanitizers (minutes), the runs then take `seconds` each. Installs cargo-fuzz
/// from crates.io when missing. New interesting inputs go to `tests/fuzz/corpus/<target>`
/// (not committed), the committed seeds are read from `tests/fuzz/seeds/<target>`. A crash,
/// panic, timeout or memory blow-up fails with the path of the input that caused it.
/// Installs cargo-fuzz at the pinned version when it is missing.
fn ensure_cargo_fuzz() -> Result<()> {
    let has_cargo_fuzz = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !has_cargo_fuzz {
        step(&format!(
            "setup: cargo install cargo-fuzz {CARGO_FUZZ_VERSION}"
        ));
        run_cmd(Command::new("cargo").args([
            "install",
            "cargo-fuzz",
            "--locked",
            "--version",
            CARGO_FUZZ_VERSION,
        ]))?;
    }
    Ok(())
}

/// Which sanitizer a fuzz build instruments with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sanitizer {
    /// By hand: AddressSanitizer, for whatever unsafe code a dependency has.
    Address,
    /// The CI replay: libFuzzer's coverage only. The parsers it feeds have no unsafe code of
    /// their own, so the replay looks for panics, hangs and memory blow-ups, which libFuzzer
    /// catches without a sanitizer; ASan instruments the whole tree and lengthens the build
    /// that the test command pays at every run.
    None,
}

impl Sanitizer {
    fn of(budget: FuzzBudget) -> Self {
        match budget {
            FuzzBudget::Seconds(_) => Self::Address,
            FuzzBudget::Replay { .. } => Self::None,
        }
    }

    fn flag(self) -> &'static str {
        match self {
            Self::Address => "address",
            Self::None => "none",
        }
    }
}

/// `cargo +NIGHTLY fuzz SUBCOMMAND` in `tests/fuzz`, run through `prefix` (e.g. `nice`).
fn fuzz_cargo(
    prefix: &[&str],
    subcommand: &str,
    object: &Path,
    sanitizer: Sanitizer,
) -> Result<Command> {
    let toolchain = crate::toolchain::ebpf_nightly()?;
    let mut command = match prefix.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg("cargo");
            command
        }
        None => Command::new("cargo"),
    };
    command
        .current_dir(workspace_root().join("tests/fuzz"))
        .arg(format!("+{toolchain}"))
        .args(["fuzz", subcommand])
        .args(["--sanitizer", sanitizer.flag()])
        // cargo-fuzz's default of one codegen unit makes LLVM optimise each of the ~220 crates
        // (k8s-openapi among them) in one piece: the build took 11 minutes of the test command
        // on two cores. Sixteen units give up a little speed per input, which runs of 100 000
        // inputs do not notice. `run` builds first: with other settings than `build` it would
        // build all again.
        .args(["--codegen-units", FUZZ_CODEGEN_UNITS])
        // LLVM's full optimisation of the whole tree (kube, k8s-openapi, tokio, hyper, aya) for
        // targets that read a few kilobytes per input: opt-level 1 keeps the inputs per second
        // the runs need and spends far less of the build in LLVM.
        .env("CARGO_PROFILE_RELEASE_OPT_LEVEL", "1")
        // One build for every target: the agent embeds the real object.
        .env("PROXY_EBPF_OBJECT", object)
        .env_remove("PROXY_EBPF_PLACEHOLDER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    Ok(command)
}

/// The fuzz targets' build, started before the integration tests at the lowest CPU priority:
/// the tests spend most of their time waiting on the network and the agent, and the build
/// (sanitizers, the whole dependency tree) takes what they leave. Its output goes to a file.
fn start_fuzz_build(object: &Path) -> Result<(Background, PathBuf)> {
    ensure_cargo_fuzz()?;
    let log = workspace_root().join("target/fuzz-build.log");
    let file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let err = file
        .try_clone()
        .with_context(|| format!("opening {}", log.display()))?;
    let child = fuzz_cargo(
        &["nice", "-n", "19"],
        "build",
        object,
        Sanitizer::of(CI_FUZZ),
    )?
    .stdout(file)
    .stderr(err)
    // Its own process group, so that a failed test run can stop cargo and its rustcs.
    .process_group(0)
    .spawn()
    .context("cannot start the fuzz build")?;
    Ok((Background(Some(child)), log))
}

/// A command running beside the tests: waited for, or stopped with its whole process group
/// when the run ends early (a failed test), so nothing of it outlives the run.
struct Background(Option<std::process::Child>);

impl Background {
    fn wait(&mut self) -> Result<std::process::ExitStatus> {
        let mut child = self
            .0
            .take()
            .context("the background command was waited for")?;
        child.wait().context("waiting for the background command")
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let _ = child.wait();
        }
    }
}

pub fn fuzz(budget: FuzzBudget, targets: &[String], object: &Path) -> Result<()> {
    ensure_cargo_fuzz()?;
    let targets: Vec<&str> = if targets.is_empty() {
        FUZZ_TARGETS.to_vec()
    } else {
        targets.iter().map(String::as_str).collect()
    };
    let dir = workspace_root().join("tests/fuzz");
    let toolchain = crate::toolchain::ebpf_nightly()?;
    let sanitizer = Sanitizer::of(budget);
    step(&format!(
        "fuzz: build every target (nightly, sanitizer: {})",
        sanitizer.flag()
    ));
    let started = std::time::Instant::now();
    run_cmd(&mut fuzz_cargo(&[], "build", object, sanitizer)?)?;
    println!("  fuzz build took {:.0?}", started.elapsed());
    for target in targets {
        let corpus = match budget {
            FuzzBudget::Seconds(seconds) => {
                step(&format!("fuzz: {target} for {seconds} s"));
                dir.join("corpus").join(target)
            }
            FuzzBudget::Replay { runs, seed, .. } => {
                step(&format!("fuzz: {target}, {runs} inputs from seed {seed}"));
                // Where libFuzzer writes what it finds interesting: empty each time, so the
                // run depends on the committed seeds only.
                let scratch = dir.join("target").join("ci-corpus").join(target);
                if scratch.exists() {
                    std::fs::remove_dir_all(&scratch)
                        .with_context(|| format!("emptying {}", scratch.display()))?;
                }
                scratch
            }
        };
        std::fs::create_dir_all(&corpus)
            .with_context(|| format!("creating {}", corpus.display()))?;
        let artifacts = dir.join("artifacts").join(target);
        let before = files_in(&artifacts);
        let mut command = fuzz_cargo(&[], "run", object, sanitizer)?;
        command.arg(target).arg(&corpus);
        let seeds = dir.join("seeds").join(target);
        if seeds.is_dir() {
            command.arg(&seeds);
        }
        if target == "api_protobuf" {
            command.arg(api_fixture_seeds(&dir.join("target"))?);
        }
        command.arg("--");
        match budget {
            FuzzBudget::Seconds(seconds) => {
                command.arg(format!("-max_total_time={seconds}"));
            }
            FuzzBudget::Replay {
                runs,
                seed,
                max_seconds,
            } => {
                command
                    .arg(format!("-runs={runs}"))
                    .arg(format!("-seed={seed}"))
                    .arg(format!("-max_total_time={max_seconds}"));
            }
        }
        command
            .arg("-rss_limit_mb=2048")
            .arg("-timeout=10")
            .arg("-print_final_stats=1");
        if let Err(e) = run_cmd(&mut command) {
            let found: Vec<String> = files_in(&artifacts)
                .into_iter()
                .filter(|f| !before.contains(f))
                .map(|f| f.display().to_string())
                .collect();
            bail!(
                "fuzz target {target} found a problem: {e}\n  input(s): {}\n  reproduce: cd \
                 tests/fuzz && cargo +{toolchain} fuzz run {target} <input>",
                if found.is_empty() {
                    "none written (see the output above)".to_owned()
                } else {
                    found.join(", ")
                }
            );
        }
    }
    Ok(())
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// Builds the agent and the benchmark with `--release` (debug builds would measure the
/// compiler's unoptimised code, not the design) and runs the benchmark, which writes
/// `docs/benchmarks.md` and the SVG plots next to it.
pub fn bench(quick: bool, only: Option<&str>) -> Result<()> {
    let object = ebpf_object();
    step("build: proxy-agent and the benchmark (release)");
    build_binaries(&object, true)?;
    if !is_root() {
        bail!("the benchmarks need root (network namespaces, cgroups, BPF)");
    }
    step(if quick {
        "bench --quick (smoke run)"
    } else {
        "bench (about 20 minutes)"
    });
    let release = workspace_root().join("target/release");
    let mut command = Command::new(release.join("bench"));
    // A partial run writes beside the build, so docs/ only ever holds a full report.
    let out_dir = if only.is_some() {
        "target/bench-partial"
    } else {
        "docs"
    };
    command
        .current_dir(workspace_root())
        .args(["--out-dir", out_dir])
        .env("PROXY_AGENT_BIN", release.join("proxy-agent"))
        .env("RIG_HELPER_BIN", release.join("rig-helper"));
    if quick {
        command.arg("--quick");
    }
    if let Some(sections) = only {
        std::fs::create_dir_all(workspace_root().join(out_dir))
            .with_context(|| format!("creating {out_dir}"))?;
        command.args(["--only", sections]);
    }
    run_cmd(&mut command)
}

/// Builds the agent and the test rig's binaries (rig-helper, demo, bench) with the embedded
/// eBPF object.
fn build_binaries(object: &Path, release: bool) -> Result<()> {
    let mut command = cargo();
    command.arg("build");
    if release {
        command.arg("--release");
    }
    run_cmd(
        command
            .args([
                "--package",
                "proxy-agent",
                "--package",
                "proxy-tests",
                "--bins",
            ])
            .env("PROXY_EBPF_OBJECT", object),
    )
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// The Kubernetes API's own protobuf fixtures (`../shared/k8s-api-testdata/<release>/*.pb`,
/// upstream's data, read where it lies rather than copied into the repository) as seeds of
/// `api_protobuf`, written under `scratch`: each `.pb` as it is (what the target reads as a list
/// body and a status) and as one ADDED watch frame (what it reads as a watch stream).
fn api_fixture_seeds(scratch: &Path) -> Result<PathBuf> {
    let fixtures = workspace_root().join("../shared/k8s-api-testdata");
    let out = scratch.join("fixture-seeds").join("api_protobuf");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("emptying {}", out.display()))?;
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = 0;
    for release in files_in(&fixtures).into_iter().filter(|p| p.is_dir()) {
        for pb in files_in(&release)
            .into_iter()
            .filter(|p| p.extension().is_some_and(|ext| ext == "pb"))
        {
            let bytes = std::fs::read(&pb).with_context(|| format!("reading {}", pb.display()))?;
            let name = format!(
                "{}-{}",
                release.file_name().unwrap_or_default().to_string_lossy(),
                pb.file_stem().unwrap_or_default().to_string_lossy()
            );
            std::fs::write(out.join(format!("{name}.pb")), &bytes)?;
            std::fs::write(out.join(format!("{name}.watch")), watch_frame(&bytes))?;
            written += 1;
        }
    }
    if written == 0 {
        bail!(
            "no protobuf fixtures under {}: the fuzz seeds need the Kubernetes API's fixtures",
            fixtures.display()
        );
    }
    println!(
        "  {written} API fixtures from {} as seeds",
        fixtures.display()
    );
    Ok(out)
}

/// One watch frame as the API server streams it in protobuf: a 4-byte big-endian length, then
/// `metav1.WatchEvent{type: "ADDED", object: runtime.RawExtension{raw: object}}`.
fn watch_frame(object: &[u8]) -> Vec<u8> {
    fn varint(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    fn field(number: u8, bytes: &[u8], out: &mut Vec<u8>) {
        // Wire type 2: length-delimited.
        out.push(number << 3 | 2);
        varint(bytes.len(), out);
        out.extend_from_slice(bytes);
    }
    let mut raw_extension = Vec::new();
    field(1, object, &mut raw_extension);
    let mut event = Vec::new();
    field(1, b"ADDED", &mut event);
    field(2, &raw_extension, &mut event);
    let mut frame = u32::try_from(event.len())
        .unwrap_or(u32::MAX)
        .to_be_bytes()
        .to_vec();
    frame.extend(event);
    frame
}

#[cfg(test)]
mod test_output_tests {
    use super::*;

    /// libtest's closing output for one failed test whose anyhow error carries a backtrace.
    #[test]
    fn a_test_line_is_told_from_the_other_output() {
        assert_eq!(test_outcome("test drift::a_check ... ok"), Some("ok"));
        assert_eq!(
            test_outcome("test takeover::scenario ... FAILED"),
            Some("FAILED")
        );
        assert_eq!(test_outcome("test result: ok. 3 passed; 0 failed"), None);
        assert_eq!(
            test_outcome("test x has been running for over 60 seconds"),
            None
        );
        assert_eq!(test_outcome("running 3 tests"), None);
    }

    #[test]
    fn a_failure_is_summarised_by_its_message_without_the_backtrace() {
        let output = "\
test a::ok ... ok
test b::broken ... FAILED

failures:

---- b::broken stdout ----
stream 0: {\"pod1\": 120}
Error: every stream answered by its one backend throughout: broken [(3, {})]

Stack backtrace:
   0: anyhow::error::<impl anyhow::Error>::msg
             at /cargo/anyhow/src/error.rs:83:36
   1: integration::b::broken
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace

failures:
    b::broken

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.00s
";
        let mut totals = TestTotals::default();
        for line in output.lines() {
            totals.read(line);
        }
        totals.close_failure();
        assert_eq!((totals.passed, totals.failed), (1, 1));
        assert_eq!(totals.failures.len(), 1);
        assert_eq!(totals.failures[0].name, "b::broken");
        assert_eq!(
            totals.failures[0].summary(),
            [
                "stream 0: {\"pod1\": 120}",
                "Error: every stream answered by its one backend throughout: broken [(3, {})]",
            ]
        );
    }
}

#[cfg(test)]
mod fixture_seed_tests {
    use super::*;

    /// Every fixture of `../shared/` as it is and as a watch frame, under the scratch folder.
    #[test]
    fn the_api_fixtures_become_seeds() {
        let scratch = workspace_root().join("target/xtask-test-fixture-seeds");
        let out = api_fixture_seeds(&scratch).expect("the fixtures beside the repository");
        let seeds = files_in(&out);
        let pb = seeds
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "pb"))
            .count();
        assert!(pb >= 15, "5 releases × 3 kinds at least: {pb}");
        assert_eq!(seeds.len(), 2 * pb, "each also as a watch frame");
        let _ = std::fs::remove_dir_all(&scratch);
    }

    #[test]
    fn a_watch_frame_is_length_prefixed_and_names_its_type_and_object() {
        let frame = watch_frame(b"k8s\0xyz");
        assert_eq!(&frame[..4], &(frame.len() as u32 - 4).to_be_bytes());
        assert_eq!(
            &frame[4..],
            &[
                0x0a, 5, b'A', b'D', b'D', b'E', b'D', 0x12, 9, 0x0a, 7, b'k', b'8', b's', 0, b'x',
                b'y', b'z'
            ]
        );
    }
}
