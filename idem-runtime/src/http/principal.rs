//! The caller an idempotent request is scoped to.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use http::request::Parts;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::problem::Problem;
use crate::key::KeyPart;

/// Who is calling, as the application's authentication decided: the scope of every
/// idempotency key it sends.
///
/// The auth layer inserts it into the request's extensions
/// (`req.extensions_mut().insert(Principal::new(user_id))`); [`IdempotencyLayer`]
/// reads it there, and handlers extract it. Scoping by principal is what stops one
/// caller's key from replaying another caller's response: keys are chosen by clients,
/// so two clients can pick the same one, by accident or on purpose. A request without
/// a principal is refused (500, the request does not run), never run in a shared
/// scope.
///
/// [`IdempotencyLayer`]: super::IdempotencyLayer
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(Arc<str>);

impl Principal {
    /// A principal from a stable identifier (a user or account id, not a display name).
    ///
    /// ```
    /// use idem_runtime::http::Principal;
    /// assert_eq!(Principal::new("user-42").as_str(), "user-42");
    /// ```
    ///
    /// # Panics
    ///
    /// If `id` is empty. The empty scope is idem's default namespace, shared by every
    /// operation given no scope, so an empty principal would share keys with them and
    /// with every other caller whose identifier came out empty; an auth layer that can
    /// produce one has a bug to fix, not a caller to serve. Use
    /// [`try_new`](Self::try_new) where the identifier comes from input.
    pub fn new(id: impl Into<String>) -> Self {
        Self::try_new(id).expect(
            "Principal::new(\"\"): a principal's identifier must not be empty (the empty \
             scope is shared); refuse the request in the auth layer instead, or use \
             `Principal::try_new`",
        )
    }

    /// A principal from `id`, or `None` if it is empty (see [`new`](Self::new)).
    ///
    /// ```
    /// use idem_runtime::http::Principal;
    /// assert!(Principal::try_new("").is_none());
    /// assert_eq!(Principal::try_new("ana").unwrap().as_str(), "ana");
    /// ```
    pub fn try_new(id: impl Into<String>) -> Option<Self> {
        let id = id.into();
        (!id.is_empty()).then(|| Principal(Arc::from(id)))
    }

    /// The identifier.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

// By hand: serde's impls for `Arc<str>` need its `rc` feature.
impl Serialize for Principal {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Principal {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let id = String::deserialize(d)?;
        Principal::try_new(id)
            .ok_or_else(|| serde::de::Error::custom("a principal's identifier must not be empty"))
    }
}

impl KeyPart for Principal {
    fn write_key(&self, out: &mut String) {
        self.as_str().write_key(out);
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Principal {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        parts
            .extensions
            .get::<Principal>()
            .cloned()
            .ok_or_else(Problem::no_principal)
    }
}

#[cfg(test)]
mod tests {
    use super::Principal;

    #[test]
    #[should_panic(expected = "must not be empty")]
    fn an_empty_principal_is_refused() {
        let _ = Principal::new("");
    }

    #[test]
    fn an_empty_principal_does_not_deserialize() {
        assert!(serde_json::from_str::<Principal>(r#""""#).is_err());
        let p: Principal = serde_json::from_str(r#""ana""#).unwrap();
        assert_eq!(p.as_str(), "ana");
    }
}
