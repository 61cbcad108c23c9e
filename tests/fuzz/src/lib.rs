//! The fuzz targets' entry points: the agent's `fuzz` module, compiled here from its own file
//! (it names only the parsers' crates), so that the targets and the bounded mutation test run
//! the same calls without this build compiling the agent.

#[path = "../../../proxy-agent/src/fuzz.rs"]
pub mod fuzz;
