//! Named network namespaces (`ip netns add`) with a deleting guard.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sched::{CloneFlags, setns};

use crate::process::run_ok;
use crate::{Result, RigError, unique_name};

/// Attempts at finding a free name when a stale namespace from a crashed run holds ours.
const NAME_ATTEMPTS: usize = 20;

/// A network namespace created with `ip netns add`; deleted (`ip netns del`) on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `kpr-<pid>-<n>-<role>` and brings its `lo` up.
    pub fn new(role: &str) -> Result<Self> {
        let mut last_err = None;
        for _ in 0..NAME_ATTEMPTS {
            let name = unique_name(role);
            if name.len() > 32 {
                return Err(RigError::Other(format!("netns name {name} is too long")));
            }
            match run_ok(Command::new("ip").args(["netns", "add", &name])) {
                Ok(_) => {
                    let ns = Self { name };
                    ns.ip(&["link", "set", "lo", "up"])?;
                    // No duplicate address detection on the interfaces made here later: their
                    // link-local addresses would stay tentative for up to 2 s after link up, and
                    // the kernel sends no neighbour solicitation for a forwarded packet until
                    // the outgoing device has a usable link-local source (`ndisc_send_ns`), so
                    // the first IPv6 packet the node forwards to a fresh pod waits a neighbour
                    // retransmission (1 s). A real node's pod interfaces are long past DAD.
                    ns.sysctl_all(&[
                        ("net.ipv6.conf.default.accept_dad", "0"),
                        ("net.ipv6.conf.all.accept_dad", "0"),
                    ])?;
                    return Ok(ns);
                }
                // A leftover with the same pid and counter: skip to the next counter value.
                Err(RigError::Command { stderr, .. }) if stderr.contains("exists") => {
                    last_err = Some(stderr);
                }
                Err(e) => return Err(e),
            }
        }
        Err(RigError::Other(format!(
            "no free netns name for role {role}: {}",
            last_err.unwrap_or_default()
        )))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `interface`'s MAC, as `ip` prints it.
    pub fn mac(&self, interface: &str) -> Result<String> {
        let json = self.ip(&["-j", "link", "show", interface])?;
        let value: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| RigError::Other(format!("ip -j link: {e}")))?;
        value[0]["address"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| RigError::Other(format!("no address in {json}")))
    }

    /// `/run/netns/NAME`, the bind mount `setns`/`nsenter --net=` use.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `ip -n NAME ARGS...`, failing on a non-zero exit; returns stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run_ok(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Runs an arbitrary command inside the namespace with `ip netns exec`. Note that this
    /// also remounts /sys, so it suits `sysctl` but not anything needing cgroup2 or bpffs.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<String> {
        run_ok(
            Command::new("ip")
                .args(["netns", "exec", &self.name, program])
                .args(args),
        )
    }

    /// The established sockets of this namespace (`ss`), TCP or (with `udp`) connected UDP
    /// ones, narrowed by the `ss` filter expression `filter` (empty: all): one `local peer`
    /// pair each.
    pub fn established(&self, udp: bool, filter: &str) -> Result<Vec<String>> {
        let mut args = vec![if udp { "-Hun" } else { "-Htn" }, "state", "established"];
        if !filter.is_empty() {
            args.push(filter);
        }
        let out = self.exec("ss", &args)?;
        Ok(out
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // Recv-Q, Send-Q, local, peer (the state column is left out under a filter).
                match fields.as_slice() {
                    [.., local, peer] if fields.len() >= 4 => Some(format!("{local} {peer}")),
                    _ => None,
                }
            })
            .collect())
    }

    /// TCP segments received in this namespace so far (`InSegs` of `/proc/net/snmp`, which is
    /// per network namespace): a kernel counter that shows whether anything reached a server
    /// here, whatever the client saw.
    pub fn tcp_segments_received(&self) -> Result<u64> {
        let snmp = self.exec("cat", &["/proc/net/snmp"])?;
        let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
        let bad = || RigError::Parse {
            what: "/proc/net/snmp Tcp lines",
            line: snmp.clone(),
        };
        let (names, values) = (tcp.next().ok_or_else(bad)?, tcp.next().ok_or_else(bad)?);
        names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(name, _)| *name == "InSegs")
            .and_then(|(_, value)| value.parse().ok())
            .ok_or_else(bad)
    }

    /// Sets several sysctls inside the namespace with one command.
    pub fn sysctl_all(&self, settings: &[(&str, &str)]) -> Result<()> {
        let mut args = vec!["-qw".to_owned()];
        args.extend(settings.iter().map(|(key, value)| format!("{key}={value}")));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.exec("sysctl", &args).map(drop)
    }

    /// Sets a sysctl inside the namespace (e.g. `net.ipv4.ip_forward`).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.sysctl_all(&[(key, value)])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = run_ok(Command::new("ip").args(["netns", "del", &self.name])) {
            eprintln!("rig: cleanup of netns {} failed: {e}", self.name);
        }
    }
}

/// Starts `f` on a new thread that first enters the network namespace at `path` (network
/// namespaces are per thread, so the rest of the process stays where it is). The thread ends
/// with an error, without running `f`, if it cannot enter the namespace.
pub fn spawn_in<T: Send + 'static>(
    path: &Path,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<std::thread::JoinHandle<Result<T>>> {
    let file = std::fs::File::open(path)
        .map_err(|e| RigError::io(format!("opening {}", path.display()), e))?;
    let entering = format!("entering {}", path.display());
    Ok(std::thread::spawn(move || -> Result<T> {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| RigError::Other(format!("{entering}: {e}")))?;
        Ok(f())
    }))
}

/// [`spawn_in`], waited for: what `f` returned, or why the namespace could not be entered or
/// that `f` panicked.
pub fn on_thread_in<T: Send + 'static>(
    path: &Path,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T> {
    spawn_in(path, f)?
        .join()
        .map_err(|_| RigError::Other(format!("the thread in {} panicked", path.display())))?
}

/// Moves the calling thread (the only one, when called first) into a network namespace.
pub fn enter_netns(path: &Path) -> Result<()> {
    let f = File::open(path).map_err(|e| RigError::io(format!("opening {}", path.display()), e))?;
    setns(&f, CloneFlags::CLONE_NEWNET)
        .map_err(|e| RigError::nix(format!("setns({})", path.display()), e))
}

/// A MAC as `ip` prints it (`02:00:00:00:00:01`), as bytes.
pub fn parse_mac(text: &str) -> Result<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| RigError::Other(format!("MAC {text}: {e}")))?;
    bytes
        .try_into()
        .map_err(|_| RigError::Other(format!("MAC {text}: not 6 bytes")))
}
