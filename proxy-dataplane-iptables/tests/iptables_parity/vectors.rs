//! The parity tests: chain vectors, misc vectors, full scenarios, packet flows.

use std::{collections::BTreeSet, net::IpAddr};

use super::fixtures::{
    NODE_NAME, fake_proxier, for_family, full_sync, load, objects, str_of, test_interface_ips,
    with_node_port_addresses,
};
use super::{fixtures, normalize, tracer::Tracer};
use proxy_dataplane_iptables::{SyncInput, generate, jumps::JUMP_RULES, rules::probability};
use proxy_model::{
    desired::{IpFamily, Snapshot},
    objects::ObjectKey,
};
use serde_yaml::Value;

fn seq(value: &Value, key: &str) -> Vec<Value> {
    value
        .get(key)
        .and_then(Value::as_sequence)
        .cloned()
        .unwrap_or_default()
}

/// The `-A` rules of one chain, in emitted order.
fn chain_rules(restore: &str, table: &str, chain: &str) -> Vec<String> {
    let mut current = "";
    let prefix = format!("-A {chain} ");
    restore
        .lines()
        .filter(|line| {
            if let Some(name) = line.strip_prefix('*') {
                current = name;
            }
            current == table && line.starts_with(&prefix)
        })
        .map(str::to_owned)
        .collect()
}

fn lines(text: &str) -> Vec<String> {
    text.lines().map(str::to_owned).collect()
}

#[test]
fn chain_vectors() {
    let vectors = load("chain-vectors.yaml");
    let mut checked = 0;
    for test in vectors.as_sequence().unwrap() {
        match str_of(test, "test").unwrap() {
            "TestDropInvalidRule" => {
                let tail = lines(str_of(test, "common_tail").unwrap());
                for variant in seq(test, "variants") {
                    let mut rules = fake_proxier(IpFamily::V4);
                    rules.conntrack_tcp_liberal = variant["tcpLiberal"].as_bool().unwrap();
                    rules.nfacct_invalid = variant["nfacct_ct_state_invalid_dropped_pkts"]
                        .as_bool()
                        .unwrap();
                    let restore = full_sync(&rules, &objects(&[], &[]));
                    let mut expected: Vec<String> = variant["first_rule"]
                        .as_str()
                        .map(str::to_owned)
                        .into_iter()
                        .collect();
                    expected.extend(tail.iter().cloned());
                    assert_eq!(
                        chain_rules(&restore, "filter", "KUBE-FORWARD"),
                        expected,
                        "{variant:?}"
                    );
                    checked += 1;
                }
            }
            "TestMasqueradeRule" => {
                for (random_fully, key) in [
                    (false, "expected_randomFully_false"),
                    (true, "expected_randomFully_true"),
                ] {
                    let mut rules = fake_proxier(IpFamily::V4);
                    rules.random_fully = random_fully;
                    let restore = full_sync(&rules, &objects(&[], &[]));
                    assert_eq!(
                        chain_rules(&restore, "nat", "KUBE-POSTROUTING"),
                        lines(str_of(test, key).unwrap())
                    );
                    checked += 1;
                }
            }
            "TestComputeProbability" => {
                for (n, expected) in test["vectors"].as_mapping().unwrap() {
                    let n = usize::try_from(n.as_u64().unwrap()).unwrap();
                    assert_eq!(probability(n), expected.as_str().unwrap(), "n = {n}");
                    checked += 1;
                }
                let mut previous = 0.0;
                for n in (2..=100_000).rev() {
                    let p: f64 = probability(n).parse().unwrap();
                    assert!(
                        p > previous,
                        "probability({n}) = {p} is not above {previous}"
                    );
                    previous = p;
                }
                checked += 1;
            }
            other => panic!("chain-vectors.yaml: unknown test {other}; add it to this test"),
        }
    }
    println!("chain vectors: {checked} checks passed");
}

fn scenario_rules(node: &Value) -> proxy_dataplane_iptables::FamilyRules {
    let mut rules = fake_proxier(IpFamily::V4);
    if let Some(mark) = str_of(node, "masqueradeMark") {
        rules.mark = mark.to_owned();
    }
    rules.masquerade_all = node
        .get("masqueradeAll")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    rules.localhost_node_ports = node
        .get("localhostNodePorts")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    rules.random_fully = node
        .get("iptablesHasRandomFully")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    rules.conntrack_tcp_liberal = node
        .get("conntrackTCPLiberal")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let counters = node.get("nfacctCounters");
    let counter = |name| {
        counters
            .and_then(|c| c.get(name))
            .and_then(Value::as_bool)
            .unwrap_or(true)
    };
    rules.nfacct_invalid = counter("ct_state_invalid_dropped_pkts");
    rules.nfacct_localhost = counter("localhost_nps_accepted_pkts");
    let cidrs: Vec<String> = seq(node, "nodePortAddresses")
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    let cidrs: Vec<&str> = cidrs.iter().map(String::as_str).collect();
    with_node_port_addresses(rules, &cidrs)
}

fn local_ips() -> Vec<IpAddr> {
    test_interface_ips()
}

fn jump_lines() -> Vec<(String, String)> {
    JUMP_RULES
        .iter()
        .map(|j| (j.table.to_owned(), j.to_line()))
        .collect()
}

/// Runs packet cases against a restore text; returns how many ran.
fn run_cases(
    context: &str,
    restore: &str,
    cases: &[Value],
    substitute: &dyn Fn(&str) -> String,
) -> usize {
    let tracer = Tracer::new(restore, &jump_lines(), &local_ips());
    for case in cases {
        let field = |k: &str| {
            substitute(
                &case[k]
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| case[k].as_u64().map(|n| n.to_string()).unwrap_or_default()),
            )
        };
        let proto = case.get("proto").and_then(Value::as_str).unwrap_or("tcp");
        let trace = tracer.trace(&field("src"), proto, &field("dst"), &field("dport"));
        let name = str_of(case, "name").unwrap_or("?");
        assert_eq!(
            trace.output,
            field("output"),
            "{context} / {name}: output\n{restore}"
        );
        if let Some(masq) = case.get("masq").and_then(Value::as_bool) {
            assert_eq!(trace.masq, masq, "{context} / {name}: masq\n{restore}");
        }
    }
    cases.len()
}

#[test]
fn scenarios() {
    let dir = fixtures::parity_dir().join("scenarios");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no scenarios in {}", dir.display());
    let mut packets = 0;
    for path in &files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let scenario: Value =
            serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let node = &scenario["node"];
        assert_eq!(str_of(node, "nodeName"), Some(NODE_NAME), "{name}");
        let rules = scenario_rules(node);
        let objs = objects(
            &seq(&scenario, "services"),
            &seq(&scenario, "endpointSlices"),
        );
        let restore = full_sync(&rules, &objs);
        normalize::assert_same(&name, str_of(&scenario, "expected").unwrap(), &restore);

        // The nat rule count kube-proxy reports is the number of nat `-A` lines.
        let snapshot = Snapshot::compute(&objs, NODE_NAME);
        let ruleset = generate(
            &rules,
            &snapshot.v4,
            SyncInput {
                changed_services: None,
                existing_nat_chains: None,
            },
        );
        let tables = normalize::parse(&restore);
        assert_eq!(
            ruleset.nat_rules_total,
            tables["nat"].rules.len(),
            "{name}: nat rule count"
        );
        assert_eq!(
            ruleset.filter_rules,
            tables["filter"].rules.len(),
            "{name}: filter rule count"
        );

        let (before, after): (Vec<Value>, Vec<Value>) = seq(&scenario, "packetFlow")
            .into_iter()
            .partition(|c| c.get("after").is_none());
        packets += run_cases(&name, &restore, &before, &|s| s.to_owned());
        if !after.is_empty() {
            // Every "after" step in the scenarios so far is "delete service; sync".
            let restore = full_sync(&rules, &objects(&[], &[]));
            packets += run_cases(&name, &restore, &after, &|s| s.to_owned());
        }
    }
    println!(
        "scenarios: {} full rulesets and {packets} packet cases passed",
        files.len()
    );
}

#[test]
fn packet_flows() {
    let tests = load("packet-flow-tests.yaml");
    let mut count = 0;
    let same = |s: &str| s.to_owned();
    for test in tests.as_sequence().unwrap() {
        let name = str_of(test, "test").unwrap();
        match name {
            "TestTracePacket" => {
                let ruleset = str_of(test, "ruleset").unwrap();
                count += run_cases(name, ruleset, &seq(test, "cases"), &same);
            }
            "TestOverallIPTablesRules" => {} // a full ruleset: covered by `scenarios`
            "TestNoEndpointsReject"
            | "TestClusterIPGeneral"
            | "TestLoadBalancer"
            | "TestExternalTrafficPolicyCluster"
            | "TestHealthCheckNodePort" => {
                let input = &test["input"];
                let mut rules = fake_proxier(IpFamily::V4);
                if let Some(over) = input.get("node_override") {
                    let cidrs: Vec<String> = seq(over, "nodePortAddresses")
                        .iter()
                        .map(|v| v.as_str().unwrap().to_owned())
                        .collect();
                    let cidrs: Vec<&str> = cidrs.iter().map(String::as_str).collect();
                    rules = with_node_port_addresses(rules, &cidrs);
                }
                let objs = objects(&seq(input, "services"), &seq(input, "endpointSlices"));
                count += run_cases(name, &full_sync(&rules, &objs), &seq(test, "cases"), &same);
                let after = seq(test, "cases_after_delete");
                if !after.is_empty() {
                    count += run_cases(name, &full_sync(&rules, &objects(&[], &[])), &after, &same);
                }
            }
            "TestNodePorts" => count += node_ports(test),
            "TestInternalTrafficPolicy" => count += internal_traffic_policy(test),
            other => panic!("packet-flow-tests.yaml: unknown test {other}; add it to this test"),
        }
    }
    println!("packet flows: {count} cases passed");
}

fn node_ports(test: &Value) -> usize {
    let mut count = 0;
    for variant in seq(test, "variants") {
        let vname = str_of(&variant, "name").unwrap();
        let family = match str_of(&variant, "family").unwrap() {
            "IPv4" => IpFamily::V4,
            _ => IpFamily::V6,
        };
        let mut rules = fake_proxier(family);
        rules.localhost_node_ports =
            variant["localhostNodePorts"].as_bool().unwrap() && family == IpFamily::V4;
        let cidrs: Vec<String> = seq(&variant, "nodePortAddresses")
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect();
        let cidrs: Vec<&str> = cidrs.iter().map(String::as_str).collect();
        rules = with_node_port_addresses(rules, &cidrs);
        let input = for_family(&test["input"], family);
        let mut slices = seq(&input, "endpointSlices");
        for slice in &mut slices {
            slice["addressType"] = Value::from(family.as_k8s());
        }
        let objs = objects(&seq(&input, "services"), &slices);
        let restore = full_sync(&rules, &objs);

        let addresses = &test["per_family_addresses"][family.as_k8s()];
        let svc_ip = fixtures::pick_family(
            str_of(&seq(&test["input"], "services")[0], "clusterIP").unwrap(),
            family,
        );
        let substitute = |s: &str| -> String {
            match s {
                "svcIP" => svc_ip.clone(),
                "<output>" => str_of(addresses, "output").unwrap().to_owned(),
                other => str_of(addresses, other).unwrap_or(other).to_owned(),
            }
        };
        let context = format!("TestNodePorts / {vname}");
        count += run_cases(
            &context,
            &restore,
            &seq(test, "cases_all_variants"),
            &substitute,
        );
        let localhost_ok =
            family == IpFamily::V4 && variant["localhostNodePorts"].as_bool().unwrap();
        let alt_ok = variant["allowAltNodeIP"].as_bool().unwrap();
        let conditional: Vec<Value> = seq(test, "cases_conditional")
            .into_iter()
            .filter(|c| match str_of(c, "when").unwrap() {
                "family==IPv4 && localhostNodePorts" => localhost_ok,
                "otherwise" => !localhost_ok,
                "allowAltNodeIP" => alt_ok,
                "!allowAltNodeIP" => !alt_ok,
                other => panic!("TestNodePorts: unknown condition {other}"),
            })
            .collect();
        count += run_cases(&context, &restore, &conditional, &substitute);

        let firewall = chain_rules(&restore, "filter", "KUBE-FIREWALL");
        let expected: Vec<String> = if variant["expectFirewall"].as_bool().unwrap() {
            vec![str_of(&test["chain_check"], "rule").unwrap().to_owned()]
        } else {
            Vec::new()
        };
        assert_eq!(firewall, expected, "{context}: KUBE-FIREWALL");
    }
    count
}

fn internal_traffic_policy(test: &Value) -> usize {
    let common = &test["common_input"];
    let rules = fake_proxier(IpFamily::V4);
    let same = |s: &str| s.to_owned();
    let mut count = 0;
    for variant in seq(test, "variants") {
        let context = format!(
            "TestInternalTrafficPolicy / {}",
            str_of(&variant, "name").unwrap()
        );
        let mut service = common["service"].clone();
        service["internalTrafficPolicy"] = variant["internalTrafficPolicy"].clone();
        let mut slice = common["endpointSlice"].clone();
        slice["endpoints"] = variant["endpoints"].clone();
        let restore = full_sync(&rules, &objects(std::slice::from_ref(&service), &[slice]));
        count += run_cases(&context, &restore, &seq(&variant, "cases"), &same);
        let restore = full_sync(&rules, &objects(&[service], &[]));
        count += run_cases(&context, &restore, &seq(test, "cases_after_delete"), &same);
    }
    count
}

#[test]
fn misc_vectors() {
    let vectors = load("misc-vectors.yaml");
    let mut checked = 0;
    for test in vectors.as_sequence().unwrap() {
        match str_of(test, "test").unwrap() {
            "TestLoadBalancerIngressRouteTypeProxy" => {
                for case in seq(test, "cases") {
                    let lb_ip = str_of(&case, "lbIP").unwrap();
                    let mut ingress = serde_yaml::Mapping::new();
                    ingress.insert("ip".into(), lb_ip.into());
                    ingress.insert("ipMode".into(), case["ipMode"].clone());
                    let service: Value = serde_yaml::from_str(&format!(
                        "{{ns: ns1, name: svc1, type: LoadBalancer, clusterIP: {}, \
                         ports: [{{name: p80, port: 80, protocol: TCP, nodePort: 3001}}]}}",
                        str_of(&case, "clusterIP").unwrap()
                    ))
                    .unwrap();
                    let mut service = service;
                    service["loadBalancerIngress"] = Value::Sequence(vec![Value::Mapping(ingress)]);
                    let slice: Value = serde_yaml::from_str(
                        "{ns: ns1, svc: svc1, addressType: IPv4, endpoints: [{addresses: [10.180.0.1]}], \
                         ports: [{name: p80, port: 80, protocol: TCP}]}",
                    )
                    .unwrap();
                    let restore =
                        full_sync(&fake_proxier(IpFamily::V4), &objects(&[service], &[slice]));
                    let has = chain_rules(&restore, "nat", "KUBE-SERVICES")
                        .iter()
                        .any(|r| r.contains(&format!("-d {lb_ip} ")));
                    let expected = case["expect_nat_KUBE-SERVICES_rule_with_-d_lbIP"]
                        .as_bool()
                        .unwrap();
                    assert_eq!(has, expected, "{case:?}");
                    checked += 1;
                }
            }
            "TestNoEndpointsMetric" => {
                for case in seq(test, "cases") {
                    let mut service: Value = serde_yaml::from_str(
                        "{ns: ns1, name: svc1, clusterIP: 172.30.1.1, ports: [{name: '', port: 80, protocol: TCP, nodePort: 123}]}",
                    )
                    .unwrap();
                    if let Some(itp) = str_of(&case, "iTP") {
                        service["internalTrafficPolicy"] = itp.into();
                    }
                    if let Some(etp) = str_of(&case, "eTP") {
                        service["externalTrafficPolicy"] = etp.into();
                        service["type"] = "NodePort".into();
                    }
                    let endpoints: Vec<Value> = seq(&case, "endpoints")
                        .iter()
                        .map(|pair| {
                            serde_yaml::from_str(&format!(
                                "{{addresses: [{}], nodeName: {}}}",
                                pair[0].as_str().unwrap(),
                                pair[1].as_str().unwrap()
                            ))
                            .unwrap()
                        })
                        .collect();
                    let mut slice: Value = serde_yaml::from_str(
                        "{ns: ns1, svc: svc1, addressType: IPv4, ports: [{name: '', port: 80, protocol: TCP}]}",
                    )
                    .unwrap();
                    slice["endpoints"] = Value::Sequence(endpoints);
                    let snapshot = Snapshot::compute(&objects(&[service], &[slice]), NODE_NAME);
                    let ruleset = generate(
                        &fake_proxier(IpFamily::V4),
                        &snapshot.v4,
                        SyncInput {
                            changed_services: None,
                            existing_nat_chains: None,
                        },
                    );
                    let name = str_of(&case, "name").unwrap();
                    assert_eq!(
                        ruleset.no_local_endpoints_internal as u64,
                        case["internal"].as_u64().unwrap(),
                        "{name}"
                    );
                    assert_eq!(
                        ruleset.no_local_endpoints_external as u64,
                        case["external"].as_u64().unwrap(),
                        "{name}"
                    );
                    checked += 1;
                }
            }
            "TestSyncProxyRulesLargeClusterMode" => checked += large_cluster_mode(),
            // Not about the generator: TestHealthCheckNodePortWhenTerminating runs in
            // http_servers/tests/service_health.rs (both steps, 200 then 503), and
            // TestUpdateEndpointsMap's key facts (its cases list results without inputs) in
            // desired/snapshot/tests.rs `update_endpoints_map_key_facts` and the local ready
            // endpoint counts in service_health.rs.
            "TestHealthCheckNodePortWhenTerminating" | "TestUpdateEndpointsMap" => {}
            other => panic!("misc-vectors.yaml: unknown test {other}; add it to this test"),
        }
    }
    println!("misc vectors: {checked} checks passed");
}

/// TestSyncProxyRulesLargeClusterMode's steps (partial syncs, comment dropping, deferred
/// stale-chain deletion is the dataplane's timing and is checked there).
fn large_cluster_mode() -> usize {
    let mut rules = fake_proxier(IpFamily::V4);
    rules.masquerade_all = true;
    let services: Vec<Value> = [("ns1", "svc1", "172.30.0.41", "p80", 80), ("ns2", "svc2", "172.30.0.42", "p8080", 8080), ("ns3", "svc3", "172.30.0.43", "p8081", 8081)]
        .iter()
        .map(|(ns, name, ip, port_name, port)| {
            serde_yaml::from_str(&format!(
                "{{ns: {ns}, name: {name}, clusterIP: {ip}, ports: [{{name: {port_name}, port: {port}, protocol: TCP}}]}}"
            ))
            .unwrap()
        })
        .collect();
    let slice_of = |ns: &str, svc: &str, port_name: &str, port: u16, ips: Vec<String>| -> Value {
        let mut slice: Value = serde_yaml::from_str(&format!(
            "{{ns: {ns}, svc: {svc}, addressType: IPv4, ports: [{{name: {port_name}, port: {port}, protocol: TCP}}]}}"
        ))
        .unwrap();
        slice["endpoints"] = Value::Sequence(
            ips.into_iter()
                .map(|ip| serde_yaml::from_str(&format!("{{addresses: [{ip}]}}")).unwrap())
                .collect(),
        );
        slice
    };
    let many = |a: u32| {
        (0..499u32)
            .map(move |i| format!("10.{a}.{}.{}", i % 256, i / 256))
            .collect::<Vec<_>>()
    };
    let mut slices = vec![
        slice_of("ns1", "svc1", "p80", 80, many(0)),
        slice_of("ns2", "svc2", "p8080", 8080, many(1)),
    ];
    let dnat_rules = |restore: &str| -> Vec<String> {
        restore
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SEP-") && l.contains("DNAT"))
            .map(str::to_owned)
            .collect()
    };
    let sync = |objs: &proxy_model::objects::Objects, changed: Option<&BTreeSet<ObjectKey>>| {
        let snapshot = Snapshot::compute(objs, NODE_NAME);
        let ruleset = generate(
            &rules,
            &snapshot.v4,
            SyncInput {
                changed_services: changed,
                existing_nat_chains: None,
            },
        );
        String::from_utf8(ruleset.restore.to_vec()).unwrap()
    };

    let restore = sync(&objects(&services, &slices), None);
    let dnat = dnat_rules(&restore);
    assert_eq!(dnat.len(), 998);
    assert!(dnat.iter().all(|r| r.contains("--comment")));
    assert!(dnat.contains(&"-A KUBE-SEP-DKGQUZGBKLTPAR56 -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.0.0.0:80".to_owned()));

    slices.push(slice_of(
        "ns3",
        "svc3",
        "p8081",
        8081,
        vec![
            "203.0.113.4".into(),
            "203.0.113.8".into(),
            "203.0.113.12".into(),
        ],
    ));
    let objs = objects(&services, &slices);
    let svc3: BTreeSet<ObjectKey> = [ObjectKey {
        namespace: "ns3".into(),
        name: "svc3".into(),
    }]
    .into();
    let dnat = dnat_rules(&sync(&objs, Some(&svc3)));
    assert_eq!(dnat.len(), 3, "partial sync writes only svc3's endpoints");
    assert!(
        dnat.contains(
            &"-A KUBE-SEP-RUVVH7YV3PHQBDOS -m tcp -p tcp -j DNAT --to-destination 203.0.113.4:8081"
                .to_owned()
        )
    );

    let dnat = dnat_rules(&sync(&objs, None));
    assert_eq!(dnat.len(), 1001);
    assert!(dnat.iter().all(|r| !r.contains("--comment")));
    assert!(
        dnat.contains(
            &"-A KUBE-SEP-DKGQUZGBKLTPAR56 -m tcp -p tcp -j DNAT --to-destination 10.0.0.0:80"
                .to_owned()
        )
    );

    let mut services4 = services.clone();
    services4.push(serde_yaml::from_str("{ns: ns4, name: svc4, clusterIP: 172.30.0.44, ports: [{name: p8082, port: 8082, protocol: TCP}]}").unwrap());
    let mut slices4 = slices.clone();
    slices4.push(slice_of(
        "ns4",
        "svc4",
        "p8082",
        8082,
        vec!["10.4.0.1".into()],
    ));
    let svc4: BTreeSet<ObjectKey> = [ObjectKey {
        namespace: "ns4".into(),
        name: "svc4".into(),
    }]
    .into();
    let dnat = dnat_rules(&sync(&objects(&services4, &slices4), Some(&svc4)));
    assert_eq!(
        dnat,
        ["-A KUBE-SEP-SU5STNODRYEWJAUF -m tcp -p tcp -j DNAT --to-destination 10.4.0.1:8082"]
    );

    // Deleting svc4: with the existing chains known, its chains are flushed and deleted.
    let snapshot = Snapshot::compute(&objects(&services4, &slices4), NODE_NAME);
    let before = generate(
        &rules,
        &snapshot.v4,
        SyncInput {
            changed_services: None,
            existing_nat_chains: None,
        },
    );
    let snapshot = Snapshot::compute(&objs, NODE_NAME);
    let after = generate(
        &rules,
        &snapshot.v4,
        SyncInput {
            changed_services: Some(&svc4),
            existing_nat_chains: Some(&before.active_nat_chains),
        },
    );
    let restore = String::from_utf8(after.restore.to_vec()).unwrap();
    assert!(
        restore.contains("-X KUBE-SVC-EBDQOQU5SJFXRIL3\n"),
        "svc4's service chain deleted"
    );
    assert!(
        restore.contains("-X KUBE-SEP-SU5STNODRYEWJAUF\n"),
        "svc4's endpoint chain deleted"
    );
    assert_eq!(after.deleted_chains.len(), 2);
    6
}

/// TestSyncProxyRulesRepeated (`vectors/sync-repeated.yaml`): a full sync, then partial syncs
/// of the changed Services only, each compared with upstream's expected text, with the nat rule
/// counts upstream's metrics report (`sync_proxy_rules_iptables_last` / `_total`).
#[test]
fn sync_proxy_rules_repeated() {
    let vectors = load("sync-repeated.yaml");
    let rules = fake_proxier(IpFamily::V4);
    let key = |text: &str| {
        let (namespace, name) = text.split_once('/').unwrap();
        ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    };
    let compact = |item: &Value| -> Value {
        match item {
            Value::String(text) => serde_yaml::from_str(text).unwrap(),
            other => other.clone(),
        }
    };
    // Keyed by namespace/name so a step replaces or removes its object.
    let mut services: std::collections::BTreeMap<String, Value> = Default::default();
    let mut slices: std::collections::BTreeMap<String, Value> = Default::default();
    let mut existing: Option<BTreeSet<String>> = None;
    let steps = seq(&vectors, "steps");
    assert_eq!(steps.len(), 8);
    for step in &steps {
        let name = str_of(step, "step").unwrap();
        for service in seq(step, "add_services").iter().map(compact) {
            let id = format!(
                "{}/{}",
                str_of(&service, "ns").unwrap(),
                str_of(&service, "name").unwrap()
            );
            services.insert(id, service);
        }
        for id in seq(step, "delete_services") {
            let id = id.as_str().unwrap();
            services.remove(id);
            slices.remove(id);
        }
        for slice in seq(step, "set_slices").iter().map(compact) {
            let id = format!(
                "{}/{}",
                str_of(&slice, "ns").unwrap(),
                str_of(&slice, "svc").unwrap()
            );
            slices.insert(id, slice);
        }
        let changed: Option<BTreeSet<ObjectKey>> = step
            .get("changed")
            .and_then(Value::as_sequence)
            .map(|ids| ids.iter().map(|id| key(id.as_str().unwrap())).collect());
        let objs = objects(
            &services.values().cloned().collect::<Vec<_>>(),
            &slices.values().cloned().collect::<Vec<_>>(),
        );
        let snapshot = Snapshot::compute(&objs, NODE_NAME);
        let ruleset = generate(
            &rules,
            &snapshot.v4,
            SyncInput {
                changed_services: changed.as_ref(),
                existing_nat_chains: existing.as_ref(),
            },
        );
        let restore = String::from_utf8(ruleset.restore.to_vec()).unwrap();
        let expected = str_of(step, "expected").unwrap();
        normalize::assert_same(name, expected, &restore);
        // upstream's countRules: the rules of the table after parsing, so `-A` lines only.
        let expected_nat = normalize::parse(expected)["nat"]
            .rules
            .iter()
            .filter(|rule| rule.starts_with("-A "))
            .count();
        assert_eq!(
            ruleset.nat_rules_written, expected_nat,
            "{name}: sync_proxy_rules_iptables_last{{nat}}"
        );
        assert_eq!(
            ruleset.nat_rules_total as u64,
            step["natRulesTotal"].as_u64().unwrap(),
            "{name}: sync_proxy_rules_iptables_total{{nat}}"
        );
        existing = Some(ruleset.active_nat_chains);
    }
    println!("TestSyncProxyRulesRepeated: {} steps passed", steps.len());
}
