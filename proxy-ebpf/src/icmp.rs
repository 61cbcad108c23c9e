//! ICMP errors the tc programs answer with themselves, built from the packet they are about
//! and sent back out of the interface it came in on:
//! - kube-proxy's REJECT for packets from outside: "port unreachable", so the client's
//!   connect() fails at once with ECONNREFUSED;
//! - on the fast path, "fragmentation needed" / "packet too big" for a packet too big for the
//!   link to its next hop, which the redirect bypasses the router (the stack) that would send
//!   it: without it path-MTU discovery through the node black-holes.
//!
//! The reply quotes the original IP header and the first 8 bytes of L4 (what RFC 792 requires
//! and what the client's stack matches the error to its socket with). Headers are built as
//! native `u32` words (see `csum::add_words`) and stored over the packet after it is trimmed or
//! extended to the reply's length.
//! Known limit: a `CHECKSUM_PARTIAL` skb (from a local stack over veth) keeps that state; veth
//! never completes checksums, so this only matters for such packets leaving through hardware.

use aya_ebpf::{
    bindings::{__sk_buff, TC_ACT_SHOT},
    helpers::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use proxy_common::{NodeAddrKey, StatIndex};

use crate::{
    clock,
    csum::{add_words, fold},
    maps::{IcmpBucket, KPR_ICMP_RATE},
    parse::{ETH_HLEN, Packet},
    stats::bump,
};

/// Minimum interval between port unreachables to one client, in ns, per family: the node's
/// `net.ipv4.icmp_ratelimit` / `net.ipv6.icmp.ratelimit` (ms; default 1000), which the agent
/// reads and sets before loading. 0: no limit. Frozen read-only globals.
#[unsafe(no_mangle)]
static KPR_ICMP_RATELIMIT_NS4: u64 = 1_000_000_000;
#[unsafe(no_mangle)]
static KPR_ICMP_RATELIMIT_NS6: u64 = 1_000_000_000;
/// The kernel's `XRLIM_BURST_FACTOR`: a client may get this many errors at once, then one per
/// interval.
const BURST: u64 = 6;

const ICMP_HLEN: usize = 8;
const IP4_HLEN: usize = 20;
const IP6_HLEN: usize = 40;
/// Quoted original: IP header + 8 bytes of L4, in words.
const QUOTE4_WORDS: usize = (IP4_HLEN + 8) / 4;
const QUOTE6_WORDS: usize = (IP6_HLEN + 8) / 4;
const TTL: u8 = 64;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;

/// Answers `pkt` with port unreachable; drops it (counted) if that is not possible.
// Not inlined: its header buffers get their own stack frame (the verifier limits the
// combined stack of a call chain to 512 bytes).
#[inline(never)]
pub fn reject(ctx: &TcContext, pkt: &Packet) -> i32 {
    if !allowed(pkt) {
        bump(StatIndex::TcRejectRateLimited);
        return TC_ACT_SHOT;
    }
    match answer(ctx, pkt, Kind::PortUnreachable) {
        Ok(action) => {
            bump(StatIndex::TcRejected);
            action
        }
        Err(()) => {
            bump(StatIndex::TcRejectFailed);
            TC_ACT_SHOT
        }
    }
}

/// Answers `pkt` (untranslated, as its sender sent it) with fragmentation needed (IPv4) or
/// packet too big (IPv6) naming `mtu`, from the address it was sent to. Not rate-limited: the
/// kernel exempts both from `icmp_ratelimit` (`icmpv4_mask_allow`, the default
/// `icmpv6_ratemask`), so path-MTU discovery is never slowed. Drops `pkt` either way.
#[inline(never)]
pub fn too_big(ctx: &TcContext, pkt: &Packet, mtu: u16) -> i32 {
    match answer(ctx, pkt, Kind::TooBig(mtu)) {
        Ok(action) => {
            bump(StatIndex::TcTooBigSent);
            action
        }
        Err(()) => {
            bump(StatIndex::TcRewriteFailed);
            TC_ACT_SHOT
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    PortUnreachable,
    TooBig(u16),
}

impl Kind {
    /// Type, code and the second word of the ICMP (ICMPv6) header.
    #[inline(always)]
    fn header(self, v6: bool) -> ([u8; 2], u32) {
        match (self, v6) {
            (Kind::PortUnreachable, false) => ([3, 3], 0),
            (Kind::PortUnreachable, true) => ([1, 4], 0),
            // RFC 1191: the next-hop MTU in the second half of the word.
            (Kind::TooBig(mtu), false) => {
                let m = mtu.to_be_bytes();
                ([3, 4], word([0, 0, m[0], m[1]]))
            }
            // RFC 4443: the whole word.
            (Kind::TooBig(mtu), true) => ([2, 0], u32::from(mtu).to_be()),
        }
    }
}

#[inline(always)]
fn answer(ctx: &TcContext, pkt: &Packet, kind: Kind) -> Result<i32, ()> {
    if pkt.is_v6() {
        answer6(ctx, kind)
    } else if pkt.l4 == ETH_HLEN + IP4_HLEN {
        answer4(ctx, kind)
    } else {
        // IP options: the quote would need the longer header; not worth the code.
        Err(())
    }
}

/// The kernel's `inet_peer_xrlim_allow` per client address: the bucket gains the time since
/// its last use, up to `BURST` intervals, and an error costs one interval. A new client starts
/// full. Concurrent CPUs may both spend the same tokens: the limit is approximate, as the
/// kernel's is without its peer lock.
fn allowed(pkt: &Packet) -> bool {
    // SAFETY: reads of plain globals the loader initialised.
    let interval = unsafe {
        if pkt.is_v6() {
            core::ptr::read_volatile(&raw const KPR_ICMP_RATELIMIT_NS6)
        } else {
            core::ptr::read_volatile(&raw const KPR_ICMP_RATELIMIT_NS4)
        }
    };
    if interval == 0 {
        return true;
    }
    let key = NodeAddrKey {
        addr: pkt.src,
        family: pkt.family,
        _pad: [0; 3],
    };
    let now = clock::now_ns();
    // No overflow: the agent caps the interval at a day (a saturating multiply would need a
    // 128-bit helper the BPF backend lacks).
    let full = interval.wrapping_mul(BURST);
    let (tokens, entry) = match KPR_ICMP_RATE.get_ptr_mut(key) {
        // SAFETY: the map's value, valid while this program runs.
        Some(bucket) => unsafe {
            let elapsed = now.saturating_sub((*bucket).last);
            (
                (*bucket).tokens.saturating_add(elapsed).min(full),
                Some(bucket),
            )
        },
        None => (full, None),
    };
    let allow = tokens >= interval;
    let tokens = if allow { tokens - interval } else { tokens };
    match entry {
        // SAFETY: as above.
        Some(bucket) => unsafe {
            (*bucket).tokens = tokens;
            (*bucket).last = now;
        },
        None => {
            // A full map evicts the least recently used client (LRU).
            let _ = KPR_ICMP_RATE.insert(key, IcmpBucket { tokens, last: now }, 0);
        }
    }
    allow
}

#[inline(always)]
fn word(bytes: [u8; 4]) -> u32 {
    u32::from_ne_bytes(bytes)
}

/// The checksum as the upper half of a word whose first two bytes are `first`.
#[inline(always)]
fn with_csum(first: [u8; 2], csum: u16) -> u32 {
    let c = csum.to_ne_bytes();
    word([first[0], first[1], c[0], c[1]])
}

/// Swaps the Ethernet source and destination (scalar loads and stores: aggregate copies of
/// 6-byte fields crash LLVM's BPF backend in post-RA pseudo expansion).
#[inline(always)]
fn swap_eth(ctx: &TcContext) -> Result<(), ()> {
    let dst_hi: u32 = ctx.load(0).map_err(drop)?;
    let dst_lo: u16 = ctx.load(4).map_err(drop)?;
    let src_hi: u16 = ctx.load(6).map_err(drop)?;
    let src_lo: u32 = ctx.load(8).map_err(drop)?;
    ctx.store(0, &src_hi, 0).map_err(drop)?;
    ctx.store(2, &src_lo, 0).map_err(drop)?;
    ctx.store(6, &dst_hi, 0).map_err(drop)?;
    ctx.store(10, &dst_lo, 0).map_err(drop)
}

#[inline(always)]
fn answer4(ctx: &TcContext, kind: Kind) -> Result<i32, ()> {
    let quote: [u32; QUOTE4_WORDS] = ctx.load(ETH_HLEN).map_err(drop)?;
    let total = ((IP4_HLEN + ICMP_HLEN + QUOTE4_WORDS * 4) as u16).to_be_bytes();
    let mut ip: [u32; 5] = [
        word([0x45, 0, total[0], total[1]]),
        word([0, 0, 0x40, 0]), // DF
        word([TTL, IPPROTO_ICMP, 0, 0]),
        // Source: the address the client wanted (as REJECT does); destination: the client.
        quote[4],
        quote[3],
    ];
    ip[2] = with_csum([TTL, IPPROTO_ICMP], fold(add_words(0, &ip)));
    let (kind, rest) = kind.header(false);
    let mut icmp: [u32; 2] = [word([kind[0], kind[1], 0, 0]), rest];
    icmp[0] = with_csum(kind, fold(add_words(add_words(0, &icmp), &quote)));
    let len = ETH_HLEN + IP4_HLEN + ICMP_HLEN + QUOTE4_WORDS * 4;
    resize(ctx, len)?;
    swap_eth(ctx)?;
    ctx.store(ETH_HLEN, &ip, 0).map_err(drop)?;
    ctx.store(ETH_HLEN + IP4_HLEN, &icmp, 0).map_err(drop)?;
    ctx.store(ETH_HLEN + IP4_HLEN + ICMP_HLEN, &quote, 0)
        .map_err(drop)?;
    send_back(ctx)
}

#[inline(always)]
fn answer6(ctx: &TcContext, kind: Kind) -> Result<i32, ()> {
    let quote: [u32; QUOTE6_WORDS] = ctx.load(ETH_HLEN).map_err(drop)?;
    let payload = ((ICMP_HLEN + QUOTE6_WORDS * 4) as u16).to_be_bytes();
    let ip: [u32; 10] = [
        word([0x60, 0, 0, 0]),
        word([payload[0], payload[1], IPPROTO_ICMPV6, TTL]),
        quote[6],
        quote[7],
        quote[8],
        quote[9],
        quote[2],
        quote[3],
        quote[4],
        quote[5],
    ];
    // The ICMPv6 checksum covers a pseudo-header: both addresses, the upper-layer length and
    // the next header value.
    let pseudo: [u32; 10] = [
        ip[2],
        ip[3],
        ip[4],
        ip[5],
        ip[6],
        ip[7],
        ip[8],
        ip[9],
        word([0, 0, payload[0], payload[1]]),
        word([0, 0, 0, IPPROTO_ICMPV6]),
    ];
    let (kind, rest) = kind.header(true);
    let mut icmp: [u32; 2] = [word([kind[0], kind[1], 0, 0]), rest];
    let sum = add_words(add_words(add_words(0, &pseudo), &icmp), &quote);
    icmp[0] = with_csum(kind, fold(sum));
    let len = ETH_HLEN + IP6_HLEN + ICMP_HLEN + QUOTE6_WORDS * 4;
    resize(ctx, len)?;
    swap_eth(ctx)?;
    ctx.store(ETH_HLEN, &ip, 0).map_err(drop)?;
    ctx.store(ETH_HLEN + IP6_HLEN, &icmp, 0).map_err(drop)?;
    ctx.store(ETH_HLEN + IP6_HLEN + ICMP_HLEN, &quote, 0)
        .map_err(drop)?;
    send_back(ctx)
}

#[inline(always)]
fn resize(ctx: &TcContext, len: usize) -> Result<(), ()> {
    // SAFETY: the program's own skb; the helper checks the length.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, len as u32, 0) } != 0 {
        return Err(());
    }
    Ok(())
}

/// Sends the packet out of the interface it came in on.
#[inline(always)]
fn send_back(ctx: &TcContext) -> Result<i32, ()> {
    let skb: *mut __sk_buff = ctx.skb.skb;
    // SAFETY: reading a field of the program's own context.
    let ifindex = unsafe { (*skb).ingress_ifindex };
    // SAFETY: redirecting to a plain ifindex has no preconditions.
    Ok(unsafe { bpf_redirect(ifindex, 0) } as i32)
}
