//! What kube-proxy's other modes leave on a node, removed when the agent starts (either mode)
//! and by `--cleanup`, as kube-proxy's own `platformCleanup` does when it switches modes
//! (cmd/kube-proxy/app/server_linux.go): the nftables mode's tables `ip kube-proxy` and
//! `ip6 kube-proxy` (pkg/proxy/nftables `CleanupLeftovers`), and the IPVS mode's virtual
//! services (all of them, `ipvs.rs`) and dummy device `kube-ipvs0` (pkg/proxy/ipvs
//! `CleanupLeftovers`; a `kube-ipvs0` that is not a dummy device is left alone, as upstream's
//! `DeleteDummyDevice` does). The iptables mode's chains are the same as ours and handled by the
//! other cleanup.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use thiserror::Error;
use tracing::{debug, info, warn};

use proxy_kernel::conntrack::dnat_connections;

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
    // The eBPF mode's hold of the kernel's NAT, if it was draining: the iptables mode's own NAT
    // rules hold it from now on (and `--cleanup` leaves nothing).
    proxy_kernel::iptables::nat_hold::release();
    let mut removed = Vec::new();
    let mut errors = Vec::new();
    for (family, table) in NFTABLES_TABLES {
        nft_table(family, table, "delete", &mut removed, &mut errors);
    }
    remove_ipvs(&mut removed, &mut errors);
    log_removed(&removed);
    (removed, errors)
}

/// [`remove`] for the eBPF mode: kube-proxy's nftables tables stay as they are until no
/// connection they translated is left in the kernel's conntrack, at the latest after `period`,
/// then go. Their rules are what keeps the kernel tracking and NATing those connections: the
/// eBPF mode registers no netfilter NAT or conntrack user of its own, and with the tables gone
/// — or only emptied: the rules' NAT expressions hold the conntrack hooks — the next segment of
/// every established connection went untranslated and was reset (all 14 streams of
/// `tests/tests/integration/takeover.rs`). Meanwhile the rules see only what the eBPF mode does not
/// translate first (its socket hooks and tc programs rewrite Service traffic before netfilter
/// sees it): the drain keeps kube-proxy's view of the Services for traffic that bypasses ours.
/// (The iptables mode registers NAT rules of its own, and removes the tables at once.)
pub fn remove_draining(period: Duration) -> (Vec<String>, Vec<LeftoverError>) {
    let present: Vec<_> = NFTABLES_TABLES
        .into_iter()
        .filter(|(family, table)| {
            matches!(run("nft", &["list", "table", family, table]), Outcome::Done)
        })
        .collect();
    if !present.is_empty() {
        info!(
            tables = ?present,
            ?period,
            "kube-proxy's nftables tables stay while the connections they translated last \
             (--mode-switch-drain-period)"
        );
        finish_nftables_drain(period);
    }
    let mut removed = Vec::new();
    let mut errors = Vec::new();
    remove_ipvs(&mut removed, &mut errors);
    log_removed(&removed);
    (removed, errors)
}

/// Deletes kube-proxy's nftables tables once the kernel's conntrack holds no DNATed
/// connection (or `period` is over), on a thread of its own. In the eBPF mode nothing else of
/// ours makes the kernel DNAT (its translations happen before netfilter sees the packet), so a
/// DNATed entry is the old owner's — or another NAT user's (a CNI's hostPort), which only holds
/// the drain up to `period`.
fn finish_nftables_drain(period: Duration) {
    let spawned = std::thread::Builder::new()
        .name("nft-drain".into())
        .spawn(move || {
            let started = Instant::now();
            loop {
                let dnat = dnat_connections();
                let over = started.elapsed() >= period;
                match dnat {
                    Ok(0) => {
                        info!(after = ?started.elapsed(), "kube-proxy's connections have drained")
                    }
                    Ok(live) if over => warn!(
                        live,
                        ?period,
                        "--mode-switch-drain-period is over: removing kube-proxy's nftables tables"
                    ),
                    Ok(_) => {
                        std::thread::sleep(Duration::from_secs(1));
                        continue;
                    }
                    Err(error) => warn!(%error, "cannot read the kernel's conntrack"),
                }
                let mut removed = Vec::new();
                let mut errors = Vec::new();
                for (family, table) in NFTABLES_TABLES {
                    nft_table(family, table, "delete", &mut removed, &mut errors);
                }
                log_removed(&removed);
                for error in errors {
                    warn!(%error, "removing kube-proxy leftovers");
                }
                return;
            }
        });
    if let Err(error) = spawned {
        warn!(%error, "cannot wait for kube-proxy's connections: removing its tables now");
        let (mut removed, mut errors) = (Vec::new(), Vec::new());
        for (family, table) in NFTABLES_TABLES {
            nft_table(family, table, "delete", &mut removed, &mut errors);
        }
    }
}

/// `nft <verb> table <family> <table>`, recorded in `done` or `errors`.
fn nft_table(
    family: &'static str,
    table: &'static str,
    verb: &str,
    done: &mut Vec<String>,
    errors: &mut Vec<LeftoverError>,
) {
    match run("nft", &[verb, "table", family, table]) {
        Outcome::Done => done.push(format!("nftables table {family} {table}")),
        Outcome::Absent => {}
        Outcome::Failed(message) => errors.push(LeftoverError::Nftables {
            family,
            table,
            message,
        }),
    }
}

fn log_removed(removed: &[String]) {
    for what in removed {
        info!(%what, "removed a leftover of another kube-proxy mode");
    }
}

fn remove_ipvs(removed: &mut Vec<String>, errors: &mut Vec<LeftoverError>) {
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
    if removed.is_empty() && errors.is_empty() {
        debug!("no leftovers of kube-proxy's IPVS mode");
    }
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
