//! The decoder against messages encoded by k8s-pb (prost's encoder for upstream's schema),
//! framed as upstream's serializers frame them.

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use k8s_pb::{
    api::{core::v1 as pb_core, discovery::v1 as pb_discovery},
    apimachinery::pkg::{apis::meta::v1 as pb_meta, runtime as pb_runtime},
};

use super::*;

fn envelope_bytes(api_version: &str, kind: &str, raw: Vec<u8>) -> Vec<u8> {
    let mut bytes = MAGIC.to_vec();
    Unknown {
        type_meta: Some(TypeMeta {
            api_version: Some(api_version.into()),
            kind: Some(kind.into()),
        }),
        raw: Some(raw),
        content_encoding: Some(String::new()),
        content_type: Some(String::new()),
    }
    .encode(&mut bytes)
    .unwrap();
    bytes
}

fn meta(name: &str, rv: &str) -> Option<pb_meta::ObjectMeta> {
    Some(pb_meta::ObjectMeta {
        name: Some(name.into()),
        namespace: Some("ns".into()),
        resource_version: Some(rv.into()),
        labels: [("kubernetes.io/service-name".into(), "web".into())].into(),
        ..Default::default()
    })
}

fn service(name: &str) -> pb_core::Service {
    pb_core::Service {
        metadata: meta(name, "7"),
        spec: Some(pb_core::ServiceSpec {
            cluster_ip: Some("10.96.0.10".into()),
            cluster_ips: vec!["10.96.0.10".into(), "fd00::10".into()],
            r#type: Some("LoadBalancer".into()),
            ports: vec![pb_core::ServicePort {
                name: Some("http".into()),
                protocol: Some("TCP".into()),
                port: Some(80),
                target_port: Some(k8s_pb::apimachinery::pkg::util::intstr::IntOrString {
                    r#type: Some(1),
                    int_val: None,
                    str_val: Some("web".into()),
                }),
                node_port: Some(30080),
                ..Default::default()
            }],
            external_traffic_policy: Some("Local".into()),
            health_check_node_port: Some(32000),
            session_affinity: Some("ClientIP".into()),
            session_affinity_config: Some(pb_core::SessionAffinityConfig {
                client_ip: Some(pb_core::ClientIpConfig {
                    timeout_seconds: Some(600),
                }),
            }),
            load_balancer_source_ranges: vec!["192.0.2.0/24".into()],
            traffic_distribution: Some("PreferClose".into()),
            ..Default::default()
        }),
        status: Some(pb_core::ServiceStatus {
            load_balancer: Some(pb_core::LoadBalancerStatus {
                ingress: vec![pb_core::LoadBalancerIngress {
                    ip: Some("192.0.2.10".into()),
                    ip_mode: Some("Proxy".into()),
                    ..Default::default()
                }],
            }),
            conditions: vec![],
        }),
    }
}

/// The JSON the same Service has on the wire (what the JSON path reads).
fn service_json(name: &str) -> Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "7",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "spec": {
            "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"],
            "type": "LoadBalancer",
            "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": "web",
                       "nodePort": 30080}],
            "externalTrafficPolicy": "Local", "healthCheckNodePort": 32000,
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
            "loadBalancerSourceRanges": ["192.0.2.0/24"],
            "trafficDistribution": "PreferClose",
        },
        "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.10", "ipMode": "Proxy"}]}},
    }))
    .unwrap()
}

fn list_bytes(items: &[pb_core::Service], rv: &str) -> Vec<u8> {
    let list = pb_core::ServiceList {
        metadata: Some(pb_meta::ListMeta {
            resource_version: Some(rv.into()),
            ..Default::default()
        }),
        items: items.to_vec(),
    };
    envelope_bytes("v1", "ServiceList", list.encode_to_vec())
}

fn parse(bytes: &[u8]) -> (Result<ListMeta, DecodeError>, Vec<Service>) {
    let mut items = Vec::new();
    let result = parse_list(&mut io::BufReader::new(bytes), |item| {
        items.push(item);
        true
    });
    (result, items)
}

#[test]
fn a_list_decodes_to_what_its_json_decodes_to() {
    let bytes = list_bytes(&[service("a"), service("b")], "42");
    let (metadata, items) = parse(&bytes);
    assert_eq!(metadata.unwrap().resource_version.as_deref(), Some("42"));
    assert_eq!(items, [service_json("a"), service_json("b")]);
    // The agent's own form, too (what reaches the store).
    assert_eq!(
        proxy_model::objects::ServiceInfo::from(&items[0]),
        proxy_model::objects::ServiceInfo::from(&service_json("a"))
    );
}

#[test]
fn a_list_nobody_takes_any_more_is_given_up() {
    let bytes = list_bytes(&[service("a"), service("b"), service("c")], "42");
    let mut taken = 0;
    let result = parse_list::<Service>(&mut io::BufReader::new(&*bytes), |_| {
        taken += 1;
        false
    });
    assert!(matches!(result, Err(DecodeError::Abandoned)), "{result:?}");
    assert_eq!(taken, 1);
}

#[test]
fn an_empty_list_has_its_metadata() {
    let (metadata, items) = parse(&list_bytes(&[], "9"));
    assert_eq!(metadata.unwrap().resource_version.as_deref(), Some("9"));
    assert!(items.is_empty());
}

#[test]
fn endpoint_slices_keep_conditions_zones_hints_and_ports() {
    let slice = pb_discovery::EndpointSlice {
        metadata: meta("web-x1", "8"),
        address_type: Some("IPv4".into()),
        endpoints: vec![pb_discovery::Endpoint {
            addresses: vec!["10.0.1.5".into()],
            conditions: Some(pb_discovery::EndpointConditions {
                ready: Some(false),
                serving: Some(true),
                terminating: Some(true),
            }),
            node_name: Some("node-a".into()),
            zone: Some("zone-1".into()),
            hints: Some(pb_discovery::EndpointHints {
                for_zones: vec![pb_discovery::ForZone {
                    name: Some("zone-1".into()),
                }],
                for_nodes: vec![pb_discovery::ForNode {
                    name: Some("node-a".into()),
                }],
            }),
            ..Default::default()
        }],
        ports: vec![pb_discovery::EndpointPort {
            name: Some("http".into()),
            protocol: Some("TCP".into()),
            port: Some(8080),
            app_protocol: None,
        }],
    };
    let json: EndpointSlice = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web-x1", "namespace": "ns", "resourceVersion": "8",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.0.1.5"],
                       "conditions": {"ready": false, "serving": true, "terminating": true},
                       "nodeName": "node-a", "zone": "zone-1",
                       "hints": {"forZones": [{"name": "zone-1"}], "forNodes": [{"name": "node-a"}]}}],
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
    }))
    .unwrap();
    let decoded = EndpointSlice::from_message(
        pb_discovery::EndpointSlice::decode(&*slice.encode_to_vec()).unwrap(),
    );
    assert_eq!(decoded, json);
}

/// Kubernetes 1.36 publishes an EndpointSlice's `endpoints` as optional: a slice without the
/// field (JSON without the key or with `null`, protobuf without the repeated field) is a slice
/// with no endpoint, not a decoding error.
#[test]
fn an_endpoint_slice_without_endpoints_decodes_with_none() {
    let slice = pb_discovery::EndpointSlice {
        metadata: meta("web-empty", "9"),
        address_type: Some("IPv4".into()),
        endpoints: Vec::new(),
        ports: Vec::new(),
    };
    let decoded = EndpointSlice::from_message(
        pb_discovery::EndpointSlice::decode(&*slice.encode_to_vec()).unwrap(),
    );
    let metadata = serde_json::json!({"name": "web-empty", "namespace": "ns",
        "resourceVersion": "9", "labels": {"kubernetes.io/service-name": "web"}});
    for json in [
        serde_json::json!({"metadata": metadata, "addressType": "IPv4"}),
        serde_json::json!({"metadata": metadata, "addressType": "IPv4", "endpoints": null}),
    ] {
        let json: EndpointSlice = serde_json::from_value(json).unwrap();
        assert!(json.endpoints.is_empty());
        assert_eq!(decoded, json);
    }
}

#[test]
fn broken_lists_are_errors_not_partial_lists() {
    let bytes = list_bytes(&[service("a"), service("b")], "42");
    // Cut inside the second item: the first was handed over, the list fails.
    let (result, _) = parse(&bytes[..bytes.len() - 5]);
    assert!(matches!(result, Err(DecodeError::Io(_))), "{result:?}");
    // JSON where protobuf was announced.
    let (result, items) = parse(br#"{"kind":"ServiceList"}"#);
    assert!(matches!(result, Err(DecodeError::NoMagic)), "{result:?}");
    assert!(items.is_empty());
    // A length far past the end of the body allocates nothing and fails.
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&[0x12, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x0a]);
    let (result, _) = parse(&bytes);
    assert!(result.is_err(), "{result:?}");
}

fn watch_frame(kind: &str, object: Vec<u8>) -> Vec<u8> {
    let event = pb_meta::WatchEvent {
        r#type: Some(kind.into()),
        object: Some(pb_runtime::RawExtension { raw: Some(object) }),
    }
    .encode_to_vec();
    let mut frame = u32::try_from(event.len()).unwrap().to_be_bytes().to_vec();
    frame.extend(event);
    frame
}

#[test]
fn watch_frames_decode_to_kube_events() {
    let mut frames = Frames::default();
    let added = watch_frame(
        "ADDED",
        envelope_bytes("v1", "Service", service("a").encode_to_vec()),
    );
    let bookmark = watch_frame(
        "BOOKMARK",
        envelope_bytes(
            "v1",
            "Service",
            pb_core::Service {
                metadata: Some(pb_meta::ObjectMeta {
                    resource_version: Some("99".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }
            .encode_to_vec(),
        ),
    );
    let expired = watch_frame(
        "ERROR",
        envelope_bytes(
            "v1",
            "Status",
            pb_meta::Status {
                status: Some("Failure".into()),
                message: Some("too old resource version: 1 (5)".into()),
                reason: Some("Expired".into()),
                code: Some(410),
                ..Default::default()
            }
            .encode_to_vec(),
        ),
    );
    let stream: Vec<u8> = [added, bookmark, expired].concat();
    let mut events = Vec::new();
    // Chunks that cut frames and headers anywhere.
    for chunk in stream.chunks(3) {
        frames.push(chunk);
        while let Some(frame) = frames.next_frame().unwrap() {
            events.push(decode_watch_event::<Service>(&frame).unwrap());
        }
    }
    frames.finish().unwrap();
    let [
        WatchEvent::Added(service),
        WatchEvent::Bookmark(bookmark),
        WatchEvent::Error(status),
    ] = &events[..]
    else {
        panic!("{events:?}");
    };
    assert_eq!(*service, service_json("a"));
    assert_eq!(bookmark.metadata.resource_version, "99");
    assert_eq!(bookmark.types.kind, "Service");
    assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
}

#[test]
fn broken_watch_frames_are_errors() {
    let mut frames = Frames::default();
    frames.push(&(MAX_FRAME as u32 + 1).to_be_bytes());
    assert!(matches!(
        frames.next_frame(),
        Err(DecodeError::FrameTooLarge(_))
    ));
    let mut frames = Frames::default();
    frames.push(&[0, 0, 0, 9, 1]);
    assert!(frames.next_frame().unwrap().is_none());
    assert!(matches!(frames.finish(), Err(DecodeError::TruncatedFrame)));
    let unknown = watch_frame("SOMETHING", envelope_bytes("v1", "Service", vec![]));
    assert!(matches!(
        decode_watch_event::<Service>(&unknown[4..]),
        Err(DecodeError::EventType(_))
    ));
}

#[test]
fn error_statuses_decode() {
    let bytes = envelope_bytes(
        "v1",
        "Status",
        pb_meta::Status {
            status: Some("Failure".into()),
            message: Some("services is forbidden".into()),
            reason: Some("Forbidden".into()),
            code: Some(403),
            ..Default::default()
        }
        .encode_to_vec(),
    );
    let status = decode_status(&bytes).unwrap();
    assert!(status.is_forbidden(), "{status:?}");
    assert_eq!(status.message, "services is forbidden");
}

#[test]
fn zero_values_the_server_always_writes_read_as_absent() {
    // A ClusterIP Service as a Go API server writes it: every non-pointer field present.
    let service = pb_core::Service {
        metadata: Some(pb_meta::ObjectMeta {
            name: Some("plain".into()),
            namespace: Some("ns".into()),
            generate_name: Some(String::new()),
            self_link: Some(String::new()),
            uid: Some(String::new()),
            resource_version: Some("3".into()),
            generation: Some(0),
            creation_timestamp: Some(pb_meta::Time::default()),
            ..Default::default()
        }),
        spec: Some(pb_core::ServiceSpec {
            ports: vec![pb_core::ServicePort {
                name: Some(String::new()),
                protocol: Some("TCP".into()),
                port: Some(53),
                target_port: Some(k8s_pb::apimachinery::pkg::util::intstr::IntOrString {
                    r#type: Some(0),
                    int_val: Some(0),
                    str_val: Some(String::new()),
                }),
                node_port: Some(0),
                app_protocol: None,
            }],
            cluster_ip: Some("10.96.0.53".into()),
            r#type: Some("ClusterIP".into()),
            session_affinity: Some("None".into()),
            load_balancer_ip: Some(String::new()),
            external_name: Some(String::new()),
            external_traffic_policy: Some(String::new()),
            health_check_node_port: Some(0),
            publish_not_ready_addresses: Some(false),
            ..Default::default()
        }),
        status: Some(pb_core::ServiceStatus {
            load_balancer: Some(pb_core::LoadBalancerStatus::default()),
            conditions: vec![],
        }),
    };
    let json: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "plain", "namespace": "ns", "resourceVersion": "3",
                     "creationTimestamp": null},
        "spec": {"ports": [{"protocol": "TCP", "port": 53}], "clusterIP": "10.96.0.53",
                 "type": "ClusterIP", "sessionAffinity": "None"},
        "status": {"loadBalancer": {}},
    }))
    .unwrap();
    let decoded =
        Service::from_message(pb_core::Service::decode(&*service.encode_to_vec()).unwrap());
    assert_eq!(decoded, json);
    // Pointer fields keep an explicit zero: `ready: false` is not an unknown readiness.
    let slice = pb_discovery::EndpointSlice {
        metadata: meta("s", "4"),
        address_type: Some("IPv4".into()),
        endpoints: vec![pb_discovery::Endpoint {
            addresses: vec!["10.0.0.1".into()],
            conditions: Some(pb_discovery::EndpointConditions {
                ready: Some(false),
                serving: None,
                terminating: None,
            }),
            ..Default::default()
        }],
        ports: vec![],
    };
    let decoded = EndpointSlice::from_message(slice);
    let conditions = decoded.endpoints[0].conditions.as_ref().unwrap();
    assert_eq!((conditions.ready, conditions.serving), (Some(false), None));
}
