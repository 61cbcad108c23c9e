//! Services and their EndpointSlices → frontends with their usable backends.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::{
    Backend, Frontend, FrontendKey, NodeContext, Protocol, ServicePortName, Snapshot,
    endpoints::{EndpointInfo, select_endpoints},
};
use crate::objects::{LABEL_SERVICE_NAME, ObjectKey, Objects};

/// A Service (or part of it) that cannot be programmed; the rest of the snapshot still is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    #[error("Service {service}: {field}: invalid IP address {value:?}")]
    InvalidIp {
        service: ObjectKey,
        field: String,
        value: String,
    },
    #[error("Service {service}: {field}: port {value} is outside 1-65535")]
    InvalidPort {
        service: ObjectKey,
        field: String,
        value: i32,
    },
    #[error("Service {service}: {field}: unsupported protocol {value:?} (TCP, UDP or SCTP)")]
    InvalidProtocol {
        service: ObjectKey,
        field: String,
        value: String,
    },
    #[error("Service {service}: frontend {frontend} is already used by {owner}; ignoring it here")]
    DuplicateFrontend {
        service: ObjectKey,
        frontend: FrontendKey,
        owner: ServicePortName,
    },
}

/// Computes the snapshot. Deterministic: the same objects always give the same snapshot and the
/// same errors, in the same order.
pub fn compute(objects: &Objects, node: &NodeContext) -> (Snapshot, Vec<ServiceError>) {
    let mut snapshot = Snapshot::default();
    let mut errors = Vec::new();
    let slices_by_service = index_slices(objects);
    for (key, service) in &objects.services {
        let slices = slices_by_service.get(key).map_or(&[][..], Vec::as_slice);
        add_service(key, service, slices, node, &mut snapshot, &mut errors);
    }
    (snapshot, errors)
}

fn index_slices(objects: &Objects) -> BTreeMap<ObjectKey, Vec<&EndpointSlice>> {
    let mut index: BTreeMap<ObjectKey, Vec<&EndpointSlice>> = BTreeMap::new();
    for (key, slice) in &objects.endpoint_slices {
        let service_name = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(LABEL_SERVICE_NAME));
        if let Some(service_name) = service_name {
            index
                .entry(ObjectKey {
                    namespace: key.namespace.clone(),
                    name: service_name.clone(),
                })
                .or_default()
                .push(slice);
        }
    }
    index
}

fn add_service(
    key: &ObjectKey,
    service: &Service,
    slices: &[&EndpointSlice],
    node: &NodeContext,
    snapshot: &mut Snapshot,
    errors: &mut Vec<ServiceError>,
) {
    let Some(spec) = &service.spec else {
        return;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return;
    }
    let cluster_ips: Vec<(String, &str)> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips
            .iter()
            .enumerate()
            .map(|(i, ip)| (format!("spec.clusterIPs[{i}]"), ip.as_str()))
            .collect(),
        (_, Some(ip)) => vec![("spec.clusterIP".to_owned(), ip.as_str())],
        _ => Vec::new(),
    };
    // Headless Services ("None") and Services without an allocated IP have no frontend.
    let mut addrs = Vec::new();
    for (field, value) in cluster_ips {
        if value.is_empty() || value == "None" {
            continue;
        }
        match value.parse::<IpAddr>() {
            Ok(addr) => addrs.push(addr),
            Err(_) => errors.push(ServiceError::InvalidIp {
                service: key.clone(),
                field,
                value: value.to_owned(),
            }),
        }
    }
    let local_only = spec.internal_traffic_policy.as_deref() == Some("Local");
    for (index, port) in spec.ports.iter().flatten().enumerate() {
        let field = |name: &str| format!("spec.ports[{index}].{name}");
        let Ok(port_number) = u16::try_from(port.port) else {
            errors.push(ServiceError::InvalidPort {
                service: key.clone(),
                field: field("port"),
                value: port.port,
            });
            continue;
        };
        if port_number == 0 {
            errors.push(ServiceError::InvalidPort {
                service: key.clone(),
                field: field("port"),
                value: port.port,
            });
            continue;
        }
        let Some(protocol) = Protocol::from_k8s(port.protocol.as_deref()) else {
            errors.push(ServiceError::InvalidProtocol {
                service: key.clone(),
                field: field("protocol"),
                value: port.protocol.clone().unwrap_or_default(),
            });
            continue;
        };
        let service_port = ServicePortName {
            service: key.clone(),
            port: port.name.clone().unwrap_or_default(),
            protocol,
        };
        let endpoints = collect_endpoints(slices, &service_port);
        for &addr in &addrs {
            let family: Vec<EndpointInfo> = endpoints
                .iter()
                .filter(|e| e.addr.is_ipv4() == addr.is_ipv4())
                .cloned()
                .collect();
            let backends: BTreeSet<Backend> = select_endpoints(&family, local_only, &node.name)
                .into_iter()
                .map(|e| Backend {
                    addr: e.addr,
                    port: e.port,
                })
                .collect();
            let frontend_key = FrontendKey {
                addr,
                port: port_number,
                protocol,
            };
            if let Some(owner) = snapshot.frontends.get(&frontend_key) {
                errors.push(ServiceError::DuplicateFrontend {
                    service: key.clone(),
                    frontend: frontend_key,
                    owner: owner.service_port.clone(),
                });
                continue;
            }
            snapshot.frontends.insert(
                frontend_key,
                Frontend {
                    service_port: service_port.clone(),
                    backends: backends.into_iter().collect(),
                },
            );
        }
    }
}

/// The endpoints of one Service port across all of the Service's slices. Slice ports match by
/// name and protocol, as in kube-proxy's endpointslicecache; only an endpoint's first address is
/// used, and an endpoint listed twice counts once (the first copy, in slice-name order, wins).
fn collect_endpoints(
    slices: &[&EndpointSlice],
    service_port: &ServicePortName,
) -> Vec<EndpointInfo> {
    let mut seen = BTreeSet::new();
    let mut endpoints = Vec::new();
    for slice in slices {
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            continue;
        }
        for slice_port in slice.ports.iter().flatten() {
            let name = slice_port.name.as_deref().unwrap_or_default();
            let protocol = Protocol::from_k8s(slice_port.protocol.as_deref());
            if name != service_port.port || protocol != Some(service_port.protocol) {
                continue;
            }
            let Some(port) = slice_port
                .port
                .and_then(|p| u16::try_from(p).ok())
                .filter(|&p| p != 0)
            else {
                continue;
            };
            for endpoint in &slice.endpoints {
                let Some(addr) = endpoint
                    .addresses
                    .first()
                    .and_then(|a| a.parse::<IpAddr>().ok())
                else {
                    continue;
                };
                if !seen.insert((addr, port)) {
                    continue;
                }
                let conditions = endpoint.conditions.as_ref();
                let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
                endpoints.push(EndpointInfo {
                    addr,
                    port,
                    ready,
                    serving: conditions.and_then(|c| c.serving).unwrap_or(ready),
                    terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
                    node_name: endpoint.node_name.clone(),
                });
            }
        }
    }
    endpoints
}

#[cfg(test)]
mod tests;
