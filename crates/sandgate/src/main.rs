//! The `sandgate` binary: parses arguments, loads configuration, starts telemetry and hands over
//! to the gateway library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sandgate_gateway::{App, Config, telemetry};

/// A multi-tenant code-interpreter MCP server.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Configuration file (TOML) layered over the built-in defaults.
    #[arg(long, global = true, env = "SANDGATE_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway (migrates the database first).
    Serve,
    /// Apply database migrations and exit.
    Migrate,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(cli.config.as_deref()) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("sandgate: {err}");
            return ExitCode::from(2);
        }
    };
    telemetry::init(&config.log);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("sandgate: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = format!("{err:#}"), "sandgate failed");
            eprintln!("sandgate: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command, config: Config) -> anyhow::Result<()> {
    match command {
        Command::Serve => {
            let app = App::build(config).await.context("starting the gateway")?;
            let mcp_url = app.mcp_url();
            tracing::info!(addr = %app.local_addr(), mcp_url, "sandgate is serving");
            println!("sandgate serving MCP at {mcp_url}");
            app.run(sandgate_gateway::shutdown_signal()).await?;
        }
        Command::Migrate => {
            sandgate_gateway::migrate(&config)
                .await
                .context("migrating")?;
            println!("migrations applied");
        }
    }
    Ok(())
}
