//! Serving an axum router the way Go's `net/http` answers: HTTP/1.1, header names in canonical
//! case (`Content-Type`, not `content-type`; clients must not care, but the health checkers of
//! some load balancers are picky), listeners on wildcard addresses dual-stack like Go's
//! `net.Listen("tcp", "0.0.0.0:port")`, and a handle that closes the port and every open
//! connection when dropped.

use std::{
    io,
    net::{IpAddr, Ipv6Addr, SocketAddr},
};

use axum::{
    Router,
    body::Body,
    http::{HeaderValue, Response, StatusCode, header},
};
use hyper::server::conn::http1;
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, warn};

/// Go's `http.Server` closes idle keep-alive connections eventually; this bounds how many
/// connections one server keeps so a misbehaving prober cannot exhaust the agent.
const MAX_CONNECTIONS: usize = 256;

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
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let local_addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        // Connections live in the set so that aborting this task closes them too.
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        if connections.len() >= MAX_CONNECTIONS {
                            debug!(server = name, %peer, "too many connections, refusing one");
                            continue;
                        }
                        let service = TowerToHyperService::new(router.clone());
                        connections.spawn(async move {
                            let connection = http1::Builder::new()
                                .title_case_headers(true)
                                .serve_connection(TokioIo::new(stream), service);
                            if let Err(error) = connection.await {
                                debug!(server = name, %peer, %error, "connection ended with an error");
                            }
                        });
                    }
                    Err(error) => {
                        // Usually EMFILE: wait a little instead of spinning.
                        warn!(server = name, %error, "cannot accept a connection");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                },
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    });
    Ok(ServerHandle { local_addr, task })
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
