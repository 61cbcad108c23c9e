//! Packet parsing for the tc and XDP programs: Ethernet → IPv4/IPv6 (a fragment header
//! included) → TCP/UDP/SCTP ports, a later fragment's from its first (`fragments`).
//!
//! The headers `parse` reads (IP header, ports, TCP flags) are read in place: direct packet
//! access, one bounds check against `data_end` per header instead of a `bpf_skb_load_bytes`
//! call (and its copy) per field. A packet whose headers a driver left outside the linear area
//! has them pulled in first (`bpf_skb_pull_data`, as Cilium does). The rarer paths (later
//! fragments, the fragment test) still load through the helper. The XDP program parses the same
//! way ([`parse_whole`]: no pull, no fragments, no SCTP).

use aya_ebpf::{
    EbpfContext,
    helpers::bpf_skb_load_bytes,
    programs::{TcContext, XdpContext},
};
use proxy_common::{StatIndex, family, proto};

pub use crate::packet::{ETH_HLEN, Packet};
use crate::{fragments, maps::scratch, stats::bump};

pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
const IPV6_HLEN: usize = 40;
/// IPv6's fragment extension header: its next-header value and length.
const IPPROTO_FRAGMENT: u8 = 44;
const FRAGMENT_HLEN: usize = 8;

/// A packet that direct packet access reads, and the interface it arrived on: an skb (tc) or
/// an XDP buffer. What a new flow needs of either (`tc::new_flow`).
pub trait Frame: EbpfContext {
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
    /// The interface the packet came in on (the start of a fib lookup).
    fn ingress_ifindex(&self) -> u32;
    /// The interface the program runs on (tc's `skb->ifindex`; in XDP the ingress one).
    fn ifindex(&self) -> u32;
    /// Copies the frame's source MAC into `mac` (map memory); false if the frame is too
    /// short.
    fn source_mac(&self, mac: &mut [u8; 6]) -> bool;
}

impl Frame for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: the context pointer is the program's own __sk_buff.
        unsafe { (*self.skb.skb).ingress_ifindex }
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn source_mac(&self, mac: &mut [u8; 6]) -> bool {
        // SAFETY: `mac` is 6 writable bytes; the context pointer is the program's own
        // __sk_buff. The raw helper, for a constant length straight into map memory
        // (`load_bytes` clamps the length to the packet, which the verifier then sees as
        // possibly zero).
        unsafe { bpf_skb_load_bytes(self.skb.skb.cast(), 6, mac.as_mut_ptr().cast(), 6) == 0 }
    }
}

impl Frame for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }

    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: the context pointer is the program's own xdp_md.
        unsafe { (*self.ctx).ingress_ifindex }
    }

    #[inline(always)]
    fn ifindex(&self) -> u32 {
        Frame::ingress_ifindex(self)
    }

    #[inline(always)]
    fn source_mac(&self, mac: &mut [u8; 6]) -> bool {
        let Some(at) = linear_at(self, 6, 6) else {
            return false;
        };
        // SAFETY: `linear_at` checked the 6 bytes against `data_end`.
        *mac = unsafe { read(at, 0) };
        true
    }
}

/// Parses a TCP, UDP or SCTP packet of one family (`V6`; all three start with the two ports),
/// the first fragment of a TCP or UDP datagram included (`Packet::first_fragment`: the caller
/// remembers its ports for the rest once it knows the flow, `fragments`); `None` for anything the tc programs leave to the kernel (the other
/// family, other protocols, SCTP fragments, IPv6 extension headers other than a fragment
/// header) and for later fragments, which [`parse_later_fragment`] parses. A TCP, UDP or SCTP
/// header cut short before its ports (and TCP's flags) is counted (`tc_truncated_header`): the
/// stack drops it as malformed, whoever it was for.
#[inline(always)]
pub fn parse<const V6: bool>(ctx: &TcContext) -> Option<&'static Packet> {
    pull_headers::<V6>(ctx);
    let (pkt, fragment, _) = ip_header::<V6, _>(ctx)?;
    // SCTP fragments stay with the stack: a port rewrite's CRC32c delta needs the whole
    // packet.
    if fragment == Fragment::Later || (fragment == Fragment::First && pkt.proto == proto::SCTP) {
        return None;
    }
    let parsed = with_ports(ctx, pkt);
    if parsed.is_none() {
        bump(StatIndex::TcTruncatedHeader);
    }
    parsed
}

/// Parses a whole (unfragmented) TCP or UDP packet of one family for the XDP program; `None`
/// for everything it leaves to tc: fragments (tc must see every fragment of a datagram), SCTP
/// (its CRC32c update needs the skb helpers), whatever [`parse`] leaves alone, and a frame
/// whose headers are not all in its first buffer. XDP has nothing to pull: a multi-buffer
/// frame (`xdp.frags`) shows its first buffer to direct packet access, and the headers the
/// program reads and rewrites, the L4 checksum included, must be there (as they are in any
/// first buffer a driver fills, a page or at least the headers a header-split NIC puts
/// apart; veth's is a page).
#[inline(always)]
pub fn parse_whole<const V6: bool>(ctx: &XdpContext) -> Option<&'static Packet> {
    let (pkt, fragment, _) = ip_header::<V6, _>(ctx)?;
    if fragment != Fragment::None || pkt.proto == proto::SCTP {
        return None;
    }
    // TCP's fixed header or UDP's, whose checksums `xdp::rewrite` updates. Checked here,
    // where `pkt.l4` is still the bounded value the IP header gave (from the scratch slot it
    // is unbounded for the verifier).
    let l4_header = if pkt.proto == proto::TCP { 20 } else { 8 };
    linear_at(ctx, pkt.l4, l4_header)?;
    with_ports(ctx, pkt)
}

/// `pkt` with its ports and TCP flags read, moved into the scratch slot.
#[inline(always)]
fn with_ports<C: Frame>(ctx: &C, mut pkt: Packet) -> Option<&'static Packet> {
    // The ports, and TCP's flags in byte 13.
    let tcp = pkt.proto == proto::TCP;
    let l4 = linear_at(ctx, pkt.l4, if tcp { 14 } else { 4 })?;
    // SAFETY: `linear_at` checked the bytes read against `data_end`.
    unsafe {
        pkt.sport = read(l4, 0);
        pkt.dport = read(l4, 2);
        if tcp {
            pkt.tcp_flags = read(l4, 13);
        }
    }
    into_scratch(pkt)
}

/// The most header bytes `parse` reads: Ethernet, the largest IP header it parses (IPv4 with
/// options; IPv6 with a fragment header) and 14 bytes of TCP header (up to its flags).
const HEADERS_MAX4: u32 = (ETH_HLEN + 60 + 14) as u32;
const HEADERS_MAX6: u32 = (ETH_HLEN + IPV6_HLEN + FRAGMENT_HLEN + 14) as u32;

/// Makes the headers `parse` reads part of the skb's linear area, where direct packet access
/// reaches, if a driver left some of them in page fragments (`bpf_skb_pull_data`, as Cilium
/// does; nothing for the usual skb, whose headers the driver pulled).
// One pull up front, not one per header: the verifier walks the pulled and the unpulled skb as
// one state from here on, where a pull per header doubled its states per header.
#[inline(always)]
fn pull_headers<const V6: bool>(ctx: &TcContext) {
    // Only as much as the packet has: a short packet, all in the linear area, needs no pull
    // (and a pull past its end fails).
    let want = if V6 { HEADERS_MAX6 } else { HEADERS_MAX4 }.min(ctx.len());
    // A comparison, not a length: the verifier allows no arithmetic between `data` and
    // `data_end`.
    if ctx.data() + want as usize > ctx.data_end() {
        let _ = ctx.pull_data(want);
    }
}

/// The address of the `len` bytes at `offset` in the linear area (see [`pull_headers`]),
/// checked against `data_end` so that the verifier allows direct reads and writes of them.
/// `None`: they are not there (the packet is shorter). Take it again after a helper that moves
/// the data (`bpf_l3/l4_csum_replace`, `bpf_skb_store_bytes`).
#[inline(always)]
pub fn linear_at<C: Frame>(ctx: &C, offset: usize, len: usize) -> Option<usize> {
    let at = ctx.data() + offset;
    if at + len > ctx.data_end() {
        return None;
    }
    Some(at)
}

/// The value of type `T` at `offset` (a header field `parse` found, within its first 128
/// bytes), read in place; `None` if it is not in the linear area.
#[inline(always)]
pub fn load<T: Copy, C: Frame>(ctx: &C, offset: usize) -> Option<T> {
    // Offsets from the parsed packet in map memory are unbounded for the verifier.
    if offset > 128 {
        return None;
    }
    let at = linear_at(ctx, offset, core::mem::size_of::<T>())?;
    // SAFETY: checked against `data_end` by `linear_at`.
    Some(unsafe { read(at, 0) })
}

/// `pkt` moved into the per-CPU scratch slot, where the program reads it from: as the
/// verifier sees values loaded from memory, fields of their width and nothing more. Kept in
/// registers and on the stack, fields read from the packet carry bounds and links through the
/// whole program, which make the verifier tell apart states it could otherwise prune (the
/// IPv6 programs went from 637k verified instructions to over the limit of 1M); and the main
/// frame would hold the packet, within the 512 bytes all frames share.
#[inline(always)]
fn into_scratch(pkt: Packet) -> Option<&'static Packet> {
    let scratch = scratch()?;
    // SAFETY: the per-CPU slot is ours until the program ends, and only `parse` writes
    // `packet`. Volatile, so that LLVM does not forward the stored fields to the reads.
    unsafe {
        core::ptr::write_volatile(&raw mut (*scratch).packet, pkt);
        Some(&(*scratch).packet)
    }
}

/// A value of type `T` at `offset` from `at` (a packet address from [`linear_at`]), as it is in
/// the packet (network byte order).
///
/// # Safety
/// `at + offset + size_of::<T>()` must be within what `linear_at` checked.
#[inline(always)]
pub unsafe fn read<T: Copy>(at: usize, offset: usize) -> T {
    // SAFETY: in bounds by the caller's contract; unaligned, as header fields can be (the
    // kernel allows unaligned packet loads where the CPU does, and the verifier checks them).
    unsafe { core::ptr::read_unaligned((at + offset) as *const T) }
}

/// Parses a later fragment of a TCP or UDP datagram (no L4 header) with the ports its first
/// fragment carried (`fragments`); `None` for any other packet, and for a later fragment whose
/// first fragment was not seen (counted there).
// Kept apart from `parse` and called only where a packet is not otherwise parsed: a fragment
// kind carried through the whole program would double the states the verifier walks.
#[inline(always)]
pub fn parse_later_fragment<const V6: bool>(ctx: &TcContext) -> Option<&'static Packet> {
    pull_headers::<V6>(ctx);
    let (mut pkt, fragment, id) = ip_header::<V6, _>(ctx)?;
    if fragment != Fragment::Later || pkt.proto == proto::SCTP {
        return None;
    }
    (pkt.sport, pkt.dport) = match fragments::later::<V6>(ctx, id, pkt.proto) {
        0 => return None,
        ports => split_ports(ports),
    };
    pkt.later_fragment = true;
    into_scratch(pkt)
}

/// Whether the packet is a later fragment of a datagram (an offset): the cheap test before
/// handing it to the fragment programs.
#[inline(always)]
pub fn is_later_fragment<const V6: bool>(ctx: &TcContext) -> bool {
    let Ok(ethertype) = ctx.load::<u16>(12) else {
        return false;
    };
    match u16::from_be(ethertype) {
        ETH_P_IP if !V6 => ctx
            .load::<u16>(ETH_HLEN + 6)
            .is_ok_and(|frag| u16::from_be(frag) & 0x1fff != 0),
        ETH_P_IPV6 if V6 => {
            ctx.load::<u8>(ETH_HLEN + 6) == Ok(IPPROTO_FRAGMENT)
                && ctx
                    .load::<u16>(ETH_HLEN + IPV6_HLEN + 2)
                    .is_ok_and(|offset_more| u16::from_be(offset_more) >> 3 != 0)
        }
        _ => false,
    }
}

/// The source and destination port of a word loaded from the L4 header as it is in the packet.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the halves of a word loaded as it is in the packet"
)]
fn split_ports(ports: u32) -> (u16, u16) {
    (ports as u16, (ports >> 16) as u16)
}

/// Whether a packet is an IP fragment, and which.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fragment {
    /// A whole datagram.
    None,
    /// The first fragment: it carries the L4 header.
    First,
    /// A later fragment: no L4 header.
    Later,
}

impl Fragment {
    /// From the offset and the more-fragments flag.
    fn of(offset: u16, more: bool) -> Self {
        match (offset, more) {
            (0, false) => Self::None,
            (0, true) => Self::First,
            _ => Self::Later,
        }
    }
}

/// The IP header of a TCP, UDP or SCTP packet (the packet without its ports and TCP flags:
/// the L4 header is where it would be), and the datagram's fragment kind and ID.
#[inline(always)]
fn ip_header<const V6: bool, C: Frame>(ctx: &C) -> Option<(Packet, Fragment, u32)> {
    let eth = linear_at(ctx, 0, ETH_HLEN)?;
    // SAFETY: the Ethernet header is checked (`linear_at`).
    let ethertype = u16::from_be(unsafe { read::<u16>(eth, 12) });
    match ethertype {
        ETH_P_IP if !V6 => ip_header4(ctx),
        ETH_P_IPV6 if V6 => ip_header6(ctx),
        _ => None,
    }
}

#[inline(always)]
fn ip_header4<C: Frame>(ctx: &C) -> Option<(Packet, Fragment, u32)> {
    let ip = linear_at(ctx, ETH_HLEN, 20)?;
    // SAFETY: the 20 bytes of the fixed header are checked (`linear_at`).
    let (version_ihl, proto, frag, id) = unsafe {
        (
            read::<u8>(ip, 0),
            read::<u8>(ip, 9),
            u16::from_be(read::<u16>(ip, 6)),
            read::<u16>(ip, 4),
        )
    };
    if version_ihl >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(version_ihl & 0x0f) * 4;
    if ihl < 20 || !is_translated(proto) {
        return None;
    }
    // Flags (reserved, DF, MF) and the offset in 8-byte units.
    let fragment = Fragment::of(frag & 0x1fff, frag & 0x2000 != 0);
    let id = match fragment {
        Fragment::None => 0,
        _ => u32::from(id),
    };
    // SAFETY: as above.
    let (src, dst) = unsafe { (read::<u32>(ip, 12), read::<u32>(ip, 16)) };
    let pkt = Packet {
        family: family::V4,
        proto,
        l4: ETH_HLEN + ihl,
        src: [src, 0, 0, 0],
        dst: [dst, 0, 0, 0],
        sport: 0,
        dport: 0,
        tcp_flags: 0,
        later_fragment: false,
        first_fragment: fragment == Fragment::First,
        fragment_id: id,
    };
    Some((pkt, fragment, id))
}

#[inline(always)]
fn ip_header6<C: Frame>(ctx: &C) -> Option<(Packet, Fragment, u32)> {
    let ip = linear_at(ctx, ETH_HLEN, IPV6_HLEN)?;
    // SAFETY: the fixed header is checked (`linear_at`).
    let (version, mut next_header) = unsafe { (read::<u8>(ip, 0), read::<u8>(ip, 6)) };
    if version >> 4 != 6 {
        return None;
    }
    // Only TCP/UDP/SCTP directly after the fixed header, or after a fragment header: walking
    // other extension headers needs a bounded loop per header type, and Service traffic does
    // not use them.
    let mut l4 = ETH_HLEN + IPV6_HLEN;
    let mut fragment = Fragment::None;
    let mut id = 0;
    if next_header == IPPROTO_FRAGMENT {
        let header = linear_at(ctx, l4, FRAGMENT_HLEN)?;
        // Next header, reserved, offset (13 bits) and M flag, identification.
        // SAFETY: the fragment header is checked (`linear_at`).
        let offset_more = unsafe {
            next_header = read(header, 0);
            id = read::<u32>(header, 4);
            u16::from_be(read::<u16>(header, 2))
        };
        fragment = Fragment::of(offset_more >> 3, offset_more & 1 != 0);
        l4 += FRAGMENT_HLEN;
    }
    if !is_translated(next_header) {
        return None;
    }
    // SAFETY: as above (the fixed header).
    let (src, dst) = unsafe { (read::<[u32; 4]>(ip, 8), read::<[u32; 4]>(ip, 24)) };
    let pkt = Packet {
        family: family::V6,
        proto: next_header,
        l4,
        src,
        dst,
        sport: 0,
        dport: 0,
        tcp_flags: 0,
        later_fragment: false,
        first_fragment: fragment == Fragment::First,
        fragment_id: id,
    };
    Some((pkt, fragment, id))
}

#[inline(always)]
fn is_translated(protocol: u8) -> bool {
    protocol == proto::TCP || protocol == proto::UDP || protocol == proto::SCTP
}
