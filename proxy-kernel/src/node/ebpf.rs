//! The tc programs' node facts from the node settings: which interfaces are external, the
//! `KPR_NODE_CONFIG` entry (SNAT addresses, local-traffic detection, masqueradeAll, localhost
//! NodePorts) and the `KPR_NODE_ADDRS` set. `dataplane/ebpf/tc.rs` writes them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use proxy_common::{NodeConfig, SnatAddrs, node_flags};

use super::{
    addresses::{Interface, is_global_unicast},
    settings::NodeSettings,
};
use proxy_common::addr::{ip4_to_map, ip6_to_map};

use super::DetectLocalMode;
use proxy_model::ip_family::IpFamily;

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

/// Which tc programs an interface gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcRole {
    /// `kpr_tc_external` on ingress: Service traffic from outside, replies of remote backends.
    External,
    /// `kpr_tc_reply` on ingress: replies of local backends (pod veths, container bridges,
    /// tunnels, interfaces that are down).
    Pod,
    /// Nothing: loopback, and links whose packets do not start with an Ethernet header
    /// (WireGuard, IPIP, GRE, TUN, ...), which the tc programs' parser would misread.
    Untouched,
}

/// Link kinds that never get the external program by default: container and pod networks
/// (a bridge — `docker0`, `cni0`, `cbr0` — unless a physical port makes it the node's uplink,
/// see `bridge_has_uplink`), overlay tunnels between nodes, TUN/TAP devices of VMs and
/// userspace tunnels, and dummies holding service addresses (`kube-ipvs0`, `nodelocaldns`),
/// where no packet arrives. Their addresses must not become the SNAT address either.
const NOT_EXTERNAL_KINDS: &[&str] = &[
    "bridge",
    "vxlan",
    "geneve",
    "gretap",
    "ip6gretap",
    "erspan",
    "ip6erspan",
    "tun",
    "dummy",
    "ipip",
    "sit",
    "gre",
    "ip6gre",
    "ip6tnl",
    "vti",
    "vti6",
    "xfrm",
    "wireguard",
    "bareudp",
];

/// Port kinds that make a bridge a container network rather than the node's uplink.
const CONTAINER_PORT_KINDS: &[&str] = &["veth", "tun", "dummy", "vxlan", "geneve", "gretap"];

/// The role of `interface` among `all`: `--interfaces` when set (an interface listed there is
/// external while it is up), else external when it is up, holds a global unicast address, is
/// not a pod interface by `--detect-local-mode` (a pod bridge usually holds the pods' gateway
/// address, but traffic arriving there is pod traffic) and is not of a kind in
/// `NOT_EXTERNAL_KINDS`. A veth stays eligible: a node in a container (kind) has a veth as
/// its uplink, while pod veths carry no global address (or are named by the detector). Links
/// without an Ethernet header get nothing, even when listed.
pub fn tc_role(
    configured: &[String],
    detect_local: &DetectLocalMode,
    interface: &Interface,
    all: &BTreeMap<String, Interface>,
) -> TcRole {
    if interface.loopback {
        return TcRole::Untouched;
    }
    let link = interface.link.as_ref();
    if link.is_some_and(|l| !l.ethernet()) {
        return TcRole::Untouched;
    }
    // Without link facts (the dump failed) every interface counts as up, as before.
    let up = link.is_none_or(|l| l.up);
    let external = if configured.is_empty() {
        up && interface.addrs.iter().any(is_global_unicast)
            && !is_pod_interface(detect_local, &interface.name)
            && link.is_none_or(|l| match l.kind.as_deref() {
                Some("bridge") => bridge_has_uplink(l.index, all),
                Some(kind) => !NOT_EXTERNAL_KINDS.contains(&kind),
                None => true,
            })
    } else {
        up && configured.contains(&interface.name)
    };
    if external {
        TcRole::External
    } else {
        TcRole::Pod
    }
}

/// Whether the bridge with ifindex `bridge` has a port that is not a container's (a NIC, a
/// bond, a VLAN): then it is the node's uplink (`br0` holding the node address over `eth0`),
/// not a container network like `docker0` or `cni0`, whose ports are veths.
fn bridge_has_uplink(bridge: u32, all: &BTreeMap<String, Interface>) -> bool {
    all.values()
        .filter_map(|i| i.link.as_ref())
        .filter(|l| l.master == Some(bridge))
        .any(|l| {
            l.kind
                .as_deref()
                .is_none_or(|kind| !CONTAINER_PORT_KINDS.contains(&kind))
        })
}

/// Every interface's role (`tc_role`), by name.
pub fn tc_roles(
    configured: &[String],
    detect_local: &DetectLocalMode,
    all: &BTreeMap<String, Interface>,
) -> BTreeMap<String, TcRole> {
    all.iter()
        .map(|(name, i)| (name.clone(), tc_role(configured, detect_local, i, all)))
        .collect()
}

/// The interfaces that get the external program (`tc_role`).
pub fn external_interfaces(
    configured: &[String],
    detect_local: &DetectLocalMode,
    all: &BTreeMap<String, Interface>,
) -> BTreeSet<String> {
    tc_roles(configured, detect_local, all)
        .into_iter()
        .filter(|(_, role)| *role == TcRole::External)
        .map(|(name, _)| name)
        .collect()
}

/// The `KPR_SNAT_IFACES` entries: each external interface's first global address per family,
/// by ifindex — the address a flow is masqueraded to when its backend's route leaves there
/// (MASQUERADE's choice), and its MAC. Interfaces without link facts (no ifindex) or without a
/// global address have no address there; the `NodeConfig` address applies to them.
pub fn snat_by_interface(
    all: &BTreeMap<String, Interface>,
    external: &BTreeSet<String>,
) -> BTreeMap<u32, SnatAddrs> {
    let mut out = BTreeMap::new();
    for interface in external.iter().filter_map(|name| all.get(name)) {
        let Some(link) = &interface.link else {
            continue;
        };
        let mut addrs = SnatAddrs::default();
        for addr in interface.addrs.iter().filter(|a| is_global_unicast(a)) {
            match addr {
                IpAddr::V4(a) if addrs.snat4 == 0 => addrs.snat4 = ip4_to_map(*a),
                IpAddr::V6(a) if addrs.snat6 == [0; 4] => addrs.snat6 = ip6_to_map(*a),
                _ => {}
            }
        }
        // The MAC alone is worth an entry: replies leave by this interface directly when
        // their route would take another (`CtValue::out_ifindex`).
        addrs.mac = link.mac.unwrap_or_default();
        if addrs != SnatAddrs::default() {
            out.insert(link.index, addrs);
        }
    }
    out
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
