//! The desired state: one pure, deterministic function from the watched objects to the
//! frontends this node must serve and the backends each may use. Dataplanes only apply it.

mod endpoints;
mod services;

use std::{collections::BTreeMap, fmt, net::IpAddr};

pub use endpoints::{EndpointInfo, select_endpoints};
pub use services::{ServiceError, compute};

use crate::objects::ObjectKey;

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

    /// Parses a Kubernetes protocol field, which defaults to TCP when absent.
    pub fn from_k8s(value: Option<&str>) -> Option<Self> {
        match value {
            None | Some("TCP") => Some(Protocol::Tcp),
            Some("UDP") => Some(Protocol::Udp),
            Some("SCTP") => Some(Protocol::Sctp),
            Some(_) => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// kube-proxy's ServicePortName: a Service and one of its named ports.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    pub service: ObjectKey,
    /// The port's name; empty for a Service's single unnamed port.
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.service, self.port)
    }
}

/// An address a client can dial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub addr: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for FrontendKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            IpAddr::V4(addr) => write!(f, "{addr}:{}/{}", self.port, self.protocol),
            IpAddr::V6(addr) => write!(f, "[{addr}]:{}/{}", self.port, self.protocol),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Backend {
    pub addr: IpAddr,
    pub port: u16,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        std::net::SocketAddr::new(self.addr, self.port).fmt(f)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frontend {
    pub service_port: ServicePortName,
    /// The backends new connections may go to, sorted; empty means "reject".
    pub backends: Vec<Backend>,
}

/// What one node must do, for every frontend.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub frontends: BTreeMap<FrontendKey, Frontend>,
}

/// Facts about this node that endpoint selection depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeContext {
    pub name: String,
}
