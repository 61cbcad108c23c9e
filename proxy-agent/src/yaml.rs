//! Reading YAML (manifest documents and the configuration file) into JSON value trees, what the
//! API server stores and what `k8s-openapi`'s types decode from, with serde-saphyr: pure Rust,
//! no panics on malformed input, and budgets that refuse deep nesting and alias bombs before
//! the value tree fills memory. Decoding the tree into a type goes through
//! `serde_path_to_error`, so an error names the field (`spec.ports[0].port`).

use serde_saphyr::{Options, SnippetMode};

/// Nesting depth accepted: far above any Kubernetes object or configuration, and low enough
/// for the recursion of a debug build on a 2 MiB thread stack (about 20 KiB per level).
pub const MAX_DEPTH: usize = 64;
/// YAML nodes in one document, counting those an alias replays: a 4 MiB manifest file has a
/// few hundred thousand.
pub const MAX_NODES: usize = 1_000_000;
/// Events replayed from aliases in one document (Kubernetes manifests rarely use any).
pub const MAX_REPLAYED_EVENTS: usize = 100_000;

fn options() -> Options {
    serde_saphyr::options! {
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

/// The single document in `text` as a value tree; `None` when it is empty (only comments).
/// `first_line` is the line of the file where `text` starts: messages name the file's lines.
pub fn parse(text: &str, first_line: usize) -> Result<Option<serde_json::Value>, String> {
    serde_saphyr::from_str_with_options::<Option<serde_json::Value>>(text, options()).map_err(
        |error| {
            error.render_with_options(serde_saphyr::render_options! {
                // Worded for the person who wrote the file, not for the program reading it.
                formatter: &serde_saphyr::UserMessageFormatter,
                line_offset: first_line.saturating_sub(1) as u64,
                snippets: SnippetMode::Off,
            })
        },
    )
}

/// Decodes `value` into `T`; the error names the field's path.
pub fn decode<T: serde::de::DeserializeOwned>(
    value: &serde_json::Value,
) -> Result<T, serde_path_to_error::Error<serde_json::Error>> {
    serde_path_to_error::deserialize(value)
}
