//! The harness of the fault tests (`tests/suite/faults.rs`, `tests/suite/steps_faults.rs`): a worker
//! process (`tests/bin/fault_worker.rs`, `tests/bin/steps_worker.rs`) run against a
//! PostgreSQL table and the toy provider (`tests/common/provider.rs`), its output lines,
//! and the signals and `go` line the tests send it.
//!
//! The workers share their protocol (`tests/bin/worker_support.rs`): `paused KEY …` at
//! the pause point, then a line `go` on stdin resumes; per key a last line
//! `done KEY …` or `error KEY KIND: MSG`.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::process::Stdio;

use idem_runtime::Idem;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use crate::common::{Cleanup, postgres_skip, postgres_url, unique_table};
use crate::provider::Provider;

/// What a fault test runs on: a fresh table (dropped by the cleanup's `run`), a handle
/// on it (`open`) and the toy provider; `None` when `test` skips (no PostgreSQL outside
/// CI).
pub async fn fixture(test: &str) -> Option<(String, Cleanup, Idem, Provider)> {
    if postgres_skip(test).is_some() {
        return None;
    }
    let table = unique_table(test);
    let cleanup = Cleanup::for_table(&table);
    let idem = open(&table).await;
    let provider = Provider::start().await;
    Some((table, cleanup, idem, provider))
}

/// A worker process and its output lines.
pub struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Worker {
    /// Starts the worker binary `exe` (an `env!("CARGO_BIN_EXE_…")`) on `table`,
    /// `provider` and `keys`, with `extra` arguments.
    pub fn spawn(
        exe: &str,
        table: &str,
        provider: &Provider,
        keys: &[String],
        extra: &[&str],
    ) -> Worker {
        Worker::spawn_at(exe, &postgres_url(), table, &provider.url(), keys, extra)
    }

    /// As [`spawn`](Self::spawn), on the database at `url` and the service at
    /// `provider` (a base URL).
    pub fn spawn_at(
        exe: &str,
        url: &str,
        table: &str,
        provider: &str,
        keys: &[String],
        extra: &[&str],
    ) -> Worker {
        let mut child = Command::new(exe)
            .args(["--url", url, "--table", table])
            .args(["--provider", provider, "--keys", &keys.join(",")])
            .args(extra)
            // Held open: the worker waits for `go` on it.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {exe}: {e}"));
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

    /// Waits until `n` lines start with `prefix`; returns every line seen so far.
    pub async fn until(&mut self, prefix: &str, n: usize) -> Vec<String> {
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
        seen
    }

    /// Sends the signal `sig` (as `kill` takes it: `-STOP`, `-CONT`, …).
    pub fn signal(&self, sig: &str) {
        let pid = self.child.id().expect("running").to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    }

    /// SIGKILLs the worker; returns the lines it printed after those already read.
    pub async fn kill9(mut self) -> Vec<String> {
        self.signal("-KILL");
        let status = self.child.wait().await.unwrap();
        assert!(!status.success());
        self.rest().await
    }

    /// Writes `go`: the worker resumes from its pause.
    pub async fn go(&mut self) {
        self.stdin.write_all(b"go\n").await.unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// Waits for a clean exit; returns every line not already read.
    pub async fn output(mut self) -> Vec<String> {
        let status = self.child.wait().await.unwrap();
        assert!(status.success(), "worker failed: {status}");
        self.rest().await
    }

    /// The remaining lines, up to the end of the output.
    async fn rest(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(line) = self.lines.recv().await {
            out.push(line);
        }
        out
    }
}

/// The last `done …`/`error …` line per key.
pub fn last_result_per_key(lines: &[String]) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for line in lines {
        let mut words = line.split_whitespace();
        if let (Some("done" | "error"), Some(key)) = (words.next(), words.next()) {
            out.insert(key.to_owned(), line.clone());
        }
    }
    out
}

/// The value of `name=VALUE` in a worker's line.
pub fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {name}= in {line}"))
}

/// A handle on the workers' `table`, without a replay cache: every read is the store's.
pub async fn open(table: &str) -> Idem {
    Idem::builder()
        .table(table)
        .replay_cache_bytes(0)
        .postgres(&postgres_url())
        .await
        .unwrap()
}
