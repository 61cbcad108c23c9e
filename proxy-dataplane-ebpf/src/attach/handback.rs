//! Handing a node back from the eBPF mode to the iptables mode without cutting connections.
//!
//! The eBPF mode's external flows live in its own conntrack (`KPR_CT`): the kernel's conntrack
//! saw them only after our DNAT, so once our programs are gone the next segment of such a
//! connection arrives addressed to the NodePort again, meets the iptables rules as a new flow,
//! goes to a random backend with a new SNAT port, and is reset. So the iptables mode keeps the
//! eBPF mode's programs and maps for a while instead of removing them at its first sync: it
//! sets `node_flags::DRAINING`, under which they translate only the flows they already carry
//! (and their replies) and start none — every new connection meets the iptables rules — and
//! removes them once no flow of theirs is live (`ct_timeout`, as the garbage collection
//! judges), at the latest after `--mode-switch-drain-period`. Socket-level ClusterIP
//! connections need nothing: their sockets are connected to the backend itself.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use aya::maps::{Array, Map, MapData};
use proxy_common::{NodeConfig, ct_flags, ct_timeout, map_names, node_flags};
use tracing::{info, warn};

use crate::{
    attach::pins::PIN_DIR_NAME, conntrack::ct_maps::ConntrackMaps,
    conntrack::tc_conntrack::monotonic_ns, error::EbpfError,
};

/// How often a drain looks for live flows.
const POLL: Duration = Duration::from_secs(1);

fn open(bpf_root: &Path, name: &'static str) -> Result<Map, EbpfError> {
    let path = bpf_root.join(PIN_DIR_NAME).join(name);
    let data = MapData::from_pin(&path).map_err(|source| EbpfError::Map { name, source })?;
    Map::from_map_data(data).map_err(|source| EbpfError::Map { name, source })
}

/// Puts the pinned eBPF datapath under `bpf_root` into draining; false if there is none.
pub fn start_drain(bpf_root: &Path) -> Result<bool, EbpfError> {
    let name = map_names::NODE_CONFIG;
    if !bpf_root.join(PIN_DIR_NAME).join(name).exists() {
        return Ok(false);
    }
    let mut config: Array<MapData, NodeConfig> = open(bpf_root, name)?
        .try_into()
        .map_err(|source| EbpfError::Map { name, source })?;
    let mut value = config
        .get(&0, 0)
        .map_err(|source| EbpfError::Map { name, source })?;
    value.flags |= node_flags::DRAINING;
    config
        .set(0, value, 0)
        .map_err(|source| EbpfError::Map { name, source })?;
    Ok(true)
}

/// Forward entries of flows that are still live at `now` (reply and egress entries follow
/// their forward entry).
pub fn live_flows(bpf_root: &Path, now: u64) -> Result<usize, EbpfError> {
    let ct = ConntrackMaps::open_pinned(&bpf_root.join(PIN_DIR_NAME))?;
    Ok(ct
        .entries()
        .iter()
        .filter(|(key, value)| {
            value.flags & (ct_flags::REPLY | ct_flags::EGRESS) == 0
                && !ct_timeout::expired(key.proto, value.flags, value.last_seen_ns, now)
        })
        .count())
}

/// Drains the eBPF datapath under `bpf_root` (already [`start_drain`]ed) and removes it when
/// no flow is live or `period` is over, on a thread of its own; then runs `after`.
pub fn finish_in_background(
    bpf_root: &Path,
    period: Duration,
    after: impl FnOnce() + Send + 'static,
) {
    let root = bpf_root.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("ebpf-drain".into())
        .spawn(move || {
            let bpf_root = root;
            let started = Instant::now();
            loop {
                let live = monotonic_ns()
                    .map_err(|e| e.to_string())
                    .and_then(|now| live_flows(&bpf_root, now).map_err(|e| e.to_string()));
                let over = started.elapsed() >= period;
                match live {
                    Ok(0) => info!(
                        after = ?started.elapsed(),
                        "the eBPF mode's flows have drained: removing its programs and maps"
                    ),
                    Ok(live) if over => warn!(
                        live,
                        ?period,
                        "--mode-switch-drain-period is over: removing the eBPF mode's programs \
                         and maps, cutting its remaining flows"
                    ),
                    Ok(_) => {
                        std::thread::sleep(POLL);
                        continue;
                    }
                    Err(error) => warn!(
                        %error,
                        "cannot read the eBPF mode's conntrack: removing its programs and maps"
                    ),
                }
                match crate::cleanup(&bpf_root) {
                    Ok(removed) => info!(removed, "removed the eBPF mode's pins and links"),
                    Err(error) => warn!(%error, "removing eBPF-mode leftovers"),
                }
                after();
                return;
            }
        });
    if let Err(error) = spawned {
        warn!(%error, "cannot start the eBPF drain: removing its programs and maps now");
        if let Err(error) = crate::cleanup(bpf_root) {
            warn!(%error, "removing eBPF-mode leftovers");
        }
    }
}
