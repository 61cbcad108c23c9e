//! Keeps the kernel's conntrack and NAT hooks registered while the connections that iptables
//! rules (kube-proxy's, or the iptables mode's) DNATed drain, once the eBPF mode has removed the
//! rules.
//!
//! An established connection needs no rule, only its conntrack entry and its NAT binding — but
//! the kernel tracks and NATs a family's packets in a network namespace only while something
//! there uses conntrack (`nf_ct_netns_get`: a NAT table or chain, a conntrack match). The eBPF
//! mode uses neither. With the iptables rules gone, a node where nothing else holds the hooks
//! (IPv6 usually: the iptables mode's `KUBE-FIREWALL` conntrack match is IPv4's) stops tracking
//! that family, the next segment of every established connection arrives untranslated and is
//! reset. So before the rules go, the eBPF mode adds a table of its own per family with NAT base
//! chains that translate nothing new and one conntrack match (they register the hooks; a NAT
//! hook applies the binding a connection already has, whatever the rules), and deletes it once the kernel's conntrack holds no DNATed
//! connection, at the latest after `--mode-switch-drain-period` — as kube-proxy's nftables
//! tables are kept for the same reason (`kube_proxy_modes::remove_draining`).

use std::{
    io::Write as _,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use thiserror::Error;
use tracing::{info, warn};

use crate::conntrack::dnat_connections;

/// The table, in the `ip` and the `ip6` family.
pub const TABLE: &str = "kubeproxy-rs-nat-hold";
const FAMILIES: [&str; 2] = ["ip", "ip6"];

#[derive(Debug, Error)]
pub enum NatHoldError {
    #[error("cannot run nft for the table {TABLE}: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("nft refused the table {TABLE}: {0}")]
    Nft(String),
}

/// The ruleset: per family the table (recreated if present) with a NAT base chain at each hook
/// a binding is applied at — PREROUTING and OUTPUT (the DNAT of the original direction), INPUT
/// and POSTROUTING (the un-DNAT of replies, and any masquerade) — which registers the NAT hooks,
/// and one conntrack match, which registers conntrack (`nf_ct_netns_get` is taken by
/// expressions, not by a NAT chain: emptied chains let the kernel stop tracking). The match
/// counts invalid packets and decides nothing.
fn ruleset() -> String {
    let mut text = String::new();
    for family in FAMILIES {
        text.push_str(&format!(
            "table {family} {TABLE} {{}}\ndelete table {family} {TABLE}\n\
             table {family} {TABLE} {{\n\
             \tchain prerouting {{ type nat hook prerouting priority -100; policy accept; \
             ct state invalid counter; }}\n\
             \tchain output {{ type nat hook output priority -100; policy accept; }}\n\
             \tchain input {{ type nat hook input priority 100; policy accept; }}\n\
             \tchain postrouting {{ type nat hook postrouting priority 100; policy accept; }}\n\
             }}\n"
        ));
    }
    text
}

fn nft_stdin(text: &str) -> Result<(), NatHoldError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NatHoldError::Spawn)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(text.as_bytes())
            .map_err(NatHoldError::Spawn)?;
    }
    let output = child.wait_with_output().map_err(NatHoldError::Spawn)?;
    if output.status.success() {
        Ok(())
    } else {
        Err(NatHoldError::Nft(
            String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        ))
    }
}

/// Deletes the tables (absent ones are fine).
pub fn release() {
    for family in FAMILIES {
        let _ = Command::new("nft")
            .args(["delete", "table", family, TABLE])
            .stderr(Stdio::null())
            .status();
    }
}

/// Called by the eBPF mode before it removes iptables rules: if the kernel's conntrack holds
/// DNATed connections, adds the tables and deletes them on a thread of its own once those
/// connections are gone or `period` is over. A zero period holds nothing (the rules' connections
/// are cut, as with kube-proxy's nftables tables).
pub fn hold_while_draining(period: Duration) {
    if period.is_zero() {
        release();
        return;
    }
    match dnat_connections() {
        Ok(0) => {
            release();
            return;
        }
        Ok(live) => info!(
            live,
            ?period,
            "keeping the kernel's NAT of the iptables rules' connections while they last \
             (--mode-switch-drain-period)"
        ),
        // Unknown: hold for the period.
        Err(error) => {
            warn!(%error, "cannot read the kernel's conntrack; holding its NAT for the drain period")
        }
    }
    if let Err(error) = nft_stdin(&ruleset()) {
        warn!(%error, "established connections of the iptables rules may be reset: the kernel's NAT is not held");
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("nat-hold".into())
        .spawn(move || {
            let started = Instant::now();
            loop {
                match dnat_connections() {
                    Ok(0) => {
                        info!(after = ?started.elapsed(), "the iptables rules' connections have drained");
                        break;
                    }
                    _ if started.elapsed() >= period => {
                        warn!(?period, "--mode-switch-drain-period is over: releasing the kernel's NAT of the iptables rules' connections");
                        break;
                    }
                    _ => std::thread::sleep(Duration::from_secs(1)),
                }
            }
            release();
        });
    if let Err(error) = spawned {
        warn!(%error, "cannot wait for the iptables rules' connections: releasing the kernel's NAT now");
        release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_gets_nat_chains_at_the_four_hooks_and_a_conntrack_match() {
        let text = ruleset();
        for family in FAMILIES {
            assert!(text.contains(&format!("delete table {family} {TABLE}\n")));
            assert!(text.contains(&format!("table {family} {TABLE} {{\n")));
        }
        for hook in ["prerouting", "output", "input", "postrouting"] {
            assert_eq!(
                text.matches(&format!("type nat hook {hook} ")).count(),
                2,
                "{hook}"
            );
        }
        // No NAT statement: no packet is translated anew. One conntrack match per family.
        assert!(!text.contains("dnat") && !text.contains("masquerade"));
        assert_eq!(text.matches("ct state invalid counter;").count(), 2);
    }
}
