//! The drift check reads the maps and compares them on another thread while the agent keeps
//! syncing (`proxy-agent/src/dataplane/ebpf/drift/reader.rs`): an EndpointSlice change through
//! the API server waited 300–600 ms for the in-loop check at 50k Services. The thread compares
//! with a copy of the map writer's record taken when the check started; a key the agent writes
//! while the check is out may have been read before or after its write, so the agent leaves the
//! keys written meanwhile out. Here, with the agent's dataplane on real pinned maps: a check
//! started before a change and run after it sees the change on its thread and reports nothing
//! once finished (so the record of written keys is what keeps it quiet), an entry changed
//! behind the agent's back during a check is still reported and repaired, and a check whose
//! record was replaced by a newer check's, or given up, is not finished at all.
//!
//! Needs root: namespaces, a private bpffs, a child cgroup.
#![expect(
    clippy::expect_used,
    reason = "test setup: a failed expectation is a failed test"
)]

use std::{collections::BTreeMap, net::Ipv4Addr};

use aya::maps::{Array, Map, MapData};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_common::{Backend4, map_names};
use proxy_dataplane_ebpf::{DriftNotChecked, EbpfDataplane, PIN_DIR_NAME};
use proxy_model::{
    desired::Snapshot,
    objects::{ObjectKey, Objects},
};
use proxy_tests::{
    in_process::on_netns_thread,
    manifests::Endpoint,
    netns::Netns,
    scenario::{http_service, http_slice},
};

const NODE: &str = "node";

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "default".into(),
        name: name.into(),
    }
}

/// Two ClusterIP Services, `web` (10.96.0.10) and `api` (10.96.0.11), TCP 80 → 8080, with the
/// given endpoints.
fn snapshot(web: &[&str], api: &[&str]) -> Snapshot {
    let mut services = BTreeMap::new();
    let mut slices = BTreeMap::new();
    for (name, ip, backends) in [
        ("web", Ipv4Addr::new(10, 96, 0, 10), web),
        ("api", Ipv4Addr::new(10, 96, 0, 11), api),
    ] {
        let service: Service =
            serde_yaml::from_str(&http_service("default", name, ip)).expect("service yaml");
        let endpoints: Vec<Endpoint> = backends
            .iter()
            .map(|a| Endpoint {
                node_name: Some(NODE.into()),
                ..Endpoint::ready(a.parse::<Ipv4Addr>().expect("an IPv4 address"))
            })
            .collect();
        let slice_name = format!("{name}-1");
        let slice: EndpointSlice =
            serde_yaml::from_str(&http_slice("default", &slice_name, name, &endpoints))
                .expect("slice yaml");
        services.insert(key(name), service.into());
        slices.insert(key(&slice_name), slice.into());
    }
    let snapshot = Snapshot::compute(&Objects::new(services, slices, None), NODE);
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    assert!(errors.is_empty(), "snapshot errors: {errors:?}");
    snapshot
}

/// `(map, kind)` of each reported drift, sorted.
fn kinds(check: &proxy_dataplane_ebpf::DriftCheck) -> Vec<(String, String)> {
    let mut kinds: Vec<(String, String)> = check
        .drift
        .iter()
        .map(|d| (d.map.to_owned(), d.kind.to_string()))
        .collect();
    kinds.sort();
    kinds
}

#[test]
fn writes_during_a_drift_reading_are_not_drift_but_tampering_is() {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let ns = Netns::new("driftread").expect("netns");
    on_netns_thread(ns.path(), |parts| {
        let options = parts.small_dataplane_options(64);
        let mut dataplane = EbpfDataplane::start(&options).expect("dataplane");
        let before = snapshot(&["10.244.1.2", "10.244.1.3"], &["10.244.2.2"]);
        let (_, errors) = dataplane.apply(&before, None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");

        // A check started before web's endpoints change, run on its thread after the change.
        let job = dataplane.start_drift_check().expect("drift check");
        let after = snapshot(&["10.244.1.4"], &["10.244.2.2"]);
        let (summary, errors) = dataplane.apply(&after, None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        assert!(summary.frontends_written > 0, "{summary:?}");
        let found = job.run();
        // The thread compared the maps after the change with the record from before it: it
        // sees web's entries differ. The record of written keys is what keeps the check quiet.
        let seen: Vec<&str> = found.unfiltered().map(|d| d.map).collect();
        assert!(
            seen.contains(&map_names::FRONTENDS4) && seen.contains(&map_names::BACKEND_SLOTS),
            "{seen:?}"
        );
        let check = dataplane.finish_drift_check(found, false).expect("checked");
        assert_eq!(kinds(&check), [], "{check:#?}");

        // A newer check replaces the record: the older one's result is stale.
        let older = dataplane.start_drift_check().expect("drift check").run();
        let newer = dataplane.start_drift_check().expect("drift check");
        assert_eq!(
            dataplane.finish_drift_check(older, false).err(),
            Some(DriftNotChecked::Superseded)
        );
        let check = dataplane
            .finish_drift_check(newer.run(), false)
            .expect("checked");
        assert_eq!(kinds(&check), [], "{check:#?}");

        // api's backend rewritten behind the agent's back while a check is out, and web
        // changed by the agent meanwhile: only the tampering is reported, and repaired.
        let pin_dir = parts.bpf_root().join(PIN_DIR_NAME);
        let map = MapData::from_pin(pin_dir.join(map_names::BACKENDS4))
            .and_then(Map::from_map_data)
            .expect("backends map");
        let mut backends: Array<MapData, Backend4> =
            Array::try_from(map).expect("typed backends map");
        let api_addr = u32::from(Ipv4Addr::new(10, 244, 2, 2)).to_be();
        let (api_id, api_backend) = (0..)
            .zip(backends.iter())
            .filter_map(|(id, b)| Some((id, b.ok()?)))
            .find(|(_, b)| b.addr == api_addr)
            .expect("api's backend in the map");
        let job = dataplane.start_drift_check().expect("drift check");
        let tampered = Backend4 {
            addr: u32::from(Ipv4Addr::new(192, 0, 2, 66)).to_be(),
            ..api_backend
        };
        backends.set(api_id, tampered, 0).expect("tamper");
        let (_, errors) = dataplane.apply(&before, None);
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        let found = job.run();
        let check = dataplane.finish_drift_check(found, true).expect("checked");
        assert_eq!(
            kinds(&check),
            [(map_names::BACKENDS4.to_owned(), "changed".to_owned())],
            "{check:#?}"
        );
        assert_eq!(
            backends.get(&api_id, 0).expect("api's backend").addr,
            api_addr,
            "repaired"
        );
        let check = dataplane.check_drift(false).expect("checked");
        assert_eq!(kinds(&check), [], "{check:#?}");

        // A check given up (its thread failed) stops the record: its result, which could no
        // longer be told apart from the writes after it, is not finished.
        let job = dataplane.start_drift_check().expect("drift check");
        dataplane.abandon_drift_check();
        let (summary, errors) = dataplane.apply(
            &snapshot(&["10.244.1.2", "10.244.1.3"], &["10.244.2.3"]),
            None,
        );
        assert!(errors.is_empty(), "apply errors: {errors:?}");
        assert!(summary.frontends_written > 0, "{summary:?}");
        assert_eq!(
            dataplane.finish_drift_check(job.run(), false).err(),
            Some(DriftNotChecked::Superseded)
        );
        let check = dataplane.check_drift(false).expect("checked");
        assert_eq!(kinds(&check), [], "{check:#?}");
        drop(dataplane);
        drop(parts);
    })
    .expect("node thread");
    drop(ns);
}
