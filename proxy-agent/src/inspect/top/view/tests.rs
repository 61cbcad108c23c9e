use std::time::Duration;

use proxy_model::{
    cli::TopSort,
    desired::Protocol,
    traffic::{
        FrontendKind, ServicePortLabels, ServiceTrafficKey, TrafficCounts, TrafficReading,
        TrafficSample,
    },
};

use super::*;

fn key(name: &str, frontend: FrontendKind) -> ServiceTrafficKey {
    ServiceTrafficKey {
        service: ServicePortLabels {
            namespace: "default".into(),
            name: name.into(),
            port: "http".into(),
            protocol: Protocol::Tcp,
        },
        frontend,
    }
}

fn sample(
    unit: u64,
    key: &ServiceTrafficKey,
    new: u64,
    rejected: u64,
    dropped: u64,
) -> TrafficSample {
    TrafficSample {
        unit,
        key: key.clone(),
        counts: TrafficCounts {
            new_connections: new,
            rejected,
            dropped_no_local: dropped,
            ..TrafficCounts::default()
        },
    }
}

fn reading(samples: Vec<TrafficSample>) -> TrafficReading {
    TrafficReading {
        services: samples,
        endpoints: Vec::new(),
    }
}

const TWO_SECONDS: Duration = Duration::from_secs(2);

fn totals(tracker: &Tracker, sort: TopSort) -> Vec<(String, u64, u64, u64)> {
    tracker
        .rows(sort)
        .iter()
        .map(|row| {
            (
                format!("{}/{}", row.key.service.name, row.key.frontend),
                row.totals.new,
                row.totals.rejected,
                row.totals.dropped,
            )
        })
        .collect()
}

#[test]
fn totals_start_at_the_first_reading_and_rates_are_per_second() {
    let web = key("web", FrontendKind::ClusterIp);
    let api = key("api", FrontendKind::ClusterIp);
    let mut tracker = Tracker::default();
    tracker.record(&reading(vec![sample(1, &web, 100, 0, 0)]), Duration::ZERO);
    let rows = tracker.rows(TopSort::New);
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].totals,
        Counts::default(),
        "the baseline counts nothing"
    );
    assert_eq!(rows[0].rates, None);

    // web: 12 more over 2 s; api appears with 3 (new since the view started: all of it).
    tracker.record(
        &reading(vec![sample(1, &web, 112, 0, 0), sample(2, &api, 3, 0, 0)]),
        TWO_SECONDS,
    );
    assert_eq!(
        totals(&tracker, TopSort::New),
        [
            ("web/cluster_ip".into(), 12, 0, 0),
            ("api/cluster_ip".into(), 3, 0, 0)
        ]
    );
    let rows = tracker.rows(TopSort::New);
    assert_eq!(rows[0].rates.map(|r| r.new), Some(6.0));
    assert_eq!(rows[1].rates.map(|r| r.new), Some(1.5));

    // Nothing new: rates 0, totals kept; the order falls back on the totals.
    tracker.record(
        &reading(vec![sample(1, &web, 112, 0, 0), sample(2, &api, 3, 0, 0)]),
        TWO_SECONDS,
    );
    let rows = tracker.rows(TopSort::New);
    assert_eq!(rows[0].rates.map(|r| r.new), Some(0.0));
    assert_eq!(
        totals(&tracker, TopSort::New),
        [
            ("web/cluster_ip".into(), 12, 0, 0),
            ("api/cluster_ip".into(), 3, 0, 0)
        ]
    );
    assert_eq!(
        totals(&tracker, TopSort::Name),
        [
            ("api/cluster_ip".into(), 3, 0, 0),
            ("web/cluster_ip".into(), 12, 0, 0)
        ]
    );
}

#[test]
fn a_unit_that_goes_back_or_changes_key_started_over_and_no_rate_is_negative() {
    let web = key("web", FrontendKind::ClusterIp);
    let other = key("other", FrontendKind::NodePort);
    let mut tracker = Tracker::default();
    tracker.record(&reading(vec![sample(7, &web, 50, 5, 0)]), Duration::ZERO);
    tracker.record(&reading(vec![sample(7, &web, 60, 5, 0)]), TWO_SECONDS);
    // The chain was rewritten: counters restarted and counted 4 since.
    tracker.record(&reading(vec![sample(7, &web, 4, 0, 0)]), TWO_SECONDS);
    let rows = tracker.rows(TopSort::New);
    assert_eq!(rows[0].totals.new, 14);
    assert_eq!(rows[0].rates.map(|r| r.new), Some(2.0));
    assert!(rows.iter().all(|row| {
        let r = row.rates.unwrap_or_default();
        r.new >= 0.0 && r.rejected >= 0.0 && r.dropped >= 0.0
    }));
    // The id now counts for another frontend, from 0: web keeps what it had.
    tracker.record(&reading(vec![sample(7, &other, 2, 0, 1)]), TWO_SECONDS);
    assert_eq!(
        totals(&tracker, TopSort::Name),
        [
            ("other/node_port".into(), 2, 0, 1),
            ("web/cluster_ip".into(), 14, 0, 0)
        ]
    );
    // A unit gone and back starts over too.
    tracker.record(&reading(vec![]), TWO_SECONDS);
    tracker.record(&reading(vec![sample(7, &other, 3, 0, 1)]), TWO_SECONDS);
    assert_eq!(
        totals(&tracker, TopSort::Name),
        [
            ("other/node_port".into(), 5, 0, 2),
            ("web/cluster_ip".into(), 14, 0, 0)
        ]
    );
}

#[test]
fn units_of_one_key_add_up_and_each_sort_orders_by_its_count() {
    let web_np = key("web", FrontendKind::NodePort);
    let empty = key("empty", FrontendKind::ClusterIp);
    let local = key("local", FrontendKind::NodePort);
    let mut tracker = Tracker::default();
    tracker.record(&reading(vec![]), Duration::ZERO);
    tracker.record(
        &reading(vec![
            // The NodePort's IPv4 and IPv6 rules.
            sample(1, &web_np, 2, 0, 0),
            sample(2, &web_np, 3, 0, 0),
            sample(3, &empty, 0, 4, 0),
            sample(4, &local, 0, 0, 6),
        ]),
        Duration::from_secs(1),
    );
    let order = |sort| -> Vec<String> {
        tracker
            .rows(sort)
            .iter()
            .map(|r| r.key.service.name.clone())
            .collect()
    };
    assert_eq!(order(TopSort::New), ["web", "empty", "local"]);
    assert_eq!(order(TopSort::Rejected), ["empty", "local", "web"]);
    assert_eq!(order(TopSort::Dropped), ["local", "empty", "web"]);
    assert_eq!(order(TopSort::Name), ["empty", "local", "web"]);
    assert_eq!(tracker.rows(TopSort::New)[0].totals.new, 5);
    assert_eq!(sort_for_key(b'r'), Some(TopSort::Rejected));
    assert_eq!(sort_for_key(b'N'), Some(TopSort::Name));
    assert_eq!(sort_for_key(b'x'), None);
}

fn header(keys: bool) -> Header<'static> {
    Header {
        source: "eBPF (/sys/fs/bpf/kubeproxy-rs)",
        interval: Duration::from_secs(2),
        elapsed: Duration::from_secs(75),
        sort: TopSort::New,
        keys,
        error: None,
    }
}

#[test]
fn a_frame_fits_its_width_and_height_and_says_what_it_left_out() {
    let keys: Vec<ServiceTrafficKey> = (0..10)
        .map(|i| key(&format!("svc{i}"), FrontendKind::ClusterIp))
        .collect();
    let mut tracker = Tracker::default();
    tracker.record(&reading(vec![]), Duration::ZERO);
    let samples = keys
        .iter()
        .enumerate()
        .map(|(i, k)| sample(i as u64, k, 10 - i as u64, 0, 0))
        .collect();
    tracker.record(&reading(samples), Duration::from_secs(1));
    let rows = tracker.rows(TopSort::New);
    let frame = render(&header(true), &rows, 60, 8);
    let lines: Vec<&str> = frame.lines().collect();
    assert_eq!(lines.len(), 8, "{frame}");
    assert!(lines.iter().all(|l| l.chars().count() <= 60), "{frame}");
    assert!(lines[0].starts_with("kubeproxy-rs top: eBPF"), "{frame}");
    assert!(lines[1].starts_with("keys: n new/s"), "{frame}");
    assert!(lines[2].starts_with("SERVICE"), "{frame}");
    assert!(lines[3].starts_with("default/svc0 "), "{frame}");
    assert!(lines[6].starts_with("default/svc3 "), "{frame}");
    assert_eq!(lines[7], "... 6 more");

    // Wide enough, everything; the totals are the last three columns.
    let frame = render(&header(false), &rows, 200, 100);
    let lines: Vec<&str> = frame.lines().collect();
    assert_eq!(lines.len(), 12, "{frame}");
    assert!(
        lines[0].ends_with("| every 2s | up 1:15 | sort: new/s"),
        "{frame}"
    );
    let words: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(
        words,
        [
            "default/svc0",
            "http/TCP",
            "cluster_ip",
            "10.0",
            "0.0",
            "0.0",
            "10",
            "0",
            "0"
        ],
        "{frame}"
    );
    // Nothing at all fits: no line, no panic.
    assert_eq!(render(&header(false), &rows, 0, 0), "");
    assert_eq!(render(&header(false), &rows, 10, 1), "kubeproxy-\n");
}

#[test]
fn names_that_are_not_names_are_escaped() {
    let mut hostile = key("web", FrontendKind::ClusterIp);
    hostile.service.namespace = "\u{1b}[2J".into();
    hostile.service.name = "caf\u{e9}\n".into();
    hostile.service.port = String::new();
    let mut tracker = Tracker::default();
    tracker.record(&reading(vec![sample(1, &hostile, 1, 0, 0)]), Duration::ZERO);
    let frame = render(&header(false), &tracker.rows(TopSort::Name), 200, 10);
    assert!(!frame.contains('\u{1b}'), "{frame:?}");
    let row = frame.lines().nth(2).unwrap_or_default();
    let words: Vec<&str> = row.split_whitespace().take(2).collect();
    assert_eq!(words, ["\\u{1b}[2J/caf\\u{e9}\\n", "-/TCP"], "{frame}");
    assert_eq!(escape("ok-1.a_b c"), "ok-1.a_b c");
}

#[test]
fn intervals_take_seconds_or_a_unit() {
    assert_eq!(parse_interval("2"), Some(Duration::from_secs(2)));
    assert_eq!(parse_interval("1s"), Some(Duration::from_secs(1)));
    assert_eq!(parse_interval("0.5"), Some(Duration::from_millis(500)));
    assert_eq!(parse_interval("250ms"), Some(Duration::from_millis(250)));
    for bad in ["", "0", "-1", "fast", "NaN", "inf", "1h", "10ms"] {
        assert_eq!(parse_interval(bad), None, "{bad}");
    }
}
