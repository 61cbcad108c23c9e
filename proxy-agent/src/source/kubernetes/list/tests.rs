use std::{
    collections::VecDeque,
    convert::Infallible,
    future::Ready,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use hyper::body::Frame;
use k8s_openapi::api::core::v1::Service;

use super::*;

const LIST: &str = r#"{"kind":"ServiceList","apiVersion":"v1",
    "metadata":{"resourceVersion":"42","continue":"next"},
    "items":[
      {"metadata":{"name":"a","namespace":"ns","resourceVersion":"40"},"spec":{"clusterIP":"10.96.0.1"}},
      {"metadata":{"name":"b","namespace":"ns"},"spec":{"clusterIP":"10.96.0.2"},"status":{}}
    ]}"#;

fn names(services: &[Service]) -> Vec<&str> {
    services
        .iter()
        .map(|s| s.metadata.name.as_deref().unwrap_or_default())
        .collect()
}

/// `text` through the parser in chunks of `chunk` bytes (as the pump hands them over).
fn parse_chunked(text: &str, chunk: usize) -> (serde_json::Result<ListMeta>, Vec<Service>) {
    let chunks: Vec<Bytes> = text
        .as_bytes()
        .chunks(chunk)
        .map(Bytes::copy_from_slice)
        .collect();
    let (chunks_tx, chunks_rx) = mpsc::channel(chunks.len().max(1));
    for c in chunks {
        chunks_tx.try_send(c).expect("room for every chunk");
    }
    drop(chunks_tx);
    let (items_tx, mut items_rx) = mpsc::channel(64);
    let mut reader = ChunkReader {
        chunks: chunks_rx,
        current: Bytes::new(),
    };
    let parsed = parse(&mut reader, &items_tx);
    drop(items_tx);
    let mut items = Vec::new();
    while let Ok(item) = items_rx.try_recv() {
        items.push(item);
    }
    (parsed, items)
}

#[test]
fn items_come_out_in_order_with_the_list_metadata_whatever_the_chunking() {
    for chunk in [1, 7, 64, LIST.len()] {
        let (parsed, items) = parse_chunked(LIST, chunk);
        let metadata = parsed.expect("a valid list");
        assert_eq!(metadata.resource_version.as_deref(), Some("42"));
        assert_eq!(metadata.continue_.as_deref(), Some("next"));
        assert_eq!(names(&items), ["a", "b"], "chunks of {chunk}");
        let ip = items[1].spec.as_ref().and_then(|s| s.cluster_ip.as_deref());
        assert_eq!(ip, Some("10.96.0.2"));
    }
}

#[test]
fn items_before_metadata_null_items_and_unknown_keys() {
    let (parsed, items) = parse_chunked(
        r#"{"items":[{"metadata":{"name":"x"}}],"extra":{"deep":[1,2]},"metadata":{"resourceVersion":"7"}}"#,
        5,
    );
    assert_eq!(
        parsed.expect("valid").resource_version.as_deref(),
        Some("7")
    );
    assert_eq!(names(&items), ["x"]);

    let (parsed, items) = parse_chunked(r#"{"metadata":{"resourceVersion":"8"},"items":null}"#, 3);
    assert_eq!(
        parsed.expect("valid").resource_version.as_deref(),
        Some("8")
    );
    assert!(items.is_empty());
}

#[test]
fn bad_json_and_a_cut_body_are_errors_after_the_items_before_them() {
    // A body cut off mid-item: the first item was already handed over.
    let cut = &LIST[..LIST.find("\"b\"").expect("b")];
    let (parsed, items) = parse_chunked(cut, 10);
    assert!(parsed.is_err());
    assert_eq!(names(&items), ["a"]);
    // An item of the wrong shape.
    let (parsed, _) = parse_chunked(r#"{"items":[{"metadata":{"name":5}}]}"#, 4);
    assert!(parsed.is_err());
    // Trailing garbage after the list object.
    let (parsed, _) = parse_chunked(r#"{"items":[]} x"#, 4);
    assert!(parsed.is_err());
}

/// A response body handed out in the given frames; `Err` frames are transport errors.
struct Frames(VecDeque<Result<Bytes, String>>);

impl hyper::body::Body for Frames {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        Poll::Ready(
            self.0
                .pop_front()
                .map(|frame| frame.map(Frame::data).map_err(std::io::Error::other)),
        )
    }
}

/// A fake API server: answers every request with `status` and `frames`, recording the URIs.
#[derive(Clone)]
struct Fake {
    status: u16,
    frames: Vec<Result<Bytes, String>>,
    uris: Arc<Mutex<Vec<String>>>,
}

impl tower::Service<http::Request<Body>> for Fake {
    type Response = Response<Frames>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Frames>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        self.uris
            .lock()
            .expect("uris")
            .push(request.uri().to_string());
        let mut response = Response::new(Frames(self.frames.iter().cloned().collect()));
        *response.status_mut() = http::StatusCode::from_u16(self.status).expect("status");
        std::future::ready(Ok(response))
    }
}

fn fake(status: u16, frames: Vec<Result<Bytes, String>>) -> (Client, Arc<Mutex<Vec<String>>>) {
    let uris = Arc::new(Mutex::new(Vec::new()));
    let service = Fake {
        status,
        frames,
        uris: Arc::clone(&uris),
    };
    (Client::new(service, "default"), uris)
}

fn frames_of(text: &str, size: usize) -> Vec<Result<Bytes, String>> {
    text.as_bytes()
        .chunks(size)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect()
}

/// A list of Services through `client` that is expected to fail (nothing to convert).
async fn services_error(client: &Client) -> Result<(), kube::Error> {
    list(
        client,
        "/api/v1/services",
        &ListParams::default(),
        &Encoding::default(),
        |_: Service| {},
    )
    .await
    .map(drop)
}

#[tokio::test]
async fn a_list_response_is_converted_item_by_item_with_the_watchers_query() {
    let (client, uris) = fake(200, frames_of(LIST, 13));
    let params = ListParams {
        label_selector: Some("!service.kubernetes.io/headless".into()),
        resource_version: Some("0".into()),
        version_match: Some(kube::core::params::VersionMatch::NotOlderThan),
        ..ListParams::default()
    };
    let mut seen = Vec::new();
    let metadata = list(
        &client,
        "/api/v1/services",
        &params,
        &Encoding::default(),
        |s: Service| {
            seen.push(s.metadata.name.unwrap_or_default());
        },
    )
    .await
    .expect("listed");
    assert_eq!(seen, ["a", "b"]);
    assert_eq!(metadata.resource_version.as_deref(), Some("42"));
    assert_eq!(
        *uris.lock().expect("uris"),
        [
            "/api/v1/services?&labelSelector=%21service.kubernetes.io%2Fheadless&resourceVersion=0&resourceVersionMatch=NotOlderThan"
        ]
    );
}

#[tokio::test]
async fn an_error_status_is_the_servers_status_and_no_item_is_converted() {
    let status = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"services is forbidden","reason":"Forbidden","code":403}"#;
    let (client, _) = fake(403, frames_of(status, 10));
    let mut seen = 0;
    let error = list(
        &client,
        "/api/v1/services",
        &ListParams::default(),
        &Encoding::default(),
        |_: Service| {
            seen += 1;
        },
    )
    .await
    .expect_err("403");
    assert!(
        matches!(&error, kube::Error::Api(s) if s.is_forbidden()),
        "{error:?}"
    );
    assert_eq!(seen, 0);

    // Not a Status (a proxy's page): the text and the HTTP code.
    let (client, _) = fake(502, frames_of("bad gateway\n", 4));
    let error = services_error(&client).await.expect_err("502");
    assert!(
        matches!(&error, kube::Error::Api(s) if s.code == 502 && s.message == "bad gateway"),
        "{error:?}"
    );
}

#[tokio::test]
async fn a_broken_body_is_its_transport_error_and_bad_json_a_serde_error() {
    let mut frames = frames_of(&LIST[..LIST.len() / 2], 16);
    frames.push(Err("connection reset".into()));
    let (client, _) = fake(200, frames);
    let error = services_error(&client).await.expect_err("broken body");
    assert!(error.to_string().contains("connection reset"), "{error}");

    let (client, _) = fake(200, frames_of(r#"{"items":[{"metadata":7}]}"#, 5));
    let error = services_error(&client).await.expect_err("bad JSON");
    assert!(matches!(error, kube::Error::SerdeError(_)), "{error:?}");
}
