//! Maglev table sizes and the flow hash: the agent's configuration validates the sizes, the
//! agent's table builder and the tc programs use them, and the tc programs and `inspect explain`
//! must hash a flow to the same slot, so they live below both.

/// The default table size: a prime well above the backend counts Services have, small enough
/// that a table (4 bytes per slot) stays a few KiB per frontend. Cilium's default is 16381.
pub const DEFAULT_TABLE_SIZE: u32 = 1021;

/// The largest table size accepted (Cilium's largest, 2^17 - 1): a table is rebuilt and
/// rewritten in full on every change of its frontend, one map update per slot.
pub const MAX_TABLE_SIZE: u32 = 131_071;

/// Whether `m` is usable as a table size (a prime ≥ 3: the permutation's skip must be coprime
/// with `m` for every backend to visit every slot).
pub fn is_valid_table_size(m: u32) -> bool {
    m >= 3
        && (2..)
            .take_while(|d: &u32| d * d <= m)
            .all(|d| !m.is_multiple_of(d))
}

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
// Not inlined: keeps the tc programs' `new_flow` body small for LLVM's BPF backend (a
// BPF-to-BPF call).
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

#[cfg(test)]
mod tests {
    use super::flow_hash;

    /// Every field of the tuple moves the hash: a field left out would put all flows that
    /// differ only in it on one backend.
    #[test]
    fn each_field_of_the_tuple_moves_the_flow_hash() {
        let src = [u32::from_be_bytes([10, 0, 0, 1]), 0, 0, 0];
        let dst = [u32::from_be_bytes([10, 96, 0, 10]), 0, 0, 0];
        let ports = (40_000u32 << 16) | 80;
        let h = flow_hash(&src, &dst, ports, 6);
        assert_eq!(h, flow_hash(&src, &dst, ports, 6));
        assert_ne!(h, flow_hash(&src, &dst, ports, 17));
        assert_ne!(h, flow_hash(&dst, &src, ports, 6));
        assert_ne!(h, flow_hash(&src, &dst, ports + 1, 6));
    }
}
