use std::collections::BTreeMap;

use super::*;
use crate::conntrack::Tuple;
use proxy_model::{
    desired::{Endpoint, ServicePort, ServicePortName},
    objects::ObjectKey,
};

fn ip(last: u8) -> IpAddr {
    IpAddr::from([10, 244, 0, last])
}

fn endpoint(last: u8, serving: bool) -> Endpoint {
    Endpoint {
        addr: ip(last),
        port: 5353,
        is_local: false,
        ready: serving,
        serving,
        terminating: false,
        cluster: serving,
        local: false,
    }
}

fn dns(protocol: Protocol, endpoints: Vec<Endpoint>) -> FamilySnapshot {
    let name = ServicePortName {
        service: ObjectKey {
            namespace: "kube-system".into(),
            name: "dns".into(),
        },
        port: "dns".into(),
        protocol,
    };
    let port = ServicePort {
        name: name.clone(),
        cluster_ip: IpAddr::from([10, 96, 0, 10]),
        port: 53,
        protocol,
        node_port: Some(30053),
        external_ips: vec![IpAddr::from([192, 0, 2, 1])],
        load_balancer_ips: Vec::new(),
        source_ranges: Vec::new(),
        affinity_timeout: None,
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: None,
        traffic_distribution: None,
        has_any_endpoints: endpoints.iter().any(|e| e.serving),
        endpoints,
    };
    FamilySnapshot {
        service_ports: BTreeMap::from([(name, port)]),
    }
}

fn entry(dst: IpAddr, dst_port: u16, backend: IpAddr, protocol: u8) -> ConntrackEntry {
    let original = Tuple {
        src: IpAddr::from([10, 0, 0, 1]),
        dst,
        protocol,
        src_port: 40000,
        dst_port,
    };
    ConntrackEntry {
        original,
        reply: Tuple {
            src: backend,
            dst: original.src,
            protocol,
            src_port: 5353,
            dst_port: 40000,
        },
        tcp_state: None,
    }
}

const UDP: u8 = 17;
const TCP: u8 = 6;

#[test]
fn entries_to_removed_endpoints_are_stale_and_live_ones_are_kept() {
    let snapshot = dns(Protocol::Udp, vec![endpoint(1, true), endpoint(2, false)]);
    let cluster_ip = IpAddr::from([10, 96, 0, 10]);
    let entries = [
        entry(cluster_ip, 53, ip(1), UDP), // live endpoint: kept
        entry(cluster_ip, 53, ip(2), UDP), // not serving: stale
        entry(cluster_ip, 53, ip(3), UDP), // removed: stale
        entry(IpAddr::from([192, 0, 2, 1]), 53, ip(3), UDP), // externalIP: stale
        entry(IpAddr::from([172, 16, 0, 1]), 30053, ip(3), UDP), // NodePort on any address
        entry(IpAddr::from([172, 16, 0, 1]), 30054, ip(3), UDP), // another port: not ours
        entry(cluster_ip, 53, ip(3), TCP), // TCP is left alone
    ];
    let stale = stale_filters(
        &snapshot,
        &GoneFrontends::default(),
        &ServedStreams::default(),
        &entries,
    );
    let got: Vec<(IpAddr, u16, IpAddr, StaleFilter)> = stale
        .iter()
        .map(|(e, why)| (e.original.dst, e.original.dst_port, e.reply.src, *why))
        .collect();
    assert_eq!(
        got,
        [
            (cluster_ip, 53, ip(2), StaleFilter::Frontend),
            (cluster_ip, 53, ip(3), StaleFilter::Frontend),
            (
                IpAddr::from([192, 0, 2, 1]),
                53,
                ip(3),
                StaleFilter::Frontend
            ),
            (
                IpAddr::from([172, 16, 0, 1]),
                30053,
                ip(3),
                StaleFilter::NodePort
            ),
        ]
    );
}

#[test]
fn the_last_endpoint_going_away_still_cleans_up() {
    // N → 0: kube-proxy skips this case; we do not.
    let snapshot = dns(Protocol::Udp, Vec::new());
    let entries = [entry(IpAddr::from([10, 96, 0, 10]), 53, ip(1), UDP)];
    assert_eq!(
        stale_filters(
            &snapshot,
            &GoneFrontends::default(),
            &ServedStreams::default(),
            &entries
        )
        .len(),
        1
    );
}

#[test]
fn entries_from_before_the_first_endpoint_are_cleaned_up() {
    // 0 → N: created while REJECTed/unanswered, never DNATed: the reply comes from the VIP.
    let cluster_ip = IpAddr::from([10, 96, 0, 10]);
    let snapshot = dns(Protocol::Udp, vec![endpoint(1, true)]);
    let entries = [entry(cluster_ip, 53, cluster_ip, UDP)];
    assert_eq!(
        stale_filters(
            &snapshot,
            &GoneFrontends::default(),
            &ServedStreams::default(),
            &entries
        )
        .len(),
        1
    );
}

#[test]
fn sctp_is_cleaned_up_too() {
    let snapshot = dns(Protocol::Sctp, vec![endpoint(1, true)]);
    let entries = [entry(IpAddr::from([10, 96, 0, 10]), 53, ip(9), 132)];
    assert_eq!(
        stale_filters(
            &snapshot,
            &GoneFrontends::default(),
            &ServedStreams::default(),
            &entries
        )
        .len(),
        1
    );
}

/// A deleted UDP Service (kube-proxy 1.37): its frontends are gone from the snapshot, and
/// the entries still DNATed through them go, whatever backend they reach; a frontend that
/// another Service took meanwhile goes by that Service's endpoints.
#[test]
fn entries_of_a_deleted_service_go_and_a_reused_frontend_follows_its_new_owner() {
    let cluster_ip = IpAddr::from([10, 96, 0, 10]);
    let before = GoneFrontends::of(&dns(Protocol::Udp, vec![endpoint(1, true)]));
    let now = GoneFrontends::of(&FamilySnapshot::default());
    let mut gone = GoneFrontends::default();
    gone.add_gone(&before, &now);
    assert!(!gone.is_empty());
    let entries = [
        entry(cluster_ip, 53, ip(1), UDP),
        entry(IpAddr::from([192, 0, 2, 1]), 53, ip(1), UDP),
        entry(IpAddr::from([172, 16, 0, 1]), 30053, ip(1), UDP),
        entry(cluster_ip, 53, ip(1), TCP),
    ];
    let stale = stale_filters(
        &FamilySnapshot::default(),
        &gone,
        &ServedStreams::default(),
        &entries,
    );
    assert_eq!(
        stale.len(),
        3,
        "every UDP entry of the deleted Service: {stale:?}"
    );
    // Without the gone frontends, nothing matches any more: the entries would stay.
    assert!(
        stale_filters(
            &FamilySnapshot::default(),
            &GoneFrontends::default(),
            &ServedStreams::default(),
            &entries
        )
        .is_empty()
    );

    // The ClusterIP re-created for a Service whose endpoint is ip(1) again: its entry stays.
    let reused = dns(Protocol::Udp, vec![endpoint(1, true)]);
    let stale = stale_filters(&reused, &gone, &ServedStreams::default(), &entries);
    assert!(
        stale.is_empty(),
        "the live owner's endpoint keeps its entries: {stale:?}"
    );
    // And once that owner is synced, the frontend is no longer gone.
    gone.add_gone(&now, &GoneFrontends::of(&reused));
    assert!(gone.is_empty());
}

/// A TCP entry to `dst:80` from `client:port`, with `reply_src` answering (the frontend itself:
/// never translated).
fn tcp_entry(dst: IpAddr, client: IpAddr, port: u16, reply_src: IpAddr) -> ConntrackEntry {
    ConntrackEntry {
        original: Tuple {
            src: client,
            dst,
            protocol: Protocol::Tcp.number(),
            src_port: port,
            dst_port: 80,
        },
        reply: Tuple {
            src: reply_src,
            dst: client,
            protocol: Protocol::Tcp.number(),
            src_port: if reply_src == dst { 80 } else { 8080 },
            dst_port: port,
        },
        tcp_state: Some(1),
    }
}

#[test]
fn untranslated_tcp_entries_go_when_their_frontend_is_first_served_and_translated_ones_stay() {
    let mut web = dns(Protocol::Tcp, vec![endpoint(1, true)]);
    for port in web.service_ports.values_mut() {
        port.port = 80;
    }
    let cluster_ip = web
        .service_ports
        .values()
        .next()
        .map(|p| p.cluster_ip)
        .expect("a port");
    let client = ip(200);
    let entries = [
        // A SYN sent before the rules: the frontend answers for itself (it never did).
        tcp_entry(cluster_ip, client, 40_000, cluster_ip),
        // A live connection DNATed to the endpoint.
        tcp_entry(cluster_ip, client, 40_001, ip(1)),
    ];
    let mut newly = ServedStreams::default();
    newly.add_newly(&ServedStreams::default(), &ServedStreams::of(&web));
    let stale = stale_filters(&web, &GoneFrontends::default(), &newly, &entries);
    assert_eq!(
        stale,
        vec![(entries[0], StaleFilter::Untranslated)],
        "only the untranslated entry goes"
    );
    // Served before: nothing new, nothing walked away (kube-proxy leaves TCP alone).
    let served = ServedStreams::of(&web);
    let mut nothing_new = ServedStreams::default();
    nothing_new.add_newly(&served, &served);
    assert!(nothing_new.is_empty());
    assert!(stale_filters(&web, &GoneFrontends::default(), &nothing_new, &entries).is_empty());
    // Without a serving endpoint the frontend is not served (its REJECT answers anyway).
    for port in web.service_ports.values_mut() {
        for endpoint in &mut port.endpoints {
            endpoint.serving = false;
        }
    }
    assert!(ServedStreams::of(&web).is_empty());
}
