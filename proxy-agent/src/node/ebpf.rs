//! The tc programs' node facts from the node settings: which interfaces are external, the
//! `KPR_NODE_CONFIG` entry (SNAT addresses, local-traffic detection, masqueradeAll, localhost
//! NodePorts) and the `KPR_NODE_ADDRS` set. `dataplane/ebpf/tc.rs` writes them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use proxy_common::{NodeConfig, node_flags};

use super::{
    addresses::{Interface, is_global_unicast},
    settings::NodeSettings,
};
use proxy_common::addr::{ip4_to_map, ip6_to_map};

use super::DetectLocalMode;
use crate::ip_family::IpFamily;

/// Whether `name` is a pod interface by `--detect-local-mode` BridgeInterface /
/// InterfaceNamePrefix (upstream's `-i <bridge>` / `-i <prefix>+`; an empty name or prefix is
/// the no-op detector).
pub fn is_pod_interface(mode: &DetectLocalMode, name: &str) -> bool {
    match mode {
        DetectLocalMode::BridgeInterface(bridge) => !bridge.is_empty() && name == bridge,
        DetectLocalMode::InterfaceNamePrefix(prefix) => {
            !prefix.is_empty() && name.starts_with(prefix.as_str())
        }
        DetectLocalMode::ClusterCidr(_) | DetectLocalMode::NodeCidr(_) => false,
    }
}

/// The interfaces that get the external program: `--interfaces`, else those with a global
/// unicast address (pod veths normally have none), except pod interfaces by name — a pod
/// bridge usually holds the pods' gateway address, but traffic arriving there is pod traffic.
pub fn external_interfaces(
    configured: &[String],
    detect_local: &DetectLocalMode,
    all: &BTreeMap<String, Interface>,
) -> BTreeSet<String> {
    if !configured.is_empty() {
        return configured.iter().cloned().collect();
    }
    all.values()
        .filter(|i| !i.loopback && i.addrs.iter().any(is_global_unicast))
        .filter(|i| !is_pod_interface(detect_local, &i.name))
        .map(|i| i.name.clone())
        .collect()
}

/// The `KPR_NODE_CONFIG` entry and the `KPR_NODE_ADDRS` addresses.
pub fn node_config(
    settings: &NodeSettings,
    all: &BTreeMap<String, Interface>,
    external: &BTreeSet<String>,
) -> (NodeConfig, Vec<IpAddr>) {
    let mut config = NodeConfig::default();
    // SNAT to the first global address of the (first) external interface, per family: the
    // address replies from any backend can be routed back to.
    let external_addrs = external
        .iter()
        .filter_map(|name| all.get(name))
        .flat_map(|i| i.addrs.iter())
        .filter(|a| is_global_unicast(a));
    for addr in external_addrs {
        match addr {
            IpAddr::V4(a) if config.snat4 == 0 => config.snat4 = ip4_to_map(*a),
            IpAddr::V6(a) if config.snat6 == [0; 4] => config.snat6 = ip6_to_map(*a),
            _ => {}
        }
    }
    // The local-traffic detector of the KUBE-SVC masquerade rule (localdetector.go): the
    // first CIDR of each family (ClusterCIDR: clusterCIDR; NodeCIDR: the Node's podCIDRs), or
    // the arrival interface.
    match &settings.detect_local {
        DetectLocalMode::ClusterCidr(cidrs) | DetectLocalMode::NodeCidr(cidrs) => {
            for family in IpFamily::ALL {
                match cidrs.iter().find(|c| IpFamily::of(&c.addr()) == family) {
                    Some(IpNet::V4(net)) => {
                        config.flags |= node_flags::CLUSTER_CIDR4;
                        config.cluster4 = ip4_to_map(net.network());
                        config.cluster4_mask = ip4_to_map(net.netmask());
                    }
                    Some(IpNet::V6(net)) => {
                        config.flags |= node_flags::CLUSTER_CIDR6;
                        config.cluster6 = ip6_to_map(net.network());
                        config.cluster6_mask = ip6_to_map(net.netmask());
                    }
                    None => {}
                }
            }
        }
        DetectLocalMode::BridgeInterface(name) | DetectLocalMode::InterfaceNamePrefix(name) => {
            if !name.is_empty() {
                config.flags |= node_flags::LOCAL_BY_INTERFACE;
            }
        }
    }
    if settings.masquerade_all {
        config.flags |= node_flags::MASQUERADE_ALL;
    }
    // Match-all with localhost NodePorts: all of 127.0.0.0/8 (kube-proxy's `--dst-type LOCAL`
    // jump without `! -d 127.0.0.0/8`); explicit CIDRs list their loopback addresses instead.
    if settings.v4.node_ports.match_all && settings.v4.localhost_node_ports {
        config.flags |= node_flags::LOCALHOST_NODEPORTS;
    }
    let addrs: BTreeSet<IpAddr> = IpFamily::ALL
        .into_iter()
        .flat_map(|family| settings.family(family).datapath_ips())
        .collect();
    (config, addrs.into_iter().collect())
}
