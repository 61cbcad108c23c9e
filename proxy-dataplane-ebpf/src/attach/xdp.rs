//! XDP on the external interfaces (`--bpf-xdp`): `kpr_xdp_external` translates the packets of
//! established fast-path flows in the driver and redirects them to interfaces in
//! `KPR_XDP_TARGETS`; everything else passes on to the tc programs (see `proxy-ebpf`'s
//! `xdp.rs` for what it takes and what it leaves).
//!
//! Which interfaces: the external ones (the tc side's roles), once their tc programs are in
//! place — XDP hands tc every packet it does not take. Native (driver) mode only: generic XDP
//! runs on the skb, after the allocation XDP is there to save, and tc already runs there. An
//! interface whose driver refuses native XDP, or that already runs another XDP program (the
//! kernel allows one; it is not ours to replace), keeps tc alone, with one log line.
//!
//! Links are pinned as `kpr_xdp_external_if<ifindex>_link`, so the program outlives the agent;
//! a new agent swaps its program into the pinned link atomically (`bpf_link_update`), never
//! leaving the interface without one (a driver that refuses the swap gets the old program
//! detached and the new one attached, tc alone in between).
//!
//! The programs are multi-buffer (`xdp.frags`): a driver takes them at any MTU it supports
//! (veth refuses a single-buffer program once the peer's MTU exceeds a page less its
//! headroom, about 3.5 kB), so jumbo-frame interfaces run XDP too. `KPR_XDP_TARGETS` (pinned too) lists the interfaces
//! with a link: only those are redirect targets.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use aya::{
    Ebpf,
    maps::{MapData, xdp::DevMapHash},
    programs::{
        Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
    },
};
use proxy_common::{map_names, program_names};
use tracing::{debug, info, warn};

use crate::{
    attach::pin_files::remove_if_present,
    attach::pins::{LINK_SUFFIX, pin_replacing},
    attach::reuse::pin_loaded,
    attach::tc_programs::{fill_program_array, load_in_parallel},
    error::EbpfError,
};

pub use proxy_model::config::ebpf_settings::XdpSetting;

/// The pin of the XDP link of interface `ifindex`.
pub fn link_pin_name(ifindex: u32) -> String {
    format!("{}_if{ifindex}{LINK_SUFFIX}", program_names::XDP_EXTERNAL)
}

/// The XDP links the agent holds and the redirect targets it wrote.
pub struct XdpState {
    setting: XdpSetting,
    targets: Option<DevMapHash<MapData>>,
    /// Pin name → (ifindex, interface name, link).
    links: BTreeMap<String, (u32, String, PinnedLink)>,
    /// Interfaces that refused the program (driver, or another XDP program): not retried
    /// until they leave the external set, and logged once.
    refused: BTreeSet<u32>,
    /// Whether the IPv6 new-flow program is loaded with the XDP program (else the idle one
    /// holds its slot): the tc programs' choice (`TcState::load_ipv6`).
    pub(crate) ipv6: bool,
}

impl std::fmt::Debug for XdpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpState")
            .field("setting", &self.setting)
            .field("links", &self.links.keys().collect::<Vec<_>>())
            .field("refused", &self.refused)
            .finish_non_exhaustive()
    }
}

impl XdpState {
    pub fn new(setting: XdpSetting, ebpf: &mut Ebpf) -> Self {
        let targets = match ebpf
            .take_map(map_names::XDP_TARGETS)
            .map(DevMapHash::try_from)
        {
            Some(Ok(map)) => Some(map),
            Some(Err(error)) => {
                warn!(%error, "cannot open the XDP target map; no XDP");
                None
            }
            None => {
                warn!("the eBPF object has no XDP target map; no XDP");
                None
            }
        };
        Self {
            setting,
            targets,
            links: BTreeMap::new(),
            refused: BTreeSet::new(),
            ipv6: true,
        }
    }

    /// The interfaces running the XDP program: (name, ifindex).
    pub fn attached(&self) -> impl Iterator<Item = (&str, u32)> {
        self.links
            .values()
            .map(|(index, name, _)| (name.as_str(), *index))
    }

    /// Attaches the program to the external interfaces `external` (name → ifindex) that do not
    /// have it, and detaches it from those that left the set. `fast_path`: whether the fast
    /// path is taken now (`--tc-fast-path`, or `auto` while the node has no forwarding policy).
    /// At start (`first`), pins of interfaces not attached again are removed.
    pub fn refresh(
        &mut self,
        ebpf: &mut Ebpf,
        mut pinned: Option<&mut Xdp>,
        pin_dir: &Path,
        external: &BTreeMap<String, u32>,
        fast_path: bool,
        first: bool,
    ) {
        let wanted: BTreeMap<String, (u32, &str)> =
            if self.setting.attaches(fast_path) && self.targets.is_some() {
                external
                    .iter()
                    .map(|(name, index)| (link_pin_name(*index), (*index, name.as_str())))
                    .collect()
            } else {
                BTreeMap::new()
            };
        self.refused
            .retain(|index| external.values().any(|i| i == index));
        for (pin_name, (index, name)) in &wanted {
            if self.links.contains_key(pin_name) || self.refused.contains(index) {
                continue;
            }
            match attach(
                ebpf,
                pinned.as_deref_mut(),
                self.ipv6,
                *index,
                pin_dir,
                pin_name,
            ) {
                Ok(link) => {
                    // No devmap program (`None`): one would run on the redirected frames, which
                    // can be multi-buffer, and would have to be `xdp.frags` as well.
                    if let Some(targets) = &mut self.targets
                        && let Err(error) = targets.insert(*index, *index, None, 0)
                    {
                        warn!(interface = %name, %error, "cannot add the interface to the XDP \
                            targets; XDP does not redirect to it");
                    }
                    info!(interface = %name, program = program_names::XDP_EXTERNAL, "XDP program attached (native)");
                    self.links
                        .insert(pin_name.clone(), (*index, (*name).to_owned(), link));
                }
                Err(error) => {
                    self.refused.insert(*index);
                    let message = "no XDP on this interface (driver without native XDP or \
                        without multi-buffer XDP at this MTU, or another XDP program there); its \
                        external traffic stays with tc";
                    if self.setting == XdpSetting::Native {
                        warn!(interface = %name, %error, "{message}");
                    } else {
                        info!(interface = %name, %error, "{message}");
                    }
                }
            }
        }
        let unwanted: Vec<String> = self
            .links
            .keys()
            .filter(|pin| !wanted.contains_key(*pin))
            .cloned()
            .collect();
        for pin in unwanted {
            self.detach(pin_dir, &pin);
        }
        if first {
            self.remove_stale_pins(pin_dir);
        }
    }

    /// Takes the interface out of the targets first (XDP then leaves its traffic to tc), then
    /// releases the pin, which detaches the program.
    fn detach(&mut self, pin_dir: &Path, pin: &str) {
        let Some((index, name, _)) = self.links.get(pin) else {
            return;
        };
        if let Some(targets) = &mut self.targets
            && let Err(error) = targets.remove(*index)
        {
            debug!(interface = %name, %error, "removing an XDP target");
        }
        if let Err(error) = remove_if_present(&pin_dir.join(pin)) {
            warn!(pin = %pin, %error, "cannot remove XDP link pin");
            return;
        }
        info!(interface = %name, "XDP program detached (interface gone, no longer external, XDP off, or the fast path left)");
        self.links.remove(pin);
    }

    /// Removes XDP link pins this run did not (re)create, and the targets of interfaces
    /// without a link.
    fn remove_stale_pins(&mut self, pin_dir: &Path) {
        if let Ok(entries) = std::fs::read_dir(pin_dir) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with(program_names::XDP_EXTERNAL)
                    && name.ends_with(LINK_SUFFIX)
                    && !self.links.contains_key(&name)
                {
                    match remove_if_present(&entry.path()) {
                        Ok(()) => info!(pin = %name, "XDP program of a previous run detached"),
                        Err(error) => {
                            warn!(pin = %name, %error, "cannot remove stale XDP link pin")
                        }
                    }
                }
            }
        }
        let ours: BTreeSet<u32> = self.links.values().map(|(index, _, _)| *index).collect();
        if let Some(targets) = &mut self.targets {
            let stale: Vec<u32> = targets
                .keys()
                .flatten()
                .filter(|index| !ours.contains(index))
                .collect();
            for index in stale {
                let _ = targets.remove(index);
            }
        }
    }
}

/// `kpr_xdp_external`, loaded, with the new-flow programs it tail-calls loaded first and
/// written into `KPR_XDP_NEW_FLOW` (which no earlier agent's program uses: writing it early
/// changes nothing that runs), and pinned in `pin_dir` (see `reuse`) — or the pinned one a
/// restart reuses (`pinned`), whose new-flow programs are already in the pinned array. Without
/// `ipv6`, the idle program takes the IPv6 slot (see `TcState::load_ipv6`).
pub(crate) fn loaded_program<'a>(
    ebpf: &'a mut Ebpf,
    pinned: Option<&'a mut Xdp>,
    ipv6: bool,
    pin_dir: &Path,
) -> Result<&'a mut Xdp, EbpfError> {
    if let Some(program) = pinned {
        return Ok(program);
    }
    let name = program_names::XDP_EXTERNAL;
    let program_error = |source| EbpfError::Program { name, source };
    let loaded = ebpf
        .program(name)
        .ok_or(EbpfError::MissingProgram(name))?
        .fd()
        .is_ok();
    if !loaded {
        let [new_flow4, new_flow6] = program_names::XDP_NEW_FLOW;
        let new_flow6 = if ipv6 {
            new_flow6
        } else {
            program_names::XDP_IDLE
        };
        load_in_parallel(ebpf, &[new_flow4, new_flow6, name])?;
        let slots = [(0, new_flow4), (1, new_flow6)];
        fill_program_array(ebpf, map_names::XDP_NEW_FLOW, &slots)?;
    }
    let program: &mut Xdp = ebpf
        .program_mut(name)
        .ok_or(EbpfError::MissingProgram(name))?
        .try_into()
        .map_err(program_error)?;
    if !loaded {
        pin_loaded(pin_dir, name, |path| program.pin(path));
    }
    Ok(program)
}

/// Attaches `kpr_xdp_external` (`pinned`, or loaded from the object) to interface `ifindex` in
/// native mode and pins the link as `pin_name`. A previous agent's pinned link there gets this
/// program swapped in atomically.
fn attach(
    ebpf: &mut Ebpf,
    pinned: Option<&mut Xdp>,
    ipv6: bool,
    ifindex: u32,
    pin_dir: &Path,
    pin_name: &str,
) -> Result<PinnedLink, EbpfError> {
    let name = program_names::XDP_EXTERNAL;
    let program_error = |source| EbpfError::Program { name, source };
    let link_error = |source| EbpfError::Link { name, source };
    let program = loaded_program(ebpf, pinned, ipv6, pin_dir)?;
    let pin = pin_dir.join(pin_name);
    if pin.exists() {
        // The previous agent's link: the interface keeps an XDP program throughout.
        let previous = PinnedLink::from_pin(&pin).map_err(link_error)?;
        let link = XdpLink::try_from(FdLink::from(previous)).map_err(link_error)?;
        match program.attach_to_link(link) {
            Ok(id) => {
                let link = program.take_link(id).map_err(program_error)?;
                let link = FdLink::try_from(link).map_err(link_error)?;
                return pin_replacing(link, name, &pin);
            }
            // A driver may refuse to swap programs in place, e.g. a single-buffer program of
            // an older build for this multi-buffer one where its receive rings depend on it
            // (veth swaps them). Detached and attached anew: tc alone carries the interface's
            // traffic in between, as it does without XDP. Detached explicitly: removing the
            // pin frees the link only after an RCU grace period, and the attach would find
            // the interface still taken (`EBUSY`).
            Err(error) => {
                info!(pin = %pin.display(), %error, "the previous XDP program cannot be \
                    replaced in place; detaching it and attaching this one");
                if let Err(error) = proxy_kernel::bpf::bpf_syscall::detach_pinned_link(&pin) {
                    debug!(pin = %pin.display(), %error, "detaching the previous XDP link");
                }
                remove_if_present(&pin).map_err(|source| EbpfError::PinDir {
                    path: pin.clone(),
                    source,
                })?;
            }
        }
    }
    let id = program
        .attach_to_if_index(ifindex, XdpMode::Driver)
        .map_err(program_error)?;
    let link = program.take_link(id).map_err(program_error)?;
    // A netlink attach (no XDP links in this kernel) cannot be pinned: detached when dropped.
    let link = FdLink::try_from(link).map_err(link_error)?;
    pin_replacing(link, name, &pin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setting_parses_every_value_and_names_the_bad_one() {
        for setting in [XdpSetting::Auto, XdpSetting::Native, XdpSetting::Off] {
            assert_eq!(setting.name().parse::<XdpSetting>(), Ok(setting));
        }
        assert_eq!(
            "generic".parse::<XdpSetting>(),
            Err("must be auto, native or off".to_owned())
        );
    }

    #[test]
    fn auto_attaches_only_on_the_fast_path() {
        assert!(XdpSetting::Auto.attaches(true));
        assert!(!XdpSetting::Auto.attaches(false));
        assert!(XdpSetting::Native.attaches(false));
        assert!(!XdpSetting::Off.attaches(true));
    }
}
