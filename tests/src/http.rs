//! Plain HTTP/1.1 GETs from inside a test's network namespace, for the agent's node endpoints
//! (`/healthz`, `/metrics`, health check node ports).

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::Path,
    time::Duration,
};

use crate::{Result, RigError};

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Response {
    /// A header's value, by its name as sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(": "))
    }
}

/// One GET from a thread inside the network namespace at `netns` (`setns` only moves that
/// thread), with 2 s connect and read timeouts.
pub fn get(netns: &Path, addr: SocketAddr, path: &str) -> Result<Response> {
    get_with_headers(netns, addr, path, &[])
}

/// [`get`] with extra request headers (e.g. `Accept`).
pub fn get_with_headers(
    netns: &Path,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Response> {
    let path = path.to_owned();
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    crate::netns::on_thread_in(netns, move || -> Result<Response> {
        let io = |e| RigError::io(format!("GET http://{addr}{path}"), e);
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(io)?;
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(io)?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra}\r\n"
        )
        .map_err(io)?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw).map_err(io)?;
        let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| RigError::Other(format!("no status line in {head:?}")))?;
        let chunked = head.lines().any(|line| {
            line.split_once(':').is_some_and(|(name, value)| {
                name.eq_ignore_ascii_case("transfer-encoding")
                    && value.trim().eq_ignore_ascii_case("chunked")
            })
        });
        let body = if chunked {
            dechunk(body).ok_or_else(|| {
                RigError::Other(format!(
                    "GET http://{addr}{path}: bad chunked body {body:?}"
                ))
            })?
        } else {
            body.to_owned()
        };
        Ok(Response {
            status,
            head: head.to_owned(),
            body,
        })
    })?
}

/// A chunked body (Go's servers chunk a large answer, e.g. Prometheus' API) put together:
/// `None` when it is cut short or malformed.
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size_line, rest) = body.split_once("\r\n")?;
        let size_text = size_line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// The sum of the samples of `name` in a Prometheus exposition whose labels contain every one
/// of `labels` (e.g. `ip_family="IPv4"`); 0 when there is none.
pub fn metric_sum(exposition: &str, name: &str, labels: &[&str]) -> f64 {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, label_text) = match series.split_once('{') {
                Some((metric, rest)) => (metric, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let matches = metric == name && labels.iter().all(|l| label_text.contains(l));
            matches.then(|| value.parse::<f64>().ok()).flatten()
        })
        .sum()
}
