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

    /// Options of a small dataplane on these parts: `capacity` frontends and backends, the
    /// default conntrack size and everything else at its default.
    pub fn small_dataplane_options(&self, capacity: u32) -> proxy_dataplane_ebpf::EbpfOptions {
        use proxy_dataplane_ebpf::{EbpfOptions, LbOptions, TcOptions, maps::map_sizes};
        EbpfOptions {
            cgroup_path: self.cgroup_path(),
            bpf_root: self.bpf_root(),
            frontends_capacity: capacity,
            max_frontends_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_FRONTENDS_PER_SERVICE,
            max_endpoints_per_service: proxy_dataplane_ebpf::DEFAULT_MAX_ENDPOINTS_PER_SERVICE,
            backends_capacity: capacity,
            conntrack_capacity: Some(proxy_common::default_sizes::CT),
            lru_budget: map_sizes::LruBudget::MemoryShare(map_sizes::DEFAULT_DYNAMIC_SIZE_RATIO),
            lb: LbOptions::default(),
            tc: TcOptions::default(),
            disabled_features: Default::default(),
            icmp_ratelimit: None,
            snat_ports: proxy_dataplane_ebpf::conntrack::reserved_ports::DEFAULT_RANGE,
        }
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
