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
    pub fn new(id: impl Into<String>) -> Self {
        Principal(Arc::from(id.into()))
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
        String::deserialize(d).map(Principal::new)
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
