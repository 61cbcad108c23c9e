//! The drift check (`dataplane::ebpf::drift`) over the in-memory maps: what it reports after
//! each kind of outside change, and that its repair leaves maps the datapath can use.

use crate::drift::{DriftKind, RepairReport, diff, diff_keyed, repair};
use crate::maps::map_writer::tests::*;

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
        slot: 0,
        generation: web_value.generation,
        _pad: 0,
    };
    let pod1 = maps.slots[&slot0];
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
    // Delete: a slot and an affinity match entry.
    let slot1 = BackendSlotKey { slot: 1, ..slot0 };
    maps.slots.remove(&slot1);
    let first_match = *maps.matches.iter().next().expect("affinity on");
    maps.matches.remove(&first_match);
    // Add: a slot of the idle generation, a frontend nobody programmed, an orphan backend.
    maps.slots.insert(
        BackendSlotKey {
            generation: 1 - web_value.generation,
            ..slot0
        },
        pod1,
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
