//! Loading the eBPF object, pinning its maps, attaching the socket programs to the cgroup, and
//! taking all of it down again.

use std::{
    collections::BTreeSet,
    fs::File,
    io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData, PerCpuArray},
    programs::{CgroupAttachMode, CgroupSockAddr},
};
use aya_log::EbpfLogger;
use proxy_common::{
    Backend4, BackendSlotKey, Frontend4Key, FrontendValue, StatIndex, map_names, program_names,
};
use tokio::{io::unix::AsyncFd, task::JoinHandle};
use tracing::{debug, info, warn};

use super::{
    ApplyError, ApplySummary, MapOps, Programmer, bpffs, cgroup, object, stats::read_stats,
};
use crate::desired::{ServicePortName, Snapshot};

/// Directory under `--bpf-root` that holds our pins.
pub const PIN_DIR_NAME: &str = "kubeproxy-rs";

const PINNED_MAPS: [&str; 5] = [
    map_names::FRONTENDS4,
    map_names::BACKEND_SLOTS,
    map_names::BACKENDS4,
    map_names::REVNAT4,
    map_names::STATS,
];

#[derive(Debug, Clone)]
pub struct EbpfOptions {
    /// cgroup2 directory to attach to; `None` means the cgroup2 mount point.
    pub cgroup_path: Option<PathBuf>,
    pub bpf_root: PathBuf,
    pub frontends_capacity: u32,
    pub backends_capacity: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "this proxy-agent was built with PROXY_EBPF_PLACEHOLDER=1 for checking only and has no \
         eBPF object; build it with `cargo xtask build-ebpf` and `cargo build -p proxy-agent`"
    )]
    Placeholder,
    #[error(transparent)]
    Bpffs(#[from] bpffs::BpffsError),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("--cgroup-path {path}: cannot open: {source}")]
    OpenCgroup { path: PathBuf, source: io::Error },
    #[error("{path}: cannot prepare pin directory: {source}")]
    PinDir { path: PathBuf, source: io::Error },
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("eBPF object has no map {0}")]
    MissingMap(&'static str),
    #[error("eBPF object has no program {0}")]
    MissingProgram(&'static str),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
}

/// The service maps as typed handles.
struct ServiceMaps {
    frontends: HashMap<MapData, Frontend4Key, FrontendValue>,
    slots: HashMap<MapData, BackendSlotKey, u32>,
    backends: HashMap<MapData, u32, Backend4>,
}

impl MapOps for ServiceMaps {
    fn put_frontend(&mut self, key: Frontend4Key, value: FrontendValue) -> Result<(), String> {
        self.frontends.insert(key, value, 0).map_err(map_error)
    }
    fn delete_frontend(&mut self, key: Frontend4Key) -> Result<(), String> {
        ignore_missing(self.frontends.remove(&key))
    }
    fn put_slot(&mut self, key: BackendSlotKey, backend_id: u32) -> Result<(), String> {
        self.slots.insert(key, backend_id, 0).map_err(map_error)
    }
    fn delete_slot(&mut self, key: BackendSlotKey) -> Result<(), String> {
        ignore_missing(self.slots.remove(&key))
    }
    fn put_backend(&mut self, id: u32, backend: Backend4) -> Result<(), String> {
        self.backends.insert(id, backend, 0).map_err(map_error)
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), String> {
        ignore_missing(self.backends.remove(&id))
    }
}

fn map_error(error: aya::maps::MapError) -> String {
    match &error {
        aya::maps::MapError::SyscallError(syscall)
            if syscall.io_error.raw_os_error() == Some(libc::E2BIG) =>
        {
            "map is full (raise its --bpf-map-* capacity)".to_owned()
        }
        _ => error.to_string(),
    }
}

fn ignore_missing(result: Result<(), aya::maps::MapError>) -> Result<(), String> {
    match result {
        Err(aya::maps::MapError::KeyNotFound) | Ok(()) => Ok(()),
        Err(error) => Err(map_error(error)),
    }
}

/// A loaded and attached eBPF dataplane. Dropping it (or [`EbpfDataplane::shutdown`]) detaches
/// the programs; `shutdown` also removes the pins.
pub struct EbpfDataplane {
    // Field order matters for Drop: programs (and their links) go before the maps' pins are
    // removed in `shutdown`.
    ebpf: Ebpf,
    maps: ServiceMaps,
    stats: PerCpuArray<MapData, u64>,
    programmer: Programmer,
    pin_dir: PathBuf,
    cgroup_path: PathBuf,
    log_drain: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for EbpfDataplane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EbpfDataplane")
            .field("pin_dir", &self.pin_dir)
            .field("cgroup_path", &self.cgroup_path)
            .finish_non_exhaustive()
    }
}

impl EbpfDataplane {
    /// Loads the programs, pins the maps and attaches to the cgroup. Must run inside a tokio
    /// runtime (the eBPF log drain is a task).
    pub fn start(options: &EbpfOptions) -> Result<Self, LoadError> {
        if object::IS_PLACEHOLDER {
            return Err(LoadError::Placeholder);
        }
        let cgroup_path = match &options.cgroup_path {
            Some(path) => path.clone(),
            None => cgroup::cgroup2_mount()?,
        };
        let cgroup_dir = File::open(&cgroup_path).map_err(|source| LoadError::OpenCgroup {
            path: cgroup_path.clone(),
            source,
        })?;

        bpffs::ensure_mounted(&options.bpf_root)?;
        let pin_dir = options.bpf_root.join(PIN_DIR_NAME);
        prepare_pin_dir(&pin_dir)?;

        let slots_capacity = options.backends_capacity;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&pin_dir)
            .map_max_entries(map_names::FRONTENDS4, options.frontends_capacity)
            .map_max_entries(map_names::BACKEND_SLOTS, slots_capacity)
            .map_max_entries(map_names::BACKENDS4, options.backends_capacity)
            .load(object::OBJECT)?;
        let log_drain = start_log_drain(&mut ebpf);

        let maps = ServiceMaps {
            frontends: take_map(&mut ebpf, map_names::FRONTENDS4)?,
            slots: take_map(&mut ebpf, map_names::BACKEND_SLOTS)?,
            backends: take_map(&mut ebpf, map_names::BACKENDS4)?,
        };
        let stats = take_map(&mut ebpf, map_names::STATS)?;

        for name in [program_names::CONNECT4, program_names::GETPEERNAME4] {
            attach_sock_addr(&mut ebpf, name, &cgroup_dir)?;
        }
        info!(cgroup = %cgroup_path.display(), pins = %pin_dir.display(), "eBPF socket programs attached");
        Ok(Self {
            ebpf,
            maps,
            stats,
            programmer: Programmer::default(),
            pin_dir,
            cgroup_path,
            log_drain,
        })
    }

    /// Makes the maps match `snapshot` for the service ports in `changed` (`None`: all of them),
    /// writing only entries that differ from what is programmed.
    pub fn apply(
        &mut self,
        snapshot: &Snapshot,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> (ApplySummary, Vec<ApplyError>) {
        self.programmer
            .apply_snapshot(snapshot, changed, &mut self.maps)
    }

    /// Datapath counters summed over all CPUs.
    pub fn stats(&self) -> Vec<(StatIndex, u64)> {
        read_stats(&self.stats)
    }

    /// Detaches the programs and removes every pin this dataplane created.
    pub fn shutdown(self) {
        let Self {
            ebpf,
            maps,
            stats,
            pin_dir,
            cgroup_path,
            log_drain,
            ..
        } = self;
        for (index, value) in read_stats(&stats) {
            info!(counter = index.name(), value, "datapath counter");
        }
        if let Some(task) = log_drain {
            task.abort();
        }
        // Dropping the Ebpf object closes the link fds, which detaches the programs.
        drop(ebpf);
        drop(maps);
        drop(stats);
        info!(cgroup = %cgroup_path.display(), "eBPF socket programs detached");
        remove_pins(&pin_dir);
    }
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, LoadError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(LoadError::MissingMap(name))?;
    T::try_from(map).map_err(|source| LoadError::Map { name, source })
}

fn attach_sock_addr(ebpf: &mut Ebpf, name: &'static str, cgroup: &File) -> Result<(), LoadError> {
    let program: &mut CgroupSockAddr = ebpf
        .program_mut(name)
        .ok_or(LoadError::MissingProgram(name))?
        .try_into()
        .map_err(|source| LoadError::Program { name, source })?;
    program
        .load()
        .map_err(|source| LoadError::Program { name, source })?;
    // Links are always multi-attach; other modes give EINVAL with bpf_link_create.
    program
        .attach(cgroup, CgroupAttachMode::Single)
        .map_err(|source| LoadError::Program { name, source })?;
    debug!(program = name, "attached");
    Ok(())
}

/// Creates the pin directory, removing pins a crashed earlier run left behind: until state
/// re-adoption lands, a fresh start begins from empty maps.
fn prepare_pin_dir(pin_dir: &Path) -> Result<(), LoadError> {
    let to_error = |source| LoadError::PinDir {
        path: pin_dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(pin_dir).map_err(to_error)?;
    for name in PINNED_MAPS {
        let pin = pin_dir.join(name);
        match std::fs::remove_file(&pin) {
            Ok(()) => warn!(pin = %pin.display(), "removed a stale pin from an earlier run"),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(to_error(error)),
        }
    }
    Ok(())
}

fn remove_pins(pin_dir: &Path) {
    for name in PINNED_MAPS {
        let pin = pin_dir.join(name);
        if let Err(error) = std::fs::remove_file(&pin)
            && error.kind() != io::ErrorKind::NotFound
        {
            warn!(pin = %pin.display(), %error, "cannot remove pin");
        }
    }
    if let Err(error) = std::fs::remove_dir(pin_dir)
        && error.kind() != io::ErrorKind::NotFound
    {
        warn!(dir = %pin_dir.display(), %error, "cannot remove pin directory");
    }
}

/// Forwards aya-log records from the eBPF programs into `tracing` (through the `log` bridge).
fn start_log_drain(ebpf: &mut Ebpf) -> Option<JoinHandle<()>> {
    let logger = match EbpfLogger::init(ebpf) {
        Ok(logger) => logger,
        Err(error) => {
            warn!(%error, "eBPF log forwarding unavailable");
            return None;
        }
    };
    // SAFETY: the logger owns its ring buffer fd and keeps returning that same open fd until it
    // is dropped, which only happens together with the AsyncFd.
    let registered =
        unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) };
    let mut logger = match registered {
        Ok(logger) => logger,
        Err(error) => {
            warn!(%error, "eBPF log forwarding unavailable");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        loop {
            let Ok(mut guard) = logger.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    }))
}
