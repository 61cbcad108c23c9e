//! A minimal ctnetlink client: dump the conntrack table of one address family and delete
//! entries by their original tuple. Messages follow `linux/netfilter/nfnetlink_conntrack.h`
//! over the shared framing in `crate::netlink`; payloads are network byte order.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use bytes::{BufMut as _, BytesMut};
use nix::sys::socket::SockProtocol;

use crate::netlink::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkError, NetlinkSocket, attributes, put_attr,
    put_nested, walk_datagram,
};
use proxy_model::desired::IpFamily;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
/// `TCP_CONNTRACK_FIN_WAIT` ..= `TCP_CONNTRACK_CLOSE` (linux/netfilter/nf_conntrack_tcp.h): a
/// FIN or RST was seen.
const TCP_CLOSING_STATES: std::ops::RangeInclusive<u8> = 4..=8;

#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("conntrack netlink: {0}")]
    Netlink(#[from] NetlinkError),
}

/// One direction of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    pub src_port: u16,
    pub dst_port: u16,
}

/// A conntrack entry: the original direction and the reply direction (after NAT, the reply
/// source is the backend a DNAT picked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConntrackEntry {
    pub original: Tuple,
    pub reply: Tuple,
    /// TCP: the connection's state (`TCP_CONNTRACK_*`), when the kernel said.
    pub tcp_state: Option<u8>,
}

impl ConntrackEntry {
    /// Whether the connection's destination was translated: its reply comes from another
    /// address or port than the one the client sent to (a DNAT picked a backend).
    pub fn dnat(&self) -> bool {
        self.reply.src != self.original.dst || self.reply.src_port != self.original.dst_port
    }

    /// A TCP connection that saw its FIN or RST (FIN_WAIT, CLOSE_WAIT, LAST_ACK, TIME_WAIT,
    /// CLOSE): a SYN of its tuple starts a new one.
    pub fn tcp_closing(&self) -> bool {
        self.tcp_state
            .is_some_and(|state| TCP_CLOSING_STATES.contains(&state))
    }
}

/// A ctnetlink socket in the network namespace of the thread that opened it.
#[derive(Debug)]
pub struct Ctnetlink {
    socket: NetlinkSocket,
}

impl Ctnetlink {
    pub fn open() -> Result<Self, ConntrackError> {
        Ok(Self {
            socket: NetlinkSocket::open(SockProtocol::NetlinkNetFilter, None)?,
        })
    }

    /// Every entry of `family`.
    pub fn dump(&mut self, family: IpFamily) -> Result<Vec<ConntrackEntry>, ConntrackError> {
        self.send(
            IPCTNL_MSG_CT_GET,
            NLM_F_REQUEST | NLM_F_DUMP,
            family,
            |_| {},
        )?;
        let mut entries = Vec::new();
        self.socket.receive(|_, payload| {
            if let Some(entry) = parse_entry(skip_nfgenmsg(payload)) {
                entries.push(entry);
            }
            Ok::<(), ConntrackError>(())
        })?;
        Ok(entries)
    }

    /// Deletes the entry with this original tuple. An entry that is already gone is not an
    /// error (it may have expired meanwhile).
    pub fn delete(&mut self, original: &Tuple) -> Result<(), ConntrackError> {
        let family = IpFamily::of(&original.src);
        self.send(
            IPCTNL_MSG_CT_DELETE,
            NLM_F_REQUEST | NLM_F_ACK,
            family,
            |buf| put_tuple(buf, CTA_TUPLE_ORIG, original),
        )?;
        match self.socket.receive(|_, _| Ok::<(), NetlinkError>(())) {
            Err(NetlinkError::Kernel(nix::Error::ENOENT)) | Ok(()) => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    /// A ctnetlink message: the nfnetlink subsystem in the type, `struct nfgenmsg` first.
    fn send(
        &mut self,
        kind: u16,
        flags: u16,
        family: IpFamily,
        body: impl FnOnce(&mut BytesMut),
    ) -> Result<(), ConntrackError> {
        self.socket
            .send((NFNL_SUBSYS_CTNETLINK << 8) | kind, flags, |buf| {
                buf.put_u8(match family {
                    IpFamily::V4 => libc::AF_INET as u8,
                    IpFamily::V6 => libc::AF_INET6 as u8,
                });
                buf.put_u8(0); // NFNETLINK_V0
                buf.put_u16(0); // res_id, big endian
                body(buf);
            })?;
        Ok(())
    }
}

/// The attributes of a ctnetlink message follow the 4-byte `struct nfgenmsg`.
fn skip_nfgenmsg(payload: &[u8]) -> &[u8] {
    payload.get(4..).unwrap_or_default()
}

/// The conntrack entries in one dump datagram as the kernel would send it (for fuzzing the
/// parser without a socket).
pub fn parse_dump_datagram(datagram: &[u8]) -> Result<Vec<ConntrackEntry>, ConntrackError> {
    let mut entries = Vec::new();
    walk_datagram(datagram, &mut |_, payload: &[u8]| {
        if let Some(entry) = parse_entry(skip_nfgenmsg(payload)) {
            entries.push(entry);
        }
        Ok::<(), ConntrackError>(())
    })?;
    Ok(entries)
}

fn put_tuple(buf: &mut BytesMut, kind: u16, tuple: &Tuple) {
    put_nested(buf, kind, |buf| {
        put_nested(buf, CTA_TUPLE_IP, |buf| match (tuple.src, tuple.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                put_attr(buf, CTA_IP_V4_SRC, &src.octets());
                put_attr(buf, CTA_IP_V4_DST, &dst.octets());
            }
            (src, dst) => {
                put_attr(buf, CTA_IP_V6_SRC, &v6_octets(src));
                put_attr(buf, CTA_IP_V6_DST, &v6_octets(dst));
            }
        });
        put_nested(buf, CTA_TUPLE_PROTO, |buf| {
            put_attr(buf, CTA_PROTO_NUM, &[tuple.protocol]);
            put_attr(buf, CTA_PROTO_SRC_PORT, &tuple.src_port.to_be_bytes());
            put_attr(buf, CTA_PROTO_DST_PORT, &tuple.dst_port.to_be_bytes());
        });
    });
}

fn v6_octets(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V6(v6) => v6.octets(),
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
    }
}

fn parse_entry(payload: &[u8]) -> Option<ConntrackEntry> {
    let mut original = None;
    let mut reply = None;
    let mut tcp_state = None;
    for (kind, value) in attributes(payload) {
        match kind {
            CTA_TUPLE_ORIG => original = parse_tuple(value),
            CTA_TUPLE_REPLY => reply = parse_tuple(value),
            CTA_PROTOINFO => tcp_state = parse_tcp_state(value),
            _ => {}
        }
    }
    original.zip(reply).map(|(original, reply)| ConntrackEntry {
        original,
        reply,
        tcp_state,
    })
}

/// `CTA_PROTOINFO` → `CTA_PROTOINFO_TCP` → `CTA_PROTOINFO_TCP_STATE`.
fn parse_tcp_state(protoinfo: &[u8]) -> Option<u8> {
    let (_, tcp) = attributes(protoinfo).find(|(kind, _)| *kind == CTA_PROTOINFO_TCP)?;
    match attributes(tcp).find(|(kind, _)| *kind == CTA_PROTOINFO_TCP_STATE)? {
        (_, [state]) => Some(*state),
        _ => None,
    }
}

fn parse_tuple(buf: &[u8]) -> Option<Tuple> {
    let (mut src, mut dst, mut protocol, mut src_port, mut dst_port) = (None, None, None, 0, 0);
    for (kind, value) in attributes(buf) {
        match kind {
            CTA_TUPLE_IP => {
                for (ip_kind, ip) in attributes(value) {
                    let addr = match ip.len() {
                        4 => <[u8; 4]>::try_from(ip)
                            .ok()
                            .map(|o| IpAddr::from(Ipv4Addr::from(o))),
                        16 => <[u8; 16]>::try_from(ip)
                            .ok()
                            .map(|o| IpAddr::from(Ipv6Addr::from(o))),
                        _ => None,
                    };
                    match ip_kind {
                        CTA_IP_V4_SRC | CTA_IP_V6_SRC => src = addr,
                        CTA_IP_V4_DST | CTA_IP_V6_DST => dst = addr,
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (proto_kind, value) in attributes(value) {
                    match (proto_kind, value) {
                        (CTA_PROTO_NUM, [number]) => protocol = Some(*number),
                        (CTA_PROTO_SRC_PORT, [a, b]) => src_port = u16::from_be_bytes([*a, *b]),
                        (CTA_PROTO_DST_PORT, [a, b]) => dst_port = u16::from_be_bytes([*a, *b]),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Tuple {
        src: src?,
        dst: dst?,
        protocol: protocol?,
        src_port,
        dst_port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tuple_survives_encoding_and_parsing() {
        let tuple = Tuple {
            src: IpAddr::from([10, 0, 0, 1]),
            dst: IpAddr::from([10, 96, 0, 10]),
            protocol: 17,
            src_port: 40000,
            dst_port: 53,
        };
        let mut buf = BytesMut::new();
        put_tuple(&mut buf, CTA_TUPLE_ORIG, &tuple);
        let mut reply = tuple;
        reply.src = IpAddr::from([10, 244, 1, 2]);
        put_tuple(&mut buf, CTA_TUPLE_REPLY, &reply);
        let entry = parse_entry(&buf).expect("entry");
        assert_eq!(entry.original, tuple);
        assert_eq!(entry.reply, reply);
    }

    #[test]
    fn ipv6_tuples_round_trip() {
        let tuple = Tuple {
            src: "fd00::1".parse().expect("ip"),
            dst: "fd00::10".parse().expect("ip"),
            protocol: 17,
            src_port: 1,
            dst_port: 2,
        };
        let mut buf = BytesMut::new();
        put_tuple(&mut buf, CTA_TUPLE_ORIG, &tuple);
        put_tuple(&mut buf, CTA_TUPLE_REPLY, &tuple);
        assert_eq!(parse_entry(&buf).expect("entry").original, tuple);
    }

    #[test]
    fn the_tcp_state_is_read_from_the_protocol_info() {
        let tuple = Tuple {
            src: IpAddr::from([10, 0, 0, 1]),
            dst: IpAddr::from([10, 96, 0, 10]),
            protocol: 6,
            src_port: 40000,
            dst_port: 80,
        };
        let mut buf = BytesMut::new();
        put_tuple(&mut buf, CTA_TUPLE_ORIG, &tuple);
        put_tuple(&mut buf, CTA_TUPLE_REPLY, &tuple);
        assert_eq!(parse_entry(&buf).expect("entry").tcp_state, None);
        for (state, closing) in [(3u8, false), (7, true), (8, true), (9, false)] {
            let mut with_state = buf.clone();
            put_nested(&mut with_state, CTA_PROTOINFO, |buf| {
                put_nested(buf, CTA_PROTOINFO_TCP, |buf| {
                    put_attr(buf, CTA_PROTOINFO_TCP_STATE, &[state]);
                });
            });
            let entry = parse_entry(&with_state).expect("entry");
            assert_eq!(entry.tcp_state, Some(state));
            assert_eq!(entry.tcp_closing(), closing, "state {state}");
        }
    }

    #[test]
    fn truncated_attributes_are_not_a_panic() {
        let mut buf = BytesMut::new();
        put_tuple(
            &mut buf,
            CTA_TUPLE_ORIG,
            &Tuple {
                src: IpAddr::from([1, 1, 1, 1]),
                dst: IpAddr::from([2, 2, 2, 2]),
                protocol: 6,
                src_port: 1,
                dst_port: 2,
            },
        );
        for cut in 0..buf.len() {
            let _ = parse_entry(&buf[..cut]);
        }
    }
}
