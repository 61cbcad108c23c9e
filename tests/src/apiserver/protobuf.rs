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
//!
//! Presence follows Go, not JSON. The upstream marshallers (gogo-generated `generated.pb.go` in
//! k8s.io/api and k8s.io/apimachinery) write every field that is not a pointer in the Go struct,
//! even when it is empty: a `string` as `""`, an `int32`/`int64`/`bool` as 0/false, a struct
//! held by value (`ObjectMeta`, `ListMeta`, `ServiceSpec`, `metav1.Time`, `IntOrString`,
//! `EndpointConditions`, ...) as a message, possibly empty. Only pointers (`*string`, `*int32`,
//! `*bool`, `*Time`, pointer structs) are left out when nil, and slices and maps write just
//! their elements. So a field the JSON omitted (`omitempty`) comes out here as `Some("")`,
//! `Some(0)`, `Some(false)` or an empty message when Go holds it by value, and the agent must
//! read those as absent, as JSON's `omitempty` would have them.

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

/// One list item's bytes (the object's message, not enveloped): what a list repeats.
pub fn encode_item(resource: Resource, item: &Value) -> Result<Vec<u8>, String> {
    Ok(match resource {
        Resource::Services => service(typed(item)?).encode_to_vec(),
        Resource::EndpointSlices => endpoint_slice(typed(item)?).encode_to_vec(),
        Resource::Nodes => node(typed(item)?).encode_to_vec(),
    })
}

/// A whole LIST body (`ServiceList`, `EndpointSliceList` or `NodeList`, enveloped) of items
/// already encoded ([`encode_item`]). Every `*List` message is
/// `metadata = 1; repeated items = 2`, and a repeated message field is each item's bytes
/// behind its tag and length: the concatenation is what encoding the whole list would give.
pub fn encode_list_of<B: AsRef<[u8]>>(
    resource: Resource,
    resource_version: &str,
    items: &[B],
) -> Vec<u8> {
    let mut raw =
        Vec::with_capacity(items.iter().map(|i| i.as_ref().len() + 6).sum::<usize>() + 32);
    prost::encoding::message::encode(1, &list_meta(resource_version), &mut raw);
    for item in items {
        let item = item.as_ref();
        prost::encoding::encode_key(2, prost::encoding::WireType::LengthDelimited, &mut raw);
        prost::encoding::encode_varint(item.len() as u64, &mut raw);
        raw.extend_from_slice(item);
    }
    envelope(resource.api_version(), &resource.list_kind(), raw)
}

/// A watched object (a `Status` for ERROR events, whatever the watched resource), enveloped.
pub fn encode_object(resource: Resource, object: &Value) -> Result<Vec<u8>, String> {
    if object["kind"] == "Status" {
        return Ok(encode_status(object));
    }
    let raw = encode_item(resource, object)?;
    Ok(envelope(resource.api_version(), resource.kind(), raw))
}

/// A `metav1.Status` (as built by `http::status_object`), enveloped as `v1/Status`.
pub fn encode_status(status: &Value) -> Vec<u8> {
    let text = |name: &str| Some(status[name].as_str().unwrap_or_default().to_owned());
    let status = pb_meta::Status {
        // Upstream's Status embeds ListMeta by value: always written, empty here.
        metadata: Some(list_meta("")),
        status: text("status"),
        message: text("message"),
        reason: text("reason"),
        // A pointer (`*StatusDetails`), nil here.
        details: None,
        code: Some(
            status["code"]
                .as_i64()
                .and_then(|c| i32::try_from(c).ok())
                .unwrap_or_default(),
        ),
    };
    envelope("v1", "Status", status.encode_to_vec())
}

fn typed<T: serde::de::DeserializeOwned>(object: &Value) -> Result<T, String> {
    // The stored objects came from k8s-openapi values, so this fails only on a server bug.
    serde_json::from_value(object.clone()).map_err(|e| format!("converting a stored object: {e}"))
}

/// A field Go holds by value (not a pointer): written even when zero, so absent becomes the
/// zero value (`""`, 0, false, an empty message).
fn always<T: Default>(value: Option<T>) -> Option<T> {
    Some(value.unwrap_or_default())
}

/// `metav1.ListMeta`: `selfLink`, `resourceVersion` and `continue` are plain strings,
/// `remainingItemCount` a pointer.
fn list_meta(resource_version: &str) -> pb_meta::ListMeta {
    pb_meta::ListMeta {
        self_link: Some(String::new()),
        resource_version: Some(resource_version.to_owned()),
        r#continue: Some(String::new()),
        remaining_item_count: None,
    }
}

fn list<T>(items: Option<Vec<T>>) -> Vec<T> {
    items.unwrap_or_default()
}

fn map<K: Ord, V>(
    items: Option<std::collections::BTreeMap<K, V>>,
) -> std::collections::BTreeMap<K, V> {
    items.unwrap_or_default()
}

/// Go's zero `time.Time` (0001-01-01T00:00:00Z) as Unix seconds.
const GO_ZERO_TIME_SECONDS: i64 = -62_135_596_800;

/// metav1.Time is `{seconds, nanos}` on the wire, but upstream's time_proto.go writes only Go's
/// `Unix()` seconds (rounded down) and a zero `nanos`: the type has second precision. A zero
/// Time marshals to nothing (`Marshal`/`MarshalTo` return no bytes when `IsZero()`), so the
/// enclosing field, written whenever Go holds the Time by value or by a non-nil pointer, is an
/// empty message.
fn time(t: meta::Time) -> pb_meta::Time {
    if t.0.as_second() == GO_ZERO_TIME_SECONDS && t.0.subsec_nanosecond() == 0 {
        return pb_meta::Time::default();
    }
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

/// A `metav1.Time` Go holds by value: absent is the zero Time, an empty message.
fn value_time(t: Option<meta::Time>) -> Option<pb_meta::Time> {
    Some(t.map(time).unwrap_or_default())
}

/// `intstr.IntOrString` writes all three of its plain fields; absent is the zero value, the
/// integer 0.
fn int_or_string(value: Option<IntOrString>) -> PbIntOrString {
    // `type` is intstr.Type: 0 Int, 1 String.
    let (r#type, int_val, str_val) = match value {
        None => (0, 0, String::new()),
        Some(IntOrString::Int(i)) => (0, i, String::new()),
        Some(IntOrString::String(s)) => (1, 0, s),
    };
    PbIntOrString {
        r#type: Some(r#type),
        int_val: Some(int_val),
        str_val: Some(str_val),
    }
}

/// managedFields are left out: nothing here writes them and the agent does not read them.
fn object_meta(m: meta::ObjectMeta) -> pb_meta::ObjectMeta {
    pb_meta::ObjectMeta {
        name: always(m.name),
        generate_name: always(m.generate_name),
        namespace: always(m.namespace),
        self_link: always(m.self_link),
        uid: always(m.uid),
        resource_version: always(m.resource_version),
        generation: always(m.generation),
        creation_timestamp: value_time(m.creation_timestamp),
        // Pointers.
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
        observed_generation: always(c.observed_generation),
        last_transition_time: Some(time(c.last_transition_time)),
        reason: Some(c.reason),
        message: Some(c.message),
    }
}

fn object_reference(r: core::ObjectReference) -> pb_core::ObjectReference {
    pb_core::ObjectReference {
        kind: always(r.kind),
        namespace: always(r.namespace),
        name: always(r.name),
        uid: always(r.uid),
        api_version: always(r.api_version),
        resource_version: always(r.resource_version),
        field_path: always(r.field_path),
    }
}

pub(super) fn service(s: core::Service) -> pb_core::Service {
    pb_core::Service {
        metadata: Some(object_meta(s.metadata)),
        // Spec and status are held by value, as is the status's LoadBalancerStatus.
        spec: Some(service_spec(s.spec.unwrap_or_default())),
        status: Some(service_status(s.status.unwrap_or_default())),
    }
}

fn service_status(status: core::ServiceStatus) -> pb_core::ServiceStatus {
    pb_core::ServiceStatus {
        load_balancer: Some(pb_core::LoadBalancerStatus {
            ingress: list(status.load_balancer.unwrap_or_default().ingress)
                .into_iter()
                .map(|i| pb_core::LoadBalancerIngress {
                    ip: always(i.ip),
                    hostname: always(i.hostname),
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
    }
}

fn service_spec(spec: core::ServiceSpec) -> pb_core::ServiceSpec {
    pb_core::ServiceSpec {
        ports: list(spec.ports)
            .into_iter()
            .map(|p| pb_core::ServicePort {
                name: always(p.name),
                protocol: always(p.protocol),
                app_protocol: p.app_protocol,
                port: Some(p.port),
                target_port: Some(int_or_string(p.target_port)),
                node_port: always(p.node_port),
            })
            .collect(),
        selector: map(spec.selector),
        cluster_ip: always(spec.cluster_ip),
        cluster_ips: list(spec.cluster_ips),
        r#type: always(spec.type_),
        external_ips: list(spec.external_ips),
        session_affinity: always(spec.session_affinity),
        load_balancer_ip: always(spec.load_balancer_ip),
        load_balancer_source_ranges: list(spec.load_balancer_source_ranges),
        external_name: always(spec.external_name),
        external_traffic_policy: always(spec.external_traffic_policy),
        health_check_node_port: always(spec.health_check_node_port),
        publish_not_ready_addresses: always(spec.publish_not_ready_addresses),
        // Pointers from here on (ipFamilies is a slice).
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
                // Held by value; its three fields are pointers.
                conditions: Some(
                    e.conditions
                        .map(|c| pb_discovery::EndpointConditions {
                            ready: c.ready,
                            serving: c.serving,
                            terminating: c.terminating,
                        })
                        .unwrap_or_default(),
                ),
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
/// allocatable, phase, daemon endpoints, nodeInfo); images, volumes, config, runtimeHandlers,
/// features and declaredFeatures are left out: the agent never reads them and the tests never
/// set them (all slices or pointers, so empty is what upstream writes for them anyway).
pub(super) fn node(n: core::Node) -> pb_core::Node {
    let quantities = |q: Option<
        std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| {
        map(q)
            .into_iter()
            .map(|(k, v)| (k, PbQuantity { string: Some(v.0) }))
            .collect()
    };
    let spec = n.spec.unwrap_or_default();
    let status = n.status.unwrap_or_default();
    pb_core::Node {
        metadata: Some(object_meta(n.metadata)),
        // Spec and status are held by value.
        spec: Some(pb_core::NodeSpec {
            pod_cidr: always(spec.pod_cidr),
            pod_cid_rs: list(spec.pod_cidrs),
            provider_id: always(spec.provider_id),
            unschedulable: always(spec.unschedulable),
            taints: list(spec.taints)
                .into_iter()
                .map(|t| pb_core::Taint {
                    key: Some(t.key),
                    value: always(t.value),
                    effect: Some(t.effect),
                    time_added: t.time_added.map(time),
                })
                .collect(),
            config_source: spec.config_source.map(|c| pb_core::NodeConfigSource {
                config_map: c.config_map.map(|m| pb_core::ConfigMapNodeConfigSource {
                    namespace: Some(m.namespace),
                    name: Some(m.name),
                    uid: always(m.uid),
                    resource_version: always(m.resource_version),
                    kubelet_config_key: Some(m.kubelet_config_key),
                }),
            }),
            // DoNotUseExternalID, a plain string.
            external_id: always(spec.external_id),
        }),
        status: Some(pb_core::NodeStatus {
            capacity: quantities(status.capacity),
            allocatable: quantities(status.allocatable),
            phase: always(status.phase),
            conditions: list(status.conditions)
                .into_iter()
                .map(|c| pb_core::NodeCondition {
                    r#type: Some(c.type_),
                    status: Some(c.status),
                    last_heartbeat_time: value_time(c.last_heartbeat_time),
                    last_transition_time: value_time(c.last_transition_time),
                    reason: always(c.reason),
                    message: always(c.message),
                })
                .collect(),
            addresses: list(status.addresses)
                .into_iter()
                .map(|a| pb_core::NodeAddress {
                    r#type: Some(a.type_),
                    address: Some(a.address),
                })
                .collect(),
            // NodeDaemonEndpoints and its DaemonEndpoint are held by value.
            daemon_endpoints: Some(pb_core::NodeDaemonEndpoints {
                kubelet_endpoint: Some(pb_core::DaemonEndpoint {
                    port: Some(
                        status
                            .daemon_endpoints
                            .and_then(|d| d.kubelet_endpoint)
                            .map_or(0, |k| k.port),
                    ),
                }),
            }),
            // NodeSystemInfo is held by value: ten plain strings and a `*NodeSwapStatus`.
            node_info: Some(node_info(status.node_info.unwrap_or_default())),
            ..Default::default()
        }),
    }
}

fn node_info(i: core::NodeSystemInfo) -> pb_core::NodeSystemInfo {
    pb_core::NodeSystemInfo {
        machine_id: Some(i.machine_id),
        system_uuid: Some(i.system_uuid),
        boot_id: Some(i.boot_id),
        kernel_version: Some(i.kernel_version),
        os_image: Some(i.os_image),
        container_runtime_version: Some(i.container_runtime_version),
        kubelet_version: Some(i.kubelet_version),
        kube_proxy_version: Some(i.kube_proxy_version),
        operating_system: Some(i.operating_system),
        architecture: Some(i.architecture),
        swap: i.swap.map(|s| pb_core::NodeSwapStatus {
            capacity: s.capacity,
        }),
    }
}

#[cfg(test)]
mod list_tests {
    use super::*;

    /// The list the server writes from its cached items is, byte for byte, prost's encoding of
    /// the whole list message.
    #[test]
    fn a_list_of_encoded_items_is_the_encoded_list() -> Result<(), String> {
        let objects: Vec<Value> = (1..=3)
            .map(|i| {
                serde_json::json!({
                    "metadata": {"name": format!("web{i}"), "namespace": "default",
                                 "resourceVersion": format!("{i}")},
                    "spec": {"clusterIP": format!("10.96.0.{i}"),
                             "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
                })
            })
            .collect();
        let items = objects
            .iter()
            .map(|o| encode_item(Resource::Services, o))
            .collect::<Result<Vec<_>, _>>()?;
        let whole = pb_core::ServiceList {
            metadata: Some(list_meta("7")),
            items: objects
                .iter()
                .map(|o| typed(o).map(service))
                .collect::<Result<_, _>>()?,
        }
        .encode_to_vec();
        assert_eq!(
            encode_list_of(Resource::Services, "7", &items),
            envelope(
                Resource::Services.api_version(),
                &Resource::Services.list_kind(),
                whole
            )
        );
        Ok(())
    }
}
