//! A minimal ctnetlink client: dump the conntrack table of one address family and delete
//! entries by their original tuple. Messages follow `linux/netfilter/nfnetlink_conntrack.h`;
//! attribute headers are host byte order, payloads network byte order.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, OwnedFd},
};

use bytes::{BufMut as _, BytesMut};
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send,
    socket,
};

use crate::desired::IpFamily;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

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

#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("conntrack netlink socket: {0}")]
    Socket(nix::Error),
    #[error("conntrack netlink: kernel answered {0}")]
    Kernel(nix::Error),
    #[error("conntrack netlink: malformed message: {0}")]
    Malformed(&'static str),
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
}

/// A ctnetlink socket in the network namespace of the thread that opened it.
#[derive(Debug)]
pub struct Ctnetlink {
    fd: OwnedFd,
    seq: u32,
}

impl Ctnetlink {
    pub fn open() -> Result<Self, ConntrackError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )
        .map_err(ConntrackError::Socket)?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(ConntrackError::Socket)?;
        Ok(Self { fd, seq: 1 })
    }

    /// Every entry of `family`.
    pub fn dump(&mut self, family: IpFamily) -> Result<Vec<ConntrackEntry>, ConntrackError> {
        let message = self.message(
            IPCTNL_MSG_CT_GET,
            NLM_F_REQUEST | NLM_F_DUMP,
            family,
            |_| {},
        );
        self.send(&message)?;
        let mut entries = Vec::new();
        self.receive(|payload| {
            if let Some(entry) = parse_entry(payload)? {
                entries.push(entry);
            }
            Ok(())
        })?;
        Ok(entries)
    }

    /// Deletes the entry with this original tuple. An entry that is already gone is not an
    /// error (it may have expired meanwhile).
    pub fn delete(&mut self, original: &Tuple) -> Result<(), ConntrackError> {
        let family = IpFamily::of(&original.src);
        let message = self.message(
            IPCTNL_MSG_CT_DELETE,
            NLM_F_REQUEST | NLM_F_ACK,
            family,
            |buf| {
                put_tuple(buf, CTA_TUPLE_ORIG, original);
            },
        );
        self.send(&message)?;
        match self.receive(|_| Ok(())) {
            Err(ConntrackError::Kernel(nix::Error::ENOENT)) => Ok(()),
            other => other,
        }
    }

    fn message(
        &mut self,
        kind: u16,
        flags: u16,
        family: IpFamily,
        body: impl FnOnce(&mut BytesMut),
    ) -> BytesMut {
        self.seq = self.seq.wrapping_add(1);
        let mut buf = BytesMut::with_capacity(128);
        buf.put_u32_ne(0); // length, patched below
        buf.put_u16_ne((NFNL_SUBSYS_CTNETLINK << 8) | kind);
        buf.put_u16_ne(flags);
        buf.put_u32_ne(self.seq);
        buf.put_u32_ne(0); // port id: the kernel fills in ours
        // struct nfgenmsg
        buf.put_u8(match family {
            IpFamily::V4 => libc::AF_INET as u8,
            IpFamily::V6 => libc::AF_INET6 as u8,
        });
        buf.put_u8(0); // NFNETLINK_V0
        buf.put_u16(0); // res_id, big endian
        body(&mut buf);
        let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
        buf[0..4].copy_from_slice(&len.to_ne_bytes());
        buf
    }

    fn send(&self, message: &[u8]) -> Result<(), ConntrackError> {
        send(self.fd.as_raw_fd(), message, MsgFlags::empty()).map_err(ConntrackError::Socket)?;
        Ok(())
    }

    /// Reads replies until DONE (dumps) or the ACK/error (requests), calling `each` with the
    /// payload of every data message.
    fn receive(
        &self,
        mut each: impl FnMut(&[u8]) -> Result<(), ConntrackError>,
    ) -> Result<(), ConntrackError> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty())
                .map_err(ConntrackError::Socket)?;
            let datagram = buf
                .get(..n)
                .ok_or(ConntrackError::Malformed("short read"))?;
            if walk_datagram(datagram, &mut each)? {
                return Ok(());
            }
        }
    }
}

/// Walks the netlink messages of one received datagram, calling `each` with the payload of
/// every data message. Returns whether the reply is complete (DONE or the ACK).
fn walk_datagram(
    mut rest: &[u8],
    each: &mut impl FnMut(&[u8]) -> Result<(), ConntrackError>,
) -> Result<bool, ConntrackError> {
    while rest.len() >= 16 {
        let len = u32::from_ne_bytes(read4(rest, 0)?) as usize;
        let kind = u16::from_ne_bytes(read2(rest, 4)?);
        if len < 16 || len > rest.len() {
            return Err(ConntrackError::Malformed("message length"));
        }
        let message = &rest[16..len];
        match kind {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let code = i32::from_ne_bytes(read4(message, 0)?);
                if code == 0 {
                    return Ok(true); // the ACK
                }
                return Err(ConntrackError::Kernel(nix::Error::from_raw(
                    code.saturating_neg(),
                )));
            }
            // Skip the 4-byte nfgenmsg in front of the attributes.
            _ => each(message.get(4..).unwrap_or_default())?,
        }
        rest = &rest[align4(len).min(rest.len())..];
    }
    Ok(false)
}

/// The conntrack entries in one dump datagram as the kernel would send it (for fuzzing the
/// parser without a socket).
pub(crate) fn parse_dump_datagram(datagram: &[u8]) -> Result<Vec<ConntrackEntry>, ConntrackError> {
    let mut entries = Vec::new();
    walk_datagram(datagram, &mut |payload| {
        if let Some(entry) = parse_entry(payload)? {
            entries.push(entry);
        }
        Ok(())
    })?;
    Ok(entries)
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn read2(buf: &[u8], at: usize) -> Result<[u8; 2], ConntrackError> {
    buf.get(at..at + 2)
        .and_then(|b| b.try_into().ok())
        .ok_or(ConntrackError::Malformed("truncated"))
}

fn read4(buf: &[u8], at: usize) -> Result<[u8; 4], ConntrackError> {
    buf.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .ok_or(ConntrackError::Malformed("truncated"))
}

/// Iterates over netlink attributes: (type without flags, payload).
fn attributes(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[align4(len).min(buf.len())..];
        Some((kind, payload))
    })
}

fn put_attr(buf: &mut BytesMut, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.put_u16_ne(u16::try_from(len).unwrap_or(u16::MAX));
    buf.put_u16_ne(kind);
    buf.put_slice(payload);
    buf.put_bytes(0, align4(len) - len);
}

fn put_nested(buf: &mut BytesMut, kind: u16, body: impl FnOnce(&mut BytesMut)) {
    let start = buf.len();
    buf.put_u32_ne(0);
    body(buf);
    let len = buf.len() - start;
    buf[start..start + 2].copy_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    buf[start + 2..start + 4].copy_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
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

fn parse_entry(payload: &[u8]) -> Result<Option<ConntrackEntry>, ConntrackError> {
    let mut original = None;
    let mut reply = None;
    for (kind, value) in attributes(payload) {
        match kind {
            CTA_TUPLE_ORIG => original = parse_tuple(value),
            CTA_TUPLE_REPLY => reply = parse_tuple(value),
            _ => {}
        }
    }
    Ok(original
        .zip(reply)
        .map(|(original, reply)| ConntrackEntry { original, reply }))
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
        let entry = parse_entry(&buf).expect("parse").expect("entry");
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
        assert_eq!(
            parse_entry(&buf).expect("parse").expect("entry").original,
            tuple
        );
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
