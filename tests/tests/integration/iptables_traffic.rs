//! The iptables mode's per-Service traffic counters against real iptables and real connections:
//! the dataplane runs in this process, in a private namespace, and the namespace's own
//! connections go through nat OUTPUT (ClusterIP, endpoint DNAT) and filter OUTPUT (the REJECT
//! of a Service without endpoints, the DROP of one whose endpoints are all on other nodes).
//! `read_service_traffic` must count each exactly, and a later sync that rewrites the top-level
//! chains (which restarts their counters) must give their rules new units while the endpoint
//! chains it leaves alone keep theirs and their counts. Needs root.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proxy_dataplane_iptables::{IptablesConfig, IptablesDataplane};
use proxy_model::desired::Snapshot;
use proxy_model::objects::{ObjectKey, Objects};
use proxy_model::traffic::{FrontendKind, TrafficCounts, TrafficReading};

use proxy_tests::netns::{Netns, on_thread_in};

const NODE: &str = "node-a";
const CONNECTIONS: u64 = 20;
const REJECTED: u64 = 4;
const DROPPED: u64 = 3;
/// Below the first SYN retransmission (1 s): a refused or dropped attempt sends one SYN.
const GIVE_UP: Duration = Duration::from_millis(300);

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "default".into(),
        name: name.into(),
    }
}

fn addr(ip: [u8; 4], port: u16) -> SocketAddr {
    SocketAddrV4::new(Ipv4Addr::from(ip), port).into()
}

fn service(name: &str, cluster_ip: &str, internal_local: bool) -> anyhow::Result<Service> {
    let mut spec = serde_json::json!({"clusterIP": cluster_ip,
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]});
    if internal_local {
        spec["internalTrafficPolicy"] = "Local".into();
    }
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }))?)
}

fn slice(service: &str, addresses: &[&str]) -> anyhow::Result<EndpointSlice> {
    let endpoints: Vec<_> = addresses
        .iter()
        .map(|a| {
            serde_json::json!({"addresses": [a], "nodeName": "node-b",
                "conditions": {"ready": true}})
        })
        .collect();
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{service}-1"), "namespace": "default",
            "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }))?)
}

/// web (10.96.0.10) with two endpoints, empty (10.96.0.11) without any, ilocal (10.96.0.12,
/// `internalTrafficPolicy: Local`) with one on another node.
fn snapshot() -> anyhow::Result<Snapshot> {
    let services = [
        (key("web"), service("web", "10.96.0.10", false)?.into()),
        (key("empty"), service("empty", "10.96.0.11", false)?.into()),
        (key("ilocal"), service("ilocal", "10.96.0.12", true)?.into()),
    ];
    let slices = [
        (
            key("web-1"),
            slice("web", &["10.244.1.1", "10.244.1.2"])?.into(),
        ),
        (key("ilocal-1"), slice("ilocal", &["10.244.1.3"])?.into()),
    ];
    let snapshot = Snapshot::compute(&Objects::new(services.into(), slices.into(), None), NODE);
    let errors: Vec<String> = snapshot.errors().map(ToString::to_string).collect();
    anyhow::ensure!(errors.is_empty(), "snapshot errors: {errors:?}");
    Ok(snapshot)
}

/// Each (Service, frontend) with its counts and unit, each (Service, endpoint) with its new
/// connections and unit.
type Services = BTreeMap<(String, FrontendKind), (TrafficCounts, u64)>;
type Endpoints = BTreeMap<(String, SocketAddr), (u64, u64)>;

fn tables(reading: &TrafficReading) -> anyhow::Result<(Services, Endpoints)> {
    let mut services = Services::new();
    for s in &reading.services {
        let k = (s.key.service.name.clone(), s.key.frontend);
        anyhow::ensure!(
            services.insert(k.clone(), (s.counts, s.unit)).is_none(),
            "two units for {k:?}: {reading:?}"
        );
    }
    let mut endpoints = Endpoints::new();
    for e in &reading.endpoints {
        let k = (e.service.name.clone(), e.endpoint);
        anyhow::ensure!(
            endpoints
                .insert(k.clone(), (e.new_connections, e.unit))
                .is_none(),
            "two units for {k:?}: {reading:?}"
        );
    }
    Ok((services, endpoints))
}

fn counts(new_connections: u64, rejected: u64, dropped_no_local: u64) -> TrafficCounts {
    TrafficCounts {
        new_connections,
        rejected,
        dropped_no_local,
        ..TrafficCounts::default()
    }
}

/// Accepts what is waiting on each listener: the connections each endpoint got.
fn accepted(listeners: &[TcpListener]) -> anyhow::Result<Vec<u64>> {
    let mut out = Vec::new();
    for listener in listeners {
        let mut n = 0;
        loop {
            match listener.accept() {
                Ok(_) => n += 1,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
        out.push(n);
    }
    Ok(out)
}

#[test]
fn iptables_traffic_counts_each_connection_rejection_drop_and_endpoint() -> anyhow::Result<()> {
    proxy_tests::require_root();
    let netns = Netns::new("iptraffic")?;
    // The node's own connections: routed by the ClusterIP range before nat OUTPUT translates
    // them to the endpoints, which are addresses of this namespace.
    netns.ip(&["route", "add", "10.96.0.0/16", "dev", "lo"])?;
    for endpoint in ["10.244.1.1/32", "10.244.1.2/32"] {
        netns.ip(&["addr", "add", endpoint, "dev", "lo"])?;
    }
    let path = netns.path();
    on_thread_in(&path, move || -> anyhow::Result<()> {
        let endpoints = [addr([10, 244, 1, 1], 8080), addr([10, 244, 1, 2], 8080)];
        let listeners = endpoints
            .iter()
            .map(|a| {
                let listener = TcpListener::bind(a)?;
                listener.set_nonblocking(true)?;
                Ok(listener)
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        let mut dataplane = IptablesDataplane::start(IptablesConfig::default())?;
        let snapshot = snapshot()?;
        for report in dataplane.apply(&snapshot, None) {
            report?;
        }

        let (services, seps) = tables(&dataplane.read_service_traffic()?)?;
        use FrontendKind::ClusterIp;
        let web = ("web".to_owned(), ClusterIp);
        let empty = ("empty".to_owned(), ClusterIp);
        let ilocal = ("ilocal".to_owned(), ClusterIp);
        let keys: Vec<_> = services.keys().cloned().collect();
        let mut expected_keys = vec![web.clone(), empty.clone(), ilocal.clone()];
        expected_keys.sort();
        anyhow::ensure!(keys == expected_keys, "{services:?}");
        anyhow::ensure!(
            services
                .values()
                .all(|(c, _)| *c == TrafficCounts::default()),
            "nothing counted yet: {services:?}"
        );
        // ilocal's endpoint chain is written, but nothing jumps to it.
        let sep_keys: Vec<_> = seps.keys().cloned().collect();
        anyhow::ensure!(
            sep_keys
                == [
                    ("web".to_owned(), endpoints[0]),
                    ("web".to_owned(), endpoints[1]),
                ],
            "{seps:?}"
        );

        let mut open = Vec::new();
        for _ in 0..CONNECTIONS {
            open.push(TcpStream::connect_timeout(
                &addr([10, 96, 0, 10], 80),
                Duration::from_secs(2),
            )?);
        }
        for (target, attempts) in [([10, 96, 0, 11], REJECTED), ([10, 96, 0, 12], DROPPED)] {
            for _ in 0..attempts {
                let attempt = TcpStream::connect_timeout(&addr(target, 80), GIVE_UP);
                anyhow::ensure!(attempt.is_err(), "{target:?} answered");
            }
        }
        let per_endpoint = accepted(&listeners)?;
        anyhow::ensure!(
            per_endpoint.iter().sum::<u64>() == CONNECTIONS,
            "{per_endpoint:?}"
        );

        let (counted, counted_seps) = tables(&dataplane.read_service_traffic()?)?;
        let got = |k: &(String, FrontendKind)| counted.get(k).map(|(c, _)| *c);
        anyhow::ensure!(
            got(&web) == Some(counts(CONNECTIONS, 0, 0))
                && got(&empty) == Some(counts(0, REJECTED, 0))
                && got(&ilocal) == Some(counts(0, 0, DROPPED)),
            "{counted:?}"
        );
        // No sync in between: the same units.
        anyhow::ensure!(
            counted.iter().all(|(k, (_, unit))| services[k].1 == *unit),
            "{services:?} → {counted:?}"
        );
        for (endpoint, n) in endpoints.iter().zip(&per_endpoint) {
            let sep = counted_seps.get(&("web".to_owned(), *endpoint)).copied();
            anyhow::ensure!(
                sep.map(|(c, _)| c) == Some(*n),
                "{endpoint} got {n}: {counted_seps:?}"
            );
        }

        // A sync of nothing rewrites the top-level chains, restarting their counters: new
        // units from 0. The endpoint chains are not written: same units, same counts.
        let nothing = std::collections::BTreeSet::new();
        for report in dataplane.apply(&snapshot, Some(&nothing)) {
            let report = report?;
            anyhow::ensure!(!report.full, "{report:?}");
        }
        for _ in 0..2 {
            open.push(TcpStream::connect_timeout(
                &addr([10, 96, 0, 10], 80),
                Duration::from_secs(2),
            )?);
        }
        let more = accepted(&listeners)?;
        let (synced, synced_seps) = tables(&dataplane.read_service_traffic()?)?;
        anyhow::ensure!(
            synced.iter().all(|(k, (_, unit))| counted[k].1 != *unit),
            "{counted:?} → {synced:?}"
        );
        anyhow::ensure!(
            synced.get(&web).map(|(c, _)| *c) == Some(counts(2, 0, 0))
                && synced.get(&empty).map(|(c, _)| *c) == Some(counts(0, 0, 0)),
            "{synced:?}"
        );
        anyhow::ensure!(
            synced_seps.keys().eq(counted_seps.keys()),
            "{counted_seps:?} → {synced_seps:?}"
        );
        for ((key, (n, unit)), (_, (before, before_unit))) in synced_seps.iter().zip(&counted_seps)
        {
            let index = endpoints.iter().position(|e| *e == key.1);
            let added = index.map_or(0, |i| more[i]);
            anyhow::ensure!(
                *unit == *before_unit && *n == before + added,
                "{key:?}: {before} + {added} → {n}: {counted_seps:?} → {synced_seps:?}"
            );
        }
        drop(open);
        Ok(())
    })??;
    drop(netns);
    Ok(())
}
