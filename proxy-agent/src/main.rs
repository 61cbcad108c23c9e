//! `proxy-agent`: the kubeproxy-rs node agent.

use std::{io::IsTerminal as _, process::ExitCode};

use clap::Parser as _;
use proxy_agent::run;
use proxy_model::{cli, config};
use tracing::{error, info, warn};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // Before the runtime starts its threads (see `limit_malloc_arenas`).
    run::limit_malloc_arenas();
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(agent_main()),
        Err(error) => {
            eprintln!("proxy-agent: cannot start the async runtime: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn agent_main() -> ExitCode {
    let args = cli::Args::parse();
    // Everything is resolved and validated before anything is touched; a bad configuration
    // is reported (one line per problem) and exits 1 without a backtrace.
    let loaded = match config::load(&args) {
        Ok(loaded) => loaded,
        Err(error) if matches!(args.command, Some(cli::Command::Inspect(_))) => {
            for line in error.lines() {
                eprintln!("proxy-agent: inspect ignores the configuration: {line}");
            }
            match config::load(&args.inspect_fallback()) {
                Ok(loaded) => loaded,
                Err(error) => {
                    for line in error.lines() {
                        eprintln!("proxy-agent: {line}");
                    }
                    return ExitCode::FAILURE;
                }
            }
        }
        Err(error) => {
            for line in error.lines() {
                eprintln!("proxy-agent: {line}");
            }
            return ExitCode::FAILURE;
        }
    };
    let config = loaded.config;
    // Fixed for the life of the process, before anything reads them (as upstream's
    // DefaultMutableFeatureGate.SetFromMap in Options.Complete).
    config::features::set(&config.feature_gates);

    // RUST_LOG, when set, wins over -v / logging.verbosity.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(config.log_level().to_string()));
    // The first reading fixes the origin of the ` m=+…` monotonic times in the health bodies.
    proxy_model::time_format::process_start();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let json =
        args.logging_format == cli::LoggingFormat::Json || loaded.document.logging.format == "json";
    // The filter stays replaceable: `PUT /debug/flags/v` changes the verbosity.
    if json {
        let builder = builder.json().with_filter_reloading();
        let handle = builder.reload_handle();
        proxy_model::logging::install(config.verbosity, move |filter| {
            handle.reload(filter).map_err(|e| e.to_string())
        });
        builder.init();
    } else {
        let builder = builder
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter_reloading();
        let handle = builder.reload_handle();
        proxy_model::logging::install(config.verbosity, move |filter| {
            handle.reload(filter).map_err(|e| e.to_string())
        });
        builder.init();
    }
    for notice in &loaded.notices {
        match notice {
            config::Notice::Info(message) => info!("{message}"),
            config::Notice::Warn(message) => warn!("{message}"),
            config::Notice::Error(message) => error!("{message}"),
        }
    }
    if !loaded.overridden.is_empty() {
        info!(flags = ?loaded.overridden, "command-line flags override the configuration file");
    }

    if let Some(cli::Command::Inspect(inspect)) = &args.command {
        return match proxy_agent::inspect::run(&config, inspect) {
            // `inspect top` prints its frames itself and returns nothing more.
            Ok(text) if text.is_empty() => ExitCode::SUCCESS,
            Ok(text) => {
                println!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                error!("{e:#}");
                ExitCode::FAILURE
            }
        };
    }

    if let Some(path) = &args.write_config_to {
        return match config::write_file(&loaded.document, path) {
            Ok(()) => {
                info!(file = %path.display(), "wrote the configuration");
                ExitCode::SUCCESS
            }
            Err(e) => {
                error!("{e}");
                ExitCode::FAILURE
            }
        };
    }
    if config.init_only {
        run::init_only(&config);
        return ExitCode::SUCCESS;
    }
    if config.cleanup {
        return match run::cleanup(&config) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                error!("{e:#}");
                ExitCode::FAILURE
            }
        };
    }
    match run::run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
