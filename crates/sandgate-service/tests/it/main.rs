//! The service against the real stack: Postgres (`DATABASE_URL`) and the Docker engine with
//! snapshots (`SANDGATE_TEST_SNAPSHOT_DOCKER`, `SANDGATE_TEST_SNAPSHOT_PLAIN`; see
//! crates/sandgate-sandbox/tests/it/snapshot.rs); the S3 snapshot store against moto on loopback
//! (`SANDGATE_TEST_PYTHON`, tests/shared/s3.rs).

mod pause_away;
mod pause_faults;
#[path = "../../../../tests/shared/s3.rs"]
mod s3;
mod s3_store;
mod sealed_snapshots;
mod support;
