//! Netlink framing shared by the agent's kernel clients (ctnetlink, sock_diag, nfacct, IPVS):
//! the message header, request/ACK/dump exchanges and attribute encoding. Each client keeps
//! only its own message types and payloads. Headers and attribute headers are host byte order
//! (`linux/netlink.h`); payload byte order is the family's business.

use std::{
    os::fd::{AsFd, AsRawFd as _, OwnedFd},
    time::Duration,
};

use bytes::{BufMut as _, BytesMut};
use nix::sys::{
    socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send,
        setsockopt, socket, sockopt,
    },
    time::TimeVal,
};

pub const NLMSG_HDRLEN: usize = 16;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("{context}: {source}")]
    Socket {
        context: &'static str,
        #[source]
        source: nix::Error,
    },
    /// The kernel's answer to a request was an error code.
    #[error("the kernel answered {0}")]
    Kernel(nix::Error),
    #[error("malformed netlink message: {0}")]
    Malformed(&'static str),
}

/// A netlink socket in the network namespace of the thread that opened it.
#[derive(Debug)]
pub struct NetlinkSocket {
    fd: OwnedFd,
    seq: u32,
}

impl NetlinkSocket {
    /// `recv_timeout` bounds each receive (a kernel that never answers ends in an error).
    pub fn open(
        protocol: SockProtocol,
        recv_timeout: Option<Duration>,
    ) -> Result<Self, NetlinkError> {
        let socket_error = |context| move |source| NetlinkError::Socket { context, source };
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            protocol,
        )
        .map_err(socket_error("opening a netlink socket"))?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))
            .map_err(socket_error("binding a netlink socket"))?;
        if let Some(timeout) = recv_timeout {
            let timeout = TimeVal::new(
                i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
                i64::from(timeout.subsec_micros()),
            );
            setsockopt(&fd, sockopt::ReceiveTimeout, &timeout)
                .map_err(socket_error("setting SO_RCVTIMEO on a netlink socket"))?;
        }
        Ok(Self { fd, seq: 0 })
    }

    /// Sends one message: the header (with the next sequence number), then `body`.
    pub fn send(
        &mut self,
        kind: u16,
        flags: u16,
        body: impl FnOnce(&mut BytesMut),
    ) -> Result<(), NetlinkError> {
        self.seq = self.seq.wrapping_add(1);
        let message = message(kind, flags, self.seq, body);
        send(self.fd.as_raw_fd(), &message, MsgFlags::empty()).map_err(|source| {
            NetlinkError::Socket {
                context: "sending a netlink request",
                source,
            }
        })?;
        Ok(())
    }

    /// Reads replies until NLMSG_DONE (dumps) or the ACK/error (requests), calling `each`
    /// with the type and payload of every data message. Bounded by the replies' end, a
    /// receive timeout when the socket has one, or an error.
    pub fn receive<E: From<NetlinkError>>(
        &self,
        mut each: impl FnMut(u16, &[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|source| {
                NetlinkError::Socket {
                    context: "receiving a netlink reply",
                    source,
                }
            })?;
            if n == 0 {
                return Err(NetlinkError::Malformed("empty datagram").into());
            }
            let datagram = buf.get(..n).unwrap_or_default();
            if walk_datagram(datagram, &mut each)? {
                return Ok(());
            }
        }
    }

    /// A request answered by an ACK (or an error).
    pub fn request_ack(
        &mut self,
        kind: u16,
        flags: u16,
        body: impl FnOnce(&mut BytesMut),
    ) -> Result<(), NetlinkError> {
        self.send(kind, flags | NLM_F_REQUEST | NLM_F_ACK, body)?;
        self.receive(|_, _| Ok::<(), NetlinkError>(()))
    }
}

impl AsFd for NetlinkSocket {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// One netlink message: header with the length patched in, then `body`.
pub fn message(kind: u16, flags: u16, seq: u32, body: impl FnOnce(&mut BytesMut)) -> BytesMut {
    let mut buf = BytesMut::with_capacity(128);
    buf.put_u32_ne(0); // length, patched below
    buf.put_u16_ne(kind);
    buf.put_u16_ne(flags);
    buf.put_u32_ne(seq);
    buf.put_u32_ne(0); // port id: the kernel fills in ours
    body(&mut buf);
    let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
    buf[0..4].copy_from_slice(&len.to_ne_bytes());
    buf
}

/// Walks the messages of one received datagram, calling `each` with (type, payload) of every
/// data message. Returns whether the reply is complete (DONE or the ACK); an error message
/// becomes [`NetlinkError::Kernel`].
pub fn walk_datagram<E: From<NetlinkError>>(
    mut rest: &[u8],
    each: &mut impl FnMut(u16, &[u8]) -> Result<(), E>,
) -> Result<bool, E> {
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(read4(rest, 0)?) as usize;
        let kind = u16::from_ne_bytes(read2(rest, 4)?);
        if len < NLMSG_HDRLEN || len > rest.len() {
            return Err(NetlinkError::Malformed("message length").into());
        }
        let payload = &rest[NLMSG_HDRLEN..len];
        match kind {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let code = i32::from_ne_bytes(read4(payload, 0)?);
                if code == 0 {
                    return Ok(true); // the ACK
                }
                return Err(
                    NetlinkError::Kernel(nix::Error::from_raw(code.saturating_neg())).into(),
                );
            }
            _ => each(kind, payload)?,
        }
        rest = rest.get(align4(len)..).unwrap_or_default();
    }
    Ok(false)
}

pub fn align4(n: usize) -> usize {
    (n + 3) & !3
}

pub fn read2(buf: &[u8], at: usize) -> Result<[u8; 2], NetlinkError> {
    buf.get(at..at + 2)
        .and_then(|b| b.try_into().ok())
        .ok_or(NetlinkError::Malformed("truncated"))
}

pub fn read4(buf: &[u8], at: usize) -> Result<[u8; 4], NetlinkError> {
    buf.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .ok_or(NetlinkError::Malformed("truncated"))
}

/// Iterates over netlink attributes: (type without flags, payload). Stops at the first
/// malformed one.
pub fn attributes(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = usize::from(u16::from_ne_bytes(read2(buf, 0).ok()?));
        let kind = u16::from_ne_bytes(read2(buf, 2).ok()?) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = buf.get(align4(len)..).unwrap_or_default();
        Some((kind, payload))
    })
}

pub fn put_attr(buf: &mut BytesMut, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.put_u16_ne(u16::try_from(len).unwrap_or(u16::MAX));
    buf.put_u16_ne(kind);
    buf.put_slice(payload);
    buf.put_bytes(0, align4(len) - len);
}

/// A NUL-terminated string attribute.
pub fn put_str(buf: &mut BytesMut, kind: u16, text: &str) {
    let mut payload = Vec::with_capacity(text.len() + 1);
    payload.extend_from_slice(text.as_bytes());
    payload.push(0);
    put_attr(buf, kind, &payload);
}

pub fn put_nested(buf: &mut BytesMut, kind: u16, body: impl FnOnce(&mut BytesMut)) {
    let start = buf.len();
    buf.put_u32_ne(0);
    body(buf);
    let len = buf.len() - start;
    buf[start..start + 2].copy_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    buf[start + 2..start + 4].copy_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_round_trip() {
        let mut buf = BytesMut::new();
        put_nested(&mut buf, 7, |buf| {
            put_attr(buf, 1, &[1, 2, 3]);
            put_str(buf, 2, "kube");
        });
        let (kind, inner) = attributes(&buf).next().expect("outer");
        assert_eq!(kind, 7);
        let inner: Vec<(u16, &[u8])> = attributes(inner).collect();
        assert_eq!(inner, [(1, &[1u8, 2, 3][..]), (2, &b"kube\0"[..])]);
    }

    #[test]
    fn a_datagram_ends_with_done_or_the_ack_and_reports_errors() {
        let data = message(20, 0, 1, |b| b.put_slice(&[9, 9, 9, 9]));
        let done = message(NLMSG_DONE, 0, 1, |b| b.put_u32_ne(0));
        let mut datagram = data.to_vec();
        datagram.extend_from_slice(&done);
        let mut seen = Vec::new();
        let complete = walk_datagram(&datagram, &mut |kind, payload: &[u8]| {
            seen.push((kind, payload.to_vec()));
            Ok::<(), NetlinkError>(())
        })
        .expect("walk");
        assert!(complete);
        assert_eq!(seen, [(20, vec![9, 9, 9, 9])]);

        let error = message(NLMSG_ERROR, 0, 1, |b| b.put_i32_ne(-libc::ENOENT));
        let result = walk_datagram(&error, &mut |_, _| Ok::<(), NetlinkError>(()));
        assert!(matches!(
            result,
            Err(NetlinkError::Kernel(nix::Error::ENOENT))
        ));
    }

    #[test]
    fn truncated_input_is_an_error_or_ignored_never_a_panic() {
        let data = message(20, 0, 1, |b| put_attr(b, 1, &[1, 2, 3, 4, 5]));
        for cut in 0..data.len() {
            let _ = walk_datagram(&data[..cut], &mut |_, payload: &[u8]| {
                attributes(payload).for_each(drop);
                Ok::<(), NetlinkError>(())
            });
        }
    }
}
