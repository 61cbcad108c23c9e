//! Reading YAML (manifest documents and the configuration file) into JSON value trees, what the
//! API server stores and what `k8s-openapi`'s types decode from, with serde-saphyr: pure Rust,
//! no panics on malformed input, and budgets that refuse deep nesting and alias bombs before
//! the value tree fills memory. Decoding into a type goes through `serde_path_to_error`, so an
//! error names the field (`spec.ports[0].port`), and `serde_ignored`, which names the fields
//! the type does not have.

use serde_saphyr::{Options, SnippetMode};

/// Nesting depth accepted: far above any Kubernetes object or configuration, and low enough
/// for the recursion of a debug build on a 2 MiB thread stack (about 20 KiB per level).
pub const MAX_DEPTH: usize = 64;
/// YAML nodes in one document, counting those an alias replays: a 4 MiB manifest file has a
/// few hundred thousand.
pub const MAX_NODES: usize = 1_000_000;
/// Events replayed from aliases in one document (Kubernetes manifests rarely use any).
pub const MAX_REPLAYED_EVENTS: usize = 100_000;

/// `typed`: decoding straight into a type. Then a plain `1` or `true` is refused where the type
/// wants a string, as in a value tree it is a number or a boolean (and as upstream's YAML →
/// JSON conversion makes it), so both paths read scalars alike.
fn options(typed: bool) -> Options {
    serde_saphyr::options! {
        no_schema: typed,
        // One-line messages, for the log.
        with_snippet: false,
        // YAML 1.2 scalars, as serde_yaml read them: `yes`, `0755` and `1_000` stay strings.
        strict_booleans: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: MAX_REPLAYED_EVENTS,
        },
        budget: serde_saphyr::budget! {
            max_depth: MAX_DEPTH,
            max_nodes: MAX_NODES,
        },
    }
}

fn render(error: &serde_saphyr::Error, first_line: usize) -> String {
    error.render_with_options(serde_saphyr::render_options! {
        // Worded for the person who wrote the file, not for the program reading it.
        formatter: &serde_saphyr::UserMessageFormatter,
        line_offset: first_line.saturating_sub(1) as u64,
        snippets: SnippetMode::Off,
    })
}

/// The single document in `text` as a value tree; `None` when it is empty (only comments).
/// `first_line` is the line of the file where `text` starts: messages name the file's lines.
pub fn parse(text: &str, first_line: usize) -> Result<Option<serde_json::Value>, String> {
    serde_saphyr::from_str_with_options::<Option<serde_json::Value>>(text, options(false))
        .map_err(|error| render(&error, first_line))
}

/// Where an ignored field is, as a path (`spec.ports[1].bogus`).
fn field_path(path: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", field_path(parent)),
        Path::Map { parent, key } => match field_path(parent) {
            parent if parent.is_empty() => key.clone(),
            parent => format!("{parent}.{key}"),
        },
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => field_path(parent),
    }
}

/// The text of the scalar a decoding error is about (a short one only: it goes in a message).
fn scalar_at<'a>(error: &serde_saphyr::Error, text: &'a str) -> Option<&'a str> {
    if !matches!(error, serde_saphyr::Error::InvalidScalar { .. }) {
        return None;
    }
    let span = error.location()?.span();
    let start = usize::try_from(span.byte_offset()?).ok()?;
    let len = usize::try_from(span.byte_len()?).ok()?;
    text.get(start..start.checked_add(len)?)
        .filter(|value| value.len() <= 64)
}

/// An object and the fields of its input it does not have (the API server's unknown fields).
#[derive(Debug)]
pub struct Decoded<T> {
    pub object: T,
    pub unknown_fields: Vec<String>,
}

/// The single document in `text` decoded straight into `T`, without a value tree (the fast
/// path for a document whose kind is known from its text). The error names the field.
pub fn decode_str<T: serde::de::DeserializeOwned>(
    text: &str,
    first_line: usize,
) -> Result<Decoded<T>, String> {
    // Without the path tracking first: the documents that decode (nearly all) do not pay for
    // it; one that does not is decoded again with it, for the message.
    let mut unknown_fields = Vec::new();
    let decoded =
        serde_saphyr::with_deserializer_from_str_with_options(text, options(true), |de| {
            let mut ignored =
                |path: serde_ignored::Path<'_>| unknown_fields.push(field_path(&path));
            T::deserialize(serde_ignored::Deserializer::new(de, &mut ignored))
        });
    if let Ok(object) = decoded {
        return Ok(Decoded {
            object,
            unknown_fields,
        });
    }
    decode_str_tracking_paths(text, first_line)
}

/// [`decode_str`] with the path of the field an error is about.
fn decode_str_tracking_paths<T: serde::de::DeserializeOwned>(
    text: &str,
    first_line: usize,
) -> Result<Decoded<T>, String> {
    let mut unknown_fields = Vec::new();
    let mut path_error = None;
    let decoded =
        serde_saphyr::with_deserializer_from_str_with_options(text, options(true), |de| {
            let mut ignored =
                |path: serde_ignored::Path<'_>| unknown_fields.push(field_path(&path));
            let de = serde_ignored::Deserializer::new(de, &mut ignored);
            serde_path_to_error::deserialize(de).map_err(|error| {
                let path = error.path().to_string();
                let error = error.into_inner();
                // Kept here: the parser may replace the error with its own on the way out.
                let mut message = render(&error, first_line);
                // "invalid i32 at line 6, column 30" does not say what was there: quote it.
                if let Some(value) = scalar_at(&error, text) {
                    message = format!("{message} (value {value:?})");
                }
                path_error = Some(match path.as_str() {
                    "." => message,
                    path => format!("{path}: {message}"),
                });
                error
            })
        });
    match decoded {
        Ok(object) => Ok(Decoded {
            object,
            unknown_fields,
        }),
        Err(error) => Err(path_error.unwrap_or_else(|| render(&error, first_line))),
    }
}

/// Decodes a value tree into `T`; the error names the field.
pub fn decode_value<T: serde::de::DeserializeOwned>(
    value: &serde_json::Value,
) -> Result<Decoded<T>, String> {
    let mut unknown_fields = Vec::new();
    let mut ignored = |path: serde_ignored::Path<'_>| unknown_fields.push(field_path(&path));
    let de = serde_ignored::Deserializer::new(value, &mut ignored);
    let object = serde_path_to_error::deserialize(de).map_err(|error| error.to_string())?;
    Ok(Decoded {
        object,
        unknown_fields,
    })
}

/// Decodes `value` into `T`; the error names the field's path.
pub fn decode<T: serde::de::DeserializeOwned>(
    value: &serde_json::Value,
) -> Result<T, serde_path_to_error::Error<serde_json::Error>> {
    serde_path_to_error::deserialize(value)
}
