//! Making sure a bpffs is mounted where maps are pinned.

use std::path::Path;

use nix::{
    mount::{MsFlags, mount},
    sys::statfs::{BPF_FS_MAGIC, statfs},
};
use tracing::info;

#[derive(Debug, thiserror::Error)]
pub enum BpffsError {
    #[error("--bpf-root {path}: cannot create directory: {source}")]
    Create {
        path: String,
        source: std::io::Error,
    },
    #[error("--bpf-root {path}: cannot inspect filesystem: {source}")]
    Statfs { path: String, source: nix::Error },
    #[error("--bpf-root {path}: cannot mount bpffs: {source}")]
    Mount { path: String, source: nix::Error },
}

/// Mounts bpffs at `root` unless it already is one. Returns whether it mounted.
pub fn ensure_mounted(root: &Path) -> Result<bool, BpffsError> {
    let shown = root.display().to_string();
    std::fs::create_dir_all(root).map_err(|source| BpffsError::Create {
        path: shown.clone(),
        source,
    })?;
    let fs = statfs(root).map_err(|source| BpffsError::Statfs {
        path: shown.clone(),
        source,
    })?;
    if fs.filesystem_type() == BPF_FS_MAGIC {
        return Ok(false);
    }
    mount(
        Some("bpffs"),
        root,
        Some("bpf"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=0700"),
    )
    .map_err(|source| BpffsError::Mount {
        path: shown.clone(),
        source,
    })?;
    info!(path = %shown, "mounted bpffs");
    Ok(true)
}
