//! `rig-helper connect-loop`: one UDP socket `connect()`ed to the same address again and again,
//! counting the refusals. Each `connect()` of a UDP socket runs the cgroup connect hook (a
//! connected socket may connect again) and sends nothing, so the loop spends most of its time
//! in the hook's choice of a backend: the cheapest way to make many choices race a map update.
//!
//! Output: one line `connects=N refused=R other=O first_other=TEXT`.

use std::io::{self, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Args;
use socket2::{Domain, Protocol, Socket, Type};

use crate::process::run_ok_within;
use crate::{Result, RigError, helper_binary};

#[derive(Debug, Clone, Args)]
pub struct ConnectLoopArgs {
    #[arg(long)]
    pub target: SocketAddr,
    /// Stop after this many connects.
    #[arg(long)]
    pub count: u64,
    /// Stop after this long, whatever `count` says.
    #[arg(long)]
    pub max_ms: u64,
    #[arg(long)]
    pub netns: Option<PathBuf>,
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// Run on this CPU only.
    #[arg(long)]
    pub cpu: Option<usize>,
}

/// What one loop saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectLoopReport {
    pub connects: u64,
    /// `ECONNREFUSED`: the hook found no backend to translate to.
    pub refused: u64,
    /// Any other error (none is expected).
    pub other: u64,
    pub first_other: String,
}

/// `rig-helper connect-loop` (after entering the namespace and cgroup).
pub fn connect_loop(args: &ConnectLoopArgs) -> Result<()> {
    if let Some(cpu) = args.cpu {
        crate::cpu::pin(0, cpu)?;
    }
    let domain = if args.target.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    let socket = Socket::new(domain, Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| RigError::io("UDP socket", e))?;
    let target = socket2::SockAddr::from(args.target);
    let max = Duration::from_millis(args.max_ms);
    let started = Instant::now();
    let mut report = ConnectLoopReport {
        connects: 0,
        refused: 0,
        other: 0,
        first_other: "-".into(),
    };
    while report.connects < args.count {
        // The clock only every 1024 connects: reading it costs about as much as a connect.
        if report.connects.is_multiple_of(1024) && started.elapsed() > max {
            break;
        }
        report.connects += 1;
        match socket.connect(&target) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => report.refused += 1,
            Err(e) => {
                if report.other == 0 {
                    report.first_other = e.to_string().replace(' ', "_");
                }
                report.other += 1;
            }
        }
    }
    let mut out = io::stdout();
    writeln!(
        out,
        "connects={} refused={} other={} first_other={}",
        report.connects, report.refused, report.other, report.first_other
    )
    .and_then(|()| out.flush())
    .map_err(|e| RigError::io("printing the report", e))
}

/// Runs `rig-helper connect-loop` in `netns` and `cgroup` (bounded by `max` plus slack) and
/// parses its report.
pub fn run_connect_loop(
    netns: &std::path::Path,
    cgroup: &std::path::Path,
    target: SocketAddr,
    count: u64,
    max: Duration,
    cpu: Option<usize>,
) -> Result<ConnectLoopReport> {
    let mut cmd = Command::new(helper_binary()?);
    cmd.arg("connect-loop")
        .args(["--target", &target.to_string()])
        .args(["--count", &count.to_string()])
        .args(["--max-ms", &max.as_millis().to_string()])
        .arg("--netns")
        .arg(netns)
        .arg("--cgroup")
        .arg(cgroup);
    if let Some(cpu) = cpu {
        cmd.args(["--cpu", &cpu.to_string()]);
    }
    let stdout = run_ok_within(&mut cmd, max + Duration::from_secs(15))?;
    parse_report(stdout.trim())
}

fn parse_report(line: &str) -> Result<ConnectLoopReport> {
    let bad = || RigError::Parse {
        what: "connect-loop report",
        line: line.to_owned(),
    };
    let field = |name: &str| -> Option<&str> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
    };
    let number =
        |name: &str| -> Result<u64> { field(name).and_then(|v| v.parse().ok()).ok_or_else(bad) };
    Ok(ConnectLoopReport {
        connects: number("connects")?,
        refused: number("refused")?,
        other: number("other")?,
        first_other: field("first_other").ok_or_else(bad)?.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_report_line() {
        let report = parse_report("connects=10 refused=2 other=1 first_other=Permission_denied")
            .expect("report");
        assert_eq!(
            report,
            ConnectLoopReport {
                connects: 10,
                refused: 2,
                other: 1,
                first_other: "Permission_denied".into(),
            }
        );
        assert!(parse_report("connects=10").is_err());
    }
}
