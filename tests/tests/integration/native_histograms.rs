//! kube-proxy's native histograms (the `NativeHistograms` feature gate, on by default as in
//! kube-proxy 1.37) as a real Prometheus ingests them: Debian's Prometheus 2.42 with
//! `--enable-feature=native-histograms`, in the node's network namespace, scrapes the agent
//! every second (it asks for the protobuf exposition first). With the gate on, the native
//! histogram it stores counts the syncs the agent's classic `_count` reports, in schema 3's
//! buckets; with `--feature-gates=NativeHistograms=false` there is no native histogram and
//! the classic series are scraped. Needs root.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context as _, ensure};
use proxy_tests::{
    prometheus::Prometheus,
    scenario::{Scenario, pod_endpoint},
    wait::try_wait_until,
};

const METRICS: &str = "127.0.0.1:10249";
const SYNC: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
const IPV4: &str = "ip_family=\"IPv4\"";
/// Syncs the test makes the agent do before comparing (the first one and endpoint changes).
const SYNCS: u64 = 4;

/// An iptables-mode agent with `args` on `default/web`, synced at least [`SYNCS`] times (each
/// endpoint change is a sync), and Prometheus scraping it.
fn agent_and_prometheus(args: &[&str]) -> anyhow::Result<(Scenario, Prometheus)> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    s.start_agent_with_args("iptables", args)?;
    s.wait_for_first_sync()?;
    let prometheus = Prometheus::start(
        s.topo.node(),
        METRICS.parse::<SocketAddr>()?,
        &["--enable-feature=native-histograms"],
    )?;
    let endpoints = [
        vec![pod_endpoint(1)],
        vec![pod_endpoint(1), pod_endpoint(2)],
    ];
    let mut round = 0;
    while s.agent()?.syncs() < SYNCS {
        let before = s.agent()?.syncs();
        s.write_web(&endpoints[round % 2])?;
        round += 1;
        let agent = s.agent()?;
        try_wait_until(
            "a sync after an endpoint change",
            Duration::from_secs(20),
            Duration::from_millis(100),
            || Ok(agent.syncs() > before),
        )
        .with_context(|| agent.log_tail(30))?;
    }
    Ok((s, prometheus))
}

/// The agent's classic `_count` and `_sum` of IPv4's sync duration (text format).
fn classic(s: &mut Scenario) -> anyhow::Result<(f64, f64)> {
    let text = s.agent()?.metrics()?;
    Ok((
        proxy_tests::http::metric_sum(&text, &format!("{SYNC}_count"), &[IPV4]),
        proxy_tests::http::metric_sum(&text, &format!("{SYNC}_sum"), &[IPV4]),
    ))
}

/// The single value of an instant query, if it has one.
fn value(prometheus: &Prometheus, promql: &str) -> anyhow::Result<Option<f64>> {
    let samples = prometheus.query(promql)?;
    ensure!(samples.len() <= 1, "{promql}: {samples:?}");
    Ok(samples.first().and_then(|sample| sample.value))
}

#[test]
fn prometheus_stores_a_native_histogram_that_counts_the_classic_syncs() -> anyhow::Result<()> {
    let (mut s, prometheus) = agent_and_prometheus(&[])?;
    // histogram_count/histogram_sum only read native histograms.
    let count_query = format!("histogram_count({SYNC}{{{IPV4}}})");
    let sum_query = format!("histogram_sum({SYNC}{{{IPV4}}})");
    let mut seen = (None, 0.0);
    let agreed = try_wait_until(
        "Prometheus' native count equal to the agent's classic count",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || {
            let native = value(&prometheus, &count_query).map_err(other)?;
            let (count, _) = classic(&mut s).map_err(other)?;
            seen = (native, count);
            Ok(native == Some(count) && count >= SYNCS as f64)
        },
    );
    agreed.with_context(|| {
        format!(
            "native {:?}, classic {}\n{}",
            seen.0,
            seen.1,
            prometheus.log()
        )
    })?;
    let (count, sum) = classic(&mut s)?;
    let native_sum = value(&prometheus, &sum_query)?.context("no histogram_sum")?;
    eprintln!("native count {count}, sum {native_sum}; classic sum {sum}");
    // The same observations: the agent has not synced since (the count agreed).
    ensure!(
        (native_sum - sum).abs() <= 1e-9 * sum.max(1.0),
        "native sum {native_sum}, classic {sum}"
    );

    // The stored histogram is in schema 3's buckets: each one 2^(1/8) wide, and their counts
    // add up to the count.
    let stored = prometheus.query(&format!("{SYNC}{{{IPV4}}}"))?;
    let histogram = stored
        .first()
        .and_then(|sample| sample.histogram.clone())
        .with_context(|| format!("no native sample in {stored:?}"))?;
    let buckets = histogram["buckets"]
        .as_array()
        .with_context(|| format!("no buckets in {histogram}"))?;
    let mut in_buckets = 0.0;
    for bucket in buckets {
        let number = |i: usize| bucket[i].as_str().and_then(|t| t.parse::<f64>().ok());
        let (lower, upper, n) = (number(1), number(2), number(3));
        let (Some(lower), Some(upper), Some(n)) = (lower, upper, n) else {
            anyhow::bail!("bucket {bucket}");
        };
        ensure!(
            (upper / lower - 2f64.powf(0.125)).abs() < 1e-9,
            "bucket ({lower}, {upper}] is not a schema 3 bucket: {histogram}"
        );
        in_buckets += n;
    }
    ensure!(
        in_buckets == count,
        "buckets hold {in_buckets}, count {count}: {histogram}"
    );
    Ok(())
}

#[test]
fn without_the_gate_prometheus_stores_only_the_classic_histogram() -> anyhow::Result<()> {
    let (mut s, prometheus) = agent_and_prometheus(&["--feature-gates=NativeHistograms=false"])?;
    let count_query = format!("{SYNC}_count{{{IPV4}}}");
    let mut seen = (None, 0.0);
    try_wait_until(
        "Prometheus' classic count equal to the agent's",
        Duration::from_secs(30),
        Duration::from_millis(500),
        || {
            let scraped = value(&prometheus, &count_query).map_err(other)?;
            let (count, _) = classic(&mut s).map_err(other)?;
            seen = (scraped, count);
            Ok(scraped == Some(count) && count >= SYNCS as f64)
        },
    )
    .with_context(|| {
        format!(
            "scraped {:?}, agent {}\n{}",
            seen.0,
            seen.1,
            prometheus.log()
        )
    })?;
    // Scraped, classic: buckets as series of their own, and no native histogram at all.
    let buckets = prometheus.query(&format!("{SYNC}_bucket{{{IPV4}}}"))?;
    ensure!(buckets.len() == 16, "{buckets:?}");
    for native in [
        format!("histogram_count({SYNC}{{{IPV4}}})"),
        format!("{SYNC}{{{IPV4}}}"),
    ] {
        let samples = prometheus.query(&native)?;
        ensure!(samples.is_empty(), "{native}: {samples:?}");
    }
    Ok(())
}

fn other(error: anyhow::Error) -> proxy_tests::RigError {
    proxy_tests::RigError::Other(format!("{error:#}"))
}
