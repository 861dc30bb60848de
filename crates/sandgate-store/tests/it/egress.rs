//! Egress rules and sealed secrets against real Postgres: one tenant's rows are never another's,
//! a rotation raises the version and keeps the first date, a listing carries no value.

use sandgate_store::egress::{self, EgressRule, SealedSecret};
use sandgate_store::tenants;

use crate::support::TestDb;

fn rule(host: &str, port: i32) -> EgressRule {
    EgressRule {
        host: host.into(),
        port,
        connections_per_minute: None,
        bytes_per_day: None,
    }
}

#[tokio::test]
async fn rules_are_the_tenants_own_and_a_second_put_replaces_the_budgets() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let acme = tenants::create(&mut conn, "acme").await.unwrap();
    let other = tenants::create(&mut conn, "other").await.unwrap();
    assert!(
        egress::rules(&mut conn, acme.id).await.unwrap().is_empty(),
        "a new tenant has no route out"
    );
    egress::put_rule(&mut conn, acme.id, &rule("api.shop.test", 443))
        .await
        .unwrap();
    egress::put_rule(&mut conn, acme.id, &rule("*.cdn.test", 443))
        .await
        .unwrap();
    let budgeted = EgressRule {
        connections_per_minute: Some(5),
        bytes_per_day: Some(1 << 20),
        ..rule("api.shop.test", 443)
    };
    egress::put_rule(&mut conn, acme.id, &budgeted)
        .await
        .unwrap();
    let rules = egress::rules(&mut conn, acme.id).await.unwrap();
    assert_eq!(rules, vec![rule("*.cdn.test", 443), budgeted.clone()]);
    assert!(
        egress::rules(&mut conn, other.id).await.unwrap().is_empty(),
        "another tenant's policy is not this one's"
    );
    assert!(
        !egress::remove_rule(&mut conn, other.id, "api.shop.test", 443)
            .await
            .unwrap(),
        "another tenant cannot take a rule out"
    );
    assert!(
        egress::remove_rule(&mut conn, acme.id, "*.cdn.test", 443)
            .await
            .unwrap()
    );
    assert_eq!(
        egress::rules(&mut conn, acme.id).await.unwrap(),
        vec![budgeted]
    );
    assert_eq!(egress::clear_rules(&mut conn, acme.id).await.unwrap(), 1);
    assert!(egress::rules(&mut conn, acme.id).await.unwrap().is_empty());
    let refused = egress::put_rule(&mut conn, acme.id, &rule("api.shop.test", 0)).await;
    assert!(refused.is_err(), "port 0 is refused by the schema");
    drop(conn);
    db.drop_db().await;
}

#[tokio::test]
async fn secrets_rotate_by_version_list_without_values_and_stay_with_their_tenant() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let acme = tenants::create(&mut conn, "acme").await.unwrap();
    let other = tenants::create(&mut conn, "other").await.unwrap();
    let hosts = vec!["api.shop.test".to_owned()];
    let headers = vec!["authorization".to_owned()];
    assert_eq!(
        egress::next_version(&mut conn, acme.id, "SHOP_TOKEN")
            .await
            .unwrap(),
        1
    );
    let first = SealedSecret {
        version: 1,
        sealed: b"sealed one".to_vec(),
    };
    let made = egress::put_secret(&mut conn, acme.id, "SHOP_TOKEN", &first, &hosts, &headers)
        .await
        .unwrap();
    assert_eq!((made.version, made.hosts.clone()), (1, hosts.clone()));
    assert_eq!(
        egress::next_version(&mut conn, acme.id, "SHOP_TOKEN")
            .await
            .unwrap(),
        2
    );
    let second = SealedSecret {
        version: 2,
        sealed: b"sealed two".to_vec(),
    };
    let wider = vec!["api.shop.test".to_owned(), "*.shop.test".to_owned()];
    let rotated = egress::put_secret(&mut conn, acme.id, "SHOP_TOKEN", &second, &wider, &headers)
        .await
        .unwrap();
    assert_eq!(rotated.version, 2);
    assert_eq!(rotated.hosts, wider, "a rotation replaces the bindings");
    assert_eq!(
        rotated.created_at, made.created_at,
        "and keeps the first date"
    );
    assert_eq!(
        egress::sealed_secret(&mut conn, acme.id, "SHOP_TOKEN")
            .await
            .unwrap(),
        Some(second)
    );
    let listed = egress::list_secrets(&mut conn, acme.id).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].name, "SHOP_TOKEN");
    assert!(
        egress::sealed_secret(&mut conn, other.id, "SHOP_TOKEN")
            .await
            .unwrap()
            .is_none(),
        "another tenant does not see the secret"
    );
    assert!(
        egress::list_secrets(&mut conn, other.id)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        !egress::delete_secret(&mut conn, other.id, "SHOP_TOKEN")
            .await
            .unwrap(),
        "another tenant cannot delete it"
    );
    assert!(
        egress::delete_secret(&mut conn, acme.id, "SHOP_TOKEN")
            .await
            .unwrap()
    );
    assert!(
        egress::list_secrets(&mut conn, acme.id)
            .await
            .unwrap()
            .is_empty()
    );
    drop(conn);
    db.drop_db().await;
}
