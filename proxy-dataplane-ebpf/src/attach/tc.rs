//! The tc side of the eBPF dataplane: which interfaces get which program, writing the node
//! facts the programs read (computed by `proxy_kernel::node::ebpf` from the node settings), and pinned
//! TCX links.
//!
//! - External interfaces (`node::ebpf::tc_role`: `--interfaces`, else every interface that is
//!   up with a global unicast address, not a pod interface by `--detect-local-mode` and not a
//!   container bridge, tunnel, TUN/TAP or dummy) get `kpr_tc_external` on ingress: service
//!   traffic from outside and replies of remote backends.
//! - Every other interface except `lo` and links without an Ethernet header (WireGuard, IPIP,
//!   ...: the programs' parser expects one) gets `kpr_tc_reply` on ingress: replies of
//!   local backends, which are addressed to the SNAT address (or the client) and must be
//!   translated before the kernel routes them; with `host_namespace_only` also the pods' own
//!   Service traffic, load-balanced per packet.
//!
//! - Every interface that gets one of the above also gets `kpr_tc_egress` on egress: on the
//!   netfilter path (the default) ingress only rewrites destinations and returns packets to
//!   the stack, so the host's FORWARD/POSTROUTING (and a CNI's netfilter policy) see client and
//!   backend; this program then rewrites sources (SNAT, frontend address on replies) after
//!   POSTROUTING. With `fast_path` (`--tc-fast-path`) ingress translates fully and redirects,
//!   and the egress program passes everything but the replies of host-network backends on this
//!   node, which leave the node's own stack (on either path).
//!
//! Interfaces are discovered with `getifaddrs` (netlink, in the agent's network namespace), at
//! start and on every sync, so pods created later get the reply program; with
//! `host_namespace_only` a new interface (a netlink link or address event) asks for a sync at
//! once, since until then the pod's Service traffic is not load-balanced at all. Links are TCX links
//! (kernel ≥ 6.6) pinned as `<program>_if<ifindex>_link`, replaced like the cgroup links;
//! without TCX (`features::Feature::Tcx`), legacy clsact filters (`legacy_tc`).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    path::Path,
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData},
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::TcAttachOptions,
    },
};
use ipnet::IpNet;
use proxy_common::{
    NodeAddrKey, NodeConfig, SnatAddrs, family, map_names, node_flags, program_names,
};
use tracing::{debug, info, warn};

use crate::{
    attach::legacy_tc,
    attach::pin_files::remove_if_present,
    attach::pins::LINK_SUFFIX,
    attach::reuse::PinnedPrograms,
    attach::tc_programs::loaded_classifier,
    attach::xdp::{XdpSetting, XdpState},
    drift::{Drift, DriftKind, RepairReport},
    error::EbpfError,
    maps::map_writer::MapWriteError,
    maps::map_writer::{ip4_to_map, ip6_to_map},
};
use proxy_kernel::node::{self, NodeInputs, NodeSettings, ebpf::TcRole, host_interfaces};
use proxy_model::config::{DetectLocal, NodePortAddresses};

/// What the agent's configuration says about external traffic. The node facts come from
/// [`NodeSettings`] once the agent sets them ([`TcState::set_node`]); until then (and for
/// users of the dataplane without a node manager, like the test rig) from these fields with no
/// Node object.
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
    /// The fast path (`--tc-fast-path`, or `auto` while the node has no forwarding policy):
    /// redirect translated packets past the host's netfilter FORWARD and POSTROUTING
    /// (`node_flags::FAST_PATH`); the host's netfilter policy then does not apply to external
    /// Service traffic. Changed at run time with [`TcState::set_fast_path`].
    pub fast_path: bool,
    /// `--bpf-socket-lb-host-namespace-only` (`node_flags::HOST_NAMESPACE_ONLY`): the socket
    /// hooks leave pods' sockets alone and the pod-side program load-balances their packets.
    pub host_namespace_only: bool,
    /// `--service-traffic-max-series 0` (`node_flags::NO_PACKET_COUNTS`): the programs do not
    /// count each Service's packets and bytes, which nobody would read.
    pub packet_counts_off: bool,
    /// `--service-traffic-endpoints` (`node_flags::ENDPOINT_COUNTS`): each new connection is
    /// also counted for its endpoint.
    pub endpoint_counts: bool,
    /// Attach as TCX links; otherwise as legacy clsact filters (`legacy_tc`).
    pub tcx: bool,
    /// `--bpf-xdp`: the XDP program on the external interfaces too (`xdp`).
    pub xdp: XdpSetting,
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

impl TcOptions {
    /// The node inputs these options stand for: no Node object, ClusterCIDR detection.
    fn node_inputs(&self) -> NodeInputs {
        NodeInputs {
            bind_address: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            node_port_addresses: if self.node_port_cidrs.is_empty() {
                NodePortAddresses::All
            } else {
                NodePortAddresses::Cidrs(self.node_port_cidrs.clone())
            },
            detect_local: DetectLocal::ClusterCidr,
            cluster_cidrs: self.cluster_cidrs.clone(),
            localhost_node_ports: self.localhost_node_ports,
            masquerade_all: self.masquerade_all,
        }
    }
}

/// The node maps and the tc links, kept in step with the interfaces.
pub struct TcState {
    options: TcOptions,
    node_addrs: HashMap<MapData, NodeAddrKey, u8>,
    node_config: Array<MapData, NodeConfig>,
    snat_ifaces: HashMap<MapData, u32, SnatAddrs>,
    programmed_addrs: BTreeSet<IpAddr>,
    /// `KPR_SNAT_IFACES` as last written (what a previous agent left at start).
    programmed_snat: BTreeMap<u32, SnatAddrs>,
    programmed_config: Option<NodeConfig>,
    /// The agent's node settings; `None`: derived from `options` at each refresh.
    node: Option<NodeSettings>,
    /// This namespace's cookie (0 when the kernel cannot tell it: the socket hooks then treat
    /// every socket as a pod's for guarded LB IPs).
    host_netns_cookie: u64,
    /// Pin file name (`<program>_if<ifindex>_link`, also the key of a legacy filter) → link,
    /// for every interface and direction we attached to.
    links: BTreeMap<String, Attached>,
    /// Interfaces of `--interfaces` last found unusable (warned about once).
    unusable: BTreeSet<String>,
    /// `node_flags::KERNEL_FLOWS`: set from the start until the kernel's NATed flows are all
    /// adopted ([`TcState::kernel_flows_adopted`]).
    kernel_flows: bool,
    /// The XDP links of the external interfaces (`--bpf-xdp`).
    xdp: XdpState,
    /// The pinned entry programs a restart reuses (`reuse`); `None`: the object's, loaded.
    pinned: Option<PinnedPrograms>,
    /// Whether the IPv6 family programs are in `KPR_TC_FAMILY` (else `kpr_tc_idle`).
    ipv6: bool,
    /// What the last refresh found and did for each wanted attachment (by pin name), for the
    /// datapath's health.
    status: BTreeMap<String, Attachment>,
    /// Attachments found detached and attached again since [`TcState::take_reattached`] last
    /// asked (bounded: a hook cleared on every check would otherwise grow it).
    reattached: Vec<Attachment>,
}

/// The most re-attachments [`TcState`] keeps between two reports.
const MAX_REATTACHED: usize = 64;

/// One attachment the agent wants (a program on one interface's tc hook), as the last
/// refresh left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub interface: String,
    pub ifindex: u32,
    pub program: &'static str,
    /// `ingress` or `egress`.
    pub hook: &'static str,
    /// An external interface's ingress program (the one the self-test runs).
    pub external: bool,
    /// TCX link (else a legacy clsact filter).
    pub tcx: bool,
    /// In place after the refresh: attached, found still attached, or attached again.
    pub attached: bool,
    /// The kernel id of the program our link runs, when known.
    pub program_id: Option<u32>,
    /// It had been detached behind the agent's back and this refresh attached it again.
    pub reattached: bool,
    /// Why it could not be attached.
    pub error: Option<String>,
}

fn hook_name(direction: TcAttachType) -> &'static str {
    match direction {
        TcAttachType::Ingress => "ingress",
        _ => "egress",
    }
}

/// One attachment of a tc program.
enum Attached {
    /// The pinned link (the pin keeps it attached; this keeps its fd while we run) and the id of
    /// the program it runs, when the kernel told (to see whether the link is still attached).
    Tcx {
        _link: PinnedLink,
        program: Option<u32>,
    },
    /// A filter in our slot of the hook (`legacy_tc`); it goes away with its interface, and a
    /// new role's program replaces it in place.
    Legacy,
}

impl Attached {
    fn program_id(&self) -> Option<u32> {
        match self {
            Attached::Tcx { program, .. } => *program,
            Attached::Legacy => None,
        }
    }
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
        snat_ifaces: HashMap<MapData, u32, SnatAddrs>,
        xdp: XdpState,
    ) -> Self {
        // Whatever a previous agent left in the node map is replaced by the first refresh.
        let programmed_addrs = node_addrs
            .keys()
            .flatten()
            .filter_map(|k| match k.family {
                family::V4 => Some(IpAddr::V4(Ipv4Addr::from(k.addr[0].to_ne_bytes()))),
                family::V6 => Some(IpAddr::V6(crate::maps::map_writer::ip6_from_map(k.addr))),
                _ => None,
            })
            .collect();
        let programmed_snat = snat_ifaces.iter().filter_map(Result::ok).collect();
        let host_namespace_only = options.host_namespace_only;
        Self {
            options,
            node_addrs,
            node_config,
            snat_ifaces,
            programmed_addrs,
            programmed_snat,
            programmed_config: None,
            kernel_flows: true,
            node: None,
            host_netns_cookie: own_netns_cookie().unwrap_or_else(|error| {
                warn!(%error, "cannot read the network namespace cookie; host processes reach \
                    LB IPs guarded by source ranges through the load balancer");
                if host_namespace_only {
                    warn!(
                        "--bpf-socket-lb-host-namespace-only has no effect without the \
                        network namespace cookie: pods' sockets are translated as before"
                    );
                }
                0
            }),
            links: BTreeMap::new(),
            unusable: BTreeSet::new(),
            xdp,
            pinned: None,
            ipv6: true,
            status: BTreeMap::new(),
            reattached: Vec::new(),
        }
    }

    /// Attaches the pinned programs a restart reuses (`reuse`) instead of the object's from now
    /// on; a program without a pin is still loaded from the object when first needed.
    pub fn reuse_pinned(&mut self, programs: PinnedPrograms) {
        self.pinned = Some(programs);
    }

    /// Re-reads the interfaces, updates the node maps and attaches the programs to interfaces
    /// that do not have them yet. At start (`first`), pins of interfaces that are gone or were
    /// not re-attached are removed.
    pub fn refresh(&mut self, ebpf: &mut Ebpf, pin_dir: &Path, first: bool) {
        let all = match host_interfaces() {
            Ok(all) => all,
            Err(error) => {
                warn!(%error, "cannot list network interfaces; tc programs not updated");
                return;
            }
        };
        let settings = match &self.node {
            Some(settings) => settings.clone(),
            None => NodeSettings::compute(&self.options.node_inputs(), None, &all),
        };
        let roles = node::ebpf::tc_roles(&self.options.interfaces, &settings.detect_local, &all);
        self.warn_unusable(&roles);
        let external: BTreeSet<String> = roles
            .iter()
            .filter(|(_, role)| **role == TcRole::External)
            .map(|(name, _)| name.clone())
            .collect();
        let (mut config, addrs) = node::ebpf::node_config(&settings, &all, &external);
        let snat = node::ebpf::snat_by_interface(&all, &external);
        config.host_netns_cookie = self.host_netns_cookie;
        if self.options.fast_path {
            config.flags |= node_flags::FAST_PATH;
        }
        if self.options.host_namespace_only {
            config.flags |= node_flags::HOST_NAMESPACE_ONLY;
        }
        if self.options.packet_counts_off {
            config.flags |= node_flags::NO_PACKET_COUNTS;
        }
        if self.options.endpoint_counts {
            config.flags |= node_flags::ENDPOINT_COUNTS;
        }
        if self.kernel_flows {
            config.flags |= node_flags::KERNEL_FLOWS;
        }
        let mut wanted = BTreeSet::new();
        // External interfaces whose tc ingress program is in place: XDP passes them what it
        // does not take.
        let mut xdp_ready = BTreeMap::new();
        for (name, role) in &roles {
            let program = match role {
                TcRole::External => program_names::TC_EXTERNAL,
                TcRole::Pod => program_names::TC_REPLY,
                TcRole::Untouched => continue,
            };
            let index = match nix::net::if_::if_nametoindex(name.as_str()) {
                Ok(index) => index,
                Err(error) => {
                    debug!(interface = %name, %error, "interface vanished");
                    continue;
                }
            };
            // Egress first: on the netfilter path an ingress translation needs its egress half.
            for (program, direction) in [
                (program_names::TC_EGRESS, TcAttachType::Egress),
                (program, TcAttachType::Ingress),
            ] {
                let pin_name = format!("{program}_if{index}{LINK_SUFFIX}");
                wanted.insert(pin_name.clone());
                let mut status = Attachment {
                    interface: name.clone(),
                    ifindex: index,
                    program,
                    hook: hook_name(direction),
                    external: *role == TcRole::External && direction == TcAttachType::Ingress,
                    tcx: self.options.tcx,
                    attached: false,
                    program_id: None,
                    reattached: false,
                    error: None,
                };
                if let Some(attached) = self.links.get(&pin_name) {
                    if still_attached(attached, name, direction) {
                        status.attached = true;
                        status.program_id = attached.program_id();
                        self.status.insert(pin_name, status);
                        continue;
                    }
                    status.reattached = true;
                    // Another tool detached it (`bpftool link detach`, an upgrade of another tc
                    // program that cleared the hook): the interface's Service traffic would
                    // pass untranslated until the agent restarted.
                    warn!(interface = %name, program, "tc program no longer attached: attaching it again");
                    self.links.remove(&pin_name);
                    if let Err(error) = remove_if_present(&pin_dir.join(&pin_name)) {
                        warn!(pin = %pin_name, %error, "cannot remove the detached link's pin");
                    }
                }
                if first
                    && self.options.tcx
                    && let Some((link, program)) = adopt_link(
                        self.pinned.as_ref(),
                        program,
                        name,
                        direction,
                        &pin_dir.join(&pin_name),
                    )
                {
                    debug!(interface = %name, program, "pinned tc link adopted");
                    status.attached = true;
                    status.program_id = Some(program);
                    self.status.insert(pin_name.clone(), status);
                    self.links.insert(
                        pin_name,
                        Attached::Tcx {
                            _link: link,
                            program: Some(program),
                        },
                    );
                    continue;
                }
                let loader = Loader {
                    pinned: self.pinned.as_mut(),
                    ipv6: self.ipv6,
                };
                let attached = if self.options.tcx {
                    attach(ebpf, loader, program, name, direction, pin_dir, &pin_name).map(
                        |(link, program)| Attached::Tcx {
                            _link: link,
                            program,
                        },
                    )
                } else {
                    attach_legacy(ebpf, loader, program, name, index, direction, pin_dir)
                        .map(|()| Attached::Legacy)
                };
                match attached {
                    Ok(link) => {
                        info!(interface = %name, program, tcx = self.options.tcx, "tc program attached");
                        status.attached = true;
                        status.program_id = link.program_id();
                        self.links.insert(pin_name.clone(), link);
                    }
                    Err(error) => {
                        warn!(interface = %name, program, %error, "cannot attach tc program");
                        status.error = Some(error.to_string());
                    }
                }
                if status.reattached && self.reattached.len() < MAX_REATTACHED {
                    self.reattached.push(status.clone());
                }
                self.status.insert(pin_name, status);
            }
            let ingress = format!("{program}_if{index}{LINK_SUFFIX}");
            if *role == TcRole::External && self.links.contains_key(&ingress) {
                xdp_ready.insert(name.clone(), index);
            }
        }
        if first && self.options.tcx {
            self.remove_legacy_filters(&all, &wanted);
        }
        // After the links: the node config chooses the path (fast or netfilter), and the
        // netfilter path needs the egress programs in place.
        self.program_node(config, &addrs);
        self.program_snat(snat);
        // After the node config and SNAT interfaces it reads; before tc detaches anything.
        let pinned_xdp = self.pinned.as_mut().and_then(|p| p.xdp.as_mut());
        self.xdp.refresh(
            ebpf,
            pinned_xdp,
            pin_dir,
            &xdp_ready,
            self.options.fast_path,
            first,
        );
        self.detach_unwanted(&wanted, pin_dir);
        self.status.retain(|pin, _| wanted.contains(pin));
        if first {
            self.remove_stale_pins(pin_dir);
        }
    }

    /// Every attachment the last refresh wanted, as it left them (interface order). A failed
    /// attach to an interface that is gone since is left out: a pod's veth deleted between
    /// the listing and the attach is no broken hook.
    pub fn attachments(&self) -> Vec<Attachment> {
        let mut all: Vec<Attachment> = self
            .status
            .values()
            .filter(|a| {
                a.attached
                    || nix::net::if_::if_nametoindex(a.interface.as_str())
                        .is_ok_and(|index| index == a.ifindex)
            })
            .cloned()
            .collect();
        all.sort_by(|a, b| (&a.interface, a.hook).cmp(&(&b.interface, b.hook)));
        all
    }

    /// The attachments found detached and attached again (or not) since the last call.
    pub fn take_reattached(&mut self) -> Vec<Attachment> {
        std::mem::take(&mut self.reattached)
    }

    /// The NodePort addresses written to `KPR_NODE_ADDRS` (a NodePort frontend's packets are
    /// addressed to one of them).
    pub fn node_port_addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.programmed_addrs.iter().copied()
    }

    /// The entry program attached as a legacy filter (loaded, or the pinned one a restart
    /// reuses), for the self-test of a hook whose program id the kernel does not tell.
    pub fn legacy_program<'a>(
        &'a mut self,
        ebpf: &'a mut Ebpf,
        program: &'static str,
        pin_dir: &Path,
    ) -> Result<&'a mut SchedClassifier, EbpfError> {
        loaded_classifier(ebpf, self.pinned.as_mut(), self.ipv6, program, pin_dir)
    }

    /// Whether the IPv6 family programs are loaded (or, on a restart, the pinned ones found in
    /// their slots) rather than `kpr_tc_idle`.
    pub fn ipv6(&self) -> bool {
        self.ipv6
    }

    /// Records whether the IPv6 family programs are in their slots (the start finds out).
    pub fn set_ipv6(&mut self, loaded: bool) {
        self.ipv6 = loaded;
        self.xdp.ipv6 = loaded;
    }

    /// Loads the IPv6 family programs (the kernel verifies them) unless they are loaded, and
    /// with `write` puts them in their slots in place of the idle programs; without it (the
    /// previous agent's programs still serve) the attach writes them with the rest.
    pub fn load_ipv6(&mut self, ebpf: &mut Ebpf, write: bool) -> Result<(), EbpfError> {
        if self.ipv6 {
            return Ok(());
        }
        // The XDP new-flow slot only matters to an XDP program this agent loaded or reuses;
        // one it loads later takes the IPv6 program with it.
        let xdp = self.pinned.as_ref().is_some_and(|p| p.xdp.is_some())
            || ebpf
                .program(program_names::XDP_EXTERNAL)
                .is_some_and(|program| program.fd().is_ok());
        crate::attach::tc_programs::load_ipv6(ebpf, xdp, write)?;
        self.set_ipv6(true);
        Ok(())
    }

    /// Warns once per interface listed in `--interfaces` that cannot get the external program
    /// (no Ethernet header) or is down, and again after it recovered and was lost again.
    fn warn_unusable(&mut self, roles: &BTreeMap<String, TcRole>) {
        let mut unusable = BTreeSet::new();
        for name in &self.options.interfaces {
            match roles.get(name) {
                Some(TcRole::External) => {}
                Some(TcRole::Untouched) => {
                    if !self.unusable.contains(name) {
                        warn!(interface = %name, "--interfaces names an interface without an \
                            Ethernet header (or loopback): the tc programs cannot parse its \
                            packets, so it gets none");
                    }
                    unusable.insert(name.clone());
                }
                Some(TcRole::Pod) => {
                    if !self.unusable.contains(name) {
                        warn!(interface = %name, "--interfaces names an interface that is down: \
                            it gets the external program once it is up");
                    }
                    unusable.insert(name.clone());
                }
                None => {}
            }
        }
        self.unusable = unusable;
    }

    /// A previous agent without TCX left legacy filters, which run after our TCX programs and
    /// would see the packets they translated: removed once every TCX link of the interface is
    /// in place, so the interface is never without our programs.
    fn remove_legacy_filters(
        &self,
        all: &BTreeMap<String, node::Interface>,
        wanted: &BTreeSet<String>,
    ) {
        for (name, interface) in all {
            let Ok(index) = nix::net::if_::if_nametoindex(name.as_str()) else {
                continue;
            };
            let suffix = format!("_if{index}{LINK_SUFFIX}");
            let complete = wanted
                .iter()
                .filter(|pin| pin.ends_with(&suffix))
                .all(|pin| self.links.contains_key(pin));
            if !interface.loopback && complete {
                let removed = legacy_tc::remove_ours(name);
                if removed > 0 {
                    info!(interface = %name, removed, "legacy tc filters of a previous agent removed");
                }
            }
        }
    }

    /// Detaches the links of interfaces that are gone or changed role (an address added or
    /// removed at run time makes an interface external or pod side): releasing the pin and the
    /// link detaches the program. The new role's program was attached first, so the interface
    /// is never without one.
    fn detach_unwanted(&mut self, wanted: &BTreeSet<String>, pin_dir: &Path) {
        let unwanted: Vec<String> = self
            .links
            .keys()
            .filter(|pin| !wanted.contains(*pin))
            .cloned()
            .collect();
        for pin in unwanted {
            if matches!(self.links.get(&pin), Some(Attached::Legacy)) {
                self.links.remove(&pin);
                debug!(pin = %pin, "legacy tc filter forgotten (interface gone or replaced)");
                continue;
            }
            if let Err(error) = remove_if_present(&pin_dir.join(&pin)) {
                warn!(pin = %pin, %error, "cannot remove tc link pin");
                continue;
            }
            self.links.remove(&pin);
            info!(pin = %pin, "tc program detached (interface gone or changed role)");
        }
    }

    /// Every flow the kernel's conntrack NATs is in `KPR_CT` now: `node_flags::KERNEL_FLOWS`
    /// goes, at once (not at the next sync).
    pub fn kernel_flows_adopted(&mut self) {
        self.kernel_flows = false;
        if let Some(mut config) = self.programmed_config
            && config.flags & node_flags::KERNEL_FLOWS != 0
        {
            config.flags &= !node_flags::KERNEL_FLOWS;
            match self.node_config.set(0, config, 0) {
                Ok(()) => self.programmed_config = Some(config),
                Err(error) => warn!(%error, "cannot write the node config map"),
            }
        }
    }

    /// Turns the programs' per-Service packet and byte counting on or off
    /// (`node_flags::NO_PACKET_COUNTS`), at once if the node config is written already.
    pub fn set_packet_counts(&mut self, on: bool) {
        self.options.packet_counts_off = !on;
        if let Some(mut config) = self.programmed_config {
            if on {
                config.flags &= !node_flags::NO_PACKET_COUNTS;
            } else {
                config.flags |= node_flags::NO_PACKET_COUNTS;
            }
            if Some(config) != self.programmed_config {
                match self.node_config.set(0, config, 0) {
                    Ok(()) => self.programmed_config = Some(config),
                    Err(error) => warn!(%error, "cannot write the node config map"),
                }
            }
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

    /// Writes the per-interface SNAT addresses: new and changed entries, then removes those of
    /// interfaces no longer external.
    fn program_snat(&mut self, wanted: BTreeMap<u32, SnatAddrs>) {
        for (index, addrs) in &wanted {
            if self.programmed_snat.get(index) == Some(addrs) {
                continue;
            }
            match self.snat_ifaces.insert(index, addrs, 0) {
                Ok(()) => {
                    self.programmed_snat.insert(*index, *addrs);
                }
                Err(error) => {
                    warn!(ifindex = index, %error, "cannot write an interface's SNAT addresses")
                }
            }
        }
        let gone: Vec<u32> = self
            .programmed_snat
            .keys()
            .filter(|index| !wanted.contains_key(index))
            .copied()
            .collect();
        for index in gone {
            if let Err(error) = self.snat_ifaces.remove(&index) {
                debug!(ifindex = index, %error, "removing an interface's SNAT addresses");
            }
            self.programmed_snat.remove(&index);
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
                || name.starts_with(program_names::TC_REPLY)
                || name.starts_with(program_names::TC_EGRESS);
            // A legacy filter's key is not a pin: a TCX pin of that name is a previous agent's.
            let ours = matches!(self.links.get(&name), Some(Attached::Tcx { .. }));
            if is_tc && name.ends_with(LINK_SUFFIX) && !ours {
                match remove_if_present(&entry.path()) {
                    Ok(()) => debug!(pin = %name, "removed stale tc link pin"),
                    Err(error) => warn!(pin = %name, %error, "cannot remove stale tc link pin"),
                }
            }
        }
    }

    /// Compares the node maps with what the agent last wrote (the `KPR_NODE_CONFIG` entry, the
    /// `KPR_NODE_ADDRS` set and the `KPR_SNAT_IFACES` entries) and, with `repair`, writes that
    /// back. Before the first
    /// refresh wrote the config nothing is compared.
    pub fn check_drift(&mut self, repair: bool, report: &mut RepairReport) -> Vec<Drift> {
        let mut out = Vec::new();
        let Some(want) = self.programmed_config else {
            return out;
        };
        let have = self.node_config.get(&0, 0).ok();
        if have != Some(want) {
            out.push(Drift {
                map: map_names::NODE_CONFIG,
                kind: if have.is_some() {
                    DriftKind::Changed
                } else {
                    DriftKind::Missing
                },
                entry: "0".to_owned(),
                expected: Some(describe_config(&want)),
                found: have.as_ref().map(describe_config),
            });
            if repair {
                count(
                    report,
                    map_names::NODE_CONFIG,
                    self.node_config.set(0, want, 0),
                );
            }
        }
        let found: BTreeMap<NodeAddrKey, u8> =
            self.node_addrs.iter().filter_map(Result::ok).collect();
        for addr in &self.programmed_addrs {
            let key = node_addr_key(*addr);
            match found.get(&key) {
                Some(1) => {}
                have => {
                    out.push(Drift {
                        map: map_names::NODE_ADDRS,
                        kind: if have.is_some() {
                            DriftKind::Changed
                        } else {
                            DriftKind::Missing
                        },
                        entry: addr.to_string(),
                        expected: Some("1".to_owned()),
                        found: have.map(ToString::to_string),
                    });
                    if repair {
                        count(
                            report,
                            map_names::NODE_ADDRS,
                            self.node_addrs.insert(key, 1, 0),
                        );
                    }
                }
            }
        }
        let wanted: BTreeSet<NodeAddrKey> = self
            .programmed_addrs
            .iter()
            .map(|a| node_addr_key(*a))
            .collect();
        for (key, value) in &found {
            if wanted.contains(key) {
                continue;
            }
            out.push(Drift {
                map: map_names::NODE_ADDRS,
                kind: DriftKind::Extra,
                entry: describe_node_addr(key),
                expected: None,
                found: Some(value.to_string()),
            });
            if repair {
                count(report, map_names::NODE_ADDRS, self.node_addrs.remove(key));
            }
        }
        self.check_snat_drift(repair, report, &mut out);
        out
    }

    /// `check_drift` for `KPR_SNAT_IFACES`.
    fn check_snat_drift(&mut self, repair: bool, report: &mut RepairReport, out: &mut Vec<Drift>) {
        let map = map_names::SNAT_IFACES;
        let found: BTreeMap<u32, SnatAddrs> =
            self.snat_ifaces.iter().filter_map(Result::ok).collect();
        for (index, want) in &self.programmed_snat {
            let have = found.get(index);
            if have == Some(want) {
                continue;
            }
            out.push(Drift {
                map,
                kind: if have.is_some() {
                    DriftKind::Changed
                } else {
                    DriftKind::Missing
                },
                entry: format!("ifindex {index}"),
                expected: Some(describe_snat(want)),
                found: have.map(describe_snat),
            });
            if repair {
                count(report, map, self.snat_ifaces.insert(index, want, 0));
            }
        }
        for (index, have) in &found {
            if self.programmed_snat.contains_key(index) {
                continue;
            }
            out.push(Drift {
                map,
                kind: DriftKind::Extra,
                entry: format!("ifindex {index}"),
                expected: None,
                found: Some(describe_snat(have)),
            });
            if repair {
                count(report, map, self.snat_ifaces.remove(index));
            }
        }
    }

    /// The agent's node settings; the next refresh programs them.
    pub fn set_node(&mut self, settings: &NodeSettings) {
        self.node = Some(settings.clone());
    }

    /// Switches between the fast path and the netfilter path (`--tc-fast-path=auto` follows
    /// the node's forwarding policy); the next refresh writes the node config's flag and
    /// attaches or detaches XDP. Returns whether it changed.
    pub fn set_fast_path(&mut self, on: bool) -> bool {
        let changed = self.options.fast_path != on;
        self.options.fast_path = on;
        changed
    }

    /// Whether translated external traffic takes the fast path now.
    pub fn fast_path(&self) -> bool {
        self.options.fast_path
    }

    /// Whether pods' Service traffic is the tc programs' (`--bpf-socket-lb-host-namespace-only`).
    pub fn host_namespace_only(&self) -> bool {
        self.options.host_namespace_only
    }

    /// The interfaces running the XDP program: (name, ifindex).
    pub fn xdp_interfaces(&self) -> Vec<(String, u32)> {
        self.xdp
            .attached()
            .map(|(name, index)| (name.to_owned(), index))
            .collect()
    }

    pub fn link_count(&self) -> usize {
        self.links.len()
    }
}

fn count(report: &mut RepairReport, map: &'static str, result: Result<(), aya::maps::MapError>) {
    match result {
        Ok(()) => *report.repaired.entry(map).or_default() += 1,
        Err(error) => report
            .errors
            .push((map, MapWriteError::Other(error.to_string()))),
    }
}

fn describe_node_addr(key: &NodeAddrKey) -> String {
    match key.family {
        family::V4 => Ipv4Addr::from(key.addr[0].to_ne_bytes()).to_string(),
        family::V6 => crate::maps::map_writer::ip6_from_map(key.addr).to_string(),
        other => format!("family {other} {:?}", key.addr),
    }
}

fn describe_snat(a: &SnatAddrs) -> String {
    let m = a.mac;
    format!(
        "snat4 {} snat6 {} mac {:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        Ipv4Addr::from(a.snat4.to_ne_bytes()),
        crate::maps::map_writer::ip6_from_map(a.snat6),
        m[0],
        m[1],
        m[2],
        m[3],
        m[4],
        m[5]
    )
}

fn describe_config(c: &NodeConfig) -> String {
    format!(
        "snat4 {} snat6 {} cluster4 {}/{:#x} cluster6 {}/{} flags {:#x} host netns {}",
        Ipv4Addr::from(c.snat4.to_ne_bytes()),
        crate::maps::map_writer::ip6_from_map(c.snat6),
        Ipv4Addr::from(c.cluster4.to_ne_bytes()),
        u32::from_be(c.cluster4_mask),
        crate::maps::map_writer::ip6_from_map(c.cluster6),
        crate::maps::map_writer::ip6_from_map(c.cluster6_mask),
        c.flags,
        c.host_netns_cookie
    )
}

/// Whether our link still runs its program on `interface` (`direction`): one query of the hook
/// per link and sync. A TCX link can be detached behind our back while its pin (and our fd)
/// stay: its program is then missing from the hook's list. Legacy filters, and links whose
/// program id the kernel did not tell, are not checked (a legacy slot is ours only by
/// convention; `legacy_tc` replaces a filter in place).
fn still_attached(attached: &Attached, interface: &str, direction: TcAttachType) -> bool {
    let Attached::Tcx {
        program: Some(id), ..
    } = attached
    else {
        return true;
    };
    let id = *id;
    match SchedClassifier::query_tcx(interface, direction) {
        Ok((_, programs)) => programs.iter().any(|program| program.id() == id),
        // The interface went or cannot be asked: the next refresh sees what became of it.
        Err(_) => true,
    }
}

/// A previous run's TCX link pinned at `pin`, adopted as it is when it runs the pinned
/// program a restart reuses and that program is attached to `interface` (`direction`): a link
/// whose interface went away (an ifindex used again) runs nowhere and is replaced.
fn adopt_link(
    pinned: Option<&PinnedPrograms>,
    program: &'static str,
    interface: &str,
    direction: TcAttachType,
    pin: &Path,
) -> Option<(PinnedLink, u32)> {
    let id = *pinned?.ids.get(program)?;
    if !pinned?.classifiers.contains_key(program) || !pin.exists() {
        return None;
    }
    let linked = FdLink::from(PinnedLink::from_pin(pin).ok()?)
        .info()
        .ok()?
        .program_id();
    let (_, attached) = SchedClassifier::query_tcx(interface, direction).ok()?;
    (linked == id && attached.iter().any(|info| info.id() == id))
        .then(|| PinnedLink::from_pin(pin).ok())
        .flatten()
        .map(|link| (link, id))
}

/// Where an entry program comes from: the pinned one a restart reuses, else the object's,
/// loaded with the family programs (the IPv6 ones, or the idle program in their slots).
struct Loader<'a> {
    pinned: Option<&'a mut PinnedPrograms>,
    ipv6: bool,
}

/// Attaches `program` to `interface` (`direction`) as a legacy clsact filter in our slot.
fn attach_legacy(
    ebpf: &mut Ebpf,
    loader: Loader<'_>,
    program: &'static str,
    interface: &str,
    ifindex: u32,
    direction: TcAttachType,
    pin_dir: &Path,
) -> Result<(), EbpfError> {
    let classifier = loaded_classifier(ebpf, loader.pinned, loader.ipv6, program, pin_dir)?;
    legacy_tc::attach(classifier, interface, ifindex, direction)
        .map_err(|e| EbpfError::LegacyTc(Box::new(e)))
}

/// Attaches `program` to `interface` (`direction`) as a TCX link and pins it (replacing, and
/// so detaching, a previous agent's link for the same interface only once the new one runs).
fn attach(
    ebpf: &mut Ebpf,
    loader: Loader<'_>,
    program: &'static str,
    interface: &str,
    direction: TcAttachType,
    pin_dir: &Path,
    pin_name: &str,
) -> Result<(PinnedLink, Option<u32>), EbpfError> {
    let program_error = |source| EbpfError::Program {
        name: program,
        source,
    };
    let classifier = loaded_classifier(ebpf, loader.pinned, loader.ipv6, program, pin_dir)?;
    // TCX on ≥ 6.6 (toolchain.md): a link, so it can be pinned and outlive the agent. Appended
    // last: programs attached before ours run first.
    let link_id = classifier
        .attach_with_options(
            interface,
            direction,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )
        .map_err(program_error)?;
    let link = classifier.take_link(link_id).map_err(program_error)?;
    let link = FdLink::try_from(link).map_err(|source| EbpfError::Link {
        name: program,
        source,
    })?;
    let program_id = link.info().ok().map(|info| info.program_id());
    let link = crate::attach::pins::pin_replacing(link, program, &pin_dir.join(pin_name))?;
    Ok((link, program_id))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use proxy_kernel::node::{Interface, ebpf::node_config};

    fn iface(name: &str, addrs: &[&str], loopback: bool) -> (String, Interface) {
        (
            name.to_owned(),
            Interface {
                name: name.to_owned(),
                addrs: addrs.iter().map(|a| a.parse().expect("addr")).collect(),
                loopback,
                link: None,
            },
        )
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|a| a.parse().expect("addr")).collect()
    }

    /// What a bare dataplane (no node manager: the test rig) programs from its options.
    fn facts(options: &TcOptions, all: &BTreeMap<String, Interface>) -> (NodeConfig, Vec<IpAddr>) {
        let settings = NodeSettings::compute(&options.node_inputs(), None, all);
        let external =
            node::ebpf::external_interfaces(&options.interfaces, &settings.detect_local, all);
        node_config(&settings, all, &external)
    }

    #[test]
    fn options_without_a_node_manager_give_upstream_node_port_addresses() {
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
        let (config, addrs) = facts(&options, &all);
        assert_eq!(config.snat4, ip4_to_map(Ipv4Addr::new(10, 10, 0, 1)));
        assert_eq!(config.flags, node_flags::CLUSTER_CIDR4);
        // Match-all is every local address (`--dst-type LOCAL`), link-local ones included.
        assert_eq!(
            addrs,
            ips(&["10.10.0.1", "fd00:10::1", "fe80::1", "fe80::2"])
        );

        // IPv6 CIDRs only: IPv4 matches all (NewNodePortAddresses per family).
        let only_v6 = TcOptions {
            node_port_cidrs: vec!["fd00::/8".parse().expect("cidr")],
            ..TcOptions::default()
        };
        assert_eq!(facts(&only_v6, &all).1, ips(&["10.10.0.1", "fd00:10::1"]));

        // Localhost NodePorts: every 127/8 address (a flag) with match-all; the listed
        // loopback addresses with CIDRs; never ::1; none without localhostNodePorts.
        let localhost = TcOptions {
            localhost_node_ports: true,
            ..TcOptions::default()
        };
        let (config, addrs) = facts(&localhost, &all);
        assert_eq!(config.flags, node_flags::LOCALHOST_NODEPORTS);
        assert!(!addrs.iter().any(IpAddr::is_loopback), "{addrs:?}");
        let listed = TcOptions {
            node_port_cidrs: vec![
                "127.0.0.0/8".parse().expect("cidr"),
                "::1/128".parse().expect("cidr"),
                "10.10.0.0/24".parse().expect("cidr"),
            ],
            localhost_node_ports: true,
            ..TcOptions::default()
        };
        let (config, addrs) = facts(&listed, &all);
        assert_eq!(config.flags, 0);
        assert_eq!(addrs, ips(&["10.10.0.1", "127.0.0.1"]));
        let off = TcOptions {
            localhost_node_ports: false,
            ..listed
        };
        let (config, addrs) = facts(&off, &all);
        assert_eq!((config.flags, addrs), (0, ips(&["10.10.0.1"])));
    }
}
