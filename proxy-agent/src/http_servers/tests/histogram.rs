//! The native histogram against client_golang: bucket indexes computed by its algorithm by
//! hand, and the expectations of its `TestNativeHistogram` scenarios (prometheus/client_golang
//! `prometheus/histogram_test.go`), run as it runs them: one observation a minute, the
//! histogram written a minute after the last.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use crate::http_servers::histogram::{
    DEFAULT_ZERO_THRESHOLD, Histogram, HistogramSnapshot, Moment, NativeConfig, SpanDeltas,
    bucket_key, bucket_upper_bound, frexp, pick_schema, spans_and_deltas,
};

const MINUTE: Duration = Duration::from_secs(60);

#[test]
fn the_default_zero_threshold_is_two_to_the_minus_128() {
    assert_eq!(DEFAULT_ZERO_THRESHOLD, 2f64.powi(-128));
}

#[test]
fn frexp_is_gos() {
    for (value, expected) in [
        (1.0, (0.5, 1)),
        (0.75, (0.75, 0)),
        (8.0, (0.5, 4)),
        (3.0, (0.75, 2)),
        (-3.0, (-0.75, 2)),
        (0.001, (0.512, -9)),
        (f64::MAX, (0.999_999_999_999_999_9, 1024)),
        // A subnormal is normalised: 2^-1024 = 0.5 × 2^-1023.
        (f64::MIN_POSITIVE / 4.0, (0.5, -1023)),
        (0.0, (0.0, 0)),
    ] {
        assert_eq!(frexp(value), expected, "{value}");
    }
}

#[test]
fn the_schema_is_picked_from_the_factor_as_client_golang_does() {
    for (factor, schema) in [
        (1.1, 3),
        (1.2, 2),
        (2.0, 0),
        (4.0, -1),
        (17.0, -2),
        (65_536.0, -4),
        (1e9, -4),
        (1.0001, 8),
    ] {
        assert_eq!(pick_schema(factor), schema, "factor {factor}");
    }
    assert_eq!(NativeConfig::kube_proxy().schema, 3);
    assert_eq!(NativeConfig::kube_proxy().max_buckets, 160);
}

/// Schema 3 (factor 1.1, kube-proxy's): 8 buckets per power of two, bucket 0 is (2^-1/8, 1].
/// Each index worked out by hand with client_golang's `observe`: frexp, then the first bound
/// of `nativeHistogramBounds[3]` not below the fraction, plus 8 × (exponent - 1).
#[test]
fn bucket_indexes_at_schema_3_are_client_golangs() {
    for (value, key) in [
        (1.0, 0),     // 0.5 × 2^1
        (2.0, 8),     // 0.5 × 2^2
        (0.5, -8),    // 0.5 × 2^0
        (1.5, 5),     // 0.75 × 2^1: first bound ≥ 0.75 is 0.7711 (index 5)
        (1.1, 2),     // 0.55 × 2^1: 0.5945 (index 2)
        (3.0, 13),    // 0.75 × 2^2: 5 + 8
        (0.001, -79), // 0.512 × 2^-9: 1 + 8 × -10
        (0.1, -26),   // 0.8 × 2^-3: 6 + 8 × -4
        (16.384, 33), // 0.512 × 2^5: 1 + 8 × 4
        // On a boundary: 2^(1/8) is bucket 1's upper bound, and the bound is inclusive.
        (2.0 * 0.545_253_866_332_628_8, 1),
        (f64::MAX, 8192), // 0.999… × 2^1024: 8 + 8 × 1023
        (f64::INFINITY, 8193),
        (-1.5, 5),
        (f64::NEG_INFINITY, 8193),
    ] {
        assert_eq!(bucket_key(value, 3), key, "{value}");
    }
}

/// Every value lies in its bucket: above the previous bucket's upper bound, at or below its
/// own, at every schema from 3 down to -4.
#[test]
fn each_value_falls_between_its_buckets_bounds() {
    let mut value = 1e-9;
    while value < 1e9 {
        for schema in -4..=3 {
            let key = bucket_key(value, schema);
            let upper = bucket_upper_bound(key, schema);
            let lower = bucket_upper_bound(key - 1, schema);
            assert!(
                lower < value && value <= upper,
                "{value} at schema {schema}: key {key} is ({lower}, {upper}]"
            );
        }
        value *= 1.037;
    }
}

#[test]
fn spans_bridge_gaps_of_up_to_two_buckets_as_client_golang_does() {
    let buckets = BTreeMap::from([(-3, 1), (-1, 3), (3, 1), (4, 2)]);
    assert_eq!(
        spans_and_deltas(&buckets),
        SpanDeltas {
            // -2 is written as an empty bucket; 0..=2 is a gap of three: a new span.
            spans: vec![(-3, 3), (3, 2)],
            deltas: vec![1, -1, 3, -2, 1],
        }
    );
    assert_eq!(spans_and_deltas(&BTreeMap::new()), SpanDeltas::default());
}

struct Scenario {
    name: &'static str,
    observations: &'static [f64],
    factor: f64,
    max_buckets: u32,
    min_reset_minutes: u64,
    max_zero_threshold: f64,
}

impl Scenario {
    const fn new(name: &'static str, observations: &'static [f64], factor: f64) -> Self {
        Self {
            name,
            observations,
            factor,
            max_buckets: 0,
            min_reset_minutes: 0,
            max_zero_threshold: 0.0,
        }
    }

    /// client_golang's test loop; returns the snapshot and the start.
    fn run(&self) -> (HistogramSnapshot, Moment) {
        let config = NativeConfig {
            max_buckets: self.max_buckets,
            min_reset_duration: MINUTE * u32::try_from(self.min_reset_minutes).unwrap_or(0),
            max_zero_threshold: self.max_zero_threshold,
            ..NativeConfig::with_factor(self.factor, 0)
        };
        let start = Moment::now();
        let histogram = Histogram::new_at(Arc::from(Vec::new()), Some(config), start);
        let mut now = start.after(MINUTE);
        for &value in self.observations {
            histogram.observe_at(value, now);
            now = now.after(MINUTE);
        }
        (histogram.snapshot_at(now), start)
    }
}

struct Expected {
    count: u64,
    sum: f64,
    schema: i32,
    zero_threshold: f64,
    zero_count: u64,
    positive: (&'static [(i32, u32)], &'static [i64]),
    negative: (&'static [(i32, u32)], &'static [i64]),
    /// Minutes after the start of the last reset (0: never reset).
    created_minutes: u64,
}

const NONE: (&[(i32, u32)], &[i64]) = (&[], &[]);

fn check(scenario: &Scenario, expected: &Expected) {
    let (snapshot, start) = scenario.run();
    let name = scenario.name;
    assert_eq!(snapshot.count, expected.count, "{name}: count");
    if expected.sum.is_nan() {
        assert!(snapshot.sum.is_nan(), "{name}: sum {}", snapshot.sum);
    } else {
        assert_eq!(snapshot.sum, expected.sum, "{name}: sum");
    }
    let Some(native) = snapshot.native else {
        panic!("{name}: no native buckets");
    };
    assert_eq!(native.schema, expected.schema, "{name}: schema");
    assert_eq!(
        native.zero_threshold, expected.zero_threshold,
        "{name}: zero threshold"
    );
    assert_eq!(native.zero_count, expected.zero_count, "{name}: zero count");
    for (side, got, want) in [
        ("positive", &native.positive, expected.positive),
        ("negative", &native.negative, expected.negative),
    ] {
        assert_eq!(got.spans, want.0, "{name}: {side} spans");
        assert_eq!(got.deltas, want.1, "{name}: {side} deltas");
    }
    let created = start.wall + MINUTE * u32::try_from(expected.created_minutes).unwrap_or(0);
    assert_eq!(snapshot.created, created, "{name}: created");
}

const Z: f64 = DEFAULT_ZERO_THRESHOLD;

#[test]
fn client_golang_native_histogram_scenarios() {
    let cases: &[(Scenario, Expected)] = &[
        (
            Scenario::new("factor 1.1 results in schema 3", &[0.0, 1.0, 2.0, 3.0], 1.1),
            Expected {
                count: 4,
                sum: 6.0,
                schema: 3,
                zero_threshold: Z,
                zero_count: 1,
                positive: (&[(0, 1), (7, 1), (4, 1)], &[1, 0, 0]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario::new(
                "factor 1.2 results in schema 2",
                &[0.0, 1.0, 1.2, 1.4, 1.8, 2.0],
                1.2,
            ),
            Expected {
                count: 6,
                sum: 7.4,
                schema: 2,
                zero_threshold: Z,
                zero_count: 1,
                positive: (&[(0, 5)], &[1, -1, 2, -2, 2]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario::new(
                "factor 4 results in schema -1",
                &[
                    0.015_625_1,
                    0.0625,
                    0.1,
                    0.25,
                    0.5,
                    1.0,
                    1.5,
                    2.0,
                    3.0,
                    3.5,
                    5.0,
                    6.0,
                    7.0,
                    33.33,
                ],
                4.0,
            ),
            Expected {
                count: 14,
                sum: 63.258_125_1,
                schema: -1,
                zero_threshold: Z,
                zero_count: 0,
                positive: (&[(-2, 6)], &[2, 0, 0, 2, -1, -2]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario::new(
                "factor 17 results in schema -2",
                &[
                    0.015_625_1,
                    0.0625,
                    0.1,
                    0.25,
                    0.5,
                    1.0,
                    1.5,
                    2.0,
                    3.0,
                    3.5,
                    5.0,
                    6.0,
                    7.0,
                    33.33,
                ],
                17.0,
            ),
            Expected {
                count: 14,
                sum: 63.258_125_1,
                schema: -2,
                zero_threshold: Z,
                zero_count: 0,
                positive: (&[(-1, 4)], &[2, 2, 3, -6]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario::new(
                "negative and positive buckets",
                &[0.0, -1.0, -1.2, -1.4, -1.8, -2.0, 1.0, 1.2, 1.4, 1.8, 2.0],
                1.2,
            ),
            Expected {
                count: 11,
                sum: 0.0,
                schema: 2,
                zero_threshold: Z,
                zero_count: 1,
                positive: (&[(0, 5)], &[1, -1, 2, -2, 2]),
                negative: (&[(0, 5)], &[1, -1, 2, -2, 2]),
                created_minutes: 0,
            },
        ),
        (
            Scenario::new(
                "NaN observation",
                &[0.0, 1.0, 1.2, 1.4, 1.8, 2.0, f64::NAN],
                1.2,
            ),
            Expected {
                count: 7,
                sum: f64::NAN,
                schema: 2,
                zero_threshold: Z,
                zero_count: 1,
                positive: (&[(0, 5)], &[1, -1, 2, -2, 2]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario::new(
                "+Inf observation",
                &[0.0, 1.0, 1.2, 1.4, 1.8, 2.0, f64::INFINITY],
                1.2,
            ),
            Expected {
                count: 7,
                sum: f64::INFINITY,
                schema: 2,
                zero_threshold: Z,
                zero_count: 1,
                positive: (&[(0, 5), (4092, 1)], &[1, -1, 2, -2, 2, -1]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario::new(
                "-Inf observation",
                &[0.0, 1.0, 1.2, 1.4, 1.8, 2.0, f64::NEG_INFINITY],
                1.2,
            ),
            Expected {
                count: 7,
                sum: f64::NEG_INFINITY,
                schema: 2,
                zero_threshold: Z,
                zero_count: 1,
                positive: (&[(0, 5)], &[1, -1, 2, -2, 2]),
                negative: (&[(4097, 1)], &[1]),
                created_minutes: 0,
            },
        ),
        (
            Scenario {
                max_buckets: 4,
                ..Scenario::new(
                    "limited buckets but nothing triggered",
                    &[0.0, 1.0, 1.2, 1.4, 1.8, 2.0],
                    1.2,
                )
            },
            Expected {
                count: 6,
                sum: 7.4,
                schema: 2,
                zero_threshold: Z,
                zero_count: 1,
                positive: (&[(0, 5)], &[1, -1, 2, -2, 2]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario {
                max_buckets: 4,
                ..Scenario::new(
                    "buckets limited by halving resolution",
                    &[0.0, 1.0, 1.1, 1.2, 1.4, 1.8, 2.0, 3.0],
                    1.2,
                )
            },
            Expected {
                count: 8,
                sum: 11.5,
                schema: 1,
                zero_threshold: Z,
                zero_count: 1,
                positive: (&[(0, 5)], &[1, 2, -1, -2, 1]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario {
                max_buckets: 4,
                max_zero_threshold: 1.2,
                ..Scenario::new(
                    "buckets limited by widening the zero bucket",
                    &[0.0, 1.0, 1.1, 1.2, 1.4, 1.8, 2.0, 3.0],
                    1.2,
                )
            },
            Expected {
                count: 8,
                sum: 11.5,
                schema: 2,
                zero_threshold: 1.0,
                zero_count: 2,
                positive: (&[(1, 7)], &[1, 1, -2, 2, -2, 0, 1]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario {
                max_buckets: 4,
                max_zero_threshold: 1.2,
                ..Scenario::new(
                    "buckets limited by widening the zero bucket twice",
                    &[0.0, 1.0, 1.1, 1.2, 1.4, 1.8, 2.0, 3.0, 4.0],
                    1.2,
                )
            },
            Expected {
                count: 9,
                sum: 15.5,
                schema: 2,
                zero_threshold: 1.189_207_115_002_721,
                zero_count: 3,
                positive: (&[(2, 7)], &[2, -2, 2, -2, 0, 1, 0]),
                negative: NONE,
                created_minutes: 0,
            },
        ),
        (
            Scenario {
                max_buckets: 4,
                max_zero_threshold: 1.2,
                min_reset_minutes: 5,
                ..Scenario::new(
                    "buckets limited by reset",
                    &[0.0, 1.0, 1.1, 1.2, 1.4, 1.8, 2.0, 3.0, 4.0],
                    1.2,
                )
            },
            Expected {
                count: 2,
                sum: 7.0,
                schema: 2,
                zero_threshold: Z,
                zero_count: 0,
                positive: (&[(7, 2)], &[1, 0]),
                negative: NONE,
                created_minutes: 8,
            },
        ),
        (
            Scenario {
                max_buckets: 4,
                max_zero_threshold: 1.2,
                min_reset_minutes: 5,
                ..Scenario::new(
                    "buckets limited by reset, negative observations",
                    &[0.0, -1.0, -1.1, -1.2, -1.4, -1.8, -2.0, -3.0, -4.0],
                    1.2,
                )
            },
            Expected {
                count: 2,
                sum: -7.0,
                schema: 2,
                zero_threshold: Z,
                zero_count: 0,
                positive: NONE,
                negative: (&[(7, 2)], &[1, 0]),
                created_minutes: 8,
            },
        ),
        (
            Scenario {
                max_buckets: 4,
                min_reset_minutes: 9,
                ..Scenario::new(
                    "buckets limited by halving resolution, then reset",
                    &[0.0, 1.0, 1.1, 1.2, 1.4, 1.8, 2.0, 5.0, 5.1, 3.0, 4.0],
                    1.2,
                )
            },
            Expected {
                count: 3,
                sum: 12.1,
                schema: 2,
                zero_threshold: Z,
                zero_count: 0,
                positive: (&[(7, 4)], &[1, 0, -1, 1]),
                negative: NONE,
                created_minutes: 9,
            },
        ),
        (
            Scenario {
                max_buckets: 4,
                max_zero_threshold: 1.2,
                min_reset_minutes: 9,
                ..Scenario::new(
                    "buckets limited by widening the zero bucket, then reset",
                    &[0.0, 1.0, 1.1, 1.2, 1.4, 1.8, 2.0, 5.0, 5.1, 3.0, 4.0],
                    1.2,
                )
            },
            Expected {
                count: 3,
                sum: 12.1,
                schema: 2,
                zero_threshold: Z,
                zero_count: 0,
                positive: (&[(7, 4)], &[1, 0, -1, 1]),
                negative: NONE,
                created_minutes: 9,
            },
        ),
    ];
    for (scenario, expected) in cases {
        check(scenario, expected);
    }
}

/// kube-proxy's options: the 161st bucket halves the resolution (no reset: component-base
/// sets no minimum reset duration), and the classic side keeps every observation.
#[test]
fn kube_proxys_histogram_halves_its_resolution_past_160_buckets() {
    let bounds: Arc<[f64]> = Arc::from(vec![0.001, 1.0, 1e9]);
    let start = Moment::now();
    let histogram = Histogram::new_at(bounds, Some(NativeConfig::kube_proxy()), start);
    let mut now = start;
    // Each bucket's (inclusive) upper bound: 160 distinct buckets, then one more.
    for k in 0..160 {
        histogram.observe_at(bucket_upper_bound(k, 3), now);
        now = now.after(MINUTE);
    }
    let before = histogram.snapshot_at(now);
    let native = before
        .native
        .as_ref()
        .map(|n| (n.schema, n.positive.deltas.len()));
    assert_eq!(native, Some((3, 160)));
    histogram.observe_at(
        bucket_upper_bound(160, 3),
        now.after(Duration::from_secs(7200)),
    );
    let after = histogram.snapshot_at(now.after(Duration::from_secs(7200)));
    assert_eq!(after.count, 161);
    assert_eq!(after.created, start.wall, "never reset");
    let Some(native) = after.native else {
        panic!("no native buckets");
    };
    assert_eq!(native.schema, 2);
    // Pairs merged: 0 stays alone (it covers -1 and 0), 1+2 → 1, …, 159+160 → 80.
    assert_eq!(native.positive.spans, vec![(0, 81)]);
    let counts: Vec<i64> = native
        .positive
        .deltas
        .iter()
        .scan(0, |count, delta| {
            *count += delta;
            Some(*count)
        })
        .collect();
    assert_eq!(counts[0], 1);
    assert!(counts[1..].iter().all(|c| *c == 2), "{counts:?}");
    assert_eq!(after.buckets, vec![(0.001, 0), (1.0, 1), (1e9, 161)]);
}

#[test]
fn without_the_gate_a_histogram_has_no_native_buckets() {
    let histogram = Histogram::new(Arc::from(vec![1.0]), None);
    histogram.observe(0.5);
    histogram.observe(3.0);
    let snapshot = histogram.snapshot();
    assert_eq!(snapshot.native, None);
    assert_eq!((snapshot.count, snapshot.sum), (2, 3.5));
    assert_eq!(snapshot.buckets, vec![(1.0, 1)]);
}
