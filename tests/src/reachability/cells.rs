//! What the matrix is made of: IP families, clients, frontends, Service shapes, their
//! addresses, and the explicit list of cells.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::topology::Topology;

/// Service port of every shape (targetPort [`BACKEND_PORT`]).
pub const SERVICE_PORT: u16 = 80;
/// The port every echo server listens on.
pub const BACKEND_PORT: u16 = 8080;
/// NodePort of shape `k` is `NODE_PORT_BASE + k`.
pub const NODE_PORT_BASE: u16 = 30100;
/// The echo server standing in for the cloud load balancer of the `ipMode: Proxy` shape.
pub const LB_PROXY_NAME: &str = "lb-proxy";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const ALL: [Self; 2] = [Self::V4, Self::V6];

    pub fn is_v6(self) -> bool {
        self == Self::V6
    }

    /// `a` for IPv4, `b` for IPv6.
    pub fn pick(self, a: impl Into<IpAddr>, b: impl Into<IpAddr>) -> IpAddr {
        match self {
            Self::V4 => a.into(),
            Self::V6 => b.into(),
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

/// Who connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Client {
    /// `pod1` on this node: its own netns, inside the agent's cgroup.
    Pod,
    /// `rpod1` on node2. node2 runs no agent, so its pods' Service traffic enters this node
    /// from outside untranslated — as on a cluster whose other node does not translate (a
    /// node whose proxy is down, or traffic a router sends to this node). Its address is not
    /// in this node's `--cluster-cidr`, so kube-proxy's ClusterCIDR detector calls it
    /// non-local, like any external client.
    RemotePod,
    /// A host-network process: the node netns, inside the cgroup, dialling node addresses.
    Host,
    /// A host-network process dialling `127.0.0.1` / `::1`.
    Localhost,
    /// The external client `ext` (10.10.0.2 / fd00:10::2).
    External,
    /// The external client from its second address (10.11.0.2 / fd00:11::2), outside the
    /// `loadBalancerSourceRanges` of the source-ranges shape.
    ExternalOutsideRanges,
    /// `pod2` on this node dialling a Service whose only endpoint is itself: hairpin (on a
    /// bridge, the packet leaves and re-enters the same bridge port).
    Hairpin,
}

impl Client {
    pub fn name(self) -> &'static str {
        match self {
            Self::Pod => "pod",
            Self::RemotePod => "node2 pod",
            Self::Host => "host",
            Self::Localhost => "localhost",
            Self::External => "external",
            Self::ExternalOutsideRanges => "external, outside ranges",
            Self::Hairpin => "hairpin pod",
        }
    }

    /// The index of the pod on this node the client runs in, if it is one.
    pub fn local_pod(self) -> Option<usize> {
        match self {
            Self::Pod => Some(1),
            Self::Hairpin => Some(2),
            _ => None,
        }
    }

    /// The client's own address when it is not a node address (host clients use the node's);
    /// for a pod of this node, its address on routed veths (the rig knows the CNI-given one:
    /// `MatrixRig::client_address`).
    pub fn own_address(self, family: Family) -> Option<IpAddr> {
        if let Some(i) = self.local_pod() {
            return Some(Topology::pod_addr(i, family.is_v6()));
        }
        match self {
            Self::RemotePod => Some(Topology::remote_pod_addr(1, family.is_v6())),
            Self::External => Some(family.pick(EXT_IP, EXT_IP6)),
            Self::ExternalOutsideRanges => Some(family.pick(EXT2_IP, EXT2_IP6)),
            Self::Pod | Self::Hairpin | Self::Host | Self::Localhost => None,
        }
    }
}

/// The external client's first address.
pub const EXT_IP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 2);
pub const EXT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 2);
/// The external client's second address, outside every source range.
pub const EXT2_IP: Ipv4Addr = Ipv4Addr::new(10, 11, 0, 2);
pub const EXT2_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x11, 0, 0, 0, 0, 0, 2);
/// The node's address on its external link (in `--nodeport-addresses`).
pub const NODE_EXT_IP: Ipv4Addr = Ipv4Addr::new(10, 10, 0, 1);
pub const NODE_EXT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 1);
/// The node's address on its link to node2 (in `--nodeport-addresses`).
pub const NODE_LINK_IP: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 1);
pub const NODE_LINK_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 1);
/// A node address outside `--nodeport-addresses` (on a dummy interface `vlocal`).
pub const NODE_UNLISTED_IP: Ipv4Addr = Ipv4Addr::new(10, 30, 0, 1);
pub const NODE_UNLISTED_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x30, 0, 0, 0, 0, 0, 1);

/// The `--nodeport-addresses` both modes run with: the external link, the node2 link and
/// loopback for both families; `vlocal` (10.30.0.0/24) and the pod-side veths stay outside.
pub const NODEPORT_ADDRESSES: &str =
    "10.10.0.0/24,fd00:10::/64,10.20.0.0/24,fd00:20::/64,127.0.0.0/8,::1/128";
/// `--cluster-cidr`: this node's pods (10.244.<i>.2, fd00:244:<i>::2) are inside, node2's
/// (10.245.<i>.2, fd00:245:<i>::2) are not. (An IPv6 /48 would only cover fd00:244:0::/48,
/// which holds no pod: the pod index is the third group.)
pub const CLUSTER_CIDR: &str = "10.244.0.0/16,fd00:244::/32";
/// `loadBalancerSourceRanges` of the source-ranges shape: the external client's first
/// address only (not the node, so kube-proxy's allowFromNode rule is not written).
pub const SOURCE_RANGES: [&str; 2] = ["10.10.0.2/32", "fd00:10::2/128"];

/// Where a Service is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Frontend {
    ClusterIp,
    /// NodePort on the node's external address (10.10.0.1).
    NodePortExternal,
    /// NodePort on another listed node address (10.20.0.1, the link to node2).
    NodePortOther,
    /// NodePort on `127.0.0.1` / `::1`.
    NodePortLoopback,
    /// NodePort on a node address outside `--nodeport-addresses` (10.30.0.1).
    NodePortUnlisted,
    ExternalIp,
    /// The shape's load-balancer ingress IP (`ipMode: VIP`, or `Proxy` for that shape).
    LoadBalancer,
}

impl Frontend {
    pub fn name(self) -> &'static str {
        match self {
            Self::ClusterIp => "ClusterIP",
            Self::NodePortExternal => "NodePort ext addr",
            Self::NodePortOther => "NodePort other addr",
            Self::NodePortLoopback => "NodePort loopback",
            Self::NodePortUnlisted => "NodePort unlisted addr",
            Self::ExternalIp => "externalIP",
            Self::LoadBalancer => "LB IP",
        }
    }

    pub fn is_node_port(self) -> bool {
        matches!(
            self,
            Self::NodePortExternal
                | Self::NodePortOther
                | Self::NodePortLoopback
                | Self::NodePortUnlisted
        )
    }
}

/// One dual-stack Service per shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Shape {
    /// LoadBalancer, eTP Cluster; endpoints pod2 (here) + rpod2 (node2).
    EtpCluster,
    /// LoadBalancer, eTP Local; pod2 + rpod2.
    EtpLocal,
    /// LoadBalancer, eTP Local; only rpod2 (no local endpoint).
    EtpLocalNoLocal,
    /// NodePort, iTP Local; pod2 + rpod2.
    ItpLocal,
    /// NodePort, iTP Local; only rpod2.
    ItpLocalNoLocal,
    /// LoadBalancer without endpoints.
    NoEndpoints,
    /// NodePort, eTP Local; only serving+terminating (not ready) endpoints pod3 + rpod3.
    Terminating,
    /// NodePort, `sessionAffinity: ClientIP`; pod2, pod3, rpod2, rpod3.
    Affinity,
    /// LoadBalancer whose ingress IPs have `ipMode: Proxy`; pod2 + rpod2.
    LbProxy,
    /// LoadBalancer (ipMode VIP) with `loadBalancerSourceRanges` [`SOURCE_RANGES`]; pod2 + rpod2.
    SourceRanges,
    /// NodePort; only pod2, which dials it itself ([`Client::Hairpin`]).
    Hairpin,
}

/// An endpoint of a shape: an echo server name and where it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backend {
    pub name: &'static str,
    /// Pod index on its node.
    pub index: usize,
    /// On node2 (another nodeName) rather than this node.
    pub remote: bool,
    /// serving + terminating, not ready.
    pub terminating: bool,
}

const fn local(name: &'static str, index: usize) -> Backend {
    Backend {
        name,
        index,
        remote: false,
        terminating: false,
    }
}

const fn remote(name: &'static str, index: usize) -> Backend {
    Backend {
        name,
        index,
        remote: true,
        terminating: false,
    }
}

const fn terminating(b: Backend) -> Backend {
    Backend {
        terminating: true,
        ..b
    }
}

const POD2: Backend = local("pod2", 2);
const POD3: Backend = local("pod3", 3);
const RPOD2: Backend = remote("rpod2", 2);
const RPOD3: Backend = remote("rpod3", 3);
const TERMINATING: &[Backend] = &[terminating(POD3), terminating(RPOD3)];

use Client::{External, ExternalOutsideRanges, Hairpin, Host, Localhost, Pod, RemotePod};
use Frontend::{
    ClusterIp, ExternalIp, LoadBalancer, NodePortExternal, NodePortLoopback, NodePortOther,
    NodePortUnlisted,
};

/// Frontends and clients of the shapes that have every frontend.
const FULL: &[(Frontend, &[Client])] = &[
    (ClusterIp, &[Pod, RemotePod, Host, External]),
    (NodePortExternal, &[Pod, Host, External]),
    (NodePortOther, &[Pod, RemotePod, Host, External]),
    // Only a process on the node can dial its loopback.
    (NodePortLoopback, &[Localhost]),
    (NodePortUnlisted, &[Pod, Host, External]),
    (ExternalIp, &[Pod, RemotePod, Host, External]),
    (LoadBalancer, &[Pod, RemotePod, Host, External]),
];

const INTERNAL_POLICY: &[(Frontend, &[Client])] = &[
    (ClusterIp, &[Pod, RemotePod, Host, External]),
    (NodePortExternal, &[Pod, Host, External]),
];

impl Shape {
    pub const ALL: [Self; 11] = [
        Self::EtpCluster,
        Self::EtpLocal,
        Self::EtpLocalNoLocal,
        Self::ItpLocal,
        Self::ItpLocalNoLocal,
        Self::NoEndpoints,
        Self::Terminating,
        Self::Affinity,
        Self::LbProxy,
        Self::SourceRanges,
        Self::Hairpin,
    ];

    /// 1-based, used to derive the shape's addresses and NodePort.
    pub fn index(self) -> u8 {
        match self {
            Self::EtpCluster => 1,
            Self::EtpLocal => 2,
            Self::EtpLocalNoLocal => 3,
            Self::ItpLocal => 4,
            Self::ItpLocalNoLocal => 5,
            Self::NoEndpoints => 6,
            Self::Terminating => 7,
            Self::Affinity => 8,
            Self::LbProxy => 9,
            Self::SourceRanges => 10,
            Self::Hairpin => 11,
        }
    }

    /// Short name; the Service is `default/m-<name>`.
    pub fn name(self) -> &'static str {
        match self {
            Self::EtpCluster => "etp-cluster",
            Self::EtpLocal => "etp-local",
            Self::EtpLocalNoLocal => "etp-local-none",
            Self::ItpLocal => "itp-local",
            Self::ItpLocalNoLocal => "itp-local-none",
            Self::NoEndpoints => "no-endpoints",
            Self::Terminating => "terminating",
            Self::Affinity => "affinity",
            Self::LbProxy => "lb-ipmode-proxy",
            Self::SourceRanges => "lb-source-ranges",
            Self::Hairpin => "hairpin",
        }
    }

    pub fn service_name(self) -> String {
        format!("m-{}", self.name())
    }

    pub fn is_load_balancer(self) -> bool {
        matches!(
            self,
            Self::EtpCluster
                | Self::EtpLocal
                | Self::EtpLocalNoLocal
                | Self::NoEndpoints
                | Self::LbProxy
                | Self::SourceRanges
        )
    }

    pub fn etp_local(self) -> bool {
        matches!(
            self,
            Self::EtpLocal | Self::EtpLocalNoLocal | Self::Terminating
        )
    }

    pub fn itp_local(self) -> bool {
        matches!(self, Self::ItpLocal | Self::ItpLocalNoLocal)
    }

    pub fn affinity(self) -> bool {
        self == Self::Affinity
    }

    pub fn has_external_ips(self) -> bool {
        matches!(
            self,
            Self::EtpCluster | Self::EtpLocal | Self::EtpLocalNoLocal | Self::NoEndpoints
        )
    }

    /// The `ipMode` of the shape's ingress IPs.
    pub fn ip_mode(self) -> &'static str {
        if self == Self::LbProxy {
            "Proxy"
        } else {
            "VIP"
        }
    }

    pub fn source_ranges(self) -> &'static [&'static str] {
        if self == Self::SourceRanges {
            &SOURCE_RANGES
        } else {
            &[]
        }
    }

    pub fn endpoints(self) -> &'static [Backend] {
        const POD2_RPOD2: &[Backend] = &[POD2, RPOD2];
        match self {
            Self::EtpCluster
            | Self::EtpLocal
            | Self::ItpLocal
            | Self::LbProxy
            | Self::SourceRanges => POD2_RPOD2,
            Self::EtpLocalNoLocal | Self::ItpLocalNoLocal => &[RPOD2],
            Self::NoEndpoints => &[],
            Self::Terminating => TERMINATING,
            Self::Affinity => &[POD2, POD3, RPOD2, RPOD3],
            Self::Hairpin => &[POD2],
        }
    }

    /// The cells of this shape, per family: frontend and the clients that try it.
    pub fn frontends(self) -> &'static [(Frontend, &'static [Client])] {
        match self {
            Self::EtpCluster | Self::EtpLocal | Self::EtpLocalNoLocal | Self::NoEndpoints => FULL,
            Self::ItpLocal | Self::ItpLocalNoLocal => INTERNAL_POLICY,
            Self::Terminating => &[
                (ClusterIp, &[Pod, External]),
                (NodePortExternal, &[Pod, Host, External]),
                (NodePortOther, &[RemotePod]),
            ],
            Self::Affinity => &[
                (ClusterIp, &[Pod, RemotePod, Host, External]),
                (NodePortExternal, &[Pod, External]),
            ],
            // Outside clients reach an `ipMode: Proxy` IP at the load balancer, never at the
            // node, so only clients whose packets could pass through the node are cells.
            Self::LbProxy => &[(LoadBalancer, &[Pod, RemotePod, Host])],
            Self::SourceRanges => &[
                (
                    LoadBalancer,
                    &[Pod, RemotePod, Host, External, ExternalOutsideRanges],
                ),
                // Source ranges guard LB IPs only; the NodePort stays open to everyone.
                (NodePortExternal, &[ExternalOutsideRanges]),
            ],
            Self::Hairpin => &[(ClusterIp, &[Hairpin]), (NodePortExternal, &[Hairpin])],
        }
    }

    pub fn cluster_ip(self, family: Family) -> IpAddr {
        let k = self.index();
        family.pick(
            Ipv4Addr::new(10, 96, 1, k),
            Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 1, u16::from(k)),
        )
    }

    pub fn node_port(self) -> u16 {
        NODE_PORT_BASE + u16::from(self.index())
    }

    pub fn external_ip(self, family: Family) -> IpAddr {
        let k = self.index();
        family.pick(
            Ipv4Addr::new(10, 50, 0, k),
            Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, u16::from(k)),
        )
    }

    pub fn lb_ip(self, family: Family) -> IpAddr {
        let k = self.index();
        family.pick(
            Ipv4Addr::new(10, 60, 0, k),
            Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, u16::from(k)),
        )
    }
}

/// One cell of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cell {
    pub shape: Shape,
    pub frontend: Frontend,
    pub client: Client,
    pub family: Family,
}

impl Cell {
    /// A stable id for the table, e.g. `etp-local/NodePort ext addr/pod/IPv4`.
    pub fn id(&self) -> String {
        format!(
            "{}/{}/{}/{}",
            self.shape.name(),
            self.frontend.name(),
            self.client.name(),
            self.family
        )
    }

    /// Where the client connects.
    pub fn target(&self) -> std::net::SocketAddr {
        let f = self.family;
        let np = self.shape.node_port();
        let (ip, port) = match self.frontend {
            Frontend::ClusterIp => (self.shape.cluster_ip(f), SERVICE_PORT),
            Frontend::NodePortExternal => (f.pick(NODE_EXT_IP, NODE_EXT_IP6), np),
            Frontend::NodePortOther => (f.pick(NODE_LINK_IP, NODE_LINK_IP6), np),
            Frontend::NodePortLoopback => (f.pick(Ipv4Addr::LOCALHOST, Ipv6Addr::LOCALHOST), np),
            Frontend::NodePortUnlisted => (f.pick(NODE_UNLISTED_IP, NODE_UNLISTED_IP6), np),
            Frontend::ExternalIp => (self.shape.external_ip(f), SERVICE_PORT),
            Frontend::LoadBalancer => (self.shape.lb_ip(f), SERVICE_PORT),
        };
        std::net::SocketAddr::new(ip, port)
    }

    /// Connections per cell: affinity needs enough to show stickiness (15, as upstream's
    /// e2e affinity checks); elsewhere 16 make missing one of two backends a 1-in-30 000 event.
    pub fn connections(&self) -> u32 {
        if self.shape.affinity() { 15 } else { 16 }
    }
}

/// Every cell but the hairpin ones, in table order (shape, frontend, client, family).
pub fn all_cells() -> Vec<Cell> {
    cells_of(Shape::ALL.into_iter().filter(|s| *s != Shape::Hairpin))
}

/// The hairpin cells: pod2 dialling the ClusterIP and a NodePort of a Service whose only
/// endpoint is pod2 itself.
pub fn hairpin_cells() -> Vec<Cell> {
    cells_of([Shape::Hairpin])
}

fn cells_of(shapes: impl IntoIterator<Item = Shape>) -> Vec<Cell> {
    let mut cells = Vec::new();
    for shape in shapes {
        for (frontend, clients) in shape.frontends() {
            for client in *clients {
                for family in Family::ALL {
                    cells.push(Cell {
                        shape,
                        frontend: *frontend,
                        client: *client,
                        family,
                    });
                }
            }
        }
    }
    cells
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_are_unique_and_addresses_distinct() {
        let cells = all_cells();
        let set: std::collections::BTreeSet<String> = cells.iter().map(Cell::id).collect();
        assert_eq!(set.len(), cells.len());
        let ports: std::collections::BTreeSet<u16> =
            Shape::ALL.iter().map(|s| s.node_port()).collect();
        assert_eq!(ports.len(), Shape::ALL.len());
        // The localhost client only ever dials loopback, and loopback only from it.
        for c in &cells {
            assert_eq!(
                c.client == Client::Localhost,
                c.frontend == Frontend::NodePortLoopback,
                "{}",
                c.id()
            );
        }
    }
}
