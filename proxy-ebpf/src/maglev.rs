//! `--lb-algorithm maglev` for the tc programs: a new flow's backend is the entry of the
//! frontend's Maglev table (built by the agent) at slot `hash(5-tuple) % maglev_size`. The same
//! tuple always hashes to the same slot, so after a change of backends a flow keeps its backend
//! unless the table moved that slot (few slots move: see the agent's `maglev` module).

use proxy_common::{FrontendValue, MAGLEV_BLOCK_SLOTS, MaglevKey};

use crate::maps::KPR_MAGLEV;

/// The flow hash is shared with `inspect explain`, which must name the same slot.
pub use proxy_common::maglev::flow_hash;

/// The backend id at the flow's slot of the frontend's live table, if the frontend has one.
#[inline(always)]
pub fn backend_id(frontend: &FrontendValue, hash: u32) -> Option<u32> {
    let slot = hash.checked_rem(frontend.maglev_size)?;
    let key = MaglevKey {
        service_id: frontend.service_id,
        block: slot / MAGLEV_BLOCK_SLOTS,
        generation: frontend.generation,
        _pad: [0; 3],
    };
    // SAFETY: the value is plain integers, read at once; the agent writes whole values.
    let block = unsafe { KPR_MAGLEV.get(key) }?;
    block
        .backend_ids
        .get((slot % MAGLEV_BLOCK_SLOTS) as usize)
        .copied()
}
