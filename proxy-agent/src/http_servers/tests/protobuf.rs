//! The protobuf exposition: the wire form of the hand-written `metrics.proto` messages, and
//! the agent's families as client_golang's `Gather` + `protodelim` would write them, with the
//! native fields only when the `NativeHistograms` gate is on.

use std::{sync::Arc, time::SystemTime};

use prost::Message as _;

use super::*;
use crate::http_servers::{
    histogram::{DEFAULT_ZERO_THRESHOLD, Histogram as KubeHistogram, NativeConfig, bucket_key},
    metrics::Metrics,
    protobuf::{Bucket, BucketSpan, Histogram, MetricFamily, MetricType, histogram_of_snapshot},
};
use proxy_model::desired::IpFamily;

/// The delimited stream back into messages.
pub(super) fn decode(mut bytes: &[u8]) -> Vec<MetricFamily> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let length = prost::decode_length_delimiter(bytes).expect("length");
        let prefix = prost::length_delimiter_len(length);
        out.push(MetricFamily::decode(&bytes[prefix..prefix + length]).expect("family"));
        bytes = &bytes[prefix + length..];
    }
    out
}

fn family<'a>(families: &'a [MetricFamily], name: &str) -> &'a MetricFamily {
    families
        .iter()
        .find(|f| f.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no family {name}"))
}

/// Field numbers and wire types as `metrics.proto` declares them, byte for byte: schema is
/// field 5 (sint32, zigzag), zero_threshold 6 (double), zero_count 7, positive_span 12 (a
/// BucketSpan: offset 1 sint32, length 2 uint32), positive_delta 13 (sint64, unpacked),
/// sample_count 1, sample_sum 2, bucket 3 (cumulative_count 1, upper_bound 2).
#[test]
fn histogram_fields_have_metrics_protos_numbers() {
    let histogram = Histogram {
        sample_count: Some(2),
        sample_sum: Some(0.5),
        bucket: vec![Bucket {
            cumulative_count: Some(1),
            upper_bound: Some(1.0),
            ..Bucket::default()
        }],
        schema: Some(3),
        zero_threshold: Some(0.0),
        zero_count: Some(1),
        positive_span: vec![BucketSpan {
            offset: Some(-2),
            length: Some(1),
        }],
        positive_delta: vec![-1],
        ..Histogram::default()
    };
    let bytes = histogram.encode_to_vec();
    let double = |tag: u8, value: f64| {
        let mut field = vec![tag];
        field.extend(value.to_le_bytes());
        field
    };
    let mut expected = vec![0x08, 0x02]; // 1: sample_count, varint 2
    expected.extend(double(0x11, 0.5)); // 2: sample_sum, fixed64
    // 3: bucket, length 11: cumulative_count (1) = 1, upper_bound (2) = 1.0
    expected.extend([0x1a, 11, 0x08, 0x01]);
    expected.extend(double(0x11, 1.0));
    expected.extend([0x28, 0x06]); // 5: schema, zigzag(3) = 6
    expected.extend(double(0x31, 0.0)); // 6: zero_threshold
    expected.extend([0x38, 0x01]); // 7: zero_count
    expected.extend([0x62, 4, 0x08, 0x03, 0x10, 0x01]); // 12: span {offset zigzag(-2), length 1}
    expected.extend([0x68, 0x01]); // 13: positive_delta, zigzag(-1) = 1, unpacked
    assert_eq!(bytes, expected);
}

#[test]
fn a_native_histogram_without_observations_and_zero_threshold_gets_a_no_op_span() {
    let config = NativeConfig {
        zero_threshold: 0.0,
        ..NativeConfig::kube_proxy()
    };
    let empty =
        histogram_of_snapshot(&KubeHistogram::new(Arc::from(vec![1.0]), Some(config)).snapshot());
    assert_eq!(
        empty.positive_span,
        vec![BucketSpan {
            offset: Some(0),
            length: Some(0)
        }]
    );
    assert_eq!((empty.schema, empty.zero_count), (Some(3), Some(0)));
    // With the default threshold the zero bucket tells it apart already.
    let default = histogram_of_snapshot(
        &KubeHistogram::new(Arc::from(vec![1.0]), Some(NativeConfig::kube_proxy())).snapshot(),
    );
    assert!(default.positive_span.is_empty());
    assert_eq!(default.zero_threshold, Some(DEFAULT_ZERO_THRESHOLD));
}

fn fed(native: bool) -> Metrics {
    let metrics = Metrics::with_native_histograms(ProxyMode::Iptables, native);
    let now = SystemTime::now();
    metrics.sync_succeeded(IpFamily::V4, Duration::from_millis(3), now);
    metrics.sync_succeeded(IpFamily::V4, Duration::from_millis(40), now);
    metrics.sync_succeeded(IpFamily::V6, Duration::from_millis(3), now);
    if let Some(iptables) = metrics.iptables() {
        iptables.sync_duration(IpFamily::V4, Duration::from_millis(3), true);
    }
    metrics.changes(3, 5, 1, 2);
    metrics
}

/// Every family of the text format, in its order and with its type, help and series; the
/// histograms with the same count, sum and buckets, and (gate on) native buckets whose
/// counts add up to the count.
#[test]
fn the_protobuf_exposition_is_the_text_one_plus_native_buckets() {
    let metrics = fed(true);
    let text = metrics.encode_text();
    let families = decode(&metrics.encode_protobuf());
    let text_families: Vec<(String, String)> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.to_owned()))
        .collect();
    let proto_families: Vec<(String, String)> = families
        .iter()
        .map(|f| {
            let kind = match f.r#type() {
                MetricType::Counter => "counter",
                MetricType::Gauge => "gauge",
                MetricType::Histogram => "histogram",
                MetricType::Summary => "summary",
                MetricType::Untyped | MetricType::GaugeHistogram => "untyped",
            };
            (f.name.clone().unwrap_or_default(), kind.to_owned())
        })
        .collect();
    assert_eq!(proto_families, text_families);

    let changes = family(
        &families,
        "kubeproxy_sync_proxy_rules_service_changes_total",
    );
    assert_eq!(
        changes.help.as_deref(),
        Some("[ALPHA] Cumulative proxy rules Service changes")
    );
    assert_eq!(
        changes.metric[0].counter.as_ref().and_then(|c| c.value),
        Some(3.0)
    );

    let sync = family(&families, "kubeproxy_sync_proxy_rules_duration_seconds");
    assert_eq!(sync.metric.len(), 2);
    let v4 = &sync.metric[0];
    assert_eq!(
        v4.label
            .iter()
            .map(|l| (l.name.as_deref(), l.value.as_deref()))
            .collect::<Vec<_>>(),
        vec![(Some("ip_family"), Some("IPv4"))]
    );
    let histogram = v4.histogram.as_ref().expect("histogram");
    assert_eq!(histogram.sample_count, Some(2));
    assert!((histogram.sample_sum.unwrap_or_default() - 0.043).abs() < 1e-12);
    // The classic buckets as the text shows them, without +Inf.
    let text_buckets: Vec<u64> = text
        .lines()
        .filter(|l| {
            l.starts_with("kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\"")
                && !l.contains("+Inf")
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse().ok())
        .collect();
    assert_eq!(text_buckets.len(), 15);
    assert_eq!(
        histogram
            .bucket
            .iter()
            .map(|b| b.cumulative_count.unwrap_or_default())
            .collect::<Vec<_>>(),
        text_buckets
    );
    assert_eq!(histogram.bucket[0].upper_bound, Some(0.001));
    assert!(histogram.created_timestamp.is_some());
    // Native: schema 3, the default zero threshold, one bucket per observation.
    assert_eq!(histogram.schema, Some(3));
    assert_eq!(histogram.zero_threshold, Some(DEFAULT_ZERO_THRESHOLD));
    assert_eq!(histogram.zero_count, Some(0));
    let (k3, k40) = (bucket_key(0.003, 3), bucket_key(0.04, 3));
    assert_eq!(
        histogram.positive_span,
        vec![
            BucketSpan {
                offset: Some(k3),
                length: Some(1)
            },
            BucketSpan {
                offset: Some(k40 - k3 - 1),
                length: Some(1)
            }
        ]
    );
    assert_eq!(histogram.positive_delta, vec![1, 0]);
    assert!(histogram.negative_span.is_empty());

    // The iptables-only histogram has native buckets too.
    let full = family(
        &families,
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
    );
    assert_eq!(
        full.metric[0].histogram.as_ref().and_then(|h| h.schema),
        Some(3)
    );
}

#[test]
fn with_the_gate_off_protobuf_carries_classic_histograms_only() {
    let metrics = fed(false);
    let families = decode(&metrics.encode_protobuf());
    let sync = family(&families, "kubeproxy_sync_proxy_rules_duration_seconds");
    let histogram = sync.metric[0].histogram.as_ref().expect("histogram");
    assert_eq!(histogram.sample_count, Some(2));
    assert_eq!(histogram.bucket.len(), 15);
    assert_eq!(
        (
            histogram.schema,
            histogram.zero_threshold,
            histogram.zero_count
        ),
        (None, None, None)
    );
    assert!(histogram.positive_span.is_empty() && histogram.positive_delta.is_empty());
}

/// promhttp answers Prometheus' native-histogram scrape with the delimited protobuf.
#[tokio::test]
async fn the_metrics_server_answers_prometheus_native_scrapes_with_protobuf() {
    let (services, _clock) = start(ProxyMode::Ebpf);
    let addr = services.metrics_addr().expect("metrics address");
    let reply = request_with(
        addr,
        "GET",
        "/metrics",
        &[("Accept", PROMETHEUS_NATIVE_SCRAPE)],
        "",
    )
    .await;
    assert_eq!(reply.status(), 200);
    assert_eq!(
        reply.header("Content-Type"),
        Some(
            "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited; escaping=underscores"
        )
    );
    assert!(!reply.body.is_empty());
    assert!(!reply.body.contains("# TYPE"));
}

/// Prometheus 2.4x's `scrapeAcceptHeaderWithProtobuf` (scrape.go), sent with
/// `--enable-feature=native-histograms`.
pub const PROMETHEUS_NATIVE_SCRAPE: &str = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
