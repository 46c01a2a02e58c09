//! What the fault workers (`fault_worker.rs`, `steps_worker.rs`) share: their common
//! arguments, the pause at a named point until a line `go` on stdin, and one task per
//! key ending in a line `done KEY …` or `error KEY KIND: MSG` (the protocol
//! `tests/common/worker.rs` reads).
//!
//! Not a binary of its own: it is not a `[[bin]]` of the root `Cargo.toml`, and cargo
//! only discovers tests directly in `tests/`. Both workers include it with
//! `#[path = "worker_support.rs"] mod worker_support;`.

use std::fmt::{Debug, Display};
use std::future::Future;

use clap::Parser;
use tokio::sync::watch;
use tokio::task::JoinError;

/// `--url PG --table T --provider URL --keys a,b,c [--pause-at POINT] [--lease-ms N]`.
#[derive(Parser)]
pub struct WorkerArgs {
    #[arg(long)]
    pub url: String,
    #[arg(long)]
    pub table: String,
    #[arg(long)]
    pub provider: String,
    #[arg(long, value_delimiter = ',')]
    pub keys: Vec<String>,
    #[arg(long)]
    pub pause_at: Option<String>,
    #[arg(long, default_value_t = 1000)]
    pub lease_ms: u64,
}

/// Whether a line `go` came on stdin: `true` from then on.
pub fn go_on_stdin() -> watch::Receiver<bool> {
    let (go_tx, go) = watch::channel(false);
    // A plain thread: a runtime's blocking stdin read would keep the process from
    // exiting while the test holds the pipe open.
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            match line {
                Ok(line) if line.trim() == "go" => {
                    let _ = go_tx.send(true);
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
    go
}

/// At the point `at` (if any), prints `paused KEY` and what `detail` returns, then
/// waits for `go` on stdin.
#[derive(Clone)]
pub struct Pause {
    at: Option<String>,
    go: watch::Receiver<bool>,
    /// Called at the pause point (inside the operation); appended to `paused KEY`.
    detail: fn() -> String,
}

impl Pause {
    /// Pauses at `at`, resumed by `go` on stdin (read from now on).
    pub fn new(at: Option<String>, detail: fn() -> String) -> Pause {
        Pause {
            at,
            go: go_on_stdin(),
            detail,
        }
    }

    /// Pauses here if `point` is the pause point.
    pub async fn at(&self, point: &str, key: &str) {
        if self.at.as_deref() != Some(point) {
            return;
        }
        println!("paused {key}{}", (self.detail)());
        let mut go = self.go.clone();
        let _ = go.wait_for(|go| *go).await;
    }
}

/// Runs `run` for every key, each on its own task, and waits for them all. Per key it
/// prints `done KEY DETAIL` (DETAIL what `run` returned) or `error KEY KIND: MSG`, KIND
/// the error's variant (its `Debug` output up to the first space, `{` or `(`).
pub async fn run_keys<F, Fut, E>(keys: &[String], run: F) -> Result<(), JoinError>
where
    F: Fn(String) -> Fut,
    Fut: Future<Output = Result<String, E>> + Send + 'static,
    E: Debug + Display,
{
    let tasks: Vec<_> = keys
        .iter()
        .cloned()
        .map(|key| {
            let result = run(key.clone());
            tokio::spawn(async move {
                match result.await {
                    Ok(detail) => println!("done {key} {detail}"),
                    Err(e) => {
                        let kind = format!("{e:?}");
                        let kind = kind.split([' ', '{', '(']).next().unwrap_or("").to_owned();
                        println!("error {key} {kind}: {e}");
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await?;
    }
    Ok(())
}
