//! A parsed packet: what `parse` reads of a TCP, UDP or SCTP packet's headers, and what the
//! maps' per-CPU scratch (`maps::TcScratch`) and every program after the parse work with.

use proxy_common::{CtKey, family, proto};

pub const ETH_HLEN: usize = 14;

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
    /// TCP header flags (byte 13: CWR ECE URG ACK PSH RST SYN FIN); 0 for UDP and SCTP, and
    /// for a later fragment.
    pub tcp_flags: u8,
    /// A later fragment of a datagram (`parse::parse_later_fragment`): no L4 header, the ports are
    /// its first fragment's, and a translation rewrites only its addresses. Always false for
    /// what `parse::parse` returns.
    pub later_fragment: bool,
    /// The first fragment of a TCP or UDP datagram: the programs remember its ports for the
    /// later fragments (`fragments::first`) once they know the datagram is a flow's.
    pub first_fragment: bool,
    /// The datagram's IP ID (IPv4's 16 bits, IPv6's 32) if it is fragmented, else 0.
    pub fragment_id: u32,
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

    /// Whether the destination is a loopback address: 127.0.0.0/8, or `::1`.
    #[inline(always)]
    pub fn loopback_destination(&self) -> bool {
        if self.is_v6() {
            self.dst[0] == 0 && self.dst[1] == 0 && self.dst[2] == 0 && self.dst[3] == 1u32.to_be()
        } else {
            u32::from_be(self.dst[0]) >> 24 == 127
        }
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
