//! `inspect explain` agrees with real packets over the whole reachability matrix: every cell
//! of `tests/src/reachability` (client on this node's pod, the host, its loopback, a pod on
//! node2, the external client from inside and outside the source ranges × the Service shapes:
//! eTP Cluster/Local with and without local endpoints, iTP Local with and without, no
//! endpoints, terminating endpoints, ClientIP affinity, LB IPs with ipMode VIP/Proxy and
//! source ranges, externalIPs, NodePorts on listed/unlisted/loopback addresses; IPv4 and
//! IPv6), plus UDP Services (with and without endpoints), in both modes. For each tuple the
//! test asks `explain` first, then makes real connections and checks every outcome:
//!
//! - `translate`: a predicted candidate answered (the chosen one, where explain names it), and
//!   the backend saw the client's own address exactly when explain says the source is kept;
//! - `refuse`: ECONNREFUSED; `drop`: a failure other than a refusal; `pass`: no Service
//!   backend answered.
//!
//! After the ClientIP-affinity cells, explain must name the backend the affinity entry now
//! holds (eBPF: the clients tc handles; iptables: every client with its own address, from the
//! `recent` lists), and the socket a UDP client kept sending from must show up among the live
//! per-socket entries (eBPF). SCTP is not here: these kernels have no
//! SCTP stack (`external_sctp.rs` covers SCTP with raw sockets). Needs root.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use proxy_tests::agent::agent_binary;
use proxy_tests::client::{Attempt, Mode, Proto};
use proxy_tests::manifests::{Endpoint, Protocol, SlicePort, endpoint_slice_yaml_family};
use proxy_tests::reachability::cells::{BACKEND_PORT, NODE_EXT_IP, NODE_EXT_IP6};
use proxy_tests::reachability::rig::{MatrixRig, REMOTE_NODE_NAME};
use proxy_tests::reachability::{Cell, Client, Family, Frontend, Shape, all_cells};
use proxy_tests::scenario::HOSTNAME;
use proxy_tests::topology::Topology;

/// Connections of a tuple explain predicts to be translated (or that something answers);
/// refusals, drops and unanswered passes cost a timeout (or, for IPv6 REJECTs, a SYN
/// retransmission) each, so they get fewer.
const ANSWERED: u32 = 16;
const FAILING: u32 = 3;
const WORKERS: usize = 8;
/// The UDP Services: with endpoints pod2 + rpod2 (eTP Cluster), and without endpoints.
const UDP_INDEX: u8 = 11;
const UDP_NONE_INDEX: u8 = 12;

/// One tuple family to check: a client, a destination, a protocol.
#[derive(Debug, Clone)]
struct Case {
    label: String,
    /// The matrix cell whose client connects (its shape is irrelevant for the UDP cases).
    cell: Cell,
    target: SocketAddr,
    udp: bool,
}

fn udp_cluster_ip(index: u8, family: Family) -> IpAddr {
    family.pick(
        Ipv4Addr::new(10, 96, 1, index),
        Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 1, u16::from(index)),
    )
}

fn udp_yaml(index: u8, name: &str, with_endpoints: bool) -> String {
    let ips: Vec<String> = Family::ALL
        .iter()
        .map(|f| format!("\"{}\"", udp_cluster_ip(index, *f)))
        .collect();
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  \
         type: NodePort\n  clusterIP: {}\n  clusterIPs: [{}]\n  ipFamilies: [IPv4, IPv6]\n  \
         ipFamilyPolicy: RequireDualStack\n  ports:\n  - {{name: dns, port: 53, targetPort: \
         {BACKEND_PORT}, protocol: UDP, nodePort: {}}}\n",
        ips[0],
        ips.join(", "),
        30100 + u16::from(index)
    );
    let port = SlicePort {
        name: "dns".into(),
        port: BACKEND_PORT,
        protocol: Protocol::Udp,
    };
    for family in Family::ALL {
        let endpoints: Vec<Endpoint> = if with_endpoints {
            [(2, false), (2, true)]
                .iter()
                .map(|&(i, remote)| Endpoint {
                    node_name: Some(if remote { REMOTE_NODE_NAME } else { HOSTNAME }.into()),
                    ..Endpoint::ready(if remote {
                        Topology::remote_pod_addr(i, family.is_v6())
                    } else {
                        Topology::pod_addr(i, family.is_v6())
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        y.push_str("---\n");
        y.push_str(&endpoint_slice_yaml_family(
            "default",
            &format!("{name}-{}", if family.is_v6() { "v6" } else { "v4" }),
            name,
            std::slice::from_ref(&port),
            &endpoints,
            family.is_v6(),
        ));
    }
    y
}

/// Every matrix cell (TCP) and the UDP cases.
fn cases() -> Vec<Case> {
    let mut cases: Vec<Case> = all_cells()
        .into_iter()
        .map(|cell| Case {
            label: format!("{} TCP", cell.id()),
            target: cell.target(),
            cell,
            udp: false,
        })
        .collect();
    for (index, name) in [(UDP_INDEX, "udp"), (UDP_NONE_INDEX, "udp-none")] {
        for family in Family::ALL {
            let cluster = SocketAddr::new(udp_cluster_ip(index, family), 53);
            let node_port = SocketAddr::new(
                family.pick(NODE_EXT_IP, NODE_EXT_IP6),
                30100 + u16::from(index),
            );
            let pairs = [
                (Frontend::ClusterIp, Client::Pod, cluster),
                (Frontend::ClusterIp, Client::Host, cluster),
                (Frontend::ClusterIp, Client::RemotePod, cluster),
                (Frontend::ClusterIp, Client::External, cluster),
                (Frontend::NodePortExternal, Client::Pod, node_port),
                (Frontend::NodePortExternal, Client::Host, node_port),
                (Frontend::NodePortExternal, Client::External, node_port),
            ];
            for (frontend, client, target) in pairs {
                let cell = Cell {
                    shape: Shape::EtpCluster,
                    frontend,
                    client,
                    family,
                };
                cases.push(Case {
                    label: format!(
                        "m-{name}/{}/{}/{family} UDP",
                        frontend.name(),
                        client.name()
                    ),
                    cell,
                    target,
                    udp: true,
                });
            }
        }
    }
    cases
}

/// `proxy-agent inspect explain --json` in the node's namespace.
fn explain(
    netns: &Path,
    bpf_root: Option<&Path>,
    args: &[String],
) -> anyhow::Result<serde_json::Value> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?);
    if let Some(root) = bpf_root {
        cmd.arg("--bpf-root").arg(root);
    }
    let output = cmd
        .args(["inspect", "explain", "--json"])
        .args(args)
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect explain {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// `proxy-agent inspect explain` for people (printed: README's examples come from here).
fn explain_table(netns: &Path, bpf_root: Option<&Path>, args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", netns.display()))
        .arg(agent_binary()?);
    if let Some(root) = bpf_root {
        cmd.arg("--bpf-root").arg(root);
    }
    let output = cmd.args(["inspect", "explain"]).args(args).output()?;
    anyhow::ensure!(
        output.status.success(),
        "inspect explain {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// explain's arguments for a case: where the client is as the datapath sees it. node2's pod
/// is an outside client to this node (its packets arrive on the link to node2).
fn explain_args(case: &Case) -> Vec<String> {
    let proto = if case.udp { "udp" } else { "tcp" };
    let mut args = vec!["--to".to_owned(), format!("{}/{proto}", case.target)];
    let own = case.cell.client.own_address(case.cell.family);
    let from = match case.cell.client {
        Client::Pod | Client::Hairpin => "pod",
        Client::Host | Client::Localhost => "node",
        Client::RemotePod | Client::External | Client::ExternalOutsideRanges => "external",
    };
    args.extend(["--from".to_owned(), from.to_owned()]);
    if let Some(ip) = own {
        args.extend(["--client".to_owned(), ip.to_string()]);
    }
    args
}

/// The echo server name of a backend address: `pod<i>` for 10.244.<i>.2 / fd00:244:<i>::2,
/// `rpod<i>` for node2's 10.245.<i>.2 / fd00:245:<i>::2.
fn echo_name(backend: &str) -> String {
    let Ok(addr) = backend.parse::<SocketAddr>() else {
        return backend.to_owned();
    };
    let (net, i) = match addr.ip() {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            (u16::from(o[1]), u16::from(o[2]))
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            (s[1], s[2])
        }
    };
    match net {
        244 | 0x244 => format!("pod{i}"),
        245 | 0x245 => format!("rpod{i}"),
        _ => backend.to_owned(),
    }
}

/// What explain predicted, in the terms the connections show.
#[derive(Debug)]
struct Prediction {
    verdict: String,
    candidates: BTreeSet<String>,
    chosen: Option<String>,
    kept: bool,
    raw: serde_json::Value,
}

fn prediction(e: serde_json::Value) -> Prediction {
    let names = |v: &serde_json::Value| v.as_str().map(echo_name);
    Prediction {
        verdict: e["verdict"].as_str().unwrap_or_default().to_owned(),
        candidates: e["candidates"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(names)
            .collect(),
        chosen: names(&e["chosen"]),
        kept: e["source"].as_str().is_some_and(|s| s.ends_with("(kept)")),
        raw: e,
    }
}

fn is_service_backend(name: &str) -> bool {
    name.starts_with("pod") || name.starts_with("rpod")
}

/// Checks one attempt against the prediction.
fn check(case: &Case, p: &Prediction, attempt: &Attempt) -> Result<(), String> {
    let own = case.cell.client.own_address(case.cell.family);
    let ok = match (p.verdict.as_str(), attempt) {
        (
            "translate",
            Attempt::Ok {
                backend, client, ..
            },
        ) => {
            p.candidates.contains(backend)
                && p.chosen.as_ref().is_none_or(|c| c == backend)
                // Host clients: kept or masqueraded, the backend sees a node address.
                && own.is_none_or(|ip| (client.ip() == ip) == p.kept)
        }
        // iptables: a node's UDP send() to a REJECTed Service fails with EPERM (the datagram
        // is dropped in filter OUTPUT); explain's reason says so when it applies.
        ("refuse", Attempt::Err(reason)) => {
            reason == "ECONNREFUSED"
                || (reason == "EPERM"
                    && p.raw["reason"]
                        .as_str()
                        .is_some_and(|r| r.contains("EPERM")))
        }
        ("drop", Attempt::Err(reason)) => reason != "ECONNREFUSED",
        ("pass", Attempt::Ok { backend, .. }) => !is_service_backend(backend),
        ("pass", Attempt::Err(_)) => true,
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{}: explain predicted {} {:?} chosen={:?} kept={}, the connection got {attempt:?}\n{}",
            case.label,
            p.verdict,
            p.candidates,
            p.chosen,
            p.kept,
            serde_json::to_string(&p.raw).unwrap_or_default()
        ))
    }
}

struct Outcome {
    checked: usize,
    /// explain's verdict (with `+chosen` where it named the backend), for the summary.
    verdict: String,
    disagreements: Vec<String>,
}

/// Explains one case, makes its connections, checks each; for affinity (eBPF, tc-handled
/// clients) and unconnected UDP sockets, asks explain again afterwards.
fn run_case(rig: &MatrixRig, mode: &str, case: &Case) -> anyhow::Result<Outcome> {
    let netns = rig.node_netns();
    let bpf_root = if mode == "ebpf" { rig.bpf_root() } else { None };
    let args = explain_args(case);
    let p = prediction(explain(&netns, bpf_root, &args)?);
    let mut client = rig.client(&case.cell)?;
    if case.udp {
        client = client.proto(Proto::Udp);
    }
    let first = if p.verdict == "translate" {
        ANSWERED
    } else {
        FAILING
    };
    let mut attempts = client.run(case.target, first)?;
    // Something answers what explain passes untranslated (an `ipMode: Proxy` load balancer):
    // then as many tuples as for a translation.
    if p.verdict == "pass" && attempts.iter().any(|a| a.backend().is_some()) {
        attempts.extend(client.run(case.target, ANSWERED - FAILING)?);
    }
    let mut disagreements: Vec<String> = attempts
        .iter()
        .filter_map(|a| check(case, &p, a).err())
        .collect();
    let answered: BTreeSet<&str> = attempts.iter().filter_map(Attempt::backend).collect();
    let tc_client = matches!(
        case.cell.client,
        Client::External | Client::ExternalOutsideRanges | Client::RemotePod
    );
    // Who explain can name the affinity backend for: in eBPF mode the clients tc handles (the
    // socket hooks key affinity by network namespace, which explain cannot tell from an
    // address); in iptables mode every client with an address of its own (the recent lists).
    let named = if mode == "ebpf" {
        tc_client
    } else {
        case.cell.client.own_address(case.cell.family).is_some()
    };
    if case.cell.shape == Shape::Affinity && !case.udp && named && p.verdict == "translate" {
        let after = prediction(explain(&netns, bpf_root, &args)?);
        let [only] = answered.iter().collect::<Vec<_>>()[..] else {
            disagreements.push(format!("{}: affinity answered {answered:?}", case.label));
            return Ok(Outcome {
                checked: attempts.len(),
                verdict: p.verdict,
                disagreements,
            });
        };
        if after.chosen.as_deref() != Some(*only) {
            disagreements.push(format!(
                "{}: after the connections {only} holds the affinity entry, explain names {:?}",
                case.label, after.chosen
            ));
        }
    }
    Ok(Outcome {
        checked: attempts.len(),
        verdict: if p.chosen.is_some() {
            format!("{}+chosen", p.verdict)
        } else {
            p.verdict
        },
        disagreements,
    })
}

/// An unconnected UDP socket of pod1 sends to the UDP ClusterIP repeatedly: every datagram
/// reaches one backend, and explain lists that socket's live entry with that backend.
fn udp_sticky(rig: &MatrixRig, family: Family) -> anyhow::Result<Outcome> {
    let cell = Cell {
        shape: Shape::EtpCluster,
        frontend: Frontend::ClusterIp,
        client: Client::Pod,
        family,
    };
    let target = SocketAddr::new(udp_cluster_ip(UDP_INDEX, family), 53);
    let attempts = rig
        .client(&cell)?
        .mode(Mode::SendtoSocket)
        .run(target, ANSWERED)?;
    let answered: BTreeSet<&str> = attempts.iter().filter_map(Attempt::backend).collect();
    let args = vec![
        "--from".to_owned(),
        "pod".to_owned(),
        "--to".to_owned(),
        format!("{target}/udp"),
    ];
    let e = explain(&rig.node_netns(), rig.bpf_root(), &args)?;
    let sockets: BTreeSet<String> = e["sticky_sockets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["backend"].as_str().map(echo_name))
        .collect();
    let mut disagreements = Vec::new();
    let label = format!("unconnected UDP socket of pod1 → {target}");
    match answered.iter().collect::<Vec<_>>()[..] {
        [only] if sockets.contains(*only) => {}
        _ => disagreements.push(format!(
            "{label}: answered by {answered:?}, explain lists the sockets' backends {sockets:?}\n{e}"
        )),
    }
    Ok(Outcome {
        checked: attempts.len(),
        verdict: "udp sticky socket".to_owned(),
        disagreements,
    })
}

fn agreement(mode: &str) -> anyhow::Result<(usize, Vec<String>)> {
    let started = Instant::now();
    let mut rig = MatrixRig::new()?;
    rig.write_manifest("m-udp.yaml", &udp_yaml(UDP_INDEX, "m-udp", true))?;
    rig.write_manifest(
        "m-udp-none.yaml",
        &udp_yaml(UDP_NONE_INDEX, "m-udp-none", false),
    )?;
    rig.start_agent(mode)?;
    let not_ready = rig.wait_ready()?;
    anyhow::ensure!(
        not_ready.is_empty(),
        "[{mode}] {not_ready:?}\n{}",
        rig.agent_log_tail(40)
    );
    let cases = cases();
    // The affinity Service's cases run in one job, one after another: parallel first
    // connections of one client could each make an entry of their own.
    let mut jobs: Vec<Vec<usize>> = vec![Vec::new()];
    for (i, case) in cases.iter().enumerate() {
        if case.cell.shape == Shape::Affinity && !case.udp {
            jobs[0].push(i);
        } else {
            jobs.push(vec![i]);
        }
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<anyhow::Result<Outcome>>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..WORKERS {
            scope.spawn(|| {
                while let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    for &i in job {
                        let Some(case) = cases.get(i) else { continue };
                        let outcome = run_case(&rig, mode, case);
                        if let Ok(mut results) = results.lock() {
                            results.push(outcome);
                        }
                    }
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_default();
    if mode == "ebpf" {
        for family in Family::ALL {
            results.push(udp_sticky(&rig, family));
        }
    }
    let bpf_root = if mode == "ebpf" { rig.bpf_root() } else { None };
    let affinity_np = format!("{NODE_EXT_IP}:{}/tcp", Shape::Affinity.node_port());
    let udp = format!("{}:53/udp", udp_cluster_ip(UDP_INDEX, Family::V4));
    for args in [
        vec![
            "--from",
            "external",
            "--client",
            "10.10.0.2",
            "--to",
            &affinity_np,
        ],
        vec!["--from", "pod", "--client", "10.244.1.2", "--to", &udp],
    ] {
        eprintln!(
            "[{mode}] $ proxy-agent inspect explain {}\n{}",
            args.join(" "),
            explain_table(&rig.node_netns(), bpf_root, &args)?
        );
    }
    let mut checked = 0;
    let mut disagreements = Vec::new();
    let mut verdicts: std::collections::BTreeMap<String, usize> = Default::default();
    for result in results {
        let outcome = result?;
        checked += outcome.checked;
        *verdicts.entry(outcome.verdict).or_default() += 1;
        disagreements.extend(outcome.disagreements);
    }
    eprintln!(
        "[{mode}] {} cases {verdicts:?}, {checked} connections checked against explain in {:?}",
        cases.len(),
        started.elapsed()
    );
    // Every kind of prediction was put to the test.
    for verdict in ["translate", "refuse", "drop", "pass"] {
        anyhow::ensure!(
            verdicts.keys().any(|v| v.starts_with(verdict)),
            "[{mode}] no case where explain predicted {verdict}: {verdicts:?}"
        );
    }
    rig.stop_agent()?;
    Ok((
        checked,
        disagreements
            .into_iter()
            .map(|d| format!("[{mode}] {d}"))
            .collect(),
    ))
}

#[test]
fn explain_agrees_with_real_connections_in_both_modes() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let modes = std::env::var("KPR_AGREEMENT_MODES").unwrap_or_else(|_| "ebpf,iptables".into());
    let mut total = 0;
    let mut disagreements = Vec::new();
    for mode in modes.split(',').map(str::trim) {
        let (checked, found) = agreement(mode)?;
        total += checked;
        disagreements.extend(found);
    }
    for d in &disagreements {
        eprintln!("{d}");
    }
    eprintln!(
        "{total} connections checked, {} disagreements",
        disagreements.len()
    );
    assert!(
        disagreements.is_empty(),
        "{} disagreements",
        disagreements.len()
    );
    assert!(total >= 1000, "{total}");
    Ok(())
}
