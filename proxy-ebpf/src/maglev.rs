//! `--lb-algorithm maglev` for the tc programs: a new flow's backend is the entry of the
//! frontend's Maglev table (built by the agent) at slot `hash(5-tuple) % maglev_size`. The same
//! tuple always hashes to the same slot, so after a change of backends a flow keeps its backend
//! unless the table moved that slot (few slots move: see the agent's `maglev` module).

use proxy_common::{FrontendValue, MAGLEV_BLOCK_SLOTS, MaglevKey};

use crate::maps::KPR_MAGLEV;

/// Murmur3's 32-bit block mix.
#[inline(always)]
fn mix(h: u32, word: u32) -> u32 {
    let k = word
        .wrapping_mul(0xcc9e_2d51)
        .rotate_left(15)
        .wrapping_mul(0x1b87_3593);
    (h ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

/// A hash of the flow's 5-tuple (addresses as the packet carries them, ports packed into one
/// word). Our own rather than `bpf_get_hash_recalc`: the skb hash may come from the NIC or
/// include the IPv6 flow label, which a host changes on TCP retransmission timeouts, so it is
/// not the same for every packet of a flow.
// Not inlined: keeps `new_flow`'s body small for LLVM's BPF backend (see `tc::new_flow`).
#[inline(never)]
pub fn flow_hash(src: &[u32; 4], dst: &[u32; 4], ports: u32, proto: u8) -> u32 {
    // Spelled out: a loop over both arrays (`chain`) compiles to pointer arithmetic the
    // verifier cannot bound ("invalid read from stack").
    let mut h = mix(u32::from(proto), src[0]);
    h = mix(h, src[1]);
    h = mix(h, src[2]);
    h = mix(h, src[3]);
    h = mix(h, dst[0]);
    h = mix(h, dst[1]);
    h = mix(h, dst[2]);
    h = mix(h, dst[3]);
    h = mix(h, ports);
    // Murmur3's finaliser: every input bit affects the low bits the modulo uses.
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

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
