//! What goes over the wire: outcomes and steps packed as the scripts store them, the
//! wake-up messages, the scripts' replies, and number arguments.

use std::time::Duration;

use ::redis::Value;

use crate::error::StoreError;
use crate::store::{OperationId, State, StepRecord, StoredOutcome};

/// Longest retention the store keeps (about 100 years), so deadlines stay exact
/// integers in Lua's numbers.
const MAX_RETAIN_MS: u128 = 100 * 365 * 86_400_000;

/// `<len>:<scope><len>:<name><key>`, as `wake()` in lifecycle.lua publishes it.
pub(super) fn parse_wakeup(mut b: &[u8]) -> Option<OperationId> {
    let mut part = || {
        let colon = b.iter().position(|&c| c == b':')?;
        let len: usize = std::str::from_utf8(&b[..colon]).ok()?.parse().ok()?;
        let text = b.get(colon + 1..colon + 1 + len)?;
        let text = String::from_utf8(text.to_vec()).ok()?;
        b = &b[colon + 1 + len..];
        Some(text)
    };
    let scope = part()?;
    let name = part()?;
    Some(OperationId {
        scope,
        name,
        key: String::from_utf8(b.to_vec()).ok()?,
    })
}

/// A step as `record_step.lua` packs it: `seq:epoch:at:` and its outcome as
/// [`packed`] writes it.
pub(super) struct PackedStep {
    /// Its place among the operation's steps, from 1.
    pub(super) seq: u64,
    epoch: u64,
    /// When it was recorded, by the server's clock (ms).
    at: i64,
    outcome: StoredOutcome,
}

impl PackedStep {
    pub(super) fn parse(packed: &[u8]) -> Option<PackedStep> {
        let mut parts = packed.splitn(4, |&b| b == b':');
        let mut num = || std::str::from_utf8(parts.next()?).ok();
        let (seq, epoch, at) = (num()?, num()?, num()?);
        Some(PackedStep {
            seq: seq.parse().ok()?,
            epoch: epoch.parse().ok()?,
            at: at.parse().ok()?,
            outcome: unpack(parts.next()?)?,
        })
    }

    /// The step as the store's contract gives it, its age by the server's `now`.
    pub(super) fn record(self, label: String, now: i64) -> StepRecord {
        StepRecord {
            label,
            epoch: self.epoch,
            age: Duration::from_millis(now.saturating_sub(self.at).max(0) as u64),
            outcome: self.outcome,
        }
    }
}

pub(super) fn protocol(message: String) -> StoreError {
    StoreError::new(false, format!("unexpected reply from Redis: {message}"))
}

pub(super) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

pub(super) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

pub(super) fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

pub(super) fn ms(d: Duration) -> String {
    ms_count(d).to_string()
}

/// `d` in whole ms, as the scripts take a duration.
pub(super) fn ms_count(d: Duration) -> i64 {
    d.as_millis().min(MAX_RETAIN_MS) as i64
}

/// An outcome as the record's field `o` and the end of a packed step hold it:
/// `is_err:version:body`.
pub(super) fn packed(outcome: &StoredOutcome) -> Vec<u8> {
    let head = format!("{}:{}:", u8::from(outcome.is_err), outcome.version);
    let mut out = Vec::with_capacity(head.len() + outcome.body.len());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(&outcome.body);
    out
}

/// The outcome [`packed`] wrote.
fn unpack(b: &[u8]) -> Option<StoredOutcome> {
    let mut parts = b.splitn(3, |&c| c == b':');
    let (is_err, version, body) = (parts.next()?, parts.next()?, parts.next()?);
    let is_err = match is_err {
        b"0" => false,
        b"1" => true,
        _ => return None,
    };
    Some(StoredOutcome {
        is_err,
        version: std::str::from_utf8(version).ok()?.parse().ok()?,
        body: body.to_vec().into(),
    })
}

/// The outcome a record's field `o` holds.
pub(super) fn unpacked(v: &Value) -> Result<StoredOutcome, StoreError> {
    match v {
        Value::BulkString(b) => unpack(b),
        _ => None,
    }
    .ok_or_else(|| protocol(format!("a completed record's outcome is {v:?}")))
}

/// A record as `read.lua` returns it, with the server's time.
pub(super) struct Read {
    pub(super) now: u64,
    pub(super) fields: Vec<Value>,
}

impl Read {
    pub(super) fn exists(&self) -> bool {
        !self.fields.is_empty()
    }
    pub(super) fn num(&self, i: usize) -> Option<u64> {
        self.fields
            .get(i)
            .and_then(int)
            .and_then(|n| u64::try_from(n).ok())
    }
    pub(super) fn state(&self) -> Option<State> {
        State::from_code(self.num(0)? as i64)
    }
    pub(super) fn outcome(&self) -> Option<StoredOutcome> {
        unpacked(self.fields.get(5)?).ok()
    }
}

/// The fields `read.lua` answers: `s`, `e`, `lu`, `ca`, `xa`, `o`.
pub(super) const FIELDS: usize = 6;
