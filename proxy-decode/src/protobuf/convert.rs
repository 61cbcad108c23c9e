//! Protobuf messages (k8s-pb, generated from upstream's `generated.proto`) → the `k8s-openapi`
//! objects the mappers convert, so that both encodings reach the store through one mapping.
//!
//! Every field of the kinds' metadata, Service spec and status, and EndpointSlice is carried
//! over; of a Node, the metadata, spec, addresses and conditions (the kubelet's images,
//! volumes and system info are nothing a proxy reads).
//!
//! The API server writes every field that is not a pointer in Go, set or not: a Service
//! without a NodePort has `nodePort: 0` on the wire, a ClusterIP Service `loadBalancerIP: ""`,
//! an object a zero `creationTimestamp`. Its JSON leaves them out (`omitempty`), and the
//! mappers read absence; so such a field's zero value becomes `None` here ([`text`],
//! [`number`], [`flag`], [`time`]), as does an empty list or map. Pointer fields keep what
//! they hold (an explicit `ready: false` is not an absent `ready`).

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{core::v1 as core, discovery::v1 as discovery},
    apimachinery::pkg::{apis::meta::v1 as meta, util::intstr::IntOrString},
    jiff::Timestamp,
};
use k8s_pb::{
    api::{core::v1 as pb_core, discovery::v1 as pb_discovery},
    apimachinery::pkg::{apis::meta::v1 as pb_meta, util::intstr as pb_intstr},
};

/// A kind the API source watches, with the message its protobuf encoding decodes into.
pub trait FromMessage: Sized {
    type Message: prost::Message + Default;

    fn from_message(message: Self::Message) -> Self;
}

impl FromMessage for core::Service {
    type Message = pb_core::Service;

    fn from_message(service: pb_core::Service) -> Self {
        Self {
            metadata: object_meta(service.metadata),
            spec: service.spec.map(service_spec),
            status: service.status.map(|status| core::ServiceStatus {
                load_balancer: status.load_balancer.map(|lb| core::LoadBalancerStatus {
                    ingress: list(lb.ingress, load_balancer_ingress),
                }),
                conditions: list(status.conditions, condition),
            }),
        }
    }
}

impl FromMessage for discovery::EndpointSlice {
    type Message = pb_discovery::EndpointSlice;

    fn from_message(slice: pb_discovery::EndpointSlice) -> Self {
        Self {
            metadata: object_meta(slice.metadata),
            address_type: slice.address_type.unwrap_or_default(),
            endpoints: slice.endpoints.into_iter().map(endpoint).collect(),
            ports: list(slice.ports, |port| discovery::EndpointPort {
                app_protocol: port.app_protocol,
                name: port.name,
                port: port.port,
                protocol: port.protocol,
            }),
        }
    }
}

impl FromMessage for core::Node {
    type Message = pb_core::Node;

    fn from_message(node: pb_core::Node) -> Self {
        Self {
            metadata: object_meta(node.metadata),
            spec: node.spec.map(|spec| core::NodeSpec {
                external_id: text(spec.external_id),
                pod_cidr: text(spec.pod_cidr),
                pod_cidrs: strings(spec.pod_cid_rs),
                provider_id: text(spec.provider_id),
                taints: list(spec.taints, |taint| core::Taint {
                    effect: taint.effect.unwrap_or_default(),
                    key: taint.key.unwrap_or_default(),
                    time_added: taint.time_added.and_then(time),
                    value: text(taint.value),
                }),
                unschedulable: flag(spec.unschedulable),
                // Dynamic kubelet configuration: removed upstream, never read here.
                config_source: None,
            }),
            status: node.status.map(|status| core::NodeStatus {
                addresses: list(status.addresses, |address| core::NodeAddress {
                    address: address.address.unwrap_or_default(),
                    type_: address.r#type.unwrap_or_default(),
                }),
                conditions: list(status.conditions, |condition| core::NodeCondition {
                    last_heartbeat_time: condition.last_heartbeat_time.and_then(time),
                    last_transition_time: condition.last_transition_time.and_then(time),
                    message: text(condition.message),
                    reason: text(condition.reason),
                    status: condition.status.unwrap_or_default(),
                    type_: condition.r#type.unwrap_or_default(),
                }),
                phase: text(status.phase),
                ..core::NodeStatus::default()
            }),
        }
    }
}

pub fn list_meta(meta: pb_meta::ListMeta) -> meta::ListMeta {
    meta::ListMeta {
        continue_: text(meta.r#continue),
        remaining_item_count: meta.remaining_item_count,
        resource_version: text(meta.resource_version),
        self_link: text(meta.self_link),
    }
}

/// A `metav1.Status` as kube reports an API error.
pub fn status(status: pb_meta::Status) -> kube_core::Status {
    let code = status
        .code
        .and_then(|code| u16::try_from(code).ok())
        .unwrap_or_default();
    kube_core::Status {
        status: match status.status.as_deref() {
            Some("Success") => Some(kube_core::response::StatusSummary::Success),
            Some("Failure") => Some(kube_core::response::StatusSummary::Failure),
            _ => None,
        },
        code,
        message: status.message.unwrap_or_default(),
        metadata: status.metadata.map(list_meta),
        reason: status.reason.unwrap_or_default(),
        details: status
            .details
            .map(|details| kube_core::response::StatusDetails {
                name: details.name.unwrap_or_default(),
                group: details.group.unwrap_or_default(),
                kind: details.kind.unwrap_or_default(),
                uid: details.uid.unwrap_or_default(),
                causes: details
                    .causes
                    .into_iter()
                    .map(|cause| kube_core::response::StatusCause {
                        reason: cause.reason.unwrap_or_default(),
                        message: cause.message.unwrap_or_default(),
                        field: cause.field.unwrap_or_default(),
                    })
                    .collect(),
                retry_after_seconds: details
                    .retry_after_seconds
                    .and_then(|s| u32::try_from(s).ok())
                    .unwrap_or_default(),
            }),
    }
}

pub fn object_meta(meta: Option<pb_meta::ObjectMeta>) -> meta::ObjectMeta {
    let Some(meta) = meta else {
        return meta::ObjectMeta::default();
    };
    meta::ObjectMeta {
        annotations: map(meta.annotations),
        creation_timestamp: meta.creation_timestamp.and_then(time),
        deletion_grace_period_seconds: meta.deletion_grace_period_seconds,
        deletion_timestamp: meta.deletion_timestamp.and_then(time),
        finalizers: strings(meta.finalizers),
        generate_name: text(meta.generate_name),
        generation: meta.generation.filter(|&generation| generation != 0),
        labels: map(meta.labels),
        // Server-side apply's bookkeeping: large, and nothing a proxy reads.
        managed_fields: None,
        name: text(meta.name),
        namespace: text(meta.namespace),
        owner_references: list(meta.owner_references, |owner| meta::OwnerReference {
            api_version: owner.api_version.unwrap_or_default(),
            block_owner_deletion: owner.block_owner_deletion,
            controller: owner.controller,
            kind: owner.kind.unwrap_or_default(),
            name: owner.name.unwrap_or_default(),
            uid: owner.uid.unwrap_or_default(),
        }),
        resource_version: text(meta.resource_version),
        self_link: text(meta.self_link),
        uid: text(meta.uid),
    }
}

fn service_spec(spec: pb_core::ServiceSpec) -> core::ServiceSpec {
    core::ServiceSpec {
        allocate_load_balancer_node_ports: spec.allocate_load_balancer_node_ports,
        cluster_ip: text(spec.cluster_ip),
        cluster_ips: strings(spec.cluster_ips),
        external_ips: strings(spec.external_ips),
        external_name: text(spec.external_name),
        external_traffic_policy: text(spec.external_traffic_policy),
        health_check_node_port: number(spec.health_check_node_port),
        internal_traffic_policy: spec.internal_traffic_policy,
        ip_families: strings(spec.ip_families),
        ip_family_policy: spec.ip_family_policy,
        load_balancer_class: spec.load_balancer_class,
        load_balancer_ip: text(spec.load_balancer_ip),
        load_balancer_source_ranges: strings(spec.load_balancer_source_ranges),
        ports: list(spec.ports, |port| core::ServicePort {
            app_protocol: port.app_protocol,
            name: text(port.name),
            node_port: number(port.node_port),
            port: port.port.unwrap_or_default(),
            protocol: text(port.protocol),
            target_port: port.target_port.and_then(int_or_string),
        }),
        publish_not_ready_addresses: flag(spec.publish_not_ready_addresses),
        selector: map(spec.selector),
        session_affinity: text(spec.session_affinity),
        session_affinity_config: spec.session_affinity_config.map(|config| {
            core::SessionAffinityConfig {
                client_ip: config.client_ip.map(|client_ip| core::ClientIPConfig {
                    timeout_seconds: client_ip.timeout_seconds,
                }),
            }
        }),
        traffic_distribution: spec.traffic_distribution,
        type_: text(spec.r#type),
    }
}

fn load_balancer_ingress(ingress: pb_core::LoadBalancerIngress) -> core::LoadBalancerIngress {
    core::LoadBalancerIngress {
        hostname: text(ingress.hostname),
        ip: text(ingress.ip),
        ip_mode: ingress.ip_mode,
        ports: list(ingress.ports, |port| core::PortStatus {
            error: port.error,
            port: port.port.unwrap_or_default(),
            protocol: port.protocol.unwrap_or_default(),
        }),
    }
}

fn endpoint(endpoint: pb_discovery::Endpoint) -> discovery::Endpoint {
    discovery::Endpoint {
        addresses: endpoint.addresses,
        conditions: endpoint
            .conditions
            .map(|conditions| discovery::EndpointConditions {
                ready: conditions.ready,
                serving: conditions.serving,
                terminating: conditions.terminating,
            }),
        deprecated_topology: map(endpoint.deprecated_topology),
        hints: endpoint.hints.map(|hints| discovery::EndpointHints {
            for_nodes: list(hints.for_nodes, |node| discovery::ForNode {
                name: node.name.unwrap_or_default(),
            }),
            for_zones: list(hints.for_zones, |zone| discovery::ForZone {
                name: zone.name.unwrap_or_default(),
            }),
        }),
        hostname: endpoint.hostname,
        node_name: endpoint.node_name,
        target_ref: endpoint.target_ref.map(|target| core::ObjectReference {
            api_version: text(target.api_version),
            field_path: text(target.field_path),
            kind: text(target.kind),
            name: text(target.name),
            namespace: text(target.namespace),
            resource_version: text(target.resource_version),
            uid: text(target.uid),
        }),
        zone: endpoint.zone,
    }
}

fn condition(condition: pb_meta::Condition) -> meta::Condition {
    meta::Condition {
        last_transition_time: condition
            .last_transition_time
            .and_then(time)
            .unwrap_or(meta::Time(Timestamp::UNIX_EPOCH)),
        message: condition.message.unwrap_or_default(),
        observed_generation: condition.observed_generation,
        reason: condition.reason.unwrap_or_default(),
        status: condition.status.unwrap_or_default(),
        type_: condition.r#type.unwrap_or_default(),
    }
}

/// intstr's `type` says which of the two values is meant (0: int, 1: string); the zero
/// value (`0`, what an unset `targetPort` is on the wire) is none.
fn int_or_string(value: pb_intstr::IntOrString) -> Option<IntOrString> {
    match value.r#type {
        Some(1) => text(value.str_val).map(IntOrString::String),
        _ => number(value.int_val).map(IntOrString::Int),
    }
}

/// A `metav1.Time` ({seconds, nanos} since the epoch); None for the zero time (written as an
/// empty message) and out of jiff's range.
fn time(time: pb_meta::Time) -> Option<meta::Time> {
    let (seconds, nanos) = (
        time.seconds.unwrap_or_default(),
        time.nanos.unwrap_or_default(),
    );
    if (seconds, nanos) == (0, 0) {
        return None;
    }
    Timestamp::new(seconds, nanos).ok().map(meta::Time)
}

/// A Go `string` field: `""` is unset.
fn text(value: Option<String>) -> Option<String> {
    value.filter(|value| !value.is_empty())
}

/// A Go `int32` field: `0` is unset.
fn number(value: Option<i32>) -> Option<i32> {
    value.filter(|&value| value != 0)
}

/// A Go `bool` field: `false` is unset.
fn flag(value: Option<bool>) -> Option<bool> {
    value.filter(|&value| value)
}

fn list<T, U>(items: Vec<T>, convert: impl FnMut(T) -> U) -> Option<Vec<U>> {
    (!items.is_empty()).then(|| items.into_iter().map(convert).collect())
}

fn strings(items: Vec<String>) -> Option<Vec<String>> {
    (!items.is_empty()).then_some(items)
}

fn map(entries: BTreeMap<String, String>) -> Option<BTreeMap<String, String>> {
    (!entries.is_empty()).then_some(entries)
}
