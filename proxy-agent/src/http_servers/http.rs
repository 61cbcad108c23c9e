//! Serving an axum router the way Go's `net/http` answers: HTTP/1.1, header names in canonical
//! case (`Content-Type`, not `content-type`; clients must not care, but the health checkers of
//! some load balancers are picky), listeners on wildcard addresses dual-stack like Go's
//! `net.Listen("tcp", "0.0.0.0:port")`, and a handle that closes the port and every open
//! connection when dropped. Unlike Go's defaults, each connection has a header-read and an idle
//! timeout and each peer address a connection cap ([`Limits`]): probes are answered whatever
//! other clients hold.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    pin::Pin,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    http::{HeaderValue, Response, StatusCode, header},
};
use hyper::server::conn::http1;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    task::{JoinHandle, JoinSet},
};
use tracing::{debug, warn};

/// What one server lets its clients hold. Go's `http.Server` as kube-proxy configures it has no
/// timeouts and no cap; ours bound each client so that no address, however many connections it
/// opens or however slowly it sends, keeps the kubelet's probe or a load balancer's check from
/// being answered (see README, "Node services").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections one peer address may have open; beyond, its new ones are closed at once.
    pub per_peer: usize,
    /// Connections of all peers together (memory and descriptors), far above what probers use.
    pub total: usize,
    /// A request's head must arrive within this (also bounds an idle keep-alive connection:
    /// waiting for the next request is waiting for a head).
    pub header_read_timeout: Duration,
    /// A connection that moves no byte either way for this long is closed (a body sent too
    /// slowly, an answer never read).
    pub idle_timeout: Duration,
}

/// The limits of every node server (health, metrics, health check node ports).
pub const LIMITS: Limits = Limits {
    per_peer: 32,
    total: 4096,
    header_read_timeout: Duration::from_secs(5),
    idle_timeout: Duration::from_secs(60),
};

/// hyper's smallest read buffer cap (8 KiB) is below a long header line; 16 KiB bounds what one
/// connection buffers (Go's limit is 1 MiB of headers).
const MAX_BUF_SIZE: usize = 16 * 1024;

/// Opens a listening socket on `addr`. An unspecified address (`0.0.0.0` or `::`) listens on
/// both families when the host has IPv6 (what Go does), else on IPv4 only.
pub fn listen(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    if addr.ip().is_unspecified()
        && let Ok(listener) = bind_socket(
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), addr.port()),
            false,
        )
    {
        return Ok(listener);
    }
    bind_socket(addr, true)
}

/// Opens a listening socket on exactly `addr`: an unspecified address listens on its own
/// family only.
pub fn listen_exact(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    bind_socket(addr, true)
}

fn bind_socket(addr: SocketAddr, v6_only: bool) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // Reopening a port right after closing it must work (servers come and go with Services).
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(v6_only)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// A running server; dropping it stops accepting, closes the port and every connection.
#[derive(Debug)]
pub struct ServerHandle {
    local_addr: SocketAddr,
    task: JoinHandle<()>,
}

impl ServerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `router` on `listener` until the handle is dropped. Must run inside a tokio runtime.
pub fn serve(
    listener: std::net::TcpListener,
    router: Router,
    name: &'static str,
) -> io::Result<ServerHandle> {
    serve_with(listener, router, name, LIMITS)
}

/// [`serve`] with other limits (tests).
pub fn serve_with(
    listener: std::net::TcpListener,
    router: Router,
    name: &'static str,
    limits: Limits,
) -> io::Result<ServerHandle> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let local_addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let peers = Peers::default();
        // Connections live in the set so that aborting this task closes them too.
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let Some(slot) = peers.admit(peer.ip(), &limits) else {
                            // Closed at once: this peer (or everyone) holds enough already.
                            debug!(server = name, %peer, "too many connections, closing one");
                            continue;
                        };
                        let service = TowerToHyperService::new(router.clone());
                        connections.spawn(async move {
                            serve_connection(stream, service, &limits, name, peer).await;
                            drop(slot);
                        });
                    }
                    Err(error) => {
                        // Usually EMFILE: wait a little instead of spinning.
                        warn!(server = name, %error, "cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    });
    Ok(ServerHandle { local_addr, task })
}

/// One connection, until the client closes it, a limit closes it, or the server stops.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    service: TowerToHyperService<Router>,
    limits: &Limits,
    name: &'static str,
    peer: SocketAddr,
) {
    let activity = Activity::new();
    let stream = Tracked {
        inner: stream,
        activity: activity.clone(),
    };
    let connection = http1::Builder::new()
        .title_case_headers(true)
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_BUF_SIZE)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        ended = connection => {
            if let Err(error) = ended {
                debug!(server = name, %peer, %error, "connection ended with an error");
            }
        }
        () = activity.idle_for(limits.idle_timeout) => {
            debug!(server = name, %peer, "idle connection closed");
        }
    }
}

/// Open connections per peer address (IPv4-mapped IPv6 counted as IPv4).
#[derive(Debug, Default, Clone)]
struct Peers {
    counts: Arc<Mutex<PeerCounts>>,
}

#[derive(Debug, Default)]
struct PeerCounts {
    by_peer: HashMap<IpAddr, usize>,
    total: usize,
}

impl Peers {
    /// A slot for one more connection of `peer`, or `None` when it (or the server) is full.
    fn admit(&self, peer: IpAddr, limits: &Limits) -> Option<PeerSlot> {
        let peer = peer.to_canonical();
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if counts.total >= limits.total {
            return None;
        }
        let count = counts.by_peer.entry(peer).or_insert(0);
        if *count >= limits.per_peer {
            return None;
        }
        *count += 1;
        counts.total += 1;
        Some(PeerSlot {
            peers: self.clone(),
            peer,
        })
    }

    #[cfg(test)]
    fn open(&self, peer: IpAddr) -> usize {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts
            .by_peer
            .get(&peer.to_canonical())
            .copied()
            .unwrap_or(0)
    }
}

/// One admitted connection; dropping it frees the slot.
#[derive(Debug)]
struct PeerSlot {
    peers: Peers,
    peer: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self
            .peers
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        counts.total = counts.total.saturating_sub(1);
        if let Some(count) = counts.by_peer.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.by_peer.remove(&self.peer);
            }
        }
    }
}

/// When a connection last moved a byte (milliseconds since it opened).
#[derive(Debug, Clone)]
struct Activity {
    opened: tokio::time::Instant,
    last_ms: Arc<AtomicU64>,
}

impl Activity {
    fn new() -> Self {
        Self {
            opened: tokio::time::Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Returns once no byte moved for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = self.opened + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let deadline = last + idle;
            if tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// A stream that notes its reads and writes in an [`Activity`].
struct Tracked {
    inner: tokio::net::TcpStream,
    activity: Activity,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A response with a fixed body and the given content type, plus `X-Content-Type-Options:
/// nosniff` as every kube-proxy handler sets.
pub fn response(status: StatusCode, content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

/// Go's `http.NotFound`: what a `ServeMux` answers for a path it has no handler for.
pub async fn go_not_found() -> Response<Body> {
    response(
        StatusCode::NOT_FOUND,
        "text/plain; charset=utf-8",
        "404 page not found\n".to_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEST: Limits = Limits {
        per_peer: 3,
        total: 5,
        header_read_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(1),
    };

    #[test]
    fn a_peer_is_capped_while_others_are_admitted_up_to_the_total() {
        let peers = Peers::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let a_mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let c: IpAddr = "fd00::3".parse().unwrap();
        let mut held: Vec<PeerSlot> = (0..3).map(|_| peers.admit(a, &TEST).unwrap()).collect();
        assert!(
            peers.admit(a, &TEST).is_none(),
            "a 4th connection of one peer"
        );
        // The same peer over a dual-stack socket is the same peer.
        assert!(peers.admit(a_mapped, &TEST).is_none());
        held.push(peers.admit(b, &TEST).unwrap());
        held.push(peers.admit(c, &TEST).unwrap());
        assert!(peers.admit(b, &TEST).is_none(), "the total");
        // A closed connection frees its slot, for its peer and the total.
        held.remove(0);
        assert_eq!(peers.open(a), 2);
        assert!(peers.admit(b, &TEST).is_some());
        drop(held);
        assert_eq!(peers.open(a), 0);
        assert!(peers.counts.lock().unwrap().by_peer.is_empty());
        assert_eq!(peers.counts.lock().unwrap().total, 0);
    }
}
