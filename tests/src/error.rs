//! Error type of the rig library.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while building or driving the rig.
#[derive(Debug, thiserror::Error)]
pub enum RigError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{context}: {source}")]
    Nix {
        context: String,
        #[source]
        source: nix::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("timed out after {waited:?} waiting for {what}{detail}")]
    Timeout {
        what: String,
        waited: Duration,
        /// Extra diagnostics (already formatted, may be empty), e.g. a log tail.
        detail: String,
    },
    #[error("cannot parse {what}: {line:?}")]
    Parse { what: &'static str, line: String },
    #[error("binary {} not found: {hint}", path.display())]
    MissingBinary { path: PathBuf, hint: &'static str },
    #[error("{message}\n--- proxy-agent log (tail) ---\n{log_tail}\n--- end of log ---")]
    Agent { message: String, log_tail: String },
    #[error("{0}")]
    Other(String),
}

impl RigError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn nix(context: impl Into<String>, source: nix::Error) -> Self {
        Self::Nix {
            context: context.into(),
            source,
        }
    }
}
