//! Pinning threads and processes to CPUs, for benchmarks and races that must not share a core
//! with what they measure.

use crate::{Result, RigError};

/// Restricts task `tid` (0: the calling thread) to `cpu`.
pub fn pin(tid: i32, cpu: usize) -> Result<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu).map_err(|e| RigError::Nix {
        context: format!("CPU {cpu} in a CPU set"),
        source: e,
    })?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(tid), &set).map_err(|e| {
        RigError::Nix {
            context: format!("pinning task {tid} to CPU {cpu}"),
            source: e,
        }
    })
}

/// Pins every thread of process `pid` to `cpu`; threads it creates later inherit that.
pub fn pin_process(pid: u32, cpu: usize) -> Result<()> {
    let dir = format!("/proc/{pid}/task");
    let tasks = std::fs::read_dir(&dir).map_err(|e| RigError::io(format!("reading {dir}"), e))?;
    for task in tasks.flatten() {
        if let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) {
            pin(tid, cpu)?;
        }
    }
    Ok(())
}
