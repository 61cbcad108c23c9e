//! `clientConnection.contentType`/`acceptContentTypes`: what the agent asks the API server for,
//! and how a response says what it is.
//!
//! As client-go (`rest.NewRequest`): `Accept` is `acceptContentTypes` when set, else
//! `<contentType>, */*`. A response is read by its own `Content-Type`, so a server (or a
//! proxy in front of it) that answers JSON to a protobuf request is still understood.

use http::{HeaderMap, HeaderValue, header};

pub const JSON: &str = "application/json";
/// The API server's protobuf media type (`source::kubernetes::protobuf` decodes it).
pub const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

#[derive(Debug, thiserror::Error)]
pub enum EncodingError {
    #[error(
        "clientConnection.contentType {0:?}: not {JSON} or {media}",
        media = PROTOBUF
    )]
    ContentType(String),
    #[error("clientConnection.acceptContentTypes {0:?}: not a valid Accept header")]
    Accept(String),
}

/// The `Accept` header of every list and watch.
#[derive(Debug, Clone)]
pub struct Encoding {
    accept: HeaderValue,
    protobuf: bool,
}

impl Encoding {
    pub fn new(content_type: &str, accept_content_types: &str) -> Result<Self, EncodingError> {
        let media = media_type(content_type);
        if media != JSON && media != PROTOBUF {
            return Err(EncodingError::ContentType(content_type.to_owned()));
        }
        let accept = if accept_content_types.is_empty() {
            format!("{content_type}, */*")
        } else {
            accept_content_types.to_owned()
        };
        let protobuf = accept.contains(PROTOBUF);
        let accept = HeaderValue::from_str(&accept)
            .map_err(|_| EncodingError::Accept(accept_content_types.to_owned()))?;
        Ok(Self { accept, protobuf })
    }

    pub fn accept(&self) -> &HeaderValue {
        &self.accept
    }

    /// Whether the agent asks for protobuf at all (else kube-rs's JSON watch is used as is).
    pub fn asks_for_protobuf(&self) -> bool {
        self.protobuf
    }
}

impl Default for Encoding {
    /// kube-proxy's default (`application/vnd.kubernetes.protobuf`).
    fn default() -> Self {
        Self {
            accept: HeaderValue::from_static("application/vnd.kubernetes.protobuf, */*"),
            protobuf: true,
        }
    }
}

/// Whether a response is protobuf (`application/vnd.kubernetes.protobuf`, with or without
/// `;stream=watch`); anything else is read as JSON, as before.
pub fn is_protobuf(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| media_type(value).eq_ignore_ascii_case(PROTOBUF))
}

/// A media type without its parameters.
fn media_type(value: &str) -> &str {
    value.split(';').next().unwrap_or_default().trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_is_client_gos() {
        let protobuf = Encoding::new("application/vnd.kubernetes.protobuf", "").unwrap();
        assert_eq!(
            protobuf.accept(),
            "application/vnd.kubernetes.protobuf, */*"
        );
        assert!(protobuf.asks_for_protobuf());
        let json = Encoding::new("application/json", "").unwrap();
        assert_eq!(json.accept(), "application/json, */*");
        assert!(!json.asks_for_protobuf());
        let both = Encoding::new(
            "application/json",
            "application/vnd.kubernetes.protobuf,application/json",
        )
        .unwrap();
        assert_eq!(
            both.accept(),
            "application/vnd.kubernetes.protobuf,application/json"
        );
        assert!(both.asks_for_protobuf());
        assert_eq!(
            Encoding::default().accept(),
            Encoding::new(PROTOBUF, "").unwrap().accept()
        );
    }

    #[test]
    fn a_bad_setting_names_its_field() {
        let error = Encoding::new("application/yaml", "").unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("clientConnection.contentType \"application/yaml\""),
            "{error}"
        );
        let error = Encoding::new(JSON, "application/json\n").unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("clientConnection.acceptContentTypes"),
            "{error}"
        );
    }

    #[test]
    fn responses_are_read_by_their_content_type() {
        let mut headers = HeaderMap::new();
        assert!(!is_protobuf(&headers));
        for (value, protobuf) in [
            ("application/vnd.kubernetes.protobuf", true),
            ("application/vnd.kubernetes.protobuf;stream=watch", true),
            ("application/json", false),
            ("application/json;stream=watch", false),
        ] {
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(value));
            assert_eq!(is_protobuf(&headers), protobuf, "{value}");
        }
    }
}
