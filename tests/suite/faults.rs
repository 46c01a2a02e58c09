//! Real faults on PostgreSQL: worker processes SIGKILLed and SIGSTOPped mid-operation
//! (`tests/bin/fault_worker.rs`), an UNKNOWN operation reconciled by
//! `examples/reconcile.rs`, all against a real HTTP provider that deduplicates by the
//! downstream key and counts effects (`tests/common/provider.rs`).
#![cfg(feature = "postgres")]
use crate::common;
use crate::worker;

use common::*;
use idem_runtime::{Idem, State};
use tokio::process::Command;
use worker::{Worker, field, fixture, last_result_per_key};

/// The worker the tests kill and freeze (`tests/bin/fault_worker.rs`).
const WORKER: &str = env!("CARGO_BIN_EXE_idem-fault-worker");

/// The provider's key for the worker's `charge` of `key`.
fn downstream(idem: &Idem, key: &str) -> String {
    idem.operation("charge", key)
        .id()
        .downstream_key("provider")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_operation_then_taken_over_one_effect_per_key() {
    let Some((table, cleanup, idem, provider)) = fixture("kill9").await else {
        return;
    };
    let points = ["before-call", "after-call", "before-record"];
    let mut all = Vec::new();
    for point in points {
        let keys: Vec<String> = (0..10).map(|i| format!("{point}-{i}")).collect();
        let mut a = Worker::spawn(WORKER, &table, &provider, &keys, &["--pause-at", point]);
        // Every key's body is at the kill point (or, before-record, its outcome is).
        a.until("paused", keys.len()).await;
        a.kill9().await;
        all.extend(keys);
    }
    let before_b = provider.effects();
    assert_eq!(
        before_b, 20,
        "A charged the after-call and before-record keys"
    );

    // B retries every key: each waits out A's lease and takes over.
    let results = last_result_per_key(
        &Worker::spawn(WORKER, &table, &provider, &all, &[])
            .output()
            .await,
    );
    for key in &all {
        let line = results
            .get(key)
            .unwrap_or_else(|| panic!("no result for {key}"));
        assert!(line.starts_with("done"), "{line}");
        assert!(
            field(line, "epoch").parse::<u64>().unwrap() >= 2,
            "a takeover: {line}"
        );
        let charge = provider
            .charge(&downstream(&idem, key))
            .unwrap_or_else(|| panic!("{key} was charged"));
        assert_eq!(field(line, "charge"), charge.id.to_string(), "{line}");
        let calls = if key.starts_with("before-call") { 1 } else { 2 };
        assert_eq!(provider.requests(&charge.key), calls, "{key}");
        let record = idem
            .get(idem.operation("charge", key.as_str()).id())
            .await
            .unwrap();
        assert_eq!(record.unwrap().info.state, State::Completed, "{key}");
    }
    assert_eq!(provider.effects(), all.len(), "exactly one effect per key");
    cleanup.run().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_process_is_fenced_when_it_resumes() {
    let Some((table, cleanup, idem, provider)) = fixture("sigstop").await else {
        return;
    };
    let key = vec!["frozen".to_owned()];

    let mut a = Worker::spawn(
        WORKER,
        &table,
        &provider,
        &key,
        &["--pause-at", "after-call", "--lease-ms", "500"],
    );
    a.until("paused", 1).await;
    // Frozen: no renewals, its lease lapses.
    a.signal("-STOP");
    let b = last_result_per_key(
        &Worker::spawn(WORKER, &table, &provider, &key, &[])
            .output()
            .await,
    );
    let b_line = &b["frozen"];
    assert!(b_line.starts_with("done"), "{b_line}");
    let b_epoch: u64 = field(b_line, "epoch").parse().unwrap();
    assert!(b_epoch >= 2, "{b_line}");

    a.signal("-CONT");
    a.go().await;
    let a_result = last_result_per_key(&a.output().await);
    let a_line = &a_result["frozen"];
    assert!(a_line.starts_with("error frozen Fenced"), "{a_line}");

    let record = idem
        .get(idem.operation("charge", "frozen").id())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (record.info.state, record.info.epoch),
        (State::Completed, b_epoch),
        "B's outcome"
    );
    assert_eq!(provider.effects(), 1);
    assert_eq!(provider.requests(&downstream(&idem, "frozen")), 2);
    cleanup.run().await;
}

/// `examples/reconcile.rs`, built once (cargo does not build examples for `--test`).
fn reconcile_binary() -> std::path::PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = std::process::Command::new(cargo)
        // `--workspace`: the features `cargo test --workspace` built it with, so nothing is
        // rebuilt.
        .args(["build", "-q", "--workspace", "--example", "reconcile"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "cargo build --example reconcile");
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("reconcile")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_takeover_is_reconciled_then_replayed() {
    let Some((table, cleanup, idem, provider)) = fixture("reconcile").await else {
        return;
    };
    let unknown = ["--on-takeover", "unknown", "--lease-ms", "500"];
    // "applied": killed after the provider charged; "never": killed before it did.
    for (key, point) in [("applied", "after-call"), ("never", "before-call")] {
        let keys = vec![key.to_owned()];
        let mut a = Worker::spawn(
            WORKER,
            &table,
            &provider,
            &keys,
            &[&["--pause-at", point][..], &unknown].concat(),
        );
        a.until("paused", 1).await;
        a.kill9().await;
    }
    let keys = vec!["applied".to_owned(), "never".to_owned()];
    let b = last_result_per_key(
        &Worker::spawn(WORKER, &table, &provider, &keys, &unknown)
            .output()
            .await,
    );
    for key in &keys {
        assert!(
            b[key].starts_with(&format!("error {key} Unknown")),
            "{}",
            b[key]
        );
    }
    assert_eq!(provider.effects(), 1);

    let out = Command::new(reconcile_binary())
        .args(["--url", &postgres_url(), "--table", &table])
        .args(["--provider", &provider.url(), "--once"])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("pass: 1 completed, 1 retried"), "{text}");

    let c = last_result_per_key(
        &Worker::spawn(WORKER, &table, &provider, &keys, &unknown)
            .output()
            .await,
    );
    let applied = provider.charge(&downstream(&idem, "applied")).unwrap();
    assert!(c["applied"].contains("replayed=true"), "{}", c["applied"]);
    assert_eq!(field(&c["applied"], "charge"), applied.id.to_string());
    assert!(
        c["never"].contains("replayed=false"),
        "runs afresh: {}",
        c["never"]
    );
    assert_eq!(provider.effects(), 2, "one charge per key, never two");
    assert_eq!(
        provider.requests(&applied.key),
        1,
        "the applied charge was not retried"
    );
    cleanup.run().await;
}
