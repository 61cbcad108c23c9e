//! [`ProxyMode`]: which dataplane runs. Its own module because the configuration, the node
//! services (`/proxyMode`, which metrics exist) and the dataplanes all name it, and none of
//! them should depend on another for it.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Socket-level load balancing with eBPF programs on the cgroup2 hierarchy.
    Ebpf,
    /// kube-proxy's iptables rules, rule for rule.
    Iptables,
}

impl ProxyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Ebpf => "ebpf",
            ProxyMode::Iptables => "iptables",
        }
    }
}

impl fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
