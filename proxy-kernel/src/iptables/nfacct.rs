//! The nfacct objects kube-proxy's iptables mode counts packets with
//! (`pkg/proxy/util/nfacct`): created over nfnetlink (`NFNL_SUBSYS_ACCT`) when the proxier starts,
//! matched by `-m nfacct --nfacct-name …` rules, read for the metrics at every scrape.
//! Messages follow `linux/netfilter/nfnetlink_acct.h`; attribute headers are host byte order,
//! the counters network byte order. Objects belong to the network namespace of the thread that
//! opens the socket.

use std::time::Duration;

use bytes::{BufMut as _, BytesMut};
use nix::sys::socket::SockProtocol;

use crate::netlink::{NLM_F_ACK, NLM_F_REQUEST, NetlinkError, NetlinkSocket, attributes, put_str};

/// kube-proxy's two counters (its metrics package), matched by the iptables mode's rules.
pub const NFACCT_CT_STATE_INVALID: &str = "ct_state_invalid_dropped_pkts";
pub const NFACCT_LOCALHOST_NODEPORTS: &str = "localhost_nps_accepted_pkts";

const NFNL_SUBSYS_ACCT: u16 = 7;
const NFNL_MSG_ACCT_NEW: u16 = 0;
const NFNL_MSG_ACCT_GET: u16 = 1;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NFACCT_NAME: u16 = 1;
const NFACCT_PKTS: u16 = 2;
const NFACCT_BYTES: u16 = 3;
/// `NFACCT_NAME_MAX`, the terminating NUL included.
const NAME_MAX: usize = 32;
/// A kernel that never answers must not hang a scrape.
const RECV_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum NfacctError {
    #[error("nfacct: {0}")]
    Open(#[source] NetlinkError),
    /// Includes a kernel without nfnetlink_acct (the subsystem request is refused).
    #[error("nfacct counter {name:?}: {source}")]
    Netlink {
        name: String,
        #[source]
        source: NetlinkError,
    },
    #[error("nfacct counter {0:?}: the name is longer than 31 bytes")]
    NameTooLong(String),
    #[error("nfacct counter {0:?}: no packet and byte counts in the kernel's answer")]
    Malformed(String),
}

impl NfacctError {
    /// The object does not exist (the subsystem answered).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            NfacctError::Netlink {
                source: NetlinkError::Kernel(nix::Error::ENOENT),
                ..
            }
        )
    }

    fn of(name: &str) -> impl FnOnce(NetlinkError) -> Self {
        let name = name.to_owned();
        move |source| NfacctError::Netlink { name, source }
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
    socket: NetlinkSocket,
}

/// `struct nfgenmsg` (AF_UNSPEC, NFNETLINK_V0, res_id 0) and the name attribute.
fn request_body(name: &str) -> impl FnOnce(&mut BytesMut) + '_ {
    move |buf| {
        buf.put_u8(0);
        buf.put_u8(0);
        buf.put_u16(0);
        put_str(buf, NFACCT_NAME, name);
    }
}

impl Nfacct {
    pub fn open() -> Result<Self, NfacctError> {
        let socket = NetlinkSocket::open(SockProtocol::NetlinkNetFilter, Some(RECV_TIMEOUT))
            .map_err(NfacctError::Open)?;
        Ok(Self { socket })
    }

    /// Creates the counter unless it exists (upstream's `Ensure`: a Get, then an Add).
    pub fn ensure(&mut self, name: &str) -> Result<(), NfacctError> {
        match self.get(name) {
            Ok(_) => Ok(()),
            Err(error) if error.is_not_found() => match self.add(name) {
                // Another process created it meanwhile.
                Err(NfacctError::Netlink {
                    source: NetlinkError::Kernel(nix::Error::EBUSY | nix::Error::EEXIST),
                    ..
                }) => Ok(()),
                other => other,
            },
            Err(error) => Err(error),
        }
    }

    pub fn add(&mut self, name: &str) -> Result<(), NfacctError> {
        check_name(name)?;
        self.socket
            .request_ack(
                (NFNL_SUBSYS_ACCT << 8) | NFNL_MSG_ACCT_NEW,
                NLM_F_CREATE | NLM_F_EXCL,
                request_body(name),
            )
            .map_err(NfacctError::of(name))
    }

    pub fn get(&mut self, name: &str) -> Result<Counter, NfacctError> {
        check_name(name)?;
        self.socket
            .send(
                (NFNL_SUBSYS_ACCT << 8) | NFNL_MSG_ACCT_GET,
                NLM_F_REQUEST | NLM_F_ACK,
                request_body(name),
            )
            .map_err(NfacctError::of(name))?;
        let mut counter = None;
        self.socket
            .receive(|_, payload| {
                // Past the 4-byte nfgenmsg: the attributes.
                counter = counter.or(parse_counter(payload.get(4..).unwrap_or_default()));
                Ok::<(), NetlinkError>(())
            })
            .map_err(NfacctError::of(name))?;
        counter.ok_or_else(|| NfacctError::Malformed(name.to_owned()))
    }
}

fn check_name(name: &str) -> Result<(), NfacctError> {
    if name.len() >= NAME_MAX || name.contains('\0') {
        return Err(NfacctError::NameTooLong(name.to_owned()));
    }
    Ok(())
}

/// The packet and byte counts of an `NFNL_MSG_ACCT_NEW` answer's attributes.
fn parse_counter(attrs: &[u8]) -> Option<Counter> {
    let (mut packets, mut bytes) = (None, None);
    for (kind, payload) in attributes(attrs) {
        let value = payload.try_into().ok().map(u64::from_be_bytes);
        match kind {
            NFACCT_PKTS => packets = value,
            NFACCT_BYTES => bytes = value,
            _ => {}
        }
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
        let mut buf = BytesMut::new();
        crate::netlink::put_attr(&mut buf, kind, payload);
        buf.to_vec()
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
