//! The `sandgate` binary: parses arguments, loads configuration, starts telemetry and hands over
//! to the gateway library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sandgate_auth::Scope;
use sandgate_gateway::{App, Config, admin, telemetry};

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
    /// Operator commands: tenants, users, clients, tokens, keys.
    #[command(subcommand)]
    Admin(Admin),
}

#[derive(Debug, Subcommand)]
enum Admin {
    /// Manage tenants.
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Manage the people of a tenant who approve apps.
    #[command(subcommand)]
    User(UserCommand),
    /// Manage OAuth clients.
    #[command(subcommand)]
    Client(ClientCommand),
    /// Issue access tokens for integrations and tests.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Manage the token signing keys.
    #[command(subcommand)]
    Keys(KeysCommand),
}

#[derive(Debug, Subcommand)]
enum TenantCommand {
    /// Create a tenant; prints its id.
    Create {
        /// A unique, human name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum UserCommand {
    /// Create a user; the password is read from standard input (first line). Prints the id.
    Create {
        /// The tenant id.
        #[arg(long)]
        tenant: uuid::Uuid,
        /// Login email.
        #[arg(long)]
        email: String,
    },
}

#[derive(Debug, Subcommand)]
enum ClientCommand {
    /// Create a confidential client for server-to-server use (client credentials) and, with
    /// redirect URIs, the authorization code flow. Prints `client_id` and `client_secret`.
    Create {
        /// The tenant its client-credentials tokens act for.
        #[arg(long)]
        tenant: uuid::Uuid,
        /// Name shown on consent and connected-apps pages.
        #[arg(long)]
        name: String,
        /// Allowed redirect URI (repeatable).
        #[arg(long = "redirect-uri")]
        redirect_uris: Vec<String>,
        /// Scopes, space- or comma-separated.
        #[arg(long, default_value = "sandbox execute files:read files:write")]
        scopes: String,
    },
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Print an access token for the tenant (audience: this gateway's MCP URL).
    Issue {
        /// The tenant id (from `admin tenant create`).
        #[arg(long)]
        tenant: uuid::Uuid,
        /// Scopes, space- or comma-separated.
        #[arg(long, default_value = "sandbox execute files:read files:write")]
        scopes: String,
        /// Lifetime, e.g. `15m`, `1h`, `30d`.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
    },
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Make a new signing key; old keys keep verifying until their tokens have expired.
    Rotate,
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
        Command::Admin(Admin::Tenant(TenantCommand::Create { name })) => {
            let tenant = admin::create_tenant(&config, &name).await?;
            println!("{}", tenant.id);
        }
        Command::Admin(Admin::User(UserCommand::Create { tenant, email })) => {
            let mut password = String::new();
            std::io::stdin()
                .read_line(&mut password)
                .context("reading the password from standard input")?;
            let password = password.trim_end_matches(['\r', '\n']);
            let id = admin::create_user(&config, tenant, &email, password).await?;
            println!("{id}");
        }
        Command::Admin(Admin::Client(ClientCommand::Create {
            tenant,
            name,
            redirect_uris,
            scopes,
        })) => {
            let scopes = Scope::parse_list(&scopes.replace(',', " "))?;
            let created =
                admin::create_client(&config, tenant, &name, &redirect_uris, &scopes).await?;
            println!("client_id={}", created.client_id);
            println!("client_secret={}", created.client_secret);
        }
        Command::Admin(Admin::Token(TokenCommand::Issue {
            tenant,
            scopes,
            ttl,
        })) => {
            let scopes = Scope::parse_list(&scopes.replace(',', " "))?;
            let token = admin::issue_token(&config, tenant, &scopes, ttl).await?;
            println!("{token}");
        }
        Command::Admin(Admin::Keys(KeysCommand::Rotate)) => {
            let kid = admin::rotate_keys(&config).await?;
            println!("{kid}");
        }
    }
    Ok(())
}
