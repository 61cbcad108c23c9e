//! Per-Service traffic as either dataplane counts it: the eBPF programs in per-CPU counters
//! indexed by a frontend's service id, the iptables mode in the packet counters of each
//! Service's own rules. A reading is a list of samples, one per counting *unit* (a frontend's
//! service id, a rule); the metrics turn the units' increases into one counter per Service port,
//! protocol and frontend kind, so a unit that disappears (a frontend removed, a chain rewritten)
//! or restarts from 0 (an id handed out again) neither takes counts back nor counts twice.

use std::fmt;
use std::net::SocketAddr;

use crate::desired::{FrontendKey, Protocol, ServicePort, ServicePortName};

/// How a client reached the Service: the frontend kinds kube-proxy writes rules for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrontendKind {
    /// The ClusterIP (in the eBPF mode, at the socket or through tc).
    ClusterIp,
    /// A NodePort on a node address.
    NodePort,
    /// A `status.loadBalancer.ingress` IP.
    LoadBalancer,
    /// An address of `spec.externalIPs`.
    ExternalIp,
}

impl FrontendKind {
    pub const ALL: [FrontendKind; 4] = [
        FrontendKind::ClusterIp,
        FrontendKind::NodePort,
        FrontendKind::LoadBalancer,
        FrontendKind::ExternalIp,
    ];

    /// The `frontend` label's value.
    pub const fn label(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "cluster_ip",
            FrontendKind::NodePort => "node_port",
            FrontendKind::LoadBalancer => "load_balancer",
            FrontendKind::ExternalIp => "external_ip",
        }
    }
}

impl FrontendKind {
    /// The kind of a service port's frontend: a NodePort has the unspecified address; among
    /// the rest the ClusterIP comes first, then LB IPs (an address both an LB IP and an
    /// externalIP gets one frontend, whose claim the LB IP wins in kube-proxy's rule order).
    pub fn of(port: &ServicePort, key: &FrontendKey) -> FrontendKind {
        if key.addr.is_unspecified() {
            FrontendKind::NodePort
        } else if key.addr == port.cluster_ip {
            FrontendKind::ClusterIp
        } else if port.load_balancer_ips.contains(&key.addr) {
            FrontendKind::LoadBalancer
        } else {
            FrontendKind::ExternalIp
        }
    }

    /// The byte the maps record it as (`proxy_common::frontend_kind`).
    pub const fn code(self) -> u8 {
        use proxy_common::frontend_kind as k;
        match self {
            FrontendKind::ClusterIp => k::CLUSTER_IP,
            FrontendKind::NodePort => k::NODE_PORT,
            FrontendKind::LoadBalancer => k::LOAD_BALANCER,
            FrontendKind::ExternalIp => k::EXTERNAL_IP,
        }
    }

    pub fn from_code(code: u8) -> Option<FrontendKind> {
        FrontendKind::ALL
            .into_iter()
            .find(|kind| kind.code() == code)
    }
}

impl ServicePortLabels {
    /// A service port's labels from the `namespace/name:port` (or `namespace/name`) text
    /// `ServicePortName` displays and the maps record; `None` for other text.
    pub fn parse(text: &str, protocol: Protocol) -> Option<ServicePortLabels> {
        let (namespace, rest) = text.split_once('/')?;
        let (name, port) = rest.split_once(':').unwrap_or((rest, ""));
        if namespace.is_empty() || name.is_empty() {
            return None;
        }
        Some(ServicePortLabels {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            port: port.to_owned(),
            protocol,
        })
    }

    pub fn of(name: &ServicePortName) -> ServicePortLabels {
        ServicePortLabels {
            namespace: name.service.namespace.to_string(),
            name: name.service.name.to_string(),
            port: name.port.to_string(),
            protocol: name.protocol,
        }
    }
}

impl fmt::Display for FrontendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The Service port a counter belongs to, as its labels name it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortLabels {
    pub namespace: String,
    pub name: String,
    /// The Service port's name; empty for a Service's single unnamed port.
    pub port: String,
    pub protocol: Protocol,
}

/// What a per-Service counter is labelled with.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceTrafficKey {
    pub service: ServicePortLabels,
    pub frontend: FrontendKind,
}

/// One unit's cumulative counts since the unit began counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TrafficCounts {
    /// Connections (TCP, SCTP) and flows (UDP) given a backend.
    pub new_connections: u64,
    /// Packets and bytes of the Service's traffic, where the path sees each packet: the eBPF
    /// mode's tc programs and XDP (external frontends, and a ClusterIP reached from outside);
    /// `None` where no packet is seen (the socket hooks and the iptables NAT table see a
    /// connection's first packet only), and the metrics then export none.
    pub packets: Option<PacketCounts>,
    /// Connections refused because the Service had no endpoints (kube-proxy's REJECT).
    pub rejected: u64,
    /// Connections dropped because the client was outside `loadBalancerSourceRanges`.
    pub dropped_source_range: u64,
    /// Connections dropped because every endpoint was on another node
    /// (`externalTrafficPolicy`/`internalTrafficPolicy: Local`).
    pub dropped_no_local: u64,
}

/// Packets and bytes (IP bytes) in each direction of a Service's flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PacketCounts {
    /// The clients' packets, to the backends.
    pub forward_packets: u64,
    pub forward_bytes: u64,
    /// The backends' packets, back to the clients.
    pub reply_packets: u64,
    pub reply_bytes: u64,
}

/// A counting unit's reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrafficSample {
    /// Identifies the unit within one dataplane's readings, stable for as long as the unit
    /// counts for the same key.
    pub unit: u64,
    pub key: ServiceTrafficKey,
    pub counts: TrafficCounts,
}

/// New connections one endpoint was given (behind `--service-traffic-endpoints`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointTrafficSample {
    pub unit: u64,
    /// Endpoints are shared by all of a Service port's frontends: no frontend kind.
    pub service: ServicePortLabels,
    pub endpoint: SocketAddr,
    pub new_connections: u64,
}

/// One reading of a dataplane's per-Service counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrafficReading {
    pub services: Vec<TrafficSample>,
    pub endpoints: Vec<EndpointTrafficSample>,
}
