//! bpffs pins: the pin directory and its layout check, links pinned by rename (a restart
//! replaces the old program without a gap), and `--cleanup`.

use std::{
    fs::File,
    io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::MapInfo,
    programs::{
        CgroupAttachMode, CgroupSockAddr,
        links::{FdLink, PinnedLink},
    },
};
use proxy_common::map_names;
use tracing::{debug, info, warn};

use crate::{
    attach::layout::{self, Plan},
    attach::pin_files::remove_if_present,
    error::EbpfError,
};

/// Directory under `--bpf-root` that holds our pins.
pub const PIN_DIR_NAME: &str = "kubeproxy-rs";

/// Suffix of link pins: `<program>_link`. (bpffs refuses names with a dot: EPERM.)
pub(crate) const LINK_SUFFIX: &str = "_link";

/// `--cleanup`: removes every link pin (which detaches the programs), program and map pin under
/// `<bpf_root>/kubeproxy-rs/`, then the directory. Returns how many pins it removed.
pub fn cleanup(bpf_root: &Path) -> Result<usize, EbpfError> {
    let filters = remove_legacy_filters();
    let pin_dir = bpf_root.join(PIN_DIR_NAME);
    let to_error = |source| EbpfError::PinDir {
        path: pin_dir.clone(),
        source,
    };
    let entries = match std::fs::read_dir(&pin_dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            info!(dir = %pin_dir.display(), filters, "no pins to clean up");
            return Ok(filters);
        }
        Err(error) => return Err(to_error(error)),
    };
    let mut pins: Vec<PathBuf> = entries
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(to_error)?;
    // Links first, so no program runs against a map that is going away.
    pins.sort_by_key(|path| !path.to_string_lossy().ends_with(LINK_SUFFIX));
    for pin in &pins {
        std::fs::remove_file(pin).map_err(to_error)?;
        debug!(pin = %pin.display(), "removed");
    }
    std::fs::remove_dir(&pin_dir).map_err(to_error)?;
    info!(dir = %pin_dir.display(), pins = pins.len(), filters, "removed every pin, link and tc filter");
    Ok(pins.len() + filters)
}

/// Our legacy tc filters on every interface of this namespace (others' filters stay).
fn remove_legacy_filters() -> usize {
    match proxy_kernel::node::host_interfaces() {
        Ok(all) => all
            .keys()
            .map(|name| crate::attach::legacy_tc::remove_ours(name))
            .sum(),
        Err(error) => {
            warn!(%error, "cannot list network interfaces; legacy tc filters not removed");
            0
        }
    }
}

/// Loads and attaches one program, pins its link under a temporary name and renames that over
/// the previous run's pin, which releases the previous link (and so detaches the old program)
/// only once the new one is attached.
pub(crate) fn attach_and_pin(
    ebpf: &mut Ebpf,
    name: &'static str,
    cgroup: &File,
    pin_dir: &Path,
) -> Result<PinnedLink, EbpfError> {
    let program_error = |source| EbpfError::Program { name, source };
    let program: &mut CgroupSockAddr = ebpf
        .program_mut(name)
        .ok_or(EbpfError::MissingProgram(name))?
        .try_into()
        .map_err(program_error)?;
    let started = std::time::Instant::now();
    program.load().map_err(program_error)?;
    tracing::debug!(
        program = name,
        elapsed_ms = started.elapsed().as_millis(),
        "program loaded (verified by the kernel)"
    );
    // cgroup links are always multi-attach; other modes give EINVAL with bpf_link_create.
    let link_id = program
        .attach(cgroup, CgroupAttachMode::Single)
        .map_err(program_error)?;
    let link = program.take_link(link_id).map_err(program_error)?;
    let link = FdLink::try_from(link).map_err(|source| EbpfError::Link { name, source })?;
    let link = pin_replacing(link, name, &pin_dir.join(format!("{name}{LINK_SUFFIX}")))?;
    debug!(program = name, "attached and pinned");
    Ok(link)
}

/// Pins `link` under a temporary name and renames that over `final_pin`, which releases a
/// previous run's link there (detaching its program) only once the new one is attached.
pub(crate) fn pin_replacing(
    link: FdLink,
    name: &'static str,
    final_pin: &Path,
) -> Result<PinnedLink, EbpfError> {
    let final_pin = final_pin.to_path_buf();
    let new_pin = final_pin.with_file_name(format!(
        "{}_new",
        final_pin
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    // A crash between pin and rename leaves the temporary pin: remove it first.
    remove_if_present(&new_pin).map_err(|source| EbpfError::PinDir {
        path: new_pin.clone(),
        source,
    })?;
    link.pin(&new_pin)
        .map_err(|source| EbpfError::Pin { name, source })?;
    // bpffs supports rename over an existing pin; the replaced pin was the old link's last
    // reference (the old agent is gone), so the kernel detaches it now.
    std::fs::rename(&new_pin, &final_pin).map_err(|source| EbpfError::PinDir {
        path: final_pin.clone(),
        source,
    })?;
    PinnedLink::from_pin(&final_pin).map_err(|source| EbpfError::Link { name, source })
}

/// Mode of the pin directory: whoever can open a pin can read or rewrite the service maps or
/// detach the programs, so only root may even list it (the pins themselves are 0600, bpffs'
/// default).
pub const PIN_DIR_MODE: u32 = 0o700;

/// Creates the pin directory (mode [`PIN_DIR_MODE`], also enforced on an existing one) and
/// decides what becomes of each pinned map (see `layout::plan`): adopted as it is, migrated
/// from an older layout, or rebuilt empty when this build does not know its layout.
///
/// The Maglev map is also replaced when its capacity differs from `maglev_capacity`
/// (`--lb-algorithm` or `--bpf-map-maglev` changed): aya would reuse the pin as it is. Its
/// tables are then rebuilt by the first apply; until then the datapath's fallback for a
/// missing table entry is random choice.
///
/// The conntrack map is replaced only when `--bpf-map-conntrack` names another size
/// (`explicit_conntrack`): a size computed from the node's memory never costs the flows a
/// pinned map tracks (an upgrade from fixed sizes keeps the old map until `--cleanup` or a
/// reboot).
pub(crate) fn prepare_pin_dir(
    pin_dir: &Path,
    maglev_capacity: u32,
    explicit_conntrack: Option<u32>,
) -> Result<Plan, EbpfError> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    let to_error = |source| EbpfError::PinDir {
        path: pin_dir.to_owned(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(PIN_DIR_MODE)
        .create(pin_dir)
        .map_err(to_error)?;
    // The umask may have narrowed the mode further (harmless), and a directory made by an
    // older agent or by hand may be wider: set it exactly.
    std::fs::set_permissions(pin_dir, std::fs::Permissions::from_mode(PIN_DIR_MODE))
        .map_err(to_error)?;
    let plan = layout::plan(pin_dir).map_err(to_error)?;
    // aya would reuse the pin at its old size: a changed `--bpf-map-conntrack` takes a new map,
    // losing the flows it tracked (established external flows through SNAT break once).
    // The unanswered flows' maps are sized from the conntrack's (`LruSizes::conntrack4_new`).
    for (name, share) in [
        (map_names::CT4, 1),
        (map_names::CT6, 1),
        (
            map_names::CT4_NEW,
            proxy_common::default_sizes::CT_NEW_SHARE,
        ),
        (
            map_names::CT6_NEW,
            proxy_common::default_sizes::CT_NEW_SHARE,
        ),
    ] {
        let pin = pin_dir.join(name);
        if let Some(conntrack_capacity) = explicit_conntrack.map(|c| (c / share).max(1))
            && pin.exists()
            && !MapInfo::from_pin(&pin).is_ok_and(|info| info.max_entries() == conntrack_capacity)
        {
            warn!(pin = %pin.display(), capacity = conntrack_capacity, "conntrack map resized; its flows start over");
            remove_if_present(&pin).map_err(to_error)?;
        }
    }
    // The single-buffer XDP programs' array of older builds: the kernel would refuse this
    // build's multi-buffer programs in it, which have an array of their own
    // (`map_names::XDP_NEW_FLOW`). The previous agent's XDP program keeps its array until its
    // link gets this build's program.
    let pin = pin_dir.join(map_names::XDP_NEW_FLOW_SINGLE_BUFFER);
    if pin.exists() {
        info!(pin = %pin.display(), "unpinning the single-buffer XDP programs' array of an older build");
        remove_if_present(&pin).map_err(to_error)?;
    }
    let pin = pin_dir.join(map_names::MAGLEV);
    if pin.exists()
        && !MapInfo::from_pin(&pin).is_ok_and(|info| info.max_entries() == maglev_capacity)
    {
        info!(pin = %pin.display(), capacity = maglev_capacity, "Maglev map resized; its tables are rebuilt");
        remove_if_present(&pin).map_err(to_error)?;
    }
    Ok(plan)
}

/// Whether a previous agent's programs are attached through links pinned in `pin_dir`.
pub(crate) fn links_pinned(pin_dir: &Path) -> bool {
    std::fs::read_dir(pin_dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(LINK_SUFFIX))
    })
}
