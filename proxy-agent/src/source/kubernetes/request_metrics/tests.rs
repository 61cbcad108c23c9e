//! The layer over a fake API server that answers the status its path names.

use std::time::Duration;

use futures::future::poll_fn;
use tower::{Layer as _, Service as _};

use super::*;

const HOST: &str = "10.96.0.1:443";

#[derive(Debug, thiserror::Error)]
#[error("connection refused")]
struct Refused;

/// Answers `/200`, `/404`… with that status and a one-frame body; `/error` fails without a
/// response; `/hang` never answers.
#[derive(Debug, Clone)]
struct FakeApiServer;

impl tower::Service<http::Request<()>> for FakeApiServer {
    type Response = http::Response<String>;
    type Error = Refused;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Refused>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Refused>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<()>) -> Self::Future {
        type Answer = Result<http::Response<String>, Refused>;
        match request.uri().path() {
            "/error" => Box::pin(std::future::ready::<Answer>(Err(Refused))),
            "/hang" => Box::pin(std::future::pending::<Answer>()),
            path => {
                let status = path
                    .trim_start_matches('/')
                    .parse::<u16>()
                    .expect("a status in the path");
                let response = http::Response::builder()
                    .status(status)
                    .body("{}".to_owned())
                    .expect("response");
                Box::pin(std::future::ready::<Answer>(Ok(response)))
            }
        }
    }
}

fn client(metrics: &RestClientMetrics) -> RequestMetrics<FakeApiServer> {
    let url: http::Uri = format!("https://user:secret@{HOST}/").parse().expect("url");
    RequestMetricsLayer::new(metrics.clone(), &url).layer(FakeApiServer)
}

fn request(method: &str, uri: &str) -> http::Request<()> {
    http::Request::builder()
        .method(method)
        .uri(uri)
        .body(())
        .expect("request")
}

/// Reads the body to its end: the bytes.
async fn read(body: &mut TimedBody<String>) -> Vec<u8> {
    let mut bytes = Vec::new();
    while let Some(frame) = poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
        let frame: Frame<bytes::Bytes> = match frame {
            Ok(frame) => frame,
            Err(never) => match never {},
        };
        if let Ok(data) = frame.into_data() {
            bytes.extend_from_slice(&data);
        }
    }
    bytes
}

#[tokio::test]
async fn counts_each_request_by_code_method_and_host() {
    let metrics = RestClientMetrics::default();
    let mut client = client(&metrics);
    for (method, uri) in [
        ("GET", "/200"),
        ("GET", "/200?watch=true"),
        ("GET", "/404"),
        ("POST", "/201"),
        ("GET", "/error"),
    ] {
        let result = client.call(request(method, uri)).await;
        if let Ok(response) = result {
            let mut body = response.into_body();
            assert_eq!(read(&mut body).await, b"{}");
        }
    }
    assert_eq!(metrics.requests("200", "GET", HOST), 2);
    assert_eq!(metrics.requests("404", "GET", HOST), 1);
    assert_eq!(metrics.requests("201", "POST", HOST), 1);
    assert_eq!(metrics.requests("<error>", "GET", HOST), 1);
    assert_eq!(metrics.requests("200", "POST", HOST), 0);
    // Every request but the watch was timed: the two other GET answers and the failed GET.
    assert_eq!(metrics.duration_count("GET", HOST), 3);
    assert_eq!(metrics.duration_count("POST", HOST), 1);
}

#[tokio::test]
async fn a_request_is_timed_until_its_body_is_read() {
    let metrics = RestClientMetrics::default();
    let mut client = client(&metrics);
    let response = client
        .call(request("GET", "/200"))
        .await
        .expect("an answer");
    // Counted at the headers, timed once the body is read.
    assert_eq!(metrics.requests("200", "GET", HOST), 1);
    assert_eq!(metrics.duration_count("GET", HOST), 0);
    let mut body = response.into_body();
    read(&mut body).await;
    assert_eq!(metrics.duration_count("GET", HOST), 1);
    // Once: dropping the read body observes nothing more.
    drop(body);
    assert_eq!(metrics.duration_count("GET", HOST), 1);
    // A body dropped unread ends the request too.
    let unread = client
        .call(request("GET", "/404"))
        .await
        .expect("an answer");
    assert_eq!(metrics.duration_count("GET", HOST), 1);
    drop(unread);
    assert_eq!(metrics.duration_count("GET", HOST), 2);
}

#[tokio::test]
async fn a_watch_is_counted_but_not_timed() {
    let metrics = RestClientMetrics::default();
    let mut client = client(&metrics);
    let response = client
        .call(request("GET", "/200?resourceVersion=5&watch=true"))
        .await
        .expect("an answer");
    let mut body = response.into_body();
    read(&mut body).await;
    drop(body);
    assert_eq!(metrics.requests("200", "GET", HOST), 1);
    assert_eq!(metrics.duration_count("GET", HOST), 0);
}

/// client-go's cancelled context: `Do` returns an error, counted as `<error>`, and the latency
/// is observed.
#[tokio::test]
async fn a_request_dropped_unanswered_is_an_error() {
    let metrics = RestClientMetrics::default();
    let mut client = client(&metrics);
    let pending = client.call(request("GET", "/hang"));
    let timed_out = tokio::time::timeout(Duration::from_millis(10), pending).await;
    assert!(timed_out.is_err());
    assert_eq!(metrics.requests("<error>", "GET", HOST), 1);
    assert_eq!(metrics.duration_count("GET", HOST), 1);
}

#[test]
fn the_host_is_gos_url_host() {
    let host = |url: &str| url_host(&url.parse().expect("url"));
    assert_eq!(host("https://10.96.0.1:443/"), "10.96.0.1:443");
    assert_eq!(host("https://api.example"), "api.example");
    assert_eq!(host("http://user:pw@[fd00::1]:6443/base"), "[fd00::1]:6443");
}

#[test]
fn watches_are_told_by_their_query() {
    let watch = |uri: &str| is_watch(&uri.parse().expect("uri"));
    assert!(watch("/api/v1/services?watch=true&resourceVersion=1"));
    assert!(watch("/api/v1/services?resourceVersion=1&watch=1"));
    assert!(!watch("/api/v1/services?watch=false"));
    assert!(!watch("/api/v1/services?watchers=true"));
    assert!(!watch("/api/v1/services?limit=500"));
    assert!(!watch("/api/v1/services"));
}
