//! ICMP and ICMPv6 errors about packets of translated flows: destination unreachable (a
//! backend's closed UDP port), fragmentation needed / packet too big (a link on the path with
//! a smaller MTU), time exceeded, parameter problem. The error quotes the packet as its sender
//! saw it — translated — and the peer matches it to a socket by that quoted tuple, so it is
//! translated back as the flow's own packets are, quote and outer header, every checksum
//! included (netfilter does the same for related packets: `nf_nat_icmp_reply_translation`).
//! Without it path-MTU discovery through a NodePort black-holes and a UDP client of a closed
//! port waits for its timeout instead of ECONNREFUSED.
//!
//! Split like the flow's packets on the netfilter path, so the kernel's conntrack finds the
//! error related to the flow it knows (client ↔ backend) and a host firewall that drops
//! invalid packets lets it through:
//! - `ingress` (the external and pod interfaces): an error addressed to the sender of the
//!   quoted packet — a backend's or a router's about a forward packet (sent to the SNAT
//!   address), a client-side router's about a reply (sent to the frontend). The flow's entry
//!   is the one of the quoted packet reversed; the error's destination and the quote's source
//!   get the entry's destination (client or backend), the destination half. Both halves on
//!   the fast path and for `ct_flags::BYPASS` flows, whose packets the kernel never sees;
//!   such an error is then redirected as the flow's packets are (`nat::forward`).
//! - `egress`: the source half, for errors the stack routed after ingress, and for those the
//!   node itself sent (it forwards the flow's packets on the netfilter path, so it is the
//!   router that finds them too big for the next link). The quote reversed is the key of the
//!   flow's egress-side entry; the quote's destination gets that entry's source (the frontend
//!   for a forward packet, the SNAT address for a reply), and so does the error's source when
//!   the error came from that address (a backend answering for itself, as netfilter rewrites
//!   it).
//!
//! Left to the stack: errors in IP fragments, quotes with IPv4 options or IPv6 extension
//! headers, quotes of non-first fragments (no ports), errors about flows the kernel NATs
//! (`ct_flags::KERNEL_NAT`: its conntrack translates them).

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    programs::TcContext,
};
use proxy_common::{CtKey, CtValue, StatIndex, ct_flags, family, proto};

use crate::{
    conntrack::{self, View},
    csum::fold,
    nat::{self, Next, fast_path},
    parse::ETH_HLEN,
    stats::bump,
};

const NEXT: i32 = TC_ACT_UNSPEC;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
const ICMP_HLEN: usize = 8;
const IPV4_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;

/// An error message and the packet it quotes. Addresses and ports in network byte order, as
/// in `parse::Packet` (IPv4 in word 0).
struct Error {
    family: u8,
    /// Offsets of the ICMP header, the quoted IP header and the quoted L4 header.
    icmp: usize,
    inner: usize,
    inner_l4: usize,
    outer_src: [u32; 4],
    outer_dst: [u32; 4],
    src: [u32; 4],
    dst: [u32; 4],
    sport: u16,
    dport: u16,
    proto: u8,
}

impl Error {
    fn is_v6(&self) -> bool {
        self.family == family::V6
    }

    /// The key of the quoted packet's opposite direction: what the flow's entries are keyed by
    /// on the side the error goes to.
    fn reversed_key(&self) -> CtKey {
        CtKey {
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
            proto: self.proto,
            family: self.family,
            _pad: 0,
        }
    }
}

/// Ingress: the destination half (both halves on the fast path). Called for packets the
/// service path does not parse; anything but an error of a translated flow passes untouched.
#[inline(never)]
pub fn ingress<const V6: bool>(ctx: &TcContext) -> i32 {
    let Some(error) = parse::<V6>(ctx) else {
        return NEXT;
    };
    // Errors go to the quoted packet's sender; anything else is not about our translation.
    if error.outer_dst != error.src {
        return NEXT;
    }
    let key = error.reversed_key();
    let Some(flow) = conntrack::lookup::<V6>(&key, View::A) else {
        return NEXT;
    };
    if flow.flags & (ct_flags::EGRESS | ct_flags::KERNEL_NAT) != 0 {
        return NEXT;
    }
    let both = fast_path() || flow.flags & ct_flags::BYPASS != 0;
    let destination = flow.dst != key.dst || flow.dport != key.dport;
    if !destination && !both {
        return NEXT;
    }
    let result = rewrite(ctx, &error, flow, true, both);
    if !both || result.is_err() {
        return finish(result);
    }
    bump(StatIndex::TcIcmpErrorTranslated);
    // Both halves: the error now comes from the frontend, the node's own address for a
    // NodePort, which the stack drops as a martian source; it leaves as the flow's packets do.
    let protocol = if error.is_v6() {
        IPPROTO_ICMPV6
    } else {
        IPPROTO_ICMP
    };
    let next = match nat::route(ctx, error.family, protocol, flow) {
        // An error is at most 576 (IPv4) or 1280 (IPv6) bytes: a link that small is the
        // stack's.
        Next::TooBig(_) => Next::Stack,
        next => next,
    };
    nat::forward(ctx, flow, next)
}

/// Egress: the source half. `None` for packets that are not ICMP errors (the egress program
/// goes on with them).
#[inline(never)]
pub fn egress<const V6: bool>(ctx: &TcContext) -> Option<i32> {
    let error = parse::<V6>(ctx)?;
    let key = error.reversed_key();
    let Some(flow) = conntrack::lookup::<V6>(&key, View::A) else {
        return Some(NEXT);
    };
    // An egress-side entry: it leaves the destination as it is and rewrites the source.
    if flow.flags & (ct_flags::EGRESS | ct_flags::REPLY) == 0
        || flow.flags & ct_flags::KERNEL_NAT != 0
        || flow.dst != key.dst
        || flow.dport != key.dport
        || (flow.src == key.src && flow.sport == key.sport)
    {
        return Some(NEXT);
    }
    Some(finish(rewrite(ctx, &error, flow, false, true)))
}

fn finish(result: Result<(), ()>) -> i32 {
    match result {
        Ok(()) => {
            bump(StatIndex::TcIcmpErrorTranslated);
            NEXT
        }
        Err(()) => {
            // A half-rewritten error must not leave.
            bump(StatIndex::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn parse<const V6: bool>(ctx: &TcContext) -> Option<Error> {
    if V6 { parse6(ctx) } else { parse4(ctx) }
}

#[inline(always)]
fn parse4(ctx: &TcContext) -> Option<Error> {
    let version_ihl: u8 = ctx.load(ETH_HLEN).ok()?;
    if version_ihl >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(version_ihl & 0x0f) * 4;
    if ihl < IPV4_HLEN {
        return None;
    }
    let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?);
    if frag & 0x3fff != 0 || ctx.load::<u8>(ETH_HLEN + 9).ok()? != IPPROTO_ICMP {
        return None;
    }
    let icmp = ETH_HLEN + ihl;
    // Destination unreachable, time exceeded, parameter problem.
    let kind: u8 = ctx.load(icmp).ok()?;
    if kind != 3 && kind != 11 && kind != 12 {
        return None;
    }
    let inner = icmp + ICMP_HLEN;
    // A quote with IP options is left alone (its L4 header moves; not worth the code).
    if ctx.load::<u8>(inner).ok()? != 0x45 {
        return None;
    }
    // Only a first fragment (or a whole datagram) quotes ports.
    if u16::from_be(ctx.load::<u16>(inner + 6).ok()?) & 0x1fff != 0 {
        return None;
    }
    let proto: u8 = ctx.load(inner + 9).ok()?;
    if !is_translated(proto) {
        return None;
    }
    let inner_l4 = inner + IPV4_HLEN;
    Some(Error {
        family: family::V4,
        icmp,
        inner,
        inner_l4,
        outer_src: [ctx.load(ETH_HLEN + 12).ok()?, 0, 0, 0],
        outer_dst: [ctx.load(ETH_HLEN + 16).ok()?, 0, 0, 0],
        src: [ctx.load(inner + 12).ok()?, 0, 0, 0],
        dst: [ctx.load(inner + 16).ok()?, 0, 0, 0],
        sport: ctx.load(inner_l4).ok()?,
        dport: ctx.load(inner_l4 + 2).ok()?,
        proto,
    })
}

#[inline(always)]
fn parse6(ctx: &TcContext) -> Option<Error> {
    if ctx.load::<u8>(ETH_HLEN).ok()? >> 4 != 6
        || ctx.load::<u8>(ETH_HLEN + 6).ok()? != IPPROTO_ICMPV6
    {
        return None;
    }
    let icmp = ETH_HLEN + IPV6_HLEN;
    // Destination unreachable, packet too big, time exceeded, parameter problem.
    let kind: u8 = ctx.load(icmp).ok()?;
    if !(1..=4).contains(&kind) {
        return None;
    }
    let inner = icmp + ICMP_HLEN;
    if ctx.load::<u8>(inner).ok()? >> 4 != 6 {
        return None;
    }
    let proto: u8 = ctx.load(inner + 6).ok()?;
    if !is_translated(proto) {
        return None;
    }
    let inner_l4 = inner + IPV6_HLEN;
    Some(Error {
        family: family::V6,
        icmp,
        inner,
        inner_l4,
        outer_src: ctx.load(ETH_HLEN + 8).ok()?,
        outer_dst: ctx.load(ETH_HLEN + 24).ok()?,
        src: ctx.load(inner + 8).ok()?,
        dst: ctx.load(inner + 24).ok()?,
        sport: ctx.load(inner_l4).ok()?,
        dport: ctx.load(inner_l4 + 2).ok()?,
        proto,
    })
}

#[inline(always)]
fn is_translated(protocol: u8) -> bool {
    protocol == proto::TCP || protocol == proto::UDP || protocol == proto::SCTP
}

/// The one's-complement sum that turns a checksum over `old` into one over `new` (RFC 1624,
/// eqn. 3: the complement of each old 16-bit half plus each new one).
#[inline(always)]
fn change(sum: u32, old: &[u32; 4], new: &[u32; 4], words: usize) -> u32 {
    let mut sum = sum;
    let mut i = 0;
    while i < 4 && i < words {
        let gone = !old[i];
        sum += (gone & 0xffff) + (gone >> 16) + (new[i] & 0xffff) + (new[i] >> 16);
        i += 1;
    }
    sum
}

#[inline(always)]
fn change16(sum: u32, old: u16, new: u16) -> u32 {
    sum + u32::from(!old) + u32::from(new)
}

/// `csum` after the covered data changed by `sum` (see `change`).
#[inline(always)]
fn updated(csum: u16, sum: u32) -> u16 {
    fold(u32::from(!csum) + sum)
}

/// Rewrites the error with `flow`, the entry of the quoted packet's opposite direction (the
/// direction the error travels): `destination` gives the error's destination and the quote's
/// source the entry's destination; `source` gives the quote's destination the entry's source,
/// and the error's source too if it was the quote's destination. Each store leaves the
/// packet's one's-complement sum as it was (every changed word has its checksum changed to
/// match: the IPv4 headers', the quoted L4 header's, the ICMP one over the quote and, for
/// ICMPv6, the pseudo-header), so `skb->csum` of a CHECKSUM_COMPLETE skb stays true.
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    error: &Error,
    flow: &CtValue,
    destination: bool,
    source: bool,
) -> Result<(), ()> {
    let v6 = error.is_v6();
    let words = if v6 { 4 } else { 1 };
    let (src_at, dst_at) = if v6 { (8, 24) } else { (12, 16) };
    // The quote's addresses (the inner IPv4 header's checksum covers them, so do the quoted
    // L4 checksum's pseudo-header and the ICMP checksum), its ports, and the outer addresses
    // (the outer IPv4 header's checksum; ICMPv6's pseudo-header).
    let mut addrs = 0u32;
    let mut ports = 0u32;
    let mut outer = 0u32;
    if destination {
        if flow.dst != error.src {
            store_addr(ctx, error.inner + src_at, &flow.dst, v6)?;
            addrs = change(addrs, &error.src, &flow.dst, words);
        }
        if flow.dport != error.sport {
            ctx.store(error.inner_l4, &flow.dport, 0).map_err(drop)?;
            ports = change16(ports, error.sport, flow.dport);
        }
        if flow.dst != error.outer_dst {
            store_addr(ctx, ETH_HLEN + dst_at, &flow.dst, v6)?;
            outer = change(outer, &error.outer_dst, &flow.dst, words);
        }
    }
    if source {
        if flow.src != error.dst {
            store_addr(ctx, error.inner + dst_at, &flow.src, v6)?;
            addrs = change(addrs, &error.dst, &flow.src, words);
            if error.outer_src == error.dst {
                store_addr(ctx, ETH_HLEN + src_at, &flow.src, v6)?;
                outer = change(outer, &error.outer_src, &flow.src, words);
            }
        }
        if flow.sport != error.dport {
            ctx.store(error.inner_l4 + 2, &flow.sport, 0)
                .map_err(drop)?;
            ports = change16(ports, error.dport, flow.sport);
        }
    }
    // What the ICMP checksum covers changed by the quote's changes and by each checksum
    // inside the quote that follows them.
    let mut icmp = addrs + ports;
    if !v6 {
        let at = error.inner + 10;
        let old: u16 = ctx.load(at).map_err(drop)?;
        let new = updated(old, addrs);
        ctx.store(at, &new, 0).map_err(drop)?;
        icmp = change16(icmp, old, new);
    }
    // The quoted L4 checksum, where the quote holds it (an error quotes at least 8 bytes of
    // L4: UDP's is in them, TCP's usually follows; SCTP's CRC32c covers no addresses and
    // neither sender nor receiver of the error checks it). UDP over IPv4 may carry none (0).
    let l4_at = match error.proto {
        proto::UDP => Some(error.inner_l4 + 6),
        proto::TCP => Some(error.inner_l4 + 16),
        _ => None,
    };
    if let Some(at) = l4_at
        && let Ok(old) = ctx.load::<u16>(at)
        && (old != 0 || error.proto != proto::UDP)
    {
        let mut new = updated(old, addrs + ports);
        if new == 0 && error.proto == proto::UDP {
            new = 0xffff;
        }
        ctx.store(at, &new, 0).map_err(drop)?;
        icmp = change16(icmp, old, new);
    }
    if v6 {
        icmp += outer;
    } else if outer != 0 {
        let at = ETH_HLEN + 10;
        let old: u16 = ctx.load(at).map_err(drop)?;
        ctx.store(at, &updated(old, outer), 0).map_err(drop)?;
    }
    let at = error.icmp + 2;
    let old: u16 = ctx.load(at).map_err(drop)?;
    ctx.store(at, &updated(old, icmp), 0).map_err(drop)
}

#[inline(always)]
fn store_addr(ctx: &TcContext, at: usize, addr: &[u32; 4], v6: bool) -> Result<(), ()> {
    if v6 {
        ctx.store(at, addr, 0).map_err(drop)
    } else {
        ctx.store(at, &addr[0], 0).map_err(drop)
    }
}
