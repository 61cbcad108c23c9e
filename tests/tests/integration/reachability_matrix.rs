//! The reachability matrix (tests/src/reachability/): every cell of client × Service shape ×
//! frontend × IP family with real packets, in both `--proxy-mode`s in sequence, each on a
//! fresh rig. Prints the whole table; with `KPR_WRITE_REACHABILITY=1` (and both modes run) it
//! rewrites `docs/reachability.md`. A cell that matches neither upstream nor a documented eBPF
//! difference fails the test, after everything is printed. `KPR_REACHABILITY_MODES=iptables`
//! (or `ebpf`) runs one mode only and `KPR_REACHABILITY_HOLD_SECS=N` holds the live rig N seconds
//! before the cells run, for debugging. Needs root.
//!
//! `bridge_wired_node` and `ptp_wired_node` run a subset on a node whose pods the CNI reference
//! plugins wired (`bridge` + `host-local` with `hairpinMode`, as flannel and kubenet do; `ptp` +
//! `host-local`): the cells whose packets cross the pod wiring ([`wiring_cells`]: a pod of this
//! node is the client or answers; the others cannot depend on how the pods are wired) plus
//! the hairpin cells, against the same oracle. The subset keeps the module's time near the
//! routed matrix's alone (they run as separate tests, beside it). On the bridge, the
//! hairpin cells' packets leave by the bridge port they came in by: with `hairpinMode` off the
//! iptables mode's hairpin cells time out (checked by hand once; the test keeps it on).

use std::time::Instant;

use proxy_tests::cni::CniPlugin;
use proxy_tests::reachability::report::{Report, Row};
use proxy_tests::reachability::rig::MatrixRig;
use proxy_tests::reachability::runner::{Outcome, run_cells};
use proxy_tests::reachability::{Cell, all_cells, hairpin_cells, wiring_cells};
use proxy_tests::topology::PodWiring;

fn wiring_name(wiring: PodWiring) -> &'static str {
    match wiring {
        PodWiring::Routed => "routed",
        PodWiring::Cni(plugin) => plugin.name(),
    }
}

/// Runs every cell against a fresh rig (pods wired as `wiring` says) with the agent in `mode`.
fn run_mode(wiring: PodWiring, mode: &str, cells: &[Cell]) -> anyhow::Result<Vec<Outcome>> {
    let started = Instant::now();
    let label = format!("{mode}, {} pods", wiring_name(wiring));
    let mut rig = MatrixRig::with_wiring(wiring)?;
    rig.start_agent(mode)?;
    let not_ready = rig.wait_ready()?;
    for line in &not_ready {
        eprintln!("[{label}] {line}");
    }
    if let Some(secs) = std::env::var("KPR_REACHABILITY_HOLD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        // A debugging aid: time to look at the live rig (ip netns, iptables-save) from
        // another shell.
        eprintln!("[{label}] holding the rig for {secs} s");
        std::thread::sleep(std::time::Duration::from_secs(secs));
    }
    let outcomes = run_cells(&rig, cells);
    eprintln!(
        "[{label}] {} cells in {:?} (agent running: {})",
        cells.len(),
        started.elapsed(),
        rig.agent_running()
    );
    if !not_ready.is_empty() || !rig.agent_running() {
        eprintln!("[{label}] agent log tail:\n{}", rig.agent_log_tail(40));
    }
    rig.stop_agent()?;
    Ok(outcomes)
}

/// Runs `cells` in every selected mode on a node whose pods are wired as `wiring` says.
fn run_matrix(wiring: PodWiring, cells: &[Cell]) -> anyhow::Result<Report> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let modes = std::env::var("KPR_REACHABILITY_MODES").unwrap_or_else(|_| "iptables,ebpf".into());
    let mut ebpf = None;
    let mut iptables = None;
    for mode in modes.split(',').map(str::trim) {
        match mode {
            "ebpf" => ebpf = Some(run_mode(wiring, mode, cells)?),
            "iptables" => iptables = Some(run_mode(wiring, mode, cells)?),
            other => anyhow::bail!("KPR_REACHABILITY_MODES: unknown mode {other:?}"),
        }
    }
    let rows: Vec<Row> = cells
        .iter()
        .enumerate()
        .map(|(i, cell)| {
            let pick = |o: &Option<Vec<Outcome>>| o.as_ref().and_then(|v| v.get(i).cloned());
            Row::new(*cell, pick(&ebpf), pick(&iptables))
        })
        .collect();
    let report = Report { rows };
    println!(
        "reachability, {} pods:\n{}",
        wiring_name(wiring),
        report.text()
    );
    Ok(report)
}

fn ensure_no_mismatch(wiring: PodWiring, report: &Report) -> anyhow::Result<()> {
    let mismatches = report.mismatches();
    anyhow::ensure!(
        mismatches.is_empty(),
        "{} pods: {} cells differ from upstream without a documented reason:\n{}",
        wiring_name(wiring),
        mismatches.len(),
        mismatches.join("\n")
    );
    Ok(())
}

#[test]
fn reachability_matrix() -> anyhow::Result<()> {
    let mut cells = all_cells();
    cells.extend(hairpin_cells());
    let report = run_matrix(PodWiring::Routed, &cells)?;
    let both = report.counts(true).2 == 0 && report.counts(false).2 == 0;
    if std::env::var_os("KPR_WRITE_REACHABILITY").is_some_and(|v| v == "1") {
        anyhow::ensure!(
            both,
            "docs/reachability.md shows both modes: run them both to rewrite it"
        );
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reachability.md");
        std::fs::write(&path, report.markdown())?;
        eprintln!("wrote {}", path.display());
    }

    ensure_no_mismatch(PodWiring::Routed, &report)
}

/// The pods on the bridge `cni0` (`bridge`, `isGateway`, `hairpinMode`, `host-local`).
#[test]
fn bridge_wired_node() -> anyhow::Result<()> {
    let wiring = PodWiring::Cni(CniPlugin::Bridge);
    ensure_no_mismatch(wiring, &run_matrix(wiring, &wiring_cells())?)
}

/// The pods behind `ptp` veths (`host-local`).
#[test]
fn ptp_wired_node() -> anyhow::Result<()> {
    let wiring = PodWiring::Cni(CniPlugin::Ptp);
    ensure_no_mismatch(wiring, &run_matrix(wiring, &wiring_cells())?)
}
