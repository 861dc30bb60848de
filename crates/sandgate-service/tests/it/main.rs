//! The service against the real stack: Postgres (`DATABASE_URL`) and the Docker engine with
//! snapshots (`SANDGATE_TEST_SNAPSHOT_DOCKER`, `SANDGATE_TEST_SNAPSHOT_PLAIN`; see
//! crates/sandgate-sandbox/tests/it/snapshot.rs).

mod pause_away;
mod pause_faults;
mod sealed_snapshots;
mod support;
