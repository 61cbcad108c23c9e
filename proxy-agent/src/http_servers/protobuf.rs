//! The protobuf exposition (expfmt's `FmtProtoDelim`): one length-delimited
//! `io.prometheus.client.MetricFamily` message per family, in the order and with the content
//! of the classic text format (`exposition::families`), as client_golang's `protodelim`
//! encoder writes what `Gather` returns. Histograms are written from their snapshots
//! (`histogram.rs`): count, sum, classic buckets and created timestamp, and with the
//! `NativeHistograms` gate the native fields, all read at one instant — a scraper checks
//! that the native buckets add up to the count.
//!
//! The messages are written out by hand from prometheus/client_model's
//! `io/prometheus/client/metrics.proto` (proto2; field numbers and types as declared there;
//! repeated numbers unpacked, as Go's encoder writes proto2 fields without `packed`).
//! Exemplars are left out: kube-proxy records none.

use std::{
    collections::BTreeMap,
    time::{SystemTime, UNIX_EPOCH},
};

use prost::Message as _;

use super::{
    exposition::{ExposedFamily, Kind, Series, parse_number, unescape_label_value},
    histogram::{HistogramSnapshot, SpanDeltas},
};

/// `google.protobuf.Timestamp` (proto3).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Timestamp {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LabelPair {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(string, optional, tag = "2")]
    pub value: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum MetricType {
    Counter = 0,
    Gauge = 1,
    Summary = 2,
    Untyped = 3,
    Histogram = 4,
    GaugeHistogram = 5,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Gauge {
    #[prost(double, optional, tag = "1")]
    pub value: Option<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Counter {
    #[prost(double, optional, tag = "1")]
    pub value: Option<f64>,
    #[prost(message, optional, tag = "3")]
    pub created_timestamp: Option<Timestamp>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Quantile {
    #[prost(double, optional, tag = "1")]
    pub quantile: Option<f64>,
    #[prost(double, optional, tag = "2")]
    pub value: Option<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(uint64, optional, tag = "1")]
    pub sample_count: Option<u64>,
    #[prost(double, optional, tag = "2")]
    pub sample_sum: Option<f64>,
    #[prost(message, repeated, tag = "3")]
    pub quantile: Vec<Quantile>,
    #[prost(message, optional, tag = "4")]
    pub created_timestamp: Option<Timestamp>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Untyped {
    #[prost(double, optional, tag = "1")]
    pub value: Option<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Histogram {
    #[prost(uint64, optional, tag = "1")]
    pub sample_count: Option<u64>,
    #[prost(double, optional, tag = "4")]
    pub sample_count_float: Option<f64>,
    #[prost(double, optional, tag = "2")]
    pub sample_sum: Option<f64>,
    /// The classic buckets, ascending; the +Inf bucket is left out (it is the count).
    #[prost(message, repeated, tag = "3")]
    pub bucket: Vec<Bucket>,
    #[prost(message, optional, tag = "15")]
    pub created_timestamp: Option<Timestamp>,
    #[prost(sint32, optional, tag = "5")]
    pub schema: Option<i32>,
    #[prost(double, optional, tag = "6")]
    pub zero_threshold: Option<f64>,
    #[prost(uint64, optional, tag = "7")]
    pub zero_count: Option<u64>,
    #[prost(double, optional, tag = "8")]
    pub zero_count_float: Option<f64>,
    #[prost(message, repeated, tag = "9")]
    pub negative_span: Vec<BucketSpan>,
    #[prost(sint64, repeated, packed = "false", tag = "10")]
    pub negative_delta: Vec<i64>,
    #[prost(double, repeated, packed = "false", tag = "11")]
    pub negative_count: Vec<f64>,
    #[prost(message, repeated, tag = "12")]
    pub positive_span: Vec<BucketSpan>,
    #[prost(sint64, repeated, packed = "false", tag = "13")]
    pub positive_delta: Vec<i64>,
    #[prost(double, repeated, packed = "false", tag = "14")]
    pub positive_count: Vec<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Bucket {
    #[prost(uint64, optional, tag = "1")]
    pub cumulative_count: Option<u64>,
    #[prost(double, optional, tag = "4")]
    pub cumulative_count_float: Option<f64>,
    #[prost(double, optional, tag = "2")]
    pub upper_bound: Option<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BucketSpan {
    #[prost(sint32, optional, tag = "1")]
    pub offset: Option<i32>,
    #[prost(uint32, optional, tag = "2")]
    pub length: Option<u32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Metric {
    #[prost(message, repeated, tag = "1")]
    pub label: Vec<LabelPair>,
    #[prost(message, optional, tag = "2")]
    pub gauge: Option<Gauge>,
    #[prost(message, optional, tag = "3")]
    pub counter: Option<Counter>,
    #[prost(message, optional, tag = "4")]
    pub summary: Option<Summary>,
    #[prost(message, optional, tag = "5")]
    pub untyped: Option<Untyped>,
    #[prost(message, optional, tag = "7")]
    pub histogram: Option<Histogram>,
    #[prost(int64, optional, tag = "6")]
    pub timestamp_ms: Option<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricFamily {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(string, optional, tag = "2")]
    pub help: Option<String>,
    #[prost(enumeration = "MetricType", optional, tag = "3")]
    pub r#type: Option<i32>,
    #[prost(message, repeated, tag = "4")]
    pub metric: Vec<Metric>,
    #[prost(string, optional, tag = "5")]
    pub unit: Option<String>,
}

/// Histogram snapshots by family name and label pairs (sorted by name, values unescaped).
pub type HistogramSnapshots = BTreeMap<(String, Vec<(String, String)>), HistogramSnapshot>;

/// The exposition: `families` in their order, each one delimited message; a histogram series
/// with a snapshot in `histograms` is written from it.
pub fn encode(families: &[ExposedFamily], histograms: &HistogramSnapshots) -> Vec<u8> {
    let mut out = Vec::new();
    for family in families {
        out.extend(metric_family(family, histograms).encode_length_delimited_to_vec());
    }
    out
}

/// One family's message.
pub fn metric_family(family: &ExposedFamily, histograms: &HistogramSnapshots) -> MetricFamily {
    let kind = match family.kind {
        Kind::Counter => MetricType::Counter,
        Kind::Gauge => MetricType::Gauge,
        Kind::Histogram => MetricType::Histogram,
        Kind::Summary => MetricType::Summary,
        Kind::Untyped => MetricType::Untyped,
    };
    MetricFamily {
        name: Some(family.name.clone()),
        // client_golang always sets the help, empty for a metric registered without one.
        help: Some(family.help.clone().unwrap_or_default()),
        r#type: Some(kind as i32),
        metric: family
            .series
            .iter()
            .map(|series| metric(family, series, histograms))
            .collect(),
        unit: None,
    }
}

fn metric(family: &ExposedFamily, series: &Series, histograms: &HistogramSnapshots) -> Metric {
    let labels: Vec<(String, String)> = series
        .labels
        .iter()
        .map(|(name, value)| (name.clone(), unescape_label_value(value)))
        .collect();
    let mut out = Metric {
        label: labels
            .iter()
            .map(|(name, value)| LabelPair {
                name: Some(name.clone()),
                value: Some(value.clone()),
            })
            .collect(),
        ..Metric::default()
    };
    let value = || {
        series
            .samples
            .iter()
            .find(|sample| sample.name == family.name)
            .or_else(|| series.samples.first())
            .and_then(|sample| parse_number(&sample.value))
    };
    match family.kind {
        Kind::Counter => {
            out.counter = Some(Counter {
                value: value(),
                created_timestamp: None,
            });
        }
        Kind::Gauge => out.gauge = Some(Gauge { value: value() }),
        Kind::Untyped => out.untyped = Some(Untyped { value: value() }),
        Kind::Histogram => {
            let key = (family.name.clone(), labels);
            out.histogram = Some(match histograms.get(&key) {
                Some(snapshot) => histogram_of_snapshot(snapshot),
                None => histogram_of_samples(series),
            });
        }
        Kind::Summary => out.summary = Some(summary_of_samples(series)),
    }
    out
}

/// A count written as a float sample (`3` or `3.0`).
fn count(text: &str) -> Option<u64> {
    parse_number(text)
        .filter(|value| value.is_finite() && *value >= 0.0)
        .map(|value| value as u64)
}

fn suffix_value<'a>(series: &'a Series, suffix: &str) -> Option<&'a str> {
    series
        .samples
        .iter()
        .find(|sample| sample.name.ends_with(suffix))
        .map(|sample| sample.value.as_str())
}

/// A classic histogram from its text samples (one that has no snapshot).
fn histogram_of_samples(series: &Series) -> Histogram {
    let bucket = series
        .samples
        .iter()
        .filter(|sample| sample.name.ends_with("_bucket"))
        .filter_map(|sample| {
            let (_, bound) = sample.bound()?;
            let upper = parse_number(bound)?;
            (upper != f64::INFINITY).then(|| Bucket {
                cumulative_count: count(&sample.value),
                upper_bound: Some(upper),
                ..Bucket::default()
            })
        })
        .collect();
    Histogram {
        sample_count: suffix_value(series, "_count").and_then(count),
        sample_sum: suffix_value(series, "_sum").and_then(parse_number),
        bucket,
        ..Histogram::default()
    }
}

fn summary_of_samples(series: &Series) -> Summary {
    Summary {
        sample_count: suffix_value(series, "_count").and_then(count),
        sample_sum: suffix_value(series, "_sum").and_then(parse_number),
        quantile: series
            .samples
            .iter()
            .filter_map(|sample| {
                let (_, quantile) = sample.bound()?;
                Some(Quantile {
                    quantile: parse_number(quantile),
                    value: parse_number(&sample.value),
                })
            })
            .collect(),
        created_timestamp: None,
    }
}

fn timestamp(time: SystemTime) -> Timestamp {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(since.subsec_nanos()).unwrap_or(0),
    }
}

fn spans(buckets: &SpanDeltas) -> Vec<BucketSpan> {
    buckets
        .spans
        .iter()
        .map(|&(offset, length)| BucketSpan {
            offset: Some(offset),
            length: Some(length),
        })
        .collect()
}

/// client_golang's `histogram.Write`.
pub fn histogram_of_snapshot(snapshot: &HistogramSnapshot) -> Histogram {
    let mut out = Histogram {
        sample_count: Some(snapshot.count),
        sample_sum: Some(snapshot.sum),
        bucket: snapshot
            .buckets
            .iter()
            .map(|&(upper, cumulative)| Bucket {
                cumulative_count: Some(cumulative),
                upper_bound: Some(upper),
                ..Bucket::default()
            })
            .collect(),
        created_timestamp: Some(timestamp(snapshot.created)),
        ..Histogram::default()
    };
    if let Some(native) = &snapshot.native {
        out.schema = Some(native.schema);
        out.zero_threshold = Some(native.zero_threshold);
        out.zero_count = Some(native.zero_count);
        out.negative_span = spans(&native.negative);
        out.negative_delta.clone_from(&native.negative.deltas);
        out.positive_span = spans(&native.positive);
        out.positive_delta.clone_from(&native.positive.deltas);
        // Without it, a native histogram with no observations and a zero threshold of zero
        // would look classic to a scraper (client_golang's no-op span).
        if native.zero_threshold == 0.0
            && native.zero_count == 0
            && out.positive_span.is_empty()
            && out.negative_span.is_empty()
        {
            out.positive_span = vec![BucketSpan {
                offset: Some(0),
                length: Some(0),
            }];
        }
    }
    out
}
