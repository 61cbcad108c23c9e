//! The decoders against upstream's own bytes: the Kubernetes API's round-trip fixtures
//! (`kubernetes/api`'s `testdata/`, copied to `../shared/k8s-api-testdata/`, see its
//! PROVENANCE.md). For every release there and every kind the proxy reads, the `.pb` (the API
//! server's `k8s\0` + `runtime.Unknown` encoding of one object with every field set), the
//! `.json` and the `.yaml` of the same object must become the same compact object, through
//! the paths the sources take: a protobuf watch event and list item (`protobuf.rs`), a JSON
//! watch line and list item (`watch_events.rs`, `list.rs`: serde into `k8s-openapi`), and a
//! manifest document (`yaml.rs`, what `manifests.rs` decodes each document with).
//!
//! Beyond the compact objects, the whole `k8s-openapi` objects are compared too, less what
//! `protobuf/convert.rs` documents it leaves out (managed fields, a Node's kubelet status):
//! a field the protobuf path drops or misreads shows up here before any mapper reads it.
//!
//! The fuzz target `api_protobuf` starts from these bytes as well: `cargo xtask fuzz` adds
//! each `.pb`, alone and as a watch frame, to the target's seeds (read from `../shared/` at
//! run time: the fixtures are upstream's data, not copied into this repository).

use std::{
    fmt::Debug,
    path::{Path, PathBuf},
};

use k8s_openapi::{
    api::{
        core::v1::{Node, NodeStatus, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use k8s_pb::apimachinery::pkg::{apis::meta::v1 as pb_meta, runtime as pb_runtime};
use kube::core::WatchEvent;
use prost::Message as _;
use serde::de::DeserializeOwned;

use super::protobuf::{self, FromMessage};
use proxy_model::objects::{EndpointSliceInfo, NodeInfo, ObjectKey, ServiceInfo};

/// Releases with fixtures when this test was written (v1.33.0 … v1.36.0 and HEAD): fewer
/// found means the fixtures went missing, not that there is less to check.
const MIN_RELEASES: usize = 5;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/k8s-api-testdata")
}

/// Every release directory (`v1.33.0`, …, `HEAD`), sorted; fails loudly without the fixtures.
fn releases() -> Vec<PathBuf> {
    let dir = fixtures_dir();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|error| {
        panic!(
            "the Kubernetes API fixtures are missing: cannot read {} ({error}); they live in \
             shared/k8s-api-testdata beside the repository (see its PROVENANCE.md)",
            dir.display()
        )
    });
    let mut releases: Vec<PathBuf> = entries
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_dir())
        .collect();
    releases.sort();
    assert!(
        releases.len() >= MIN_RELEASES,
        "{} holds {} release directories, expected at least {MIN_RELEASES}: {releases:?}",
        dir.display(),
        releases.len()
    );
    releases
}

/// The file names' stems of the kinds the proxy reads (`<group>.<version>.<kind>`).
const STEMS: [&str; 3] = [
    "core.v1.Service",
    "discovery.k8s.io.v1.EndpointSlice",
    "core.v1.Node",
];

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|error| panic!("reading {}: {error}", path.display()))
}

/// `bytes` (an encoded object, magic and envelope included) as one protobuf watch frame.
fn watch_frame(event_type: &str, object: &[u8]) -> Vec<u8> {
    let event = pb_meta::WatchEvent {
        r#type: Some(event_type.into()),
        object: Some(pb_runtime::RawExtension {
            raw: Some(object.to_vec()),
        }),
    }
    .encode_to_vec();
    let mut frame = u32::try_from(event.len()).unwrap().to_be_bytes().to_vec();
    frame.extend(event);
    frame
}

/// A list body (magic, envelope, `{metadata: 1, items: 2}`) whose one item is the message in
/// the fixture's envelope, byte for byte.
fn list_body(fixture: &[u8]) -> Vec<u8> {
    let unknown =
        pb_runtime::Unknown::decode(fixture.strip_prefix(b"k8s\0").expect("magic")).unwrap();
    let types = unknown.type_meta.clone().unwrap_or_default();
    let item = unknown.raw.expect("the fixture's envelope holds an object");
    let mut list = Vec::new();
    prost::encoding::message::encode(
        1,
        &pb_meta::ListMeta {
            resource_version: Some("42".into()),
            ..Default::default()
        },
        &mut list,
    );
    prost::encoding::bytes::encode(2, &item, &mut list);
    let mut body = b"k8s\0".to_vec();
    pb_runtime::Unknown {
        type_meta: Some(pb_runtime::TypeMeta {
            api_version: types.api_version,
            kind: types.kind.map(|kind| format!("{kind}List")),
        }),
        raw: Some(list),
        content_encoding: Some(String::new()),
        content_type: Some(String::new()),
    }
    .encode(&mut body)
    .unwrap();
    body
}

/// One kind's fixture decoded every way, each way's `k8s-openapi` object.
struct Decoded<K> {
    watch_pb: K,
    list_pb: K,
    watch_json: K,
    json: K,
    yaml: K,
}

fn decode_all<K>(release: &Path, stem: &str) -> Decoded<K>
where
    K: FromMessage + DeserializeOwned + k8s_openapi::Resource + Debug,
{
    let at = |ext: &str| release.join(format!("{stem}.{ext}"));
    let pb = read(&at("pb"));
    let json = read(&at("json"));
    let yaml = String::from_utf8(read(&at("yaml"))).unwrap();
    let name = at("pb").display().to_string();

    // The envelope names the kind the file is (a fixture of another kind would decode into
    // this one's message with most fields unknown, and prove nothing).
    let unknown = pb_runtime::Unknown::decode(&pb[4..]).unwrap();
    let types = unknown.type_meta.unwrap_or_default();
    assert_eq!(
        (types.api_version.as_deref(), types.kind.as_deref()),
        (Some(K::API_VERSION), Some(K::KIND)),
        "{name}"
    );

    let mut frames = protobuf::Frames::default();
    frames.push(&watch_frame("ADDED", &pb));
    let frame = frames.next_frame().unwrap().expect("one whole frame");
    frames.finish().unwrap();
    let watch_pb = match protobuf::decode_watch_event::<K>(&frame) {
        Ok(WatchEvent::Added(object)) => object,
        other => panic!("{name} as a protobuf watch event: {other:?}"),
    };
    let mut items = Vec::new();
    let list_meta = protobuf::parse_list::<K>(&mut &*list_body(&pb), |item| {
        items.push(item);
        true
    })
    .unwrap_or_else(|error| panic!("{name} as a protobuf list item: {error}"));
    assert_eq!(list_meta.resource_version.as_deref(), Some("42"), "{name}");
    let [list_pb] = <[K; 1]>::try_from(items).unwrap();

    let mut line = br#"{"type":"ADDED","object":"#.to_vec();
    line.extend(json.iter().filter(|&&b| b != b'\n'));
    line.push(b'}');
    let watch_json = match super::watch_events::json_line::<K>(&line) {
        Ok(Some(WatchEvent::Added(object))) => object,
        other => panic!("{} as a JSON watch line: {other:?}", at("json").display()),
    };
    let json = serde_json::from_slice::<K>(&json)
        .unwrap_or_else(|error| panic!("{}: {error}", at("json").display()));
    let yaml = proxy_model::yaml::decode_str::<K>(&yaml, 1)
        .unwrap_or_else(|error| panic!("{}: {error}", at("yaml").display()))
        .object;
    Decoded {
        watch_pb,
        list_pb,
        watch_json,
        json,
        yaml,
    }
}

/// What `protobuf/convert.rs` does not carry over, by design: cleared on the JSON side.
trait Omitted {
    fn metadata_mut(&mut self) -> &mut ObjectMeta;
    fn omit(&mut self) {
        self.metadata_mut().managed_fields = None;
    }
}

impl Omitted for Service {
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl Omitted for EndpointSlice {
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl Omitted for Node {
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
    fn omit(&mut self) {
        self.metadata.managed_fields = None;
        if let Some(spec) = &mut self.spec {
            spec.config_source = None;
        }
        if let Some(status) = &mut self.status {
            *status = NodeStatus {
                addresses: status.addresses.take(),
                conditions: status.conditions.take(),
                phase: status.phase.take(),
                ..NodeStatus::default()
            };
        }
    }
}

/// Checks one kind in every release; returns how many fixtures were compared.
fn check_kind<K, Info>(stem: &str) -> usize
where
    K: FromMessage
        + DeserializeOwned
        + k8s_openapi::Resource
        + kube::Resource
        + Omitted
        + Clone
        + PartialEq
        + Debug,
    Info: for<'a> From<&'a K> + PartialEq + Debug,
{
    let mut checked = 0;
    for release in releases() {
        let name = format!("{}/{stem}", release.display());
        let decoded = decode_all::<K>(&release, stem);

        // The compact objects, and the keys the store files them under.
        let compact = Info::from(&decoded.json);
        let key = ObjectKey::of(kube::Resource::meta(&decoded.json));
        assert!(key.is_some(), "{name}: no key");
        for (way, object) in [
            ("protobuf watch event", &decoded.watch_pb),
            ("protobuf list item", &decoded.list_pb),
            ("JSON watch line", &decoded.watch_json),
            ("YAML manifest", &decoded.yaml),
        ] {
            assert_eq!(Info::from(object), compact, "{name}: {way} vs JSON");
            assert_eq!(
                ObjectKey::of(kube::Resource::meta(object)),
                key,
                "{name}: {way} vs JSON (key)"
            );
        }
        // Not a vacuous comparison: the fixture sets every field, so the compact object is
        // not the empty one.
        assert_ne!(
            format!("{compact:?}"),
            format!("{:?}", Info::from(&K::from_message(Default::default()))),
            "{name}: the compact object is empty"
        );

        // The whole objects, less what the protobuf path leaves out by design.
        let mut json = decoded.json.clone();
        json.omit();
        assert_eq!(decoded.watch_pb, json, "{name}: protobuf vs JSON");
        assert_eq!(decoded.list_pb, json, "{name}: protobuf list item vs JSON");
        assert_eq!(decoded.watch_json, decoded.json, "{name}: JSON watch line");
        assert_eq!(decoded.yaml, decoded.json, "{name}: YAML vs JSON");
        checked += 1;
    }
    checked
}

#[test]
fn services_decode_alike_from_protobuf_json_and_yaml() {
    let checked = check_kind::<Service, ServiceInfo>(STEMS[0]);
    assert!(checked >= MIN_RELEASES, "only {checked} Service fixtures");
}

#[test]
fn endpoint_slices_decode_alike_from_protobuf_json_and_yaml() {
    let checked = check_kind::<EndpointSlice, EndpointSliceInfo>(STEMS[1]);
    assert!(
        checked >= MIN_RELEASES,
        "only {checked} EndpointSlice fixtures"
    );
}

#[test]
fn nodes_decode_alike_from_protobuf_json_and_yaml() {
    let checked = check_kind::<Node, NodeInfo>(STEMS[2]);
    assert!(checked >= MIN_RELEASES, "only {checked} Node fixtures");
}
