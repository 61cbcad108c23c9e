//! A wire-faithful Kubernetes API test server for the agent's `kubernetes` source.
//!
//! It serves LIST and WATCH for Services, EndpointSlices and Nodes on `127.0.0.1:<port>` (in a
//! given network namespace, so an agent running there reaches it), with a global, monotonically
//! increasing resourceVersion, label and field selectors and BOOKMARK events. Like the real
//! server it negotiates the encoding from the `Accept` header: JSON (newline-delimited watch
//! events) by default, protobuf when the client prefers `application/vnd.kubernetes.protobuf`
//! (kube-proxy's default): bodies are `k8s\0` + `runtime.Unknown`, watch streams
//! (`;stream=watch`) are 4-byte big-endian length-prefixed `WatchEvent`s whose objects are
//! enveloped the same way, and error Statuses follow the negotiated type (see `protobuf.rs` for
//! the upstream sources). [`ApiServer::list_content_types`] and
//! [`ApiServer::watch_content_types`] tell what each request was answered in. Tests change
//! objects directly and can break things the way a real
//! cluster does: expire the watch history (a resuming watch gets a 410 `Expired` ERROR event),
//! drop every open watch connection, hold back list responses, and stop the server and start it
//! again on the same port. LIST ignores `limit` (a whole list, no `continue`), as the real server
//! does for `resourceVersion=0`.

mod http;
mod protobuf;
mod selector;
mod state;

use std::fs;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde::Serialize;
use tokio::sync::watch;

use self::state::State;
use crate::{Result, RigError, unique_name};

/// The resources served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Services,
    EndpointSlices,
    Nodes,
}

impl Resource {
    pub const ALL: [Self; 3] = [Self::Services, Self::EndpointSlices, Self::Nodes];

    fn kind(self) -> &'static str {
        match self {
            Self::Services => "Service",
            Self::EndpointSlices => "EndpointSlice",
            Self::Nodes => "Node",
        }
    }

    fn list_kind(self) -> String {
        format!("{}List", self.kind())
    }

    fn api_version(self) -> &'static str {
        match self {
            Self::Services | Self::Nodes => "v1",
            Self::EndpointSlices => "discovery.k8s.io/v1",
        }
    }
}

/// A k8s-openapi type the server stores.
pub trait ApiObject: Serialize {
    const RESOURCE: Resource;
}

impl ApiObject for Service {
    const RESOURCE: Resource = Resource::Services;
}

impl ApiObject for EndpointSlice {
    const RESOURCE: Resource = Resource::EndpointSlices;
}

impl ApiObject for Node {
    const RESOURCE: Resource = Resource::Nodes;
}

/// Requests served per resource (to assert that a relist happened, for instance).
#[derive(Debug, Default)]
pub struct Counters {
    pub lists: AtomicU64,
    pub watches: AtomicU64,
    /// The `resourceVersion` and `resourceVersionMatch` of every LIST, as the query had them
    /// (`resourceVersion=0` asks for the watch cache; absent, for a quorum read from etcd).
    pub list_queries: std::sync::Mutex<Vec<String>>,
    /// The Content-Type every LIST answered with a list was written in (in order), to assert
    /// that a client negotiated protobuf.
    pub list_content_types: std::sync::Mutex<Vec<String>>,
    /// The Content-Type of every WATCH stream opened (including those that carry only a 410
    /// ERROR event), e.g. `application/vnd.kubernetes.protobuf;stream=watch`.
    pub watch_content_types: std::sync::Mutex<Vec<String>>,
}

/// Each object's protobuf list item by resource and key, with the resource version it was
/// encoded at.
type EncodedItems = std::collections::HashMap<(Resource, state::Key), (String, Arc<[u8]>)>;

/// State shared between the test's handle and the HTTP tasks; it outlives server restarts.
#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Announces every change (and dropped watches) to the watch streams; sent under the lock.
    changes: watch::Sender<u64>,
    held: [watch::Sender<bool>; 3],
    counters: [Counters; 3],
    bookmark_interval: Duration,
    /// Events (events.k8s.io/v1) the agent posted, as JSON.
    events: Mutex<Vec<serde_json::Value>>,
    /// Each object's protobuf list item at the resource version it was encoded at: a real API
    /// server serves lists from its watch cache, and converting every stored object again on
    /// each list made the rig's lists, not the agent, most of a restart at 50k Services.
    encoded_items: Mutex<EncodedItems>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not take the server down with a poisoned lock.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn record_event(&self, event: serde_json::Value) {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(event);
    }

    fn changes_rx(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn held_rx(&self, resource: Resource) -> watch::Receiver<bool> {
        self.held[resource as usize].subscribe()
    }

    fn counters(&self, resource: Resource) -> &Counters {
        &self.counters[resource as usize]
    }

    /// Runs `f` on the state and wakes every watch afterwards (still under the lock).
    fn mutate<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let mut state = self.lock();
        let result = f(&mut state);
        let rv = state.rv;
        self.changes.send_replace(rv);
        drop(state);
        result
    }
}

/// Changes made together, seen by watches as one burst (see [`ApiServer::batch`]).
#[derive(Debug)]
pub struct Batch<'a> {
    state: &'a mut State,
}

impl Batch<'_> {
    /// Creates or updates `object` (namespace and name from its metadata); returns its new
    /// resourceVersion.
    pub fn apply<K: ApiObject>(&mut self, object: &K) -> Result<u64> {
        let value = serde_json::to_value(object)
            .map_err(|e| RigError::Other(format!("serializing a {:?}: {e}", K::RESOURCE)))?;
        if value["metadata"]["name"].as_str().is_none_or(str::is_empty) {
            return Err(RigError::Other(format!("a {:?} needs a name", K::RESOURCE)));
        }
        Ok(self.state.apply(K::RESOURCE, value))
    }

    /// Deletes `namespace/name` (namespace "" for Nodes); returns the deletion's
    /// resourceVersion, None if there was no such object.
    pub fn delete<K: ApiObject>(&mut self, namespace: &str, name: &str) -> Option<u64> {
        self.state
            .delete(K::RESOURCE, &(namespace.to_owned(), name.to_owned()))
    }
}

/// How [`ApiServer::break_watches`] breaks the open watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Break {
    /// Connections drop; the history stays, so a client resumes from its resourceVersion.
    Disconnect,
    /// The history is compacted first: a client resuming from its resourceVersion gets a 410
    /// `Expired` ERROR event and must relist.
    Expire,
}

/// The running (or stopped) test server. Drop stops it and removes its kubeconfig.
#[derive(Debug)]
pub struct ApiServer {
    shared: Arc<Shared>,
    netns: Option<PathBuf>,
    port: u16,
    runtime: Option<tokio::runtime::Runtime>,
    dir: PathBuf,
    kubeconfig: PathBuf,
}

/// How often open watches get a BOOKMARK (the real server: about once a minute).
pub const BOOKMARK_INTERVAL: Duration = Duration::from_secs(5);

impl ApiServer {
    /// Starts a server on an ephemeral port of 127.0.0.1 in `netns` (None: the caller's
    /// network namespace) and writes a kubeconfig pointing at it.
    pub fn start(netns: Option<&Path>) -> Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            changes: watch::Sender::new(0),
            held: std::array::from_fn(|_| watch::Sender::new(false)),
            counters: Default::default(),
            bookmark_interval: BOOKMARK_INTERVAL,
            events: Mutex::default(),
            encoded_items: Mutex::default(),
        });
        let dir = std::env::temp_dir().join(unique_name("apiserver"));
        fs::create_dir(&dir).map_err(|e| RigError::io(format!("creating {}", dir.display()), e))?;
        let kubeconfig = dir.join("kubeconfig");
        let mut server = Self {
            shared,
            netns: netns.map(Path::to_path_buf),
            port: 0,
            runtime: None,
            dir,
            kubeconfig,
        };
        server.serve()?;
        let yaml = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters:\n- name: test\n  cluster:\n    server: {}\n\
             users:\n- name: test\n  user: {{}}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n\
             current-context: test\n",
            server.url()
        );
        fs::write(&server.kubeconfig, yaml)
            .map_err(|e| RigError::io(format!("writing {}", server.kubeconfig.display()), e))?;
        Ok(server)
    }

    /// Binds (the same port after the first time) and serves on a fresh runtime.
    fn serve(&mut self) -> Result<()> {
        let listener = bind_in_netns(self.netns.as_deref(), self.port)?;
        self.port = listener
            .local_addr()
            .map_err(|e| RigError::io("reading the API server's port", e))?
            .port();
        listener
            .set_nonblocking(true)
            .map_err(|e| RigError::io("setting the API server socket non-blocking", e))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("apiserver")
            .enable_all()
            .build()
            .map_err(|e| RigError::io("starting the API server runtime", e))?;
        let app = http::router(self.shared.clone());
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener)
                .map_err(|e| RigError::io("registering the API server socket", e))?
        };
        runtime.spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("apiserver: serve failed: {e}");
            }
        });
        self.runtime = Some(runtime);
        Ok(())
    }

    /// The events posted so far (events.k8s.io/v1 Event objects as JSON).
    pub fn events(&self) -> Vec<serde_json::Value> {
        self.shared
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A kubeconfig file for this server (plain HTTP, no credentials).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The last resourceVersion handed out.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// Applies several changes atomically: a watch sees all of them or none yet.
    pub fn batch<T>(&self, f: impl FnOnce(&mut Batch<'_>) -> T) -> T {
        self.shared.mutate(|state| f(&mut Batch { state }))
    }

    /// Creates or updates one object; returns its resourceVersion.
    pub fn apply<K: ApiObject>(&self, object: &K) -> Result<u64> {
        self.batch(|b| b.apply(object))
    }

    /// Deletes one object (namespace "" for Nodes).
    pub fn delete<K: ApiObject>(&self, namespace: &str, name: &str) -> Option<u64> {
        self.batch(|b| b.delete::<K>(namespace, name))
    }

    /// Breaks every open watch, with `changes` applied in the same step, so that no watch can
    /// deliver them: a client learns about them only by resuming (Disconnect) or by relisting
    /// (Expire).
    pub fn break_watches<T>(&self, how: Break, changes: impl FnOnce(&mut Batch<'_>) -> T) -> T {
        self.shared.mutate(|state| {
            let result = changes(&mut Batch { state: &mut *state });
            if how == Break::Expire {
                state.compact();
            }
            state.drop_generation += 1;
            result
        })
    }

    /// Lists of `resource` wait (the connection stays open) until [`ApiServer::release_lists`].
    pub fn hold_lists(&self, resource: Resource) {
        self.shared.held[resource as usize].send_replace(true);
    }

    pub fn release_lists(&self, resource: Resource) {
        self.shared.held[resource as usize].send_replace(false);
    }

    /// LIST requests answered so far for `resource`.
    pub fn lists_served(&self, resource: Resource) -> u64 {
        self.shared.counters(resource).lists.load(Ordering::Relaxed)
    }

    /// The resourceVersion parameters of every LIST of `resource` so far, in order, as
    /// `resourceVersion=…&resourceVersionMatch=…` (a parameter the client left out is absent).
    pub fn list_queries(&self, resource: Resource) -> Vec<String> {
        self.shared
            .counters(resource)
            .list_queries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The Content-Type of every LIST of `resource` answered so far, in order
    /// (`application/json` or `application/vnd.kubernetes.protobuf`).
    pub fn list_content_types(&self, resource: Resource) -> Vec<String> {
        self.shared
            .counters(resource)
            .list_content_types
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The Content-Type of every WATCH stream of `resource` opened so far, in order
    /// (`application/json` or `application/vnd.kubernetes.protobuf;stream=watch`).
    pub fn watch_content_types(&self, resource: Resource) -> Vec<String> {
        self.shared
            .counters(resource)
            .watch_content_types
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// WATCH requests received so far for `resource` (including those answered with 410).
    pub fn watches_started(&self, resource: Resource) -> u64 {
        self.shared
            .counters(resource)
            .watches
            .load(Ordering::Relaxed)
    }

    /// An outage: the listening socket and every connection close at once. Objects can still
    /// be changed meanwhile.
    pub fn stop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Dropping every task closes their sockets: clients see resets, not clean ends.
            runtime.shutdown_background();
        }
    }

    /// Starts serving again on the same port (after [`ApiServer::stop`]).
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.serve()
    }

    pub fn is_running(&self) -> bool {
        self.runtime.is_some()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop();
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("rig: removing {} failed: {e}", self.dir.display());
        }
    }
}

/// Binds 127.0.0.1:`port` inside `netns`: a socket belongs to the namespace it was created in,
/// so a short-lived thread enters the namespace (setns affects only the calling thread) and
/// hands the bound socket back. std sets SO_REUSEADDR, so a restart can rebind the port at once.
fn bind_in_netns(netns: Option<&Path>, port: u16) -> Result<TcpListener> {
    let addr = SocketAddr::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
    let Some(netns) = netns else {
        return TcpListener::bind(addr).map_err(|e| RigError::io(format!("binding {addr}"), e));
    };
    let shown = netns.display().to_string();
    crate::netns::on_thread_in(netns, move || {
        TcpListener::bind(addr).map_err(|e| RigError::io(format!("binding {addr} in {shown}"), e))
    })?
}

#[cfg(test)]
mod tests;
