//! `proxy-agent`: the kubeproxy-rs node agent.

use std::io::IsTerminal as _;

use clap::Parser as _;
use proxy_agent::{cli, run};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = cli::Args::parse();
    let default_level = match args.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // The first reading fixes the origin of the ` m=+…` monotonic times in the health bodies.
    proxy_agent::node_services::time_format::process_start();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.logging_format {
        cli::LoggingFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        cli::LoggingFormat::Json => builder.json().init(),
    }
    run::run(args).await
}
