//! Instants as Go prints a `time.Time` (`t.String()`, which kube-proxy's health server puts in
//! its JSON with `%q`): `2006-01-02 15:04:05.999999999 -0700 MST`, plus ` m=+<secs>.<nanos>` for
//! times read from the clock, where the monotonic reading counts from process start.

use std::{
    sync::OnceLock,
    time::{Duration, Instant, SystemTime},
};

use jiff::{Timestamp, tz::TimeZone};

/// Go's zero `time.Time`, which kube-proxy prints when no family has synced yet.
pub const GO_ZERO_TIME: &str = "0001-01-01 00:00:00 +0000 UTC";

static PROCESS_START: OnceLock<Instant> = OnceLock::new();

/// The origin of the ` m=` readings. Go measures from runtime start; the agent calls this first
/// thing in `main`, and later calls only read it.
pub fn process_start() -> Instant {
    *PROCESS_START.get_or_init(Instant::now)
}

/// A clock reading: the wall clock for printing, the monotonic clock for intervals (as Go's
/// `time.Now()` carries both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub wall: SystemTime,
    pub mono: Instant,
}

impl Stamp {
    pub fn now() -> Self {
        // Read the start first so a reading is never before it.
        process_start();
        Self {
            wall: SystemTime::now(),
            mono: Instant::now(),
        }
    }

    /// Time elapsed from `earlier` to `self` on the monotonic clock (zero if `earlier` is later),
    /// like Go's `Sub` for two readings that both carry a monotonic part.
    pub fn since(&self, earlier: &Stamp) -> Duration {
        self.mono.saturating_duration_since(earlier.mono)
    }

    /// The value shifted by `by` on both clocks (test clocks advance this way).
    pub fn plus(&self, by: Duration) -> Self {
        Self {
            wall: self.wall + by,
            mono: self.mono + by,
        }
    }

    /// Go's `time.Time.String()` of this reading, monotonic suffix included.
    pub fn go_string(&self) -> String {
        let start = process_start();
        let monotonic = match self.mono.checked_duration_since(start) {
            Some(after) => Monotonic::After(after),
            None => Monotonic::Before(start.duration_since(self.mono)),
        };
        format_go(self.wall, Some(monotonic))
    }
}

/// The monotonic part of a Go time relative to process start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Monotonic {
    After(Duration),
    Before(Duration),
}

/// `time.Time.String()` in UTC: the fraction drops trailing zeros (and the dot when the
/// nanoseconds are zero); the monotonic suffix is seconds with exactly nine decimals.
///
/// Go prints the local zone; the agent always prints UTC (what kube-proxy prints in its usual
/// container image, which has no zone configured).
pub fn format_go(wall: SystemTime, monotonic: Option<Monotonic>) -> String {
    let timestamp = Timestamp::try_from(wall).unwrap_or(Timestamp::UNIX_EPOCH);
    let civil = timestamp.to_zoned(TimeZone::UTC).datetime();
    let mut out = format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        civil.year(),
        civil.month(),
        civil.day(),
        civil.hour(),
        civil.minute(),
        civil.second()
    );
    let nanos = civil.subsec_nanosecond();
    if nanos != 0 {
        let fraction = format!("{nanos:09}");
        out.push('.');
        out.push_str(fraction.trim_end_matches('0'));
    }
    out.push_str(" +0000 UTC");
    if let Some(monotonic) = monotonic {
        let (sign, offset) = match monotonic {
            Monotonic::After(d) => ('+', d),
            Monotonic::Before(d) => ('-', d),
        };
        out.push_str(&format!(
            " m={sign}{}.{:09}",
            offset.as_secs(),
            offset.subsec_nanos()
        ));
    }
    out
}

/// Parses the EndpointSlice annotation `endpoints.kubernetes.io/last-change-trigger-time`
/// (RFC 3339, as the EndpointSlice controller writes it).
pub fn parse_rfc3339(value: &str) -> Option<SystemTime> {
    value.trim().parse::<Timestamp>().ok().map(SystemTime::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn wall_clock_like_go() {
        // 2025-01-02 03:04:05 UTC
        let base = 1_735_787_045;
        assert_eq!(
            format_go(at(base, 123_456_789), None),
            "2025-01-02 03:04:05.123456789 +0000 UTC"
        );
        assert_eq!(
            format_go(at(base, 0), None),
            "2025-01-02 03:04:05 +0000 UTC"
        );
        // Trailing zeros of the fraction go.
        assert_eq!(
            format_go(at(base, 120_000_000), None),
            "2025-01-02 03:04:05.12 +0000 UTC"
        );
        assert_eq!(
            format_go(at(base, 1), None),
            "2025-01-02 03:04:05.000000001 +0000 UTC"
        );
    }

    #[test]
    fn monotonic_suffix_like_go() {
        let wall = at(1_735_787_045, 123_456_789);
        assert_eq!(
            format_go(wall, Some(Monotonic::After(Duration::new(12, 345_678_901)))),
            "2025-01-02 03:04:05.123456789 +0000 UTC m=+12.345678901"
        );
        // Nine decimals always, even when zero; no leading zero padding of the seconds.
        assert_eq!(
            format_go(wall, Some(Monotonic::After(Duration::from_millis(1)))),
            "2025-01-02 03:04:05.123456789 +0000 UTC m=+0.001000000"
        );
        assert_eq!(
            format_go(wall, Some(Monotonic::Before(Duration::new(3, 5)))),
            "2025-01-02 03:04:05.123456789 +0000 UTC m=-3.000000005"
        );
    }

    #[test]
    fn readings_from_the_clock_carry_the_suffix() {
        let stamp = Stamp::now();
        let text = stamp.go_string();
        let (_, suffix) = text.split_once(" +0000 UTC m=+").unwrap();
        let (secs, nanos) = suffix.split_once('.').unwrap();
        assert!(secs.parse::<u64>().is_ok(), "{text}");
        assert_eq!(nanos.len(), 9, "{text}");
    }

    #[test]
    fn trigger_time_annotation() {
        assert_eq!(
            parse_rfc3339("2025-01-02T03:04:05Z"),
            Some(at(1_735_787_045, 0))
        );
        assert_eq!(
            parse_rfc3339("2025-01-02T03:04:05.5+01:00"),
            Some(at(1_735_787_045 - 3600, 500_000_000))
        );
        assert_eq!(parse_rfc3339("yesterday"), None);
    }
}
