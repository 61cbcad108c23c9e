//! Host address changes: a `NETLINK_ROUTE` socket subscribed to the IPv4 and IPv6 address
//! groups, so an address added or removed at run time (RTM_NEWADDR / RTM_DELADDR) triggers a
//! sync that recomputes the NodePort addresses and the tc attachment. Also the link group
//! (RTM_NEWLINK / RTM_DELLINK): a pod interface without any address still needs the pod-side
//! tc program at once with `--bpf-socket-lb-host-namespace-only`. The messages are not
//! parsed: any of them means "re-read the addresses", which `getifaddrs` does at the sync, and
//! a burst (an interface with many addresses going away) becomes one sync.

use std::{
    io,
    os::fd::{AsRawFd, OwnedFd},
};

use nix::{
    errno::Errno,
    sys::socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, socket,
    },
};
use tokio::io::unix::AsyncFd;

/// Subscribed to the address events of the network namespace it was opened in.
#[derive(Debug)]
pub struct AddressWatcher {
    fd: AsyncFd<OwnedFd>,
}

impl AddressWatcher {
    /// Must run inside a tokio runtime.
    pub fn open() -> io::Result<Self> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            SockProtocol::NetlinkRoute,
        )?;
        let groups =
            (libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR | libc::RTMGRP_LINK) as u32;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, groups))?;
        // SAFETY: the OwnedFd is moved into the AsyncFd, so the registered fd stays open (and
        // the same) until the AsyncFd is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)? };
        Ok(Self { fd })
    }

    /// Waits for the next address event, then drains every queued one. Cancel safe: nothing is
    /// consumed before the socket is readable. An error is returned only when the socket is
    /// unusable (then the caller should stop watching).
    pub async fn changed(&self) -> io::Result<()> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut buffer = [0u8; 8192];
            let mut received = false;
            loop {
                match recv(
                    guard.get_inner().as_raw_fd(),
                    &mut buffer,
                    MsgFlags::MSG_DONTWAIT,
                ) {
                    Ok(0) => break,
                    Ok(_) => received = true,
                    // The kernel dropped events for us: something changed all the same.
                    Err(Errno::ENOBUFS) => received = true,
                    Err(Errno::EAGAIN) => {
                        guard.clear_ready();
                        break;
                    }
                    Err(Errno::EINTR) => {}
                    Err(errno) => return Err(errno.into()),
                }
            }
            if received {
                return Ok(());
            }
        }
    }
}
