//! Bounded polling.

use std::thread;
use std::time::{Duration, Instant};

use crate::{Result, RigError};

/// Polls `cond` every `interval` until it returns true, for at most `timeout`
/// (at least one poll is always made).
pub fn wait_until(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut cond: impl FnMut() -> bool,
) -> Result<()> {
    try_wait_until(what, timeout, interval, || Ok(cond()))
}

/// Like [`wait_until`], but `cond` may fail, which aborts the wait with its error.
pub fn try_wait_until(
    what: &str,
    timeout: Duration,
    interval: Duration,
    mut cond: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let start = Instant::now();
    loop {
        if cond()? {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(RigError::Timeout {
                what: what.to_owned(),
                waited: timeout,
                detail: String::new(),
            });
        }
        thread::sleep(interval);
    }
}
