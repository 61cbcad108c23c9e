//! A BPF array map created with `BPF_F_MMAPABLE`, its values mapped into the agent's memory:
//! the agent changes single words of a large value with atomic stores, where an update through
//! bpf(2) copies the whole value each time (and a reader in the kernel could see a value
//! copied half-way).

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
    ptr::NonNull,
    sync::atomic::AtomicU64,
};

/// The values of an mmapable array map as 64-bit words, in index order.
#[derive(Debug)]
pub struct MappedArray {
    words: NonNull<AtomicU64>,
    len: usize,
    mapped_bytes: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through `AtomicU64`.
unsafe impl Send for MappedArray {}
// SAFETY: as above.
unsafe impl Sync for MappedArray {}

impl MappedArray {
    /// Maps the first `bytes` of the map's values (the kernel lays out an mmapable array's
    /// values back to back from offset 0, each rounded up to 8 bytes).
    pub fn map(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
            .map_err(|_| io::Error::other("no page size"))?;
        let mapped_bytes = bytes.div_ceil(page).max(1) * page;
        // SAFETY: a new shared mapping of the map's fd; the kernel refuses it (EINVAL/EPERM)
        // for a map that is not an mmapable array or is smaller than asked for.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let words = NonNull::new(at.cast::<AtomicU64>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(Self {
            words,
            len: bytes / 8,
            mapped_bytes,
        })
    }

    /// The mapped words (page-aligned, so every word is aligned).
    pub fn words(&self) -> &[AtomicU64] {
        // SAFETY: `len` words lie within the live mapping, which lasts as long as `self`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr(), self.len) }
    }
}

impl Drop for MappedArray {
    fn drop(&mut self) {
        // SAFETY: the mapping `map` made; nothing borrows it past `self`.
        unsafe {
            libc::munmap(self.words.as_ptr().cast(), self.mapped_bytes);
        }
    }
}
