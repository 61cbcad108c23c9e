//! `proxy-agent inspect drift`: the running agent's drift check, without repair (it alone
//! knows what it wrote). Exits with the report; the table lists one differing entry a line.

use std::{
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, bail};

use super::http_client::{Answer, get};
use crate::drift_checks::DriftReport;

/// A full check reads every entry of the service maps: seconds at the largest sizes.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

pub fn run(metrics: Option<SocketAddr>, json: bool) -> anyhow::Result<String> {
    let Some(mut addr) = metrics else {
        bail!("`inspect drift` asks the agent over --metrics-bind-address, which is off");
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(IpAddr::from([127, 0, 0, 1]));
    }
    let body = get_when_allowed(addr, "/debug/drift")?;
    let report: DriftReport =
        serde_json::from_str(&body).with_context(|| format!("{addr}/debug/drift: bad answer"))?;
    if json {
        return Ok(serde_json::to_string_pretty(&report)?);
    }
    Ok(table(&report))
}

/// The report for people: a summary line, then one line per entry.
pub fn table(report: &DriftReport) -> String {
    let mut out = String::new();
    if !report.checked {
        let _ = writeln!(
            out,
            "{} mode: not checked ({})",
            report.mode,
            report.note.as_deref().unwrap_or("-")
        );
        return out;
    }
    let _ = writeln!(
        out,
        "{} mode: {} entries compared, {} differ",
        report.mode,
        report.entries_compared,
        report.drift.len()
    );
    if report.drift.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "{:<20} {:<8} {:<40} {:<40} FOUND",
        "MAP", "KIND", "ENTRY", "EXPECTED"
    );
    for entry in &report.drift {
        let _ = writeln!(
            out,
            "{:<20} {:<8} {:<40} {:<40} {}",
            entry.map,
            entry.kind,
            entry.entry,
            entry.expected.as_deref().unwrap_or("-"),
            entry.found.as_deref().unwrap_or("-")
        );
    }
    out
}

/// How many times a rate-limited request is retried (the agent allows one check a second).
const RATE_LIMITED_ATTEMPTS: u32 = 30;

/// [`get`], waiting as long as the agent's `Retry-After` says while it turns the request away
/// (429: another check ran within the last second, or runs).
fn get_when_allowed(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    for _ in 1..RATE_LIMITED_ATTEMPTS {
        match get(addr, path, READ_TIMEOUT)? {
            Answer::Body(body) => return Ok(body),
            Answer::RetryAfter(wait) => std::thread::sleep(wait),
        }
    }
    match get(addr, path, READ_TIMEOUT)? {
        Answer::Body(body) => Ok(body),
        Answer::RetryAfter(_) => bail!("{addr}{path}: still rate limited, try again later"),
    }
}
