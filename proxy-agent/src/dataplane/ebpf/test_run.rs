//! `BPF_PROG_TEST_RUN` of the tc programs against the live maps (tests and benchmarks).

use aya::programs::{SchedClassifier, TestRun as _, TestRunOptions};

use super::{dataplane::EbpfDataplane, error::EbpfError};

/// One run of a tc program with `BPF_PROG_TEST_RUN` ([`EbpfDataplane::test_run_tc`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcTestRun {
    /// The program's return value (`TC_ACT_*`).
    pub action: i32,
    /// The packet after the program.
    pub packet: Vec<u8>,
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
        self.test_run_tc_timed(program, packet, ifindex, 1)
            .map(|(run, _)| run)
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
        let program_error = |source| EbpfError::Program {
            name: program,
            source,
        };
        let classifier: &mut SchedClassifier = self
            .ebpf
            .program_mut(program)
            .ok_or(EbpfError::MissingProgram(program))?
            .try_into()
            .map_err(program_error)?;
        if classifier.fd().is_err() {
            classifier.load().map_err(program_error)?;
        }
        // A partial `struct __sk_buff`: the kernel copies what is given and requires the rest
        // zero. `ingress_ifindex` (offset 36) is what the programs read; `ifindex` (offset 40)
        // makes that interface the skb's device, so fib lookups start from it.
        let mut ctx = [0u8; 44];
        ctx[36..40].copy_from_slice(&ifindex.to_ne_bytes());
        ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        // Room for growth: a reject may turn a short packet into a longer ICMP error.
        let mut out = vec![0u8; packet.len().max(128) + 256];
        let result = classifier
            .test_run(TestRunOptions {
                data_in: Some(packet),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                repeat: repeat.max(1),
                ..TestRunOptions::default()
            })
            .map_err(program_error)?;
        out.truncate(result.data_size_out as usize);
        Ok((
            TcTestRun {
                action: result.return_value as i32,
                packet: out,
            },
            result.duration,
        ))
    }
}
