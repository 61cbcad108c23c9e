//! Destroying connected UDP sockets whose backend was removed (netlink `SOCK_DIAG`).
//!
//! A connected UDP socket was translated once, at `connect()`; without help it keeps sending to
//! its backend forever, even after that backend left the Service (the stale-UDP pain of
//! kubernetes#48370 and cilium#12859). After each map update the agent destroys such sockets
//! with `SOCK_DESTROY`: the kernel aborts them with `ECONNABORTED` (a blocked `recv()` wakes up
//! with it) and disconnects them, so the client's retry opens a new socket that the connect
//! hook sends to a live backend.
//!
//! Which sockets: sockets live in the network namespaces of the processes in the attached
//! cgroup (pods each have their own), and `SOCK_DIAG` only sees the namespace of the netlink
//! socket. So the agent collects the distinct network namespaces of every process in the
//! cgroup subtree, enters each on a short-lived thread (`setns` affects only that thread),
//! dumps its connected UDP sockets with the removed backend as destination, and destroys only
//! those whose (cookie, backend) entry in the reverse-NAT map says they were translated from
//! the frontend that lost the backend. A socket that dialled the pod address directly, or
//! reached the backend through another Service that still has it, is left alone.
//!
//! TCP sockets are deliberately not destroyed: kube-proxy lets established TCP connections to a
//! removed (e.g. terminating) endpoint drain, and a pod that is really gone answers with a
//! reset or times out, which TCP clients handle.

use std::{
    collections::BTreeSet,
    fs::File,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::{
        fd::{AsRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::{Path, PathBuf},
    time::Duration,
};

use nix::{
    sched::{CloneFlags, setns},
    sys::socket::{
        AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, recv, send, setsockopt, socket,
        sockopt,
    },
    sys::time::TimeVal,
};
use tracing::debug;

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_HDRLEN: usize = 16;
/// `struct inet_diag_sockid`.
const SOCKID_LEN: usize = 48;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 8 + SOCKID_LEN;
/// `struct inet_diag_msg` (without attributes).
const MSG_LEN: usize = 4 + SOCKID_LEN + 20;
/// Connected UDP sockets are in `TCP_ESTABLISHED` (1).
const ESTABLISHED_STATES: u32 = 1 << 1;
const IPPROTO_UDP: u8 = 17;
/// Bound for every netlink receive, so a misbehaving kernel cannot hang a sync.
const RECV_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound for the cgroup walk (directories visited).
const MAX_CGROUPS: usize = 100_000;

#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },
    #[error("{context}: {source}")]
    Nix {
        context: &'static str,
        source: nix::Error,
    },
    #[error("netlink: {0}")]
    Protocol(String),
}

/// A connected socket as `SOCK_DIAG` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiagSocket {
    pub cookie: u64,
    pub destination: SocketAddr,
    /// The raw `inet_diag_sockid`, echoed back in the destroy request.
    sockid: [u8; SOCKID_LEN],
    family: u8,
}

/// Outcome of one cleanup pass.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DestroyReport {
    pub namespaces: usize,
    pub candidates: usize,
    pub destroyed: usize,
}

/// Destroys the connected UDP sockets of processes in `cgroup` (and its descendants) whose
/// destination is in `backends` and for which `translated(socket)` says our datapath sent it
/// there from a frontend that no longer has that backend.
pub fn destroy_udp_sockets(
    cgroup: &Path,
    backends: &BTreeSet<SocketAddr>,
    translated: &(dyn Fn(&DiagSocket) -> bool + Sync),
) -> Result<DestroyReport, SockDiagError> {
    let namespaces = cgroup_netns(cgroup)?;
    let mut report = DestroyReport {
        namespaces: namespaces.len(),
        ..DestroyReport::default()
    };
    std::thread::scope(|scope| {
        // One thread for all namespaces: setns only changes this thread, which then exits.
        scope
            .spawn(|| {
                for netns in &namespaces {
                    setns(netns, CloneFlags::CLONE_NEWNET).map_err(|source| {
                        SockDiagError::Nix {
                            context: "setns into a pod network namespace",
                            source,
                        }
                    })?;
                    let netlink = open_netlink()?;
                    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
                        for socket in dump_udp(&netlink, family)? {
                            if !backends.contains(&socket.destination) {
                                continue;
                            }
                            report.candidates += 1;
                            if translated(&socket) {
                                destroy(&netlink, &socket)?;
                                debug!(cookie = socket.cookie, destination = %socket.destination, "destroyed connected UDP socket");
                                report.destroyed += 1;
                            }
                        }
                    }
                }
                Ok(())
            })
            .join()
            .unwrap_or_else(|_| Err(SockDiagError::Protocol("socket walker panicked".into())))
    })?;
    Ok(report)
}

/// The distinct network namespaces of the processes in `cgroup` and below.
fn cgroup_netns(cgroup: &Path) -> Result<Vec<File>, SockDiagError> {
    let mut seen = BTreeSet::new();
    let mut namespaces = Vec::new();
    let mut pending: Vec<PathBuf> = vec![cgroup.to_owned()];
    let mut visited = 0;
    while let Some(dir) = pending.pop() {
        visited += 1;
        if visited > MAX_CGROUPS {
            break;
        }
        let procs = dir.join("cgroup.procs");
        // A cgroup can vanish while we walk: skip it.
        let Ok(text) = std::fs::read_to_string(&procs) else {
            continue;
        };
        for pid in text.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let path = format!("/proc/{pid}/ns/net");
            // Processes exit while we walk; that is not an error.
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            if seen.insert((meta.dev(), meta.ino()))
                && let Ok(file) = File::open(&path)
            {
                namespaces.push(file);
            }
        }
        let entries = std::fs::read_dir(&dir).map_err(|source| SockDiagError::Io {
            context: format!("listing {}", dir.display()),
            source,
        });
        for entry in entries.into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                pending.push(entry.path());
            }
        }
    }
    Ok(namespaces)
}

fn open_netlink() -> Result<OwnedFd, SockDiagError> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )
    .map_err(|source| SockDiagError::Nix {
        context: "opening a NETLINK_SOCK_DIAG socket",
        source,
    })?;
    setsockopt(
        &fd,
        sockopt::ReceiveTimeout,
        &TimeVal::new(RECV_TIMEOUT.as_secs() as i64, 0),
    )
    .map_err(|source| SockDiagError::Nix {
        context: "setting SO_RCVTIMEO on the netlink socket",
        source,
    })?;
    Ok(fd)
}

fn request(kind: u16, flags: u16, family: u8, states: u32, sockid: &[u8; SOCKID_LEN]) -> Vec<u8> {
    let len = (NLMSG_HDRLEN + REQ_LEN) as u32;
    let mut msg = Vec::with_capacity(len as usize);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel
    msg.extend_from_slice(&[family, IPPROTO_UDP, 0, 0]);
    msg.extend_from_slice(&states.to_ne_bytes());
    msg.extend_from_slice(sockid);
    msg
}

fn send_all(fd: &OwnedFd, msg: &[u8]) -> Result<(), SockDiagError> {
    send(fd.as_raw_fd(), msg, MsgFlags::empty()).map_err(|source| SockDiagError::Nix {
        context: "sending a SOCK_DIAG request",
        source,
    })?;
    Ok(())
}

/// Netlink messages in one datagram: (type, payload).
fn messages(buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            break;
        }
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        out.push((kind, &rest[NLMSG_HDRLEN..len]));
        let aligned = (len + 3) & !3;
        rest = rest.get(aligned..).unwrap_or_default();
    }
    out
}

fn netlink_error(payload: &[u8]) -> i32 {
    payload
        .get(..4)
        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or(-libc::EPROTO)
}

fn dump_udp(fd: &OwnedFd, family: u8) -> Result<Vec<DiagSocket>, SockDiagError> {
    let any = [0u8; SOCKID_LEN];
    send_all(
        fd,
        &request(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_REQUEST | NLM_F_DUMP,
            family,
            ESTABLISHED_STATES,
            &any,
        ),
    )?;
    let mut sockets = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    // Bounded: each datagram holds at least one message and the dump ends with NLMSG_DONE;
    // a stuck kernel ends in the receive timeout.
    loop {
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|source| {
            SockDiagError::Nix {
                context: "receiving a SOCK_DIAG dump",
                source,
            }
        })?;
        if n == 0 {
            return Err(SockDiagError::Protocol("empty datagram in a dump".into()));
        }
        for (kind, payload) in messages(&buf[..n]) {
            match kind {
                NLMSG_DONE => return Ok(sockets),
                NLMSG_ERROR => {
                    return Err(SockDiagError::Protocol(format!(
                        "dump failed: {}",
                        io::Error::from_raw_os_error(-netlink_error(payload))
                    )));
                }
                SOCK_DIAG_BY_FAMILY => {
                    if let Some(socket) = parse_diag_msg(payload) {
                        sockets.push(socket);
                    }
                }
                _ => {}
            }
        }
    }
}

/// The sockets in one SOCK_DIAG dump datagram (for fuzzing the parser without a socket).
pub(crate) fn parse_dump_datagram(datagram: &[u8]) -> Vec<DiagSocket> {
    messages(datagram)
        .into_iter()
        .filter(|(kind, _)| *kind == SOCK_DIAG_BY_FAMILY)
        .filter_map(|(_, payload)| parse_diag_msg(payload))
        .collect()
}

fn parse_diag_msg(payload: &[u8]) -> Option<DiagSocket> {
    if payload.len() < MSG_LEN {
        return None;
    }
    let family = payload[0];
    let sockid: [u8; SOCKID_LEN] = payload[4..4 + SOCKID_LEN].try_into().ok()?;
    let dport = u16::from_be_bytes([sockid[2], sockid[3]]);
    let dst = &sockid[20..36];
    let ip = match i32::from(family) {
        libc::AF_INET => IpAddr::V4(Ipv4Addr::new(dst[0], dst[1], dst[2], dst[3])),
        libc::AF_INET6 => {
            let octets: [u8; 16] = dst.try_into().ok()?;
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    let cookie_lo = u32::from_ne_bytes(sockid[40..44].try_into().ok()?);
    let cookie_hi = u32::from_ne_bytes(sockid[44..48].try_into().ok()?);
    Some(DiagSocket {
        cookie: u64::from(cookie_lo) | (u64::from(cookie_hi) << 32),
        destination: SocketAddr::new(ip, dport),
        sockid,
        family,
    })
}

/// Whether the kernel can destroy sockets (`CONFIG_INET_DIAG_DESTROY`): a destroy of a UDP
/// socket that does not exist fails with ENOENT when it can (the lookup ran) and with
/// EOPNOTSUPP when it cannot.
pub fn destroy_supported() -> bool {
    let probe = || -> Result<bool, SockDiagError> {
        let fd = open_netlink()?;
        // No socket has cookie 2^64-1 … with port 0 on 0.0.0.0 → 0.0.0.0.
        let mut sockid = [0u8; SOCKID_LEN];
        sockid[40..48].copy_from_slice(&[0xfe; 8]);
        send_all(
            &fd,
            &request(
                SOCK_DESTROY,
                NLM_F_REQUEST | NLM_F_ACK,
                libc::AF_INET as u8,
                u32::MAX,
                &sockid,
            ),
        )?;
        let mut buf = [0u8; 1024];
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|source| {
            SockDiagError::Nix {
                context: "receiving the SOCK_DESTROY probe's ack",
                source,
            }
        })?;
        Ok(messages(&buf[..n]).into_iter().any(|(kind, payload)| {
            kind == NLMSG_ERROR && -netlink_error(payload) != libc::EOPNOTSUPP
        }))
    };
    probe().unwrap_or_else(|error| {
        debug!(%error, "socket destroy probe failed");
        false
    })
}

fn destroy(fd: &OwnedFd, socket: &DiagSocket) -> Result<(), SockDiagError> {
    send_all(
        fd,
        &request(
            SOCK_DESTROY,
            NLM_F_REQUEST | NLM_F_ACK,
            socket.family,
            u32::MAX,
            &socket.sockid,
        ),
    )?;
    let mut buf = [0u8; 1024];
    let n =
        recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|source| SockDiagError::Nix {
            context: "receiving the SOCK_DESTROY ack",
            source,
        })?;
    for (kind, payload) in messages(&buf[..n]) {
        if kind == NLMSG_ERROR {
            return match -netlink_error(payload) {
                0 => Ok(()),
                // Closed between the dump and the destroy: nothing left to do.
                libc::ENOENT => Ok(()),
                errno => Err(SockDiagError::Protocol(format!(
                    "SOCK_DESTROY of {}: {}",
                    socket.destination,
                    io::Error::from_raw_os_error(errno)
                ))),
            };
        }
    }
    Err(SockDiagError::Protocol("no SOCK_DESTROY ack".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_diag_message_and_builds_a_matching_destroy_request() {
        let mut payload = vec![0u8; MSG_LEN];
        payload[0] = libc::AF_INET as u8;
        payload[4 + 2..4 + 4].copy_from_slice(&8080u16.to_be_bytes());
        payload[4 + 20..4 + 24].copy_from_slice(&[10, 244, 2, 2]);
        payload[4 + 40..4 + 44].copy_from_slice(&7u32.to_ne_bytes());
        payload[4 + 44..4 + 48].copy_from_slice(&1u32.to_ne_bytes());
        let socket = parse_diag_msg(&payload).expect("parses");
        assert_eq!(
            socket.destination,
            SocketAddr::from(([10, 244, 2, 2], 8080))
        );
        assert_eq!(socket.cookie, (1 << 32) | 7);
        let req = request(
            SOCK_DESTROY,
            NLM_F_REQUEST,
            socket.family,
            0,
            &socket.sockid,
        );
        assert_eq!(req.len(), NLMSG_HDRLEN + REQ_LEN);
        assert_eq!(&req[NLMSG_HDRLEN + 8..], &socket.sockid[..]);
        let parsed = messages(&req);
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].0, SOCK_DESTROY);
    }
}
