//! A LIST read as it arrives: each item is handed over as soon as it is parsed, so that no
//! more than a few `k8s-openapi` objects, and a few chunks of the response, exist at a time.
//!
//! `kube::Api::list` collects the whole response body, copies it into a `String` and parses it
//! into one `ObjectList` whose items all live until the last is converted: at 30k Services ×
//! 10 endpoints the EndpointSlice list is tens of MB of JSON and several times that as
//! objects, most of the agent's peak memory. Here the body's chunks go to a parser on a
//! blocking thread (serde_json reads from `io::Read`, which is synchronous), and the items
//! come back one by one over a small bounded channel. A protobuf body (the default encoding,
//! see [`super::encoding`]) is read the same way by [`super::protobuf::parse_list`].

use std::{io, pin::Pin};

use bytes::{Buf as _, Bytes};
use futures::future;
use http::Response;
use hyper::body::{Body as _, Frame};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use kube::{
    Client,
    client::Body,
    core::{Request as KubeRequest, params::ListParams},
};
use serde::de::{self, DeserializeOwned, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess};
use tokio::sync::mpsc;

use super::{
    encoding::{self, Encoding},
    protobuf::{self, FromMessage},
};

/// Body chunks queued for the parser. A chunk is what hyper read (up to its read buffer,
/// some 400 KiB at most), so this bounds the text held at once to a few MiB.
const CHUNKS_QUEUED: usize = 4;
/// Parsed items queued for conversion: the objects that exist at once.
const ITEMS_QUEUED: usize = 16;

/// Lists `url_path` (an `Api`'s `resource_url`) with `params`, calling `item` for each object
/// in the order of the response. Returns the list's metadata (resourceVersion, continue).
///
/// Errors are kube's: an error status is `Api` with the server's `Status` (as
/// `kube::Client::request` reports it), a broken body its transport error, bad JSON
/// `SerdeError`, bad protobuf `Service` with a [`protobuf::DecodeError`].
pub async fn list<K>(
    client: &Client,
    url_path: &str,
    params: &ListParams,
    encoding: &Encoding,
    mut item: impl FnMut(K),
) -> kube::Result<ListMeta>
where
    K: DeserializeOwned + FromMessage + Send + 'static,
{
    let mut request = KubeRequest::new(url_path)
        .list(params)
        .map_err(kube::Error::BuildRequest)?;
    // The operation name kube's own `Api::list` gives the request (its tracing reads it).
    request.extensions_mut().insert("list");
    request
        .headers_mut()
        .insert(http::header::ACCEPT, encoding.accept().clone());
    let response = check_status(client.send(request.map(Body::from)).await?).await?;
    let is_protobuf = encoding::is_protobuf(response.headers());
    let mut body = response.into_body();

    let (chunks_tx, chunks_rx) = mpsc::channel::<Bytes>(CHUNKS_QUEUED);
    let (items_tx, mut items_rx) = mpsc::channel::<K>(ITEMS_QUEUED);
    let parser = tokio::task::spawn_blocking(move || {
        let mut reader = ChunkReader {
            chunks: chunks_rx,
            current: Bytes::new(),
        };
        if is_protobuf {
            protobuf::parse_list(&mut io::BufReader::new(reader), |item| {
                items_tx.blocking_send(item).is_ok()
            })
            .map_err(|e| kube::Error::Service(Box::new(e)))
        } else {
            parse(&mut reader, &items_tx).map_err(kube::Error::SerdeError)
        }
    });
    // Until the body ends (or the parser stops taking chunks): dropping `chunks_tx` at the end
    // is the parser's end of input.
    let pump = async move {
        while let Some(frame) = next_frame(&mut body).await {
            let Ok(data) = frame?.into_data() else {
                // Trailers: no data.
                continue;
            };
            if chunks_tx.send(data).await.is_err() {
                // The parser stopped (bad JSON): its error says why.
                break;
            }
        }
        Ok::<(), kube::Error>(())
    };
    let convert = async {
        while let Some(object) = items_rx.recv().await {
            item(object);
        }
    };
    let (pumped, ()) = future::join(pump, convert).await;
    let parsed = parser
        .await
        .map_err(|e| kube::Error::Service(Box::new(e)))?;
    // A broken body also makes the parser fail (early end of input): the transport error is
    // the one that says what happened.
    pumped?;
    parsed
}

/// As kube's client: a 4xx/5xx response becomes `Error::Api` with the server's `Status` (in
/// JSON or protobuf, as the response says), or a `Status` made from the body's text when it
/// is not one (a proxy's error page).
pub async fn check_status(response: Response<Body>) -> kube::Result<Response<Body>> {
    let code = response.status();
    if !(code.is_client_error() || code.is_server_error()) {
        return Ok(response);
    }
    let is_protobuf = encoding::is_protobuf(response.headers());
    let mut body = response.into_body();
    let mut text = Vec::new();
    while let Some(frame) = next_frame(&mut body).await {
        if let Ok(data) = frame?.into_data() {
            text.extend_from_slice(&data);
        }
    }
    let decoded = if is_protobuf {
        protobuf::decode_status(&text).ok()
    } else {
        serde_json::from_slice::<kube::core::Status>(&text).ok()
    };
    let status = match decoded {
        Some(status) => status,
        None => {
            let text = String::from_utf8_lossy(&text);
            kube::core::Status::failure(text.trim(), "Failed to parse error data")
                .with_code(code.as_u16())
        }
    };
    Err(kube::Error::Api(status.boxed()))
}

/// The body's next frame (http-body's `frame()`, which lives in http-body-util).
pub async fn next_frame(body: &mut Body) -> Option<kube::Result<Frame<Bytes>>> {
    future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
}

/// `io::Read` over the body's chunks as the pump sends them (blocking: runs on the parser's
/// thread).
struct ChunkReader {
    chunks: mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl io::Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.current.is_empty() {
            match self.chunks.blocking_recv() {
                Some(chunk) => self.current = chunk,
                // The body ended.
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        self.current.advance(n);
        Ok(n)
    }
}

/// Parses one list object from `reader`, sending each item to `items`.
fn parse<K: DeserializeOwned>(
    reader: &mut impl io::Read,
    items: &mpsc::Sender<K>,
) -> serde_json::Result<ListMeta> {
    let mut deserializer = serde_json::Deserializer::from_reader(io::BufReader::new(reader));
    let metadata = ListSeed { items }.deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(metadata)
}

/// The list object: `metadata` kept, `items` streamed, anything else (`kind`, `apiVersion`)
/// skipped.
struct ListSeed<'a, K> {
    items: &'a mpsc::Sender<K>,
}

impl<'de, K: DeserializeOwned> DeserializeSeed<'de> for ListSeed<'_, K> {
    type Value = ListMeta;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<ListMeta, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, K: DeserializeOwned> de::Visitor<'de> for ListSeed<'_, K> {
    type Value = ListMeta;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a Kubernetes list object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ListMeta, A::Error> {
        let mut metadata = ListMeta::default();
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match &*key {
                "metadata" => metadata = map.next_value()?,
                "items" => map.next_value_seed(ItemsSeed { items: self.items })?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(metadata)
    }
}

/// `items`: an array (or `null`, which the API server writes for an empty list).
struct ItemsSeed<'a, K> {
    items: &'a mpsc::Sender<K>,
}

impl<'de, K: DeserializeOwned> DeserializeSeed<'de> for ItemsSeed<'_, K> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de, K: DeserializeOwned> de::Visitor<'de> for ItemsSeed<'_, K> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array of objects")
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(item) = seq.next_element::<K>()? {
            if self.items.blocking_send(item).is_err() {
                // Nobody takes the items any more (the list was given up).
                return Err(de::Error::custom("list abandoned"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
