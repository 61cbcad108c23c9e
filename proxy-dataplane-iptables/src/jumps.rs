//! The jumps from the built-in chains into ours (kube-proxy's `iptablesJumpChains` and
//! `iptablesKubeletJumpChains`). They are ensured one by one with `iptables -C`/`-I` on full
//! syncs, never through iptables-restore, so other software's rules in the built-in chains stay
//! untouched.

use super::chains::{
    KUBE_EXTERNAL_SERVICES, KUBE_FIREWALL, KUBE_FORWARD, KUBE_NODEPORTS, KUBE_POSTROUTING,
    KUBE_PROXY_FIREWALL, KUBE_SERVICES,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JumpRule {
    pub table: &'static str,
    pub source: &'static str,
    pub extra_args: &'static [&'static str],
    /// `None` for kubelet's KUBE-FIREWALL jumps, which carry no comment.
    pub comment: Option<&'static str>,
    pub target: &'static str,
}

const CT_NEW: &[&str] = &["-m", "conntrack", "--ctstate", "NEW"];

/// In kube-proxy's order; each is prepended, so when several are missing the last ends up first.
pub const JUMP_RULES: &[JumpRule] = &[
    jump(
        "filter",
        "INPUT",
        CT_NEW,
        "kubernetes externally-visible service portals",
        KUBE_EXTERNAL_SERVICES,
    ),
    jump(
        "filter",
        "FORWARD",
        CT_NEW,
        "kubernetes externally-visible service portals",
        KUBE_EXTERNAL_SERVICES,
    ),
    jump(
        "filter",
        "INPUT",
        &[],
        "kubernetes health check service ports",
        KUBE_NODEPORTS,
    ),
    jump(
        "filter",
        "FORWARD",
        CT_NEW,
        "kubernetes service portals",
        KUBE_SERVICES,
    ),
    jump(
        "filter",
        "OUTPUT",
        CT_NEW,
        "kubernetes service portals",
        KUBE_SERVICES,
    ),
    jump(
        "filter",
        "FORWARD",
        &[],
        "kubernetes forwarding rules",
        KUBE_FORWARD,
    ),
    jump(
        "filter",
        "INPUT",
        CT_NEW,
        "kubernetes load balancer firewall",
        KUBE_PROXY_FIREWALL,
    ),
    jump(
        "filter",
        "OUTPUT",
        CT_NEW,
        "kubernetes load balancer firewall",
        KUBE_PROXY_FIREWALL,
    ),
    jump(
        "filter",
        "FORWARD",
        CT_NEW,
        "kubernetes load balancer firewall",
        KUBE_PROXY_FIREWALL,
    ),
    jump(
        "nat",
        "OUTPUT",
        &[],
        "kubernetes service portals",
        KUBE_SERVICES,
    ),
    jump(
        "nat",
        "PREROUTING",
        &[],
        "kubernetes service portals",
        KUBE_SERVICES,
    ),
    jump(
        "nat",
        "POSTROUTING",
        &[],
        "kubernetes postrouting rules",
        KUBE_POSTROUTING,
    ),
];

/// kubelet's own jumps, duplicated (IPv4 with localhost NodePorts only); never removed by
/// cleanup because kubelet owns them.
pub const KUBELET_JUMP_RULES: &[JumpRule] = &[
    JumpRule {
        table: "filter",
        source: "INPUT",
        extra_args: &[],
        comment: None,
        target: KUBE_FIREWALL,
    },
    JumpRule {
        table: "filter",
        source: "OUTPUT",
        extra_args: &[],
        comment: None,
        target: KUBE_FIREWALL,
    },
];

const fn jump(
    table: &'static str,
    source: &'static str,
    extra_args: &'static [&'static str],
    comment: &'static str,
    target: &'static str,
) -> JumpRule {
    JumpRule {
        table,
        source,
        extra_args,
        comment: Some(comment),
        target,
    }
}

impl JumpRule {
    /// The rule's arguments after the chain name, as separate argv entries (no quoting).
    pub fn args(&self) -> Vec<&'static str> {
        let mut args = self.extra_args.to_vec();
        if let Some(comment) = self.comment {
            args.extend(["-m", "comment", "--comment", comment]);
        }
        args.extend(["-j", self.target]);
        args
    }

    /// The rule as a restore/save line (`-A CHAIN …`, comment quoted), e.g. for tests.
    pub fn to_line(&self) -> String {
        let args: Vec<String> = self
            .args()
            .into_iter()
            .map(|a| {
                if a.contains(' ') {
                    format!("\"{a}\"")
                } else {
                    a.to_owned()
                }
            })
            .collect();
        format!("-A {} {}", self.source, args.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_services_jump_prints_like_iptables_save() {
        assert_eq!(
            JUMP_RULES[0].to_line(),
            "-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES"
        );
    }
}
