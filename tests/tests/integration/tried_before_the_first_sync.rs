//! A client that tries a Service while the agent is still starting (the slow first sync of a big
//! cluster) must lose no connection once the Service is programmed: a pod trying its ClusterIP,
//! an outside client its LB IP. Its early SYNs leave the
//! node's conntrack with untranslated entries: with no rule yet, the SYN went out by the node's
//! default route, nobody answered, and the entry waits in SYN_SENT for two minutes. A later
//! connection from a reused source port matched such an entry, so netfilter never asked the
//! NAT rules again and it was black-holed too. The iptables mode now deletes a TCP frontend's
//! untranslated entries once the frontend has serving endpoints (`proxy-kernel`'s
//! `ServedStreams`); the eBPF mode translates before netfilter sees the packet (the socket hooks
//! at connect, tc at the external interface's ingress), so the new connection's tuple is
//! another one. Needs root.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use proxy_kernel::conntrack::Ctnetlink;
use proxy_model::desired::IpFamily;
use proxy_tests::client::Attempt;
use proxy_tests::netns::on_thread_in;
use proxy_tests::scenario::{SERVICE_PORT, Scenario, http_slice, is_pod, pod_endpoint};
use proxy_tests::topology::Topology;

/// A ClusterIP nothing in the rig answers for (the scenario's decoy sits on another one).
const SLOW_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 77);
/// The Service's LB IP, routed to the node by the external namespace.
const SLOW_LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 77);

/// Where the client tries the Service from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum From {
    /// Pod 1, to the ClusterIP.
    Pod,
    /// The external namespace, to the LB IP.
    Outside,
}
/// The client pod's one source port: every connection after the start reuses the port of the
/// attempts made before it.
const PORT: u16 = 40_100;

impl From {
    fn target(self) -> SocketAddr {
        let ip = match self {
            From::Pod => SLOW_IP,
            From::Outside => SLOW_LB_IP,
        };
        SocketAddr::from((ip, SERVICE_PORT))
    }
}

/// `slow`: a LoadBalancer Service on `SLOW_IP` with the LB IP `SLOW_LB_IP`, port 80 → 8080.
fn slow_service() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: slow, namespace: default}}\n\
         spec:\n  type: LoadBalancer\n  clusterIP: \"{SLOW_IP}\"\n  clusterIPs: [\"{SLOW_IP}\"]\n\
         \x20 ports: [{{name: http, port: {SERVICE_PORT}, protocol: TCP, targetPort: 8080, nodePort: 30077}}]\n\
         status: {{loadBalancer: {{ingress: [{{ip: \"{SLOW_LB_IP}\"}}]}}}}\n"
    )
}

/// The node's conntrack entries to `target` that were never translated.
fn untranslated_entries(s: &Scenario, target: SocketAddr) -> anyhow::Result<usize> {
    let entries = on_thread_in(&s.topo.node().path(), || {
        Ctnetlink::open().and_then(|mut ct| ct.dump(IpFamily::V4))
    })??;
    Ok(entries
        .iter()
        .filter(|e| {
            e.original.dst == target.ip() && e.original.dst_port == target.port() && !e.dnat()
        })
        .count())
}

fn tried_before_the_first_sync(mode: &str, from: From) -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    s.topo.route_node_via_ext()?;
    // The node's netfilter tracks connections before any agent runs, as on a real node: a CNI
    // with `ipMasq` (the reference plugins') masquerades pods' traffic leaving the pod network.
    s.topo.node().exec(
        "iptables",
        &[
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-s",
            "10.244.0.0/16",
            "!",
            "-d",
            "10.244.0.0/16",
            "-j",
            "MASQUERADE",
        ],
    )?;
    s.manifests.write("slow.yaml", &slow_service())?;
    s.topo.ext().ip(&[
        "route",
        "add",
        &format!("{SLOW_LB_IP}/32"),
        "via",
        &Topology::node_ext_ip().to_string(),
    ])?;
    s.manifests.write(
        "slow-slice.yaml",
        &http_slice(
            "default",
            "slow-1",
            "slow",
            &[pod_endpoint(1), pod_endpoint(2)],
        ),
    )?;
    // The port, which the client itself holds in TIME_WAIT (it closes first), is reused a
    // second later.
    let (client_ns, client) = match from {
        From::Pod => (s.topo.pod(1)?, s.pod_client(1)?),
        From::Outside => (s.topo.ext(), s.external_client()),
    };
    client_ns.sysctl_all(&[
        ("net.ipv4.ip_local_port_range", &format!("{PORT} {PORT}")),
        ("net.ipv4.tcp_tw_reuse", "1"),
    ])?;
    // The kernel reuses a TIME_WAIT tuple only once `tcp_tw_reuse_delay` (1 s by default) has
    // passed since its last segment; the server's FIN can arrive well after the attempt ended
    // on a loaded machine, so a reuse a second after the attempt could still find the tuple
    // taken (EADDRNOTAVAIL) — a port clash of the client, not a lost connection. Kernels
    // before 6.14 have no such knob and wait one second.
    if std::path::Path::new("/proc/sys/net/ipv4/tcp_tw_reuse_delay").exists() {
        client_ns.sysctl("net.ipv4.tcp_tw_reuse_delay", "100")?;
    }
    let target = from.target();
    // Before any agent: the ClusterIP is tried twice, unanswered.
    let early = client
        .clone()
        .timeout(Duration::from_millis(300))
        .run(target, 2)?;
    s.ensure(early.iter().all(|a| matches!(a, Attempt::Err(_))), || {
        format!("nothing answers the ClusterIP before the agent: {early:?}")
    })?;
    let left = untranslated_entries(&s, target)?;
    s.ensure(left == 1, || {
        format!("the early attempts left their untranslated conntrack entry on the node: {left}")
    })?;
    s.start_agent_with_args(mode, &["--interfaces", "vext"])?;
    s.wait_for_first_sync()?;
    // Every connection from now on reuses one of those ports; each must reach a pod.
    let attempts = client
        .timeout(Duration::from_secs(2))
        .interval(Duration::from_millis(1500))
        .run(target, 6)?;
    let lost: Vec<&Attempt> = attempts.iter().filter(|a| !is_pod(a)).collect();
    s.ensure(lost.is_empty(), || {
        format!(
            "{mode}, {from:?}: {} of {} connections after the first sync were lost ({left} \
             untranslated entries before it, {} now): {lost:?}",
            lost.len(),
            attempts.len(),
            untranslated_entries(&s, target).map_or_else(|e| e.to_string(), |n| n.to_string()),
        )
    })?;
    Ok(())
}

#[test]
fn a_pod_that_tried_a_cluster_ip_during_the_start_loses_no_connection_after_it_iptables()
-> anyhow::Result<()> {
    tried_before_the_first_sync("iptables", From::Pod)
}

#[test]
fn a_pod_that_tried_a_cluster_ip_during_the_start_loses_no_connection_after_it_ebpf()
-> anyhow::Result<()> {
    tried_before_the_first_sync("ebpf", From::Pod)
}

#[test]
fn an_outside_client_that_tried_an_lb_ip_during_the_start_loses_no_connection_after_it_iptables()
-> anyhow::Result<()> {
    tried_before_the_first_sync("iptables", From::Outside)
}

#[test]
fn an_outside_client_that_tried_an_lb_ip_during_the_start_loses_no_connection_after_it_ebpf()
-> anyhow::Result<()> {
    tried_before_the_first_sync("ebpf", From::Outside)
}
