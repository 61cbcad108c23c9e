//! `--cleanup` after the iptables mode leaves the node's tables exactly as they were before the
//! agent started: every KUBE- chain and jump the agent wrote is gone, and what other software
//! put there (a foreign rule in a built-in chain, a foreign chain, kubelet's KUBE-FIREWALL)
//! survives. Needs root.

use proxy_tests::{netns::Netns, scenario::Scenario};

/// `iptables-save` of both families without comments and packet counters (traffic changes
/// them), in the node namespace. A table with nothing but built-in chains at policy ACCEPT is
/// left out: it is what an unused table looks like once something has loaded it, and equivalent
/// to a table never loaded.
fn saved(node: &Netns) -> anyhow::Result<String> {
    const BUILT_IN: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
    let mut out = String::new();
    for program in ["iptables-save", "ip6tables-save"] {
        let mut table: Vec<String> = Vec::new();
        for line in node.exec(program, &[])?.lines() {
            if line.starts_with('#') {
                continue;
            }
            // `:INPUT ACCEPT [12:345]` → `:INPUT ACCEPT`
            let line = match line.rfind(" [") {
                Some(i) if line.starts_with(':') => &line[..i],
                _ => line,
            };
            table.push(line.to_owned());
            if line == "COMMIT" {
                let untouched = table.iter().all(|l| {
                    l.starts_with('*')
                        || l == "COMMIT"
                        || l.strip_prefix(':').is_some_and(|chain| {
                            let mut words = chain.split(' ');
                            let name = words.next().unwrap_or_default();
                            BUILT_IN.contains(&name) && words.next() == Some("ACCEPT")
                        })
                });
                if !untouched {
                    for l in &table {
                        out.push_str(l);
                        out.push('\n');
                    }
                }
                table.clear();
            }
        }
    }
    Ok(out)
}

/// What other software typically has on a node: a foreign filter rule and nat chain, and
/// kubelet's KUBE-FIREWALL (which kube-proxy's cleanup never removes).
fn foreign_rules(node: &Netns) -> anyhow::Result<()> {
    let ipt = |args: &[&str]| node.exec("iptables", args).map(|_| ());
    ipt(&["-w", "-A", "INPUT", "-s", "198.51.100.0/24", "-j", "ACCEPT"])?;
    ipt(&["-w", "-t", "nat", "-N", "FOREIGN"])?;
    ipt(&[
        "-w",
        "-t",
        "nat",
        "-A",
        "FOREIGN",
        "-d",
        "198.51.100.1/32",
        "-j",
        "RETURN",
    ])?;
    ipt(&["-w", "-t", "nat", "-A", "PREROUTING", "-j", "FOREIGN"])?;
    for program in ["iptables", "ip6tables"] {
        node.exec(program, &["-w", "-N", "KUBE-FIREWALL"])?;
        node.exec(program, &["-w", "-A", "INPUT", "-j", "KUBE-FIREWALL"])?;
        node.exec(program, &["-w", "-A", "OUTPUT", "-j", "KUBE-FIREWALL"])?;
    }
    ipt(&[
        "-w",
        "-A",
        "KUBE-FIREWALL",
        "-d",
        "127.0.0.0/8",
        "!",
        "-s",
        "127.0.0.0/8",
        "-m",
        "comment",
        "--comment",
        "block incoming localnet connections",
        "-m",
        "conntrack",
        "!",
        "--ctstate",
        "RELATED,ESTABLISHED,DNAT",
        "-j",
        "DROP",
    ])?;
    Ok(())
}

#[test]
fn cleanup_restores_the_tables_as_they_were() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(2)?;
    foreign_rules(s.topo.node())?;
    let before = saved(s.topo.node())?;

    s.write_web_service(2)?;
    s.start_serving("iptables", &[])?;
    let during = saved(s.topo.node())?;
    let kube_lines = during.lines().filter(|l| l.contains("KUBE-SVC")).count();
    eprintln!(
        "while running: {} lines, {kube_lines} mention KUBE-SVC",
        during.lines().count()
    );
    anyhow::ensure!(
        kube_lines > 0,
        "the agent wrote no service rules:\n{during}"
    );

    let agent = s.agent()?;
    let status = agent.stop()?;
    anyhow::ensure!(status.success(), "agent exited with {status}");
    let cleanup = agent.run_cleanup()?;
    anyhow::ensure!(cleanup.success(), "--cleanup exited with {cleanup}");
    let after = saved(s.topo.node())?;
    if before != after {
        let only_before: Vec<&str> = before.lines().filter(|l| !after.contains(l)).collect();
        let only_after: Vec<&str> = after.lines().filter(|l| !before.contains(l)).collect();
        anyhow::bail!(
            "iptables-save differs after --cleanup\nmissing: {only_before:#?}\nleft over: {only_after:#?}"
        );
    }
    eprintln!(
        "after --cleanup: identical to before ({} lines)",
        after.lines().count()
    );
    // A second run finds nothing to do and still succeeds.
    let again = s.agent()?.run_cleanup()?;
    anyhow::ensure!(again.success(), "second --cleanup exited with {again}");
    anyhow::ensure!(
        saved(s.topo.node())? == before,
        "the second --cleanup changed something"
    );
    Ok(())
}
