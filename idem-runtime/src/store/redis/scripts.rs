//! The Lua scripts (`idem-runtime/lua/*.lua`), each assembled from the prelude, the
//! lifecycle helpers and its own body, and how the store runs them on an operation's
//! keys.

use ::redis::{Script, ScriptInvocation, Value};

use super::RedisStore;
use super::conn::{Conn, Lane, store_error};
use super::wire::{FIELDS, Read, int, protocol};
use crate::error::StoreError;
use crate::store::{Fence, OperationId};

/// How long Redis keeps a completed record past its retention (the prelude's
/// `GRACE_MS`).
pub(super) const GRACE_MS: i64 = 300_000;

const PRELUDE: &str = include_str!("../../../lua/prelude.lua");
const LIFECYCLE: &str = include_str!("../../../lua/lifecycle.lua");
/// The line of a script where the lifecycle helpers go, when not at its top.
const LIFECYCLE_AT: &str = "--[[lifecycle]]";

/// The scripts, each with the prelude in front and the lifecycle helpers at its
/// `--[[lifecycle]]` line (or after the prelude).
#[derive(Debug)]
pub(super) struct Scripts {
    pub(super) claim: Script,
    pub(super) record: Script,
    pub(super) release: Script,
    pub(super) mark_unknown: Script,
    pub(super) renew: Script,
    pub(super) resolve: Script,
    pub(super) forget: Script,
    pub(super) record_step: Script,
    pub(super) steps: Script,
    pub(super) read: Script,
    pub(super) purge: Script,
    pub(super) announce: Script,
    /// A shared claim limit's count: standalone, on a key of its own.
    pub(super) claim_limit: Script,
}

impl Scripts {
    pub(super) fn new() -> Scripts {
        let s = |body: &str| {
            let body = match body.split_once(LIFECYCLE_AT) {
                Some((first, rest)) => format!("{first}{LIFECYCLE}{rest}"),
                None => format!("{LIFECYCLE}\n{body}"),
            };
            Script::new(&format!("{PRELUDE}\n{body}"))
        };
        Scripts {
            claim: s(include_str!("../../../lua/claim.lua")),
            record: s(include_str!("../../../lua/record.lua")),
            release: s(include_str!("../../../lua/release.lua")),
            mark_unknown: s(include_str!("../../../lua/mark_unknown.lua")),
            renew: s(include_str!("../../../lua/renew.lua")),
            resolve: s(include_str!("../../../lua/resolve.lua")),
            forget: s(include_str!("../../../lua/forget.lua")),
            record_step: s(include_str!("../../../lua/record_step.lua")),
            steps: s(include_str!("../../../lua/steps.lua")),
            read: s(include_str!("../../../lua/read.lua")),
            purge: s(include_str!("../../../lua/purge.lua")),
            announce: s(include_str!("../../../lua/announce.lua")),
            claim_limit: Script::new(include_str!("../../../lua/claim_limit.lua")),
        }
    }
}

impl RedisStore {
    /// Runs `script` on `id`'s keys with `args`.
    pub(super) async fn run(
        &self,
        script: &Script,
        id: &OperationId,
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        let (rec, steps) = self.keys(id);
        let mut inv = script.prepare_invoke();
        inv.key(rec).key(steps);
        for a in args {
            inv.arg(*a);
        }
        self.invoke(&inv).await
    }

    pub(super) async fn invoke(&self, inv: &ScriptInvocation<'_>) -> Result<Value, StoreError> {
        match &self.conn {
            Conn::Single(c) => {
                c.run(Lane::Script, async |c| inv.invoke_async(c).await)
                    .await
            }
            Conn::Cluster { conn, .. } => inv.invoke_async(&mut conn.clone()).await,
        }
        .map_err(store_error)
    }

    /// A fenced write: 1 from the script means the epoch held.
    pub(super) async fn fenced(
        &self,
        script: &Script,
        id: &OperationId,
        args: &[&[u8]],
    ) -> Result<Fence, StoreError> {
        let v = self.run(script, id, args).await?;
        Ok(match int(&v) {
            Some(1) => Fence::Held,
            Some(0) => Fence::Lost,
            _ => return Err(protocol(format!("a fenced write answered {v:?}"))),
        })
    }

    pub(super) async fn read(&self, id: &OperationId) -> Result<Read, StoreError> {
        let v = self.run(&self.scripts.read, id, &[]).await?;
        let Value::Array(mut parts) = v else {
            return Err(protocol(format!("read answered {v:?}")));
        };
        if parts.is_empty() {
            return Err(protocol("read answered nothing".into()));
        }
        let fields = parts.split_off(1);
        let now = int(&parts[0])
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| protocol("read gave no time".into()))?;
        if !fields.is_empty() && fields.len() != FIELDS {
            return Err(protocol(format!("read gave {} fields", fields.len())));
        }
        Ok(Read { now, fields })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_grace_period_is_the_scripts_own() {
        let line = format!("local GRACE_MS = {}\n", super::GRACE_MS);
        assert!(super::PRELUDE.contains(&line), "the prelude lacks {line:?}");
    }

    /// The prelude's `dec` writes every whole number the scripts store (times in ms,
    /// epochs in µs) digit for digit as Rust does: fenced writes compare epochs as
    /// these strings.
    #[tokio::test]
    async fn dec_writes_numbers_as_rust_does() {
        let url =
            std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let required = std::env::var("IDEM_REQUIRE_DB").as_deref() == Ok("1");
        let conn = match ::redis::Client::open(url.as_str()) {
            Ok(client) => client.get_multiplexed_async_connection().await,
            Err(e) => Err(e),
        };
        let mut conn = match conn {
            Ok(conn) => conn,
            Err(e) if required => panic!("Redis not reachable at {url} and IDEM_REQUIRE_DB=1: {e}"),
            Err(_) => {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "skipping: Redis not reachable at {url} (set IDEM_REDIS_URL)"
                );
                return;
            }
        };
        let numbers: [u64; 9] = [
            0,
            7,
            999_999_999,
            1_000_000_000,
            1_000_000_007,
            1_796_481_367_435,
            1_796_481_367_000_042,
            4_000_000_000_000_001,
            (1 << 53) - 1,
        ];
        let list: Vec<String> = numbers.iter().map(u64::to_string).collect();
        let body = format!("return {{dec({})}}", list.join("), dec("));
        let script = ::redis::Script::new(&format!("{}\n{body}", super::PRELUDE));
        let written: Vec<String> = script
            .key("idem-test:dec:r")
            .key("idem-test:dec:s")
            .invoke_async(&mut conn)
            .await
            .expect("run dec");
        assert_eq!(written, list);
    }
}
