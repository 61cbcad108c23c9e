//! The API server's data: objects per resource, a global resourceVersion, the event history
//! watches replay from, and the knobs the tests turn (compaction, dropped watches, held lists).

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use super::Resource;

/// The type of a watch event, as on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

/// One change, kept for watches that resume from an older resourceVersion.
#[derive(Debug, Clone)]
pub struct HistoryEvent {
    pub rv: u64,
    pub resource: Resource,
    pub kind: EventType,
    /// The object before the change (None for a create): decides, per watch, whether a
    /// modification enters or leaves the watch's selector.
    pub old: Option<Value>,
    /// The object after the change (for a delete: its last state at the deletion's rv).
    pub new: Value,
}

/// `(namespace, name)`; cluster-scoped objects have an empty namespace.
pub type Key = (String, String);

#[derive(Debug, Default)]
pub struct State {
    /// The last resourceVersion handed out (0: nothing happened yet).
    pub rv: u64,
    pub objects: HashMap<Resource, BTreeMap<Key, Value>>,
    pub history: Vec<HistoryEvent>,
    /// Watches from a resourceVersion below this get 410 Gone (etcd compaction).
    pub compacted: u64,
    /// Bumped to drop every open watch; each stream remembers the value it started with.
    pub drop_generation: u64,
    pub uid_counter: u64,
}

impl State {
    /// Creates or replaces an object; returns its new resourceVersion.
    pub fn apply(&mut self, resource: Resource, mut object: Value) -> u64 {
        self.rv += 1;
        let rv = self.rv;
        let key = key_of(&object);
        let objects = self.objects.entry(resource).or_default();
        let old = objects.get(&key).cloned();
        let uid = match old.as_ref().and_then(|o| o["metadata"]["uid"].as_str()) {
            Some(uid) => uid.to_owned(),
            None => {
                self.uid_counter += 1;
                format!("00000000-0000-4000-8000-{:012x}", self.uid_counter)
            }
        };
        if let Some(metadata) = object["metadata"].as_object_mut() {
            metadata.insert("resourceVersion".into(), Value::String(rv.to_string()));
            metadata.insert("uid".into(), Value::String(uid));
        }
        let kind = if old.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        objects.insert(key, object.clone());
        self.history.push(HistoryEvent {
            rv,
            resource,
            kind,
            old,
            new: object,
        });
        rv
    }

    /// Deletes an object; returns the deletion's resourceVersion, None if it did not exist.
    pub fn delete(&mut self, resource: Resource, key: &Key) -> Option<u64> {
        let mut object = self.objects.get_mut(&resource)?.remove(key)?;
        self.rv += 1;
        let rv = self.rv;
        // The DELETED event carries the object's last state at the deletion's version.
        if let Some(metadata) = object["metadata"].as_object_mut() {
            metadata.insert("resourceVersion".into(), Value::String(rv.to_string()));
        }
        self.history.push(HistoryEvent {
            rv,
            resource,
            kind: EventType::Deleted,
            old: Some(object.clone()),
            new: object,
        });
        Some(rv)
    }

    /// Forgets all history: only watches from the current resourceVersion can resume.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    pub fn list(&self, resource: Resource) -> impl Iterator<Item = &Value> {
        self.objects
            .get(&resource)
            .into_iter()
            .flat_map(|o| o.values())
    }
}

/// The `(namespace, name)` of a JSON object.
pub fn key_of(object: &Value) -> Key {
    let metadata = &object["metadata"];
    (
        metadata["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        metadata["name"].as_str().unwrap_or_default().to_owned(),
    )
}
