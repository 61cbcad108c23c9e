//! The drift check (`dataplane::ebpf::drift`) over the in-memory maps: what it reports after
//! each kind of outside change, and that its repair leaves maps the datapath can use.

use crate::drift::reader::{DriftReading, compare};
use crate::drift::{Drift, DriftKind, RepairReport, diff, diff_keyed, repair};
use crate::maps::map_writer::tests::*;
use crate::maps::map_writer::{CopyStep, RecordCopy, RecordCopying};
use crate::maps::touched_keys::Touched;
use proxy_common::map_names;

/// The repair of everything `diff` reports.
fn repair_all(expected: &MapsContent, maps: &mut FakeMaps) -> RepairReport {
    let keyed = diff_keyed(expected, &maps.content());
    repair(keyed.iter().map(|keyed| &keyed.fix), maps)
}

/// (map, kind) of each reported difference, sorted.
fn kinds(drift: &[crate::drift::Drift]) -> Vec<(&'static str, DriftKind)> {
    let mut kinds: Vec<_> = drift.iter().map(|d| (d.map, d.kind)).collect();
    kinds.sort();
    kinds
}

fn programmed() -> (FakeMaps, MapWriter, FrontendKey) {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    let mut state = with_affinity(snapshot(&[(web, &[1, 2])]), Some(5));
    state.extend(snapshot(&[(api, &[2, 3])]));
    let (_, errors) = map_writer.apply(state, &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    (maps, map_writer, web)
}

#[test]
fn maps_as_programmed_have_no_drift() {
    let (maps, map_writer, _) = programmed();
    let expected = map_writer.expected_content().expect("nothing damaged");
    assert_eq!(diff(&expected, &maps.content()), []);
}

#[test]
fn corrupted_deleted_and_added_entries_are_reported_and_repaired() {
    let (mut maps, map_writer, web) = programmed();
    let expected = map_writer.expected_content().expect("nothing damaged");
    let web_value = maps.frontends[&frontend_map_key(&web).expect("key")];
    let slot0 = BackendSlotKey {
        service_id: web_value.service_id,
        block: 0,
        generation: web_value.generation,
        _pad: 0,
    };
    let pod1 = maps.slots[&slot0].backend_ids[0];
    // Corrupt: a backend's address, a frontend's count.
    maps.backends.insert(
        pod1,
        BackendValue::V4(Backend4 {
            addr: ip4_to_map([192, 0, 2, 1].into()),
            port: 8080u16.to_be(),
            proto: 6,
            flags: 0,
        }),
    );
    let mut corrupted = web_value;
    corrupted.backend_count = 7;
    maps.frontends
        .insert(frontend_map_key(&web).expect("key"), corrupted);
    // Delete: a block of slots and an affinity match entry.
    maps.slots.remove(&slot0);
    let first_match = *maps.matches.iter().next().expect("affinity on");
    maps.matches.remove(&first_match);
    // Add: a slot of the idle generation, a frontend nobody programmed, an orphan backend.
    let mut stray_block = SlotBlock::default();
    stray_block.backend_ids[0] = pod1;
    maps.slots.insert(
        BackendSlotKey {
            generation: 1 - web_value.generation,
            ..slot0
        },
        stray_block,
    );
    let stray = frontend_map_key(&key([10, 96, 0, 99], 80)).expect("key");
    maps.frontends.insert(stray, web_value);
    maps.backends.insert(
        999,
        BackendValue::V4(Backend4 {
            addr: ip4_to_map([10, 244, 9, 2].into()),
            port: 80u16.to_be(),
            proto: 6,
            flags: 0,
        }),
    );

    let drift = diff(&expected, &maps.content());
    assert_eq!(
        kinds(&drift),
        [
            ("KPR_AFFINITY_MATCH", DriftKind::Missing),
            ("KPR_BACKENDS4", DriftKind::Changed),
            ("KPR_BACKENDS4", DriftKind::Extra),
            ("KPR_BACKEND_SLOTS", DriftKind::Missing),
            ("KPR_BACKEND_SLOTS", DriftKind::Extra),
            ("KPR_FRONTENDS4", DriftKind::Changed),
            ("KPR_FRONTENDS4", DriftKind::Extra),
        ],
        "{drift:#?}"
    );
    let changed = drift
        .iter()
        .find(|d| d.map == "KPR_BACKENDS4" && d.kind == DriftKind::Changed)
        .expect("reported");
    assert_eq!(changed.found.as_deref(), Some("192.0.2.1:8080"));
    assert_eq!(changed.expected.as_deref(), Some("10.244.1.2:8080"));

    let report = repair_all(&expected, &mut maps);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.repaired.values().sum::<u64>(), 7);
    assert_eq!(report.repaired["KPR_FRONTENDS4"], 2);
    assert_eq!(diff(&expected, &maps.content()), []);
    maps.check_invariants();
    assert_eq!(pods(&maps, &web), [1, 2]);
}

#[test]
fn a_corrupted_maglev_block_is_reported_and_rewritten() {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut map_writer = no_grace();
    map_writer.set_maglev_table_size(Some(13));
    let nodeport = external(key([0, 0, 0, 0], 30080));
    let (_, errors) = map_writer.apply(snapshot(&[(nodeport, &[1, 2, 3])]), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    let expected = map_writer.expected_content().expect("nothing damaged");
    assert_eq!(diff(&expected, &maps.content()), []);
    let before = maglev_pods(&maps, &nodeport);

    let block = maps.maglev.values_mut().next().expect("one block");
    block.backend_ids.swap(0, 1);
    block.backend_ids[2] = 4242;
    let drift = diff(&expected, &maps.content());
    assert_eq!(kinds(&drift), [("KPR_MAGLEV", DriftKind::Changed)]);

    let report = repair_all(&expected, &mut maps);
    assert_eq!(report.repaired["KPR_MAGLEV"], 1);
    assert_eq!(maglev_pods(&maps, &nodeport), before);
    maps.check_invariants();
}

#[test]
fn source_ranges_with_host_bits_are_expected_as_networks() {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut map_writer = no_grace();
    let lb = external(key([192, 0, 2, 10], 80));
    let mut state = snapshot(&[(lb, &[1])]);
    state[0].1[0].1.source_ranges = vec!["203.0.113.7/24".parse().expect("range")];
    map_writer.apply(state, &mut maps);
    let expected = map_writer.expected_content().expect("nothing damaged");
    let ranges: Vec<String> = expected
        .source_ranges
        .iter()
        .map(|(_, range)| range.to_string())
        .collect();
    assert_eq!(ranges, ["203.0.113.0/24"]);
}

#[test]
fn retired_generations_are_expected_until_their_grace_ends() {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut map_writer = with_test_clock();
    map_writer.set_maglev_table_size(Some(97));
    let web = external(key([10, 96, 0, 10], 80));
    let api = key([10, 96, 0, 11], 80);
    map_writer.apply(snapshot(&[(web, &[1, 2]), (api, &[3])]), &mut maps);
    map_writer.apply(snapshot(&[(web, &[2, 3])]), &mut maps);
    map_writer.apply([gone(api)], &mut maps);
    // Old slots, a Maglev table and backends 1 are still there: the agent's, not drift; a
    // repair would otherwise delete them before their grace.
    let expected = map_writer.expected_content().expect("nothing damaged");
    assert_eq!(diff(&expected, &maps.content()), []);
    advance(GENERATION_GRACE);
    assert_eq!(map_writer.retire_expired(&mut maps).deleted, 2);
    maps.check_invariants();
    let expected = map_writer.expected_content().expect("nothing damaged");
    assert_eq!(diff(&expected, &maps.content()), []);
}

/// The in-memory maps, noting the keys written as the service maps do while a drift check is
/// out (`ServiceMaps::touched`).
struct Noting<'a> {
    maps: &'a mut FakeMaps,
    touched: &'a mut Touched,
}

impl MapOps for Noting<'_> {
    fn put_frontend(
        &mut self,
        key: FrontendMapKey,
        value: FrontendValue,
    ) -> Result<(), MapWriteError> {
        self.touched.frontend(key);
        self.touched.service(value.service_id);
        self.maps.put_frontend(key, value)
    }
    fn delete_frontend(&mut self, key: FrontendMapKey) -> Result<(), MapWriteError> {
        self.touched.frontend(key);
        self.maps.delete_frontend(key)
    }
    fn put_slot(&mut self, key: BackendSlotKey, block: SlotBlock) -> Result<(), MapWriteError> {
        self.touched.slot(key);
        self.maps.put_slot(key, block)
    }
    fn delete_slot(&mut self, key: BackendSlotKey) -> Result<(), MapWriteError> {
        self.touched.slot(key);
        self.maps.delete_slot(key)
    }
    fn put_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError> {
        self.touched.backend_value(id, &backend);
        self.maps.put_backend(id, backend)
    }
    fn delete_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError> {
        self.touched.backend(id);
        self.maps.delete_backend(id, backend)
    }
    fn put_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError> {
        self.touched.affinity_match(key);
        self.maps.put_affinity_match(key)
    }
    fn delete_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError> {
        self.touched.affinity_match(key);
        self.maps.delete_affinity_match(key)
    }
    fn put_source_range(&mut self, service_id: u32, range: IpNet) -> Result<(), MapWriteError> {
        self.touched.source_ranges_of(service_id);
        self.maps.put_source_range(service_id, range)
    }
    fn delete_source_range(&mut self, service_id: u32, range: IpNet) -> Result<(), MapWriteError> {
        self.touched.source_ranges_of(service_id);
        self.maps.delete_source_range(service_id, range)
    }
    fn put_maglev(&mut self, key: MaglevKey, block: MaglevBlock) -> Result<(), MapWriteError> {
        self.touched.maglev(key);
        self.maps.put_maglev(key, block)
    }
    fn delete_maglev(&mut self, key: MaglevKey) -> Result<(), MapWriteError> {
        self.touched.maglev(key);
        self.maps.delete_maglev(key)
    }
}

/// What the drift check reports of `maps` against a finished copy: differences of entries not
/// written since the copy began (as `EbpfDataplane::finish_drift_check` leaves them).
fn reported(copy: &RecordCopy, maps: &FakeMaps, touched: &Touched) -> Vec<Drift> {
    let expected = copy.expected_content().expect("nothing damaged");
    let reading = DriftReading {
        found: maps.content(),
        ..DriftReading::default()
    };
    let (kept, _) = compare(&expected, reading).without(touched);
    assert!(kept.orphans.is_empty(), "{:?}", kept.orphans);
    kept.drift.into_iter().map(|keyed| keyed.drift).collect()
}

#[test]
fn changes_synced_between_copy_steps_are_no_drift_and_real_drift_is_still_found() {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    // The real grace: generations switched out during the copy stay in the maps meanwhile.
    let mut map_writer = with_test_clock();
    let behind = key([10, 96, 0, 9], 80);
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    let db = key([10, 96, 0, 12], 80);
    let gone = key([10, 96, 0, 13], 80);
    let (_, errors) = map_writer.apply(
        snapshot(&[(web, &[1, 2]), (api, &[2, 3]), (db, &[4]), (gone, &[5])]),
        &mut maps,
    );
    assert!(errors.is_empty(), "{errors:?}");

    // The check begins: keys are noted from here. One frontend a step: web is copied first.
    let mut touched = Touched::new(1);
    let CopyStep::More(mut copying) = map_writer.record_copy_step(RecordCopying::default(), 1)
    else {
        panic!("four frontends take more than one step");
    };
    // A change synced between two steps: web (copied already) switches backends, a frontend
    // appears behind the cursor, db (not copied yet) grows, gone goes (before its copy).
    let mut change = snapshot(&[
        (behind, &[7]),
        (web, &[2, 6]),
        (api, &[2, 3]),
        (db, &[4, 8]),
    ]);
    change.push((name_of(&gone), Vec::new()));
    let (_, errors) = map_writer.apply(
        change,
        &mut Noting {
            maps: &mut maps,
            touched: &mut touched,
        },
    );
    assert!(errors.is_empty(), "{errors:?}");
    let mut steps = 1;
    let copy = loop {
        steps += 1;
        match map_writer.record_copy_step(copying, 1) {
            CopyStep::More(more) => copying = more,
            CopyStep::Done(copy) => break copy,
            CopyStep::Damaged => panic!("nothing damaged"),
        }
    };
    // api and db a step each, then the retired generations and the backends.
    assert_eq!(steps, 4);
    // The copy straddles the change (web's old frontend, behind missing): only the noted keys
    // keep that from being reported.
    let straddling = kinds(&reported(&copy, &maps, &Touched::new(1)));
    assert!(
        straddling.contains(&(map_names::FRONTENDS4, DriftKind::Changed))
            && straddling.contains(&(map_names::FRONTENDS4, DriftKind::Extra)),
        "{straddling:?}"
    );
    assert_eq!(reported(&copy, &maps, &touched), []);

    // Someone else changes api's frontend, which the agent did not write during the copy: the
    // check still finds it.
    let api_key = frontend_map_key(&api).expect("key");
    let mut corrupted = maps.frontends[&api_key];
    corrupted.backend_count = 9;
    maps.frontends.insert(api_key, corrupted);
    let drift = reported(&copy, &maps, &touched);
    assert_eq!(kinds(&drift), [(map_names::FRONTENDS4, DriftKind::Changed)]);
    assert_eq!(drift[0].entry, api.to_string());
}
