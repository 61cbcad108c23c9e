//! The commit the agent is built from, for `kubernetes_build_info` (component-base labels
//! every Kubernetes binary with its git commit). A build outside a git checkout, or without
//! git, leaves the label empty.

use std::{path::Path, process::Command};

fn main() {
    let git_dir = Path::new("../.git");
    // Rebuilt when the checked-out commit moves (a worktree's `.git` is a file: HEAD then
    // lives elsewhere, and a stale commit there costs only a label).
    for watched in ["HEAD", "refs/heads", "packed-refs"] {
        let path = git_dir.join(watched);
        if path.exists() {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
    let commit = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|text| text.trim().to_owned())
        .filter(|text| text.len() == 40 && text.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_default();
    println!("cargo:rustc-env=KPR_GIT_COMMIT={commit}");
}
