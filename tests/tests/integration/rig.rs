//! Self-tests of the rig itself (no agent needed): topology, echo servers, decoy, clients,
//! cgroups, and that every guard cleans up. Needs root.

use std::net::{SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, ensure};
use proxy_tests::client::{Attempt, Proto, tally};
use proxy_tests::scenario::{BACKEND_PORT, Scenario, cluster_addr};
use proxy_tests::topology::{DECOY_NAME, Topology};

fn setup() {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
}

fn pod_addr(i: usize, port: u16) -> SocketAddr {
    SocketAddrV4::new(Topology::pod_ip(i), port).into()
}

#[test]
fn topology_echo_decoy_and_cleanup() -> anyhow::Result<()> {
    setup();
    let scenario = Scenario::new(2)?;
    let names: Vec<String> = [scenario.topo.node(), scenario.topo.ext()]
        .into_iter()
        .chain(
            (1..=2)
                .map(|i| scenario.topo.pod(i))
                .collect::<Result<Vec<_>, _>>()?,
        )
        .map(|ns| ns.name().to_owned())
        .collect();
    let cgroup_dir: PathBuf = scenario.cgroup.path().to_path_buf();
    let manifests_dir: PathBuf = scenario.manifests.path().to_path_buf();

    for proto in [Proto::Tcp, Proto::Udp] {
        // Without an agent, the ClusterIP is the node-local decoy, inside or outside the cgroup.
        for client in [scenario.outside_client(), scenario.cgroup_client()] {
            let attempts = client.proto(proto).run(cluster_addr(), 3)?;
            eprintln!(
                "{proto:?} to ClusterIP without agent: {:?}",
                tally(&attempts)
            );
            for a in &attempts {
                let Attempt::Ok { backend, peer, .. } = a else {
                    anyhow::bail!("{proto:?}: unexpected {a:?}");
                };
                ensure!(backend == DECOY_NAME && *peer == cluster_addr(), "{a:?}");
            }
        }
        // Pods are reachable directly, and see the node side of their veth as the source.
        for i in 1..=2 {
            let a = scenario
                .outside_client()
                .proto(proto)
                .once(pod_addr(i, BACKEND_PORT))?;
            let Attempt::Ok {
                backend, client, ..
            } = &a
            else {
                anyhow::bail!("{proto:?} pod{i}: unexpected {a:?}");
            };
            ensure!(*backend == format!("pod{i}"), "{a:?}");
            ensure!(client.ip() == Topology::pod_gateway(i), "{a:?}");
        }
        // The external namespace reaches pods through the forwarding node.
        let a = proxy_tests::client::Client::new(scenario.topo.ext().path())
            .proto(proto)
            .once(pod_addr(2, BACKEND_PORT))?;
        let Attempt::Ok {
            backend, client, ..
        } = &a
        else {
            anyhow::bail!("{proto:?} ext: unexpected {a:?}");
        };
        ensure!(
            backend == "pod2" && client.ip() == Topology::ext_ip(),
            "{a:?}"
        );
    }

    // A closed port is reported as exactly ECONNREFUSED.
    let a = scenario.outside_client().once(pod_addr(1, 9))?;
    ensure!(a == Attempt::Err("ECONNREFUSED".into()), "{a:?}");

    drop(scenario);
    let out = Command::new("ip").args(["netns", "list"]).output()?;
    let listed = String::from_utf8_lossy(&out.stdout);
    for name in &names {
        ensure!(
            !listed
                .lines()
                .any(|l| l.split_whitespace().next() == Some(name)),
            "netns {name} left behind"
        );
    }
    ensure!(
        !cgroup_dir.exists(),
        "cgroup {} left behind",
        cgroup_dir.display()
    );
    ensure!(
        !manifests_dir.exists(),
        "{} left behind",
        manifests_dir.display()
    );
    Ok(())
}

#[test]
fn cgroup_guard_kills_members() -> anyhow::Result<()> {
    setup();
    let cg = proxy_tests::cgroup::ChildCgroup::new()?;
    let path = cg.path().to_path_buf();
    let mut child = Command::new("sleep")
        .arg("30")
        .spawn()
        .context("spawning sleep")?;
    std::fs::write(path.join("cgroup.procs"), child.id().to_string())
        .context("moving sleep into the cgroup")?;
    ensure!(cg.pids()? == vec![child.id()], "pids: {:?}", cg.pids()?);
    drop(cg);
    let status = child.wait()?;
    ensure!(!status.success(), "sleep should have been killed: {status}");
    ensure!(!path.exists(), "cgroup {} left behind", path.display());
    Ok(())
}
