//! The nightly toolchain the eBPF programs and the fuzz targets build with, pinned by date and
//! checked by commit.
//!
//! The pin is [`EBPF_NIGHTLY`]: rustup's dated channel and the rustc commit it ships. Every
//! nightly build (`cargo xtask build-ebpf`, the eBPF clippy run, `cargo xtask fuzz`) goes
//! through [`ebpf_nightly`], which answers the name of an installed toolchain whose `rustc -vV`
//! is exactly that commit (and LLVM major, which bpf-linker is built against):
//! 1. the dated toolchain itself, when installed;
//! 2. else the plain `nightly` toolchain when it is that same build (these machines come with
//!    it, see ../shared/toolchain.md; nothing is downloaded then);
//! 3. else `rustup toolchain install` of the dated channel (minimal profile + rust-src).
//!
//! Anything else fails, naming what is installed: a different nightly never builds the object.

use std::{process::Command, sync::OnceLock};

use anyhow::{Result, bail};

use crate::commands::step;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nightly {
    /// rustup's dated channel (the build of the day before's last commit).
    pub channel: &'static str,
    /// `commit-hash` of its `rustc -vV`.
    pub commit_hash: &'static str,
    /// `commit-date` of its `rustc -vV`.
    pub commit_date: &'static str,
    /// The major version of its LLVM: bpf-linker is built against the same (setup.rs).
    pub llvm_major: u32,
}

/// rustc 1.97.0-nightly (e50aa6fba 2026-05-19), LLVM 22.1.4: what `nightly-2026-05-20`
/// installs (rustup: "latest update on 2026-05-20 for version 1.97.0-nightly (e50aa6fba
/// 2026-05-19)").
pub const EBPF_NIGHTLY: Nightly = Nightly {
    channel: "nightly-2026-05-20",
    commit_hash: "e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a",
    commit_date: "2026-05-19",
    llvm_major: 22,
};

/// What `rustc -vV` says about a toolchain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RustcVersion {
    pub release: String,
    pub commit_hash: String,
    pub commit_date: String,
    pub llvm_major: Option<u32>,
}

impl RustcVersion {
    pub fn parse(verbose_version: &str) -> Self {
        let field = |name: &str| {
            verbose_version
                .lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(": "))
                .unwrap_or_default()
                .trim()
                .to_owned()
        };
        let llvm_major = field("LLVM version")
            .split('.')
            .next()
            .and_then(|major| major.parse().ok());
        Self {
            release: field("release"),
            commit_hash: field("commit-hash"),
            commit_date: field("commit-date"),
            llvm_major,
        }
    }

    pub fn is(&self, pin: &Nightly) -> bool {
        self.commit_hash == pin.commit_hash
            && self.commit_date == pin.commit_date
            && self.llvm_major == Some(pin.llvm_major)
    }
}

impl std::fmt::Display for RustcVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rustc {} ({} {}), LLVM {}",
            self.release,
            self.commit_hash.get(..9).unwrap_or(&self.commit_hash),
            self.commit_date,
            self.llvm_major
                .map_or_else(|| "?".to_owned(), |major| major.to_string())
        )
    }
}

/// `rustc +TOOLCHAIN -vV`, when that toolchain is installed (never installs one: rustup's
/// auto-install is off for this call).
fn rustc_version(toolchain: &str) -> Option<RustcVersion> {
    let installed = Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .ok()?;
    let listed = String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|line| {
            line.split_whitespace()
                .next()
                .is_some_and(|name| name == toolchain || name.starts_with(&format!("{toolchain}-")))
        });
    if !listed {
        return None;
    }
    let out = Command::new("rustc")
        .arg(format!("+{toolchain}"))
        .arg("-vV")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env("RUSTUP_AUTO_INSTALL", "0")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| RustcVersion::parse(&String::from_utf8_lossy(&out.stdout)))
}

static RESOLVED: OnceLock<String> = OnceLock::new();

/// The installed toolchain that is [`EBPF_NIGHTLY`] (its rustup name, for `cargo +NAME`),
/// installing the dated channel when no installed one is.
pub fn ebpf_nightly() -> Result<&'static str> {
    if let Some(name) = RESOLVED.get() {
        return Ok(name);
    }
    let pin = EBPF_NIGHTLY;
    let mut seen = Vec::new();
    for name in [pin.channel, "nightly"] {
        match rustc_version(name) {
            Some(version) if version.is(&pin) => {
                return Ok(RESOLVED.get_or_init(|| name.to_owned()));
            }
            Some(version) => seen.push(format!("`{name}` is {version}")),
            None => seen.push(format!("`{name}` is not installed")),
        }
    }
    step(&format!(
        "setup: installing the pinned nightly {} ({})",
        pin.channel,
        seen.join("; ")
    ));
    let installed = Command::new("rustup")
        .args(["toolchain", "install", pin.channel])
        .args([
            "--profile",
            "minimal",
            "--component",
            "rust-src",
            "--no-self-update",
        ])
        .env_remove("RUSTUP_TOOLCHAIN")
        .status()
        .is_ok_and(|status| status.success());
    match rustc_version(pin.channel) {
        Some(version) if version.is(&pin) => Ok(RESOLVED.get_or_init(|| pin.channel.to_owned())),
        found => bail!(
            "the eBPF build is pinned to {} (rustc {} {}, LLVM {}), and no installed toolchain \
             is that build: {}; {}. Install it (`rustup toolchain install {} --profile minimal \
             --component rust-src`), or, to move the pin, change EBPF_NIGHTLY in \
             xtask/src/toolchain.rs together with bpf-linker's LLVM (setup.rs) and check the \
             eBPF object still loads (`cargo xtask test`)",
            pin.channel,
            &pin.commit_hash[..9],
            pin.commit_date,
            pin.llvm_major,
            seen.join("; "),
            match (installed, found) {
                (false, _) => format!("`rustup toolchain install {}` failed", pin.channel),
                (true, Some(version)) => format!("{} installed as {version}", pin.channel),
                (true, None) => format!("{} did not install", pin.channel),
            },
            pin.channel,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED: &str = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)
binary: rustc
commit-hash: e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a
commit-date: 2026-05-19
host: x86_64-unknown-linux-gnu
release: 1.97.0-nightly
LLVM version: 22.1.4
";

    #[test]
    fn the_pinned_nightly_is_recognised() {
        let version = RustcVersion::parse(PINNED);
        assert_eq!(version.release, "1.97.0-nightly");
        assert_eq!(version.llvm_major, Some(22));
        assert!(version.is(&EBPF_NIGHTLY));
        assert_eq!(
            version.to_string(),
            "rustc 1.97.0-nightly (e50aa6fba 2026-05-19), LLVM 22"
        );
    }

    #[test]
    fn another_nightly_is_not() {
        let next_day = PINNED
            .replace(
                "e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a",
                "0123456789abcdef",
            )
            .replace("2026-05-19", "2026-05-20");
        assert!(!RustcVersion::parse(&next_day).is(&EBPF_NIGHTLY));
        // The same commit with another LLVM (a distribution's own build) is not it either.
        let other_llvm = PINNED.replace("LLVM version: 22.1.4", "LLVM version: 21.1.0");
        assert!(!RustcVersion::parse(&other_llvm).is(&EBPF_NIGHTLY));
        assert!(!RustcVersion::parse("").is(&EBPF_NIGHTLY));
    }

    #[test]
    fn the_channel_is_dated() {
        let date = EBPF_NIGHTLY.channel.strip_prefix("nightly-").unwrap();
        assert_eq!(date.len(), "YYYY-MM-DD".len());
        assert!(EBPF_NIGHTLY.commit_date < date);
    }
}
