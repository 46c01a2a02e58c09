//! How an operation's result is encoded for the store (sealed where the `Idem`
//! encrypts) and how a recorded outcome is decoded (opened, upgraded) for a replay.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Disposition, ErrorPolicy, Operation, Upgrade};
use crate::error::IdemError;
use crate::seal::Part;
use crate::store::{OutcomeRef, StoredOutcome};

impl<P, U, F, R> Operation<P, U, F, R> {
    pub(crate) fn decode_outcome<T, E>(&self, outcome: OutcomeRef<'_>) -> Result<T, E>
    where
        T: DeserializeOwned,
        E: From<IdemError>,
        P: ErrorPolicy<E>,
        U: Upgrade<T>,
    {
        let codec = |message: String| IdemError::Codec {
            name: self.id.name.as_str().to_owned(),
            message,
        };
        // Opened where it was sealed (`seal.rs`); a clear body is read as it is.
        let opened = match &self.idem {
            Some(idem) => idem.open(
                &self.id,
                Part::Outcome,
                outcome.is_err,
                outcome.version,
                outcome.body,
            )?,
            None => std::borrow::Cow::Borrowed(outcome.body),
        };
        let outcome = OutcomeRef {
            body: &opened,
            ..outcome
        };
        if outcome.is_err {
            if outcome.version != self.version {
                return Err(codec(format!(
                    "a recorded error has schema version {} but this build expects version {}; \
                     resolve the operation or wait for it to expire",
                    outcome.version, self.version
                ))
                .into());
            }
            return match self.policy.decode(outcome.body) {
                Ok(e) => Err(e),
                Err(m) => Err(codec(format!("cannot decode the recorded error: {m}")).into()),
            };
        }
        if outcome.version != self.version {
            let value: serde_json::Value = serde_json::from_slice(outcome.body)
                .map_err(|e| codec(format!("the recorded outcome is not JSON: {e}")))?;
            return Ok(self.upgrade.upgrade(
                self.id.name.as_str(),
                outcome.version,
                self.version,
                value,
            )?);
        }
        serde_json::from_slice(outcome.body).map_err(|e| {
            codec(format!(
                "cannot decode the recorded outcome as this build's type: {e}; if the type \
                 changed shape, bump `version` and add `upgrade`"
            ))
            .into()
        })
    }
}

/// A body's result as it will be stored: decided once, for the leased and the
/// transactional paths alike.
pub(crate) enum Encoded<T, E> {
    /// Record this outcome, then answer with the result.
    Record(StoredOutcome, Result<T, E>),
    /// Release the claim: a retry runs the body again.
    Release(E),
    /// The effect may have happened: park the operation in UNKNOWN.
    Unknown(E),
    /// The body ran but its result cannot be recorded.
    Unrecordable(Unrecordable),
}

/// Why a result cannot be recorded.
pub(crate) enum Unrecordable {
    /// The `Ok` value does not serialize.
    Outcome(String),
    /// The `Err` value does not serialize.
    Error(String),
    /// The outcome is over the cap.
    TooLarge(usize),
}

impl Unrecordable {
    /// The error to answer with when the body ran and its effect may stand; `then` says
    /// what became of the operation.
    pub(crate) fn error(&self, name: &str, max: usize, then: &str) -> IdemError {
        self.answer(name, max, then, true)
    }

    /// The error to answer with when the body's writes were rolled back with its claim,
    /// so nothing took effect; `then` says so.
    #[cfg(feature = "_sql")]
    pub(crate) fn rolled_back(&self, name: &str, max: usize, then: &str) -> IdemError {
        self.answer(name, max, then, false)
    }

    fn answer(&self, name: &str, max: usize, then: &str, in_doubt: bool) -> IdemError {
        let name = name.to_owned();
        match self {
            Unrecordable::Outcome(e) => IdemError::Codec {
                name,
                message: format!("the body ran but its outcome cannot be serialized ({e}); {then}"),
            },
            Unrecordable::Error(e) => IdemError::Codec {
                name,
                message: format!(
                    "the body's error cannot be serialized for recording ({e}); {then}"
                ),
            },
            Unrecordable::TooLarge(len) => IdemError::OutcomeTooLarge {
                name,
                len: *len,
                max,
                in_doubt,
            },
        }
    }
}

impl<P, U> Operation<P, U> {
    /// What `out` becomes, with outcomes over `max` bytes refused. With
    /// `unknown_is_record` an error classified `Unknown` is recorded (transactional mode,
    /// where nothing is in doubt).
    pub(crate) fn encode<T: Serialize, E>(
        &self,
        out: Result<T, E>,
        max: usize,
        unknown_is_record: bool,
    ) -> Encoded<T, E>
    where
        P: ErrorPolicy<E>,
    {
        let (body, is_err, result) = match out {
            Ok(v) => match serde_json::to_vec(&v) {
                Ok(body) => (body, false, Ok(v)),
                Err(e) => return Encoded::Unrecordable(Unrecordable::Outcome(e.to_string())),
            },
            Err(err) => match self.policy.disposition(&err) {
                Disposition::Release => return Encoded::Release(err),
                Disposition::Unknown if !unknown_is_record => return Encoded::Unknown(err),
                Disposition::Record | Disposition::Unknown => match self.policy.encode(&err) {
                    Ok(body) => (body, true, Err(err)),
                    Err(m) => return Encoded::Unrecordable(Unrecordable::Error(m)),
                },
            },
        };
        if body.len() > max {
            return Encoded::Unrecordable(Unrecordable::TooLarge(body.len()));
        }
        // Sealed here, for every store and both modes, when the `Idem` encrypts.
        let body = match &self.idem {
            Some(idem) => match idem.seal(&self.id, Part::Outcome, is_err, self.version, body) {
                Ok(body) => body,
                Err(e) => return Encoded::Unrecordable(Unrecordable::Outcome(e.to_string())),
            },
            None => body,
        };
        let outcome = StoredOutcome::new(body, is_err, self.version);
        Encoded::Record(outcome, result)
    }
}
