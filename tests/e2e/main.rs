//! End-to-end tests: the real `sandgate` binary against the real stack (Postgres, Docker, the
//! sandbox image), started by `scripts/stack.sh`.

mod cli;
mod connection_flood;
mod console;
mod db_roles;
mod db_tls;
mod deploy;
mod egress;
mod egress_approval;
mod egress_secrets;
mod egress_split;
mod endings;
mod erasure;
mod error_kinds;
mod front;
mod gateway_share;
mod handoff;
mod hostile;
mod image_pull;
mod jobs;
mod lifecycle;
mod links;
mod login_form;
mod mcp;
mod mcp_client;
mod node;
mod node_identity;
mod oauth;
mod package_abuse;
mod packages;
mod pause;
mod pause_files;
mod pause_many;
mod pause_remote;
mod placement;
mod pool;
mod private_listener;
mod python_sdk;
mod quotas;
mod reads;
mod replicas;
#[path = "../shared/s3.rs"]
#[allow(dead_code)] // shared with sandgate-service's store tests; the e2e tests use part of it
mod s3;
mod scale_out;
mod small_holes;
mod support;
mod templates;
mod ts_sdk;
mod two_hosts;
mod upgrades;
mod webdriver;
#[path = "../shared/wheels.rs"]
mod wheels;
