//! A manifests file as YAML documents, each parsed on its own into a value tree
//! ([`proxy_model::yaml`]).
//!
//! The file is cut at its document markers first: a line starting with `---` or `...` ends any
//! document, even inside a block or quoted scalar (YAML 1.2 §9.1.4, `c-forbidden`), so the cut
//! is exact. A document then costs only itself, whatever is wrong with it: the next one is
//! parsed from a clean parser, and errors are numbered as a stream parser would number them.

/// One document of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Document<'a> {
    /// 1-based, counted as a stream parser counts: a document opened by `---` counts even when
    /// empty; text before the first `---` (or after a `...`) only when it has content.
    pub number: usize,
    /// The file's line (1-based) where the document's text starts.
    pub first_line: usize,
    pub text: &'a str,
}

/// Why a document was not read: not YAML (a syntax error, an alias to no anchor), or not a
/// value tree the proxy takes (a duplicate key, a non-string key, nesting or alias expansion
/// over the limits). The message names the file's line and column.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid YAML: {0}")]
pub struct DocumentError(String);

/// A line that is a document marker: `---` or `...`, then the end of the line or a blank.
fn is_marker(line: &str, marker: &str) -> bool {
    line.strip_prefix(marker)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r', '\n']))
}

/// Whether `text` has anything but blank lines, comments and directives.
fn has_content(text: &str) -> bool {
    text.lines().any(|line| {
        let trimmed = line.trim_start();
        !(trimmed.is_empty() || trimmed.starts_with('#') || line.starts_with('%'))
    })
}

/// The documents of `text`, in order.
pub fn split(text: &str) -> Vec<Document<'_>> {
    // Document candidates: (start, end, first line, opened by `---`).
    let mut pieces: Vec<(usize, usize, usize, bool)> = Vec::new();
    let mut start = 0;
    let mut first_line = 1;
    let mut explicit = false;
    let mut offset = 0;
    for (index, line) in text.split_inclusive('\n').enumerate() {
        let line_number = index + 1;
        if is_marker(line, "---") {
            // Text without content before a marker (comments, directives) stays with the
            // document the marker opens.
            if explicit || has_content(&text[start..offset]) {
                pieces.push((start, offset, first_line, explicit));
                start = offset;
                first_line = line_number;
            }
            explicit = true;
        } else if is_marker(line, "...") {
            let end = offset + line.len();
            pieces.push((start, end, first_line, explicit));
            start = end;
            first_line = line_number + 1;
            explicit = false;
        }
        offset += line.len();
    }
    pieces.push((start, text.len(), first_line, explicit));
    let mut documents = Vec::new();
    for (start, end, first_line, explicit) in pieces {
        let text = &text[start..end];
        if explicit || has_content(text) {
            documents.push(Document {
                number: documents.len() + 1,
                first_line,
                text,
            });
        }
    }
    documents
}

/// `apiVersion` and `kind` when the document shows them as plain top-level keys (`kind: X` at
/// the start of a line, once each): what to decode it into, without building its value tree.
/// Only a hint: a document it misleads fails to decode and is read through its value tree.
pub fn sniff_kind(text: &str) -> Option<(&str, &str)> {
    fn scalar(rest: &str) -> Option<&str> {
        let rest = rest.split(" #").next().unwrap_or_default().trim();
        let unquoted = rest
            .strip_prefix('"')
            .and_then(|r| r.strip_suffix('"'))
            .or_else(|| rest.strip_prefix('\'').and_then(|r| r.strip_suffix('\'')))
            .unwrap_or(rest);
        let plain = !unquoted.is_empty()
            && unquoted
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"./-".contains(&b));
        plain.then_some(unquoted)
    }
    let mut api_version = None;
    let mut kind = None;
    for line in text.lines() {
        let (slot, rest) = if let Some(rest) = line.strip_prefix("apiVersion:") {
            (&mut api_version, rest)
        } else if let Some(rest) = line.strip_prefix("kind:") {
            (&mut kind, rest)
        } else {
            continue;
        };
        if slot.replace(scalar(rest)?).is_some() {
            return None;
        }
    }
    Some((api_version?, kind?))
}

/// The document's value; `None` for an empty document (a trailing `---`, only comments).
pub fn parse(document: &Document<'_>) -> Result<Option<serde_json::Value>, DocumentError> {
    proxy_model::yaml::parse(document.text, document.first_line).map_err(DocumentError)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(text: &str) -> Vec<(usize, usize, &str)> {
        split(text)
            .into_iter()
            .map(|d| (d.number, d.first_line, d.text))
            .collect()
    }

    #[test]
    fn documents_are_cut_at_markers_and_numbered_like_a_stream_parser() {
        assert_eq!(numbered(""), vec![]);
        assert_eq!(numbered("a: 1\n"), vec![(1, 1, "a: 1\n")]);
        assert_eq!(
            numbered("# header\n---\na: 1\n---\nb: 2\n---\n"),
            vec![
                (1, 1, "# header\n---\na: 1\n"),
                (2, 4, "---\nb: 2\n"),
                (3, 6, "---\n")
            ]
        );
        assert_eq!(
            numbered("a: 1\n--- # c\nb: |\n  ---x\n----\n...\n# trailing\n"),
            vec![
                (1, 1, "a: 1\n"),
                (2, 2, "--- # c\nb: |\n  ---x\n----\n...\n")
            ]
        );
        assert_eq!(
            numbered("%YAML 1.2\n---\na: 1\n...\nb: 2\n"),
            vec![(1, 1, "%YAML 1.2\n---\na: 1\n...\n"), (2, 5, "b: 2\n")]
        );
    }

    #[test]
    fn a_broken_document_costs_only_itself_and_names_the_files_line() {
        let text = "a: 1\n---\nb: [1\n---\nc: 3\n";
        let results: Vec<_> = split(text).iter().map(parse).collect();
        assert_eq!(results.len(), 3);
        assert_eq!(results[0], Ok(Some(serde_json::json!({"a": 1}))));
        let Err(DocumentError(message)) = &results[1] else {
            panic!("{results:?}");
        };
        assert!(message.contains("line 3"), "{message}");
        assert_eq!(results[2], Ok(Some(serde_json::json!({"c": 3}))));
    }

    #[test]
    fn limits_aliases_and_duplicates_refuse_the_document() {
        let deep = format!("a: {}1{}\n", "[".repeat(200), "]".repeat(200));
        let duplicate = "spec:\n  clusterIP: a\n  clusterIP: b\n";
        let mut bomb = String::from("a: &a [x,x,x,x,x,x,x,x,x,x]\n");
        for (name, previous) in ["b", "c", "d", "e", "f", "g"]
            .iter()
            .zip(["a", "b", "c", "d", "e", "f"])
        {
            bomb.push_str(&format!(
                "{name}: &{name} [{}]\n",
                vec![format!("*{previous}"); 10].join(",")
            ));
        }
        for text in [deep.as_str(), duplicate, bomb.as_str()] {
            let document = split(text)[0];
            assert!(parse(&document).is_err(), "{text}");
        }
        let unknown = parse(&split("port: [1, *2]\n")[0]);
        assert!(
            matches!(&unknown, Err(DocumentError(m)) if m.contains("unknown value")),
            "{unknown:?}"
        );
    }

    #[test]
    fn the_kind_is_sniffed_only_from_plain_top_level_keys() {
        assert_eq!(
            sniff_kind("---\napiVersion: v1\nkind: Service # c\nmetadata: {}\n"),
            Some(("v1", "Service"))
        );
        assert_eq!(
            sniff_kind("apiVersion: \"discovery.k8s.io/v1\"\nkind: 'EndpointSlice'\n"),
            Some(("discovery.k8s.io/v1", "EndpointSlice"))
        );
        for text in [
            "{apiVersion: v1, kind: Service}\n",
            "apiVersion: v1\nkind: Service\nkind: Node\n",
            "apiVersion: v1\n  kind: Service\n",
            "apiVersion: v1\nkind: &k Service\n",
            "apiVersion: v1\n",
        ] {
            assert_eq!(sniff_kind(text), None, "{text:?}");
        }
    }

    #[test]
    fn scalars_read_as_yaml_1_2() {
        let value = parse(&split("a: yes\nb: 0755\nc: 1_000\nd: ~\n1: x\n")[0]);
        assert_eq!(
            value,
            Ok(Some(serde_json::json!({
                "a": "yes", "b": "0755", "c": "1_000", "d": null, "1": "x"
            })))
        );
    }
}
