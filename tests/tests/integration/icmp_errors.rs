//! ICMP errors about packets of Service flows reach the peer as errors about its own packets.
//! The client matches an error to its socket by the packet the error
//! quotes; through a NodePort or an LB IP that packet was translated, so the error has to be
//! translated back. The oracle is the iptables mode on the same rig: netfilter translates
//! errors related to a NATed connection (`nf_nat_icmp_reply_translation`). Real packets, both
//! families, masqueraded (`web`'s NodePort and LB IP) and client-keeping (`local`'s NodePort,
//! eTP Local) flows, one endpoint (pod 1):
//! - port unreachable from the backend: the pod rejects UDP to its port (an nft `reject`, the
//!   error a closed port sends); the client's connected socket gets ECONNREFUSED at once
//!   instead of waiting for its timeout;
//! - fragmentation needed / packet too big: the node's link to the pod gets MTU 1280 and the
//!   client sends 1400-byte datagrams with DF; the node, which forwards the flow's packets,
//!   sends the error; the client's socket gets EMSGSIZE and learns the path MTU (without the
//!   translation path-MTU discovery through a NodePort black-holes).
//!
//! The client's kernel checks the error's ICMP checksum (over the rewritten quote) before it
//! looks at it. Needs root.

use std::net::SocketAddr;

use proxy_common::StatIndex;
use proxy_tests::client::Proto;
use proxy_tests::scenario::Scenario;
use proxy_tests::takeover;
use proxy_tests::udp_probe::exchange;

/// The pod link's MTU, and a datagram that does not fit it but fits the client's 1500.
const SMALL_MTU: u32 = 1280;
const BIG_DATAGRAM: usize = 1400;

/// `web`'s NodePort and LB IP (masqueraded) and `local`'s NodePort (client address kept), UDP.
fn frontends(ipv6: bool) -> [(&'static str, SocketAddr); 3] {
    [
        ("NodePort", takeover::web_node_port(Proto::Udp, ipv6)),
        ("LB IP", takeover::load_balancer(Proto::Udp, ipv6)),
        (
            "NodePort eTP Local",
            takeover::local_node_port(Proto::Udp, ipv6),
        ),
    ]
}

fn family(ipv6: bool) -> &'static str {
    if ipv6 { "IPv6" } else { "IPv4" }
}

/// Runs both cases in `mode`; returns the scenario (for counters) after asserting what the
/// client saw.
fn run(mode: &str, args: &[&str]) -> anyhow::Result<Scenario> {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = takeover::served_by_pod1_on(mode, args)?;
    let mut seen = Vec::new();
    let mut failures = Vec::new();
    let mut check = |what: String, answer: String, ok: bool| {
        eprintln!("{mode}: {what}: {answer}");
        if !ok {
            failures.push(format!("{what}: {answer}"));
        }
        seen.push((what, answer));
    };

    // Answered first: what follows is about the errors, not the path.
    for ipv6 in [false, true] {
        for (name, target) in frontends(ipv6) {
            let answer = exchange(&s.topo.ext().path(), target, 8, true)?;
            let ok = answer.starts_with("reply pod1");
            check(format!("{name} {} answered", family(ipv6)), answer, ok);
        }
    }

    // Port unreachable from the backend.
    let pod = s.topo.pod(1)?;
    pod.exec(
        "nft",
        &["add table inet closed; add chain inet closed input { type filter hook input priority 0; }; add rule inet closed input udp dport 8080 reject"],
    )?;
    for ipv6 in [false, true] {
        for (name, target) in frontends(ipv6) {
            let answer = exchange(&s.topo.ext().path(), target, 8, false)?;
            let ok = answer == "recv ECONNREFUSED";
            check(
                format!("{name} {} to a closed port", family(ipv6)),
                answer,
                ok,
            );
        }
    }
    pod.exec("nft", &["delete table inet closed"])?;

    // Fragmentation needed / packet too big from the node.
    let node = s.topo.node();
    node.ip(&["link", "set", "vpod1", "mtu", &SMALL_MTU.to_string()])?;
    for ipv6 in [false, true] {
        for (name, target) in frontends(ipv6) {
            // The MTU a previous probe taught the client for this address would refuse the
            // datagram locally (`send EMSGSIZE`) without any error coming back.
            s.topo.ext().ip(&["-4", "route", "flush", "cache"])?;
            s.topo.ext().ip(&["-6", "route", "flush", "cache"])?;
            let answer = exchange(&s.topo.ext().path(), target, BIG_DATAGRAM, true)?;
            let ok = answer == format!("recv EMSGSIZE mtu={SMALL_MTU}");
            check(
                format!("{name} {} over a {SMALL_MTU}-byte link", family(ipv6)),
                answer,
                ok,
            );
        }
    }
    s.ensure(failures.is_empty(), || {
        format!(
            "{mode}: every ICMP error about a Service flow reaches the client as one about its own packet: {failures:#?} (all: {seen:#?})"
        )
    })?;
    Ok(s)
}

#[test]
fn icmp_errors_about_service_flows_reach_the_client_in_iptables_mode() -> anyhow::Result<()> {
    run("iptables", &[])?;
    Ok(())
}

#[test]
fn icmp_errors_about_service_flows_reach_the_client_in_ebpf_mode() -> anyhow::Result<()> {
    ebpf_mode(takeover::EBPF_NETFILTER_PATH)
}

/// The fast path: an error from the backend leaves by redirect as the flow's replies do (up
/// the stack, a NodePort's error, whose source is the node's own address, is a martian), and
/// a datagram too big for the pod's link is answered by the program itself, since the
/// redirect bypasses the router that would answer it.
#[test]
fn icmp_errors_about_service_flows_reach_the_client_on_the_fast_path() -> anyhow::Result<()> {
    ebpf_mode(takeover::EBPF_FAST_PATH)
}

/// XDP in front of the fast path (native on `vext`, wire-like checksums from the client): a
/// packet too big for its next hop's link and the errors about these flows are tc's, so XDP
/// hands them on.
#[test]
fn icmp_errors_about_service_flows_reach_the_client_with_xdp_in_front() -> anyhow::Result<()> {
    ebpf_mode(takeover::EBPF_XDP)
}

fn ebpf_mode(args: &[&str]) -> anyhow::Result<()> {
    let mut s = run("ebpf", args)?;
    let agent = s.agent()?;
    let translated = agent.datapath_counter(StatIndex::TcIcmpErrorTranslated)?;
    let answered = agent.datapath_counter(StatIndex::TcTooBigSent)?;
    if args.contains(&"--tc-fast-path") {
        // Port unreachable: both halves at the pod's ingress, 6 errors; too big: the program
        // answered each of the 6 datagrams itself (the stack never forwarded them).
        s.ensure(translated >= 6 && answered >= 6, || {
            format!("tc_icmp_error_translated {translated} (≥ 6), tc_too_big_sent {answered} (≥ 6)")
        })?;
    } else {
        // Port unreachable: ingress (masqueraded flows: the error is addressed to the SNAT
        // address) and egress; too big: egress. At least one rewrite per error of the 12,
        // and the stack, not the program, answered the big datagrams.
        s.ensure(translated >= 12 && answered == 0, || {
            format!(
                "the tc programs translated every error: tc_icmp_error_translated \
                 {translated}, tc_too_big_sent {answered}"
            )
        })?;
    }
    Ok(())
}
