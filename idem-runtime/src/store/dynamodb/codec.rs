//! A record as a DynamoDB item, and the SDK's errors as the store's.

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use sha2::{Digest, Sha256};

use crate::store::record::{Record, Step, Steps, Tick};
use crate::store::{OperationId, State, StoreError, StoredOutcome};

/// The key of the item recording how keys and scopes are stored.
pub(super) const META_PK: &str = "idem#meta";

/// How long DynamoDB's TTL waits past a record's expiry: idem treats it as absent from
/// the expiry on, so this only keeps the item from going while a clock that runs
/// behind may still read it.
const TTL_GRACE_SECS: u64 = 300;

/// A record as read, with the version its next write is conditional on.
pub(super) struct Item {
    pub(super) rec: Record,
    pub(super) version: u64,
}

type Attrs = HashMap<String, AttributeValue>;

/// The partition key of `id`: a digest of its three parts, each length-prefixed so
/// parts that run together stay apart.
pub(super) fn pk(id: &OperationId) -> String {
    let mut h = Sha256::new();
    for part in [&id.scope, &id.name, &id.key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    crate::secret::hex(&h.finalize()[..16])
}

fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn bytes(b: &[u8]) -> AttributeValue {
    AttributeValue::B(Blob::new(b.to_vec()))
}

fn state_code(s: State) -> u64 {
    match s {
        State::InProgress => 0,
        State::Completed => 1,
        State::Unknown => 2,
    }
}

/// The item of `id`'s record at `version`.
pub(super) fn encode(id: &OperationId, rec: &Record, version: u64) -> Attrs {
    let mut item = Attrs::new();
    item.insert("pk".into(), AttributeValue::S(pk(id)));
    // DynamoDB keeps no empty string in an index; an empty part is left out.
    for (name, part) in [("sc", &id.scope), ("nm", &id.name), ("ky", &id.key)] {
        if !part.is_empty() {
            item.insert(name.into(), AttributeValue::S(part.clone()));
        }
    }
    item.insert("v".into(), n(version));
    item.insert("st".into(), n(state_code(rec.state)));
    item.insert("ep".into(), n(rec.epoch));
    item.insert("fp".into(), bytes(&rec.fingerprint));
    item.insert("lu".into(), n(rec.lease_until.0));
    item.insert("ca".into(), n(rec.claimed_at.0));
    if rec.expires_at != Tick::NEVER {
        item.insert("xa".into(), n(rec.expires_at.0));
        let secs = rec.expires_at.0 / 1_000_000_000;
        item.insert("expires_ttl".into(), n(secs.saturating_add(TTL_GRACE_SECS)));
    }
    if let Some(o) = &rec.outcome {
        item.insert("o".into(), bytes(&o.body));
        item.insert("oe".into(), AttributeValue::Bool(o.is_err));
        item.insert("ov".into(), n(u64::from(o.version)));
    }
    if let Some(steps) = &rec.steps {
        let done = steps.done.iter().map(|s| {
            let mut m = Attrs::new();
            m.insert("l".into(), AttributeValue::S(s.label.to_string()));
            m.insert("e".into(), n(s.epoch));
            m.insert("a".into(), n(s.at.0));
            m.insert("o".into(), bytes(&s.outcome.body));
            m.insert("oe".into(), AttributeValue::Bool(s.outcome.is_err));
            m.insert("ov".into(), n(u64::from(s.outcome.version)));
            AttributeValue::M(m)
        });
        item.insert("sp".into(), AttributeValue::L(done.collect()));
        item.insert("sr".into(), AttributeValue::Bool(steps.released));
    }
    item
}

fn corrupt(what: &str) -> StoreError {
    StoreError::new(
        false,
        format!("a DynamoDB item of idem's has no valid `{what}`: it was not written by idem"),
    )
}

fn num(item: &Attrs, name: &str) -> Result<u64, StoreError> {
    match item.get(name) {
        Some(AttributeValue::N(v)) => v.parse().map_err(|_| corrupt(name)),
        _ => Err(corrupt(name)),
    }
}

fn blob<'a>(item: &'a Attrs, name: &str) -> Result<&'a [u8], StoreError> {
    match item.get(name) {
        Some(AttributeValue::B(b)) => Ok(b.as_ref()),
        _ => Err(corrupt(name)),
    }
}

fn flag(item: &Attrs, name: &str) -> Result<bool, StoreError> {
    match item.get(name) {
        Some(AttributeValue::Bool(b)) => Ok(*b),
        _ => Err(corrupt(name)),
    }
}

fn text(item: &Attrs, name: &str) -> Result<String, StoreError> {
    match item.get(name) {
        Some(AttributeValue::S(s)) => Ok(s.clone()),
        None => Ok(String::new()),
        _ => Err(corrupt(name)),
    }
}

fn outcome_of(item: &Attrs) -> Result<StoredOutcome, StoreError> {
    let version = u32::try_from(num(item, "ov")?).map_err(|_| corrupt("ov"))?;
    Ok(StoredOutcome::new(
        blob(item, "o")?.to_vec(),
        flag(item, "oe")?,
        version,
    ))
}

/// The operation an item records.
pub(super) fn id_of(item: &Attrs) -> Result<OperationId, StoreError> {
    Ok(OperationId {
        scope: text(item, "sc")?,
        name: text(item, "nm")?,
        key: text(item, "ky")?,
    })
}

/// Whether `item` is the table's own record of its key mode.
pub(super) fn is_meta(item: &Attrs) -> bool {
    matches!(item.get("pk"), Some(AttributeValue::S(pk)) if pk == META_PK)
}

impl Item {
    pub(super) fn decode(item: &Attrs) -> Result<Item, StoreError> {
        let state = match num(item, "st")? {
            0 => State::InProgress,
            1 => State::Completed,
            2 => State::Unknown,
            _ => return Err(corrupt("st")),
        };
        let fingerprint: [u8; 32] = blob(item, "fp")?.try_into().map_err(|_| corrupt("fp"))?;
        let expires_at = match item.get("xa") {
            None => Tick::NEVER,
            Some(_) => Tick(num(item, "xa")?),
        };
        let outcome = match item.get("o") {
            None => None,
            Some(_) => Some(outcome_of(item)?),
        };
        let steps = match item.get("sp") {
            None => None,
            Some(AttributeValue::L(list)) => {
                let mut done = Vec::with_capacity(list.len());
                for step in list {
                    let AttributeValue::M(m) = step else {
                        return Err(corrupt("sp"));
                    };
                    done.push(Step {
                        label: text(m, "l")?.into(),
                        epoch: num(m, "e")?,
                        at: Tick(num(m, "a")?),
                        outcome: outcome_of(m)?,
                    });
                }
                Some(Box::new(Steps {
                    done,
                    released: flag(item, "sr")?,
                }))
            }
            Some(_) => return Err(corrupt("sp")),
        };
        Ok(Item {
            rec: Record {
                state,
                epoch: num(item, "ep")?,
                fingerprint,
                lease_until: Tick(num(item, "lu")?),
                claimed_at: Tick(num(item, "ca")?),
                expires_at,
                outcome,
                steps,
            },
            version: num(item, "v")?,
        })
    }
}

/// The SDK's errors, as the store reports them.
pub(super) mod errors {
    use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};

    use crate::store::StoreError;

    /// Error codes DynamoDB answers when a retry may succeed.
    const RETRYABLE: [&str; 6] = [
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalServerError",
        "ServiceUnavailable",
        "TransactionConflictException",
    ];

    /// Whether a conditional write failed on its condition: another writer came first.
    pub(in crate::store::dynamodb) fn lost_race<E: ProvideErrorMetadata, R>(
        e: &SdkError<E, R>,
    ) -> bool {
        e.as_service_error()
            .and_then(ProvideErrorMetadata::code)
            .is_some_and(|code| code == "ConditionalCheckFailedException")
    }

    /// `e` as a store error: a request that never reached DynamoDB, or timed out, is
    /// unreachable; throttling and server errors are retryable; the rest are refusals.
    pub(in crate::store::dynamodb) fn store<E, R>(e: SdkError<E, R>) -> StoreError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug + Send + Sync + 'static,
    {
        match &e {
            SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => StoreError::unreachable(e),
            SdkError::ServiceError(s) => {
                let retryable = s.err().code().is_some_and(|c| RETRYABLE.contains(&c));
                let message = match (s.err().code(), s.err().message()) {
                    (Some(code), Some(message)) => format!("DynamoDB: {code}: {message}"),
                    (Some(code), None) => format!("DynamoDB: {code}"),
                    _ => format!("DynamoDB: {e}"),
                };
                StoreError::new(retryable, message)
            }
            _ => StoreError::new(true, format!("DynamoDB: {e}")),
        }
    }
}
