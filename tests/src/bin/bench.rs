//! `cargo xtask bench`: runs every benchmark with its baselines side by side and writes
//! `docs/benchmarks.md` plus SVG plots. Needs root (namespaces, cgroups, BPF, iptables in
//! private namespaces).

use std::path::PathBuf;

use anyhow::bail;
use clap::Parser;
use proxy_tests::bench::{self, Config, IptablesBackend, Section};

#[derive(Debug, Parser)]
#[command(about = "kubeproxy-rs benchmarks: eBPF vs iptables vs direct, written to docs/")]
struct Cli {
    /// A short smoke run (small sizes, single runs); the report says so.
    #[arg(long)]
    quick: bool,
    /// Where benchmarks.md and the SVGs go.
    #[arg(long, default_value = "docs")]
    out_dir: PathBuf,
    /// Run only these sections (comma-separated); the report leaves the others out. For
    /// working on one benchmark; the committed report comes from a run of everything.
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Section>,
    /// Backend of the iptables-mode runs (default legacy: see docs/benchmarks.md).
    #[arg(long, value_enum)]
    iptables_backend: Option<IptablesBackend>,
    /// Services of the scale section (default: 50 000, or 2 000 with `--quick`), so a quick
    /// run can still look at the largest size.
    #[arg(long)]
    scale_services: Option<usize>,
    /// EndpointSlice changes through the API server in the scale section (default: 100, or 20
    /// with `--quick`); about one a second, so enough of them span periodic resyncs.
    #[arg(long)]
    scale_changes: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "the benchmarks need root (network namespaces, cgroups, BPF): run `cargo xtask bench` as root"
        );
    }
    let mut config = if cli.quick {
        Config::quick(cli.out_dir.clone())
    } else {
        Config::full(cli.out_dir.clone())
    };
    config.only = cli.only;
    if let Some(backend) = cli.iptables_backend {
        config.iptables_backend = backend;
    }
    if let Some(services) = cli.scale_services {
        config.scale_workload.services = services;
    }
    if let Some(changes) = cli.scale_changes {
        config.scale_changes = changes;
    }
    let results = bench::run(config);
    bench::report::write(&results, &cli.out_dir)?;
    println!(
        "wrote {}/benchmarks.md and its SVG plots",
        cli.out_dir.display()
    );
    if !results.failures.is_empty() {
        bail!(
            "{} measurement(s) failed (see the report): {}",
            results.failures.len(),
            results.failures.join("; ")
        );
    }
    Ok(())
}
