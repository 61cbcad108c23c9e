//! The types of the desired state.

use std::{fmt, net::IpAddr};

use ipnet::IpNet;

use crate::objects::ObjectKey;

pub use crate::ip_family::IpFamily;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// The IP protocol number the kernel uses.
    pub const fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proxy_common::proto::TCP,
            Protocol::Udp => proxy_common::proto::UDP,
            Protocol::Sctp => proxy_common::proto::SCTP,
        }
    }

    /// The protocol of an IP protocol number the kernel uses.
    pub const fn from_number(number: u8) -> Option<Self> {
        match number {
            proxy_common::proto::TCP => Some(Protocol::Tcp),
            proxy_common::proto::UDP => Some(Protocol::Udp),
            proxy_common::proto::SCTP => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// Parses a Kubernetes protocol field; the API server defaults it to TCP.
    pub fn from_k8s(value: Option<&str>) -> Option<Self> {
        match value {
            None | Some("TCP") => Some(Protocol::Tcp),
            Some("UDP") => Some(Protocol::Udp),
            Some("SCTP") => Some(Protocol::Sctp),
            Some(_) => None,
        }
    }

    pub const fn as_k8s(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// Lower-case, as iptables' `-p`/`-m` take it.
    pub const fn as_lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_k8s())
    }
}

/// kube-proxy's ServicePortName: a Service, one of its port names and the protocol.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServicePortName {
    pub service: ObjectKey,
    /// The port's name; empty for a Service's single unnamed port. Shared with the Service's
    /// compact form (interned), so the snapshot's keys and values hold no copy of it.
    pub port: crate::objects::Name,
    pub protocol: Protocol,
}

/// Service, port name, protocol, as the derived order would; the port name without reading
/// it when both share its interned copy.
impl Ord for ServicePortName {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.service
            .cmp(&other.service)
            .then_with(|| crate::objects::cmp_shared(&self.port, &other.port))
            .then_with(|| self.protocol.cmp(&other.protocol))
    }
}

impl PartialOrd for ServicePortName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for ServicePortName {
    /// `ns/name:port`, or `ns/name` for an unnamed port — kube-proxy's
    /// `ServicePortName.String()`, used in rule comments and hashed into chain names.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

/// One endpoint of a service port, with what endpoint selection decided about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
    /// On this node (`nodeName` equals this node's name).
    pub is_local: bool,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// In the set Cluster traffic policy uses (ready and topology-eligible, or the
    /// serving+terminating fallback).
    pub cluster: bool,
    /// In the set Local traffic policy uses.
    pub local: bool,
}

impl Endpoint {
    /// `ip:port` (`[ip]:port` for IPv6), kube-proxy's endpoint string; endpoints are sorted by it.
    pub fn to_endpoint_string(&self) -> String {
        std::net::SocketAddr::new(self.addr, self.port).to_string()
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        std::net::SocketAddr::new(self.addr, self.port).fmt(f)
    }
}

/// Everything a dataplane needs about one service port in one IP family (kube-proxy's
/// `ServicePort` plus its categorized endpoints).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub name: ServicePortName,
    pub cluster_ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub node_port: Option<u16>,
    /// `spec.externalIPs` of this family.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` of this family, except `ipMode: Proxy`.
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges` of this family (whitespace trimmed, as upstream).
    pub source_ranges: Vec<IpNet>,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout: Option<u32>,
    pub external_policy_local: bool,
    pub internal_policy_local: bool,
    pub health_check_node_port: Option<u16>,
    /// `spec.trafficDistribution` as given; selection itself follows the slices' hints.
    pub traffic_distribution: Option<String>,
    /// Every endpoint of this family, sorted by endpoint string (kube-proxy's order), with the
    /// selection flags set.
    pub endpoints: Vec<Endpoint>,
    /// Whether any endpoint anywhere in the cluster is usable (decides REJECT vs DROP).
    pub has_any_endpoints: bool,
}

impl ServicePort {
    /// kube-proxy's `ExternallyAccessible`.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some()
            || !self.load_balancer_ips.is_empty()
            || !self.external_ips.is_empty()
    }

    /// The addresses the port is a frontend on: its ClusterIP, externalIPs and LB IPs (its
    /// NodePort aside, which every node address serves).
    pub fn frontend_addresses(&self) -> impl Iterator<Item = &IpAddr> {
        std::iter::once(&self.cluster_ip)
            .chain(&self.external_ips)
            .chain(&self.load_balancer_ips)
    }

    /// kube-proxy's `UsesClusterEndpoints`: Cluster internal policy, or any external access
    /// (even with Local external policy, for short-circuiting traffic from inside the cluster).
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }

    /// kube-proxy's `UsesLocalEndpoints`.
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.external_policy_local && self.externally_accessible())
    }

    pub fn cluster_endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.iter().filter(|e| e.cluster)
    }

    pub fn local_endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.iter().filter(|e| e.local)
    }

    /// The union of the two sets: every endpoint this node may send to.
    pub fn reachable_endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.iter().filter(|e| e.cluster || e.local)
    }

    /// Endpoints for traffic to the ClusterIP.
    pub fn internal_endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        let local = self.internal_policy_local;
        self.endpoints
            .iter()
            .filter(move |e| if local { e.local } else { e.cluster })
    }

    /// Endpoints for traffic from outside the node to NodePorts, externalIPs and LB IPs.
    pub fn external_endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        let local = self.external_policy_local;
        self.endpoints
            .iter()
            .filter(move |e| if local { e.local } else { e.cluster })
    }
}

/// Facts about this node that the desired state depends on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeContext {
    pub name: String,
    /// The node's `topology.kubernetes.io/zone` label.
    pub zone: Option<String>,
}

impl NodeContext {
    pub const ZONE_LABEL: &'static str = crate::objects::ZONE_LABEL;

    /// The context for `name`, with the zone from the node object when there is one.
    pub fn new(name: &str, node: Option<&crate::objects::NodeInfo>) -> Self {
        let zone = node
            .and_then(|node| node.zone.as_deref())
            .map(str::to_owned);
        Self {
            name: name.to_owned(),
            zone,
        }
    }
}

#[cfg(test)]
mod display_tests {
    use super::*;

    #[test]
    fn service_port_name_omits_the_colon_for_unnamed_ports() {
        let name = |port: &str| ServicePortName {
            service: ObjectKey {
                namespace: "ns1".into(),
                name: "svc1".into(),
            },
            port: port.into(),
            protocol: Protocol::Tcp,
        };
        assert_eq!(name("p80").to_string(), "ns1/svc1:p80");
        assert_eq!(name("").to_string(), "ns1/svc1");
    }
}
