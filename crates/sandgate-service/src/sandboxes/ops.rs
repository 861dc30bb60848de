//! What the file and job tools do to a sandbox, apart from how a face (MCP, a download link)
//! encodes the call and the answer.

use bytes::Bytes;
use sandgate_sandbox::{AgentError, EntryKind, FileChunks, FileInfo, Job, Listing, SandboxError};
use sandgate_store::sandboxes::{self, SandboxState};
use uuid::Uuid;

use super::{Caller, Resolved, SandboxService, ServiceError};

/// Which sandbox a call is for: the named one, else the conversation's (leased on demand), else
/// a new unbound one; and the idle timeout the call asks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct Target<'a> {
    /// The sandbox the caller named.
    pub sandbox_id: Option<&'a str>,
    /// The conversation the call belongs to.
    pub conversation: Option<&'a str>,
    /// The idle timeout the call asks for, seconds.
    pub keep_alive: Option<u32>,
}

/// What a bounded read of a file found.
#[derive(Debug)]
pub enum BoundedRead {
    /// The file, whole.
    Read(Vec<u8>, FileInfo),
    /// The file is bigger than the bound; its size when the sandbox said it.
    TooLarge {
        /// The file's size, bytes.
        size: Option<u64>,
    },
}

impl SandboxService {
    /// The sandbox a call is for (see [`Target`]), its idle clock refreshed.
    pub async fn resolve_target(
        &self,
        caller: &Caller,
        target: Target<'_>,
    ) -> Result<Resolved, ServiceError> {
        self.resolve(
            caller,
            target.sandbox_id,
            target.conversation,
            target.keep_alive,
        )
        .await
    }

    /// Writes `data` to `path` (under /home/user) in the target sandbox; refuses a file larger
    /// than `limits.max_file_bytes` before a sandbox is touched.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn upload_file(
        &self,
        caller: &Caller,
        target: Target<'_>,
        path: &str,
        data: &[u8],
        overwrite: bool,
    ) -> Result<(Resolved, FileInfo), ServiceError> {
        let max = self.limits.max_file_bytes;
        if data.len() as u64 > max {
            return Err(ServiceError::Limit {
                limit: "max file size",
                value: format!("{max} bytes; this file has {}", data.len()),
                hint: "upload a smaller file (e.g. compress it or split it)",
            });
        }
        let resolved = self.resolve_target(caller, target).await?;
        tracing::Span::current().record("sandbox_id", &resolved.row.id);
        let written = resolved.sandbox.write_file(path, data, overwrite).await;
        let info = self.checked(&resolved, written).await?;
        if let Some(person) = &caller.person {
            self.people_acted(&resolved.row.id, person).await;
        }
        Ok((resolved, info))
    }

    /// Reads `path` from the target sandbox, up to `limits.max_file_bytes`.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn read_file(
        &self,
        caller: &Caller,
        target: Target<'_>,
        path: &str,
    ) -> Result<(Resolved, Vec<u8>, FileInfo), ServiceError> {
        let resolved = self.resolve_target(caller, target).await?;
        tracing::Span::current().record("sandbox_id", &resolved.row.id);
        let read = resolved
            .sandbox
            .read_file(path, self.limits.max_file_bytes)
            .await;
        let (data, info) = self.checked(&resolved, read).await?;
        Ok((resolved, data, info))
    }

    /// Reads `path` from a resolved sandbox if it is at most `max_bytes`; a bigger file is
    /// [`BoundedRead::TooLarge`] (its size, when the sandbox said it), never read whole.
    pub async fn read_file_bounded(
        &self,
        resolved: &Resolved,
        path: &str,
        max_bytes: u64,
    ) -> Result<BoundedRead, ServiceError> {
        match resolved.sandbox.read_file(path, max_bytes).await {
            Ok((data, info)) => Ok(BoundedRead::Read(data, info)),
            Err(SandboxError::Channel(sandgate_sandbox::ChannelError::Agent(
                AgentError::TooLarge { size, .. },
            ))) => Ok(BoundedRead::TooLarge { size }),
            Err(err) => Err(self.check_death(resolved, err).await),
        }
    }

    /// Streams `path` (absolute, under /home/user) from a tenant's live sandbox, for a download
    /// link: the first chunk once it has arrived, then the rest as the sandbox sends it (up to
    /// `limits.max_file_bytes`), never the whole file in memory. Opening a link is not use of
    /// the sandbox: its idle clock is neither touched nor held (the reaper may end it meanwhile,
    /// which ends the stream). Another tenant's sandbox is `NotFound`, like a missing one.
    #[tracing::instrument(skip_all, fields(tenant_id = %tenant, sandbox_id = %sandbox_id))]
    pub async fn stream_file(
        &self,
        tenant: Uuid,
        sandbox_id: &str,
        path: &str,
    ) -> Result<(Bytes, FileChunks), ServiceError> {
        let mut conn = self.db.acquire().await?;
        let row = sandboxes::get(&mut conn, tenant, sandbox_id)
            .await?
            .ok_or_else(|| ServiceError::NotFound(sandbox_id.to_owned()))?;
        drop(conn);
        if row.state != SandboxState::Leased || self.due_and_unused(&row).await? {
            return Err(super::ended_error(&row));
        }
        let sandbox = self.handle(&row).await?;
        match sandbox
            .read_file_stream(path, self.limits.max_file_bytes)
            .await
        {
            Ok(stream) => Ok(stream),
            Err(SandboxError::Died { fate, .. }) => {
                Err(self.lose(&row.id, super::describe_fate(&fate)).await)
            }
            Err(err) => Err(err.into()),
        }
    }

    /// Lists the directory `path` in the target sandbox.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn list_files(
        &self,
        caller: &Caller,
        target: Target<'_>,
        path: &str,
    ) -> Result<(Resolved, Listing), ServiceError> {
        let resolved = self.resolve_target(caller, target).await?;
        tracing::Span::current().record("sandbox_id", &resolved.row.id);
        let listing = resolved.sandbox.list(path).await;
        let listing = self.checked(&resolved, listing).await?;
        Ok((resolved, listing))
    }

    /// The regular files under /home/user of a resolved sandbox, as (absolute path, size):
    /// at most `max_files`, at most `max_depth` directories deep, hidden directories skipped.
    /// Directories that cannot be read are skipped.
    pub async fn walk_files(
        &self,
        resolved: &Resolved,
        max_files: usize,
        max_depth: usize,
    ) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        let mut dirs = vec![("/home/user".to_owned(), 0usize)];
        while let Some((dir, depth)) = dirs.pop() {
            let Ok(entries) = resolved.sandbox.list_dir(&dir).await else {
                continue;
            };
            for entry in entries {
                let path = format!("{dir}/{}", entry.name);
                match entry.kind {
                    EntryKind::Dir if depth + 1 < max_depth && !entry.name.starts_with('.') => {
                        dirs.push((path, depth + 1));
                    }
                    EntryKind::File if out.len() < max_files => out.push((path, entry.size)),
                    _ => {}
                }
            }
        }
        out
    }

    /// Starts `command` as a background job in the target sandbox: it outlives the call and
    /// the sweeps that end a call's processes, until it exits or [`Self::kill_job`] ends it.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn start_job(
        &self,
        caller: &Caller,
        target: Target<'_>,
        command: &str,
        cwd: Option<&str>,
    ) -> Result<(Resolved, Job), ServiceError> {
        let resolved = self.resolve_target(caller, target).await?;
        tracing::Span::current().record("sandbox_id", &resolved.row.id);
        let started = resolved.sandbox.start_job(command, cwd).await;
        let job = self.checked(&resolved, started).await?;
        Ok((resolved, job))
    }

    /// The target sandbox's background jobs, running and recently ended.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn jobs(
        &self,
        caller: &Caller,
        target: Target<'_>,
    ) -> Result<(Resolved, Vec<Job>), ServiceError> {
        let resolved = self.resolve_target(caller, target).await?;
        tracing::Span::current().record("sandbox_id", &resolved.row.id);
        let jobs = resolved.sandbox.jobs().await;
        let jobs = self.checked(&resolved, jobs).await?;
        Ok((resolved, jobs))
    }

    /// Kills the background job `job` of the target sandbox and everything it started; returns
    /// the job as it ended.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn kill_job(
        &self,
        caller: &Caller,
        target: Target<'_>,
        job: &str,
    ) -> Result<(Resolved, Job), ServiceError> {
        let resolved = self.resolve_target(caller, target).await?;
        tracing::Span::current().record("sandbox_id", &resolved.row.id);
        let killed = resolved.sandbox.kill_job(job).await;
        match self.checked(&resolved, killed).await {
            Ok(ended) => Ok((resolved, ended)),
            Err(ServiceError::Refused(AgentError::NotFound { .. })) => {
                Err(ServiceError::NoSuchJob {
                    job_id: job.to_owned(),
                })
            }
            Err(err) => Err(err),
        }
    }
}
