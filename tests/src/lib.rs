//! Test rig for kubeproxy-rs: hermetic network namespaces, veth topologies, child cgroups,
//! echo servers, socket clients, manifest files and the real `proxy-agent` process.
//!
//! Every resource is owned by a guard whose `Drop` cleans it up, so a failing (panicking)
//! test leaves nothing behind on the host.

pub mod agent;
#[cfg(feature = "rig")]
pub mod apiserver;
#[cfg(feature = "rig")]
pub mod bench;
pub mod cgroup;
#[cfg(feature = "rig")]
pub mod client;
#[cfg(feature = "rig")]
pub mod cni;
#[cfg(feature = "rig")]
pub mod connect_loop;
#[cfg(feature = "rig")]
pub mod cpu;
#[cfg(feature = "rig")]
pub mod echo;
pub mod error;
#[cfg(feature = "rig")]
pub mod flood;
#[cfg(feature = "rig")]
pub mod foreign_tc;
#[cfg(feature = "rig")]
pub mod helper;
pub mod http;
#[cfg(feature = "rig")]
pub mod in_process;
#[cfg(feature = "rig")]
pub mod manifests;
#[cfg(feature = "rig")]
pub mod monitoring;
pub mod netns;
pub mod packet;
pub mod process;
#[cfg(feature = "rig")]
pub mod prometheus;
#[cfg(feature = "rig")]
pub mod reachability;
#[cfg(feature = "rig")]
pub mod scenario;
#[cfg(feature = "rig")]
pub mod service_scenarios;
#[cfg(feature = "rig")]
pub mod takeover;
pub mod tc_fuzz;
#[cfg(feature = "rig")]
pub mod topology;
#[cfg(feature = "rig")]
pub mod udp_probe;
pub mod wait;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

pub use error::RigError;

/// Result type of the rig library.
pub type Result<T, E = RigError> = std::result::Result<T, E>;

/// Panics unless the process runs as root: the rig needs namespaces, cgroups and bpffs.
/// Integration tests must fail loudly rather than silently skip.
pub fn require_root() {
    if !nix::unistd::geteuid().is_root() {
        panic!("integration tests need root (run `cargo xtask test` as root)");
    }
}

/// Where [`report_skipped`] writes, one line per skipped check; `cargo xtask test` sets it and
/// lists the lines in its closing summary.
pub const SKIPPED_FILE_ENV: &str = "KPR_SKIPPED_FILE";

/// Records that part of a test could not run on this machine (`what`) and why: on stderr, and
/// in the run's summary when `cargo xtask test` runs it. For a capability the kernel lacks that
/// no other means can provide; the test's other checks still run.
pub fn report_skipped(what: &str, why: &str) {
    use std::io::Write as _;
    eprintln!("SKIPPED: {what}: {why}");
    let Some(path) = std::env::var_os(SKIPPED_FILE_ENV) else {
        return;
    };
    // A summary line lost to a failing write is not worth failing the test for: the line on
    // stderr above stays.
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(file, "{what}: {why}");
    }
}

/// A name unique within this machine for the lifetime of this process:
/// `kpr-<pid>-<counter>-<role>`.
pub fn unique_name(role: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("kpr-{}-{n}-{role}", std::process::id())
}

static HELPER_OVERRIDE: OnceLock<PathBuf> = OnceLock::new();

/// Tells the rig which executable implements the `echo`/`client` helper subcommands.
/// Integration tests pass `env!("CARGO_BIN_EXE_rig-helper")`; the demo passes itself.
/// The first call wins (later calls are ignored), which suits tests running in parallel.
pub fn set_helper_binary(path: impl Into<PathBuf>) {
    // Ignoring the error is intended: every caller in one process passes the same path.
    let _ = HELPER_OVERRIDE.set(path.into());
}

/// Path of the helper binary: the override, else `RIG_HELPER_BIN`, else `rig-helper` next to
/// the running executable (cargo puts test executables in `target/<profile>/deps/`).
pub fn helper_binary() -> Result<PathBuf> {
    if let Some(p) = HELPER_OVERRIDE.get() {
        return Ok(p.clone());
    }
    if let Some(p) = std::env::var_os("RIG_HELPER_BIN") {
        return Ok(PathBuf::from(p));
    }
    let path = profile_dir()?.join("rig-helper");
    if path.is_file() {
        Ok(path)
    } else {
        Err(RigError::MissingBinary {
            path,
            hint: "build it with `cargo build -p proxy-tests --bins` (or set RIG_HELPER_BIN)",
        })
    }
}

/// `target/<profile>/`, derived from the running executable.
pub(crate) fn profile_dir() -> Result<PathBuf> {
    let exe =
        std::env::current_exe().map_err(|e| RigError::io("locating current executable", e))?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    Ok(dir)
}
