//! What a sync did → logs, metrics and the health and latency reports of the node services.

use std::{
    collections::BTreeSet,
    time::{Duration, SystemTime},
};

use tracing::{debug, error, info, warn};

use crate::{
    dataplane::{EbpfSyncOutcome, SyncOutcome},
    http_servers::{
        HttpServers,
        metrics::{IptablesTable, Metrics},
    },
    sync_runner::SyncReason,
};
use proxy_dataplane_ebpf::GcProgress;
use proxy_model::{
    desired::{IpFamily, ServicePortName, Snapshot},
    objects::{Changes, Objects},
};

/// Logs one sync's outcome and records its metrics (sync durations, rule counts, conntrack
/// cleanup, the service ids `inspect` reads).
/// `changed`: how many service ports the sync was asked to cover (`None`: all, a full sync).
/// `snapshot`: what the sync took before the dataplane's part (the store's changes and the
/// snapshot's update), logged beside the dataplane's own `elapsed_us` so a slow sync shows
/// which half it was.
pub fn record_sync(
    outcome: &SyncOutcome,
    reason: SyncReason,
    changed: Option<usize>,
    snapshot: Duration,
    metrics: &Metrics,
) {
    let partial = changed.is_some();
    let changed = changed.unwrap_or(0);
    let snapshot_us = snapshot.as_micros() as u64;
    match outcome {
        SyncOutcome::Ebpf(outcome) => record_ebpf(outcome, reason, changed, snapshot_us, metrics),
        SyncOutcome::Iptables(results) => {
            for (family, result) in results {
                match result {
                    Ok(report) => {
                        info!(
                            family = report.family.as_k8s(),
                            full = report.full,
                            changed,
                            filter_rules = report.filter_rules,
                            nat_rules = report.nat_rules,
                            deleted_chains = report.deleted_chains,
                            snapshot_us,
                            elapsed_us = report.elapsed.as_micros() as u64,
                            "sync applied"
                        );
                        if let Some(ipt) = metrics.iptables() {
                            ipt.sync_duration(report.family, report.elapsed, report.full);
                            // proxier.go: the filter table is always written whole; nat's
                            // "last" counts only this sync's restore input.
                            let filter = report.filter_rules as u64;
                            ipt.rules(report.family, IptablesTable::Filter, filter, filter);
                            ipt.rules(
                                report.family,
                                IptablesTable::Nat,
                                report.nat_rules as u64,
                                report.nat_rules_written as u64,
                            );
                        }
                        if let Some(cleanup) = &report.conntrack {
                            let family = report.family;
                            match &cleanup.result {
                                Ok(cleaned) => {
                                    debug!(
                                        family = family.as_k8s(),
                                        ?cleaned,
                                        "conntrack reconciled"
                                    );
                                    if cleaned.deleted > 0 {
                                        info!(
                                            family = family.as_k8s(),
                                            deleted = cleaned.deleted,
                                            "deleted stale conntrack entries"
                                        );
                                    }
                                    metrics.conntrack_reconciled(
                                        family,
                                        cleanup.elapsed,
                                        cleaned.deleted as u64,
                                    );
                                }
                                Err(error) => {
                                    warn!(family = family.as_k8s(), %error, "conntrack cleanup failed");
                                }
                            }
                        }
                    }
                    Err(error) => {
                        if let Some(ipt) = metrics.iptables() {
                            ipt.restore_failed(*family, partial);
                        }
                        error!(%error, "iptables sync failed; the next sync is a full one");
                    }
                }
            }
        }
    }
}

fn record_ebpf(
    outcome: &EbpfSyncOutcome,
    reason: SyncReason,
    changed: usize,
    snapshot_us: u64,
    metrics: &Metrics,
) {
    for error in &outcome.errors {
        warn!("{error}");
    }
    if outcome.errors.iter().any(|error| error.is_capacity()) {
        warn!(
            count = outcome.unfit.len(),
            capacity_errors = outcome.capacity_errors,
            service_ports = %outcome.unfit.join(", "),
            "service ports that do not fit in the eBPF maps are not programmed (or keep their \
             previous backends): a full map needs a larger --bpf-map-frontends / \
             --bpf-map-backends / --bpf-map-maglev; a Service or namespace over its share of a \
             map is its owner's to shrink (--bpf-max-frontends-per-service)"
        );
    }
    let summary = &outcome.summary;
    if summary.frontends_unsupported > 0 {
        warn!(
            count = summary.frontends_unsupported,
            "frontends the eBPF dataplane cannot program (mixed-family backends)"
        );
    }
    info!(
        ?reason,
        changed,
        written = summary.frontends_written,
        removed = summary.frontends_removed,
        unchanged = summary.frontends_unchanged,
        deferred = summary.frontends_deferred,
        removed_backends = summary.removed_backends.len(),
        udp_sockets_destroyed = summary.udp_sockets_destroyed,
        conntrack_purged = summary.conntrack_purged,
        conntrack_purge_queued = summary.conntrack_purge_queued,
        snapshot_us,
        elapsed_us = outcome.elapsed.as_micros() as u64,
        "sync applied"
    );
    if let Some(ebpf) = metrics.ebpf() {
        for &(map, entries, capacity) in &outcome.map_usage {
            ebpf.map_usage(map, entries, capacity);
        }
    }
}

/// The tc conntrack GC's rounds and what the last one left.
pub fn record_conntrack_gc(progress: &GcProgress, metrics: &Metrics) {
    let Some(ebpf) = metrics.ebpf() else {
        return;
    };
    for _ in 0..progress.rounds {
        ebpf.conntrack_gc_run();
    }
    if let Some(remaining) = progress.remaining {
        ebpf.conntrack_entries(u64::try_from(remaining).unwrap_or(u64::MAX));
    }
}

/// Health timestamps, sync metrics, health check node ports and network programming latency
/// after a successful sync of both families.
pub fn report_sync(
    http_servers: &HttpServers,
    changes: &Changes,
    snapshot: &Snapshot,
    scope: Option<&BTreeSet<ServicePortName>>,
    elapsed: Duration,
) {
    http_servers.synced(&IpFamily::ALL, snapshot, scope, elapsed);
    for family in IpFamily::ALL {
        let of_family: Vec<SystemTime> = changes
            .trigger_times
            .values()
            .flatten()
            .filter(|(f, _)| *f == family)
            .map(|(_, time)| *time)
            .collect();
        http_servers.network_programmed(family, &of_family);
    }
}

pub fn log_snapshot_size(objects: &Objects, snapshot: &Snapshot) {
    debug!(
        services = objects.services.len(),
        endpoint_slices = objects.endpoint_slices().len(),
        service_ports_v4 = snapshot.v4.service_ports.len(),
        service_ports_v6 = snapshot.v6.service_ports.len(),
        "snapshot"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_model::proxy_mode::ProxyMode;

    #[test]
    fn conntrack_gc_rounds_and_the_entries_left_are_recorded() {
        let metrics = Metrics::new(ProxyMode::Ebpf);
        record_conntrack_gc(
            &GcProgress {
                rounds: 2,
                remaining: Some(6),
            },
            &metrics,
        );
        record_conntrack_gc(
            &GcProgress {
                rounds: 0,
                remaining: None,
            },
            &metrics,
        );
        let text = metrics.encode();
        let sample = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                .map(str::to_owned)
        };
        assert_eq!(
            sample("kubeproxy_ebpf_conntrack_gc_runs_total").as_deref(),
            Some("2")
        );
        assert_eq!(
            sample("kubeproxy_ebpf_conntrack_entries").as_deref(),
            Some("6")
        );
    }
}
