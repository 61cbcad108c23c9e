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

use std::{io, time::Duration};

use aya::programs::{
    SchedClassifier, TcAttachType,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
};
use bytes::BufMut as _;
use nix::sys::socket::SockProtocol;
use proxy_common::program_names;
use tracing::debug;

use proxy_kernel::netlink::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkError, NetlinkSocket, attributes};

/// Our filters' priority: rare enough not to collide with other components (tc's automatic
/// priorities start at 49152 and count down; Cilium's legacy mode uses 1).
pub const PRIORITY: u16 = 0x6b70;
/// Our filters' handle within [`PRIORITY`].
pub const HANDLE: u32 = 0x6b70;

const RTM_GETTFILTER: u16 = 46;
const TCMSG_LEN: usize = 20;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_NAME: u16 = 7;
/// `TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS / EGRESS)`.
const PARENT_INGRESS: u32 = 0xffff_fff2;
const PARENT_EGRESS: u32 = 0xffff_fff3;
/// Bound for each receive of a dump.
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
    let mut netlink = NetlinkSocket::open(SockProtocol::NetlinkRoute, Some(RECV_TIMEOUT))
        .map_err(io::Error::other)?;
    netlink
        .send(RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP, |buf| {
            // struct tcmsg: family AF_UNSPEC and padding, ifindex, handle, parent, info (0:
            // every priority and protocol).
            buf.put_slice(&[0, 0, 0, 0]);
            buf.put_i32_ne(ifindex as i32);
            buf.put_u32_ne(0);
            buf.put_u32_ne(parent);
            buf.put_u32_ne(0);
        })
        .map_err(io::Error::other)?;
    let mut out = Vec::new();
    // Bounded: the dump ends with NLMSG_DONE; a stuck kernel ends in the receive timeout.
    let dumped = netlink.receive(|_, payload| {
        out.extend(parse_filter(payload));
        Ok::<(), NetlinkError>(())
    });
    match dumped {
        Ok(()) => Ok(out),
        // No clsact qdisc: no filters.
        Err(NetlinkError::Kernel(nix::Error::EINVAL | nix::Error::ENOENT)) => Ok(out),
        Err(NetlinkError::Kernel(errno)) => Err(io::Error::from_raw_os_error(errno as i32)),
        Err(error) => Err(io::Error::other(error)),
    }
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
