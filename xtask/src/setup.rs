//! `cargo xtask setup`: the eBPF build chain from ../shared/toolchain.md, installed idempotently.

use std::{os::unix::fs::PermissionsExt as _, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

use crate::{
    commands::{run_cmd, step},
    deny::{CARGO_DENY_VERSION, has_cargo_deny},
    toolchain::{EBPF_NIGHTLY, ebpf_nightly},
};

/// Debian packages: LLVM 22 for bpf-linker (nightly's LLVM is 22), runtime tools for tests
/// (`nftables`: the host-policy tests add a foreign nft table, as a CNI would; the agent
/// removes kube-proxy's nftables tables and the migration test creates them; `prometheus`
/// for `promtool check metrics` on the agent's expositions, `metrics_exposition.rs`, a
/// Prometheus server scraping native histograms, `native_histograms.rs`, and `promtool
/// check/test rules` plus a Prometheus evaluating the dashboard's and alerts' queries,
/// `monitoring.rs`; `ethtool`:
/// the XDP test gives its veths a wire's complete checksums, `external_xdp.rs`).
const DEBIAN_PACKAGES: [&str; 10] = [
    "llvm-22-dev",
    "libpolly-22-dev",
    "iptables",
    "iproute2",
    "bpftool",
    "nftables",
    "prometheus",
    "ethtool",
    // `inspect top`'s test runs it in a terminal.
    "tmux",
    // The CNI reference plugins (`bridge`, `ptp`, `host-local`): the reachability matrix and
    // the pps benchmark (§4b) wire pods with them as a container runtime would
    // (`tests/src/cni.rs`).
    "containernetworking-plugins",
];
const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `cargo xtask setup`: report every item, install what is missing.
    Always,
    /// Other commands: stay quiet when everything is present.
    IfMissing,
}

pub fn run(mode: Mode) -> Result<()> {
    // The pinned nightly (installed here if no installed toolchain is that build).
    let nightly = ebpf_nightly()?;
    let rust_src = has_rust_src(nightly);
    let missing_packages: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|package| !debian_package_installed(package))
        .collect();
    let linker = has_bpf_linker();
    if mode == Mode::IfMissing && rust_src && missing_packages.is_empty() && linker {
        return Ok(());
    }
    step("setup: checking the eBPF build chain");

    println!(
        "  pinned nightly {} (rustc {} {}): toolchain `{nightly}`",
        EBPF_NIGHTLY.channel,
        &EBPF_NIGHTLY.commit_hash[..9],
        EBPF_NIGHTLY.commit_date
    );
    if rust_src {
        println!("  {nightly} rust-src: present");
    } else {
        println!("  {nightly} rust-src: installing");
        run_cmd(
            Command::new("rustup")
                .args(["component", "add", "rust-src", "--toolchain", nightly])
                .env_remove("RUSTUP_TOOLCHAIN"),
        )
        .with_context(|| format!("cannot add rust-src to the {nightly} toolchain"))?;
    }

    if missing_packages.is_empty() {
        println!("  Debian packages {}: present", DEBIAN_PACKAGES.join(" "));
    } else {
        println!(
            "  Debian packages: installing {}",
            missing_packages.join(" ")
        );
        run_cmd(Command::new("apt-get").arg("update").arg("-q"))?;
        // The packages' maintainer scripts start their services (`prometheus` would listen on
        // the host's :9090); the tests start their own servers, in test namespaces.
        let _no_starts = NoServiceStarts::install()?;
        run_cmd(
            Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(&missing_packages)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
        if missing_packages.contains(&"prometheus") {
            // Not started by the install (above), but enabled for the next boot on a machine
            // with systemd: the tests do not need it.
            let _ = Command::new("systemctl")
                .args(["disable", "--now", "prometheus"])
                .status();
        }
    }

    if linker {
        println!("  bpf-linker {BPF_LINKER_VERSION}: present");
    } else {
        println!("  bpf-linker {BPF_LINKER_VERSION}: building against LLVM 22 (about 2 minutes)");
        run_cmd(
            Command::new("cargo")
                .args([
                    "install",
                    "bpf-linker",
                    "--locked",
                    "--version",
                    BPF_LINKER_VERSION,
                ])
                .args(["--no-default-features", "--features", "llvm-22"])
                .env("LLVM_PREFIX", LLVM_PREFIX)
                .env_remove("RUSTUP_TOOLCHAIN"),
        )?;
        if !has_bpf_linker() {
            bail!("bpf-linker was installed but is not on PATH; add ~/.cargo/bin to PATH");
        }
    }
    if mode == Mode::Always {
        if has_cargo_deny() {
            println!("  cargo-deny {CARGO_DENY_VERSION}: present");
        } else {
            cargo_deny()?;
        }
        if crate::docs::has_mdbook() {
            println!("  mdbook {}: present", crate::docs::MDBOOK_VERSION);
        } else {
            crate::docs::install_mdbook()?;
        }
    }
    println!("  setup complete");
    Ok(())
}

/// cargo-deny at the pinned release, for `cargo xtask test`'s supply-chain check (several
/// minutes to build, once).
pub fn cargo_deny() -> Result<()> {
    if has_cargo_deny() {
        return Ok(());
    }
    step(&format!(
        "setup: cargo install cargo-deny {CARGO_DENY_VERSION} (once; 26 min measured on 2 shared cores)"
    ));
    run_cmd(
        Command::new("cargo")
            .args([
                "install",
                "cargo-deny",
                "--locked",
                "--version",
                CARGO_DENY_VERSION,
            ])
            .env_remove("RUSTUP_TOOLCHAIN"),
    )?;
    if !has_cargo_deny() {
        bail!(
            "cargo-deny {CARGO_DENY_VERSION} was installed but `cargo deny --version` does not \
             say so; is ~/.cargo/bin on PATH?"
        );
    }
    Ok(())
}

fn has_rust_src(toolchain: &str) -> bool {
    Command::new("rustup")
        .args(["component", "list", "--toolchain", toolchain, "--installed"])
        .output()
        .is_ok_and(|out| {
            out.status.success()
                && String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .any(|line| line.starts_with("rust-src"))
        })
}

/// Debian's policy layer (`/usr/sbin/policy-rc.d`, read by `invoke-rc.d` and
/// `deb-systemd-invoke`) answering 101, "action forbidden", to every service start while it
/// lives: the install starts nothing, with or without systemd. A policy file the machine
/// already has is left as it is.
struct NoServiceStarts {
    created: Option<&'static Path>,
}

impl NoServiceStarts {
    const PATH: &'static str = "/usr/sbin/policy-rc.d";

    fn install() -> Result<Self> {
        let path = Path::new(Self::PATH);
        if path.exists() {
            return Ok(Self { created: None });
        }
        std::fs::write(path, "#!/bin/sh\n# cargo xtask setup: no service starts while it installs packages\nexit 101\n")
            .with_context(|| format!("writing {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", path.display()))?;
        Ok(Self {
            created: Some(path),
        })
    }
}

impl Drop for NoServiceStarts {
    fn drop(&mut self) {
        if let Some(path) = self.created
            && let Err(e) = std::fs::remove_file(path)
        {
            eprintln!("setup: removing {} failed: {e}", path.display());
        }
    }
}

fn debian_package_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Abbrev}", package])
        .output()
        .is_ok_and(|out| out.status.success() && out.stdout.starts_with(b"ii"))
}

fn has_bpf_linker() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|out| {
            out.status.success()
                && String::from_utf8_lossy(&out.stdout).contains(BPF_LINKER_VERSION)
        })
}
