//! Address and port rewrites with incremental checksum updates (RFC 1624), via the kernel's
//! `bpf_l3_csum_replace`/`bpf_l4_csum_replace`, which also handle `CHECKSUM_PARTIAL` skbs
//! (packets from a local stack over veth carry only the pseudo-header sum in the L4 field).
//! SCTP has no pseudo-header (its CRC32c covers only the SCTP packet): address rewrites leave
//! it alone, port rewrites are in `sctp`.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    cty::c_long,
    helpers::{bpf_csum_diff, bpf_csum_update},
    programs::TcContext,
};
use proxy_common::proto;

use crate::parse::{ETH_HLEN, Frame, Packet, linear_at};

/// Offset of the IPv4 header checksum.
const IPV4_CSUM: usize = ETH_HLEN + 10;

/// `BPF_F_IPV6` of `bpf_l4_csum_replace` (kernel 6.16).
const BPF_F_IPV6: u64 = 1 << 7;

/// Set by the loader when the kernel knows `BPF_F_IPV6` (the `l4-csum-ipv6` feature probe).
/// A frozen read-only global: the verifier knows its value and prunes the other path.
#[unsafe(no_mangle)]
static KPR_L4_CSUM_IPV6: u8 = 0;

fn l4_csum_ipv6_flag() -> bool {
    // SAFETY: a read of a plain global the loader initialised.
    unsafe { core::ptr::read_volatile(&raw const KPR_L4_CSUM_IPV6) != 0 }
}

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
        write(ctx, offset, new)?;
        // The address and the L4 checksum change by opposite amounts, so the packet's
        // one's-complement sum — `skb->csum` of a CHECKSUM_COMPLETE skb — stays as it was
        // (IPv6 has no header checksum to move it, unlike IPv4). Without `BPF_F_IPV6` the
        // helper adjusts `skb->csum` by `diff` as for IPv4, and a NIC that sums packets then
        // logs "hw csum failure"; kernels without the flag get the adjustment taken back with
        // `bpf_csum_update` (a no-op on other skbs), as Cilium does.
        if l4_csum_ipv6_flag() {
            // Size 0: `diff` is a precomputed checksum difference.
            return ctx.l4_csum_replace(pkt.l4_csum_offset(), 0, diff as u64, pseudo | BPF_F_IPV6);
        }
        // A zero UDP checksum (invalid over IPv6, yet possible) is left alone by the helper
        // (`BPF_F_MARK_MANGLED_0`), so there is nothing to take back then.
        let untouched = pkt.proto == proto::UDP && ctx.load::<u16>(pkt.l4_csum_offset())? == 0;
        ctx.l4_csum_replace(pkt.l4_csum_offset(), 0, diff as u64, pseudo)?;
        if !untouched {
            // SAFETY: the helper only reads and writes the skb the program was given.
            unsafe { bpf_csum_update(ctx.skb.skb, diff as u32) };
        }
        Ok(())
    } else {
        write(ctx, offset, &new[0])?;
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

/// Replaces an address (at `offset`) of a later fragment, which has no L4 header: the
/// pseudo-header's change is in the L4 checksum of its first fragment, fixed there.
#[inline(always)]
pub fn replace_fragment_addr(
    ctx: &TcContext,
    pkt: &Packet,
    offset: usize,
    old: &[u32; 4],
    new: &[u32; 4],
) -> Result<(), c_long> {
    if pkt.is_v6() {
        // Nothing in the packet compensates (no IPv6 header checksum): the flag has the kernel
        // move `skb->csum` of a CHECKSUM_COMPLETE skb with it.
        return ctx.store(offset, new, u64::from(BPF_F_RECOMPUTE_CSUM));
    }
    ctx.store(offset, &new[0], 0)?;
    ctx.l3_csum_replace(IPV4_CSUM, u64::from(old[0]), u64::from(new[0]), 4)
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
    write(ctx, offset, &new)?;
    ctx.l4_csum_replace(
        pkt.l4_csum_offset(),
        u64::from(old),
        u64::from(new),
        l4_flags(pkt) | 2,
    )
}

/// Writes `value` at `offset` in place (direct packet access), where `bpf_skb_store_bytes`
/// would copy it in: the headers `parse` read are in the linear area (`parse::pull_headers`).
/// Only for writes the checksum helpers then account for (the helper's flags are not needed).
/// A program that writes packets directly gets an unclone prologue from the verifier (a cloned
/// skb is made private before the program runs), as `bpf_skb_store_bytes` unclones on its first
/// write. `Err`: the bytes are not in the linear area (not seen for a packet `parse` read).
#[inline(always)]
fn write<T: Copy>(ctx: &TcContext, offset: usize, value: &T) -> Result<(), c_long> {
    store(ctx, offset, value).ok_or(-1)
}

/// Writes `value` at `offset` in place (see [`write`]); `None`: the bytes are not in the
/// linear area.
#[inline(always)]
pub fn store<T: Copy, C: Frame>(ctx: &C, offset: usize, value: &T) -> Option<()> {
    // Offsets come from the parsed packet in map memory (`parse::into_scratch`), unbounded for
    // the verifier; every header field `parse` found is within its 128 bytes.
    if offset > 128 {
        return None;
    }
    // Taken again for every write: the checksum helpers between writes move the data.
    let at = linear_at(ctx, offset, core::mem::size_of::<T>())?;
    // SAFETY: in bounds of the linear area, checked above; unaligned, as header fields can be.
    unsafe { core::ptr::write_unaligned(at as *mut T, *value) };
    Some(())
}

/// RFC 1624 (eqn. 3) for a 32-bit word of data under a checksum: adds its change from `old`
/// to `new` to `sum`, a complemented checksum (`!check`) being updated, unfolded. Words as
/// loaded from the packet (byte-order independent, see [`add_words`]).
#[inline(always)]
pub fn sum_word(sum: u32, old: u32, new: u32) -> u32 {
    sum + (!old & 0xffff) + (!old >> 16) + (new & 0xffff) + (new >> 16)
}

/// [`sum_word`] for a 16-bit word (a port).
#[inline(always)]
pub fn sum_port(sum: u32, old: u16, new: u16) -> u32 {
    sum + u32::from(!old) + u32::from(new)
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
