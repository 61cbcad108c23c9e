//! Loading the tc programs. Each entry program the agent attaches (`kpr_tc_external`,
//! `kpr_tc_reply`, `kpr_tc_egress`) only hands a packet to the program of its family through
//! the pinned program array `KPR_TC_FAMILY` (see `proxy-ebpf`'s `tc::family`): loading an entry
//! program loads those and writes them into the array first. The array is shared with the
//! previous agent's entry programs, so writing it is what switches the running datapath to this
//! agent's programs: it happens when the agent attaches (after the first sync where maps were
//! rebuilt), never earlier.

use aya::{
    Ebpf,
    maps::ProgramArray,
    programs::{ProgramFd, SchedClassifier},
};
use proxy_common::{TcFamilyProgram, map_names};

use super::error::EbpfError;

/// `program`, loaded (with the programs of each family it hands packets to, and those written
/// into `KPR_TC_FAMILY`).
pub fn loaded_classifier<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut SchedClassifier, EbpfError> {
    if classifier(ebpf, program)?.fd().is_err() {
        fill_family_programs(ebpf)?;
    }
    let classifier = classifier(ebpf, program)?;
    if classifier.fd().is_err() {
        classifier.load().map_err(|source| EbpfError::Program {
            name: program,
            source,
        })?;
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

/// Loads every family program not loaded yet and writes each into its slot.
fn fill_family_programs(ebpf: &mut Ebpf) -> Result<(), EbpfError> {
    let mut fds: Vec<(TcFamilyProgram, ProgramFd)> = Vec::with_capacity(TcFamilyProgram::ALL.len());
    for slot in TcFamilyProgram::ALL {
        let name = slot.program();
        let program_error = |source| EbpfError::Program { name, source };
        let classifier = classifier(ebpf, name)?;
        if classifier.fd().is_err() {
            classifier.load().map_err(program_error)?;
        }
        let fd = classifier
            .fd()
            .map_err(program_error)?
            .try_clone()
            .map_err(|e| program_error(e.into()))?;
        fds.push((slot, fd));
    }
    let map_error = |source| EbpfError::Map {
        name: map_names::TC_FAMILY,
        source,
    };
    let mut array = ProgramArray::try_from(
        ebpf.map_mut(map_names::TC_FAMILY)
            .ok_or(EbpfError::MissingMap(map_names::TC_FAMILY))?,
    )
    .map_err(map_error)?;
    for (slot, fd) in &fds {
        array.set(*slot as u32, fd, 0).map_err(map_error)?;
    }
    Ok(())
}
