//! The objects the proxy watches and the store every source feeds.
//!
//! Sources (the manifests folder, the Kubernetes API) send [`Update`]s; the [`Store`] applies
//! them, remembers which Services changed since the last sync (kube-proxy's change trackers), and
//! says when every kind has been listed once, so the first sync never programs a half-empty view.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    time::SystemTime,
};

use crate::ip_family::IpFamily;

mod node_change;

pub use node_change::{NodeChange, node_change};

mod endpoint_slice;
mod interned;
mod node;
mod service;

pub use endpoint_slice::{
    EndpointAddress, EndpointHints, EndpointSliceInfo, LABEL_SERVICE_NAME,
    LAST_CHANGE_TRIGGER_TIME, SliceEndpoint, SlicePort,
};
pub(crate) use interned::cmp_shared;
pub use interned::{Name, intern};
pub use node::{NodeAddress, NodeInfo, REGION_LABEL, Taint, ZONE_LABEL};
pub use service::{LoadBalancerIngress, ServiceInfo, ServicePortSpec};

/// An object's namespace and name. Both are shared strings: the key is cloned into the store's
/// index, the snapshot and every service port name, and a clone is a reference count.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    pub namespace: Name,
    pub name: Name,
}

/// Namespace, then name, as the derived order would; the namespace without reading it when
/// both keys share its interned copy (`cmp_shared`).
impl Ord for ObjectKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        interned::cmp_shared(&self.namespace, &other.namespace)
            .then_with(|| self.name.cmp(&other.name))
    }
}

impl PartialOrd for ObjectKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ObjectKey {
    /// The key of an object's metadata; objects without a namespace land in "default" (like
    /// kubectl does for namespaced kinds). `None` without a name.
    pub fn of(
        metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ) -> Option<Self> {
        Some(Self {
            namespace: intern(metadata.namespace.as_deref().unwrap_or("default")),
            name: metadata.name.as_deref()?.into(),
        })
    }
}

/// Everything the desired-state computation reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Objects {
    pub services: BTreeMap<ObjectKey, ServiceInfo>,
    endpoint_slices: BTreeMap<ObjectKey, EndpointSliceInfo>,
    /// Slice keys by the Service they belong to, so one Service's slices are found without a scan.
    slices_by_service: BTreeMap<ObjectKey, SliceKeys>,
    /// This node, when known (standalone mode has none unless a manifest defines it).
    pub node: Option<NodeInfo>,
}

impl Objects {
    pub fn new(
        services: BTreeMap<ObjectKey, ServiceInfo>,
        endpoint_slices: BTreeMap<ObjectKey, EndpointSliceInfo>,
        node: Option<NodeInfo>,
    ) -> Self {
        let mut objects = Self {
            services,
            node,
            ..Self::default()
        };
        objects.replace_slices(endpoint_slices);
        objects
    }

    pub fn endpoint_slices(&self) -> &BTreeMap<ObjectKey, EndpointSliceInfo> {
        &self.endpoint_slices
    }

    /// The EndpointSlices of one Service, in slice-name order.
    pub fn slices_of(&self, service: &ObjectKey) -> Vec<(&ObjectKey, &EndpointSliceInfo)> {
        self.slices_by_service
            .get(service)
            .into_iter()
            .flatten()
            .filter_map(|key| self.endpoint_slices.get_key_value(key))
            .collect()
    }

    pub fn insert_slice(
        &mut self,
        key: ObjectKey,
        slice: EndpointSliceInfo,
    ) -> Option<EndpointSliceInfo> {
        let old = self.remove_slice(&key);
        if let Some(service) = slice_service(&key, &slice) {
            self.slices_by_service
                .entry(service)
                .or_default()
                .insert(key.clone());
        }
        self.endpoint_slices.insert(key, slice);
        old
    }

    pub fn remove_slice(&mut self, key: &ObjectKey) -> Option<EndpointSliceInfo> {
        let old = self.endpoint_slices.remove(key)?;
        if let Some(service) = slice_service(key, &old)
            && let Some(keys) = self.slices_by_service.get_mut(&service)
        {
            keys.remove(key);
            if keys.is_empty() {
                self.slices_by_service.remove(&service);
            }
        }
        Some(old)
    }

    pub fn replace_slices(&mut self, slices: BTreeMap<ObjectKey, EndpointSliceInfo>) {
        self.slices_by_service.clear();
        for (key, slice) in &slices {
            if let Some(service) = slice_service(key, slice) {
                self.slices_by_service
                    .entry(service)
                    .or_default()
                    .insert(key.clone());
            }
        }
        self.endpoint_slices = slices;
    }
}

/// The slices of one Service, sorted. Most Services have one or two slices: a sorted vector
/// holds them in one small allocation, where a `BTreeSet` allocates a whole node (11 keys).
#[derive(Debug, Clone, Default, PartialEq)]
struct SliceKeys(Vec<ObjectKey>);

impl SliceKeys {
    fn insert(&mut self, key: ObjectKey) {
        if let Err(at) = self.0.binary_search(&key) {
            // One more, not the doubling a push does: the usual count is one.
            self.0.reserve_exact(1);
            self.0.insert(at, key);
        }
    }

    fn remove(&mut self, key: &ObjectKey) {
        if let Ok(at) = self.0.binary_search(key) {
            self.0.remove(at);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> std::slice::Iter<'_, ObjectKey> {
        self.0.iter()
    }
}

impl<'a> IntoIterator for &'a SliceKeys {
    type Item = &'a ObjectKey;
    type IntoIter = std::slice::Iter<'a, ObjectKey>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// The Service an EndpointSlice belongs to.
pub fn slice_service(key: &ObjectKey, slice: &EndpointSliceInfo) -> Option<ObjectKey> {
    Some(ObjectKey {
        namespace: key.namespace.clone(),
        name: slice.service.clone()?,
    })
}

/// The kinds a source lists and watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
}

/// One change from a source.
#[derive(Debug, Clone)]
pub enum Update {
    /// The complete current set of Services (initial list, relist, or a re-read folder).
    ReplaceServices(BTreeMap<ObjectKey, ServiceInfo>),
    ReplaceEndpointSlices(BTreeMap<ObjectKey, EndpointSliceInfo>),
    /// This node as currently listed (`None`: it does not exist).
    ReplaceNode(Option<NodeInfo>),
    ServiceApplied(ObjectKey, ServiceInfo),
    ServiceDeleted(ObjectKey),
    EndpointSliceApplied(ObjectKey, EndpointSliceInfo),
    EndpointSliceDeleted(ObjectKey),
}

/// What changed since the last [`Store::take_changes`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services whose own object or whose EndpointSlices changed.
    pub services: BTreeSet<ObjectKey>,
    /// Per Service, the `last-change-trigger-time` of each of its EndpointSlices' updates (each
    /// family's), as kube-proxy's endpoints change tracker keeps them: recorded when the update
    /// comes, only when later than the store's start ([`Store::started_at`]), and dropped when
    /// one of the Service's slices is deleted (a deletion carries the last update's time, not
    /// its own). The network programming latency is measured from them after a sync.
    pub trigger_times: BTreeMap<ObjectKey, Vec<(IpFamily, SystemTime)>>,
    /// What changed in this node that matters (topology labels, podCIDRs, addresses, taints,
    /// deletion; see [`proxy_kernel::node::node_change`]): status heartbeats are not a change.
    pub node: NodeChange,
    /// How many Service / EndpointSlice objects changed (added, modified or deleted) — what
    /// kube-proxy's `*_changes_*` metrics count.
    pub service_events: u64,
    pub slice_events: u64,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && !self.node.any()
    }

    pub fn merge(&mut self, other: Changes) {
        self.services.extend(other.services);
        for (service, times) in other.trigger_times {
            self.trigger_times.entry(service).or_default().extend(times);
        }
        self.node.merge(other.node);
        self.service_events += other.service_events;
        self.slice_events += other.slice_events;
    }
}

#[derive(Debug, Default)]
pub struct Store {
    objects: Objects,
    synced: BTreeSet<Kind>,
    changes: Changes,
    /// Trigger times up to this one are not recorded (`None`: every one is).
    trigger_times_after: Option<SystemTime>,
}

impl Store {
    /// A store that records only the trigger times later than `started` (kube-proxy's
    /// `trackerStartTime`): a slice listed at the start was changed before this process could
    /// program it, so its time measures nothing of ours.
    pub fn started_at(started: SystemTime) -> Self {
        Self {
            trigger_times_after: Some(started),
            ..Self::default()
        }
    }

    pub fn objects(&self) -> &Objects {
        &self.objects
    }

    /// Whether Services, EndpointSlices and the Node have each been listed once.
    pub fn is_synced(&self) -> bool {
        self.synced.len() == 3
    }

    /// Marks a kind as listed even though no `Replace*` update comes for it (standalone mode
    /// has no Node object unless a manifest defines one).
    pub fn mark_synced(&mut self, kind: Kind) {
        self.synced.insert(kind);
    }

    /// Changes waiting for the next sync (for the `*_changes_pending` metrics).
    pub fn pending_changes(&self) -> &Changes {
        &self.changes
    }

    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// Applies one update; returns whether anything changed.
    pub fn apply(&mut self, update: Update) -> bool {
        match update {
            Update::ReplaceServices(services) => {
                self.synced.insert(Kind::Service);
                let changed = diff_keys(&self.objects.services, &services);
                self.changes.service_events += changed.len() as u64;
                self.changes.services.extend(changed.iter().cloned());
                self.objects.services = services;
                !changed.is_empty()
            }
            Update::ReplaceEndpointSlices(slices) => {
                self.synced.insert(Kind::EndpointSlice);
                let changed = diff_keys(&self.objects.endpoint_slices, &slices);
                self.changes.slice_events += changed.len() as u64;
                for key in &changed {
                    let old = self
                        .objects
                        .endpoint_slices
                        .get(key)
                        .and_then(|slice| slice_service(key, slice));
                    match slices.get(key) {
                        Some(slice) => self.record_trigger_time(key, slice),
                        None => self.drop_trigger_times(old.as_ref()),
                    }
                    let new = slices.get(key).and_then(|slice| slice_service(key, slice));
                    self.changes.services.extend(old.into_iter().chain(new));
                }
                self.objects.replace_slices(slices);
                !changed.is_empty()
            }
            Update::ReplaceNode(node) => {
                self.synced.insert(Kind::Node);
                let change = node_change(self.objects.node.as_ref(), node.as_ref());
                self.changes.node.merge(change);
                // Kept even when nothing relevant changed: readers see the latest object.
                self.objects.node = node;
                change.any()
            }
            Update::ServiceApplied(key, service) => {
                if self.objects.services.get(&key) == Some(&service) {
                    return false;
                }
                self.changes.services.insert(key.clone());
                self.changes.service_events += 1;
                self.objects.services.insert(key, service);
                true
            }
            Update::ServiceDeleted(key) => {
                let changed = self.objects.services.remove(&key).is_some();
                if changed {
                    self.changes.services.insert(key);
                    self.changes.service_events += 1;
                }
                changed
            }
            Update::EndpointSliceApplied(key, slice) => {
                if self.objects.endpoint_slices.get(&key) == Some(&slice) {
                    return false;
                }
                self.mark_slice_service(&key, Some(&slice));
                self.record_trigger_time(&key, &slice);
                let old = self.objects.insert_slice(key.clone(), slice);
                self.mark_slice_service(&key, old.as_ref());
                self.changes.slice_events += 1;
                true
            }
            Update::EndpointSliceDeleted(key) => {
                let old = self.objects.remove_slice(&key);
                self.mark_slice_service(&key, old.as_ref());
                let service = old.as_ref().and_then(|slice| slice_service(&key, slice));
                self.drop_trigger_times(service.as_ref());
                self.changes.slice_events += u64::from(old.is_some());
                old.is_some()
            }
        }
    }

    fn record_trigger_time(&mut self, key: &ObjectKey, slice: &EndpointSliceInfo) {
        let (Some(family), Some(time)) = (slice.address_type, slice.trigger_time) else {
            return;
        };
        if self.trigger_times_after.is_some_and(|after| time <= after) {
            return;
        }
        if let Some(service) = slice_service(key, slice) {
            self.changes
                .trigger_times
                .entry(service)
                .or_default()
                .push((family, time));
        }
    }

    fn drop_trigger_times(&mut self, service: Option<&ObjectKey>) {
        if let Some(service) = service {
            self.changes.trigger_times.remove(service);
        }
    }

    fn mark_slice_service(&mut self, key: &ObjectKey, slice: Option<&EndpointSliceInfo>) {
        if let Some(service) = slice.and_then(|slice| slice_service(key, slice)) {
            self.changes.services.insert(service);
        }
    }
}

/// Keys added, removed or changed between two maps.
fn diff_keys<T: PartialEq>(
    old: &BTreeMap<ObjectKey, T>,
    new: &BTreeMap<ObjectKey, T>,
) -> Vec<ObjectKey> {
    let removed_or_changed = old
        .iter()
        .filter(|(key, value)| new.get(*key) != Some(value))
        .map(|(key, _)| key.clone());
    let added = new.keys().filter(|key| !old.contains_key(*key)).cloned();
    removed_or_changed.chain(added).collect()
}

#[cfg(test)]
mod tests;
