//! The diff and update-protocol logic, over in-memory maps with a capacity, checked after every
//! step for the invariants the datapath relies on. Kernel behaviour itself is covered by the
//! integration tests in `tests/`.

use std::collections::BTreeMap;

use super::*;
use crate::{
    desired::{Backend, Frontend, Protocol, ServicePortName},
    objects::ObjectKey,
};

#[derive(Debug, Default)]
struct FakeMaps {
    frontends: BTreeMap<Frontend4Key, FrontendValue>,
    slots: BTreeMap<BackendSlotKey, u32>,
    backends: BTreeMap<u32, Backend4>,
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

    /// What a datapath lookup would see: every frontend's complete backend set, and nothing
    /// unreachable left behind.
    fn check_invariants(&self) {
        let mut reachable_slots = 0;
        for (key, value) in &self.frontends {
            for slot in 0..value.backend_count {
                let slot_key = BackendSlotKey {
                    service_id: value.service_id,
                    slot,
                    generation: value.generation,
                    _pad: 0,
                };
                let id = self
                    .slots
                    .get(&slot_key)
                    .unwrap_or_else(|| panic!("{key:?}: slot {slot} missing"));
                assert!(
                    self.backends.contains_key(id),
                    "{key:?}: backend {id} missing"
                );
                reachable_slots += 1;
            }
        }
        assert_eq!(
            reachable_slots,
            self.slots.len(),
            "orphan slots: {:?}",
            self.slots
        );
        let used: std::collections::BTreeSet<u32> = self.slots.values().copied().collect();
        assert_eq!(
            used.len(),
            self.backends.len(),
            "orphan backends: {:?}",
            self.backends
        );
    }

    /// Backends of a frontend as (address, host-order port).
    fn backends_of(&self, key: &FrontendKey) -> Vec<(std::net::Ipv4Addr, u16)> {
        let map_key = frontend_map_key(key).expect("ipv4");
        let Some(value) = self.frontends.get(&map_key) else {
            return Vec::new();
        };
        (0..value.backend_count)
            .map(|slot| {
                let id = self.slots[&BackendSlotKey {
                    service_id: value.service_id,
                    slot,
                    generation: value.generation,
                    _pad: 0,
                }];
                let backend = self.backends[&id];
                (
                    std::net::Ipv4Addr::from(backend.addr.to_ne_bytes()),
                    u16::from_be(backend.port),
                )
            })
            .collect()
    }
}

impl MapOps for FakeMaps {
    fn put_frontend(&mut self, key: Frontend4Key, value: FrontendValue) -> Result<(), String> {
        self.writes += 1;
        self.frontends.insert(key, value);
        Ok(())
    }
    fn delete_frontend(&mut self, key: Frontend4Key) -> Result<(), String> {
        self.writes += 1;
        self.frontends.remove(&key);
        Ok(())
    }
    fn put_slot(&mut self, key: BackendSlotKey, backend_id: u32) -> Result<(), String> {
        if !self.slots.contains_key(&key) && self.slots.len() >= self.slot_capacity {
            return Err("map is full".into());
        }
        self.writes += 1;
        self.slots.insert(key, backend_id);
        Ok(())
    }
    fn delete_slot(&mut self, key: BackendSlotKey) -> Result<(), String> {
        self.writes += 1;
        self.slots.remove(&key);
        Ok(())
    }
    fn put_backend(&mut self, id: u32, backend: Backend4) -> Result<(), String> {
        self.writes += 1;
        self.backends.insert(id, backend);
        Ok(())
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), String> {
        self.writes += 1;
        self.backends.remove(&id);
        Ok(())
    }
}

fn key(ip: [u8; 4], port: u16) -> FrontendKey {
    FrontendKey {
        addr: IpAddr::from(ip),
        port,
        protocol: Protocol::Tcp,
    }
}

type Update = (ServicePortName, Vec<(FrontendKey, Frontend)>);

/// Each frontend as the only frontend of its own service port.
fn name_of(key: &FrontendKey) -> ServicePortName {
    ServicePortName {
        service: ObjectKey {
            namespace: "ns".into(),
            name: format!("svc-{}-{}", key.addr, key.port),
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
        .map(|(addr, _)| addr.octets()[2])
        .collect()
}

#[test]
fn first_apply_writes_frontend_slots_and_backends_in_network_order() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut programmer = Programmer::default();
    let web = key([10, 96, 0, 10], 80);
    let (summary, errors) = programmer.apply(snapshot(&[(web, &[1, 2])]), &mut maps);
    assert!(errors.is_empty());
    assert_eq!(summary.frontends_written, 1);
    maps.check_invariants();
    assert_eq!(
        maps.backends_of(&web),
        [
            ([10, 244, 1, 2].into(), 8080),
            ([10, 244, 2, 2].into(), 8080)
        ]
    );
    let map_key = frontend_map_key(&web).expect("ipv4");
    assert_eq!(map_key.addr.to_ne_bytes(), [10, 96, 0, 10]);
    assert_eq!(map_key.port.to_ne_bytes(), [0, 80]);
}

#[test]
fn a_backend_change_switches_generation_and_cleans_the_old_one() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut programmer = Programmer::default();
    let web = key([10, 96, 0, 10], 80);
    programmer.apply(snapshot(&[(web, &[1, 2, 3])]), &mut maps);
    let before = maps.frontends[&frontend_map_key(&web).expect("ipv4")];
    programmer.apply(snapshot(&[(web, &[1, 3])]), &mut maps);
    let after = maps.frontends[&frontend_map_key(&web).expect("ipv4")];
    maps.check_invariants();
    assert_eq!(after.service_id, before.service_id);
    assert_ne!(after.generation, before.generation);
    assert_eq!(pods(&maps, &web), [1, 3]);
    assert_eq!(maps.backends.len(), 2, "the removed backend is gone");
}

#[test]
fn an_unchanged_snapshot_writes_nothing() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut programmer = Programmer::default();
    let state = snapshot(&[
        (key([10, 96, 0, 10], 80), &[1, 2]),
        (key([10, 96, 0, 11], 80), &[3]),
    ]);
    programmer.apply(state.clone(), &mut maps);
    let writes = maps.writes;
    let (summary, _) = programmer.apply(state.clone(), &mut maps);
    assert_eq!(maps.writes, writes);
    assert_eq!(summary.frontends_unchanged, 2);
}

#[test]
fn only_the_changed_frontend_is_rewritten() {
    let mut maps = FakeMaps::with_slot_capacity(1000);
    let mut programmer = Programmer::default();
    let many: Vec<(FrontendKey, &[u8])> = (0..100u8)
        .map(|i| (key([10, 96, 1, i], 80), &[1u8, 2][..]))
        .collect();
    programmer.apply(snapshot(&many), &mut maps);
    let writes = maps.writes;
    let mut changed = many.clone();
    changed[7].1 = &[1, 2, 3];
    let (summary, _) = programmer.apply(snapshot(&changed), &mut maps);
    maps.check_invariants();
    assert_eq!(summary.frontends_written, 1);
    // 1 new backend + 3 slots + 1 frontend + 2 old slots deleted.
    assert_eq!(maps.writes - writes, 7);
}

#[test]
fn removing_a_frontend_removes_everything_it_used() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut programmer = Programmer::default();
    let web = key([10, 96, 0, 10], 80);
    let api = key([10, 96, 0, 11], 443);
    programmer.apply(snapshot(&[(web, &[1, 2]), (api, &[2, 3])]), &mut maps);
    let (summary, _) = programmer.apply(vec![gone(web)], &mut maps);
    maps.check_invariants();
    assert_eq!(summary.frontends_removed, 1);
    assert_eq!(maps.frontends.len(), 1);
    assert_eq!(pods(&maps, &api), [2, 3], "the shared backend survives");
    programmer.apply(vec![gone(api)], &mut maps);
    assert!(maps.frontends.is_empty() && maps.slots.is_empty() && maps.backends.is_empty());
}

#[test]
fn a_frontend_without_backends_is_written_with_count_zero() {
    let mut maps = FakeMaps::with_slot_capacity(100);
    let mut programmer = Programmer::default();
    let web = key([10, 96, 0, 10], 80);
    programmer.apply(snapshot(&[(web, &[])]), &mut maps);
    let value = maps.frontends[&frontend_map_key(&web).expect("ipv4")];
    assert_eq!(value.backend_count, 0);
    maps.check_invariants();
}

#[test]
fn a_full_map_leaves_the_frontend_on_its_previous_complete_set() {
    let mut maps = FakeMaps::with_slot_capacity(5);
    let mut programmer = Programmer::default();
    let web = key([10, 96, 0, 10], 80);
    programmer.apply(snapshot(&[(web, &[1, 2])]), &mut maps);
    // The new generation needs 4 slots while 2 are still live: only 3 fit.
    let (summary, errors) = programmer.apply(snapshot(&[(web, &[1, 2, 3, 4])]), &mut maps);
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
    assert_eq!(pods(&maps, &web), [1, 2]);
    // A later snapshot that fits is applied normally.
    let (summary, errors) = programmer.apply(snapshot(&[(web, &[3])]), &mut maps);
    assert!(errors.is_empty());
    assert_eq!(summary.frontends_written, 1);
    maps.check_invariants();
    assert_eq!(pods(&maps, &web), [3]);
}

#[test]
fn a_new_frontend_that_does_not_fit_leaves_nothing_behind() {
    let mut maps = FakeMaps::with_slot_capacity(2);
    let mut programmer = Programmer::default();
    let web = key([10, 96, 0, 10], 80);
    let (_, errors) = programmer.apply(snapshot(&[(web, &[1, 2, 3])]), &mut maps);
    assert_eq!(errors.len(), 1);
    assert!(maps.frontends.is_empty() && maps.slots.is_empty() && maps.backends.is_empty());
    assert_eq!(programmer.counts(), (0, 0));
}

#[test]
fn ipv6_frontends_are_counted_as_unsupported_not_dropped_silently() {
    let mut maps = FakeMaps::with_slot_capacity(10);
    let mut programmer = Programmer::default();
    let key = FrontendKey {
        addr: "fd00::10".parse().expect("ipv6"),
        port: 80,
        protocol: Protocol::Tcp,
    };
    let mut update = snapshot(&[(key, &[])]);
    update[0].1[0].1.backends.clear();
    let (summary, _) = programmer.apply(update, &mut maps);
    assert_eq!(summary.frontends_unsupported, 1);
    assert!(maps.frontends.is_empty());
}

#[test]
fn a_frontend_claimed_by_two_service_ports_stays_with_the_first() {
    let mut maps = FakeMaps::with_slot_capacity(10);
    let mut programmer = Programmer::default();
    let web = key([10, 96, 0, 10], 80);
    programmer.apply(snapshot(&[(web, &[1])]), &mut maps);
    let mut intruder = snapshot(&[(web, &[2])]);
    intruder[0].0.service.name = "intruder".into();
    let (summary, errors) = programmer.apply(intruder, &mut maps);
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
