//! Limits applied to YAML text before serde_yaml parses it (manifests and the configuration
//! file).

/// Deepest flow nesting (`[`/`{`) accepted. libyaml checks every pending simple key on each
/// token, so its time grows with the square of the flow depth (8000 levels: about a second;
/// a 4 MiB file of `[`: hours). serde_yaml refuses more than 128 levels of any nesting anyway,
/// so nothing valid is lost by refusing deeper text before parsing it.
pub const MAX_FLOW_DEPTH: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "line {line}: flow collections ([...] or {{...}}) nested deeper than {MAX_FLOW_DEPTH} levels"
)]
pub struct TooDeep {
    pub line: usize,
}

/// A quick scan for flow nesting deeper than [`MAX_FLOW_DEPTH`], skipping quoted scalars and
/// comments. Brackets inside plain or block scalars are counted too, which can only make it
/// refuse text with more than 128 unclosed brackets in scalars.
pub fn check_flow_depth(text: &str) -> Result<(), TooDeep> {
    let mut depth = 0usize;
    let mut line = 1usize;
    let mut previous = b'\n';
    let mut bytes = text.bytes();
    while let Some(byte) = bytes.next() {
        let at_token_start = previous.is_ascii_whitespace() || b"[{,:-".contains(&previous);
        match byte {
            b'\n' => line += 1,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Err(TooDeep { line });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b'#' if previous.is_ascii_whitespace() => {
                for byte in bytes.by_ref() {
                    if byte == b'\n' {
                        line += 1;
                        break;
                    }
                }
            }
            b'\'' if at_token_start => {
                // '' inside is an escaped quote: it closes and reopens, same effect.
                for byte in bytes.by_ref() {
                    match byte {
                        b'\n' => line += 1,
                        b'\'' => break,
                        _ => {}
                    }
                }
            }
            b'"' if at_token_start => {
                let mut escaped = false;
                for byte in bytes.by_ref() {
                    match byte {
                        b'\n' => line += 1,
                        b'"' if !escaped => break,
                        _ => {}
                    }
                    escaped = byte == b'\\' && !escaped;
                }
            }
            _ => {}
        }
        previous = byte;
    }
    Ok(())
}
