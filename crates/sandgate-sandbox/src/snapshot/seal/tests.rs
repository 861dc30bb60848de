//! Sealing and opening on a tmpfs (`/dev/shm`), playing each attack on the stream: a flipped
//! bit, a cut, swapped chunks, another tenant's or snapshot's binding, a wrong key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::*;
use crate::config::SandboxProfile;

/// A scratch directory on the tmpfs with `images/` (where a snapshot's image is) and `open/`
/// (where opening writes); removed on drop.
struct Scratch {
    root: PathBuf,
}

impl Scratch {
    fn new() -> Self {
        let root = PathBuf::from("/dev/shm").join(format!(
            "sandgate-seal-test-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(root.join("images")).unwrap();
        std::fs::create_dir_all(root.join("open")).unwrap();
        Self { root }
    }

    fn open_dir(&self) -> PathBuf {
        self.root.join("open")
    }

    /// What opening left behind.
    fn leftovers(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.open_dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    }

    /// A snapshot whose image holds `files` (relative path → bytes).
    fn snapshot(&self, id: &str, files: &BTreeMap<String, Vec<u8>>) -> Snapshot {
        let dir = self.root.join("images").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        let mut size_bytes = 0;
        for (path, bytes) in files {
            let path = dir.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, bytes).unwrap();
            size_bytes += bytes.len() as u64;
        }
        Snapshot {
            id: id.into(),
            source_sandbox: "sbx_source".into(),
            profile: SandboxProfile {
                name: "snap".into(),
                runtime: crate::OciRuntime::Runsc2024,
                ..SandboxProfile::default()
            },
            image: SnapshotImage {
                dir,
                size_bytes,
                name: id.into(),
                agent: "agent-fingerprint".into(),
            },
            taken: std::time::SystemTime::now(),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn aad(tenant: &str, snapshot: &str) -> SnapshotAad {
    SnapshotAad {
        tenant_id: tenant.into(),
        sandbox_id: "sbx_source".into(),
        snapshot_id: snapshot.into(),
    }
}

/// Bytes no compressor could shrink, reproducibly.
fn noise(len: usize, seed: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut state = Sha256::digest([seed]);
    while out.len() < len {
        out.extend_from_slice(&state);
        state = Sha256::digest(state);
    }
    out.truncate(len);
    out
}

/// An image like runsc's: a large compressed memory file, small metadata files, a subdirectory.
fn image_files() -> BTreeMap<String, Vec<u8>> {
    BTreeMap::from([
        (
            "checkpoint.img".to_owned(),
            noise(5 * CHUNK_BYTES + 1234, 1),
        ),
        ("pages.meta".to_owned(), b"{\"pages\": 7}".to_vec()),
        ("sub/deeper/empty".to_owned(), Vec::new()),
        ("sub/config.json".to_owned(), noise(700, 2)),
    ])
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn sealed(
    snapshot: &Snapshot,
    key: &DataKey,
    aad: &SnapshotAad,
) -> (Vec<u8>, SealedSnapshot) {
    let mut out = Vec::new();
    let info = snapshot.seal(key, aad, &mut out).await.expect("it seals");
    (out, info)
}

fn read_tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Where the chunks begin in a sealed stream.
fn body_start(stream: &[u8]) -> usize {
    let len = u32::from_be_bytes(stream[8..12].try_into().unwrap()) as usize;
    12 + len
}

/// Opens `stream` expecting a refusal; checks nothing was left behind.
async fn refused(scratch: &Scratch, stream: &[u8], key: &DataKey, aad: &SnapshotAad) -> SealError {
    let err = SealedSnapshot::open(stream, key, aad, &scratch.open_dir())
        .await
        .expect_err("a bad stream is refused");
    assert_eq!(
        scratch.leftovers(),
        Vec::<PathBuf>::new(),
        "a refused open leaves nothing ({err})"
    );
    err
}

#[test]
fn a_sealed_snapshot_opens_whole_under_its_own_binding() {
    runtime().block_on(async {
        let scratch = Scratch::new();
        let files = image_files();
        let snapshot = scratch.snapshot("snap_a", &files);
        let key = DataKey::generate();
        let binding = aad("tenant-a", "snap_a");
        let (stream, info) = sealed(&snapshot, &key, &binding).await;
        assert_eq!(info.sealed_bytes, stream.len() as u64);
        assert!(
            info.chunks >= 6,
            "five full chunks of memory and more: {info:?}"
        );
        assert_eq!(info.header.image_bytes, snapshot.size_bytes());
        assert_eq!(
            info.header.profile_fingerprint,
            profile_fingerprint(&snapshot.profile)
        );
        let plain = &files["checkpoint.img"][..64];
        assert!(
            !stream.windows(plain.len()).any(|w| w == plain),
            "the image's bytes do not appear in the sealed stream"
        );

        let opened = SealedSnapshot::open(&stream[..], &key, &binding, &scratch.open_dir())
            .await
            .expect("it opens");
        assert_eq!(opened.id, "snap_a");
        assert_eq!(opened.source_sandbox, "sbx_source");
        assert_eq!(opened.profile, snapshot.profile);
        assert_eq!(opened.image.name, "snap_a");
        assert_eq!(opened.image.agent, "agent-fingerprint");
        assert_eq!(opened.size_bytes(), snapshot.size_bytes());
        assert!(opened.image.dir.starts_with(scratch.open_dir()));
        assert_eq!(
            read_tree(&opened.image.dir),
            files,
            "every file back, byte for byte"
        );
        assert!(
            opened.image.dir.join("sub/deeper").is_dir(),
            "directories kept"
        );
        let dir = opened.image.dir.clone();
        drop(opened);
        assert!(!dir.exists(), "the opened image goes with its handle");
    });
}

#[test]
fn an_empty_image_round_trips() {
    runtime().block_on(async {
        let scratch = Scratch::new();
        let snapshot = scratch.snapshot("snap_e", &BTreeMap::new());
        let key = DataKey::generate();
        let (stream, _) = sealed(&snapshot, &key, &aad("t", "snap_e")).await;
        let opened =
            SealedSnapshot::open(&stream[..], &key, &aad("t", "snap_e"), &scratch.open_dir())
                .await
                .expect("it opens");
        assert_eq!(read_tree(&opened.image.dir), BTreeMap::new());
    });
}

#[test]
fn every_attack_on_the_stream_is_refused_with_its_error_and_leaves_nothing() {
    runtime().block_on(async {
        let scratch = Scratch::new();
        let snapshot = scratch.snapshot("snap_x", &image_files());
        let key = DataKey::generate();
        let binding = aad("tenant-a", "snap_x");
        let (stream, _) = sealed(&snapshot, &key, &binding).await;
        let body = body_start(&stream);
        let full = CHUNK_BYTES + TAG_BYTES;

        let mut flipped = stream.clone();
        flipped[body + full + 100] ^= 0x08;
        let err = refused(&scratch, &flipped, &key, &binding).await;
        assert!(
            matches!(err, SealError::Unauthentic { chunk: 1 }),
            "a flipped bit in chunk 1: {err:?}"
        );

        let mut last = stream.clone();
        let end = last.len() - 1;
        last[end] ^= 0x01;
        let err = refused(&scratch, &last, &key, &binding).await;
        assert!(
            matches!(err, SealError::Unauthentic { .. }),
            "a flipped bit in the last tag: {err:?}"
        );

        // The header is in every chunk's associated data: an edit that still parses is refused.
        let text = String::from_utf8(stream[12..body].to_vec()).unwrap();
        let edited = text.replace("\"memory_mb\":512", "\"memory_mb\":999");
        assert_ne!(edited, text);
        let mut header_edit = stream[..8].to_vec();
        header_edit.extend_from_slice(&(edited.len() as u32).to_be_bytes());
        header_edit.extend_from_slice(edited.as_bytes());
        header_edit.extend_from_slice(&stream[body..]);
        let err = refused(&scratch, &header_edit, &key, &binding).await;
        assert!(
            matches!(err, SealError::Format(_)),
            "an edited profile misses its fingerprint: {err:?}"
        );
        let edited = text.replace(
            "\"agent\":\"agent-fingerprint\"",
            "\"agent\":\"agent-fingerprinX\"",
        );
        let mut header_edit = stream[..8].to_vec();
        header_edit.extend_from_slice(&(edited.len() as u32).to_be_bytes());
        header_edit.extend_from_slice(edited.as_bytes());
        header_edit.extend_from_slice(&stream[body..]);
        let err = refused(&scratch, &header_edit, &key, &binding).await;
        assert!(
            matches!(err, SealError::Unauthentic { chunk: 0 }),
            "an edited header: {err:?}"
        );

        let at_boundary = &stream[..body + 3 * full];
        let err = refused(&scratch, at_boundary, &key, &binding).await;
        assert!(
            matches!(err, SealError::Truncated { chunks: 3 }),
            "cut after chunk 2: {err:?}"
        );
        let inside = &stream[..body + 2 * full + 500];
        let err = refused(&scratch, inside, &key, &binding).await;
        assert!(
            matches!(err, SealError::Unauthentic { chunk: 2 }),
            "cut inside chunk 2: {err:?}"
        );
        let in_header = &stream[..body - 3];
        let err = refused(&scratch, in_header, &key, &binding).await;
        assert!(
            matches!(err, SealError::Format(_)),
            "cut inside the header: {err:?}"
        );
        let mut longer = stream.clone();
        longer.extend_from_slice(b"more");
        let err = refused(&scratch, &longer, &key, &binding).await;
        assert!(
            matches!(err, SealError::Unauthentic { .. }),
            "bytes appended: {err:?}"
        );

        let mut swapped = stream[..body].to_vec();
        swapped.extend_from_slice(&stream[body + full..body + 2 * full]);
        swapped.extend_from_slice(&stream[body..body + full]);
        swapped.extend_from_slice(&stream[body + 2 * full..]);
        let err = refused(&scratch, &swapped, &key, &binding).await;
        assert!(
            matches!(err, SealError::Unauthentic { chunk: 0 }),
            "chunks 0 and 1 swapped: {err:?}"
        );
        let mut dropped = stream[..body + full].to_vec();
        dropped.extend_from_slice(&stream[body + 2 * full..]);
        let err = refused(&scratch, &dropped, &key, &binding).await;
        assert!(
            matches!(err, SealError::Unauthentic { chunk: 1 }),
            "chunk 1 left out: {err:?}"
        );

        let err = refused(&scratch, &stream, &key, &aad("tenant-b", "snap_x")).await;
        assert!(
            matches!(err, SealError::Unauthentic { chunk: 0 }),
            "another tenant's binding: {err:?}"
        );
        let err = refused(&scratch, &stream, &key, &aad("tenant-a", "snap_y")).await;
        assert!(
            matches!(err, SealError::Binding { .. }),
            "another snapshot's binding: {err:?}"
        );
        let other_sandbox = SnapshotAad {
            sandbox_id: "sbx_other".into(),
            ..binding.clone()
        };
        let err = refused(&scratch, &stream, &key, &other_sandbox).await;
        assert!(
            matches!(err, SealError::Binding { .. }),
            "another sandbox's binding: {err:?}"
        );
        let err = refused(&scratch, &stream, &DataKey::generate(), &binding).await;
        assert!(
            matches!(err, SealError::Unauthentic { chunk: 0 }),
            "a wrong key: {err:?}"
        );
        let err = refused(
            &scratch,
            b"PK\x03\x04 not a snapshot at all",
            &key,
            &binding,
        )
        .await;
        assert!(
            matches!(err, SealError::Format(_)),
            "not a sealed snapshot: {err:?}"
        );

        // After all that, the genuine stream still opens.
        SealedSnapshot::open(&stream[..], &key, &binding, &scratch.open_dir())
            .await
            .expect("the genuine stream opens");
    });
}

#[test]
fn another_snapshots_stream_does_not_open_under_this_ones_header() {
    runtime().block_on(async {
        // Two snapshots of one tenant under one key: chunks of one spliced after the other's
        // header do not authenticate (the header's hash is in each chunk's associated data).
        let scratch = Scratch::new();
        let key = DataKey::generate();
        let a = scratch.snapshot("snap_1", &image_files());
        let b = scratch.snapshot("snap_2", &image_files());
        let (sa, _) = sealed(&a, &key, &aad("t", "snap_1")).await;
        let (sb, _) = sealed(&b, &key, &aad("t", "snap_2")).await;
        let mut spliced = sa[..body_start(&sa)].to_vec();
        spliced.extend_from_slice(&sb[body_start(&sb)..]);
        let err = refused(&scratch, &spliced, &key, &aad("t", "snap_1")).await;
        assert!(
            matches!(err, SealError::Unauthentic { chunk: 0 }),
            "{err:?}"
        );
    });
}

#[test]
fn sealing_under_another_snapshots_binding_is_refused() {
    runtime().block_on(async {
        let scratch = Scratch::new();
        let snapshot = scratch.snapshot("snap_s", &image_files());
        let mut out = Vec::new();
        let err = snapshot
            .seal(&DataKey::generate(), &aad("t", "snap_other"), &mut out)
            .await
            .expect_err("refused");
        assert!(matches!(err, SealError::Binding { .. }), "{err:?}");
        assert!(out.is_empty(), "nothing written");
    });
}

#[test]
fn opening_outside_a_tmpfs_is_refused() {
    runtime().block_on(async {
        let scratch = Scratch::new();
        let snapshot = scratch.snapshot("snap_d", &image_files());
        let key = DataKey::generate();
        let (stream, _) = sealed(&snapshot, &key, &aad("t", "snap_d")).await;
        // The source tree is on a disk, never a tmpfs.
        let disk = Path::new(env!("CARGO_MANIFEST_DIR"));
        let err = SealedSnapshot::open(&stream[..], &key, &aad("t", "snap_d"), disk)
            .await
            .expect_err("refused");
        assert!(matches!(err, SealError::NotTmpfs { .. }), "{err:?}");
    });
}

#[test]
fn an_image_holding_a_symlink_is_refused_on_open() {
    runtime().block_on(async {
        let scratch = Scratch::new();
        let snapshot = scratch.snapshot("snap_l", &image_files());
        std::os::unix::fs::symlink("/etc/passwd", snapshot.image.dir.join("link")).unwrap();
        let key = DataKey::generate();
        let (stream, _) = sealed(&snapshot, &key, &aad("t", "snap_l")).await;
        let err = refused(&scratch, &stream, &key, &aad("t", "snap_l")).await;
        assert!(matches!(err, SealError::Archive(_)), "{err:?}");
    });
}

#[test]
fn a_data_key_never_prints() {
    let key = DataKey::from_bytes([7; 32]);
    assert_eq!(format!("{key:?}"), "DataKey(…)");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Any image round-trips; any single flipped bit after the header is refused, leaving
    /// nothing.
    #[test]
    fn any_image_round_trips_and_any_flipped_bit_is_refused(
        sizes in proptest::collection::vec(0usize..(3 * CHUNK_BYTES), 1..4),
        flip in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        runtime().block_on(async {
            let scratch = Scratch::new();
            let files: BTreeMap<String, Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &len)| (format!("d{}/f{i}", i % 2), noise(len, i as u8)))
                .collect();
            let snapshot = scratch.snapshot("snap_p", &files);
            let key = DataKey::generate();
            let binding = aad("t", "snap_p");
            let (stream, _) = sealed(&snapshot, &key, &binding).await;
            let opened = SealedSnapshot::open(&stream[..], &key, &binding, &scratch.open_dir())
                .await
                .expect("it opens");
            assert_eq!(read_tree(&opened.image.dir), files);
            drop(opened);
            let body = body_start(&stream);
            let at = body + flip.index(stream.len() - body);
            let mut bad = stream.clone();
            bad[at] ^= 1 << bit;
            let err = refused(&scratch, &bad, &key, &binding).await;
            assert!(matches!(err, SealError::Unauthentic { .. }), "bit {bit} of byte {at}: {err:?}");
        });
    }
}

/// Not a check: how long sealing and opening a checkpoint-sized image take in this build
/// profile, printed (`cargo test -p sandgate-sandbox --lib seal_timing -- --ignored
/// --nocapture`), to see what the workspace's `[profile.dev.package.*]` opt-levels buy. The
/// image is `SANDGATE_SEAL_TIMING_IMAGE` (a directory, e.g. a real runsc image) or else ~100 MB
/// like one: memory pages half noise, half zeros and repeats.
#[test]
#[ignore = "a timing printout, not a test"]
fn seal_timing_printout() {
    runtime().block_on(async {
        let scratch = Scratch::new();
        let snapshot = match std::env::var_os("SANDGATE_SEAL_TIMING_IMAGE") {
            Some(dir) => scratch.snapshot("snap_t", &read_tree(Path::new(&dir))),
            None => {
                let mut pages = noise(50 << 20, 9);
                pages.extend(std::iter::repeat_n(0u8, 30 << 20));
                pages.extend(b"import numpy, pandas\n".repeat(1 << 20));
                scratch.snapshot("snap_t", &BTreeMap::from([("pages.img".to_owned(), pages)]))
            }
        };
        let key = DataKey::generate();
        let binding = aad("t", "snap_t");
        let started = std::time::Instant::now();
        let (stream, info) = sealed(&snapshot, &key, &binding).await;
        let sealing = started.elapsed();
        let started = std::time::Instant::now();
        let opened = SealedSnapshot::open(&stream[..], &key, &binding, &scratch.open_dir())
            .await
            .expect("it opens");
        let opening = started.elapsed();
        eprintln!(
            "image {} bytes, sealed {} bytes ({} chunks): sealing {sealing:?}, opening {opening:?}",
            snapshot.size_bytes(),
            info.sealed_bytes,
            info.chunks,
        );
        assert_eq!(opened.size_bytes(), snapshot.size_bytes());
    });
}
