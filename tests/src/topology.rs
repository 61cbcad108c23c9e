//! The test cluster node: a node namespace, pod namespaces behind veth pairs and an
//! external client namespace.
//!
//! ```text
//!   pod<i>: eth0 10.244.<i>.2/24 ──veth── vpod<i> 10.244.<i>.1/24 :node: vext 10.10.0.1/24 ──veth── eth0 10.10.0.2/24 :ext
//!           fd00:244:<i>::2/64           fd00:244:<i>::1/64          fd00:10::1/64            fd00:10::2/64
//! ```
//!
//! IPv6 uses ULA addresses inside the test namespaces only, added with `nodad` so they are
//! usable at once (duplicate address detection would hold them "tentative" for a second).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

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
}

/// A node with `pods` pod namespaces and one external namespace. Dropping it kills the echo
/// servers first (a process inside a namespace would keep it alive), then deletes every
/// namespace, which also destroys the veth pairs.
#[derive(Debug)]
pub struct Topology {
    // Field order is drop order: children before namespaces.
    echoes: Vec<EchoServer>,
    pods: Vec<Netns>,
    ext: Netns,
    node: Netns,
}

impl Topology {
    /// Builds the node, `pods` pods (1..=pods) and the external namespace.
    pub fn new(pods: usize) -> Result<Self> {
        if !(1..=254).contains(&pods) {
            return Err(RigError::Other(format!("pod count {pods} not in 1..=254")));
        }
        let node = Netns::new("node")?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        let ext = Netns::new("ext")?;
        let mut topo = Self {
            echoes: Vec::new(),
            pods: Vec::with_capacity(pods),
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
        }
        Ok(topo)
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
        }
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

    /// Starts `pod<i>` echo servers on `10.244.<i>.2:port` in every pod.
    pub fn start_pod_echoes(&mut self, port: u16) -> Result<()> {
        for i in 1..=self.pods.len() {
            let addr = SocketAddrV4::new(Self::pod_ip(i), port);
            self.start_echo(Place::Pod(i), &format!("pod{i}"), addr.into())?;
        }
        Ok(())
    }

    /// Starts `pod<i>` echo servers on `[fd00:244:<i>::2]:port` in every pod.
    pub fn start_pod_echoes6(&mut self, port: u16) -> Result<()> {
        for i in 1..=self.pods.len() {
            let addr = SocketAddrV6::new(Self::pod_ip6(i), port, 0, 0);
            self.start_echo(Place::Pod(i), &format!("pod{i}"), addr.into())?;
        }
        Ok(())
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
