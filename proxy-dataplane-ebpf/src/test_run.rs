//! `BPF_PROG_TEST_RUN` of the tc and XDP programs against the live maps (tests and
//! benchmarks).

use std::os::fd::AsFd as _;

use proxy_common::{FragmentKey, map_names};

use crate::{
    attach::tc_programs::loaded_classifier, attach::xdp, dataplane::EbpfDataplane, error::EbpfError,
};
use proxy_kernel::bpf::bpf_syscall::{self, SkbTestRun};

/// One run of the XDP program with `BPF_PROG_TEST_RUN` ([`EbpfDataplane::test_run_xdp`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdpTestRun {
    /// The program's return value (`XDP_*`).
    pub action: u32,
    /// The packet after the program.
    pub packet: Vec<u8>,
}

/// One run of a tc program with `BPF_PROG_TEST_RUN` ([`EbpfDataplane::test_run_tc`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcTestRun {
    /// The program's return value (`TC_ACT_*`).
    pub action: i32,
    /// The packet after the program.
    pub packet: Vec<u8>,
    /// The skb mark after the program (the netfilter path's `TRANSLATED_MARK`).
    pub mark: u32,
}

/// How the skb of a [`EbpfDataplane::test_run_tc_with`] arrives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcTestInput {
    /// The interface it arrives on (0: the namespace's loopback).
    pub ifindex: u32,
    /// Its mark (as one an ingress program marked reaches egress).
    pub mark: u32,
    /// `CHECKSUM_COMPLETE`, as from a NIC that sums every packet: the kernel checks after the
    /// run that the program kept `skb->csum` true to the packet, and the run fails with
    /// `EBADMSG` when it did not (kernel 6.17; `EINVAL` before).
    pub checksum_complete: bool,
    /// Sent by the node's own stack rather than received (`ingress_ifindex` 0, as egress
    /// programs see a local socket's packets); `ifindex` stays the skb's device.
    pub local: bool,
}

impl EbpfDataplane {
    /// Runs the tc program `program` once on `packet` with `BPF_PROG_TEST_RUN`, as if it had
    /// arrived on interface `ifindex` (0: the namespace's loopback), against the live maps.
    /// For tests: the kernel builds an skb from the bytes, runs the program and returns its
    /// action and the packet as the program left it; a redirect is reported
    /// (`TC_ACT_REDIRECT`), not performed.
    pub fn test_run_tc(
        &mut self,
        program: &'static str,
        packet: &[u8],
        ifindex: u32,
    ) -> Result<TcTestRun, EbpfError> {
        self.test_run_tc_marked(program, packet, ifindex, 0)
    }

    /// [`Self::test_run_tc`] on an skb that arrives with `mark` (as one an ingress program
    /// marked reaches egress).
    pub fn test_run_tc_marked(
        &mut self,
        program: &'static str,
        packet: &[u8],
        ifindex: u32,
        mark: u32,
    ) -> Result<TcTestRun, EbpfError> {
        self.test_run_tc_with(
            program,
            packet,
            TcTestInput {
                ifindex,
                mark,
                ..TcTestInput::default()
            },
        )
    }

    /// [`Self::test_run_tc`] on an skb that arrives as `input` says.
    pub fn test_run_tc_with(
        &mut self,
        program: &'static str,
        packet: &[u8],
        input: TcTestInput,
    ) -> Result<TcTestRun, EbpfError> {
        self.run_tc(program, packet, input, 1).map(|(run, _)| run)
    }

    /// [`Self::test_run_tc`] with the kernel's `repeat`, also returning the mean time of one
    /// run as the kernel measured it (for the benchmarks). The kernel runs the program
    /// `repeat` times on the same skb, so every run after the first sees the packet as the
    /// previous run left it: only a packet the program does not rewrite is measured `repeat`
    /// times as given.
    pub fn test_run_tc_timed(
        &mut self,
        program: &'static str,
        packet: &[u8],
        ifindex: u32,
        repeat: u32,
    ) -> Result<(TcTestRun, std::time::Duration), EbpfError> {
        let input = TcTestInput {
            ifindex,
            ..TcTestInput::default()
        };
        self.run_tc(program, packet, input, repeat)
    }

    /// The datagrams whose first fragment's ports the tc programs remember for their later
    /// fragments (`KPR_FRAGMENTS`, a snapshot): for tests, which check what is recorded.
    pub fn fragment_datagrams(&self) -> Result<Vec<FragmentKey>, EbpfError> {
        let name = map_names::FRAGMENTS;
        let map = self.ebpf.map(name).ok_or(EbpfError::MissingMap(name))?;
        let map = aya::maps::HashMap::<_, FragmentKey, u32>::try_from(map)
            .map_err(|source| EbpfError::Map { name, source })?;
        map.keys()
            .collect::<Result<_, _>>()
            .map_err(|source| EbpfError::Map { name, source })
    }

    /// Runs `kpr_xdp_external` once on `packet` as if it had arrived on interface `ifindex`
    /// (it must exist in the caller's namespace), against the live maps. A redirect is
    /// reported (`XDP_REDIRECT`), not performed.
    pub fn test_run_xdp(&mut self, packet: &[u8], ifindex: u32) -> Result<XdpTestRun, EbpfError> {
        self.run_xdp(packet, ifindex, 1).map(|(run, _)| run)
    }

    /// [`Self::test_run_xdp`] with the kernel's `repeat`, also returning the mean time of one
    /// run (for the benchmarks; the same caveat as [`Self::test_run_tc_timed`]).
    pub fn test_run_xdp_timed(
        &mut self,
        packet: &[u8],
        ifindex: u32,
        repeat: u32,
    ) -> Result<(XdpTestRun, std::time::Duration), EbpfError> {
        self.run_xdp(packet, ifindex, repeat)
    }

    fn run_xdp(
        &mut self,
        packet: &[u8],
        ifindex: u32,
        repeat: u32,
    ) -> Result<(XdpTestRun, std::time::Duration), EbpfError> {
        let name = proxy_common::program_names::XDP_EXTERNAL;
        let ipv6 = self.tc.ipv6();
        let program = xdp::loaded_program(&mut self.ebpf, None, ipv6, &self.pin_dir)?;
        // `struct xdp_md`: data 0, data_end the packet's length, data_meta 0 (the kernel
        // requires these), then ingress_ifindex (offset 12), which the fib lookup starts from.
        let mut ctx = [0u8; 24];
        let len = u32::try_from(packet.len()).unwrap_or(u32::MAX);
        ctx[4..8].copy_from_slice(&len.to_ne_bytes());
        ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        let mut out = vec![0u8; packet.len() + 256];
        let mut ctx_out = [0u8; 24];
        let fd = program
            .fd()
            .map_err(|source| EbpfError::Program { name, source })?;
        let run = SkbTestRun {
            data_in: packet,
            ctx_in: &ctx,
            repeat,
            flags: 0,
        };
        let result = bpf_syscall::test_run_skb(fd.as_fd(), &run, &mut out, &mut ctx_out)
            .map_err(|source| EbpfError::TestRun { name, source })?;
        out.truncate(result.data_size_out);
        Ok((
            XdpTestRun {
                action: result.retval,
                packet: out,
            },
            result.duration,
        ))
    }

    fn run_tc(
        &mut self,
        program: &'static str,
        packet: &[u8],
        input: TcTestInput,
        repeat: u32,
    ) -> Result<(TcTestRun, std::time::Duration), EbpfError> {
        let ipv6 = self.tc.ipv6();
        let classifier = loaded_classifier(&mut self.ebpf, None, ipv6, program, &self.pin_dir)?;
        let fd = classifier.fd().map_err(|source| EbpfError::Program {
            name: program,
            source,
        })?;
        run_tc_fd(fd.as_fd(), program, packet, input, repeat)
    }
}

/// One `BPF_PROG_TEST_RUN` of the tc program `fd` (named `program` in errors) on `packet`
/// (`repeat` times), against the live maps.
pub(crate) fn run_tc_fd(
    fd: std::os::fd::BorrowedFd<'_>,
    program: &'static str,
    packet: &[u8],
    input: TcTestInput,
    repeat: u32,
) -> Result<(TcTestRun, std::time::Duration), EbpfError> {
    // A partial `struct __sk_buff`: the kernel copies what is given and requires the rest
    // zero. `ingress_ifindex` (offset 36) is what the programs read; `ifindex` (offset 40)
    // makes that interface the skb's device, so fib lookups start from it; `mark` is at 8.
    let mut ctx = [0u8; 44];
    ctx[8..12].copy_from_slice(&input.mark.to_ne_bytes());
    let ingress_ifindex = if input.local { 0 } else { input.ifindex };
    ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    ctx[40..44].copy_from_slice(&input.ifindex.to_ne_bytes());
    // Room for growth: a reject may turn a short packet into a longer ICMP error.
    let mut out = vec![0u8; packet.len().max(128) + 256];
    // The kernel writes the whole `struct __sk_buff` back (ENOSPC if it does not fit).
    let mut ctx_out = [0u8; 256];
    let run = SkbTestRun {
        data_in: packet,
        ctx_in: &ctx,
        repeat,
        flags: if input.checksum_complete {
            bpf_syscall::TEST_SKB_CHECKSUM_COMPLETE
        } else {
            0
        },
    };
    let result = bpf_syscall::test_run_skb(fd, &run, &mut out, &mut ctx_out).map_err(|source| {
        EbpfError::TestRun {
            name: program,
            source,
        }
    })?;
    out.truncate(result.data_size_out);
    Ok((
        TcTestRun {
            action: result.retval as i32,
            packet: out,
            mark: u32::from_ne_bytes([ctx_out[8], ctx_out[9], ctx_out[10], ctx_out[11]]),
        },
        result.duration,
    ))
}
