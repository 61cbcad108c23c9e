//! A "foreign" TCX program, standing in for another component's (a CNI's, a monitoring
//! agent's) on the same interface: it sets the bits of [`FOREIGN_MARK`] in the mark of every
//! packet it sees and passes it on with `TCX_NEXT`, so an nft counter on those bits counts what
//! it saw. Loaded and attached with the raw `bpf(2)` syscall (aya only loads programs from an
//! ELF object), as a link appended to the interface's ingress chain — behind whatever is
//! already attached.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::Path;

use crate::{Result, RigError};

/// The mark bits the foreign program sets, leaving the others as they are — as a CNI does
/// within its own mask (these are in Calico's default 0xffff0000). Clear of kube-proxy's
/// masquerade and drop bits (0x4000, 0x8000) and of the bit our ingress programs hand to egress
/// (0x1000): a program that set those would have the iptables rules masquerade every packet it
/// touched, and ours finish translations they never started.
pub const FOREIGN_MARK: u32 = 0x00c0_0000;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
/// `enum bpf_attach_type`: BPF_TCX_INGRESS.
const BPF_TCX_INGRESS: u32 = 46;
/// BPF_TCX_EGRESS.
const BPF_TCX_EGRESS: u32 = 47;

/// The attached program; dropping it closes the link fd, which detaches it.
#[derive(Debug)]
pub struct ForeignTcx {
    _prog: OwnedFd,
    _link: OwnedFd,
}

fn bpf(cmd: libc::c_long, attr: &mut [u8], what: &str) -> Result<OwnedFd> {
    // SAFETY: attr is a valid bpf_attr prefix of the given size whose pointers outlive the
    // call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if fd < 0 {
        return Err(RigError::io(what, std::io::Error::last_os_error()));
    }
    let fd = i32::try_from(fd).map_err(|_| RigError::Other(format!("{what}: fd {fd}")))?;
    // SAFETY: the kernel just returned this fd to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl ForeignTcx {
    /// Attaches the program to `interface`'s ingress in network namespace `netns` (the link
    /// is made on a thread that entered it; the fds stay valid in the whole process).
    pub fn attach(netns: &Path, interface: &str) -> Result<Self> {
        Self::attach_program(netns, interface, BPF_TCX_INGRESS, load_marking_program)
    }

    /// A NIC's hardware VLAN offload, as seen by the receiver: a program on `interface`'s
    /// egress that gives every packet the out-of-band VLAN tag `vid` (`bpf_skb_vlan_push`
    /// keeps it in `skb->vlan_tci`; veth carries it across as it is), so the peer's tc
    /// programs see `vlan_present` with an untagged frame — what a NIC that strips tags hands
    /// the stack. ARP goes tagged too: the test sets static neighbours.
    pub fn attach_vlan_tagger(netns: &Path, interface: &str, vid: u16) -> Result<Self> {
        Self::attach_program(netns, interface, BPF_TCX_EGRESS, move || {
            load_vlan_tagging_program(vid)
        })
    }

    fn attach_program(
        netns: &Path,
        interface: &str,
        attach_type: u32,
        load: impl FnOnce() -> Result<OwnedFd> + Send + 'static,
    ) -> Result<Self> {
        let interface = interface.to_owned();
        crate::netns::on_thread_in(netns, move || -> Result<Self> {
            let ifindex = nix::net::if_::if_nametoindex(interface.as_str())
                .map_err(|e| RigError::Other(format!("{interface}: {e}")))?;
            let prog = load()?;
            // BPF_LINK_CREATE: prog_fd, target_ifindex, attach_type, flags (0: append).
            let mut attr = [0u8; 64];
            let prog_fd = u32::try_from(prog.as_raw_fd()).unwrap_or(0);
            attr[0..4].copy_from_slice(&prog_fd.to_ne_bytes());
            attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
            attr[8..12].copy_from_slice(&attach_type.to_ne_bytes());
            let link = bpf(
                BPF_LINK_CREATE,
                &mut attr,
                "attaching the foreign tc program",
            )?;
            Ok(Self {
                _prog: prog,
                _link: link,
            })
        })?
    }
}

/// The VLAN tagger: `bpf_skb_vlan_push(skb, 802.1Q, vid)`, then `TC_ACT_UNSPEC` (TCX_NEXT).
fn load_vlan_tagging_program(vid: u16) -> Result<OwnedFd> {
    const BPF_FUNC_SKB_VLAN_PUSH: u64 = 18;
    // ETH_P_8021Q in network byte order, as the helper takes it.
    let proto = u64::from(0x8100u16.to_be());
    let insns: [u64; 5] = [
        // mov64 r2, proto; mov64 r3, vid (r1 is still the skb); call; mov64 r0, -1; exit.
        0x02b7 | (proto << 32),
        0x03b7 | (u64::from(vid) << 32),
        0x85 | (BPF_FUNC_SKB_VLAN_PUSH << 32),
        u64::from_le_bytes([0xb7, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
        0x95,
    ];
    load_program(&insns, "loading the VLAN tagging program")
}

/// The program: sets [`FOREIGN_MARK`]'s bits in the packet's mark and returns `TC_ACT_UNSPEC`
/// (TCX_NEXT; for a legacy filter: "no verdict", the next filter runs).
fn load_marking_program() -> Result<OwnedFd> {
    let mark = FOREIGN_MARK.to_le_bytes();
    let insns: [u64; 5] = [
        // ldxw r2, [r1 + 8] (__sk_buff.mark): BPF_LDX | BPF_MEM | BPF_W, src r1, dst r2.
        u64::from_le_bytes([0x61, 0x12, 8, 0, 0, 0, 0, 0]),
        // or32 r2, FOREIGN_MARK: BPF_ALU | BPF_OR | BPF_K.
        u64::from_le_bytes([0x44, 0x02, 0, 0, mark[0], mark[1], mark[2], mark[3]]),
        // stxw [r1 + 8], r2: BPF_STX | BPF_MEM | BPF_W, src r2, dst r1.
        u64::from_le_bytes([0x63, 0x21, 8, 0, 0, 0, 0, 0]),
        // mov64 r0, -1 (TC_ACT_UNSPEC); exit.
        u64::from_le_bytes([0xb7, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
        0x95,
    ];
    load_program(&insns, "loading the foreign tc program")
}

fn load_program(insns: &[u64], what: &str) -> Result<OwnedFd> {
    let count = u32::try_from(insns.len()).unwrap_or(u32::MAX);
    let license = c"GPL";
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&count.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    bpf(BPF_PROG_LOAD, &mut attr, what)
}

const BPF_OBJ_PIN: libc::c_long = 6;

/// The same marking program as a legacy `cls_bpf` filter (direct action) of another
/// component, added with `tc(8)` at `priority` of `interface`'s ingress in network namespace
/// `netns`; the netns going away removes it.
#[derive(Debug)]
pub struct ForeignLegacyFilter {
    pub priority: u16,
}

impl ForeignLegacyFilter {
    pub fn attach(netns: &crate::netns::Netns, interface: &str, priority: u16) -> Result<Self> {
        // tc takes a pinned program: pin it in a bpffs of our own, which goes away after.
        let root = crate::agent::TempBpfRoot::new()?;
        let mounted = std::process::Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(root.path())
            .status()
            .map_err(|e| RigError::io("mounting a bpffs", e))?;
        if !mounted.success() {
            return Err(RigError::Other(format!("mount -t bpf: {mounted}")));
        }
        let prog = load_marking_program()?;
        let pin = root.path().join("foreign_prog");
        let pin_c = std::ffi::CString::new(pin.to_string_lossy().as_bytes())
            .map_err(|e| RigError::Other(format!("pin path: {e}")))?;
        let mut attr = [0u8; 16];
        attr[0..8].copy_from_slice(&(pin_c.as_ptr() as u64).to_ne_bytes());
        let prog_fd = u32::try_from(prog.as_raw_fd()).unwrap_or(0);
        attr[8..12].copy_from_slice(&prog_fd.to_ne_bytes());
        // BPF_OBJ_PIN returns 0, not an fd: call it directly.
        // SAFETY: attr is a valid bpf_attr prefix whose pointer outlives the call.
        let ret =
            unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, attr.as_mut_ptr(), attr.len()) };
        if ret != 0 {
            return Err(RigError::io(
                "pinning the foreign program",
                std::io::Error::last_os_error(),
            ));
        }
        // Present already when another filter (ours) made it; tc then says so, harmlessly.
        let _ = netns.exec("tc", &["qdisc", "add", "dev", interface, "clsact"]);
        let pin_arg = pin.to_string_lossy().into_owned();
        netns.exec(
            "tc",
            &[
                "filter",
                "add",
                "dev",
                interface,
                "ingress",
                "prio",
                &priority.to_string(),
                "handle",
                "1",
                "bpf",
                "direct-action",
                "object-pinned",
                &pin_arg,
            ],
        )?;
        Ok(Self { priority })
    }
}
