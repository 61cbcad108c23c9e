//! `rig-helper echo|client`: the processes the test rig runs inside namespaces and cgroups.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    proxy_tests::helper::run(proxy_tests::helper::Cli::parse())?;
    Ok(())
}
