//! When to sync: kube-proxy's current BoundedFrequencyRunner (pkg/proxy/runner, which replaced
//! pkg/util/async's token-bucket runner in 1.33) as a small state machine.
//!
//! - Changes are coalesced: however many arrive while a sync is not allowed yet, one sync
//!   follows.
//! - No burst: at least `min_interval` passes between the *end* of one sync and the *start* of
//!   the next (kube-proxy: `--iptables-min-sync-period`).
//! - A sync runs at least every `max_interval` after the end of the previous one even without
//!   changes (kube-proxy's iptables mode: an hour, `proxyutil.FullSyncPeriod`; the canary
//!   monitor covers `--iptables-sync-period`).
//! - A failed sync is retried `retry_interval` after it ended (kube-proxy: the sync period),
//!   unless something else runs one sooner; a successful sync cancels the retry.
//!
//! The agent's loop runs syncs inline, so a sync never overlaps another. eBPF's periodic sync
//! is the exception to "inline": its full pass runs in steps between the loop's other work, and
//! the syncs for changes meanwhile run between them (they write the maps from the same loop,
//! so still never at the same time); the pass reports with [`SyncRunner::pass_finished`].

use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerConfig {
    pub min_interval: Duration,
    pub max_interval: Duration,
    pub retry_interval: Duration,
}

impl RunnerConfig {
    /// kube-proxy's iptables mode with default settings (proxier.go:
    /// `NewBoundedFrequencyRunner("sync-runner", …, minSyncPeriod, syncPeriod,
    /// proxyutil.FullSyncPeriod)`): min 1 s, retry 30 s, max 1 h.
    pub const KUBE_PROXY_DEFAULT: RunnerConfig = RunnerConfig {
        min_interval: Duration::from_secs(1),
        max_interval: Duration::from_secs(3600),
        retry_interval: Duration::from_secs(30),
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
    /// No sync starts before this (the end of the last sync + `min_interval`).
    cooldown_until: Instant,
    /// The periodic sync is due at this instant (the end of the last sync + `max_interval`).
    periodic_at: Instant,
    pending: bool,
    retry_at: Option<Instant>,
}

impl SyncRunner {
    /// As upstream's Loop: the first sync may start at once; the periodic timer starts now.
    pub fn new(config: RunnerConfig, now: Instant) -> Self {
        Self {
            config,
            cooldown_until: now,
            periodic_at: now + config.max_interval,
            pending: false,
            retry_at: None,
        }
    }

    /// Something changed: a sync should follow as soon as the minimum interval allows.
    pub fn request(&mut self) {
        self.pending = true;
    }

    pub fn is_pending(&self) -> bool {
        self.pending
    }

    /// The instant the loop should wake up at to check [`SyncRunner::due`] again.
    pub fn next_wakeup(&self, now: Instant) -> Instant {
        let mut wake = self.periodic_at;
        if self.pending {
            wake = wake.min(now);
        }
        if let Some(retry) = self.retry_at {
            wake = wake.min(retry);
        }
        wake.max(self.cooldown_until).max(now)
    }

    /// Whether a sync should start now, and why. The caller reports its end with
    /// [`SyncRunner::finished`].
    pub fn due(&mut self, now: Instant) -> Option<SyncReason> {
        if now < self.cooldown_until {
            return None;
        }
        let reason = if now >= self.periodic_at {
            SyncReason::Periodic
        } else if self.pending || self.retry_at.is_some_and(|at| now >= at) {
            SyncReason::Changes
        } else {
            return None;
        };
        self.pending = false;
        Some(reason)
    }

    /// The sync that [`SyncRunner::due`] started ended at `now`: the minimum and maximum
    /// intervals restart from here; a failure schedules a retry, a success cancels it.
    pub fn finished(&mut self, now: Instant, ok: bool) {
        self.cooldown_until = now + self.config.min_interval;
        self.periodic_at = now + self.config.max_interval;
        self.retry_at = (!ok).then(|| now + self.config.retry_interval);
    }

    /// A periodic sync that runs in steps started at `now`: the periodic timer is not due again
    /// while its steps go on (only a sync for changes is, between them).
    pub fn pass_started(&mut self, now: Instant) {
        self.periodic_at = now + self.config.max_interval;
    }

    /// A periodic sync that ran in steps ended at `now`: as [`SyncRunner::finished`], except
    /// that a success keeps a retry scheduled by a sync that failed between its steps (the pass
    /// may have covered that sync's service ports before it ran).
    pub fn pass_finished(&mut self, now: Instant, ok: bool) {
        let retry = self.retry_at;
        self.finished(now, ok);
        if ok {
            self.retry_at = retry;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: RunnerConfig = RunnerConfig {
        min_interval: Duration::from_secs(1),
        max_interval: Duration::from_secs(30),
        retry_interval: Duration::from_secs(5),
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
        runner.finished(start + ms(30_500), true);
        // The periodic timer restarts from the end of the last sync.
        assert_eq!(runner.due(start + ms(60_000)), None);
        assert_eq!(runner.next_wakeup(start + ms(30_501)), start + ms(60_500));
    }

    /// Upstream's runner has no burst (the old one ran two syncs back to back): with a change
    /// every 100 ms and syncs of 200 ms, a sync starts 1 s after the previous one ended.
    #[test]
    fn no_burst_and_min_interval_from_the_end_of_a_sync() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(CONFIG, start);
        let mut runs = Vec::new();
        let mut now = start;
        let end = start + ms(4_000);
        while now < end {
            runner.request();
            if runner.due(now).is_some() {
                runs.push(now.duration_since(start).as_millis());
                now += ms(200);
                runner.finished(now, true);
                continue;
            }
            now += ms(100);
        }
        assert_eq!(runs, [0, 1_200, 2_400, 3_600]);
    }

    #[test]
    fn changes_during_the_cooldown_coalesce_into_one_sync() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(CONFIG, start);
        runner.request();
        assert!(runner.due(start).is_some());
        runner.finished(start + ms(50), true);
        for _ in 0..3 {
            runner.request();
        }
        assert_eq!(runner.due(start + ms(60)), None);
        let wake = runner.next_wakeup(start + ms(60));
        assert_eq!(wake, start + ms(1_050));
        assert_eq!(runner.due(wake), Some(SyncReason::Changes));
        assert!(!runner.is_pending(), "one sync covered all three");
        runner.finished(wake, true);
        assert_eq!(runner.due(wake + ms(2_000)), None);
    }

    #[test]
    fn a_failed_sync_is_retried_after_the_retry_interval_from_its_end() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(CONFIG, start);
        runner.request();
        assert!(runner.due(start).is_some());
        runner.finished(start + ms(100), false);
        assert_eq!(runner.next_wakeup(start + ms(100)), start + ms(5_100));
        assert_eq!(runner.due(start + ms(5_099)), None);
        assert_eq!(runner.due(start + ms(5_100)), Some(SyncReason::Changes));
        // A success cancels the retry.
        runner.finished(start + ms(5_200), true);
        assert_eq!(runner.next_wakeup(start + ms(5_200)), start + ms(35_200));
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
            runner.finished(start, true);
        }
    }

    #[test]
    fn a_pass_in_steps_keeps_the_retry_of_a_sync_that_failed_between_its_steps() {
        let start = Instant::now();
        let mut runner = SyncRunner::new(CONFIG, start);
        assert_eq!(runner.due(start + ms(30_000)), Some(SyncReason::Periodic));
        runner.pass_started(start + ms(30_000));
        // The periodic timer is not due again while the pass goes on.
        assert_eq!(runner.next_wakeup(start + ms(30_001)), start + ms(60_000));
        // A sync for changes between two steps fails…
        runner.request();
        assert_eq!(runner.due(start + ms(30_010)), Some(SyncReason::Changes));
        runner.finished(start + ms(30_011), false);
        // …and the pass that ends after it succeeds: the retry stands.
        runner.pass_finished(start + ms(30_050), true);
        assert_eq!(runner.next_wakeup(start + ms(30_050)), start + ms(35_011));
        assert_eq!(runner.due(start + ms(35_011)), Some(SyncReason::Changes));
        // A failed pass schedules its own.
        runner.finished(start + ms(35_020), true);
        runner.pass_finished(start + ms(35_100), false);
        assert_eq!(runner.next_wakeup(start + ms(35_100)), start + ms(40_100));
    }
}
