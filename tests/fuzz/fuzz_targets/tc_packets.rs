//! The packet parser (the tc programs, which run in the kernel) under libFuzzer: every input
//! becomes a frame that goes through `kpr_tc_external` and `kpr_tc_reply` with
//! `BPF_PROG_TEST_RUN`, with Services programmed through the real `EbpfDataplane`, and the
//! invariants of `proxy_tests::tc_fuzz` are checked on every output; a violation panics (a
//! finding). Needs root and the real eBPF object (`cargo xtask fuzz tc_packets` builds it).
//!
//! libFuzzer sees only user-space coverage, so inputs are steered towards frames the programs
//! care about: with the first byte odd, the next 8 bytes seed a well-formed frame from the
//! address and port pools (the generator of `tests/tests/integration/tc_fuzz.rs`) and the rest is XORed
//! over it (all zero: the frame stays well-formed); with it even, the rest is the raw frame.
#![no_main]

use std::cell::RefCell;

use proxy_tests::tc_fuzz::{Rng, TcNode, structured_frame};

thread_local! {
    // libFuzzer calls the target on its main thread, which enters the node namespace once;
    // glibc runs thread-local destructors in exit(), so a normal end deletes the namespace, the
    // bpffs and the cgroup (a crash leaves `kpr-<pid>-*-tcfuzz` behind, and the named netns).
    static NODE: RefCell<Option<TcNode>> = const { RefCell::new(None) };
}

fn frame_of(data: &[u8]) -> Vec<u8> {
    match data.split_first() {
        Some((mode, rest)) if mode % 2 == 1 => {
            let (seed, overlay) = rest.split_at(rest.len().min(8));
            let mut seed_bytes = [0u8; 8];
            seed_bytes[..seed.len()].copy_from_slice(seed);
            let mut frame = structured_frame(&mut Rng::new(u64::from_le_bytes(seed_bytes)));
            for (byte, x) in frame.iter_mut().zip(overlay) {
                *byte ^= x;
            }
            frame
        }
        Some((_, rest)) => rest.to_vec(),
        None => Vec::new(),
    }
}

libfuzzer_sys::fuzz_target!(
    // The node is set up before the first input, outside libFuzzer's per-input timeout: loading
    // the tc programs runs the verifier over ~1M instructions, which takes longer than
    // `-timeout` on a slow or busy machine and was reported as a timeout on the empty input.
    init: {
        // Thread-local destructors run in reverse order of first use: touching tokio's context
        // first keeps it alive while the node (and its runtime) is dropped at exit.
        let _ = tokio::runtime::Handle::try_current();
        match TcNode::new() {
            Ok(new) => NODE.set(Some(new)),
            Err(e) => panic!("setting up the tc node (root? eBPF object?): {e}"),
        }
    },
    |data: &[u8]| {
        let frame = frame_of(data);
        NODE.with_borrow_mut(|node| {
            if let Some(node) = node.as_mut()
                && let Err(e) = node.check(&frame)
            {
                panic!("tc invariant violated: {e}");
            }
        });
    }
);
