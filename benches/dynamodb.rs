//! The DynamoDB store beside the raw calls it makes, on the same local server
//! (`IDEM_DYNAMODB_URL`, moto's by default): one caller's fresh calls against one
//! conditional `PutItem` each (the floor of a claim), and replays against one
//! strongly consistent `GetItem` each (the floor of a replay read). An idem fresh call
//! is a conditional put, a read and a conditional put (claim, then record); a replay is
//! one read. Medians of the rounds, idem and the floor alternating within each round.
//!
//! `IDEM_BENCH_CALLS` (a tenth of it per measurement; default 2000) and
//! `IDEM_BENCH_ROUNDS` (default 3).
//!
//! `cargo bench -p idem-tests --bench dynamodb`

use std::time::{Duration, Instant};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::types::AttributeValue;
use idem_runtime::{Idem, IdemError};

#[path = "support/knobs.rs"]
mod knobs;
use knobs::{env, median};

const DAY: Duration = Duration::from_secs(86_400);

#[path = "../tests/common/dynamodb_client.rs"]
mod local;
use local::client;

/// Microseconds per call of idem's, keys `from..from + calls`.
async fn idem_calls(idem: &Idem, from: u64, calls: usize) -> f64 {
    let started = Instant::now();
    for i in from..from + calls as u64 {
        idem.operation("charge", &i)
            .retain(DAY)
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(1999u64) })
            .await
            .unwrap();
    }
    started.elapsed().as_secs_f64() * 1e6 / calls as f64
}

/// Microseconds per raw call: a conditional put of a new item, or a consistent read.
async fn raw_calls(client: &Client, table: &str, from: u64, calls: usize, read: bool) -> f64 {
    let started = Instant::now();
    for i in from..from + calls as u64 {
        let pk = AttributeValue::S(format!("raw-{i}"));
        if read {
            let got = client
                .get_item()
                .table_name(table)
                .key("pk", pk)
                .consistent_read(true)
                .send()
                .await
                .unwrap();
            assert!(got.item.is_some());
        } else {
            client
                .put_item()
                .table_name(table)
                .item("pk", pk)
                .item("o", AttributeValue::N("1999".into()))
                .condition_expression("attribute_not_exists(pk)")
                .send()
                .await
                .unwrap();
        }
    }
    started.elapsed().as_secs_f64() * 1e6 / calls as f64
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // A tenth of the in-process benches' count: a server in Python answers in ms.
    let calls = (env("IDEM_BENCH_CALLS", 2_000) / 10).max(10);
    let rounds = env("IDEM_BENCH_ROUNDS", 3).max(1);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let table = format!("idem-bench-{stamp}");
    let idem = match Idem::builder()
        .replay_cache_bytes(0)
        .dynamodb(client(), &table)
        .await
    {
        Ok(idem) => idem,
        Err(e) => {
            eprintln!(
                "no DynamoDB-compatible server at {}: {e}",
                idem_test_support::dynamodb_url()
            );
            return;
        }
    };
    let raw = client();
    let (mut fresh, mut replay) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    for round in 0..rounds {
        let from = (round * calls) as u64;
        fresh[0].push(idem_calls(&idem, from, calls).await);
        fresh[1].push(raw_calls(&raw, &table, from, calls, false).await);
        replay[0].push(idem_calls(&idem, from, calls).await);
        replay[1].push(raw_calls(&raw, &table, from, calls, true).await);
    }
    println!("| call | idem µs/call | floor | floor µs/call | idem / floor |");
    println!("|---|---:|---|---:|---:|");
    for (call, floor, [idem, raw]) in [
        ("fresh", "conditional `PutItem`", fresh),
        ("replay", "consistent `GetItem`", replay),
    ] {
        let (idem, raw) = (median(idem), median(raw));
        println!(
            "| {call} | {idem:.0} | {floor} | {raw:.0} | {:.2}× |",
            idem / raw
        );
    }
    let _ = raw.delete_table().table_name(&table).send().await;
}
