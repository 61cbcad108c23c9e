//! Events the agent posts: about itself, as kube-proxy does (`Starting` for its Node when it
//! starts; events.k8s.io/v1, reporting controller `kube-proxy`), and Warnings on a Service
//! whose fields it refused to program (an unusable address, a frontend an older Service owns),
//! so the Service's owner sees them in `kubectl describe`.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// Events reported as kube-proxy's on this node, as upstream reports them.
fn recorder(client: Client, node_name: &str) -> Recorder {
    Recorder::new(
        client,
        Reporter {
            controller: "kube-proxy".to_owned(),
            instance: Some(node_name.to_owned()),
        },
    )
}

/// A Warning Event to post on a Service.
#[derive(Debug, Clone)]
pub struct ServiceEvent {
    pub namespace: String,
    pub name: String,
    pub uid: Option<String>,
    pub reason: &'static str,
    pub note: String,
}

/// Where the sync loop hands Service Events; posting happens on its own task, so the loop
/// never waits for the API server. When the queue is full an Event is dropped (the warning
/// in the log and the metrics still tell).
#[derive(Debug, Clone)]
pub struct ServiceWarnings(mpsc::Sender<ServiceEvent>);

impl ServiceWarnings {
    pub fn post(&self, event: ServiceEvent) {
        if let Err(error) = self.0.try_send(event) {
            debug!(%error, "a Service event was not queued");
        }
    }
}

/// Starts the task that posts Service Events for the agent on `node_name`.
pub fn service_warnings(client: Client, node_name: &str) -> ServiceWarnings {
    let (tx, mut rx) = mpsc::channel::<ServiceEvent>(256);
    let recorder = recorder(client, node_name);
    tokio::spawn(async move {
        while let Some(event) = rx.recv().await {
            let reference = ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Service".to_owned()),
                namespace: Some(event.namespace.clone()),
                name: Some(event.name.clone()),
                uid: event.uid.clone(),
                ..ObjectReference::default()
            };
            let published = Event {
                type_: EventType::Warning,
                reason: event.reason.to_owned(),
                // The API limits a note to 1 kB.
                note: Some(event.note.chars().take(1000).collect()),
                action: "ProgramService".to_owned(),
                secondary: None,
            };
            if let Err(error) = recorder.publish(&published, &reference).await {
                warn!(service = %format!("{}/{}", event.namespace, event.name), %error,
                    "cannot post a Service event");
            }
        }
    });
    ServiceWarnings(tx)
}

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
    let recorder = recorder(client, node_name);
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
