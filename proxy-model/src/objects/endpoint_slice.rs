//! The agent's own form of an EndpointSlice: what the proxy reads of it and nothing else, as
//! kube-proxy's `endpointSliceInfo` keeps it. A source converts each slice as it arrives and
//! drops the `k8s-openapi` object; the store, the snapshot and both dataplanes read this.
//!
//! What the desired-state computation warns about (a port without a name, an invalid
//! address or protocol) is kept as it was written, so the warnings still name the value; the
//! rest is parsed once here: addresses as IPs, conditions as bits, repeated strings interned.
//! An endpoint takes about 60 bytes instead of about 800 as a `k8s-openapi` object.

use std::{net::IpAddr, time::SystemTime};

use k8s_openapi::api::discovery::v1::{self as k8s, EndpointSlice};

use super::interned::{Name, intern, intern_all};
use crate::{ip_family::IpFamily, time_format};

/// The label that ties an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// The annotation the network programming latency is measured from.
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSliceInfo {
    /// The `kubernetes.io/service-name` label.
    pub service: Option<Name>,
    /// `addressType`, when IPv4 or IPv6 (FQDN slices are not the proxy's business).
    pub address_type: Option<IpFamily>,
    /// The `endpoints.kubernetes.io/last-change-trigger-time` annotation, when valid.
    pub trigger_time: Option<SystemTime>,
    pub ports: Box<[SlicePort]>,
    pub endpoints: Box<[SliceEndpoint]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePort {
    pub name: Option<Name>,
    pub port: Option<i32>,
    /// As written (`None`: not set, which means TCP).
    pub protocol: Option<Name>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint {
    /// The endpoint's first address (the only one kube-proxy uses); `None` without one.
    pub address: Option<EndpointAddress>,
    pub node_name: Option<Name>,
    conditions: Conditions,
    /// `None` when the endpoint has no zone or node hints.
    pub hints: Option<Box<EndpointHints>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointAddress {
    /// Parsed as `ParseIPSloppy` does (canonical form).
    Ip(IpAddr),
    /// Not an IP address; kept for the warning.
    Invalid(Box<str>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointHints {
    pub zones: Box<[Name]>,
    pub nodes: Box<[Name]>,
}

/// The three conditions, resolved to their API defaults (unset ready/serving mean true, unset
/// terminating means false), one bit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Conditions(u8);

impl Conditions {
    const READY: u8 = 1;
    const SERVING: u8 = 2;
    const TERMINATING: u8 = 4;

    fn of(conditions: Option<&k8s::EndpointConditions>) -> Self {
        let bit = |value: Option<bool>, default: bool, bit: u8| {
            if value.unwrap_or(default) { bit } else { 0 }
        };
        Self(
            bit(conditions.and_then(|c| c.ready), true, Self::READY)
                | bit(conditions.and_then(|c| c.serving), true, Self::SERVING)
                | bit(
                    conditions.and_then(|c| c.terminating),
                    false,
                    Self::TERMINATING,
                ),
        )
    }
}

impl SliceEndpoint {
    pub fn ready(&self) -> bool {
        self.conditions.0 & Conditions::READY != 0
    }

    pub fn serving(&self) -> bool {
        self.conditions.0 & Conditions::SERVING != 0
    }

    pub fn terminating(&self) -> bool {
        self.conditions.0 & Conditions::TERMINATING != 0
    }

    fn of(endpoint: &k8s::Endpoint) -> Self {
        let address = endpoint.addresses.first().map(|text| {
            crate::ip_family::parse_ip_sloppy(text).map_or_else(
                || EndpointAddress::Invalid(text.as_str().into()),
                EndpointAddress::Ip,
            )
        });
        let hints = endpoint.hints.as_ref().and_then(|hints| {
            let zones = intern_all(
                hints
                    .for_zones
                    .iter()
                    .flatten()
                    .map(|zone| zone.name.as_str()),
            );
            let nodes = intern_all(
                hints
                    .for_nodes
                    .iter()
                    .flatten()
                    .map(|node| node.name.as_str()),
            );
            (!zones.is_empty() || !nodes.is_empty())
                .then(|| Box::new(EndpointHints { zones, nodes }))
        });
        Self {
            address,
            node_name: endpoint.node_name.as_deref().map(intern),
            conditions: Conditions::of(endpoint.conditions.as_ref()),
            hints,
        }
    }
}

impl From<&EndpointSlice> for EndpointSliceInfo {
    fn from(slice: &EndpointSlice) -> Self {
        let metadata = &slice.metadata;
        let address_type = match slice.address_type.as_str() {
            "IPv4" => Some(IpFamily::V4),
            "IPv6" => Some(IpFamily::V6),
            _ => None,
        };
        Self {
            service: metadata
                .labels
                .as_ref()
                .and_then(|labels| labels.get(LABEL_SERVICE_NAME))
                .map(|name| intern(name)),
            address_type,
            trigger_time: metadata
                .annotations
                .as_ref()
                .and_then(|annotations| annotations.get(LAST_CHANGE_TRIGGER_TIME))
                .and_then(|value| time_format::parse_rfc3339(value)),
            ports: slice
                .ports
                .iter()
                .flatten()
                .map(|port| SlicePort {
                    name: port.name.as_deref().map(intern),
                    port: port.port,
                    protocol: port.protocol.as_deref().map(intern),
                })
                .collect(),
            endpoints: slice.endpoints.iter().map(SliceEndpoint::of).collect(),
        }
    }
}

impl From<EndpointSlice> for EndpointSliceInfo {
    fn from(slice: EndpointSlice) -> Self {
        Self::from(&slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(yaml: &str) -> EndpointSliceInfo {
        serde_yaml::from_str::<EndpointSlice>(yaml)
            .expect("slice yaml")
            .into()
    }

    #[test]
    fn keeps_what_the_proxy_reads() {
        let info = slice(
            "metadata:\n  name: web-1\n  namespace: ns\n  labels: {kubernetes.io/service-name: web}\n  \
             annotations: {endpoints.kubernetes.io/last-change-trigger-time: \"2025-01-02T03:04:05Z\"}\n\
             addressType: IPv4\n\
             ports: [{name: http, port: 8080, protocol: UDP}, {port: 9090}]\n\
             endpoints:\n\
             - addresses: [010.001.002.003, 10.9.9.9]\n  nodeName: n1\n  conditions: {ready: false, terminating: true}\n  \
               hints: {forZones: [{name: z1}], forNodes: [{name: n1}]}\n\
             - addresses: [not-an-ip]\n  hints: {}\n\
             - addresses: []\n",
        );
        assert_eq!(info.service.as_deref(), Some("web"));
        assert_eq!(info.address_type, Some(IpFamily::V4));
        assert_eq!(
            info.trigger_time,
            time_format::parse_rfc3339("2025-01-02T03:04:05Z")
        );
        assert_eq!(info.ports.len(), 2);
        assert_eq!(info.ports[0].name.as_deref(), Some("http"));
        assert_eq!(info.ports[0].port, Some(8080));
        assert_eq!(info.ports[0].protocol.as_deref(), Some("UDP"));
        assert_eq!(info.ports[1].name, None);
        assert_eq!(info.ports[1].protocol, None);
        let [first, invalid, empty] = &*info.endpoints else {
            panic!("three endpoints: {:?}", info.endpoints);
        };
        // The first address only, read sloppily (leading zeros) into its canonical form.
        assert_eq!(
            first.address,
            Some(EndpointAddress::Ip([10, 1, 2, 3].into()))
        );
        assert_eq!(first.node_name.as_deref(), Some("n1"));
        assert!(!first.ready() && first.serving() && first.terminating());
        let hints = first.hints.as_ref().expect("hints");
        assert_eq!(&*hints.zones[0], "z1");
        assert_eq!(&*hints.nodes[0], "n1");
        assert_eq!(
            invalid.address,
            Some(EndpointAddress::Invalid("not-an-ip".into()))
        );
        // Unset conditions take the API defaults; empty hints are no hints.
        assert!(invalid.ready() && invalid.serving() && !invalid.terminating());
        assert!(invalid.hints.is_none());
        assert_eq!(empty.address, None);
    }

    #[test]
    fn fields_the_proxy_does_not_read_do_not_make_a_change() {
        let base = "metadata:\n  name: web-1\n  namespace: ns\n  labels: {kubernetes.io/service-name: web}\n";
        let rest = "addressType: IPv6\nendpoints: [{addresses: [\"fd00::1\"]}]\n";
        let a = slice(&format!("{base}  resourceVersion: \"1\"\n{rest}"));
        let b = slice(&format!(
            "{base}  resourceVersion: \"2\"\n  generation: 7\n{rest}"
        ));
        assert_eq!(a, b);
        let c = slice(&format!(
            "{base}addressType: IPv6\nendpoints: [{{addresses: [\"fd00::2\"]}}]\n"
        ));
        assert_ne!(a, c);
    }

    #[test]
    fn an_endpoint_is_small() {
        // The size the memory goal is built on; a field added here should be a
        // conscious choice.
        assert!(
            std::mem::size_of::<SliceEndpoint>() <= 64,
            "{} bytes",
            std::mem::size_of::<SliceEndpoint>()
        );
    }
}
