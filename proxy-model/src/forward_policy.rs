//! Whether the node has a forwarding policy that the eBPF fast path (and XDP with it) would
//! bypass: `--tc-fast-path=auto` takes the fast path only while it has none.
//!
//! The fast path redirects translated external traffic past the host's netfilter FORWARD; on
//! the netfilter path that traffic goes through it. So the fast path is only the same service
//! as the netfilter path when FORWARD lets everything through: every base chain on the
//! `forward` hook (iptables-legacy's and iptables-nft's filter FORWARD, any nftables chain
//! with `hook forward`) has policy accept and holds nothing but unconditional accepts before
//! its end. Anything else counts as policy, on purpose also what only *could* filter:
//!
//! - a conditional ACCEPT (flannel's `-A FORWARD -s 10.244.0.0/16 -j ACCEPT`): harmless with
//!   an accept policy on its own, but it says a CNI manages FORWARD, and in nftables an accept
//!   in one base chain does not spare a packet another base chain's drop;
//! - a jump to a user chain (Docker's `DOCKER-USER`), whatever that chain holds now: it is
//!   someone's hook for policy, and the watch would have to follow every chain it reaches;
//! - a non-terminating target or statement (LOG, MARK, `meta mark set`): what it does to a
//!   packet would not happen to fast-path packets.
//!
//! The eBPF mode installs no rule of its own in a forward chain (it keeps kube-proxy's emptied
//! nftables tables while their connections drain, whose chains hold no rules), so there is no
//! "our own" exception; what the iptables mode left behind counts as policy until its cleanup
//! removes it, which keeps the netfilter path during a mode switch's drain.
//!
//! The kernel side (`proxy_kernel::forward_policy`) reads the rulesets into [`ForwardChain`]s;
//! [`decide`] is the decision, kept pure so it is tested on real tools' output.

use std::fmt;

/// What a rule does when it matches, as far as the decision cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleAction {
    /// ACCEPT / `accept`: the packet leaves this base chain.
    Accept,
    /// No verdict and no statement (a counter-only rule): nothing happens to the packet.
    Nothing,
    /// Anything else: DROP, REJECT, RETURN, a jump or goto, LOG, a mangle, a queue …
    Other(String),
}

/// One rule of a forward base chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardRule {
    /// The rule as its tool prints it (`-s 10.244.0.0/16 -j ACCEPT`), for the log.
    pub text: String,
    /// Whether it matches only some packets (a match besides comments).
    pub conditional: bool,
    pub action: RuleAction,
}

/// A base chain on the `forward` hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardChain {
    /// Which ruleset: `iptables-legacy (IPv4) filter`, `nftables table inet fw`, …
    pub ruleset: String,
    pub chain: String,
    /// The chain's policy as its tool prints it (`ACCEPT`, `drop`).
    pub policy: String,
    pub rules: Vec<ForwardRule>,
}

impl ForwardChain {
    fn policy_accepts(&self) -> bool {
        self.policy.eq_ignore_ascii_case("accept")
    }
}

/// The decision: no forwarding policy, or the first thing found that is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardPolicy {
    /// Every forward base chain lets everything through: the fast path serves the same.
    None,
    /// A policy the fast path would bypass, described for the log and `inspect features`.
    Found(String),
    /// The rulesets could not be read: assumed present (the netfilter path is the safe one).
    Unknown(String),
}

impl ForwardPolicy {
    /// Whether `--tc-fast-path=auto` takes the fast path.
    pub fn fast_path_safe(&self) -> bool {
        matches!(self, ForwardPolicy::None)
    }
}

impl fmt::Display for ForwardPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ForwardPolicy::None => f.write_str("no forwarding policy"),
            ForwardPolicy::Found(what) => write!(f, "forwarding policy: {what}"),
            ForwardPolicy::Unknown(why) => write!(f, "forwarding policy unknown: {why}"),
        }
    }
}

/// The decision over every forward base chain of the node (in any order; the first offending
/// one in `chains`' order is reported).
pub fn decide(chains: &[ForwardChain]) -> ForwardPolicy {
    for chain in chains {
        if let Some(found) = offending(chain) {
            return ForwardPolicy::Found(found);
        }
    }
    ForwardPolicy::None
}

fn offending(chain: &ForwardChain) -> Option<String> {
    let place = format!("{} chain {}", chain.ruleset, chain.chain);
    for rule in &chain.rules {
        match (&rule.action, rule.conditional) {
            // Nothing after it is reached, the policy included.
            (RuleAction::Accept, false) => return None,
            (RuleAction::Nothing, _) => continue,
            _ => return Some(format!("{place}: rule `{}`", rule.text)),
        }
    }
    if !chain.policy_accepts() {
        return Some(format!("{place}: policy {}", chain.policy));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(text: &str, conditional: bool, action: RuleAction) -> ForwardRule {
        ForwardRule {
            text: text.to_owned(),
            conditional,
            action,
        }
    }

    fn chain(policy: &str, rules: Vec<ForwardRule>) -> ForwardChain {
        ForwardChain {
            ruleset: "iptables-nft (IPv4) filter".to_owned(),
            chain: "FORWARD".to_owned(),
            policy: policy.to_owned(),
            rules,
        }
    }

    #[test]
    fn empty_accepting_chains_are_no_policy() {
        assert_eq!(decide(&[]), ForwardPolicy::None);
        assert_eq!(decide(&[chain("ACCEPT", vec![])]), ForwardPolicy::None);
        assert!(decide(&[chain("accept", vec![])]).fast_path_safe());
    }

    #[test]
    fn a_drop_policy_is_policy() {
        assert_eq!(
            decide(&[chain("DROP", vec![])]),
            ForwardPolicy::Found("iptables-nft (IPv4) filter chain FORWARD: policy DROP".into())
        );
    }

    #[test]
    fn an_unconditional_accept_ends_the_chain_even_before_a_drop() {
        let rules = vec![
            rule("", false, RuleAction::Nothing),
            rule("-j ACCEPT", false, RuleAction::Accept),
            rule("-j DROP", false, RuleAction::Other("DROP".into())),
        ];
        assert_eq!(decide(&[chain("DROP", rules)]), ForwardPolicy::None);
    }

    #[test]
    fn conditional_accepts_jumps_and_statements_are_policy() {
        for r in [
            rule("-s 10.244.0.0/16 -j ACCEPT", true, RuleAction::Accept),
            rule(
                "-j DOCKER-USER",
                false,
                RuleAction::Other("DOCKER-USER".into()),
            ),
            rule("-j LOG", false, RuleAction::Other("LOG".into())),
        ] {
            let text = r.text.clone();
            let decision = decide(&[chain("ACCEPT", vec![r])]);
            assert!(
                matches!(&decision, ForwardPolicy::Found(what) if what.ends_with(&format!("`{text}`"))),
                "{decision:?}"
            );
            assert!(!decision.fast_path_safe());
        }
    }

    #[test]
    fn the_first_offending_chain_is_reported() {
        let mut second = chain("DROP", vec![]);
        second.ruleset = "nftables table inet fw".into();
        second.chain = "forward".into();
        assert_eq!(
            decide(&[chain("ACCEPT", vec![]), second]),
            ForwardPolicy::Found("nftables table inet fw chain forward: policy DROP".into())
        );
    }

    #[test]
    fn unknown_is_not_safe() {
        assert!(!ForwardPolicy::Unknown("nft: not found".into()).fast_path_safe());
    }
}
