//! What the host offers: the iptables backend in use (nft or legacy, decided like the
//! `iptables-wrapper` in kube-proxy's image), the iptables version (wait flags,
//! `--random-fully`), conntrack's TCP liberal mode, and the node's addresses.

use std::{net::IpAddr, process::Command};

use proxy_model::desired::IpFamily;

/// Which xtables backend the tools should use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `iptables-nft` & co.
    Nft,
    /// `iptables-legacy` & co.
    Legacy,
    /// Plain `iptables` (no `-nft`/`-legacy` variants installed).
    Default,
}

impl Backend {
    pub fn binary_infix(self) -> Option<&'static str> {
        match self {
            Backend::Nft => Some("nft"),
            Backend::Legacy => Some("legacy"),
            Backend::Default => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl Version {
    /// From `iptables v1.8.9 (nf_tables)` (or `iptables-restore v1.8.9 …`).
    pub fn parse(text: &str) -> Option<Self> {
        let start = text.find(" v")? + 2;
        let digits: String = text[start..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let mut parts = digits.split('.').map(|p| p.parse::<u32>().ok());
        Some(Version(
            parts.next()??,
            parts.next().flatten().unwrap_or(0),
            parts.next().flatten().unwrap_or(0),
        ))
    }
}

/// The first version with `MASQUERADE --random-fully` (and restore's `-w <secs> -W`).
pub const RANDOM_FULLY_MIN: Version = Version(1, 6, 2);

fn stdout_of(program: &str, args: &[&str]) -> Option<String> {
    let output = Command::new(program).args(args).output().ok()?;
    Some(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn exists(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The iptables-wrapper decision: kubelet's `KUBE-IPTABLES-HINT` / `KUBE-KUBELET-CANARY` in the
/// nft mangle table, else in legacy, else whichever backend holds more rules (ties: nft).
pub fn detect_backend() -> Backend {
    if !exists("iptables-nft") || !exists("iptables-legacy") {
        return Backend::Default;
    }
    let save = |infix: &str, args: &[&str]| -> String {
        ["iptables", "ip6tables"]
            .iter()
            .filter_map(|base| stdout_of(&format!("{base}-{infix}-save"), args))
            .collect()
    };
    // Legacy is never asked for `-t mangle`: that would create the table in the kernel.
    if has_kubelet_chains(&save("nft", &["-t", "mangle"])) {
        return Backend::Nft;
    }
    let legacy = save("legacy", &[]);
    if has_kubelet_chains(&legacy) {
        return Backend::Legacy;
    }
    if rule_count(&legacy) > rule_count(&save("nft", &[])) {
        Backend::Legacy
    } else {
        Backend::Nft
    }
}

pub fn has_kubelet_chains(save: &str) -> bool {
    save.lines()
        .any(|l| l.starts_with(":KUBE-IPTABLES-HINT") || l.starts_with(":KUBE-KUBELET-CANARY"))
}

pub fn rule_count(save: &str) -> usize {
    save.lines().filter(|l| l.starts_with('-')).count()
}

/// The version of the family's `iptables` with this backend.
pub fn version(family: IpFamily, backend: Backend) -> Option<Version> {
    let base = match family {
        IpFamily::V4 => "iptables",
        IpFamily::V6 => "ip6tables",
    };
    let program = match backend.binary_infix() {
        Some(infix) => format!("{base}-{infix}"),
        None => base.to_owned(),
    };
    Version::parse(&stdout_of(&program, &["--version"])?)
}

/// `nf_conntrack_tcp_be_liberal` is set (per network namespace); unreadable counts as unset.
pub fn conntrack_tcp_liberal() -> bool {
    std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal")
        .is_ok_and(|v| v.trim() != "0")
}

/// Every address on this node's interfaces (for `--nodeport-addresses`).
pub fn interface_addresses() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = addrs
        .filter_map(|ifaddr| {
            let addr = ifaddr.address?;
            if let Some(v4) = addr.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                addr.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

/// The node's primary address of a family when none is configured: the first global unicast
/// interface address (kube-proxy takes it from the Node object or the host name).
pub fn primary_address(ips: &[IpAddr], family: IpFamily) -> Option<IpAddr> {
    ips.iter().copied().find(|ip| {
        IpFamily::of(ip) == family
            && !ip.is_loopback()
            && !ip.is_unspecified()
            && match ip {
                IpAddr::V4(v4) => !v4.is_link_local(),
                IpAddr::V6(v6) => !v6.is_unicast_link_local(),
            }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_from_tool_output() {
        assert_eq!(
            Version::parse("iptables v1.8.9 (nf_tables)"),
            Some(Version(1, 8, 9))
        );
        assert_eq!(
            Version::parse("iptables-restore v1.6.2"),
            Some(Version(1, 6, 2))
        );
        assert_eq!(Version::parse("ip6tables v1.4"), Some(Version(1, 4, 0)));
        assert_eq!(Version::parse("garbage"), None);
        assert!(Version(1, 8, 9) >= RANDOM_FULLY_MIN);
        assert!(Version(1, 6, 1) < RANDOM_FULLY_MIN);
    }

    #[test]
    fn kubelet_hint_and_rule_counting() {
        let save =
            "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n-A FOO -j ACCEPT\n-A BAR -j DROP\nCOMMIT\n";
        assert!(has_kubelet_chains(save));
        assert!(!has_kubelet_chains("*mangle\n:KUBE-PROXY-CANARY - [0:0]\n"));
        assert_eq!(rule_count(save), 2);
    }

    #[test]
    fn primary_address_skips_loopback_and_link_local() {
        let ips: Vec<IpAddr> = [
            "127.0.0.1",
            "169.254.1.1",
            "10.0.0.5",
            "fe80::1",
            "2001:db8::1",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        assert_eq!(
            primary_address(&ips, IpFamily::V4),
            Some("10.0.0.5".parse().unwrap())
        );
        assert_eq!(
            primary_address(&ips, IpFamily::V6),
            Some("2001:db8::1".parse().unwrap())
        );
    }
}
