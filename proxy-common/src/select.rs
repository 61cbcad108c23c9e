//! Backend selection: frontend value → (sticky socket | session affinity | Maglev slot | slot
//! from the flow hash or at random) → backend id → backend. The programs (`proxy-ebpf`'s
//! `lb.rs`) run it over the maps; `proxy-agent inspect explain` over the pinned maps, with a
//! random pick it reports as undetermined.

use crate::{
    AffinityKey, AffinityMatchKey, AffinityValue, BackendSlotKey, FrontendValue,
    MAGLEV_BLOCK_SLOTS, MaglevKey, SLOT_BLOCK_SLOTS, StatIndex, ct_timeout::NANOS_PER_SECOND,
    frontend_flags,
};

/// What to do with a connection to a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision<B> {
    /// A service without usable backends: refuse like kube-proxy's REJECT.
    NoBackends,
    /// The frontend's slot or backend vanished between lookups.
    BackendMissing,
    Backend(B, Chosen),
    /// The backend this socket already uses ([`frontend_flags::STICKY_SOCKET`]): its
    /// reverse-NAT entry is already there.
    Kept(B),
}

/// How a new backend was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chosen {
    /// The client's live session-affinity entry.
    Affinity,
    /// The flow hash's slot of the frontend's Maglev table.
    Maglev { slot: u32 },
    /// Backend slot `slot`, from the flow hash or (`random`) a random number.
    Slot { slot: u16, random: bool },
}

/// The maps and clocks a choice reads and writes.
pub trait BackendMaps {
    type Backend: Copy;
    /// `KPR_BACKENDS4/6`.
    fn backend(&mut self, id: u32) -> Option<Self::Backend>;
    /// Entry `index` of the `KPR_BACKEND_SLOTS` block under `key`.
    fn slot(&mut self, key: &BackendSlotKey, index: usize) -> Option<u32>;
    /// Entry `index` of the `KPR_MAGLEV` block under `key`.
    fn maglev(&mut self, key: &MaglevKey, index: usize) -> Option<u32>;
    /// `KPR_AFFINITY`.
    fn affinity(&mut self, key: &AffinityKey) -> Option<AffinityValue>;
    /// `KPR_UDP_STICKY`.
    fn sticky(&mut self, key: &AffinityKey) -> Option<AffinityValue>;
    /// Whether the backend is still a member of the service (`KPR_AFFINITY_MATCH`).
    fn member(&mut self, key: &AffinityMatchKey) -> bool;
    /// Records a client's backend in `KPR_AFFINITY` (best effort).
    fn remember_affinity(&mut self, key: &AffinityKey, value: &AffinityValue);
    /// Records a socket's backend in `KPR_UDP_STICKY` (best effort).
    fn remember_sticky(&mut self, key: &AffinityKey, value: &AffinityValue);
    /// `bpf_ktime_get_ns()`.
    fn now_ns(&mut self) -> u64;
    fn random(&mut self) -> u32;
    /// Counts an event of the choice (affinity hits and stale entries).
    fn count(&mut self, stat: StatIndex);
}

/// Picks the backend for a new connection (or datagram) of `client` to `frontend`.
///
/// Without affinity the choice is uniform at random, like kube-proxy's iptables `statistic`
/// rules per connection. With affinity, a client keeps the backend it used last as long as it
/// comes back within the timeout (measured from its last use, like `-m recent --rcheck
/// --seconds`) and the backend is still in the service. A frontend with a Maglev table
/// ([`frontend_flags::MAGLEV`], external frontends only) takes the table's entry for
/// `flow_hash`. Callers with a flow tuple (the tc programs) pick the slot of other frontends
/// from `flow_hash` too: as uniform over connections as a random pick (every connection has
/// its own client port), and the same again for the same tuple, so a mid-stream packet whose
/// conntrack entry was evicted finds its flow's backend. The socket hooks give `None` and stay
/// random.
///
/// `socket` (the hooks' socket cookie, `None` elsewhere) keys the per-socket choice of
/// [`frontend_flags::STICKY_SOCKET`] frontends: an unconnected UDP socket keeps its backend
/// while it stays in the service (session affinity, keyed wider, goes first).
#[inline(always)]
pub fn select_backend<M: BackendMaps>(
    maps: &mut M,
    frontend: &FrontendValue,
    client: impl FnOnce() -> u64,
    flow_hash: impl FnOnce() -> Option<u32>,
    socket: Option<u64>,
) -> Decision<M::Backend> {
    if frontend.backend_count == 0 {
        return Decision::NoBackends;
    }
    let affinity = frontend.flags & frontend_flags::AFFINITY != 0;
    let sticky_key = socket
        .filter(|_| !affinity && frontend.flags & frontend_flags::STICKY_SOCKET != 0)
        .map(|cookie| AffinityKey {
            client: cookie,
            service_id: frontend.service_id,
            _pad: 0,
        });
    if let Some(key) = &sticky_key
        && let Some(backend) = sticky_backend(maps, key, frontend)
    {
        return Decision::Kept(backend);
    }
    let mut affinity_key = None;
    let now = maps.now_ns();
    if affinity {
        let key = AffinityKey {
            client: client(),
            service_id: frontend.service_id,
            _pad: 0,
        };
        if let Some(backend) = affinity_backend(maps, &key, frontend, now) {
            maps.count(StatIndex::AffinityHit);
            return Decision::Backend(backend, Chosen::Affinity);
        }
        affinity_key = Some(key);
    }

    let hash = flow_hash();
    let maglev_hash = hash.filter(|_| frontend.flags & frontend_flags::MAGLEV != 0);
    // A missing table entry (a table the agent is rebuilding after a restart) falls back to
    // the slot choice rather than dropping the flow.
    let (backend_id, chosen) =
        match maglev_hash.and_then(|hash| maglev_backend_id(maps, frontend, hash)) {
            Some((id, slot)) => (Some(id), Chosen::Maglev { slot }),
            None => {
                let random = hash.is_none();
                let pick = match hash {
                    Some(hash) => hash,
                    None => maps.random(),
                };
                let (key, index, slot) = slot_entry(frontend, pick);
                (maps.slot(&key, index), Chosen::Slot { slot, random })
            }
        };
    let Some(backend_id) = backend_id else {
        return Decision::BackendMissing;
    };
    let Some(backend) = maps.backend(backend_id) else {
        return Decision::BackendMissing;
    };
    if let Some(key) = affinity_key {
        remember(maps, &key, backend_id, now);
    }
    if let Some(key) = sticky_key {
        let value = AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns: now,
        };
        // Best effort: without the entry the socket's next datagram chooses again.
        maps.remember_sticky(&key, &value);
    }
    Decision::Backend(backend, chosen)
}

/// The slot `pick % backend_count` of the frontend's live generation: the key and index of
/// its `KPR_BACKEND_SLOTS` block entry, and the slot.
#[inline(always)]
pub fn slot_entry(frontend: &FrontendValue, pick: u32) -> (BackendSlotKey, usize, u16) {
    let slot = pick % u32::from(frontend.backend_count).max(1);
    let key = BackendSlotKey {
        service_id: frontend.service_id,
        block: (slot / SLOT_BLOCK_SLOTS) as u16,
        generation: frontend.generation,
        _pad: 0,
    };
    // The mask keeps the index provably inside the block for the verifier.
    let index = (slot % SLOT_BLOCK_SLOTS) as usize & (SLOT_BLOCK_SLOTS as usize - 1);
    (key, index, slot as u16)
}

/// The key and index of the `KPR_MAGLEV` block entry of the flow's slot, and the slot, if the
/// frontend has a table.
#[inline(always)]
pub fn maglev_entry(frontend: &FrontendValue, hash: u32) -> Option<(MaglevKey, usize, u32)> {
    let slot = hash.checked_rem(frontend.maglev_size)?;
    let key = MaglevKey {
        service_id: frontend.service_id,
        block: slot / MAGLEV_BLOCK_SLOTS,
        generation: frontend.generation,
        _pad: [0; 3],
    };
    Some((key, (slot % MAGLEV_BLOCK_SLOTS) as usize, slot))
}

/// The backend id at the flow's slot of the frontend's live Maglev table, and the slot.
#[inline(always)]
fn maglev_backend_id<M: BackendMaps>(
    maps: &mut M,
    frontend: &FrontendValue,
    hash: u32,
) -> Option<(u32, u32)> {
    let (key, index, slot) = maglev_entry(frontend, hash)?;
    maps.maglev(&key, index).map(|id| (id, slot))
}

/// The affinity key of a tc client: its address (map words), an IPv6 one folded to 64 bits (a
/// collision only makes two clients share a live backend).
#[inline(always)]
pub fn address_client(src: &[u32; 4], v6: bool) -> u64 {
    if v6 {
        (u64::from(src[0] ^ src[2]) << 32) | u64::from(src[1] ^ src[3])
    } else {
        u64::from(src[0])
    }
}

/// The frontend's session-affinity timeout in nanoseconds.
#[inline(always)]
pub fn affinity_timeout_ns(frontend: &FrontendValue) -> u64 {
    u64::from(frontend.affinity_timeout) * NANOS_PER_SECOND
}

/// Whether an entry last used at `last_used_ns` is still within `timeout_ns` at `now`.
#[inline(always)]
pub fn fresh(last_used_ns: u64, now: u64, timeout_ns: u64) -> bool {
    now.saturating_sub(last_used_ns) <= timeout_ns
}

/// The backend an unconnected UDP socket used last, if it is still a member of the service.
#[inline(always)]
fn sticky_backend<M: BackendMaps>(
    maps: &mut M,
    key: &AffinityKey,
    frontend: &FrontendValue,
) -> Option<M::Backend> {
    let entry = maps.sticky(key)?;
    let member = AffinityMatchKey {
        service_id: frontend.service_id,
        backend_id: entry.backend_id,
    };
    if !maps.member(&member) {
        return None;
    }
    maps.backend(entry.backend_id)
}

/// The backend of the client's affinity entry if it is fresh and its backend still a member
/// (the entry is refreshed), else `None` (counted as stale when there was an entry).
#[inline(always)]
fn affinity_backend<M: BackendMaps>(
    maps: &mut M,
    key: &AffinityKey,
    frontend: &FrontendValue,
    now: u64,
) -> Option<M::Backend> {
    let entry = maps.affinity(key)?;
    let fresh = fresh(entry.last_used_ns, now, affinity_timeout_ns(frontend));
    let member = AffinityMatchKey {
        service_id: frontend.service_id,
        backend_id: entry.backend_id,
    };
    let live = maps.member(&member);
    let backend = maps.backend(entry.backend_id);
    match backend {
        Some(backend) if fresh && live => {
            remember(maps, key, entry.backend_id, now);
            Some(backend)
        }
        _ => {
            maps.count(StatIndex::AffinityStale);
            None
        }
    }
}

#[inline(always)]
fn remember<M: BackendMaps>(maps: &mut M, key: &AffinityKey, backend_id: u32, now: u64) {
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_used_ns: now,
    };
    // Best effort: an LRU insert only fails on allocation failure; the next connection then
    // simply chooses again.
    maps.remember_affinity(key, &value);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slot i holds backend id 100 + i, backend id n is n; one affinity and one sticky entry.
    struct Fake {
        slots: u16,
        maglev: Option<u32>,
        affinity: Option<AffinityValue>,
        sticky: Option<AffinityValue>,
        members: [u32; 2],
        now: u64,
        random: u32,
        remembered: Option<(AffinityKey, AffinityValue)>,
        stale: usize,
    }

    impl Default for Fake {
        fn default() -> Self {
            Self {
                slots: 4,
                maglev: None,
                affinity: None,
                sticky: None,
                members: [101, 102],
                now: 1_000 * NANOS_PER_SECOND,
                random: 2,
                remembered: None,
                stale: 0,
            }
        }
    }

    impl BackendMaps for Fake {
        type Backend = u32;
        fn backend(&mut self, id: u32) -> Option<u32> {
            Some(id)
        }
        fn slot(&mut self, key: &BackendSlotKey, index: usize) -> Option<u32> {
            let slot = u32::from(key.block) * SLOT_BLOCK_SLOTS + index as u32;
            (slot < u32::from(self.slots)).then_some(100 + slot)
        }
        fn maglev(&mut self, _key: &MaglevKey, _index: usize) -> Option<u32> {
            self.maglev
        }
        fn affinity(&mut self, _key: &AffinityKey) -> Option<AffinityValue> {
            self.affinity
        }
        fn sticky(&mut self, _key: &AffinityKey) -> Option<AffinityValue> {
            self.sticky
        }
        fn member(&mut self, key: &AffinityMatchKey) -> bool {
            self.members.contains(&key.backend_id)
        }
        fn remember_affinity(&mut self, key: &AffinityKey, value: &AffinityValue) {
            self.remembered = Some((*key, *value));
        }
        fn remember_sticky(&mut self, key: &AffinityKey, value: &AffinityValue) {
            self.remembered = Some((*key, *value));
        }
        fn now_ns(&mut self) -> u64 {
            self.now
        }
        fn random(&mut self) -> u32 {
            self.random
        }
        fn count(&mut self, stat: StatIndex) {
            if matches!(stat, StatIndex::AffinityStale) {
                self.stale += 1;
            }
        }
    }

    fn frontend(flags: u8) -> FrontendValue {
        FrontendValue {
            service_id: 7,
            backend_count: 4,
            generation: 1,
            flags,
            affinity_timeout: 10,
            maglev_size: 1021,
        }
    }

    fn entry(backend_id: u32, idle_s: u64, now: u64) -> Option<AffinityValue> {
        Some(AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns: now - idle_s * NANOS_PER_SECOND,
        })
    }

    #[test]
    fn the_slot_comes_from_the_flow_hash_else_at_random() {
        let mut maps = Fake::default();
        let by_hash = select_backend(&mut maps, &frontend(0), || 0, || Some(5), None);
        let slot = Chosen::Slot {
            slot: 1,
            random: false,
        };
        assert_eq!(by_hash, Decision::Backend(101, slot));
        let random = select_backend(&mut maps, &frontend(0), || 0, || None, None);
        let slot = Chosen::Slot {
            slot: 2,
            random: true,
        };
        assert_eq!(random, Decision::Backend(102, slot));
        let empty = FrontendValue {
            backend_count: 0,
            ..frontend(0)
        };
        assert_eq!(
            select_backend(&mut maps, &empty, || 0, || None, None),
            Decision::NoBackends
        );
        maps.slots = 0;
        assert_eq!(
            select_backend(&mut maps, &frontend(0), || 0, || Some(5), None),
            Decision::BackendMissing
        );
    }

    #[test]
    fn maglev_takes_the_table_entry_and_falls_back_to_the_slot() {
        let mut maps = Fake {
            maglev: Some(42),
            ..Fake::default()
        };
        let maglev = frontend(frontend_flags::MAGLEV);
        assert_eq!(
            select_backend(&mut maps, &maglev, || 0, || Some(1030), None),
            Decision::Backend(42, Chosen::Maglev { slot: 9 })
        );
        // Without a hash (a socket hook) the table is not used.
        assert!(matches!(
            select_backend(&mut maps, &maglev, || 0, || None, None),
            Decision::Backend(_, Chosen::Slot { random: true, .. })
        ));
        maps.maglev = None;
        assert!(matches!(
            select_backend(&mut maps, &maglev, || 0, || Some(1030), None),
            Decision::Backend(_, Chosen::Slot { random: false, .. })
        ));
        assert_eq!(
            maglev_entry(&maglev, 1030).map(|(k, i, _)| (k.block, i)),
            Some((0, 9))
        );
    }

    #[test]
    fn affinity_keeps_a_fresh_member_backend_and_remembers_new_choices() {
        let now = Fake::default().now;
        let affine = frontend(frontend_flags::AFFINITY);
        let mut maps = Fake {
            affinity: entry(102, 10, now),
            ..Fake::default()
        };
        assert_eq!(
            select_backend(&mut maps, &affine, || 3, || Some(5), None),
            Decision::Backend(102, Chosen::Affinity)
        );
        // Past the timeout: chosen again, the new choice remembered for the client.
        maps.affinity = entry(102, 11, now);
        let decision = select_backend(&mut maps, &affine, || 3, || Some(5), None);
        assert!(matches!(
            decision,
            Decision::Backend(101, Chosen::Slot { .. })
        ));
        assert_eq!(maps.stale, 1);
        let (key, value) = maps.remembered.expect("remembered");
        assert_eq!((key.client, key.service_id, value.backend_id), (3, 7, 101));
        // No longer a member.
        maps.affinity = entry(103, 0, now);
        assert!(matches!(
            select_backend(&mut maps, &affine, || 3, || Some(5), None),
            Decision::Backend(101, _)
        ));
    }

    #[test]
    fn a_sticky_socket_keeps_its_member_backend() {
        let now = Fake::default().now;
        let sticky = frontend(frontend_flags::STICKY_SOCKET);
        let mut maps = Fake {
            sticky: entry(102, 1_000, now),
            ..Fake::default()
        };
        assert_eq!(
            select_backend(&mut maps, &sticky, || 0, || None, Some(9)),
            Decision::Kept(102)
        );
        // Without a socket (tc) the entry is not read.
        assert!(matches!(
            select_backend(&mut maps, &sticky, || 0, || None, None),
            Decision::Backend(..)
        ));
        maps.sticky = entry(103, 0, now);
        assert!(matches!(
            select_backend(&mut maps, &sticky, || 0, || None, Some(9)),
            Decision::Backend(102, _)
        ));
        let (key, _) = maps.remembered.expect("remembered");
        assert_eq!(key.client, 9);
    }

    #[test]
    fn tc_clients_fold_ipv6_addresses() {
        assert_eq!(address_client(&[5, 0, 0, 0], false), 5);
        assert_eq!(address_client(&[1, 2, 4, 8], true), (5 << 32) | 10);
        assert!(fresh(0, 10, 10));
        assert!(!fresh(0, 11, 10));
    }
}
