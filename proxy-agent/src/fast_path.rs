//! `--tc-fast-path=auto` (the default): the eBPF mode takes the fast path — and with
//! `--bpf-xdp auto` XDP — only while the node has no forwarding policy the fast path would
//! bypass (`proxy_model::forward_policy`). The rulesets are read once before the dataplane
//! starts, so its first attach already takes the right path; then a thread watches them
//! (`proxy_kernel::forward_policy::watch`) and hands each new decision to the loop, which
//! switches the path at once ([`crate::dataplane::Dataplane::set_fast_path`]).

use tokio::sync::mpsc;
use tracing::{info, warn};

use proxy_model::{
    config::{Config, ProxyMode, ebpf_settings::FastPathSetting},
    forward_policy::ForwardPolicy,
};

/// Decisions queued for the loop: each replaces the one before, so a few are plenty.
const QUEUE: usize = 4;

/// The path the dataplane starts on, and the decision behind it with `auto`.
#[derive(Debug, Clone)]
pub struct FastPathStart {
    pub on: bool,
    /// `auto` in eBPF mode: the forwarding policy read at start.
    pub policy: Option<ForwardPolicy>,
}

/// Decides the starting path (blocking with `auto`: runs the ruleset tools).
pub fn start(config: &Config) -> FastPathStart {
    match (config.mode, config.ebpf.tc_fast_path) {
        (ProxyMode::Ebpf, FastPathSetting::Auto) => {
            let policy = proxy_kernel::forward_policy::read();
            log_decision(&policy);
            FastPathStart {
                on: policy.fast_path_safe(),
                policy: Some(policy),
            }
        }
        (_, setting) => FastPathStart {
            on: setting == FastPathSetting::On,
            policy: None,
        },
    }
}

/// Starts the watch (with `auto`): the receiver gets each changed decision. `None` when there
/// is nothing to watch or the thread cannot start (logged; the path then stays as it started).
pub fn watch(start: &FastPathStart) -> Option<mpsc::Receiver<ForwardPolicy>> {
    let current = start.policy.clone()?;
    let (sender, receiver) = mpsc::channel(QUEUE);
    match proxy_kernel::forward_policy::watch(current, move |policy| {
        // Closed: the agent is shutting down, and the thread ends.
        sender.blocking_send(policy).is_ok()
    }) {
        Ok(_thread) => Some(receiver),
        Err(error) => {
            warn!(%error, "cannot start the forwarding policy watch: the path chosen at start \
                stays until the agent restarts");
            None
        }
    }
}

/// The log line of a decision: taking the fast path is news, leaving it is a warning worth
/// seeing (traffic that was fast now pays for netfilter).
pub fn log_decision(policy: &ForwardPolicy) {
    if policy.fast_path_safe() {
        info!(
            %policy,
            "--tc-fast-path=auto: external Service traffic takes the fast path (XDP with \
             --bpf-xdp auto): nothing in the node's forward chains would be bypassed"
        );
    } else {
        warn!(
            %policy,
            "--tc-fast-path=auto: external Service traffic takes the netfilter path, so that \
             the node's forwarding policy applies to it"
        );
    }
}
