//! Opening a download link, one operation ([`LinkService::open`]):
//! - refused when the link was not sealed by us, has expired, or the app connection or token
//!   that made it was revoked (at once);
//! - rate-limited per link and per tenant;
//! - a file streams from the live sandbox chunk by chunk, never whole in memory, and opening it
//!   is not use of the sandbox (its idle clock is left alone);
//! - audited (`download_events`: tenant, link, sandbox, path, outcome, reason, bytes), written
//!   in the background once the outcome is known.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use chrono::Utc;
use futures::Stream;
use sandgate_sandbox::{ChannelError, FileChunks};
use sandgate_store::PgPool;
use sandgate_store::downloads::{DownloadEvent, DownloadKind, DownloadOutcome, DownloadReason};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{Claims, DownloadLinks, LinkKind, LinkLimit, LinkLimits, OpenedLink};
use crate::sandboxes::{ErrorKind, SandboxService, ServiceError};
use crate::transcripts::{Format, Subject, TranscriptError, Transcripts};

/// Why a download link gives nothing.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The link was not minted by us (or was altered).
    #[error("invalid link")]
    InvalidLink,
    /// The link's time is up.
    #[error("expired link")]
    Expired,
    /// The app connection (grant) or token that made the link was revoked.
    #[error("revoked link")]
    Revoked,
    /// The transcript the link names is no longer kept (past its retention, or purged).
    #[error("transcript no longer kept")]
    TranscriptGone,
    /// The link, or its tenant's links together, were opened too often.
    #[error("link opened too often")]
    RateLimited {
        /// Which limit.
        limit: LinkLimit,
        /// When a retry may succeed.
        retry_after: Duration,
    },
    /// The sandbox could not serve the file (or Postgres was away).
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl LinkError {
    /// Why the link gave nothing, as the audit trail records it and the gateway answers it
    /// (the one classification of a service failure for links).
    pub fn reason(&self) -> DownloadReason {
        match self {
            LinkError::InvalidLink => DownloadReason::Invalid,
            LinkError::Expired => DownloadReason::Expired,
            LinkError::Revoked => DownloadReason::Revoked,
            LinkError::TranscriptGone => DownloadReason::TranscriptGone,
            LinkError::RateLimited { .. } => DownloadReason::RateLimited,
            // By the catalogue's kind, as the gateway answers it (its `error.rs`).
            LinkError::Service(err) => match err.kind() {
                // Another tenant's sandbox reads like a missing one: gone for the link.
                ErrorKind::NotFound | ErrorKind::Ended | ErrorKind::Lost => {
                    DownloadReason::SandboxGone
                }
                ErrorKind::Unavailable | ErrorKind::NodeAway => DownloadReason::Unavailable,
                ErrorKind::QuotaExceeded | ErrorKind::Capacity => DownloadReason::Limit,
                // The agent refused: the file was moved, removed or grew past the size limit.
                ErrorKind::BadPath | ErrorKind::SandboxRefused | ErrorKind::Limit => {
                    DownloadReason::FileGone
                }
                ErrorKind::Internal
                | ErrorKind::SandboxFailed
                | ErrorKind::Timeout
                | ErrorKind::ConnectionLost
                | ErrorKind::InvalidParams
                | ErrorKind::NoSuchJob
                | ErrorKind::CommandFailed => DownloadReason::Internal,
            },
        }
    }

    /// The audited outcome: `failed` when serving went wrong on our side, else `refused` (the
    /// link may not be opened, now or at all).
    fn outcome(&self) -> DownloadOutcome {
        match self.reason() {
            DownloadReason::Unavailable | DownloadReason::Internal => DownloadOutcome::Failed,
            _ => DownloadOutcome::Refused,
        }
    }
}

/// What an opened link serves.
#[derive(Debug)]
pub enum Download {
    /// A file, streamed from its sandbox.
    File(Box<FileBody>),
    /// A transcript, rendered.
    Transcript(TranscriptDownload),
}

/// A rendered transcript behind a link.
#[derive(Debug)]
pub struct TranscriptDownload {
    /// The format it was rendered in.
    pub format: Format,
    /// What to call it in a file name: the sandbox id, or `conversation`.
    pub name: String,
    /// The rendering (untrusted content: the sandbox's output is in it).
    pub body: String,
}

/// Opens download links. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LinkService {
    links: DownloadLinks,
    limits: LinkLimits,
    db: PgPool,
    sandboxes: SandboxService,
    transcripts: Transcripts,
}

impl LinkService {
    /// Opens the links `links` sealed, under `limits`, from the sandboxes and transcripts.
    pub fn new(
        links: DownloadLinks,
        limits: LinkLimits,
        db: PgPool,
        sandboxes: SandboxService,
        transcripts: Transcripts,
    ) -> Self {
        Self {
            links,
            limits,
            db,
            sandboxes,
            transcripts,
        }
    }

    /// Every minute until `stop`, drops the rate-limit state of links (and tenants) not opened
    /// lately.
    pub fn start_housekeeping(&self, stop: CancellationToken, tasks: &TaskTracker) {
        let limits = self.limits.clone();
        tasks.spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(60));
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = every.tick() => limits.forget_idle(),
                }
            }
        });
    }

    /// Opens the link `token` (the part after `/files/`): what it serves, or why not. Every
    /// opening of a genuine link is audited.
    #[tracing::instrument(skip_all, fields(tenant_id, link_id))]
    pub async fn open(&self, token: &str) -> Result<Download, LinkError> {
        let link = self.links.open(token).ok_or(LinkError::InvalidLink)?;
        let span = tracing::Span::current();
        span.record("tenant_id", tracing::field::display(link.claims.t));
        span.record("link_id", link.id.as_str());
        let audit = Opening::new(self.db.clone(), &link);
        match self.serve(&link, &audit).await {
            Ok(download) => Ok(download),
            Err(err) => {
                audit.record(err.outcome(), Some(err.reason()), None);
                Err(err)
            }
        }
    }

    async fn serve(&self, link: &OpenedLink, audit: &Opening) -> Result<Download, LinkError> {
        let claims = &link.claims;
        if claims.e <= Utc::now().timestamp() {
            return Err(LinkError::Expired);
        }
        self.limits
            .check(link)
            .map_err(|(limit, retry_after)| LinkError::RateLimited { limit, retry_after })?;
        self.refuse_revoked(claims).await?;
        let format = match claims.k {
            LinkKind::File => {
                let (first, rest) = self
                    .sandboxes
                    .stream_file(claims.t, &claims.s, &claims.p)
                    .await?;
                return Ok(Download::File(Box::new(FileBody {
                    path: claims.p.clone(),
                    first: Some(first),
                    rest,
                    sent: 0,
                    audit: Some(audit.clone()),
                })));
            }
            LinkKind::Html => Format::Html,
            LinkKind::Notebook => Format::Notebook,
        };
        let (subject, name) = match &claims.c {
            Some(c) => (Subject::Conversation(c.clone()), "conversation".to_owned()),
            None => (Subject::Sandbox(claims.s.clone()), claims.s.clone()),
        };
        let body = self
            .transcripts
            .render(claims.t, &subject, format)
            .await
            .map_err(|err| match err {
                TranscriptError::NotFound { .. } => LinkError::TranscriptGone,
                TranscriptError::Store(_) => LinkError::Service(ServiceError::DatabaseAway),
                busy @ TranscriptError::Busy => LinkError::Service(busy.into()),
            })?;
        audit.record(DownloadOutcome::Ok, None, None);
        Ok(Download::Transcript(TranscriptDownload {
            format,
            name,
            body,
        }))
    }

    /// A link made under an app connection stops working once the connection is revoked, and
    /// one made with a token once that token is revoked.
    async fn refuse_revoked(&self, claims: &Claims) -> Result<(), LinkError> {
        if claims.g.is_none() && claims.j.is_none() {
            return Ok(());
        }
        let live = async {
            let mut conn = sandgate_store::acquire(&self.db).await?;
            if let Some(grant) = claims.g {
                match sandgate_store::grants::get(&mut conn, grant).await? {
                    Some(g) if g.revoked_at.is_none() && g.tenant_id == claims.t => {}
                    _ => return Ok(false),
                }
            }
            match &claims.j {
                Some(jti) => sandgate_store::grants::token_is_active(&mut conn, None, jti).await,
                None => Ok(true),
            }
        }
        .await;
        match live {
            Ok(true) => Ok(()),
            Ok(false) => Err(LinkError::Revoked),
            Err(_) => Err(LinkError::Service(ServiceError::DatabaseAway)),
        }
    }
}

/// The audit record of one opening, written once its outcome is known. Cheap to clone.
#[derive(Debug, Clone)]
struct Opening {
    db: PgPool,
    event: DownloadEvent,
}

impl Opening {
    fn new(db: PgPool, link: &OpenedLink) -> Self {
        let c = &link.claims;
        let kind = match c.k {
            LinkKind::File => DownloadKind::File,
            LinkKind::Notebook => DownloadKind::Notebook,
            LinkKind::Html => DownloadKind::Html,
        };
        Self {
            db,
            event: DownloadEvent {
                at: Utc::now(),
                tenant_id: c.t,
                link_id: link.id.clone(),
                grant_id: c.g,
                token_id: c.j.clone(),
                kind,
                sandbox_id: (!c.s.is_empty()).then(|| c.s.clone()),
                conversation_id: c.c.clone(),
                path: (!c.p.is_empty()).then(|| c.p.clone()),
                outcome: DownloadOutcome::Ok,
                reason: None,
                bytes: None,
            },
        }
    }

    /// Writes the event in the background (the answer does not wait for it).
    fn record(&self, outcome: DownloadOutcome, reason: Option<DownloadReason>, bytes: Option<u64>) {
        let mut event = self.event.clone();
        event.outcome = outcome;
        event.reason = reason;
        event.bytes = bytes.map(|b| i64::try_from(b).unwrap_or(i64::MAX));
        let db = self.db.clone();
        tokio::spawn(async move {
            let written = async {
                let mut conn = sandgate_store::acquire(&db).await?;
                sandgate_store::downloads::record(&mut conn, &event).await
            }
            .await;
            if let Err(err) = written {
                tracing::warn!(error = %err, tenant_id = %event.tenant_id, "auditing a download failed");
            }
        });
    }
}

/// The file stream from a sandbox broke off before its end.
#[derive(Debug, thiserror::Error)]
#[error("the file stream from the sandbox broke off")]
pub struct DownloadBroke(#[source] ChannelError);

/// A file's body as the sandbox sends it, audited when it ends: `ok` with the bytes sent,
/// `failed` when the stream broke (the body then ends with an error, so the downloader sees a
/// broken transfer, never a short file passed off as whole), `cancelled` when the downloader
/// went away first (the body was dropped before its end).
pub struct FileBody {
    path: String,
    first: Option<Bytes>,
    rest: FileChunks,
    sent: u64,
    audit: Option<Opening>,
}

impl std::fmt::Debug for FileBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBody")
            .field("path", &self.path)
            .field("sent", &self.sent)
            .finish_non_exhaustive()
    }
}

impl FileBody {
    /// The file's path in the sandbox.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The file's first bytes (up to 512: enough to tell its type), before any is sent.
    pub fn head(&self) -> &[u8] {
        self.first
            .as_deref()
            .map_or(&[], |b| &b[..b.len().min(512)])
    }
}

impl Stream for FileBody {
    type Item = Result<Bytes, DownloadBroke>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(first) = self.first.take()
            && !first.is_empty()
        {
            self.sent += first.len() as u64;
            return Poll::Ready(Some(Ok(first)));
        }
        let next = self.rest.as_mut().poll_next(cx);
        match &next {
            Poll::Ready(Some(Ok(chunk))) => self.sent += chunk.len() as u64,
            Poll::Ready(Some(Err(err))) => {
                tracing::warn!(error = %err, "a download broke off");
                if let Some(audit) = self.audit.take() {
                    audit.record(
                        DownloadOutcome::Failed,
                        Some(DownloadReason::Sandbox),
                        Some(self.sent),
                    );
                }
            }
            Poll::Ready(None) => {
                if let Some(audit) = self.audit.take() {
                    audit.record(DownloadOutcome::Ok, None, Some(self.sent));
                }
            }
            Poll::Pending => {}
        }
        next.map(|item| item.map(|chunk| chunk.map_err(DownloadBroke)))
    }
}

impl Drop for FileBody {
    fn drop(&mut self) {
        if let Some(audit) = self.audit.take() {
            audit.record(DownloadOutcome::Cancelled, None, Some(self.sent));
        }
    }
}
