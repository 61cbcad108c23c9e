//! The reader over rules this crate's own generator writes, with a distinct counter on every
//! rule, and over text no generator writes.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::*;
use crate::{
    HostFeatures, IptablesConfig,
    config::FamilyRules,
    localdetect::DetectLocalMode,
    rules::{SyncInput, generate},
};
use proxy_model::desired::{Endpoint, ServicePort, ServicePortName};

const FULL: SyncInput<'static> = SyncInput {
    changed_services: None,
    existing_nat_chains: None,
};

fn key(ns: &str, name: &str) -> ObjectKey {
    ObjectKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

/// An endpoint on another node (`local`: in the node-local set too).
fn endpoint(addr: &str, local: bool) -> Endpoint {
    Endpoint {
        addr: addr.parse().unwrap(),
        port: 8080,
        is_local: local,
        ready: true,
        serving: true,
        terminating: false,
        cluster: true,
        local,
    }
}

fn port(name: &str, port_name: &str, protocol: Protocol, cluster_ip: &str) -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: key("default", name),
            port: port_name.into(),
            protocol,
        },
        cluster_ip: cluster_ip.parse().unwrap(),
        port: 80,
        protocol,
        node_port: None,
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        source_ranges: Vec::new(),
        affinity_timeout: None,
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: None,
        traffic_distribution: None,
        has_any_endpoints: false,
        endpoints: Vec::new(),
    }
}

fn with_endpoints(mut port: ServicePort, endpoints: Vec<Endpoint>) -> ServicePort {
    port.has_any_endpoints = !endpoints.is_empty();
    port.endpoints = endpoints;
    port
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// - web (TCP, unnamed port): ClusterIP, NodePort, an externalIP and an LB IP behind a source
///   range, two endpoints;
/// - empty (UDP `dns`): the same frontends, no endpoints;
/// - local (TCP `https`): `externalTrafficPolicy: Local`, its one endpoint on another node;
/// - ilocal (TCP `p`): `internalTrafficPolicy: Local`, its one endpoint on another node.
fn services() -> FamilySnapshot {
    let mut web = with_endpoints(
        port("web", "", Protocol::Tcp, "172.30.0.1"),
        vec![endpoint("10.1.0.1", false), endpoint("10.1.0.2", false)],
    );
    web.node_port = Some(30080);
    web.external_ips = vec![ip("192.168.99.1")];
    web.load_balancer_ips = vec![ip("5.6.7.8")];
    web.source_ranges = vec!["1.2.3.0/24".parse().unwrap()];

    let mut empty = port("empty", "dns", Protocol::Udp, "172.30.0.2");
    empty.node_port = Some(30081);
    empty.external_ips = vec![ip("192.168.99.2")];
    empty.load_balancer_ips = vec![ip("5.6.7.9")];

    let mut local = with_endpoints(
        port("local", "https", Protocol::Tcp, "172.30.0.3"),
        vec![endpoint("10.2.0.1", false)],
    );
    local.node_port = Some(30082);
    local.external_ips = vec![ip("192.168.99.3")];
    local.load_balancer_ips = vec![ip("5.6.7.10")];
    local.external_policy_local = true;
    local.health_check_node_port = Some(32000);

    let mut ilocal = with_endpoints(
        port("ilocal", "p", Protocol::Tcp, "172.30.0.4"),
        vec![endpoint("10.3.0.1", false)],
    );
    ilocal.internal_policy_local = true;

    FamilySnapshot {
        service_ports: [web, empty, local, ilocal]
            .into_iter()
            .map(|p| (p.name.clone(), p))
            .collect(),
    }
}

fn rules_context(large_cluster_threshold: usize) -> FamilyRules {
    let config = IptablesConfig {
        detect_local: DetectLocalMode::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]),
        ..IptablesConfig::default()
    };
    let mut rules = FamilyRules::new(&config, IpFamily::V4, None, &[], &HostFeatures::default());
    rules.large_cluster_threshold = large_cluster_threshold;
    rules
}

/// The LB frontends of [`services`], as the dataplane records them.
fn traffic_context(snapshot: &FamilySnapshot) -> TrafficContext {
    let mut context = TrafficContext::default();
    context.record_restore(snapshot, None, true);
    context
}

/// A restore text as `iptables-save -c` shows it: every `-A` line gets its own counters
/// (`packets` = 1000 + its index, 60 bytes a packet).
struct Dump {
    text: String,
    /// (table, line without counters, packets)
    rules: Vec<(String, String, u64)>,
}

impl Dump {
    fn of(restore: &str) -> Self {
        let mut text = String::new();
        let mut rules = Vec::new();
        let mut table = String::new();
        for line in restore.lines() {
            if let Some(name) = line.strip_prefix('*') {
                table = name.to_owned();
            }
            if line.starts_with("-A ") {
                let packets = 1000 + rules.len() as u64;
                text.push_str(&format!("[{packets}:{}] {line}\n", packets * 60));
                rules.push((table.clone(), line.to_owned(), packets));
            } else {
                text.push_str(line);
                text.push('\n');
            }
        }
        Dump { text, rules }
    }

    /// The packets of the one rule of `table` that starts with `start` and contains every
    /// one of `parts`.
    fn packets(&self, table: &str, start: &str, parts: &[&str]) -> u64 {
        let found: Vec<u64> = self
            .rules
            .iter()
            .filter(|(t, line, _)| {
                t == table && line.starts_with(start) && parts.iter().all(|p| line.contains(p))
            })
            .map(|(_, _, packets)| *packets)
            .collect();
        assert_eq!(found.len(), 1, "{table} {start} {parts:?}: {found:?}");
        found[0]
    }
}

fn labels(name: &str, port: &str, protocol: Protocol) -> ServicePortLabels {
    ServicePortLabels {
        namespace: "default".into(),
        name: name.into(),
        port: port.into(),
        protocol,
    }
}

fn sample(
    service: &ServicePortLabels,
    frontend: FrontendKind,
    count: Count,
    packets: u64,
) -> (ServiceTrafficKey, TrafficCounts) {
    (
        ServiceTrafficKey {
            service: service.clone(),
            frontend,
        },
        count.counts(packets),
    )
}

fn sorted(
    mut samples: Vec<(ServiceTrafficKey, TrafficCounts)>,
) -> Vec<(ServiceTrafficKey, TrafficCounts)> {
    samples.sort_by_key(|(key, counts)| (key.clone(), format!("{counts:?}")));
    samples
}

fn of_reading(reading: &TrafficReading) -> Vec<(ServiceTrafficKey, TrafficCounts)> {
    sorted(
        reading
            .services
            .iter()
            .map(|s| (s.key.clone(), s.counts))
            .collect(),
    )
}

#[test]
fn each_frontend_counts_once_at_its_entry_rule_and_each_drop_where_it_drops() {
    let snapshot = services();
    let restore = generate(&rules_context(1000), &snapshot, FULL).restore;
    let dump = Dump::of(&String::from_utf8_lossy(&restore));
    let reading = reading(IpFamily::V4, &dump.text, &traffic_context(&snapshot));

    use Count::*;
    use FrontendKind::*;
    let web = labels("web", "", Protocol::Tcp);
    let empty = labels("empty", "dns", Protocol::Udp);
    let local = labels("local", "https", Protocol::Tcp);
    let ilocal = labels("ilocal", "p", Protocol::Tcp);
    let nat = |start, parts: &[&str]| dump.packets("nat", start, parts);
    let filter = |start, parts: &[&str]| dump.packets("filter", start, parts);
    let expected = sorted(vec![
        sample(
            &web,
            ClusterIp,
            NewConnections,
            nat("-A KUBE-SERVICES", &["\"default/web cluster IP\""]),
        ),
        sample(
            &web,
            ExternalIp,
            NewConnections,
            nat("-A KUBE-SERVICES", &["\"default/web external IP\""]),
        ),
        // Behind its source range: counted in KUBE-FW, not at the KUBE-SERVICES rule.
        sample(
            &web,
            LoadBalancer,
            NewConnections,
            nat("-A KUBE-FW-", &["-s 1.2.3.0/24", "-j KUBE-EXT-"]),
        ),
        sample(
            &web,
            LoadBalancer,
            DroppedSourceRange,
            nat(
                "-A KUBE-FW-",
                &["other traffic to default/web will be dropped"],
            ),
        ),
        sample(
            &web,
            NodePort,
            NewConnections,
            nat("-A KUBE-NODEPORTS", &["--dport 30080"]),
        ),
        sample(
            &empty,
            ClusterIp,
            Rejected,
            filter("-A KUBE-SERVICES", &["-d 172.30.0.2", "REJECT"]),
        ),
        sample(
            &empty,
            ExternalIp,
            Rejected,
            filter("-A KUBE-EXTERNAL-SERVICES", &["-d 192.168.99.2", "REJECT"]),
        ),
        sample(
            &empty,
            LoadBalancer,
            Rejected,
            filter("-A KUBE-EXTERNAL-SERVICES", &["-d 5.6.7.9", "REJECT"]),
        ),
        sample(
            &empty,
            NodePort,
            Rejected,
            filter("-A KUBE-EXTERNAL-SERVICES", &["--dport 30081", "REJECT"]),
        ),
        // eTP Local without a local endpoint: the ClusterIP still works; the external
        // frontends count where the filter table drops them, not at their nat rules.
        sample(
            &local,
            ClusterIp,
            NewConnections,
            nat("-A KUBE-SERVICES", &["\"default/local:https cluster IP\""]),
        ),
        sample(
            &local,
            ExternalIp,
            DroppedNoLocal,
            filter("-A KUBE-EXTERNAL-SERVICES", &["-d 192.168.99.3", "DROP"]),
        ),
        sample(
            &local,
            LoadBalancer,
            DroppedNoLocal,
            filter("-A KUBE-EXTERNAL-SERVICES", &["-d 5.6.7.10", "DROP"]),
        ),
        sample(
            &local,
            NodePort,
            DroppedNoLocal,
            filter("-A KUBE-EXTERNAL-SERVICES", &["--dport 30082", "DROP"]),
        ),
        sample(
            &ilocal,
            ClusterIp,
            DroppedNoLocal,
            filter("-A KUBE-SERVICES", &["-d 172.30.0.4", "DROP"]),
        ),
    ]);
    // Nothing else: the masquerade rules, KUBE-EXT/KUBE-SVC, the KUBE-SERVICES rule into
    // KUBE-FW, KUBE-PROXY-FIREWALL's DROP and local's external nat rules all see packets
    // counted above.
    assert_eq!(of_reading(&reading), expected);
    assert!(reading.services.iter().all(|s| s.counts.packets.is_none()));

    let sep = |addr: &str| {
        nat(
            "-A KUBE-SEP-",
            &["DNAT", &format!("--to-destination {addr}")],
        )
    };
    let mut endpoints: Vec<(ServicePortLabels, SocketAddr, u64)> = reading
        .endpoints
        .iter()
        .map(|e| (e.service.clone(), e.endpoint, e.new_connections))
        .collect();
    endpoints.sort();
    let mut expected_endpoints = vec![
        (
            web.clone(),
            "10.1.0.1:8080".parse().unwrap(),
            sep("10.1.0.1:8080"),
        ),
        (
            web.clone(),
            "10.1.0.2:8080".parse().unwrap(),
            sep("10.1.0.2:8080"),
        ),
        (
            local.clone(),
            "10.2.0.1:8080".parse().unwrap(),
            sep("10.2.0.1:8080"),
        ),
    ];
    // ilocal's endpoint chain is written (the endpoint is reachable) but no chain jumps to it:
    // its only frontend keeps to local endpoints.
    assert!(sep("10.3.0.1:8080") > 0);
    expected_endpoints.sort();
    assert_eq!(endpoints, expected_endpoints);

    let units: BTreeSet<u64> = reading
        .services
        .iter()
        .map(|s| s.unit)
        .chain(reading.endpoints.iter().map(|e| e.unit))
        .collect();
    assert_eq!(
        units.len(),
        reading.services.len() + reading.endpoints.len()
    );
}

#[test]
fn without_the_lb_frontends_a_rejected_lb_ip_reads_as_an_external_ip() {
    // The REJECTs of a Service without endpoints are alike for externalIPs and LB IPs; with
    // endpoints the nat comments say which is which, whatever the context.
    let snapshot = services();
    let restore = generate(&rules_context(1000), &snapshot, FULL).restore;
    let dump = Dump::of(&String::from_utf8_lossy(&restore));
    let reading = reading(IpFamily::V4, &dump.text, &TrafficContext::default());
    let frontends = |name: &str| -> Vec<FrontendKind> {
        let mut kinds: Vec<FrontendKind> = reading
            .services
            .iter()
            .filter(|s| s.key.service.name == name)
            .map(|s| s.key.frontend)
            .collect();
        kinds.sort();
        kinds
    };
    use FrontendKind::*;
    assert_eq!(
        frontends("empty"),
        [ClusterIp, NodePort, ExternalIp, ExternalIp]
    );
    assert_eq!(
        frontends("local"),
        [ClusterIp, NodePort, LoadBalancer, ExternalIp]
    );
}

#[test]
fn endpoints_without_comments_are_found_through_their_service_chain() {
    // Large clusters drop the comments of endpoint rules.
    let snapshot = services();
    let restore = generate(&rules_context(0), &snapshot, FULL).restore;
    let restore = String::from_utf8_lossy(&restore);
    assert!(
        !restore
            .lines()
            .any(|l| l.starts_with("-A KUBE-SEP-") && l.contains("--comment"))
    );
    let dump = Dump::of(&restore);
    let reading = reading(IpFamily::V4, &dump.text, &traffic_context(&snapshot));
    let mut endpoints: Vec<(String, String)> = reading
        .endpoints
        .iter()
        .map(|e| (e.service.name.clone(), e.endpoint.to_string()))
        .collect();
    endpoints.sort();
    assert_eq!(
        endpoints,
        [
            ("local".to_owned(), "10.2.0.1:8080".to_owned()),
            ("web".to_owned(), "10.1.0.1:8080".to_owned()),
            ("web".to_owned(), "10.1.0.2:8080".to_owned()),
        ]
    );
    // The Service samples do not depend on endpoint comments.
    let full = {
        let restore = generate(&rules_context(1000), &snapshot, FULL).restore;
        let dump = Dump::of(&String::from_utf8_lossy(&restore));
        super::reading(IpFamily::V4, &dump.text, &traffic_context(&snapshot))
    };
    let keys = |r: &TrafficReading| -> Vec<ServiceTrafficKey> {
        let mut keys: Vec<_> = r.services.iter().map(|s| s.key.clone()).collect();
        keys.sort();
        keys
    };
    assert_eq!(keys(&reading), keys(&full));
}

/// Units by the rule they count and the counter's value.
fn units(reading: &TrafficReading) -> Vec<(String, u64)> {
    let mut units: Vec<(String, u64)> = reading
        .services
        .iter()
        .map(|s| (format!("{:?}", (&s.key, s.counts)), s.unit))
        .chain(
            reading
                .endpoints
                .iter()
                .map(|e| (format!("{} {}", e.service.name, e.endpoint), e.unit)),
        )
        .collect();
    units.sort();
    units
}

#[test]
fn units_follow_the_rule_family_and_the_restore_that_wrote_the_chain() {
    let snapshot = services();
    let restore = generate(&rules_context(1000), &snapshot, FULL).restore;
    let dump = Dump::of(&String::from_utf8_lossy(&restore));
    let context = traffic_context(&snapshot);
    let first = reading(IpFamily::V4, &dump.text, &context);

    // Other counters, same rules: the same units.
    let recounted = dump.text.replace("[10", "[20");
    let again = reading(IpFamily::V4, &recounted, &context);
    let unit_set = |r: &TrafficReading| -> BTreeSet<u64> {
        r.services
            .iter()
            .map(|s| s.unit)
            .chain(r.endpoints.iter().map(|e| e.unit))
            .collect()
    };
    assert_eq!(unit_set(&first), unit_set(&again));
    assert_ne!(first, again);

    // The same text read as the other family: no unit in common.
    let v6 = reading(IpFamily::V6, &dump.text, &context);
    assert!(unit_set(&first).is_disjoint(&unit_set(&v6)));

    // A partial sync of web: every shared chain's rules and web's own chains are new units;
    // the other Services' endpoint chains keep theirs.
    let mut partial = context.clone();
    partial.record_restore(&snapshot, Some(&[key("default", "web")].into()), false);
    let after = reading(IpFamily::V4, &dump.text, &partial);
    let kept: Vec<String> = units(&first)
        .into_iter()
        .zip(units(&after))
        .filter(|((_, a), (_, b))| a == b)
        .map(|((name, _), _)| name)
        .collect();
    assert_eq!(kept, ["local 10.2.0.1:8080"]);

    // A full sync rewrites everything.
    let mut full = partial.clone();
    full.record_restore(&snapshot, None, true);
    let rewritten = reading(IpFamily::V4, &dump.text, &full);
    assert!(unit_set(&after).is_disjoint(&unit_set(&rewritten)));
}

#[test]
fn a_reading_taken_off_the_loop_keeps_only_the_chains_no_restore_rewrote_meanwhile() {
    let snapshot = services();
    let restore = generate(&rules_context(1000), &snapshot, FULL).restore;
    let dump = Dump::of(&String::from_utf8_lossy(&restore));
    let context = traffic_context(&snapshot);
    let taken = epoch_reading(IpFamily::V4, &dump.text, &context);

    // No restore since: all of it, as the loop would have read it.
    assert_eq!(
        taken.clone().settle(&context),
        reading(IpFamily::V4, &dump.text, &context)
    );

    // A partial sync of web meanwhile restarted the shared chains' counters and web's: only
    // the samples whose unit the new context still gives them are kept (local's endpoint).
    let mut partial = context.clone();
    partial.record_restore(&snapshot, Some(&[key("default", "web")].into()), false);
    let settled = taken.clone().settle(&partial);
    assert_eq!(units(&settled).len(), 1, "{:?}", units(&settled));
    assert_eq!(units(&settled)[0].0, "local 10.2.0.1:8080");
    let same = reading(IpFamily::V4, &dump.text, &partial);
    assert!(
        units(&settled)
            .iter()
            .all(|kept| units(&same).contains(kept))
    );

    // A full sync meanwhile: nothing is current.
    let mut full = context.clone();
    full.record_restore(&snapshot, None, true);
    assert_eq!(taken.settle(&full), TrafficReading::default());
}

#[test]
fn restores_move_the_epochs_of_what_they_wrote() {
    let snapshot = services();
    let mut context = TrafficContext::default();
    context.record_restore(&snapshot, None, true);
    assert_eq!((context.epochs.shared, context.epochs.full), (1, 1));
    assert_eq!(
        context.load_balancer_frontends,
        [
            (ip("5.6.7.10"), 80, Protocol::Tcp),
            (ip("5.6.7.8"), 80, Protocol::Tcp),
            (ip("5.6.7.9"), 80, Protocol::Udp),
        ]
        .into()
    );

    let gone = key("default", "gone");
    context.record_restore(
        &snapshot,
        Some(&[key("default", "web"), gone.clone()].into()),
        false,
    );
    assert_eq!((context.epochs.shared, context.epochs.full), (2, 1));
    assert_eq!(context.epochs.service("default", "web"), 2);
    assert_eq!(context.epochs.service("default", "gone"), 2);
    assert_eq!(context.epochs.service("default", "local"), 1);

    // Its chains are deleted once stale chains are: no epoch to remember.
    context.record_restore(&snapshot, Some(&BTreeSet::new()), true);
    assert_eq!(context.epochs.shared, 3);
    assert!(!context.epochs.services.contains_key(&gone));
    assert_eq!(context.epochs.service("default", "web"), 2);

    context.record_restore(&FamilySnapshot::default(), None, false);
    assert_eq!((context.epochs.shared, context.epochs.full), (4, 4));
    assert!(context.epochs.services.is_empty());
    assert!(context.load_balancer_frontends.is_empty());
}

#[test]
fn iptables_save_spelling_is_read() {
    // As `iptables-save -c` prints rules: its own option order, `/32` on addresses, names
    // without quotes, a `!`, other software's rules and chains around ours.
    let text = r#"# Generated by iptables-save v1.8.10 (nf_tables) on Wed Dec  2 18:00:00 2026
*filter
:INPUT ACCEPT [9:9]
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
[3:180] -A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
[4:240] -A KUBE-SERVICES -d 10.96.0.20/32 -p tcp -m comment --comment "ns/nothing:web has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable
[5:300] -A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment "ns/nothing:web has no endpoints" -m addrtype --dst-type LOCAL -m tcp --dport 31000 -j REJECT --reject-with icmp-port-unreachable
[6:360] -A KUBE-EXTERNAL-SERVICES -d 203.0.113.7/32 -p tcp -m comment --comment "ns/nothing:web has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-TCOU7JCQXEZGVUNU - [0:0]
:KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]
[77:4620] -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
[12:720] -A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-SVC-TCOU7JCQXEZGVUNU
[2:120] -A KUBE-SVC-TCOU7JCQXEZGVUNU ! -s 10.0.0.0/8 -d 10.96.0.10/32 -p udp -m comment --comment "kube-system/kube-dns:dns cluster IP" -m udp --dport 53 -j KUBE-MARK-MASQ
[12:720] -A KUBE-SVC-TCOU7JCQXEZGVUNU -m comment --comment "kube-system/kube-dns:dns -> 10.244.0.5:53" -j KUBE-SEP-AAAAAAAAAAAAAAAA
[0:0] -A KUBE-SEP-AAAAAAAAAAAAAAAA -s 10.244.0.5/32 -m comment --comment kube-system/kube-dns:dns -j KUBE-MARK-MASQ
[12:720] -A KUBE-SEP-AAAAAAAAAAAAAAAA -p udp -m comment --comment kube-system/kube-dns:dns -m udp -j DNAT --to-destination 10.244.0.5:53
[1:60] -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
COMMIT
"#;
    let reading = reading(IpFamily::V4, text, &TrafficContext::default());
    let dns = ServicePortLabels {
        namespace: "kube-system".into(),
        name: "kube-dns".into(),
        port: "dns".into(),
        protocol: Protocol::Udp,
    };
    let nothing = ServicePortLabels {
        namespace: "ns".into(),
        name: "nothing".into(),
        port: "web".into(),
        protocol: Protocol::Tcp,
    };
    use Count::*;
    use FrontendKind::*;
    assert_eq!(
        of_reading(&reading),
        sorted(vec![
            sample(&dns, ClusterIp, NewConnections, 12),
            sample(&nothing, ClusterIp, Rejected, 4),
            sample(&nothing, NodePort, Rejected, 5),
            sample(&nothing, ExternalIp, Rejected, 6),
        ])
    );
    assert_eq!(reading.endpoints.len(), 1);
    assert_eq!(reading.endpoints[0].service, dns);
    assert_eq!(
        reading.endpoints[0].endpoint,
        "10.244.0.5:53".parse::<SocketAddr>().unwrap()
    );
    assert_eq!(reading.endpoints[0].new_connections, 12);
}

#[test]
fn odd_text_is_skipped_never_a_panic() {
    let text = "\
garbage before any table\n\
[1:1] -A KUBE-SERVICES -p tcp -m comment --comment \"a/b:c cluster IP\" -j KUBE-SVC-BEFORETABLE\n\
*nat\n\
\u{0}\u{ff}\u{7f} binary junk ]]][[[\n\
[\n\
]\n\
[:] -A\n\
[1:2]\n\
[1:2] -A\n\
[3:4] -A KUBE-SERVICES\n\
-A KUBE-SERVICES -p tcp -m comment --comment \"ns/nocounters:p cluster IP\" -j KUBE-SVC-X\n\
[99999999999999999999999:1] -A KUBE-SERVICES -p tcp -m comment --comment \"ns/toobig:p cluster IP\" -j KUBE-SVC-X\n\
[18446744073709551615:18446744073709551615] -A KUBE-SERVICES -p tcp -m comment --comment \"ns/max:p cluster IP\" -j KUBE-SVC-X\n\
[-1:0] -A KUBE-SERVICES -p tcp -m comment --comment \"ns/negative:p cluster IP\" -j KUBE-SVC-X\n\
[5:5] -A KUBE-SERVICES -p tcp -m comment --comment \"say \\\"ns/quoted:p cluster IP\\\" twice\" -j KUBE-SVC-X\n\
[5:5] -A KUBE-SERVICES -p tcp -m comment --comment \"ns/unterminated:p cluster IP -j KUBE-SVC-X\n\
[5:5] -A KUBE-SERVICES -p tcp -m comment --comment \"ns/\\\"odd:p cluster IP\" -j KUBE-SVC-X\n\
[5:5] -A KUBE-SERVICES -p tcp -m comment --comment \"/:p cluster IP\" -j KUBE-SVC-X\n\
[5:5] -A KUBE-SERVICES -p icmp -m comment --comment \"ns/icmp:p cluster IP\" -j KUBE-SVC-X\n\
[5:5] -A KUBE-SERVICES -p tcp -m comment --comment \"ns/notarget:p cluster IP\"\n\
[5:5] -A KUBE-SERVICES -p tcp -m comment --comment \"ns/dangling:p external IP\" -d\n\
[5:5] -A KUBE-SERVICES -p tcp -m comment --comment --comment -j\n\
[5:5] -A KUBE-SEP-X -p tcp -j DNAT --to-destination not-an-address\n\
[5:5] -A KUBE-SEP-Y -p tcp -m comment --comment ns/ep:p -j DNAT --to-destination 10.0.0.1\n\
[5:5] -A KUBE-SEP-Z -p tcp -j DNAT --to-destination 10.0.0.1:80\n\
[5:5] -A KUBE-FW-UNKNOWN -m comment --comment \"other traffic to ns/x:p will be dropped by KUBE-PROXY-FIREWALL\"\n\
[5:5] -A KUBE-NODEPORTS -p tcp -m comment --comment \"ns/np:p extra words\" -j KUBE-EXT-X\n\
COMMIT\n\
*filter\n\
[5:5] -A KUBE-EXTERNAL-SERVICES -p tcp -m comment --comment \"ns/x:p has no endpoints\" -j REJECT\n\
[5:5] -A KUBE-EXTERNAL-SERVICES -p tcp -d 10.0.0.0/24 --dport 80 -m comment --comment \"ns/x:p has no endpoints\" -j REJECT\n\
[5:5] -A KUBE-SERVICES -p tcp -m comment --comment \"ns/x:p has no endpoints\" -j DROP\n\
[5:5] -A KUBE-FORWARD -p tcp -m comment --comment \"ns/x:p has no endpoints\" -j REJECT\n\
";
    let reading = reading(IpFamily::V4, text, &TrafficContext::default());
    let mut counted: Vec<(String, u64)> = reading
        .services
        .iter()
        .map(|s| (s.key.service.name.clone(), s.counts.new_connections))
        .collect();
    counted.sort();
    assert_eq!(counted, [("max".to_owned(), u64::MAX)]);
    assert!(reading.endpoints.is_empty());

    // Every prefix of the generator's own dump, cut anywhere: no panic.
    let snapshot = services();
    let restore = generate(&rules_context(1000), &snapshot, FULL).restore;
    let dump = Dump::of(&String::from_utf8_lossy(&restore));
    let context = traffic_context(&snapshot);
    for (end, _) in dump.text.char_indices().step_by(17) {
        let _ = super::reading(IpFamily::V4, &dump.text[..end], &context);
    }
    for garbage in [
        text,
        "",
        "*",
        "*nat\n[",
        "[1:1] -A \"",
        "*nat\n[0:0] -A X \"\\",
    ] {
        let _ = super::reading(IpFamily::V6, garbage, &context);
    }
}

#[test]
fn chains_no_packet_reaches_are_not_counted() {
    // Large clusters delete unused chains only once per sync period: until then a removed
    // endpoint's KUBE-SEP chain and a KUBE-FW chain the Service no longer uses keep their old
    // counters, while the Service's epoch moves with each sync that changes it.
    let snapshot = services();
    let before = generate(&rules_context(1000), &snapshot, FULL);
    let mut changed = snapshot.clone();
    for port in changed.service_ports.values_mut() {
        if port.name.service.name.as_ref() == "web" {
            port.endpoints.truncate(1);
            port.source_ranges.clear();
        }
    }
    let after = generate(&rules_context(1000), &changed, FULL);
    let restore = String::from_utf8_lossy(&after.restore).into_owned();
    // The stale chains, as iptables still holds them: the old text of each.
    let old = String::from_utf8_lossy(&before.restore).into_owned();
    let stale: Vec<&str> = old
        .lines()
        .filter(|l| {
            l.starts_with("-A KUBE-FW-")
                || (l.starts_with("-A KUBE-SEP-") && l.contains("10.1.0.2"))
        })
        .collect();
    assert_eq!(stale.len(), 4, "{stale:?}");
    let with_stale = restore.replace("*nat\n", &format!("*nat\n{}\n", stale.join("\n")));
    let dump = Dump::of(&with_stale);
    let reading = reading(IpFamily::V4, &dump.text, &traffic_context(&changed));
    assert!(
        !reading
            .services
            .iter()
            .any(|s| s.counts.dropped_source_range > 0),
        "{reading:?}"
    );
    let web_lb: Vec<_> = reading
        .services
        .iter()
        .filter(|s| s.key.service.name == "web" && s.key.frontend == FrontendKind::LoadBalancer)
        .collect();
    assert_eq!(web_lb.len(), 1, "{web_lb:?}");
    assert_eq!(
        web_lb[0].counts.new_connections,
        dump.packets("nat", "-A KUBE-SERVICES", &["default/web loadbalancer IP"])
    );
    let endpoints: Vec<String> = reading
        .endpoints
        .iter()
        .map(|e| e.endpoint.to_string())
        .collect();
    assert!(
        !endpoints.contains(&"10.1.0.2:8080".to_owned()),
        "{endpoints:?}"
    );
    assert!(
        endpoints.contains(&"10.1.0.1:8080".to_owned()),
        "{endpoints:?}"
    );
}
