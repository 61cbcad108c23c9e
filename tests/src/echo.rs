//! Echo server processes (`rig-helper echo`) that name themselves in every answer.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use crate::process::{describe, kill_and_reap};
use crate::{Result, RigError, helper_binary};

/// How long an echo server may take to bind and print `ready`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(5);

/// A running echo server; SIGKILLed and reaped on drop.
#[derive(Debug)]
pub struct EchoServer {
    name: String,
    listen: SocketAddr,
    child: Child,
}

impl EchoServer {
    /// Starts `rig-helper echo` inside the namespace at `netns` and waits (bounded) until
    /// it reports `ready`.
    pub fn start(netns: &Path, name: &str, listen: SocketAddr) -> Result<Self> {
        Self::start_with(netns, name, listen, &[])
    }

    /// Like [`EchoServer::start`], answering TCP clients with the connection's original
    /// destination (`SO_ORIGINAL_DST`) in place of the client address: a stand-in for a
    /// service-mesh sidecar that an iptables REDIRECT in its pod feeds.
    pub fn start_sidecar(netns: &Path, name: &str, listen: SocketAddr) -> Result<Self> {
        Self::start_with(netns, name, listen, &["--original-dst"])
    }

    fn start_with(netns: &Path, name: &str, listen: SocketAddr, extra: &[&str]) -> Result<Self> {
        let mut cmd = Command::new(helper_binary()?);
        cmd.arg("echo")
            .args(["--name", name])
            .args(["--listen", &listen.to_string()])
            .args(extra)
            .arg("--netns")
            .arg(netns)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let what = describe(&cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| RigError::io(format!("spawning `{what}`"), e))?;
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take();
        // The reader thread ends at EOF, i.e. when the server exits.
        thread::spawn(move || {
            if let Some(out) = stdout {
                for line in BufReader::new(out).lines().map_while(std::io::Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            }
        });
        let ready = loop {
            match rx.recv_timeout(READY_TIMEOUT) {
                Ok(line) if line.trim() == "ready" => break true,
                Ok(_) => continue,
                Err(_) => break false,
            }
        };
        if ready {
            return Ok(Self {
                name: name.to_owned(),
                listen,
                child,
            });
        }
        kill_and_reap(&mut child);
        let mut stderr = String::new();
        if let Some(mut err) = child.stderr.take() {
            let _ = err.read_to_string(&mut stderr);
        }
        Err(RigError::Timeout {
            what: format!("echo server {name} on {listen} to become ready (`{what}`)"),
            waited: READY_TIMEOUT,
            detail: format!("; stderr: {}", stderr.trim()),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn listen(&self) -> SocketAddr {
        self.listen
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        kill_and_reap(&mut self.child);
    }
}
