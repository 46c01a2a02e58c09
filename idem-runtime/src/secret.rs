//! The `hash_keys` secret, and the key mode a store records at its first open so that
//! it is never read with another; the hex helpers both use.

use std::sync::Arc;

use sha2::Sha256;

use crate::error::IdemError;

/// The `hash_keys` secret; never printed.
#[derive(Clone)]
pub(crate) struct Secret(pub(crate) Arc<[u8]>);

impl Secret {
    /// The shortest secret any store takes: a shorter one can be guessed, and with it
    /// every hashed key tried against a dictionary.
    pub(crate) const MIN_LEN: usize = 16;

    /// The one rule every store applies to the secret.
    pub(crate) fn check(&self) -> Result<(), IdemError> {
        self.check_as("hash_keys")
    }

    /// [`check`](Self::check), for the secret the builder's method `what` set.
    pub(crate) fn check_as(&self, what: &str) -> Result<(), IdemError> {
        if self.0.len() < Self::MIN_LEN {
            return Err(IdemError::Config {
                message: format!(
                    "the `{what}` secret is {} bytes, shorter than {}; use at least 32 \
                     random bytes kept with your other secrets",
                    self.0.len(),
                    Self::MIN_LEN
                ),
            });
        }
        Ok(())
    }
}

/// The key mode of a store whose keys and scopes are stored as given.
#[cfg_attr(not(any(feature = "_sql", feature = "redis")), allow(dead_code))]
pub(crate) const PLAIN_KEYS: &str = "plain";

/// How a store records the way its keys and scopes are stored, at its first open:
/// [`PLAIN_KEYS`], or `hmac-sha256:` and a check value of the secret, so that opening
/// it later without the secret, or with another one, is refused rather than giving every
/// operation a new identity (and running every body again).
#[cfg_attr(not(any(feature = "_sql", feature = "redis")), allow(dead_code))]
pub(crate) fn key_mode(secret: Option<&Secret>) -> String {
    match secret {
        None => PLAIN_KEYS.to_owned(),
        Some(Secret(secret)) => format!(
            "hmac-sha256:{}",
            &keyed_hex(secret, b"idem key-mode check")[..16]
        ),
    }
}

/// Fails unless the key mode `where_` recorded (if any) is `wanted`. `where_` names the
/// records ("the idem table `t`"), `other` the way out ("another table").
#[cfg_attr(not(any(feature = "_sql", feature = "redis")), allow(dead_code))]
pub(crate) fn check_key_mode(
    where_: &str,
    other: &str,
    recorded: Option<&str>,
    wanted: &str,
) -> Result<(), IdemError> {
    let describe = |mode: &str| {
        if mode == PLAIN_KEYS {
            "as given (no `hash_keys`)".to_owned()
        } else {
            format!("keyed-hashed with the secret whose check value is `{mode}`")
        }
    };
    match recorded {
        Some(found) if found != wanted => Err(IdemError::Config {
            message: format!(
                "{where_} stores keys and scopes {}, but this store was opened with keys {}; \
                 open it with the same `hash_keys` setting and secret, or use {other}",
                describe(found),
                describe(wanted)
            ),
        }),
        _ => Ok(()),
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// HMAC-SHA256 of `bytes` under `secret`, in hex.
pub(crate) fn keyed_hex(secret: &[u8], bytes: &[u8]) -> String {
    use hmac::Mac;
    let mut mac =
        hmac::Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(bytes);
    hex(&mac.finalize().into_bytes())
}

/// `bytes` in lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// Appends `bytes` to `out` in lowercase hex.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
}
