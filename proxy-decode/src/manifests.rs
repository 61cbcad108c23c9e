//! A manifests folder: Service, EndpointSlice and Node objects from multi-document YAML (or
//! JSON) files, read whole ([`load_dir`]) or again only where files changed ([`FolderReader`]).
//! The agent's standalone source watches the folder and sends what this reads.
//!
//! A bad document is reported (file, document number, kind and name where known) and skipped;
//! every valid document in the folder is still used.

use std::{
    collections::{BTreeMap, btree_map::Entry},
    path::{Path, PathBuf},
    sync::Arc,
};

use k8s_openapi::{
    Resource as _,
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::de::DeserializeOwned;

use self::documents::Document;
use proxy_model::objects::{EndpointSliceInfo, NodeInfo, ObjectKey, ServiceInfo};
use proxy_model::yaml::Decoded;

/// Largest manifest file read. Far above any real folder of Services and EndpointSlices (the
/// API server stores an object in at most 1.5 MiB), and it bounds the memory a parse can take
/// (a YAML value tree costs several times its text).
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// The API server's limit on an object's annotations, keys and values together
/// (`TotalAnnotationSizeLimitB`): the folder stands in for the API server, so what it would
/// refuse is refused here too.
pub const MAX_ANNOTATIONS_BYTES: usize = 256 << 10;

/// Where a problem is: the file, the document in it (1-based) and, for `kind: List`, the
/// item (0-based, as in `items[3]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// Shared by every problem in the file (and it keeps the errors small).
    pub path: Arc<Path>,
    pub doc: usize,
    pub item: Option<usize>,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: document {}", self.path.display(), self.doc)?;
        if let Some(item) = self.item {
            write!(f, ": items[{item}]")?;
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{path}: cannot read manifests folder: {source}")]
    ReadDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot read file: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: file is larger than {MAX_FILE_BYTES} bytes ({size}); not read", path.display())]
    TooLarge { path: PathBuf, size: u64 },
    #[error(
        "{}: not UTF-8 text (invalid byte at offset {offset}); the file is skipped",
        path.display()
    )]
    NotUtf8 { path: PathBuf, offset: usize },
    /// A document that is not YAML, or not a value tree the proxy takes (duplicate keys,
    /// nested too deeply, too many alias expansions); the next documents are still read.
    #[error("{at}: {source}")]
    Document {
        at: Location,
        source: documents::DocumentError,
    },
    #[error("{at}: missing or non-string field `{field}`")]
    MissingField { at: Location, field: &'static str },
    #[error(
        "{at}: {api_version} {kind} {name}: not a kind the proxy reads (v1 Service, \
         discovery.k8s.io/v1 EndpointSlice, v1 Node, v1 List); skipped"
    )]
    UnsupportedKind {
        at: Location,
        api_version: String,
        kind: String,
        name: String,
    },
    /// Like the API server's `fieldValidation: Warn` (kubectl's default): the object is used,
    /// the fields it does not have are named.
    #[error("{at}: {kind} {name}: unknown field `{field}`; ignored")]
    UnknownField {
        at: Location,
        kind: &'static str,
        name: String,
        field: String,
    },
    #[error("{at}: {kind} {name}: {message}")]
    InvalidObject {
        at: Location,
        kind: String,
        name: String,
        /// The field's path (`spec.ports[0].port`) and what is wrong with its value.
        message: String,
    },
    #[error(
        "{at}: {kind} {name}: metadata.annotations: {size} bytes, more than the API server's \
         limit of {MAX_ANNOTATIONS_BYTES}; skipped"
    )]
    AnnotationsTooLarge {
        at: Location,
        kind: &'static str,
        name: String,
        size: usize,
    },
    #[error(
        "{at}: EndpointSlice {key}: metadata.labels: no `kubernetes.io/service-name` label, so it \
         belongs to no Service; skipped"
    )]
    SliceWithoutServiceLabel { at: Location, key: ObjectKey },
    #[error(
        "{at}: EndpointSlice {key}: its Service {}/{service} (label \
         `kubernetes.io/service-name`) is not defined in the folder; its endpoints are unused \
         until it is",
        key.namespace
    )]
    SliceWithoutService {
        at: Location,
        key: ObjectKey,
        /// The Service's name (its namespace is the slice's).
        service: proxy_model::objects::Name,
    },
    #[error("{at}: {kind} {key} is already defined in {}; ignoring this copy", first.display())]
    Duplicate {
        at: Location,
        kind: &'static str,
        key: ObjectKey,
        first: Arc<Path>,
    },
}

/// Which document first defined each object, to name it in duplicate errors and to find slices
/// whose Service is missing.
type Origins = BTreeMap<(&'static str, ObjectKey), Location>;

/// The result of reading the folder once.
#[derive(Debug, Default)]
pub struct Loaded {
    pub services: BTreeMap<ObjectKey, ServiceInfo>,
    pub endpoint_slices: BTreeMap<ObjectKey, EndpointSliceInfo>,
    /// Nodes by name (cluster-scoped: the key's namespace is empty).
    pub nodes: BTreeMap<ObjectKey, NodeInfo>,
    pub errors: Vec<ManifestError>,
}

/// Reads every `*.yaml`/`*.yml` file in `dir` (not recursively, ignoring dot-files so that
/// editors and atomic writers can use hidden temporary files).
pub fn load_dir(dir: &Path) -> Loaded {
    let mut loaded = Loaded::default();
    let mut files = match manifest_files(dir) {
        Ok(files) => files,
        Err(source) => {
            loaded.errors.push(ManifestError::ReadDir {
                path: dir.to_owned(),
                source,
            });
            return loaded;
        }
    };
    files.sort();
    let mut origins = Origins::new();
    for path in files {
        match read_bounded(&path) {
            Ok(bytes) => load_file(&path, &bytes, &mut loaded, &mut origins),
            // The file may have been renamed away between listing and reading.
            Err(ManifestError::ReadFile { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => loaded.errors.push(error),
        }
    }
    check_slices_have_services(&mut loaded, &origins);
    loaded
}

/// The objects of one file's content, as [`load_dir`] reads each file (without the checks
/// across files). The entry point for fuzzing.
pub fn load_bytes(path: &Path, bytes: &[u8]) -> Loaded {
    let mut loaded = Loaded::default();
    load_file(path, bytes, &mut loaded, &mut Origins::new());
    loaded
}

/// Reads at most [`MAX_FILE_BYTES`] (+1, to tell a file that grew past the limit after the
/// size check).
fn read_bounded(path: &Path) -> Result<Vec<u8>, ManifestError> {
    use std::io::Read as _;
    let read_error = |source| ManifestError::ReadFile {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let size = file.metadata().map_err(read_error)?.len();
    if size > MAX_FILE_BYTES {
        return Err(ManifestError::TooLarge {
            path: path.to_owned(),
            size,
        });
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(ManifestError::TooLarge {
            path: path.to_owned(),
            size: bytes.len() as u64,
        });
    }
    Ok(bytes)
}

fn manifest_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let is_yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        if is_yaml && !name.starts_with('.') && path.is_file() {
            files.push(path);
        }
    }
    Ok(files)
}

/// Loads one file into `loaded`: its objects, unless an earlier file defined them.
fn load_file(path: &Path, bytes: &[u8], loaded: &mut Loaded, origins: &mut Origins) {
    let text = match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(error) => {
            loaded.errors.push(ManifestError::NotUtf8 {
                path: path.to_owned(),
                offset: error.valid_up_to(),
            });
            return;
        }
    };
    let mut file = Loaded::default();
    let mut file_origins = Origins::new();
    load_text(path, text, &mut file, &mut file_origins);
    loaded.errors.extend(file.errors);
    merge(
        file.services,
        &mut loaded.services,
        "Service",
        &file_origins,
        origins,
        &mut loaded.errors,
    );
    merge(
        file.endpoint_slices,
        &mut loaded.endpoint_slices,
        "EndpointSlice",
        &file_origins,
        origins,
        &mut loaded.errors,
    );
    merge(
        file.nodes,
        &mut loaded.nodes,
        "Node",
        &file_origins,
        origins,
        &mut loaded.errors,
    );
}

/// Adds one file's objects to the folder's; an object an earlier file defined keeps that
/// definition and this copy is reported.
fn merge<T>(
    from_file: BTreeMap<ObjectKey, T>,
    into: &mut BTreeMap<ObjectKey, T>,
    kind: &'static str,
    file_origins: &Origins,
    origins: &mut Origins,
    errors: &mut Vec<ManifestError>,
) {
    for (key, object) in from_file {
        let origin_key = (kind, key);
        let Some(at) = file_origins.get(&origin_key) else {
            continue;
        };
        if let Err(error) = insert_unique(at, origin_key.1.clone(), object, into, origins, kind) {
            errors.push(error);
        }
    }
}

fn load_text(path: &Path, text: &str, loaded: &mut Loaded, origins: &mut Origins) {
    let path: Arc<Path> = Arc::from(path);
    for document in documents::split(text) {
        let at = Location {
            path: Arc::clone(&path),
            doc: document.number,
            item: None,
        };
        if let Err(error) = load_document(&at, &document, loaded, origins) {
            loaded.errors.push(error);
        }
    }
}

/// The kinds the proxy reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    fn of(api_version: &str, kind: &str) -> Option<Self> {
        let is = |api: &str, k: &str| api_version == api && kind == k;
        if is(Service::API_VERSION, Service::KIND) {
            Some(Self::Service)
        } else if is(EndpointSlice::API_VERSION, EndpointSlice::KIND) {
            Some(Self::EndpointSlice)
        } else if is(Node::API_VERSION, Node::KIND) {
            Some(Self::Node)
        } else {
            None
        }
    }
}

/// One object in the proxy's kinds, decoded, with the fields of its input it does not have.
#[expect(
    clippy::large_enum_variant,
    reason = "one at a time, on its way to the compact form; boxing would only add an allocation"
)]
enum Object {
    Service(Decoded<Service>),
    EndpointSlice(Decoded<EndpointSlice>),
    Node(Decoded<Node>),
}

/// What an object is decoded from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// A whole document's text, as on the direct path.
    Text(&'a Document<'a>),
    /// A value tree: a `kind: List` item.
    Value(&'a serde_json::Value),
}

fn decode_object(kind: Kind, source: Source<'_>) -> Result<Object, String> {
    fn one<T: DeserializeOwned>(source: Source<'_>) -> Result<Decoded<T>, String> {
        match source {
            Source::Text(document) => {
                proxy_model::yaml::decode_str(document.text, document.first_line)
            }
            Source::Value(value) => proxy_model::yaml::decode_value(value),
        }
    }
    Ok(match kind {
        Kind::Service => Object::Service(one(source)?),
        Kind::EndpointSlice => Object::EndpointSlice(one(source)?),
        Kind::Node => Object::Node(one(source)?),
    })
}

/// A document: straight into its type when its kind shows at the top of its text (the usual
/// manifest, and the fast path: no value tree); otherwise, or if that fails, through its value
/// tree, which names what is wrong (kind, name, field) and holds `kind: List` items.
fn load_document(
    at: &Location,
    document: &Document<'_>,
    loaded: &mut Loaded,
    origins: &mut Origins,
) -> Result<(), ManifestError> {
    let sniffed = documents::sniff_kind(document.text).and_then(|(a, k)| Kind::of(a, k));
    let failed = match sniffed.map(|kind| (kind, decode_object(kind, Source::Text(document)))) {
        Some((_, Ok(object))) => return load_decoded(at, object, loaded, origins),
        Some((kind, Err(message))) => Some((kind, message)),
        None => None,
    };
    match documents::parse(document) {
        Ok(None) => Ok(()), // empty document, e.g. a trailing `---`
        Ok(Some(value)) => {
            let text = DocumentText { document, failed };
            load_object(at, &value, Some(text), loaded, origins)
        }
        Err(source) => Err(ManifestError::Document {
            at: at.clone(),
            source,
        }),
    }
}

/// The text of a document read through its value tree, and what decoding that text into the
/// sniffed kind said, if it was tried.
struct DocumentText<'a> {
    document: &'a Document<'a>,
    failed: Option<(Kind, String)>,
}

/// An object from its value tree: the document itself (`document` has its text) or an item
/// of a `kind: List`.
fn load_object(
    at: &Location,
    value: &serde_json::Value,
    document: Option<DocumentText<'_>>,
    loaded: &mut Loaded,
    origins: &mut Origins,
) -> Result<(), ManifestError> {
    let field = |name: &'static str| {
        value
            .get(name)
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
            .ok_or(ManifestError::MissingField {
                at: at.clone(),
                field: name,
            })
    };
    let api_version = field("apiVersion")?;
    let kind = field("kind")?;
    let name = value
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("<unnamed>")
        .to_owned();
    if api_version == "v1" && kind == "List" {
        if at.item.is_some() {
            // kubectl does not nest Lists either; refusing keeps the recursion at one level.
            return Err(ManifestError::UnsupportedKind {
                at: at.clone(),
                api_version,
                kind: "List inside a List".to_owned(),
                name,
            });
        }
        let items = match value.get("items") {
            None | Some(serde_json::Value::Null) => &[][..],
            Some(serde_json::Value::Array(items)) => items.as_slice(),
            Some(_) => {
                return Err(ManifestError::MissingField {
                    at: at.clone(),
                    field: "items (a list)",
                });
            }
        };
        for (index, item) in items.iter().enumerate() {
            let item_at = Location {
                item: Some(index),
                ..at.clone()
            };
            if let Err(error) = load_object(&item_at, item, None, loaded, origins) {
                loaded.errors.push(error);
            }
        }
        return Ok(());
    }
    let Some(known) = Kind::of(&api_version, &kind) else {
        return Err(ManifestError::UnsupportedKind {
            at: at.clone(),
            api_version,
            kind,
            name,
        });
    };
    // A document is decoded from its text, as on the direct path, so that both read scalars
    // alike; if the direct path already tried this kind, its error is the answer.
    let decoded = match document {
        Some(DocumentText {
            failed: Some((tried, message)),
            ..
        }) if tried == known => Err(message),
        Some(DocumentText { document, .. }) => decode_object(known, Source::Text(document)),
        None => decode_object(known, Source::Value(value)),
    };
    let object = decoded.map_err(|message| ManifestError::InvalidObject {
        at: at.clone(),
        kind,
        name,
        message,
    })?;
    load_decoded(at, object, loaded, origins)
}

/// The checks every object gets, then the object in the agent's own form (the `k8s-openapi`
/// object goes here).
fn load_decoded(
    at: &Location,
    object: Object,
    loaded: &mut Loaded,
    origins: &mut Origins,
) -> Result<(), ManifestError> {
    match object {
        Object::Service(Decoded {
            object: service,
            unknown_fields,
        }) => {
            let key = checked_key(at, "Service", &service.metadata, unknown_fields, loaded)?;
            let service = ServiceInfo::from(&service);
            insert_unique(at, key, service, &mut loaded.services, origins, "Service")
        }
        Object::EndpointSlice(Decoded {
            object: slice,
            unknown_fields,
        }) => {
            let key = checked_key(at, "EndpointSlice", &slice.metadata, unknown_fields, loaded)?;
            let slice = EndpointSliceInfo::from(&slice);
            if proxy_model::objects::slice_service(&key, &slice).is_none() {
                return Err(ManifestError::SliceWithoutServiceLabel {
                    at: at.clone(),
                    key,
                });
            }
            insert_unique(
                at,
                key,
                slice,
                &mut loaded.endpoint_slices,
                origins,
                "EndpointSlice",
            )
        }
        Object::Node(Decoded {
            object: node,
            unknown_fields: _,
        }) => {
            check_annotations(at, "Node", &name_of(&node.metadata), &node.metadata)?;
            let key = ObjectKey {
                namespace: "".into(),
                name: node.metadata.name.as_deref().map(Into::into).ok_or(
                    ManifestError::MissingField {
                        at: at.clone(),
                        field: "metadata.name",
                    },
                )?,
            };
            let node = NodeInfo::from(&node);
            insert_unique(at, key, node, &mut loaded.nodes, origins, "Node")
        }
    }
}

fn name_of(metadata: &ObjectMeta) -> String {
    metadata
        .name
        .clone()
        .unwrap_or_else(|| "<unnamed>".to_owned())
}

/// A namespaced object's checks: its unknown fields are reported, its annotations checked, and
/// its key is the result.
fn checked_key(
    at: &Location,
    kind: &'static str,
    metadata: &ObjectMeta,
    unknown_fields: Vec<String>,
    loaded: &mut Loaded,
) -> Result<ObjectKey, ManifestError> {
    let name = name_of(metadata);
    loaded.errors.extend(
        unknown_fields
            .into_iter()
            .map(|field| ManifestError::UnknownField {
                at: at.clone(),
                kind,
                name: name.clone(),
                field,
            }),
    );
    check_annotations(at, kind, &name, metadata)?;
    object_key(at, metadata)
}

fn check_annotations(
    at: &Location,
    kind: &'static str,
    name: &str,
    metadata: &ObjectMeta,
) -> Result<(), ManifestError> {
    let size: usize = metadata
        .annotations
        .iter()
        .flatten()
        .map(|(key, value)| key.len() + value.len())
        .sum();
    if size > MAX_ANNOTATIONS_BYTES {
        return Err(ManifestError::AnnotationsTooLarge {
            at: at.clone(),
            kind,
            name: name.to_owned(),
            size,
        });
    }
    Ok(())
}

fn object_key(at: &Location, metadata: &ObjectMeta) -> Result<ObjectKey, ManifestError> {
    ObjectKey::of(metadata).ok_or(ManifestError::MissingField {
        at: at.clone(),
        field: "metadata.name",
    })
}

fn insert_unique<T>(
    at: &Location,
    key: ObjectKey,
    object: T,
    into: &mut BTreeMap<ObjectKey, T>,
    origins: &mut Origins,
    kind: &'static str,
) -> Result<(), ManifestError> {
    match into.entry(key.clone()) {
        Entry::Occupied(_) => Err(ManifestError::Duplicate {
            at: at.clone(),
            kind,
            first: origins
                .get(&(kind, key.clone()))
                .map_or_else(|| Arc::clone(&at.path), |first| Arc::clone(&first.path)),
            key,
        }),
        Entry::Vacant(slot) => {
            slot.insert(object);
            origins.insert((kind, key), at.clone());
            Ok(())
        }
    }
}

/// In a folder, unlike the API, every object is there at once: a slice whose Service is
/// missing is most likely a mistake (a typo in the label, a forgotten file). Reported, not
/// dropped: the Service may be added next.
fn check_slices_have_services(loaded: &mut Loaded, origins: &Origins) {
    for (key, slice) in &loaded.endpoint_slices {
        let Some(service) = proxy_model::objects::slice_service(key, slice) else {
            continue;
        };
        if loaded.services.contains_key(&service) {
            continue;
        }
        if let Some(at) = origins.get(&("EndpointSlice", key.clone())) {
            loaded.errors.push(ManifestError::SliceWithoutService {
                at: at.clone(),
                key: key.clone(),
                service: service.name,
            });
        }
    }
}

mod documents;
mod incremental;
pub use incremental::{FolderReader, Read};

#[cfg(test)]
mod tests;
