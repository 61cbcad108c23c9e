//! The eBPF view of a service port: which addresses a client may dial and which backends each
//! leads to — local processes through the socket hooks ([`socket_frontends`]), packets from
//! outside the node through the tc programs ([`external_frontends`]).

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

use super::{Protocol, ServicePort, ServicePortName};

/// Which datapath serves a frontend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// Local sockets (cgroup hooks).
    Internal,
    /// Packets arriving from outside the node (tc). A NodePort has the unspecified address.
    External,
}

/// An address a client can dial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub addr: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub scope: Scope,
}

impl fmt::Display for FrontendKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            std::net::SocketAddr::new(self.addr, self.port),
            self.protocol
        )?;
        if self.scope == Scope::External {
            f.write_str(" (external)")?;
        }
        Ok(())
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
    /// `proxy_common::frontend_flags` other than affinity (external frontends only).
    pub flags: u8,
    /// `loadBalancerSourceRanges` (with `frontend_flags::SOURCE_RANGES`).
    pub source_ranges: Vec<IpNet>,
}

/// The frontends local processes reach a service port through: the ClusterIP with the internal
/// endpoints, and externalIPs / load-balancer IPs (those without `loadBalancerSourceRanges`)
/// with the cluster endpoints — like kube-proxy,
/// which sends traffic from the node itself to those addresses through the Service chain even
/// with `externalTrafficPolicy: Local` ("short-circuiting").
pub fn socket_frontends(port: &ServicePort) -> Vec<(FrontendKey, Frontend)> {
    let key = |addr| FrontendKey {
        addr,
        port: port.port,
        protocol: port.protocol,
        scope: Scope::Internal,
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
        flags: 0,
        source_ranges: Vec::new(),
    };
    let mut frontends = vec![(
        key(port.cluster_ip),
        frontend(&mut port.internal_endpoints()),
    )];
    if port.external_ips.is_empty() && port.load_balancer_ips.is_empty() {
        return frontends;
    }
    let external = frontend(&mut port.cluster_endpoints());
    // The socket hooks run before a source address is chosen, so they cannot check
    // `loadBalancerSourceRanges`; kube-proxy's KUBE-FW filters the node's own and its pods'
    // traffic to the LB IPs too. So an LB IP the ranges guard gets no socket frontend: the
    // connection goes out untranslated and meets the check where it enters a node from outside
    // (the tc programs or the cloud load balancer), with its real source address.
    let guarded = !port.source_ranges.is_empty() && port.has_any_endpoints;
    let load_balancer_ips = port.load_balancer_ips.iter().filter(|_| !guarded);
    for &addr in port.external_ips.iter().chain(load_balancer_ips) {
        frontends.push((key(addr), external.clone()));
    }
    frontends
}

/// The frontends packets from outside the node reach a service port through (kube-proxy's
/// KUBE-EXT / KUBE-NODEPORTS / KUBE-EXTERNAL-SERVICES / KUBE-FW rules):
/// - NodePort (on every NodePort address), externalIPs and LB IPs with the external endpoints:
///   `externalTrafficPolicy: Local` keeps the client address; with no endpoints anywhere the
///   client gets port unreachable (REJECT), with endpoints only elsewhere the packet is dropped
///   (DROP); LB IPs enforce `loadBalancerSourceRanges`.
/// - the ClusterIP with the internal endpoints (kube-proxy DNATs ClusterIP traffic arriving
///   from outside too, masquerading it by the local-traffic detector).
pub fn external_frontends(port: &ServicePort) -> Vec<(FrontendKey, Frontend)> {
    use proxy_common::frontend_flags as f;
    let key = |addr, port_number| FrontendKey {
        addr,
        port: port_number,
        protocol: port.protocol,
        scope: Scope::External,
    };
    let frontend = |endpoints: &mut dyn Iterator<Item = &super::Endpoint>, flags: u8| {
        let backends: Vec<Backend> = endpoints
            .map(|e| Backend {
                addr: e.addr,
                port: e.port,
            })
            .collect();
        let no_backends = if backends.is_empty() && port.has_any_endpoints {
            f::DROP_NO_BACKENDS
        } else {
            0
        };
        Frontend {
            service_port: port.name.clone(),
            backends,
            affinity_timeout: port.affinity_timeout,
            flags: flags | no_backends,
            source_ranges: Vec::new(),
        }
    };
    let mut frontends = vec![(
        key(port.cluster_ip, port.port),
        frontend(&mut port.internal_endpoints(), f::CLUSTER_IP),
    )];
    let policy = if port.external_policy_local {
        f::PRESERVE_CLIENT
    } else {
        0
    };
    let external = frontend(&mut port.external_endpoints(), policy);
    if let Some(node_port) = port.node_port {
        let any = match port.cluster_ip {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        frontends.push((key(any, node_port), external.clone()));
    }
    for &addr in &port.external_ips {
        frontends.push((key(addr, port.port), external.clone()));
    }
    for &addr in &port.load_balancer_ips {
        let mut lb = external.clone();
        // kube-proxy applies source ranges only while the service has endpoints (no FW chain
        // otherwise: the REJECT comes first).
        if !port.source_ranges.is_empty() && port.has_any_endpoints {
            lb.flags |= f::SOURCE_RANGES;
            lb.source_ranges = port.source_ranges.clone();
        }
        frontends.push((key(addr, port.port), lb));
    }
    frontends
}
