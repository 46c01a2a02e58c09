//! Real faults on PostgreSQL: worker processes SIGKILLed and SIGSTOPped mid-operation
//! (`tests/bin/fault_worker.rs`), an UNKNOWN operation reconciled by
//! `examples/reconcile.rs`, all against a real HTTP provider that deduplicates by the
//! downstream key and counts effects (`tests/common/provider.rs`).
#![cfg(feature = "postgres")]
mod common;
#[path = "common/provider.rs"]
mod provider;

use std::collections::HashMap;
use std::process::Stdio;

use common::*;
use idem_runtime::{Idem, State};
use provider::Provider;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

/// A worker process and its output lines.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Worker {
    fn spawn(table: &str, provider: &Provider, keys: &[String], extra: &[&str]) -> Worker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem-fault-worker"))
            .args(["--url", &postgres_url(), "--table", table])
            .args(["--provider", &provider.url(), "--keys", &keys.join(",")])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start idem-fault-worker");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                let _ = tx.send(line);
            }
        });
        Worker {
            child,
            stdin,
            lines,
        }
    }

    /// Waits until `n` lines start with `prefix`.
    async fn until(&mut self, prefix: &str, n: usize) {
        let mut seen = Vec::new();
        while seen
            .iter()
            .filter(|l: &&String| l.starts_with(prefix))
            .count()
            < n
        {
            match self.lines.recv().await {
                Some(line) => seen.push(line),
                None => panic!("the worker exited before {n} `{prefix}` lines: {seen:#?}"),
            }
        }
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.id().expect("running").to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    }

    async fn kill9(mut self) {
        self.signal("-KILL");
        let status = self.child.wait().await.unwrap();
        assert!(!status.success());
    }

    async fn go(&mut self) {
        self.stdin.write_all(b"go\n").await.unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// Waits for the exit; returns the last line per key (`done …` or `error …`).
    async fn results(mut self) -> HashMap<String, String> {
        let status = self.child.wait().await.unwrap();
        assert!(status.success(), "worker failed: {status}");
        let mut out = HashMap::new();
        while let Some(line) = self.lines.recv().await {
            let mut words = line.split_whitespace();
            if let (Some("done" | "error"), Some(key)) = (words.next(), words.next()) {
                out.insert(key.to_owned(), line.clone());
            }
        }
        out
    }
}

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {name}= in {line}"))
}

async fn open(table: &str) -> Idem {
    Idem::builder()
        .table(table)
        .replay_cache_bytes(0)
        .postgres(&postgres_url())
        .await
        .unwrap()
}

/// The provider's key for the worker's `charge` of `key`.
fn downstream(idem: &Idem, key: &str) -> String {
    idem.operation("charge", key)
        .id()
        .downstream_key("provider")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_operation_then_taken_over_one_effect_per_key() {
    if postgres_skip("kill9").is_some() {
        return;
    }
    let table = unique_table("kill9");
    let cleanup = Cleanup::for_table(&table);
    let idem = open(&table).await;
    let provider = Provider::start().await;
    let points = ["before-call", "after-call", "before-record"];
    let mut all = Vec::new();
    for point in points {
        let keys: Vec<String> = (0..10).map(|i| format!("{point}-{i}")).collect();
        let mut a = Worker::spawn(&table, &provider, &keys, &["--pause-at", point]);
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
    let results = Worker::spawn(&table, &provider, &all, &[]).results().await;
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
    if postgres_skip("sigstop").is_some() {
        return;
    }
    let table = unique_table("sigstop");
    let cleanup = Cleanup::for_table(&table);
    let idem = open(&table).await;
    let provider = Provider::start().await;
    let key = vec!["frozen".to_owned()];

    let mut a = Worker::spawn(
        &table,
        &provider,
        &key,
        &["--pause-at", "after-call", "--lease-ms", "500"],
    );
    a.until("paused", 1).await;
    // Frozen: no renewals, its lease lapses.
    a.signal("-STOP");
    let b = Worker::spawn(&table, &provider, &key, &[]).results().await;
    let b_line = &b["frozen"];
    assert!(b_line.starts_with("done"), "{b_line}");
    let b_epoch: u64 = field(b_line, "epoch").parse().unwrap();
    assert!(b_epoch >= 2, "{b_line}");

    a.signal("-CONT");
    a.go().await;
    let a_result = a.results().await;
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
        .args(["build", "-q", "-p", "idem-tests", "--example", "reconcile"])
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
    if postgres_skip("reconcile").is_some() {
        return;
    }
    let table = unique_table("reconcile");
    let cleanup = Cleanup::for_table(&table);
    let idem = open(&table).await;
    let provider = Provider::start().await;
    let unknown = ["--on-takeover", "unknown", "--lease-ms", "500"];
    // "applied": killed after the provider charged; "never": killed before it did.
    for (key, point) in [("applied", "after-call"), ("never", "before-call")] {
        let keys = vec![key.to_owned()];
        let mut a = Worker::spawn(
            &table,
            &provider,
            &keys,
            &[&["--pause-at", point][..], &unknown].concat(),
        );
        a.until("paused", 1).await;
        a.kill9().await;
    }
    let keys = vec!["applied".to_owned(), "never".to_owned()];
    let b = Worker::spawn(&table, &provider, &keys, &unknown)
        .results()
        .await;
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

    let c = Worker::spawn(&table, &provider, &keys, &unknown)
        .results()
        .await;
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
