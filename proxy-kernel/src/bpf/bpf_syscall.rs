//! The few `bpf(2)` commands aya 0.14 does not expose the way we need them:
//! `BPF_PROG_TEST_RUN` with `flags` (aya's `TestRunAttrs` only sets the XDP live-frames flag,
//! and `BPF_F_TEST_SKB_CHECKSUM_COMPLETE` is how a test gets a `CHECKSUM_COMPLETE` skb), and
//! `BPF_PROG_LOAD` of a handful of raw instructions for feature probes that must call a helper
//! with arguments the verifier cannot judge (flag bits are checked only when the helper runs),
//! `BPF_MAP_LOOKUP_ELEM` of a program array's slot (the program id; aya only writes them),
//! and `BPF_LINK_DETACH` of a pinned link (aya's links detach when their last reference goes,
//! which for a pin is its removal, and bpffs releases it after an RCU grace period).
//!
//! The attribute layouts are the kernel's `union bpf_attr`
//! (<https://github.com/torvalds/linux/blob/master/include/uapi/linux/bpf.h>); the kernel
//! accepts a prefix of the union and requires the bytes it does not know to be zero, so the
//! buffers here are zero-filled and only as long as the fields used.

use std::{
    io,
    os::fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    time::Duration,
};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_DETACH: libc::c_long = 34;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;

/// `BPF_F_TEST_SKB_CHECKSUM_COMPLETE` (kernel 6.17): the skb gets `CHECKSUM_COMPLETE` with
/// `skb->csum` computed over the packet, and after the run the kernel checks that the program
/// kept `skb->csum` true to the packet (`EBADMSG` otherwise) — exactly what a NIC delivering
/// `CHECKSUM_COMPLETE` would later verify and log as "hw csum failure".
pub const TEST_SKB_CHECKSUM_COMPLETE: u32 = 1 << 2;

/// `bpf(cmd, attr, size_of_val(attr))`.
///
/// # Safety
/// `attr` is the `union bpf_attr` prefix `cmd` takes, every byte the caller does not set is
/// zero, and every pointer in it points to memory valid for what the kernel reads or writes
/// there (sizes as the attribute states them), alive across the call.
pub unsafe fn sys_bpf<T: ?Sized>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    let size = std::mem::size_of_val(attr);
    // SAFETY: as the caller guarantees; `size` is exactly the attribute's size.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr).cast::<u8>(),
            size,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn put_u32(attr: &mut [u8], offset: usize, value: u32) {
    attr[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
}

fn put_ptr(attr: &mut [u8], offset: usize, ptr: *const u8) {
    attr[offset..offset + 8].copy_from_slice(&(ptr as u64).to_ne_bytes());
}

fn get_u32(attr: &[u8], offset: usize) -> u32 {
    u32::from_ne_bytes([
        attr[offset],
        attr[offset + 1],
        attr[offset + 2],
        attr[offset + 3],
    ])
}

/// Loads a `BPF_PROG_TYPE_SCHED_CLS` program from raw instructions (GPL, no BTF).
pub fn load_sched_cls(insns: &[u64]) -> io::Result<OwnedFd> {
    let count = u32::try_from(insns.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too many instructions"))?;
    let license = c"GPL";
    // prog_type, insn_cnt, insns, license.
    let mut attr = [0u8; 24];
    put_u32(&mut attr, 0, BPF_PROG_TYPE_SCHED_CLS);
    put_u32(&mut attr, 4, count);
    put_ptr(&mut attr, 8, insns.as_ptr().cast());
    put_ptr(&mut attr, 16, license.as_ptr().cast());
    // SAFETY: a zero-filled prefix with `insns` (`count` instructions) and `license`, both
    // alive until the call returns.
    let fd = unsafe { sys_bpf(BPF_PROG_LOAD, &mut attr)? };
    let fd = i32::try_from(fd).map_err(|_| io::Error::other(format!("bpf fd {fd}")))?;
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The id of the program in slot `index` of the program array `map`; `None` when the slot is
/// empty. aya's `ProgramArray` only sets and clears slots; a lookup from user space returns the
/// program's id (the kernel's `prog_fd_array_sys_lookup_elem`).
pub fn program_array_slot(map: BorrowedFd<'_>, index: u32) -> io::Result<Option<u32>> {
    let key = index;
    let mut id = 0u32;
    // map_fd, (pad), key, value, flags.
    let mut attr = [0u8; 32];
    put_u32(&mut attr, 0, map.as_raw_fd() as u32);
    put_ptr(&mut attr, 8, std::ptr::from_ref(&key).cast());
    put_ptr(
        &mut attr,
        16,
        std::ptr::from_mut(&mut id).cast_const().cast(),
    );
    // SAFETY: a zero-filled prefix with the map's fd (open across the call), a 4-byte key and
    // a 4-byte value, both alive until the call returns: a program array's key and value size.
    match unsafe { sys_bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) } {
        Ok(_) => Ok(Some(id)),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Detaches the link pinned at `pin` now (`BPF_LINK_DETACH`): its program leaves the hook at
/// once, while the link object lives on until its pin and fds go. Removing the pin alone
/// detaches it only once bpffs frees the inode, after an RCU grace period: an attach to the
/// same hook right after it can still find the hook taken (`EBUSY`).
pub fn detach_pinned_link(pin: &std::path::Path) -> io::Result<()> {
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes())?;
    // pathname, bpf_fd, file_flags.
    let mut attr = [0u8; 16];
    put_ptr(&mut attr, 0, path.as_ptr().cast());
    // SAFETY: a zero-filled prefix with `path`, alive until the call returns.
    let fd = unsafe { sys_bpf(BPF_OBJ_GET, &mut attr)? };
    let fd = i32::try_from(fd).map_err(|_| io::Error::other(format!("bpf fd {fd}")))?;
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    let link = unsafe { OwnedFd::from_raw_fd(fd) };
    // link_fd.
    let mut attr = [0u8; 4];
    put_u32(&mut attr, 0, link.as_raw_fd() as u32);
    // SAFETY: a prefix holding only the link's fd, open across the call.
    unsafe { sys_bpf(BPF_LINK_DETACH, &mut attr)? };
    Ok(())
}

/// What one `BPF_PROG_TEST_RUN` of a tc program takes.
#[derive(Debug, Default)]
pub struct SkbTestRun<'a> {
    pub data_in: &'a [u8],
    pub ctx_in: &'a [u8],
    pub repeat: u32,
    /// `BPF_F_TEST_*` flags.
    pub flags: u32,
}

/// What it returns.
#[derive(Debug)]
pub struct SkbTestRunOutput {
    pub retval: u32,
    pub data_size_out: usize,
    pub duration: Duration,
}

/// Runs `program` once (or `repeat` times) on `run.data_in`; the packet and `struct
/// __sk_buff` the program left are written to `data_out` / `ctx_out`.
pub fn test_run_skb(
    program: BorrowedFd<'_>,
    run: &SkbTestRun<'_>,
    data_out: &mut [u8],
    ctx_out: &mut [u8],
) -> io::Result<SkbTestRunOutput> {
    let len = |buf: usize| {
        u32::try_from(buf).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "buffer size"))
    };
    let prog_fd = u32::try_from(program.as_fd().as_raw_fd())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "program fd"))?;
    // prog_fd, retval, data_size_in, data_size_out, data_in, data_out, repeat, duration,
    // ctx_size_in, ctx_size_out, ctx_in, ctx_out, flags.
    let mut attr = [0u8; 72];
    put_u32(&mut attr, 0, prog_fd);
    put_u32(&mut attr, 8, len(run.data_in.len())?);
    put_u32(&mut attr, 12, len(data_out.len())?);
    put_ptr(&mut attr, 16, run.data_in.as_ptr());
    put_ptr(&mut attr, 24, data_out.as_mut_ptr());
    put_u32(&mut attr, 32, run.repeat.max(1));
    if !run.ctx_in.is_empty() {
        put_u32(&mut attr, 40, len(run.ctx_in.len())?);
        put_ptr(&mut attr, 48, run.ctx_in.as_ptr());
    }
    if !ctx_out.is_empty() {
        put_u32(&mut attr, 44, len(ctx_out.len())?);
        put_ptr(&mut attr, 56, ctx_out.as_mut_ptr());
    }
    put_u32(&mut attr, 64, run.flags);
    // SAFETY: a zero-filled prefix whose data and context pointers come from the slices
    // above with their lengths, all borrowed across the call.
    unsafe { sys_bpf(BPF_PROG_TEST_RUN, &mut attr)? };
    Ok(SkbTestRunOutput {
        retval: get_u32(&attr, 4),
        data_size_out: get_u32(&attr, 12) as usize,
        duration: Duration::from_nanos(u64::from(get_u32(&attr, 36))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `mov64 r0, 7; exit`: the layouts above agree with the kernel (needs root).
    #[test]
    fn a_raw_program_loads_and_runs() {
        let program = load_sched_cls(&[0x0000_0007_0000_00b7, 0x95]).expect("load");
        let packet = [0u8; 64];
        let mut out = [0u8; 128];
        let run = SkbTestRun {
            data_in: &packet,
            ..SkbTestRun::default()
        };
        let result = test_run_skb(program.as_fd(), &run, &mut out, &mut []).expect("run");
        assert_eq!(result.retval, 7);
        assert_eq!(result.data_size_out, packet.len());
    }
}
