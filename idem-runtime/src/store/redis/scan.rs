//! Walking the store's records for the operator's calls (stats, list, purge): `SCAN`
//! over the record keys of a standalone server, or of every master of a cluster.

use std::time::Duration;

use ::redis::Value;
use ::redis::aio::ConnectionLike;
use ::redis::cluster_async::ClusterConnection;

use super::RedisStore;
use super::conn::{Conn, Lane, store_error};
use super::wire::{int, parse_wakeup, protocol, text};
use crate::error::StoreError;
use crate::store::{OperationId, State};

/// Keys asked for per `SCAN` step.
const SCAN_COUNT: u32 = 1000;

impl RedisStore {
    /// Every record of this store on every node, with the node's clock.
    pub(super) async fn scan(&self) -> Result<Vec<(u64, Row)>, StoreError> {
        let mut rows = Vec::new();
        match &self.conn {
            Conn::Single(c) => {
                let mut c = c.get(Lane::Light).await.map_err(store_error)?;
                self.scan_node(&mut c, &mut rows).await?
            }
            Conn::Cluster { conn, info } => {
                for (host, port) in masters(&mut conn.clone()).await? {
                    let addr = match info.addr() {
                        ::redis::ConnectionAddr::TcpTls {
                            insecure,
                            tls_params,
                            ..
                        } => ::redis::ConnectionAddr::TcpTls {
                            host,
                            port,
                            insecure: *insecure,
                            tls_params: tls_params.clone(),
                        },
                        _ => ::redis::ConnectionAddr::Tcp(host, port),
                    };
                    let node = (**info).clone().set_addr(addr);
                    let client = ::redis::Client::open(node).map_err(store_error)?;
                    let mut c = client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(store_error)?;
                    self.scan_node(&mut c, &mut rows).await?;
                }
            }
        }
        Ok(rows)
    }

    async fn scan_node<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        rows: &mut Vec<(u64, Row)>,
    ) -> Result<(), StoreError> {
        let (secs, micros): (u64, u64) = ::redis::cmd("TIME")
            .query_async(conn)
            .await
            .map_err(store_error)?;
        let now = secs * 1000 + micros / 1000;
        let pattern = format!("{}:r:{{*", glob_escape(&self.prefix));
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = ::redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(conn)
                .await
                .map_err(store_error)?;
            let keys: Vec<Vec<u8>> = keys.into_iter().filter(|k| self.is_record_key(k)).collect();
            if !keys.is_empty() {
                let mut pipe = ::redis::pipe();
                for k in &keys {
                    pipe.cmd("HMGET")
                        .arg(k)
                        .arg(&["s", "e", "ca", "sn", "k", "xa", "st"]);
                }
                let fields: Vec<Vec<Option<Vec<u8>>>> =
                    pipe.query_async(conn).await.map_err(store_error)?;
                for (key, f) in keys.into_iter().zip(fields) {
                    if let Some(row) = Row::parse(key, &f) {
                        rows.push((now, row));
                    }
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(());
            }
        }
    }
}

/// A record as `SCAN` sees it.
pub(super) struct Row {
    pub(super) key: Vec<u8>,
    pub(super) state: State,
    pub(super) epoch: u64,
    pub(super) claimed_at: u64,
    pub(super) expires_at: Option<u64>,
    /// In progress, released with its steps kept (`st` is '2'): no claim holds it.
    pub(super) released: bool,
    pub(super) id: OperationId,
}

impl Row {
    /// `None` for a key that went away between `SCAN` and `HMGET`.
    fn parse(key: Vec<u8>, f: &[Option<Vec<u8>>]) -> Option<Row> {
        let text = |i: usize| {
            f.get(i)
                .and_then(|v| v.as_deref())
                .map(|b| String::from_utf8_lossy(b).into_owned())
        };
        let num = |i: usize| text(i).and_then(|s| s.parse::<u64>().ok());
        // `sn` and `k` together are the operation as a wake-up carries it.
        let mut op = f.get(3)?.clone()?;
        op.extend_from_slice(f.get(4)?.as_deref()?);
        let epoch = num(1)?;
        Some(Row {
            key,
            state: State::from_code(num(0)? as i64)?,
            epoch,
            // A record as its first claim wrote it has no `ca`: its epoch is the
            // server's clock in µs at that claim (prelude.lua).
            claimed_at: num(2).unwrap_or(epoch / 1000),
            expires_at: num(5),
            released: num(6) == Some(2),
            id: parse_wakeup(&op)?,
        })
    }

    pub(super) fn age(&self, now: u64) -> Duration {
        Duration::from_millis(now.saturating_sub(self.claimed_at))
    }
}

/// The masters of a cluster, from `CLUSTER SLOTS`.
async fn masters(conn: &mut ClusterConnection) -> Result<Vec<(String, u16)>, StoreError> {
    let v: Value = ::redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .map_err(store_error)?;
    let mut out = Vec::new();
    let Value::Array(ranges) = v else {
        return Err(protocol(format!("CLUSTER SLOTS answered {v:?}")));
    };
    for range in ranges {
        let Value::Array(parts) = range else { continue };
        let Some(Value::Array(master)) = parts.get(2) else {
            continue;
        };
        let host = master.first().and_then(text);
        let port = master.get(1).and_then(int);
        if let (Some(host), Some(port)) = (host, port) {
            let node = (host, port as u16);
            if !out.contains(&node) {
                out.push(node);
            }
        }
    }
    Ok(out)
}

fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
