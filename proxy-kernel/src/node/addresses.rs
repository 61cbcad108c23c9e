//! The host's interfaces and addresses, and kube-proxy's `NodePortAddresses`
//! (pkg/proxy/util/nodeport_addresses.go) for one IP family.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
};

use ipnet::IpNet;
use nix::{ifaddrs::getifaddrs, net::if_::InterfaceFlags};

use tracing::warn;

use super::links::{Link, host_links};
use proxy_model::ip_family::IpFamily;

/// One interface of the node's network namespace with its addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub addrs: Vec<IpAddr>,
    pub loopback: bool,
    /// State, kind and hardware type; `None` when the link dump failed (every interface is
    /// then judged by its addresses alone, as before these facts were read).
    pub link: Option<Link>,
}

/// Every interface (up or not) with its addresses and link facts, by name (`getifaddrs` and
/// an `RTM_GETLINK` dump, in the caller's network namespace).
pub fn host_interfaces() -> Result<BTreeMap<String, Interface>, nix::Error> {
    let mut found = interface_addresses()?;
    match host_links() {
        Ok(mut links) => {
            for interface in found.values_mut() {
                interface.link = links.remove(&interface.name);
            }
        }
        Err(error) => {
            warn!(%error, "cannot read link states and kinds; interfaces judged by their addresses only")
        }
    }
    Ok(found)
}

fn interface_addresses() -> Result<BTreeMap<String, Interface>, nix::Error> {
    let mut found: BTreeMap<String, Interface> = BTreeMap::new();
    for entry in getifaddrs()? {
        let interface = found
            .entry(entry.interface_name.clone())
            .or_insert_with(|| Interface {
                name: entry.interface_name.clone(),
                ..Interface::default()
            });
        interface.loopback |= entry.flags.contains(InterfaceFlags::IFF_LOOPBACK);
        let Some(address) = entry.address else {
            continue;
        };
        if let Some(v4) = address.as_sockaddr_in() {
            interface.addrs.push(IpAddr::V4(v4.ip()));
        } else if let Some(v6) = address.as_sockaddr_in6() {
            interface.addrs.push(IpAddr::V6(v6.ip()));
        }
    }
    Ok(found)
}

/// Every address of every interface, sorted and deduplicated (Go's `net.InterfaceAddrs`).
pub fn all_addresses(interfaces: &BTreeMap<String, Interface>) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = interfaces
        .values()
        .flat_map(|i| i.addrs.iter().copied())
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

pub fn is_global_unicast(addr: &IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => !(a.is_loopback() || a.is_link_local() || a.is_unspecified()),
        IpAddr::V6(a) => {
            !(a.is_loopback()
                || a.is_unicast_link_local()
                || a.is_unspecified()
                || a.is_multicast())
        }
    }
}

/// kube-proxy's `NodePortAddresses` for one family: the `nodePortAddresses` CIDRs of that
/// family; none, or a zero CIDR among them, means every local address (`MatchAll`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePortAddressSet {
    pub family: IpFamily,
    pub match_all: bool,
    /// The family's CIDRs (just the zero CIDR when `match_all`).
    pub cidrs: Vec<IpNet>,
    /// `ContainsIPv4Loopback`: an IPv4 CIDR that is a loopback address or contains 127.0.0.0
    /// (so the zero CIDR does). Localhost NodePorts are only served when this holds.
    pub contains_ipv4_loopback: bool,
}

impl NodePortAddressSet {
    /// `NewNodePortAddresses(family, cidrs)`: CIDRs of the other family are ignored; with none
    /// left, the family's zero CIDR is used. Parsing stops at the first zero CIDR ("ignore
    /// everything else"), as upstream.
    pub fn new(family: IpFamily, cidrs: &[IpNet]) -> Self {
        let mut of_family: Vec<IpNet> = cidrs
            .iter()
            .filter(|c| IpFamily::of(&c.addr()) == family)
            .copied()
            .collect();
        if of_family.is_empty() {
            of_family.push(match family {
                IpFamily::V4 => IpNet::V4(ipnet::Ipv4Net::default()),
                IpFamily::V6 => IpNet::V6(ipnet::Ipv6Net::default()),
            });
        }
        let mut set = Self {
            family,
            match_all: false,
            cidrs: Vec::new(),
            contains_ipv4_loopback: false,
        };
        for cidr in of_family {
            if let IpNet::V4(net) = cidr
                && (net.addr().is_loopback() || net.contains(&Ipv4Addr::new(127, 0, 0, 0)))
            {
                set.contains_ipv4_loopback = true;
            }
            if cidr.prefix_len() == 0 {
                set.cidrs = vec![cidr];
                set.match_all = true;
                break;
            }
            set.cidrs.push(cidr);
        }
        set
    }

    /// `GetNodeIPs`: the host addresses inside the CIDRs (sorted; upstream's order is a Go
    /// map's). With `match_all` that is every address of the family.
    pub fn matching(&self, host: &[IpAddr]) -> Vec<IpAddr> {
        let mut ips: Vec<IpAddr> = host
            .iter()
            .filter(|ip| self.cidrs.iter().any(|c| c.contains(*ip)))
            .copied()
            .collect();
        ips.sort();
        ips.dedup();
        ips
    }
}
