//! Packet parsing for the tc programs: Ethernet → IPv4/IPv6 → TCP/UDP/SCTP ports.
//!
//! Every read goes through `bpf_skb_load_bytes` (`TcContext::load`), which bounds-checks
//! against the whole skb: no direct packet access, so no `data_end` proofs for the verifier and
//! no dependence on how much of the packet is in the linear area.

use aya_ebpf::programs::TcContext;
use proxy_common::{CtKey, family, proto};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
const IPV6_HLEN: usize = 40;

/// A parsed TCP, UDP or SCTP packet. Addresses and ports are in network byte order as they appear in
/// the packet (IPv4 in word 0 of the address arrays).
#[derive(Clone, Copy)]
pub struct Packet {
    pub family: u8,
    pub proto: u8,
    /// Offset of the L4 header.
    pub l4: usize,
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    /// TCP header flags (byte 13: CWR ECE URG ACK PSH RST SYN FIN); 0 for UDP and SCTP.
    pub tcp_flags: u8,
}

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

impl Packet {
    pub fn is_v6(&self) -> bool {
        self.family == family::V6
    }

    /// Writes the packet's conntrack key into `key` field by field (a whole `CtKey` would be
    /// built on the caller's stack first).
    #[inline(always)]
    pub fn write_ct_key(&self, key: &mut CtKey) {
        key.src = self.src;
        key.dst = self.dst;
        key.sport = self.sport;
        key.dport = self.dport;
        key.proto = self.proto;
        key.family = self.family;
        key._pad = 0;
    }

    pub fn ct_key(&self) -> CtKey {
        CtKey {
            src: self.src,
            dst: self.dst,
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            family: self.family,
            _pad: 0,
        }
    }

    pub fn src_offset(&self) -> usize {
        ETH_HLEN + if self.is_v6() { 8 } else { 12 }
    }

    pub fn dst_offset(&self) -> usize {
        ETH_HLEN + if self.is_v6() { 24 } else { 16 }
    }

    /// A TCP FIN or RST: the flow is ending.
    pub fn closes(&self) -> bool {
        self.tcp_flags & (TCP_FIN | TCP_RST) != 0
    }

    /// A TCP segment with SYN (a client's SYN or a server's SYN-ACK).
    pub fn syn(&self) -> bool {
        self.tcp_flags & TCP_SYN != 0
    }

    /// A TCP SYN without ACK: a client opening a connection.
    pub fn opens(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// Offset of the TCP or UDP checksum (SCTP's CRC32c is handled by `sctp`).
    pub fn l4_csum_offset(&self) -> usize {
        self.l4 + if self.proto == proto::TCP { 16 } else { 6 }
    }
}

/// Parses a TCP, UDP or SCTP packet of one family (`V6`; all three start with the two ports);
/// `None` for anything the tc programs leave to the kernel (the other family, other protocols,
/// IPv4 fragments, IPv6 extension headers).
#[inline(always)]
pub fn parse<const V6: bool>(ctx: &TcContext) -> Option<Packet> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).ok()?);
    let mut pkt = match ethertype {
        ETH_P_IP if !V6 => parse4(ctx)?,
        ETH_P_IPV6 if V6 => parse6(ctx)?,
        _ => return None,
    };
    if pkt.proto == proto::TCP {
        pkt.tcp_flags = ctx.load(pkt.l4 + 13).ok()?;
    }
    Some(pkt)
}

#[inline(always)]
fn parse4(ctx: &TcContext) -> Option<Packet> {
    let version_ihl: u8 = ctx.load(ETH_HLEN).ok()?;
    if version_ihl >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(version_ihl & 0x0f) * 4;
    if ihl < 20 {
        return None;
    }
    let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?);
    // Non-first fragments carry no ports, and translating a first fragment would need
    // reassembly state for the rest: fragments go to the kernel untouched (MF bit or offset).
    if frag & 0x3fff != 0 {
        return None;
    }
    let proto: u8 = ctx.load(ETH_HLEN + 9).ok()?;
    if !is_translated(proto) {
        return None;
    }
    let src: u32 = ctx.load(ETH_HLEN + 12).ok()?;
    let dst: u32 = ctx.load(ETH_HLEN + 16).ok()?;
    let l4 = ETH_HLEN + ihl;
    Some(Packet {
        family: family::V4,
        proto,
        l4,
        src: [src, 0, 0, 0],
        dst: [dst, 0, 0, 0],
        sport: ctx.load(l4).ok()?,
        dport: ctx.load(l4 + 2).ok()?,
        tcp_flags: 0,
    })
}

#[inline(always)]
fn parse6(ctx: &TcContext) -> Option<Packet> {
    let version: u8 = ctx.load(ETH_HLEN).ok()?;
    if version >> 4 != 6 {
        return None;
    }
    // Only TCP/UDP/SCTP directly after the fixed header: walking extension headers needs a bounded
    // loop per header type, and Service traffic does not use them.
    let next_header: u8 = ctx.load(ETH_HLEN + 6).ok()?;
    if !is_translated(next_header) {
        return None;
    }
    let l4 = ETH_HLEN + IPV6_HLEN;
    Some(Packet {
        family: family::V6,
        proto: next_header,
        l4,
        src: ctx.load(ETH_HLEN + 8).ok()?,
        dst: ctx.load(ETH_HLEN + 24).ok()?,
        sport: ctx.load(l4).ok()?,
        dport: ctx.load(l4 + 2).ok()?,
        tcp_flags: 0,
    })
}

#[inline(always)]
fn is_translated(protocol: u8) -> bool {
    protocol == proto::TCP || protocol == proto::UDP || protocol == proto::SCTP
}
