//! Real faults on PostgreSQL for steps: worker processes (`tests/bin/steps_worker.rs`)
//! SIGKILLed between two steps and inside the second, then taken over by another
//! process, against a real HTTP provider that deduplicates by the downstream key and
//! counts effects and requests (`tests/common/provider.rs`).
#![cfg(feature = "postgres")]
use crate::worker;

use std::collections::HashMap;

use idem_runtime::{Idem, State};
use worker::{Worker, field, fixture, last_result_per_key};

/// The worker the test kills (`tests/bin/steps_worker.rs`).
const WORKER: &str = env!("CARGO_BIN_EXE_idem-steps-worker");

/// Whether a `ran KEY LABEL` line is among `lines`.
fn ran(lines: &[String], key: &str, label: &str) -> bool {
    lines.iter().any(|l| *l == format!("ran {key} {label}"))
}

/// The provider's key for the worker's step `label` of `key`.
fn downstream(idem: &Idem, key: &str, label: &str) -> String {
    idem.operation("checkout", key).id().downstream_key(label)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_and_inside_steps_then_taken_over_one_effect_per_step() {
    let Some((table, cleanup, idem, provider)) = fixture("steps_kill9").await else {
        return;
    };
    let points = ["between-steps", "in-second-step"];
    let mut all = Vec::new();
    // A's epoch per key, from its `paused KEY epoch=E` lines.
    let mut a_epochs: HashMap<String, u64> = HashMap::new();
    for point in points {
        let keys: Vec<String> = (0..10).map(|i| format!("{point}-{i}")).collect();
        let mut a = Worker::spawn(WORKER, &table, &provider, &keys, &["--pause-at", point]);
        // Every key's body is at the kill point.
        let mut lines = a.until("paused", keys.len()).await;
        lines.extend(a.kill9().await);
        for line in lines.iter().filter(|l| l.starts_with("paused")) {
            let key = line.split_whitespace().nth(1).unwrap().to_owned();
            a_epochs.insert(key, field(line, "epoch").parse().unwrap());
        }
        for key in &keys {
            assert!(ran(&lines, key, "charge"), "A charged {key}: {lines:#?}");
            assert_eq!(
                ran(&lines, key, "ship"),
                point == "in-second-step",
                "A ships {key} only when killed inside the second step: {lines:#?}"
            );
            assert!(
                !last_result_per_key(&lines).contains_key(key),
                "A never finished {key}: {lines:#?}"
            );
        }
        all.extend(keys);
    }
    assert_eq!(a_epochs.len(), all.len(), "A paused on every key");
    for key in &all {
        let charge = provider.charge(&downstream(&idem, key, "charge"));
        assert!(charge.is_some(), "A charged {key}");
        let shipped = provider.charge(&downstream(&idem, key, "ship")).is_some();
        assert_eq!(
            shipped,
            key.starts_with("in-second-step"),
            "A shipped {key} only when killed inside the second step"
        );
    }
    assert_eq!(
        provider.effects(),
        30,
        "after A: 20 charges, 10 shipments (the in-second-step keys)"
    );

    // B runs every key: each waits out A's lease and takes over.
    let lines = Worker::spawn(WORKER, &table, &provider, &all, &[])
        .output()
        .await;
    let results = last_result_per_key(&lines);
    for key in &all {
        let line = results
            .get(key)
            .unwrap_or_else(|| panic!("no result for {key}: {lines:#?}"));
        assert!(line.starts_with("done"), "{line}");
        let epoch: u64 = field(line, "epoch").parse().unwrap();
        assert!(epoch > a_epochs[key], "a takeover above A's epoch: {line}");

        let charge = provider
            .charge(&downstream(&idem, key, "charge"))
            .unwrap_or_else(|| panic!("{key} was charged"));
        assert_eq!(field(line, "charge"), charge.id.to_string(), "{line}");
        assert_eq!(charge.amount_cents, 1000, "{key}");
        assert_eq!(
            provider.requests(&charge.key),
            1,
            "{key}: B replayed the recorded charge step instead of calling the provider"
        );
        assert!(
            !ran(&lines, key, "charge"),
            "B must not run the recorded charge step of {key}: {lines:#?}"
        );

        let ship = provider
            .charge(&downstream(&idem, key, "ship"))
            .unwrap_or_else(|| panic!("{key} was shipped"));
        assert_eq!(field(line, "ship"), ship.id.to_string(), "{line}");
        assert_eq!(ship.amount_cents, 1, "{key}");
        let calls = if key.starts_with("between-steps") {
            1
        } else {
            2
        };
        assert_eq!(
            provider.requests(&ship.key),
            calls,
            "{key}: the unrecorded ship step runs again on B, with the same downstream key"
        );
        assert!(
            ran(&lines, key, "ship"),
            "B runs the unrecorded ship step of {key}: {lines:#?}"
        );

        let record = idem
            .get(idem.operation("checkout", key.as_str()).id())
            .await
            .unwrap();
        assert_eq!(record.unwrap().info.state, State::Completed, "{key}");
    }
    assert_eq!(
        provider.effects(),
        2 * all.len(),
        "exactly one charge and one shipment per key"
    );
    cleanup.run().await;
}
