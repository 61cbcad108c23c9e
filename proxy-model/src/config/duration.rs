//! Go's `time.Duration` text format (`30s`, `1m0s`, `24h0m0s`, `1.5ms`), which kube-proxy uses
//! both in its configuration file (`metav1.Duration`) and in its duration flags. Parsing and
//! printing follow Go's `time.ParseDuration` and `Duration.String` exactly, so a file we write
//! reads the same in kube-proxy and vice versa.

use std::{fmt, str::FromStr, time::Duration};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

const NANOSECOND: u64 = 1;
const MICROSECOND: u64 = 1_000 * NANOSECOND;
const MILLISECOND: u64 = 1_000 * MICROSECOND;
const SECOND: u64 = 1_000 * MILLISECOND;
const MINUTE: u64 = 60 * SECOND;
const HOUR: u64 = 60 * MINUTE;

/// A signed duration with nanosecond precision, like Go's `time.Duration`. It is signed because
/// Go accepts `-1s`, and upstream validation reports negative values rather than the parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GoDuration(i64);

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid duration {input:?}: {reason} (Go format, e.g. 30s, 1m0s, 2h45m, 1.5s, 100ms)")]
pub struct ParseDurationError {
    input: String,
    reason: &'static str,
}

impl GoDuration {
    pub const ZERO: GoDuration = GoDuration(0);

    pub const fn from_nanos(nanos: i64) -> Self {
        GoDuration(nanos)
    }

    pub const fn from_secs(secs: i64) -> Self {
        GoDuration(secs * SECOND as i64)
    }

    pub const fn as_nanos(self) -> i64 {
        self.0
    }

    pub const fn is_zero(self) -> bool {
        self.0 == 0
    }

    pub const fn is_negative(self) -> bool {
        self.0 < 0
    }

    /// The std duration, or None when negative.
    pub fn to_std(self) -> Option<Duration> {
        u64::try_from(self.0).ok().map(Duration::from_nanos)
    }

    /// Saturates at Go's maximum (about 292 years), which no setting comes near.
    pub fn from_std(duration: Duration) -> Self {
        GoDuration(i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX))
    }
}

impl FromStr for GoDuration {
    type Err = ParseDurationError;

    /// Go's `time.ParseDuration`: an optional sign, then one or more decimal numbers, each
    /// with an optional fraction and a required unit (`ns`, `us`/`µs`/`μs`, `ms`, `s`, `m`,
    /// `h`); `0` alone is allowed without a unit.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let fail = |reason| ParseDurationError {
            input: input.to_owned(),
            reason,
        };
        let mut s = input;
        let mut negative = false;
        if let Some(rest) = s.strip_prefix('-') {
            negative = true;
            s = rest;
        } else if let Some(rest) = s.strip_prefix('+') {
            s = rest;
        }
        if s == "0" {
            return Ok(GoDuration(0));
        }
        if s.is_empty() {
            return Err(fail("empty"));
        }
        // Go accumulates in a u64 and allows up to 1<<63 before applying the sign.
        let limit: u128 = 1 << 63;
        let mut total: u128 = 0;
        while !s.is_empty() {
            let first = s.as_bytes()[0];
            if !(first == b'.' || first.is_ascii_digit()) {
                return Err(fail("expected a number"));
            }
            let int_len = s.bytes().take_while(u8::is_ascii_digit).count();
            let mut whole: u128 = 0;
            for digit in s[..int_len].bytes() {
                whole = whole * 10 + u128::from(digit - b'0');
                if whole > limit {
                    return Err(fail("overflow"));
                }
            }
            s = &s[int_len..];
            let mut fraction: u128 = 0;
            let mut scale: f64 = 1.0;
            let mut fraction_len = 0;
            if let Some(rest) = s.strip_prefix('.') {
                s = rest;
                fraction_len = s.bytes().take_while(u8::is_ascii_digit).count();
                let mut overflowed = false;
                for digit in s[..fraction_len].bytes() {
                    // Like Go: digits past what fits are ignored, not an error.
                    if overflowed {
                        continue;
                    }
                    let next = fraction * 10 + u128::from(digit - b'0');
                    if next > limit {
                        overflowed = true;
                        continue;
                    }
                    fraction = next;
                    scale *= 10.0;
                }
                s = &s[fraction_len..];
            }
            if int_len == 0 && fraction_len == 0 {
                return Err(fail("expected digits"));
            }
            let unit_len = s
                .char_indices()
                .find(|(_, c)| *c == '.' || c.is_ascii_digit())
                .map_or(s.len(), |(i, _)| i);
            if unit_len == 0 {
                return Err(fail("missing unit"));
            }
            let unit = match &s[..unit_len] {
                "ns" => NANOSECOND,
                "us" | "\u{b5}s" | "\u{3bc}s" => MICROSECOND,
                "ms" => MILLISECOND,
                "s" => SECOND,
                "m" => MINUTE,
                "h" => HOUR,
                _ => return Err(fail("unknown unit")),
            };
            s = &s[unit_len..];
            let unit = u128::from(unit);
            if whole > limit / unit {
                return Err(fail("overflow"));
            }
            let mut value = whole * unit;
            if fraction > 0 {
                // Go computes the fractional part in float64 and truncates.
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    clippy::cast_precision_loss,
                    reason = "same float arithmetic and truncation as Go's ParseDuration"
                )]
                let part = (fraction as f64 * (unit as f64 / scale)) as u128;
                value += part;
                if value > limit {
                    return Err(fail("overflow"));
                }
            }
            total += value;
            if total > limit {
                return Err(fail("overflow"));
            }
        }
        if negative {
            // total <= 1<<63, so the negation fits.
            let nanos = i64::try_from(total).map(|n| -n).unwrap_or(i64::MIN);
            return Ok(GoDuration(nanos));
        }
        i64::try_from(total)
            .map(GoDuration)
            .map_err(|_| fail("overflow"))
    }
}

impl fmt::Display for GoDuration {
    /// Go's `Duration.String`: `0s`; below one second the largest unit that keeps a whole
    /// part (`1.5ms`, `100µs`, `10ns`); otherwise `[Nh][Nm]N[.fff]s`, with minutes written
    /// whenever hours are (`1h0m0s`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let negative = self.0 < 0;
        let mut u = self.0.unsigned_abs();
        if u == 0 {
            return f.write_str("0s");
        }
        let mut out = String::new();
        if u < SECOND {
            let (digits, unit) = if u < MICROSECOND {
                (0, "ns")
            } else if u < MILLISECOND {
                (3, "\u{b5}s")
            } else {
                (6, "ms")
            };
            let (whole, fraction) = split_fraction(u, digits);
            out.push_str(&whole.to_string());
            out.push_str(&fraction);
            out.push_str(unit);
        } else {
            let (seconds, fraction) = split_fraction(u, 9);
            u = seconds;
            let mut text = format!("{}{fraction}s", u % 60);
            u /= 60;
            if u > 0 {
                text = format!("{}m{text}", u % 60);
                u /= 60;
                if u > 0 {
                    text = format!("{u}h{text}");
                }
            }
            out.push_str(&text);
        }
        if negative {
            f.write_str("-")?;
        }
        f.write_str(&out)
    }
}

/// Splits `value` into `value / 10^digits` and the fraction text (".5", or "" when zero), with
/// trailing zeros dropped, like Go's fmtFrac.
fn split_fraction(value: u64, digits: u32) -> (u64, String) {
    if digits == 0 {
        return (value, String::new());
    }
    let divisor = 10u64.pow(digits);
    let fraction = value % divisor;
    if fraction == 0 {
        return (value / divisor, String::new());
    }
    let text = format!("{fraction:0width$}", width = digits as usize);
    (value / divisor, format!(".{}", text.trim_end_matches('0')))
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    /// Only strings, like metav1.Duration (`syncPeriod: 30` is an error there too).
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Parsed inside the visitor, not after `String::deserialize` returned: the decoder then
        // reports the error at the value, with its full path (`iptables.syncPeriod`), instead
        // of at the enclosing mapping.
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = GoDuration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a Go duration such as 30s or 1m0s")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<GoDuration, E> {
                text.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_like_go() {
        let cases: &[(&str, i64)] = &[
            ("0", 0),
            ("0s", 0),
            ("-0", 0),
            ("+5s", 5 * SECOND as i64),
            ("30s", 30 * SECOND as i64),
            ("1m0s", MINUTE as i64),
            ("24h0m0s", 24 * HOUR as i64),
            ("2h45m", (2 * HOUR + 45 * MINUTE) as i64),
            ("1.5s", 1_500 * MILLISECOND as i64),
            (".5s", 500 * MILLISECOND as i64),
            ("1.s", SECOND as i64),
            ("250ms", 250 * MILLISECOND as i64),
            ("10us", 10_000),
            ("10\u{b5}s", 10_000),
            ("10\u{3bc}s", 10_000),
            ("7ns", 7),
            ("-1s", -(SECOND as i64)),
            (
                "1h1m1s1ms1us1ns",
                (HOUR + MINUTE + SECOND + MILLISECOND + MICROSECOND + 1) as i64,
            ),
            ("9223372036854775807ns", i64::MAX),
            ("-9223372036854775808ns", i64::MIN),
            ("0.100000000000000000000h", 6 * MINUTE as i64),
        ];
        for (text, nanos) in cases {
            assert_eq!(text.parse::<GoDuration>(), Ok(GoDuration(*nanos)), "{text}");
        }
    }

    #[test]
    fn rejects_like_go() {
        for text in [
            "",
            "3",
            "-",
            "s",
            ".",
            ".s",
            "1d",
            "1.5",
            "30 s",
            "1s ",
            "x1s",
            "9223372036854775808ns",
            "3000000h",
        ] {
            assert!(text.parse::<GoDuration>().is_err(), "{text:?} should fail");
        }
    }

    #[test]
    fn prints_like_go() {
        let cases: &[(i64, &str)] = &[
            (0, "0s"),
            (1, "1ns"),
            (1_100, "1.1\u{b5}s"),
            (2_200_000, "2.2ms"),
            (250 * MILLISECOND as i64, "250ms"),
            (SECOND as i64, "1s"),
            (1_500 * MILLISECOND as i64, "1.5s"),
            (30 * SECOND as i64, "30s"),
            (MINUTE as i64, "1m0s"),
            (90 * SECOND as i64, "1m30s"),
            (15 * MINUTE as i64, "15m0s"),
            (HOUR as i64, "1h0m0s"),
            (24 * HOUR as i64, "24h0m0s"),
            ((HOUR + SECOND + 1) as i64, "1h0m1.000000001s"),
            (-(SECOND as i64), "-1s"),
            (i64::MAX, "2562047h47m16.854775807s"),
            (i64::MIN, "-2562047h47m16.854775808s"),
        ];
        for (nanos, text) in cases {
            assert_eq!(GoDuration(*nanos).to_string(), *text);
            assert_eq!(
                text.parse::<GoDuration>(),
                Ok(GoDuration(*nanos)),
                "round trip {text}"
            );
        }
    }
}
