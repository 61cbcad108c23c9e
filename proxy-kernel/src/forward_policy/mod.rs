//! The node's forwarding policy as `proxy_model::forward_policy` decides on it: the forward
//! base chains read from the tools, and a watch that re-reads them when they change.
//!
//! What is read, in this order (the first policy found is the one reported):
//!
//! 1. iptables-legacy's filter table, IPv4 and IPv6 (`iptables-legacy-save -t filter`), only
//!    when `/proc/net/ip{,6}_tables_names` lists it: asking for a table that is not there would
//!    load `iptable_filter`, which registers one in every namespace of the host.
//! 2. iptables-nft's filter table (`iptables-nft-save -t filter`, IPv4 and IPv6) when the tool
//!    is installed: the same chains nftables shows next, but as iptables rules, for the log.
//!    Its failure is not one: step 3 reads the same chains.
//! 3. Every nftables base chain on the `forward` hook of the ip, ip6 and inet families
//!    (`nft -j list ruleset`), iptables-nft's among them.
//!
//! A tool that fails, times out or is missing where it is needed (nft always; the legacy tool
//! when its table exists) makes the policy unknown, which keeps the netfilter path.
//!
//! The watch (`watch`) runs on a thread of its own: nftables changes (nft, iptables-nft,
//! firewalld …) are announced on nfnetlink's `NFNLGRP_NFTABLES` group, and a burst of them is
//! one re-read [`DEBOUNCE`] after the first. iptables-legacy announces nothing: its tables are
//! polled every [`LEGACY_POLL`] (`/proc/net/ip{,6}_tables_names`, then, when a filter table is
//! there, `iptables-legacy-save` with counters and comments left out, compared with the last
//! one), which is a process a second only on nodes that use the legacy backend.

use std::{
    collections::BTreeMap,
    io,
    os::fd::{AsRawFd as _, OwnedFd},
    process::{Command, Stdio},
    time::Duration,
};

use nix::{
    errno::Errno,
    sys::{
        socket::{
            AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv,
            setsockopt, socket, sockopt,
        },
        time::TimeVal,
    },
};
use proxy_model::forward_policy::{ForwardChain, ForwardPolicy, ForwardRule, RuleAction, decide};
use tracing::{debug, warn};

use crate::iptables::save;

/// How long one tool may take before the reading is given up (and the policy unknown).
const TOOL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long after the first nftables notification the rulesets are read: a tool's transaction
/// (`iptables-restore`, `nft -f`) notifies once per object it changes.
pub const DEBOUNCE: Duration = Duration::from_millis(50);
/// How often iptables-legacy's tables are looked at: it sends no notification.
pub const LEGACY_POLL: Duration = Duration::from_secs(1);
/// `NFNLGRP_NFTABLES` (`linux/netfilter/nfnetlink.h`).
const NFNLGRP_NFTABLES: u32 = 7;
/// Most notifications drained after one before the rulesets are read.
const MAX_DRAINED: usize = 4096;
/// Longest rule text kept for the log.
const MAX_RULE_TEXT: usize = 200;

/// Reads every forward base chain and decides. Blocking (runs the tools).
pub fn read() -> ForwardPolicy {
    match read_chains() {
        Ok(chains) => decide(&chains),
        Err(why) => ForwardPolicy::Unknown(why),
    }
}

fn read_chains() -> Result<Vec<ForwardChain>, String> {
    let mut chains = Vec::new();
    for (names, tool, label) in [
        (
            "/proc/net/ip_tables_names",
            "iptables-legacy-save",
            "iptables-legacy (IPv4) filter",
        ),
        (
            "/proc/net/ip6_tables_names",
            "ip6tables-legacy-save",
            "iptables-legacy (IPv6) filter",
        ),
    ] {
        if !legacy_filter_exists(names) {
            continue;
        }
        match run(tool, &["-t", "filter"]) {
            Ok(Some(text)) => chains.extend(chains_of_iptables_save(&text, label)),
            Ok(None) => {
                return Err(format!(
                    "{tool} not found, and {names} lists a filter table"
                ));
            }
            Err(why) => return Err(why),
        }
    }
    for (tool, label) in [
        ("iptables-nft-save", "iptables-nft (IPv4) filter"),
        ("ip6tables-nft-save", "iptables-nft (IPv6) filter"),
    ] {
        match run(tool, &["-t", "filter"]) {
            Ok(Some(text)) => chains.extend(chains_of_iptables_save(&text, label)),
            Ok(None) => {}
            // nftables' own listing below has the same chains.
            Err(why) => debug!(%why, "reading iptables-nft's filter table"),
        }
    }
    match run("nft", &["-j", "list", "ruleset"]) {
        Ok(Some(text)) => chains.extend(chains_of_nft_json(&text)?),
        Ok(None) => return Err("nft not found: the nftables forward chains cannot be read".into()),
        Err(why) => return Err(why),
    }
    Ok(chains)
}

/// Whether `/proc/net/ip{,6}_tables_names` (this namespace's legacy tables) lists `filter`.
fn legacy_filter_exists(names: &str) -> bool {
    std::fs::read_to_string(names).is_ok_and(|text| text.lines().any(|l| l.trim() == "filter"))
}

/// Runs a tool, bounded by [`TOOL_TIMEOUT`]. `Ok(None)`: not installed.
fn run(program: &str, args: &[&str]) -> Result<Option<String>, String> {
    let command = format!("{program} {}", args.join(" "));
    let child = match Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(format!("cannot run {command}: {error}")),
    };
    let pid = child.id();
    let (done, result) = std::sync::mpsc::channel();
    // The output is read to its end by `wait_with_output` (a full pipe would stall the tool);
    // this thread only waits for it, so the timeout can give up on a tool that hangs.
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match result.recv_timeout(TOOL_TIMEOUT) {
        Ok(Ok(output)) if output.status.success() => {
            Ok(Some(String::from_utf8_lossy(&output.stdout).into_owned()))
        }
        Ok(Ok(output)) => Err(format!(
            "{command} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Ok(Err(error)) => Err(format!("{command}: {error}")),
        Err(_) => {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            Err(format!("{command} did not finish within {TOOL_TIMEOUT:?}"))
        }
    }
}

/// The FORWARD chain of the filter table in an `iptables-save` dump (none when the dump has no
/// filter table).
pub fn chains_of_iptables_save(text: &str, ruleset: &str) -> Vec<ForwardChain> {
    let mut in_filter = false;
    let mut policy = None;
    let mut rules = Vec::new();
    for line in text.lines() {
        if let Some(table) = line.strip_prefix('*') {
            in_filter = table.trim() == "filter";
            continue;
        }
        if !in_filter {
            continue;
        }
        if let Some(decl) = line.strip_prefix(":FORWARD ") {
            policy = decl.split_whitespace().next().map(str::to_owned);
        } else if let Some(rule) = save::rule_of(line)
            && rule.chain == "FORWARD"
        {
            let text = line
                .split_once("-A FORWARD")
                .map_or(line, |(_, rest)| rest)
                .trim()
                .to_owned();
            rules.push(iptables_rule(text, &rule.words));
        }
    }
    match policy {
        Some(policy) => vec![ForwardChain {
            ruleset: ruleset.to_owned(),
            chain: "FORWARD".to_owned(),
            policy,
            rules,
        }],
        None => Vec::new(),
    }
}

/// One `-A FORWARD` rule's words: its target (`-j`/`-g`) and whether anything but a comment
/// comes before it.
fn iptables_rule(text: String, words: &[String]) -> ForwardRule {
    let mut conditional = false;
    let mut action = RuleAction::Nothing;
    let mut i = 0;
    while let Some(word) = words.get(i) {
        match word.as_str() {
            "-j" | "--jump" => {
                let target = words.get(i + 1).map_or("", String::as_str);
                action = if target == "ACCEPT" {
                    RuleAction::Accept
                } else {
                    RuleAction::Other(target.to_owned())
                };
                // What follows are the target's options.
                break;
            }
            "-g" | "--goto" => {
                let target = words.get(i + 1).map_or("", String::as_str);
                action = RuleAction::Other(format!("goto {target}"));
                break;
            }
            // A comment matches every packet.
            "-m" if words.get(i + 1).is_some_and(|m| m == "comment") => i += 2,
            "--comment" => i += 2,
            _ => {
                conditional = true;
                i += 1;
            }
        }
    }
    ForwardRule {
        text,
        conditional,
        action,
    }
}

/// Every base chain on the `forward` hook of the ip, ip6 and inet families in `nft -j list
/// ruleset` output (the bridge and netdev families' hooks see no routed traffic).
pub fn chains_of_nft_json(text: &str) -> Result<Vec<ForwardChain>, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|error| format!("nft -j list ruleset: {error}"))?;
    let items = value
        .get("nftables")
        .and_then(serde_json::Value::as_array)
        .ok_or("nft -j list ruleset: no \"nftables\" array")?;
    let key = |object: &serde_json::Value, name: &str| -> Option<(String, String, String)> {
        let field = |f: &str| object.get(f)?.as_str().map(str::to_owned);
        Some((field("family")?, field("table")?, field(name)?))
    };
    let mut chains: BTreeMap<(String, String, String), ForwardChain> = BTreeMap::new();
    let mut order = Vec::new();
    for item in items {
        let Some(chain) = item.get("chain") else {
            continue;
        };
        if chain.get("hook").and_then(serde_json::Value::as_str) != Some("forward") {
            continue;
        }
        let Some(id) = key(chain, "name") else {
            continue;
        };
        if !matches!(id.0.as_str(), "ip" | "ip6" | "inet") {
            continue;
        }
        let policy = chain
            .get("policy")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("accept");
        order.push(id.clone());
        chains.insert(
            id.clone(),
            ForwardChain {
                ruleset: format!("nftables table {} {}", id.0, id.1),
                chain: id.2.clone(),
                policy: policy.to_owned(),
                rules: Vec::new(),
            },
        );
    }
    for item in items {
        let Some(rule) = item.get("rule") else {
            continue;
        };
        let Some(chain) = key(rule, "chain").and_then(|id| chains.get_mut(&id)) else {
            continue;
        };
        chain.rules.push(nft_rule(rule));
    }
    Ok(order
        .into_iter()
        .filter_map(|id| chains.remove(&id))
        .collect())
}

/// One nftables rule's expressions: matches make it conditional, counters do nothing, the
/// verdict is its action; any other statement (log, mangle, limit, an iptables target) is
/// counted as an action too.
fn nft_rule(rule: &serde_json::Value) -> ForwardRule {
    let mut conditional = false;
    let mut action = RuleAction::Nothing;
    let exprs = rule
        .get("expr")
        .and_then(serde_json::Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for expr in exprs {
        let Some((kind, body)) = expr.as_object().and_then(|o| o.iter().next()) else {
            continue;
        };
        match kind.as_str() {
            "match" => conditional = true,
            "counter" => {}
            "accept" => action = RuleAction::Accept,
            // iptables-nft's compatibility expressions: a comment matches everything.
            "xt" => {
                let name = body.get("name").and_then(serde_json::Value::as_str);
                match body.get("type").and_then(serde_json::Value::as_str) {
                    Some("match") if name == Some("comment") => {}
                    Some("match") => conditional = true,
                    _ => action = RuleAction::Other(name.unwrap_or("xt").to_owned()),
                }
            }
            "jump" | "goto" => {
                let target = body
                    .get("target")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("?");
                action = RuleAction::Other(format!("{kind} {target}"));
            }
            other => action = RuleAction::Other(other.to_owned()),
        }
    }
    let handle = rule
        .get("handle")
        .map_or_else(|| "?".to_owned(), ToString::to_string);
    let mut text = format!(
        "handle {handle}: {}",
        serde_json::Value::from(exprs.to_vec())
    );
    if text.len() > MAX_RULE_TEXT {
        let mut end = MAX_RULE_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    ForwardRule {
        text,
        conditional,
        action,
    }
}

/// The legacy tables as they stand, counters and comments left out: a change of it is a
/// change of their rules or policies.
fn legacy_fingerprint() -> String {
    let mut out = String::new();
    for (names, tool) in [
        ("/proc/net/ip_tables_names", "iptables-legacy-save"),
        ("/proc/net/ip6_tables_names", "ip6tables-legacy-save"),
    ] {
        if !legacy_filter_exists(names) {
            continue;
        }
        match run(tool, &["-t", "filter"]) {
            Ok(Some(text)) => {
                for line in text.lines().filter(|l| !l.starts_with('#')) {
                    // `:CHAIN POLICY [packets:bytes]`: the counters change with traffic.
                    let line = line.split_once(" [").map_or(line, |(head, _)| head);
                    out.push_str(line);
                    out.push('\n');
                }
            }
            Ok(None) => out.push_str("missing tool\n"),
            Err(why) => {
                out.push_str(&why);
                out.push('\n');
            }
        }
    }
    out
}

/// Subscribed to nftables' change notifications of this network namespace; reads time out
/// after [`LEGACY_POLL`] so the legacy tables are polled between them.
struct Notifications {
    fd: OwnedFd,
}

impl Notifications {
    fn open() -> io::Result<Self> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )?;
        bind(
            fd.as_raw_fd(),
            &NetlinkAddr::new(0, 1 << (NFNLGRP_NFTABLES - 1)),
        )?;
        let poll = TimeVal::new(
            i64::try_from(LEGACY_POLL.as_secs()).unwrap_or(1),
            i64::from(LEGACY_POLL.subsec_micros()),
        );
        setsockopt(&fd, sockopt::ReceiveTimeout, &poll)?;
        Ok(Self { fd })
    }

    /// Waits (at most [`LEGACY_POLL`]) for a notification; then, [`DEBOUNCE`] later, drains
    /// the rest of the burst. Whether there was one.
    fn wait(&self) -> io::Result<bool> {
        let mut buffer = [0u8; 8192];
        let changed = match recv(self.fd.as_raw_fd(), &mut buffer, MsgFlags::empty()) {
            Ok(_) => true,
            // The kernel dropped notifications for us: something changed all the same.
            Err(Errno::ENOBUFS) => true,
            Err(Errno::EAGAIN | Errno::EINTR) => false,
            Err(errno) => return Err(errno.into()),
        };
        if changed {
            std::thread::sleep(DEBOUNCE);
            // Bounded: under a steady stream of changes the re-read still comes; what is left
            // wakes the next wait, which reads again.
            for _ in 0..MAX_DRAINED {
                match recv(self.fd.as_raw_fd(), &mut buffer, MsgFlags::MSG_DONTWAIT) {
                    Ok(_) | Err(Errno::ENOBUFS | Errno::EINTR) => {}
                    Err(_) => break,
                }
            }
        }
        Ok(changed)
    }
}

/// Starts the watch on a thread of its own: `changed` gets each new decision (not the same one
/// twice; `current` is the one the caller has) and returns false when it wants no more, which
/// ends the thread. The thread runs in the caller's network namespace (the node's).
pub fn watch(
    current: ForwardPolicy,
    mut changed: impl FnMut(ForwardPolicy) -> bool + Send + 'static,
) -> io::Result<std::thread::JoinHandle<()>> {
    let notifications = match Notifications::open() {
        Ok(notifications) => Some(notifications),
        Err(error) => {
            warn!(%error, "cannot subscribe to nftables change notifications; the forwarding \
                policy is read again every {LEGACY_POLL:?} instead");
            None
        }
    };
    std::thread::Builder::new()
        .name("forward-policy".into())
        .spawn(move || {
            let mut last = current;
            let mut legacy = legacy_fingerprint();
            // Read once as soon as the subscription stands: a change between the caller's
            // reading and the subscription announced itself to no one.
            let mut first = true;
            loop {
                let notified = match &notifications {
                    _ if first => {
                        first = false;
                        true
                    }
                    Some(notifications) => match notifications.wait() {
                        Ok(notified) => notified,
                        Err(error) => {
                            warn!(%error, "nftables change notifications failed; the \
                                forwarding policy is read every {LEGACY_POLL:?} from now on");
                            std::thread::sleep(LEGACY_POLL);
                            true
                        }
                    },
                    None => {
                        std::thread::sleep(LEGACY_POLL);
                        true
                    }
                };
                let legacy_now = legacy_fingerprint();
                if !notified && legacy_now == legacy {
                    continue;
                }
                legacy = legacy_now;
                let policy = read();
                if policy == last {
                    continue;
                }
                debug!(before = %last, now = %policy, "the node's forwarding policy changed");
                last = policy.clone();
                if !changed(policy) {
                    return;
                }
            }
        })
}

#[cfg(test)]
mod tests;
