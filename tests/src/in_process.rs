//! What a dataplane started inside the test process needs: a thread in the test's own network
//! namespace, a tokio runtime entered on it, a private bpffs root and a child cgroup.

use std::path::PathBuf;

use crate::agent::TempBpfRoot;
use crate::cgroup::ChildCgroup;
use crate::{Result, RigError};

/// The parts; field order is drop order (the runtime, then the pins, then the cgroup), after
/// the dataplane that holds their file descriptors.
#[derive(Debug)]
pub struct InProcess {
    pub runtime: tokio::runtime::Runtime,
    pub bpf: TempBpfRoot,
    pub cgroup: ChildCgroup,
}

impl InProcess {
    /// The bpffs root for `EbpfOptions::bpf_root`.
    pub fn bpf_root(&self) -> PathBuf {
        PathBuf::from(self.bpf.path())
    }

    /// The cgroup for `EbpfOptions::cgroup_path`.
    pub fn cgroup_path(&self) -> Option<PathBuf> {
        Some(self.cgroup.path().to_path_buf())
    }
}

/// Runs `f` on a new thread inside the network namespace at `netns` (its `/run/netns` path)
/// with fresh [`InProcess`] parts and their runtime entered; returns what `f` returns, or why
/// the parts could not be made (or that the thread panicked: a test's assertion in `f`).
pub fn on_netns_thread<R: Send + 'static>(
    netns: PathBuf,
    f: impl FnOnce(InProcess) -> R + Send + 'static,
) -> Result<R> {
    crate::netns::on_thread_in(&netns, move || -> Result<R> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| RigError::io("building a tokio runtime", e))?;
        // A handle of its own, so the runtime can move into the parts while it is entered.
        let handle = runtime.handle().clone();
        let _entered = handle.enter();
        let bpf = TempBpfRoot::new()?;
        let cgroup = ChildCgroup::new()?;
        Ok(f(InProcess {
            runtime,
            bpf,
            cgroup,
        }))
    })?
}
