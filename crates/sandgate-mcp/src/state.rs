//! What the MCP endpoint's handlers share.

use std::sync::Arc;

use sandgate_service::PgPool;
use sandgate_service::audit::AuditLog;
use sandgate_service::config::Config;
use sandgate_service::keys::KeyRing;
use sandgate_service::links::DownloadLinks;
use sandgate_service::sandboxes::SandboxService;
use sandgate_service::transcripts::Transcripts;

use crate::metrics::ToolMetrics;

/// The state handed to the MCP endpoint: the parts of the gateway's state the bearer guard and
/// the tools use. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The validated configuration.
    pub config: Arc<Config>,
    /// The Postgres pool (the bearer guard checks that a token's grant is live).
    pub db: PgPool,
    /// Verifying keys for access tokens.
    pub keys: KeyRing,
    /// Tenant-scoped sandboxes.
    pub sandboxes: SandboxService,
    /// The audit trail's writer.
    pub audit: AuditLog,
    /// Tool calls by tool and outcome.
    pub metrics: ToolMetrics,
    /// Expiring download links (`get_file`, `export_transcript`).
    pub links: DownloadLinks,
    /// Transcripts of what ran in sandboxes.
    pub transcripts: Transcripts,
    /// Who owns each MCP session (Postgres, keyed hashes of the ids).
    pub sessions: sandgate_service::sessions::SessionBindings,
    /// rmcp's sessions of this process (2025-11-25 era).
    pub mcp_sessions: Arc<crate::LocalSessionManager>,
}
