//! Files-only snapshots (issue 27's fallback where a runtime cannot checkpoint): an archive made
//! inside the sandbox (of /home/user and the list of installed packages) sealed exactly as a
//! checkpoint image is ([`super::seal`]: the same header, STREAM chunks, key and binding), but
//! as a stream of bytes the caller pushes and pulls rather than a directory on a tmpfs: the
//! archive is the sandbox's own bytes, read and written through its agent, and only the sealed
//! form rests anywhere.
//!
//! The header says [`SealedContent::Files`]; a checkpoint restore refuses such a stream, and
//! [`FilesOpener`] refuses anything else. Its `image_bytes` is 0 (the archive's length is known
//! only at its end; [`FilesSealer::finish`] reports it).

use chacha20poly1305::XChaCha20Poly1305;
use chacha20poly1305::aead::OsRng;
use chacha20poly1305::aead::rand_core::RngCore as _;
use chacha20poly1305::aead::stream::{DecryptorBE32, EncryptorBE32};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use zeroize::Zeroizing;

use super::seal::{
    CHUNK_BYTES, DataKey, MAGIC, NONCE_PREFIX_BYTES, SealError, SealedContent, SealedHeader,
    SealedSnapshot, SnapshotAad, TAG_BYTES, check_header, chunk_aad, io_err, profile_fingerprint,
    read_header,
};
use crate::config::SandboxProfile;

/// Seals a files-only archive pushed to it piece by piece into `out`.
pub struct FilesSealer<W> {
    out: W,
    encryptor: Option<EncryptorBE32<XChaCha20Poly1305>>,
    aad: Vec<u8>,
    plain: Zeroizing<Vec<u8>>,
    header: SealedHeader,
    written: u64,
    archived: u64,
    chunks: u64,
}

impl<W: AsyncWrite + Unpin> FilesSealer<W> {
    /// Writes the header of a files-only stream bound to `aad` (for a sandbox of `profile`)
    /// into `out`, ready for the archive's bytes.
    pub async fn start(
        mut out: W,
        key: &DataKey,
        aad: &SnapshotAad,
        profile: &SandboxProfile,
    ) -> Result<Self, SealError> {
        let mut nonce = [0u8; NONCE_PREFIX_BYTES];
        OsRng.fill_bytes(&mut nonce);
        let header = SealedHeader {
            snapshot_id: aad.snapshot_id.clone(),
            source_sandbox: aad.sandbox_id.clone(),
            profile: profile.clone(),
            profile_fingerprint: profile_fingerprint(profile),
            image_name: "home".into(),
            agent: "files".into(),
            image_bytes: 0,
            taken_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            chunk_bytes: CHUNK_BYTES as u64,
            nonce: hex::encode(nonce),
            content: Some(SealedContent::Files),
        };
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
        Ok(Self {
            out,
            encryptor: Some(EncryptorBE32::from_aead(key.cipher(), &nonce.into())),
            aad: chunk_aad(aad, &header_bytes),
            plain: Zeroizing::new(Vec::with_capacity(CHUNK_BYTES)),
            header,
            written,
            archived: 0,
            chunks: 0,
        })
    }

    /// The archive's plaintext bytes so far.
    pub fn archived_bytes(&self) -> u64 {
        self.archived
    }

    /// Seals the next bytes of the archive.
    pub async fn write(&mut self, mut bytes: &[u8]) -> Result<(), SealError> {
        self.archived += bytes.len() as u64;
        while !bytes.is_empty() {
            let room = CHUNK_BYTES - self.plain.len();
            let taken = room.min(bytes.len());
            self.plain.extend_from_slice(&bytes[..taken]);
            bytes = &bytes[taken..];
            if self.plain.len() == CHUNK_BYTES {
                let mut chunk = std::mem::replace(
                    &mut self.plain,
                    Zeroizing::new(Vec::with_capacity(CHUNK_BYTES)),
                )
                .to_vec();
                chunk.reserve_exact(TAG_BYTES);
                self.encryptor
                    .as_mut()
                    .expect("not finished")
                    .encrypt_next_in_place(&self.aad, &mut chunk)
                    .map_err(|_| {
                        io_err("sealing")(std::io::Error::other("a STREAM of 2^32 chunks"))
                    })?;
                self.emit(&chunk).await?;
            }
        }
        Ok(())
    }

    async fn emit(&mut self, sealed: &[u8]) -> Result<(), SealError> {
        self.out
            .write_all(sealed)
            .await
            .map_err(io_err("writing the sealed snapshot"))?;
        self.written += sealed.len() as u64;
        self.chunks += 1;
        Ok(())
    }

    /// Seals what is left as the last chunk and flushes; what was sealed (its header's
    /// `image_bytes` is the archive's length).
    pub async fn finish(mut self) -> Result<SealedSnapshot, SealError> {
        let encryptor = self.encryptor.take().expect("finished once");
        let mut last = std::mem::take(&mut *self.plain);
        encryptor
            .encrypt_last_in_place(&self.aad, &mut last)
            .map_err(|_| io_err("sealing the last chunk")(std::io::Error::other("refused")))?;
        self.emit(&last).await?;
        self.out
            .flush()
            .await
            .map_err(io_err("writing the sealed snapshot"))?;
        let mut header = self.header.clone();
        header.image_bytes = self.archived;
        Ok(SealedSnapshot {
            header,
            sealed_bytes: self.written,
            chunks: self.chunks,
        })
    }
}

/// Opens a sealed files-only archive chunk by chunk, authenticating each before handing it out.
pub struct FilesOpener<R> {
    reader: R,
    decryptor: Option<DecryptorBE32<XChaCha20Poly1305>>,
    aad: Vec<u8>,
    chunk: u64,
    /// The stream's header.
    pub header: SealedHeader,
}

impl<R: AsyncRead + Unpin> FilesOpener<R> {
    /// Reads and checks the header: the stream must be a files-only archive bound to `aad`.
    pub async fn open(mut reader: R, key: &DataKey, aad: &SnapshotAad) -> Result<Self, SealError> {
        let (header, header_bytes) = read_header(&mut reader).await?;
        check_header(&header, aad)?;
        if header.content != Some(SealedContent::Files) {
            return Err(SealError::Format(
                "a checkpoint image, not a files-only archive".into(),
            ));
        }
        let nonce = <[u8; NONCE_PREFIX_BYTES]>::try_from(
            hex::decode(&header.nonce)
                .map_err(|_| SealError::Format("a malformed nonce".into()))?,
        )
        .map_err(|_| SealError::Format("a nonce of the wrong length".into()))?;
        Ok(Self {
            reader,
            decryptor: Some(DecryptorBE32::from_aead(key.cipher(), &nonce.into())),
            aad: chunk_aad(aad, &header_bytes),
            chunk: 0,
            header,
        })
    }

    /// The next chunk of the archive, authenticated; `None` after the last one. A stream cut
    /// short, altered or reordered is an error, never a shorter archive.
    pub async fn next_chunk(&mut self) -> Result<Option<Zeroizing<Vec<u8>>>, SealError> {
        if self.decryptor.is_none() {
            return Ok(None);
        }
        let full = CHUNK_BYTES + TAG_BYTES;
        let mut bytes = Vec::with_capacity(full);
        while bytes.len() < full {
            let n = (&mut self.reader)
                .take((full - bytes.len()) as u64)
                .read_to_end(&mut bytes)
                .await
                .map_err(io_err("reading the sealed snapshot"))?;
            if n == 0 {
                break;
            }
        }
        let chunk = self.chunk;
        let last = bytes.len() < full;
        if last && bytes.len() < TAG_BYTES {
            return Err(SealError::Truncated { chunks: chunk });
        }
        let opened = if last {
            let decryptor = self.decryptor.take().expect("present");
            decryptor.decrypt_last_in_place(&self.aad, &mut bytes)
        } else {
            self.decryptor
                .as_mut()
                .expect("present")
                .decrypt_next_in_place(&self.aad, &mut bytes)
        };
        if opened.is_err() {
            self.decryptor = None;
            return Err(SealError::Unauthentic { chunk });
        }
        self.chunk += 1;
        Ok(Some(Zeroizing::new(bytes)))
    }
}

impl<W> std::fmt::Debug for FilesSealer<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilesSealer")
            .field("snapshot", &self.header.snapshot_id)
            .field("archived", &self.archived)
            .finish_non_exhaustive()
    }
}

impl<R> std::fmt::Debug for FilesOpener<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilesOpener")
            .field("snapshot", &self.header.snapshot_id)
            .field("chunk", &self.chunk)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> SandboxProfile {
        SandboxProfile::default()
    }

    fn aad(snapshot: &str) -> SnapshotAad {
        SnapshotAad {
            tenant_id: "t1".into(),
            sandbox_id: "sbx_1".into(),
            snapshot_id: snapshot.into(),
        }
    }

    async fn sealed(archive: &[u8], key: &DataKey) -> Vec<u8> {
        let mut out = Vec::new();
        let mut sealer = FilesSealer::start(&mut out, key, &aad("snap_1"), &profile())
            .await
            .unwrap();
        for piece in archive.chunks(1000) {
            sealer.write(piece).await.unwrap();
        }
        let done = sealer.finish().await.unwrap();
        assert_eq!(done.header.image_bytes, archive.len() as u64);
        out
    }

    async fn opened(stream: &[u8], key: &DataKey, aad: &SnapshotAad) -> Result<Vec<u8>, SealError> {
        let mut opener = FilesOpener::open(stream, key, aad).await?;
        let mut plain = Vec::new();
        while let Some(chunk) = opener.next_chunk().await? {
            plain.extend_from_slice(&chunk);
        }
        Ok(plain)
    }

    #[tokio::test]
    async fn an_archive_round_trips_and_nothing_else_opens() {
        let key = DataKey::generate();
        // Three full chunks and a part: every boundary is crossed.
        let archive: Vec<u8> = (0..CHUNK_BYTES * 3 + 17).map(|i| (i % 251) as u8).collect();
        let stream = sealed(&archive, &key).await;
        assert_eq!(
            opened(&stream, &key, &aad("snap_1")).await.unwrap(),
            archive
        );
        // Another snapshot's binding, another key, a stream cut at a chunk boundary, a flipped
        // byte: refused, never a shorter archive.
        assert!(opened(&stream, &key, &aad("snap_2")).await.is_err());
        assert!(
            opened(&stream, &DataKey::generate(), &aad("snap_1"))
                .await
                .is_err()
        );
        let header_len = stream.len() - (archive.len() + 4 * TAG_BYTES);
        let cut = &stream[..header_len + 2 * (CHUNK_BYTES + TAG_BYTES)];
        assert!(opened(cut, &key, &aad("snap_1")).await.is_err());
        let mut flipped = stream.clone();
        let at = flipped.len() - 5;
        flipped[at] ^= 1;
        assert!(opened(&flipped, &key, &aad("snap_1")).await.is_err());
    }

    #[tokio::test]
    async fn a_checkpoint_restore_refuses_a_files_only_stream() {
        let shm = std::path::Path::new("/dev/shm");
        if crate::snapshot::fs_type(shm).as_deref() != Some("tmpfs") {
            eprintln!("skipping: /dev/shm is not a tmpfs here");
            return;
        }
        let key = DataKey::generate();
        let stream = sealed(b"an archive", &key).await;
        let opened =
            super::super::seal::SealedSnapshot::open(&stream[..], &key, &aad("snap_1"), shm).await;
        assert!(
            matches!(&opened, Err(SealError::Format(why)) if why.contains("files-only")),
            "refused as a files-only archive: {:?}",
            opened.err()
        );
    }

    #[tokio::test]
    async fn an_empty_archive_and_an_exact_multiple_round_trip() {
        let key = DataKey::generate();
        for len in [0, CHUNK_BYTES, CHUNK_BYTES * 2] {
            let archive = vec![7u8; len];
            let stream = sealed(&archive, &key).await;
            assert_eq!(
                opened(&stream, &key, &aad("snap_1")).await.unwrap(),
                archive
            );
        }
    }
}
