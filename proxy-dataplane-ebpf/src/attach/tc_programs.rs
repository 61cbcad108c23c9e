//! Loading the tc programs. Each entry program the agent attaches (`kpr_tc_external`,
//! `kpr_tc_reply`, `kpr_tc_egress`) only hands a packet to the program of its family through
//! the pinned program array `KPR_TC_FAMILY` (see `proxy-ebpf`'s `tc::family`): loading an entry
//! program loads those and writes them into the array first, after the programs of later IP
//! fragments the family programs tail-call through `KPR_TC_FRAGMENT`. The array is shared with
//! the previous agent's entry programs, so writing it is what switches the running datapath to
//! this agent's programs: it happens when the agent attaches (after the first sync where maps
//! were rebuilt), never earlier.

use std::path::Path;

use aya::{
    Ebpf,
    maps::ProgramArray,
    programs::{Program, ProgramError, ProgramFd, SchedClassifier},
};
use std::os::fd::AsFd as _;

use proxy_common::{TcFamilyProgram, TcFragmentProgram, map_names, program_names};

use crate::{
    attach::reuse::{self, PinnedPrograms},
    error::EbpfError,
};

/// `program`, loaded (with the programs of each family it hands packets to, and those written
/// into `KPR_TC_FAMILY`; without `ipv6` the idle program stands in for the IPv6 ones) and
/// pinned as `<program>_prog` in `pin_dir` (see `reuse`) — or, when the start reuses the
/// pinned programs (`pinned`), the pinned one: no load, no verifier.
pub fn loaded_classifier<'a>(
    ebpf: &'a mut Ebpf,
    pinned: Option<&'a mut PinnedPrograms>,
    ipv6: bool,
    program: &'static str,
    pin_dir: &Path,
) -> Result<&'a mut SchedClassifier, EbpfError> {
    if let Some(classifier) = pinned.and_then(|p| p.classifiers.get_mut(program)) {
        return Ok(classifier);
    }
    if classifier(ebpf, program)?.fd().is_err() {
        fill_family_programs(ebpf, ipv6)?;
    }
    let classifier = classifier(ebpf, program)?;
    if classifier.fd().is_err() {
        classifier.load().map_err(|source| EbpfError::Program {
            name: program,
            source,
        })?;
        reuse::pin_loaded(pin_dir, program, |path| classifier.pin(path));
    }
    Ok(classifier)
}

fn classifier<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut SchedClassifier, EbpfError> {
    ebpf.program_mut(program)
        .ok_or(EbpfError::MissingProgram(program))?
        .try_into()
        .map_err(|source| EbpfError::Program {
            name: program,
            source,
        })
}

/// Loads every family program and every fragment program not loaded yet and writes each into
/// its slot: the fragment programs first, which the family programs tail-call. Without `ipv6`
/// the IPv6 family slots get `kpr_tc_idle` and the IPv6 fragment programs are not loaded (only
/// the IPv6 family programs hand packets to them).
fn fill_family_programs(ebpf: &mut Ebpf, ipv6: bool) -> Result<(), EbpfError> {
    let fragment: Vec<(u32, &'static str)> = TcFragmentProgram::ALL
        .into_iter()
        .filter(|slot| ipv6 || !slot.ipv6())
        .map(|slot| (slot as u32, slot.program()))
        .collect();
    let family = TcFamilyProgram::ALL.map(|slot| {
        let program = if ipv6 || !slot.ipv6() {
            slot.program()
        } else {
            program_names::TC_IDLE
        };
        (slot as u32, program)
    });
    let names: Vec<&'static str> = fragment
        .iter()
        .chain(&family)
        .map(|&(_, name)| name)
        .collect();
    load_in_parallel(ebpf, &names)?;
    fill_program_array(ebpf, map_names::TC_FRAGMENT, &fragment)?;
    fill_program_array(ebpf, map_names::TC_FAMILY, &family)
}

/// Loads the IPv6 family and fragment programs not loaded yet (and with `xdp` the IPv6 XDP
/// new-flow program); with `write`, puts each into its slot, in place of the idle program: the
/// fragment programs first, which the family programs tail-call.
pub(crate) fn load_ipv6(ebpf: &mut Ebpf, xdp: bool, write: bool) -> Result<(), EbpfError> {
    let fragment: Vec<(u32, &'static str)> = TcFragmentProgram::ALL
        .into_iter()
        .filter(|slot| slot.ipv6())
        .map(|slot| (slot as u32, slot.program()))
        .collect();
    let family: Vec<(u32, &'static str)> = TcFamilyProgram::ALL
        .into_iter()
        .filter(|slot| slot.ipv6())
        .map(|slot| (slot as u32, slot.program()))
        .collect();
    let new_flow = [(1, program_names::XDP_NEW_FLOW[1])];
    let new_flow = if xdp { &new_flow[..] } else { &[] };
    let names: Vec<&'static str> = fragment
        .iter()
        .chain(&family)
        .chain(new_flow)
        .map(|&(_, name)| name)
        .collect();
    let started = std::time::Instant::now();
    load_in_parallel(ebpf, &names)?;
    tracing::info!(
        elapsed_ms = started.elapsed().as_millis(),
        xdp,
        "IPv6 tc programs loaded for the node's first IPv6 Service"
    );
    if write {
        fill_program_array(ebpf, map_names::TC_FRAGMENT, &fragment)?;
        fill_program_array(ebpf, map_names::TC_FAMILY, &family)?;
        fill_program_array(ebpf, map_names::XDP_NEW_FLOW, new_flow)?;
    }
    Ok(())
}

/// Whether the IPv6 slots of the pinned `KPR_TC_FAMILY` hold the IPv6 programs (a previous
/// agent loaded them), rather than the idle program or nothing. `None`: the array cannot be
/// read.
pub(crate) fn ipv6_in_slots(ebpf: &Ebpf) -> Option<bool> {
    let map = ebpf.map(map_names::TC_FAMILY)?;
    let aya::maps::Map::ProgramArray(data) = map else {
        return None;
    };
    let slot = TcFamilyProgram::External6 as u32;
    let id = match proxy_kernel::bpf::bpf_syscall::program_array_slot(data.fd().as_fd(), slot) {
        Ok(Some(id)) => id,
        Ok(None) => return Some(false),
        Err(error) => {
            tracing::debug!(%error, "cannot read the IPv6 family slot");
            return None;
        }
    };
    let name = aya::programs::loaded_programs()
        .flatten()
        .find(|info| info.id() == id)?
        .name_as_str()
        .map(str::to_owned)?;
    // The kernel keeps the first 15 bytes of a name: `kpr_tc_idle` whole.
    Some(name != program_names::TC_IDLE)
}

/// Loads the programs `names` not loaded yet (classifiers, or XDP programs), each on a thread
/// of its own. The kernel verifies the family programs (each thousands of instructions over
/// many paths) in seconds each, one core each and without a lock between loads: one after the
/// other they were most of the agent's cold start on a small node.
pub(crate) fn load_in_parallel(ebpf: &mut Ebpf, names: &[&'static str]) -> Result<(), EbpfError> {
    let mut pending: Vec<(&'static str, &mut Program)> = Vec::with_capacity(names.len());
    for (name, program) in ebpf.programs_mut() {
        let Some(&name) = names.iter().find(|&&wanted| wanted == name) else {
            continue;
        };
        if program.fd().is_err() {
            pending.push((name, program));
        }
    }
    std::thread::scope(|scope| {
        let loads: Vec<_> = pending
            .into_iter()
            .map(|(name, program)| {
                scope.spawn(move || {
                    let started = std::time::Instant::now();
                    let loaded = match program {
                        Program::SchedClassifier(classifier) => classifier.load(),
                        Program::Xdp(xdp) => xdp.load(),
                        _ => Err(ProgramError::UnexpectedProgramType),
                    };
                    // The instructions the verifier walked (every path, each state it kept):
                    // what its time follows, unlike the program's length.
                    let verified = program
                        .info()
                        .ok()
                        .and_then(|info| info.verified_instruction_count());
                    tracing::debug!(
                        program = name,
                        elapsed_ms = started.elapsed().as_millis(),
                        verified_instructions = verified,
                        "program loaded (verified by the kernel)"
                    );
                    loaded.map_err(|source| EbpfError::Program { name, source })
                })
            })
            .collect();
        // Every load is waited for before the first error is returned.
        let results: Vec<_> = loads.into_iter().map(|load| load.join()).collect();
        for result in results {
            match result {
                Ok(loaded) => loaded?,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        Ok(())
    })
}

/// Writes each loaded program of `slots` (index, program) into its slot of the program array
/// `map` ([`load_in_parallel`] loads them first).
pub(crate) fn fill_program_array(
    ebpf: &mut Ebpf,
    map: &'static str,
    slots: &[(u32, &'static str)],
) -> Result<(), EbpfError> {
    let mut fds: Vec<(u32, ProgramFd)> = Vec::with_capacity(slots.len());
    for &(slot, name) in slots {
        let program_error = |source| EbpfError::Program { name, source };
        let fd = ebpf
            .program(name)
            .ok_or(EbpfError::MissingProgram(name))?
            .fd()
            .map_err(program_error)?
            .try_clone()
            .map_err(|e| program_error(e.into()))?;
        fds.push((slot, fd));
    }
    let map_error = |source| EbpfError::Map { name: map, source };
    let mut array = ProgramArray::try_from(ebpf.map_mut(map).ok_or(EbpfError::MissingMap(map))?)
        .map_err(map_error)?;
    for (slot, fd) in &fds {
        array.set(*slot, fd, 0).map_err(map_error)?;
    }
    Ok(())
}
