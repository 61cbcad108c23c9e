//! One client port, one backend, two frontends at once. A client reuses its source port
//! towards another destination (the kernel allows it: the 4-tuple differs), so two live
//! connections from the same address and port can reach the same backend through two
//! frontends — a NodePort and an LB IP of one Service, or two Services. kube-proxy's iptables
//! rules keep them apart: the kernel's conntrack tracks each by its own original tuple (the
//! oracle, run side by side in the iptables mode). The eBPF mode's netfilter path shows the
//! kernel, and keys its egress entries by, the tuple between client and backend — the same for
//! both connections: the second one's egress entries replaced the first one's, whose packets
//! then left with the second one's translation (the first connection stalled after its second
//! exchange, as the mode-switch scenario showed about once in three runs). The second connection
//! now takes the fast path (`ct_flags::BYPASS`); when it keeps the client's address (eTP Local)
//! and the first was masqueraded, the first moves to the fast path and hands it the tuple.
//! Both families, both modes. Needs root.

use std::net::SocketAddr;
use std::time::Duration;

use proxy_common::StatIndex;
use proxy_tests::client::{Attempt, Mode, Proto, tally};
use proxy_tests::scenario::{Scenario, is_pod};
use proxy_tests::takeover;

/// Exchanges of the first connection, 100 ms apart: the second one is made in the middle.
const EXCHANGES: u32 = 20;

/// A frontend of the scenario's Services (one endpoint: pod 1).
#[derive(Debug, Clone, Copy)]
enum Frontend {
    /// `web`'s NodePort, eTP Cluster: masqueraded.
    WebNodePort,
    /// `web`'s LB IP, eTP Cluster: masqueraded.
    LoadBalancer,
    /// `local`'s NodePort, eTP Local: the client's address kept.
    LocalNodePort,
}

impl Frontend {
    fn addr(self, ipv6: bool) -> SocketAddr {
        match self {
            Frontend::WebNodePort => takeover::web_node_port(Proto::Tcp, ipv6),
            Frontend::LoadBalancer => takeover::load_balancer(Proto::Tcp, ipv6),
            Frontend::LocalNodePort => takeover::local_node_port(Proto::Tcp, ipv6),
        }
    }
}

/// (first, second): both masqueraded; masqueraded then client kept; client kept then
/// masqueraded. (Both keeping the client's address cannot work anywhere: the backend would
/// see one tuple for two connections.)
const CASES: [(Frontend, Frontend); 3] = [
    (Frontend::WebNodePort, Frontend::LoadBalancer),
    (Frontend::LoadBalancer, Frontend::LocalNodePort),
    (Frontend::LocalNodePort, Frontend::LoadBalancer),
];

fn run(mode: &str, args: &[&str]) -> anyhow::Result<Scenario> {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = takeover::served_by_pod1(mode, args)?;
    let mut failures = Vec::new();
    for (i, (first, second)) in CASES.into_iter().enumerate() {
        // One source port per case (a case's connections would meet the previous case's in
        // the client's TIME_WAIT otherwise): both connections of the case get it.
        let port = 40_000 + u16::try_from(i)?;
        s.topo
            .ext()
            .sysctl("net.ipv4.ip_local_port_range", &format!("{port} {port}"))?;
        let client = s.external_client().timeout(Duration::from_secs(1));
        for ipv6 in [false, true] {
            let (first_addr, second_addr) = (first.addr(ipv6), second.addr(ipv6));
            let stream = client
                .clone()
                .mode(Mode::TcpStream)
                .interval(Duration::from_millis(100));
            let handle = std::thread::spawn(move || stream.run(first_addr, EXCHANGES));
            // The stream holds the port when the second connection is made.
            s.wait_for_tcp_streams(1)?;
            let answer = client.once(second_addr)?;
            let attempts = handle
                .join()
                .map_err(|_| anyhow::anyhow!("stream thread panicked"))??;
            let kept = attempts.iter().all(|a| {
                is_pod(a)
                    && a.backend().is_some_and(|b| b == "pod1#1")
                    && matches!(a, Attempt::Ok { client, peer, .. } if client.port() != 0 && *peer == first_addr)
            });
            let answered = is_pod(&answer)
                && matches!(&answer, Attempt::Ok { peer, .. } if *peer == second_addr);
            // eTP Local keeps the client's port: the backend saw the one the client used.
            let client_kept = !matches!(second, Frontend::LocalNodePort)
                || matches!(&answer, Attempt::Ok { client, .. } if client.port() == port);
            eprintln!(
                "{mode} {first:?} then {second:?} ({}): first {:?}, second {answer:?}",
                if ipv6 { "IPv6" } else { "IPv4" },
                tally(&attempts)
            );
            if !(kept && answered && client_kept) {
                failures.push(format!(
                    "{first:?} then {second:?} ({}): first {:?}, second {answer:?}",
                    if ipv6 { "IPv6" } else { "IPv4" },
                    tally(&attempts)
                ));
            }
        }
    }
    s.ensure(failures.is_empty(), || {
        format!(
            "{mode}: both connections of one client port to one backend are answered, each through its own frontend: {failures:#?}"
        )
    })?;
    Ok(s)
}

#[test]
fn one_client_port_reaches_one_backend_through_two_frontends_in_iptables_mode() -> anyhow::Result<()>
{
    run("iptables", &[])?;
    Ok(())
}

#[test]
fn one_client_port_reaches_one_backend_through_two_frontends_in_ebpf_mode() -> anyhow::Result<()> {
    let mut s = run("ebpf", &["--interfaces", "vext"])?;
    // Each case's second connection (both families) took the fast path.
    let bypassed = s.agent()?.datapath_counter(StatIndex::TcTupleBypassed)?;
    s.ensure(bypassed >= 6, || {
        format!("every second connection took the fast path: tc_tuple_bypassed {bypassed}")
    })?;
    Ok(())
}
