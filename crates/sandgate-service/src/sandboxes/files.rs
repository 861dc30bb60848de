//! The files-only pause (issue 27, DESIGN §4a): where a sandbox's runtime cannot checkpoint (runc
//! here, an engine without the tools), a pause keeps its files instead of its memory.
//!
//! - **Pause**: the sandbox's own agent, as the sandbox user, writes a gzip'd tar of /home/user
//!   (links stored as links, never followed; sockets, pipes and unreadable files left out and
//!   named) with the list of pip's user installs (`name==version` of every distribution under
//!   the user site, /opt/packages: what `install_packages` or a cell's `pip install` put there)
//!   into a file of its home; the service reads it back through the agent, seals it in this
//!   process under a fresh data key bound to the tenant, sandbox and snapshot id (the snapshot
//!   keys and sealed format of a checkpoint, [`sandgate_sandbox::FilesSealer`]) into the same
//!   snapshot store, and records it as a snapshot row (counted in the tenant's storage quota
//!   and `max_paused`, deleted by purge, retention and close like any snapshot). The row is
//!   `paused` with `paused_kind = files`; the container is removed.
//! - **Resume**: a fresh sandbox under the same `sandbox_id`; the archive, opened here, is
//!   written into it in parts and unpacked by a script that writes only under /home/user (every
//!   parent of a path must be a real directory there, files are created with `O_NOFOLLOW |
//!   O_EXCL`, no absolute or `..` paths, hard links only to files under /home/user, no devices
//!   or pipes, no set-id bits); the listed packages are installed again through the package
//!   index where packages are on, else named as not reinstalled. The call says `state_lost`.
//!
//! Bounded by the quota: an archive larger than what the tenant's storage quota has left (or
//! that does not fit beside the files in /home/user) refuses the pause; the reaper then closes
//! the sandbox as it would without pauses, and logs why.

use std::time::Duration;

use sandgate_node::SandboxHandle;
use sandgate_sandbox::{CommandOptions, FilesOpener, FilesSealer};
use sandgate_store::pauses::{self, PausedKind};
use sandgate_store::sandboxes::SandboxRow;
use sandgate_store::snapshots;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

use super::pause::{Pausing, snapshot_error, store_failed};
use super::{Caller, SandboxService, ServiceError};
use crate::snapshots::{SnapshotCustody, SnapshotStoreError};

/// How long the archive's making or unpacking may take in the sandbox.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long reinstalling the listed packages may take.
const PIP_TIMEOUT: Duration = Duration::from_secs(600);
/// The archive goes into a fresh sandbox in parts of this size (each one `write_file`).
const PART_BYTES: usize = 4 << 20;
/// What `state_lost_reason` says of a files-only resume.
pub const RESUMED_FROM_FILES: &str = "resumed from files: variables were not kept";

/// Makes the archive, run by the sandbox user in the sandbox (`python3 -I - NAME HOME`).
const ARCHIVE_SCRIPT: &str = r#"
import glob, io, json, os, sys, tarfile
name, home = sys.argv[1], sys.argv[2]
out_path = os.path.join(home, name)
skipped = []

def packages():
    try:
        import importlib.metadata as md
        found = set()
        user_site = glob.glob("/opt/packages/lib/python3*/site-packages")
        for dist in md.distributions(path=user_site):
            if dist.metadata["Name"]:
                found.add(dist.metadata["Name"] + "==" + dist.version)
        return sorted(found)
    except Exception:
        return []

def nofollow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW)

fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
with os.fdopen(fd, "wb") as raw, tarfile.open(
    fileobj=raw, mode="w:gz", compresslevel=1, format=tarfile.PAX_FORMAT
) as tar:
    def add(path, arc):
        try:
            info = tar.gettarinfo(path, arc)
        except OSError:
            skipped.append(arc[5:])
            return
        if info is None:
            skipped.append(arc[5:])
        elif info.isdir():
            tar.addfile(info)
            try:
                names = sorted(os.listdir(path))
            except OSError:
                skipped.append(arc[5:] + "/")
                return
            for entry in names:
                if arc == "home" and entry == name:
                    continue
                add(os.path.join(path, entry), arc + "/" + entry)
        elif info.isreg():
            try:
                f = open(path, "rb", opener=nofollow)
            except OSError:
                skipped.append(arc[5:])
                return
            with f:
                tar.addfile(info, f)
        elif info.issym() or info.islnk():
            tar.addfile(info)
        else:
            skipped.append(arc[5:])
    add(home, "home")
    data = json.dumps({"packages": packages()}).encode()
    info = tarfile.TarInfo("sandgate/packages.json")
    info.size = len(data)
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))
print(json.dumps({"bytes": os.path.getsize(out_path), "skipped": skipped[:20],
                  "skipped_count": len(skipped)}))
"#;

/// Unpacks the archive's parts into /home/user, run by the sandbox user in the fresh sandbox
/// (`python3 -I - PREFIX COUNT HOME`). Writes only under HOME; reports what it refused.
const RESTORE_SCRIPT: &str = r#"
import io, json, os, shutil, stat, sys, tarfile
prefix, count, home = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def nofollow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW)

class Parts(io.RawIOBase):
    def __init__(self):
        self.i, self.f = 0, None
    def readable(self):
        return True
    def readinto(self, b):
        while True:
            if self.f is None:
                if self.i >= count:
                    return 0
                p = os.path.join(home, "%s.%d" % (prefix, self.i))
                self.f = open(p, "rb", opener=nofollow)
                os.unlink(p)
                self.i += 1
            n = self.f.readinto(b)
            if n:
                return n
            self.f.close()
            self.f = None

def relative(name):
    if not name.startswith("home/"):
        return None
    rel = name[5:]
    parts = rel.split("/")
    if not rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        return None
    return rel

def under_home(rel):
    cur = home
    for part in rel.split("/")[:-1]:
        cur = os.path.join(cur, part)
        try:
            if not stat.S_ISDIR(os.lstat(cur).st_mode):
                return None
        except OSError:
            return None
    return os.path.join(home, rel)

restored, refused, packages, error, modes = 0, [], [], None, []
try:
    with tarfile.open(fileobj=io.BufferedReader(Parts(), 1 << 20), mode="r|gz") as tar:
        for m in tar:
            if m.name == "sandgate/packages.json":
                if m.isreg() and m.size < (1 << 20):
                    packages = json.load(tar.extractfile(m)).get("packages", [])
                continue
            if m.name == "home":
                continue
            rel = relative(m.name)
            dest = under_home(rel) if rel else None
            if dest is None:
                refused.append(m.name)
                continue
            mode = m.mode & 0o777
            try:
                if m.isdir():
                    try:
                        os.mkdir(dest, 0o700)
                    except FileExistsError:
                        if not stat.S_ISDIR(os.lstat(dest).st_mode):
                            raise
                    modes.append((dest, mode))
                elif m.isreg():
                    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        shutil.copyfileobj(tar.extractfile(m), f, 1 << 20)
                        os.fchmod(f.fileno(), mode)
                    os.utime(dest, (m.mtime, m.mtime), follow_symlinks=False)
                elif m.issym():
                    os.symlink(m.linkname, dest)
                elif m.islnk():
                    target_rel = relative(m.linkname)
                    target = under_home(target_rel) if target_rel else None
                    if target is None or not stat.S_ISREG(os.lstat(target).st_mode):
                        refused.append(m.name)
                        continue
                    os.link(target, dest, follow_symlinks=False)
                else:
                    refused.append(m.name)
                    continue
                restored += 1
            except OSError:
                refused.append(m.name)
except Exception as e:
    error = "%s: %s" % (type(e).__name__, e)
finally:
    for i in range(count):
        try:
            os.unlink(os.path.join(home, "%s.%d" % (prefix, i)))
        except OSError:
            pass
for dest, mode in reversed(modes):
    try:
        os.chmod(dest, mode)
    except OSError:
        pass
print(json.dumps({"restored": restored, "refused": [r[5:] if r.startswith("home/") else r
                  for r in refused[:20]], "refused_count": len(refused), "packages": packages,
                  "error": error}))
"#;

/// What the archive script reported.
#[derive(Debug, Deserialize)]
struct Archived {
    bytes: u64,
    skipped: Vec<String>,
    skipped_count: usize,
}

/// What the restore script reported.
#[derive(Debug, Deserialize)]
struct Unpacked {
    refused: Vec<String>,
    refused_count: usize,
    packages: Vec<String>,
    error: Option<String>,
}

/// What a resume from files restored, and what not.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FilesResume {
    /// Packages installed again (`name==version`).
    pub packages_reinstalled: Vec<String>,
    /// Packages listed at the pause that are not installed again.
    pub packages_not_reinstalled: Vec<String>,
    /// Why those were not, when some were not.
    pub packages_note: Option<String>,
    /// Paths under /home/user the archive held that were not restored (at most 20), with the
    /// reason when the archive could not be read to its end.
    pub files_not_restored: Vec<String>,
}

impl FilesResume {
    /// One line for the model about what did not come back, if anything.
    pub fn missing_note(&self) -> Option<String> {
        let mut parts = Vec::new();
        if !self.packages_not_reinstalled.is_empty() {
            parts.push(format!(
                "packages not reinstalled: {} ({})",
                self.packages_not_reinstalled.join(", "),
                self.packages_note.as_deref().unwrap_or("unknown reason")
            ));
        }
        if !self.files_not_restored.is_empty() {
            parts.push(format!(
                "files not restored: {}",
                self.files_not_restored.join(", ")
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// The refusal of a files-only pause (the reaper closes the sandbox instead).
fn refused(value: String) -> ServiceError {
    ServiceError::Limit {
        limit: "files-only pause",
        value,
        hint: "free space in /home/user, or ask the operator for a larger \
               snapshots.tenant_max_bytes; an idle sandbox that cannot be paused is closed",
    }
}

/// A random file name in /home/user for the archive (or its parts).
fn archive_name(what: &str) -> String {
    format!(".sandgate-{what}-{}", uuid::Uuid::new_v4().simple())
}

/// The sandbox's home, where the archive is made and restored.
const HOME: &str = "/home/user";

/// `/usr/bin/python3 -I - ARGS` with `script` on its stdin, as one bash line: the image's own
/// interpreter by its path, isolated from the environment and the user's site (a sandbox's
/// `~/.profile` may change PATH or PYTHON* variables).
fn python(script: &str, args: &[&str]) -> String {
    format!(
        "/usr/bin/python3 -I - {} <<'SANDGATE_SCRIPT_END'\n{script}\nSANDGATE_SCRIPT_END",
        args.join(" ")
    )
}

fn script_options() -> CommandOptions {
    CommandOptions {
        timeout: SCRIPT_TIMEOUT,
        output_limit: 256 << 10,
        cwd: None,
    }
}

impl SandboxService {
    /// Keeps a `pausing` sandbox's files (its runtime cannot checkpoint): the archive sealed
    /// into the store, its row recorded and the sandbox `paused` (files) in one transaction.
    /// The container still runs when this returns; the caller removes it. A refusal (over the
    /// quota, no room for the archive, the archive failing) is [`ServiceError::Limit`].
    #[tracing::instrument(skip_all, fields(sandbox_id = %row.id))]
    pub(super) async fn pause_files(
        &self,
        pausing: &Pausing,
        row: &SandboxRow,
    ) -> Result<SandboxRow, ServiceError> {
        let tenant = row.tenant_id.expect("a leased sandbox has a tenant");
        let sandbox = self.handle(row).await?;
        let left = {
            let mut conn = self.db.acquire().await?;
            let used = snapshots::sealed_bytes_of_tenant(&mut conn, tenant).await?;
            pausing.tenant_max_bytes.saturating_sub(used)
        };
        let name = archive_name("pause");
        let made = sandbox
            .command(
                &python(ARCHIVE_SCRIPT, &[&name, HOME]),
                script_options(),
                None,
            )
            .await?;
        let archived = match (
            made.exit_code,
            serde_json::from_str::<Archived>(made.stdout.trim()),
        ) {
            (Some(0), Ok(archived)) => archived,
            _ => {
                let _ = sandbox
                    .command(&format!("rm -f -- {name}"), script_options(), None)
                    .await;
                let why = made
                    .stderr
                    .lines()
                    .last()
                    .unwrap_or("no message")
                    .to_owned();
                return Err(refused(format!(
                    "archiving /home/user failed ({why}); it may not fit beside the files"
                )));
            }
        };
        if archived.skipped_count > 0 {
            tracing::info!(skipped = archived.skipped_count, first = ?archived.skipped, "a files-only pause left out what is not a file, directory or link, or not readable");
        }
        // The sealed stream is the archive, a header and 16 bytes per 64 KiB chunk.
        let sealed_estimate = archived.bytes + archived.bytes / 4096 + 4096;
        if sealed_estimate > left {
            let _ = sandbox
                .command(&format!("rm -f -- {name}"), script_options(), None)
                .await;
            return Err(refused(format!(
                "its files' archive ({} bytes) is larger than the {left} bytes the tenant's \
                 snapshot storage quota (snapshots.tenant_max_bytes) has left",
                archived.bytes
            )));
        }
        let sealed = self
            .seal_archive(pausing, row, &sandbox, &name, archived.bytes)
            .await;
        let _ = sandbox
            .command(&format!("rm -f -- {name}"), script_options(), None)
            .await;
        let (snapshot_id, pending) = sealed?;
        let recorded = async {
            let mut tx = self.db.begin().await?;
            pending.record(&mut tx).await?;
            let paused =
                pauses::finish_pause(&mut tx, row, &snapshot_id, PausedKind::Files).await?;
            if paused.is_some() {
                tx.commit().await?;
            }
            Ok::<_, ServiceError>(paused)
        }
        .await;
        match recorded {
            Ok(Some(paused)) => Ok(paused),
            other => {
                // Nothing records these bytes (no row holds their key): they go.
                let _ = pausing.store.delete(tenant, &snapshot_id).await;
                match other {
                    Err(err) => Err(err),
                    _ => Err(ServiceError::NotFound(row.id.clone())),
                }
            }
        }
    }

    /// Reads the archive `name` out of the sandbox and seals it into the store under a fresh
    /// snapshot id.
    async fn seal_archive(
        &self,
        pausing: &Pausing,
        row: &SandboxRow,
        sandbox: &SandboxHandle,
        name: &str,
        bytes: u64,
    ) -> Result<(String, crate::snapshots::PendingSnapshot), ServiceError> {
        use futures::StreamExt as _;
        let tenant = row.tenant_id.expect("a leased sandbox has a tenant");
        let snapshot_id = SnapshotCustody::new_id();
        let issued = pausing
            .custody
            .issue_files(&snapshot_id, tenant, &row.id, &row.node);
        let profile = self.profile.clone();
        let mut out = pausing.store.writer(tenant, &snapshot_id);
        let sealed = async {
            let mut sealer = FilesSealer::start(&mut out, &issued.key, &issued.aad, &profile)
                .await
                .map_err(|e| seal_failed(&row.id, e))?;
            let (first, mut rest) = sandbox.read_file_stream(name, bytes).await?;
            sealer
                .write(&first)
                .await
                .map_err(|e| seal_failed(&row.id, e))?;
            while let Some(chunk) = rest.next().await {
                let chunk = chunk.map_err(sandgate_sandbox::SandboxError::from)?;
                sealer
                    .write(&chunk)
                    .await
                    .map_err(|e| seal_failed(&row.id, e))?;
            }
            sealer.finish().await.map_err(|e| seal_failed(&row.id, e))
        }
        .await;
        let sealed = match sealed {
            Ok(sealed) => sealed,
            Err(err) => {
                let _ = out.abort().await;
                return Err(err);
            }
        };
        out.shutdown()
            .await
            .map_err(|e| store_failed(&row.id, pausing.store.write_failed(e)))?;
        Ok((snapshot_id, issued.pending(sealed)))
    }

    /// Resumes a `resuming` sandbox paused as files: a fresh sandbox under its id on a node the
    /// placement chooses, its files restored and its packages reinstalled where possible; then
    /// `resuming → leased` and its snapshot deleted.
    #[tracing::instrument(skip_all, fields(sandbox_id = %row.id))]
    pub(super) async fn restore_files(
        &self,
        pausing: &Pausing,
        caller: &Caller,
        row: &SandboxRow,
    ) -> Result<(SandboxRow, SandboxHandle, FilesResume), ServiceError> {
        let snapshot_id = row
            .snapshot_id
            .clone()
            .ok_or_else(|| ServiceError::NotFound(row.id.clone()))?;
        let node_id = match self.nodes.place(&self.db).await? {
            crate::placement::Placement::On(id) => id,
            _ => {
                return Err(ServiceError::Busy {
                    what: format!("sandbox {} (no node has room to resume it)", row.id),
                    retry_after_seconds: 30,
                });
            }
        };
        let node = self.nodes.get(&self.db, &node_id).await?;
        let sealed = match pausing.store.reader(caller.tenant, &snapshot_id).await {
            Ok(sealed) => sealed,
            Err(SnapshotStoreError::Missing { .. }) => {
                return Err(self
                    .lose_with_snapshot(caller.tenant, row, &snapshot_id)
                    .await);
            }
            Err(err) => return Err(store_failed(&row.id, err)),
        };
        let (key, aad) = pausing
            .custody
            .open_key(caller.tenant, &snapshot_id)
            .await
            .map_err(|e| snapshot_error(&row.id, e))?;
        let mut opener = FilesOpener::open(sealed, &key, &aad)
            .await
            .map_err(|e| seal_failed(&row.id, e))?;
        let profile = caller.limits.profile(&self.profile);
        let ticket = node.start_permit(&profile.name).await?;
        let sandbox = match node.launch_as(&profile, ticket, &row.id).await {
            Ok(sandbox) => sandbox,
            Err(err) => return Err(self.node_error(&node_id, node.local().is_none(), err)),
        };
        let filled = async {
            if sandbox.id() != row.id {
                return Err(ServiceError::Busy {
                    what: format!(
                        "sandbox {} (its node is of a version that cannot resume it from files)",
                        row.id
                    ),
                    retry_after_seconds: 60,
                });
            }
            let unpacked = self.unpack(&sandbox, &row.id, &mut opener).await?;
            Ok(self.reinstall(caller, &sandbox, &row.id, unpacked).await)
        }
        .await;
        let resume = match filled {
            Ok(resume) => resume,
            Err(err) => {
                let _ = node.close(sandbox).await;
                return Err(err);
            }
        };
        let mut conn = self.db.acquire().await?;
        let live = pauses::finish_resume(&mut conn, row, sandbox.container_id(), &node_id).await?;
        let Some(live) = live else {
            drop(conn);
            let _ = node.close(sandbox).await;
            return Err(ServiceError::NotFound(row.id.clone()));
        };
        snapshots::delete(&mut conn, caller.tenant, &snapshot_id).await?;
        drop(conn);
        if let Err(err) = pausing.store.delete(caller.tenant, &snapshot_id).await {
            tracing::warn!(error = %err, snapshot = %snapshot_id, "deleting a resumed sandbox's snapshot failed");
        }
        Ok((live, sandbox, resume))
    }

    /// Writes the opened archive into the fresh sandbox in parts and unpacks it there.
    async fn unpack(
        &self,
        sandbox: &SandboxHandle,
        sandbox_id: &str,
        opener: &mut FilesOpener<impl tokio::io::AsyncRead + Unpin>,
    ) -> Result<Unpacked, ServiceError> {
        let prefix = archive_name("resume");
        let mut part = Vec::with_capacity(PART_BYTES);
        let mut parts = 0usize;
        loop {
            let chunk = opener
                .next_chunk()
                .await
                .map_err(|e| seal_failed(sandbox_id, e))?;
            let end = chunk.is_none();
            if let Some(chunk) = chunk {
                part.extend_from_slice(&chunk);
            }
            if part.len() >= PART_BYTES || (end && !part.is_empty()) {
                sandbox
                    .write_file(&format!("{prefix}.{parts}"), &part, false)
                    .await?;
                zeroize::Zeroize::zeroize(&mut part);
                part.clear();
                parts += 1;
            }
            if end {
                break;
            }
        }
        let parts_arg = parts.to_string();
        let ran = sandbox
            .command(
                &python(RESTORE_SCRIPT, &[&prefix, &parts_arg, HOME]),
                script_options(),
                None,
            )
            .await?;
        serde_json::from_str::<Unpacked>(ran.stdout.trim()).map_err(|_| {
            tracing::warn!(stderr = %ran.stderr, exit = ?ran.exit_code, "the restore script failed");
            ServiceError::Busy {
                what: format!("sandbox {sandbox_id} (restoring its files failed)"),
                retry_after_seconds: 30,
            }
        })
    }

    /// Installs the archive's listed packages again through the package index, where packages
    /// are on; says which were not.
    async fn reinstall(
        &self,
        caller: &Caller,
        sandbox: &SandboxHandle,
        sandbox_id: &str,
        unpacked: Unpacked,
    ) -> FilesResume {
        let mut resume = FilesResume {
            files_not_restored: unpacked.refused,
            ..FilesResume::default()
        };
        if unpacked.refused_count > resume.files_not_restored.len() {
            resume
                .files_not_restored
                .push(format!("… {} in all", unpacked.refused_count));
        }
        if let Some(error) = unpacked.error {
            resume.files_not_restored.push(format!(
                "(the archive could not be read to its end: {error})"
            ));
        }
        if unpacked.packages.is_empty() {
            return resume;
        }
        let packages = unpacked.packages;
        let Some(index) = &self.packages else {
            resume.packages_not_reinstalled = packages;
            resume.packages_note = Some("package installs are off on this server".into());
            return resume;
        };
        let command = match crate::packages::requirements::pip_command(&packages) {
            Ok(command) => command,
            Err(err) => {
                resume.packages_not_reinstalled = packages;
                resume.packages_note = Some(err.to_string());
                return resume;
            }
        };
        let handler = index.for_call(caller.tenant, sandbox_id);
        let options = CommandOptions {
            timeout: PIP_TIMEOUT,
            output_limit: 64 << 10,
            cwd: None,
        };
        let ran = sandbox
            .with_index(&handler, sandbox.command(&command, options, None))
            .await;
        match ran {
            Ok(out) if out.exit_code == Some(0) => resume.packages_reinstalled = packages,
            Ok(out) => {
                resume.packages_not_reinstalled = packages;
                resume.packages_note = Some(format!(
                    "pip failed: {}",
                    out.stderr.lines().last().unwrap_or("no message")
                ));
            }
            Err(err) => {
                resume.packages_not_reinstalled = packages;
                resume.packages_note = Some(format!("pip could not run: {err}"));
            }
        }
        resume
    }
}

fn seal_failed(sandbox_id: &str, err: sandgate_sandbox::SealError) -> ServiceError {
    tracing::error!(error = %err, sandbox_id, "sealing or opening a files-only snapshot failed");
    ServiceError::Busy {
        what: format!("sandbox {sandbox_id} (its files-only snapshot)"),
        retry_after_seconds: 30,
    }
}

#[cfg(test)]
mod tests {
    //! The two scripts on the host's python3 (as they run in a sandbox, with a directory of the
    //! test's own as the home), against what a hostile sandbox puts in its home or its archive.

    use std::io::Write as _;
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};

    use super::{ARCHIVE_SCRIPT, RESTORE_SCRIPT};

    struct Scratch(PathBuf);

    impl Scratch {
        fn new() -> Self {
            let dir = std::env::temp_dir().join(format!(
                "sandgate-files-test-{}",
                uuid::Uuid::new_v4().simple()
            ));
            for sub in ["home", "home2", "outside"] {
                std::fs::create_dir_all(dir.join(sub)).unwrap();
            }
            Self(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn run(script: &str, args: &[&str]) -> serde_json::Value {
        let mut child = Command::new("python3")
            .arg("-I")
            .arg("-")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3 runs");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "the script succeeds: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("the script prints its JSON report")
    }

    fn files_under(dir: &Path) -> Vec<String> {
        let mut found: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        found.sort();
        found
    }

    #[test]
    fn a_home_with_links_odd_names_and_a_pipe_round_trips_without_following_a_link_out() {
        let scratch = Scratch::new();
        let (home, home2, outside) = (
            scratch.0.join("home"),
            scratch.0.join("home2"),
            scratch.0.join("outside"),
        );
        std::fs::write(outside.join("secret"), "outside the home").unwrap();
        std::fs::write(home.join("kept.txt"), "kept").unwrap();
        std::fs::create_dir_all(home.join("d/e")).unwrap();
        std::fs::write(home.join("d/e/odd name\nwith a newline"), "odd").unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), home.join("link-out")).unwrap();
        std::os::unix::fs::symlink(&outside, home.join("dir-out")).unwrap();
        let fifo = home.join("a-pipe");
        assert!(
            Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success(),
            "mkfifo"
        );
        let home_arg = home.to_str().unwrap();
        let made = run(ARCHIVE_SCRIPT, &[".sandgate-pause-t", home_arg]);
        assert_eq!(made["skipped"], serde_json::json!(["a-pipe"]), "{made}");
        // The archive becomes the restore's one part in the other home.
        std::fs::rename(
            home.join(".sandgate-pause-t"),
            home2.join(".sandgate-resume-t.0"),
        )
        .unwrap();
        let done = run(
            RESTORE_SCRIPT,
            &[".sandgate-resume-t", "1", home2.to_str().unwrap()],
        );
        assert_eq!(done["refused_count"], 0, "{done}");
        assert!(done["error"].is_null(), "{done}");
        assert_eq!(
            std::fs::read_to_string(home2.join("kept.txt")).unwrap(),
            "kept"
        );
        assert_eq!(
            std::fs::read_to_string(home2.join("d/e/odd name\nwith a newline")).unwrap(),
            "odd"
        );
        for link in ["link-out", "dir-out"] {
            let meta = std::fs::symlink_metadata(home2.join(link)).unwrap();
            assert!(
                meta.file_type().is_symlink(),
                "{link} is restored as a link, not what it points to"
            );
        }
        assert_eq!(
            files_under(&outside),
            vec!["secret".to_owned()],
            "nothing was written through a link"
        );
        assert!(
            !files_under(&home2)
                .iter()
                .any(|f| f.starts_with(".sandgate-")),
            "the parts are gone: {:?}",
            files_under(&home2)
        );
    }

    #[test]
    fn a_hostile_archive_writes_nothing_outside_the_home() {
        let scratch = Scratch::new();
        let (home, outside) = (scratch.0.join("home"), scratch.0.join("outside"));
        std::fs::write(outside.join("secret"), "outside the home").unwrap();
        // What a sandbox that swapped its archive could hand back: paths out of the home, a
        // link followed by a path through it, a hard link to a file outside, a device, a
        // set-uid file, and one honest file.
        let craft = format!(
            r#"
import io, tarfile, sys
out = sys.argv[1]
def add(t, name, kind=tarfile.REGTYPE, data=b"x", link="", mode=0o644):
    i = tarfile.TarInfo(name); i.type = kind; i.linkname = link; i.mode = mode
    i.size = len(data) if kind == tarfile.REGTYPE else 0
    t.addfile(i, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
with tarfile.open(out, "w:gz") as t:
    add(t, "home", tarfile.DIRTYPE, mode=0o755)
    add(t, "home/../escape.txt")
    add(t, "/abs.txt")
    add(t, "elsewhere/x.txt")
    add(t, "home/l", tarfile.SYMTYPE, link="{outside}")
    add(t, "home/l/through.txt")
    add(t, "home/h", tarfile.LNKTYPE, link="{outside}/secret")
    add(t, "home/h2", tarfile.LNKTYPE, link="home/../outside/secret")
    add(t, "home/dev", tarfile.CHRTYPE)
    add(t, "home/suid", mode=0o4755)
    add(t, "home/ok.txt", data=b"ok")
"#,
            outside = outside.display()
        );
        let part = home.join(".sandgate-resume-h.0");
        let status = Command::new("python3")
            .args(["-I", "-c", &craft, part.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(status.success(), "the hostile archive is made");
        let done = run(
            RESTORE_SCRIPT,
            &[".sandgate-resume-h", "1", home.to_str().unwrap()],
        );
        assert_eq!(
            files_under(&outside),
            vec!["secret".to_owned()],
            "nothing was written outside the home: {done}"
        );
        assert_eq!(
            std::fs::read_to_string(outside.join("secret")).unwrap(),
            "outside the home"
        );
        assert!(
            !scratch.0.join("escape.txt").exists() && !Path::new("/abs.txt").exists(),
            "{done}"
        );
        assert_eq!(
            std::fs::read_to_string(home.join("ok.txt")).unwrap(),
            "ok",
            "the honest file is restored: {done}"
        );
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(home.join("suid"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7000, 0, "no set-id bits are restored");
        let refused: Vec<String> = done["refused"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect();
        for bad in [
            "../escape.txt",
            "/abs.txt",
            "elsewhere/x.txt",
            "l/through.txt",
            "h",
            "h2",
            "dev",
        ] {
            assert!(
                refused.iter().any(|r| r == bad),
                "{bad} is refused: {refused:?}"
            );
        }
        assert_eq!(
            files_under(&home),
            vec!["l".to_owned(), "ok.txt".to_owned(), "suid".to_owned()],
            "only the link itself and the plain files are there"
        );
    }
}
