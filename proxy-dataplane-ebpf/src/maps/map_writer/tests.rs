//! The diff and update-protocol logic, over in-memory maps with a capacity, checked after every
//! step for the invariants the datapath relies on. Kernel behaviour itself is covered by the
//! integration tests in `tests/`.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use crate::maps::map_writer::*;
use proxy_model::{
    desired::{Backend, Frontend, Protocol, ServicePortName},
    objects::ObjectKey,
};

#[derive(Debug, Default)]
struct FakeMaps {
    frontends: BTreeMap<FrontendMapKey, FrontendValue>,
    slots: BTreeMap<BackendSlotKey, SlotBlock>,
    backends: BTreeMap<u32, BackendValue>,
    matches: BTreeSet<AffinityMatchKey>,
    maglev: BTreeMap<MaglevKey, MaglevBlock>,
    slot_capacity: usize,
    writes: usize,
}

impl FakeMaps {
    fn with_slot_capacity(slot_capacity: usize) -> Self {
        Self {
            slot_capacity,
            ..Self::default()
        }
    }

    /// The backend id in `value`'s live generation's slot `slot`, as the datapath reads it.
    fn slot_id(&self, value: &FrontendValue, slot: u16) -> Option<u32> {
        let (key, index, _) = proxy_common::select::slot_entry(value, u32::from(slot));
        let id = *self.slots.get(&key)?.backend_ids.get(index)?;
        (id != 0).then_some(id)
    }

    /// What a datapath lookup would see: every frontend's complete backend set, and nothing
    /// unreachable left behind.
    fn check_invariants(&self) {
        let mut reachable_blocks = BTreeSet::new();
        let mut live_matches = BTreeSet::new();
        for (key, value) in &self.frontends {
            for slot in 0..value.backend_count {
                let id = &self
                    .slot_id(value, slot)
                    .unwrap_or_else(|| panic!("{key:?}: slot {slot} missing"));
                let backend = self
                    .backends
                    .get(id)
                    .unwrap_or_else(|| panic!("{key:?}: backend {id} missing"));
                assert_eq!(
                    matches!(key, FrontendMapKey::V4(_)),
                    matches!(backend, BackendValue::V4(_)),
                    "{key:?}: backend {id} of the other family"
                );
                if value.flags & frontend_flags::AFFINITY != 0 {
                    live_matches.insert(AffinityMatchKey {
                        service_id: value.service_id,
                        backend_id: *id,
                    });
                }
                reachable_blocks.insert(proxy_common::select::slot_entry(value, slot.into()).0);
            }
        }
        assert_eq!(
            reachable_blocks.len(),
            self.slots.len(),
            "orphan slots: {:?}",
            self.slots
        );
        let used: BTreeSet<u32> = self
            .slots
            .values()
            .flat_map(|block| block.backend_ids)
            .filter(|&id| id != 0)
            .collect();
        assert_eq!(
            used.len(),
            self.backends.len(),
            "orphan backends: {:?}",
            self.backends
        );
        assert_eq!(live_matches, self.matches, "affinity match entries");
        // Maglev: a frontend with a table sees all of it, each entry one of its own backends;
        // no entry of any other table is left.
        let mut reachable_maglev = 0;
        for (key, value) in &self.frontends {
            if value.flags & frontend_flags::MAGLEV == 0 {
                continue;
            }
            let own: BTreeSet<u32> = (0..value.backend_count)
                .filter_map(|slot| self.slot_id(value, slot))
                .collect();
            for block in 0..value.maglev_size.div_ceil(MAGLEV_BLOCK_SLOTS) {
                let entry = self
                    .maglev
                    .get(&MaglevKey {
                        service_id: value.service_id,
                        block,
                        generation: value.generation,
                        _pad: [0; 3],
                    })
                    .unwrap_or_else(|| panic!("{key:?}: Maglev block {block} missing"));
                for id in &entry.backend_ids {
                    assert!(own.contains(id), "{key:?}: Maglev block {block} → {id}");
                }
                reachable_maglev += 1;
            }
        }
        assert_eq!(reachable_maglev, self.maglev.len(), "orphan Maglev slots");
    }

    /// Backends of a frontend as socket addresses.
    fn backends_of(&self, key: &FrontendKey) -> Vec<SocketAddr> {
        let map_key = frontend_map_key(key).expect("supported");
        let Some(value) = self.frontends.get(&map_key) else {
            return Vec::new();
        };
        (0..value.backend_count)
            .map(|slot| {
                let id = self.slot_id(value, slot).expect("slot");
                self.backends[&id].socket_addr()
            })
            .collect()
    }

    /// Everything in the maps, as `EbpfDataplane::start` reads it back after a restart.
    fn content(&self) -> MapsContent {
        MapsContent {
            frontends: self.frontends.iter().map(|(k, v)| (*k, *v)).collect(),
            slots: self.slots.clone(),
            backends: self.backends.clone(),
            affinity_matches: self.matches.clone(),
            source_ranges: BTreeSet::new(),
            maglev: self.maglev.clone(),
        }
    }
}

impl MapOps for FakeMaps {
    fn put_frontend(
        &mut self,
        key: FrontendMapKey,
        value: FrontendValue,
    ) -> Result<(), MapWriteError> {
        self.writes += 1;
        self.frontends.insert(key, value);
        Ok(())
    }
    fn delete_frontend(&mut self, key: FrontendMapKey) -> Result<(), MapWriteError> {
        self.writes += 1;
        self.frontends.remove(&key);
        Ok(())
    }
    fn put_slot(&mut self, key: BackendSlotKey, block: SlotBlock) -> Result<(), MapWriteError> {
        if !self.slots.contains_key(&key) && self.slots.len() >= self.slot_capacity {
            return Err(MapWriteError::Full("slots"));
        }
        self.writes += 1;
        self.slots.insert(key, block);
        Ok(())
    }
    fn delete_slot(&mut self, key: BackendSlotKey) -> Result<(), MapWriteError> {
        self.writes += 1;
        self.slots.remove(&key);
        Ok(())
    }
    fn put_backend(&mut self, id: u32, backend: BackendValue) -> Result<(), MapWriteError> {
        self.writes += 1;
        self.backends.insert(id, backend);
        Ok(())
    }
    fn delete_backend(&mut self, id: u32, _backend: BackendValue) -> Result<(), MapWriteError> {
        self.writes += 1;
        self.backends.remove(&id);
        Ok(())
    }
    fn put_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError> {
        self.writes += 1;
        self.matches.insert(key);
        Ok(())
    }
    fn delete_affinity_match(&mut self, key: AffinityMatchKey) -> Result<(), MapWriteError> {
        self.writes += 1;
        self.matches.remove(&key);
        Ok(())
    }
    fn put_source_range(&mut self, _service_id: u32, _range: IpNet) -> Result<(), MapWriteError> {
        self.writes += 1;
        Ok(())
    }
    fn delete_source_range(
        &mut self,
        _service_id: u32,
        _range: IpNet,
    ) -> Result<(), MapWriteError> {
        self.writes += 1;
        Ok(())
    }
    fn put_maglev(&mut self, key: MaglevKey, block: MaglevBlock) -> Result<(), MapWriteError> {
        if !self.maglev.contains_key(&key) && self.maglev.len() >= self.slot_capacity {
            return Err(MapWriteError::Full("maglev"));
        }
        self.writes += 1;
        self.maglev.insert(key, block);
        Ok(())
    }
    fn delete_maglev(&mut self, key: MaglevKey) -> Result<(), MapWriteError> {
        self.writes += 1;
        self.maglev.remove(&key);
        Ok(())
    }
}

/// A map writer that deletes a generation at its switch, as before the grace: for the tests of
/// everything else, which check after each apply that nothing unreachable is left.
fn no_grace() -> MapWriter {
    MapWriter::default().with_grace(Duration::ZERO, Instant::now)
}

thread_local! {
    /// The clock of `with_test_clock` writers: each test runs on its own thread.
    static NOW: Cell<Option<Instant>> = const { Cell::new(None) };
}

fn test_now() -> Instant {
    NOW.with(|now| match now.get() {
        Some(now) => now,
        None => {
            let start = Instant::now();
            now.set(Some(start));
            start
        }
    })
}

fn advance(by: Duration) {
    let now = test_now() + by;
    NOW.with(|cell| cell.set(Some(now)));
}

/// A map writer with the real grace on a clock the test moves.
fn with_test_clock() -> MapWriter {
    MapWriter::default().with_grace(GENERATION_GRACE, test_now)
}

fn key(ip: [u8; 4], port: u16) -> FrontendKey {
    FrontendKey {
        addr: IpAddr::from(ip),
        port,
        protocol: Protocol::Tcp,
        scope: Scope::Internal,
    }
}

type Update = (ServicePortName, Vec<(FrontendKey, Frontend)>);

/// Each frontend as the only frontend of its own service port.
fn name_of(key: &FrontendKey) -> ServicePortName {
    ServicePortName {
        service: ObjectKey {
            namespace: "ns".into(),
            name: format!("svc-{}-{}", key.addr, key.port).into(),
        },
        port: "http".into(),
        protocol: Protocol::Tcp,
    }
}

fn snapshot(frontends: &[(FrontendKey, &[u8])]) -> Vec<Update> {
    frontends
        .iter()
        .map(|(key, pods)| {
            let frontend = Frontend {
                service_port: name_of(key),
                backends: pods
                    .iter()
                    .map(|&pod| Backend {
                        addr: IpAddr::from([10, 244, pod, 2]),
                        port: 8080,
                    })
                    .collect(),
                affinity_timeout: None,
                flags: 0,
                source_ranges: Vec::new(),
            };
            (name_of(key), vec![(*key, frontend)])
        })
        .collect()
}

/// The service port of `key` no longer has any frontend.
fn gone(key: FrontendKey) -> Update {
    (name_of(&key), Vec::new())
}

fn pods(maps: &FakeMaps, key: &FrontendKey) -> Vec<u8> {
    maps.backends_of(key)
        .iter()
        .map(|addr| match addr.ip() {
            IpAddr::V4(ip) => ip.octets()[2],
            IpAddr::V6(ip) => ip.octets()[15],
        })
        .collect()
}

#[test]
fn first_apply_writes_frontend_slots_and_backends_in_network_order() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let (summary, errors) = map_writer.apply(snapshot(&[(web, &[1, 2])]), &mut maps);
    assert!(errors.is_empty());
    assert_eq!(summary.frontends_written, 1);
    maps.check_invariants();
    assert_eq!(
        maps.backends_of(&web),
        [
            SocketAddr::from(([10, 244, 1, 2], 8080)),
            SocketAddr::from(([10, 244, 2, 2], 8080))
        ]
    );
    let Some(FrontendMapKey::V4(map_key)) = frontend_map_key(&web) else {
        panic!("ipv4 key expected");
    };
    assert_eq!(map_key.addr.to_ne_bytes(), [10, 96, 0, 10]);
    assert_eq!(map_key.port.to_ne_bytes(), [0, 80]);
}

#[test]
fn a_backend_change_switches_generation_and_cleans_the_old_one() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    map_writer.apply(snapshot(&[(web, &[1, 2, 3])]), &mut maps);
    let before = maps.frontends[&frontend_map_key(&web).expect("supported")];
    map_writer.apply(snapshot(&[(web, &[1, 3])]), &mut maps);
    let after = maps.frontends[&frontend_map_key(&web).expect("supported")];
    maps.check_invariants();
    assert_eq!(after.service_id, before.service_id);
    assert_ne!(after.generation, before.generation);
    assert_eq!(pods(&maps, &web), [1, 3]);
    assert_eq!(maps.backends.len(), 2, "the removed backend is gone");
}

#[test]
fn an_unchanged_snapshot_writes_nothing() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = no_grace();
    let state = snapshot(&[
        (key([10, 96, 0, 10], 80), &[1, 2]),
        (key([10, 96, 0, 11], 80), &[3]),
    ]);
    map_writer.apply(state.clone(), &mut maps);
    let writes = maps.writes;
    let (summary, _) = map_writer.apply(state.clone(), &mut maps);
    assert_eq!(maps.writes, writes);
    assert_eq!(summary.frontends_unchanged, 2);
}

#[test]
fn only_the_changed_frontend_is_rewritten() {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut map_writer = no_grace();
    let many: Vec<(FrontendKey, &[u8])> = (0..100u8)
        .map(|i| (key([10, 96, 1, i], 80), &[1u8, 2][..]))
        .collect();
    map_writer.apply(snapshot(&many), &mut maps);
    let writes = maps.writes;
    let mut changed = many.clone();
    changed[7].1 = &[1, 2, 3];
    let (summary, _) = map_writer.apply(snapshot(&changed), &mut maps);
    maps.check_invariants();
    assert_eq!(summary.frontends_written, 1);
    // 1 new backend + 1 block of 3 slots + 1 frontend + the old generation's block deleted.
    assert_eq!(maps.writes - writes, 4);
}

#[test]
fn removing_a_frontend_removes_everything_it_used() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 443);
    map_writer.apply(snapshot(&[(web, &[1, 2]), (api, &[2, 3])]), &mut maps);
    let (summary, _) = map_writer.apply(vec![gone(web)], &mut maps);
    maps.check_invariants();
    assert_eq!(summary.frontends_removed, 1);
    assert_eq!(maps.frontends.len(), 1);
    assert_eq!(pods(&maps, &api), [2, 3], "the shared backend survives");
    map_writer.apply(vec![gone(api)], &mut maps);
    assert!(maps.frontends.is_empty() && maps.slots.is_empty() && maps.backends.is_empty());
}

#[test]
fn a_frontend_without_backends_is_written_with_count_zero() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    map_writer.apply(snapshot(&[(web, &[])]), &mut maps);
    let value = maps.frontends[&frontend_map_key(&web).expect("supported")];
    assert_eq!(value.backend_count, 0);
    maps.check_invariants();
}

#[test]
fn a_full_map_leaves_the_frontend_on_its_previous_complete_set() {
    // Room for 3 blocks of slots.
    let mut maps = FakeMaps::with_slot_capacity(3);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let nine: Vec<u8> = (1..=9).collect();
    let ten: Vec<u8> = (1..=10).collect();
    map_writer.apply(snapshot(&[(web, &nine)]), &mut maps);
    // The new generation needs 2 blocks while 2 are still live: only 3 fit.
    let (summary, errors) = map_writer.apply(snapshot(&[(web, &ten)]), &mut maps);
    assert_eq!(summary.frontends_written, 0);
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0]
            .to_string()
            .contains("keeps its previous backends"),
        "{}",
        errors[0]
    );
    maps.check_invariants();
    assert_eq!(pods(&maps, &web), nine);
    // A later snapshot that fits is applied normally.
    let (summary, errors) = map_writer.apply(snapshot(&[(web, &[3])]), &mut maps);
    assert!(errors.is_empty());
    assert_eq!(summary.frontends_written, 1);
    maps.check_invariants();
    assert_eq!(pods(&maps, &web), [3]);
}

#[test]
fn a_new_frontend_that_does_not_fit_leaves_nothing_behind() {
    // Room for 2 blocks of slots; web needs 3.
    let mut maps = FakeMaps::with_slot_capacity(2);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let pods17: Vec<u8> = (1..=17).collect();
    let (_, errors) = map_writer.apply(snapshot(&[(web, &pods17)]), &mut maps);
    assert_eq!(errors.len(), 1);
    assert!(maps.frontends.is_empty() && maps.slots.is_empty() && maps.backends.is_empty());
    assert_eq!(map_writer.counts(), (0, 0));
}

fn key6(last: u16, port: u16) -> FrontendKey {
    FrontendKey {
        addr: IpAddr::from([0xfd00, 0x96, 0, 0, 0, 0, 0, last]),
        port,
        protocol: Protocol::Tcp,
        scope: Scope::Internal,
    }
}

/// One IPv6 frontend with backends `fd00:244:<pod>::2`.
fn snapshot6(key: FrontendKey, pod_ids: &[u16]) -> Vec<Update> {
    let frontend = Frontend {
        service_port: name_of(&key),
        backends: pod_ids
            .iter()
            .map(|&pod| Backend {
                addr: IpAddr::from([0xfd00, 0x244, pod, 0, 0, 0, 0, 2]),
                port: 8080,
            })
            .collect(),
        affinity_timeout: None,
        flags: 0,
        source_ranges: Vec::new(),
    };
    vec![(name_of(&key), vec![(key, frontend)])]
}

#[test]
fn ipv6_frontends_are_programmed_in_network_order() {
    let mut maps = FakeMaps::with_slot_capacity(10);
    let mut map_writer = no_grace();
    let web6 = key6(0x10, 80);
    let (summary, errors) = map_writer.apply(snapshot6(web6, &[1, 2]), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_written, 1);
    maps.check_invariants();
    let Some(FrontendMapKey::V6(map_key)) = frontend_map_key(&web6) else {
        panic!("ipv6 key expected");
    };
    let bytes: Vec<u8> = map_key.addr.iter().flat_map(|w| w.to_ne_bytes()).collect();
    assert_eq!(bytes[..4], [0xfd, 0x00, 0x00, 0x96]);
    assert_eq!(bytes[15], 0x10);
    assert_eq!(
        maps.backends_of(&web6),
        [
            "[fd00:244:1::2]:8080".parse::<SocketAddr>().expect("addr"),
            "[fd00:244:2::2]:8080".parse::<SocketAddr>().expect("addr"),
        ]
    );
    map_writer.apply(snapshot6(web6, &[2]), &mut maps);
    maps.check_invariants();
    assert_eq!(maps.backends.len(), 1);
}

/// `snapshot` with session affinity on every frontend.
fn with_affinity(mut updates: Vec<Update>, timeout: Option<u32>) -> Vec<Update> {
    for (_, frontends) in &mut updates {
        for (_, frontend) in frontends {
            frontend.affinity_timeout = timeout;
        }
    }
    updates
}

#[test]
fn affinity_flag_timeout_and_match_entries_follow_the_service() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let map_key = frontend_map_key(&web).expect("supported");
    map_writer.apply(snapshot(&[(web, &[1, 2, 3])]), &mut maps);
    assert!(maps.matches.is_empty());

    // On: flag, timeout and one match entry per live backend.
    let (summary, _) = map_writer.apply(
        with_affinity(snapshot(&[(web, &[1, 2, 3])]), Some(2)),
        &mut maps,
    );
    assert_eq!(summary.frontends_written, 1, "switching affinity rewrites");
    maps.check_invariants();
    let value = maps.frontends[&map_key];
    assert_eq!(
        value.flags & frontend_flags::AFFINITY,
        frontend_flags::AFFINITY
    );
    assert_eq!(value.affinity_timeout, 2);
    assert_eq!(maps.matches.len(), 3);

    // A removed backend loses its match entry (affinity can no longer lead to it).
    map_writer.apply(
        with_affinity(snapshot(&[(web, &[1, 3])]), Some(2)),
        &mut maps,
    );
    maps.check_invariants();
    assert_eq!(maps.matches.len(), 2);

    // A new timeout alone is a change too.
    let (summary, _) = map_writer.apply(
        with_affinity(snapshot(&[(web, &[1, 3])]), Some(30)),
        &mut maps,
    );
    assert_eq!(summary.frontends_written, 1);
    assert_eq!(maps.frontends[&map_key].affinity_timeout, 30);

    // Off: flag cleared, match entries gone.
    map_writer.apply(snapshot(&[(web, &[1, 3])]), &mut maps);
    maps.check_invariants();
    assert_eq!(maps.frontends[&map_key].flags, 0);
    assert!(maps.matches.is_empty());
}

#[test]
fn removed_backends_are_reported_per_frontend() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    map_writer.apply(snapshot(&[(web, &[1, 2]), (api, &[2])]), &mut maps);
    let (summary, _) = map_writer.apply(snapshot(&[(web, &[1])]), &mut maps);
    assert_eq!(
        summary.removed_backends,
        [RemovedBackend {
            frontend: web,
            backend: SocketAddr::from(([10, 244, 2, 2], 8080)),
        }]
    );
    let (summary, _) = map_writer.apply(vec![gone(api)], &mut maps);
    assert_eq!(summary.removed_backends.len(), 1);
    assert_eq!(summary.removed_backends[0].frontend, api);
}

#[test]
fn adopting_pinned_maps_then_a_full_apply_of_the_same_state_writes_nothing() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut first = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    let web6 = key6(0x10, 80);
    let mut state = with_affinity(snapshot(&[(web, &[1, 2])]), Some(5));
    state.extend(snapshot(&[(api, &[2, 3])]));
    state.extend(snapshot6(web6, &[1]));
    first.apply(state.clone(), &mut maps);
    let writes = maps.writes;

    let mut adopted =
        MapWriter::adopt(maps.content(), &mut maps).with_grace(Duration::ZERO, Instant::now);
    assert_eq!(maps.writes, writes, "consistent maps need no cleanup");
    assert_eq!(adopted.counts(), first.counts());
    let (summary, errors) = adopted.apply(state, &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_unchanged, 3);
    assert_eq!(
        maps.writes, writes,
        "claiming unchanged frontends writes nothing"
    );
    maps.check_invariants();

    // New ids do not collide with adopted ones.
    let other = key([10, 96, 0, 12], 80);
    adopted.apply(snapshot(&[(other, &[4])]), &mut maps);
    maps.check_invariants();
    assert_eq!(pods(&maps, &other), [4]);
    assert_eq!(pods(&maps, &api), [2, 3]);
}

#[test]
fn a_full_apply_after_adoption_removes_frontends_nobody_claims() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    no_grace().apply(snapshot(&[(web, &[1]), (api, &[2])]), &mut maps);

    let mut adopted =
        MapWriter::adopt(maps.content(), &mut maps).with_grace(Duration::ZERO, Instant::now);
    // Only `web` is still a Service; a full resync goes through apply_snapshot(None).
    adopted.apply(snapshot(&[(web, &[1])]), &mut maps);
    let (mut summary, mut errors) = (ApplySummary::default(), Vec::new());
    adopted.remove_unclaimed(&mut maps, &mut summary, &mut errors);
    assert!(errors.is_empty());
    assert_eq!(summary.frontends_removed, 1);
    maps.check_invariants();
    assert_eq!(pods(&maps, &web), [1]);
    assert!(pods(&maps, &api).is_empty());
}

#[test]
fn adoption_cleans_what_an_interrupted_update_left_behind() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let web = key([10, 96, 0, 10], 80);
    no_grace().apply(snapshot(&[(web, &[1, 2])]), &mut maps);
    // A crash after writing the idle generation, before the switch.
    let value = maps.frontends[&frontend_map_key(&web).expect("supported")];
    maps.backends.insert(
        99,
        BackendValue::V4(Backend4 {
            addr: 1,
            port: 2,
            proto: 6,
            flags: 0,
        }),
    );
    let mut block = SlotBlock::default();
    block.backend_ids[0] = 99;
    maps.slots.insert(
        BackendSlotKey {
            service_id: value.service_id,
            block: 0,
            generation: value.generation ^ 1,
            _pad: 0,
        },
        block,
    );
    maps.matches.insert(AffinityMatchKey {
        service_id: value.service_id,
        backend_id: 99,
    });
    let adopted =
        MapWriter::adopt(maps.content(), &mut maps).with_grace(Duration::ZERO, Instant::now);
    maps.check_invariants();
    assert_eq!(adopted.counts(), (1, 2));
    assert_eq!(pods(&maps, &web), [1, 2]);
}

/// The block and index of the slot `slot` of `key`'s live generation.
fn live_slot(maps: &FakeMaps, key: &FrontendKey, slot: u16) -> (BackendSlotKey, usize) {
    let value = maps.frontends[&frontend_map_key(key).expect("supported")];
    let (key, index, _) = proxy_common::select::slot_entry(&value, slot.into());
    (key, index)
}

/// Sets one slot's backend id in the maps (0: the slot holds none).
fn set_slot(maps: &mut FakeMaps, (key, index): (BackendSlotKey, usize), id: u32) {
    if let Some(block) = maps.slots.get_mut(&key) {
        block.backend_ids[index] = id;
    }
}

#[test]
fn adoption_rewrites_frontends_with_a_missing_slot_or_a_backend_under_a_second_id() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    let db = key([10, 96, 0, 12], 80);
    let state = snapshot(&[(web, &[1, 2]), (api, &[2, 3]), (db, &[4, 5])]);
    no_grace().apply(state.clone(), &mut maps);
    // api's first slot names pod 2 under a second id; db's second slot is gone.
    let api_first = live_slot(&maps, &api, 0);
    let pod2 = maps.backends[&maps.slots[&api_first.0].backend_ids[api_first.1]];
    maps.backends.insert(99, pod2);
    set_slot(&mut maps, api_first, 99);
    let db_second = live_slot(&maps, &db, 1);
    set_slot(&mut maps, db_second, 0);

    let mut adopted =
        MapWriter::adopt(maps.content(), &mut maps).with_grace(Duration::ZERO, Instant::now);
    assert!(
        !maps.backends.contains_key(&99),
        "the second id is removed with the orphans"
    );
    assert_eq!(
        adopted.counts(),
        (3, 4),
        "pods 1 to 4: pod 5's only slot is gone"
    );
    assert!(adopted.expected_content().is_none(), "damaged frontends");
    let (summary, errors) = adopted.apply(state, &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        (summary.frontends_unchanged, summary.frontends_written),
        (1, 2)
    );
    maps.check_invariants();
    assert_eq!(pods(&maps, &api), [2, 3]);
    assert_eq!(pods(&maps, &db), [4, 5]);
    assert!(adopted.expected_content().is_some());
    // Every reference the damaged generations held was released: nothing is left.
    adopted.apply([gone(web), gone(api), gone(db)], &mut maps);
    maps.check_invariants();
    assert!(maps.frontends.is_empty() && maps.slots.is_empty() && maps.backends.is_empty());
    assert_eq!(adopted.counts(), (0, 0));
}

#[test]
fn a_frontend_claimed_by_two_service_ports_stays_with_the_first() {
    let mut maps = FakeMaps::with_slot_capacity(10);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    map_writer.apply(snapshot(&[(web, &[1])]), &mut maps);
    let mut intruder = snapshot(&[(web, &[2])]);
    intruder[0].0.service.name = "intruder".into();
    let (summary, errors) = map_writer.apply(intruder, &mut maps);
    assert_eq!(summary.frontends_written, 0);
    assert!(
        errors[0]
            .to_string()
            .contains("already used by ns/svc-10.96.0.10-80:http"),
        "{}",
        errors[0]
    );
    assert_eq!(pods(&maps, &web), [1]);
}

#[test]
fn a_frontend_that_does_not_fit_is_tracked_not_programmed_and_fits_once_space_is_freed() {
    // Room for 3 blocks of slots; web and api need 2 each.
    let mut maps = FakeMaps::with_slot_capacity(3);
    let mut map_writer = no_grace();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    let web_pods: Vec<u8> = (1..=9).collect();
    let api_pods: Vec<u8> = (10..=18).collect();
    let (summary, errors) =
        map_writer.apply(snapshot(&[(web, &web_pods), (api, &api_pods)]), &mut maps);
    assert_eq!(summary.frontends_written, 1);
    assert_eq!(errors.len(), 1);
    assert!(errors[0].is_capacity(), "{}", errors[0]);
    maps.check_invariants();
    // Never half-programmed: no frontend entry, no slot, no backend of api.
    assert!(
        !maps
            .frontends
            .contains_key(&frontend_map_key(&api).expect("key"))
    );
    assert_eq!(pods(&maps, &web), web_pods);
    assert_eq!(maps.slots.len(), 2);
    assert_eq!(
        map_writer.unfit().keys().copied().collect::<Vec<_>>(),
        [api]
    );
    // web goes: api fits now and is no longer reported.
    let (summary, errors) = map_writer.apply([gone(web)], &mut maps);
    assert!(errors.is_empty());
    assert_eq!(summary.frontends_removed, 1);
    let (_, errors) = map_writer.apply(snapshot(&[(api, &api_pods)]), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    maps.check_invariants();
    assert_eq!(pods(&maps, &api), api_pods);
    assert!(map_writer.unfit().is_empty());
}

fn external(key: FrontendKey) -> FrontendKey {
    FrontendKey {
        scope: Scope::External,
        ..key
    }
}

/// The backend pod of each slot of a frontend's live Maglev table.
fn maglev_pods(maps: &FakeMaps, key: &FrontendKey) -> Vec<u8> {
    let map_key = frontend_map_key(key).expect("supported");
    let value = maps.frontends[&map_key];
    (0..value.maglev_size)
        .map(|slot| {
            let id = maps.maglev[&MaglevKey {
                service_id: value.service_id,
                block: slot / MAGLEV_BLOCK_SLOTS,
                generation: value.generation,
                _pad: [0; 3],
            }]
                .backend_ids[(slot % MAGLEV_BLOCK_SLOTS) as usize];
            match maps.backends[&id].socket_addr().ip() {
                IpAddr::V4(ip) => ip.octets()[2],
                IpAddr::V6(ip) => ip.octets()[15],
            }
        })
        .collect()
}

#[test]
fn maglev_tables_follow_external_frontends_through_generations() {
    const M: u32 = 13;
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut map_writer = no_grace();
    map_writer.set_maglev_table_size(Some(M));
    let internal = key([10, 96, 0, 10], 80);
    let nodeport = external(key([0, 0, 0, 0], 30080));
    let (_, errors) = map_writer.apply(
        snapshot(&[(internal, &[1, 2, 3]), (nodeport, &[1, 2, 3])]),
        &mut maps,
    );
    assert!(errors.is_empty(), "{errors:?}");
    maps.check_invariants();
    let value = |maps: &FakeMaps, key| maps.frontends[&frontend_map_key(&key).expect("key")];
    assert_eq!(value(&maps, internal).flags & frontend_flags::MAGLEV, 0);
    assert_eq!(value(&maps, internal).maglev_size, 0);
    assert_ne!(value(&maps, nodeport).flags & frontend_flags::MAGLEV, 0);
    assert_eq!(
        maps.maglev.len(),
        1,
        "one table (one block of 16 slots), for the external frontend"
    );
    let before = maglev_pods(&maps, &nodeport);
    for pod in [1, 2, 3] {
        let n = before.iter().filter(|&&p| p == pod).count();
        assert!(
            (4..=5).contains(&n),
            "pod {pod}: {n} of {M} slots: {before:?}"
        );
    }

    // Pod 2 leaves: new generation, complete; the old table is gone (check_invariants), and
    // slots that were not pod 2's mostly stay.
    let (summary, _) = map_writer.apply(snapshot(&[(nodeport, &[1, 3])]), &mut maps);
    assert_eq!(summary.frontends_written, 1);
    maps.check_invariants();
    let after = maglev_pods(&maps, &nodeport);
    assert!(after.iter().all(|p| [1, 3].contains(p)), "{after:?}");
    let kept = before
        .iter()
        .zip(&after)
        .filter(|(b, a)| **b != 2 && b == a)
        .count();
    let others = before.iter().filter(|&&p| p != 2).count();
    assert!(
        kept * 10 >= others * 7,
        "kept {kept} of {others}: {before:?} → {after:?}"
    );

    // The same set again writes nothing; a restart with the same setting adopts the tables.
    let writes = maps.writes;
    map_writer.apply(snapshot(&[(nodeport, &[1, 3])]), &mut maps);
    assert_eq!(maps.writes, writes);
    let mut adopted =
        MapWriter::adopt(maps.content(), &mut maps).with_grace(Duration::ZERO, Instant::now);
    adopted.set_maglev_table_size(Some(M));
    let state = snapshot(&[(internal, &[1, 2, 3]), (nodeport, &[1, 3])]);
    let (summary, _) = adopted.apply(state.clone(), &mut maps);
    assert_eq!(summary.frontends_unchanged, 2);
    assert_eq!(
        maps.writes, writes,
        "adopted tables are claimed without writes"
    );

    // Back to random: the external frontend is rewritten without a table.
    adopted.set_maglev_table_size(None);
    let (summary, _) = adopted.apply(state, &mut maps);
    assert_eq!(summary.frontends_written, 1);
    maps.check_invariants();
    assert!(maps.maglev.is_empty());
    assert_eq!(value(&maps, nodeport).flags & frontend_flags::MAGLEV, 0);
}

#[test]
fn adoption_rewrites_a_frontend_whose_maglev_table_is_incomplete() {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut first = no_grace();
    first.set_maglev_table_size(Some(7));
    let nodeport = external(key([0, 0, 0, 0], 30080));
    first.apply(snapshot(&[(nodeport, &[1, 2])]), &mut maps);
    let Some(&lost) = maps.maglev.keys().next() else {
        panic!("no Maglev table written");
    };
    maps.maglev.remove(&lost);

    let slots = maps.slots.clone();
    let mut adopted =
        MapWriter::adopt(maps.content(), &mut maps).with_grace(Duration::ZERO, Instant::now);
    adopted.set_maglev_table_size(Some(7));
    assert!(maps.maglev.is_empty(), "an incomplete table is deleted");
    assert_eq!(
        maps.slots, slots,
        "the slots stay for random choice meanwhile"
    );
    let (summary, errors) = adopted.apply(snapshot(&[(nodeport, &[1, 2])]), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_written, 1);
    maps.check_invariants();
    assert_eq!(maps.maglev.len(), 1, "7 slots: one block");
}

#[test]
fn a_maglev_table_that_does_not_fit_leaves_the_previous_one() {
    let mut maps = FakeMaps::with_slot_capacity(20);
    let mut map_writer = no_grace();
    // 167 slots: 11 blocks, so two tables do not fit in 20 entries.
    map_writer.set_maglev_table_size(Some(167));
    let nodeport = external(key([0, 0, 0, 0], 30080));
    let (_, errors) = map_writer.apply(snapshot(&[(nodeport, &[1, 2])]), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    // A second table does not fit next to the first during the switch.
    let (_, errors) = map_writer.apply(snapshot(&[(nodeport, &[1, 3])]), &mut maps);
    assert!(errors.iter().all(ApplyError::is_capacity), "{errors:?}");
    assert_eq!(errors.len(), 1);
    maps.check_invariants();
    assert_eq!(pods(&maps, &nodeport), [1, 2]);
    assert!(
        maglev_pods(&maps, &nodeport)
            .iter()
            .all(|p| [1, 2].contains(p))
    );
}

// The drift check against the same in-memory maps (it needs `FakeMaps` and the helpers above).
#[path = "tests/drift.rs"]
mod drift;

/// What a program that read `value` (a frontend value, possibly no longer the live one) finds:
/// each slot's backend, or `None` where a slot or its backend is missing.
fn reader_finds(maps: &FakeMaps, value: &FrontendValue) -> Vec<Option<SocketAddr>> {
    (0..value.backend_count)
        .map(|slot| {
            let id = maps.slot_id(value, slot)?;
            maps.backends.get(&id).map(BackendValue::socket_addr)
        })
        .collect()
}

fn pod_addr(pod: u8) -> Option<SocketAddr> {
    Some(SocketAddr::from(([10, 244, pod, 2], 8080)))
}

#[test]
fn a_switched_out_generation_stays_for_the_grace_then_goes() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = with_test_clock();
    let web = key([10, 96, 0, 10], 80);
    map_writer.apply(snapshot(&[(web, &[1, 2])]), &mut maps);
    let before = maps.frontends[&frontend_map_key(&web).expect("supported")];
    let (summary, errors) = map_writer.apply(snapshot(&[(web, &[1, 3])]), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_written, 1);
    assert_eq!(pods(&maps, &web), [1, 3]);
    // A program that read the frontend before the switch still finds every slot and backend,
    // including pod 2, which left the service.
    assert_eq!(reader_finds(&maps, &before), [pod_addr(1), pod_addr(2)]);
    let due = map_writer.next_retirement().expect("a retired generation");
    assert_eq!(due, test_now() + GENERATION_GRACE);
    advance(GENERATION_GRACE - Duration::from_millis(1));
    assert_eq!(map_writer.retire_expired(&mut maps).deleted, 0);
    assert_eq!(reader_finds(&maps, &before), [pod_addr(1), pod_addr(2)]);
    advance(Duration::from_millis(1));
    let retirement = map_writer.retire_expired(&mut maps);
    assert_eq!(
        retirement,
        Retirement {
            deleted: 1,
            sync_needed: false
        }
    );
    assert_eq!(map_writer.next_retirement(), None);
    maps.check_invariants();
    assert_eq!(pods(&maps, &web), [1, 3]);
}

#[test]
fn a_second_switch_within_the_grace_is_deferred_until_the_old_generation_is_gone() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = with_test_clock();
    let web = key([10, 96, 0, 10], 80);
    map_writer.apply(snapshot(&[(web, &[1, 2])]), &mut maps);
    let first = maps.frontends[&frontend_map_key(&web).expect("supported")];
    map_writer.apply(snapshot(&[(web, &[1, 3])]), &mut maps);
    advance(GENERATION_GRACE / 2);
    // The next switch would write over the generation `first` points at: not yet.
    let (summary, errors) = map_writer.apply(snapshot(&[(web, &[4])]), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(
        (summary.frontends_written, summary.frontends_deferred),
        (0, 1)
    );
    assert_eq!(pods(&maps, &web), [1, 3], "keeps its current set meanwhile");
    assert_eq!(reader_finds(&maps, &first), [pod_addr(1), pod_addr(2)]);
    // The grace ends: the deletion asks for a sync, which switches.
    advance(GENERATION_GRACE / 2);
    assert!(map_writer.retire_expired(&mut maps).sync_needed);
    let (summary, _) = map_writer.apply(snapshot(&[(web, &[4])]), &mut maps);
    assert_eq!(
        (summary.frontends_written, summary.frontends_deferred),
        (1, 0)
    );
    assert_eq!(pods(&maps, &web), [4]);
    advance(GENERATION_GRACE);
    map_writer.retire_expired(&mut maps);
    maps.check_invariants();
}

#[test]
fn a_deferred_frontend_changed_back_is_no_longer_deferred() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = with_test_clock();
    let web = key([10, 96, 0, 10], 80);
    map_writer.apply(snapshot(&[(web, &[1])]), &mut maps);
    map_writer.apply(snapshot(&[(web, &[2])]), &mut maps);
    let (summary, _) = map_writer.apply(snapshot(&[(web, &[3])]), &mut maps);
    assert_eq!(summary.frontends_deferred, 1);
    let (summary, _) = map_writer.apply(snapshot(&[(web, &[2])]), &mut maps);
    assert_eq!(
        (summary.frontends_unchanged, summary.frontends_deferred),
        (1, 0)
    );
    advance(GENERATION_GRACE);
    assert!(
        !map_writer.retire_expired(&mut maps).sync_needed,
        "nothing is waiting"
    );
    maps.check_invariants();
}

#[test]
fn a_removed_frontend_keeps_its_slots_and_service_id_for_the_grace() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = with_test_clock();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    map_writer.apply(snapshot(&[(web, &[1, 2])]), &mut maps);
    let removed = maps.frontends[&frontend_map_key(&web).expect("supported")];
    let (summary, _) = map_writer.apply([gone(web)], &mut maps);
    assert_eq!(summary.frontends_removed, 1);
    assert!(maps.frontends.is_empty(), "unlinked at once");
    assert_eq!(reader_finds(&maps, &removed), [pod_addr(1), pod_addr(2)]);
    // A frontend created meanwhile must not take the service id whose slots are still there.
    map_writer.apply(snapshot(&[(api, &[3])]), &mut maps);
    let api_value = maps.frontends[&frontend_map_key(&api).expect("supported")];
    assert_ne!(api_value.service_id, removed.service_id);
    assert_eq!(reader_finds(&maps, &removed), [pod_addr(1), pod_addr(2)]);
    advance(GENERATION_GRACE);
    assert_eq!(map_writer.retire_expired(&mut maps).deleted, 1);
    maps.check_invariants();
    assert_eq!(pods(&maps, &api), [3]);
    // Now the id is free again.
    map_writer.apply(snapshot(&[(web, &[1])]), &mut maps);
    let web_value = maps.frontends[&frontend_map_key(&web).expect("supported")];
    assert_eq!(web_value.service_id, removed.service_id);
    maps.check_invariants();
}

#[test]
fn a_frontend_removed_during_its_grace_keeps_both_generations_until_each_is_due() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut map_writer = with_test_clock();
    let web = key([10, 96, 0, 10], 80);
    map_writer.apply(snapshot(&[(web, &[1])]), &mut maps);
    let first = maps.frontends[&frontend_map_key(&web).expect("supported")];
    map_writer.apply(snapshot(&[(web, &[2])]), &mut maps);
    let second = maps.frontends[&frontend_map_key(&web).expect("supported")];
    advance(GENERATION_GRACE / 2);
    map_writer.apply([gone(web)], &mut maps);
    assert_eq!(reader_finds(&maps, &first), [pod_addr(1)]);
    assert_eq!(reader_finds(&maps, &second), [pod_addr(2)]);
    advance(GENERATION_GRACE / 2);
    assert_eq!(map_writer.retire_expired(&mut maps).deleted, 1);
    assert_eq!(reader_finds(&maps, &first), [None]);
    assert_eq!(reader_finds(&maps, &second), [pod_addr(2)]);
    advance(GENERATION_GRACE / 2);
    assert_eq!(map_writer.retire_expired(&mut maps).deleted, 1);
    assert!(maps.slots.is_empty() && maps.backends.is_empty());
    // The service id was released with the last generation.
    map_writer.apply(snapshot(&[(web, &[3])]), &mut maps);
    assert_eq!(
        maps.frontends[&frontend_map_key(&web).expect("supported")].service_id,
        first.service_id
    );
}

#[test]
fn retirement_frees_room_for_a_frontend_that_did_not_fit() {
    // Two slots: web's two generations during an update, nothing more.
    let mut maps = FakeMaps::with_slot_capacity(2);
    let mut map_writer = with_test_clock();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    map_writer.apply(snapshot(&[(web, &[1])]), &mut maps);
    map_writer.apply(snapshot(&[(web, &[2])]), &mut maps);
    let (_, errors) = map_writer.apply(snapshot(&[(api, &[3])]), &mut maps);
    assert!(errors.iter().all(ApplyError::is_capacity) && errors.len() == 1);
    advance(GENERATION_GRACE);
    assert!(map_writer.retire_expired(&mut maps).sync_needed);
    let (_, errors) = map_writer.apply(snapshot(&[(api, &[3])]), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    maps.check_invariants();
    assert_eq!(pods(&maps, &api), [3]);
}

#[test]
fn adoption_deletes_the_retired_generations_of_the_previous_run() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut first = with_test_clock();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    first.apply(snapshot(&[(web, &[1, 2]), (api, &[3])]), &mut maps);
    first.apply(snapshot(&[(web, &[2, 4])]), &mut maps);
    first.apply([gone(api)], &mut maps);
    assert!(first.next_retirement().is_some());
    // Restarted within the grace: nothing remembers it, so the adoption deletes what no
    // frontend reaches and the record it builds has nothing to drift from.
    let adopted = MapWriter::adopt(maps.content(), &mut maps);
    maps.check_invariants();
    assert_eq!(adopted.next_retirement(), None);
    assert_eq!(pods(&maps, &web), [2, 4]);
    let expected = adopted.expected_content().expect("nothing damaged");
    assert_eq!(crate::drift::diff(&expected, &maps.content()), []);
}

#[test]
fn an_apply_recomputes_what_did_not_fit_for_its_service_ports_only() {
    // Room for one frontend's slot: web fits, api and db do not.
    let mut maps = FakeMaps::with_slot_capacity(1);
    let mut map_writer = with_test_clock();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 80);
    let db = key([10, 96, 0, 12], 80);
    let (_, errors) =
        map_writer.apply(snapshot(&[(web, &[1]), (api, &[2]), (db, &[3])]), &mut maps);
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert_eq!(
        map_writer.unfit().keys().copied().collect::<Vec<_>>(),
        [api, db]
    );
    // api goes away: its entry goes, db's stays (another service port's apply).
    let (_, errors) = map_writer.apply([gone(api)], &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(map_writer.unfit().keys().copied().collect::<Vec<_>>(), [db]);
    // web and db in one apply: web is unchanged, db still does not fit and is listed once.
    let (_, errors) = map_writer.apply(snapshot(&[(web, &[1]), (db, &[3])]), &mut maps);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(map_writer.unfit().keys().copied().collect::<Vec<_>>(), [db]);
    maps.check_invariants();
}

/// One service port of `namespace/name` with frontends on `ports` of `ip`, one backend each.
fn many_ports(namespace: &str, name: &str, ip: [u8; 4], ports: std::ops::Range<u16>) -> Update {
    let service_port = ServicePortName {
        service: ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        },
        port: "http".into(),
        protocol: Protocol::Tcp,
    };
    let frontends = ports
        .map(|port| {
            let frontend = Frontend {
                service_port: service_port.clone(),
                backends: vec![Backend {
                    addr: IpAddr::from([10, 244, 1, 2]),
                    port: 8080,
                }],
                affinity_timeout: None,
                flags: 0,
                source_ranges: Vec::new(),
            };
            (key(ip, port), frontend)
        })
        .collect();
    (service_port, frontends)
}

/// Every shared map of `capacity` entries, at most `per_service` frontends per Service.
fn set_shares(map_writer: &mut MapWriter, capacity: u64, per_service: u32) {
    map_writer.set_shares(shares::Entries::splat(capacity), per_service);
}

fn share_errors(errors: &[ApplyError]) -> Vec<shares::ShareLimit> {
    errors
        .iter()
        .filter_map(|error| match error {
            ApplyError::Frontend {
                reason: MapWriteError::Share(limit),
                ..
            } => Some(*limit),
            _ => None,
        })
        .collect()
}

/// One namespace floods a 512-entry frontend map: it gets at most all but the reserve (an
/// eighth), and another namespace's new Service still fits afterwards; what did not fit is
/// reported as the namespace's share, counted as capacity (never a node fault), and retried
/// when the flood goes away.
#[test]
fn a_namespace_cannot_take_the_reserve_that_other_namespaces_need() {
    let mut maps = FakeMaps::with_slot_capacity(10_000);
    let mut map_writer = no_grace();
    set_shares(&mut map_writer, 512, 4096);
    let (summary, errors) = map_writer.apply(
        [many_ports("greedy", "big", [10, 96, 0, 1], 1..601)],
        &mut maps,
    );
    assert_eq!(summary.frontends_written, 448, "512 less the reserve of 64");
    assert_eq!(share_errors(&errors).len(), 600 - 448);
    assert!(errors.iter().all(ApplyError::is_capacity));
    assert!(
        share_errors(&errors)
            .iter()
            .all(|l| l.holder == shares::Holder::Namespace)
    );
    // A second greedy Service of the same namespace gets nothing more.
    let (summary, errors) = map_writer.apply(
        [many_ports("greedy", "bigger", [10, 96, 0, 2], 1..10)],
        &mut maps,
    );
    assert_eq!((summary.frontends_written, errors.len()), (0, 9));
    // Another namespace's Service is programmed.
    let victim = many_ports("victim", "web", [10, 96, 0, 3], 80..81);
    let victim_key = victim.1[0].0;
    let (summary, errors) = map_writer.apply([victim], &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_written, 1);
    assert_eq!(pods(&maps, &victim_key), [1]);
    maps.check_invariants();
}

/// In the reserve a namespace takes entries only while it holds few; and one Service never
/// takes more than its cap, whatever room the map has.
#[test]
fn the_reserve_goes_to_small_namespaces_and_a_service_has_a_cap() {
    let mut maps = FakeMaps::with_slot_capacity(10_000);
    let mut map_writer = no_grace();
    // Reserve 64, a small namespace holds fewer than 8.
    set_shares(&mut map_writer, 512, 4096);
    map_writer.apply([many_ports("a", "big", [10, 96, 0, 1], 1..449)], &mut maps);
    let (summary, errors) = map_writer.apply(
        [many_ports("b", "medium", [10, 96, 0, 2], 1..21)],
        &mut maps,
    );
    assert_eq!(summary.frontends_written, 8);
    assert_eq!(share_errors(&errors).len(), 12);

    let mut maps = FakeMaps::with_slot_capacity(10_000);
    let mut map_writer = no_grace();
    set_shares(&mut map_writer, 65_536, 100);
    let (summary, errors) =
        map_writer.apply([many_ports("a", "many", [10, 96, 0, 1], 1..151)], &mut maps);
    assert_eq!(summary.frontends_written, 100);
    assert_eq!(
        share_errors(&errors),
        vec![
            shares::ShareLimit {
                map: shares::SharedMap::Frontends,
                holder: shares::Holder::Service
            };
            50
        ],
        "the Service's cap, not the namespace's"
    );
    // Fewer ports later: what it keeps stays, and it is under its cap again.
    let (summary, errors) =
        map_writer.apply([many_ports("a", "many", [10, 96, 0, 1], 1..91)], &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_removed, 10);
    maps.check_invariants();
}

/// One service port of `namespace/name` with frontends on `ports` of `ip` in `scope`, each with
/// the backends `10.250.<ip's last byte>.1..=endpoints`.
fn flood(
    namespace: &str,
    name: &str,
    ip: [u8; 4],
    ports: std::ops::Range<u16>,
    scope: Scope,
    endpoints: u8,
) -> Update {
    let (service_port, mut frontends) = many_ports(namespace, name, ip, ports);
    for (key, frontend) in &mut frontends {
        key.scope = scope;
        frontend.backends = (1..=endpoints)
            .map(|i| Backend {
                addr: IpAddr::from([10, 250, ip[3], i]),
                port: 8080,
            })
            .collect();
    }
    (service_port, frontends)
}

/// The shared maps at `capacity` entries but `map`, which has `small` (a reserve of an eighth).
fn shares_with_small(map: shares::SharedMap, small: u64) -> shares::Entries {
    shares::Entries::splat(65_536).with(map, small)
}

/// An EndpointSlice flood: one namespace's Services of 16 endpoints each take the slot map
/// but its reserve; another namespace's new Service still gets its slots, a small share of
/// the reserve; a Service of the flooding namespace that changes cannot take the reserve for
/// its new generation either and keeps its previous, complete set.
#[test]
fn an_endpoint_flood_cannot_take_the_slots_that_other_namespaces_need() {
    use shares::{Holder, ShareLimit, SharedMap};
    let mut maps = FakeMaps::with_slot_capacity(10_000);
    let mut map_writer = no_grace();
    // 512 slots: a reserve of 64, a small namespace holds at most 8.
    map_writer.set_shares(shares_with_small(SharedMap::Slots, 512), 4096);
    let greedy: Vec<Update> = (0..40)
        .map(|i| {
            flood(
                "greedy",
                &format!("flood-{i:02}"),
                [10, 96, 1, i],
                80..81,
                Scope::Internal,
                16,
            )
        })
        .collect();
    let greedy_keys: Vec<FrontendKey> = greedy.iter().map(|(_, f)| f[0].0).collect();
    let (summary, errors) = map_writer.apply(greedy.clone(), &mut maps);
    assert_eq!(
        summary.frontends_written, 28,
        "448 slots: 512 less the reserve"
    );
    assert_eq!(
        share_errors(&errors),
        vec![
            ShareLimit {
                map: SharedMap::Slots,
                holder: Holder::Namespace
            };
            12
        ]
    );
    assert!(errors.iter().all(ApplyError::is_capacity));
    assert_eq!(map_writer.unfit().len(), 12);
    maps.check_invariants();

    // The victim's Service gets 3 slots of the reserve, a second one of 6 more does not.
    let victim = flood("victim", "web", [10, 96, 2, 1], 80..81, Scope::Internal, 3);
    let victim_key = victim.1[0].0;
    let (summary, errors) = map_writer.apply([victim], &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_written, 1);
    assert_eq!(maps.backends_of(&victim_key).len(), 3);
    let (summary, errors) = map_writer.apply(
        [flood(
            "victim",
            "db",
            [10, 96, 2, 2],
            80..81,
            Scope::Internal,
            6,
        )],
        &mut maps,
    );
    assert_eq!(summary.frontends_written, 0);
    assert_eq!(share_errors(&errors).len(), 1);

    // A programmed greedy Service whose endpoints change would need 16 slots more while the
    // old generation lasts: into the reserve, refused; it keeps serving its previous set.
    let (name, mut frontends) = greedy[0].clone();
    for backend in &mut frontends[0].1.backends {
        backend.port = 9090;
    }
    let before = maps.backends_of(&greedy_keys[0]);
    let (summary, errors) = map_writer.apply([(name.clone(), frontends)], &mut maps);
    assert_eq!(summary.frontends_written, 0);
    assert_eq!(share_errors(&errors).len(), 1);
    assert_eq!(maps.backends_of(&greedy_keys[0]), before);
    assert_eq!(map_writer.service_ids_of(&name).len(), 1, "still owned");
    assert!(map_writer.unfit().contains_key(&greedy_keys[0]));
    maps.check_invariants();

    // The flood goes: what did not fit fits now, and the victim kept its own all along.
    let (summary, errors) = map_writer.apply(
        greedy[..28]
            .iter()
            .map(|(name, _)| (name.clone(), Vec::new())),
        &mut maps,
    );
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_removed, 28);
    let (summary, errors) = map_writer.apply(greedy[28..].to_vec(), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_written, 12);
    assert_eq!(maps.backends_of(&victim_key).len(), 3);
    maps.check_invariants();
}

/// With Maglev, a namespace whose Services fill the Maglev map with their tables leaves the
/// reserve, and a reserve of at least one table, to the others.
#[test]
fn maglev_tables_of_one_namespace_leave_room_for_the_others() {
    use shares::{Holder, ShareLimit, SharedMap};
    let mut maps = FakeMaps::with_slot_capacity(10_000);
    let mut map_writer = no_grace();
    // 1021 slots: tables of 64 blocks; 1024 blocks: a reserve of 128, 896 for one namespace.
    map_writer.set_maglev_table_size(Some(1021));
    map_writer.set_shares(shares_with_small(SharedMap::Maglev, 1024), 4096);
    let (summary, errors) = map_writer.apply(
        [flood(
            "greedy",
            "lb",
            [10, 96, 1, 1],
            1..21,
            Scope::External,
            2,
        )],
        &mut maps,
    );
    assert_eq!(summary.frontends_written, 14, "896 blocks of tables");
    assert_eq!(
        share_errors(&errors),
        vec![
            ShareLimit {
                map: SharedMap::Maglev,
                holder: Holder::Namespace
            };
            6
        ]
    );
    assert_eq!(maps.maglev.len(), 14 * 64);
    // Another namespace's external frontend gets its table from the reserve; its second one
    // would take more than a small namespace's part of it.
    let (summary, errors) = map_writer.apply(
        [flood(
            "victim",
            "web",
            [10, 96, 2, 1],
            80..82,
            Scope::External,
            1,
        )],
        &mut maps,
    );
    assert_eq!(summary.frontends_written, 1);
    assert_eq!(share_errors(&errors).len(), 1);
    assert_eq!(maps.maglev.len(), 15 * 64);
    maps.check_invariants();
}

/// A service port over `--bpf-max-endpoints-per-service` is programmed with its first
/// endpoints by address and port (the same on every node, whatever the EndpointSlices' order),
/// reported each time it is applied, and never a node fault.
#[test]
fn a_service_over_the_endpoint_cap_is_programmed_with_its_first_endpoints_by_address() {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut map_writer = no_grace();
    map_writer.set_max_endpoints_per_service(2);
    let web = key([10, 96, 0, 1], 80);
    let mut update = snapshot(&[(web, &[])]);
    // Address order is not the order of the map's values (network-order words compared as
    // host integers): 10.244.1.9 comes before 10.244.2.1.
    update[0].1[0].1.backends = [[4, 2], [2, 1], [3, 5], [1, 9]]
        .into_iter()
        .map(|[c, d]| Backend {
            addr: IpAddr::from([10, 244, c, d]),
            port: 8080,
        })
        .collect();
    let truncation = |errors: &[ApplyError]| -> Vec<(usize, usize)> {
        errors
            .iter()
            .filter_map(|error| match error {
                ApplyError::Truncated {
                    endpoints,
                    programmed,
                    ..
                } => Some((*endpoints, *programmed)),
                _ => None,
            })
            .collect()
    };
    let (summary, errors) = map_writer.apply(update.clone(), &mut maps);
    assert_eq!(summary.frontends_written, 1);
    assert_eq!(truncation(&errors), [(4, 2)]);
    assert!(errors.iter().all(ApplyError::is_tenant_limit));
    assert!(!errors.iter().any(ApplyError::is_capacity));
    assert!(errors[0].to_string().contains("ns/svc-10.96.0.1-80:http"));
    let mut programmed = maps.backends_of(&web);
    programmed.sort();
    assert_eq!(
        programmed,
        ["10.244.1.9:8080", "10.244.2.1:8080"].map(|a| a.parse::<SocketAddr>().expect("addr"))
    );
    // Unchanged: nothing written, still reported; not something that did not fit.
    let (summary, errors) = map_writer.apply(update.clone(), &mut maps);
    assert_eq!(
        (summary.frontends_written, summary.frontends_unchanged),
        (0, 1)
    );
    assert_eq!(truncation(&errors), [(4, 2)]);
    assert!(map_writer.unfit().is_empty());
    // A higher cap: the next apply programs them all.
    map_writer.set_max_endpoints_per_service(10);
    let (summary, errors) = map_writer.apply(update.clone(), &mut maps);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_written, 1);
    assert_eq!(maps.backends_of(&web).len(), 4);
    maps.check_invariants();

    // One that is not programmed at all is reported as not fitting, not as truncated.
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut map_writer = no_grace();
    map_writer.set_max_endpoints_per_service(2);
    set_shares(&mut map_writer, 65_536, 0);
    let (summary, errors) = map_writer.apply(update, &mut maps);
    assert_eq!(summary.frontends_written, 0);
    assert_eq!(share_errors(&errors).len(), 1);
    assert!(truncation(&errors).is_empty(), "{errors:?}");
}

/// A full pass in steps goes through every service port the writer owns once, in name order,
/// `count` at a time, and its end removes what a pass in one go removes.
#[test]
fn a_full_pass_in_steps_covers_every_owned_service_port_once() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let keys: Vec<FrontendKey> = (10..15).map(|last| key([10, 96, 0, last], 80)).collect();
    let all: Vec<(FrontendKey, &[u8])> = keys.iter().map(|&k| (k, &[1_u8][..])).collect();
    let mut writer = no_grace();
    writer.apply(snapshot(&all), &mut maps);
    let empty = Snapshot::default();
    let mut after: Option<ServicePortName> = None;
    let mut steps = Vec::new();
    loop {
        let names = writer.full_pass_names(&empty, after.as_ref(), 2);
        let last_step = names.len() < 2;
        after = names.last().cloned().or(after);
        steps.push(names);
        if last_step {
            break;
        }
    }
    let mut expected: Vec<ServicePortName> = keys.iter().map(name_of).collect();
    expected.sort();
    assert_eq!(
        steps.iter().map(BTreeSet::len).collect::<Vec<_>>(),
        [2, 2, 1]
    );
    let covered: Vec<ServicePortName> = steps.into_iter().flatten().collect();
    assert_eq!(covered, expected, "each once, in name order");

    // Adopted frontends nobody claims go at the end of the pass, as in one go.
    let mut adopted =
        MapWriter::adopt(maps.content(), &mut maps).with_grace(Duration::ZERO, Instant::now);
    adopted.apply(snapshot(&all[..1]), &mut maps);
    let (summary, errors) = adopted.finish_full_pass(&mut maps, false);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(summary.frontends_removed, 4);
    maps.check_invariants();
    assert_eq!(pods(&maps, &keys[0]), [1]);
}
