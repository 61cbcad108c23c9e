//! One UDP exchange on a connected socket, made in a network namespace by a thread of the test
//! process, that reports what the socket saw: the answer, or the error an ICMP message brought
//! back (ECONNREFUSED, EMSGSIZE with the path MTU learned) — what a client of a Service sees.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::path::Path;
use std::time::Duration;

use anyhow::ensure;

/// One exchange on a connected UDP socket in `netns`: `payload` bytes (with DF
/// and path-MTU discovery on, if `dont_fragment`), up to three tries 500 ms apart. Returns
/// `reply TEXT`, `send ERRNO` (refused locally), `recv ERRNO` (an error came back for the
/// socket; with DF the path MTU the socket learned follows as ` mtu=N`) or `TIMEOUT`.
pub fn exchange(
    netns: &Path,
    target: SocketAddr,
    payload: usize,
    dont_fragment: bool,
) -> anyhow::Result<String> {
    crate::netns::on_thread_in(netns, move || exchange_here(target, payload, dont_fragment))?
}

fn exchange_here(
    target: SocketAddr,
    payload: usize,
    dont_fragment: bool,
) -> anyhow::Result<String> {
    let local: SocketAddr = if target.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    }
    .parse()?;
    let sock = UdpSocket::bind(local)?;
    sock.connect(target)?;
    sock.set_read_timeout(Some(Duration::from_millis(500)))?;
    let (level, discover, mtu) = if target.is_ipv6() {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_MTU)
    } else {
        (libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_MTU)
    };
    if dont_fragment {
        // IP_PMTUDISC_DO and IPV6_PMTUDISC_DO are both 2.
        let value: libc::c_int = libc::IP_PMTUDISC_DO;
        // SAFETY: a valid socket and a c_int option of the size given.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                level,
                discover,
                (&raw const value).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        ensure!(
            rc == 0,
            "setsockopt(MTU_DISCOVER): {}",
            std::io::Error::last_os_error()
        );
    }
    let data = vec![b'x'; payload];
    let mut buf = [0u8; 2048];
    for _ in 0..3 {
        if let Err(e) = sock.send(&data) {
            return Ok(format!("send {}", errno_name(&e)));
        }
        match sock.recv(&mut buf) {
            Ok(n) => {
                let text = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
                return Ok(format!("reply {}", text.trim_end()));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => {
                let mut answer = format!("recv {}", errno_name(&e));
                if dont_fragment {
                    let mut value: libc::c_int = 0;
                    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
                    // SAFETY: a valid socket and a c_int buffer of the size given.
                    let rc = unsafe {
                        libc::getsockopt(
                            sock.as_raw_fd(),
                            level,
                            mtu,
                            (&raw mut value).cast(),
                            &raw mut len,
                        )
                    };
                    if rc == 0 {
                        answer.push_str(&format!(" mtu={value}"));
                    }
                }
                return Ok(answer);
            }
        }
    }
    Ok("TIMEOUT".into())
}

fn errno_name(e: &std::io::Error) -> String {
    e.raw_os_error().map_or_else(
        || format!("{:?}", e.kind()),
        |code| format!("{:?}", nix::errno::Errno::from_raw(code)),
    )
}
