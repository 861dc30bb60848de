//! A live runsc2024 sandbox checkpointed and sealed with a key from the service's custody, its
//! plaintext gone, restored from the sealed bytes alone; the same bytes refused to another
//! tenant, to an altered stream and to a moved key.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use chrono::Utc;
use sandgate_node::{NodeHandle, SandboxHandle};
use sandgate_sandbox::{
    DataKey, ExecOptions, SandboxError, SealError, SealedSnapshot, SnapshotAad,
};
use sandgate_service::snapshots::{SnapshotCustody, SnapshotKeys, SnapshotServiceError};
use sandgate_store::sandboxes::{self, NewLease};
use sandgate_store::tenants;

use crate::support::{SnapEngine, TestDb, within};

const LIMIT: Duration = Duration::from_secs(180);
const SECRET: &[u8] = b"the test deployment's secret, at least 32 characters";

async fn value(sandbox: &SandboxHandle, code: &str) -> String {
    let outcome = within(
        LIMIT,
        "a cell",
        sandbox.exec(code, ExecOptions::default(), None),
    )
    .await
    .expect("the cell runs");
    assert!(outcome.error.is_none(), "the cell failed: {outcome:?}");
    outcome
        .result
        .as_ref()
        .and_then(|r| r.get("text/plain").cloned())
        .unwrap_or_default()
}

/// Samples of an image's bytes (32 bytes at a quarter, half and three quarters of each file of
/// at least 4 KiB) and its file names, learnt by opening the sealed stream onto a scratch tmpfs.
struct ImagePrint {
    samples: Vec<Vec<u8>>,
}

/// How many different byte values `bytes` holds.
fn distinct(bytes: &[u8]) -> usize {
    let mut seen = [false; 256];
    for b in bytes {
        seen[usize::from(*b)] = true;
    }
    seen.iter().filter(|s| **s).count()
}

impl ImagePrint {
    async fn of(sealed: &[u8], key: &DataKey, aad: &SnapshotAad) -> Self {
        let scratch = PathBuf::from("/dev/shm").join(format!(
            "sandgate-seal-it-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&scratch).unwrap();
        let opened = SealedSnapshot::open(sealed, key, aad, &scratch)
            .await
            .expect("the sealed stream opens with the custody's key");
        let mut samples = Vec::new();
        for path in files(&opened.image.dir) {
            let bytes = std::fs::read(&path).unwrap();
            if bytes.len() >= 4096 {
                for at in [bytes.len() / 4, bytes.len() / 2, 3 * bytes.len() / 4] {
                    // An uncompressed image (runsc's direct route) is mostly zero pages and
                    // small structures that any database file also holds: take the first run
                    // from here whose bytes are varied enough to be this image's own.
                    if let Some(sample) = bytes[at..]
                        .windows(32)
                        .step_by(8)
                        .take(1 << 16)
                        .find(|w| distinct(w) >= 24)
                    {
                        samples.push(sample.to_vec());
                    }
                }
            }
        }
        assert!(
            !samples.is_empty(),
            "a runsc image has a memory file of some size"
        );
        let print = Self { samples };
        // The search can fail: it finds the image where the image is.
        assert!(
            !print
                .found_in(std::slice::from_ref(&scratch), SystemTime::UNIX_EPOCH)
                .is_empty(),
            "the print finds the opened image"
        );
        drop(opened);
        std::fs::remove_dir_all(&scratch).unwrap();
        print
    }

    /// Files under `roots` (changed since `since`, at most 512 MiB) holding a sample.
    fn found_in(&self, roots: &[PathBuf], since: SystemTime) -> Vec<PathBuf> {
        let mut found = Vec::new();
        for root in roots {
            for path in files(root) {
                let Ok(meta) = std::fs::metadata(&path) else {
                    continue;
                };
                if meta.len() > 512 << 20 || meta.modified().is_ok_and(|m| m < since) {
                    continue;
                }
                let Ok(bytes) = std::fs::read(&path) else {
                    continue;
                };
                if self
                    .samples
                    .iter()
                    .any(|s| bytes.windows(s.len()).any(|w| w == s.as_slice()))
                {
                    found.push(path);
                }
            }
        }
        found
    }
}

/// Every regular file under `dir` (not following symlinks).
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            out.extend(files(&entry.path()));
        } else if kind.is_file() {
            out.push(entry.path());
        }
    }
    out
}

/// Where a snapshot's plaintext could be left: the engine's plaintext tmpfs (its images,
/// links, TMPDIR and containerd's content store), the containers' directories in the data root,
/// the rest of the data root but its image layers, and /tmp.
fn searched(engine: &SnapEngine, containers: &[&str]) -> Vec<PathBuf> {
    let mut roots = vec![engine.plain.clone(), PathBuf::from("/tmp")];
    for id in containers {
        roots.push(engine.data_root.join("containers").join(id));
    }
    for entry in std::fs::read_dir(&engine.data_root)
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name();
        if !["overlay2", "image", "containers", "volumes"].contains(&name.to_str().unwrap_or("")) {
            roots.push(entry.path());
        }
    }
    roots
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_snapshot_restores_its_sandbox_and_opens_for_no_one_else() {
    let started = SystemTime::now() - Duration::from_secs(1);
    let db = TestDb::new().await;
    let engine = SnapEngine::new("seal").await;
    let custody = SnapshotCustody::new(db.pool.clone(), SnapshotKeys::new(SECRET));
    let node = NodeHandle::Local(engine.manager.clone());
    let mut conn = db.pool.acquire().await.unwrap();
    let owner = tenants::create(&mut conn, "owner").await.unwrap();
    let other = tenants::create(&mut conn, "other").await.unwrap();

    let sandbox = SandboxHandle::Local(
        within(LIMIT, "a lease", engine.manager.lease("snap"))
            .await
            .expect("a runsc2024 sandbox"),
    );
    let lease = NewLease {
        tenant_id: owner.id,
        conversation_id: Some("conv-1"),
        idle_timeout_seconds: 600,
        expires_at: Utc::now() + chrono::Duration::hours(1),
        grant_id: None,
    };
    sandboxes::insert_leased(
        &mut conn,
        sandbox.id(),
        "snap",
        sandbox.container_id(),
        "node1",
        &lease,
    )
    .await
    .unwrap();
    drop(conn);
    value(
        &sandbox,
        "import pandas as pd\nrows = pd.DataFrame({'n': [1, 2, 3]})\nsecret = 'kept-' + str(41 + 1)\n\
         open('/home/user/notes.txt', 'w').write('written before the pause')",
    )
    .await;

    // Another tenant cannot snapshot the owner's sandbox: nothing is checkpointed.
    let mut nowhere = Vec::new();
    let refused = custody
        .take(other.id, "node1", &node, &sandbox, false, &mut nowhere)
        .await
        .expect_err("another tenant's sandbox");
    assert!(
        matches!(refused, SnapshotServiceError::SandboxNotFound { .. }),
        "{refused:?}"
    );
    assert!(nowhere.is_empty());
    assert_eq!(
        value(&sandbox, "secret").await,
        "'kept-42'",
        "the sandbox serves on"
    );

    let at_rest = std::env::temp_dir().join(format!(
        "sandgate-seal-it-{}.sealed",
        uuid::Uuid::new_v4().simple()
    ));
    let file = tokio::fs::File::create(&at_rest).await.unwrap();
    let taken = within(
        LIMIT,
        "a sealed checkpoint",
        custody.take(owner.id, "node1", &node, &sandbox, false, file),
    )
    .await
    .expect("the owner's sandbox is checkpointed and sealed");
    let sealed = std::fs::read(&at_rest).unwrap();
    assert_eq!(taken.row.sealed_bytes as usize, sealed.len());
    assert_eq!(taken.row.tenant_id, owner.id);
    assert_eq!(taken.row.sandbox_id, sandbox.id());
    assert!(taken.row.image_bytes > 1_000_000, "{:?}", taken.row);
    assert!(
        !sealed
            .windows(taken.row.wrapped_key.len())
            .any(|w| w == taken.row.wrapped_key.as_slice()),
        "the stream does not carry its key"
    );

    // What the image looks like, learnt from the sealed bytes with the custody's key.
    let binding = SnapshotAad {
        tenant_id: owner.id.to_string(),
        sandbox_id: sandbox.id().to_owned(),
        snapshot_id: taken.row.id.clone(),
    };
    let keys = SnapshotKeys::new(SECRET);
    let key = keys
        .unwrap(&binding, &taken.row.wrapped_key)
        .expect("the key unwraps");
    let print = ImagePrint::of(&sealed, &key, &binding).await;
    let leftovers = print.found_in(&searched(&engine, &[sandbox.container_id()]), started);
    assert_eq!(
        leftovers,
        Vec::<PathBuf>::new(),
        "no plaintext of the image is left after the checkpoint"
    );
    assert!(
        print
            .found_in(std::slice::from_ref(&at_rest), started)
            .is_empty(),
        "the sealed file holds none of the image's bytes"
    );

    // Mis-bound, tampered, cut: refused, and no container is made.
    let before = engine.containers().await;
    let refused = custody
        .restore(other.id, &taken.row.id, &node, &sealed[..])
        .await
        .expect_err("another tenant's snapshot");
    assert!(
        matches!(refused, SnapshotServiceError::NotFound { .. }),
        "{refused:?}"
    );
    let as_other = SnapshotAad {
        tenant_id: other.id.to_string(),
        ..binding.clone()
    };
    assert!(
        keys.unwrap(&as_other, &taken.row.wrapped_key).is_err(),
        "the key does not unwrap for another tenant"
    );
    let refused = node
        .restore_sealed(&sealed[..], &key, &as_other, false)
        .await
        .expect_err("opened with another tenant's binding");
    assert!(
        matches!(&refused, SandboxError::Seal { source, .. } if matches!(**source, SealError::Unauthentic { chunk: 0 })),
        "{refused:?}"
    );
    let mut altered = sealed.clone();
    let at = altered.len() / 2;
    altered[at] ^= 0x20;
    let refused = node
        .restore_sealed(&altered[..], &key, &binding, false)
        .await
        .expect_err("an altered stream");
    assert!(
        matches!(&refused, SandboxError::Seal { source, .. } if matches!(**source, SealError::Unauthentic { .. })),
        "{refused:?}"
    );
    let refused = custody
        .restore(
            owner.id,
            &taken.row.id,
            &node,
            &sealed[..sealed.len() - 100],
        )
        .await
        .expect_err("a stream cut short");
    assert!(
        matches!(&refused, SnapshotServiceError::Sandbox(e) if matches!(&**e, SandboxError::Seal { .. })),
        "{refused:?}"
    );
    assert_eq!(
        engine.containers().await,
        before,
        "a refused restore makes no container"
    );

    // The genuine bytes, through the service: the variables and the file are back.
    let file = tokio::fs::File::open(&at_rest).await.unwrap();
    let restored = within(
        LIMIT,
        "a sealed restore",
        custody.restore(owner.id, &taken.row.id, &node, file),
    )
    .await
    .expect("the sealed snapshot restores");
    assert_ne!(restored.id(), sandbox.id());
    assert_eq!(
        value(
            &restored,
            "(secret, int(rows['n'].sum()), open('/home/user/notes.txt').read())"
        )
        .await,
        "('kept-42', 6, 'written before the pause')"
    );
    let leftovers = print.found_in(
        &searched(&engine, &[sandbox.container_id(), restored.container_id()]),
        started,
    );
    assert_eq!(
        leftovers,
        Vec::<PathBuf>::new(),
        "no plaintext of the image is left after the restore"
    );
    assert_eq!(
        files(&engine.plain.join("sandgate/images"))
            .into_iter()
            .filter(|p| p.to_string_lossy().contains(&taken.row.id))
            .collect::<Vec<_>>(),
        Vec::<PathBuf>::new(),
        "no image of this snapshot on the tmpfs"
    );

    assert!(custody.forget(owner.id, &taken.row.id).await.unwrap());
    let refused = custody
        .restore(owner.id, &taken.row.id, &node, &sealed[..])
        .await
        .expect_err("a forgotten snapshot");
    assert!(
        matches!(refused, SnapshotServiceError::NotFound { .. }),
        "{refused:?}"
    );
    let _ = std::fs::remove_file(&at_rest);
    engine.cleanup().await;
    db.drop_db().await;
}
