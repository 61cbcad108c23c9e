//! kube-runtime's list-then-watch state machine (`kube::runtime::watcher`, ListWatch strategy),
//! with the list streamed through [`super::list`] into the kind's mapper.
//!
//! kube-runtime's watcher buffers a whole list page as `k8s-openapi` objects (its list reads
//! the whole body first) and hands them out one `InitApply` at a time; its `ApiMode` is not
//! public, so the list cannot be replaced there. Everything else is kept as it does it: the
//! same list and watch parameters, an `Init`/`InitApply`/`InitDone` per list (the mappers turn
//! them into one `Replace*`), continue tokens followed, a watch resumed from the last
//! resourceVersion (bookmarks included) when it ends or idles out, a relist after a 410 Gone,
//! and its error type, so that `default_backoff` and the logs behave as before.

use std::{fmt, time::Duration};

use futures::{Stream, StreamExt as _};
use kube::{
    Api, Client, Resource, ResourceExt as _,
    core::{
        WatchEvent,
        params::{ListParams, VersionMatch, WatchParams},
    },
    runtime::watcher::{Error, Event},
};
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use super::{
    encoding::Encoding,
    list,
    mapping::EventMapper,
    protobuf::FromMessage,
    watch_events::{self, Events},
};
use proxy_model::objects::Update;

/// kube-runtime's margin over the server-side watch timeout before an idle watch is dropped.
const WATCH_IDLE_TIMEOUT_MARGIN: Duration = Duration::from_secs(5);
/// kube-runtime's server-side watch timeout when none is set (`WatchParams::default`).
const WATCH_TIMEOUT_SECS: u32 = 290;

/// What the stream reports besides errors.
#[derive(Debug)]
#[expect(
    clippy::large_enum_variant,
    reason = "one at a time, moved straight on to the store's channel as an `Update`"
)]
pub enum Step {
    /// A (re)list starts.
    Listing,
    /// What the mapper made of a list or a watch event.
    Update(Update),
}

/// The list and watch parameters (kube-runtime's `watcher::Config`, the fields the agent sets).
#[derive(Debug, Clone, Default)]
pub struct Params {
    pub label_selector: Option<String>,
    pub field_selector: Option<String>,
}

impl Params {
    /// kube-runtime's `any_semantic()` without a page size: served from the watch cache
    /// (`resourceVersion=0`, `resourceVersionMatch=NotOlderThan`), not from etcd.
    fn list_params(&self, continue_token: Option<String>) -> ListParams {
        ListParams {
            label_selector: self.label_selector.clone(),
            field_selector: self.field_selector.clone(),
            resource_version: Some("0".into()),
            version_match: Some(VersionMatch::NotOlderThan),
            continue_token,
            ..ListParams::default()
        }
    }

    fn watch_params(&self) -> WatchParams {
        WatchParams {
            label_selector: self.label_selector.clone(),
            field_selector: self.field_selector.clone(),
            timeout: None,
            bookmarks: true,
            send_initial_events: false,
        }
    }
}

enum State<K: 'static> {
    /// Nothing listed yet, or starting over (410 Gone, no resourceVersion).
    Empty,
    /// Listed up to `resource_version`; the watch is (re)started from there.
    Listed { resource_version: String },
    Watching {
        resource_version: String,
        stream: Events<K>,
    },
}

/// `api`'s objects as [`Step`]s: the watch never ends; errors are items (put a backoff on the
/// stream, as kube-runtime's `default_backoff`).
pub fn watch<K, M>(
    api: Api<K>,
    params: Params,
    encoding: Encoding,
    mapper: M,
) -> impl Stream<Item = Result<Step, Error>>
where
    K: Resource + Clone + DeserializeOwned + FromMessage + fmt::Debug + Send + 'static,
    M: EventMapper<K>,
{
    let client: Client = api.clone().into_client();
    let url = api.resource_url().to_owned();
    let machine = Machine {
        api,
        client,
        url,
        params,
        encoding,
        mapper,
        state: State::Empty,
        listing: false,
    };
    futures::stream::unfold(machine, |mut machine| async move {
        let item = machine.step().await;
        Some((item, machine))
    })
}

struct Machine<K: 'static, M> {
    api: Api<K>,
    client: Client,
    url: String,
    params: Params,
    /// What lists and watches ask for; a watch that asks for JSON only is kube-rs's own.
    encoding: Encoding,
    mapper: M,
    state: State<K>,
    /// `Init` was reported and the list not done yet.
    listing: bool,
}

impl<K, M> Machine<K, M>
where
    K: Resource + Clone + DeserializeOwned + FromMessage + fmt::Debug + Send + 'static,
    M: EventMapper<K>,
{
    /// The next item: loops over the transitions that report nothing (a watch started, a
    /// bookmark, an event the mapper drops).
    async fn step(&mut self) -> Result<Step, Error> {
        loop {
            match std::mem::replace(&mut self.state, State::Empty) {
                State::Empty if !self.listing => {
                    // As kube-runtime: `Init` first, then the list (again after a failure).
                    self.listing = true;
                    return Ok(Step::Listing);
                }
                State::Empty => match self.list().await {
                    Ok((update, resource_version)) => {
                        self.listing = false;
                        self.state = State::Listed { resource_version };
                        if let Some(update) = update {
                            return Ok(Step::Update(update));
                        }
                    }
                    Err(error) => {
                        self.listing = false;
                        return Err(error);
                    }
                },
                State::Listed { resource_version } => {
                    match self.start_watch(&resource_version).await {
                        Ok(stream) => {
                            self.state = State::Watching {
                                resource_version,
                                stream,
                            };
                        }
                        Err(error) => {
                            log_client_error("watch start", &error);
                            self.state = State::Listed { resource_version };
                            return Err(Error::WatchStartFailed(error));
                        }
                    }
                }
                State::Watching {
                    resource_version,
                    mut stream,
                } => {
                    let idle = Duration::from_secs(u64::from(WATCH_TIMEOUT_SECS))
                        + WATCH_IDLE_TIMEOUT_MARGIN;
                    let next = match tokio::time::timeout(idle, stream.next()).await {
                        Ok(next) => next,
                        Err(_) => {
                            debug!("watch stream idle timeout, reconnecting");
                            None
                        }
                    };
                    match next {
                        // The server ended the watch (its timeout): resume from where it was.
                        None => self.state = State::Listed { resource_version },
                        Some(Ok(WatchEvent::Added(object) | WatchEvent::Modified(object))) => {
                            if let Some(step) = self.watched(object, stream, Event::Apply)? {
                                return Ok(step);
                            }
                        }
                        Some(Ok(WatchEvent::Deleted(object))) => {
                            if let Some(step) = self.watched(object, stream, Event::Delete)? {
                                return Ok(step);
                            }
                        }
                        Some(Ok(WatchEvent::Bookmark(bookmark))) => {
                            self.state = State::Watching {
                                resource_version: bookmark.metadata.resource_version,
                                stream,
                            };
                        }
                        Some(Ok(WatchEvent::Error(status))) => {
                            // 410 Gone: the history to resume from has expired; list again.
                            if status.code != 410 {
                                self.state = State::Watching {
                                    resource_version,
                                    stream,
                                };
                            }
                            if status.code == 403 {
                                warn!("watcher watchevent error 403: {status:?}");
                            } else {
                                debug!("error watchevent error: {status:?}");
                            }
                            return Err(Error::WatchError(status.boxed()));
                        }
                        Some(Err(error)) => {
                            log_client_error("watch", &error);
                            self.state = State::Watching {
                                resource_version,
                                stream,
                            };
                            return Err(Error::WatchFailed(error));
                        }
                    }
                }
            }
        }
    }

    async fn start_watch(&mut self, resource_version: &str) -> kube::Result<Events<K>> {
        let params = self.params.watch_params();
        if self.encoding.asks_for_protobuf() {
            watch_events::watch(
                &self.client,
                &self.url,
                &params,
                resource_version,
                &self.encoding,
            )
            .await
        } else {
            Ok(self.api.watch(&params, resource_version).await?.boxed())
        }
    }

    /// An object the watch delivered: the watch goes on from its resourceVersion, and the
    /// mapper makes of it what `event` says happened to it.
    fn watched(
        &mut self,
        object: K,
        stream: Events<K>,
        event: fn(K) -> Event<K>,
    ) -> Result<Option<Step>, Error> {
        let Some(resource_version) = version_of(&object) else {
            return Err(Error::NoResourceVersion);
        };
        self.state = State::Watching {
            resource_version,
            stream,
        };
        Ok(self.mapper.map(event(object)).map(Step::Update))
    }

    /// One complete list (every page), streamed into the mapper: its `Replace*` and the
    /// resourceVersion to watch from.
    async fn list(&mut self) -> Result<(Option<Update>, String), Error> {
        // The mapper starts a new buffer, dropping what an interrupted list left.
        let _ = self.mapper.map(Event::Init);
        let mut continue_token = None;
        loop {
            let params = self.params.list_params(continue_token.take());
            let mapper = &mut self.mapper;
            let listed = list::list(
                &self.client,
                &self.url,
                &params,
                &self.encoding,
                |object: K| {
                    let _ = mapper.map(Event::InitApply(object));
                },
            )
            .await;
            let metadata = match listed {
                Ok(metadata) => metadata,
                Err(error) => {
                    log_client_error("list", &error);
                    return Err(Error::InitialListFailed(error));
                }
            };
            let resource_version = metadata.resource_version.filter(|v| !v.is_empty());
            continue_token = metadata.continue_.filter(|c| !c.is_empty());
            match (continue_token.is_some(), resource_version) {
                (true, _) => {}
                (false, Some(resource_version)) => {
                    return Ok((self.mapper.map(Event::InitDone), resource_version));
                }
                (false, None) => return Err(Error::NoResourceVersion),
            }
        }
    }
}

/// An object's resourceVersion, if it has a non-empty one.
fn version_of<K: Resource>(object: &K) -> Option<String> {
    object.resource_version().filter(|v| !v.is_empty())
}

/// As kube-runtime: a 403 is worth a warning (RBAC), anything else is retried quietly (the
/// caller logs the error it returns).
fn log_client_error(what: &str, error: &kube::Error) {
    if matches!(error, kube::Error::Api(status) if status.is_forbidden()) {
        warn!("{what} error with 403: {error:?}");
    } else {
        debug!("{what} error: {error:?}");
    }
}
