//! Child cgroups (cgroup2) for confining clients, with a guard that kills and removes them.

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use crate::wait::wait_until;
use crate::{Result, RigError, unique_name};

/// How long the processes of a killed cgroup may take to exit.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// Finds the cgroup2 mount point from /proc/mounts (its location differs between hybrid and
/// unified layouts, e.g. `/sys/fs/cgroup/unified` vs `/sys/fs/cgroup`).
pub fn cgroup2_mount() -> Result<PathBuf> {
    let mounts =
        fs::read_to_string("/proc/mounts").map_err(|e| RigError::io("reading /proc/mounts", e))?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(dir))
        })
        .next()
        .ok_or_else(|| RigError::Other("no cgroup2 mount in /proc/mounts".into()))
}

/// A uniquely named child of the cgroup2 root. Drop kills every process in it
/// (`cgroup.kill`), waits (bounded) until it is empty and removes it.
#[derive(Debug)]
pub struct ChildCgroup {
    path: PathBuf,
}

impl ChildCgroup {
    pub fn new() -> Result<Self> {
        let path = cgroup2_mount()?.join(unique_name("cg"));
        fs::create_dir(&path)
            .map_err(|e| RigError::io(format!("creating cgroup {}", path.display()), e))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pids currently in the cgroup.
    pub fn pids(&self) -> Result<Vec<u32>> {
        let procs = self.path.join("cgroup.procs");
        let text = fs::read_to_string(&procs)
            .map_err(|e| RigError::io(format!("reading {}", procs.display()), e))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    fn kill_all(&self) -> Result<()> {
        let kill = self.path.join("cgroup.kill");
        fs::write(&kill, "1")
            .map_err(|e| RigError::io(format!("writing {}", kill.display()), e))?;
        wait_until(
            "cgroup to become empty",
            KILL_TIMEOUT,
            Duration::from_millis(20),
            || self.pids().map(|p| p.is_empty()).unwrap_or(false),
        )
    }
}

impl Drop for ChildCgroup {
    fn drop(&mut self) {
        if let Err(e) = self.kill_all() {
            eprintln!("rig: emptying cgroup {} failed: {e}", self.path.display());
        }
        // rmdir can briefly report EBUSY while the last exiting task is being released.
        for attempt in 0..50 {
            match fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if attempt == 49 => {
                    eprintln!("rig: removing cgroup {} failed: {e}", self.path.display());
                }
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// Moves this process into a cgroup2 directory.
pub fn join_cgroup(dir: &Path) -> Result<()> {
    let procs = dir.join("cgroup.procs");
    fs::write(&procs, std::process::id().to_string())
        .map_err(|e| RigError::io(format!("writing {}", procs.display()), e))
}
