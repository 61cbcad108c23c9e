//! Address and port rewrites with incremental checksum updates (RFC 1624): the IPv4 header
//! checksum in place, the L4 checksum through the kernel's `bpf_l4_csum_replace`, which also
//! handles `CHECKSUM_PARTIAL` skbs (packets from a local stack over veth carry only the
//! pseudo-header sum in the L4 field) and `skb->csum` of `CHECKSUM_COMPLETE` ones.
//! SCTP has no pseudo-header (its CRC32c covers only the SCTP packet): address rewrites leave
//! it alone, port rewrites are in `sctp`.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    cty::c_long,
    helpers::bpf_csum_update,
    programs::TcContext,
};
use proxy_common::proto;

use crate::parse::{ETH_HLEN, Frame, Packet, linear_at, load};

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

/// The new source and destination of a TCP or UDP packet; an address is written only with its
/// flag. Flags rather than `Option<&_>`: LLVM folds such an option's test into arithmetic on the
/// map-value pointer, which the verifier refuses.
pub struct Rewrite<'a> {
    pub src: &'a [u32; 4],
    pub new_src: bool,
    pub dst: &'a [u32; 4],
    pub new_dst: bool,
    pub sport: u16,
    pub dport: u16,
}

/// Rewrites a TCP or UDP packet's addresses and ports in place and fixes its checksums with two
/// helper calls at most, where one address or port at a time took two each (an established
/// flow's both halves: six). The IPv4 header checksum is updated in place by RFC 1624: it
/// covers only the header, so `skb->csum` of a CHECKSUM_COMPLETE skb (the sum of the whole
/// packet) is unchanged by an address and its compensating header checksum, as
/// `bpf_l3_csum_replace` leaves it. The L4 checksum takes the addresses' change as one
/// pseudo-header difference and the ports' as another: a CHECKSUM_PARTIAL skb's field holds
/// only the pseudo-header sum, so the helper must apply the first and not the second, which one
/// call with one set of flags cannot say.
#[inline(always)]
pub fn rewrite_tuple(ctx: &TcContext, pkt: &Packet, to: &Rewrite) -> Result<(), c_long> {
    let v6 = pkt.is_v6();
    let mut addr_sum = 0u32;
    if to.new_src {
        addr_sum = address_sum(addr_sum, &pkt.src, to.src, v6);
        write_address(ctx, pkt.src_offset(), to.src, v6)?;
    }
    if to.new_dst {
        addr_sum = address_sum(addr_sum, &pkt.dst, to.dst, v6);
        write_address(ctx, pkt.dst_offset(), to.dst, v6)?;
    }
    let mut port_sum = 0u32;
    let ports = to.sport != pkt.sport || to.dport != pkt.dport;
    if to.sport != pkt.sport {
        port_sum = sum_port(port_sum, pkt.sport, to.sport);
        write(ctx, pkt.l4, &to.sport)?;
    }
    if to.dport != pkt.dport {
        port_sum = sum_port(port_sum, pkt.dport, to.dport);
        write(ctx, pkt.l4 + 2, &to.dport)?;
    }
    let addresses = to.new_src || to.new_dst;
    if addresses && !v6 {
        let check = load::<u16, _>(ctx, IPV4_CSUM).ok_or(-1)?;
        write(ctx, IPV4_CSUM, &fold(u32::from(!check) + addr_sum))?;
    }
    let flags = l4_flags(pkt);
    if addresses {
        let pseudo = u64::from(BPF_F_PSEUDO_HDR) | flags;
        if !v6 || l4_csum_ipv6_flag() {
            let ipv6 = if v6 { BPF_F_IPV6 } else { 0 };
            // Size 0: the value is a checksum difference.
            ctx.l4_csum_replace(pkt.l4_csum_offset(), 0, u64::from(addr_sum), pseudo | ipv6)?;
        } else {
            // The address and the L4 checksum change by opposite amounts, so the packet's
            // one's-complement sum (`skb->csum` of a CHECKSUM_COMPLETE skb) stays as it was:
            // IPv6 has no header checksum to move it. Without `BPF_F_IPV6` the helper adjusts
            // `skb->csum` as for IPv4, and a NIC that sums packets then logs "hw csum
            // failure"; so kernels without the flag get the adjustment taken back with
            // `bpf_csum_update` (a no-op on other skbs), as Cilium does. A zero UDP checksum
            // (invalid over IPv6, yet possible) is left alone by the helper
            // (`BPF_F_MARK_MANGLED_0`): nothing to take back then.
            let untouched = pkt.proto == proto::UDP && ctx.load::<u16>(pkt.l4_csum_offset())? == 0;
            ctx.l4_csum_replace(pkt.l4_csum_offset(), 0, u64::from(addr_sum), pseudo)?;
            if !untouched {
                // SAFETY: the helper only reads and writes the skb the program was given.
                unsafe { bpf_csum_update(ctx.skb.skb, addr_sum) };
            }
        }
    }
    if ports {
        ctx.l4_csum_replace(pkt.l4_csum_offset(), 0, u64::from(port_sum), flags)?;
    }
    Ok(())
}

/// Adds an address's change from `old` to `new` to `sum` (one word for IPv4, four for IPv6).
#[inline(always)]
fn address_sum(mut sum: u32, old: &[u32; 4], new: &[u32; 4], v6: bool) -> u32 {
    sum = sum_word(sum, old[0], new[0]);
    if v6 {
        sum = sum_word(sum, old[1], new[1]);
        sum = sum_word(sum, old[2], new[2]);
        sum = sum_word(sum, old[3], new[3]);
    }
    sum
}

/// Writes an address in place: its one word (IPv4) or four (IPv6).
#[inline(always)]
fn write_address(ctx: &TcContext, offset: usize, new: &[u32; 4], v6: bool) -> Result<(), c_long> {
    if v6 {
        write(ctx, offset, new)
    } else {
        write(ctx, offset, &new[0])
    }
}

/// Replaces an address (at `offset`) that no L4 checksum in the packet covers — a later
/// fragment's (no L4 header: the pseudo-header's change is in its first fragment's checksum,
/// fixed there) or an SCTP packet's (its CRC32c has no pseudo-header; ports:
/// `sctp::replace_ports`) — and fixes the IPv4 header checksum.
#[inline(always)]
pub fn replace_addr_outside_l4(
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
