//! When to sync: kube-proxy's BoundedFrequencyRunner (pkg/util/async) as a small state machine.
//!
//! - Changes are coalesced: however many arrive while a sync is not allowed yet, one sync
//!   follows.
//! - Syncs are rate limited by a token bucket: `burst` syncs may run back to back, after that
//!   at most one per `min_interval` (kube-proxy: `--iptables-min-sync-period`, burst 2).
//! - A sync runs at least every `max_interval` even without changes (kube-proxy:
//!   `--iptables-sync-period`), which is when dataplanes do a full resync.
//! - A failed sync asks for a retry after a delay.
//!
//! The agent's loop runs syncs inline, so a sync never overlaps another.

use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerConfig {
    pub min_interval: Duration,
    pub max_interval: Duration,
    pub burst: u32,
}

impl RunnerConfig {
    /// kube-proxy's defaults: min 1 s, max 30 s, burst 2.
    pub const KUBE_PROXY_DEFAULT: RunnerConfig = RunnerConfig {
        min_interval: Duration::from_secs(1),
        max_interval: Duration::from_secs(30),
        burst: 2,
    };
}

/// Why a sync runs now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncReason {
    /// Something changed (or a retry was due).
    Changes,
    /// `max_interval` passed without a sync: resync everything.
    Periodic,
}

#[derive(Debug)]
pub struct SyncRunner {
    config: RunnerConfig,
    /// Token bucket credit in time units: one token is worth `min_interval`; the bucket holds
    /// `burst` tokens. Integer nanoseconds keep the arithmetic exact.
    credit: Duration,
    refilled_at: Instant,
    last_run: Instant,
    pending: bool,
    retry_at: Option<Instant>,
}

impl SyncRunner {
    pub fn new(config: RunnerConfig, now: Instant) -> Self {
        Self {
            config,
            credit: config.min_interval * config.burst.max(1),
            refilled_at: now,
            last_run: now,
            pending: false,
            retry_at: None,
        }
    }

    /// Something changed: a sync should follow as soon as the rate limit allows.
    pub fn request(&mut self) {
        self.pending = true;
    }

    /// The last sync failed: try again after `delay` (or earlier if a change arrives and the
    /// rate limit allows).
    pub fn retry_after(&mut self, delay: Duration, now: Instant) {
        let at = now + delay;
        self.retry_at = Some(self.retry_at.map_or(at, |current| current.min(at)));
    }

    pub fn is_pending(&self) -> bool {
        self.pending
    }

    fn capacity(&self) -> Duration {
        self.config.min_interval * self.config.burst.max(1)
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled_at);
        self.credit = (self.credit + elapsed).min(self.capacity());
        self.refilled_at = now;
    }

    fn has_token(&self) -> bool {
        self.credit >= self.config.min_interval
    }

    /// When the next token is available (now if one is).
    fn token_at(&self, now: Instant) -> Instant {
        now + self.config.min_interval.saturating_sub(self.credit)
    }

    /// The instant the loop should wake up at to check [`SyncRunner::due`] again.
    pub fn next_wakeup(&mut self, now: Instant) -> Instant {
        self.refill(now);
        let periodic = self.last_run + self.config.max_interval;
        let mut wake = periodic;
        if self.pending {
            wake = wake.min(self.token_at(now));
        }
        if let Some(retry) = self.retry_at {
            wake = wake.min(retry.max(self.token_at(now)));
        }
        wake.max(now)
    }

    /// Whether a sync should run now, and why; consumes a token when it says yes.
    pub fn due(&mut self, now: Instant) -> Option<SyncReason> {
        self.refill(now);
        let periodic = now >= self.last_run + self.config.max_interval;
        let retry = self.retry_at.is_some_and(|at| now >= at);
        let wanted = self.pending || retry;
        let reason = if periodic {
            SyncReason::Periodic
        } else if wanted && self.has_token() {
            SyncReason::Changes
        } else {
            return None;
        };
        // The periodic sync is not rate limited (it is at most one per max_interval anyway),
        // but it still spends a token if there is one.
        self.credit = self.credit.saturating_sub(self.config.min_interval);
        self.pending = false;
        self.retry_at = None;
        self.last_run = now;
        Some(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: RunnerConfig = RunnerConfig {
        min_interval: Duration::from_secs(1),
        max_interval: Duration::from_secs(30),
        burst: 2,
    };

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn nothing_runs_without_a_request_until_the_max_interval() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(CONFIG, start);
        assert_eq!(runner.due(start + ms(29_999)), None);
        assert_eq!(runner.next_wakeup(start), start + CONFIG.max_interval);
        assert_eq!(runner.due(start + ms(30_000)), Some(SyncReason::Periodic));
        // The periodic timer restarts from the last sync.
        assert_eq!(runner.due(start + ms(30_001)), None);
        assert_eq!(runner.next_wakeup(start + ms(30_001)), start + ms(60_000));
    }

    #[test]
    fn a_burst_of_two_runs_at_once_then_one_per_min_interval() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(CONFIG, start);
        let mut runs = Vec::new();
        // A change every 100 ms for 3 s; the loop wakes up when told to.
        let mut now = start;
        let end = start + ms(3_000);
        while now < end {
            runner.request();
            if runner.due(now).is_some() {
                runs.push(now.duration_since(start).as_millis());
            }
            now += ms(100);
        }
        assert_eq!(runs, [0, 100, 1000, 2000]);
    }

    #[test]
    fn changes_while_rate_limited_coalesce_into_one_sync_at_the_next_token() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(CONFIG, start);
        runner.request();
        assert!(runner.due(start).is_some());
        runner.request();
        assert!(runner.due(start).is_some());
        // Bucket empty: three more changes arrive.
        for _ in 0..3 {
            runner.request();
        }
        assert_eq!(runner.due(start + ms(10)), None);
        let wake = runner.next_wakeup(start + ms(10));
        assert_eq!(wake, start + ms(1_000));
        assert_eq!(runner.due(wake), Some(SyncReason::Changes));
        assert!(!runner.is_pending(), "one sync covered all three");
        assert_eq!(runner.due(wake + ms(1)), None);
    }

    #[test]
    fn a_failed_sync_is_retried_after_the_delay() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(CONFIG, start);
        runner.request();
        assert!(runner.due(start).is_some());
        runner.retry_after(ms(5_000), start);
        assert_eq!(runner.next_wakeup(start), start + ms(5_000));
        assert_eq!(runner.due(start + ms(4_999)), None);
        assert_eq!(runner.due(start + ms(5_000)), Some(SyncReason::Changes));
    }

    #[test]
    fn zero_min_interval_never_limits() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(
            RunnerConfig {
                min_interval: Duration::ZERO,
                ..CONFIG
            },
            start,
        );
        for _ in 0..10 {
            runner.request();
            assert_eq!(runner.due(start), Some(SyncReason::Changes));
        }
    }
}
