//! The store against the real Postgres: each test gets a database of its own, migrated.

mod audit;
mod egress;
mod egress_approvals;
mod nodes;
mod pauses;
mod quotas;
mod sandboxes;
mod snapshots;
mod support;
mod transcripts;
