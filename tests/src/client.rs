//! Runs `rig-helper client` inside a namespace (and optionally a cgroup) and parses its output.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::process::run_ok_within;
use crate::{Result, RigError, helper_binary};
use clap::ValueEnum;

/// The outcome of one connection attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    Ok {
        /// Name of the echo server that answered, e.g. `pod2` or `untranslated`.
        backend: String,
        /// The client address as the server saw it.
        client: SocketAddr,
        /// getpeername() on the client socket.
        peer: SocketAddr,
    },
    /// `ECONNREFUSED`, `TIMEOUT`, `ENETUNREACH`, ...
    Err(String),
}

impl Attempt {
    /// Backend name, or `err REASON` for a failed attempt: a key for tallies.
    pub fn label(&self) -> String {
        match self {
            Self::Ok { backend, .. } => backend.clone(),
            Self::Err(reason) => format!("err {reason}"),
        }
    }

    pub fn backend(&self) -> Option<&str> {
        match self {
            Self::Ok { backend, .. } => Some(backend),
            Self::Err(_) => None,
        }
    }

    /// Parses one helper output line (`ok NAME IP:PORT peer=IP:PORT` or `err REASON`, each
    /// optionally followed by ` at=MS`).
    pub fn parse(line: &str) -> Result<Self> {
        Self::parse_timed(line).map(|(attempt, _)| attempt)
    }

    /// Like [`Attempt::parse`], also returning `at=`: when the attempt started, in ms since the
    /// client started.
    pub fn parse_timed(line: &str) -> Result<(Self, Option<u64>)> {
        let (line, at) = match line.trim_end().rsplit_once(" at=") {
            Some((rest, ms)) if ms.chars().all(|c| c.is_ascii_digit()) => (rest, ms.parse().ok()),
            _ => (line, None),
        };
        Self::parse_untimed(line).map(|attempt| (attempt, at))
    }

    fn parse_untimed(line: &str) -> Result<Self> {
        let bad = || RigError::Parse {
            what: "client output line",
            line: line.to_owned(),
        };
        if let Some(reason) = line.strip_prefix("err ") {
            return Ok(Self::Err(reason.trim().to_owned()));
        }
        let rest = line.strip_prefix("ok ").ok_or_else(bad)?;
        let (reply, peer) = rest.rsplit_once(" peer=").ok_or_else(bad)?;
        let (backend, client) = reply.split_once(' ').ok_or_else(bad)?;
        Ok(Self::Ok {
            backend: backend.to_owned(),
            client: client.trim().parse().map_err(|_| bad())?,
            peer: peer.trim().parse().map_err(|_| bad())?,
        })
    }
}

/// Counts attempts per [`Attempt::label`].
pub fn tally(attempts: &[Attempt]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for a in attempts {
        *counts.entry(a.label()).or_insert(0) += 1;
    }
    counts
}

/// A client configuration: where it runs and how long each attempt may take.
#[derive(Debug, Clone)]
pub struct Client {
    netns: PathBuf,
    cgroup: Option<PathBuf>,
    proto: Proto,
    mode: Mode,
    timeout: Duration,
    interval: Duration,
    bind: Option<IpAddr>,
    until: Option<PathBuf>,
}

impl Client {
    /// A TCP client in the namespace at `netns` (e.g. `Netns::path()`), outside any rig cgroup.
    pub fn new(netns: impl Into<PathBuf>) -> Self {
        Self {
            netns: netns.into(),
            cgroup: None,
            proto: Proto::Tcp,
            mode: Mode::Connect,
            timeout: Duration::from_millis(1000),
            interval: Duration::ZERO,
            bind: None,
            until: None,
        }
    }

    /// Binds each socket to `source` before connecting (`Mode::Connect` only): a client with
    /// several addresses that must use a given one.
    pub fn bind(mut self, source: IpAddr) -> Self {
        self.bind = Some(source);
        self
    }

    /// Runs the client inside this cgroup2 directory.
    pub fn in_cgroup(mut self, cgroup: &Path) -> Self {
        self.cgroup = Some(cgroup.to_path_buf());
        self
    }

    pub fn proto(mut self, proto: Proto) -> Self {
        self.proto = proto;
        self
    }

    /// How sockets are used (see [`Mode`]); `Sendto` and `Stream` imply UDP, `TcpStream` TCP.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self.proto = match mode {
            Mode::Connect => self.proto,
            Mode::Sendto | Mode::Stream | Mode::SendtoSocket => Proto::Udp,
            Mode::TcpStream => Proto::Tcp,
        };
        self
    }

    /// Pause between attempts.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Stops before the next attempt once the file `stop` exists: a run's `count` is then its
    /// bound, and it may make fewer attempts (at least one).
    pub fn until(mut self, stop: &Path) -> Self {
        self.until = Some(stop.to_path_buf());
        self
    }

    /// Per-attempt connect/read timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Makes `count` attempts to `target` (each on a new socket, except in `Stream` mode).
    pub fn run(&self, target: SocketAddr, count: u32) -> Result<Vec<Attempt>> {
        Ok(self
            .run_timed(target, count)?
            .into_iter()
            .map(|(attempt, _)| attempt)
            .collect())
    }

    /// Like [`Client::run`], with each attempt's start time in ms since the client started.
    pub fn run_timed(&self, target: SocketAddr, count: u32) -> Result<Vec<(Attempt, u64)>> {
        let mut cmd = Command::new(helper_binary()?);
        cmd.arg("client")
            .args(["--target", &target.to_string()])
            .args(["--count", &count.to_string()])
            .args(["--proto", self.proto.as_arg()])
            .args(["--timeout-ms", &self.timeout.as_millis().to_string()])
            .args(["--mode", self.mode.as_arg()])
            .args(["--interval-ms", &self.interval.as_millis().to_string()])
            .arg("--netns")
            .arg(&self.netns);
        if let Some(cg) = &self.cgroup {
            cmd.arg("--cgroup").arg(cg);
        }
        if let Some(source) = self.bind {
            cmd.args(["--bind", &source.to_string()]);
        }
        if let Some(stop) = &self.until {
            cmd.arg("--until").arg(stop);
        }
        // An attempt can wait for connect and then read: bound the whole run accordingly.
        let bound = (self.timeout * 2 + self.interval) * count + Duration::from_secs(5);
        let stdout = run_ok_within(&mut cmd, bound)?;
        let attempts = stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|line| {
                Attempt::parse_timed(line).map(|(attempt, at)| (attempt, at.unwrap_or_default()))
            })
            .collect::<Result<Vec<_>>>()?;
        let printed = attempts.len();
        let expected = if self.until.is_some() {
            (1..=count as usize).contains(&printed)
        } else {
            printed == count as usize
        };
        if !expected {
            return Err(RigError::Other(format!(
                "client printed {} results for {count} attempts",
                attempts.len()
            )));
        }
        Ok(attempts)
    }

    /// Convenience: a single attempt.
    pub fn once(&self, target: SocketAddr) -> Result<Attempt> {
        self.run(target, 1)?
            .into_iter()
            .next()
            .ok_or_else(|| RigError::Other("client printed no result".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ok_and_err_lines() -> Result<()> {
        let ok = Attempt::parse("ok pod1 10.244.1.1:40312 peer=10.96.0.10:80")?;
        assert_eq!(
            ok,
            Attempt::Ok {
                backend: "pod1".into(),
                client: "10.244.1.1:40312"
                    .parse()
                    .map_err(|_| RigError::Other("addr".into()))?,
                peer: "10.96.0.10:80"
                    .parse()
                    .map_err(|_| RigError::Other("addr".into()))?,
            }
        );
        assert_eq!(
            Attempt::parse("err ECONNREFUSED")?,
            Attempt::Err("ECONNREFUSED".into())
        );
        assert!(Attempt::parse("garbage").is_err());
        let (timed, at) = Attempt::parse_timed("err ECONNABORTED at=1234")?;
        assert_eq!(timed, Attempt::Err("ECONNABORTED".into()));
        assert_eq!(at, Some(1234));
        let counts = tally(&[ok.clone(), ok, Attempt::Err("TIMEOUT".into())]);
        assert_eq!(counts.get("pod1"), Some(&2));
        assert_eq!(counts.get("err TIMEOUT"), Some(&1));
        Ok(())
    }
}

/// How the client uses its sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// A new socket per attempt, `connect()`ed (TCP, or connected UDP).
    Connect,
    /// A new unconnected UDP socket per attempt: `sendto()` + `recvfrom()`; `peer=` is the
    /// address the reply came from.
    Sendto,
    /// One connected UDP socket for all attempts, replaced only after an error — a DNS-style
    /// retry loop.
    Stream,
    /// One unconnected UDP socket for all attempts: `sendto()` + `recvfrom()` — a QUIC or
    /// RADIUS client. Replaced only after an error.
    SendtoSocket,
    /// One TCP connection for all attempts: each sends a line and reads its echo. The reply
    /// is the backend's greeting from when the connection was made, its name suffixed with
    /// `#<n>`, the number of connections made so far (`pod1#1`): a broken-and-replaced stream
    /// shows as `#2`.
    TcpStream,
}

impl Mode {
    pub fn as_arg(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Sendto => "sendto",
            Self::Stream => "stream",
            Self::SendtoSocket => "sendto-socket",
            Self::TcpStream => "tcp-stream",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn as_arg(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        }
    }
}
