//! Address and port rewrites with incremental checksum updates (RFC 1624), via the kernel's
//! `bpf_l3_csum_replace`/`bpf_l4_csum_replace`, which also handle `CHECKSUM_PARTIAL` skbs
//! (packets from a local stack over veth carry only the pseudo-header sum in the L4 field).
//! SCTP has no pseudo-header (its CRC32c covers only the SCTP packet): address rewrites leave
//! it alone, port rewrites are in `sctp`.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    cty::c_long,
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use proxy_common::proto;

use crate::parse::{ETH_HLEN, Packet};

/// Offset of the IPv4 header checksum.
const IPV4_CSUM: usize = ETH_HLEN + 10;

/// UDP over IPv4 may carry checksum 0 ("none"): the kernel leaves it so and turns a computed
/// 0 into 0xffff (`BPF_F_MARK_MANGLED_0`). TCP and UDP over IPv6 always have one.
fn l4_flags(pkt: &Packet) -> u64 {
    if pkt.proto == proto::UDP {
        u64::from(BPF_F_MARK_MANGLED_0)
    } else {
        0
    }
}

/// Replaces the address at `offset` (source or destination) and fixes the IPv4 header
/// checksum and the L4 checksum, whose pseudo-header covers both addresses (TCP, UDP).
#[inline(always)]
pub fn replace_addr(
    ctx: &TcContext,
    pkt: &Packet,
    offset: usize,
    old: &[u32; 4],
    new: &[u32; 4],
) -> Result<(), c_long> {
    let pseudo = u64::from(BPF_F_PSEUDO_HDR) | l4_flags(pkt);
    let sctp = pkt.proto == proto::SCTP;
    if pkt.is_v6() {
        if sctp {
            // Nothing else in the packet changes to compensate (no IPv6 header checksum, no
            // pseudo-header in the CRC), so the packet's one's-complement sum moves: the flag
            // has the kernel fix `skb->csum` of a CHECKSUM_COMPLETE skb.
            return ctx.store(offset, new, u64::from(BPF_F_RECOMPUTE_CSUM));
        }
        // 16-byte addresses: one checksum difference over the whole address.
        // SAFETY: both pointers are to 16-byte stack arrays; the helper only reads them.
        let diff =
            unsafe { bpf_csum_diff(old.as_ptr().cast_mut(), 16, new.as_ptr().cast_mut(), 16, 0) };
        if diff < 0 {
            return Err(diff);
        }
        ctx.store(offset, new, 0)?;
        // Size 0: `diff` is a precomputed checksum difference.
        ctx.l4_csum_replace(pkt.l4_csum_offset(), 0, diff as u64, pseudo)
    } else {
        ctx.store(offset, &new[0], 0)?;
        ctx.l3_csum_replace(IPV4_CSUM, u64::from(old[0]), u64::from(new[0]), 4)?;
        if sctp {
            return Ok(());
        }
        ctx.l4_csum_replace(
            pkt.l4_csum_offset(),
            u64::from(old[0]),
            u64::from(new[0]),
            pseudo | 4,
        )
    }
}

/// Replaces the port at `offset` and fixes the L4 checksum.
#[inline(always)]
pub fn replace_port(
    ctx: &TcContext,
    pkt: &Packet,
    offset: usize,
    old: u16,
    new: u16,
) -> Result<(), c_long> {
    ctx.store(offset, &new, 0)?;
    ctx.l4_csum_replace(
        pkt.l4_csum_offset(),
        u64::from(old),
        u64::from(new),
        l4_flags(pkt) | 2,
    )
}

/// Folds and complements a one's-complement sum (RFC 1071).
#[inline(always)]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// Adds packet words, loaded as native `u32`s, to a one's-complement sum. The sum is
/// byte-order independent (RFC 1071 §2(B)): summing the halves of native words and storing the
/// folded result with native byte order gives the right bytes on the wire. Whole `u32` words
/// (not byte slices) keep LLVM's BPF backend away from unaligned memcpy expansions.
#[inline(always)]
pub fn add_words<const N: usize>(mut sum: u32, words: &[u32; N]) -> u32 {
    let mut i = 0;
    while i < N {
        sum += (words[i] & 0xffff) + (words[i] >> 16);
        i += 1;
    }
    sum
}
