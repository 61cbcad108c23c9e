//! The tc entry programs' first test, before any hash lookup or tail call: whether a packet can
//! be a Service flow's at all. Most of a node's traffic is not (pod to pod, the node's own
//! connections), and the reply program sits on every pod's veth, so what such a packet costs is
//! what the node pays for having the programs attached.
//!
//! Ingress: a TCP, UDP or SCTP packet (whole, or a datagram's first fragment) passes on when
//! neither its destination port is a frontend's nor its source port a backend's
//! (`KPR_PORT_FILTER`, one array lookup, which the verifier turns into an address computation)
//! and its destination port is outside the SNAT range (a remote backend's reply). Everything
//! else takes the whole path: later fragments (no ports), ICMP (errors about flows), IPv6
//! extension headers, loopback destinations (dropped there), headers outside the linear area.
//!
//! XDP (`kpr_xdp_external`) asks the same before its conntrack lookup.
//!
//! Egress: the programs only finish what an ingress program started (`TRANSLATED_MARK`) or
//! answer for the node's own host-network backends (packets the node sent itself) and translate
//! ICMP errors; a forwarded TCP, UDP or SCTP packet without the mark passes on.

use aya_ebpf::programs::TcContext;
use proxy_common::{TRANSLATED_MARK, proto};

use crate::{
    conntrack::in_snat_range,
    maps::KPR_PORT_FILTER,
    parse::{ETH_HLEN, Frame, linear_at, read},
};

const IPV4_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;

/// Whether an ingress program (tc, or XDP, which then passes it to tc) may leave the packet
/// to the stack without looking further.
#[inline(always)]
pub fn ingress_passes<C: Frame>(ctx: &C, v6: bool) -> bool {
    let Some((source, destination)) = ports(ctx, v6) else {
        return false;
    };
    let Some(filter) = KPR_PORT_FILTER.get(0) else {
        return false;
    };
    !filter.wants(u16::from_be(source), u16::from_be(destination)) && !in_snat_range(destination)
}

/// Whether the egress program may leave the packet to the stack without looking further: a
/// forwarded (received, not sent by the node) TCP, UDP or SCTP packet no ingress program
/// translated.
#[inline(always)]
pub fn egress_passes(ctx: &TcContext, v6: bool) -> bool {
    // SAFETY: the context pointer is the program's own __sk_buff.
    let (ingress_ifindex, mark) = unsafe { ((*ctx.skb.skb).ingress_ifindex, (*ctx.skb.skb).mark) };
    ingress_ifindex != 0 && mark & TRANSLATED_MARK == 0 && carries_l4(ctx, v6)
}

/// The source and destination port (network order) of a TCP, UDP or SCTP packet whose headers
/// are in the linear area, unless it is a later fragment or addressed to a loopback address.
#[inline(always)]
fn ports<C: Frame>(ctx: &C, v6: bool) -> Option<(u16, u16)> {
    let l4 = if v6 {
        let ip = linear_at(ctx, ETH_HLEN, IPV6_HLEN + 4)?;
        // SAFETY: `linear_at` checked the IPv6 header and 4 bytes past it.
        let (next, dst_high, dst_low) =
            unsafe { (read::<u8>(ip, 6), read::<u64>(ip, 24), read::<u64>(ip, 32)) };
        if !is_l4(next) || (dst_high == 0 && u64::from_be(dst_low) == 1) {
            return None;
        }
        ip + IPV6_HLEN
    } else {
        let ip = linear_at(ctx, ETH_HLEN, IPV4_HLEN)?;
        // SAFETY: `linear_at` checked the fixed IPv4 header.
        let (version_ihl, fragment, protocol, dst_first) = unsafe {
            (
                read::<u8>(ip, 0),
                read::<u16>(ip, 6),
                read::<u8>(ip, 9),
                read::<u8>(ip, 16),
            )
        };
        let header = usize::from(version_ihl & 0x0f) * 4;
        if version_ihl >> 4 != 4
            || header < IPV4_HLEN
            || u16::from_be(fragment) & 0x1fff != 0
            || !is_l4(protocol)
            || dst_first == 127
        {
            return None;
        }
        linear_at(ctx, ETH_HLEN + header, 4)?
    };
    // SAFETY: `linear_at` checked the 4 bytes at `l4` (past the IPv6 header, or at the IPv4
    // header's end).
    Some(unsafe { (read::<u16>(l4, 0), read::<u16>(l4, 2)) })
}

/// Whether the packet is TCP, UDP or SCTP (IPv6 without extension headers).
#[inline(always)]
fn carries_l4(ctx: &TcContext, v6: bool) -> bool {
    let (offset, len) = if v6 { (6, IPV6_HLEN) } else { (9, IPV4_HLEN) };
    let Some(ip) = linear_at(ctx, ETH_HLEN, len) else {
        return false;
    };
    // SAFETY: `linear_at` checked the fixed IP header.
    is_l4(unsafe { read::<u8>(ip, offset) })
}

#[inline(always)]
fn is_l4(protocol: u8) -> bool {
    protocol == proto::TCP || protocol == proto::UDP || protocol == proto::SCTP
}
