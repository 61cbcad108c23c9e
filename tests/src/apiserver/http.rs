//! The HTTP side: LIST and WATCH for the three resources, with the real API server's paths,
//! query parameters, JSON and protobuf shapes and status codes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State as AxumState};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::stream;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::protobuf::{self, Format};
use super::selector::{FieldSelector, Filter, LabelSelector};
use super::state::{EventType, HistoryEvent};
use super::{Resource, Shared};

type Params = Query<HashMap<String, String>>;

pub fn router(shared: Arc<Shared>) -> Router {
    let route = |resource: Resource| {
        get(
            move |AxumState(s): AxumState<Arc<Shared>>, headers: HeaderMap, Query(q): Params| async move {
                handle(s, resource, None, &headers, q).await
            },
        )
    };
    let namespaced = |resource: Resource| {
        get(
            move |AxumState(s): AxumState<Arc<Shared>>,
                  headers: HeaderMap,
                  Path(ns): Path<String>,
                  Query(q): Params| async move {
                handle(s, resource, Some(ns), &headers, q).await
            },
        )
    };
    Router::new()
        .route("/api/v1/services", route(Resource::Services))
        .route(
            "/api/v1/namespaces/{ns}/services",
            namespaced(Resource::Services),
        )
        .route(
            "/apis/discovery.k8s.io/v1/endpointslices",
            route(Resource::EndpointSlices),
        )
        .route(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
            namespaced(Resource::EndpointSlices),
        )
        .route("/api/v1/nodes", route(Resource::Nodes))
        .route(
            "/apis/events.k8s.io/v1/namespaces/{ns}/events",
            axum::routing::post(
                |AxumState(s): AxumState<Arc<Shared>>, Path(ns): Path<String>, body: Bytes| async move {
                    create_event(s, ns, body)
                },
            ),
        )
        .fallback(|headers: HeaderMap| async move {
            status_response(
                negotiate(&headers),
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            )
        })
        .with_state(shared)
}

async fn handle(
    shared: Arc<Shared>,
    resource: Resource,
    namespace: Option<String>,
    headers: &HeaderMap,
    query: HashMap<String, String>,
) -> Response {
    let format = negotiate(headers);
    let param = |name: &str| query.get(name).map(String::as_str).unwrap_or_default();
    let filter = match parse_filter(param("labelSelector"), param("fieldSelector"), namespace) {
        Ok(filter) => filter,
        Err(message) => {
            return status_response(format, StatusCode::BAD_REQUEST, "BadRequest", &message);
        }
    };
    if matches!(param("watch"), "true" | "1") {
        let Ok(rv) = parse_rv(param("resourceVersion")) else {
            return status_response(
                format,
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "invalid resourceVersion",
            );
        };
        let timeout = param("timeoutSeconds")
            .parse()
            .ok()
            .map(Duration::from_secs);
        let bookmarks = param("allowWatchBookmarks") == "true";
        shared
            .counters(resource)
            .watches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        record(
            &shared.counters(resource).watch_content_types,
            format.watch_content_type(),
        );
        return watch(shared, resource, format, filter, rv, timeout, bookmarks);
    }
    let versions: Vec<String> = ["resourceVersion", "resourceVersionMatch"]
        .into_iter()
        .filter_map(|name| query.get(name).map(|value| format!("{name}={value}")))
        .collect();
    shared
        .counters(resource)
        .list_queries
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(versions.join("&"));
    list(shared, resource, format, filter).await
}

/// The encoding the request's `Accept` header asks for.
fn negotiate(headers: &HeaderMap) -> Format {
    Format::negotiate(
        headers
            .get(header::ACCEPT)
            .and_then(|value| value.to_str().ok()),
    )
}

fn record(log: &std::sync::Mutex<Vec<String>>, content_type: &str) {
    log.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(content_type.to_owned());
}

/// POST of an Event: stored for the test, echoed back with a name and a resourceVersion like
/// the real server's create.
fn create_event(shared: Arc<Shared>, namespace: String, body: Bytes) -> Response {
    let Ok(mut event) = serde_json::from_slice::<Value>(&body) else {
        return status_response(
            Format::Json,
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "invalid Event JSON",
        );
    };
    let count = shared
        .events
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .len();
    if let Some(metadata) = event.get_mut("metadata").and_then(Value::as_object_mut) {
        metadata.insert("namespace".into(), json!(namespace));
        metadata.insert("resourceVersion".into(), json!(format!("{}", count + 1)));
        if !metadata.contains_key("name") {
            let prefix = metadata
                .get("generateName")
                .and_then(Value::as_str)
                .unwrap_or("event-")
                .to_owned();
            metadata.insert("name".into(), json!(format!("{prefix}{count}")));
        }
    }
    shared.record_event(event.clone());
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        event.to_string(),
    )
        .into_response()
}

fn parse_filter(labels: &str, fields: &str, namespace: Option<String>) -> Result<Filter, String> {
    Ok(Filter {
        labels: LabelSelector::parse(labels)?,
        fields: FieldSelector::parse(fields)?,
        namespace,
    })
}

/// `""` and `"0"` mean "any version": the watch starts with the current state.
fn parse_rv(text: &str) -> Result<Option<u64>, std::num::ParseIntError> {
    match text {
        "" | "0" => Ok(None),
        text => text.parse().map(Some),
    }
}

async fn list(shared: Arc<Shared>, resource: Resource, format: Format, filter: Filter) -> Response {
    // A held list answers only once the test releases it (the hold is re-read on release).
    let mut held = shared.held_rx(resource);
    // An error means the sender is gone, i.e. the server is being torn down: answer anyway.
    let _ = held.wait_for(|held| !held).await;
    shared
        .counters(resource)
        .lists
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    record(
        &shared.counters(resource).list_content_types,
        format.content_type(),
    );
    let state = shared.lock();
    let rv = state.rv.to_string();
    if format == Format::Protobuf {
        let mut cache = shared
            .encoded_items
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut items = Vec::new();
        for object in state.list(resource).filter(|o| filter.matches(o)) {
            let version = object["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default();
            let key = (resource, super::state::key_of(object));
            let bytes = match cache.get(&key) {
                Some((at, bytes)) if at == version => Arc::clone(bytes),
                _ => match protobuf::encode_item(resource, object) {
                    Ok(bytes) => {
                        let bytes: Arc<[u8]> = bytes.into();
                        cache.insert(key, (version.to_owned(), Arc::clone(&bytes)));
                        bytes
                    }
                    Err(message) => {
                        return status_response(
                            format,
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "InternalError",
                            &message,
                        );
                    }
                },
            };
            items.push(bytes);
        }
        drop(cache);
        drop(state);
        let body = protobuf::encode_list_of(resource, &rv, &items);
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, protobuf::MEDIA_TYPE)],
            body,
        )
            .into_response();
    }
    let items: Vec<Value> = state
        .list(resource)
        .filter(|o| filter.matches(o))
        .map(|o| {
            // Items of a typed list carry no kind/apiVersion, as from the real server.
            let mut item = o.clone();
            if let Some(map) = item.as_object_mut() {
                map.remove("kind");
                map.remove("apiVersion");
            }
            item
        })
        .collect();
    drop(state);
    let body = json!({
        "kind": resource.list_kind(),
        "apiVersion": resource.api_version(),
        "metadata": {"resourceVersion": rv},
        "items": items,
    });
    json_response(StatusCode::OK, &body)
}

/// What a watch stream still has to do.
struct Cursor {
    shared: Arc<Shared>,
    resource: Resource,
    format: Format,
    filter: Filter,
    rv: u64,
    /// Encoded events; an error (an object that would not encode) breaks the stream there.
    pending: std::collections::VecDeque<Result<Bytes, std::io::Error>>,
    drop_generation: u64,
    changes: tokio::sync::watch::Receiver<u64>,
    deadline: Option<Instant>,
    bookmarks: bool,
    done: bool,
}

fn watch(
    shared: Arc<Shared>,
    resource: Resource,
    format: Format,
    filter: Filter,
    from: Option<u64>,
    timeout: Option<Duration>,
    bookmarks: bool,
) -> Response {
    let cursor = {
        let state = shared.lock();
        // Subscribed under the lock (changes are announced under it too): no change can fall
        // between the state read here and the first wait.
        let changes = shared.changes_rx();
        let mut cursor = Cursor {
            shared: shared.clone(),
            resource,
            format,
            filter,
            rv: state.rv,
            pending: Default::default(),
            drop_generation: state.drop_generation,
            changes,
            deadline: timeout.map(|t| Instant::now() + t),
            bookmarks,
            done: false,
        };
        match from {
            // No version: synthetic ADDED events for the current state, then live events.
            None => {
                for object in state.list(resource).filter(|o| cursor.filter.matches(o)) {
                    let event = encode_event(format, resource, "ADDED", object);
                    cursor.pending.push_back(event);
                }
            }
            // Too old: the real server answers 200 with one ERROR event and ends the stream.
            Some(rv) if rv < state.compacted => {
                let status = status_object(
                    410,
                    "Expired",
                    &format!("too old resource version: {rv} ({})", state.compacted),
                );
                cursor.push("ERROR", &status);
                cursor.done = true;
            }
            Some(rv) => {
                cursor.rv = rv;
                cursor.collect(&state.history);
                cursor.rv = state.rv.max(rv);
            }
        }
        cursor
    };
    let body = stream::unfold(cursor, |mut cursor| async move {
        let item = cursor.next().await?;
        Some((item, cursor))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, format.watch_content_type())
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

impl Cursor {
    /// Queues one event in the stream's encoding.
    fn push(&mut self, event_type: &str, object: &Value) {
        let event = encode_event(self.format, self.resource, event_type, object);
        self.pending.push_back(event);
    }

    /// Queues the events after `self.rv` that this watch sees.
    fn collect(&mut self, history: &[HistoryEvent]) {
        let from = self.rv;
        // The history is in resourceVersion order: a watch of a large cluster looks at the
        // events after its own only, as the real server's watch cache does (it was a scan of
        // every event since the start, milliseconds per change at 50k Services).
        let first = history.partition_point(|e| e.rv <= from);
        for event in &history[first..] {
            if event.resource != self.resource {
                continue;
            }
            let was = event.old.as_ref().is_some_and(|o| self.filter.matches(o));
            let is = self.filter.matches(&event.new);
            // A change that moves an object into or out of the selection is an ADDED or
            // DELETED for this watch (what the real server's watch cache does).
            let kind = match (event.kind, was, is) {
                (EventType::Deleted, true, _) => "DELETED",
                (EventType::Deleted, false, _) => continue,
                (_, false, true) => "ADDED",
                (_, true, true) => "MODIFIED",
                (_, true, false) => "DELETED",
                (_, false, false) => continue,
            };
            self.push(kind, &event.new);
        }
    }

    async fn next(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                if event.is_err() {
                    // Like upstream, a failed encode ends the stream: the client sees a cut.
                    self.pending.clear();
                    self.done = true;
                }
                return Some(event);
            }
            if self.done {
                return None;
            }
            let bookmark_at = Instant::now() + self.shared.bookmark_interval;
            let deadline = self.deadline;
            tokio::select! {
                biased;
                _ = self.changes.changed() => {
                    let shared = self.shared.clone();
                    let state = shared.lock();
                    if state.drop_generation != self.drop_generation {
                        // A broken connection, not a clean end: the client sees a read error.
                        self.done = true;
                        return Some(Err(std::io::Error::other("watch dropped by the test")));
                    }
                    self.collect(&state.history);
                    self.rv = state.rv;
                }
                _ = tokio::time::sleep_until(bookmark_at), if self.bookmarks => {
                    let rv = self.shared.lock().rv;
                    let object = json!({
                        "kind": self.resource.kind(),
                        "apiVersion": self.resource.api_version(),
                        "metadata": {"resourceVersion": rv.to_string()},
                    });
                    // Only what this stream has already delivered may be bookmarked.
                    if rv == self.rv {
                        self.push("BOOKMARK", &object);
                    }
                }
                _ = sleep_until_opt(deadline) => {
                    self.done = true;
                }
            }
        }
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn encode_event(
    format: Format,
    resource: Resource,
    event_type: &str,
    object: &Value,
) -> Result<Bytes, std::io::Error> {
    match format {
        Format::Json => Ok(event_line(event_type, object)),
        Format::Protobuf => protobuf::encode_object(resource, object)
            .and_then(|object| protobuf::watch_frame(event_type, object))
            .map(Bytes::from)
            .map_err(std::io::Error::other),
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// An error answer, in the negotiated encoding as upstream writes its Status objects.
fn status_response(format: Format, code: StatusCode, reason: &str, message: &str) -> Response {
    let status = status_object(code.as_u16(), reason, message);
    match format {
        Format::Json => json_response(code, &status),
        Format::Protobuf => (
            code,
            [(header::CONTENT_TYPE, protobuf::MEDIA_TYPE)],
            protobuf::encode_status(&status),
        )
            .into_response(),
    }
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}
