//! Who is calling and the limits in force for them.

use sandgate_sandbox::SandboxProfile;
use sandgate_store::sandboxes::SandboxRow;
use sandgate_store::tenants::TenantLimits;
use uuid::Uuid;

use crate::config::LimitsConfig;

/// Who is calling: the verified token's tenant and ids, and the limits in force for it.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant whose sandboxes the call may reach.
    pub tenant: Uuid,
    /// The token's subject.
    pub subject: String,
    /// The token's id (audit).
    pub token_id: String,
    /// The OAuth grant the token was issued under, recorded on sandboxes it leases.
    pub grant: Option<Uuid>,
    /// The tenant's limits (its own where set, else the configured defaults).
    pub limits: Limits,
    /// The sandbox the call names, as read in the statement that admitted the call
    /// ([`super::SandboxService::admit_naming`]); `None` when it named none or was admitted
    /// without it. Saves the lookup's read while the sandbox's idle clock needs no write.
    pub read_at_admission: Option<SandboxRow>,
    /// The tenant's user acting from the console (their email); `None` for a token's caller
    /// (the bot). A person's cells and commands are marked with it in the transcript, and the
    /// bot is told of them.
    pub person: Option<String>,
}

/// A tenant's limits in force: its own (Postgres) where set, else the gateway's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Most live sandboxes at once.
    pub max_sandboxes: u32,
    /// Idle timeout of a sandbox when the caller names none, seconds.
    pub default_idle_seconds: u32,
    /// Longest idle timeout a caller may ask for, seconds.
    pub max_idle_seconds: u32,
    /// Hard lifetime of a sandbox, seconds.
    pub max_lifetime_seconds: u32,
    /// Memory per sandbox, MiB.
    pub memory_mb: u64,
    /// CPU quota per sandbox, cores.
    pub cpus: f64,
    /// Most tool calls started per minute.
    pub max_calls_per_minute: u32,
    /// Most open MCP sessions.
    pub max_sessions: u32,
    /// Most tool calls running at once.
    pub max_calls_in_flight: u32,
}

impl Limits {
    /// Combines a tenant's own limits with the configured defaults and the profile's resources.
    pub fn effective(
        own: &TenantLimits,
        defaults: &LimitsConfig,
        profile: &SandboxProfile,
    ) -> Self {
        let pick = |own: Option<i32>, default: u32| {
            own.and_then(|v| u32::try_from(v).ok()).unwrap_or(default)
        };
        let max_idle_seconds = pick(own.max_idle_seconds, defaults.max_idle_timeout_seconds);
        Self {
            max_sandboxes: pick(own.max_sandboxes, defaults.max_sandboxes),
            default_idle_seconds: defaults.idle_timeout_seconds.min(max_idle_seconds),
            max_idle_seconds,
            max_lifetime_seconds: pick(own.max_lifetime_seconds, defaults.max_lifetime_seconds),
            memory_mb: own
                .memory_mb
                .and_then(|v| u64::try_from(v).ok())
                .unwrap_or(profile.memory_mb),
            cpus: own.cpus.map_or(profile.cpus, f64::from),
            max_calls_per_minute: pick(own.max_calls_per_minute, defaults.max_calls_per_minute),
            max_sessions: pick(own.max_sessions, defaults.max_sessions),
            max_calls_in_flight: pick(own.max_calls_in_flight, defaults.max_calls_in_flight),
        }
    }

    /// The profile a sandbox of this tenant is made from: `base` with the tenant's memory and
    /// CPU.
    pub fn profile(&self, base: &SandboxProfile) -> SandboxProfile {
        SandboxProfile {
            memory_mb: self.memory_mb,
            cpus: self.cpus,
            ..base.clone()
        }
    }
}
