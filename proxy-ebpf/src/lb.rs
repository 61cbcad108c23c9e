//! Backend selection over the maps: the choice itself is `proxy_common::select` (shared with
//! `proxy-agent inspect explain`); this module gives it the maps, the clock and the counters.
//! Shared by IPv4 and IPv6; only the backend map differs.

use aya_ebpf::{helpers::bpf_get_prandom_u32, maps::Array};
pub use proxy_common::select::Decision;
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, BackendEntry, BackendSlotKey, FrontendValue,
    MaglevKey, StatIndex, select::BackendMaps,
};

use crate::{
    clock,
    maps::{KPR_AFFINITY, KPR_AFFINITY_MATCH, KPR_BACKEND_SLOTS, KPR_MAGLEV, KPR_UDP_STICKY},
    stats::bump,
};

/// The maps a choice reads, with the backend map of the flow's family.
struct Maps<'a, B: 'static> {
    backends: &'a Array<B>,
}

// SAFETY (every `get` below): map values are plain integers, copied out at once; the agent and
// the programs replace values with whole-value updates, so a copy is always one complete value.
impl<B: BackendEntry + 'static> BackendMaps for Maps<'_, B> {
    type Backend = B;
    #[inline(always)]
    fn backend(&mut self, id: u32) -> Option<B> {
        // An id past the array's end has no element; a removed backend is the zero value, a
        // miss as the hash map's was (`BackendEntry`).
        self.backends.get(id).copied().filter(BackendEntry::in_use)
    }
    #[inline(always)]
    fn slot(&mut self, key: &BackendSlotKey, index: usize) -> Option<u32> {
        // SAFETY: see above.
        let block = unsafe { KPR_BACKEND_SLOTS.get(key) }?;
        block.backend_ids.get(index).copied()
    }
    #[inline(always)]
    fn maglev(&mut self, key: &MaglevKey, index: usize) -> Option<u32> {
        // SAFETY: see above.
        let block = unsafe { KPR_MAGLEV.get(key) }?;
        block.backend_ids.get(index).copied()
    }
    #[inline(always)]
    fn affinity(&mut self, key: &AffinityKey) -> Option<AffinityValue> {
        // SAFETY: see above.
        (unsafe { KPR_AFFINITY.get(key) }).copied()
    }
    #[inline(always)]
    fn sticky(&mut self, key: &AffinityKey) -> Option<AffinityValue> {
        // SAFETY: see above.
        (unsafe { KPR_UDP_STICKY.get(key) }).copied()
    }
    #[inline(always)]
    fn member(&mut self, key: &AffinityMatchKey) -> bool {
        // SAFETY: presence check only.
        unsafe { KPR_AFFINITY_MATCH.get(key) }.is_some()
    }
    #[inline(always)]
    fn remember_affinity(&mut self, key: &AffinityKey, value: &AffinityValue) {
        // Best effort: an LRU insert only fails on allocation failure.
        let _ = KPR_AFFINITY.insert(key, value, 0);
    }
    #[inline(always)]
    fn remember_sticky(&mut self, key: &AffinityKey, value: &AffinityValue) {
        // Best effort: as above.
        let _ = KPR_UDP_STICKY.insert(key, value, 0);
    }
    #[inline(always)]
    fn now_ns(&mut self) -> u64 {
        clock::now_ns()
    }
    #[inline(always)]
    fn random(&mut self) -> u32 {
        // SAFETY: bpf_get_prandom_u32 has no preconditions.
        unsafe { bpf_get_prandom_u32() }
    }
    #[inline(always)]
    fn count(&mut self, stat: StatIndex) {
        bump(stat);
    }
}

/// Picks the backend for a new connection (or datagram) of `client` to `frontend` from
/// `backends`: see `proxy_common::select::select_backend`.
#[inline(always)]
pub fn select_backend<B: BackendEntry + 'static>(
    frontend: &FrontendValue,
    client: impl FnOnce() -> u64,
    flow_hash: impl FnOnce() -> Option<u32>,
    socket: Option<u64>,
    backends: &Array<B>,
) -> Decision<B> {
    proxy_common::select::select_backend(
        &mut Maps { backends },
        frontend,
        client,
        flow_hash,
        socket,
    )
}
