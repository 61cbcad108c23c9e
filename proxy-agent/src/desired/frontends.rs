//! The socket-level view of a service port: which addresses a local process may dial and which
//! backends each leads to. The eBPF socket hooks serve exactly these.

use std::{fmt, net::IpAddr};

use super::{Protocol, ServicePort, ServicePortName};

/// An address a client can dial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub addr: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for FrontendKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            std::net::SocketAddr::new(self.addr, self.port),
            self.protocol
        )
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
    /// The backends new connections may go to, in kube-proxy's order; empty means "reject".
    pub backends: Vec<Backend>,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout: Option<u32>,
}

/// The frontends local processes reach a service port through: the ClusterIP with the internal
/// endpoints, and externalIPs / load-balancer IPs with the cluster endpoints — like kube-proxy,
/// which sends traffic from the node itself to those addresses through the Service chain even
/// with `externalTrafficPolicy: Local` ("short-circuiting").
pub fn socket_frontends(port: &ServicePort) -> Vec<(FrontendKey, Frontend)> {
    let key = |addr| FrontendKey {
        addr,
        port: port.port,
        protocol: port.protocol,
    };
    let frontend = |endpoints: &mut dyn Iterator<Item = &super::Endpoint>| Frontend {
        service_port: port.name.clone(),
        backends: endpoints
            .map(|e| Backend {
                addr: e.addr,
                port: e.port,
            })
            .collect(),
        affinity_timeout: port.affinity_timeout,
    };
    let mut frontends = vec![(
        key(port.cluster_ip),
        frontend(&mut port.internal_endpoints()),
    )];
    if port.external_ips.is_empty() && port.load_balancer_ips.is_empty() {
        return frontends;
    }
    let external = frontend(&mut port.cluster_endpoints());
    for &addr in port.external_ips.iter().chain(&port.load_balancer_ips) {
        frontends.push((key(addr), external.clone()));
    }
    frontends
}
