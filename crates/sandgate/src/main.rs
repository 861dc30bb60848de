//! The `sandgate` binary: parses arguments, loads configuration, starts telemetry and hands over
//! to the gateway library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sandgate_auth::Scope;
use sandgate_gateway::{App, Config, admin, egress, erasure, retention, telemetry};

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
    /// Run the gateway with its in-process sandbox node (migrates the database first unless
    /// `database.auto_migrate` is false; then it only checks the schema). With `node.listen`
    /// set, the node also serves other gateways over the node RPC.
    Serve {
        /// A gateway replica without a node of its own: no Docker, no warm pool; sandboxes are
        /// leased on the nodes registered in Postgres and reached over the node RPC (with the
        /// `node.tls_*` certificates as its client identity).
        #[arg(long)]
        gateway_only: bool,
    },
    /// Run a sandbox node only: this host's containers, warm pool and attach channels, served
    /// to gateways over the node RPC on `node.listen` (mutual TLS; docs/scale-out.md). It never
    /// migrates (run `sandgate migrate` first) and holds no signing key or secret.
    Node,
    /// Apply database migrations and exit (the only command that does in a deployment).
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
    /// Show a tenant's audit trail (one event per tool call), newest first.
    Audit {
        /// The tenant id.
        #[arg(long)]
        tenant: uuid::Uuid,
        /// Most events shown.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Show the tenant's package installs instead (every wheel handed to a sandbox's pip).
        #[arg(long)]
        packages: bool,
    },
    /// The sandbox nodes registered in Postgres: list, drain, undrain.
    #[command(subcommand)]
    Nodes(NodesCommand),
    /// List live sandboxes with owner, age and time left.
    Sandboxes {
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<uuid::Uuid>,
    },
}

#[derive(Debug, Subcommand)]
enum NodesCommand {
    /// List the nodes: id, name, URL, slots, live and warm sandboxes, state, heartbeat age.
    List,
    /// Drain a node: it gets no new leases; its sandboxes run until they end.
    Drain {
        /// The node's id (its engine's id; `nodes list` shows it).
        id: String,
    },
    /// Take a drained node back: it gets new leases again.
    Undrain {
        /// The node's id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum TenantCommand {
    /// Create a tenant; prints its id.
    Create {
        /// A unique, human name.
        name: String,
    },
    /// Show or set a tenant's limits; a value of `default` goes back to the configured default.
    /// Prints the limits in force.
    Limits {
        /// The tenant id.
        tenant: uuid::Uuid,
        /// Put every limit back to the default before applying the others.
        #[arg(long)]
        reset: bool,
        /// Most live sandboxes at once.
        #[arg(long, value_parser = limit::<i32>)]
        max_sandboxes: Option<Setting<i32>>,
        /// Longest idle timeout (keep_alive_seconds), seconds.
        #[arg(long, value_parser = limit::<i32>)]
        max_idle_seconds: Option<Setting<i32>>,
        /// Longest lifetime of a sandbox, seconds.
        #[arg(long, value_parser = limit::<i32>)]
        max_lifetime_seconds: Option<Setting<i32>>,
        /// Memory per sandbox, MiB.
        #[arg(long, value_parser = limit::<i32>)]
        memory_mb: Option<Setting<i32>>,
        /// CPU quota per sandbox, cores.
        #[arg(long, value_parser = limit::<f32>)]
        cpus: Option<Setting<f32>>,
        /// Most tool calls started per minute (a burst of this many, then one every 60/N s).
        #[arg(long, value_parser = limit::<i32>)]
        max_calls_per_minute: Option<Setting<i32>>,
        /// Most open MCP sessions (2025-11-25 protocol era) at once.
        #[arg(long, value_parser = limit::<i32>)]
        max_sessions: Option<Setting<i32>>,
        /// Most tool calls running at once (across replicas).
        #[arg(long, value_parser = limit::<i32>)]
        max_calls_in_flight: Option<Setting<i32>>,
    },
    /// Set how long the tenant's transcripts are kept after their sandbox ended, and how long
    /// its paused sandboxes are kept (their snapshots deleted after), e.g. `7d`, `12h`, `0s`, or
    /// `default` for the configured default. Prints the retention in force of what was set.
    #[command(group(clap::ArgGroup::new("what").required(true).multiple(true)))]
    Retention {
        /// The tenant id.
        tenant: uuid::Uuid,
        /// How long transcripts are kept after their sandbox ended, or `default`
        /// (`retention.transcripts_seconds`).
        #[arg(long, value_parser = retention, group = "what")]
        transcripts: Option<Setting<u32>>,
        /// How long a paused sandbox is kept, or `default` (`retention.paused_seconds`).
        #[arg(long, value_parser = retention, group = "what")]
        paused: Option<Setting<u32>>,
    },
    /// Show or change a tenant's package policy (packages on demand: `pip install` in its
    /// sandboxes). Rules are a project name with optional version specifiers, e.g. `numpy` or
    /// `numpy>=1.26`. With an allow rule, only allowed projects install. Prints the policy in force.
    Packages {
        /// The tenant id.
        tenant: uuid::Uuid,
        /// Start from the empty policy before applying the other options.
        #[arg(long)]
        clear: bool,
        /// Add an allow rule (repeatable).
        #[arg(long)]
        allow: Vec<String>,
        /// Add a deny rule (repeatable).
        #[arg(long)]
        deny: Vec<String>,
        /// Remove a rule, as written, from either list (repeatable).
        #[arg(long)]
        remove: Vec<String>,
        /// Largest wheel a sandbox may download, MiB, or `default`.
        #[arg(long, value_parser = limit::<i32>)]
        max_wheel_mb: Option<Setting<i32>>,
    },
    /// Show or change a tenant's egress policy: the hosts its sandboxes may reach (off until a
    /// host is allowed), through the proxy the agent serves in the sandbox and the relay to the
    /// gateway. Prints the policy in force.
    Egress {
        /// The tenant id.
        tenant: uuid::Uuid,
        /// Take out every rule first (no route out), then apply the others.
        #[arg(long)]
        deny_all: bool,
        /// Allow a host: a DNS name (`api.shop.example`) or a wildcard of its subdomains
        /// (`*.shop.example`), optionally `:port` (default 443); never an address (repeatable).
        #[arg(long, value_name = "HOST[:PORT]")]
        allow: Vec<String>,
        /// Take out a rule, `host[:port]` as allowed (repeatable).
        #[arg(long, value_name = "HOST[:PORT]")]
        remove: Vec<String>,
        /// A budget of the hosts of this command's --allow: most new connections per minute.
        #[arg(long, value_name = "N")]
        connections_per_minute: Option<i32>,
        /// A budget of the hosts of this command's --allow: most bytes (both ways) per day.
        #[arg(long, value_name = "BYTES")]
        bytes_per_day: Option<i64>,
        /// Whether a host outside the policy that a sandbox asks for becomes a request a person
        /// with the `approver` role may approve for that sandbox in the console (`on`/`off`;
        /// off by default; `off` also ends pending requests and standing approvals).
        #[arg(long, value_name = "on|off", value_parser = on_off)]
        approvals: Option<bool>,
        /// Only show the policy (the default when nothing else is given).
        #[arg(long, conflicts_with_all = ["deny_all", "allow", "remove", "approvals"])]
        show: bool,
    },
    /// Manage a tenant's secrets: values the egress component will put into the named headers of
    /// requests to the named hosts, so they never enter a sandbox. Values are read from standard
    /// input, stored sealed under egress.secrets_key, and never shown.
    #[command(subcommand)]
    Secret(SecretCommand),
    /// Remove everything of a tenant's content now: close its live sandboxes (their files go
    /// with their containers), delete its transcripts, forget its conversation ids. The tenant,
    /// its users, connections and audit trail stay.
    Purge {
        /// The tenant id.
        tenant: uuid::Uuid,
    },
    /// Delete a tenant and everything stored under it: its tokens are refused at once, its
    /// sandboxes closed and their containers removed, its snapshots, transcripts, users,
    /// clients, connections, tokens, quotas, package and egress settings, secrets and audit
    /// trail deleted (docs/data.md). Cannot be undone; needs `--yes`.
    Delete {
        /// The tenant id.
        tenant: uuid::Uuid,
        /// Confirm the deletion.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Subcommand)]
enum SecretCommand {
    /// Set a secret (creates it, or replaces its value and bindings): the value is read from
    /// standard input (one line; the final newline is dropped), never from the command line.
    Set {
        /// The tenant id.
        tenant: uuid::Uuid,
        /// The secret's name, upper-case letters, digits and `_` (e.g. SHOP_TOKEN): the
        /// placeholder's environment variable in the sandbox.
        name: String,
        /// A host it may be sent to, a name or `*.` wildcard as in `tenant egress` (repeatable).
        #[arg(long, required = true)]
        host: Vec<String>,
        /// A request header it may go into, e.g. authorization or x-api-key (repeatable).
        #[arg(long, required = true)]
        header: Vec<String>,
    },
    /// List a tenant's secrets: names, hosts, headers, versions and dates (never values).
    List {
        /// The tenant id.
        tenant: uuid::Uuid,
    },
    /// Give a secret a new value, read from standard input; its hosts and headers are kept and
    /// its version raised.
    Rotate {
        /// The tenant id.
        tenant: uuid::Uuid,
        /// The secret's name.
        name: String,
    },
    /// Delete a secret.
    Delete {
        /// The tenant id.
        tenant: uuid::Uuid,
        /// The secret's name.
        name: String,
    },
}

/// A secret's value from standard input: everything up to its end (a pipe or a file), or one
/// line on a terminal. Bounded: a value is at most 8 KiB, so more is never read.
fn read_secret_value() -> anyhow::Result<zeroize::Zeroizing<String>> {
    use std::io::{BufRead as _, IsTerminal as _, Read as _};
    let stdin = std::io::stdin();
    let mut value = zeroize::Zeroizing::new(String::new());
    let limit = (egress::MAX_VALUE_BYTES + 3) as u64;
    if stdin.is_terminal() {
        eprintln!(
            "the secret's value (one line; it is shown as you type, pipe it in to avoid that):"
        );
        stdin.lock().take(limit).read_line(&mut value)
    } else {
        stdin.lock().take(limit).read_to_string(&mut value)
    }
    .context("reading the secret's value from standard input")?;
    Ok(value)
}

fn retention(s: &str) -> Result<Setting<u32>, String> {
    if s == "default" {
        return Ok(Setting(None));
    }
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (e.g. 30d, 12h or default)"))?;
    u32::try_from(d.as_secs())
        .ok()
        .filter(|s| *s <= i32::MAX as u32)
        .map(|s| Setting(Some(s)))
        .ok_or_else(|| "at most 68 years".to_owned())
}

/// A limit value on the command line: a number, or `default` (`None`).
#[derive(Debug, Clone, Copy)]
struct Setting<T>(Option<T>);

fn limit<T: std::str::FromStr>(s: &str) -> Result<Setting<T>, String>
where
    T::Err: std::fmt::Display,
{
    if s == "default" {
        return Ok(Setting(None));
    }
    s.parse()
        .map(|v| Setting(Some(v)))
        .map_err(|e| format!("{e} (give a number or `default`)"))
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
    /// Set a user's console role: `viewer` reads the tenant's conversations, `takeover` may
    /// also run code and move files in its sandboxes, `approver` may also approve hosts a
    /// conversation's sandbox asked for outside the egress policy (`tenant egress --approvals`).
    Role {
        /// Login email.
        #[arg(long)]
        email: String,
        /// `viewer`, `takeover` or `approver`.
        #[arg(long, value_parser = user_role)]
        role: admin::UserRole,
    },
    /// End every browser session of a user (a stolen cookie stops working); they sign in again.
    RevokeSessions {
        /// Login email.
        #[arg(long)]
        email: String,
    },
    /// Delete a user: its browser sessions end at once, the app connections it approved are
    /// deleted (their tokens are refused from the next request on). Needs `--yes`.
    Delete {
        /// The user's id (printed by `user create`).
        user: uuid::Uuid,
        /// Confirm the deletion.
        #[arg(long)]
        yes: bool,
    },
}

fn on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: give on or off")),
    }
}

fn user_role(s: &str) -> Result<admin::UserRole, String> {
    admin::UserRole::parse(s).ok_or_else(|| format!("{s:?}: give viewer, takeover or approver"))
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
    /// Delete an OAuth client: its app connections are deleted, so every token issued to it
    /// is refused from the next request on. Needs `--yes`.
    Delete {
        /// The `client_id`.
        client: String,
        /// Confirm the deletion.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Print an access token for the tenant (audience: this gateway's MCP URL). Its id is
    /// recorded (and printed on standard error) for `list` and `revoke`.
    Issue {
        /// The tenant id (from `admin tenant create`).
        #[arg(long)]
        tenant: uuid::Uuid,
        /// Scopes, space- or comma-separated.
        #[arg(long, default_value = "sandbox execute files:read files:write")]
        scopes: String,
        /// Lifetime, e.g. `15m`, `1h`, `30d`; at most `keys.admin_token_max_ttl_seconds`
        /// (30 days by default).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
    },
    /// List the tokens issued with `issue` (not the tokens themselves): id, tenant, lifetime,
    /// state, scopes.
    List {
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<uuid::Uuid>,
        /// Include expired tokens.
        #[arg(long)]
        all: bool,
    },
    /// Revoke a token by its id (from `list`): every gateway refuses it from its next request.
    Revoke {
        /// The token's id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// Make a new signing key; old keys keep verifying until their tokens have expired (at least
    /// as long as the longest admin-token lifetime).
    Rotate,
}

/// Refuses a delete command not confirmed with `--yes`.
fn confirmed(yes: bool, what: &str) -> anyhow::Result<()> {
    if yes {
        Ok(())
    } else {
        anyhow::bail!("this deletes {what} and cannot be undone; run it again with --yes")
    }
}

/// Stack size of each async runtime worker thread.
const WORKER_STACK_BYTES: usize = 8 << 20;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A node's and the migrator's configurations need no secrets (they hold none).
    let process = match cli.command {
        Command::Node => sandgate_gateway::config::Process::Node,
        Command::Migrate => sandgate_gateway::config::Process::Migrator,
        _ => sandgate_gateway::config::Process::Gateway,
    };
    let config = match Config::load_for(cli.config.as_deref(), process) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("sandgate: {err}");
            return ExitCode::from(2);
        }
    };
    telemetry::init(&config.log);
    // 8 MiB per worker rather than the default 2: a call that resumes a paused sandbox after a
    // restart (adopting, restoring, resolving) nests deep futures, and a debug build overflowed
    // 2 MiB there (e2e `pause::a_paused_sandbox_resumes_after_the_gateway_restarts`).
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(WORKER_STACK_BYTES)
        .build()
    {
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
        Command::Serve { gateway_only } => {
            let app = if gateway_only {
                App::build_gateway_only(config).await
            } else {
                App::build(config).await
            }
            .context("starting the gateway")?;
            let mcp_url = app.mcp_url();
            tracing::info!(addr = %app.local_addr(), mcp_url, "sandgate is serving");
            // The address too: behind a load balancer the MCP URL is the balancer's.
            println!(
                "sandgate listening on http://{}, serving MCP at {mcp_url}",
                app.local_addr()
            );
            app.run(sandgate_gateway::shutdown_signal()).await?;
        }
        Command::Node => {
            let node = sandgate_gateway::node::Node::build(config)
                .await
                .context("starting the sandbox node")?;
            let addr = node
                .local_addr()
                .map_or_else(|| "?".to_owned(), |a| a.to_string());
            tracing::info!(addr, "sandgate node is serving");
            println!("sandgate node serving at {addr}");
            node.run(sandgate_gateway::shutdown_signal()).await?;
        }
        Command::Migrate => {
            sandgate_gateway::migrate(&config)
                .await
                .context("migrating")?;
            println!("migrations applied");
        }
        Command::Admin(command) => run_admin(command, config).await?,
    }
    Ok(())
}

/// Runs an `admin tenant secret` command.
async fn run_secret(command: SecretCommand, config: &Config) -> anyhow::Result<()> {
    match command {
        SecretCommand::Set {
            tenant,
            name,
            host,
            header,
        } => {
            let value = read_secret_value()?;
            let (info, write) =
                egress::admin::set_secret(config, tenant, &name, &host, &header, &value).await?;
            let what = match write {
                egress::admin::SecretWrite::Created => "set",
                egress::admin::SecretWrite::Replaced => "replaced",
            };
            println!(
                "secret {} of tenant {tenant} {what} (version {})",
                info.name, info.version
            );
        }
        SecretCommand::List { tenant } => {
            let secrets = egress::admin::list_secrets(config, tenant).await?;
            println!("{}", egress::admin::render_secrets(&secrets));
        }
        SecretCommand::Rotate { tenant, name } => {
            let value = read_secret_value()?;
            let info = egress::admin::rotate_secret(config, tenant, &name, &value).await?;
            println!(
                "secret {} of tenant {tenant} rotated (version {})",
                info.name, info.version
            );
        }
        SecretCommand::Delete { tenant, name } => {
            egress::admin::delete_secret(config, tenant, &name).await?;
            println!("secret {name} of tenant {tenant} deleted");
        }
    }
    Ok(())
}

/// Runs an operator command.
async fn run_admin(command: Admin, config: Config) -> anyhow::Result<()> {
    match command {
        Admin::Tenant(TenantCommand::Create { name }) => {
            let tenant = admin::create_tenant(&config, &name).await?;
            println!("{}", tenant.id);
        }
        Admin::User(UserCommand::Create { tenant, email }) => {
            let mut password = String::new();
            std::io::stdin()
                .read_line(&mut password)
                .context("reading the password from standard input")?;
            let password = password.trim_end_matches(['\r', '\n']);
            let id = admin::create_user(&config, tenant, &email, password).await?;
            println!("{id}");
        }
        Admin::User(UserCommand::Role { email, role }) => {
            let (id, tenant) = admin::set_user_role(&config, &email, role).await?;
            println!("user {id} of tenant {tenant} now has role {role}");
        }
        Admin::Tenant(TenantCommand::Delete { tenant, yes }) => {
            confirmed(
                yes,
                &format!("tenant {tenant} and everything stored under it"),
            )?;
            let deleted = erasure::delete_tenant(&config, tenant).await?;
            println!("{}", erasure::render_deleted_tenant(tenant, &deleted));
        }
        Admin::User(UserCommand::Delete { user, yes }) => {
            confirmed(
                yes,
                &format!("user {user}, its sessions and app connections"),
            )?;
            let deleted = erasure::delete_user(&config, user).await?;
            println!(
                "deleted user {user} of tenant {}: ended {} session(s), deleted {} app connection(s)",
                deleted.tenant_id, deleted.sessions, deleted.grants
            );
        }
        Admin::Client(ClientCommand::Delete { client, yes }) => {
            confirmed(
                yes,
                &format!("OAuth client {client:?} and its app connections"),
            )?;
            let grants = erasure::delete_client(&config, &client).await?;
            println!("deleted client {client}: deleted {grants} app connection(s)");
        }
        Admin::User(UserCommand::RevokeSessions { email }) => {
            let ended = admin::revoke_user_sessions(&config, &email).await?;
            println!("ended {ended} session(s) of {email}");
        }
        Admin::Client(ClientCommand::Create {
            tenant,
            name,
            redirect_uris,
            scopes,
        }) => {
            let scopes = Scope::parse_list(&scopes.replace(',', " "))?;
            let created =
                admin::create_client(&config, tenant, &name, &redirect_uris, &scopes).await?;
            println!("client_id={}", created.client_id);
            println!("client_secret={}", created.client_secret);
        }
        Admin::Token(TokenCommand::Issue {
            tenant,
            scopes,
            ttl,
        }) => {
            let scopes = Scope::parse_list(&scopes.replace(',', " "))?;
            let (token, record) = admin::issue_token(&config, tenant, &scopes, ttl).await?;
            eprintln!(
                "token id {} (expires {}; `sandgate admin token revoke {}` ends it)",
                record.jti,
                record.expires_at.format("%Y-%m-%dT%H:%M:%SZ"),
                record.jti
            );
            println!("{token}");
        }
        Admin::Token(TokenCommand::List { tenant, all }) => {
            let tokens = admin::list_tokens(&config, tenant, all).await?;
            println!("{}", admin::render_tokens(&tokens));
        }
        Admin::Token(TokenCommand::Revoke { id }) => {
            let token = admin::revoke_token(&config, &id).await?;
            println!("revoked {} (tenant {})", token.jti, token.tenant_id);
        }
        Admin::Tenant(TenantCommand::Limits {
            tenant,
            reset,
            max_sandboxes,
            max_idle_seconds,
            max_lifetime_seconds,
            memory_mb,
            cpus,
            max_calls_per_minute,
            max_sessions,
            max_calls_in_flight,
        }) => {
            let changes = admin::LimitChanges {
                max_sandboxes: max_sandboxes.map(|s| s.0),
                max_idle_seconds: max_idle_seconds.map(|s| s.0),
                max_lifetime_seconds: max_lifetime_seconds.map(|s| s.0),
                memory_mb: memory_mb.map(|s| s.0),
                cpus: cpus.map(|s| s.0),
                max_calls_per_minute: max_calls_per_minute.map(|s| s.0),
                max_sessions: max_sessions.map(|s| s.0),
                max_calls_in_flight: max_calls_in_flight.map(|s| s.0),
            };
            let (own, effective) =
                admin::set_tenant_limits(&config, tenant, reset, &changes).await?;
            println!("{}", admin::render_limits(&own, &effective));
        }
        Admin::Tenant(TenantCommand::Retention {
            tenant,
            transcripts,
            paused,
        }) => {
            if let Some(transcripts) = transcripts {
                let seconds =
                    retention::set_tenant_retention(&config, tenant, transcripts.0).await?;
                println!(
                    "transcripts kept {} after their sandbox ends",
                    humantime::format_duration(std::time::Duration::from_secs(seconds))
                );
            }
            if let Some(paused) = paused {
                let seconds =
                    retention::set_tenant_paused_retention(&config, tenant, paused.0).await?;
                println!(
                    "paused sandboxes kept {}",
                    humantime::format_duration(std::time::Duration::from_secs(seconds))
                );
            }
        }
        Admin::Tenant(TenantCommand::Packages {
            tenant,
            clear,
            allow,
            deny,
            remove,
            max_wheel_mb,
        }) => {
            let change = admin::PackagePolicyChange {
                clear,
                allow,
                deny,
                remove,
                max_wheel_mb: max_wheel_mb.map(|s| s.0),
            };
            let policy = admin::set_package_policy(&config, tenant, change).await?;
            println!("{}", admin::render_package_policy(&policy, &config));
        }
        Admin::Tenant(TenantCommand::Egress {
            tenant,
            deny_all,
            allow,
            remove,
            connections_per_minute,
            bytes_per_day,
            approvals,
            show: _,
        }) => {
            let change = egress::admin::EgressChange {
                deny_all,
                allow,
                remove,
                connections_per_minute,
                bytes_per_day,
                approvals,
            };
            let policy = egress::admin::set_egress(&config, tenant, &change).await?;
            println!("{}", egress::admin::render_egress(&policy));
        }
        Admin::Tenant(TenantCommand::Secret(command)) => run_secret(command, &config).await?,
        Admin::Tenant(TenantCommand::Purge { tenant }) => {
            let purged = retention::purge_tenant(&config, tenant).await?;
            println!("{}", retention::render_purged(&purged));
        }
        Admin::Audit {
            tenant,
            limit,
            packages: true,
        } => {
            let installs = admin::package_installs(&config, tenant, limit).await?;
            println!("{}", admin::render_package_installs(&installs));
        }
        Admin::Audit { tenant, limit, .. } => {
            let events = admin::audit(&config, tenant, limit).await?;
            println!("{}", admin::render_audit(&events));
        }
        Admin::Nodes(NodesCommand::List) => {
            let rows = admin::nodes(&config).await?;
            println!("{}", admin::render_nodes(&rows, config.node.liveness()));
        }
        Admin::Nodes(NodesCommand::Drain { id }) => {
            let row = admin::set_node_draining(&config, &id, true).await?;
            println!("node {} ({}) is draining", row.id, row.name);
        }
        Admin::Nodes(NodesCommand::Undrain { id }) => {
            let row = admin::set_node_draining(&config, &id, false).await?;
            println!("node {} ({}) takes new leases", row.id, row.name);
        }
        Admin::Sandboxes { tenant } => {
            let rows = admin::sandboxes(&config, tenant).await?;
            println!("{}", admin::render_sandboxes(&rows));
        }
        Admin::Keys(KeysCommand::Rotate) => {
            let kid = admin::rotate_keys(&config).await?;
            println!("{kid}");
        }
    }
    Ok(())
}
