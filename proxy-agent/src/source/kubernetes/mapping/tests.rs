use super::*;
use proxy_model::objects::Store;

fn service(name: &str, cluster_ip: &str) -> Service {
    serde_yaml::from_str(&format!(
        "metadata: {{name: {name}, namespace: ns}}\nspec: {{clusterIP: \"{cluster_ip}\"}}"
    ))
    .expect("service")
}

fn slice(name: &str, service: &str) -> EndpointSlice {
    serde_yaml::from_str(&format!(
        "metadata: {{name: {name}, namespace: ns, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nendpoints: []"
    ))
    .expect("slice")
}

/// A Node whose zone names it: the converted form has no name, the zone tells them apart.
fn node(name: &str) -> Node {
    serde_yaml::from_str(&format!(
        "metadata: {{name: {name}, labels: {{topology.kubernetes.io/zone: zone-of-{name}}}}}"
    ))
    .expect("node")
}

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "ns".into(),
        name: name.into(),
    }
}

fn names<T>(map: &BTreeMap<ObjectKey, T>) -> Vec<&str> {
    map.keys().map(|k| &*k.name).collect()
}

#[test]
fn a_list_becomes_one_replace_at_init_done_without_headless_services() {
    let mut m = ServiceEvents::default();
    assert!(m.map(Event::Init).is_none());
    assert!(m.map(Event::InitApply(service("a", "10.96.0.1"))).is_none());
    assert!(m.map(Event::InitApply(service("h", "None"))).is_none());
    assert!(m.map(Event::InitApply(service("b", "10.96.0.2"))).is_none());
    let Some(Update::ReplaceServices(listed)) = m.map(Event::InitDone) else {
        panic!("InitDone must give ReplaceServices");
    };
    assert_eq!(names(&listed), ["a", "b"]);
}

#[test]
fn an_interrupted_list_is_discarded_by_the_next_init() {
    let mut m = ServiceEvents::default();
    m.map(Event::Init);
    m.map(Event::InitApply(service("stale", "10.96.0.1")));
    // The list broke off (e.g. a 410 on a later page) and the watcher started over.
    m.map(Event::Init);
    m.map(Event::InitApply(service("fresh", "10.96.0.2")));
    let Some(Update::ReplaceServices(listed)) = m.map(Event::InitDone) else {
        panic!("InitDone must give ReplaceServices");
    };
    assert_eq!(names(&listed), ["fresh"]);
    // An empty relist replaces with nothing (everything was deleted meanwhile).
    m.map(Event::Init);
    let Some(Update::ReplaceServices(listed)) = m.map(Event::InitDone) else {
        panic!("InitDone must give ReplaceServices");
    };
    assert!(listed.is_empty());
}

#[test]
fn service_watch_events_and_headless_becomes_delete() {
    let mut m = ServiceEvents::default();
    match m.map(Event::Apply(service("a", "10.96.0.1"))) {
        Some(Update::ServiceApplied(k, s)) => {
            assert_eq!(k, key("a"));
            assert_eq!(s, ServiceInfo::from(service("a", "10.96.0.1")));
        }
        other => panic!("expected ServiceApplied, got {other:?}"),
    }
    assert!(matches!(
        m.map(Event::Apply(service("h", "None"))),
        Some(Update::ServiceDeleted(k)) if k == key("h")
    ));
    assert!(matches!(
        m.map(Event::Delete(service("a", "10.96.0.1"))),
        Some(Update::ServiceDeleted(k)) if k == key("a")
    ));
    let nameless: Service = serde_yaml::from_str("metadata: {namespace: ns}").expect("service");
    assert!(m.map(Event::Apply(nameless)).is_none());
}

#[test]
fn slice_list_and_watch_events() {
    let mut m = EndpointSliceEvents::default();
    m.map(Event::Init);
    m.map(Event::InitApply(slice("web-1", "web")));
    let Some(Update::ReplaceEndpointSlices(listed)) = m.map(Event::InitDone) else {
        panic!("InitDone must give ReplaceEndpointSlices");
    };
    assert_eq!(names(&listed), ["web-1"]);
    assert!(matches!(
        m.map(Event::Apply(slice("web-2", "web"))),
        Some(Update::EndpointSliceApplied(k, _)) if k == key("web-2")
    ));
    assert!(matches!(
        m.map(Event::Delete(slice("web-1", "web"))),
        Some(Update::EndpointSliceDeleted(k)) if k == key("web-1")
    ));
}

#[test]
fn node_events_track_only_this_node() {
    let mut m = NodeEvents::new("n1".into());
    m.map(Event::Init);
    m.map(Event::InitApply(node("other")));
    assert!(matches!(
        m.map(Event::InitDone),
        Some(Update::ReplaceNode(None))
    ));
    m.map(Event::Init);
    m.map(Event::InitApply(node("n1")));
    assert!(matches!(
        m.map(Event::InitDone),
        Some(Update::ReplaceNode(Some(n))) if n.zone.as_deref() == Some("zone-of-n1")
    ));
    assert!(m.map(Event::Apply(node("other"))).is_none());
    assert!(matches!(
        m.map(Event::Apply(node("n1"))),
        Some(Update::ReplaceNode(Some(n))) if n.zone.as_deref() == Some("zone-of-n1")
    ));
    assert!(m.map(Event::Delete(node("other"))).is_none());
    assert!(matches!(
        m.map(Event::Delete(node("n1"))),
        Some(Update::ReplaceNode(None))
    ));
    // A relist that no longer finds the node says so.
    m.map(Event::Init);
    assert!(matches!(
        m.map(Event::InitDone),
        Some(Update::ReplaceNode(None))
    ));
}

/// Through the store: the watch feeds a service, a relist after a break drops what was
/// deleted during the break and keeps what is still there.
#[test]
fn relist_after_a_break_converges_the_store() {
    let mut m = ServiceEvents::default();
    let mut store = Store::default();
    let mut feed = |store: &mut Store, event| {
        if let Some(update) = m.map(event) {
            store.apply(update);
        }
    };
    feed(&mut store, Event::Init);
    feed(&mut store, Event::InitApply(service("a", "10.96.0.1")));
    feed(&mut store, Event::InitApply(service("b", "10.96.0.2")));
    feed(&mut store, Event::InitDone);
    feed(&mut store, Event::Apply(service("c", "10.96.0.3")));
    assert_eq!(names(&store.objects().services), ["a", "b", "c"]);
    store.take_changes();
    // During the break: b deleted, c changed, d created. The relist shows the result.
    feed(&mut store, Event::Init);
    feed(&mut store, Event::InitApply(service("a", "10.96.0.1")));
    assert_eq!(
        names(&store.objects().services),
        ["a", "b", "c"],
        "nothing changes before InitDone"
    );
    feed(&mut store, Event::InitApply(service("c", "10.96.0.33")));
    feed(&mut store, Event::InitApply(service("d", "10.96.0.4")));
    feed(&mut store, Event::InitDone);
    assert_eq!(names(&store.objects().services), ["a", "c", "d"]);
    assert_eq!(
        store.take_changes().services,
        [key("b"), key("c"), key("d")].into_iter().collect()
    );
}
