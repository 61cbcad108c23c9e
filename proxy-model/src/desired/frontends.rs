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

/// The frontends local processes (host-network processes and pods) reach a service port
/// through — kube-proxy's `KUBE-SERVICES` as traversed from OUTPUT and, for pods, PREROUTING:
/// - the ClusterIP with the internal endpoints; with `internalTrafficPolicy: Local` and no local
///   endpoint kube-proxy DROPs (`"has no local endpoints" -j DROP`), so the frontend carries
///   [`frontend_flags::DROP_NO_BACKENDS`](proxy_common::frontend_flags::DROP_NO_BACKENDS);
/// - the NodePort (unspecified address: the hooks match any NodePort address of the node,
///   kube-proxy's final `--dst-type LOCAL -j KUBE-NODEPORTS` rule), externalIPs and LB IPs with
///   the cluster endpoints: kube-proxy's KUBE-EXT chain sends the node's own traffic
///   (`--src-type LOCAL`) and its pods' (the local-traffic detector) to KUBE-SVC even with
///   `externalTrafficPolicy: Local` ("short-circuiting"), and KUBE-EXTERNAL-SERVICES, which
///   would REJECT/DROP, is not on their path (hooked from INPUT/FORWARD for packets still
///   addressed to the node);
/// - an LB IP guarded by `loadBalancerSourceRanges` with the ranges: the hooks translate only
///   the node's own processes there, judged by the node address (a socket has no source address
///   yet at connect()); pods' packets go to the tc program on their veth, which judges their
///   source like kube-proxy's KUBE-FW chain.
pub fn socket_frontends(port: &ServicePort) -> Vec<(FrontendKey, Frontend)> {
    use proxy_common::frontend_flags as f;
    let key = |addr, port_number| FrontendKey {
        addr,
        port: port_number,
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
    let mut cluster_ip = frontend(&mut port.internal_endpoints());
    if cluster_ip.backends.is_empty() && port.has_any_endpoints {
        cluster_ip.flags |= f::DROP_NO_BACKENDS;
    }
    let mut frontends = vec![(key(port.cluster_ip, port.port), cluster_ip)];
    if !port.externally_accessible() {
        return frontends;
    }
    let external = frontend(&mut port.cluster_endpoints());
    if let Some(node_port) = port.node_port {
        frontends.push((
            key(unspecified(port.cluster_ip), node_port),
            external.clone(),
        ));
    }
    for &addr in &port.external_ips {
        frontends.push((key(addr, port.port), external.clone()));
    }
    // kube-proxy applies source ranges only while the service has endpoints (no FW chain
    // otherwise: the REJECT comes first).
    let guarded = !port.source_ranges.is_empty() && port.has_any_endpoints;
    for &addr in &port.load_balancer_ips {
        let mut lb = external.clone();
        if guarded {
            lb.flags |= f::SOURCE_RANGES;
            lb.source_ranges = port.source_ranges.clone();
        }
        frontends.push((key(addr, port.port), lb));
    }
    frontends
}

/// The unspecified address of `addr`'s family: a NodePort frontend's address.
fn unspecified(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
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
        frontends.push((
            key(unspecified(port.cluster_ip), node_port),
            external.clone(),
        ));
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
