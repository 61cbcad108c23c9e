//! Tests against the real servers on 127.0.0.1 ephemeral ports, with a raw HTTP/1.1 client so
//! status lines, header names and bodies are seen byte for byte.

mod exposition;
mod health;
mod histogram;
mod http;
mod metrics;
mod protobuf;
mod rest_client;
mod service_health;

use std::{
    collections::BTreeMap,
    net::{SocketAddr, TcpListener},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::{
    HttpServers, HttpServersConfig,
    health::{Clock as _, ManualClock},
};
use proxy_model::time_format::Stamp;
use proxy_model::{
    desired::Snapshot,
    objects::{ObjectKey, Objects},
    proxy_mode::ProxyMode,
};

pub const NODE: &str = "test-node";
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// One HTTP answer as it came over the wire.
#[derive(Debug)]
pub struct Reply {
    pub status_line: String,
    /// Header names as sent (case kept), in order.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn status(&self) -> u16 {
        self.status_line
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .expect("status code")
    }

    /// The value of a header, by exact (canonical) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

pub async fn request(addr: SocketAddr, method: &str, path: &str) -> Reply {
    request_with(addr, method, path, &[], "").await
}

/// A request with extra header lines and a body.
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await
            .expect("connect timeout")
            .expect("connect");
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut raw))
        .await
        .expect("read timeout")
        .expect("read");
    // Lossy: a protobuf body is not text; the tests that ask for one only read its headers.
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("end of headers");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line").to_owned();
    let headers = lines
        .map(|line| {
            let (name, value) = line.split_once(": ").expect("header");
            (name.to_owned(), value.to_owned())
        })
        .collect();
    Reply {
        status_line,
        headers,
        body: body.to_owned(),
    }
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path).await
}

/// Whether something listens on `addr`.
pub async fn is_open(addr: SocketAddr) -> bool {
    tokio::net::TcpStream::connect(addr).await.is_ok()
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

pub fn key(namespace: &str, name: &str) -> ObjectKey {
    ObjectKey {
        namespace: namespace.into(),
        name: name.into(),
    }
}

/// Node services on ephemeral loopback ports with a clock the test moves.
pub fn start(mode: ProxyMode) -> (HttpServers, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(Stamp::now()));
    let config = HttpServersConfig {
        healthz_bind_address: Some("127.0.0.1:0".parse().expect("addr")),
        metrics_bind_address: Some("127.0.0.1:0".parse().expect("addr")),
        node_port_addresses: vec!["127.0.0.1".parse().expect("ip")],
        ..HttpServersConfig::new(NODE, mode, TIMEOUT / 2)
    };
    let services = HttpServers::start_with_clock(&config, Arc::clone(&clock) as _);
    (services, clock)
}

/// The object view of a multi-document YAML string.
pub fn objects(yaml: &str) -> Objects {
    let mut services = BTreeMap::new();
    let mut slices = BTreeMap::new();
    let mut node = None;
    for document in serde_yaml::Deserializer::from_str(yaml) {
        let value: serde_yaml::Value = serde::Deserialize::deserialize(document).expect("yaml");
        match value.get("kind").and_then(|k| k.as_str()).expect("kind") {
            "Service" => {
                let svc: Service = serde_yaml::from_value(value).expect("service");
                services.insert(ObjectKey::of(&svc.metadata).expect("key"), svc.into());
            }
            "EndpointSlice" => {
                let slice: EndpointSlice = serde_yaml::from_value(value).expect("slice");
                slices.insert(ObjectKey::of(&slice.metadata).expect("key"), slice.into());
            }
            "Node" => node = Some(serde_yaml::from_value::<Node>(value).expect("node").into()),
            other => panic!("unexpected kind {other}"),
        }
    }
    Objects::new(services, slices, node)
}

pub fn snapshot(yaml: &str) -> Snapshot {
    Snapshot::compute(&objects(yaml), NODE)
}
