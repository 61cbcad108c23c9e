//! Limits applied to YAML text before serde_yaml parses it (manifests and the configuration
//! file).

/// Deepest flow nesting (`[`/`{`) accepted. libyaml checks every pending simple key on each
/// token, so its time grows with the square of the flow depth (8000 levels: about a second;
/// a 4 MiB file of `[`: hours). serde_yaml refuses more than 128 levels of any nesting anyway,
/// so nothing valid is lost by refusing deeper text before parsing it.
pub const MAX_FLOW_DEPTH: usize = 128;

/// What the scan of the text refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    #[error(
        "line {line}: flow collections ([...] or {{...}}) nested deeper than {MAX_FLOW_DEPTH} levels"
    )]
    TooDeep { line: usize },
    /// serde_yaml 0.9 (final, deprecated) panics on some documents with an alias to an
    /// undefined anchor (found by the manifests fuzz target: `port: [1, *2]` in a flow
    /// mapping); the panic would cost the file anyway, so the text is refused up front with
    /// a message that says what is wrong.
    #[error(
        "line {line}: alias `*{name}` refers to no anchor `&{name}` defined before it in the document"
    )]
    UnknownAlias { line: usize, name: String },
}

/// Characters that end an anchor or alias name (YAML 1.2: whitespace and flow indicators).
fn ends_name(byte: u8) -> bool {
    byte.is_ascii_whitespace() || b",[]{}".contains(&byte)
}

/// A quick scan, skipping quoted scalars and comments, for flow nesting deeper than
/// [`MAX_FLOW_DEPTH`] and for aliases without an earlier anchor in their document.
/// Brackets inside plain or block scalars are counted too, which can only make it refuse text
/// with more than 128 unclosed brackets in scalars; likewise a block-scalar line starting with
/// `*name` reads as an alias (a plain scalar cannot start with `*`).
pub fn check_text(text: &str) -> Result<(), TextError> {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut line = 1usize;
    let mut anchors: Vec<&[u8]> = Vec::new();
    let mut previous = b'\n';
    let mut i = 0;
    let name_at = |start: usize| {
        let end = bytes[start..]
            .iter()
            .position(|&b| ends_name(b))
            .map_or(bytes.len(), |n| start + n);
        &bytes[start..end]
    };
    while let Some(&byte) = bytes.get(i) {
        let at_token_start = previous.is_ascii_whitespace() || b"[{,:-".contains(&previous);
        i += 1;
        match byte {
            b'\n' => {
                line += 1;
                if bytes[i..].starts_with(b"---") {
                    anchors.clear(); // anchors are per document
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Err(TextError::TooDeep { line });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b'&' if at_token_start => anchors.push(name_at(i)),
            b'*' if at_token_start => {
                let name = name_at(i);
                if !name.is_empty() && !anchors.contains(&name) {
                    return Err(TextError::UnknownAlias {
                        line,
                        name: String::from_utf8_lossy(name).into_owned(),
                    });
                }
            }
            b'#' if previous.is_ascii_whitespace() => {
                while let Some(&b) = bytes.get(i) {
                    if b == b'\n' {
                        break; // the newline itself is handled above
                    }
                    i += 1;
                }
            }
            b'\'' if at_token_start => {
                // '' inside is an escaped quote: it closes and reopens, same effect.
                while let Some(&b) = bytes.get(i) {
                    i += 1;
                    match b {
                        b'\n' => line += 1,
                        b'\'' => break,
                        _ => {}
                    }
                }
            }
            b'"' if at_token_start => {
                let mut escaped = false;
                while let Some(&b) = bytes.get(i) {
                    i += 1;
                    match b {
                        b'\n' => line += 1,
                        b'"' if !escaped => break,
                        _ => {}
                    }
                    escaped = b == b'\\' && !escaped;
                }
            }
            _ => {}
        }
        previous = bytes.get(i.wrapping_sub(1)).copied().unwrap_or(byte);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_need_an_earlier_anchor_in_their_document() {
        assert_eq!(check_text("a: &x 1\nb: *x\n"), Ok(()));
        assert_eq!(check_text("a: [1, &p 2, *p]\n"), Ok(()));
        assert_eq!(
            check_text("spec:\n  ports: [{port: [1, *2]}]\n"),
            Err(TextError::UnknownAlias {
                line: 2,
                name: "2".into()
            })
        );
        // Anchors do not cross documents.
        assert!(matches!(
            check_text("a: &x 1\n---\nb: *x\n"),
            Err(TextError::UnknownAlias { line: 3, .. })
        ));
        // Not aliases: inside quotes, comments, words, a lone `*`.
        assert_eq!(
            check_text("a: '*x'\nb: \"*y\" # *z\nc: a*b\nd: [ * ]\n"),
            Ok(())
        );
    }

    #[test]
    fn deep_flow_nesting_is_refused_with_its_line() {
        let deep = format!("a:\n  {}", "[".repeat(MAX_FLOW_DEPTH + 1));
        assert_eq!(check_text(&deep), Err(TextError::TooDeep { line: 2 }));
        assert_eq!(check_text(&"[".repeat(MAX_FLOW_DEPTH)), Ok(()));
    }
}
