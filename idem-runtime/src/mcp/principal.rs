//! [`Principal`]: the caller of a tool, on streamable HTTP or stdio, for `scope`.

use std::fmt;

use rmcp::ErrorData;
use rmcp::model::Extensions;

use crate::KeyPart;

/// The authenticated caller of a tool, for `scope`, so one principal's key never
/// replays another's outcome.
///
/// - **Streamable HTTP**: the server's authentication layer (an axum middleware or tower
///   layer in front of rmcp's `StreamableHttpService`) inserts a `Principal` into the
///   request's extensions after checking the credentials; rmcp hands the request's
///   [`http::request::Parts`] to the tool, and [`Principal::from_http`] reads it back.
/// - **stdio**: there is no request to authenticate; the spec has the server take
///   credentials from its environment, so read the principal once at startup with
///   [`Principal::from_env`].
///
/// [`Principal::caller`] picks between the two for a tool call, and never falls back to
/// the stdio principal for an HTTP request without one.
///
/// ```
/// use idem_runtime::mcp::Principal;
///
/// // In the HTTP auth layer, after checking the credentials:
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(Principal::new("ana"));
/// let (parts, ()) = request.into_parts();
/// assert_eq!(Principal::from_http(&parts).map(Principal::as_str), Some("ana"));
///
/// // On stdio:
/// let me = Principal::from_env("MY_SERVER_PRINCIPAL", "local");
/// let mut ext = rmcp::model::Extensions::new();
/// assert_eq!(Principal::caller(&ext, &me).unwrap(), me);
/// ext.insert(parts); // what rmcp does on streamable HTTP
/// assert_eq!(Principal::caller(&ext, &me).unwrap(), Principal::new("ana"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Principal(String);

impl Principal {
    /// A principal named `name` (what your authentication established).
    ///
    /// # Panics
    ///
    /// If `name` is empty. The empty scope is idem's default namespace, shared by every
    /// operation given no scope, so an empty principal would share keys with them and
    /// with every other caller whose name came out empty; an auth layer that can produce
    /// one has a bug to fix. Use [`try_new`](Self::try_new) where the name comes from
    /// input.
    pub fn new(name: impl Into<String>) -> Self {
        Self::try_new(name).expect(
            "mcp::Principal::new(\"\"): a principal's name must not be empty (the empty \
             scope is shared); refuse the request in the auth layer instead, or use \
             `Principal::try_new`",
        )
    }

    /// A principal named `name`, or `None` if it is empty (see [`new`](Self::new)).
    ///
    /// ```
    /// use idem_runtime::mcp::Principal;
    /// assert!(Principal::try_new("").is_none());
    /// assert_eq!(Principal::try_new("ana").unwrap().as_str(), "ana");
    /// ```
    pub fn try_new(name: impl Into<String>) -> Option<Self> {
        let name = name.into();
        (!name.is_empty()).then_some(Principal(name))
    }

    /// Its name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The principal for a stdio server: the environment variable `var`, or `default`
    /// when it is unset or empty.
    ///
    /// # Panics
    ///
    /// If `var` is unset or empty and `default` is empty.
    pub fn from_env(var: &str, default: &str) -> Self {
        match std::env::var(var) {
            Ok(name) if !name.is_empty() => Principal(name),
            _ => Principal::new(default),
        }
    }

    /// The principal an authentication layer put in the HTTP request's extensions.
    pub fn from_http(parts: &http::request::Parts) -> Option<&Principal> {
        parts.extensions.get::<Principal>()
    }

    /// The caller of a tool, from its request's extensions (a tool takes them as a
    /// parameter of type [`Extensions`], or as `RequestContext::extensions`): on
    /// streamable HTTP the principal of [`from_http`](Self::from_http), on stdio (no HTTP
    /// request) `stdio`. An HTTP request without a principal is refused with a protocol
    /// error: the auth layer is missing, and the call must not run as anyone.
    pub fn caller(extensions: &Extensions, stdio: &Principal) -> Result<Principal, ErrorData> {
        match extensions.get::<http::request::Parts>() {
            None => Ok(stdio.clone()),
            Some(parts) => Principal::from_http(parts).cloned().ok_or_else(|| {
                ErrorData::invalid_request(
                    "unauthenticated: no principal on this HTTP request (the server's \
                     authentication layer must insert `idem_runtime::mcp::Principal`)",
                    None,
                )
            }),
        }
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl KeyPart for Principal {
    fn write_key(&self, out: &mut String) {
        self.0.write_key(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "must not be empty")]
    fn an_empty_principal_is_refused() {
        let _ = Principal::new("");
    }

    #[test]
    fn http_request_without_principal_is_refused() {
        let stdio = Principal::new("local");
        let (parts, ()) = http::Request::new(()).into_parts();
        let mut ext = Extensions::new();
        ext.insert(parts);
        // Never the stdio principal for an HTTP request the auth layer did not mark.
        assert!(Principal::caller(&ext, &stdio).is_err());
    }
}
