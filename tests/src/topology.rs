//! The test cluster node: a node namespace, pod namespaces behind veth pairs and an
//! external client namespace.
//!
//! ```text
//!   pod<i>: eth0 10.244.<i>.2/24 ──veth── vpod<i> 10.244.<i>.1/24 :node: vext 10.10.0.1/24 ──veth── eth0 10.10.0.2/24 :ext
//!           fd00:244:<i>::2/64           fd00:244:<i>::1/64          fd00:10::1/64            fd00:10::2/64
//! ```
//!
//! [`Topology::add_remote_node`] adds a second node `node2` behind the first, with pods of its
//! own (`rpod<i>`: 10.245.<i>.2/24 + fd00:245:<i>::2/64 behind `vrpod<i>` 10.245.<i>.1/24 +
//! fd00:245:<i>::1/64 on node2):
//!
//! ```text
//!   node: vnode2 10.20.0.1/24 ──veth── eth0 10.20.0.2/24 :node2   (node: 10.245.0.0/16 and
//!                fd00:20::1/64           fd00:20::2/64             fd00:245::/32 via node2;
//!                                                                  node2: default via node)
//! ```
//!
//! [`Topology::with_wiring`] with [`PodWiring::Cni`] wires the pods with a CNI reference
//! plugin instead ([`crate::cni`]): every pod on the bridge `cni0` (10.244.0.1/24,
//! fd00:244::1/64) or behind a `ptp` veth each, with the addresses `host-local` hands out of
//! 10.244.0.0/24 and fd00:244::/64 ([`Topology::pod_address`]; the plugin's result says which).
//!
//! IPv6 uses ULA addresses inside the test namespaces only, added with `nodad` so they are
//! usable at once (duplicate address detection would hold them "tentative" for a second).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::cni::{CniAttachment, CniNetwork, CniPlugin};
use crate::echo::EchoServer;
use crate::netns::Netns;
use crate::{Result, RigError};

/// Name of the echo server answering for addresses the datapath did not translate.
pub const DECOY_NAME: &str = "untranslated";

/// Where to run something inside a [`Topology`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Node,
    /// 1-based pod index.
    Pod(usize),
    Ext,
    /// 1-based pod index on the remote node ([`Topology::add_remote_node`]).
    RemotePod(usize),
    /// The remote node's own namespace (`node2`, 10.20.0.2).
    RemoteNode,
}

/// How the node's pods are connected to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodWiring {
    /// A veth per pod, created by the rig, with a /24 (/64) per pod: pod `i` is
    /// `10.244.<i>.2` behind `vpod<i>` (10.244.<i>.1).
    Routed,
    /// Wired by a CNI reference plugin, run as a container runtime runs it.
    Cni(CniPlugin),
}

/// A node with `pods` pod namespaces and one external namespace. Dropping it kills the echo
/// servers first (a process inside a namespace would keep it alive), then deletes every
/// namespace, which also destroys the veth pairs.
#[derive(Debug)]
pub struct Topology {
    // Field order is drop order: children before namespaces.
    echoes: Vec<EchoServer>,
    /// `router2` and `client2` ([`Topology::add_second_uplink`]).
    uplink2: Vec<Netns>,
    remote_pods: Vec<Netns>,
    remote: Option<Netns>,
    /// `DEL`ed before the pods' namespaces go, and before host-local's data directory.
    cni_pods: Vec<CniAttachment>,
    cni: Option<CniNetwork>,
    pods: Vec<Netns>,
    /// Each pod's IPv4 and IPv6 address (the routed scheme's, or the CNI result's).
    pod_addrs: Vec<(Ipv4Addr, Ipv6Addr)>,
    ext: Netns,
    node: Netns,
}

impl Topology {
    /// Builds the node, `pods` routed pods (1..=pods) and the external namespace.
    pub fn new(pods: usize) -> Result<Self> {
        Self::with_wiring(pods, PodWiring::Routed)
    }

    /// Builds the node, `pods` pods (1..=pods) wired as `wiring` says and the external
    /// namespace.
    pub fn with_wiring(pods: usize, wiring: PodWiring) -> Result<Self> {
        if !(1..=254).contains(&pods) {
            return Err(RigError::Other(format!("pod count {pods} not in 1..=254")));
        }
        let node = Netns::new("node")?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        let ext = Netns::new("ext")?;
        let mut topo = Self {
            echoes: Vec::new(),
            uplink2: Vec::new(),
            remote_pods: Vec::new(),
            remote: None,
            cni_pods: Vec::new(),
            cni: None,
            pods: Vec::with_capacity(pods),
            pod_addrs: Vec::with_capacity(pods),
            ext,
            node,
        };
        link(
            &topo.node,
            "vext",
            "10.10.0.1/24",
            &topo.ext,
            "10.10.0.2/24",
            "10.10.0.1",
        )?;
        link6(&topo.node, "vext", "fd00:10::1", &topo.ext, "fd00:10::2")?;
        if let PodWiring::Cni(plugin) = wiring {
            topo.cni = Some(CniNetwork::new(plugin, &topo.node)?);
            for i in 1..=pods {
                let pod = Netns::new(&format!("pod{i}"))?;
                // Pushed first: should ADD fail half-way, the namespace still goes on drop.
                topo.pods.push(pod);
                let (Some(cni), Some(pod)) = (&topo.cni, topo.pods.last()) else {
                    return Err(RigError::Other("CNI network".into()));
                };
                let attachment = cni.add(pod)?;
                topo.pod_addrs.push(attachment.addresses());
                topo.cni_pods.push(attachment);
            }
            return Ok(topo);
        }
        for i in 1..=pods {
            let pod = Netns::new(&format!("pod{i}"))?;
            link(
                &topo.node,
                &format!("vpod{i}"),
                &format!("{}/24", Self::pod_gateway(i)),
                &pod,
                &format!("{}/24", Self::pod_ip(i)),
                &Self::pod_gateway(i).to_string(),
            )?;
            link6(
                &topo.node,
                &format!("vpod{i}"),
                &Self::pod_gateway6(i).to_string(),
                &pod,
                &Self::pod_ip6(i).to_string(),
            )?;
            topo.pods.push(pod);
            topo.pod_addrs.push((Self::pod_ip(i), Self::pod_ip6(i)));
        }
        Ok(topo)
    }

    /// Pod `i`'s (1-based) address of the family, however the pods are wired.
    pub fn pod_address(&self, i: usize, ipv6: bool) -> Result<IpAddr> {
        let (v4, v6) = i
            .checked_sub(1)
            .and_then(|k| self.pod_addrs.get(k))
            .ok_or_else(|| RigError::Other(format!("no pod {i}")))?;
        Ok(if ipv6 { (*v6).into() } else { (*v4).into() })
    }

    /// The CNI plugin that wired the pods, if one did.
    pub fn cni_plugin(&self) -> Option<CniPlugin> {
        self.cni.as_ref().map(CniNetwork::plugin)
    }

    pub fn node(&self) -> &Netns {
        &self.node
    }

    pub fn ext(&self) -> &Netns {
        &self.ext
    }

    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// The namespace of pod `i` (1-based).
    pub fn pod(&self, i: usize) -> Result<&Netns> {
        i.checked_sub(1)
            .and_then(|k| self.pods.get(k))
            .ok_or_else(|| RigError::Other(format!("no pod {i}")))
    }

    pub fn netns(&self, place: Place) -> Result<&Netns> {
        match place {
            Place::Node => Ok(&self.node),
            Place::Ext => Ok(&self.ext),
            Place::Pod(i) => self.pod(i),
            Place::RemoteNode => self
                .remote
                .as_ref()
                .ok_or_else(|| RigError::Other("no remote node".into())),
            Place::RemotePod(i) => i
                .checked_sub(1)
                .and_then(|k| self.remote_pods.get(k))
                .ok_or_else(|| RigError::Other(format!("no remote pod {i}"))),
        }
    }

    /// Adds a second node (`node2`, no agent) linked to the node, with `pods` pods of its own
    /// running `rpod<i>` echo servers on `10.245.<i>.2:port`. The node routes the remote pod
    /// network via node2, and node2 routes everything else back via the node — what a flat
    /// cluster network does between two nodes.
    pub fn add_remote_node(&mut self, pods: usize, port: u16) -> Result<()> {
        if self.remote.is_some() || !(1..=254).contains(&pods) {
            return Err(RigError::Other("one remote node with 1..=254 pods".into()));
        }
        let remote = Netns::new("node2")?;
        remote.sysctl("net.ipv4.ip_forward", "1")?;
        remote.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        link(
            &self.node,
            "vnode2",
            "10.20.0.1/24",
            &remote,
            "10.20.0.2/24",
            "10.20.0.1",
        )?;
        link6(&self.node, "vnode2", "fd00:20::1", &remote, "fd00:20::2")?;
        self.node
            .ip(&["route", "add", "10.245.0.0/16", "via", "10.20.0.2"])?;
        self.node
            .ip(&["-6", "route", "add", "fd00:245::/32", "via", "fd00:20::2"])?;
        self.remote = Some(remote);
        for i in 1..=pods {
            let pod = Netns::new(&format!("rpod{i}"))?;
            let remote = self
                .remote
                .as_ref()
                .ok_or_else(|| RigError::Other("remote node".into()))?;
            link(
                remote,
                &format!("vrpod{i}"),
                &format!("{}/24", Self::remote_pod_gateway(i)),
                &pod,
                &format!("{}/24", Self::remote_pod_ip(i)),
                &Self::remote_pod_gateway(i).to_string(),
            )?;
            link6(
                remote,
                &format!("vrpod{i}"),
                &Self::remote_pod_gateway6(i).to_string(),
                &pod,
                &Self::remote_pod_ip6(i).to_string(),
            )?;
            self.remote_pods.push(pod);
            let addr = SocketAddrV4::new(Self::remote_pod_ip(i), port);
            self.start_echo(Place::RemotePod(i), &format!("rpod{i}"), addr.into())?;
        }
        Ok(())
    }

    /// `10.20.0.2`, the remote node's address on its link to the node.
    pub fn remote_node_ip() -> Ipv4Addr {
        Ipv4Addr::new(10, 20, 0, 2)
    }

    /// `10.20.0.1`, the node's address on its link to the remote node.
    pub fn node_link_ip() -> Ipv4Addr {
        Ipv4Addr::new(10, 20, 0, 1)
    }

    /// `10.245.<i>.2`, remote pod `i`'s address.
    pub fn remote_pod_ip(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 245, octet(i), 2)
    }

    fn remote_pod_gateway(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 245, octet(i), 1)
    }

    /// `fd00:245:<i>::2`, remote pod `i`'s IPv6 address.
    pub fn remote_pod_ip6(i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x245, u16::from(octet(i)), 0, 0, 0, 0, 2)
    }

    fn remote_pod_gateway6(i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x245, u16::from(octet(i)), 0, 0, 0, 0, 1)
    }

    /// Remote pod `i`'s address of the given family.
    pub fn remote_pod_addr(i: usize, ipv6: bool) -> IpAddr {
        if ipv6 {
            Self::remote_pod_ip6(i).into()
        } else {
            Self::remote_pod_ip(i).into()
        }
    }

    /// `fd00:20::1`, the node's IPv6 address on its link to the remote node.
    pub fn node_link_ip6() -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 1)
    }

    /// Starts `rpod<i>` echo servers on `[fd00:245:<i>::2]:port` in every remote pod (the
    /// IPv4 ones start with [`Topology::add_remote_node`]).
    pub fn start_remote_pod_echoes6(&mut self, port: u16) -> Result<()> {
        for i in 1..=self.remote_pods.len() {
            let addr = SocketAddrV6::new(Self::remote_pod_ip6(i), port, 0, 0);
            self.start_echo(Place::RemotePod(i), &format!("rpod{i}"), addr.into())?;
        }
        Ok(())
    }

    /// Gives the node a second uplink, `vup2` (10.30.0.1/24, fd00:30::1/64), to a router
    /// (`router2`, forwarding) behind which a client (`client2`, 10.40.0.2, fd00:40::2) lives.
    /// The node has no route to the client's network but its default route (see
    /// [`Topology::route_node_via_ext`]), which leaves by `vext`: a node with two uplinks where
    /// a client reached through the second is routed back through the first. The router
    /// sends everything else to the node. Loose reverse-path filtering on the node (`2`, as
    /// systemd sets it), which such a node needs.
    pub fn add_second_uplink(&mut self) -> Result<()> {
        if !self.uplink2.is_empty() {
            return Err(RigError::Other("one second uplink".into()));
        }
        let router = Netns::new("router2")?;
        router.sysctl("net.ipv4.ip_forward", "1")?;
        router.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        link(
            &self.node,
            "vup2",
            "10.30.0.1/24",
            &router,
            "10.30.0.2/24",
            "10.30.0.1",
        )?;
        link6(&self.node, "vup2", "fd00:30::1", &router, "fd00:30::2")?;
        let client = Netns::new("client2")?;
        link(
            &router,
            "vcl2",
            "10.40.0.1/24",
            &client,
            "10.40.0.2/24",
            "10.40.0.1",
        )?;
        link6(&router, "vcl2", "fd00:40::1", &client, "fd00:40::2")?;
        for key in ["all", "vup2", "vext"] {
            self.node
                .sysctl(&format!("net.ipv4.conf.{key}.rp_filter"), "2")?;
        }
        self.uplink2 = vec![client, router];
        Ok(())
    }

    /// The client behind the second uplink ([`Topology::add_second_uplink`]).
    pub fn uplink2_client(&self) -> Result<&Netns> {
        self.uplink2
            .first()
            .ok_or_else(|| RigError::Other("no second uplink".into()))
    }

    /// The node's address of the family on its second uplink: `10.30.0.1`, `fd00:30::1`.
    pub fn node_uplink2_addr(ipv6: bool) -> IpAddr {
        if ipv6 {
            Ipv6Addr::new(0xfd00, 0x30, 0, 0, 0, 0, 0, 1).into()
        } else {
            Ipv4Addr::new(10, 30, 0, 1).into()
        }
    }

    /// The address of the family of the client behind the second uplink: `10.40.0.2`,
    /// `fd00:40::2`.
    pub fn uplink2_client_addr(ipv6: bool) -> IpAddr {
        if ipv6 {
            Ipv6Addr::new(0xfd00, 0x40, 0, 0, 0, 0, 0, 2).into()
        } else {
            Ipv4Addr::new(10, 40, 0, 2).into()
        }
    }

    /// Gives the node a default route (both families) via the external namespace, as a real
    /// node has one towards its router: without it the node's own clients could not even
    /// route a packet to a ClusterIP, externalIP or LB IP. The external namespace does not
    /// forward, so a packet the node sends out to an address nobody holds is dropped there.
    pub fn route_node_via_ext(&self) -> Result<()> {
        self.node.ip(&[
            "route",
            "add",
            "default",
            "via",
            &Self::ext_ip().to_string(),
        ])?;
        self.node
            .ip(&["-6", "route", "add", "default", "via", "fd00:10::2"])?;
        Ok(())
    }

    /// `10.244.<i>.2`, the pod's own address. `i` must be in 1..=254.
    pub fn pod_ip(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, octet(i), 2)
    }

    /// `10.244.<i>.1`, the node side of pod `i`'s veth; the source address a node-namespace
    /// client uses towards that pod.
    pub fn pod_gateway(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 244, octet(i), 1)
    }

    /// `fd00:244:<i>::2`, pod `i`'s IPv6 address.
    pub fn pod_ip6(i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x244, u16::from(octet(i)), 0, 0, 0, 0, 2)
    }

    /// `fd00:244:<i>::1`, the node side of pod `i`'s veth.
    pub fn pod_gateway6(i: usize) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x244, u16::from(octet(i)), 0, 0, 0, 0, 1)
    }

    /// Pod `i`'s address of the given family.
    pub fn pod_addr(i: usize, ipv6: bool) -> IpAddr {
        if ipv6 {
            Self::pod_ip6(i).into()
        } else {
            Self::pod_ip(i).into()
        }
    }

    /// The node side of pod `i`'s veth, of the given family.
    pub fn pod_gateway_addr(i: usize, ipv6: bool) -> IpAddr {
        if ipv6 {
            Self::pod_gateway6(i).into()
        } else {
            Self::pod_gateway(i).into()
        }
    }

    pub fn ext_ip() -> Ipv4Addr {
        Ipv4Addr::new(10, 10, 0, 2)
    }

    pub fn node_ext_ip() -> Ipv4Addr {
        Ipv4Addr::new(10, 10, 0, 1)
    }

    /// `fd00:10::2`, the external client's IPv6 address.
    pub fn ext_ip6() -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 2)
    }

    /// `fd00:10::1`, the node's IPv6 address on its link to the external client.
    pub fn node_ext_ip6() -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 1)
    }

    /// `fd00:20::2`, the remote node's IPv6 address on its link to the node.
    pub fn remote_node_ip6() -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 2)
    }

    /// Adds `ip/32` (`/128`) to the node's `lo`, making it a local address of the node
    /// namespace.
    pub fn add_node_local_address(&self, ip: impl Into<IpAddr>) -> Result<()> {
        match ip.into() {
            IpAddr::V4(ip) => self
                .node
                .ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"]),
            IpAddr::V6(ip) => self.node.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{ip}/128"),
                "dev",
                "lo",
                "nodad",
            ]),
        }
        .map(drop)
    }

    /// Starts an echo server called `name` on `listen` inside `place`; it lives as long as
    /// the topology.
    pub fn start_echo(&mut self, place: Place, name: &str, listen: SocketAddr) -> Result<()> {
        let server = EchoServer::start(&self.netns(place)?.path(), name, listen)?;
        self.echoes.push(server);
        Ok(())
    }

    /// Starts a sidecar stand-in called `name` on `listen` inside `place`: an echo server
    /// answering with each TCP connection's original destination (`SO_ORIGINAL_DST`) in place
    /// of the client address ([`EchoServer::start_sidecar`]); it lives as long as the topology.
    pub fn start_sidecar(&mut self, place: Place, name: &str, listen: SocketAddr) -> Result<()> {
        let server = EchoServer::start_sidecar(&self.netns(place)?.path(), name, listen)?;
        self.echoes.push(server);
        Ok(())
    }

    /// Starts `pod<i>` echo servers on pod `i`'s IPv4 address (`10.244.<i>.2` when routed)
    /// and `port` in every pod.
    pub fn start_pod_echoes(&mut self, port: u16) -> Result<()> {
        for i in 1..=self.pods.len() {
            let addr = SocketAddr::new(self.pod_address(i, false)?, port);
            self.start_echo(Place::Pod(i), &format!("pod{i}"), addr)?;
        }
        Ok(())
    }

    /// Starts `pod<i>` echo servers on pod `i`'s IPv6 address (`[fd00:244:<i>::2]` when
    /// routed) and `port` in every pod.
    pub fn start_pod_echoes6(&mut self, port: u16) -> Result<()> {
        for i in 1..=self.pods.len() {
            let addr = SocketAddr::new(self.pod_address(i, true)?, port);
            self.start_echo(Place::Pod(i), &format!("pod{i}"), addr)?;
        }
        Ok(())
    }

    /// Process ids of the echo servers started so far (for CPU pinning in the benchmarks).
    pub fn echo_pids(&self) -> Vec<u32> {
        self.echoes.iter().map(EchoServer::pid).collect()
    }

    /// Makes `vip:port` answer as [`DECOY_NAME`] from the node namespace itself, so a
    /// connection the datapath fails to translate is visible instead of merely failing.
    pub fn add_decoy(&mut self, vip: impl Into<IpAddr>, port: u16) -> Result<()> {
        let vip = vip.into();
        self.add_node_local_address(vip)?;
        self.start_echo(Place::Node, DECOY_NAME, SocketAddr::new(vip, port))
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Explicit so that reordering the fields can never delete a namespace first.
        self.echoes.clear();
        self.remote_pods.clear();
        self.remote = None;
        self.cni_pods.clear();
        self.cni = None;
    }
}

fn octet(i: usize) -> u8 {
    u8::try_from(i).unwrap_or(u8::MAX)
}

/// Adds IPv6 addresses (`/64`, `nodad`) to both ends of an existing veth pair (`a_if` in `a`,
/// `eth0` in `b`) and gives `b` a default IPv6 route via `a_addr`.
fn link6(a: &Netns, a_if: &str, a_addr: &str, b: &Netns, b_addr: &str) -> Result<()> {
    a.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{a_addr}/64"),
        "dev",
        a_if,
        "nodad",
    ])?;
    b.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{b_addr}/64"),
        "dev",
        "eth0",
        "nodad",
    ])?;
    b.ip(&["-6", "route", "add", "default", "via", a_addr])?;
    Ok(())
}

/// Creates a veth pair directly between two namespaces (never in the host namespace),
/// addresses both ends and gives the `b` side a default route via `gw`.
fn link(a: &Netns, a_if: &str, a_addr: &str, b: &Netns, b_addr: &str, gw: &str) -> Result<()> {
    a.ip(&[
        "link",
        "add",
        a_if,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        b.name(),
    ])?;
    a.ip(&["addr", "add", a_addr, "dev", a_if])?;
    a.ip(&["link", "set", a_if, "up"])?;
    b.ip(&["addr", "add", b_addr, "dev", "eth0"])?;
    b.ip(&["link", "set", "eth0", "up"])?;
    b.ip(&["route", "add", "default", "via", gw])?;
    Ok(())
}
