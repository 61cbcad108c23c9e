//! EndpointSlices → the endpoints of each service port, as kube-proxy's `endpointslicecache`
//! builds them: slice ports match by name and protocol, an endpoint's first address is used,
//! endpoints of the other IP family are ignored, and an endpoint listed twice counts once (a
//! local copy wins). The result is sorted by endpoint string, kube-proxy's order.

use std::{collections::BTreeMap, net::IpAddr};

use super::{IpFamily, Protocol};
use crate::objects::{EndpointAddress, EndpointSliceInfo, ObjectKey};

/// An endpoint before selection, with what selection needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawEndpoint {
    pub addr: IpAddr,
    pub port: u16,
    pub is_local: bool,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub zone_hints: Vec<String>,
    pub node_hints: Vec<String>,
}

/// A slice problem worth one warning; the rest of the slice is still used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SliceWarning {
    #[error("EndpointSlice {slice}: ports[{index}]: no name; ignored (kube-proxy ignores it too)")]
    PortWithoutName { slice: ObjectKey, index: usize },
    #[error("EndpointSlice {slice}: ports[{index}]: missing or invalid port; ignored")]
    InvalidPort { slice: ObjectKey, index: usize },
    #[error("EndpointSlice {slice}: ports[{index}]: unsupported protocol {value:?}; ignored")]
    InvalidProtocol {
        slice: ObjectKey,
        index: usize,
        value: String,
    },
    #[error(
        "EndpointSlice {slice}: endpoints[{index}].addresses[0]: {value} is {reason}, never a Service's endpoint; ignored"
    )]
    UnusableAddress {
        slice: ObjectKey,
        index: usize,
        value: String,
        reason: &'static str,
    },
    #[error("EndpointSlice {slice}: endpoints[{index}]: invalid address {value:?}; ignored")]
    InvalidAddress {
        slice: ObjectKey,
        index: usize,
        value: String,
    },
}

pub type EndpointsByPort = BTreeMap<(String, Protocol), Vec<RawEndpoint>>;

/// The endpoints of every (port name, protocol) of one Service in one IP family.
pub fn endpoints_by_port(
    slices: &[(&ObjectKey, &EndpointSliceInfo)],
    family: IpFamily,
    node_name: &str,
    warnings: &mut Vec<SliceWarning>,
) -> EndpointsByPort {
    // Keyed by endpoint string so duplicates collapse and the order is kube-proxy's.
    let mut by_port: BTreeMap<(String, Protocol), BTreeMap<String, RawEndpoint>> = BTreeMap::new();
    for (key, slice) in slices {
        for (index, slice_port) in slice.ports.iter().enumerate() {
            let Some(name) = slice_port.name.as_deref().map(str::to_owned) else {
                warnings.push(SliceWarning::PortWithoutName {
                    slice: (*key).clone(),
                    index,
                });
                continue;
            };
            let Some(port) = slice_port
                .port
                .and_then(|p| u16::try_from(p).ok())
                .filter(|&p| p != 0)
            else {
                warnings.push(SliceWarning::InvalidPort {
                    slice: (*key).clone(),
                    index,
                });
                continue;
            };
            let Some(protocol) = Protocol::from_k8s(slice_port.protocol.as_deref()) else {
                warnings.push(SliceWarning::InvalidProtocol {
                    slice: (*key).clone(),
                    index,
                    value: slice_port
                        .protocol
                        .as_deref()
                        .unwrap_or_default()
                        .to_owned(),
                });
                continue;
            };
            let endpoints = by_port.entry((name, protocol)).or_default();
            add_endpoints(key, slice, port, family, node_name, endpoints, warnings);
        }
    }
    by_port
        .into_iter()
        .map(|(port, endpoints)| (port, endpoints.into_values().collect()))
        .collect()
}

fn add_endpoints(
    key: &ObjectKey,
    slice: &EndpointSliceInfo,
    port: u16,
    family: IpFamily,
    node_name: &str,
    into: &mut BTreeMap<String, RawEndpoint>,
    warnings: &mut Vec<SliceWarning>,
) {
    for (index, endpoint) in slice.endpoints.iter().enumerate() {
        let addr = match &endpoint.address {
            None => continue,
            Some(EndpointAddress::Ip(addr)) => *addr,
            Some(EndpointAddress::Invalid(value)) => {
                // Only worth a warning once per slice, not once per port.
                let warning = SliceWarning::InvalidAddress {
                    slice: key.clone(),
                    index,
                    value: value.to_string(),
                };
                if !warnings.contains(&warning) {
                    warnings.push(warning);
                }
                continue;
            }
        };
        if IpFamily::of(&addr) != family {
            continue;
        }
        if let Some(reason) = crate::ip_family::unusable_address(&addr) {
            let warning = SliceWarning::UnusableAddress {
                slice: key.clone(),
                index,
                value: addr.to_string(),
                reason,
            };
            if !warnings.contains(&warning) {
                warnings.push(warning);
            }
            continue;
        }
        let is_local = !node_name.is_empty() && endpoint.node_name.as_deref() == Some(node_name);
        let hints = endpoint.hints.as_deref();
        let names = |names: &[crate::objects::Name]| names.iter().map(|n| n.to_string()).collect();
        let raw = RawEndpoint {
            addr,
            port,
            is_local,
            ready: endpoint.ready(),
            serving: endpoint.serving(),
            terminating: endpoint.terminating(),
            zone_hints: hints.map(|h| names(&h.zones)).unwrap_or_default(),
            node_hints: hints.map(|h| names(&h.nodes)).unwrap_or_default(),
        };
        let endpoint_string = std::net::SocketAddr::new(addr, port).to_string();
        // kube-proxy keeps the first copy unless a later one is local.
        if is_local || !into.contains_key(&endpoint_string) {
            into.insert(endpoint_string, raw);
        }
    }
}
