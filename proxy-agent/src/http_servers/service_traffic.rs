//! Per-Service traffic (`kubeproxy_rs_service_*`, `kubeproxy_rs_endpoint_new_connections`):
//! each dataplane's [`TrafficReading`] turned into counters by Service port, protocol and
//! frontend kind (and, for packets and bytes, where the dataplane sees them, direction). Readings count per unit (a frontend's service id, a rule); the counters here
//! grow by each unit's increase since the last reading, so a unit that disappears keeps what it
//! counted, and one that starts over (an id handed out again, a chain rewritten) counts from 0.
//! At most `--service-traffic-max-series` Service keys get series; the ones past it are counted
//! in a gauge, not exported.

use std::{
    collections::{HashMap, HashSet},
    sync::{Mutex, PoisonError},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
};
use proxy_model::traffic::{
    PacketCounts, ServicePortLabels, ServiceTrafficKey, TrafficCounts, TrafficReading,
};

pub const NEW_CONNECTIONS: &str = "kubeproxy_rs_service_new_connections";
pub const REJECTED: &str = "kubeproxy_rs_service_rejected";
pub const DROPPED: &str = "kubeproxy_rs_service_dropped";
pub const PACKETS: &str = "kubeproxy_rs_service_packets";
pub const BYTES: &str = "kubeproxy_rs_service_bytes";
pub const ENDPOINT_NEW_CONNECTIONS: &str = "kubeproxy_rs_endpoint_new_connections";
pub const SERIES_CAPPED: &str = "kubeproxy_rs_service_traffic_series_capped";

// Fields in alphabetical order, as Go's client sorts label names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct ServiceLabel {
    frontend: &'static str,
    name: String,
    namespace: String,
    port: String,
    protocol: &'static str,
}

impl ServiceLabel {
    fn of(key: &ServiceTrafficKey) -> Self {
        Self {
            frontend: key.frontend.label(),
            name: key.service.name.clone(),
            namespace: key.service.namespace.clone(),
            port: key.service.port.clone(),
            protocol: key.service.protocol.as_k8s(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct DropLabel {
    frontend: &'static str,
    name: String,
    namespace: String,
    port: String,
    protocol: &'static str,
    reason: &'static str,
}

/// A Service's packets or bytes in one `direction`: `forward` (client → backend) or `reply`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct DirectionLabel {
    direction: &'static str,
    frontend: &'static str,
    name: String,
    namespace: String,
    port: String,
    protocol: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(super) struct EndpointLabel {
    endpoint: String,
    name: String,
    namespace: String,
    port: String,
    protocol: &'static str,
}

/// The families, and what the last reading said of each unit.
#[derive(Debug, Default)]
pub struct ServiceTrafficMetrics {
    pub(super) new_connections: Family<ServiceLabel, Counter>,
    pub(super) rejected: Family<ServiceLabel, Counter>,
    pub(super) dropped: Family<DropLabel, Counter>,
    pub(super) packets: Family<DirectionLabel, Counter>,
    pub(super) bytes: Family<DirectionLabel, Counter>,
    pub(super) endpoint_new_connections: Family<EndpointLabel, Counter>,
    pub(super) series_capped: Gauge,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// `--service-traffic-max-series`; 0: nothing is exported.
    max_series: u32,
    endpoints: bool,
    last: HashMap<u64, (ServiceTrafficKey, TrafficCounts)>,
    last_endpoints: HashMap<u64, (ServicePortLabels, String, u64)>,
    /// The Service keys (and endpoint series) that have series.
    exported: HashSet<ServiceTrafficKey>,
    exported_endpoints: HashSet<(ServicePortLabels, String)>,
    capped: HashSet<ServiceTrafficKey>,
}

/// How much a unit's count grew: all of it when the unit is new or started over.
fn increase(previous: Option<u64>, value: u64) -> u64 {
    match previous {
        Some(previous) if value >= previous => value - previous,
        _ => value,
    }
}

impl ServiceTrafficMetrics {
    /// `--service-traffic-max-series` and `--service-traffic-endpoints`.
    pub fn set_limits(&self, max_series: u32, endpoints: bool) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.max_series = max_series;
        state.endpoints = endpoints;
    }

    /// Whether readings are wanted at all.
    pub fn enabled(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .max_series
            > 0
    }

    /// Adds what each unit counted since the last reading.
    pub fn record(&self, reading: &TrafficReading) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let state = &mut *state;
        let max = usize::try_from(state.max_series).unwrap_or(usize::MAX);
        // What each unit's packets were at the last reading (read before it is replaced).
        let previous_packets: HashMap<u64, Option<PacketCounts>> = reading
            .services
            .iter()
            .filter_map(|sample| {
                let (key, counts) = state.last.get(&sample.unit)?;
                (*key == sample.key).then_some((sample.unit, counts.packets))
            })
            .collect();
        let mut seen = HashSet::with_capacity(reading.services.len());
        for sample in &reading.services {
            seen.insert(sample.unit);
            let previous = state
                .last
                .get(&sample.unit)
                .filter(|(key, _)| *key == sample.key)
                .map(|(_, counts)| *counts);
            state
                .last
                .insert(sample.unit, (sample.key.clone(), sample.counts));
            if !state.exported.contains(&sample.key) {
                if state.exported.len() >= max {
                    state.capped.insert(sample.key.clone());
                    continue;
                }
                state.exported.insert(sample.key.clone());
            }
            let label = ServiceLabel::of(&sample.key);
            let was = |field: fn(&TrafficCounts) -> u64| previous.as_ref().map(field);
            let counts = &sample.counts;
            let add = |family: &Family<ServiceLabel, Counter>, by: u64| {
                // A zero still creates the series: a Service that was tried shows a 0 rate.
                family.get_or_create(&label).inc_by(by);
            };
            add(
                &self.new_connections,
                increase(was(|c| c.new_connections), counts.new_connections),
            );
            add(
                &self.rejected,
                increase(was(|c| c.rejected), counts.rejected),
            );
            for (reason, value, before) in [
                (
                    "source_range",
                    counts.dropped_source_range,
                    was(|c| c.dropped_source_range),
                ),
                (
                    "no_local_endpoints",
                    counts.dropped_no_local,
                    was(|c| c.dropped_no_local),
                ),
            ] {
                let grew = increase(before, value);
                if value > 0 {
                    self.dropped
                        .get_or_create(&DropLabel {
                            frontend: label.frontend,
                            name: label.name.clone(),
                            namespace: label.namespace.clone(),
                            port: label.port.clone(),
                            protocol: label.protocol,
                            reason,
                        })
                        .inc_by(grew);
                }
            }
        }
        state.last.retain(|unit, _| seen.contains(unit));
        self.record_packets(reading, &previous_packets, &state.exported);
        if state.endpoints {
            let mut seen = HashSet::with_capacity(reading.endpoints.len());
            for sample in &reading.endpoints {
                seen.insert(sample.unit);
                let endpoint = sample.endpoint.to_string();
                let previous = state
                    .last_endpoints
                    .get(&sample.unit)
                    .filter(|(service, at, _)| *service == sample.service && *at == endpoint)
                    .map(|(_, _, count)| *count);
                state.last_endpoints.insert(
                    sample.unit,
                    (
                        sample.service.clone(),
                        endpoint.clone(),
                        sample.new_connections,
                    ),
                );
                let series = (sample.service.clone(), endpoint.clone());
                if !state.exported_endpoints.contains(&series) {
                    if state.exported.len() + state.exported_endpoints.len() >= max {
                        continue;
                    }
                    state.exported_endpoints.insert(series);
                }
                self.endpoint_new_connections
                    .get_or_create(&EndpointLabel {
                        endpoint,
                        name: sample.service.name.clone(),
                        namespace: sample.service.namespace.clone(),
                        port: sample.service.port.clone(),
                        protocol: sample.service.protocol.as_k8s(),
                    })
                    .inc_by(increase(previous, sample.new_connections));
            }
            state.last_endpoints.retain(|unit, _| seen.contains(unit));
        }
        self.series_capped
            .set(i64::try_from(state.capped.len()).unwrap_or(i64::MAX));
    }

    /// Adds each exported unit's packets and bytes since the last reading (`previous`), by
    /// direction; a unit whose dataplane sees no packets (`None`) has no series.
    fn record_packets(
        &self,
        reading: &TrafficReading,
        previous: &HashMap<u64, Option<PacketCounts>>,
        exported: &HashSet<ServiceTrafficKey>,
    ) {
        for sample in &reading.services {
            let Some(now) = sample.counts.packets else {
                continue;
            };
            if !exported.contains(&sample.key) {
                continue;
            }
            let before = previous.get(&sample.unit).copied().flatten();
            let label = ServiceLabel::of(&sample.key);
            for (direction, packets, bytes, was_packets, was_bytes) in [
                (
                    "forward",
                    now.forward_packets,
                    now.forward_bytes,
                    before.map(|b| b.forward_packets),
                    before.map(|b| b.forward_bytes),
                ),
                (
                    "reply",
                    now.reply_packets,
                    now.reply_bytes,
                    before.map(|b| b.reply_packets),
                    before.map(|b| b.reply_bytes),
                ),
            ] {
                let series = DirectionLabel {
                    direction,
                    frontend: label.frontend,
                    name: label.name.clone(),
                    namespace: label.namespace.clone(),
                    port: label.port.clone(),
                    protocol: label.protocol,
                };
                self.packets
                    .get_or_create(&series)
                    .inc_by(increase(was_packets, packets));
                self.bytes
                    .get_or_create(&series)
                    .inc_by(increase(was_bytes, bytes));
            }
        }
    }
}
