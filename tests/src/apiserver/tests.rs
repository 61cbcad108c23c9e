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
