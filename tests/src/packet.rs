//! Crafted packets for `BPF_PROG_TEST_RUN` tests of the tc programs: Ethernet + IPv4/IPv6 +
//! TCP/UDP/SCTP builders with correct checksums, a parser for what the program returns, and
//! checksum verification computed from scratch (RFC 1071 for IP/TCP/UDP/ICMP, CRC32c for SCTP),
//! so a test never trusts the incremental updates it checks.

use std::net::{IpAddr, SocketAddr};

use crate::{Result, RigError};

pub const ETH_HLEN: usize = 14;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;
pub const PROTO_SCTP: u8 = 132;

/// tc actions (`TC_ACT_*`) as the programs return them.
pub const TC_ACT_OK: i32 = 0;
pub const TC_ACT_SHOT: i32 = 2;
/// `TC_ACT_UNSPEC`: not the program's packet — the next program (TCX_NEXT), else the stack.
pub const TC_ACT_UNSPEC: i32 = -1;
pub const TC_ACT_REDIRECT: i32 = 7;
/// XDP program return values (`enum xdp_action`).
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_REDIRECT: u32 = 4;

const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

pub use proxy_common::inet_checksum::{inet_checksum, l4_checksum};

/// CRC32c (Castagnoli, reflected polynomial 0x82f63b78), as SCTP uses it (RFC 3309).
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in bytes {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// What to put after the IP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L4 {
    TcpSyn,
    /// A TCP ACK segment (a connection's data or last ACK).
    TcpAck,
    /// A TCP FIN|ACK segment.
    TcpFin,
    /// A TCP RST segment.
    TcpRst,
    Udp,
    /// An SCTP common header and one DATA-less INIT chunk.
    Sctp,
    /// An SCTP common header (verification tag [`SCTP_VTAG`]) and one DATA chunk carrying the
    /// payload (padded to 4 bytes, as RFC 9260 requires).
    SctpData,
}

/// The verification tag of [`L4::SctpData`] packets.
pub const SCTP_VTAG: u32 = 0x5ca1_ab1e;

impl L4 {
    pub fn proto(self) -> u8 {
        match self {
            L4::TcpSyn | L4::TcpAck | L4::TcpFin | L4::TcpRst => PROTO_TCP,
            L4::Udp => PROTO_UDP,
            L4::Sctp | L4::SctpData => PROTO_SCTP,
        }
    }
}

/// Builds an Ethernet frame carrying `l4` from `src` to `dst` with `payload`, every checksum
/// valid.
pub fn build(src: SocketAddr, dst: SocketAddr, l4: L4, payload: &[u8]) -> Vec<u8> {
    let mut seg = match l4 {
        L4::TcpSyn | L4::TcpAck | L4::TcpFin | L4::TcpRst => {
            let mut h = vec![0u8; 20];
            h[0..2].copy_from_slice(&src.port().to_be_bytes());
            h[2..4].copy_from_slice(&dst.port().to_be_bytes());
            h[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
            h[12] = 5 << 4;
            h[13] = match l4 {
                L4::TcpAck => 0x10,
                L4::TcpFin => 0x11, // FIN|ACK
                L4::TcpRst => 0x04, // RST
                _ => 0x02,          // SYN
            };
            h[14..16].copy_from_slice(&64240u16.to_be_bytes());
            h
        }
        L4::Udp => {
            let mut h = vec![0u8; 8];
            h[0..2].copy_from_slice(&src.port().to_be_bytes());
            h[2..4].copy_from_slice(&dst.port().to_be_bytes());
            h[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
            h
        }
        L4::Sctp => {
            let mut h = vec![0u8; 12];
            h[0..2].copy_from_slice(&src.port().to_be_bytes());
            h[2..4].copy_from_slice(&dst.port().to_be_bytes());
            h[4..8].copy_from_slice(&0u32.to_be_bytes()); // verification tag 0 for INIT
            // INIT chunk: type 1, flags 0, length 20, initiate tag, a_rwnd, streams, TSN.
            h.extend_from_slice(&[1, 0, 0, 20]);
            h.extend_from_slice(&0xdead_beefu32.to_be_bytes());
            h.extend_from_slice(&65535u32.to_be_bytes());
            h.extend_from_slice(&[0, 10, 0, 10]);
            h.extend_from_slice(&1u32.to_be_bytes());
            h
        }
        L4::SctpData => {
            let mut h = vec![0u8; 12];
            h[0..2].copy_from_slice(&src.port().to_be_bytes());
            h[2..4].copy_from_slice(&dst.port().to_be_bytes());
            h[4..8].copy_from_slice(&SCTP_VTAG.to_be_bytes());
            // DATA chunk: type 0, flags B|E (unfragmented), length, TSN, stream 0, SSN 0, PPID 0.
            h.extend_from_slice(&[0, 0x03]);
            h.extend_from_slice(&((16 + payload.len()) as u16).to_be_bytes());
            h.extend_from_slice(&1u32.to_be_bytes());
            h.extend_from_slice(&[0; 8]);
            h
        }
    };
    seg.extend_from_slice(payload);
    if l4 == L4::SctpData {
        seg.resize(seg.len().next_multiple_of(4), 0);
    }
    match l4 {
        L4::TcpSyn | L4::TcpAck | L4::TcpFin | L4::TcpRst => {
            let c = l4_checksum(src.ip(), dst.ip(), PROTO_TCP, &seg);
            seg[16..18].copy_from_slice(&c.to_be_bytes());
        }
        L4::Udp => {
            let c = l4_checksum(src.ip(), dst.ip(), PROTO_UDP, &seg);
            let c = if c == 0 { 0xffff } else { c };
            seg[6..8].copy_from_slice(&c.to_be_bytes());
        }
        L4::Sctp | L4::SctpData => {
            // The CRC is stored little-endian (RFC 4960 appendix B, as Linux does).
            let c = crc32c(&seg);
            seg[8..12].copy_from_slice(&c.to_le_bytes());
        }
    }
    ip_frame(src.ip(), dst.ip(), l4.proto(), &seg)
}

/// An Ethernet frame carrying `seg` (an L4 segment of protocol `proto`, its checksum done) from
/// `src` to `dst`.
fn ip_frame(src: IpAddr, dst: IpAddr, proto: u8, seg: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(ETH_HLEN + 40 + seg.len());
    frame.extend_from_slice(&NODE_MAC);
    frame.extend_from_slice(&CLIENT_MAC);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            frame.extend_from_slice(&0x0800u16.to_be_bytes());
            let mut ip = vec![0u8; 20];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&((20 + seg.len()) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&0x4242u16.to_be_bytes());
            ip[6] = 0x40; // DF
            ip[8] = 64;
            ip[9] = proto;
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            let c = inet_checksum(&ip);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            frame.extend_from_slice(&ip);
        }
        (s, d) => {
            let octets = |a: IpAddr| match a {
                IpAddr::V6(a) => a.octets(),
                IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
            };
            frame.extend_from_slice(&0x86ddu16.to_be_bytes());
            let mut ip = vec![0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(seg.len() as u16).to_be_bytes());
            ip[6] = proto;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&octets(s));
            ip[24..40].copy_from_slice(&octets(d));
            frame.extend_from_slice(&ip);
        }
    }
    frame.extend_from_slice(seg);
    frame
}

/// An ICMP error (ICMPv4 between IPv4 addresses, ICMPv6 otherwise) from `src` to `dst` of
/// `kind`/`code`, `rest` in its header's second word (the next-hop MTU of fragmentation
/// needed / packet too big), quoting the whole IP packet of `quoted` (a frame from [`build`]),
/// every checksum valid.
pub fn icmp_error(
    src: IpAddr,
    dst: IpAddr,
    kind: u8,
    code: u8,
    rest: u32,
    quoted: &[u8],
) -> Vec<u8> {
    let mut icmp = vec![kind, code, 0, 0];
    icmp.extend_from_slice(&rest.to_be_bytes());
    icmp.extend_from_slice(quoted.get(ETH_HLEN..).unwrap_or_default());
    let proto = if src.is_ipv4() {
        PROTO_ICMP
    } else {
        PROTO_ICMPV6
    };
    let c = if proto == PROTO_ICMP {
        inet_checksum(&icmp)
    } else {
        l4_checksum(src, dst, proto, &icmp)
    };
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    ip_frame(src, dst, proto, &icmp)
}

/// Splits the datagram of `frame` (from [`build`]) into IP fragments of datagram `id`, each
/// carrying `chunk` bytes of its IP payload (a multiple of 8; the last one the rest): IPv4
/// fragments (MF and offset, DF cleared) or IPv6 ones (a fragment header).
pub fn fragment(frame: &[u8], chunk: usize, id: u32) -> Vec<Vec<u8>> {
    let v6 = frame.get(12..14) == Some(&[0x86, 0xdd][..]);
    let hlen = if v6 { 40 } else { 20 };
    let (eth, rest) = frame.split_at(ETH_HLEN.min(frame.len()));
    let (header, payload) = rest.split_at(hlen.min(rest.len()));
    let pieces: Vec<&[u8]> = payload.chunks(chunk.max(8)).collect();
    let count = pieces.len();
    let mut out = Vec::with_capacity(count);
    for (i, piece) in pieces.into_iter().enumerate() {
        let offset = i * chunk;
        let more = i + 1 < count;
        let mut f = eth.to_vec();
        let mut ip = header.to_vec();
        if v6 {
            let next = ip[6];
            ip[4..6].copy_from_slice(&((8 + piece.len()) as u16).to_be_bytes());
            ip[6] = 44;
            f.extend_from_slice(&ip);
            f.extend_from_slice(&[next, 0]);
            f.extend_from_slice(&(((offset / 8) as u16) << 3 | u16::from(more)).to_be_bytes());
            f.extend_from_slice(&id.to_be_bytes());
        } else {
            ip[2..4].copy_from_slice(&((20 + piece.len()) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&(id as u16).to_be_bytes());
            let flags = if more { 0x2000 } else { 0 };
            ip[6..8].copy_from_slice(&(flags | (offset / 8) as u16).to_be_bytes());
            ip[10..12].fill(0);
            let c = inet_checksum(&ip);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            f.extend_from_slice(&ip);
        }
        f.extend_from_slice(piece);
        out.push(f);
    }
    out
}

/// A fragment's addresses and its place in the datagram, every header checked (the IPv4
/// header checksum; the fragment header's next header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fragment {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub id: u32,
    pub offset: usize,
    pub more: bool,
    /// The payload after the IP (and fragment) header.
    pub data: Vec<u8>,
    /// The datagram's protocol.
    pub proto: u8,
}

/// Parses a fragment built by [`fragment`] (as a program left it).
pub fn parse_fragment(frame: &[u8]) -> Result<Fragment> {
    let ip = frame.get(ETH_HLEN..).ok_or_else(|| bad("short fragment"))?;
    match ip.first().map(|b| b >> 4) {
        Some(4) => {
            let h = ip.get(..20).ok_or_else(|| bad("short IPv4 fragment"))?;
            if inet_checksum(h) != 0 {
                return Err(bad("IPv4 header checksum of a fragment"));
            }
            let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
            let flags = u16::from_be_bytes([h[6], h[7]]);
            Ok(Fragment {
                src: IpAddr::from([h[12], h[13], h[14], h[15]]),
                dst: IpAddr::from([h[16], h[17], h[18], h[19]]),
                id: u32::from(u16::from_be_bytes([h[4], h[5]])),
                offset: usize::from(flags & 0x1fff) * 8,
                more: flags & 0x2000 != 0,
                data: ip
                    .get(20..total)
                    .ok_or_else(|| bad("IPv4 fragment length"))?
                    .to_vec(),
                proto: h[9],
            })
        }
        Some(6) => {
            let h = ip.get(..48).ok_or_else(|| bad("short IPv6 fragment"))?;
            if h[6] != 44 {
                return Err(bad("no fragment header"));
            }
            let payload = usize::from(u16::from_be_bytes([h[4], h[5]]));
            let mut s = [0u8; 16];
            let mut d = [0u8; 16];
            s.copy_from_slice(&h[8..24]);
            d.copy_from_slice(&h[24..40]);
            let offset_more = u16::from_be_bytes([h[42], h[43]]);
            Ok(Fragment {
                src: IpAddr::from(s),
                dst: IpAddr::from(d),
                id: u32::from_be_bytes([h[44], h[45], h[46], h[47]]),
                offset: usize::from(offset_more >> 3) * 8,
                more: offset_more & 1 != 0,
                data: ip
                    .get(48..40 + payload)
                    .ok_or_else(|| bad("IPv6 fragment length"))?
                    .to_vec(),
                proto: h[40],
            })
        }
        _ => Err(bad("fragment version")),
    }
}

/// The datagram `fragments` (parsed) make up, as one frame, parsed with every checksum checked
/// (the L4 checksum over the whole datagram, with the addresses the fragments carry). The
/// fragments must agree on their addresses, ID and protocol and leave no gap.
pub fn reassemble(fragments: &[Fragment]) -> Result<Parsed> {
    let first = fragments.first().ok_or_else(|| bad("no fragments"))?;
    let mut sorted: Vec<&Fragment> = fragments.iter().collect();
    sorted.sort_by_key(|f| f.offset);
    let mut data = Vec::new();
    for f in &sorted {
        if (f.src, f.dst, f.id, f.proto) != (first.src, first.dst, first.id, first.proto) {
            return Err(bad("fragments of different datagrams"));
        }
        if f.offset != data.len() {
            return Err(bad("a gap or an overlap between fragments"));
        }
        data.extend_from_slice(&f.data);
    }
    if sorted.last().is_some_and(|f| f.more) {
        return Err(bad("the last fragment says more follow"));
    }
    parse_checked(&ip_frame(first.src, first.dst, first.proto, &data))
}

/// The packet an ICMP error (`error`, parsed) quotes, parsed with every checksum checked: the
/// quote must hold the whole packet.
pub fn quoted_packet(error: &Parsed) -> Result<Parsed> {
    let quote = error.l4.get(8..).ok_or_else(|| bad("short ICMP error"))?;
    let ethertype: u16 = match quote.first().map(|b| b >> 4) {
        Some(4) => 0x0800,
        Some(6) => 0x86dd,
        _ => return Err(bad("quoted packet version")),
    };
    let mut frame = vec![0u8; 12];
    frame.extend_from_slice(&ethertype.to_be_bytes());
    frame.extend_from_slice(quote);
    parse_checked(&frame)
}

/// A parsed frame as the program left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub eth_dst: [u8; 6],
    pub eth_src: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub proto: u8,
    /// The L4 segment (header and payload).
    pub l4: Vec<u8>,
}

impl Parsed {
    pub fn sport(&self) -> u16 {
        u16::from_be_bytes([self.l4[0], self.l4[1]])
    }

    pub fn dport(&self) -> u16 {
        u16::from_be_bytes([self.l4[2], self.l4[3]])
    }

    pub fn source(&self) -> SocketAddr {
        SocketAddr::new(self.src, self.sport())
    }

    pub fn destination(&self) -> SocketAddr {
        SocketAddr::new(self.dst, self.dport())
    }
}

fn bad(what: &str) -> RigError {
    RigError::Other(format!("packet: {what}"))
}

/// Parses `frame` and checks every checksum (IPv4 header; TCP/UDP/ICMP/ICMPv6; SCTP CRC32c)
/// and the length fields; an error names the first problem.
pub fn parse_checked(frame: &[u8]) -> Result<Parsed> {
    let eth = frame.get(..ETH_HLEN).ok_or_else(|| bad("short Ethernet"))?;
    let ethertype = u16::from_be_bytes([eth[12], eth[13]]);
    let mut eth_dst = [0u8; 6];
    let mut eth_src = [0u8; 6];
    eth_dst.copy_from_slice(&eth[0..6]);
    eth_src.copy_from_slice(&eth[6..12]);
    let ip = &frame[ETH_HLEN..];
    let (src, dst, proto, l4) = match ethertype {
        0x0800 => {
            let h = ip.get(..20).ok_or_else(|| bad("short IPv4"))?;
            if h[0] != 0x45 {
                return Err(bad("IPv4 options or version"));
            }
            if inet_checksum(h) != 0 {
                return Err(bad("IPv4 header checksum"));
            }
            let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
            let l4 = ip.get(20..total).ok_or_else(|| bad("IPv4 total length"))?;
            let src = IpAddr::from([h[12], h[13], h[14], h[15]]);
            let dst = IpAddr::from([h[16], h[17], h[18], h[19]]);
            (src, dst, h[9], l4)
        }
        0x86dd => {
            let h = ip.get(..40).ok_or_else(|| bad("short IPv6"))?;
            let payload = usize::from(u16::from_be_bytes([h[4], h[5]]));
            let l4 = ip
                .get(40..40 + payload)
                .ok_or_else(|| bad("IPv6 payload length"))?;
            let mut s = [0u8; 16];
            let mut d = [0u8; 16];
            s.copy_from_slice(&h[8..24]);
            d.copy_from_slice(&h[24..40]);
            (IpAddr::from(s), IpAddr::from(d), h[6], l4)
        }
        other => return Err(bad(&format!("ethertype {other:#06x}"))),
    };
    match proto {
        PROTO_TCP | PROTO_ICMPV6 if l4_checksum(src, dst, proto, l4) != 0 => {
            return Err(bad(&format!("L4 (proto {proto}) checksum")));
        }
        PROTO_UDP => {
            let stored = l4.get(6..8).ok_or_else(|| bad("short UDP"))?;
            let none = stored == [0, 0] && src.is_ipv4();
            if !none && l4_checksum(src, dst, proto, l4) != 0 {
                return Err(bad("UDP checksum"));
            }
        }
        PROTO_ICMP if inet_checksum(l4) != 0 => return Err(bad("ICMP checksum")),
        PROTO_SCTP => {
            let mut seg = l4.to_vec();
            let stored = seg.get(8..12).ok_or_else(|| bad("short SCTP"))?.to_vec();
            seg[8..12].fill(0);
            if crc32c(&seg).to_le_bytes() != stored.as_slice() {
                return Err(bad("SCTP CRC32c"));
            }
        }
        _ => {}
    }
    Ok(Parsed {
        eth_dst,
        eth_src,
        src,
        dst,
        proto,
        l4: l4.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_packets_pass_their_own_checks() -> Result<()> {
        let pairs: [(&str, &str); 2] = [
            ("10.10.0.2:40000", "10.10.0.1:30080"),
            ("[fd00:10::2]:40000", "[fd00:10::1]:30080"),
        ];
        for (s, d) in pairs {
            let s: SocketAddr = s.parse().map_err(|_| bad("addr"))?;
            let d: SocketAddr = d.parse().map_err(|_| bad("addr"))?;
            for l4 in [L4::TcpSyn, L4::Udp, L4::Sctp, L4::SctpData] {
                let frame = build(s, d, l4, b"hello");
                let parsed = parse_checked(&frame)?;
                assert_eq!(parsed.source(), s);
                assert_eq!(parsed.destination(), d);
                assert_eq!(parsed.proto, l4.proto());
                let mut broken = frame.clone();
                let last = broken.len() - 1;
                broken[last] ^= 1;
                assert!(parse_checked(&broken).is_err(), "{l4:?} corruption unseen");
            }
        }
        // RFC 3720 B.4 test vector: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        Ok(())
    }
}
