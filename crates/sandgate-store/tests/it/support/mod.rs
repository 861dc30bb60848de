//! A fresh, migrated database per test on the stack's Postgres (`DATABASE_URL`).

use sandgate_store::{PgPool, PoolSettings};
use sqlx::Connection;
use std::time::Duration;

/// A test's own database; dropped (best effort) when the test ends well.
pub struct TestDb {
    /// A pool on it.
    pub pool: PgPool,
    name: String,
    admin: String,
}

impl TestDb {
    /// Creates and migrates a database named after nothing but a fresh UUID.
    pub async fn new() -> Self {
        let admin = std::env::var("DATABASE_URL").expect(
            "DATABASE_URL is not set; source the stack's environment (scripts/stack.sh prints it)",
        );
        let name = format!("sandgate_store_{}", uuid::Uuid::new_v4().simple());
        let mut conn = sqlx::PgConnection::connect(&admin)
            .await
            .expect("the stack's Postgres accepts connections");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("a test database can be created");
        let url = format!("{}/{name}", without_database(&admin));
        let settings = PoolSettings {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(30),
        };
        let pool =
            sandgate_store::connect_lazy(&url, &settings).expect("a pool on the test database");
        sandgate_store::migrate(&pool)
            .await
            .expect("migrations apply");
        Self { pool, name, admin }
    }

    /// Closes the pool and drops the database.
    pub async fn drop_db(self) {
        self.pool.close().await;
        if let Ok(mut conn) = sqlx::PgConnection::connect(&self.admin).await {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            )))
            .execute(&mut conn)
            .await;
        }
    }
}

fn without_database(url: &str) -> String {
    let base = url.split('?').next().unwrap_or(url);
    match base.rfind('/') {
        Some(i) if i > "postgres://".len() => base[..i].to_owned(),
        _ => base.to_owned(),
    }
}
