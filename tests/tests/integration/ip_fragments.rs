//! IP fragments of Service flows: 4 KB UDP datagrams, which the client's
//! stack sends as three fragments (MTU 1500; IPv6 with a fragment header), to a NodePort and
//! an LB IP (masqueraded) and to an eTP Local NodePort (client address kept), in both
//! families, are answered by the pod. Only the first fragment carries the ports; the tc
//! programs give the later ones the first one's translation (`fragments.rs`). The oracle is
//! the iptables mode on the same rig, where netfilter reassembles before NAT. Needs root.

use std::net::SocketAddr;

use proxy_common::StatIndex;
use proxy_tests::client::Proto;
use proxy_tests::scenario::Scenario;
use proxy_tests::takeover;
use proxy_tests::udp_probe::exchange;

/// More than two MTUs of 1500.
const DATAGRAM: usize = 4000;

fn run(mode: &str, args: &[&str]) -> anyhow::Result<Scenario> {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = takeover::served_by_pod1_on(mode, args)?;
    let mut failures = Vec::new();
    for ipv6 in [false, true] {
        let frontends: [(&str, SocketAddr); 3] = [
            ("NodePort", takeover::web_node_port(Proto::Udp, ipv6)),
            ("LB IP", takeover::load_balancer(Proto::Udp, ipv6)),
            (
                "NodePort eTP Local",
                takeover::local_node_port(Proto::Udp, ipv6),
            ),
        ];
        for (name, target) in frontends {
            let answer = exchange(&s.topo.ext().path(), target, DATAGRAM, false)?;
            let what = format!("{name} {}", if ipv6 { "IPv6" } else { "IPv4" });
            eprintln!("{mode}: {what}, {DATAGRAM}-byte datagram: {answer}");
            if !answer.starts_with("reply pod1") {
                failures.push(format!("{what}: {answer}"));
            }
        }
    }
    s.ensure(failures.is_empty(), || {
        format!("{mode}: fragmented datagrams to every frontend are answered: {failures:#?}")
    })?;
    Ok(s)
}

#[test]
fn fragmented_datagrams_reach_the_pod_in_iptables_mode() -> anyhow::Result<()> {
    run("iptables", &[])?;
    Ok(())
}

#[test]
fn fragmented_datagrams_reach_the_pod_in_ebpf_mode() -> anyhow::Result<()> {
    ebpf_mode(takeover::EBPF_NETFILTER_PATH)
}

/// The fast path: both halves at ingress and a redirect, egress never involved.
#[test]
fn fragmented_datagrams_reach_the_pod_on_the_fast_path() -> anyhow::Result<()> {
    ebpf_mode(takeover::EBPF_FAST_PATH)
}

/// XDP in front of the fast path (native on `vext`, wire-like checksums from the client):
/// fragments are tc's, so XDP hands every one of them on untouched and nothing is lost.
#[test]
fn fragmented_datagrams_reach_the_pod_with_xdp_in_front() -> anyhow::Result<()> {
    ebpf_mode(takeover::EBPF_XDP)
}

fn ebpf_mode(args: &[&str]) -> anyhow::Result<()> {
    let mut s = run("ebpf", args)?;
    // Every later fragment found its first one (they arrive in order here).
    let untracked = s
        .agent()?
        .datapath_counter(StatIndex::TcFragmentUntracked)?;
    s.ensure(untracked == 0, || {
        format!("no fragment went untranslated: tc_fragment_untracked {untracked}")
    })?;
    Ok(())
}
