//! Route, policy rule, neighbour and link changes of the network namespace a watch was opened
//! in: a `NETLINK_ROUTE` socket subscribed to their groups, read by a thread of its own. The
//! tc fast path keeps each flow's next hop in its conntrack entry under the node's route
//! generation (`proxy_common::NextHop`); the caller bumps the generation on each burst of
//! these messages, so that every flow looks its next hop up again. The messages are not
//! parsed: a neighbour's state change that moved nothing costs each flow one lookup.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    thread::JoinHandle,
};

use nix::{
    errno::Errno,
    sys::socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, socket,
    },
};

/// `RTNLGRP_IPV6_RULE` (linux/rtnetlink.h): IPv6 policy rules have no `RTMGRP_` bit.
const RTNLGRP_IPV6_RULE: libc::c_int = 19;

/// Watches until dropped; the drop stops and joins the thread.
#[derive(Debug)]
pub struct RouteWatch {
    /// An eventfd the drop writes to end the thread's poll.
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

impl RouteWatch {
    /// Subscribes in the calling thread's network namespace, then calls `changed` from the
    /// watch's thread once at once (what changed before the watch began is not known) and
    /// once after each burst of messages; a message lost to a full socket buffer counts as a
    /// change.
    pub fn start(mut changed: impl FnMut() + Send + 'static) -> io::Result<Self> {
        let socket = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            SockProtocol::NetlinkRoute,
        )?;
        let groups = (libc::RTMGRP_LINK
            | libc::RTMGRP_NEIGH
            | libc::RTMGRP_IPV4_ROUTE
            | libc::RTMGRP_IPV4_RULE
            | libc::RTMGRP_IPV6_ROUTE) as u32;
        bind(socket.as_raw_fd(), &NetlinkAddr::new(0, groups))?;
        let group = RTNLGRP_IPV6_RULE;
        // SAFETY: a plain setsockopt with an int option value that outlives the call.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_NETLINK,
                libc::NETLINK_ADD_MEMBERSHIP,
                (&raw const group).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: plain syscall; a valid fd is owned by the OwnedFd below.
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if stop < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this fd and nothing else owns it.
        let stop = unsafe { OwnedFd::from_raw_fd(stop) };
        let stop_raw = stop.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("route-watch".into())
            .spawn(move || {
                changed();
                while wait(&socket, stop_raw) {
                    if drain(&socket) {
                        changed();
                    }
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

/// Blocks until the socket has messages (`true`) or the watch is stopped or broken (`false`).
fn wait(socket: &OwnedFd, stop: libc::c_int) -> bool {
    let mut fds = [
        libc::pollfd {
            fd: socket.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: stop,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of the given length for the duration of the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if ready < 0 {
            if Errno::last() == Errno::EINTR {
                continue;
            }
            return false;
        }
        if fds[1].revents != 0 || fds[0].revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
            return false;
        }
        if fds[0].revents != 0 {
            return true;
        }
    }
}

/// Reads every queued message; whether any was there (or lost).
fn drain(socket: &OwnedFd) -> bool {
    let mut buffer = [0u8; 8192];
    let mut received = false;
    loop {
        match recv(socket.as_raw_fd(), &mut buffer, MsgFlags::MSG_DONTWAIT) {
            Ok(0) | Err(Errno::EAGAIN) => return received,
            Ok(_) | Err(Errno::ENOBUFS) => received = true,
            Err(Errno::EINTR) => {}
            // A broken socket: the next poll reports it.
            Err(_) => return received,
        }
    }
}

impl Drop for RouteWatch {
    fn drop(&mut self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to the eventfd this struct owns.
        let _ = unsafe {
            libc::write(
                self.stop.as_raw_fd(),
                (&raw const one).cast(),
                size_of::<u64>(),
            )
        };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };
    use std::time::{Duration, Instant};

    use super::RouteWatch;

    /// Needs root (a private network namespace): a route added after the start is one more
    /// call, and the drop ends the thread.
    #[test]
    fn a_route_change_calls_back_and_the_drop_stops_the_watch() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let result = std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare");
            let watch = RouteWatch::start(move || {
                counted.fetch_add(1, Ordering::SeqCst);
            })
            .expect("watch");
            let settle = |at_least: usize| {
                let bound = Instant::now() + Duration::from_secs(5);
                while calls_now(&calls) < at_least && Instant::now() < bound {
                    std::thread::sleep(Duration::from_millis(5));
                }
                calls_now(&calls)
            };
            let first = settle(1);
            let status = std::process::Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()
                .expect("ip");
            assert!(status.success());
            let after = settle(first + 1);
            drop(watch);
            (first, after)
        })
        .join()
        .expect("thread");
        assert_eq!(result.0, 1, "called once at the start");
        assert!(result.1 > result.0, "a link and route change calls back");
    }

    fn calls_now(calls: &Arc<AtomicUsize>) -> usize {
        calls.load(Ordering::SeqCst)
    }
}
