//! Sealed snapshots (issue 26): a [`Snapshot`]'s image as one stream that is safe at rest,
//! encrypted under a data key the service holds, bound to the tenant, sandbox and snapshot it
//! belongs to.
//!
//! The stream: a small versioned header in the clear, then the image's files as a tar archive,
//! encrypted in chunks with the STREAM construction (Hoang, Reyhanitabar, Rogaway and Vizár,
//! "Online Authenticated-Encryption and its Nonce-Reuse Misuse-Resistance", 2015; the `aead`
//! crate's `stream::EncryptorBE32`) over XChaCha20-Poly1305:
//!
//! ```text
//! "SGSNAPv1" (8) ‖ header length (u32, big-endian) ‖ header (JSON, ≤ 64 KiB)
//! ‖ chunk 0 ‖ chunk 1 ‖ … ‖ last chunk
//! ```
//!
//! Every chunk but the last carries [`CHUNK_BYTES`] of archive (plus a 16-byte tag); the last
//! carries fewer (possibly none), and STREAM marks it as last inside its nonce, so a stream cut at
//! a chunk boundary does not authenticate. Each chunk's associated data is the binding (tenant,
//! sandbox and snapshot id, [`SnapshotAad`]) and the SHA-256 of the header, so the header cannot be
//! altered and a stream cannot be opened as another tenant's, sandbox's or snapshot's.
//!
//! Not compressed: on Docker's API route runsc compresses its checkpoint images itself (its
//! default), and zstd -3 of one gained nothing (28.1 MB both, docs/snapshots.md); the
//! `sandgate-runsc` route writes them uncompressed on purpose (~110 MB for the analyst's sandbox,
//! restored twice as fast), and sealing them as they are keeps that (docs/benchmarks.md, "Pause,
//! resume and fork": the snapshot-size goal is missed for it).
//!
//! Memory is bounded: sealing and opening hold a few chunks at a time, never the image. The tar
//! and cipher work runs on a blocking thread; the async side only moves sealed bytes.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use chacha20poly1305::XChaCha20Poly1305;
use chacha20poly1305::aead::rand_core::RngCore as _;
use chacha20poly1305::aead::stream::{DecryptorBE32, EncryptorBE32};
use chacha20poly1305::aead::{KeyInit, OsRng};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use zeroize::Zeroizing;

use super::{Snapshot, SnapshotImage};
use crate::config::SandboxProfile;

/// The stream's first bytes: what it is and its format version.
pub const MAGIC: &[u8; 8] = b"SGSNAPv1";
/// Archive bytes per chunk (every chunk but the last).
pub const CHUNK_BYTES: usize = 64 * 1024;
/// The Poly1305 tag each chunk carries.
pub(super) const TAG_BYTES: usize = 16;
/// The STREAM nonce prefix: XChaCha20's 24 bytes less STREAM-BE32's counter (4) and flag (1).
pub(super) const NONCE_PREFIX_BYTES: usize = 19;
/// The largest header accepted (a real one is well under 1 KiB).
const MAX_HEADER_BYTES: u32 = 64 * 1024;
/// Sealed or plain chunks in flight between the blocking thread and the async side.
const CHUNKS_IN_FLIGHT: usize = 4;

/// A snapshot's data key: 32 random bytes, one per snapshot, held by a node only for the one
/// operation (zeroized when dropped; never printed).
#[derive(Clone)]
pub struct DataKey(Zeroizing<[u8; 32]>);

impl DataKey {
    /// A fresh random key.
    pub fn generate() -> Self {
        let mut key = Zeroizing::new([0u8; 32]);
        OsRng.fill_bytes(key.as_mut());
        Self(key)
    }

    /// The key of these bytes (unwrapped by the service, or received over the node RPC). The
    /// caller zeroizes its own copy.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(Zeroizing::new(bytes))
    }

    /// The key of a slice, if it is 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        let bytes: [u8; 32] = bytes.try_into().ok()?;
        Some(Self::from_bytes(bytes))
    }

    /// The key's bytes, for wrapping it or sending it to a node.
    pub fn expose(&self) -> &[u8; 32] {
        &self.0
    }

    pub(super) fn cipher(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new(self.0.as_ref().into())
    }
}

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataKey(…)")
    }
}

/// Whose a sealed snapshot is: every chunk is bound to these three ids, and a stream opened with
/// any other ids (another tenant's, sandbox's or snapshot's) is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotAad {
    /// The tenant that owns the sandbox (its id as the service writes it).
    pub tenant_id: String,
    /// The sandbox the snapshot is of.
    pub sandbox_id: String,
    /// The snapshot.
    pub snapshot_id: String,
}

impl SnapshotAad {
    /// The binding as bytes under a `purpose` label: each id length-prefixed, so that no two
    /// different bindings give the same bytes. The service wraps data keys with the same
    /// binding under another label.
    pub fn bytes(&self, purpose: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + purpose.len());
        for part in [
            purpose,
            &self.tenant_id,
            &self.sandbox_id,
            &self.snapshot_id,
        ] {
            out.extend_from_slice(&(part.len() as u32).to_be_bytes());
            out.extend_from_slice(part.as_bytes());
        }
        out
    }
}

/// The clear header of a sealed stream (authenticated: its hash is in every chunk's associated
/// data).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealedHeader {
    /// The snapshot's id.
    pub snapshot_id: String,
    /// The sandbox it was taken of.
    pub source_sandbox: String,
    /// The profile that sandbox ran (a restore needs a container of exactly this profile).
    pub profile: SandboxProfile,
    /// SHA-256 (hex) of the profile's JSON: which profile, at a glance.
    pub profile_fingerprint: String,
    /// The name the engine knows the checkpoint by.
    pub image_name: String,
    /// The fingerprint of the agent the checkpointed container ran.
    pub agent: String,
    /// The image's size in bytes (its files' lengths).
    pub image_bytes: u64,
    /// When it was taken, milliseconds since the Unix epoch.
    pub taken_unix_ms: u64,
    /// Archive bytes per chunk.
    pub chunk_bytes: u64,
    /// The STREAM nonce prefix (hex, 19 bytes).
    pub nonce: String,
    /// What the archive holds: absent for a checkpoint image; [`SealedContent::Files`] for a
    /// files-only pause (a binary of before refuses such a stream: the field is unknown to it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<SealedContent>,
}

/// What a sealed stream other than a checkpoint image holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SealedContent {
    /// A files-only pause: an archive of /home/user and the list of installed packages, made
    /// inside the sandbox (see [`super::files`]).
    Files,
}

/// What a sealing wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SealedSnapshot {
    /// Its header.
    pub header: SealedHeader,
    /// The whole stream's length in bytes.
    pub sealed_bytes: u64,
    /// How many chunks it holds.
    pub chunks: u64,
}

/// Why sealing or opening a snapshot failed. An open that fails leaves no file behind.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// The binding names another snapshot or sandbox than the one being sealed or opened.
    #[error(
        "the snapshot is {found}, but the binding names {expected}: a sealed snapshot opens only \
         under its own tenant, sandbox and snapshot id"
    )]
    Binding {
        /// What the binding said.
        expected: String,
        /// What the snapshot (or its header) is.
        found: String,
    },
    /// The stream is not a sealed snapshot of a format this version reads.
    #[error("not a sealed snapshot this version can read: {0}")]
    Format(String),
    /// A chunk did not authenticate: the stream was altered, reordered or cut inside a chunk, or
    /// it is opened with the wrong data key or another tenant's, sandbox's or snapshot's binding.
    #[error(
        "sealed snapshot chunk {chunk} does not authenticate: altered, reordered, cut short, or \
         opened with a wrong key or another tenant's, sandbox's or snapshot's binding"
    )]
    Unauthentic {
        /// The chunk's index (0 is the first after the header).
        chunk: u64,
    },
    /// The stream ended before its last chunk.
    #[error(
        "the sealed snapshot ends after {chunks} chunks without its last one: it was cut short"
    )]
    Truncated {
        /// The chunks it had.
        chunks: u64,
    },
    /// The directory to open into is not on a tmpfs (plaintext must never reach a disk).
    #[error("{} is on {fs_type}, not a tmpfs: plaintext snapshot images go only to a tmpfs", path.display())]
    NotTmpfs {
        /// The directory.
        path: PathBuf,
        /// The file system it is on.
        fs_type: String,
    },
    /// The archive inside held something other than plain files and directories.
    #[error("the sealed snapshot's archive holds {0}, which an image never does")]
    Archive(String),
    /// Reading the image, writing the stream, reading the stream or writing the files failed.
    #[error("{what} failed")]
    Io {
        /// What was done.
        what: &'static str,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

pub(super) fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> SealError {
    move |source| SealError::Io { what, source }
}

/// The SHA-256 (hex) of a profile's JSON.
pub fn profile_fingerprint(profile: &SandboxProfile) -> String {
    let json = serde_json::to_vec(profile).expect("a profile serializes");
    hex::encode(Sha256::digest(json))
}

/// Each chunk's associated data: the binding and the header's hash.
pub(super) fn chunk_aad(aad: &SnapshotAad, header: &[u8]) -> Vec<u8> {
    let mut bytes = aad.bytes("sandgate sealed snapshot chunk v1");
    bytes.extend_from_slice(&Sha256::digest(header));
    bytes
}

impl Snapshot {
    /// Seals this snapshot into `out` under `key`, bound to `aad` (which must name this
    /// snapshot and the sandbox it was taken of). The plaintext image stays; drop the snapshot
    /// to delete it.
    #[tracing::instrument(skip_all, fields(snapshot = %self.id))]
    pub async fn seal(
        &self,
        key: &DataKey,
        aad: &SnapshotAad,
        mut out: impl AsyncWrite + Unpin,
    ) -> Result<SealedSnapshot, SealError> {
        for (expected, found) in [
            (&aad.snapshot_id, &self.id),
            (&aad.sandbox_id, &self.source_sandbox),
        ] {
            if expected != found {
                return Err(SealError::Binding {
                    expected: expected.clone(),
                    found: found.clone(),
                });
            }
        }
        let mut nonce = [0u8; NONCE_PREFIX_BYTES];
        OsRng.fill_bytes(&mut nonce);
        let header = self.header(&nonce);
        let header_bytes = serde_json::to_vec(&header).expect("a header serializes");
        let mut written = 0u64;
        for part in [
            &MAGIC[..],
            &(header_bytes.len() as u32).to_be_bytes(),
            &header_bytes,
        ] {
            out.write_all(part).await.map_err(io_err("writing"))?;
            written += part.len() as u64;
        }
        let (sender, mut chunks) = mpsc::channel::<Vec<u8>>(CHUNKS_IN_FLIGHT);
        let sink = SealingSink {
            encryptor: Some(EncryptorBE32::from_aead(key.cipher(), &nonce.into())),
            aad: chunk_aad(aad, &header_bytes),
            plain: Vec::with_capacity(CHUNK_BYTES),
            sender,
            chunks: 0,
        };
        let dir = self.image.dir.clone();
        let archiver = tokio::task::spawn_blocking(move || archive(&dir, sink));
        let mut write_failed = None;
        while let Some(chunk) = chunks.recv().await {
            if let Err(err) = out.write_all(&chunk).await {
                write_failed = Some(err);
                break;
            }
            written += chunk.len() as u64;
        }
        // Dropping the receiver stops the archiver at its next chunk.
        drop(chunks);
        let archived = archiver.await.expect("the archiver does not panic");
        if let Some(err) = write_failed {
            return Err(io_err("writing the sealed snapshot")(err));
        }
        let chunk_count = archived?;
        out.flush()
            .await
            .map_err(io_err("writing the sealed snapshot"))?;
        Ok(SealedSnapshot {
            header,
            sealed_bytes: written,
            chunks: chunk_count,
        })
    }

    fn header(&self, nonce: &[u8]) -> SealedHeader {
        SealedHeader {
            snapshot_id: self.id.clone(),
            source_sandbox: self.source_sandbox.clone(),
            profile: self.profile.clone(),
            profile_fingerprint: profile_fingerprint(&self.profile),
            image_name: self.image.name.clone(),
            agent: self.image.agent.clone(),
            image_bytes: self.image.size_bytes,
            taken_unix_ms: self
                .taken
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            chunk_bytes: CHUNK_BYTES as u64,
            nonce: hex::encode(nonce),
            content: None,
        }
    }
}

/// Writes `dir` as a tar archive into `sink`; returns the chunks sealed.
fn archive(dir: &Path, sink: SealingSink) -> Result<u64, SealError> {
    let mut builder = tar::Builder::new(sink);
    builder.follow_symlinks(false);
    builder.mode(tar::HeaderMode::Complete);
    builder
        .append_dir_all(".", dir)
        .map_err(io_err("archiving the snapshot image"))?;
    let sink = builder
        .into_inner()
        .map_err(io_err("archiving the snapshot image"))?;
    sink.finish()
}

/// The archive's sink: cuts it into chunks, seals each, hands it to the async writer.
struct SealingSink {
    encryptor: Option<EncryptorBE32<XChaCha20Poly1305>>,
    aad: Vec<u8>,
    plain: Vec<u8>,
    sender: mpsc::Sender<Vec<u8>>,
    chunks: u64,
}

impl SealingSink {
    fn send(&mut self, sealed: Vec<u8>) -> io::Result<()> {
        self.chunks += 1;
        self.sender.blocking_send(sealed).map_err(|_| {
            io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the sealed stream's writer stopped",
            )
        })
    }

    /// Seals the full chunk in `plain` (not the last: the last is always shorter).
    fn seal_full(&mut self) -> io::Result<()> {
        let encryptor = self.encryptor.as_mut().expect("not finished");
        let mut chunk = std::mem::replace(&mut self.plain, Vec::with_capacity(CHUNK_BYTES));
        chunk.reserve_exact(TAG_BYTES);
        encryptor
            .encrypt_next_in_place(&self.aad, &mut chunk)
            .map_err(|_| io::Error::other("a STREAM of 2^32 chunks is too long"))?;
        self.send(chunk)
    }

    /// Seals what is left as the last chunk; returns the chunk count.
    fn finish(mut self) -> Result<u64, SealError> {
        let encryptor = self.encryptor.take().expect("finished once");
        let mut last = std::mem::take(&mut self.plain);
        encryptor
            .encrypt_last_in_place(&self.aad, &mut last)
            .map_err(|_| io_err("sealing the last chunk")(io::Error::other("STREAM refused")))?;
        self.send(last)
            .map_err(io_err("writing the sealed snapshot"))?;
        Ok(self.chunks)
    }
}

impl Write for SealingSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = CHUNK_BYTES - self.plain.len();
        let taken = room.min(buf.len());
        self.plain.extend_from_slice(&buf[..taken]);
        if self.plain.len() == CHUNK_BYTES {
            self.seal_full()?;
        }
        Ok(taken)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for SealingSink {
    fn drop(&mut self) {
        use zeroize::Zeroize as _;
        self.plain.zeroize();
    }
}

/// One piece of sealed stream as the reader cut it.
struct SealedPiece {
    bytes: Vec<u8>,
    /// Shorter than a full chunk: the stream ended with it.
    last: bool,
}

impl SealedSnapshot {
    /// Opens a sealed snapshot from `reader` with `key` and the binding `aad`, into a fresh
    /// directory under `plain_dir` (which must be on a tmpfs). Refuses a stream that was
    /// altered, reordered or cut short, or that belongs to another tenant, sandbox or snapshot
    /// (a typed [`SealError`]), and then leaves nothing behind.
    #[tracing::instrument(skip_all, fields(snapshot = %aad.snapshot_id))]
    pub async fn open(
        mut reader: impl AsyncRead + Unpin,
        key: &DataKey,
        aad: &SnapshotAad,
        plain_dir: &Path,
    ) -> Result<Snapshot, SealError> {
        require_tmpfs(plain_dir)?;
        let (header, header_bytes) = read_header(&mut reader).await?;
        check_header(&header, aad)?;
        if header.content.is_some() {
            return Err(SealError::Format(
                "a files-only archive, not a checkpoint image".into(),
            ));
        }
        let nonce = <[u8; NONCE_PREFIX_BYTES]>::try_from(
            hex::decode(&header.nonce)
                .map_err(|_| SealError::Format("a malformed nonce".into()))?,
        )
        .map_err(|_| SealError::Format("a nonce of the wrong length".into()))?;
        let dir = plain_dir.join(format!(
            "{}.{}",
            header.snapshot_id,
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ));
        std::fs::create_dir(&dir).map_err(io_err("creating the snapshot's directory"))?;
        let (sender, pieces) = mpsc::channel::<SealedPiece>(CHUNKS_IN_FLIGHT);
        let source = OpeningSource {
            decryptor: Some(DecryptorBE32::from_aead(key.cipher(), &nonce.into())),
            aad: chunk_aad(aad, &header_bytes),
            pieces,
            plain: Zeroizing::new(Vec::new()),
            at: 0,
            chunk: 0,
            failure: None,
        };
        let target = dir.clone();
        let extractor = tokio::task::spawn_blocking(move || extract(source, &target));
        let read = read_pieces(&mut reader, sender).await;
        let extracted = extractor.await.expect("the extractor does not panic");
        let result = match (read, extracted) {
            // The stream's own failure explains the extractor's.
            (Err(err), _) | (Ok(()), Err(err)) => Err(err),
            (Ok(()), Ok(())) => tree_size(&dir).map_err(io_err("measuring the snapshot image")),
        };
        match result {
            Ok(size_bytes) => Ok(Snapshot {
                id: header.snapshot_id,
                source_sandbox: header.source_sandbox,
                profile: header.profile,
                image: SnapshotImage {
                    dir,
                    size_bytes,
                    name: header.image_name,
                    agent: header.agent,
                },
                taken: std::time::UNIX_EPOCH
                    + std::time::Duration::from_millis(header.taken_unix_ms),
            }),
            Err(err) => {
                if let Err(cleanup) = std::fs::remove_dir_all(&dir) {
                    tracing::warn!(error = %cleanup, dir = %dir.display(), "removing a refused snapshot's files failed");
                }
                Err(err)
            }
        }
    }
}

pub(super) async fn read_header(
    reader: &mut (impl AsyncRead + Unpin),
) -> Result<(SealedHeader, Vec<u8>), SealError> {
    let mut magic = [0u8; 8];
    read_exact_or_format(reader, &mut magic, "its magic").await?;
    if &magic != MAGIC {
        return Err(SealError::Format(if magic.starts_with(b"SGSNAP") {
            format!("format {:?}", String::from_utf8_lossy(&magic[6..]))
        } else {
            "no sealed-snapshot magic".into()
        }));
    }
    let mut len = [0u8; 4];
    read_exact_or_format(reader, &mut len, "its header length").await?;
    let len = u32::from_be_bytes(len);
    if len > MAX_HEADER_BYTES {
        return Err(SealError::Format(format!("a header of {len} bytes")));
    }
    let mut bytes = vec![0u8; len as usize];
    read_exact_or_format(reader, &mut bytes, "its header").await?;
    let header: SealedHeader = serde_json::from_slice(&bytes)
        .map_err(|err| SealError::Format(format!("a malformed header ({err})")))?;
    Ok((header, bytes))
}

async fn read_exact_or_format(
    reader: &mut (impl AsyncRead + Unpin),
    buf: &mut [u8],
    what: &str,
) -> Result<(), SealError> {
    match reader.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => {
            Err(SealError::Format(format!("the stream ends inside {what}")))
        }
        Err(err) => Err(io_err("reading the sealed snapshot")(err)),
    }
}

/// The header names what the binding names, and describes itself consistently.
pub(super) fn check_header(header: &SealedHeader, aad: &SnapshotAad) -> Result<(), SealError> {
    for (expected, found) in [
        (&aad.snapshot_id, &header.snapshot_id),
        (&aad.sandbox_id, &header.source_sandbox),
    ] {
        if expected != found {
            return Err(SealError::Binding {
                expected: expected.clone(),
                found: found.clone(),
            });
        }
    }
    if header.chunk_bytes != CHUNK_BYTES as u64 {
        return Err(SealError::Format(format!(
            "chunks of {} bytes",
            header.chunk_bytes
        )));
    }
    if header.profile_fingerprint != profile_fingerprint(&header.profile) {
        return Err(SealError::Format(
            "a profile that does not match its fingerprint".into(),
        ));
    }
    if header.image_name.is_empty()
        || header.image_name.contains(['/', '\0'])
        || header.image_name.starts_with('.')
    {
        return Err(SealError::Format("an unusable image name".into()));
    }
    Ok(())
}

/// Cuts the stream after the header into pieces of a full sealed chunk; the first shorter piece
/// (the stream's end) is the last.
async fn read_pieces(
    reader: &mut (impl AsyncRead + Unpin),
    pieces: mpsc::Sender<SealedPiece>,
) -> Result<(), SealError> {
    let full = CHUNK_BYTES + TAG_BYTES;
    loop {
        let mut bytes = Vec::with_capacity(full);
        while bytes.len() < full {
            let n = (&mut *reader)
                .take((full - bytes.len()) as u64)
                .read_to_end(&mut bytes)
                .await
                .map_err(io_err("reading the sealed snapshot"))?;
            if n == 0 {
                break;
            }
        }
        let last = bytes.len() < full;
        if pieces.send(SealedPiece { bytes, last }).await.is_err() || last {
            // The extractor stopped (its error says why) or the stream is whole.
            return Ok(());
        }
    }
}

/// The decrypted archive, as a reader for `tar`: authenticates each chunk before handing out
/// any of its bytes.
struct OpeningSource {
    decryptor: Option<DecryptorBE32<XChaCha20Poly1305>>,
    aad: Vec<u8>,
    pieces: mpsc::Receiver<SealedPiece>,
    plain: Zeroizing<Vec<u8>>,
    at: usize,
    chunk: u64,
    /// Why reading stopped, in our terms (the `tar` crate's error wraps an opaque one).
    failure: Option<SealError>,
}

impl OpeningSource {
    fn fail(&mut self, err: SealError) -> io::Error {
        let text = err.to_string();
        self.failure = Some(err);
        io::Error::new(io::ErrorKind::InvalidData, text)
    }

    /// The next chunk's plaintext into `plain`; false at the end of the stream.
    fn next_chunk(&mut self) -> io::Result<bool> {
        let Some(decryptor) = self.decryptor.as_mut() else {
            return Ok(false);
        };
        let Some(piece) = self.pieces.blocking_recv() else {
            // The reader failed or stopped; its error is the one reported.
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the sealed stream stopped",
            ));
        };
        let chunk = self.chunk;
        let mut bytes = piece.bytes;
        if piece.last && bytes.len() < TAG_BYTES {
            return Err(self.fail(SealError::Truncated { chunks: chunk }));
        }
        let opened = if piece.last {
            let decryptor = self.decryptor.take().expect("present");
            decryptor.decrypt_last_in_place(&self.aad, &mut bytes)
        } else {
            decryptor.decrypt_next_in_place(&self.aad, &mut bytes)
        };
        if opened.is_err() {
            return Err(self.fail(SealError::Unauthentic { chunk }));
        }
        self.chunk += 1;
        self.plain = Zeroizing::new(bytes);
        self.at = 0;
        Ok(true)
    }
}

impl Read for OpeningSource {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.plain.len() {
            if !self.next_chunk()? {
                return Ok(0);
            }
        }
        let n = buf.len().min(self.plain.len() - self.at);
        buf[..n].copy_from_slice(&self.plain[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Unpacks the archive from `source` into `dir` (plain files and directories only), then reads
/// the stream to its authenticated end.
fn extract(source: OpeningSource, dir: &Path) -> Result<(), SealError> {
    let mut archive = tar::Archive::new(source);
    archive.set_preserve_permissions(true);
    archive.set_overwrite(false);
    let unpacked = unpack_entries(&mut archive, dir);
    let mut source = archive.into_inner();
    if let Some(failure) = source.failure.take() {
        return Err(failure);
    }
    unpacked?;
    // tar stops at its end-of-archive blocks: the rest must still authenticate to the last chunk.
    let drained = io::copy(&mut source, &mut io::sink());
    if let Some(failure) = source.failure.take() {
        return Err(failure);
    }
    drained.map_err(io_err("reading the sealed snapshot"))?;
    Ok(())
}

fn unpack_entries(archive: &mut tar::Archive<OpeningSource>, dir: &Path) -> Result<(), SealError> {
    let entries = archive.entries().map_err(io_err("reading the archive"))?;
    for entry in entries {
        let mut entry = entry.map_err(io_err("reading the archive"))?;
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_dir()) {
            return Err(SealError::Archive(format!("an entry of type {kind:?}")));
        }
        // `unpack_in` refuses paths that leave `dir` (absolute, `..`).
        if !entry
            .unpack_in(dir)
            .map_err(io_err("writing the snapshot's files"))?
        {
            return Err(SealError::Archive("a path outside the image".into()));
        }
    }
    Ok(())
}

/// The bytes of the files under `dir`.
fn tree_size(dir: &Path) -> io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            tree_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// Refuses a directory that is not on a tmpfs (from /proc/self/mountinfo).
fn require_tmpfs(path: &Path) -> Result<(), SealError> {
    let found = crate::snapshot::fs_type(path);
    match found {
        Some(kind) if kind == "tmpfs" => Ok(()),
        other => Err(SealError::NotTmpfs {
            path: path.to_owned(),
            fs_type: other.unwrap_or_else(|| "nothing known (does it exist?)".into()),
        }),
    }
}

#[cfg(test)]
mod tests;
