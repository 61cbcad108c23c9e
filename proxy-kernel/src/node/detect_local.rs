//! [`DetectLocalMode`]: how traffic from this node's pods is told apart (kube-proxy's
//! `--detect-local-mode`), resolved with the node's facts (podCIDRs for `NodeCIDR`). Both
//! dataplanes read it: iptables as rule arguments (`dataplane::iptables::localdetect`), eBPF as
//! the tc programs' node config.

use ipnet::IpNet;

/// The configured mode, for both families.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetectLocalMode {
    /// `ClusterCIDR` (kube-proxy's default): pods are the `--cluster-cidr` ranges.
    ClusterCidr(Vec<IpNet>),
    /// `NodeCIDR`: pods are this node's `spec.podCIDRs`.
    NodeCidr(Vec<IpNet>),
    /// `BridgeInterface`: pod traffic arrives on this bridge (`--pod-bridge-interface`).
    BridgeInterface(String),
    /// `InterfaceNamePrefix`: pod traffic arrives on interfaces with this prefix.
    InterfaceNamePrefix(String),
}

impl Default for DetectLocalMode {
    fn default() -> Self {
        DetectLocalMode::ClusterCidr(Vec::new())
    }
}
