//! A Service → its service ports in one IP family, as kube-proxy's `newBaseServiceInfo` reads
//! them. Invalid fields are reported naming the Service and the field; the valid rest is kept.

use std::net::IpAddr;

use super::{IpFamily, Protocol, ServicePort, ServicePortName};
use crate::{
    ip_family::{parse_cidr_sloppy, parse_ip_sloppy, unusable_address},
    objects::{ObjectKey, ServiceInfo, intern},
};
use ipnet::IpNet;

/// Kubernetes' default `sessionAffinityConfig.clientIP.timeoutSeconds` (3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10_800;

/// A Service (or part of it) that cannot be programmed; the rest of the snapshot still is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    #[error("Service {service}: {field}: invalid IP address {value:?}; ignored")]
    InvalidIp {
        service: ObjectKey,
        field: String,
        value: String,
    },
    #[error("Service {service}: {field}: {value} is {reason}, never a Service's address; ignored")]
    UnusableAddress {
        service: ObjectKey,
        field: String,
        value: String,
        reason: &'static str,
    },
    #[error(
        "Service {service}: {field}: {address} port {port}/{protocol} belongs to Service {owner} (its cluster IP, or its older claim); ignored here"
    )]
    Conflict {
        service: ObjectKey,
        field: &'static str,
        address: IpAddr,
        port: u16,
        protocol: Protocol,
        owner: ObjectKey,
    },
    #[error("Service {service}: {field}: invalid CIDR {value:?}; ignored")]
    InvalidCidr {
        service: ObjectKey,
        field: String,
        value: String,
    },
    #[error("Service {service}: {field}: {value} is outside 1-65535; port ignored")]
    InvalidPort {
        service: ObjectKey,
        field: String,
        value: i32,
    },
    #[error(
        "Service {service}: {field}: unsupported protocol {value:?} (TCP, UDP or SCTP); port ignored"
    )]
    InvalidProtocol {
        service: ObjectKey,
        field: String,
        value: String,
    },
    #[error(
        "Service {service}: {field}: port {port}/{protocol} is listed twice; ignoring this copy"
    )]
    DuplicatePort {
        service: ObjectKey,
        field: String,
        port: u16,
        protocol: Protocol,
    },
    #[error(
        "Service {service}: {field}: invalid sessionAffinity timeout {value}; using {DEFAULT_AFFINITY_TIMEOUT}"
    )]
    InvalidAffinityTimeout {
        service: ObjectKey,
        field: String,
        value: i32,
    },
    #[error("{0}")]
    Slice(#[from] super::endpoints::SliceWarning),
}

impl ServiceError {
    /// The reason an address was refused as never a Service's (a metric label), if it was.
    pub fn unusable_reason(&self) -> Option<&'static str> {
        match self {
            Self::UnusableAddress { reason, .. }
            | Self::Slice(super::endpoints::SliceWarning::UnusableAddress { reason, .. }) => {
                Some(reason)
            }
            _ => None,
        }
    }

    /// For what a Service's own fields caused and its owner should see: the Service to post a
    /// Kubernetes Event on, and the Event's reason.
    pub fn event(&self) -> Option<(&ObjectKey, &'static str)> {
        match self {
            Self::UnusableAddress { service, .. } => Some((service, "IgnoredAddress")),
            Self::Conflict { service, .. } => Some((service, "FrontendConflict")),
            _ => None,
        }
    }
}

/// Whether kube-proxy handles this Service at all (`ShouldSkipService`): not ExternalName, and a
/// cluster IP is set (headless `None` and unallocated `""` are skipped).
pub fn is_proxied(spec: &ServiceInfo) -> bool {
    if spec.type_.as_deref() == Some("ExternalName") {
        return false;
    }
    matches!(spec.cluster_ip.as_deref(), Some(ip) if !ip.is_empty() && ip != "None")
        || spec
            .cluster_ips
            .iter()
            .flatten()
            .any(|ip| !ip.is_empty() && &**ip != "None")
}

/// The service ports of `service` in `family`, without endpoints yet.
pub fn service_ports(
    key: &ObjectKey,
    service: &ServiceInfo,
    family: IpFamily,
    errors: &mut Vec<ServiceError>,
) -> Vec<ServicePort> {
    let spec = service;
    if !is_proxied(service) {
        return Vec::new();
    }
    let Some(cluster_ip) = cluster_ip(key, service, family, errors) else {
        return Vec::new();
    };
    let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
    // With the deprecated field's gate off, upstream reads no external IP at all: the Service
    // is then only externally accessible through its NodePorts and load balancer IPs.
    let no_external_ips: &[Box<str>] = &[];
    let external_ip_strings =
        if crate::config::features::enabled(crate::config::features::ALLOW_SERVICE_EXTERNAL_IPS) {
            &spec.external_ips[..]
        } else {
            no_external_ips
        };
    let externally_accessible = matches!(type_, "LoadBalancer" | "NodePort")
        || (type_ == "ClusterIP" && !external_ip_strings.is_empty());
    let external_policy_local =
        externally_accessible && spec.external_traffic_policy.as_deref() == Some("Local");
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let needs_health_check = type_ == "LoadBalancer" && external_policy_local;

    let report = first_family(service) == Some(family);
    let external_ips = ips_of_family(
        key,
        "spec.externalIPs",
        external_ip_strings.iter().map(AsRef::as_ref),
        family,
        report,
        errors,
    );
    // Only VIP-style load balancers: `ipMode: Proxy` ones deliver to the node themselves.
    let load_balancer_ips = ips_of_family(
        key,
        "status.loadBalancer.ingress[].ip",
        service
            .load_balancer_ingress
            .iter()
            .filter(|ing| ing.ip_mode.as_deref().is_none_or(|mode| mode == "VIP"))
            .filter_map(|ing| ing.ip.as_deref())
            .filter(|ip| !ip.is_empty()),
        family,
        report,
        errors,
    );
    let source_ranges = cidrs_of_family(
        key,
        &spec.load_balancer_source_ranges,
        family,
        report,
        errors,
    );
    let affinity_timeout = affinity_timeout(key, service, report, errors);
    let health_check_node_port = if needs_health_check {
        spec.health_check_node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|&p| p != 0)
    } else {
        None
    };

    let mut ports: Vec<ServicePort> = Vec::new();
    let mut port_errors = Vec::new();
    for (index, port) in spec.ports.iter().enumerate() {
        let field = |name: &str| format!("spec.ports[{index}].{name}");
        let Some(port_number) = u16::try_from(port.port).ok().filter(|&p| p != 0) else {
            port_errors.push(ServiceError::InvalidPort {
                service: key.clone(),
                field: field("port"),
                value: port.port,
            });
            continue;
        };
        let Some(protocol) = Protocol::from_k8s(port.protocol.as_deref()) else {
            port_errors.push(ServiceError::InvalidProtocol {
                service: key.clone(),
                field: field("protocol"),
                value: port.protocol.as_deref().unwrap_or_default().to_owned(),
            });
            continue;
        };
        let name = ServicePortName {
            service: key.clone(),
            port: port.name.clone().unwrap_or_else(|| intern("")),
            protocol,
        };
        if ports
            .iter()
            .any(|p| p.name == name || (p.port == port_number && p.protocol == protocol))
        {
            port_errors.push(ServiceError::DuplicatePort {
                service: key.clone(),
                field: field("port"),
                port: port_number,
                protocol,
            });
            continue;
        }
        let node_port = match port.node_port {
            None | Some(0) => None,
            Some(value) => match u16::try_from(value) {
                Ok(p) => Some(p),
                Err(_) => {
                    port_errors.push(ServiceError::InvalidPort {
                        service: key.clone(),
                        field: field("nodePort"),
                        value,
                    });
                    None
                }
            },
        };
        ports.push(ServicePort {
            name,
            cluster_ip,
            port: port_number,
            protocol,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            source_ranges: source_ranges.clone(),
            affinity_timeout,
            external_policy_local,
            internal_policy_local,
            health_check_node_port,
            traffic_distribution: spec.traffic_distribution.as_deref().map(str::to_owned),
            endpoints: Vec::new(),
            has_any_endpoints: false,
        });
    }
    if report {
        errors.extend(port_errors);
    }
    ports
}

/// The family of the Service's first valid cluster IP: per-Service problems are reported in
/// that family's pass only.
fn first_family(spec: &ServiceInfo) -> Option<IpFamily> {
    spec.cluster_ips
        .iter()
        .flatten()
        .chain(spec.cluster_ip.iter())
        .find_map(|ip| parse_ip_sloppy(ip))
        .map(|ip| IpFamily::of(&ip))
}

/// kube-proxy's `GetClusterIPByFamily`: from `clusterIPs` when set, else `clusterIP`.
fn cluster_ip(
    key: &ObjectKey,
    spec: &ServiceInfo,
    family: IpFamily,
    errors: &mut Vec<ServiceError>,
) -> Option<IpAddr> {
    let candidates: Vec<(String, &str)> = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips
            .iter()
            .enumerate()
            .map(|(i, ip)| (format!("spec.clusterIPs[{i}]"), ip.as_ref()))
            .collect(),
        _ => spec
            .cluster_ip
            .iter()
            .map(|ip| ("spec.clusterIP".to_owned(), ip.as_ref()))
            .collect(),
    };
    for (field, value) in candidates {
        if value.is_empty() || value == "None" {
            continue;
        }
        match parse_ip_sloppy(value) {
            Some(ip) if IpFamily::of(&ip) == family => return Some(ip),
            Some(_) => {}
            // Reported once, with the IPv4 pass, not once per family.
            None if family == IpFamily::V4 => errors.push(ServiceError::InvalidIp {
                service: key.clone(),
                field,
                value: value.to_owned(),
            }),
            None => {}
        }
    }
    None
}

/// `report`: whether to report invalid values (only in the first family's pass, so each problem
/// is reported once).
fn ips_of_family<'a>(
    key: &ObjectKey,
    field: &str,
    values: impl Iterator<Item = &'a str>,
    family: IpFamily,
    report: bool,
    errors: &mut Vec<ServiceError>,
) -> Vec<IpAddr> {
    let mut ips = Vec::new();
    for value in values {
        match parse_ip_sloppy(value.trim()) {
            // Reported in the address's own family pass, so once.
            Some(ip) if IpFamily::of(&ip) == family => match unusable_address(&ip) {
                Some(reason) => errors.push(ServiceError::UnusableAddress {
                    service: key.clone(),
                    field: field.to_owned(),
                    value: ip.to_string(),
                    reason,
                }),
                None => ips.push(ip),
            },
            Some(_) => {}
            None if report => errors.push(ServiceError::InvalidIp {
                service: key.clone(),
                field: field.to_owned(),
                value: value.to_owned(),
            }),
            None => {}
        }
    }
    ips
}

fn cidrs_of_family(
    key: &ObjectKey,
    values: &[Box<str>],
    family: IpFamily,
    report: bool,
    errors: &mut Vec<ServiceError>,
) -> Vec<IpNet> {
    let mut cidrs = Vec::new();
    for (i, value) in values.iter().enumerate() {
        // Validation upstream mistakenly allows whitespace padding; trim like kube-proxy.
        match parse_cidr_sloppy(value.trim()) {
            Some(net) if IpFamily::of(&net.addr()) == family => cidrs.push(net.trunc()),
            Some(_) => {}
            None if report => errors.push(ServiceError::InvalidCidr {
                service: key.clone(),
                field: format!("spec.loadBalancerSourceRanges[{i}]"),
                value: value.to_string(),
            }),
            None => {}
        }
    }
    cidrs
}

fn affinity_timeout(
    key: &ObjectKey,
    spec: &ServiceInfo,
    report: bool,
    errors: &mut Vec<ServiceError>,
) -> Option<u32> {
    if spec.session_affinity.as_deref() != Some("ClientIP") {
        return None;
    }
    Some(match spec.affinity_timeout_seconds {
        None => DEFAULT_AFFINITY_TIMEOUT,
        // The API allows 1..=86400.
        Some(value @ 1..=86_400) => value.unsigned_abs(),
        Some(value) => {
            if report {
                errors.push(ServiceError::InvalidAffinityTimeout {
                    service: key.clone(),
                    field: "spec.sessionAffinityConfig.clientIP.timeoutSeconds".to_owned(),
                    value,
                });
            }
            DEFAULT_AFFINITY_TIMEOUT
        }
    })
}

#[cfg(test)]
mod sloppy_tests {
    use super::*;

    /// k8s.io/utils/net's ParseIPSloppy/ParseCIDRSloppy cases (net/parse_test.go and
    /// matchZeros): leading zeros are decimal, not octal; anything else is Go's parser.
    #[test]
    fn sloppy_parsing_as_utils_net() {
        let ip = |s: &str| parse_ip_sloppy(s).map(|ip| ip.to_string());
        assert_eq!(ip("1.2.3.4").as_deref(), Some("1.2.3.4"));
        assert_eq!(ip("010.001.002.003").as_deref(), Some("10.1.2.3"));
        assert_eq!(ip("000.000.000.000").as_deref(), Some("0.0.0.0"));
        assert_eq!(ip("0255.0.0.1").as_deref(), Some("255.0.0.1"));
        assert_eq!(
            ip("::ffff:010.001.002.003").as_deref(),
            Some("::ffff:10.1.2.3")
        );
        assert_eq!(ip("fd00::0010").as_deref(), Some("fd00::10"));
        for bad in [
            "256.0.0.1",
            "0256.0.0.1",
            "1.2.3",
            "1.2.3.4.5",
            "a.b.c.d",
            "",
            " 1.2.3.4",
        ] {
            assert_eq!(ip(bad), None, "{bad:?}");
        }
        let cidr = |s: &str| parse_cidr_sloppy(s).map(|n| n.to_string());
        assert_eq!(cidr("010.000.000.000/008").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(cidr("10.0.0.0/8").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(cidr("10.0.0.0/33"), None);
        assert_eq!(cidr("10.0.0.0"), None, "a prefix length is required");
        assert_eq!(cidr("10.0.0.0/x"), None);
    }
}
