//! Loading the object and attaching its programs: the pins and their layouts, tc (TCX or
//! legacy) and XDP, and the hand-back that removes them once a switch to iptables has drained.

pub mod handback;
pub mod layout;
pub mod legacy_tc;
pub(super) mod object;
pub(super) mod pin_files;
pub(super) mod pins;
pub mod reuse;
pub(super) mod tc;
pub(super) mod tc_programs;
pub mod xdp;
