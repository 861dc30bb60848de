//! The S3 snapshot store (issue 27) against a real S3-compatible server on loopback (moto, see
//! tests/shared/s3.rs): objects written, read back, listed and deleted through the S3 API; a
//! snapshot past one part goes up as a multipart upload; a missing bucket and refused
//! credentials are errors that name the setting to fix; a tenant's purge leaves another
//! tenant's objects alone.

use object_store::path::Path as ObjectPath;
use sandgate_service::config::S3StoreConfig;
use sandgate_service::snapshots::{SnapshotStore, SnapshotStoreError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

use crate::s3::{ACCESS_KEY_ID, Moto, REGION, SECRET_ACCESS_KEY};

const BUCKET: &str = "sandgate-snapshots";

fn config(moto: &Moto, bucket: &str, prefix: &str) -> S3StoreConfig {
    S3StoreConfig {
        bucket: bucket.into(),
        endpoint: moto.endpoint.clone(),
        region: REGION.into(),
        access_key_id: ACCESS_KEY_ID.into(),
        secret_access_key: SECRET_ACCESS_KEY.into(),
        prefix: prefix.into(),
        allow_http: true,
    }
}

async fn put(store: &SnapshotStore, tenant: Uuid, snapshot_id: &str, bytes: &[u8]) {
    let mut out = store.writer(tenant, snapshot_id);
    out.write_all(bytes).await.expect("the bytes are written");
    out.shutdown().await.expect("the object is complete");
}

async fn get(store: &SnapshotStore, tenant: Uuid, snapshot_id: &str) -> Vec<u8> {
    let mut read = Vec::new();
    store
        .reader(tenant, snapshot_id)
        .await
        .expect("a reader")
        .read_to_end(&mut read)
        .await
        .expect("the object is read");
    read
}

/// Bytes that compress to nothing like themselves, so nothing between could shortcut them.
fn noise(len: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

#[tokio::test]
async fn an_s3_store_puts_gets_and_deletes_a_snapshot_under_its_prefix() {
    let moto = Moto::start(&[BUCKET]);
    let store = SnapshotStore::s3(&config(&moto, BUCKET, "sandgate/test")).expect("a store");
    store.check().await.expect("the bucket is reachable");
    let tenant = Uuid::new_v4();
    let bytes = noise(64 * 1024);
    put(&store, tenant, "snap_a", &bytes).await;

    assert_eq!(
        moto.keys(BUCKET).await,
        vec![format!("sandgate/test/tenants/{tenant}/snap_a.sgsnap")],
        "the object is in the bucket under the prefix, listed through the S3 API"
    );
    assert!(store.contains(tenant, "snap_a").await.expect("a lookup"));
    assert_eq!(
        get(&store, tenant, "snap_a").await,
        bytes,
        "the same bytes back"
    );

    store.delete(tenant, "snap_a").await.expect("deleted");
    assert!(
        moto.keys(BUCKET).await.is_empty(),
        "the bucket is empty again"
    );
    assert!(!store.contains(tenant, "snap_a").await.expect("a lookup"));
    assert!(
        matches!(
            store.reader(tenant, "snap_a").await,
            Err(SnapshotStoreError::Missing { .. })
        ),
        "a deleted snapshot is missing, not a store failure"
    );
    store
        .delete(tenant, "snap_a")
        .await
        .expect("deleting what is gone is no error");
}

#[tokio::test]
async fn a_snapshot_past_one_part_goes_up_as_a_multipart_upload_and_streams_back() {
    let moto = Moto::start(&[BUCKET]);
    let store = SnapshotStore::s3(&config(&moto, BUCKET, "")).expect("a store");
    let tenant = Uuid::new_v4();
    // Past the writer's 10 MiB buffer: at least two parts.
    let bytes = noise(23 * 1024 * 1024);
    put(&store, tenant, "snap_big", &bytes).await;

    let raw = moto.bucket(BUCKET);
    let meta = raw
        .head(&ObjectPath::from(format!(
            "tenants/{tenant}/snap_big.sgsnap"
        )))
        .await
        .expect("the object is in the bucket");
    assert_eq!(meta.size, bytes.len() as u64, "the whole snapshot is there");
    // S3 names a multipart object's ETag "<md5 of the parts' md5s>-<part count>".
    let etag = meta.e_tag.expect("an ETag");
    let parts: u32 = etag
        .trim_matches('"')
        .rsplit_once('-')
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or_else(|| panic!("{etag} is not a multipart upload's ETag"));
    assert!(parts >= 2, "{parts} parts: {etag}");
    assert!(
        get(&store, tenant, "snap_big").await == bytes,
        "the multipart object reads back as written"
    );
}

#[tokio::test]
async fn a_missing_bucket_is_an_error_that_names_snapshots_s3_bucket() {
    let moto = Moto::start(&[BUCKET]);
    let store = SnapshotStore::s3(&config(&moto, "no-such-bucket", "")).expect("a store");
    let err = store
        .check()
        .await
        .expect_err("a missing bucket fails the check");
    assert!(
        matches!(err, SnapshotStoreError::BucketMissing { .. }),
        "a missing bucket, not a generic failure: {err:?}"
    );
    assert!(err.to_string().contains("snapshots.s3.bucket"), "{err}");

    // A pause's write into it says the same.
    let mut out = store.writer(Uuid::new_v4(), "snap_x");
    let written = match out.write_all(b"sealed").await {
        Ok(()) => out.shutdown().await,
        Err(err) => Err(err),
    };
    let err = store.write_failed(written.expect_err("nothing is written into no bucket"));
    assert!(
        matches!(err, SnapshotStoreError::BucketMissing { .. }),
        "the write says the bucket is missing: {err:?}"
    );
    assert!(
        moto.keys(BUCKET).await.is_empty(),
        "nothing landed elsewhere"
    );
}

#[tokio::test]
async fn refused_credentials_are_an_error_that_names_the_key_settings() {
    let moto = Moto::start_checking_credentials(&[BUCKET]);
    let store = SnapshotStore::s3(&config(&moto, BUCKET, "")).expect("a store");
    let err = store
        .check()
        .await
        .expect_err("credentials the server does not know are refused");
    assert!(
        matches!(err, SnapshotStoreError::CredentialsRefused { .. }),
        "refused credentials, not a generic failure: {err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("snapshots.s3.access_key_id")
            && message.contains("snapshots.s3.secret_access_key"),
        "{message}"
    );
    assert!(
        !message.contains(SECRET_ACCESS_KEY),
        "the secret is never in the message: {message}"
    );
}

#[tokio::test]
async fn a_tenants_purge_deletes_its_snapshots_and_no_other_tenants() {
    let moto = Moto::start(&[BUCKET]);
    let store = SnapshotStore::s3(&config(&moto, BUCKET, "p")).expect("a store");
    let (purged, other) = (Uuid::new_v4(), Uuid::new_v4());
    put(&store, purged, "snap_1", b"one").await;
    put(&store, purged, "snap_2", b"two").await;
    put(&store, other, "snap_3", b"three").await;

    assert_eq!(store.delete_tenant(purged).await.expect("purged"), 2);
    assert_eq!(
        moto.keys(BUCKET).await,
        vec![format!("p/tenants/{other}/snap_3.sgsnap")],
        "only the other tenant's snapshot is left"
    );
    // The purged tenant's ids name nothing in the other's prefix.
    assert!(!store.contains(purged, "snap_3").await.expect("a lookup"));
}
