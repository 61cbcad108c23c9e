//! Content negotiation and the classic text format, against what client_golang's `promhttp`
//! and `expfmt` answer (prometheus/common v0.66: the escaping scheme is in the header).

use crate::http_servers::exposition::{Format, go_float, negotiate, openmetrics_to_text};

const PROMETHEUS_SCRAPER: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

#[test]
fn negotiation_follows_expfmt() {
    let text = "text/plain; version=0.0.4; charset=utf-8; escaping=underscores";
    for accept in [
        None,
        Some(""),
        Some("*/*"),
        Some("text/plain;version=0.0.4"),
        Some("text/plain"),
        Some("application/json"),
        // A version we do not know is passed over, as expfmt does.
        Some("application/openmetrics-text;version=2.0.0"),
        // The protobuf text encodings are not offered: the next entry (text) answers.
        Some(
            "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text,text/plain;version=0.0.4;q=0.5",
        ),
        // Nor protobuf of another message, or without an encoding.
        Some("application/vnd.google.protobuf;proto=other.Message;encoding=delimited"),
        Some("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily"),
        // Quality decides, not the order written.
        Some("application/openmetrics-text;q=0.2,text/plain;q=0.9"),
    ] {
        let negotiated = negotiate(accept);
        assert_eq!(negotiated.format, Format::Text, "{accept:?}");
        assert_eq!(negotiated.content_type, text, "{accept:?}");
    }
    // Prometheus with native histograms lists protobuf first; expfmt answers it.
    let protobuf = "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited; escaping=underscores";
    for accept in [
        super::protobuf::PROMETHEUS_NATIVE_SCRAPE,
        "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited",
        // Quality first: protobuf preferred although listed last.
        "text/plain;version=0.0.4;q=0.5,application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited",
    ] {
        let negotiated = negotiate(Some(accept));
        assert_eq!(negotiated.format, Format::Protobuf, "{accept}");
        assert_eq!(negotiated.content_type, protobuf, "{accept}");
    }
    // Text listed with a higher quality wins over protobuf.
    assert_eq!(
        negotiate(Some("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.4,text/plain;q=0.9")).format,
        Format::Text
    );
    let om = negotiate(Some(PROMETHEUS_SCRAPER));
    assert_eq!(om.format, Format::OpenMetrics("1.0.0"));
    assert_eq!(
        om.content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
    );
    assert_eq!(
        negotiate(Some("application/openmetrics-text")).content_type,
        "application/openmetrics-text; version=0.0.1; charset=utf-8; escaping=underscores"
    );
    assert_eq!(
        negotiate(Some("text/plain;version=0.0.4;escaping=allow-utf-8")).content_type,
        "text/plain; version=0.0.4; charset=utf-8; escaping=allow-utf-8"
    );
}

#[test]
fn floats_are_written_as_go_writes_them() {
    for (value, go) in [
        (0.0, "0"),
        (1.0, "1"),
        (-1.0, "-1"),
        (0.001, "0.001"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (16.384, "16.384"),
        (0.25, "0.25"),
        (32768.0, "32768"),
        (131_072.0, "131072"),
        (1_048_576.0, "1.048576e+06"),
        (1_000_000.0, "1e+06"),
        (1_732_520_000.123, "1.732520000123e+09"),
        (f64::INFINITY, "+Inf"),
        (f64::NEG_INFINITY, "-Inf"),
        (f64::NAN, "NaN"),
        (123.456, "123.456"),
        (1e21, "1e+21"),
    ] {
        assert_eq!(go_float(value), go, "{value}");
    }
}

#[test]
fn openmetrics_becomes_the_classic_text() {
    let openmetrics = "\
# HELP kubeproxy_sync_proxy_rules_endpoint_changes [ALPHA] Cumulative proxy rules Endpoint changes.
# TYPE kubeproxy_sync_proxy_rules_endpoint_changes counter
kubeproxy_sync_proxy_rules_endpoint_changes_total 3
kubeproxy_sync_proxy_rules_endpoint_changes_created 1700000000.5
# HELP kubeproxy_a_duration_seconds [ALPHA] A histogram.
# TYPE kubeproxy_a_duration_seconds histogram
kubeproxy_a_duration_seconds_sum{ip_family=\"IPv6\"} 0.5
kubeproxy_a_duration_seconds_count{ip_family=\"IPv6\"} 1
kubeproxy_a_duration_seconds_bucket{le=\"0.001\",ip_family=\"IPv6\"} 0
kubeproxy_a_duration_seconds_bucket{le=\"1.0\",ip_family=\"IPv6\"} 1
kubeproxy_a_duration_seconds_bucket{le=\"+Inf\",ip_family=\"IPv6\"} 1
kubeproxy_a_duration_seconds_sum{ip_family=\"IPv4\"} 0.0
kubeproxy_a_duration_seconds_count{ip_family=\"IPv4\"} 0
kubeproxy_a_duration_seconds_bucket{le=\"0.001\",ip_family=\"IPv4\"} 0
kubeproxy_a_duration_seconds_bucket{le=\"1.0\",ip_family=\"IPv4\"} 0
kubeproxy_a_duration_seconds_bucket{le=\"+Inf\",ip_family=\"IPv4\"} 0
# HELP kubeproxy_b_timestamp_seconds With \\\\ a backslash and \\\"quotes\\\".
# TYPE kubeproxy_b_timestamp_seconds gauge
kubeproxy_b_timestamp_seconds{ip_family=\"IPv4\",x=\"a \\\"}\\\" b\"} 1732520000.123
# TYPE kubeproxy_c unknown
kubeproxy_c 7
# EOF
";
    let expected = "\
# HELP kubeproxy_a_duration_seconds [ALPHA] A histogram.
# TYPE kubeproxy_a_duration_seconds histogram
kubeproxy_a_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.001\"} 0
kubeproxy_a_duration_seconds_bucket{ip_family=\"IPv4\",le=\"1\"} 0
kubeproxy_a_duration_seconds_bucket{ip_family=\"IPv4\",le=\"+Inf\"} 0
kubeproxy_a_duration_seconds_sum{ip_family=\"IPv4\"} 0
kubeproxy_a_duration_seconds_count{ip_family=\"IPv4\"} 0
kubeproxy_a_duration_seconds_bucket{ip_family=\"IPv6\",le=\"0.001\"} 0
kubeproxy_a_duration_seconds_bucket{ip_family=\"IPv6\",le=\"1\"} 1
kubeproxy_a_duration_seconds_bucket{ip_family=\"IPv6\",le=\"+Inf\"} 1
kubeproxy_a_duration_seconds_sum{ip_family=\"IPv6\"} 0.5
kubeproxy_a_duration_seconds_count{ip_family=\"IPv6\"} 1
# HELP kubeproxy_b_timestamp_seconds With \\\\ a backslash and \"quotes\".
# TYPE kubeproxy_b_timestamp_seconds gauge
kubeproxy_b_timestamp_seconds{ip_family=\"IPv4\",x=\"a \\\"}\\\" b\"} 1.732520000123e+09
# TYPE kubeproxy_c untyped
kubeproxy_c 7
# HELP kubeproxy_sync_proxy_rules_endpoint_changes_total [ALPHA] Cumulative proxy rules Endpoint changes.
# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter
kubeproxy_sync_proxy_rules_endpoint_changes_total 3
";
    assert_eq!(openmetrics_to_text(openmetrics), expected);
}
