//! A WATCH request with the configured `Accept` ([`super::encoding`]), its events read in the
//! encoding the response has: length-delimited protobuf frames, or JSON lines as kube-rs
//! reads them (`Client::request_events`), for a server that answers JSON to a protobuf ask.

use std::io;

use bytes::{Bytes, BytesMut};
use futures::{StreamExt as _, stream::BoxStream};
use kube::{
    Client,
    client::Body,
    core::{Request as KubeRequest, Status, WatchEvent, params::WatchParams},
};
use serde::de::DeserializeOwned;
use tracing::warn;

use super::{
    encoding::{self, Encoding},
    list::{check_status, next_frame},
    protobuf::{self, Frames, FromMessage},
};

pub type Events<K> = BoxStream<'static, kube::Result<WatchEvent<K>>>;

/// Starts a watch of `url_path` from `resource_version`.
pub async fn watch<K>(
    client: &Client,
    url_path: &str,
    params: &WatchParams,
    resource_version: &str,
    encoding: &Encoding,
) -> kube::Result<Events<K>>
where
    K: DeserializeOwned + FromMessage + Send + 'static,
{
    let mut request = KubeRequest::new(url_path)
        .watch(params, resource_version)
        .map_err(kube::Error::BuildRequest)?;
    request.extensions_mut().insert("watch");
    let headers = request.headers_mut();
    headers.insert(http::header::ACCEPT, encoding.accept().clone());
    // As kube-rs: a gzipped watch stream is one gzip member per event, which the client's
    // decompression does not read past the first.
    headers.insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    let response = check_status(client.send(request.map(Body::from)).await?).await?;
    let format = if encoding::is_protobuf(response.headers()) {
        Format::Protobuf(Frames::default())
    } else {
        Format::JsonLines(BytesMut::new())
    };
    let reader = Reader {
        body: Some(response.into_body()),
        format,
    };
    Ok(futures::stream::unfold(reader, |mut reader| async move {
        let event = reader.next().await?;
        Some((event, reader))
    })
    .boxed())
}

enum Format {
    Protobuf(Frames),
    JsonLines(BytesMut),
}

struct Reader {
    /// None once the body ended or failed: the stream ends, and the watcher resumes.
    body: Option<Body>,
    format: Format,
}

impl Reader {
    async fn next<K>(&mut self) -> Option<kube::Result<WatchEvent<K>>>
    where
        K: DeserializeOwned + FromMessage,
    {
        loop {
            match self.decode_buffered() {
                Some(Ok(Some(event))) => return Some(Ok(event)),
                // A line that was not an event (an empty line, or a partial one at the end).
                Some(Ok(None)) => continue,
                Some(Err(error)) => {
                    self.body = None;
                    return Some(Err(error));
                }
                None => {}
            }
            let body = self.body.as_mut()?;
            match next_frame(body).await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.push(&data);
                    }
                }
                Some(Err(error)) => {
                    self.body = None;
                    return ended_by(error);
                }
                None => {
                    self.body = None;
                    if let Format::Protobuf(frames) = &self.format
                        && let Err(error) = frames.finish()
                    {
                        warn!(%error, "watch stream ended inside an event");
                    }
                    return None;
                }
            }
        }
    }

    fn push(&mut self, data: &Bytes) {
        match &mut self.format {
            Format::Protobuf(frames) => frames.push(data),
            Format::JsonLines(buffer) => buffer.extend_from_slice(data),
        }
    }

    /// The next event already buffered: None if more input is needed; `Ok(None)` for a line
    /// that holds no event.
    fn decode_buffered<K>(&mut self) -> Option<kube::Result<Option<WatchEvent<K>>>>
    where
        K: DeserializeOwned + FromMessage,
    {
        match &mut self.format {
            Format::Protobuf(frames) => match frames.next_frame() {
                Ok(None) => None,
                Ok(Some(frame)) => Some(
                    protobuf::decode_watch_event(&frame)
                        .map(Some)
                        .map_err(|e| kube::Error::Service(Box::new(e))),
                ),
                Err(error) => Some(Err(kube::Error::Service(Box::new(error)))),
            },
            Format::JsonLines(buffer) => {
                let end = buffer.iter().position(|&b| b == b'\n')?;
                let line = buffer.split_to(end + 1);
                Some(json_line(&line[..end]))
            }
        }
    }
}

/// One JSON line, as kube-rs reads it: an event, or an error `Status`.
pub(super) fn json_line<K: DeserializeOwned>(line: &[u8]) -> kube::Result<Option<WatchEvent<K>>> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    match serde_json::from_slice::<WatchEvent<K>>(line) {
        Ok(event) => Ok(Some(event)),
        Err(error) => match serde_json::from_slice::<Status>(line) {
            Ok(status) => Err(kube::Error::Api(status.boxed())),
            Err(_) => Err(kube::Error::SerdeError(error)),
        },
    }
}

/// As kube-rs: a connection cut mid-stream (an unexpected EOF, however deep in the error
/// chain; hyper's chunk decoder says so only in its text) ends the watch, which resumes from
/// its resourceVersion; anything else is an error.
fn ended_by<K>(error: kube::Error) -> Option<kube::Result<WatchEvent<K>>> {
    let mut source: Option<&dyn std::error::Error> = Some(&error);
    while let Some(current) = source {
        if current
            .downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::UnexpectedEof)
            || current.to_string().contains("unexpected EOF during chunk")
        {
            warn!(%error, "watch connection cut; resuming");
            return None;
        }
        source = current.source();
    }
    Some(Err(kube::Error::ReadEvents(io::Error::other(error))))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;

    use super::*;

    #[test]
    fn json_lines_are_events_or_statuses() {
        let event = json_line::<Service>(
            br#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"5"}}}"#,
        )
        .unwrap();
        assert!(
            matches!(&event, Some(WatchEvent::Added(s)) if s.metadata.name.as_deref() == Some("a")),
            "{event:?}"
        );
        assert!(json_line::<Service>(b"  ").unwrap().is_none());
        let status = json_line::<Service>(
            br#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Expired","code":410}"#,
        )
        .unwrap_err();
        assert!(
            matches!(&status, kube::Error::Api(s) if s.code == 410),
            "{status:?}"
        );
        assert!(matches!(
            json_line::<Service>(b"{not json").unwrap_err(),
            kube::Error::SerdeError(_)
        ));
    }

    #[test]
    fn json_lines_split_across_chunks() {
        let mut reader = Reader {
            body: None,
            format: Format::JsonLines(BytesMut::new()),
        };
        let text = concat!(
            r#"{"type":"ADDED","object":{"metadata":{"name":"a"}}}"#,
            "\n",
            r#"{"type":"DELETED","object":{"metadata":{"name":"b"}}}"#,
            "\n"
        );
        let mut names = Vec::new();
        for chunk in text.as_bytes().chunks(7) {
            reader.push(&Bytes::copy_from_slice(chunk));
            while let Some(event) = reader.decode_buffered::<Service>() {
                match event.unwrap() {
                    Some(WatchEvent::Added(s) | WatchEvent::Deleted(s)) => {
                        names.push(s.metadata.name.unwrap_or_default());
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
        assert_eq!(names, ["a", "b"]);
    }
}
