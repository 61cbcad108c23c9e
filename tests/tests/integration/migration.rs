//! Replacing kube-proxy on a node without residue: kube-proxy's nftables mode left its
//! `ip kube-proxy` table (DNATing the Service to an address nothing answers) and the IPVS mode
//! its `kube-ipvs0` device in the node namespace; the agent starts (either mode), removes both
//! as kube-proxy's own platformCleanup does, and the Service is answered by its pods only.
//! Needs root and `nft` (`cargo xtask setup` installs it).

use proxy_tests::scenario::{CLUSTER_IP, Scenario, cluster_addr, is_pod};

fn init() {
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
}

/// kube-proxy nftables-mode shaped state: its table, a service-ips map-like chain hooked at
/// output and prerouting at dstnat priority, DNATing the ClusterIP elsewhere; and the IPVS
/// dummy device holding the ClusterIP.
fn kube_proxy_leftovers(s: &Scenario) -> anyhow::Result<()> {
    let node = s.topo.node();
    let ruleset = format!(
        "table ip kube-proxy {{\n\
         \tchain nat-output {{ type nat hook output priority -100; policy accept; jump services; }}\n\
         \tchain nat-prerouting {{ type nat hook prerouting priority -100; policy accept; jump services; }}\n\
         \tchain services {{ ip daddr {CLUSTER_IP} tcp dport 80 dnat to 192.0.2.99:8080; }}\n\
         }}\n\
         table ip6 kube-proxy {{\n\
         \tchain nat-output {{ type nat hook output priority -100; policy accept; }}\n\
         }}\n"
    );
    // Named after the node namespace, unique per test: both tests of this file run at once in
    // one process, and a shared name let one remove the file while the other read it.
    let file = std::env::temp_dir().join(format!("kube-proxy-nft-{}.nft", node.name()));
    std::fs::write(&file, ruleset)?;
    node.exec("nft", &["-f", file.to_str().unwrap_or_default()])?;
    let _ = std::fs::remove_file(&file);
    // The dummy driver is not in every kernel (kube-proxy's IPVS mode needs it): without it
    // there can be no such leftover. Nothing else can stand in for it (the agent, as upstream,
    // removes only a device of kind dummy), so the run's summary says the check was skipped.
    if let Err(e) = node.exec("ip", &["link", "add", "kube-ipvs0", "type", "dummy"]) {
        proxy_tests::report_skipped(
            "migration: removal of kube-proxy's kube-ipvs0 dummy device",
            &format!("this kernel cannot make a dummy link ({e})"),
        );
        return Ok(());
    }
    node.exec(
        "ip",
        &[
            "addr",
            "add",
            &format!("{CLUSTER_IP}/32"),
            "dev",
            "kube-ipvs0",
        ],
    )?;
    Ok(())
}

fn nothing_of_kube_proxy_remains(s: &Scenario) -> anyhow::Result<()> {
    let node = s.topo.node();
    let tables = node.exec("nft", &["list", "tables"])?;
    s.ensure(!tables.contains("kube-proxy"), || {
        format!("kube-proxy's nftables tables remain: {tables}")
    })?;
    let links = node.exec("ip", &["-o", "link", "show"])?;
    s.ensure(!links.contains("kube-ipvs0"), || {
        format!("kube-ipvs0 remains: {links}")
    })?;
    Ok(())
}

fn migrates(mode: &str) -> anyhow::Result<()> {
    init();
    proxy_tests::require_root();
    let mut s = Scenario::new(2)?;
    s.write_web_service(2)?;
    kube_proxy_leftovers(&s)?;
    let client = s.start_serving(mode, &[])?;
    let answers = client.run(cluster_addr(), 20)?;
    s.ensure(answers.iter().all(is_pod), || {
        format!("the ClusterIP must be answered by the pods only: {answers:?}")
    })?;
    nothing_of_kube_proxy_remains(&s)
}

#[test]
fn iptables_mode_removes_kube_proxys_nftables_and_ipvs_state() -> anyhow::Result<()> {
    migrates("iptables")
}

#[test]
fn ebpf_mode_removes_kube_proxys_nftables_and_ipvs_state() -> anyhow::Result<()> {
    migrates("ebpf")
}

/// What kube-proxy's IPVS cleanup would not remove stays: a `kube-ipvs0` that is not a dummy
/// device (upstream's `DeleteDummyDevice` refuses other kinds); and IPVS virtual services are
/// looked for over generic netlink — on a kernel without IPVS (no `ip_vs`, as here) the agent
/// leaves the module unloaded (asking generic netlink would load it) and goes on, at start and
/// with `--cleanup`.
#[test]
fn ipvs_cleanup_leaves_what_kube_proxy_would_leave() -> anyhow::Result<()> {
    init();
    proxy_tests::require_root();
    let mut s = Scenario::new(1)?;
    s.write_web_service(1)?;
    let node = s.topo.node();
    node.exec(
        "ip",
        &[
            "link",
            "add",
            "kube-ipvs0",
            "type",
            "veth",
            "peer",
            "name",
            "kipvs-peer",
        ],
    )?;
    // Before the agent runs: it must not make the kernel load ip_vs just to look.
    let ipvs_before = s.topo.node().exec("cat", &["/proc/net/ip_vs"]).is_ok();
    let client = s.start_serving("iptables", &[])?;
    let answers = client.run(cluster_addr(), 5)?;
    s.ensure(answers.iter().all(is_pod), || format!("{answers:?}"))?;
    let still_there = |s: &Scenario| -> anyhow::Result<bool> {
        Ok(s.topo
            .node()
            .exec("ip", &["-o", "link", "show"])?
            .contains("kube-ipvs0"))
    };
    s.ensure(still_there(&s)?, || {
        "a veth named kube-ipvs0 is not kube-proxy's dummy device and must stay".to_owned()
    })?;
    let ipvs_in_kernel = s.topo.node().exec("cat", &["/proc/net/ip_vs"]).is_ok();
    let log = s.agent()?.log_contents();
    if ipvs_before {
        eprintln!("this kernel has IPVS: the flush path ran (no services were set up here)");
        // The error an operator would be shown.
        s.ensure(!log.contains("cannot remove kube-proxy's IPVS"), || {
            log.clone()
        })?;
    } else {
        eprintln!("no IPVS in this kernel: the absent path");
        s.ensure(!ipvs_in_kernel, || {
            "the agent made the kernel load ip_vs to look for virtual services".to_owned()
        })?;
    }
    s.agent()?.stop()?;
    let status = s.agent()?.run_cleanup()?;
    let tail = s.agent()?.log_tail(20);
    s.ensure(status.success(), || format!("--cleanup failed: {tail}"))?;
    s.ensure(still_there(&s)?, || {
        "--cleanup removed a non-dummy kube-ipvs0".to_owned()
    })?;
    let ipvs_after_cleanup = s.topo.node().exec("cat", &["/proc/net/ip_vs"]).is_ok();
    s.ensure(ipvs_before || !ipvs_after_cleanup, || {
        "--cleanup made the kernel load ip_vs to look for virtual services".to_owned()
    })?;
    Ok(())
}
