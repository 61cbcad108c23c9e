use std::os::fd::AsFd as _;

use aya::maps::IterableMap as _;

use super::*;

/// The layouts as released, by version. A change of a pinned key or value type fails here:
/// bump the map's version in `current()` and update the row; for a map of datapath state
/// (`holds`) also register the previous layout in `OLDER` with a conversion, or its entries are
/// lost at the upgrade (service state is refilled by the first sync before the new programs
/// attach).
const RELEASED: [(&str, u32, u32, u32); 18] = [
    (map_names::FRONTENDS4, 1, 8, 16),
    (map_names::FRONTENDS6, 1, 20, 16),
    (map_names::BACKEND_SLOTS, 1, 8, 4),
    (map_names::BACKENDS4, 1, 4, 8),
    (map_names::BACKENDS6, 1, 4, 20),
    (map_names::REVNAT4, 2, 16, 8),
    (map_names::REVNAT6, 1, 32, 20),
    (map_names::AFFINITY, 1, 16, 16),
    (map_names::AFFINITY_MATCH, 1, 8, 1),
    (map_names::STATS, 1, 4, 8),
    (map_names::CT, 2, 40, 56),
    (map_names::SOURCE_RANGES, 1, 24, 1),
    (map_names::NODE_ADDRS, 1, 20, 1),
    (map_names::NODE_CONFIG, 1, 4, 72),
    (map_names::SNAT_IFACES, 2, 4, 28),
    (map_names::MAGLEV, 1, 12, 64),
    (map_names::UDP_STICKY, 1, 16, 16),
    (map_names::SERVICE_NAMES, 1, 4, 160),
];

#[test]
fn layout_versions_follow_the_types() {
    for (layout, (name, version, key, value)) in current().iter().zip(RELEASED) {
        assert_eq!(layout.name, name);
        assert_eq!(
            (layout.version, layout.key_size, layout.value_size),
            (version, key, value),
            "{name}: a changed layout needs a new version (and, for datapath state, its predecessor in OLDER)"
        );
    }
}

#[test]
fn every_pinned_map_has_one_current_layout_and_its_name_fits_a_record() {
    let names: Vec<&str> = current().iter().map(|l| l.name).collect();
    assert_eq!(names, map_names::PINNED);
    for name in names {
        assert!(LayoutKey::new(name).is_some(), "{name}");
    }
    assert!(LayoutKey::new(LAYOUTS).is_some());
    assert!(LayoutKey::new(&"x".repeat(NAME_LEN + 1)).is_none());
}

#[test]
fn every_older_layout_is_older_than_the_current_one_and_has_other_sizes() {
    for migration in OLDER {
        let now = current()
            .into_iter()
            .find(|l| l.name == migration.from.name)
            .expect("a pinned map");
        assert!(migration.from.version < now.version, "{migration:?}");
        // An unrecorded map is told apart from the current layout by its sizes alone.
        assert_ne!(
            (migration.from.key_size, migration.from.value_size),
            (now.key_size, now.value_size),
            "{migration:?}"
        );
    }
    assert_eq!(size::<u64>(), 8);
    assert_eq!(size::<v1::RevNat4>(), 16);
    assert_eq!(size::<v1::CtValue>(), 48);
}

#[test]
fn a_foundation_reverse_nat_entry_converts_to_the_socket_and_backend_key() {
    let old = v1::RevNat4 {
        frontend_addr: u32::from_ne_bytes([10, 96, 0, 10]),
        backend_addr: u32::from_ne_bytes([10, 244, 1, 1]),
        frontend_port: 80u16.to_be(),
        backend_port: 8080u16.to_be(),
        _pad: 0,
    };
    let (key, value) = v1::revnat4(42, old).expect("converted");
    assert_eq!(
        key,
        RevNat4Key {
            cookie: 42,
            addr: old.backend_addr,
            port: old.backend_port,
            _pad: 0
        }
    );
    assert_eq!(
        value,
        RevNat4 {
            addr: old.frontend_addr,
            port: old.frontend_port,
            _pad: 0
        }
    );
}

fn revnat4() -> Layout {
    current()
        .into_iter()
        .find(|l| l.name == map_names::REVNAT4)
        .expect("pinned")
}

fn ct() -> Layout {
    current()
        .into_iter()
        .find(|l| l.name == map_names::CT)
        .expect("pinned")
}

#[test]
fn decisions_by_record_and_sizes() {
    let now = revnat4();
    let migrate = |d: Decision| matches!(d, Decision::Migrate(m) if m.from.version == 1);
    // This build's layout, recorded or (an agent from before the records) not.
    assert_eq!(decide(&now, Found::Recorded(2), 16, 8), Decision::Adopt);
    assert_eq!(decide(&now, Found::Unrecorded, 16, 8), Decision::Adopt);
    // The foundation's layout: by its record or its sizes.
    assert!(migrate(decide(&now, Found::Recorded(1), 8, 16)));
    assert!(migrate(decide(&now, Found::Unrecorded, 8, 16)));
    // A newer agent's version, even with today's sizes, and sizes no version had.
    assert_eq!(decide(&now, Found::Recorded(3), 16, 8), Decision::Rebuild);
    assert_eq!(decide(&now, Found::Recorded(1), 16, 8), Decision::Rebuild);
    assert_eq!(decide(&now, Found::Unrecorded, 12, 8), Decision::Rebuild);
    // The conntrack before the reply interface: migrated, by record or sizes.
    let ct_v1 = |d: Decision| matches!(d, Decision::Migrate(m) if m.from.name == map_names::CT);
    assert_eq!(decide(&ct(), Found::Recorded(2), 40, 56), Decision::Adopt);
    assert!(ct_v1(decide(&ct(), Found::Recorded(1), 40, 48)));
    assert!(ct_v1(decide(&ct(), Found::Unrecorded, 40, 48)));
    assert_eq!(decide(&ct(), Found::Recorded(3), 40, 56), Decision::Rebuild);
    assert_eq!(decide(&ct(), Found::Unrecorded, 40, 40), Decision::Rebuild);
    // A map without older layouts.
    let rev6 = current()
        .into_iter()
        .find(|l| l.name == map_names::REVNAT6)
        .expect("pinned");
    assert_eq!(decide(&rev6, Found::Recorded(1), 32, 20), Decision::Adopt);
    assert_eq!(decide(&rev6, Found::Recorded(2), 32, 20), Decision::Rebuild);
}

#[test]
fn holds_names_what_a_rebuild_costs() {
    assert_eq!(holds(map_names::FRONTENDS4), Holds::ServiceState);
    assert_eq!(holds(map_names::STATS), Holds::Counters);
    assert!(matches!(holds(map_names::CT), Holds::DatapathState(_)));
    assert!(matches!(holds(map_names::REVNAT4), Holds::DatapathState(_)));
}

fn as_map<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> Map {
    let fd = map
        .map()
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .expect("dup map fd");
    Map::from_map_data(MapData::from_fd(fd).expect("map data")).expect("map")
}

/// Real maps (needs root): the first copy converts every entry, the second adds only what the
/// new map lacks, so an entry the new programs wrote in between is kept.
#[test]
fn copies_convert_every_entry_and_the_last_keeps_newer_ones() {
    let mut old = HashMap::<MapData, u64, v1::RevNat4>::create(16, 0).expect("old map");
    let mut new = HashMap::<MapData, RevNat4Key, RevNat4>::create(16, 0).expect("new map");
    let entry = |i: u32| v1::RevNat4 {
        frontend_addr: 0x0a60_0000 + i,
        backend_addr: 0x0af4_0000 + i,
        frontend_port: 80,
        backend_port: 8080,
        _pad: 0,
    };
    for i in 0..3 {
        old.insert(u64::from(i), entry(i), 0).expect("insert");
    }
    let (old_map, mut new_map) = (as_map(&old), as_map(&new));
    let first = (OLDER[0].copy)(&old_map, &mut new_map, 0).expect("first copy");
    assert_eq!((first.copied, first.skipped, first.failed), (3, 0, 0));
    // The new programs rewrote socket 0's entry; the old ones made socket 3's meanwhile.
    let (key0, _) = v1::revnat4(0, entry(0)).expect("converted");
    let newer = RevNat4 {
        addr: 1,
        port: 1,
        _pad: 0,
    };
    new.insert(key0, newer, 0).expect("insert");
    old.insert(3, entry(3), 0).expect("insert");
    let last = (OLDER[0].copy)(&old_map, &mut new_map, BPF_NOEXIST).expect("last copy");
    assert_eq!((last.copied, last.skipped, last.failed), (1, 3, 0));
    assert_eq!(new.get(&key0, 0).expect("kept"), newer);
    let mut entries: Vec<(RevNat4Key, RevNat4)> = new.iter().flatten().collect();
    entries.sort_by_key(|(k, _)| k.cookie);
    assert_eq!(entries.len(), 4);
    assert_eq!(
        entries[3],
        v1::revnat4(3, entry(3)).expect("converted"),
        "the entry the old programs made after the first copy"
    );
}

/// The conntrack's entries before the reply interface keep their translation, with the
/// interface unset (routed by the table, as they were).
#[test]
fn a_conntrack_entry_without_the_reply_interface_converts_unchanged() {
    let key = CtKey {
        src: [1, 0, 0, 0],
        dst: [2, 0, 0, 0],
        sport: 1,
        dport: 2,
        proto: 6,
        family: proxy_common::family::V4,
        _pad: 0,
    };
    let old = v1::CtValue {
        src: [3, 0, 0, 0],
        dst: [4, 0, 0, 0],
        sport: 3,
        dport: 4,
        flags: proxy_common::ct_flags::REPLY | proxy_common::ct_flags::SNAT,
        _pad: [0; 3],
        last_seen_ns: 99,
    };
    let (k, v) = v1::ct(key, old).expect("converted");
    assert_eq!(k, key);
    assert_eq!(
        (v.src, v.dst, v.sport, v.dport, v.flags, v.last_seen_ns),
        (
            old.src,
            old.dst,
            old.sport,
            old.dport,
            old.flags,
            old.last_seen_ns
        )
    );
    assert_eq!((v.out_ifindex, v.out_mac), (0, [0; 6]));
}
