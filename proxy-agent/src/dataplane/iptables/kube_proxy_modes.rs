//! What kube-proxy's other modes leave on a node, removed when the agent starts (either mode)
//! and by `--cleanup`, as kube-proxy's own `platformCleanup` does when it switches modes
//! (cmd/kube-proxy/app/server_linux.go): the nftables mode's tables `ip kube-proxy` and
//! `ip6 kube-proxy` (pkg/proxy/nftables `CleanupLeftovers`), and the IPVS mode's virtual
//! services (all of them, `ipvs.rs`) and dummy device `kube-ipvs0` (pkg/proxy/ipvs
//! `CleanupLeftovers`; a `kube-ipvs0` that is not a dummy device is left alone, as upstream's
//! `DeleteDummyDevice` does). The iptables mode's chains are the same as ours and handled by the
//! other cleanup.

use std::process::Command;

use thiserror::Error;
use tracing::{debug, info};

use super::ipvs::{self, IpvsError, IpvsOutcome};

/// The nftables tables kube-proxy's nftables mode owns.
pub const NFTABLES_TABLES: [(&str, &str); 2] = [("ip", "kube-proxy"), ("ip6", "kube-proxy")];
/// The IPVS mode's dummy interface holding the service addresses.
pub const IPVS_DEVICE: &str = "kube-ipvs0";

#[derive(Debug, Error)]
pub enum LeftoverError {
    #[error("cannot remove kube-proxy's nftables table {family} {table}: {message}")]
    Nftables {
        family: &'static str,
        table: &'static str,
        message: String,
    },
    #[error("cannot remove kube-proxy's IPVS device {IPVS_DEVICE}: {message}")]
    IpvsDevice { message: String },
    #[error("cannot remove kube-proxy's IPVS virtual services: {0}")]
    IpvsServices(#[from] IpvsError),
}

/// Removes every leftover that exists; returns what was removed and what could not be.
/// A missing `nft` or `ip` binary means there is nothing of that kind to remove.
pub fn remove() -> (Vec<String>, Vec<LeftoverError>) {
    let mut removed = Vec::new();
    let mut errors = Vec::new();
    for (family, table) in NFTABLES_TABLES {
        match run("nft", &["delete", "table", family, table]) {
            Outcome::Done => removed.push(format!("nftables table {family} {table}")),
            Outcome::Absent => {}
            Outcome::Failed(message) => errors.push(LeftoverError::Nftables {
                family,
                table,
                message,
            }),
        }
    }
    match ipvs::flush_virtual_services() {
        Ok(IpvsOutcome::Flushed(count)) => removed.push(format!("{count} IPVS virtual services")),
        Ok(IpvsOutcome::Empty) => {}
        // Once per start: says why IPVS state is not looked at further.
        Ok(IpvsOutcome::Absent) => {
            info!("the kernel has no IPVS (ip_vs not loaded): no virtual services to remove");
        }
        Err(error) => errors.push(error.into()),
    }
    if is_dummy(IPVS_DEVICE) {
        match run("ip", &["link", "delete", IPVS_DEVICE]) {
            Outcome::Done => removed.push(format!("device {IPVS_DEVICE}")),
            Outcome::Absent => {}
            Outcome::Failed(message) => errors.push(LeftoverError::IpvsDevice { message }),
        }
    }
    for what in &removed {
        info!(%what, "removed a leftover of another kube-proxy mode");
    }
    if removed.is_empty() && errors.is_empty() {
        debug!("no leftovers of kube-proxy's nftables or IPVS modes");
    }
    (removed, errors)
}

/// Whether a device of that name exists and is a dummy device (`ip -d link show`: the kind
/// follows the link's flags on the second line).
fn is_dummy(name: &str) -> bool {
    Command::new("ip")
        .args(["-d", "-o", "link", "show", "dev", name])
        .output()
        .is_ok_and(|output| {
            output.status.success()
                && String::from_utf8_lossy(&output.stdout)
                    .split_whitespace()
                    .any(|word| word == "dummy")
        })
}

enum Outcome {
    Done,
    Absent,
    Failed(String),
}

fn run(program: &str, args: &[&str]) -> Outcome {
    let output = match Command::new(program).args(args).output() {
        Ok(output) => output,
        // No nft (or ip) on the node: nothing of that kind can exist to remove.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Outcome::Absent,
        Err(error) => return Outcome::Failed(error.to_string()),
    };
    if output.status.success() {
        return Outcome::Done;
    }
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    // nft: "No such file or directory"; ip: "Cannot find device"; a kernel without nf_tables
    // or without the table family support says "Operation not supported" / "Protocol not
    // supported" — none of these leave anything behind.
    if [
        "No such file or directory",
        "Cannot find device",
        "not supported",
    ]
    .iter()
    .any(|absent| stderr.contains(absent))
    {
        return Outcome::Absent;
    }
    Outcome::Failed(stderr)
}
