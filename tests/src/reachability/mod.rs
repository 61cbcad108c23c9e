//! The reachability matrix: one table of cells — client × Service shape ×
//! frontend × IP family — that both `--proxy-mode`s run with real packets on a two-node rig.
//!
//! - [`cells`]: the shapes (one dual-stack Service each), frontends, clients and the explicit
//!   cell list (not every client × frontend pair is meaningful).
//! - [`expected`]: a pure function cell → expected outcome, derived from upstream kube-proxy's
//!   iptables rules (each branch cites the rule), with the eBPF mode's deliberate differences.
//! - [`rig`]: the node as a real one looks (default route, several local addresses, a second
//!   node with IPv6, a second external address, a cloud load balancer decoy) and the agent.
//! - [`runner`]: runs every cell in parallel (bounded workers) and summarises what was seen.
//! - [`report`]: the printed table and `docs/reachability.md`.

pub mod cells;
pub mod expected;
pub mod report;
pub mod rig;
pub mod runner;

pub use cells::{Cell, Client, Family, Frontend, Shape, all_cells, hairpin_cells};
pub use expected::wiring_cells;
