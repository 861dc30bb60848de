//! 2025-11-25 sessions that survive a replica change: rmcp's [`SessionStore`] backed by
//! Postgres through [`SessionBindings`]. rmcp saves the client's `initialize` parameters after
//! the handshake; a replica that gets a request for a session it does not hold in memory loads
//! them and replays the handshake, so a load balancer needs no stickiness.
//!
//! The session id never reaches Postgres: the state is keyed by the same keyed hash as the
//! session's owner binding, and is loaded only while that binding is open. The binding
//! middleware ([`crate::sessions`]) runs first, so a session presented by another principal is
//! refused (404) before rmcp would restore it.

use rmcp::transport::streamable_http_server::session::store::{
    SessionState, SessionStore, SessionStoreError,
};
use sandgate_service::sessions::SessionBindings;

/// rmcp's session store over the Postgres session bindings.
#[derive(Debug, Clone)]
pub struct PgSessionStore {
    bindings: SessionBindings,
}

impl PgSessionStore {
    /// A store keyed like `bindings`.
    pub fn new(bindings: SessionBindings) -> Self {
        Self { bindings }
    }
}

#[async_trait::async_trait]
impl SessionStore for PgSessionStore {
    async fn load(&self, session_id: &str) -> Result<Option<SessionState>, SessionStoreError> {
        let session = self.bindings.hash(session_id.as_bytes());
        match self.bindings.load_state(session).await? {
            Some(state) => Ok(Some(serde_json::from_value(state)?)),
            None => Ok(None),
        }
    }

    async fn store(&self, session_id: &str, state: &SessionState) -> Result<(), SessionStoreError> {
        let session = self.bindings.hash(session_id.as_bytes());
        let state = serde_json::to_value(state)?;
        self.bindings.save_state(session, &state).await?;
        Ok(())
    }

    async fn delete(&self, session_id: &str) -> Result<(), SessionStoreError> {
        let session = self.bindings.hash(session_id.as_bytes());
        self.bindings.delete_state(session).await?;
        Ok(())
    }
}
