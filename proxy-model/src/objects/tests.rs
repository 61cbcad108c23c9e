use super::*;

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "ns".into(),
        name: name.into(),
    }
}

fn service(name: &str, ip: &str) -> ServiceInfo {
    serde_yaml::from_str::<k8s_openapi::api::core::v1::Service>(&format!(
        "metadata: {{name: {name}, namespace: ns}}\nspec: {{clusterIP: {ip}}}"
    ))
    .expect("service")
    .into()
}

fn slice(name: &str, service: &str) -> EndpointSliceInfo {
    serde_yaml::from_str::<k8s_openapi::api::discovery::v1::EndpointSlice>(&format!(
        "metadata: {{name: {name}, namespace: ns, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nendpoints: []"
    ))
    .expect("slice")
    .into()
}

/// A slice of `service` with a `last-change-trigger-time` of `second` seconds past 2030.
fn timed_slice(name: &str, service: &str, family: &str, second: u32) -> EndpointSliceInfo {
    serde_yaml::from_str::<k8s_openapi::api::discovery::v1::EndpointSlice>(&format!(
        "metadata: {{name: {name}, namespace: ns, labels: {{kubernetes.io/service-name: {service}}}, \
         annotations: {{endpoints.kubernetes.io/last-change-trigger-time: \"2030-01-01T00:00:{second:02}Z\"}}}}\n\
         addressType: {family}\nendpoints: []"
    ))
    .expect("slice")
    .into()
}

fn at(second: u32) -> SystemTime {
    crate::time_format::parse_rfc3339(&format!("2030-01-01T00:00:{second:02}Z")).expect("time")
}

/// Applies `(slice, service, addressType, trigger second)` updates one by one.
fn apply_timed(store: &mut Store, updates: &[(&str, &str, &str, u32)]) {
    for &(slice, service, family, second) in updates {
        store.apply(Update::EndpointSliceApplied(
            key(slice),
            timed_slice(slice, service, family, second),
        ));
    }
}

// kube-proxy's EndpointsChangeTracker.EndpointSliceUpdate: a time after the tracker's start is
// appended per update, a slice's deletion drops its Service's times.
#[test]
fn trigger_times_are_recorded_per_update_after_the_start_and_dropped_with_a_deleted_slice() {
    let mut store = Store::started_at(at(5));
    store.apply(Update::ReplaceEndpointSlices(BTreeMap::from([
        (key("s1"), timed_slice("s1", "web", "IPv4", 0)),
        (key("s2"), timed_slice("s2", "api", "IPv4", 10)),
    ])));
    assert_eq!(
        store.take_changes().trigger_times,
        BTreeMap::from([(key("api"), vec![(IpFamily::V4, at(10))])])
    );

    apply_timed(
        &mut store,
        &[("s1", "web", "IPv4", 20), ("s3", "web", "IPv6", 30)],
    );
    assert_eq!(
        store.take_changes().trigger_times,
        BTreeMap::from([(
            key("web"),
            vec![(IpFamily::V4, at(20)), (IpFamily::V6, at(30))]
        )])
    );

    apply_timed(
        &mut store,
        &[("s1", "web", "IPv4", 40), ("s2", "api", "IPv4", 41)],
    );
    store.apply(Update::EndpointSliceDeleted(key("s3")));
    assert_eq!(
        store.take_changes().trigger_times,
        BTreeMap::from([(key("api"), vec![(IpFamily::V4, at(41))])])
    );

    // A relist that no longer has a slice: as its deletion.
    apply_timed(&mut store, &[("s2", "api", "IPv4", 50)]);
    store.apply(Update::ReplaceEndpointSlices(BTreeMap::from([(
        key("s1"),
        timed_slice("s1", "web", "IPv4", 40),
    )])));
    assert!(store.take_changes().trigger_times.is_empty());
}

#[test]
fn synced_only_after_every_kind_was_listed() {
    let mut store = Store::default();
    store.apply(Update::ReplaceServices(BTreeMap::new()));
    store.apply(Update::ReplaceEndpointSlices(BTreeMap::new()));
    assert!(!store.is_synced());
    store.apply(Update::ReplaceNode(None));
    assert!(store.is_synced());
}

#[test]
fn replace_reports_added_changed_and_removed_services_only() {
    let mut store = Store::default();
    store.apply(Update::ReplaceServices(BTreeMap::from([
        (key("a"), service("a", "10.96.0.1")),
        (key("b"), service("b", "10.96.0.2")),
        (key("c"), service("c", "10.96.0.3")),
    ])));
    store.take_changes();
    store.apply(Update::ReplaceServices(BTreeMap::from([
        (key("a"), service("a", "10.96.0.1")),
        (key("b"), service("b", "10.96.0.22")),
        (key("d"), service("d", "10.96.0.4")),
    ])));
    let changes = store.take_changes();
    assert_eq!(
        changes.services,
        BTreeSet::from([key("b"), key("c"), key("d")])
    );
}

#[test]
fn slice_changes_mark_their_service_including_a_relabel() {
    let mut store = Store::default();
    store.apply(Update::EndpointSliceApplied(key("s1"), slice("s1", "web")));
    assert_eq!(store.take_changes().services, BTreeSet::from([key("web")]));
    store.apply(Update::EndpointSliceApplied(key("s1"), slice("s1", "api")));
    assert_eq!(
        store.take_changes().services,
        BTreeSet::from([key("web"), key("api")])
    );
    assert!(!store.apply(Update::EndpointSliceApplied(key("s1"), slice("s1", "api"))));
    assert!(store.take_changes().is_empty());
    store.apply(Update::EndpointSliceDeleted(key("s1")));
    assert_eq!(store.take_changes().services, BTreeSet::from([key("api")]));
}

#[test]
fn deleting_an_unknown_object_changes_nothing() {
    let mut store = Store::default();
    assert!(!store.apply(Update::ServiceDeleted(key("ghost"))));
    assert!(store.take_changes().is_empty());
}

#[test]
fn every_update_keeps_the_slices_by_service_index() {
    let mut store = Store::default();
    let web = key("web");
    let api = key("api");
    store.apply(Update::ReplaceEndpointSlices(BTreeMap::from([(
        key("s1"),
        slice("s1", "web"),
    )])));
    assert_eq!(store.objects().slices_of(&web).len(), 1);
    store.apply(Update::EndpointSliceApplied(key("s2"), slice("s2", "web")));
    assert_eq!(store.objects().slices_of(&web).len(), 2);
    store.apply(Update::EndpointSliceApplied(key("s1"), slice("s1", "api")));
    assert_eq!(store.objects().slices_of(&web).len(), 1);
    assert_eq!(store.objects().slices_of(&api).len(), 1);
    store.apply(Update::EndpointSliceDeleted(key("s2")));
    assert!(store.objects().slices_of(&web).is_empty());
    store.apply(Update::ReplaceEndpointSlices(BTreeMap::new()));
    assert!(store.objects().slices_of(&api).is_empty());
}
