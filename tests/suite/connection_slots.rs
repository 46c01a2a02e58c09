//! A server with every connection slot taken: opening an `Idem` there fails at once
//! with the server's own reason and the connections idem would hold, and on PostgreSQL
//! a claim that needs a connection the server will not give fails at once too. Each
//! test runs a server of its own with a few slots (see `common/own_servers.rs`) and
//! takes them.
#![cfg(any(feature = "postgres", feature = "mysql"))]
use crate::own_servers;

use std::time::Duration;

use idem_runtime::{Idem, IdemError};
#[allow(unused_imports)]
use own_servers::*;
use sqlx::Connection;

/// Longer than any answer the server gives, far shorter than a pool's acquire timeout
/// (30 s): a regression fails here instead of hanging.
const BOUND: Duration = Duration::from_secs(10);

/// Opens connections until the server refuses one, and returns them.
#[cfg(feature = "postgres")]
async fn take_every_slot(url: &str) -> Vec<sqlx::PgConnection> {
    let mut held = Vec::new();
    loop {
        match sqlx::PgConnection::connect(url).await {
            Ok(c) => held.push(c),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("53300") => {
                return held;
            }
            Err(e) => panic!("taking a slot: {e}"),
        }
        assert!(held.len() <= 5, "the server took more than its 5 slots");
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_postgres_refuses_at_once_and_says_why() {
    let Some(server) = OwnPostgres::start(
        "a_full_postgres_refuses_at_once_and_says_why",
        &[
            "max_connections=5",
            "superuser_reserved_connections=0",
            "max_wal_senders=0",
        ],
    ) else {
        return;
    };
    let url = server.url();
    let mut held = take_every_slot(&url).await;

    let opened = tokio::time::timeout(BOUND, Idem::postgres(&url))
        .await
        .expect("opening on a full server waited instead of failing");
    match opened {
        Err(e @ IdemError::Store { .. }) => {
            let text = e.to_string();
            assert!(e.is_retryable(), "{text}");
            assert!(text.contains("too many connections"), "{text}");
            // The default footprint: 16 for claims and records, 4, and the listener.
            assert!(text.contains("up to 21 connections"), "{text}");
            assert!(text.contains("max_connections"), "{text}");
        }
        Err(other) => panic!("opening on a full server: {other:?}"),
        Ok(_) => panic!("opened on a server with no slot left"),
    }
    let opened = tokio::time::timeout(BOUND, Idem::builder().max_connections(2).postgres(&url))
        .await
        .expect("opening on a full server waited instead of failing");
    let Err(e) = opened else {
        panic!("opened on a server with no slot left");
    };
    let text = e.to_string();
    assert!(text.contains("up to 7 connections"), "{text}");

    // One slot free: the open runs on it (its statements one at a time on one
    // connection), and leaves it.
    held.pop().unwrap().close().await.unwrap();
    // The server frees the slot when the backend has exited, a moment after the close.
    while {
        let clients: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
        )
        .fetch_one(&mut held[0])
        .await
        .unwrap();
        clients > held.len() as i64
    } {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let idem_url = format!("{url}?application_name=idem-under-test");
    let idem = tokio::time::timeout(Duration::from_secs(60), Idem::postgres(&idem_url))
        .await
        .expect("opening with a slot free hung")
        .expect("open with a slot free");
    // Then every slot is taken again: by this test, and by idem's wake-up listener if
    // it got one. Done when the open's connection is gone and the slots held here and
    // by idem's listener make 5.
    loop {
        held.extend(take_every_slot(&url).await);
        let (listening, other): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE query ILIKE 'LISTEN%'), \
                    count(*) FILTER (WHERE query NOT ILIKE 'LISTEN%') \
             FROM pg_stat_activity WHERE application_name = 'idem-under-test'",
        )
        .fetch_one(&mut held[0])
        .await
        .unwrap();
        if other == 0 && held.len() as i64 + listening == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let claimed = tokio::time::timeout(
        BOUND,
        idem.operation("charge", "full")
            .retain(Duration::from_secs(60))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(1) }),
    )
    .await
    .expect("a claim on a full server waited instead of failing");
    match claimed {
        Err(e @ IdemError::Store { .. }) => {
            assert!(e.is_retryable(), "{e}");
            assert!(e.to_string().contains("too many clients"), "{e}");
        }
        other => panic!("a claim on a full server: {other:?}"),
    }
    drop(held);
}

/// MariaDB's "Too many connections" (1040), for a user without the slot MariaDB keeps
/// for `SUPER`.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_mariadb_refuses_at_once_and_says_why() {
    let Some(server) = OwnMariaDb::start_with(
        "a_full_mariadb_refuses_at_once_and_says_why",
        // MariaDB's least.
        &["--max-connections=10"],
    ) else {
        return;
    };
    let mut root = sqlx::MySqlConnection::connect(&server.url("root", "mysql"))
        .await
        .unwrap();
    let url = server.idem_user(&mut root).await;
    let mut held = Vec::new();
    loop {
        match sqlx::MySqlConnection::connect(&url).await {
            Ok(c) => held.push(c),
            Err(sqlx::Error::Database(e)) if e.message().contains("Too many connections") => {
                break;
            }
            Err(e) => panic!("taking a slot: {e}"),
        }
        assert!(held.len() <= 11, "the server took more than its 10 slots");
    }
    let opened = tokio::time::timeout(BOUND, Idem::builder().max_connections(6).mysql(&url))
        .await
        .expect("opening on a full server waited instead of failing");
    match opened {
        Err(e @ IdemError::Store { .. }) => {
            let text = e.to_string();
            assert!(e.is_retryable(), "{text}");
            assert!(text.contains("too many connections"), "{text}");
            assert!(text.contains("up to 6 connections"), "{text}");
        }
        Err(other) => panic!("opening on a full server: {other:?}"),
        Ok(_) => panic!("opened on a server with no slot left"),
    }
    drop(held);
}
