//! The Kubernetes protobuf encoding, as the real API server writes it: content negotiation, the
//! `k8s\0` + `runtime.Unknown` envelope, length-delimited watch frames, and the conversion of
//! the stored JSON objects (through the k8s-openapi types) into the k8s-pb messages.
//!
//! Upstream references: `apimachinery/pkg/runtime/serializer/protobuf/protobuf.go` (envelope:
//! magic, then `Unknown{typeMeta, raw, contentEncoding, contentType}`),
//! `.../runtime/types_proto.go` (`Unknown.NestedMarshalTo` writes `contentEncoding` and
//! `contentType` even when empty), `.../apis/meta/v1/time_proto.go` (Time: seconds only),
//! `.../util/framer/framer.go` (4-byte big-endian length per frame) and
//! `apiserver/pkg/endpoints/handlers/watch.go` (the event goes through the stream serializer,
//! which for protobuf is the raw serializer: no magic, no envelope; the object inside the event
//! goes through the normal serializer: magic and envelope).

use k8s_openapi::api::{core::v1 as core, discovery::v1 as discovery};
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_pb::api::{core::v1 as pb_core, discovery::v1 as pb_discovery};
use k8s_pb::apimachinery::pkg::api::resource::Quantity as PbQuantity;
use k8s_pb::apimachinery::pkg::apis::meta::v1 as pb_meta;
use k8s_pb::apimachinery::pkg::runtime::{RawExtension, TypeMeta, Unknown};
use k8s_pb::apimachinery::pkg::util::intstr::IntOrString as PbIntOrString;
use prost::Message as _;
use serde_json::Value;

use super::Resource;

pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";
pub const WATCH_MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf;stream=watch";
pub const JSON_MEDIA_TYPE: &str = "application/json";

/// Marks a protobuf body; the fourth byte is the encoding style (0: a `runtime.Unknown`).
pub const MAGIC: [u8; 4] = [0x6b, 0x38, 0x73, 0x00];

/// The encoding a response is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Protobuf,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Json => JSON_MEDIA_TYPE,
            Self::Protobuf => MEDIA_TYPE,
        }
    }

    /// The watch stream's Content-Type: upstream appends `;stream=watch` for every type but
    /// JSON (watch.go).
    pub fn watch_content_type(self) -> &'static str {
        match self {
            Self::Json => JSON_MEDIA_TYPE,
            Self::Protobuf => WATCH_MEDIA_TYPE,
        }
    }

    /// Picks the encoding from an `Accept` header as the real server's negotiation does
    /// (goautoneg): entries ordered by `q` (ties: a concrete type before `type/*` before
    /// `*/*`, then the client's order), the first one served wins. No header, or nothing
    /// served, means JSON (the real server would answer 406 for the latter; nothing here asks
    /// for a type it cannot get).
    pub fn negotiate(accept: Option<&str>) -> Self {
        let Some(accept) = accept else {
            return Self::Json;
        };
        let mut ranges: Vec<(f32, u8, &str, &str)> = accept
            .split(',')
            .filter_map(|range| {
                let mut parts = range.split(';');
                let media = parts.next()?.trim();
                let (kind, sub) = media.split_once('/')?;
                let mut q = 1.0_f32;
                for param in parts {
                    if let Some((name, value)) = param.split_once('=')
                        && name.trim() == "q"
                    {
                        q = value.trim().parse().unwrap_or(0.0);
                    }
                }
                let specificity = match (kind.trim(), sub.trim()) {
                    ("*", _) => 0,
                    (_, "*") => 1,
                    _ => 2,
                };
                (q > 0.0).then_some((q, specificity, kind.trim(), sub.trim()))
            })
            .collect();
        // A stable sort keeps the client's order among equals.
        ranges.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
        for (_, _, kind, sub) in ranges {
            let kind = kind.to_ascii_lowercase();
            let sub = sub.to_ascii_lowercase();
            match (kind.as_str(), sub.as_str()) {
                ("application", "vnd.kubernetes.protobuf") => return Self::Protobuf,
                // The server's own order puts JSON first, so wildcards land on it.
                ("application", "json") | ("application", "*") | ("*", "*") => return Self::Json,
                _ => {}
            }
        }
        Self::Json
    }
}

/// `k8s\0` + `Unknown{typeMeta{apiVersion, kind}, raw}`: a whole protobuf body, or the object
/// of a watch event.
pub fn envelope(api_version: &str, kind: &str, raw: Vec<u8>) -> Vec<u8> {
    let unknown = Unknown {
        type_meta: Some(TypeMeta {
            api_version: Some(api_version.to_owned()),
            kind: Some(kind.to_owned()),
        }),
        raw: Some(raw),
        // Written even when empty, as upstream's Unknown marshaller does.
        content_encoding: Some(String::new()),
        content_type: Some(String::new()),
    };
    let mut body = Vec::with_capacity(MAGIC.len() + unknown.encoded_len());
    body.extend_from_slice(&MAGIC);
    unknown.encode_raw(&mut body);
    body
}

/// One watch frame: the length, then the bare `WatchEvent` (the raw serializer adds no
/// envelope); its object is enveloped (`object` is already the output of [`envelope`]).
pub fn watch_frame(event_type: &str, object: Vec<u8>) -> Result<Vec<u8>, String> {
    let event = pb_meta::WatchEvent {
        r#type: Some(event_type.to_owned()),
        object: Some(RawExtension { raw: Some(object) }),
    };
    let len = event.encoded_len();
    let header = u32::try_from(len)
        .map_err(|_| format!("a {len}-byte watch event does not fit a frame"))?
        .to_be_bytes();
    let mut frame = Vec::with_capacity(header.len() + len);
    frame.extend_from_slice(&header);
    event.encode_raw(&mut frame);
    Ok(frame)
}

/// A whole LIST body: `ServiceList`, `EndpointSliceList` or `NodeList`, enveloped.
pub fn encode_list(
    resource: Resource,
    resource_version: &str,
    items: &[Value],
) -> Result<Vec<u8>, String> {
    let metadata = Some(pb_meta::ListMeta {
        resource_version: Some(resource_version.to_owned()),
        ..Default::default()
    });
    let raw = match resource {
        Resource::Services => pb_core::ServiceList {
            metadata,
            items: items
                .iter()
                .map(|i| typed(i).map(service))
                .collect::<Result<_, _>>()?,
        }
        .encode_to_vec(),
        Resource::EndpointSlices => pb_discovery::EndpointSliceList {
            metadata,
            items: items
                .iter()
                .map(|i| typed(i).map(endpoint_slice))
                .collect::<Result<_, _>>()?,
        }
        .encode_to_vec(),
        Resource::Nodes => pb_core::NodeList {
            metadata,
            items: items
                .iter()
                .map(|i| typed(i).map(node))
                .collect::<Result<_, _>>()?,
        }
        .encode_to_vec(),
    };
    Ok(envelope(resource.api_version(), &resource.list_kind(), raw))
}

/// A watched object (a `Status` for ERROR events, whatever the watched resource), enveloped.
pub fn encode_object(resource: Resource, object: &Value) -> Result<Vec<u8>, String> {
    if object["kind"] == "Status" {
        return Ok(encode_status(object));
    }
    let raw = match resource {
        Resource::Services => service(typed(object)?).encode_to_vec(),
        Resource::EndpointSlices => endpoint_slice(typed(object)?).encode_to_vec(),
        Resource::Nodes => node(typed(object)?).encode_to_vec(),
    };
    Ok(envelope(resource.api_version(), resource.kind(), raw))
}

/// A `metav1.Status` (as built by `http::status_object`), enveloped as `v1/Status`.
pub fn encode_status(status: &Value) -> Vec<u8> {
    let text = |name: &str| status[name].as_str().map(str::to_owned);
    let status = pb_meta::Status {
        // Upstream's Status embeds ListMeta by value: always written, empty here.
        metadata: Some(pb_meta::ListMeta::default()),
        status: text("status"),
        message: text("message"),
        reason: text("reason"),
        details: None,
        code: status["code"].as_i64().and_then(|c| i32::try_from(c).ok()),
    };
    envelope("v1", "Status", status.encode_to_vec())
}

fn typed<T: serde::de::DeserializeOwned>(object: &Value) -> Result<T, String> {
    // The stored objects came from k8s-openapi values, so this fails only on a server bug.
    serde_json::from_value(object.clone()).map_err(|e| format!("converting a stored object: {e}"))
}

fn list<T>(items: Option<Vec<T>>) -> Vec<T> {
    items.unwrap_or_default()
}

fn map<K: Ord, V>(
    items: Option<std::collections::BTreeMap<K, V>>,
) -> std::collections::BTreeMap<K, V> {
    items.unwrap_or_default()
}

/// metav1.Time is `{seconds, nanos}` on the wire, but upstream's time_proto.go writes only Go's
/// `Unix()` seconds (rounded down) and a zero `nanos`: the type has second precision.
fn time(t: meta::Time) -> pb_meta::Time {
    let seconds = t.0.as_second();
    // jiff truncates towards zero; Go's Unix() rounds down before 1970.
    let seconds = if t.0.subsec_nanosecond() < 0 {
        seconds - 1
    } else {
        seconds
    };
    pb_meta::Time {
        seconds: Some(seconds),
        nanos: Some(0),
    }
}

fn int_or_string(value: IntOrString) -> PbIntOrString {
    // `type` is intstr.Type: 0 Int, 1 String.
    match value {
        IntOrString::Int(i) => PbIntOrString {
            r#type: Some(0),
            int_val: Some(i),
            str_val: None,
        },
        IntOrString::String(s) => PbIntOrString {
            r#type: Some(1),
            int_val: None,
            str_val: Some(s),
        },
    }
}

/// managedFields are left out: nothing here writes them and the agent does not read them.
fn object_meta(m: meta::ObjectMeta) -> pb_meta::ObjectMeta {
    pb_meta::ObjectMeta {
        name: m.name,
        generate_name: m.generate_name,
        namespace: m.namespace,
        self_link: m.self_link,
        uid: m.uid,
        resource_version: m.resource_version,
        generation: m.generation,
        creation_timestamp: m.creation_timestamp.map(time),
        deletion_timestamp: m.deletion_timestamp.map(time),
        deletion_grace_period_seconds: m.deletion_grace_period_seconds,
        labels: map(m.labels),
        annotations: map(m.annotations),
        owner_references: list(m.owner_references)
            .into_iter()
            .map(|o| pb_meta::OwnerReference {
                api_version: Some(o.api_version),
                kind: Some(o.kind),
                name: Some(o.name),
                uid: Some(o.uid),
                controller: o.controller,
                block_owner_deletion: o.block_owner_deletion,
            })
            .collect(),
        finalizers: list(m.finalizers),
        managed_fields: Vec::new(),
    }
}

fn condition(c: meta::Condition) -> pb_meta::Condition {
    pb_meta::Condition {
        r#type: Some(c.type_),
        status: Some(c.status),
        observed_generation: c.observed_generation,
        last_transition_time: Some(time(c.last_transition_time)),
        reason: Some(c.reason),
        message: Some(c.message),
    }
}

fn object_reference(r: core::ObjectReference) -> pb_core::ObjectReference {
    pb_core::ObjectReference {
        kind: r.kind,
        namespace: r.namespace,
        name: r.name,
        uid: r.uid,
        api_version: r.api_version,
        resource_version: r.resource_version,
        field_path: r.field_path,
    }
}

pub(super) fn service(s: core::Service) -> pb_core::Service {
    pb_core::Service {
        metadata: Some(object_meta(s.metadata)),
        spec: s.spec.map(service_spec),
        status: s.status.map(|status| pb_core::ServiceStatus {
            load_balancer: status.load_balancer.map(|lb| pb_core::LoadBalancerStatus {
                ingress: list(lb.ingress)
                    .into_iter()
                    .map(|i| pb_core::LoadBalancerIngress {
                        ip: i.ip,
                        hostname: i.hostname,
                        ip_mode: i.ip_mode,
                        ports: list(i.ports)
                            .into_iter()
                            .map(|p| pb_core::PortStatus {
                                port: Some(p.port),
                                protocol: Some(p.protocol),
                                error: p.error,
                            })
                            .collect(),
                    })
                    .collect(),
            }),
            conditions: list(status.conditions).into_iter().map(condition).collect(),
        }),
    }
}

fn service_spec(spec: core::ServiceSpec) -> pb_core::ServiceSpec {
    pb_core::ServiceSpec {
        ports: list(spec.ports)
            .into_iter()
            .map(|p| pb_core::ServicePort {
                name: p.name,
                protocol: p.protocol,
                app_protocol: p.app_protocol,
                port: Some(p.port),
                target_port: p.target_port.map(int_or_string),
                node_port: p.node_port,
            })
            .collect(),
        selector: map(spec.selector),
        cluster_ip: spec.cluster_ip,
        cluster_ips: list(spec.cluster_ips),
        r#type: spec.type_,
        external_ips: list(spec.external_ips),
        session_affinity: spec.session_affinity,
        load_balancer_ip: spec.load_balancer_ip,
        load_balancer_source_ranges: list(spec.load_balancer_source_ranges),
        external_name: spec.external_name,
        external_traffic_policy: spec.external_traffic_policy,
        health_check_node_port: spec.health_check_node_port,
        publish_not_ready_addresses: spec.publish_not_ready_addresses,
        session_affinity_config: spec.session_affinity_config.map(|c| {
            pb_core::SessionAffinityConfig {
                client_ip: c.client_ip.map(|ip| pb_core::ClientIpConfig {
                    timeout_seconds: ip.timeout_seconds,
                }),
            }
        }),
        ip_families: list(spec.ip_families),
        ip_family_policy: spec.ip_family_policy,
        allocate_load_balancer_node_ports: spec.allocate_load_balancer_node_ports,
        load_balancer_class: spec.load_balancer_class,
        internal_traffic_policy: spec.internal_traffic_policy,
        traffic_distribution: spec.traffic_distribution,
    }
}

pub(super) fn endpoint_slice(s: discovery::EndpointSlice) -> pb_discovery::EndpointSlice {
    pb_discovery::EndpointSlice {
        metadata: Some(object_meta(s.metadata)),
        address_type: Some(s.address_type),
        endpoints: s
            .endpoints
            .into_iter()
            .map(|e| pb_discovery::Endpoint {
                addresses: e.addresses,
                conditions: e.conditions.map(|c| pb_discovery::EndpointConditions {
                    ready: c.ready,
                    serving: c.serving,
                    terminating: c.terminating,
                }),
                hostname: e.hostname,
                target_ref: e.target_ref.map(object_reference),
                deprecated_topology: map(e.deprecated_topology),
                node_name: e.node_name,
                zone: e.zone,
                hints: e.hints.map(|h| pb_discovery::EndpointHints {
                    for_zones: list(h.for_zones)
                        .into_iter()
                        .map(|z| pb_discovery::ForZone { name: Some(z.name) })
                        .collect(),
                    for_nodes: list(h.for_nodes)
                        .into_iter()
                        .map(|n| pb_discovery::ForNode { name: Some(n.name) })
                        .collect(),
                }),
            })
            .collect(),
        ports: list(s.ports)
            .into_iter()
            .map(|p| pb_discovery::EndpointPort {
                name: p.name,
                protocol: p.protocol,
                port: p.port,
                app_protocol: p.app_protocol,
            })
            .collect(),
    }
}

/// Node status keeps what a proxy or an operator reads (addresses, conditions, capacity,
/// allocatable, phase, daemon endpoints); nodeInfo, images, volumes, config, runtimeHandlers
/// and features are left out: the agent never reads them and the tests never set them.
pub(super) fn node(n: core::Node) -> pb_core::Node {
    let quantities = |q: Option<
        std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| {
        map(q)
            .into_iter()
            .map(|(k, v)| (k, PbQuantity { string: Some(v.0) }))
            .collect()
    };
    pb_core::Node {
        metadata: Some(object_meta(n.metadata)),
        spec: n.spec.map(|spec| pb_core::NodeSpec {
            pod_cidr: spec.pod_cidr,
            pod_cid_rs: list(spec.pod_cidrs),
            provider_id: spec.provider_id,
            unschedulable: spec.unschedulable,
            taints: list(spec.taints)
                .into_iter()
                .map(|t| pb_core::Taint {
                    key: Some(t.key),
                    value: t.value,
                    effect: Some(t.effect),
                    time_added: t.time_added.map(time),
                })
                .collect(),
            config_source: spec.config_source.map(|c| pb_core::NodeConfigSource {
                config_map: c.config_map.map(|m| pb_core::ConfigMapNodeConfigSource {
                    namespace: Some(m.namespace),
                    name: Some(m.name),
                    uid: m.uid,
                    resource_version: m.resource_version,
                    kubelet_config_key: Some(m.kubelet_config_key),
                }),
            }),
            external_id: spec.external_id,
        }),
        status: n.status.map(|status| pb_core::NodeStatus {
            capacity: quantities(status.capacity),
            allocatable: quantities(status.allocatable),
            phase: status.phase,
            conditions: list(status.conditions)
                .into_iter()
                .map(|c| pb_core::NodeCondition {
                    r#type: Some(c.type_),
                    status: Some(c.status),
                    last_heartbeat_time: c.last_heartbeat_time.map(time),
                    last_transition_time: c.last_transition_time.map(time),
                    reason: c.reason,
                    message: c.message,
                })
                .collect(),
            addresses: list(status.addresses)
                .into_iter()
                .map(|a| pb_core::NodeAddress {
                    r#type: Some(a.type_),
                    address: Some(a.address),
                })
                .collect(),
            daemon_endpoints: status
                .daemon_endpoints
                .map(|d| pb_core::NodeDaemonEndpoints {
                    kubelet_endpoint: d
                        .kubelet_endpoint
                        .map(|k| pb_core::DaemonEndpoint { port: Some(k.port) }),
                }),
            ..Default::default()
        }),
    }
}
