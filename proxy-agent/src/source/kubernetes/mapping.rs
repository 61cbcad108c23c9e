//! Watcher events → store updates, one pure mapper per kind.
//!
//! kube-runtime's watcher reports a (re)list as `Init`, one `InitApply` per object, then
//! `InitDone`. The mappers buffer the listed objects and emit one `Replace*` at `InitDone`, so
//! the store never sees a half-listed kind (kube-proxy's informers behave the same: a relist
//! replaces the whole cache).

use std::collections::BTreeMap;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::runtime::watcher::Event;

use proxy_model::objects::{EndpointSliceInfo, Kind, NodeInfo, ObjectKey, ServiceInfo, Update};

/// Turns one kind's watcher events into store updates.
pub trait EventMapper<K>: Send + 'static {
    const KIND: Kind;

    /// The update for `event`, if it completes a list or is a watch event.
    fn map(&mut self, event: Event<K>) -> Option<Update>;
}

/// Objects received since `Init`, until `InitDone`.
#[derive(Debug)]
struct ListBuffer<T> {
    objects: BTreeMap<ObjectKey, T>,
}

impl<T> Default for ListBuffer<T> {
    fn default() -> Self {
        Self {
            objects: BTreeMap::new(),
        }
    }
}

impl<T> ListBuffer<T> {
    /// The listed objects, in a map with full nodes (the list came in key order).
    fn take(&mut self) -> BTreeMap<ObjectKey, T> {
        proxy_model::btree::packed(std::mem::take(&mut self.objects))
    }
}

/// kube-proxy skips headless Services (`spec.clusterIP: None`): nothing to proxy.
pub fn is_headless(service: &Service) -> bool {
    service
        .spec
        .as_ref()
        .and_then(|spec| spec.cluster_ip.as_deref())
        .is_some_and(|ip| ip == "None")
}

#[derive(Debug, Default)]
pub struct ServiceEvents {
    list: ListBuffer<ServiceInfo>,
}

impl EventMapper<Service> for ServiceEvents {
    const KIND: Kind = Kind::Service;

    fn map(&mut self, event: Event<Service>) -> Option<Update> {
        match event {
            Event::Init => {
                self.list.take();
                None
            }
            Event::InitApply(service) => {
                if let Some(key) = ObjectKey::of(&service.metadata)
                    && !is_headless(&service)
                {
                    self.list.objects.insert(key, ServiceInfo::from(&service));
                }
                None
            }
            Event::InitDone => Some(Update::ReplaceServices(self.list.take())),
            Event::Apply(service) => {
                let key = ObjectKey::of(&service.metadata)?;
                // A Service that is (now) headless is gone as far as the proxy is concerned;
                // deleting an unknown key is a no-op in the store.
                Some(if is_headless(&service) {
                    Update::ServiceDeleted(key)
                } else {
                    Update::ServiceApplied(key, ServiceInfo::from(&service))
                })
            }
            Event::Delete(service) => ObjectKey::of(&service.metadata).map(Update::ServiceDeleted),
        }
    }
}

#[derive(Debug, Default)]
pub struct EndpointSliceEvents {
    list: ListBuffer<EndpointSliceInfo>,
}

impl EventMapper<EndpointSlice> for EndpointSliceEvents {
    const KIND: Kind = Kind::EndpointSlice;

    fn map(&mut self, event: Event<EndpointSlice>) -> Option<Update> {
        match event {
            Event::Init => {
                self.list.take();
                None
            }
            Event::InitApply(slice) => {
                // Converted as it arrives: a relist never holds the `k8s-openapi` objects.
                if let Some(key) = ObjectKey::of(&slice.metadata) {
                    self.list
                        .objects
                        .insert(key, EndpointSliceInfo::from(&slice));
                }
                None
            }
            Event::InitDone => Some(Update::ReplaceEndpointSlices(self.list.take())),
            Event::Apply(slice) => {
                let key = ObjectKey::of(&slice.metadata)?;
                Some(Update::EndpointSliceApplied(
                    key,
                    EndpointSliceInfo::from(&slice),
                ))
            }
            Event::Delete(slice) => {
                ObjectKey::of(&slice.metadata).map(Update::EndpointSliceDeleted)
            }
        }
    }
}

/// This node only: the watch is field-selected by name, and the mapper checks the name again
/// so that a server ignoring the selector cannot make another node's labels ours.
#[derive(Debug)]
pub struct NodeEvents {
    name: String,
    listed: Option<NodeInfo>,
}

impl NodeEvents {
    pub fn new(name: String) -> Self {
        Self { name, listed: None }
    }

    fn is_ours(&self, node: &Node) -> bool {
        node.metadata.name.as_deref() == Some(self.name.as_str())
    }
}

impl EventMapper<Node> for NodeEvents {
    const KIND: Kind = Kind::Node;

    fn map(&mut self, event: Event<Node>) -> Option<Update> {
        match event {
            Event::Init => {
                self.listed = None;
                None
            }
            Event::InitApply(node) => {
                if self.is_ours(&node) {
                    self.listed = Some(NodeInfo::from(&node));
                }
                None
            }
            Event::InitDone => Some(Update::ReplaceNode(self.listed.take())),
            Event::Apply(node) => self
                .is_ours(&node)
                .then(|| Update::ReplaceNode(Some(NodeInfo::from(&node)))),
            Event::Delete(node) => self.is_ours(&node).then_some(Update::ReplaceNode(None)),
        }
    }
}

#[cfg(test)]
mod tests;
