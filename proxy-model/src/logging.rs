//! klog's verbosity at run time: `PUT /debug/flags/v` on the metrics server (with
//! `--profiling`, as upstream) changes the log filter the binary installed.

use std::sync::{
    OnceLock,
    atomic::{AtomicI32, Ordering},
};

use tracing_subscriber::{EnvFilter, filter::LevelFilter};

type Reload = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>;

static RELOAD: OnceLock<Reload> = OnceLock::new();
static VERBOSITY: AtomicI32 = AtomicI32::new(0);

/// klog verbosity → tracing: 0-1 info (klog's default and "steady state" levels), 2-3 debug
/// (klog's "extended info" and "debug"), 4 and above trace.
pub fn level(verbosity: i64) -> LevelFilter {
    match verbosity {
        ..=1 => LevelFilter::INFO,
        2 | 3 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// Called once by the binary with how to replace its filter.
pub fn install(
    verbosity: u32,
    reload: impl Fn(EnvFilter) -> Result<(), String> + Send + Sync + 'static,
) {
    VERBOSITY.store(
        i32::try_from(verbosity).unwrap_or(i32::MAX),
        Ordering::Relaxed,
    );
    // A second install (tests) keeps the first.
    let _ = RELOAD.set(Box::new(reload));
}

/// The verbosity in effect.
pub fn verbosity() -> i32 {
    VERBOSITY.load(Ordering::Relaxed)
}

/// component-base's `GlogSetter`: klog's `Level.Set` parses the text as a base-10 int32
/// (`strconv.ParseInt(value, 10, 32)`), untrimmed. Returns the answer's text.
pub fn set_verbosity(text: &str) -> Result<String, String> {
    let parsed: i32 = text.parse().map_err(|error: std::num::ParseIntError| {
        let reason = match error.kind() {
            std::num::IntErrorKind::PosOverflow | std::num::IntErrorKind::NegOverflow => {
                "value out of range"
            }
            _ => "invalid syntax",
        };
        format!(
            "failed set klog.logging.verbosity {text}: strconv.ParseInt: parsing {text:?}: {reason}"
        )
    })?;
    if let Some(reload) = RELOAD.get() {
        reload(EnvFilter::new(level(i64::from(parsed)).to_string()))
            .map_err(|error| format!("failed set klog.logging.verbosity {text}: {error}"))?;
    }
    VERBOSITY.store(parsed, Ordering::Relaxed);
    Ok(format!("successfully set klog.logging.verbosity to {text}"))
}
