//! What the iptables dataplane is configured with (the iptables-relevant part of kube-proxy's
//! KubeProxyConfiguration, with its defaults) and the per-family facts the rule generator reads.

use std::{net::IpAddr, time::Duration};

use ipnet::IpNet;

use super::localdetect::{DetectLocalMode, LocalDetector};
use proxy_kernel::node::{FamilySettings, NodePortAddressSet};
use proxy_model::desired::IpFamily;

/// kube-proxy's `largeClusterEndpointsThreshold`.
pub const LARGE_CLUSTER_ENDPOINTS_THRESHOLD: usize = 1000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IptablesConfig {
    /// `--iptables-masquerade-bit` (0..=31); the mark is `1 << bit`.
    pub masquerade_bit: u8,
    /// `--masquerade-all`: SNAT all traffic to ClusterIPs.
    pub masquerade_all: bool,
    /// `--detect-local-mode` with its input (`--cluster-cidr`, node podCIDRs, interface names).
    pub detect_local: DetectLocalMode,
    /// `--nodeport-addresses`; empty (or a zero CIDR of the family) means every local address.
    pub node_port_addresses: Vec<IpNet>,
    /// `--iptables-localhost-nodeports` (IPv4 only; sets `route_localnet`).
    pub localhost_node_ports: bool,
    /// Total endpoints above which rule comments are dropped and stale chains are deleted at
    /// most once per `sync_period`.
    pub large_cluster_threshold: usize,
    /// `--iptables-sync-period`.
    pub sync_period: Duration,
    /// `--iptables-min-sync-period`.
    pub min_sync_period: Duration,
    /// A full (non-partial) sync at least this often (kube-proxy's `FullSyncPeriod`).
    pub full_sync_period: Duration,
}

impl Default for IptablesConfig {
    fn default() -> Self {
        Self {
            masquerade_bit: 14,
            masquerade_all: false,
            detect_local: DetectLocalMode::default(),
            node_port_addresses: Vec::new(),
            localhost_node_ports: true,
            large_cluster_threshold: LARGE_CLUSTER_ENDPOINTS_THRESHOLD,
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
            full_sync_period: Duration::from_secs(3600),
        }
    }
}

impl IptablesConfig {
    /// The mark as kube-proxy formats it: Go's `%#08x`, which zero-pads the digits to 8 and then
    /// prefixes `0x` (bit 14 → `0x00004000`).
    pub fn masquerade_mark(&self) -> String {
        format!("0x{:08x}", 1u32 << (self.masquerade_bit & 31))
    }
}

/// Which destinations the NodePort rules accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address (`-m addrtype --dst-type LOCAL`).
    All,
    /// These node addresses (those inside the configured CIDRs), one rule each.
    Ips(Vec<IpAddr>),
}

/// Everything the rule generator needs for one IP family, resolved from the configuration and
/// from probing the host (iptables features, sysctls, nfacct counters, interface addresses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyRules {
    pub family: IpFamily,
    pub mark: String,
    pub masquerade_all: bool,
    pub local_detector: LocalDetector,
    /// The node's primary address of this family (loadBalancerSourceRanges "allow from node").
    pub node_ip: Option<IpAddr>,
    pub node_ports: NodePortAddresses,
    /// Always false for IPv6 (kube-proxy builds the IPv6 proxier with it off).
    pub localhost_node_ports: bool,
    /// `MASQUERADE --random-fully` is supported (iptables ≥ 1.6.2).
    pub random_fully: bool,
    /// `nf_conntrack_tcp_be_liberal` is set: no INVALID drop rule.
    pub conntrack_tcp_liberal: bool,
    /// nfacct counter `ct_state_invalid_dropped_pkts` exists.
    pub nfacct_invalid: bool,
    /// nfacct counter `localhost_nps_accepted_pkts` exists.
    pub nfacct_localhost: bool,
    pub large_cluster_threshold: usize,
}

impl FamilyRules {
    /// The family's rules context from the configuration and what was found on the host.
    /// `interface_ips` are the node's addresses (every interface) for `--nodeport-addresses`.
    pub fn new(
        config: &IptablesConfig,
        family: IpFamily,
        node_ip: Option<IpAddr>,
        interface_ips: &[IpAddr],
        host: &HostFeatures,
    ) -> Self {
        Self {
            family,
            mark: config.masquerade_mark(),
            masquerade_all: config.masquerade_all,
            local_detector: LocalDetector::for_family(&config.detect_local, family),
            node_ip,
            node_ports: node_port_addresses(&config.node_port_addresses, family, interface_ips),
            // Upstream's NewProxier: localhost NodePorts only for IPv4, and only when the
            // NodePort CIDRs contain an IPv4 loopback address (so never with `primary`).
            localhost_node_ports: config.localhost_node_ports
                && family == IpFamily::V4
                && NodePortAddressSet::new(family, &config.node_port_addresses)
                    .contains_ipv4_loopback,
            random_fully: host.random_fully,
            conntrack_tcp_liberal: host.conntrack_tcp_liberal,
            nfacct_invalid: host.nfacct_invalid,
            nfacct_localhost: host.nfacct_localhost,
            large_cluster_threshold: config.large_cluster_threshold,
        }
    }
}

impl FamilyRules {
    /// Takes the node-dependent fields from the node settings (the Node object and the host's
    /// current addresses): local-traffic detection, node IP, NodePort addresses, localhost
    /// NodePorts.
    pub fn set_node(&mut self, settings: &FamilySettings, detect_local: &DetectLocalMode) {
        self.local_detector = LocalDetector::for_family(detect_local, self.family);
        self.node_ip = Some(settings.node_ip);
        self.node_ports = if settings.node_ports.match_all {
            NodePortAddresses::All
        } else {
            NodePortAddresses::Ips(settings.node_port_ips.clone())
        };
        self.localhost_node_ports = settings.localhost_node_ports;
    }
}

/// Facts probed from the host once at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostFeatures {
    pub random_fully: bool,
    pub conntrack_tcp_liberal: bool,
    pub nfacct_invalid: bool,
    pub nfacct_localhost: bool,
}

/// kube-proxy's `NewNodePortAddresses` + `GetNodeIPs`: CIDRs of the other family are ignored;
/// none left, or a zero CIDR, means every address. Matching addresses are sorted (kube-proxy's
/// order is a Go map's, i.e. random).
pub fn node_port_addresses(
    cidrs: &[IpNet],
    family: IpFamily,
    interface_ips: &[IpAddr],
) -> NodePortAddresses {
    let set = NodePortAddressSet::new(family, cidrs);
    if set.match_all {
        return NodePortAddresses::All;
    }
    NodePortAddresses::Ips(set.matching(interface_ips))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mark_uses_go_alternate_hex_formatting() {
        assert_eq!(IptablesConfig::default().masquerade_mark(), "0x00004000");
        let config = IptablesConfig {
            masquerade_bit: 0,
            ..IptablesConfig::default()
        };
        assert_eq!(config.masquerade_mark(), "0x00000001");
    }

    #[test]
    fn node_port_addresses_filter_by_family() {
        let ips: Vec<IpAddr> = [
            "127.0.0.1",
            "192.168.0.2",
            "192.168.1.2",
            "2001:db8::1",
            "2001:db8:1::2",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let cidrs: Vec<IpNet> = ["192.168.0.0/24", "2001:db8::/64"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(
            node_port_addresses(&cidrs, IpFamily::V4, &ips),
            NodePortAddresses::Ips(vec!["192.168.0.2".parse().unwrap()])
        );
        assert_eq!(
            node_port_addresses(&cidrs, IpFamily::V6, &ips),
            NodePortAddresses::Ips(vec!["2001:db8::1".parse().unwrap()])
        );
        assert_eq!(
            node_port_addresses(&[], IpFamily::V4, &ips),
            NodePortAddresses::All
        );
        let zero: Vec<IpNet> = vec!["0.0.0.0/0".parse().unwrap()];
        assert_eq!(
            node_port_addresses(&zero, IpFamily::V4, &ips),
            NodePortAddresses::All
        );
    }
}
