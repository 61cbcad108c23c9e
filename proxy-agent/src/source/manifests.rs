//! Standalone source: Service and EndpointSlice objects from multi-document YAML files in a
//! folder, re-read whenever the folder changes.
//!
//! A bad document is reported (file, document number, kind and name where known) and skipped;
//! every valid document in the folder is still used.

use std::{
    collections::{BTreeMap, btree_map::Entry},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::{
    Resource as _,
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
};
use notify::{RecursiveMode, Watcher as _};
use serde::de::DeserializeOwned;
use tokio::sync::{Notify, mpsc};
use tracing::{debug, info, warn};

use crate::objects::{ObjectKey, Update};

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
    #[error("{path}: document {doc}: invalid YAML: {source}")]
    Yaml {
        path: PathBuf,
        doc: usize,
        source: serde_yaml::Error,
    },
    #[error("{path}: document {doc}: missing or non-string field `{field}`")]
    MissingField {
        path: PathBuf,
        doc: usize,
        field: &'static str,
    },
    #[error("{path}: document {doc}: {kind} {name}: {source}")]
    InvalidObject {
        path: PathBuf,
        doc: usize,
        kind: String,
        name: String,
        source: serde_yaml::Error,
    },
    #[error(
        "{path}: document {doc}: {kind} {key} is already defined in {first}; ignoring this copy"
    )]
    Duplicate {
        path: PathBuf,
        doc: usize,
        kind: &'static str,
        key: ObjectKey,
        first: PathBuf,
    },
}

/// Which file first defined each object, to name it in duplicate errors.
type Origins = BTreeMap<(&'static str, ObjectKey), PathBuf>;

/// The result of reading the folder once.
#[derive(Debug, Default)]
pub struct Loaded {
    pub services: BTreeMap<ObjectKey, Service>,
    pub endpoint_slices: BTreeMap<ObjectKey, EndpointSlice>,
    /// Nodes by name (cluster-scoped: the key's namespace is empty).
    pub nodes: BTreeMap<ObjectKey, Node>,
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
        match std::fs::read_to_string(&path) {
            Ok(text) => load_text(&path, &text, &mut loaded, &mut origins),
            // The file may have been renamed away between listing and reading.
            Err(source) if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => loaded.errors.push(ManifestError::ReadFile { path, source }),
        }
    }
    loaded
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

fn load_text(path: &Path, text: &str, loaded: &mut Loaded, origins: &mut Origins) {
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let doc = index + 1;
        let value = match <serde_yaml::Value as serde::Deserialize>::deserialize(document) {
            Ok(serde_yaml::Value::Null) => continue, // empty document, e.g. a trailing `---`
            Ok(value) => value,
            Err(source) => {
                loaded.errors.push(ManifestError::Yaml {
                    path: path.to_owned(),
                    doc,
                    source,
                });
                // The YAML stream is broken from here on; serde_yaml cannot resync.
                return;
            }
        };
        if let Err(error) = load_document(path, doc, value, loaded, origins) {
            loaded.errors.push(error);
        }
    }
}

fn load_document(
    path: &Path,
    doc: usize,
    value: serde_yaml::Value,
    loaded: &mut Loaded,
    origins: &mut Origins,
) -> Result<(), ManifestError> {
    let field = |name: &'static str| {
        value
            .get(name)
            .and_then(serde_yaml::Value::as_str)
            .map(str::to_owned)
            .ok_or(ManifestError::MissingField {
                path: path.to_owned(),
                doc,
                field: name,
            })
    };
    let api_version = field("apiVersion")?;
    let kind = field("kind")?;
    if kind == "List" {
        let items = value
            .get("items")
            .and_then(serde_yaml::Value::as_sequence)
            .cloned()
            .unwrap_or_default();
        for item in items {
            load_document(path, doc, item, loaded, origins)?;
        }
        return Ok(());
    }
    let name = value
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(serde_yaml::Value::as_str)
        .unwrap_or("<unnamed>")
        .to_owned();
    let is = |api: &str, k: &str| api_version == api && kind == k;
    if is(Service::API_VERSION, Service::KIND) {
        let service: Service = parse_object(path, doc, &kind, &name, value)?;
        let key = object_key(path, doc, &service.metadata)?;
        insert_unique(
            path,
            doc,
            key,
            service,
            &mut loaded.services,
            origins,
            "Service",
        )
    } else if is(EndpointSlice::API_VERSION, EndpointSlice::KIND) {
        let slice: EndpointSlice = parse_object(path, doc, &kind, &name, value)?;
        let key = object_key(path, doc, &slice.metadata)?;
        insert_unique(
            path,
            doc,
            key,
            slice,
            &mut loaded.endpoint_slices,
            origins,
            "EndpointSlice",
        )
    } else if is(Node::API_VERSION, Node::KIND) {
        let node: Node = parse_object(path, doc, &kind, &name, value)?;
        let key = ObjectKey {
            namespace: String::new(),
            name: node
                .metadata
                .name
                .clone()
                .ok_or(ManifestError::MissingField {
                    path: path.to_owned(),
                    doc,
                    field: "metadata.name",
                })?,
        };
        insert_unique(path, doc, key, node, &mut loaded.nodes, origins, "Node")
    } else {
        debug!(path = %path.display(), doc, %api_version, %kind, %name, "ignoring object of a kind the proxy does not use");
        Ok(())
    }
}

fn parse_object<T: DeserializeOwned>(
    path: &Path,
    doc: usize,
    kind: &str,
    name: &str,
    value: serde_yaml::Value,
) -> Result<T, ManifestError> {
    serde_yaml::from_value(value).map_err(|source| ManifestError::InvalidObject {
        path: path.to_owned(),
        doc,
        kind: kind.to_owned(),
        name: name.to_owned(),
        source,
    })
}

fn object_key(
    path: &Path,
    doc: usize,
    metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Result<ObjectKey, ManifestError> {
    ObjectKey::of(metadata).ok_or(ManifestError::MissingField {
        path: path.to_owned(),
        doc,
        field: "metadata.name",
    })
}

fn insert_unique<T>(
    path: &Path,
    doc: usize,
    key: ObjectKey,
    object: T,
    into: &mut BTreeMap<ObjectKey, T>,
    origins: &mut Origins,
    kind: &'static str,
) -> Result<(), ManifestError> {
    match into.entry(key.clone()) {
        Entry::Occupied(_) => Err(ManifestError::Duplicate {
            path: path.to_owned(),
            doc,
            kind,
            first: origins
                .get(&(kind, key.clone()))
                .cloned()
                .unwrap_or_default(),
            key,
        }),
        Entry::Vacant(slot) => {
            slot.insert(object);
            origins.insert((kind, key), path.to_owned());
            Ok(())
        }
    }
}

/// How often the folder is re-read even without a change notification, as a safety net for
/// filesystems where inotify misses events.
const RESCAN_INTERVAL: Duration = Duration::from_secs(10);

/// Watches `dir` and sends its objects to the store every time the folder changes: the complete
/// sets of Services and EndpointSlices, and the Node named `node_name` if a manifest defines it.
/// Errors are logged (once per distinct message) and never stop the watch.
pub async fn run(dir: PathBuf, node_name: String, tx: mpsc::Sender<Update>) -> anyhow::Result<()> {
    let changed = Arc::new(Notify::new());
    let notifier = Arc::clone(&changed);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Reading the files ourselves raises access events: only changes count.
        if event.is_ok_and(|event| !event.kind.is_access()) {
            notifier.notify_one();
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    info!(dir = %dir.display(), "watching manifests folder");

    let mut last_errors: Vec<String> = Vec::new();
    loop {
        let reader_dir = dir.clone();
        let mut loaded = tokio::task::spawn_blocking(move || load_dir(&reader_dir)).await?;
        let errors: Vec<String> = loaded.errors.iter().map(ToString::to_string).collect();
        if errors != last_errors {
            for error in &errors {
                warn!("manifest skipped: {error}");
            }
            last_errors = errors;
        }
        debug!(
            services = loaded.services.len(),
            endpoint_slices = loaded.endpoint_slices.len(),
            "manifests read"
        );
        let node = loaded.nodes.remove(&ObjectKey {
            namespace: String::new(),
            name: node_name.clone(),
        });
        for update in [
            Update::ReplaceNode(node),
            Update::ReplaceServices(loaded.services),
            Update::ReplaceEndpointSlices(loaded.endpoint_slices),
        ] {
            if tx.send(update).await.is_err() {
                return Ok(()); // the agent is shutting down
            }
        }
        tokio::select! {
            () = changed.notified() => {
                // Editors and `cp` write in several steps; let them finish before re-reading.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            () = tokio::time::sleep(RESCAN_INTERVAL) => {}
        }
    }
}

#[cfg(test)]
mod tests;
