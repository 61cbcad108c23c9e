//! client-go's `rest_client_*` families as kube-proxy serves them (component-base's
//! `metrics/prometheus/restclient`): hidden without series, and with upstream's names, types,
//! help, label names and buckets in the text, OpenMetrics and protobuf expositions.

use super::{protobuf::decode, *};
use crate::http_servers::{
    histogram::NativeConfig, metrics::Metrics, protobuf::MetricType, rest_client::RestClientMetrics,
};

const HOST: &str = "10.96.0.1:443";
const REQUESTS_HELP: &str =
    "[ALPHA] Number of HTTP requests, partitioned by status code, method, and host.";
const DURATION_HELP: &str = "[ALPHA] Request latency in seconds. Broken down by verb, and host.";

/// Metrics serving `rest_client`'s families, after three 200s, a 404, a failed GET and a
/// POST; two GET latencies (30 ms, 2 s).
fn fed(mode: ProxyMode) -> (Metrics, RestClientMetrics) {
    let rest_client = RestClientMetrics::new(Some(NativeConfig::kube_proxy()));
    let metrics = Metrics::with_rest_client(mode, rest_client.clone());
    for _ in 0..3 {
        rest_client.request_done(Some(200), "GET", HOST);
    }
    rest_client.request_done(Some(404), "GET", HOST);
    rest_client.request_done(None, "GET", HOST);
    rest_client.request_done(Some(201), "POST", HOST);
    rest_client.observe_duration("GET", HOST, Duration::from_millis(30));
    rest_client.observe_duration("GET", HOST, Duration::from_secs(2));
    (metrics, rest_client)
}

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

#[test]
fn without_requests_neither_family_is_shown() {
    for mode in [ProxyMode::Ebpf, ProxyMode::Iptables] {
        let metrics = Metrics::new(mode);
        for text in [metrics.encode(), metrics.encode_text()] {
            assert!(!text.contains("rest_client_"), "{text}");
        }
        let families = decode(&metrics.encode_protobuf());
        assert!(!families.is_empty());
        assert!(
            families
                .iter()
                .all(|f| !f.name.as_deref().unwrap_or("").starts_with("rest_client_"))
        );
    }
}

#[test]
fn the_text_exposition_has_client_gos_names_help_labels_and_buckets() {
    for mode in [ProxyMode::Ebpf, ProxyMode::Iptables] {
        let (metrics, _) = fed(mode);
        let text = metrics.encode_text();
        let lines = lines(&text);
        for expected in [
            format!("# HELP rest_client_requests_total {REQUESTS_HELP}"),
            "# TYPE rest_client_requests_total counter".to_owned(),
            format!("rest_client_requests_total{{code=\"200\",host=\"{HOST}\",method=\"GET\"}} 3"),
            format!("rest_client_requests_total{{code=\"404\",host=\"{HOST}\",method=\"GET\"}} 1"),
            format!(
                "rest_client_requests_total{{code=\"<error>\",host=\"{HOST}\",method=\"GET\"}} 1"
            ),
            format!("rest_client_requests_total{{code=\"201\",host=\"{HOST}\",method=\"POST\"}} 1"),
            format!("# HELP rest_client_request_duration_seconds {DURATION_HELP}"),
            "# TYPE rest_client_request_duration_seconds histogram".to_owned(),
            format!(
                "rest_client_request_duration_seconds_bucket{{host=\"{HOST}\",verb=\"GET\",le=\"0.025\"}} 0"
            ),
            format!(
                "rest_client_request_duration_seconds_bucket{{host=\"{HOST}\",verb=\"GET\",le=\"0.1\"}} 1"
            ),
            format!(
                "rest_client_request_duration_seconds_bucket{{host=\"{HOST}\",verb=\"GET\",le=\"2\"}} 2"
            ),
            format!("rest_client_request_duration_seconds_count{{host=\"{HOST}\",verb=\"GET\"}} 2"),
        ] {
            assert!(lines.contains(&expected.as_str()), "{expected} in\n{text}");
        }
        let bounds: Vec<&str> = lines
            .iter()
            .filter(|line| line.starts_with("rest_client_request_duration_seconds_bucket{"))
            .filter_map(|line| line.split("le=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(
            bounds,
            [
                "0.005", "0.025", "0.1", "0.25", "0.5", "1", "2", "4", "8", "15", "30", "60",
                "+Inf"
            ]
        );
    }
}

#[test]
fn the_openmetrics_exposition_names_the_counter_family_without_total() {
    let (metrics, _) = fed(ProxyMode::Ebpf);
    let text = metrics.encode();
    let lines = lines(&text);
    for expected in [
        format!("# HELP rest_client_requests {REQUESTS_HELP}"),
        "# TYPE rest_client_requests counter".to_owned(),
        format!("rest_client_requests_total{{code=\"200\",host=\"{HOST}\",method=\"GET\"}} 3"),
        "# TYPE rest_client_request_duration_seconds histogram".to_owned(),
        format!(
            "rest_client_request_duration_seconds_bucket{{le=\"60.0\",host=\"{HOST}\",verb=\"GET\"}} 2"
        ),
        format!("rest_client_request_duration_seconds_count{{host=\"{HOST}\",verb=\"GET\"}} 2"),
    ] {
        assert!(lines.contains(&expected.as_str()), "{expected} in\n{text}");
    }
}

#[test]
fn the_protobuf_exposition_has_both_families_with_native_buckets() {
    let (metrics, _) = fed(ProxyMode::Iptables);
    let families = decode(&metrics.encode_protobuf());
    let family = |name: &str| {
        families
            .iter()
            .find(|f| f.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no family {name}"))
    };
    let label_pairs = |metric: &crate::http_servers::protobuf::Metric| -> Vec<(String, String)> {
        metric
            .label
            .iter()
            .map(|pair| {
                (
                    pair.name.clone().unwrap_or_default(),
                    pair.value.clone().unwrap_or_default(),
                )
            })
            .collect()
    };

    let requests = family("rest_client_requests_total");
    assert_eq!(requests.r#type(), MetricType::Counter);
    assert_eq!(requests.help.as_deref(), Some(REQUESTS_HELP));
    let counts: BTreeMap<Vec<(String, String)>, f64> = requests
        .metric
        .iter()
        .map(|metric| {
            let value = metric
                .counter
                .as_ref()
                .and_then(|c| c.value)
                .unwrap_or(-1.0);
            (label_pairs(metric), value)
        })
        .collect();
    let key = |code: &str, method: &str| {
        vec![
            ("code".to_owned(), code.to_owned()),
            ("host".to_owned(), HOST.to_owned()),
            ("method".to_owned(), method.to_owned()),
        ]
    };
    assert_eq!(counts.get(&key("200", "GET")), Some(&3.0));
    assert_eq!(counts.get(&key("<error>", "GET")), Some(&1.0));
    assert_eq!(counts.get(&key("201", "POST")), Some(&1.0));
    assert_eq!(counts.len(), 4);

    let duration = family("rest_client_request_duration_seconds");
    assert_eq!(duration.r#type(), MetricType::Histogram);
    assert_eq!(duration.help.as_deref(), Some(DURATION_HELP));
    assert_eq!(duration.metric.len(), 1);
    let metric = &duration.metric[0];
    assert_eq!(
        label_pairs(metric),
        vec![
            ("host".to_owned(), HOST.to_owned()),
            ("verb".to_owned(), "GET".to_owned()),
        ]
    );
    let histogram = metric.histogram.as_ref().expect("histogram");
    assert_eq!(histogram.sample_count, Some(2));
    let bounds: Vec<f64> = histogram
        .bucket
        .iter()
        .filter_map(|b| b.upper_bound)
        .collect();
    assert_eq!(
        bounds,
        [
            0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0
        ]
    );
    // The native buckets (schema 3, as the agent's other histograms) hold both observations.
    assert_eq!(histogram.schema, Some(3));
    let native: i64 = histogram
        .positive_delta
        .iter()
        .scan(0, |count, delta| {
            *count += delta;
            Some(*count)
        })
        .sum();
    assert_eq!(native, 2);
}

/// The families the client records into are the ones served: clones share their series.
#[test]
fn a_clone_records_into_the_served_families() {
    let (metrics, rest_client) = fed(ProxyMode::Ebpf);
    rest_client.clone().request_done(Some(200), "GET", HOST);
    assert_eq!(metrics.rest_client().requests("200", "GET", HOST), 4);
    assert_eq!(metrics.rest_client().duration_count("GET", HOST), 2);
    assert!(metrics.encode_text().contains(&format!(
        "rest_client_requests_total{{code=\"200\",host=\"{HOST}\",method=\"GET\"}} 4"
    )));
}
