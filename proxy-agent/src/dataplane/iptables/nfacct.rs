//! The nfacct objects kube-proxy's iptables mode counts packets with
//! (`pkg/proxy/util/nfacct`): created over nfnetlink (`NFNL_SUBSYS_ACCT`) when the proxier starts,
//! matched by `-m nfacct --nfacct-name …` rules, read for the metrics at every scrape.
//! Messages follow `linux/netfilter/nfnetlink_acct.h`; attribute headers are host byte order,
//! the counters network byte order. Objects belong to the network namespace of the thread that
//! opens the socket.

use std::os::fd::{AsRawFd as _, OwnedFd};

use bytes::{BufMut as _, BytesMut};
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send,
    socket,
};

const NFNL_SUBSYS_ACCT: u16 = 7;
const NFNL_MSG_ACCT_NEW: u16 = 0;
const NFNL_MSG_ACCT_GET: u16 = 1;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NFACCT_NAME: u16 = 1;
const NFACCT_PKTS: u16 = 2;
const NFACCT_BYTES: u16 = 3;
const NLA_TYPE_MASK: u16 = 0x3fff;
/// `NFACCT_NAME_MAX`, the terminating NUL included.
const NAME_MAX: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum NfacctError {
    #[error("nfacct netlink socket: {0}")]
    Socket(nix::Error),
    /// The kernel has no nfnetlink_acct (no `NFNL_SUBSYS_ACCT` handler): EOPNOTSUPP/ENOENT on
    /// a request the subsystem would have answered.
    #[error("nfacct counter {name:?}: kernel answered {error}")]
    Kernel { name: String, error: nix::Error },
    #[error("nfacct counter {0:?}: the name is longer than 31 bytes")]
    NameTooLong(String),
    #[error("nfacct counter {0:?}: malformed reply from the kernel")]
    Malformed(String),
}

impl NfacctError {
    /// The object does not exist (the subsystem answered).
    pub fn is_not_found(&self) -> bool {
        matches!(self, NfacctError::Kernel { error, .. } if *error == nix::Error::ENOENT)
    }
}

/// A counter's readings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// An nfnetlink socket for the accounting subsystem.
#[derive(Debug)]
pub struct Nfacct {
    fd: OwnedFd,
    seq: u32,
}

impl Nfacct {
    pub fn open() -> Result<Self, NfacctError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )
        .map_err(NfacctError::Socket)?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(NfacctError::Socket)?;
        Ok(Self { fd, seq: 1 })
    }

    /// Creates the counter unless it exists (upstream's `Ensure`: a Get, then an Add).
    pub fn ensure(&mut self, name: &str) -> Result<(), NfacctError> {
        match self.get(name) {
            Ok(_) => Ok(()),
            Err(error) if error.is_not_found() => match self.add(name) {
                // Another process created it meanwhile.
                Err(NfacctError::Kernel {
                    error: nix::Error::EBUSY | nix::Error::EEXIST,
                    ..
                }) => Ok(()),
                other => other,
            },
            Err(error) => Err(error),
        }
    }

    pub fn add(&mut self, name: &str) -> Result<(), NfacctError> {
        let message = self.message(
            NFNL_MSG_ACCT_NEW,
            NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK,
            name,
        )?;
        self.send(&message)?;
        self.receive(name, |_| Ok(()))
    }

    pub fn get(&mut self, name: &str) -> Result<Counter, NfacctError> {
        let message = self.message(NFNL_MSG_ACCT_GET, NLM_F_REQUEST | NLM_F_ACK, name)?;
        self.send(&message)?;
        let mut counter = None;
        self.receive(name, |payload| {
            counter = Some(parse_counter(payload).ok_or_else(|| malformed(name))?);
            Ok(())
        })?;
        counter.ok_or_else(|| malformed(name))
    }

    fn message(&mut self, kind: u16, flags: u16, name: &str) -> Result<BytesMut, NfacctError> {
        check_name(name)?;
        self.seq = self.seq.wrapping_add(1);
        let mut buf = BytesMut::with_capacity(64);
        buf.put_u32_ne(0); // length, patched below
        buf.put_u16_ne((NFNL_SUBSYS_ACCT << 8) | kind);
        buf.put_u16_ne(flags);
        buf.put_u32_ne(self.seq);
        buf.put_u32_ne(0);
        // struct nfgenmsg: AF_UNSPEC, NFNETLINK_V0, res_id 0
        buf.put_u8(0);
        buf.put_u8(0);
        buf.put_u16(0);
        let mut payload = name.as_bytes().to_vec();
        payload.push(0);
        let len = 4 + payload.len();
        buf.put_u16_ne(u16::try_from(len).unwrap_or(u16::MAX));
        buf.put_u16_ne(NFACCT_NAME);
        buf.put_slice(&payload);
        buf.put_bytes(0, align4(len) - len);
        let total = u32::try_from(buf.len()).unwrap_or(u32::MAX);
        buf[0..4].copy_from_slice(&total.to_ne_bytes());
        Ok(buf)
    }

    fn send(&self, message: &[u8]) -> Result<(), NfacctError> {
        send(self.fd.as_raw_fd(), message, MsgFlags::empty()).map_err(NfacctError::Socket)?;
        Ok(())
    }

    /// Reads until the ACK or an error, calling `each` with every data message's attributes.
    fn receive(
        &self,
        name: &str,
        mut each: impl FnMut(&[u8]) -> Result<(), NfacctError>,
    ) -> Result<(), NfacctError> {
        let mut buf = vec![0u8; 8192];
        // A request is answered by at most a data message and the ACK; bound the loop anyway.
        for _ in 0..16 {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty())
                .map_err(NfacctError::Socket)?;
            let mut rest = buf.get(..n).ok_or_else(|| malformed(name))?;
            while rest.len() >= 16 {
                let len =
                    u32::from_ne_bytes(read4(rest, 0).ok_or_else(|| malformed(name))?) as usize;
                let kind = u16::from_ne_bytes([rest[4], rest[5]]);
                if len < 16 || len > rest.len() {
                    return Err(malformed(name));
                }
                let message = &rest[16..len];
                match kind {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let code =
                            i32::from_ne_bytes(read4(message, 0).ok_or_else(|| malformed(name))?);
                        if code == 0 {
                            return Ok(());
                        }
                        return Err(NfacctError::Kernel {
                            name: name.to_owned(),
                            error: nix::Error::from_raw(code.saturating_neg()),
                        });
                    }
                    _ => each(message.get(4..).unwrap_or_default())?,
                }
                rest = &rest[align4(len).min(rest.len())..];
            }
        }
        Err(malformed(name))
    }
}

fn check_name(name: &str) -> Result<(), NfacctError> {
    if name.len() >= NAME_MAX || name.contains('\0') {
        return Err(NfacctError::NameTooLong(name.to_owned()));
    }
    Ok(())
}

fn malformed(name: &str) -> NfacctError {
    NfacctError::Malformed(name.to_owned())
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn read4(buf: &[u8], at: usize) -> Option<[u8; 4]> {
    buf.get(at..at + 4).and_then(|b| b.try_into().ok())
}

/// The packet and byte counts of an `NFNL_MSG_ACCT_NEW` reply's attributes.
fn parse_counter(mut attrs: &[u8]) -> Option<Counter> {
    let (mut packets, mut bytes) = (None, None);
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > attrs.len() {
            return None;
        }
        let payload = &attrs[4..len];
        let value = || payload.try_into().ok().map(u64::from_be_bytes);
        match kind {
            NFACCT_PKTS => packets = value(),
            NFACCT_BYTES => bytes = value(),
            _ => {}
        }
        attrs = &attrs[align4(len).min(attrs.len())..];
    }
    Some(Counter {
        packets: packets?,
        bytes: bytes?,
    })
}

/// Creates kube-proxy's two counters (in the calling thread's network namespace) and says which
/// exist: `(ct_state_invalid_dropped_pkts, localhost_nps_accepted_pkts)`. A failure is logged
/// once per counter with upstream's wording, and its `-m nfacct` match is then left out.
pub fn ensure_kube_proxy_counters() -> (bool, bool) {
    use super::rules::{NFACCT_CT_STATE_INVALID, NFACCT_LOCALHOST_NODEPORTS};
    let mut client = match Nfacct::open() {
        Ok(client) => client,
        Err(error) => {
            tracing::error!(%error, "Failed to create nfacct runner, nfacct based metrics won't be available");
            return (false, false);
        }
    };
    let mut ensure = |name: &str| match client.ensure(name) {
        Ok(()) => true,
        Err(error) => {
            tracing::error!(%error, counter = name, "Failed to create nfacct counter; the corresponding metric will not be updated");
            false
        }
    };
    let invalid = ensure(NFACCT_CT_STATE_INVALID);
    let localhost = ensure(NFACCT_LOCALHOST_NODEPORTS);
    (invalid, localhost)
}

/// The packet count of `name` now, for a scrape.
pub fn packets(name: &str) -> Result<u64, NfacctError> {
    Ok(Nfacct::open()?.get(name)?.packets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
        let len = 4 + payload.len();
        let mut out = Vec::new();
        out.extend_from_slice(&u16::try_from(len).unwrap().to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(payload);
        out.resize(align4(out.len()), 0);
        out
    }

    #[test]
    fn counters_are_read_big_endian() {
        let mut attrs = attr(NFACCT_NAME, b"ct_state_invalid_dropped_pkts\0");
        attrs.extend(attr(NFACCT_PKTS, &7u64.to_be_bytes()));
        attrs.extend(attr(NFACCT_BYTES, &420u64.to_be_bytes()));
        assert_eq!(
            parse_counter(&attrs),
            Some(Counter {
                packets: 7,
                bytes: 420
            })
        );
        // Truncated or missing counters are not a panic.
        assert_eq!(parse_counter(&attrs[..attrs.len() - 3]), None);
        assert_eq!(parse_counter(&attr(NFACCT_NAME, b"x\0")), None);
    }

    #[test]
    fn long_names_are_refused_before_the_kernel_sees_them() {
        assert!(check_name("localhost_nps_accepted_pkts").is_ok());
        assert!(check_name(&"x".repeat(31)).is_ok());
        for bad in ["x".repeat(32), "a\0b".to_owned()] {
            assert!(
                matches!(check_name(&bad), Err(NfacctError::NameTooLong(_))),
                "{bad:?}"
            );
        }
    }
}
