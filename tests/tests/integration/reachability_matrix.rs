//! The reachability matrix (tests/src/reachability/): every cell of client × Service shape ×
//! frontend × IP family with real packets, in both `--proxy-mode`s in sequence, each on a
//! fresh rig. Prints the whole table; with `KPR_WRITE_REACHABILITY=1` (and both modes run) it
//! rewrites `docs/reachability.md`. A cell that matches neither upstream nor a documented eBPF
//! difference fails the test, after everything is printed. `KPR_REACHABILITY_MODES=iptables`
//! (or `ebpf`) runs one mode only and `KPR_REACHABILITY_HOLD_SECS=N` holds the live rig N seconds
//! before the cells run, for debugging. Needs root.

use std::time::Instant;

use proxy_tests::reachability::report::{Report, Row};
use proxy_tests::reachability::rig::MatrixRig;
use proxy_tests::reachability::runner::{Outcome, run_cells};
use proxy_tests::reachability::{Cell, all_cells};

/// Runs every cell against a fresh rig with the agent in `mode`.
fn run_mode(mode: &str, cells: &[Cell]) -> anyhow::Result<Vec<Outcome>> {
    let started = Instant::now();
    let mut rig = MatrixRig::new()?;
    rig.start_agent(mode)?;
    let not_ready = rig.wait_ready()?;
    for line in &not_ready {
        eprintln!("[{mode}] {line}");
    }
    if let Some(secs) = std::env::var("KPR_REACHABILITY_HOLD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        // A debugging aid: time to look at the live rig (ip netns, iptables-save) from
        // another shell.
        eprintln!("[{mode}] holding the rig for {secs} s");
        std::thread::sleep(std::time::Duration::from_secs(secs));
    }
    let outcomes = run_cells(&rig, cells);
    eprintln!(
        "[{mode}] {} cells in {:?} (agent running: {})",
        cells.len(),
        started.elapsed(),
        rig.agent_running()
    );
    if !not_ready.is_empty() || !rig.agent_running() {
        eprintln!("[{mode}] agent log tail:\n{}", rig.agent_log_tail(40));
    }
    rig.stop_agent()?;
    Ok(outcomes)
}

#[test]
fn reachability_matrix() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let modes = std::env::var("KPR_REACHABILITY_MODES").unwrap_or_else(|_| "iptables,ebpf".into());
    let cells = all_cells();
    let mut ebpf = None;
    let mut iptables = None;
    for mode in modes.split(',').map(str::trim) {
        match mode {
            "ebpf" => ebpf = Some(run_mode(mode, &cells)?),
            "iptables" => iptables = Some(run_mode(mode, &cells)?),
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
    println!("{}", report.text());

    if std::env::var_os("KPR_WRITE_REACHABILITY").is_some_and(|v| v == "1") {
        anyhow::ensure!(
            ebpf.is_some() && iptables.is_some(),
            "docs/reachability.md shows both modes: run them both to rewrite it"
        );
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reachability.md");
        std::fs::write(&path, report.markdown())?;
        eprintln!("wrote {}", path.display());
    }

    let mismatches = report.mismatches();
    anyhow::ensure!(
        mismatches.is_empty(),
        "{} cells differ from upstream without a documented reason:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    Ok(())
}
