//! Kubernetes API source: kube-runtime watchers for Services, EndpointSlices and this Node,
//! with kube-proxy's selectors, feeding the store through [`Update`]s.
//!
//! Each kind has its own watcher (`watcher.rs`: kube-runtime's, with the list streamed by
//! `list.rs` so that no list is ever held as `k8s-openapi` objects or as one body). A
//! (re)list (`Init → InitApply* → InitDone`) becomes one `Replace*` update, so the store only
//! ever sees complete lists; watch events become `*Applied`/`*Deleted`. Errors (API server
//! unreachable, 410 Gone, dropped connections) are retried with kube-runtime's default
//! backoff; until then the store, and so the datapath, keeps the last state.

mod client;
use proxy_model::config::encoding;
mod events;
#[cfg(test)]
mod fixtures;
mod list;
mod mapping;
mod rate_limit;
mod request_metrics;
mod watch_events;
mod watcher;

use std::fmt;

use futures::{StreamExt as _, future};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{Api, Client, Resource, runtime::WatchStreamExt as _};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tracing::{info, warn};

pub use client::{ClientError, ClientOptions, client};
pub use encoding::{Encoding, EncodingError};
pub use events::{ServiceEvent, ServiceWarnings, post_starting_event, service_warnings};
pub use mapping::{EndpointSliceEvents, EventMapper, NodeEvents, ServiceEvents};

use proxy_decode::protobuf;
use proxy_model::objects::Update;

/// kube-proxy's label selector for Services and EndpointSlices (one informer factory for both
/// in cmd/kube-proxy): objects meant for another service proxy, and headless Services and
/// their slices, are not this proxy's business.
pub const PROXY_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name";

/// The field selector that restricts the Node watch to this node.
pub fn node_field_selector(node_name: &str) -> String {
    format!("metadata.name={node_name}")
}

/// Watches the three kinds until the receiver of `tx` goes away.
pub async fn run(client: Client, encoding: Encoding, node_name: String, tx: mpsc::Sender<Update>) {
    // Lists (the first and every relist after a 410) are served from the API server's watch
    // cache (`resourceVersion=0`), as client-go informers ask: a quorum read goes to etcd,
    // and with every node's agent relisting at once that is what the control plane feels.
    // Without a `limit` (kube-core would drop `resourceVersion=0` from a list that has one; the
    // watch cache serves such a list whole anyway, and client-go's reflector does not page it
    // either): see `watcher::Params`.
    let labels = watcher::Params {
        label_selector: Some(PROXY_LABEL_SELECTOR.to_owned()),
        field_selector: None,
    };
    let services = watch(
        Api::<Service>::all(client.clone()),
        labels.clone(),
        encoding.clone(),
        ServiceEvents::default(),
        tx.clone(),
    );
    let slices = watch(
        Api::<EndpointSlice>::all(client.clone()),
        labels,
        encoding.clone(),
        EndpointSliceEvents::default(),
        tx.clone(),
    );
    let node = watch(
        Api::<Node>::all(client),
        watcher::Params {
            label_selector: None,
            field_selector: Some(node_field_selector(&node_name)),
        },
        encoding,
        NodeEvents::new(node_name),
        tx,
    );
    future::join3(services, slices, node).await;
}

/// One kind's watch loop. Returns when the receiver is gone.
async fn watch<K, M>(
    api: Api<K>,
    params: watcher::Params,
    encoding: Encoding,
    mapper: M,
    tx: mpsc::Sender<Update>,
) where
    K: Resource + Clone + DeserializeOwned + protobuf::FromMessage + fmt::Debug + Send + 'static,
    M: EventMapper<K>,
{
    let kind = M::KIND;
    let mut stream = watcher::watch(api, params, encoding, mapper)
        .default_backoff()
        .boxed();
    let mut lists = 0_u64;
    let mut failing = false;
    while let Some(result) = stream.next().await {
        let event = match result {
            Ok(event) => event,
            Err(error) => {
                // kube-runtime only logs these at debug; they matter to an operator (the
                // datapath is frozen on the last state until the watch is back).
                warn!(kind = ?kind, %error, "watch failed; keeping the last state, retrying");
                failing = true;
                continue;
            }
        };
        if failing {
            failing = false;
            info!(kind = ?kind, "watch reconnected");
        }
        let update = match event {
            watcher::Step::Listing if lists == 0 => {
                info!(kind = ?kind, "listing");
                continue;
            }
            watcher::Step::Listing => {
                // The watch could not resume from its resourceVersion (410 Gone: history
                // expired) and starts over with a full list.
                warn!(kind = ?kind, "relisting");
                continue;
            }
            watcher::Step::Update(update) => update,
        };
        if let Some(count) = replaced_count(&update) {
            lists += 1;
            info!(kind = ?kind, objects = count, "listed");
        }
        if tx.send(update).await.is_err() {
            return;
        }
    }
    // A kube-runtime watcher stream never ends on its own; say so if it ever does.
    warn!(kind = ?kind, "watch stream ended");
}

/// The object count of a `Replace*` update (None for watch events).
fn replaced_count(update: &Update) -> Option<usize> {
    match update {
        Update::ReplaceServices(services) => Some(services.len()),
        Update::ReplaceEndpointSlices(slices) => Some(slices.len()),
        Update::ReplaceNode(node) => Some(usize::from(node.is_some())),
        _ => None,
    }
}
