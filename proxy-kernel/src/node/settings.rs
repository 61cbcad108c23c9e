//! (Node object, host addresses, configuration) → [`NodeSettings`], pure.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

use super::{
    DetectLocalMode,
    addresses::{Interface, NodePortAddressSet, all_addresses},
};
use proxy_model::{
    config::{Config, DetectLocal, NodePortAddresses},
    ip_family::IpFamily,
    objects::NodeInfo,
};

/// The part of the configuration the node settings depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInputs {
    /// `--bind-address`: overrides the primary node IP unless unspecified.
    pub bind_address: IpAddr,
    pub node_port_addresses: NodePortAddresses,
    pub detect_local: DetectLocal,
    pub cluster_cidrs: Vec<IpNet>,
    /// `iptables.localhostNodePorts` (both modes: the eBPF mode serves the same addresses).
    pub localhost_node_ports: bool,
    pub masquerade_all: bool,
}

impl NodeInputs {
    pub fn from_config(config: &Config) -> Self {
        Self {
            bind_address: config.bind_address,
            node_port_addresses: config.node_port_addresses.clone(),
            detect_local: config.detect_local.clone(),
            cluster_cidrs: config.cluster_cidrs.clone(),
            localhost_node_ports: config.iptables.localhost_node_ports,
            masquerade_all: config.masquerade_all,
        }
    }
}

/// One IP family's node settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilySettings {
    pub family: IpFamily,
    /// The node IP (`detectNodeIPs`): loadBalancerSourceRanges "allow from the node" rules.
    pub node_ip: IpAddr,
    /// `nodePortAddresses` for this family (after `primary` is resolved).
    pub node_ports: NodePortAddressSet,
    /// The host addresses inside `node_ports` (upstream's `GetNodeIPs`); every address of the
    /// family with `match_all`.
    pub node_port_ips: Vec<IpAddr>,
    /// Localhost NodePorts are served: IPv4 only, `localhostNodePorts` on and the CIDRs contain
    /// an IPv4 loopback address (upstream's iptables `NewProxier`; it then sets
    /// `route_localnet`).
    pub localhost_node_ports: bool,
}

impl FamilySettings {
    /// The addresses the tc datapath answers NodePorts on (`KPR_NODE_ADDRS`): `node_port_ips`
    /// without loopback addresses that are not served (IPv6 `::1` never is, IPv4 only with
    /// localhost NodePorts), and with `match_all` without any loopback address (the
    /// `LOCALHOST_NODEPORTS` node flag stands for all of 127.0.0.0/8).
    pub fn datapath_ips(&self) -> Vec<IpAddr> {
        self.node_port_ips
            .iter()
            .filter(|ip| {
                !ip.is_loopback() || (!self.node_ports.match_all && self.localhost_node_ports)
            })
            .copied()
            .collect()
    }
}

/// Everything the dataplanes and node services need from the Node object and the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSettings {
    /// The Node's `spec.podCIDRs` (unparsable entries left out).
    pub pod_cidrs: Vec<IpNet>,
    /// `--detect-local-mode` with its input resolved (NodeCIDR: the pod CIDRs).
    pub detect_local: DetectLocalMode,
    pub masquerade_all: bool,
    pub v4: FamilySettings,
    pub v6: FamilySettings,
    /// Where health check node ports listen: `[0.0.0.0]` (every address of both families) when
    /// both families match all; else per family its unspecified address (match-all) or its
    /// NodePort addresses (upstream's `newServiceHealthServer`).
    pub health_check_ips: Vec<IpAddr>,
}

impl NodeSettings {
    pub fn family(&self, family: IpFamily) -> &FamilySettings {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }

    /// The settings for `inputs`, this Node (if known) and these host interfaces.
    pub fn compute(
        inputs: &NodeInputs,
        node: Option<&NodeInfo>,
        interfaces: &BTreeMap<String, Interface>,
    ) -> Self {
        let raw_ips = node.map(node_host_ips).unwrap_or_default();
        let (_, v4_ip, v6_ip) = detect_node_ips(&raw_ips, inputs.bind_address);
        let pod_cidrs = node.map(pod_cidrs).unwrap_or_default();
        let cidrs: Vec<IpNet> = match &inputs.node_port_addresses {
            NodePortAddresses::All => Vec::new(),
            NodePortAddresses::Cidrs(cidrs) => cidrs.clone(),
            // server.go: `primary` becomes the node IPs as /32 and /128, loopback ones left
            // out; a family without one then matches all (NewNodePortAddresses' zero CIDR),
            // unless the other entries give it ranges.
            NodePortAddresses::Primary(others) => [v4_ip, v6_ip]
                .into_iter()
                .filter(|ip| !ip.is_loopback())
                .map(IpNet::from)
                .chain(others.iter().copied())
                .collect(),
        };
        let host = all_addresses(interfaces);
        let family = |family: IpFamily, node_ip: IpAddr| {
            let node_ports = NodePortAddressSet::new(family, &cidrs);
            FamilySettings {
                family,
                node_ip,
                node_port_ips: node_ports.matching(&host),
                // The IPv6 proxier is always built with localhostNodePorts off.
                localhost_node_ports: family == IpFamily::V4
                    && inputs.localhost_node_ports
                    && node_ports.contains_ipv4_loopback,
                node_ports,
            }
        };
        let v4 = family(IpFamily::V4, v4_ip);
        let v6 = family(IpFamily::V6, v6_ip);
        let detect_local = match &inputs.detect_local {
            DetectLocal::ClusterCidr => DetectLocalMode::ClusterCidr(inputs.cluster_cidrs.clone()),
            DetectLocal::NodeCidr => DetectLocalMode::NodeCidr(pod_cidrs.clone()),
            DetectLocal::BridgeInterface(name) => DetectLocalMode::BridgeInterface(name.clone()),
            DetectLocal::InterfaceNamePrefix(prefix) => {
                DetectLocalMode::InterfaceNamePrefix(prefix.clone())
            }
        };
        let health_check_ips = health_check_ips(&v4, &v6);
        Self {
            pod_cidrs,
            detect_local,
            masquerade_all: inputs.masquerade_all,
            v4,
            v6,
            health_check_ips,
        }
    }
}

fn health_check_ips(v4: &FamilySettings, v6: &FamilySettings) -> Vec<IpAddr> {
    if v4.node_ports.match_all && v6.node_ports.match_all {
        return vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)];
    }
    let mut ips = Vec::new();
    for (settings, any) in [
        (v4, IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
        (v6, IpAddr::V6(Ipv6Addr::UNSPECIFIED)),
    ] {
        if settings.node_ports.match_all {
            ips.push(any);
        } else {
            ips.extend(settings.node_port_ips.iter().copied());
        }
    }
    ips
}

/// The Node's `spec.podCIDRs`, parsed (upstream reads only `podCIDRs`, not the legacy
/// `podCIDR`; the API server keeps `podCIDRs[0] == podCIDR`).
pub fn pod_cidrs(node: &NodeInfo) -> Vec<IpNet> {
    node.pod_cidrs
        .iter()
        .filter_map(|cidr| cidr.trim().parse::<IpNet>().ok())
        .collect()
}

/// `utilnode.GetNodeHostIPs` (pkg/util/node): the `InternalIP` addresses then the `ExternalIP`
/// ones; the first, plus the first of the other family if any. Empty when there is none.
pub fn node_host_ips(node: &NodeInfo) -> Vec<IpAddr> {
    let of_type = |kind: &'static str| {
        node.addresses
            .iter()
            .filter(move |a| &*a.type_ == kind)
            .filter_map(|a| a.address.trim().parse::<IpAddr>().ok())
    };
    let all: Vec<IpAddr> = of_type("InternalIP").chain(of_type("ExternalIP")).collect();
    let Some(first) = all.first().copied() else {
        return Vec::new();
    };
    let mut ips = vec![first];
    if let Some(other) = all.iter().find(|ip| ip.is_ipv6() != first.is_ipv6()) {
        ips.push(*other);
    }
    ips
}

/// `detectNodeIPs` (cmd/kube-proxy/app/server.go): 127.0.0.1 and ::1 by default; the Node's IPs
/// (the first decides the primary family); a specified `--bind-address` overrides the IP of
/// its family and makes that family primary. Returns (primary family, IPv4 IP, IPv6 IP).
pub fn detect_node_ips(raw: &[IpAddr], bind_address: IpAddr) -> (IpFamily, IpAddr, IpAddr) {
    let mut primary = IpFamily::V4;
    let mut v4 = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let mut v6 = IpAddr::V6(Ipv6Addr::LOCALHOST);
    let mut set = |ip: IpAddr| match ip {
        IpAddr::V4(_) => v4 = ip,
        IpAddr::V6(_) => v6 = ip,
    };
    if let Some(first) = raw.first() {
        primary = IpFamily::of(first);
        set(*first);
        if let Some(second) = raw.get(1) {
            set(*second);
        }
    }
    if !bind_address.is_unspecified() {
        primary = IpFamily::of(&bind_address);
        set(bind_address);
    }
    (primary, v4, v6)
}
