//! client-go's `rest_client_requests_total` and `rest_client_request_duration_seconds` for every
//! request of the kube client, as client-go's `rest.Request` records them:
//!
//! - the counter, once per request, with the final reply's status code or `<error>` when no
//!   response came (kube's own retries are inside this layer, as client-go's are before its
//!   final reply; a request dropped before its reply is client-go's cancelled context, an
//!   error);
//! - the latency, for the requests client-go sends with `Do` (lists, gets, Events): from before
//!   the client-side rate limit (this layer wraps it) until the response body has been read
//!   (client-go reads it inside the timed `request`). Watches are not timed: client-go's
//!   `Watch` observes no latency.
//!
//! `host` is the API server URL's host as Go's `url.URL.Host` has it: host and port as the URL
//! writes them, without scheme or user info.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use http_body::{Body, Frame, SizeHint};

use crate::http_servers::rest_client::RestClientMetrics;

/// Go's `url.URL.Host` of `url`: the authority without user info ("" when it has none).
pub fn url_host(url: &http::Uri) -> String {
    let authority = url.authority().map_or("", |authority| authority.as_str());
    authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host)
        .to_owned()
}

/// Whether `uri` asks for a watch (`watch=` with a value the API server's `strconv.ParseBool`
/// reads as true).
fn is_watch(uri: &http::Uri) -> bool {
    uri.query().is_some_and(|query| {
        query.split('&').any(|pair| {
            matches!(
                pair.split_once('='),
                Some(("watch", "1" | "t" | "T" | "true" | "TRUE" | "True"))
            )
        })
    })
}

/// The layer, for `kube::client::ClientBuilder::with_layer`: outside the rate limit.
#[derive(Debug, Clone)]
pub struct RequestMetricsLayer {
    metrics: RestClientMetrics,
    host: Arc<str>,
}

impl RequestMetricsLayer {
    /// Records into `metrics` the requests to the API server at `cluster_url`.
    pub fn new(metrics: RestClientMetrics, cluster_url: &http::Uri) -> Self {
        Self {
            metrics,
            host: url_host(cluster_url).into(),
        }
    }
}

impl<S> tower::Layer<S> for RequestMetricsLayer {
    type Service = RequestMetrics<S>;

    fn layer(&self, inner: S) -> RequestMetrics<S> {
        RequestMetrics {
            inner,
            metrics: self.metrics.clone(),
            host: Arc::clone(&self.host),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RequestMetrics<S> {
    inner: S,
    metrics: RestClientMetrics,
    host: Arc<str>,
}

impl<S, B, R> tower::Service<http::Request<B>> for RequestMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: Body,
{
    type Response = http::Response<TimedBody<R>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let mut pending = Pending {
            metrics: self.metrics.clone(),
            host: Arc::clone(&self.host),
            method: request.method().as_str().to_owned(),
            timer: None,
            counted: false,
        };
        if !is_watch(request.uri()) {
            pending.timer = Some(Timer {
                metrics: self.metrics.clone(),
                host: Arc::clone(&self.host),
                verb: pending.method.clone(),
                start: Instant::now(),
            });
        }
        let response = self.inner.call(request);
        Box::pin(async move {
            let result = response.await;
            pending.count(
                result
                    .as_ref()
                    .ok()
                    .map(|response| response.status().as_u16()),
            );
            let timer = pending.timer.take();
            // Without a response the timer drops here, and the latency is observed now.
            result.map(|response| {
                response.map(|body| TimedBody {
                    inner: Box::pin(body),
                    timer,
                })
            })
        })
    }
}

/// A request sent and not yet answered: counted as `<error>` if dropped unanswered.
struct Pending {
    metrics: RestClientMetrics,
    host: Arc<str>,
    method: String,
    timer: Option<Timer>,
    counted: bool,
}

impl Pending {
    fn count(&mut self, code: Option<u16>) {
        self.counted = true;
        self.metrics.request_done(code, &self.method, &self.host);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.counted {
            self.count(None);
        }
    }
}

/// Observes the latency since `start` when dropped.
struct Timer {
    metrics: RestClientMetrics,
    host: Arc<str>,
    verb: String,
    start: Instant,
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.metrics
            .observe_duration(&self.verb, &self.host, self.start.elapsed());
    }
}

/// The response body, which observes the request's latency when it ends (or fails, or is
/// dropped unread).
pub struct TimedBody<B> {
    // Boxed so that the wrapper is `Unpin` whatever the body is.
    inner: Pin<Box<B>>,
    timer: Option<Timer>,
}

impl<B> std::fmt::Debug for TimedBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimedBody")
            .field("timed", &self.timer.is_some())
            .finish_non_exhaustive()
    }
}

impl<B> Body for TimedBody<B>
where
    B: Body,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let frame = this.inner.as_mut().poll_frame(cx);
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
            this.timer = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests;
