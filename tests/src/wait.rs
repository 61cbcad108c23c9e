//! Bounded polling.

use std::collections::BTreeSet;
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

/// Waits until at least `n` connections are held: `sample` lists the connections there are
/// now, and one counts once two samples `interval` apart both have it, so that short-lived
/// ones (single attempts passing by) do not. Bounded by `timeout`.
pub fn wait_for_held(
    what: &str,
    n: usize,
    timeout: Duration,
    interval: Duration,
    mut sample: impl FnMut() -> Result<BTreeSet<String>>,
) -> Result<()> {
    let mut previous: Option<BTreeSet<String>> = None;
    let mut held = 0;
    try_wait_until(what, timeout, interval, || {
        let now = sample()?;
        held = previous
            .as_ref()
            .map_or(0, |before| now.intersection(before).count());
        previous = Some(now);
        Ok(held >= n)
    })
    .map_err(|e| match e {
        RigError::Timeout { what, waited, .. } => RigError::Timeout {
            what,
            waited,
            detail: format!("{held} of {n} held"),
        },
        other => other,
    })
}
