use std::os::fd::AsFd as _;

use aya::maps::IterableMap as _;

use crate::attach::layout::*;

/// The layouts as released, by version. A change of a pinned key or value type fails here:
/// bump the map's version in `current()` and update the row; for a map of datapath state
/// (`holds`) also register the previous layout in `OLDER` with a conversion, or its entries are
/// lost at the upgrade (service state is refilled by the first sync before the new programs
/// attach).
const RELEASED: [(&str, u32, u32, u32); 26] = [
    (map_names::FRONTENDS4, 1, 8, 16),
    (map_names::FRONTENDS6, 1, 20, 16),
    (map_names::BACKEND_SLOTS, 2, 8, 32),
    (map_names::BACKENDS4, 2, 4, 8),
    (map_names::BACKENDS6, 2, 4, 20),
    (map_names::REVNAT4, 2, 16, 8),
    (map_names::REVNAT6, 1, 32, 20),
    (map_names::AFFINITY, 1, 16, 16),
    (map_names::AFFINITY_MATCH, 1, 8, 1),
    (map_names::STATS, 1, 4, 8),
    (map_names::CT4, 3, 16, 64),
    (map_names::CT6, 3, 40, 88),
    (map_names::CT4_NEW, 3, 16, 64),
    (map_names::CT6_NEW, 3, 40, 88),
    (map_names::SOURCE_RANGES, 1, 24, 1),
    (map_names::NODE_ADDRS, 1, 20, 1),
    (map_names::NODE_CONFIG, 1, 4, 72),
    (map_names::SNAT_IFACES, 2, 4, 28),
    (map_names::MAGLEV, 1, 12, 64),
    (map_names::UDP_STICKY, 1, 16, 16),
    (map_names::SERVICE_NAMES, 1, 4, 160),
    (map_names::SERVICE_TRAFFIC, 1, 4, 32),
    (map_names::SERVICE_PACKETS, 1, 4, 32),
    (map_names::ENDPOINT_TRAFFIC, 1, 24, 8),
    (map_names::PORT_FILTER, 1, 4, 16_392),
    (map_names::ROUTE_GENERATION, 1, 4, 4),
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
        for name in migration.into {
            assert!(map_names::PINNED.contains(name), "{migration:?}");
        }
        let Some(now) = current()
            .into_iter()
            .find(|l| l.name == migration.from.name)
        else {
            // Retired: its successors have other names.
            assert!(migration.retired() && !migration.into.contains(&migration.from.name));
            continue;
        };
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
    assert_eq!(size::<v1::CtValueV1>(), 48);
    assert_eq!(size::<v1::CtValueV2>(), 56);
    assert_eq!(size::<v1::CtValue4V1>(), 32);
    assert_eq!(size::<v2::CtValue4>(), 40);
    assert_eq!(size::<v2::CtValue>(), 64);
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

fn ct6() -> Layout {
    current()
        .into_iter()
        .find(|l| l.name == map_names::CT6)
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
    // The per-family conntrack before its values carried the service id, and before they
    // kept the next hop: by record or sizes.
    assert_eq!(decide(&ct6(), Found::Recorded(3), 40, 88), Decision::Adopt);
    let migrate_ct6 = |d: Decision, version: u32| matches!(d, Decision::Migrate(m) if m.from.name == map_names::CT6 && m.from.version == version);
    assert!(migrate_ct6(decide(&ct6(), Found::Recorded(1), 40, 56), 1));
    assert!(migrate_ct6(decide(&ct6(), Found::Unrecorded, 40, 56), 1));
    assert!(migrate_ct6(decide(&ct6(), Found::Recorded(2), 40, 64), 2));
    assert!(migrate_ct6(decide(&ct6(), Found::Unrecorded, 40, 64), 2));
    assert_eq!(
        decide(&ct6(), Found::Recorded(2), 40, 56),
        Decision::Rebuild
    );
    assert_eq!(decide(&ct6(), Found::Unrecorded, 40, 48), Decision::Rebuild);
}

#[test]
fn holds_names_what_a_rebuild_costs() {
    assert_eq!(holds(map_names::FRONTENDS4), Holds::ServiceState);
    assert_eq!(holds(map_names::STATS), Holds::Counters);
    assert!(matches!(holds(map_names::CT4), Holds::DatapathState(_)));
    assert!(matches!(holds(map_names::CT6), Holds::DatapathState(_)));
    assert!(matches!(holds(v1::CT), Holds::DatapathState(_)));
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
    let old_map = as_map(&old);
    let pins = PinDir::new(&[(map_names::REVNAT4, as_map(&new))]);
    let first = (OLDER[0].copy)(&old_map, pins.path(), 0).expect("first copy");
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
    let last = (OLDER[0].copy)(&old_map, pins.path(), BPF_NOEXIST).expect("last copy");
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

/// A bpffs of its own (mounted on a fresh directory) with maps pinned in it (needs root);
/// unmounted and removed on drop.
struct PinDir {
    dir: std::path::PathBuf,
}

impl PinDir {
    fn new(maps: &[(&str, Map)]) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kpr-layout-{}-{n}", std::process::id()));
        let pins = Self { dir };
        proxy_kernel::bpf::bpffs::ensure_mounted(&pins.dir).expect("bpffs");
        for (name, map) in maps {
            let data = match map {
                Map::HashMap(data) | Map::LruHashMap(data) | Map::Array(data) => data,
                _ => panic!("a hash map or an array"),
            };
            data.pin(pins.dir.join(name)).expect("pin");
        }
        pins
    }

    fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.dir, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Real maps (needs root): the foundation's conntrack of both families goes into the map of
/// each entry's family, IPv4 narrowed, with no reply interface (routed as before).
#[test]
fn the_one_conntrack_map_splits_into_one_per_family() {
    let mut old = HashMap::<MapData, CtKey, v1::CtValueV1>::create(16, 0).expect("old map");
    let v4 = HashMap::<MapData, CtKey4, CtValue4>::create(16, 0).expect("v4 map");
    let v6 = HashMap::<MapData, CtKey, CtValue>::create(16, 0).expect("v6 map");
    let key = |family: u8, last: u32| CtKey {
        src: if family == proxy_common::family::V6 {
            [0xfd00, 0, 0, last]
        } else {
            [last, 0, 0, 0]
        },
        dst: [7, 0, 0, 0],
        sport: 1234u16.to_be(),
        dport: 80u16.to_be(),
        proto: proxy_common::proto::TCP,
        family,
        _pad: 0,
    };
    let value = |last: u32| v1::CtValueV1 {
        src: [last, 0, 0, 0],
        dst: [9, 0, 0, 0],
        sport: 1234u16.to_be(),
        dport: 8080u16.to_be(),
        flags: proxy_common::ct_flags::SNAT,
        _pad: [0; 3],
        last_seen_ns: 42,
    };
    let four = key(proxy_common::family::V4, 1);
    let six = key(proxy_common::family::V6, 2);
    old.insert(four, value(1), 0).expect("insert");
    old.insert(six, value(2), 0).expect("insert");
    let pins = PinDir::new(&[(map_names::CT4, as_map(&v4)), (map_names::CT6, as_map(&v6))]);
    let migration = OLDER
        .iter()
        .find(|m| m.from.name == v1::CT)
        .expect("registered");
    let count = (migration.copy)(&as_map(&old), pins.path(), 0).expect("copy");
    assert_eq!((count.copied, count.skipped, count.failed), (2, 0, 0));
    let narrow: Vec<(CtKey4, CtValue4)> = v4.iter().flatten().collect();
    assert_eq!(narrow.len(), 1);
    assert_eq!(narrow[0].0.widen(), four);
    assert_eq!(narrow[0].1.widen(), CtValue::from(value(1)));
    assert_eq!(narrow[0].1.out_ifindex, 0);
    assert_eq!(v6.get(&six, 0).expect("v6 entry"), CtValue::from(value(2)));
    assert_eq!(v6.iter().count(), 1);
}

/// Real maps (needs root): the one conntrack map of the reply-interface layout (version 2)
/// splits the same way, each entry keeping the interface and neighbour its replies leave by.
#[test]
fn the_one_conntrack_map_of_version_2_splits_keeping_the_reply_interface() {
    let mut old = HashMap::<MapData, CtKey, v1::CtValueV2>::create(16, 0).expect("old map");
    let v4 = HashMap::<MapData, CtKey4, CtValue4>::create(16, 0).expect("v4 map");
    let v6 = HashMap::<MapData, CtKey, CtValue>::create(16, 0).expect("v6 map");
    let four = CtKey {
        src: [0x0a00_0001, 0, 0, 0],
        dst: [0x0a00_0002, 0, 0, 0],
        sport: 4321u16.to_be(),
        dport: 30080u16.to_be(),
        proto: proxy_common::proto::UDP,
        family: proxy_common::family::V4,
        _pad: 0,
    };
    let six = CtKey {
        src: [0xfd00, 0, 0, 1],
        dst: [0xfd00, 0, 0, 2],
        family: proxy_common::family::V6,
        ..four
    };
    let reply = |src: [u32; 4]| v1::CtValueV2 {
        src,
        dst: [0x0a00_0003, 0, 0, 0],
        sport: 80u16.to_be(),
        dport: 4321u16.to_be(),
        flags: proxy_common::ct_flags::REPLY,
        _pad: 0,
        out_mac: [2, 0, 0, 0, 0, 7],
        out_ifindex: 7,
        last_seen_ns: 5,
    };
    old.insert(four, reply([0x0a00_0004, 0, 0, 0]), 0)
        .expect("insert");
    old.insert(six, reply([0xfd00, 0, 0, 4]), 0)
        .expect("insert");
    let pins = PinDir::new(&[(map_names::CT4, as_map(&v4)), (map_names::CT6, as_map(&v6))]);
    let migration = OLDER
        .iter()
        .find(|m| m.from.name == v1::CT && m.from.version == 2)
        .expect("registered");
    assert_eq!(
        (migration.from.key_size, migration.from.value_size),
        (40, 56)
    );
    let count = (migration.copy)(&as_map(&old), pins.path(), 0).expect("copy");
    assert_eq!((count.copied, count.skipped, count.failed), (2, 0, 0));
    let narrow: Vec<(CtKey4, CtValue4)> = v4.iter().flatten().collect();
    assert_eq!(narrow.len(), 1);
    assert_eq!(narrow[0].0.widen(), four);
    assert_eq!(
        narrow[0].1.widen(),
        CtValue::from(reply([0x0a00_0004, 0, 0, 0]))
    );
    assert_eq!(
        v6.get(&six, 0).expect("v6 entry"),
        CtValue::from(reply([0xfd00, 0, 0, 4]))
    );
}

/// Real maps (needs root): the per-family conntrack of the agent before its values carried the
/// flow's service id is copied entry for entry, each keeping its translation, reply interface
/// and age, with service id 0 (its packets are not counted).
#[test]
fn per_family_conntrack_entries_keep_their_translation_without_a_service_id() {
    let mut old4 = HashMap::<MapData, CtKey4, v1::CtValue4V1>::create(16, 0).expect("old v4");
    let mut old6 = HashMap::<MapData, CtKey, v1::CtValueV2>::create(16, 0).expect("old v6");
    let v4 = HashMap::<MapData, CtKey4, CtValue4>::create(16, 0).expect("v4 map");
    let v6 = HashMap::<MapData, CtKey, CtValue>::create(16, 0).expect("v6 map");
    let key6 = CtKey {
        src: [0xfd00, 0, 0, 2],
        dst: [0xfd00, 0, 0, 7],
        sport: 1234u16.to_be(),
        dport: 80u16.to_be(),
        proto: proxy_common::proto::TCP,
        family: proxy_common::family::V6,
        _pad: 0,
    };
    let key4 = CtKey4 {
        src: 0x0a00_0002,
        dst: 0x0a00_0007,
        sport: 1234u16.to_be(),
        dport: 80u16.to_be(),
        proto: proxy_common::proto::TCP,
        _pad: [0; 3],
    };
    let value6 = v1::CtValueV2 {
        src: [0xfd00, 0, 0, 4],
        dst: [0xfd00, 0, 0, 9],
        sport: 40_000u16.to_be(),
        dport: 8080u16.to_be(),
        flags: proxy_common::ct_flags::REPLY,
        _pad: 0,
        out_mac: [2, 0, 0, 0, 0, 9],
        out_ifindex: 5,
        last_seen_ns: 42,
    };
    let value4 = v1::CtValue4V1 {
        src: 0x0a00_0004,
        dst: 0x0a00_0009,
        sport: 40_000u16.to_be(),
        dport: 8080u16.to_be(),
        flags: proxy_common::ct_flags::SNAT,
        _pad: 0,
        out_mac: [2, 0, 0, 0, 0, 4],
        out_ifindex: 3,
        last_seen_ns: 43,
    };
    old4.insert(key4, value4, 0).expect("insert");
    old6.insert(key6, value6, 0).expect("insert");
    let pins = PinDir::new(&[(map_names::CT4, as_map(&v4)), (map_names::CT6, as_map(&v6))]);
    let older = |name: &str| {
        OLDER
            .iter()
            .find(|m| m.from.name == name && m.from.version == 1)
            .expect("registered")
    };
    let count = (older(map_names::CT4).copy)(&as_map(&old4), pins.path(), 0).expect("copy");
    assert_eq!((count.copied, count.skipped, count.failed), (1, 0, 0));
    let count = (older(map_names::CT6).copy)(&as_map(&old6), pins.path(), 0).expect("copy");
    assert_eq!((count.copied, count.skipped, count.failed), (1, 0, 0));
    let copied = v4.get(&key4, 0).expect("v4 entry");
    assert_eq!(copied, CtValue4::from(value4));
    assert_eq!(
        (copied.out_ifindex, copied.last_seen_ns, copied.service_id),
        (3, 43, 0)
    );
    let copied = v6.get(&key6, 0).expect("v6 entry");
    assert_eq!(copied, CtValue::from(value6));
    assert_eq!((copied.out_mac, copied.service_id), ([2, 0, 0, 0, 0, 9], 0));
}

/// Real maps (needs root): the per-family conntrack of the agent before its values kept the
/// next hop is copied entry for entry, each keeping its translation, reply interface, age and
/// service id, with no next hop (the flow's next packet looks it up).
#[test]
fn per_family_conntrack_entries_keep_everything_and_look_their_next_hop_up_again() {
    let mut old4 = HashMap::<MapData, CtKey4, v2::CtValue4>::create(16, 0).expect("old v4");
    let mut old6 = HashMap::<MapData, CtKey, v2::CtValue>::create(16, 0).expect("old v6");
    let v4 = HashMap::<MapData, CtKey4, CtValue4>::create(16, 0).expect("v4 map");
    let v6 = HashMap::<MapData, CtKey, CtValue>::create(16, 0).expect("v6 map");
    let key6 = CtKey {
        src: [0xfd00, 0, 0, 2],
        dst: [0xfd00, 0, 0, 7],
        sport: 1234u16.to_be(),
        dport: 80u16.to_be(),
        proto: proxy_common::proto::TCP,
        family: proxy_common::family::V6,
        _pad: 0,
    };
    let key4 = CtKey4 {
        src: 0x0a00_0002,
        dst: 0x0a00_0007,
        sport: 1234u16.to_be(),
        dport: 80u16.to_be(),
        proto: proxy_common::proto::TCP,
        _pad: [0; 3],
    };
    let value6 = v2::CtValue {
        src: [0xfd00, 0, 0, 4],
        dst: [0xfd00, 0, 0, 9],
        sport: 40_000u16.to_be(),
        dport: 8080u16.to_be(),
        flags: proxy_common::ct_flags::REPLY,
        _pad: 0,
        out_mac: [2, 0, 0, 0, 0, 9],
        out_ifindex: 5,
        last_seen_ns: 42,
        service_id: 7,
        _pad2: 0,
    };
    let value4 = v2::CtValue4 {
        src: 0x0a00_0004,
        dst: 0x0a00_0009,
        sport: 40_000u16.to_be(),
        dport: 8080u16.to_be(),
        flags: proxy_common::ct_flags::SNAT,
        _pad: 0,
        out_mac: [2, 0, 0, 0, 0, 4],
        out_ifindex: 3,
        last_seen_ns: 43,
        service_id: 8,
        _pad2: 0,
    };
    old4.insert(key4, value4, 0).expect("insert");
    old6.insert(key6, value6, 0).expect("insert");
    let pins = PinDir::new(&[(map_names::CT4, as_map(&v4)), (map_names::CT6, as_map(&v6))]);
    let older = |name: &str| {
        OLDER
            .iter()
            .find(|m| m.from.name == name && m.from.version == 2)
            .expect("registered")
    };
    let count = (older(map_names::CT4).copy)(&as_map(&old4), pins.path(), 0).expect("copy");
    assert_eq!((count.copied, count.skipped, count.failed), (1, 0, 0));
    let count = (older(map_names::CT6).copy)(&as_map(&old6), pins.path(), 0).expect("copy");
    assert_eq!((count.copied, count.skipped, count.failed), (1, 0, 0));
    let copied = v4.get(&key4, 0).expect("v4 entry");
    assert_eq!(
        (
            copied.src,
            copied.dst,
            copied.flags,
            copied.out_ifindex,
            copied.last_seen_ns,
            copied.service_id
        ),
        (
            0x0a00_0004,
            0x0a00_0009,
            proxy_common::ct_flags::SNAT,
            3,
            43,
            8
        )
    );
    assert_eq!(copied.next_hop, proxy_common::NextHop::NONE);
    let copied = v6.get(&key6, 0).expect("v6 entry");
    assert_eq!(
        (copied.dst, copied.out_mac, copied.service_id),
        ([0xfd00, 0, 0, 9], [2, 0, 0, 0, 0, 9], 7)
    );
    assert_eq!(copied.next_hop, proxy_common::NextHop::NONE);
}

/// Real maps (needs root): the previous agent's backend maps were hash maps of the same key and
/// value sizes as today's arrays, so only their type tells them apart when unrecorded, and
/// their version when recorded. Either way the map is rebuilt, with the service maps that share
/// its ids, to be filled by the first sync before the new programs attach; an array of this
/// build's is adopted.
#[test]
fn hash_backend_maps_of_the_previous_layout_are_rebuilt_with_the_id_linked_maps() {
    let frontends =
        || HashMap::<MapData, Frontend4Key, FrontendValue>::create(16, 0).expect("frontends map");
    let hash_backends = HashMap::<MapData, u32, Backend4>::create(16, 0).expect("hash backends");
    let unrecorded = PinDir::new(&[
        (map_names::BACKENDS4, as_map(&hash_backends)),
        (map_names::FRONTENDS4, as_map(&frontends())),
    ]);
    let decided = plan(unrecorded.path()).expect("plan");
    assert!(
        decided.rebuilt.contains(&map_names::BACKENDS4),
        "{decided:?}"
    );
    assert!(
        decided.rebuilt.contains(&map_names::FRONTENDS4),
        "{decided:?}"
    );
    assert!(decided.rebuilds_service_state() && !decided.migrates());
    assert!(!unrecorded.path().join(map_names::BACKENDS4).exists());
    assert!(!unrecorded.path().join(map_names::FRONTENDS4).exists());

    // Recorded as version 1 by the previous agent.
    let mut records =
        HashMap::<MapData, LayoutKey, LayoutRecord>::create(LAYOUTS_CAPACITY, 0).expect("records");
    records
        .insert(
            LayoutKey::new(map_names::BACKENDS4).expect("name fits"),
            LayoutRecord {
                version: 1,
                key_size: 4,
                value_size: 8,
                _pad: 0,
            },
            0,
        )
        .expect("record");
    let hash_backends = HashMap::<MapData, u32, Backend4>::create(16, 0).expect("hash backends");
    let recorded = PinDir::new(&[
        (map_names::BACKENDS4, as_map(&hash_backends)),
        (LAYOUTS, as_map(&records)),
    ]);
    let decided = plan(recorded.path()).expect("plan");
    assert_eq!(decided.rebuilt, [map_names::BACKENDS4], "{decided:?}");

    // This build's array, unrecorded: adopted as it is.
    let array = aya::maps::Array::<MapData, Backend4>::create(16, 0).expect("array");
    let fd = array
        .map()
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .expect("dup map fd");
    let array = Map::from_map_data(MapData::from_fd(fd).expect("map data")).expect("map");
    let current = PinDir::new(&[(map_names::BACKENDS4, array)]);
    let decided = plan(current.path()).expect("plan");
    assert!(decided.rebuilt.is_empty(), "{decided:?}");
    assert!(current.path().join(map_names::BACKENDS4).exists());
}
