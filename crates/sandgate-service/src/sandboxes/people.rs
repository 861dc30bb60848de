//! People in the bot's sandbox (issue 28): what a tenant's user does from the console goes
//! through the same operations as the tools, and this module keeps the two things that differ.
//!
//! - The bot is told: a console run marks its sandbox (`sandboxes.people_acted_at`, by whom),
//!   and the bot's next cell or command takes the mark ([`SandboxService::take_people_note`]),
//!   once, as a note on its result.
//! - A person may interrupt any running call of a sandbox, the bot's too
//!   ([`SandboxService::interrupt_calls`]): the calls running in this process are registered
//!   here, and an interrupted one drops its sandbox call (which interrupts the cell or kills the
//!   command) and answers that a person interrupted it. The replica that serves the console
//!   interrupts its own calls at once, and tells the others through Postgres
//!   (`sandgate_store::interrupts`: a row and a notification of its id), whose listener
//!   ([`SandboxService::listen_for_interrupts`]) interrupts theirs. An interrupt notified while
//!   a replica's listener is reconnecting is lost for that replica (the person presses again).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use chrono::{DateTime, Utc};
use sandgate_store::interrupts::{self, InterruptListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::{SandboxService, ServiceError};

/// Pause before listening again after the interrupt listener lost or could not make its
/// connection.
const RELISTEN_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// The calls running in this process, by sandbox id.
#[derive(Debug, Clone)]
pub(crate) struct RunningCalls {
    calls: Arc<Mutex<HashMap<String, Vec<Arc<Interrupt>>>>>,
    /// This process, as the origin of the interrupts it asks other replicas for.
    origin: Uuid,
}

impl Default for RunningCalls {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
            origin: Uuid::new_v4(),
        }
    }
}

/// A running call's interrupt: cancelled by a person, whose email it keeps.
#[derive(Debug, Default)]
pub(crate) struct Interrupt {
    token: CancellationToken,
    by: OnceLock<String>,
}

impl Interrupt {
    /// Resolves when a person interrupted the call, with their email.
    pub(crate) async fn wait(&self) -> String {
        self.token.cancelled().await;
        self.by.get().cloned().unwrap_or_default()
    }
}

/// Keeps a call registered while it runs.
#[derive(Debug)]
pub(crate) struct Registered {
    calls: RunningCalls,
    sandbox_id: String,
    pub(crate) interrupt: Arc<Interrupt>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut calls = self.calls.calls.lock().expect("running calls");
        if let Some(list) = calls.get_mut(&self.sandbox_id) {
            list.retain(|i| !Arc::ptr_eq(i, &self.interrupt));
            if list.is_empty() {
                calls.remove(&self.sandbox_id);
            }
        }
    }
}

impl RunningCalls {
    /// Registers a call into `sandbox_id` until the returned guard drops.
    pub(crate) fn register(&self, sandbox_id: &str) -> Registered {
        let interrupt = Arc::new(Interrupt::default());
        self.calls
            .lock()
            .expect("running calls")
            .entry(sandbox_id.to_owned())
            .or_default()
            .push(interrupt.clone());
        Registered {
            calls: self.clone(),
            sandbox_id: sandbox_id.to_owned(),
            interrupt,
        }
    }

    /// Interrupts every call running in `sandbox_id`; how many.
    fn interrupt(&self, sandbox_id: &str, by: &str) -> usize {
        let calls = self.calls.lock().expect("running calls");
        let list = calls.get(sandbox_id).map_or(&[][..], Vec::as_slice);
        for call in list {
            let _ = call.by.set(by.to_owned());
            call.token.cancel();
        }
        list.len()
    }
}

/// What the bot is told about people who acted in its sandbox since its last call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeopleNote {
    /// The last person who acted (their email).
    pub by: String,
    /// When.
    pub at: DateTime<Utc>,
}

impl PeopleNote {
    /// The sentence on the bot's tool result.
    pub fn text(&self) -> String {
        format!(
            "[note: a person ({}) acted in this sandbox from the sandgate console since your last \
             call, most recently at {}; variables and files may have changed: see \
             export_transcript for what they ran]",
            self.by,
            self.at.format("%H:%M:%S UTC")
        )
    }
}

impl SandboxService {
    /// Interrupts every call running in the tenant's sandbox `sandbox_id` (the bot's and
    /// people's) in this process, as `by`; how many. Another tenant's sandbox is `NotFound`.
    pub async fn interrupt_calls(
        &self,
        tenant: Uuid,
        sandbox_id: &str,
        by: &str,
    ) -> Result<usize, ServiceError> {
        let mut conn = self.db.acquire().await?;
        sandgate_store::sandboxes::get(&mut conn, tenant, sandbox_id)
            .await?
            .ok_or_else(|| ServiceError::NotFound(sandbox_id.to_owned()))?;
        let here = self.running.interrupt(sandbox_id, by);
        // The other replicas' calls in this sandbox.
        interrupts::request(&mut conn, tenant, sandbox_id, by, self.running.origin).await?;
        Ok(here)
    }

    /// Interrupts this process's calls that other replicas' consoles ask to interrupt, until
    /// `stop`, on `tasks`; listening again after a lost connection.
    pub fn listen_for_interrupts(&self, stop: CancellationToken, tasks: &TaskTracker) {
        let service = self.clone();
        tasks.spawn(async move {
            loop {
                let connected = tokio::select! {
                    () = stop.cancelled() => return,
                    connected = InterruptListener::connect(&service.db) => connected,
                };
                match connected {
                    Ok(listener) => service.follow_interrupts(listener, &stop).await,
                    Err(err) => tracing::warn!(
                        error = %err,
                        "cannot listen for other replicas' interrupts; trying again"
                    ),
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(RELISTEN_EVERY) => {}
                }
            }
        });
    }

    async fn follow_interrupts(&self, mut listener: InterruptListener, stop: &CancellationToken) {
        loop {
            let next = tokio::select! {
                () = stop.cancelled() => return,
                next = listener.next() => next,
            };
            match next {
                Ok(Some(Some(id))) => self.interrupt_as_asked(id).await,
                Ok(Some(None)) => tracing::warn!("an interrupt notification that is not an id"),
                Ok(None) => tracing::info!(
                    "the interrupt listener reconnected; interrupts in between were missed"
                ),
                Err(err) => {
                    tracing::warn!(error = %err, "the interrupt listener lost its connection");
                    return;
                }
            }
        }
    }

    /// Interrupts this process's calls in the sandbox of interrupt `id`, unless this process
    /// asked for it (and interrupted them already).
    async fn interrupt_as_asked(&self, id: i64) {
        let asked = async {
            let mut conn = self.db.acquire().await?;
            interrupts::get(&mut conn, id).await
        }
        .await;
        match asked {
            Ok(Some(row)) if row.origin != self.running.origin => {
                let stopped = self.running.interrupt(&row.sandbox_id, &row.by_email);
                tracing::info!(sandbox_id = %row.sandbox_id, stopped, "interrupted at another replica's request");
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(error = %err, id, "cannot read another replica's interrupt");
            }
        }
    }

    /// Marks that the person `by` acted in `sandbox_id` now.
    pub(crate) async fn people_acted(&self, sandbox_id: &str, by: &str) {
        let marked = async {
            let mut conn = self.db.acquire().await?;
            sqlx::query(
                "UPDATE sandboxes SET people_acted_at = now(), people_acted_by = $2 WHERE id = $1",
            )
            .bind(sandbox_id)
            .bind(by)
            .execute(&mut *conn)
            .await
        }
        .await;
        if let Err(err) = marked {
            tracing::warn!(error = %err, sandbox_id, "marking a person's action failed; the bot is not told of it");
        }
    }

    /// The note for the bot when people acted in the tenant's `sandbox_id` since it was last
    /// told; taken once (the next call gets none until people act again).
    pub async fn take_people_note(
        &self,
        tenant: Uuid,
        sandbox_id: &str,
    ) -> Result<Option<PeopleNote>, ServiceError> {
        let mut conn = self.db.acquire().await?;
        let row: Option<(Option<String>, DateTime<Utc>)> = sqlx::query_as(
            "UPDATE sandboxes SET people_told_at = now()
             WHERE id = $1 AND tenant_id = $2 AND people_acted_at IS NOT NULL
               AND (people_told_at IS NULL OR people_told_at < people_acted_at)
             RETURNING people_acted_by, people_acted_at",
        )
        .bind(sandbox_id)
        .bind(tenant)
        .fetch_optional(&mut *conn)
        .await
        .map_err(sandgate_store::StoreError::from)?;
        Ok(row.map(|(by, at)| PeopleNote {
            by: by.unwrap_or_else(|| "someone".to_owned()),
            at,
        }))
    }
}

/// A conversation as the console lists it.
pub use sandgate_store::conversations::ConversationLine;

/// Most conversations the console lists at once.
pub const MAX_CONVERSATIONS_LISTED: i64 = 100;

impl SandboxService {
    /// The tenant's conversations, most recently active first (at most
    /// [`MAX_CONVERSATIONS_LISTED`]); with `search`, those whose id contains it.
    #[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
    pub async fn conversations(
        &self,
        tenant: Uuid,
        search: Option<&str>,
    ) -> Result<Vec<ConversationLine>, ServiceError> {
        let mut conn = self.db.acquire().await?;
        Ok(
            sandgate_store::conversations::list(
                &mut conn,
                tenant,
                search,
                MAX_CONVERSATIONS_LISTED,
            )
            .await?,
        )
    }

    /// The live sandbox of the tenant's conversation, if it has one.
    #[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
    pub async fn live_sandbox_of(
        &self,
        tenant: Uuid,
        conversation: &str,
    ) -> Result<Option<sandgate_store::sandboxes::SandboxRow>, ServiceError> {
        let mut conn = self.db.acquire().await?;
        Ok(sandgate_store::sandboxes::by_conversation(&mut conn, tenant, conversation).await?)
    }

    /// The caller for a tenant's user acting from the console: the tenant's limits, audited as
    /// `user:<email>`.
    pub async fn person_caller(
        &self,
        tenant: Uuid,
        user_id: Uuid,
        email: &str,
    ) -> Result<super::Caller, ServiceError> {
        Ok(super::Caller {
            tenant,
            subject: format!("user:{email}"),
            token_id: format!("console:{user_id}"),
            grant: None,
            limits: self.limits(tenant).await?,
            read_at_admission: None,
            person: Some(email.to_owned()),
        })
    }
}
