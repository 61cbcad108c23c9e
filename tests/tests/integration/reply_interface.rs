//! Replies of a node with two uplinks: a client reached through the second
//! uplink (`vup2`, behind a router) whose network the node's routing table sends out by the
//! first (`vext`, its default route, where nothing leads back to the client). The eBPF mode
//! sends the replies of its translated flows out by the interface the client's packets came in
//! on, to the neighbour they came from (`CtValue::out_ifindex`), on the netfilter path and on
//! the fast path, for NodePorts eTP Cluster (masqueraded) and Local (client kept) and an LB IP,
//! TCP and UDP, both families. kube-proxy's iptables mode leaves replies to the routing table:
//! the same rig shows them lost there, which is what makes the rig a case where routing would
//! differ (a deliberate difference, README "Behaviour worth knowing"). Needs root.

use std::net::SocketAddr;
use std::time::Duration;

use proxy_common::StatIndex;
use proxy_tests::client::{Attempt, Client, Proto, tally};
use proxy_tests::scenario::{Scenario, is_pod};
use proxy_tests::takeover;
use proxy_tests::topology::Topology;

/// The frontends a client behind the second uplink dials, with whether the backend keeps the
/// client's address (eTP Local).
fn frontends(proto: Proto, ipv6: bool) -> [(SocketAddr, &'static str, bool); 3] {
    let at_uplink2 = |a: SocketAddr| SocketAddr::new(Topology::node_uplink2_addr(ipv6), a.port());
    [
        (
            at_uplink2(takeover::web_node_port(proto, ipv6)),
            "NodePort eTP Cluster",
            false,
        ),
        (
            at_uplink2(takeover::local_node_port(proto, ipv6)),
            "NodePort eTP Local",
            true,
        ),
        (takeover::load_balancer(proto, ipv6), "LB IP", false),
    ]
}

fn setup() -> anyhow::Result<Scenario> {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = takeover::setup_with_endpoints(&[1])?;
    s.topo.route_node_via_ext()?;
    s.topo.add_second_uplink()?;
    Ok(s)
}

fn client(s: &Scenario, proto: Proto, timeout: Duration) -> anyhow::Result<Client> {
    Ok(Client::new(s.topo.uplink2_client()?.path())
        .proto(proto)
        .timeout(timeout))
}

/// Every frontend answers the client behind the second uplink from the frontend's address, in
/// both families and protocols; the backend saw the client's own address where eTP Local
/// keeps it.
fn served_through_the_second_uplink(args: &[&str]) -> anyhow::Result<()> {
    let mut s = setup()?;
    s.start_agent_with_args("ebpf", args)?;
    let mut failures = Vec::new();
    let mut answered = 0u64;
    for ipv6 in [false, true] {
        let client_ip = Topology::uplink2_client_addr(ipv6);
        for proto in [Proto::Tcp, Proto::Udp] {
            let client = client(&s, proto, Duration::from_secs(1))?;
            for (target, what, keeps_client) in frontends(proto, ipv6) {
                s.wait_for_datapath_with(&client, target, what, is_pod)?;
                let attempts = client.run(target, 5)?;
                let good = attempts.iter().all(|a| {
                    is_pod(a)
                        && matches!(a, Attempt::Ok { client, peer, .. }
                            if *peer == target && (!keeps_client || client.ip() == client_ip))
                });
                eprintln!("{what} {target} {proto:?}: {:?}", tally(&attempts));
                answered += attempts.len() as u64;
                if !good {
                    failures.push(format!("{what} {target} {proto:?}: {attempts:?}"));
                }
            }
        }
    }
    s.ensure(failures.is_empty(), || {
        format!("answered through the second uplink: {failures:#?}")
    })?;
    let via = s.agent()?.datapath_counter(StatIndex::TcReplyViaIngress)?;
    s.ensure(via >= answered, || {
        format!("every reply left by the client's interface: tc_reply_via_ingress_interface {via} for {answered} answers")
    })?;
    Ok(())
}

#[test]
fn replies_leave_by_the_clients_uplink_on_the_netfilter_path() -> anyhow::Result<()> {
    served_through_the_second_uplink(&[])
}

#[test]
fn replies_leave_by_the_clients_uplink_on_the_fast_path() -> anyhow::Result<()> {
    served_through_the_second_uplink(&["--tc-fast-path"])
}

/// The oracle for the rig: kube-proxy's rules leave the reply to the routing table, which sends
/// it out by the first uplink, where it is lost.
#[test]
fn in_iptables_mode_the_routing_table_sends_replies_by_the_other_uplink() -> anyhow::Result<()> {
    let mut s = setup()?;
    s.start_agent_with_args("iptables", &[])?;
    // Served from outside through the first uplink: the rules are in place.
    takeover::wait_served(&mut s)?;
    let mut answered = Vec::new();
    for ipv6 in [false, true] {
        let client = client(&s, Proto::Tcp, Duration::from_millis(700))?;
        for (target, what, _) in frontends(Proto::Tcp, ipv6) {
            let attempt = client.once(target)?;
            if is_pod(&attempt) {
                answered.push(format!("{what} {target}: {attempt:?}"));
            }
        }
    }
    s.ensure(answered.is_empty(), || {
        format!("routed by the table, the replies cannot reach the client: {answered:#?}")
    })?;
    Ok(())
}
