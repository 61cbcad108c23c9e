//! The API server's protobuf encoding (`application/vnd.kubernetes.protobuf`), which kube-proxy
//! asks for by default (`clientConnection.contentType`).
//!
//! As upstream writes it (apimachinery's `runtime/serializer/protobuf`, the apiserver's watch
//! handler):
//! - an object or a list is the magic `k8s\0` followed by a `runtime.Unknown` whose `raw` is
//!   the message itself (`ServiceList`: `metadata` 1, `items` 2);
//! - a watch (`;stream=watch`) is a sequence of frames, each a 4-byte big-endian length and a
//!   bare `metav1.WatchEvent` whose `object.raw` is an object encoded as above.
//!
//! A list is read field by field from the body as it arrives, each item decoded and converted
//! on its own, so that, as with JSON (`list.rs`), no list is held whole.

mod convert;

use std::io::{self, Read};

use bytes::{Buf as _, Bytes, BytesMut};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use k8s_pb::apimachinery::pkg::{
    apis::meta::v1 as pb_meta,
    runtime::{TypeMeta, Unknown},
};
use kube_core::{
    Status, WatchEvent,
    watch::{Bookmark, BookmarkMeta},
};
use prost::Message as _;

pub use convert::FromMessage;

/// What precedes every protobuf-encoded object (apimachinery's `protoEncodingPrefix`).
const MAGIC: [u8; 4] = *b"k8s\0";
/// `runtime.Unknown`'s `raw` and a list's `items`.
const RAW_FIELD: u32 = 2;
const LIST_METADATA_FIELD: u32 = 1;
const LIST_ITEMS_FIELD: u32 = 2;
/// The largest watch frame taken (the apiserver's own limit for a request body is 3 MiB; an
/// object in etcd is at most 1.5 MiB): a corrupt length must not become an allocation.
const MAX_FRAME: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("protobuf: no `k8s\\0` magic prefix: not a protobuf-encoded object")]
    NoMagic,
    #[error("protobuf: reading the response: {0}")]
    Io(#[from] io::Error),
    #[error("protobuf: bad message: {0}")]
    Message(#[from] prost::DecodeError),
    #[error("protobuf: a varint longer than 10 bytes")]
    Varint,
    #[error("protobuf: bad field tag {0}")]
    Tag(u64),
    #[error("protobuf: the envelope holds no object (no `raw`)")]
    NoRaw,
    #[error("protobuf: a list without metadata")]
    NoListMetadata,
    #[error("protobuf: watch frame of {0} bytes (at most {MAX_FRAME})")]
    FrameTooLarge(usize),
    #[error("protobuf: the watch stream ended inside a frame")]
    TruncatedFrame,
    #[error("protobuf: watch event of unknown type {0:?}")]
    EventType(String),
    #[error("the list was given up")]
    Abandoned,
}

/// Reads a protobuf list from `reader` (the response body), handing each item converted to
/// `K` to `item`, which returns false when it takes no more (the list was given up). Returns
/// the list's metadata.
pub fn parse_list<K: FromMessage>(
    reader: &mut impl Read,
    mut item: impl FnMut(K) -> bool,
) -> Result<ListMeta, DecodeError> {
    let mut magic = [0; 4];
    reader.read_exact(&mut magic)?;
    if magic != MAGIC {
        return Err(DecodeError::NoMagic);
    }
    // The envelope runs to the end of the body.
    let mut metadata = None;
    while let Some((field, wire_type)) = next_tag(reader)? {
        if field == RAW_FIELD && wire_type == WireType::Len {
            let len = read_varint(reader)?;
            metadata = Some(parse_list_message(reader.by_ref().take(len), &mut item)?);
        } else {
            skip(reader, wire_type)?;
        }
    }
    metadata.ok_or(DecodeError::NoRaw)
}

/// The list message itself: `metadata` kept, each of `items` decoded and handed over.
fn parse_list_message<K: FromMessage>(
    mut list: impl Read,
    item: &mut impl FnMut(K) -> bool,
) -> Result<ListMeta, DecodeError> {
    let mut metadata = None;
    let mut buffer = Vec::new();
    while let Some((field, wire_type)) = next_tag(&mut list)? {
        match (field, wire_type) {
            (LIST_METADATA_FIELD, WireType::Len) => {
                read_len_delimited(&mut list, &mut buffer)?;
                metadata = Some(convert::list_meta(pb_meta::ListMeta::decode(&*buffer)?));
            }
            (LIST_ITEMS_FIELD, WireType::Len) => {
                read_len_delimited(&mut list, &mut buffer)?;
                if !item(K::from_message(K::Message::decode(&*buffer)?)) {
                    return Err(DecodeError::Abandoned);
                }
            }
            _ => skip(&mut list, wire_type)?,
        }
    }
    metadata.ok_or(DecodeError::NoListMetadata)
}

/// An object as the API server encodes one on its own (an error's `Status`, a watch event's
/// object): the magic, then a `runtime.Unknown`.
fn envelope(bytes: &[u8]) -> Result<Unknown, DecodeError> {
    let body = bytes.strip_prefix(&MAGIC).ok_or(DecodeError::NoMagic)?;
    Ok(Unknown::decode(body)?)
}

/// An error response's `Status`.
pub fn decode_status(bytes: &[u8]) -> Result<Status, DecodeError> {
    let raw = envelope(bytes)?.raw.ok_or(DecodeError::NoRaw)?;
    Ok(convert::status(pb_meta::Status::decode(&*raw)?))
}

/// Just the `metadata` (field 1 of every kind): what a BOOKMARK carries.
#[derive(Clone, PartialEq, prost::Message)]
struct MetadataOnly {
    #[prost(message, optional, tag = "1")]
    metadata: Option<pb_meta::ObjectMeta>,
}

/// One watch frame's event.
pub fn decode_watch_event<K: FromMessage>(frame: &[u8]) -> Result<WatchEvent<K>, DecodeError> {
    let event = pb_meta::WatchEvent::decode(frame)?;
    let raw = event
        .object
        .and_then(|object| object.raw)
        .unwrap_or_default();
    let object = envelope(&raw)?;
    let types = object.type_meta.unwrap_or_default();
    let raw = object.raw.ok_or(DecodeError::NoRaw)?;
    let kind = || Ok::<_, DecodeError>(K::from_message(K::Message::decode(&*raw)?));
    Ok(match event.r#type.as_deref().unwrap_or_default() {
        "ADDED" => WatchEvent::Added(kind()?),
        "MODIFIED" => WatchEvent::Modified(kind()?),
        "DELETED" => WatchEvent::Deleted(kind()?),
        "BOOKMARK" => WatchEvent::Bookmark(bookmark(types, &raw)?),
        "ERROR" => WatchEvent::Error(Box::new(convert::status(pb_meta::Status::decode(&*raw)?))),
        other => return Err(DecodeError::EventType(other.to_owned())),
    })
}

fn bookmark(types: TypeMeta, raw: &[u8]) -> Result<Bookmark, DecodeError> {
    let metadata = MetadataOnly::decode(raw)?.metadata.unwrap_or_default();
    Ok(Bookmark {
        types: kube_core::TypeMeta {
            api_version: types.api_version.unwrap_or_default(),
            kind: types.kind.unwrap_or_default(),
        },
        metadata: BookmarkMeta {
            resource_version: metadata.resource_version.unwrap_or_default(),
            annotations: metadata.annotations,
        },
    })
}

/// Splits a watch body into frames (apimachinery's `LengthDelimitedFrameReader`).
#[derive(Debug, Default)]
pub struct Frames {
    buffer: BytesMut,
}

impl Frames {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buffer.extend_from_slice(chunk);
    }

    /// The next whole frame, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Bytes>, DecodeError> {
        let Some(header) = self.buffer.first_chunk::<4>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*header) as usize;
        if len > MAX_FRAME {
            return Err(DecodeError::FrameTooLarge(len));
        }
        if self.buffer.len() < 4 + len {
            return Ok(None);
        }
        self.buffer.advance(4);
        Ok(Some(self.buffer.split_to(len).freeze()))
    }

    /// At the end of the body: a partial frame left is a broken stream.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.buffer.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::TruncatedFrame)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WireType {
    Varint,
    I64,
    Len,
    I32,
}

/// The next field's number and wire type; None at the end of the input.
fn next_tag(input: &mut impl Read) -> Result<Option<(u32, WireType)>, DecodeError> {
    let mut first = [0; 1];
    if input.read(&mut first)? == 0 {
        return Ok(None);
    }
    let tag = if first[0] & 0x80 == 0 {
        u64::from(first[0])
    } else {
        u64::from(first[0] & 0x7f) | (read_varint(input)? << 7)
    };
    let wire_type = match tag & 7 {
        0 => WireType::Varint,
        1 => WireType::I64,
        2 => WireType::Len,
        5 => WireType::I32,
        _ => return Err(DecodeError::Tag(tag)),
    };
    let field = u32::try_from(tag >> 3).map_err(|_| DecodeError::Tag(tag))?;
    if field == 0 {
        return Err(DecodeError::Tag(tag));
    }
    Ok(Some((field, wire_type)))
}

fn read_varint(input: &mut impl Read) -> Result<u64, DecodeError> {
    let mut value = 0_u64;
    for shift in (0..64).step_by(7) {
        let mut byte = [0; 1];
        input.read_exact(&mut byte)?;
        value |= u64::from(byte[0] & 0x7f) << shift;
        if byte[0] & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(DecodeError::Varint)
}

/// A length-delimited field's bytes into `buffer` (which grows as they arrive: a corrupt
/// length cannot allocate more than the body holds).
fn read_len_delimited(input: &mut impl Read, buffer: &mut Vec<u8>) -> Result<(), DecodeError> {
    let len = read_varint(input)?;
    buffer.clear();
    let read = input.by_ref().take(len).read_to_end(buffer)?;
    if read as u64 != len {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    Ok(())
}

fn skip(input: &mut impl Read, wire_type: WireType) -> Result<(), DecodeError> {
    let len = match wire_type {
        WireType::Varint => {
            read_varint(input)?;
            return Ok(());
        }
        WireType::I64 => 8,
        WireType::I32 => 4,
        WireType::Len => read_varint(input)?,
    };
    let skipped = io::copy(&mut input.by_ref().take(len), &mut io::sink())?;
    if skipped != len {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    Ok(())
}

/// Every decoder here over `bytes`: as a list body of each kind, as a watch stream of each
/// kind, as an error `Status` (the fuzz target `api_protobuf`).
pub fn decode_everything(bytes: &[u8]) {
    use k8s_openapi::api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    };
    let _ = parse_list::<Service>(&mut &*bytes, |_| true);
    let _ = parse_list::<EndpointSlice>(&mut &*bytes, |_| true);
    let _ = parse_list::<Node>(&mut &*bytes, |_| true);
    let _ = decode_status(bytes);
    let mut frames = Frames::default();
    frames.push(bytes);
    while let Ok(Some(frame)) = frames.next_frame() {
        let _ = decode_watch_event::<Service>(&frame);
        let _ = decode_watch_event::<EndpointSlice>(&frame);
        let _ = decode_watch_event::<Node>(&frame);
    }
    let _ = frames.finish();
}

#[cfg(test)]
mod tests;
