//! Restarting without the verifier. Loading a program makes the kernel verify it, which for
//! the tc family programs is seconds of CPU per start; a restarting agent of the same build on
//! the same kernel would have the kernel verify the very same instructions again. So the
//! entry programs the agent attaches are pinned (`<program>_prog`) next to their links, and a
//! stamp, `KPR_LOAD_STAMP` (a pinned one-entry array that only user space reads), records what
//! they were loaded from: a SHA-256 of the embedded object, of the kernel release (`uname -r`)
//! and of the options that change how they load or where they attach (the object's globals,
//! the map sizes, BTF, the cgroup, TCX and XDP). A start whose stamp matches and whose pins
//! are all there ([`decide`]) opens the pinned programs and adopts their links instead of
//! loading (`EbpfDataplane::start`); anything else takes the full load, which unpins the
//! stamp first and pins it again only once every program is attached, so a stamp never
//! vouches for pins another build replaced half-way.
//!
//! An agent of an older build ignores the program pins and the stamp but replaces the links;
//! so a socket program's link that runs another program than the pinned one of its name
//! ([`open`]) means the pins are stale, and the start loads.
//!
//! The tc family and fragment programs need no pins of their own: the pinned program arrays
//! that the entry programs tail-call through keep them, loaded once with their entry programs.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use aya::{
    Pod,
    maps::{Array, Map, MapData},
    programs::{
        SchedClassifier, Xdp,
        links::{FdLink, PinnedLink},
    },
};
use proxy_common::{map_names, program_names};
use sha2::{Digest as _, Sha256};
use tracing::{debug, warn};

use crate::attach::{
    pin_files::remove_if_present,
    pins::{LINK_SUFFIX, PIN_DIR_NAME},
};

/// Pinned name of the stamp (not in the eBPF object: the datapath never reads it).
pub const STAMP: &str = "KPR_LOAD_STAMP";

/// Suffix of program pins: `<program>_prog` (never `_link`: those are links, see `pins`).
pub const PROGRAM_SUFFIX: &str = "_prog";

/// Version of [`StampValue`]'s layout: a value of another version (or size) is no match.
const STAMP_VERSION: u32 = 1;

/// Where program `name` is pinned in `pin_dir`.
pub fn program_pin(pin_dir: &Path, name: &str) -> PathBuf {
    pin_dir.join(format!("{name}{PROGRAM_SUFFIX}"))
}

/// What the pinned programs were loaded from, each part a SHA-256.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadStamp {
    pub object: [u8; 32],
    pub kernel: [u8; 32],
    pub options: [u8; 32],
}

/// The value of `KPR_LOAD_STAMP` (one entry, key 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StampValue {
    version: u32,
    _pad: u32,
    object: [u8; 32],
    kernel: [u8; 32],
    options: [u8; 32],
}

// SAFETY: a `repr(C)` struct of integers and byte arrays without implicit padding, valid for
// any bytes.
unsafe impl Pod for StampValue {}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

impl LoadStamp {
    /// The stamp of `object` loaded on kernel `release` with the load-relevant `options`
    /// (their canonical text).
    pub fn new(object: &[u8], release: &str, options: &str) -> Self {
        Self {
            object: sha256(object),
            kernel: sha256(release.as_bytes()),
            options: sha256(options.as_bytes()),
        }
    }

    fn value(&self) -> StampValue {
        StampValue {
            version: STAMP_VERSION,
            _pad: 0,
            object: self.object,
            kernel: self.kernel,
            options: self.options,
        }
    }

    /// The first 8 bytes of the object's hash in hex, for the log.
    pub fn object_short(&self) -> String {
        self.object[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

/// The running kernel's release (`uname -r`); `None` when it cannot be read, and then no
/// pinned program is reused (which kernel verified them is unknown).
pub fn kernel_release() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|text| text.trim().to_owned())
        .filter(|text| !text.is_empty())
}

/// Why the programs are loaded (and verified) rather than reused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadReason {
    /// No stamp (a first start, a `--cleanup`, an older agent, or a full load that never
    /// finished).
    NoStamp,
    /// The pinned programs came from another object (an upgrade or a downgrade).
    Object,
    /// The pinned programs were verified by another kernel.
    Kernel,
    /// The kernel release is unreadable.
    UnknownKernel,
    /// An option that changes how the programs load or attach changed.
    Options,
    /// A pin the reuse needs is missing (program, link or map).
    MissingPin(String),
    /// A pinned map is being migrated, rebuilt or resized: the pinned programs hold the old one.
    MapsReplaced,
}

impl std::fmt::Display for LoadReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoStamp => f.write_str("no stamp of the pinned programs"),
            Self::Object => f.write_str("the pinned programs come from another eBPF object"),
            Self::Kernel => f.write_str("the pinned programs were loaded by another kernel"),
            Self::UnknownKernel => f.write_str("the kernel release is unreadable"),
            Self::Options => f.write_str("a load-relevant option changed"),
            Self::MissingPin(pin) => write!(f, "pin {pin} is missing"),
            Self::MapsReplaced => f.write_str("a pinned map is migrated, rebuilt or resized"),
        }
    }
}

/// Whether to reuse the pinned programs: only when the stamp recorded with them is `current`
/// in every part, no pin they need is `missing`, and no pinned map is replaced (the pinned
/// programs would keep using the old one).
pub fn decide(
    recorded: Option<&LoadStamp>,
    current: Option<&LoadStamp>,
    missing: Option<&str>,
    maps_replaced: bool,
) -> Result<(), LoadReason> {
    let Some(current) = current else {
        return Err(LoadReason::UnknownKernel);
    };
    let Some(recorded) = recorded else {
        return Err(LoadReason::NoStamp);
    };
    if recorded.object != current.object {
        return Err(LoadReason::Object);
    }
    if recorded.kernel != current.kernel {
        return Err(LoadReason::Kernel);
    }
    if recorded.options != current.options {
        return Err(LoadReason::Options);
    }
    if let Some(pin) = missing {
        return Err(LoadReason::MissingPin(pin.to_owned()));
    }
    if maps_replaced {
        return Err(LoadReason::MapsReplaced);
    }
    Ok(())
}

/// The pins a reuse cannot do without: every socket program and its cgroup link, every
/// pinned map (a new map would not be the one the pinned programs use) and the program
/// arrays. The tc and XDP entry programs are optional: one never loaded is loaded when an
/// interface first needs it, as on a full start.
pub fn first_missing_pin(pin_dir: &Path) -> Option<String> {
    let programs = program_names::ALL.iter().flat_map(|name| {
        [
            format!("{name}{PROGRAM_SUFFIX}"),
            format!("{name}{LINK_SUFFIX}"),
        ]
    });
    let maps = map_names::PINNED
        .iter()
        .chain(&[
            map_names::TC_FAMILY,
            map_names::TC_FRAGMENT,
            map_names::XDP_TARGETS,
            map_names::XDP_NEW_FLOW,
        ])
        .map(|name| (*name).to_owned());
    programs
        .chain(maps)
        .find(|name| !pin_dir.join(name).exists())
}

/// The stamp pinned in `pin_dir`; `None` if there is none or it is not readable as this
/// build's (another layout is as good as none).
pub fn read(pin_dir: &Path) -> Option<LoadStamp> {
    let pin = pin_dir.join(STAMP);
    if !pin.exists() {
        return None;
    }
    let map = MapData::from_pin(&pin)
        .and_then(Map::from_map_data)
        .and_then(Array::<MapData, StampValue>::try_from);
    let value = match map.and_then(|map| map.get(&0, 0)) {
        Ok(value) => value,
        Err(error) => {
            debug!(pin = %pin.display(), %error, "load stamp unreadable");
            return None;
        }
    };
    (value.version == STAMP_VERSION).then_some(LoadStamp {
        object: value.object,
        kernel: value.kernel,
        options: value.options,
    })
}

/// Unpins the stamp: from now until [`write`], the pinned programs may be another build's.
pub fn invalidate(pin_dir: &Path) {
    if let Err(error) = remove_if_present(&pin_dir.join(STAMP)) {
        warn!(%error, "cannot remove the load stamp; the next start may reuse programs it should not");
    }
}

/// Pins `stamp` (a new map, renamed over any old one) once every program it vouches for is
/// pinned and attached. Best effort: without it the next start loads the programs again.
pub fn write(pin_dir: &Path, stamp: &LoadStamp) {
    let pin = pin_dir.join(STAMP);
    let new_pin = pin_dir.join(format!("{STAMP}_new"));
    let written = || -> Result<(), String> {
        remove_if_present(&new_pin).map_err(|e| e.to_string())?;
        let mut map = Array::<MapData, StampValue>::create(1, 0).map_err(|e| e.to_string())?;
        map.set(0, stamp.value(), 0).map_err(|e| e.to_string())?;
        map.pin(&new_pin).map_err(|e| e.to_string())?;
        std::fs::rename(&new_pin, &pin).map_err(|e| e.to_string())
    };
    let renamed = written();
    match renamed {
        Ok(()) => debug!(object = %stamp.object_short(), "load stamp pinned"),
        Err(error) => {
            warn!(%error, "cannot pin the load stamp; the next start loads the programs again")
        }
    }
}

/// Pins a loaded program as `<program>_prog` under a temporary name renamed over a previous
/// run's pin, which a pinned link or program array may still hold (the old program then
/// lives on until those go).
pub fn pin_program(
    pin_dir: &Path,
    name: &'static str,
    pin: impl FnOnce(&Path) -> Result<(), aya::pin::PinError>,
) -> Result<(), crate::error::EbpfError> {
    let final_pin = program_pin(pin_dir, name);
    let new_pin = pin_dir.join(format!("{name}{PROGRAM_SUFFIX}_new"));
    let dir_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| crate::error::EbpfError::PinDir { path, source }
    };
    remove_if_present(&new_pin).map_err(dir_error(&new_pin))?;
    pin(&new_pin).map_err(|source| crate::error::EbpfError::PinProgram { name, source })?;
    std::fs::rename(&new_pin, &final_pin).map_err(dir_error(&final_pin))
}

/// Pins a program just loaded for the next start. Best effort: a program not pinned only
/// makes that start load it again.
pub(crate) fn pin_loaded(
    pin_dir: &Path,
    program: &'static str,
    pin: impl FnOnce(&Path) -> Result<(), aya::pin::PinError>,
) {
    if let Err(error) = pin_program(pin_dir, program, pin) {
        warn!(program, %error, "cannot pin the program; the next start loads it again");
    }
}

/// Why the pinned programs could not be reused after all (the start then loads them).
#[derive(Debug, thiserror::Error)]
pub enum ReuseError {
    #[error("pinned program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("pinned link of {name}: {source}")]
    Link {
        name: &'static str,
        source: aya::programs::links::LinkError,
    },
    #[error("the pinned link of {name} runs program {linked}, not the pinned program {pinned}")]
    Mismatch {
        name: &'static str,
        linked: u32,
        pinned: u32,
    },
}

/// The pinned entry programs a restart reuses instead of loading: the tc and XDP ones attach
/// to interfaces as they come (`TcState`), the socket programs' links are adopted as they are.
#[derive(Debug, Default)]
pub struct PinnedPrograms {
    pub classifiers: BTreeMap<&'static str, SchedClassifier>,
    pub xdp: Option<Xdp>,
    /// Kernel program id by name, for the log (and tests).
    pub ids: BTreeMap<&'static str, u32>,
}

/// The pinned programs and the adopted cgroup links.
#[derive(Debug)]
pub struct Reused {
    pub programs: PinnedPrograms,
    pub links: Vec<PinnedLink>,
}

fn program_id(pin: &Path, name: &'static str) -> Result<u32, ReuseError> {
    aya::programs::ProgramInfo::from_pin(pin)
        .map(|info| info.id())
        .map_err(|source| ReuseError::Program { name, source })
}

/// Opens the pinned programs under `pin_dir` and adopts the socket programs' cgroup links,
/// each checked to run the pinned program of its name.
pub fn open(pin_dir: &Path) -> Result<Reused, ReuseError> {
    let mut programs = PinnedPrograms::default();
    let mut links = Vec::with_capacity(program_names::ALL.len());
    for name in program_names::ALL {
        let pinned = program_id(&program_pin(pin_dir, name), name)?;
        let link_pin = pin_dir.join(format!("{name}{LINK_SUFFIX}"));
        let link_error = |source| ReuseError::Link { name, source };
        let linked = FdLink::from(PinnedLink::from_pin(&link_pin).map_err(link_error)?)
            .info()
            .map_err(link_error)?
            .program_id();
        if linked != pinned {
            return Err(ReuseError::Mismatch {
                name,
                linked,
                pinned,
            });
        }
        links.push(PinnedLink::from_pin(&link_pin).map_err(link_error)?);
        programs.ids.insert(name, pinned);
    }
    for name in [
        program_names::TC_EXTERNAL,
        program_names::TC_REPLY,
        program_names::TC_EGRESS,
    ] {
        let pin = program_pin(pin_dir, name);
        if !pin.exists() {
            continue;
        }
        let classifier = SchedClassifier::from_pin(&pin)
            .map_err(|source| ReuseError::Program { name, source })?;
        programs.ids.insert(name, program_id(&pin, name)?);
        programs.classifiers.insert(name, classifier);
    }
    let name = program_names::XDP_EXTERNAL;
    let pin = program_pin(pin_dir, name);
    if pin.exists() {
        let xdp = Xdp::from_pin(&pin, aya_obj::programs::XdpAttachType::Interface)
            .map_err(|source| ReuseError::Program { name, source })?;
        programs.ids.insert(name, program_id(&pin, name)?);
        programs.xdp = Some(xdp);
    }
    Ok(Reused { programs, links })
}

/// The kernel ids of the programs pinned under `<bpf_root>/kubeproxy-rs`, by name: what a
/// restart that reused them keeps (for tests and `inspect`).
pub fn pinned_program_ids(bpf_root: &Path) -> BTreeMap<String, u32> {
    let pin_dir = bpf_root.join(PIN_DIR_NAME);
    let Ok(entries) = std::fs::read_dir(&pin_dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let file = entry.file_name().to_string_lossy().into_owned();
            let name = file.strip_suffix(PROGRAM_SUFFIX)?.to_owned();
            let id = aya::programs::ProgramInfo::from_pin(entry.path())
                .ok()?
                .id();
            Some((name, id))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OBJECT: &[u8] = b"\x7fELF object";
    const RELEASE: &str = "6.8.0-45-generic";
    const OPTIONS: &str = "set_retval=1 frontends=65536";

    fn stamp() -> LoadStamp {
        LoadStamp::new(OBJECT, RELEASE, OPTIONS)
    }

    #[test]
    fn the_same_object_kernel_and_options_reuse_the_pins() {
        assert_eq!(decide(Some(&stamp()), Some(&stamp()), None, false), Ok(()));
    }

    #[test]
    fn any_difference_loads_and_says_which() {
        let current = stamp();
        let cases = [
            (
                LoadStamp::new(b"\x7fELF other", RELEASE, OPTIONS),
                LoadReason::Object,
            ),
            (
                LoadStamp::new(OBJECT, "6.8.0-46-generic", OPTIONS),
                LoadReason::Kernel,
            ),
            (
                LoadStamp::new(OBJECT, RELEASE, "set_retval=0 frontends=65536"),
                LoadReason::Options,
            ),
        ];
        for (recorded, reason) in cases {
            assert_eq!(
                decide(Some(&recorded), Some(&current), None, false),
                Err(reason)
            );
        }
    }

    #[test]
    fn no_stamp_an_unknown_kernel_a_missing_pin_or_a_replaced_map_load() {
        let current = stamp();
        assert_eq!(
            decide(None, Some(&current), None, false),
            Err(LoadReason::NoStamp)
        );
        assert_eq!(
            decide(Some(&current), None, None, false),
            Err(LoadReason::UnknownKernel)
        );
        assert_eq!(
            decide(
                Some(&current),
                Some(&current),
                Some("kpr_connect4_link"),
                false
            ),
            Err(LoadReason::MissingPin("kpr_connect4_link".to_owned()))
        );
        assert_eq!(
            decide(Some(&current), Some(&current), None, true),
            Err(LoadReason::MapsReplaced)
        );
    }

    #[test]
    fn each_part_of_the_stamp_hashes_only_its_own_input() {
        let a = stamp();
        let b = LoadStamp::new(OBJECT, RELEASE, "another option");
        assert_eq!(a.object, b.object);
        assert_eq!(a.kernel, b.kernel);
        assert_ne!(a.options, b.options);
        assert_eq!(a.object_short().len(), 16);
    }

    #[test]
    fn an_empty_pin_dir_misses_the_first_socket_program() {
        let dir = std::env::temp_dir().join(format!("kpr-reuse-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        assert_eq!(
            first_missing_pin(&dir),
            Some(format!("{}{PROGRAM_SUFFIX}", program_names::CONNECT4))
        );
        std::fs::remove_dir_all(&dir).expect("temp dir removed");
    }

    #[test]
    fn program_pins_are_never_taken_for_links() {
        for name in program_names::ALL {
            let pin = program_pin(Path::new("/x"), name);
            assert!(!pin.to_string_lossy().ends_with(LINK_SUFFIX));
        }
    }
}
