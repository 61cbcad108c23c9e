//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! The object is found at `PROXY_EBPF_OBJECT` or in the workspace's `target/ebpf/` folder. When it
//! is missing the build fails and says how to make it, unless `PROXY_EBPF_PLACEHOLDER=1` asks for
//! a check-only build (`cargo check`/`clippy` on machines without bpf-linker) whose loader
//! refuses to run.

use std::{env, path::PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ebpf_placeholder)");
    println!("cargo::rerun-if-env-changed=PROXY_EBPF_OBJECT");
    println!("cargo::rerun-if-env-changed=PROXY_EBPF_PLACEHOLDER");

    let object = match env::var_os("PROXY_EBPF_OBJECT") {
        Some(path) => PathBuf::from(path),
        None => {
            let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
            manifest_dir.join("../target/ebpf/bpfel-unknown-none/release/proxy-ebpf")
        }
    };
    println!("cargo::rerun-if-changed={}", object.display());

    if env::var_os("PROXY_EBPF_PLACEHOLDER").is_some_and(|v| v == "1") {
        println!("cargo::rustc-cfg=ebpf_placeholder");
        println!(
            "cargo::warning=PROXY_EBPF_PLACEHOLDER=1: building without the eBPF object; this \
             binary is for checking only and will refuse to run"
        );
        return;
    }
    if !object.is_file() {
        eprintln!(
            "\nThe eBPF object {} does not exist.\nBuild it first with `cargo xtask build-ebpf` \
             (or run `cargo xtask test` / `cargo xtask demo`, which do it for you).\nFor \
             `cargo check`/`cargo clippy` on a machine without bpf-linker, set \
             PROXY_EBPF_PLACEHOLDER=1.\n",
            object.display()
        );
        std::process::exit(1);
    }
    let object = object.canonicalize().unwrap_or(object);
    println!("cargo::rustc-env=PROXY_EBPF_OBJECT={}", object.display());
}
