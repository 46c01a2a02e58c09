//! The tool argument [`IdempotencyKey`]: its validation, its JSON Schema, and its
//! encoding as a [`KeyPart`].

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize};

use crate::KeyPart;

/// The longest [`IdempotencyKey`], in bytes: the cap of the HTTP `Idempotency-Key`
/// header (`idem_runtime::http::MAX_KEY_LEN`), so one client key fits both transports.
/// A key longer than 250 bytes is keyed by its SHA-256, to fit idem's 255-byte cap on
/// encoded keys.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// The title of [`IdempotencyKey`]'s JSON Schema, by which [`audit`](super::audit) knows a key
/// argument whatever its name.
pub(super) const KEY_TITLE: &str = "IdempotencyKey";

/// What the key's JSON Schema tells the model.
const KEY_DESCRIPTION: &str = "Idempotency key of this action. Generate a new unique value \
    (for example a UUID) once per intended action, and send the same value again, with the \
    same arguments, whenever you retry that action (after a timeout, an error or a restart): \
    the action then happens once and the retry gets the first result. Never reuse a key for \
    a different action.";

/// A tool argument naming one intent of the caller: 1 to [`MAX_IDEMPOTENCY_KEY_LEN`]
/// visible ASCII characters (`!` to `~`: no whitespace, no control characters).
///
/// It deserializes only when valid, so a tool never runs with a bad key (rmcp answers
/// with a tool error naming the rule). Its JSON Schema carries those bounds and a description telling the
/// model to generate one key per intent and reuse it on retry; a field of this type in a
/// tool's argument struct puts both in the tool's input schema. As a [`KeyPart`] it
/// encodes like the same string, so `key = args.idempotency_key` works.
///
/// ```
/// use idem_runtime::mcp::IdempotencyKey;
///
/// let key: IdempotencyKey = serde_json::from_str(r#""refund-7f3a9c""#).unwrap();
/// assert_eq!(key.as_str(), "refund-7f3a9c");
/// assert!(serde_json::from_str::<IdempotencyKey>(r#""two words""#).is_err());
/// assert!(serde_json::from_str::<IdempotencyKey>(r#""""#).is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct IdempotencyKey(String);

/// Why a string is not an [`IdempotencyKey`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidIdempotencyKey {
    /// The key is empty.
    #[error("the idempotency key is empty; generate one unique value per action")]
    Empty,
    /// The key is over [`MAX_IDEMPOTENCY_KEY_LEN`] bytes.
    #[error("the idempotency key is {len} bytes, over the cap of {MAX_IDEMPOTENCY_KEY_LEN}")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key holds whitespace, a control character or a non-ASCII character.
    #[error(
        "the idempotency key holds {found:?} at byte {at}; use visible ASCII characters only \
         (`!` to `~`), such as a UUID"
    )]
    BadCharacter {
        /// The character.
        found: char,
        /// Its byte offset.
        at: usize,
    },
}

impl IdempotencyKey {
    /// Validates `key`.
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidIdempotencyKey> {
        let key = key.into();
        if key.is_empty() {
            return Err(InvalidIdempotencyKey::Empty);
        }
        if key.len() > MAX_IDEMPOTENCY_KEY_LEN {
            return Err(InvalidIdempotencyKey::TooLong { len: key.len() });
        }
        if let Some((at, found)) = key.char_indices().find(|(_, c)| !c.is_ascii_graphic()) {
            return Err(InvalidIdempotencyKey::BadCharacter { found, at });
        }
        Ok(IdempotencyKey(key))
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for IdempotencyKey {
    type Err = InvalidIdempotencyKey;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        IdempotencyKey::new(s)
    }
}

impl TryFrom<String> for IdempotencyKey {
    type Error = InvalidIdempotencyKey;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        IdempotencyKey::new(s)
    }
}

impl<'de> Deserialize<'de> for IdempotencyKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let key = String::deserialize(deserializer)?;
        IdempotencyKey::new(key).map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for IdempotencyKey {
    fn schema_name() -> Cow<'static, str> {
        "IdempotencyKey".into()
    }

    // Inline, so the description sits on the tool's own property, where models read it.
    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "title": KEY_TITLE,
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_IDEMPOTENCY_KEY_LEN,
            "pattern": "^[!-~]+$",
            "description": KEY_DESCRIPTION,
        })
    }
}

impl KeyPart for IdempotencyKey {
    fn write_key(&self, out: &mut String) {
        crate::key::write_client_key(&self.0, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_validation() {
        assert!(IdempotencyKey::new("a").is_ok());
        assert!(IdempotencyKey::new("x".repeat(MAX_IDEMPOTENCY_KEY_LEN)).is_ok());
        assert_eq!(
            IdempotencyKey::new("x".repeat(MAX_IDEMPOTENCY_KEY_LEN + 1)),
            Err(InvalidIdempotencyKey::TooLong {
                len: MAX_IDEMPOTENCY_KEY_LEN + 1
            })
        );
        assert_eq!(IdempotencyKey::new(""), Err(InvalidIdempotencyKey::Empty));
        for bad in ["a b", "a\tb", "a\nb", "é", "a\u{7f}"] {
            assert!(IdempotencyKey::new(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            IdempotencyKey::new("k").unwrap().encode_key(),
            "k".encode_key()
        );
    }

    #[test]
    fn keys_up_to_the_cap_fit_the_store_and_stay_distinct() {
        let short = IdempotencyKey::new("x".repeat(250)).unwrap();
        assert_eq!(short.encode_key(), "x".repeat(250).encode_key());
        let long = IdempotencyKey::new("x".repeat(MAX_IDEMPOTENCY_KEY_LEN)).unwrap();
        let other = IdempotencyKey::new(format!("{}y", "x".repeat(254))).unwrap();
        assert!(long.encode_key().len() <= crate::MAX_KEY_BYTES);
        assert_ne!(long.encode_key(), other.encode_key());
        assert_ne!(long.encode_key(), "x".repeat(255).encode_key());
    }

    #[test]
    fn schema_describes_the_key() {
        let schema = schemars::schema_for!(IdempotencyKey);
        let value = schema.as_value();
        assert_eq!(value["type"], "string");
        assert_eq!(value["maxLength"], MAX_IDEMPOTENCY_KEY_LEN);
        assert!(
            value["description"]
                .as_str()
                .unwrap()
                .contains("same value again")
        );
    }
}
