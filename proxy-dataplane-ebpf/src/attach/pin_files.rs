//! A pin is a file in bpffs: removing one unpins its map, program or link, and one already gone
//! (another agent's cleanup, an operator) is what the caller wanted anyway.

use std::{io, path::Path};

pub(crate) fn remove_if_present(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(error),
        _ => Ok(()),
    }
}
