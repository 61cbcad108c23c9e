//! The serving limits against real sockets: a slow peer's connections beyond its cap are
//! closed at once, the ones it keeps are closed after the header-read (or idle) timeout, and
//! another peer is answered meanwhile.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use axum::{Router, routing::any};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpSocket, TcpStream},
};

use super::get;
use crate::http_servers::http::{Limits, ServerHandle, listen_exact, serve_with};

const LIMITS: Limits = Limits {
    per_peer: 4,
    total: 64,
    header_read_timeout: Duration::from_millis(1500),
    idle_timeout: Duration::from_secs(3),
};

fn server() -> ServerHandle {
    let router = Router::new()
        .route("/livez", any(|| async { "ok" }))
        // Reads the whole body, as `/debug/flags/v` does.
        .route("/echo", any(|body: String| async move { body }));
    let listener = listen_exact("127.0.0.1:0".parse().expect("addr")).expect("listen");
    serve_with(listener, router, "test", LIMITS).expect("serve")
}

/// A connection from `source` (another loopback address than the probes').
async fn connect_from(source: IpAddr, to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.bind(SocketAddr::new(source, 0)).expect("bind");
    tokio::time::timeout(Duration::from_secs(5), socket.connect(to))
        .await
        .expect("connect timeout")
        .expect("connect")
}

/// Whether the server closed `stream` within `within` (EOF or reset after whatever it sent).
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test]
async fn a_slow_peer_is_capped_and_timed_out_while_another_is_answered() {
    let server = server();
    let addr = server.local_addr();
    let slow: IpAddr = "127.0.0.2".parse().expect("ip");
    let mut held = Vec::new();
    for _ in 0..20 {
        let mut stream = connect_from(slow, addr).await;
        // A request head that never ends.
        stream
            .write_all(b"GET /livez HTTP/1.1\r\n")
            .await
            .expect("write");
        held.push(stream);
    }
    let opened = Instant::now();
    // Probes from another address are answered while the slow peer holds its connections.
    for _ in 0..5 {
        let reply = tokio::time::timeout(Duration::from_millis(500), get(addr, "/livez"))
            .await
            .expect("a probe was not answered within 500ms");
        assert_eq!(reply.status(), 200);
        assert_eq!(reply.body, "ok");
    }
    // Beyond its cap the slow peer's connections were closed at once; the cap's worth stay
    // open until the header-read timeout.
    let mut closed_at_once = 0;
    let mut kept = Vec::new();
    for mut stream in held {
        if closed_within(&mut stream, Duration::from_millis(100)).await {
            closed_at_once += 1;
        } else {
            kept.push(stream);
        }
    }
    assert!(
        opened.elapsed() < LIMITS.header_read_timeout,
        "too slow to tell the cap from the timeout"
    );
    assert_eq!(closed_at_once, 20 - LIMITS.per_peer);
    assert_eq!(kept.len(), LIMITS.per_peer);
    for stream in &mut kept {
        assert!(
            closed_within(stream, LIMITS.header_read_timeout + Duration::from_secs(3)).await,
            "a half-sent request was kept past the header-read timeout"
        );
    }
    // Its slots are free again.
    let mut stream = connect_from(slow, addr).await;
    stream
        .write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut reply))
        .await
        .expect("read timeout")
        .expect("read");
    assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
}

#[tokio::test]
async fn a_body_that_stops_coming_is_closed_after_the_idle_timeout() {
    let server = server();
    let addr = server.local_addr();
    let mut stream = connect_from("127.0.0.3".parse().expect("ip"), addr).await;
    stream
        .write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        .await
        .expect("write");
    let started = Instant::now();
    assert!(
        closed_within(
            &mut stream,
            LIMITS.idle_timeout + LIMITS.header_read_timeout + Duration::from_secs(3)
        )
        .await,
        "a stalled body kept its connection"
    );
    assert!(
        started.elapsed() >= LIMITS.idle_timeout - Duration::from_millis(100),
        "closed before the idle timeout: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed() {
    let server = server();
    let addr = server.local_addr();
    let mut stream = connect_from("127.0.0.4".parse().expect("ip"), addr).await;
    stream
        .write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 512];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .expect("read timeout")
        .expect("read");
    assert!(buf[..read].starts_with(b"HTTP/1.1 200 OK"));
    assert!(
        closed_within(
            &mut stream,
            LIMITS.header_read_timeout + Duration::from_secs(3)
        )
        .await,
        "an idle keep-alive connection stayed open"
    );
}
