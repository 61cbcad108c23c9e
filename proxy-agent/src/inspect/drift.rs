//! `proxy-agent inspect drift`: the running agent's drift check, without repair (it alone
//! knows what it wrote). Exits with the report; the table lists one differing entry a line.

use std::{
    fmt::Write as _,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::drift::DriftReport;

/// A full check reads every entry of the service maps: seconds at the largest sizes.
const READ_TIMEOUT: Duration = Duration::from_secs(60);

pub fn run(metrics: Option<SocketAddr>, json: bool) -> anyhow::Result<String> {
    let Some(mut addr) = metrics else {
        bail!("`inspect drift` asks the agent over --metrics-bind-address, which is off");
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(IpAddr::from([127, 0, 0, 1]));
    }
    let body = get(addr, "/debug/drift")?;
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

fn get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))
        .with_context(|| format!("cannot reach the agent at {addr}"))?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "{addr}{path}: {} {}",
            head.lines().next().unwrap_or_default(),
            body.trim()
        );
    }
    Ok(body.to_owned())
}
