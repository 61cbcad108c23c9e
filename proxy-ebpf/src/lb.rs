//! Service lookup and backend selection (frontend → slot → backend).

use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{Backend4, BackendSlotKey, Frontend4Key, FrontendValue};

use crate::maps::{KPR_BACKEND_SLOTS, KPR_BACKENDS4, KPR_FRONTENDS4};

/// What to do with a connection to an address.
pub enum Decision {
    /// Not a service address: leave the socket alone.
    NotAService,
    /// A service without usable backends: refuse like kube-proxy's REJECT.
    NoBackends,
    /// The frontend's slot or backend vanished between lookups.
    BackendMissing,
    Backend(Backend4),
}

#[inline(always)]
pub fn lookup_frontend(key: &Frontend4Key) -> Option<FrontendValue> {
    // SAFETY: hash map values are copied out immediately; the agent replaces frontend values
    // with whole-value updates, so a copy is always one complete value.
    unsafe { KPR_FRONTENDS4.get(key) }.copied()
}

/// Picks a backend uniformly at random, like kube-proxy's iptables `statistic` rules do per
/// connection.
#[inline(always)]
pub fn select_backend(key: &Frontend4Key) -> Decision {
    let Some(frontend) = lookup_frontend(key) else {
        return Decision::NotAService;
    };
    if frontend.backend_count == 0 {
        return Decision::NoBackends;
    }
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    let random = unsafe { bpf_get_prandom_u32() };
    let slot_key = BackendSlotKey {
        service_id: frontend.service_id,
        slot: (random % u32::from(frontend.backend_count)) as u16,
        generation: frontend.generation,
        _pad: 0,
    };
    // SAFETY: see lookup_frontend; values are plain integers copied out at once.
    let Some(backend_id) = (unsafe { KPR_BACKEND_SLOTS.get(slot_key) }).copied() else {
        return Decision::BackendMissing;
    };
    // SAFETY: as above.
    match unsafe { KPR_BACKENDS4.get(backend_id) } {
        Some(backend) => Decision::Backend(*backend),
        None => Decision::BackendMissing,
    }
}
