//! The packet-parser fuzz, bounded and deterministic: 20 000 frames (half well-formed from
//! address and port pools, half of them damaged) through the real tc programs under
//! `BPF_PROG_TEST_RUN`, with the invariants of `proxy_tests::tc_fuzz` checked on every output.
//! The same checks run under libFuzzer as the cargo-fuzz target `tc_packets` (`tests/fuzz/`).
//! Needs root and the real eBPF object.

use std::collections::BTreeMap;

use proxy_tests::tc_fuzz::{Outcome, Rng, TcNode, mutate, structured_frame, unrelated};

const FRAMES: usize = 20_000;
const SEED: u64 = 0x6b70_722d_7463_6675;

#[test]
fn random_frames_keep_the_tc_invariants() -> anyhow::Result<()> {
    proxy_tests::require_root();
    // The node namespace is entered by the running thread for good: a thread of its own.
    let report = std::thread::spawn(|| -> anyhow::Result<String> {
        let mut node = TcNode::new()?;
        let mut rng = Rng::new(SEED);
        let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
        let mut unrelated_checked = 0;
        for index in 0..FRAMES {
            let frame = structured_frame(&mut rng);
            let frame = if index % 2 == 1 {
                mutate(&mut rng, frame)
            } else {
                frame
            };
            unrelated_checked += usize::from(unrelated(&frame));
            let results = node
                .check(&frame)
                .map_err(|e| anyhow::anyhow!("frame {index} (seed {SEED:#x}): {e}"))?;
            for outcome in results {
                let label = match outcome {
                    Outcome::TooShort => "Ethernet header only (not run)".to_owned(),
                    Outcome::Refused => "refused by BPF_PROG_TEST_RUN (not run)".to_owned(),
                    Outcome::Ran {
                        program,
                        action,
                        rewritten,
                        checked,
                    } => format!(
                        "{program} action {action}{}{}",
                        if rewritten { " rewritten" } else { "" },
                        if checked {
                            " (well-formed in)"
                        } else {
                            " (malformed in)"
                        }
                    ),
                };
                *outcomes.entry(label).or_insert(0) += 1;
            }
        }
        Ok(format!(
            "{FRAMES} frames tried, {unrelated_checked} unrelated to any Service (checked \
             unchanged); outcomes per program: {outcomes:#?}"
        ))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the fuzz thread panicked"))??;
    eprintln!("{report}");
    Ok(())
}
