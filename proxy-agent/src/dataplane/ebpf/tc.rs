//! The tc side of the eBPF dataplane: which interfaces get which program, the node facts the
//! programs read (NodePort addresses, SNAT address, cluster CIDRs), and pinned TCX links.
//!
//! - External interfaces (`--interfaces`, else every interface with a global unicast address)
//!   get `kpr_tc_external` on ingress: service traffic from outside and replies of remote
//!   backends.
//! - Every other interface except `lo` (pod veths) gets `kpr_tc_reply` on ingress: replies of
//!   local backends, which are addressed to the SNAT address (or the client) and must be
//!   translated before the kernel routes them.
//!
//! Interfaces are discovered with `getifaddrs` (netlink, in the agent's network namespace), at
//! start and on every sync, so pods created later get the reply program. Links are TCX links
//! (kernel ≥ 6.6) pinned as `<program>_if<ifindex>_link`, replaced like the cgroup links.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    path::Path,
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData},
    programs::{
        SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
    },
};
use ipnet::IpNet;
use nix::{ifaddrs::getifaddrs, net::if_::InterfaceFlags};
use proxy_common::{NodeAddrKey, NodeConfig, family, node_flags, program_names};
use tracing::{debug, info, warn};

use super::{
    loader::{LINK_SUFFIX, LoadError, remove_if_present},
    program::{ip4_to_map, ip6_to_map},
};

/// What the agent's configuration says about external traffic.
#[derive(Debug, Clone, Default)]
pub struct TcOptions {
    /// `--interfaces`; empty: every interface with a global unicast address.
    pub interfaces: Vec<String>,
    /// `nodePortAddresses` CIDRs; empty: every local address.
    pub node_port_cidrs: Vec<IpNet>,
    /// `clusterCIDR` (one per family at most).
    pub cluster_cidrs: Vec<IpNet>,
    pub masquerade_all: bool,
    /// `iptables.localhostNodePorts`: IPv4 NodePorts on loopback addresses too.
    pub localhost_node_ports: bool,
}

/// One interface of the node namespace with its addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub addrs: Vec<IpAddr>,
    pub loopback: bool,
}

/// Every interface (up or not) with its addresses.
pub fn interfaces() -> Result<BTreeMap<String, Interface>, nix::Error> {
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

fn is_global_unicast(addr: &IpAddr) -> bool {
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

/// The interfaces that get the external program: `--interfaces`, else those with a global
/// unicast address (pod veths normally have none).
pub fn external_interfaces(
    options: &TcOptions,
    all: &BTreeMap<String, Interface>,
) -> BTreeSet<String> {
    if !options.interfaces.is_empty() {
        return options.interfaces.iter().cloned().collect();
    }
    all.values()
        .filter(|i| !i.loopback && i.addrs.iter().any(is_global_unicast))
        .map(|i| i.name.clone())
        .collect()
}

/// The node facts for the tc programs, from the interfaces and the configuration.
pub fn node_config(
    options: &TcOptions,
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
    for cidr in &options.cluster_cidrs {
        match cidr {
            IpNet::V4(net) => {
                config.flags |= node_flags::CLUSTER_CIDR4;
                config.cluster4 = ip4_to_map(net.network());
                config.cluster4_mask = ip4_to_map(net.netmask());
            }
            IpNet::V6(net) => {
                config.flags |= node_flags::CLUSTER_CIDR6;
                config.cluster6 = ip6_to_map(net.network());
                config.cluster6_mask = ip6_to_map(net.netmask());
            }
        }
    }
    if options.masquerade_all {
        config.flags |= node_flags::MASQUERADE_ALL;
    }
    // NodePorts answer on every local address in nodePortAddresses (all when unset). Loopback
    // addresses only matter to the socket hooks (packets to 127/8 never arrive on an interface
    // with a tc program): kube-proxy serves IPv4 ones with localhostNodePorts — every 127/8
    // address when nodePortAddresses is unset (a flag), the listed ones otherwise — and never
    // `::1`.
    let match_all = options.node_port_cidrs.is_empty();
    if match_all && options.localhost_node_ports {
        config.flags |= node_flags::LOCALHOST_NODEPORTS;
    }
    let node_port_addrs = all
        .values()
        .flat_map(|i| i.addrs.iter().copied())
        .filter(|a| {
            is_global_unicast(a)
                || (!match_all && options.localhost_node_ports && a.is_ipv4() && a.is_loopback())
        })
        .filter(|a| match_all || options.node_port_cidrs.iter().any(|c| c.contains(a)))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    (config, node_port_addrs)
}

/// The cookie of the agent's network namespace — the node's — as the socket hooks'
/// `bpf_get_netns_cookie` reports it for sockets there (`SO_NETNS_COOKIE`, Linux ≥ 5.14).
fn own_netns_cookie() -> std::io::Result<u64> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: plain socket(2); the descriptor is owned (and closed) by `socket` below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: a valid socket and an out-buffer of the size passed.
    let ret = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    if ret != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

pub fn node_addr_key(addr: IpAddr) -> NodeAddrKey {
    match addr {
        IpAddr::V4(a) => NodeAddrKey {
            addr: [ip4_to_map(a), 0, 0, 0],
            family: family::V4,
            _pad: [0; 3],
        },
        IpAddr::V6(a) => NodeAddrKey {
            addr: ip6_to_map(a),
            family: family::V6,
            _pad: [0; 3],
        },
    }
}

/// The node maps and the tc links, kept in step with the interfaces.
pub struct TcState {
    options: TcOptions,
    node_addrs: HashMap<MapData, NodeAddrKey, u8>,
    node_config: Array<MapData, NodeConfig>,
    programmed_addrs: BTreeSet<IpAddr>,
    programmed_config: Option<NodeConfig>,
    /// This namespace's cookie (0 when the kernel cannot tell it: the socket hooks then treat
    /// every socket as a pod's for guarded LB IPs).
    host_netns_cookie: u64,
    /// Pin file name → link, for every interface we attached to.
    links: BTreeMap<String, PinnedLink>,
}

impl std::fmt::Debug for TcState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcState")
            .field("links", &self.links.keys().collect::<Vec<_>>())
            .field("node_addrs", &self.programmed_addrs)
            .finish_non_exhaustive()
    }
}

impl TcState {
    pub fn new(
        options: TcOptions,
        node_addrs: HashMap<MapData, NodeAddrKey, u8>,
        node_config: Array<MapData, NodeConfig>,
    ) -> Self {
        // Whatever a previous agent left in the node map is replaced by the first refresh.
        let programmed_addrs = node_addrs
            .keys()
            .flatten()
            .filter_map(|k| match k.family {
                family::V4 => Some(IpAddr::V4(Ipv4Addr::from(k.addr[0].to_ne_bytes()))),
                family::V6 => Some(IpAddr::V6(super::program::ip6_from_map(k.addr))),
                _ => None,
            })
            .collect();
        Self {
            options,
            node_addrs,
            node_config,
            programmed_addrs,
            programmed_config: None,
            host_netns_cookie: own_netns_cookie().unwrap_or_else(|error| {
                warn!(%error, "cannot read the network namespace cookie; host processes reach \
                    LB IPs guarded by source ranges through the load balancer");
                0
            }),
            links: BTreeMap::new(),
        }
    }

    /// Re-reads the interfaces, updates the node maps and attaches the programs to interfaces
    /// that do not have them yet. At start (`first`), pins of interfaces that are gone or were
    /// not re-attached are removed.
    pub fn refresh(&mut self, ebpf: &mut Ebpf, pin_dir: &Path, first: bool) {
        let all = match interfaces() {
            Ok(all) => all,
            Err(error) => {
                warn!(%error, "cannot list network interfaces; tc programs not updated");
                return;
            }
        };
        let external = external_interfaces(&self.options, &all);
        let (mut config, addrs) = node_config(&self.options, &all, &external);
        config.host_netns_cookie = self.host_netns_cookie;
        self.program_node(config, &addrs);
        for name in all.keys() {
            if all[name].loopback {
                continue;
            }
            let program = if external.contains(name) {
                program_names::TC_EXTERNAL
            } else {
                program_names::TC_REPLY
            };
            let index = match nix::net::if_::if_nametoindex(name.as_str()) {
                Ok(index) => index,
                Err(error) => {
                    debug!(interface = %name, %error, "interface vanished");
                    continue;
                }
            };
            let pin_name = format!("{program}_if{index}{LINK_SUFFIX}");
            if self.links.contains_key(&pin_name) {
                continue;
            }
            match attach(ebpf, program, name, pin_dir, &pin_name) {
                Ok(link) => {
                    info!(interface = %name, program, "tc program attached");
                    self.links.insert(pin_name, link);
                }
                Err(error) => warn!(interface = %name, program, %error, "cannot attach tc program"),
            }
        }
        if first {
            self.remove_stale_pins(pin_dir);
        }
    }

    fn program_node(&mut self, config: NodeConfig, addrs: &[IpAddr]) {
        if self.programmed_config != Some(config) {
            match self.node_config.set(0, config, 0) {
                Ok(()) => self.programmed_config = Some(config),
                Err(error) => warn!(%error, "cannot write the node config map"),
            }
        }
        let wanted: BTreeSet<IpAddr> = addrs.iter().copied().collect();
        for addr in wanted.difference(&self.programmed_addrs.clone()) {
            match self.node_addrs.insert(node_addr_key(*addr), 1, 0) {
                Ok(()) => {
                    self.programmed_addrs.insert(*addr);
                }
                Err(error) => warn!(%addr, %error, "cannot add NodePort address"),
            }
        }
        for addr in self.programmed_addrs.clone().difference(&wanted) {
            if let Err(error) = self.node_addrs.remove(&node_addr_key(*addr)) {
                debug!(%addr, %error, "removing NodePort address");
            }
            self.programmed_addrs.remove(addr);
        }
    }

    /// Removes tc link pins this run did not (re)create: their interfaces are gone or changed
    /// role, and releasing the pin detaches a link that may still be attached.
    fn remove_stale_pins(&self, pin_dir: &Path) {
        let Ok(entries) = std::fs::read_dir(pin_dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let is_tc = name.starts_with(program_names::TC_EXTERNAL)
                || name.starts_with(program_names::TC_REPLY);
            if is_tc && name.ends_with(LINK_SUFFIX) && !self.links.contains_key(&name) {
                match remove_if_present(&entry.path()) {
                    Ok(()) => debug!(pin = %name, "removed stale tc link pin"),
                    Err(error) => warn!(pin = %name, %error, "cannot remove stale tc link pin"),
                }
            }
        }
    }

    pub fn link_count(&self) -> usize {
        self.links.len()
    }
}

/// Attaches `program` to `interface` ingress as a TCX link and pins it (replacing, and so
/// detaching, a previous agent's link for the same interface only once the new one runs).
fn attach(
    ebpf: &mut Ebpf,
    program: &'static str,
    interface: &str,
    pin_dir: &Path,
    pin_name: &str,
) -> Result<PinnedLink, LoadError> {
    let program_error = |source| LoadError::Program {
        name: program,
        source,
    };
    let classifier: &mut SchedClassifier = ebpf
        .program_mut(program)
        .ok_or(LoadError::MissingProgram(program))?
        .try_into()
        .map_err(program_error)?;
    if classifier.fd().is_err() {
        classifier.load().map_err(program_error)?;
    }
    // TCX on ≥ 6.6 (toolchain.md): a link, so it can be pinned and outlive the agent.
    let link_id = classifier
        .attach(interface, TcAttachType::Ingress)
        .map_err(program_error)?;
    let link = classifier.take_link(link_id).map_err(program_error)?;
    let link = FdLink::try_from(link).map_err(|source| LoadError::Link {
        name: program,
        source,
    })?;
    super::loader::pin_replacing(link, program, &pin_dir.join(pin_name))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use super::*;

    fn iface(name: &str, addrs: &[&str], loopback: bool) -> (String, Interface) {
        (
            name.to_owned(),
            Interface {
                name: name.to_owned(),
                addrs: addrs.iter().map(|a| a.parse().expect("addr")).collect(),
                loopback,
            },
        )
    }

    #[test]
    fn external_interfaces_and_node_config_follow_the_addresses() {
        let all: BTreeMap<_, _> = [
            iface("lo", &["127.0.0.1", "::1"], true),
            iface("eth0", &["10.10.0.1", "fe80::1", "fd00:10::1"], false),
            iface("veth1", &["fe80::2"], false),
        ]
        .into_iter()
        .collect();
        let options = TcOptions {
            cluster_cidrs: vec!["10.244.0.0/16".parse().expect("cidr")],
            ..TcOptions::default()
        };
        let external = external_interfaces(&options, &all);
        assert_eq!(external.into_iter().collect::<Vec<_>>(), ["eth0"]);
        let external = external_interfaces(&options, &all);
        let (config, addrs) = node_config(&options, &all, &external);
        assert_eq!(config.snat4, ip4_to_map(Ipv4Addr::new(10, 10, 0, 1)));
        assert_eq!(
            config.snat6,
            ip6_to_map("fd00:10::1".parse::<Ipv6Addr>().expect("v6"))
        );
        assert_eq!(config.flags, node_flags::CLUSTER_CIDR4);
        assert_eq!(
            config.cluster4_mask,
            ip4_to_map(Ipv4Addr::new(255, 255, 0, 0))
        );
        assert_eq!(addrs.len(), 2);

        let only_v6 = TcOptions {
            node_port_cidrs: vec!["fd00::/8".parse().expect("cidr")],
            ..TcOptions::default()
        };
        let (_, addrs) = node_config(&only_v6, &all, &external);
        assert_eq!(addrs, vec!["fd00:10::1".parse::<IpAddr>().expect("v6")]);

        // Localhost NodePorts: every 127/8 address (a flag) with match-all; the listed
        // loopback addresses with CIDRs; never ::1; none without localhostNodePorts.
        let localhost = TcOptions {
            localhost_node_ports: true,
            ..TcOptions::default()
        };
        let (config, addrs) = node_config(&localhost, &all, &external);
        assert_eq!(config.flags, node_flags::LOCALHOST_NODEPORTS);
        assert_eq!(addrs.len(), 2, "loopback is covered by the flag: {addrs:?}");
        let listed = TcOptions {
            node_port_cidrs: vec![
                "127.0.0.0/8".parse().expect("cidr"),
                "::1/128".parse().expect("cidr"),
                "10.10.0.0/24".parse().expect("cidr"),
            ],
            localhost_node_ports: true,
            ..TcOptions::default()
        };
        let (config, addrs) = node_config(&listed, &all, &external);
        assert_eq!(config.flags, 0);
        let expected: Vec<IpAddr> = ["10.10.0.1", "127.0.0.1"]
            .iter()
            .map(|a| a.parse().expect("addr"))
            .collect();
        assert_eq!(addrs, expected);
        let off = TcOptions {
            localhost_node_ports: false,
            ..listed
        };
        let (config, addrs) = node_config(&off, &all, &external);
        assert_eq!((config.flags, addrs.len()), (0, 1));
    }
}
