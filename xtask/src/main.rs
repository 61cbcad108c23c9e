//! Project tasks. `cargo xtask --help` lists them; README.md explains the main two (demo, test)
//! and the book (docs/, `cargo xtask docs`) the rest.

mod build;
mod commands;
mod deny;
mod docs;
mod image;
mod layers;
mod setup;
mod toolchain;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "kubeproxy-rs project tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install what building, testing and the book need (idempotent: skips what is present).
    Setup,
    /// Build the eBPF object (release, nightly + build-std + bpf-linker).
    BuildEbpf,
    /// Build everything and run every check, unit test and integration test, then each fuzz
    /// target briefly (needs root).
    Test {
        /// For development: fmt, links, layers, clippy and every unit and integration test,
        /// without the supply-chain check, the eBPF clippy and the fuzz targets.
        #[arg(long)]
        quick: bool,
    },
    /// The supply-chain check alone (part of `test`): cargo deny over both workspaces with
    /// deny.toml; advisories only when RustSec's database is beside the repository.
    Deny,
    /// Build the book under docs/ with mdBook (pinned; installed when missing) into
    /// target/book/, then check every link and anchor of README.md, ARCHITECTURE.md and
    /// docs/*.md (also part of `test`; external links are listed, not fetched).
    Docs {
        /// Only check the links (what `test` runs), without mdBook.
        #[arg(long)]
        links_only: bool,
    },
    /// Show socket-level load balancing to three pods in a throwaway topology (needs root).
    Demo,
    /// Coverage-guided fuzzing of the agent's parsers and of the tc programs (cargo-fuzz,
    /// nightly; tc_packets needs root), each target for the given time. Findings land in
    /// tests/fuzz/artifacts/.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u32,
        /// Only these targets (default: manifests, config, ctnetlink, sockdiag, api_protobuf,
        /// tc_packets).
        targets: Vec<String>,
    },
    /// Build the agent's OCI image archive (target/image/proxy-agent-VERSION.oci.tar, tag
    /// localhost/kubeproxy-rs/proxy-agent:VERSION) from Debian packages and the release binary,
    /// then load it into podman and smoke-run it (needs root; installs mmdebstrap, umoci,
    /// skopeo, podman and runc when missing).
    Image {
        /// Rebuild the cached Debian layer (it must still match deploy/image-base.lock).
        #[arg(long)]
        rebuild_base: bool,
        /// Rebuild the Debian layer and pin what it holds (Debian's updates) in
        /// deploy/image-base.lock, to review and commit.
        #[arg(long)]
        repin_base: bool,
        /// Only build the archive.
        #[arg(long)]
        no_smoke: bool,
    },
    /// Run the benchmarks (eBPF vs iptables vs direct) and write docs/benchmarks.md and its
    /// SVG plots (needs root; about 25 minutes, `--quick` for a short smoke run).
    Bench {
        /// Small sizes and single runs: checks that everything works, numbers not comparable.
        #[arg(long)]
        quick: bool,
        /// Run only these sections (comma-separated: datapath, nodeport, tc-cost, pps,
        /// programming, inprocess, snat, syn-flood, scale). The partial report goes to `target/bench-partial/`, never over
        /// docs/benchmarks.md, which comes from a run of everything.
        #[arg(long)]
        only: Option<String>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Setup => setup::run(setup::Mode::Always),
        Command::BuildEbpf => {
            setup::run(setup::Mode::IfMissing)?;
            build::ebpf()
        }
        Command::Test { quick } => {
            setup::run(setup::Mode::IfMissing)?;
            if !quick {
                setup::cargo_deny()?;
            }
            build::ebpf()?;
            build::test(quick)
        }
        Command::Deny => {
            setup::cargo_deny()?;
            deny::check()
        }
        Command::Fuzz { seconds, targets } => {
            setup::run(setup::Mode::IfMissing)?;
            build::ebpf()?;
            build::fuzz(
                build::FuzzBudget::Seconds(seconds),
                &targets,
                &build::ebpf_object(),
            )
        }
        Command::Docs { links_only: true } => docs::check_links(),
        Command::Docs { links_only: false } => docs::run(),
        Command::Demo => {
            setup::run(setup::Mode::IfMissing)?;
            build::ebpf()?;
            build::demo()
        }
        Command::Image {
            rebuild_base,
            repin_base,
            no_smoke,
        } => {
            setup::run(setup::Mode::IfMissing)?;
            build::ebpf()?;
            image::run(image::Options {
                rebuild_base,
                repin_base,
                no_smoke,
            })
        }
        Command::Bench { quick, only } => {
            setup::run(setup::Mode::IfMissing)?;
            build::ebpf()?;
            build::bench(quick, only.as_deref())
        }
    }
}
