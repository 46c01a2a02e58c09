//! The `Idempotency-Key` request header: parsing, the extractor (which warns once on a
//! route with no layer that sets `Idempotent-Replayed`), and the key's identity.

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;

use super::problem::Problem;
use super::rejection::{KeyRejection, MAX_KEY_LEN};
use crate::key::KeyPart;

/// The request header that carries the key (IETF httpapi draft).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header set to `true` on a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A valid `Idempotency-Key`: 1 to 255 printable ASCII characters.
///
/// The header may carry the draft's structured-field string (`"8e03-..."`, RFC 9651:
/// quotes, with `\"` and `\\` escapes; parameters are ignored) or the bare value
/// Stripe-style clients send (`8e03-...`: visible ASCII, no spaces, not starting with
/// a quote). Both spell the same key, so a client may switch between them.
///
/// As an axum extractor it answers a missing or invalid header with a 400
/// problem+json naming the header and the rule; `Option<IdempotencyKey>` accepts a
/// missing header (and still refuses an invalid one).
///
/// It is a [`KeyPart`], so it can be the `key` of `#[idempotent]` (mark the parameter
/// `#[idem(skip)]`: the key is the operation's identity, not part of its payload).
/// A key of up to 250 characters is keyed exactly like the same `&str`; a longer one
/// (up to 255) by its SHA-256, to fit the store's key cap.
///
/// ```
/// use idem_runtime::http::IdempotencyKey;
/// let quoted = IdempotencyKey::parse(br#""8e03-40d5""#).unwrap();
/// let bare = IdempotencyKey::parse(b"8e03-40d5").unwrap();
/// assert_eq!(quoted, bare);
/// assert_eq!(bare.as_str(), "8e03-40d5");
/// assert!(IdempotencyKey::parse(b"").is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

fn is_ows(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

impl IdempotencyKey {
    /// Parses one header value.
    pub fn parse(value: &[u8]) -> Result<Self, KeyRejection> {
        let start = value
            .iter()
            .position(|&b| !is_ows(b))
            .unwrap_or(value.len());
        let end = value
            .iter()
            .rposition(|&b| !is_ows(b))
            .map_or(start, |i| i + 1);
        let value = &value[start..end];
        let Some(&first) = value.first() else {
            return Err(KeyRejection::Empty);
        };
        if value.iter().any(|&b| !(0x20..=0x7e).contains(&b)) {
            return Err(KeyRejection::NotAscii);
        }
        let key = if first == b'"' {
            let item: sfv::Item = sfv::Parser::new(value)
                .parse()
                .map_err(|_| KeyRejection::Malformed)?;
            match item.bare_item {
                sfv::BareItem::String(s) => s.as_str().to_owned(),
                _ => return Err(KeyRejection::Malformed),
            }
        } else {
            if value.contains(&b' ') {
                return Err(KeyRejection::Malformed);
            }
            // Checked above: every byte is ASCII.
            String::from_utf8(value.to_vec()).map_err(|_| KeyRejection::NotAscii)?
        };
        Self::new(key)
    }

    /// A key from its text, checked like a parsed one (`"abc"` is the key `abc` with
    /// no quotes; use [`parse`](Self::parse) for header values).
    pub fn new(key: impl Into<String>) -> Result<Self, KeyRejection> {
        let key = key.into();
        if key.is_empty() {
            return Err(KeyRejection::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyRejection::TooLong { len: key.len() });
        }
        if key.bytes().any(|b| !(0x20..=0x7e).contains(&b)) {
            return Err(KeyRejection::NotAscii);
        }
        Ok(IdempotencyKey(key))
    }

    /// The key in `headers`: `Ok(None)` when the header is absent.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyRejection> {
        let mut values = headers.get_all(IDEMPOTENCY_KEY).into_iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyRejection::Repeated);
        }
        Self::parse(value.as_bytes()).map(Some)
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as the draft spells it: a structured-field string.
    ///
    /// ```
    /// use idem_runtime::http::IdempotencyKey;
    /// let key = IdempotencyKey::new(r#"a "b""#).unwrap();
    /// assert_eq!(key.to_header_value(), r#""a \"b\"""#);
    /// assert_eq!(IdempotencyKey::parse(key.to_header_value().as_bytes()).unwrap(), key);
    /// ```
    pub fn to_header_value(&self) -> HeaderValue {
        let s = sfv::StringRef::from_str(&self.0).expect("a checked key is a valid sf-string");
        let text = sfv::ItemSerializer::new().bare_item(s).finish();
        HeaderValue::from_str(&text).expect("an sf-string is a valid header value")
    }
}

impl std::fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl KeyPart for IdempotencyKey {
    fn write_key(&self, out: &mut String) {
        crate::key::write_client_key(&self.0, out);
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        match Self::from_headers(&parts.headers) {
            Ok(Some(key)) => {
                check_layer(&parts.extensions);
                Ok(key)
            }
            Ok(None) => Err(KeyRejection::Missing.into()),
            Err(e) => Err(e.into()),
        }
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Problem> {
        let key = Self::from_headers(&parts.headers).map_err(Problem::from)?;
        if key.is_some() {
            check_layer(&parts.extensions);
        }
        Ok(key)
    }
}

/// Put in a request's extensions by the layers that set `Idempotent-Replayed`
/// ([`IdempotentHandlerLayer`](super::IdempotentHandlerLayer) and
/// [`IdempotencyLayer`](super::IdempotencyLayer)), so the [`IdempotencyKey`] extractor
/// can tell a route that has neither.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReplayHeaderSet;

/// Warns, once per process, when a request carrying an `Idempotency-Key` reaches its
/// handler through neither layer. Such a route compiles and runs, and its calls are
/// idempotent, but nothing observes them, so a replay goes out without
/// `Idempotent-Replayed` and its client cannot tell it from a first execution. Once:
/// a missing layer is a setup mistake, and one line says so without flooding the log.
fn check_layer(extensions: &http::Extensions) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if extensions.get::<ReplayHeaderSet>().is_none() {
        WARNED.call_once(|| {
            tracing::warn!(
                "an `IdempotencyKey` was extracted on a route without \
                 `IdempotentHandlerLayer`: replayed responses will not carry \
                 `Idempotent-Replayed: true`, and a client's disconnect cancels the handler \
                 mid-effect; add `.layer(IdempotentHandlerLayer::new())` to the router \
                 (warned once per process)"
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_and_rules() {
        let k = |v: &str| IdempotencyKey::parse(v.as_bytes());
        assert_eq!(k(r#""abc""#).unwrap().as_str(), "abc");
        assert_eq!(k("abc").unwrap().as_str(), "abc");
        assert_eq!(k(r#"  "a b";x=1 "#).unwrap().as_str(), "a b");
        assert_eq!(k(r#""a\"b\\""#).unwrap().as_str(), r#"a"b\"#);
        assert_eq!(k(""), Err(KeyRejection::Empty));
        assert_eq!(k(r#""""#), Err(KeyRejection::Empty));
        assert_eq!(k(r#""abc"#), Err(KeyRejection::Malformed));
        assert_eq!(k(r#""abc" x"#), Err(KeyRejection::Malformed));
        assert_eq!(k("a b"), Err(KeyRejection::Malformed));
        assert_eq!(k("caf\u{e9}"), Err(KeyRejection::NotAscii));
        assert_eq!(
            IdempotencyKey::parse(b"a\x01b"),
            Err(KeyRejection::NotAscii)
        );
        assert_eq!(k(&"x".repeat(255)).unwrap().as_str().len(), 255);
        assert_eq!(k(&"x".repeat(256)), Err(KeyRejection::TooLong { len: 256 }));
        assert_eq!(
            k(&format!("\"{}\"", "x".repeat(256))),
            Err(KeyRejection::TooLong { len: 256 })
        );
    }

    #[test]
    fn key_encoding_fits_the_cap() {
        let short = IdempotencyKey::new("x".repeat(250)).unwrap();
        assert_eq!(short.encode_key(), "x".repeat(250).encode_key());
        assert!(short.encode_key().len() <= crate::MAX_KEY_BYTES);
        let long = IdempotencyKey::new("x".repeat(255)).unwrap();
        let other = IdempotencyKey::new("y".repeat(255)).unwrap();
        assert!(long.encode_key().len() <= crate::MAX_KEY_BYTES);
        assert_ne!(long.encode_key(), other.encode_key());
    }
}
