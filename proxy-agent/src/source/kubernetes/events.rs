//! Events the agent posts about itself, as kube-proxy does: `Starting` for its Node when it
//! starts (events.k8s.io/v1, reporting controller `kube-proxy`).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tracing::{debug, warn};

/// kube-proxy's NodeRef: kind Node, the node name as name and UID.
fn node_reference(node_name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Node".to_owned()),
        name: Some(node_name.to_owned()),
        uid: Some(node_name.to_owned()),
        ..ObjectReference::default()
    }
}

/// Posts the `Starting` event; a failure is logged, never fatal (events are informational).
pub async fn post_starting_event(client: Client, node_name: &str) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "kube-proxy".to_owned(),
            instance: Some(node_name.to_owned()),
        },
    );
    let event = Event {
        type_: EventType::Normal,
        reason: "Starting".to_owned(),
        note: None,
        action: "StartKubeProxy".to_owned(),
        secondary: None,
    };
    match recorder.publish(&event, &node_reference(node_name)).await {
        Ok(()) => debug!(node = node_name, "posted the Starting event"),
        Err(error) => warn!(node = node_name, %error, "cannot post the Starting event"),
    }
}
