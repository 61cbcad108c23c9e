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
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use bytes::{BufMut as _, BytesMut};
use nix::{
    sched::{CloneFlags, setns},
    sys::socket::SockProtocol,
};
use tracing::debug;

use crate::netlink::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkError, NetlinkSocket, walk_datagram};

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
/// `struct inet_diag_sockid`.
const SOCKID_LEN: usize = 48;
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
    #[error("SOCK_DIAG: {0}")]
    Netlink(#[from] NetlinkError),
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
                    let mut netlink = open_netlink()?;
                    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
                        for socket in dump_udp(&mut netlink, family)? {
                            if !backends.contains(&socket.destination) {
                                continue;
                            }
                            report.candidates += 1;
                            if translated(&socket) {
                                destroy(&mut netlink, &socket)?;
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

fn open_netlink() -> Result<NetlinkSocket, SockDiagError> {
    Ok(NetlinkSocket::open(
        SockProtocol::NetlinkSockDiag,
        Some(RECV_TIMEOUT),
    )?)
}

/// `struct inet_diag_req_v2` for UDP sockets of `family` in `states`, matching `sockid`.
fn put_request(buf: &mut BytesMut, family: u8, states: u32, sockid: &[u8; SOCKID_LEN]) {
    buf.put_slice(&[family, IPPROTO_UDP, 0, 0]);
    buf.put_u32_ne(states);
    buf.put_slice(sockid);
}

fn dump_udp(netlink: &mut NetlinkSocket, family: u8) -> Result<Vec<DiagSocket>, SockDiagError> {
    let any = [0u8; SOCKID_LEN];
    netlink.send(SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, |buf| {
        put_request(buf, family, ESTABLISHED_STATES, &any);
    })?;
    let mut sockets = Vec::new();
    // Bounded: the dump ends with NLMSG_DONE; a stuck kernel ends in the receive timeout.
    netlink
        .receive(|kind, payload| {
            if kind == SOCK_DIAG_BY_FAMILY
                && let Some(socket) = parse_diag_msg(payload)
            {
                sockets.push(socket);
            }
            Ok::<(), NetlinkError>(())
        })
        .map_err(|error| match error {
            NetlinkError::Kernel(errno) => SockDiagError::Protocol(format!(
                "dump failed: {}",
                io::Error::from_raw_os_error(errno as i32)
            )),
            other => other.into(),
        })?;
    Ok(sockets)
}

/// The sockets in one SOCK_DIAG dump datagram (for fuzzing the parser without a socket).
pub fn parse_dump_datagram(datagram: &[u8]) -> Vec<DiagSocket> {
    let mut sockets = Vec::new();
    let _ = walk_datagram(datagram, &mut |kind, payload: &[u8]| {
        if kind == SOCK_DIAG_BY_FAMILY
            && let Some(socket) = parse_diag_msg(payload)
        {
            sockets.push(socket);
        }
        Ok::<(), NetlinkError>(())
    });
    sockets
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
        let mut netlink = open_netlink()?;
        // No socket has cookie 2^64-1 … with port 0 on 0.0.0.0 → 0.0.0.0.
        let mut sockid = [0u8; SOCKID_LEN];
        sockid[40..48].copy_from_slice(&[0xfe; 8]);
        let answer = netlink.request_ack(SOCK_DESTROY, 0, |buf| {
            put_request(buf, libc::AF_INET as u8, u32::MAX, &sockid);
        });
        match answer {
            Err(NetlinkError::Kernel(nix::Error::EOPNOTSUPP)) => Ok(false),
            Ok(()) | Err(NetlinkError::Kernel(_)) => Ok(true),
            Err(error) => Err(error.into()),
        }
    };
    probe().unwrap_or_else(|error| {
        debug!(%error, "socket destroy probe failed");
        false
    })
}

fn destroy(netlink: &mut NetlinkSocket, socket: &DiagSocket) -> Result<(), SockDiagError> {
    let answer = netlink.request_ack(SOCK_DESTROY, 0, |buf| {
        put_request(buf, socket.family, u32::MAX, &socket.sockid);
    });
    match answer {
        // Closed between the dump and the destroy: nothing left to do.
        Ok(()) | Err(NetlinkError::Kernel(nix::Error::ENOENT)) => Ok(()),
        Err(NetlinkError::Kernel(errno)) => Err(SockDiagError::Protocol(format!(
            "SOCK_DESTROY of {}: {}",
            socket.destination,
            io::Error::from_raw_os_error(errno as i32)
        ))),
        Err(error) => Err(error.into()),
    }
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
        let req = crate::netlink::message(SOCK_DESTROY, NLM_F_REQUEST, 1, |buf| {
            put_request(buf, socket.family, 0, &socket.sockid);
        });
        assert_eq!(req.len(), crate::netlink::NLMSG_HDRLEN + 8 + SOCKID_LEN);
        assert_eq!(&req[crate::netlink::NLMSG_HDRLEN + 8..], &socket.sockid[..]);
        let mut kinds = Vec::new();
        walk_datagram(&req, &mut |kind, _: &[u8]| {
            kinds.push(kind);
            Ok::<(), NetlinkError>(())
        })
        .expect("walk");
        assert_eq!(kinds, [SOCK_DESTROY]);
    }
}
