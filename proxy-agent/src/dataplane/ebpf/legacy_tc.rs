//! tc programs as legacy `cls_bpf` filters on a `clsact` qdisc, for kernels without TCX
//! (< 6.6) or with `--bpf-disable-feature tcx`.
//!
//! Our filters sit at one fixed slot per hook: priority [`PRIORITY`], handle [`HANDLE`],
//! protocol all, direct action. That slot is how a restarted agent finds them again (legacy
//! filters cannot be pinned): it replaces the program in place — one `RTM_NEWTFILTER` without
//! `NLM_F_CREATE`, so the hook never runs without our program and never runs two of them —
//! and only after reading back that the filter in the slot is a `bpf` filter named after one
//! of our programs. A filter we did not create is never replaced or deleted: a foreign filter
//! in our slot makes the attach fail with an error naming it. Filters at other priorities run
//! before ours (lower numbers) or after ours (higher numbers: ours pass everything that is not
//! theirs to keep with `TC_ACT_UNSPEC`). The `clsact` qdisc is created when missing and never
//! deleted (deleting it would delete every other filter on it too).

use std::{io, os::fd::AsRawFd as _, time::Duration};

use aya::programs::{
    SchedClassifier, TcAttachType,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
};
use nix::sys::{
    socket::{
        AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, recv, send, setsockopt, socket,
        sockopt,
    },
    time::TimeVal,
};
use proxy_common::program_names;
use tracing::debug;

/// Our filters' priority: rare enough not to collide with other components (tc's automatic
/// priorities start at 49152 and count down; Cilium's legacy mode uses 1).
pub const PRIORITY: u16 = 0x6b70;
/// Our filters' handle within [`PRIORITY`].
pub const HANDLE: u32 = 0x6b70;

const RTM_GETTFILTER: u16 = 46;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_HDRLEN: usize = 16;
const TCMSG_LEN: usize = 20;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_NAME: u16 = 7;
/// `TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS / EGRESS)`.
const PARENT_INGRESS: u32 = 0xffff_fff2;
const PARENT_EGRESS: u32 = 0xffff_fff3;
/// Bounds for a dump: datagrams read and time per receive.
const MAX_DATAGRAMS: usize = 10_000;
const RECV_TIMEOUT: Duration = Duration::from_secs(2);

/// The tc programs' names: what marks a `bpf` filter as ours.
const OURS: [&str; 3] = [
    program_names::TC_EXTERNAL,
    program_names::TC_REPLY,
    program_names::TC_EGRESS,
];

#[derive(Debug, thiserror::Error)]
pub enum LegacyTcError {
    #[error("{interface}: listing tc filters: {source}")]
    Dump {
        interface: String,
        source: io::Error,
    },
    #[error(
        "{interface} {direction}: tc filter priority {PRIORITY} handle {HANDLE:#x} belongs to \
         another component ({kind} {name:?}); not replacing it"
    )]
    Foreign {
        interface: String,
        direction: &'static str,
        kind: String,
        name: String,
    },
    #[error("{interface} {direction}: {source}")]
    Attach {
        interface: String,
        direction: &'static str,
        source: aya::programs::ProgramError,
    },
}

/// One filter as the kernel lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    pub kind: String,
    /// `cls_bpf`'s program name (empty for other kinds).
    pub name: String,
}

impl Filter {
    fn is_ours(&self) -> bool {
        self.kind == "bpf" && OURS.contains(&self.name.as_str())
    }
}

fn direction_name(direction: TcAttachType) -> &'static str {
    match direction {
        TcAttachType::Egress => "egress",
        _ => "ingress",
    }
}

/// Attaches `classifier` (loaded) at our slot of `interface`'s `direction` hook: replaces our
/// previous program there in place, creates the filter (and the `clsact` qdisc) when missing.
pub fn attach(
    classifier: &mut SchedClassifier,
    interface: &str,
    ifindex: u32,
    direction: TcAttachType,
) -> Result<(), LegacyTcError> {
    let direction_str = direction_name(direction);
    let attach_error = |source| LegacyTcError::Attach {
        interface: interface.to_owned(),
        direction: direction_str,
        source,
    };
    // Fails with EEXIST when the qdisc is there already; a real failure shows in the attach.
    if let Err(error) = tc::qdisc_add_clsact(interface) {
        debug!(interface, %error, "clsact qdisc not added (present already?)");
    }
    let existing = filters(ifindex, direction)
        .map_err(|source| LegacyTcError::Dump {
            interface: interface.to_owned(),
            source,
        })?
        .into_iter()
        .find(|f| f.priority == PRIORITY && f.handle == HANDLE);
    let link_id = match existing {
        Some(filter) if filter.is_ours() => {
            let previous = SchedClassifierLink::attached(
                interface,
                direction,
                PRIORITY,
                TcHandle::from(HANDLE),
                None,
            )
            .map_err(|e| attach_error(tc::TcError::IoError(e).into()))?;
            classifier.attach_to_link(previous).map_err(attach_error)?
        }
        Some(filter) => {
            return Err(LegacyTcError::Foreign {
                interface: interface.to_owned(),
                direction: direction_str,
                kind: filter.kind,
                name: filter.name,
            });
        }
        None => classifier
            .attach_with_options(
                interface,
                direction,
                TcAttachOptions::Netlink(NlOptions {
                    priority: PRIORITY,
                    handle: TcHandle::from(HANDLE),
                    classid: None,
                }),
            )
            .map_err(attach_error)?,
    };
    let link = classifier.take_link(link_id).map_err(attach_error)?;
    // Dropping a netlink link deletes the filter; the filter must outlive this process like a
    // pinned TCX link does (the next agent replaces it in place, `--cleanup` deletes it).
    std::mem::forget(link);
    Ok(())
}

/// Deletes our filters from both hooks of `interface` (the ones named after our programs, in
/// any slot); others' filters and the qdisc stay. Returns how many were deleted.
pub fn remove_ours(interface: &str) -> usize {
    let mut removed = 0;
    for direction in [TcAttachType::Ingress, TcAttachType::Egress] {
        for name in OURS {
            match tc::qdisc_detach_program(interface, direction, name) {
                Ok(()) => {
                    removed += 1;
                    debug!(interface, program = name, "legacy tc filter deleted");
                }
                Err(error) => debug!(interface, program = name, %error, "no legacy tc filter"),
            }
        }
    }
    removed
}

/// The filters on `ifindex`'s clsact `direction` hook (none without the qdisc).
pub fn filters(ifindex: u32, direction: TcAttachType) -> io::Result<Vec<Filter>> {
    let parent = match direction {
        TcAttachType::Egress => PARENT_EGRESS,
        _ => PARENT_INGRESS,
    };
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkRoute,
    )?;
    setsockopt(
        &fd,
        sockopt::ReceiveTimeout,
        &TimeVal::new(
            RECV_TIMEOUT.as_secs() as _,
            RECV_TIMEOUT.subsec_micros() as _,
        ),
    )?;
    let len = (NLMSG_HDRLEN + TCMSG_LEN) as u32;
    let mut msg = Vec::with_capacity(len as usize);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&RTM_GETTFILTER.to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(&[0, 0, 0, 0]); // family AF_UNSPEC, padding
    msg.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // handle
    msg.extend_from_slice(&parent.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // info: every priority and protocol
    send(fd.as_raw_fd(), &msg, MsgFlags::empty())?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    for _ in 0..MAX_DATAGRAMS {
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        let mut rest = &buf[..n];
        while rest.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            if len < NLMSG_HDRLEN || len > rest.len() {
                break;
            }
            let kind = u16::from_ne_bytes([rest[4], rest[5]]);
            let payload = &rest[NLMSG_HDRLEN..len];
            match kind {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let errno = payload.get(..4).map_or(-libc::EPROTO, |b| {
                        i32::from_ne_bytes([b[0], b[1], b[2], b[3]])
                    });
                    // No clsact qdisc: no filters.
                    if -errno == libc::EINVAL || -errno == libc::ENOENT {
                        return Ok(out);
                    }
                    if errno != 0 {
                        return Err(io::Error::from_raw_os_error(-errno));
                    }
                }
                _ => out.extend(parse_filter(payload)),
            }
            rest = rest.get((len + 3) & !3..).unwrap_or_default();
        }
    }
    Err(io::Error::other("tc filter dump did not end"))
}

/// A `tcmsg` with its attributes; the header-only entries tc lists per priority have no
/// kind-specific options and handle 0.
fn parse_filter(payload: &[u8]) -> Option<Filter> {
    let header = payload.get(..TCMSG_LEN)?;
    let handle = u32::from_ne_bytes(header[8..12].try_into().ok()?);
    let info = u32::from_ne_bytes(header[16..20].try_into().ok()?);
    let mut filter = Filter {
        priority: (info >> 16) as u16,
        handle,
        kind: String::new(),
        name: String::new(),
    };
    for (kind, value) in attributes(&payload[TCMSG_LEN..]) {
        match kind {
            TCA_KIND => filter.kind = c_string(value),
            TCA_OPTIONS => {
                for (kind, value) in attributes(value) {
                    if kind == TCA_BPF_NAME {
                        filter.name = c_string(value);
                    }
                }
            }
            _ => {}
        }
    }
    Some(filter)
}

fn attributes(mut rest: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while rest.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([rest[0], rest[1]]));
        // NLA_F_NESTED and NLA_F_NET_BYTEORDER are flags in the type's top bits.
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
        if len < 4 || len > rest.len() {
            break;
        }
        out.push((kind, &rest[4..len]));
        rest = rest.get((len + 3) & !3..).unwrap_or_default();
    }
    out
}

fn c_string(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&u16::try_from(4 + value.len()).expect("len").to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out
    }

    #[test]
    fn parses_a_bpf_filter_and_tells_ours_from_a_foreign_one() {
        let mut payload = vec![0u8; TCMSG_LEN];
        payload[8..12].copy_from_slice(&HANDLE.to_ne_bytes());
        payload[16..20].copy_from_slice(&((u32::from(PRIORITY) << 16) | 0x0300).to_ne_bytes());
        payload.extend(attr(TCA_KIND, b"bpf\0"));
        let options = attr(TCA_BPF_NAME, b"kpr_tc_external\0");
        payload.extend(attr(TCA_OPTIONS | 0x8000, &options));
        let filter = parse_filter(&payload).expect("parses");
        assert_eq!(
            (filter.priority, filter.handle, filter.kind.as_str()),
            (PRIORITY, HANDLE, "bpf")
        );
        assert!(filter.is_ours(), "{filter:?}");
        let foreign = Filter {
            name: "cil_from_netdev".into(),
            ..filter.clone()
        };
        assert!(!foreign.is_ours());
        let u32_filter = Filter {
            kind: "u32".into(),
            ..filter
        };
        assert!(!u32_filter.is_ours());
        // Truncated input: no panic, no filter.
        assert_eq!(parse_filter(&payload[..10]), None);
    }
}
