//! EndpointSlices → the endpoints of each service port, as kube-proxy's `endpointslicecache`
//! builds them: slice ports match by name and protocol, an endpoint's first address is used,
//! endpoints of the other IP family are ignored, and an endpoint listed twice counts once (see
//! `keeps_copy` for which copy). The result is sorted by endpoint string, kube-proxy's order.

use std::{
    collections::{BTreeMap, btree_map::Entry},
    fmt,
    net::{IpAddr, SocketAddr},
};

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
    let mut by_port: BTreeMap<(String, Protocol), BTreeMap<EndpointText, RawEndpoint>> =
        BTreeMap::new();
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
    into: &mut BTreeMap<EndpointText, RawEndpoint>,
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
        match into.entry(EndpointText::new(SocketAddr::new(addr, port))) {
            // The first copy always takes its place (`keeps_copy(false, _)`).
            Entry::Vacant(place) => {
                place.insert(raw);
            }
            Entry::Occupied(mut place) => {
                if keeps_copy(true, raw.terminating) {
                    place.insert(raw);
                }
            }
        }
    }
}

/// An endpoint's string as kube-proxy sorts and dedups endpoints by it (`ip:port`,
/// `[ip]:port`), formatted on the stack: a heap string per endpoint and port, allocated,
/// compared down a tree and freed, was a fifth of a full snapshot at 30k Services.
#[derive(Clone, Copy)]
struct EndpointText {
    len: u8,
    bytes: [u8; ENDPOINT_TEXT_MAX],
}

/// `[` + the longest IPv6 text (45, with an embedded IPv4 address) + `]:` + 5 digits: 53.
const ENDPOINT_TEXT_MAX: usize = 56;

impl EndpointText {
    fn new(endpoint: SocketAddr) -> Self {
        let mut text = Self {
            len: 0,
            bytes: [0; ENDPOINT_TEXT_MAX],
        };
        // Cannot fail: every socket address fits (see `ENDPOINT_TEXT_MAX`).
        let _ = fmt::Write::write_fmt(&mut text, format_args!("{endpoint}"));
        text
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl fmt::Write for EndpointText {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let start = usize::from(self.len);
        let end = start + s.len();
        let (Some(place), Ok(len)) = (self.bytes.get_mut(start..end), u8::try_from(end)) else {
            return Err(fmt::Error);
        };
        place.copy_from_slice(s.as_bytes());
        self.len = len;
        Ok(())
    }
}

// Byte order: the order of the strings (`String`'s `Ord` compares bytes).
impl Ord for EndpointText {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl PartialOrd for EndpointText {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for EndpointText {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for EndpointText {}

/// Whether a copy of an endpoint string replaces the copy seen before it (`seen`), as
/// kube-proxy 1.36's `addEndpoints` decides: a copy that is not terminating always does, a
/// terminating one only fills an empty place. Two cases list one address twice:
///
/// - a pod network that hands out the address of a pod still stuck terminating: the new pod's
///   copy must win whatever the order of the copies (in one slice or across slices), or the
///   Service loses its only ready endpoint to the ghost (a copy's node does not count, so a
///   ghost on this node does not win for being local);
/// - the EndpointSlice controller moving an endpoint between slices, so both slices list it
///   for a moment: the copies are one pod's, and the next update of the slice left behind
///   settles it; meanwhile a copy that is not terminating is kept, even if the other slice is
///   the newer.
///
/// Between copies that are both terminating, the first stays; between copies that both are
/// not, the last wins. Copies come in slice-name order and, within a slice, in the slice's own
/// order; kube-proxy goes through the slices in Go's map order, so which of two such copies it
/// keeps is not defined.
fn keeps_copy(seen: bool, terminating: bool) -> bool {
    !seen || !terminating
}

#[cfg(test)]
mod tests;
