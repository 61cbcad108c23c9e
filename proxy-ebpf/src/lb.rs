//! Backend selection: frontend value → (session affinity | Maglev slot | random slot) → backend
//! id → backend.
//! Shared by IPv4 and IPv6; only the backend map differs.

use aya_ebpf::{
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    maps::HashMap,
};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, BackendSlotKey, FrontendValue, StatIndex,
    frontend_flags,
};

use crate::{
    maglev,
    maps::{KPR_AFFINITY, KPR_AFFINITY_MATCH, KPR_BACKEND_SLOTS, KPR_UDP_STICKY},
    stats::bump,
};

const NANOS_PER_SECOND: u64 = 1_000_000_000;

/// What to do with a connection to a frontend.
pub enum Decision<B> {
    /// A service without usable backends: refuse like kube-proxy's REJECT.
    NoBackends,
    /// The frontend's slot or backend vanished between lookups.
    BackendMissing,
    Backend(B),
    /// The backend this socket already uses ([`frontend_flags::STICKY_SOCKET`]): its
    /// reverse-NAT entry is already there.
    Kept(B),
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
/// conntrack entry was evicted finds its flow's backend (`tc::new_flow`). The socket hooks give
/// `None` and stay random.
///
/// `socket` (the hooks' socket cookie, `None` elsewhere) keys the per-socket choice of
/// [`frontend_flags::STICKY_SOCKET`] frontends: an unconnected UDP socket keeps its backend
/// while it stays in the service (session affinity, keyed wider, goes first).
#[inline(always)]
pub fn select_backend<B: Copy>(
    frontend: &FrontendValue,
    client: impl FnOnce() -> u64,
    flow_hash: impl FnOnce() -> Option<u32>,
    socket: Option<u64>,
    backends: &HashMap<u32, B>,
) -> Decision<B> {
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
        && let Some(backend) = sticky_backend(key, frontend, backends)
    {
        return Decision::Kept(backend);
    }
    let mut affinity_key = None;
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if affinity {
        let key = AffinityKey {
            client: client(),
            service_id: frontend.service_id,
            _pad: 0,
        };
        if let Some(backend) = affinity_backend(&key, frontend, now, backends) {
            bump(StatIndex::AffinityHit);
            return Decision::Backend(backend);
        }
        affinity_key = Some(key);
    }

    let hash = flow_hash();
    let maglev_hash = hash.filter(|_| frontend.flags & frontend_flags::MAGLEV != 0);
    // A missing table entry (a table the agent is rebuilding after a restart) falls back to
    // the slot choice rather than dropping the flow.
    let backend_id = match maglev_hash.and_then(|hash| maglev::backend_id(frontend, hash)) {
        Some(id) => Some(id),
        None => slot_backend_id(frontend, hash),
    };
    let Some(backend_id) = backend_id else {
        return Decision::BackendMissing;
    };
    // SAFETY: as above.
    let Some(backend) = (unsafe { backends.get(backend_id) }).copied() else {
        return Decision::BackendMissing;
    };
    if let Some(key) = affinity_key {
        remember(&key, backend_id, now);
    }
    if let Some(key) = sticky_key {
        let value = AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns: now,
        };
        // Best effort: without the entry the socket's next datagram chooses again.
        let _ = KPR_UDP_STICKY.insert(key, value, 0);
    }
    Decision::Backend(backend)
}

/// The backend an unconnected UDP socket used last, if it is still a member of the service.
#[inline(always)]
fn sticky_backend<B: Copy>(
    key: &AffinityKey,
    frontend: &FrontendValue,
    backends: &HashMap<u32, B>,
) -> Option<B> {
    // SAFETY: as in select_backend.
    let entry = (unsafe { KPR_UDP_STICKY.get(key) }).copied()?;
    let member = AffinityMatchKey {
        service_id: frontend.service_id,
        backend_id: entry.backend_id,
    };
    // SAFETY: as in select_backend.
    unsafe { KPR_AFFINITY_MATCH.get(member) }?;
    // SAFETY: as in select_backend.
    (unsafe { backends.get(entry.backend_id) }).copied()
}

/// The backend id at slot `hash % backend_count`, a random slot without a hash.
#[inline(always)]
fn slot_backend_id(frontend: &FrontendValue, hash: Option<u32>) -> Option<u32> {
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    let pick = hash.unwrap_or_else(|| unsafe { bpf_get_prandom_u32() });
    let slot_key = BackendSlotKey {
        service_id: frontend.service_id,
        slot: (pick % u32::from(frontend.backend_count)) as u16,
        generation: frontend.generation,
        _pad: 0,
    };
    // SAFETY: map values are plain integers, copied out at once; the agent replaces values
    // with whole-value updates, so a copy is always one complete value.
    (unsafe { KPR_BACKEND_SLOTS.get(slot_key) }).copied()
}

#[inline(always)]
fn affinity_backend<B: Copy>(
    key: &AffinityKey,
    frontend: &FrontendValue,
    now: u64,
    backends: &HashMap<u32, B>,
) -> Option<B> {
    // SAFETY: as in select_backend.
    let entry = (unsafe { KPR_AFFINITY.get(key) }).copied()?;
    let timeout = u64::from(frontend.affinity_timeout) * NANOS_PER_SECOND;
    let fresh = now.wrapping_sub(entry.last_used_ns) <= timeout;
    let member = AffinityMatchKey {
        service_id: frontend.service_id,
        backend_id: entry.backend_id,
    };
    // SAFETY: as in select_backend.
    let live = unsafe { KPR_AFFINITY_MATCH.get(member) }.is_some();
    // SAFETY: as in select_backend.
    let backend = (unsafe { backends.get(entry.backend_id) }).copied();
    match backend {
        Some(backend) if fresh && live => {
            remember(key, entry.backend_id, now);
            Some(backend)
        }
        _ => {
            bump(StatIndex::AffinityStale);
            None
        }
    }
}

#[inline(always)]
fn remember(key: &AffinityKey, backend_id: u32, now: u64) {
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_used_ns: now,
    };
    // Best effort: an LRU insert only fails on allocation failure; the next connection then
    // simply chooses again.
    let _ = KPR_AFFINITY.insert(key, value, 0);
}
