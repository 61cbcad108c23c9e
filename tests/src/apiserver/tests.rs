//! kube-rs (the client the agent uses) against the test server: lists, selectors, watch
//! events, 410 Expired, dropped watches, outages.

use std::time::Duration;

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::ListParams;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client, ResourceExt as _};
use serde_json::json;

use super::*;

const SELECTOR: &str = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name";
const EVENT_TIMEOUT: Duration = Duration::from_secs(15);

fn service(name: &str, ip: &str, labels: serde_json::Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"clusterIP": ip, "ports": [{"port": 80}]},
    }))
    .unwrap()
}

fn node(name: &str) -> Node {
    serde_json::from_value(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}))
        .unwrap()
}

fn client(server: &ApiServer) -> Client {
    Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap()
}

/// The next event that is not an error (errors are counted), within [`EVENT_TIMEOUT`].
async fn next_event<K>(
    stream: &mut (impl Stream<Item = Result<Event<K>, watcher::Error>> + Unpin),
    errors: &mut Vec<String>,
) -> Event<K> {
    loop {
        let item = tokio::time::timeout(EVENT_TIMEOUT, stream.next())
            .await
            .expect("no watcher event in time")
            .expect("the watcher stream ended");
        match item {
            Ok(event) => return event,
            Err(e) => errors.push(e.to_string()),
        }
    }
}

/// Events up to and including the next InitDone; returns the names listed.
async fn listed<K: kube::Resource>(
    stream: &mut (impl Stream<Item = Result<Event<K>, watcher::Error>> + Unpin),
    errors: &mut Vec<String>,
) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        match next_event(stream, errors).await {
            Event::Init => names.clear(),
            Event::InitApply(o) => names.push(o.meta().name.clone().unwrap_or_default()),
            Event::InitDone => return names,
            Event::Apply(_) | Event::Delete(_) => panic!("watch event during a list"),
        }
    }
}

fn applied_name<K: kube::Resource>(event: Event<K>) -> (&'static str, String) {
    match event {
        Event::Apply(o) => ("apply", o.meta().name.clone().unwrap_or_default()),
        Event::Delete(o) => ("delete", o.meta().name.clone().unwrap_or_default()),
        Event::Init => ("init", String::new()),
        Event::InitApply(o) => ("init-apply", o.meta().name.clone().unwrap_or_default()),
        Event::InitDone => ("init-done", String::new()),
    }
}

#[tokio::test]
async fn list_honours_selectors_and_reports_the_resource_version() {
    let server = ApiServer::start(None).unwrap();
    server.apply(&service("a", "10.96.0.1", json!({}))).unwrap();
    server
        .apply(&service(
            "b",
            "10.96.0.2",
            json!({"service.kubernetes.io/service-proxy-name": "other"}),
        ))
        .unwrap();
    server.apply(&node("n1")).unwrap();
    server.apply(&node("n2")).unwrap();
    let client = client(&server);

    let list = Api::<Service>::all(client.clone())
        .list(&ListParams::default().labels(SELECTOR))
        .await
        .unwrap();
    let names: Vec<_> = list.items.iter().map(|s| s.name_any()).collect();
    assert_eq!(names, ["a"]);
    assert_eq!(list.metadata.resource_version, Some("4".into()));
    assert_eq!(list.items[0].resource_version(), Some("1".into()));

    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default().fields("metadata.name=n2"))
        .await
        .unwrap();
    assert_eq!(
        nodes.items.iter().map(|n| n.name_any()).collect::<Vec<_>>(),
        ["n2"]
    );
    let namespaced = Api::<Service>::namespaced(client.clone(), "other")
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(namespaced.items.is_empty());

    let bad = Api::<Node>::all(client)
        .list(&ListParams::default().fields("spec.unschedulable=true"))
        .await
        .unwrap_err();
    assert!(
        matches!(bad, kube::Error::Api(ref s) if s.code == 400),
        "{bad:?}"
    );
}

#[tokio::test]
async fn watcher_sees_changes_relabels_expiry_disconnects_and_outages() {
    let mut server = ApiServer::start(None).unwrap();
    server.apply(&service("a", "10.96.0.1", json!({}))).unwrap();
    let api = Api::<Service>::all(client(&server));
    let mut stream = watcher::watcher(api, watcher::Config::default().labels(SELECTOR))
        .default_backoff()
        .boxed();
    let mut errors = Vec::new();
    assert_eq!(listed(&mut stream, &mut errors).await, ["a"]);
    assert_eq!(server.lists_served(Resource::Services), 1);

    // Plain watch events; an object leaving the selection is a delete for this watch.
    server.apply(&service("c", "10.96.0.3", json!({}))).unwrap();
    assert_eq!(
        applied_name(next_event(&mut stream, &mut errors).await),
        ("apply", "c".into())
    );
    server.delete::<Service>("default", "a").unwrap();
    assert_eq!(
        applied_name(next_event(&mut stream, &mut errors).await),
        ("delete", "a".into())
    );
    server
        .apply(&service(
            "c",
            "10.96.0.3",
            json!({"service.kubernetes.io/headless": ""}),
        ))
        .unwrap();
    assert_eq!(
        applied_name(next_event(&mut stream, &mut errors).await),
        ("delete", "c".into())
    );

    // Disconnect: the watcher resumes from its resourceVersion and gets the missed change
    // without relisting.
    server.break_watches(Break::Disconnect, |b| {
        b.apply(&service("d", "10.96.0.4", json!({}))).unwrap()
    });
    assert_eq!(
        applied_name(next_event(&mut stream, &mut errors).await),
        ("apply", "d".into())
    );
    assert_eq!(
        server.lists_served(Resource::Services),
        1,
        "a disconnect must not force a relist"
    );

    // Expire: the resumed watch gets 410 Expired, the watcher relists and sees the new state.
    server.break_watches(Break::Expire, |b| {
        b.apply(&service("e", "10.96.0.5", json!({}))).unwrap();
        b.delete::<Service>("default", "d").unwrap();
    });
    assert_eq!(listed(&mut stream, &mut errors).await, ["e"]);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("410") || e.contains("Expired") || e.contains("too old")),
        "the relist must come from a 410: {errors:?}"
    );
    assert_eq!(server.lists_served(Resource::Services), 2);

    // Outage: the change made while the server is down arrives after the restart.
    let watches = server.watches_started(Resource::Services);
    server.stop();
    server.apply(&service("f", "10.96.0.6", json!({}))).unwrap();
    // The outage itself: the client's watch meets a server that is gone for this long.
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart().unwrap();
    assert_eq!(
        applied_name(next_event(&mut stream, &mut errors).await),
        ("apply", "f".into())
    );
    // kube-client retries failed connects itself and treats a cut stream as its end, so the
    // outage need not surface as an error: the proof is the new watch after the restart.
    assert!(server.watches_started(Resource::Services) > watches);
}

#[tokio::test]
async fn held_lists_answer_only_when_released() {
    let server = ApiServer::start(None).unwrap();
    server.apply(&node("n1")).unwrap();
    server.hold_lists(Resource::Nodes);
    let api = Api::<Node>::all(client(&server));
    let pending = tokio::spawn(async move { api.list(&ListParams::default()).await });
    // The request has reached the server (its query is recorded before the hold)...
    let arrived = tokio::time::timeout(EVENT_TIMEOUT, async {
        while server.list_queries(Resource::Nodes).is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(arrived.is_ok(), "the list request never reached the server");
    // ...and time, not state, shows it is not answered: a negative check.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!pending.is_finished(), "a held list must not be answered");
    assert_eq!(server.lists_served(Resource::Nodes), 0);
    server.release_lists(Resource::Nodes);
    let list = tokio::time::timeout(EVENT_TIMEOUT, pending)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(list.items.len(), 1);
}

// The protobuf side, checked on the wire: a raw HTTP/1.1 client sees exactly what the server
// writes, with no client library decoding in between.

mod wire {
    use std::time::Duration;

    use k8s_openapi::api::core::v1::{Node, Service};
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use k8s_pb::api::{core::v1 as pb_core, discovery::v1 as pb_discovery};
    use k8s_pb::apimachinery::pkg::api::resource::Quantity;
    use k8s_pb::apimachinery::pkg::apis::meta::v1 as pb_meta;
    use k8s_pb::apimachinery::pkg::runtime::Unknown;
    use k8s_pb::apimachinery::pkg::util::intstr::IntOrString;
    use prost::Message as _;
    use serde_json::{Value, json};
    use std::io::{BufRead as _, BufReader, Read as _, Write as _};
    use std::net::TcpStream;

    use super::super::protobuf::{self, Format, MAGIC};
    use super::super::{ApiServer, Break, Resource};

    const PROTOBUF_ACCEPT: &str = "application/vnd.kubernetes.protobuf, */*";
    const PB: &str = "application/vnd.kubernetes.protobuf";
    const PB_WATCH: &str = "application/vnd.kubernetes.protobuf;stream=watch";
    const TIMEOUT: Duration = Duration::from_secs(15);

    // Blocking I/O is fine here: the server runs on its own runtime and threads.

    /// One response, head read, body still on the socket.
    struct Response {
        reader: BufReader<TcpStream>,
        status: u16,
        headers: Vec<(String, String)>,
    }

    fn get(server: &ApiServer, path: &str, accept: Option<&str>) -> Response {
        let mut stream = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        let accept = accept
            .map(|a| format!("Accept: {a}\r\n"))
            .unwrap_or_default();
        let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{accept}\r\n");
        stream.write_all(request.as_bytes()).unwrap();
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let status = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        let mut headers = Vec::new();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            let Some((name, value)) = line.trim_end().split_once(':') else {
                break;
            };
            headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
        }
        Response {
            reader,
            status,
            headers,
        }
    }

    impl Response {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }

        fn content_type(&self) -> &str {
            self.header("content-type").unwrap_or_default()
        }

        /// The next chunk of a chunked body; None at its end (a read timeout panics).
        fn chunk(&mut self) -> Option<Vec<u8>> {
            let mut line = String::new();
            if self.reader.read_line(&mut line).expect("reading a chunk") == 0 {
                return None;
            }
            let size = usize::from_str_radix(line.trim(), 16).expect("a chunk size");
            let mut data = vec![0; size + 2];
            self.reader.read_exact(&mut data).expect("reading a chunk");
            data.truncate(size);
            (size > 0).then_some(data)
        }

        fn body(mut self) -> Vec<u8> {
            if let Some(length) = self.header("content-length") {
                let mut body = vec![0; length.parse().unwrap()];
                self.reader.read_exact(&mut body).unwrap();
                return body;
            }
            assert_eq!(self.header("transfer-encoding"), Some("chunked"));
            let mut body = Vec::new();
            while let Some(chunk) = self.chunk() {
                body.extend(chunk);
            }
            body
        }
    }

    /// A protobuf watch stream read frame by frame.
    struct Frames {
        response: Response,
        buffer: Vec<u8>,
    }

    impl Frames {
        /// The next frame's WatchEvent (the frame itself carries no magic), None at the end.
        fn next(&mut self) -> Option<pb_meta::WatchEvent> {
            loop {
                if self.buffer.len() >= 4 {
                    let len = u32::from_be_bytes(self.buffer[..4].try_into().unwrap()) as usize;
                    if self.buffer.len() >= 4 + len {
                        let frame: Vec<u8> = self.buffer.drain(..4 + len).skip(4).collect();
                        assert_ne!(frame[..4], MAGIC, "a watch frame has no envelope");
                        return Some(pb_meta::WatchEvent::decode(frame.as_slice()).unwrap());
                    }
                }
                let chunk = self.response.chunk()?;
                self.buffer.extend(chunk);
            }
        }

        /// The next event's type, and its object's envelope.
        fn event(&mut self) -> (String, Unknown) {
            let event = self.next().expect("the watch ended");
            let raw = event.object.unwrap().raw.unwrap();
            (event.r#type.unwrap(), envelope(&raw))
        }
    }

    /// Checks the magic and decodes the `runtime.Unknown` behind it.
    fn envelope(body: &[u8]) -> Unknown {
        assert_eq!(body[..4], MAGIC, "protobuf bodies start with k8s\\0");
        let unknown = Unknown::decode(&body[4..]).unwrap();
        assert_eq!(unknown.content_encoding.as_deref(), Some(""));
        assert_eq!(unknown.content_type.as_deref(), Some(""));
        unknown
    }

    fn type_meta(unknown: &Unknown) -> (&str, &str) {
        let meta = unknown.type_meta.as_ref().unwrap();
        (
            meta.api_version.as_deref().unwrap(),
            meta.kind.as_deref().unwrap(),
        )
    }

    fn raw(unknown: &Unknown) -> &[u8] {
        unknown.raw.as_deref().unwrap()
    }

    fn s(text: &str) -> Option<String> {
        Some(text.to_owned())
    }

    fn strings(texts: &[&str]) -> Vec<String> {
        texts.iter().map(|t| (*t).to_owned()).collect()
    }

    fn time(rfc3339: &str) -> Option<pb_meta::Time> {
        let t: k8s_openapi::jiff::Timestamp = rfc3339.parse().unwrap();
        Some(pb_meta::Time {
            seconds: Some(t.as_second()),
            nanos: Some(0),
        })
    }

    fn rich_service() -> Service {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {
                "name": "rich", "namespace": "default", "generateName": "rich-",
                "generation": 3,
                "creationTimestamp": "2024-05-06T07:08:09Z",
                "deletionTimestamp": "2024-05-07T00:00:00Z",
                "labels": {"app": "web"},
                "annotations": {"note": "kept"},
                "ownerReferences": [{
                    "apiVersion": "apps/v1", "kind": "Deployment", "name": "web",
                    "uid": "owner-uid", "controller": true, "blockOwnerDeletion": true,
                }],
                "finalizers": ["service.kubernetes.io/load-balancer-cleanup"],
            },
            "spec": {
                "ports": [
                    {"name": "http", "protocol": "TCP", "appProtocol": "http", "port": 80,
                     "targetPort": "web", "nodePort": 30080},
                    {"name": "dns", "protocol": "UDP", "port": 53, "targetPort": 5353},
                ],
                "selector": {"app": "web"},
                "clusterIP": "10.96.0.10",
                "clusterIPs": ["10.96.0.10", "fd00::10"],
                "type": "LoadBalancer",
                "externalIPs": ["192.0.2.1"],
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
                "loadBalancerIP": "198.51.100.1",
                "loadBalancerSourceRanges": ["203.0.113.0/24"],
                "externalName": "web.example.com",
                "externalTrafficPolicy": "Local",
                "healthCheckNodePort": 32000,
                "publishNotReadyAddresses": true,
                "ipFamilies": ["IPv4", "IPv6"],
                "ipFamilyPolicy": "PreferDualStack",
                "allocateLoadBalancerNodePorts": false,
                "loadBalancerClass": "example.com/lb",
                "internalTrafficPolicy": "Cluster",
                "trafficDistribution": "PreferClose",
            },
            "status": {
                "loadBalancer": {"ingress": [
                    {"ip": "198.51.100.1", "ipMode": "VIP",
                     "ports": [{"port": 80, "protocol": "TCP", "error": "Pending"}]},
                    {"hostname": "lb.example.com", "ipMode": "Proxy"},
                ]},
                "conditions": [{
                    "type": "Ready", "status": "True", "observedGeneration": 3,
                    "lastTransitionTime": "2024-05-06T07:08:10Z", "reason": "Ok", "message": "fine",
                }],
            },
        }))
        .unwrap()
    }

    fn plain_service(name: &str) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 443}]},
        }))
        .unwrap()
    }

    fn rich_slice() -> EndpointSlice {
        serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {
                "name": "rich-abc", "namespace": "default",
                "labels": {"kubernetes.io/service-name": "rich"},
            },
            "addressType": "IPv4",
            "endpoints": [
                {
                    "addresses": ["10.0.0.1"],
                    "conditions": {"ready": true, "serving": true, "terminating": false},
                    "hostname": "pod-a",
                    "targetRef": {"kind": "Pod", "namespace": "default", "name": "pod-a",
                                  "uid": "pod-uid", "apiVersion": "v1", "resourceVersion": "7",
                                  "fieldPath": "spec"},
                    "nodeName": "node-a",
                    "zone": "zone-a",
                    "hints": {"forZones": [{"name": "zone-a"}], "forNodes": [{"name": "node-a"}]},
                },
                {
                    "addresses": ["10.0.0.2"],
                    "conditions": {"ready": false, "serving": true, "terminating": true},
                    "nodeName": "node-b",
                    "zone": "zone-b",
                    "hints": {"forZones": [{"name": "zone-b"}, {"name": "zone-c"}]},
                },
            ],
            "ports": [{"name": "http", "protocol": "TCP", "port": 8080, "appProtocol": "http"}],
        }))
        .unwrap()
    }

    fn rich_node() -> Node {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a"}},
            "spec": {
                "podCIDR": "10.244.1.0/24",
                "podCIDRs": ["10.244.1.0/24", "fd00:10:244:1::/64"],
                "providerID": "kind://docker/kind/node-a",
                "unschedulable": true,
                "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule",
                            "timeAdded": "2024-05-06T07:08:09Z"}],
            },
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": "172.18.0.2"},
                    {"type": "InternalIP", "address": "fc00::2"},
                    {"type": "Hostname", "address": "node-a"},
                ],
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                "message": "kubelet is posting ready status",
                                "lastHeartbeatTime": "2024-05-06T07:08:09Z",
                                "lastTransitionTime": "2024-05-06T07:00:00Z"}],
                "capacity": {"cpu": "4"},
            },
        }))
        .unwrap()
    }

    /// The JSON list of the same request, for comparison.
    fn json_list(server: &ApiServer, path: &str) -> Value {
        let response = get(server, path, Some("application/json"));
        assert_eq!(response.content_type(), "application/json");
        serde_json::from_slice(&response.body()).unwrap()
    }

    fn protobuf_list(server: &ApiServer, path: &str) -> Unknown {
        let response = get(server, path, Some(PROTOBUF_ACCEPT));
        assert_eq!(response.status, 200);
        assert_eq!(response.content_type(), PB);
        envelope(&response.body())
    }

    fn item<T: serde::de::DeserializeOwned>(json: &Value) -> T {
        serde_json::from_value(json.clone()).unwrap()
    }

    #[test]
    fn protobuf_lists_are_unknown_envelopes_with_the_json_lists_content() {
        let server = ApiServer::start(None).unwrap();
        server.apply(&rich_service()).unwrap();
        server.apply(&plain_service("plain")).unwrap();
        server.apply(&rich_slice()).unwrap();
        server.apply(&rich_node()).unwrap();

        // Services: the envelope, then every item equal to the JSON list's, then the rich one
        // field by field against the literal it was made from.
        let unknown = protobuf_list(&server, "/api/v1/services");
        assert_eq!(type_meta(&unknown), ("v1", "ServiceList"));
        let list = pb_core::ServiceList::decode(raw(&unknown)).unwrap();
        let json = json_list(&server, "/api/v1/services");
        assert_eq!(
            list.metadata.unwrap().resource_version.as_deref(),
            json["metadata"]["resourceVersion"].as_str()
        );
        let json_items = json["items"].as_array().unwrap();
        assert_eq!(list.items.len(), json_items.len());
        for (pb, json) in list.items.iter().zip(json_items) {
            assert_eq!(*pb, protobuf::service(item(json)));
        }
        let names: Vec<_> = list
            .items
            .iter()
            .map(|s| s.metadata.as_ref().unwrap().name.as_deref().unwrap())
            .collect();
        assert_eq!(names, ["plain", "rich"]);
        let rich = &list.items[1];
        let meta = rich.metadata.as_ref().unwrap();
        assert_eq!(
            *meta,
            pb_meta::ObjectMeta {
                name: s("rich"),
                generate_name: s("rich-"),
                namespace: s("default"),
                // Plain strings in Go: written even when empty.
                self_link: s(""),
                uid: json_items[1]["metadata"]["uid"].as_str().map(str::to_owned),
                resource_version: s("1"),
                generation: Some(3),
                creation_timestamp: time("2024-05-06T07:08:09Z"),
                deletion_timestamp: time("2024-05-07T00:00:00Z"),
                labels: [("app".to_owned(), "web".to_owned())].into(),
                annotations: [("note".to_owned(), "kept".to_owned())].into(),
                owner_references: vec![pb_meta::OwnerReference {
                    api_version: s("apps/v1"),
                    kind: s("Deployment"),
                    name: s("web"),
                    uid: s("owner-uid"),
                    controller: Some(true),
                    block_owner_deletion: Some(true),
                }],
                finalizers: strings(&["service.kubernetes.io/load-balancer-cleanup"]),
                // Pointers and slices: absent stays absent.
                deletion_grace_period_seconds: None,
                managed_fields: vec![],
            }
        );
        assert!(meta.uid.is_some());
        assert_eq!(
            rich.spec,
            Some(pb_core::ServiceSpec {
                ports: vec![
                    pb_core::ServicePort {
                        name: s("http"),
                        protocol: s("TCP"),
                        app_protocol: s("http"),
                        port: Some(80),
                        target_port: Some(IntOrString {
                            r#type: Some(1),
                            int_val: Some(0),
                            str_val: s("web"),
                        }),
                        node_port: Some(30080),
                    },
                    pb_core::ServicePort {
                        name: s("dns"),
                        protocol: s("UDP"),
                        app_protocol: None,
                        port: Some(53),
                        target_port: Some(IntOrString {
                            r#type: Some(0),
                            int_val: Some(5353),
                            str_val: s(""),
                        }),
                        // A plain int32: zero, not absent.
                        node_port: Some(0),
                    },
                ],
                selector: [("app".to_owned(), "web".to_owned())].into(),
                cluster_ip: s("10.96.0.10"),
                cluster_ips: strings(&["10.96.0.10", "fd00::10"]),
                r#type: s("LoadBalancer"),
                external_ips: strings(&["192.0.2.1"]),
                session_affinity: s("ClientIP"),
                load_balancer_ip: s("198.51.100.1"),
                load_balancer_source_ranges: strings(&["203.0.113.0/24"]),
                external_name: s("web.example.com"),
                external_traffic_policy: s("Local"),
                health_check_node_port: Some(32000),
                publish_not_ready_addresses: Some(true),
                session_affinity_config: Some(pb_core::SessionAffinityConfig {
                    client_ip: Some(pb_core::ClientIpConfig {
                        timeout_seconds: Some(600),
                    }),
                }),
                ip_families: strings(&["IPv4", "IPv6"]),
                ip_family_policy: s("PreferDualStack"),
                allocate_load_balancer_node_ports: Some(false),
                load_balancer_class: s("example.com/lb"),
                internal_traffic_policy: s("Cluster"),
                traffic_distribution: s("PreferClose"),
            })
        );
        assert_eq!(
            rich.status,
            Some(pb_core::ServiceStatus {
                load_balancer: Some(pb_core::LoadBalancerStatus {
                    ingress: vec![
                        pb_core::LoadBalancerIngress {
                            ip: s("198.51.100.1"),
                            hostname: s(""),
                            ip_mode: s("VIP"),
                            ports: vec![pb_core::PortStatus {
                                port: Some(80),
                                protocol: s("TCP"),
                                error: s("Pending"),
                            }],
                        },
                        pb_core::LoadBalancerIngress {
                            ip: s(""),
                            hostname: s("lb.example.com"),
                            ip_mode: s("Proxy"),
                            ports: vec![],
                        },
                    ],
                }),
                conditions: vec![pb_meta::Condition {
                    r#type: s("Ready"),
                    status: s("True"),
                    observed_generation: Some(3),
                    last_transition_time: time("2024-05-06T07:08:10Z"),
                    reason: s("Ok"),
                    message: s("fine"),
                }],
            })
        );
        // What the JSON left out: fields Go holds by value are written as their zero value
        // (as upstream's marshallers do), pointers stay absent.
        let plain = &list.items[0];
        assert_eq!(
            plain.status,
            Some(pb_core::ServiceStatus {
                load_balancer: Some(pb_core::LoadBalancerStatus { ingress: vec![] }),
                conditions: vec![],
            })
        );
        let plain_meta = plain.metadata.as_ref().unwrap();
        assert_eq!(
            *plain_meta,
            pb_meta::ObjectMeta {
                name: s("plain"),
                generate_name: s(""),
                namespace: s("default"),
                self_link: s(""),
                uid: plain_meta.uid.clone(),
                resource_version: s("2"),
                generation: Some(0),
                // A zero metav1.Time marshals to no bytes: an empty message.
                creation_timestamp: Some(pb_meta::Time {
                    seconds: None,
                    nanos: None,
                }),
                deletion_timestamp: None,
                deletion_grace_period_seconds: None,
                labels: Default::default(),
                annotations: Default::default(),
                owner_references: vec![],
                finalizers: vec![],
                managed_fields: vec![],
            }
        );
        assert!(plain_meta.uid.as_deref().is_some_and(|u| !u.is_empty()));
        assert_eq!(
            plain.spec,
            Some(pb_core::ServiceSpec {
                ports: vec![pb_core::ServicePort {
                    name: s(""),
                    protocol: s(""),
                    app_protocol: None,
                    port: Some(443),
                    target_port: Some(IntOrString {
                        r#type: Some(0),
                        int_val: Some(0),
                        str_val: s(""),
                    }),
                    node_port: Some(0),
                }],
                selector: Default::default(),
                cluster_ip: s("10.96.0.20"),
                cluster_ips: vec![],
                r#type: s(""),
                external_ips: vec![],
                session_affinity: s(""),
                load_balancer_ip: s(""),
                load_balancer_source_ranges: vec![],
                external_name: s(""),
                external_traffic_policy: s(""),
                health_check_node_port: Some(0),
                publish_not_ready_addresses: Some(false),
                session_affinity_config: None,
                ip_families: vec![],
                ip_family_policy: None,
                allocate_load_balancer_node_ports: None,
                load_balancer_class: None,
                internal_traffic_policy: None,
                traffic_distribution: None,
            })
        );

        // EndpointSlices.
        let unknown = protobuf_list(&server, "/apis/discovery.k8s.io/v1/endpointslices");
        assert_eq!(
            type_meta(&unknown),
            ("discovery.k8s.io/v1", "EndpointSliceList")
        );
        let list = pb_discovery::EndpointSliceList::decode(raw(&unknown)).unwrap();
        let json = json_list(&server, "/apis/discovery.k8s.io/v1/endpointslices");
        assert_eq!(
            list.metadata.unwrap().resource_version.as_deref(),
            json["metadata"]["resourceVersion"].as_str()
        );
        assert_eq!(list.items.len(), 1);
        assert_eq!(
            list.items[0],
            protobuf::endpoint_slice(item(&json["items"][0]))
        );
        let slice = &list.items[0];
        assert_eq!(slice.address_type.as_deref(), Some("IPv4"));
        assert_eq!(
            slice.metadata.as_ref().unwrap().labels["kubernetes.io/service-name"],
            "rich"
        );
        assert_eq!(
            slice.endpoints,
            vec![
                pb_discovery::Endpoint {
                    addresses: strings(&["10.0.0.1"]),
                    conditions: Some(pb_discovery::EndpointConditions {
                        ready: Some(true),
                        serving: Some(true),
                        terminating: Some(false),
                    }),
                    hostname: s("pod-a"),
                    target_ref: Some(pb_core::ObjectReference {
                        kind: s("Pod"),
                        namespace: s("default"),
                        name: s("pod-a"),
                        uid: s("pod-uid"),
                        api_version: s("v1"),
                        resource_version: s("7"),
                        field_path: s("spec"),
                    }),
                    deprecated_topology: Default::default(),
                    node_name: s("node-a"),
                    zone: s("zone-a"),
                    hints: Some(pb_discovery::EndpointHints {
                        for_zones: vec![pb_discovery::ForZone { name: s("zone-a") }],
                        for_nodes: vec![pb_discovery::ForNode { name: s("node-a") }],
                    }),
                },
                pb_discovery::Endpoint {
                    addresses: strings(&["10.0.0.2"]),
                    conditions: Some(pb_discovery::EndpointConditions {
                        ready: Some(false),
                        serving: Some(true),
                        terminating: Some(true),
                    }),
                    hostname: None,
                    target_ref: None,
                    deprecated_topology: Default::default(),
                    node_name: s("node-b"),
                    zone: s("zone-b"),
                    hints: Some(pb_discovery::EndpointHints {
                        for_zones: vec![
                            pb_discovery::ForZone { name: s("zone-b") },
                            pb_discovery::ForZone { name: s("zone-c") },
                        ],
                        for_nodes: vec![],
                    }),
                },
            ]
        );
        assert_eq!(
            slice.ports,
            vec![pb_discovery::EndpointPort {
                name: s("http"),
                protocol: s("TCP"),
                port: Some(8080),
                app_protocol: s("http"),
            }]
        );

        // Nodes.
        let unknown = protobuf_list(&server, "/api/v1/nodes");
        assert_eq!(type_meta(&unknown), ("v1", "NodeList"));
        let list = pb_core::NodeList::decode(raw(&unknown)).unwrap();
        let json = json_list(&server, "/api/v1/nodes");
        assert_eq!(list.items.len(), 1);
        assert_eq!(list.items[0], protobuf::node(item(&json["items"][0])));
        let node = &list.items[0];
        assert_eq!(
            node.spec,
            Some(pb_core::NodeSpec {
                pod_cidr: s("10.244.1.0/24"),
                pod_cid_rs: strings(&["10.244.1.0/24", "fd00:10:244:1::/64"]),
                provider_id: s("kind://docker/kind/node-a"),
                unschedulable: Some(true),
                taints: vec![pb_core::Taint {
                    key: s("node.kubernetes.io/unschedulable"),
                    value: s(""),
                    effect: s("NoSchedule"),
                    time_added: time("2024-05-06T07:08:09Z"),
                }],
                config_source: None,
                external_id: s(""),
            })
        );
        let status = node.status.as_ref().unwrap();
        assert_eq!(
            status.addresses,
            [
                ("InternalIP", "172.18.0.2"),
                ("InternalIP", "fc00::2"),
                ("Hostname", "node-a")
            ]
            .map(|(t, a)| pb_core::NodeAddress {
                r#type: s(t),
                address: s(a),
            })
        );
        assert_eq!(
            status.conditions,
            vec![pb_core::NodeCondition {
                r#type: s("Ready"),
                status: s("True"),
                last_heartbeat_time: time("2024-05-06T07:08:09Z"),
                last_transition_time: time("2024-05-06T07:00:00Z"),
                reason: s("KubeletReady"),
                message: s("kubelet is posting ready status"),
            }]
        );
        assert_eq!(status.capacity["cpu"], Quantity { string: s("4") });
        assert_eq!(status.phase, s(""));
        // Held by value down to the port, and nodeInfo's ten strings.
        assert_eq!(
            status.daemon_endpoints,
            Some(pb_core::NodeDaemonEndpoints {
                kubelet_endpoint: Some(pb_core::DaemonEndpoint { port: Some(0) }),
            })
        );
        let info = status.node_info.as_ref().unwrap();
        assert_eq!(info.machine_id, s(""));
        assert_eq!(info.architecture, s(""));
        assert_eq!(info.swap, None);

        // Selectors apply to protobuf lists too.
        let unknown = protobuf_list(&server, "/api/v1/namespaces/other/services");
        assert!(
            pb_core::ServiceList::decode(raw(&unknown))
                .unwrap()
                .items
                .is_empty()
        );

        assert_eq!(
            server.list_content_types(Resource::Services),
            [PB, "application/json", PB]
        );
        assert_eq!(
            server.list_content_types(Resource::Nodes),
            [PB, "application/json"]
        );
    }

    fn watch(server: &ApiServer, query: &str) -> Frames {
        let response = get(
            server,
            &format!("/api/v1/services?watch=true&{query}"),
            Some(PROTOBUF_ACCEPT),
        );
        assert_eq!(response.status, 200);
        assert_eq!(response.content_type(), PB_WATCH);
        Frames {
            response,
            buffer: Vec::new(),
        }
    }

    fn decoded_service(unknown: &Unknown) -> pb_core::Service {
        assert_eq!(type_meta(unknown), ("v1", "Service"));
        pb_core::Service::decode(raw(unknown)).unwrap()
    }

    fn name_and_rv(service: &pb_core::Service) -> (String, String) {
        let meta = service.metadata.as_ref().unwrap();
        (
            meta.name.clone().unwrap_or_default(),
            meta.resource_version.clone().unwrap_or_default(),
        )
    }

    #[test]
    fn protobuf_watch_streams_length_prefixed_events_and_bookmarks() {
        let server = ApiServer::start(None).unwrap();
        server.apply(&rich_service()).unwrap();
        let mut frames = watch(&server, "resourceVersion=0&allowWatchBookmarks=true");

        let (kind, object) = frames.event();
        assert_eq!(kind, "ADDED");
        let added = decoded_service(&object);
        assert_eq!(added, protobuf::service(rich_service_as_stored(&server)));
        assert_eq!(name_and_rv(&added), ("rich".into(), "1".into()));

        server.apply(&plain_service("plain")).unwrap();
        let (kind, object) = frames.event();
        assert_eq!(kind, "ADDED");
        assert_eq!(
            name_and_rv(&decoded_service(&object)),
            ("plain".into(), "2".into())
        );

        let mut changed = plain_service("plain");
        changed.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.21".into());
        server.apply(&changed).unwrap();
        let (kind, object) = frames.event();
        assert_eq!(kind, "MODIFIED");
        let modified = decoded_service(&object);
        assert_eq!(name_and_rv(&modified), ("plain".into(), "3".into()));
        assert_eq!(
            modified.spec.unwrap().cluster_ip.as_deref(),
            Some("10.96.0.21")
        );

        server.delete::<Service>("default", "rich").unwrap();
        let (kind, object) = frames.event();
        assert_eq!(kind, "DELETED");
        assert_eq!(
            name_and_rv(&decoded_service(&object)),
            ("rich".into(), "4".into())
        );

        // Nothing happens for a bookmark interval: a BOOKMARK of the watched kind carrying only
        // the resourceVersion.
        let (kind, object) = frames.event();
        assert_eq!(kind, "BOOKMARK");
        assert_eq!(
            decoded_service(&object),
            protobuf::service(
                serde_json::from_value(json!({"metadata": {"resourceVersion": "4"}})).unwrap()
            )
        );
        let bookmark = decoded_service(&object);
        let meta = bookmark.metadata.unwrap();
        assert_eq!(meta.resource_version, s("4"));
        assert_eq!(meta.name, s(""));
        assert!(bookmark.spec.is_some() && bookmark.status.is_some());
        assert_eq!(server.watch_content_types(Resource::Services), [PB_WATCH]);

        // A resumed watch replays from its version.
        let mut resumed = watch(&server, "resourceVersion=2");
        let (kind, object) = resumed.event();
        assert_eq!(kind, "MODIFIED");
        assert_eq!(
            name_and_rv(&decoded_service(&object)),
            ("plain".into(), "3".into())
        );
        let (kind, _) = resumed.event();
        assert_eq!(kind, "DELETED");
    }

    /// The rich Service as the server holds it (with its uid and resourceVersion).
    fn rich_service_as_stored(server: &ApiServer) -> Service {
        let state = server.shared.lock();
        let value = state
            .list(Resource::Services)
            .find(|o| o["metadata"]["name"] == "rich")
            .unwrap()
            .clone();
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn protobuf_watch_from_a_compacted_version_gets_an_expired_status() {
        let server = ApiServer::start(None).unwrap();
        server.apply(&plain_service("a")).unwrap();
        server.break_watches(Break::Expire, |b| {
            b.apply(&plain_service("b")).unwrap();
        });
        let mut frames = watch(&server, "resourceVersion=1");
        let (kind, object) = frames.event();
        assert_eq!(kind, "ERROR");
        assert_eq!(type_meta(&object), ("v1", "Status"));
        let status = pb_meta::Status::decode(raw(&object)).unwrap();
        assert_eq!(status.code, Some(410));
        assert_eq!(status.reason.as_deref(), Some("Expired"));
        assert_eq!(status.status.as_deref(), Some("Failure"));
        assert!(
            status.message.unwrap().contains("too old resource version"),
            "the message names the cause"
        );
        assert!(frames.next().is_none(), "the stream ends after the ERROR");
        assert_eq!(server.watch_content_types(Resource::Services), [PB_WATCH]);
    }

    #[test]
    fn protobuf_errors_are_enveloped_statuses() {
        let server = ApiServer::start(None).unwrap();
        for (path, code, reason) in [
            (
                "/api/v1/nodes?fieldSelector=spec.unschedulable%3Dtrue",
                400,
                "BadRequest",
            ),
            (
                "/api/v1/services?watch=true&resourceVersion=x",
                400,
                "BadRequest",
            ),
            ("/api/v1/pods", 404, "NotFound"),
        ] {
            let response = get(&server, path, Some(PROTOBUF_ACCEPT));
            assert_eq!(response.status, code, "{path}");
            assert_eq!(response.content_type(), PB, "{path}");
            let unknown = envelope(&response.body());
            assert_eq!(type_meta(&unknown), ("v1", "Status"));
            let status = pb_meta::Status::decode(raw(&unknown)).unwrap();
            assert_eq!(status.code, Some(i32::from(code)), "{path}");
            assert_eq!(status.reason.as_deref(), Some(reason), "{path}");
            assert_eq!(status.status.as_deref(), Some("Failure"), "{path}");
        }
        // The JSON client still gets JSON errors.
        let response = get(&server, "/api/v1/pods", None);
        assert_eq!(response.status, 404);
        assert_eq!(response.content_type(), "application/json");
        let status: Value = serde_json::from_slice(&response.body()).unwrap();
        assert_eq!(status["code"], 404);
    }

    #[test]
    fn json_is_served_without_accept_for_json_and_for_wildcards() {
        let server = ApiServer::start(None).unwrap();
        server.apply(&plain_service("a")).unwrap();
        for accept in [
            None,
            Some("application/json"),
            Some("*/*"),
            Some("application/json, */*"),
        ] {
            let response = get(&server, "/api/v1/services", accept);
            assert_eq!(response.content_type(), "application/json", "{accept:?}");
            let list: Value = serde_json::from_slice(&response.body()).unwrap();
            assert_eq!(list["kind"], "ServiceList", "{accept:?}");
            assert_eq!(list["items"][0]["metadata"]["name"], "a", "{accept:?}");

            let mut response = get(&server, "/api/v1/services?watch=true", accept);
            assert_eq!(response.content_type(), "application/json", "{accept:?}");
            let line = response.chunk().unwrap();
            let event: Value = serde_json::from_slice(&line).unwrap();
            assert_eq!(event["type"], "ADDED", "{accept:?}");
            assert_eq!(event["object"]["metadata"]["name"], "a", "{accept:?}");
        }
        assert_eq!(
            server.list_content_types(Resource::Services),
            ["application/json"; 4]
        );
        assert_eq!(
            server.watch_content_types(Resource::Services),
            ["application/json"; 4]
        );
    }

    /// The bytes upstream's `Unknown.NestedMarshalTo` and length-delimited framer write.
    #[test]
    fn envelope_and_frame_bytes_follow_upstreams_layout() {
        let mut expected = MAGIC.to_vec();
        // typeMeta (1): apiVersion (1) "v1", kind (2) "Status".
        expected.extend([0x0a, 12, 0x0a, 2, b'v', b'1', 0x12, 6]);
        expected.extend(b"Status");
        // raw (2), then contentEncoding (3) and contentType (4), empty but present.
        expected.extend([0x12, 2, 0xca, 0xfe, 0x1a, 0, 0x22, 0]);
        assert_eq!(
            protobuf::envelope("v1", "Status", vec![0xca, 0xfe]),
            expected
        );

        let frame = protobuf::watch_frame("ADDED", vec![0xca, 0xfe]).unwrap();
        // type (1) "ADDED", object (2) = RawExtension{raw (1)}.
        let mut event = vec![0x0a, 5];
        event.extend(b"ADDED");
        event.extend([0x12, 4, 0x0a, 2, 0xca, 0xfe]);
        assert_eq!(frame[..4], [0, 0, 0, 13]);
        assert_eq!(frame[4..], event);
    }

    /// A Service with nothing but its resourceVersion (a bookmark's object), byte for byte as
    /// upstream's gogo marshallers write it: every plain field of ObjectMeta, ServiceSpec and
    /// ServiceStatus present with its zero value, pointers and empty slices left out.
    #[test]
    fn zero_values_of_non_pointer_fields_are_on_the_wire() {
        let service: Service =
            serde_json::from_value(json!({"metadata": {"resourceVersion": "4"}})).unwrap();
        let mut meta = vec![
            // name (1), generateName (2), namespace (3), selfLink (4), uid (5): "".
            0x0a, 0, 0x12, 0, 0x1a, 0, 0x22, 0, 0x2a, 0,
            // resourceVersion (6) "4", generation (7) 0, creationTimestamp (8) zero: empty.
            0x32, 1, b'4', 0x38, 0, 0x42, 0,
        ];
        let spec = [
            // clusterIP (3), type (4), sessionAffinity (7), loadBalancerIP (8),
            // externalName (10), externalTrafficPolicy (11): "".
            0x1a, 0, 0x22, 0, 0x3a, 0, 0x42, 0, 0x52, 0, 0x5a, 0,
            // healthCheckNodePort (12) 0, publishNotReadyAddresses (13) false.
            0x60, 0, 0x68, 0,
        ];
        let mut expected = vec![0x0a, 17];
        expected.append(&mut meta);
        expected.extend([0x12, 16]);
        expected.extend(spec);
        // status (3) = ServiceStatus{loadBalancer (1) = empty LoadBalancerStatus}.
        expected.extend([0x1a, 2, 0x0a, 0]);
        assert_eq!(protobuf::service(service).encode_to_vec(), expected);
    }

    #[test]
    fn negotiation_follows_the_accept_preferences() {
        for (accept, expected) in [
            (None, Format::Json),
            (Some(""), Format::Json),
            (Some("*/*"), Format::Json),
            (Some("application/json"), Format::Json),
            (
                Some("application/vnd.kubernetes.protobuf"),
                Format::Protobuf,
            ),
            (
                Some("application/vnd.kubernetes.protobuf, */*"),
                Format::Protobuf,
            ),
            (
                Some("application/vnd.kubernetes.protobuf,application/json"),
                Format::Protobuf,
            ),
            (
                Some("application/json, application/vnd.kubernetes.protobuf"),
                Format::Json,
            ),
            // q values and specificity decide before the order.
            (
                Some("*/*, application/vnd.kubernetes.protobuf"),
                Format::Protobuf,
            ),
            (
                Some("application/json;q=0.5, application/vnd.kubernetes.protobuf"),
                Format::Protobuf,
            ),
            (
                Some("application/vnd.kubernetes.protobuf;q=0.1, application/json"),
                Format::Json,
            ),
            (
                Some("application/vnd.kubernetes.protobuf;q=0, */*"),
                Format::Json,
            ),
            (
                Some("APPLICATION/VND.KUBERNETES.PROTOBUF"),
                Format::Protobuf,
            ),
            // Types not served are skipped.
            (
                Some("application/yaml, application/vnd.kubernetes.protobuf"),
                Format::Protobuf,
            ),
            (Some("text/html"), Format::Json),
        ] {
            assert_eq!(Format::negotiate(accept), expected, "{accept:?}");
        }
    }
}
