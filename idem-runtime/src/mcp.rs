//! Idempotent tools for MCP servers built on [`rmcp`] (feature `mcp`).
//!
//! An agent repeats tool calls: the model re-issues a call after a timeout, the client
//! retries with a new JSON-RPC id, a planner replays a step. A side-effecting tool
//! therefore takes an [`IdempotencyKey`] in its input schema (the model generates one
//! per intent and sends it again on every retry of that intent) and its handler carries
//! `#[idempotent]`, keyed on that argument and scoped to the caller's [`Principal`]:
//!
//! ```
//! use idem_runtime::mcp::{IdempotencyKey, Principal, ToolError};
//! use idem_runtime::{Idem, idempotent};
//! use rmcp::handler::server::wrapper::Parameters;
//! use rmcp::model::Extensions;
//! use rmcp::{tool, tool_router};
//!
//! #[derive(serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
//! struct Refund {
//!     charge_id: String,
//!     amount_cents: u64,
//!     idempotency_key: IdempotencyKey,
//! }
//!
//! #[derive(Clone)]
//! struct Payments {
//!     idem: Idem,
//!     stdio_principal: Principal,
//! }
//!
//! #[tool_router(server_handler)]
//! impl Payments {
//!     // `#[idempotent]` above `#[tool]`: it must see the `async fn` as written.
//!     #[idempotent(
//!         store = self.idem,
//!         key = args.idempotency_key,
//!         scope = Principal::caller(&ext, &self.stdio_principal)?,
//!         retain = "7d"
//!     )]
//!     #[tool(description = "Refund a charge.", annotations(destructive_hint = true, idempotent_hint = true))]
//!     async fn refund(
//!         &self,
//!         Parameters(args): Parameters<Refund>,
//!         #[idem(skip)] ext: Extensions,
//!     ) -> Result<String, ToolError> {
//!         Ok(format!("refunded {} cents of {}", args.amount_cents, args.charge_id))
//!     }
//! }
//! ```
//!
//! What this module holds is what an rmcp user cannot write alone: the key's type with
//! its schema, the conversions of [`IdemError`] into what a tool returns (the orphan
//! rule forbids them outside this crate), and the caller's principal on either
//! transport.
//!
//! # Attribute order
//!
//! `#[idempotent]` goes **above** `#[tool]`. rmcp's `#[tool]` rewrites the `async fn`
//! into a plain `fn` returning a boxed future; placed below it, `#[idempotent]` would
//! see that rewritten function and stops with an error saying to move it up.
//!
//! # What the model sees
//!
//! A tool returning `Result<T, ToolError>` turns idem's errors into
//! ([`tool_result`]):
//! - a tool result with `isError: true` and a structured body `{ "code", "message",
//!   "retry_after" }` where the model can act: `idempotency_key_mismatch` (the key was
//!   used for other arguments; nothing ran), `in_flight` (the same call is running;
//!   `retry_after` in seconds), `outcome_unknown` (this attempt or an earlier one may
//!   have taken effect, a result too large to save from a tool run outside a
//!   transaction included; held for an operator), `outcome_too_large` (a transactional
//!   tool's result was too large to save, so its writes were rolled back and nothing
//!   happened; it may be called again), `fenced` (this attempt lost its claim; retry
//!   with the same key), `outcome_unrecorded` (it ran but was not recorded; retry later
//!   with the same key);
//! - an `invalid_params` JSON-RPC error for a key idem refuses (empty, or over its cap)
//!   or a scope over its cap: the tool did not run, and the request must change;
//! - a JSON-RPC error where the model cannot act: no store, the store down (the tool did
//!   not run), and idem's configuration or encoding errors.
//!
//! The JSON-RPC request id is never the key: the protocol gives every retry a new one.
//! [`ToolError::tool`] makes a tool's own domain errors look the same to the model; with
//! the default `errors = release` they leave the key free for a corrected retry.
//!
//! # The key
//!
//! [`IdempotencyKey`] is 1 to 255 visible ASCII characters, no whitespace: the same cap
//! as the HTTP `Idempotency-Key` header, so a key a client chose for one transport fits
//! the other. rmcp refuses an invalid one before the tool runs, with a tool result
//! (`isError: true`) that names the rule broken. Its schema tells the model to generate
//! one key per intended action and to send it again, with the same arguments, on every
//! retry of that action.
//!
//! # Telling a replay from a first run
//!
//! A replayed result is the recorded one, so the model would take it for a fresh
//! effect. [`mark_replays`] wraps a tool router so that a replayed result carries
//! `"_meta": { "io.idem/replayed": true }` ([`REPLAYED_META`]; MCP reserves unprefixed
//! `_meta` names for itself). A first run carries no such entry, and `structuredContent`
//! is the same for the first result and every replay:
//!
//! ```
//! use idem_runtime::mcp::mark_replays;
//! use rmcp::handler::server::router::tool::ToolRouter;
//! use rmcp::{tool, tool_handler, tool_router, ServerHandler};
//!
//! #[derive(Clone)]
//! struct Payments {
//!     tool_router: ToolRouter<Self>,
//! }
//!
//! #[tool_router]
//! impl Payments {
//!     fn new() -> Self {
//!         // Wrapped once; every call then goes through it.
//!         Payments { tool_router: mark_replays(Self::tool_router()) }
//!     }
//!     // ... the tools, as above.
//! #   #[tool(description = "The balance.", annotations(read_only_hint = true))]
//! #   async fn balance(&self) -> String { String::new() }
//! }
//!
//! #[tool_handler(router = self.tool_router)]
//! impl ServerHandler for Payments {}
//! # let _ = Payments::new();
//! ```
//!
//! # Auditing a server's tools
//!
//! A tool that changes something and takes no key runs its effect again on every retry
//! of the model. [`audit`] lists every tool of a router that is not annotated read-only
//! (`readOnlyHint`) and takes no [`IdempotencyKey`] argument (or takes it as optional).
//! Add it to every MCP server's tests:
//!
//! ```
//! # use rmcp::{handler::server::wrapper::Parameters, tool, tool_router};
//! # #[derive(serde::Deserialize, schemars::JsonSchema)]
//! # struct Account { account: String }
//! # #[derive(Clone)] struct Payments;
//! # #[tool_router]
//! # impl Payments {
//! #     #[tool(description = "A balance.", annotations(read_only_hint = true))]
//! #     async fn balance(&self, Parameters(a): Parameters<Account>) -> String { a.account }
//! # }
//! // `#[test]` in the server's tests:
//! fn every_side_effecting_tool_takes_an_idempotency_key() {
//!     let findings = idem_runtime::mcp::audit(&Payments::tool_router());
//!     assert!(findings.is_empty(), "{findings:#?}");
//! }
//! # every_side_effecting_tool_takes_an_idempotency_key();
//! ```
//!
//! A tool that is idempotent by its own nature (it sets a value rather than adding to
//! one) needs no key: leave it out of the assertion by name. [`audit_tools`] checks a
//! list of tools as a client sees it (`list_tools`), for a server you only reach over
//! the protocol.
//!
//! # The scope is the caller
//!
//! [`Principal::caller`] is, on streamable HTTP, the [`Principal`] the server's auth
//! layer (axum middleware) inserted into the request's extensions, which rmcp hands to
//! the tool inside `http::request::Parts`; an HTTP request without one is refused,
//! never run as someone. On stdio there is no request to authenticate, so the principal
//! comes from the environment, read once at startup with [`Principal::from_env`].
//!
//! # Outcomes are your types
//!
//! A tool's `Ok` value is recorded and replayed, so it must be `Serialize +
//! DeserializeOwned` as well as rmcp's `IntoCallToolResult` or `IntoContents`:
//! `rmcp::Json<T>` has no serde impls and cannot be recorded. Other extractor parameters
//! (`Extensions`, `RequestContext`, `Peer`) are marked `#[idem(skip)]`: they are not the
//! request.
//!
//! The workspace's `examples/agent_tools.rs` is a complete server on stdio and on
//! streamable HTTP, whose tools write each effect in
//! [transactional mode](crate::guide::transactions) on SQLite; its test drives it with
//! rmcp's own client over both transports, through repeats, concurrent duplicates, a
//! reused key, two principals, and a SIGKILL mid-body followed by a restart.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use rmcp::ErrorData;
use rmcp::handler::server::router::tool::{ToolRoute, ToolRouter};
use rmcp::handler::server::tool::{IntoCallToolResult, ToolCallContext};
use rmcp::model::{CallToolResponse, CallToolResult, Extensions, MetaObject, Tool};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::{IdemError, KeyPart};

/// The longest [`IdempotencyKey`], in bytes: the cap of the HTTP `Idempotency-Key`
/// header (`idem_runtime::http::MAX_KEY_LEN`), so one client key fits both transports.
/// A key longer than 250 bytes is keyed by its SHA-256, to fit idem's 255-byte cap on
/// encoded keys.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// The title of [`IdempotencyKey`]'s JSON Schema, by which [`audit`] knows a key
/// argument whatever its name.
const KEY_TITLE: &str = "IdempotencyKey";

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

/// The `_meta` entry [`mark_replays`] sets to `true` on a replayed tool result.
pub const REPLAYED_META: &str = "io.idem/replayed";

/// Wraps every tool of `router` so that a result replayed by idem (a recorded success
/// or a recorded error alike, as [`observe`](crate::observe) reports it) carries
/// `"_meta": { "io.idem/replayed": true }` ([`REPLAYED_META`]). A first run, a tool
/// without `#[idempotent]` and a protocol error are passed on as they are; the result's
/// content and `structuredContent` are never changed. With several idempotent calls in
/// one tool, the last one decides. See [the module docs](self#telling-a-replay-from-a-first-run).
pub fn mark_replays<S: Send + Sync + 'static>(mut router: ToolRouter<S>) -> ToolRouter<S> {
    for route in router.map.values_mut() {
        let call = route.call.clone();
        let marked = ToolRoute::new_dyn(
            route.attr.clone(),
            move |context: ToolCallContext<'_, S>| {
                let result = call(context);
                Box::pin(async move {
                    let (result, info) = crate::observe(result).await;
                    if info.replayed() {
                        result.map(mark_replayed)
                    } else {
                        result
                    }
                })
            },
        );
        *route = marked;
    }
    router
}

fn mark_replayed(response: CallToolResponse) -> CallToolResponse {
    match response {
        CallToolResponse::Complete(mut result) => {
            let meta = result.meta.get_or_insert_with(MetaObject::new);
            meta.insert(REPLAYED_META.to_owned(), Value::Bool(true));
            CallToolResponse::Complete(result)
        }
        other => other,
    }
}

/// What [`audit`] found wrong with one tool.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// The tool's name.
    pub tool: String,
    /// What is wrong.
    pub kind: FindingKind,
    /// What is wrong and what to do, in words.
    pub message: String,
}

/// The kinds of [`Finding`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum FindingKind {
    /// The tool is not annotated read-only and takes no [`IdempotencyKey`].
    NoKey,
    /// The tool's key argument is optional: a call without one runs unprotected.
    OptionalKey,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The tools of `router` that may have side effects yet take no idempotency key: every
/// tool not annotated `read_only_hint = true` whose input schema has no
/// [`IdempotencyKey`] argument (a property named `idempotency_key` or `idempotencyKey`,
/// or one whose schema is the key's), or has it only as an optional one. Each
/// [`Finding`] names the tool and what to do. An empty list is what a test asserts; see
/// [the module docs](self#auditing-a-servers-tools).
///
/// ```
/// use idem_runtime::mcp::{FindingKind, audit};
/// use rmcp::handler::server::wrapper::Parameters;
/// use rmcp::{tool, tool_router};
///
/// #[derive(serde::Deserialize, schemars::JsonSchema)]
/// struct Sms { to: String, text: String }
///
/// #[derive(Clone)]
/// struct Notifier;
///
/// #[tool_router]
/// impl Notifier {
///     #[tool(description = "Send a text message.")]
///     async fn send_sms(&self, Parameters(sms): Parameters<Sms>) -> String {
///         format!("sent to {}", sms.to)
///     }
/// }
///
/// let findings = audit(&Notifier::tool_router());
/// assert_eq!(findings.len(), 1);
/// assert_eq!((findings[0].tool.as_str(), findings[0].kind), ("send_sms", FindingKind::NoKey));
/// ```
pub fn audit<S: Send + Sync + 'static>(router: &ToolRouter<S>) -> Vec<Finding> {
    audit_tools(&router.list_all())
}

/// [`audit`] over tool definitions as a client lists them (`list_tools`), for a server
/// reached over the protocol.
pub fn audit_tools<'a>(tools: impl IntoIterator<Item = &'a Tool>) -> Vec<Finding> {
    let mut findings = Vec::new();
    for tool in tools {
        let read_only = tool
            .annotations
            .as_ref()
            .and_then(|a| a.read_only_hint)
            .unwrap_or(false);
        if read_only {
            continue;
        }
        let name = tool.name.to_string();
        let schema = &*tool.input_schema;
        let required = |property: &str| {
            schema
                .get("required")
                .and_then(Value::as_array)
                .is_some_and(|r| r.iter().any(|v| v.as_str() == Some(property)))
        };
        let properties = schema.get("properties").and_then(Value::as_object);
        let keys: Vec<&String> = properties
            .into_iter()
            .flatten()
            .filter(|(property, value)| {
                matches!(property.as_str(), "idempotency_key" | "idempotencyKey")
                    || is_key_schema(schema, value, 0)
            })
            .map(|(property, _)| property)
            .collect();
        if keys.is_empty() {
            findings.push(Finding {
                message: format!(
                    "tool `{name}` is not annotated read-only and takes no idempotency key, so \
                     a model's retry (after a timeout, a restart, a replanned step) runs its \
                     effect again: give its arguments an `idempotency_key: \
                     idem_runtime::mcp::IdempotencyKey` and put `#[idempotent(key = \
                     args.idempotency_key, scope = ..., retain = ...)]` above its `#[tool]`; \
                     if it changes nothing, annotate it `read_only_hint = true`"
                ),
                tool: name,
                kind: FindingKind::NoKey,
            });
        } else if let Some(optional) = keys.iter().find(|k| !required(k)) {
            findings.push(Finding {
                message: format!(
                    "tool `{name}` takes its idempotency key `{optional}` as optional, so a \
                     call without one runs unprotected: make it required (`IdempotencyKey`, \
                     not `Option<IdempotencyKey>`, and no `#[serde(default)]`)"
                ),
                tool: name,
                kind: FindingKind::OptionalKey,
            });
        }
    }
    findings
}

/// Whether `value` (a schema within `root`) is [`IdempotencyKey`]'s, directly, as a
/// branch of `anyOf`/`oneOf`/`allOf` (an `Option`), or behind a local `$ref`.
fn is_key_schema(root: &serde_json::Map<String, Value>, value: &Value, depth: u8) -> bool {
    let Some(schema) = value.as_object() else {
        return false;
    };
    if depth > 8 {
        return false;
    }
    if schema.get("title").and_then(Value::as_str) == Some(KEY_TITLE) {
        return true;
    }
    if let Some(target) = schema.get("$ref").and_then(Value::as_str) {
        let found = target.strip_prefix("#/").map(|path| {
            path.split('/')
                .try_fold(root, |at, part| at.get(part)?.as_object())
        });
        if let Some(Some(target)) = found {
            let named = target_name(value).is_some_and(|n| n == KEY_TITLE);
            return named || is_key_schema(root, &Value::Object(target.clone()), depth + 1);
        }
    }
    ["anyOf", "oneOf", "allOf"].iter().any(|branches| {
        schema
            .get(*branches)
            .and_then(Value::as_array)
            .is_some_and(|b| b.iter().any(|v| is_key_schema(root, v, depth + 1)))
    })
}

/// The last segment of a `$ref`, the name schemars gives a definition.
fn target_name(value: &Value) -> Option<&str> {
    value.get("$ref")?.as_str()?.rsplit('/').next()
}

/// The structured body of a tool result with `isError: true` made from an
/// [`IdemError`] (see [`tool_result`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolErrorBody {
    /// What happened, for the model to branch on: `idempotency_key_mismatch`,
    /// `in_flight`, `outcome_unknown`, `fenced`, `outcome_unrecorded`, and
    /// `outcome_too_large` (a transactional tool whose result was over the cap: its
    /// changes were undone and nothing happened).
    pub code: String,
    /// What happened and what to do, in words.
    pub message: String,
    /// For `in_flight`: seconds to wait before retrying with the same key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// Converts idem's error into what a tool returns: `Ok` a tool result with
/// `isError: true` and a [`ToolErrorBody`] as its structured content, for what the model
/// should see and act on; `Err` a JSON-RPC error: `invalid_params` for a key idem refuses
/// (empty or over its cap) or a scope over its cap, and an internal error for what the
/// model cannot act on (no store, store down, configuration or encoding errors), whose
/// message does not leak the driver's error.
///
/// ```
/// use idem_runtime::IdemError;
/// use idem_runtime::mcp::{ToolErrorBody, tool_result};
///
/// let result = tool_result(IdemError::Mismatch { name: "refund".into() }).unwrap();
/// assert_eq!(result.is_error, Some(true));
/// let body: ToolErrorBody = serde_json::from_value(result.structured_content.unwrap()).unwrap();
/// assert_eq!(body.code, "idempotency_key_mismatch");
/// assert!(tool_result(IdemError::NoStore).is_err());
/// let empty = tool_result(IdemError::EmptyKey { name: "refund".into() }).unwrap_err();
/// assert_eq!(empty.code, rmcp::model::ErrorCode::INVALID_PARAMS);
/// ```
pub fn tool_result(error: IdemError) -> Result<CallToolResult, ErrorData> {
    let body = |code: &str, message: String, retry_after: Option<u64>| {
        let body = ToolErrorBody {
            code: code.to_owned(),
            message,
            retry_after,
        };
        let value = serde_json::to_value(body).expect("a struct of strings serializes");
        Ok(CallToolResult::structured_error(value))
    };
    match error {
        IdemError::Mismatch { name } => body(
            "idempotency_key_mismatch",
            format!(
                "this idempotency_key was already used for `{name}` with different arguments, \
                 so nothing was done; for a new action generate a new idempotency_key, and to \
                 retry the earlier one send exactly its original arguments"
            ),
            None,
        ),
        IdemError::InFlight { name, retry_after }
        | IdemError::TooManyWaiters { name, retry_after } => {
            // Whole seconds, rounded up, and at least one: a retry sooner finds it running.
            let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            let secs = secs.max(1);
            body(
                "in_flight",
                format!(
                    "the same `{name}` call (this idempotency_key) is still running; retry with \
                     the same idempotency_key and arguments after {secs} s to get its result"
                ),
                Some(secs),
            )
        }
        IdemError::Unknown { name, .. } => body(
            "outcome_unknown",
            format!(
                "an earlier `{name}` attempt with this idempotency_key may or may not have taken \
                 effect and is held for review; do not retry it under a new key, tell the user \
                 it needs checking"
            ),
            None,
        ),
        // The tool ran outside a transaction: the operation is held in UNKNOWN, and its
        // retry is answered outcome_unknown, so this call is answered alike.
        IdemError::OutcomeTooLarge {
            name,
            len,
            max,
            in_doubt: true,
        } => body(
            "outcome_unknown",
            format!(
                "`{name}` ran but its result ({len} bytes, over the limit of {max}) is too \
                 large to be saved, so it may have taken effect and is held for review; do \
                 not retry it under a new key, tell the user it needs checking"
            ),
            None,
        ),
        // A transactional tool's writes were rolled back with its claim: nothing happened.
        IdemError::OutcomeTooLarge { name, len, max, .. } => body(
            "outcome_too_large",
            format!(
                "`{name}` did nothing: its result ({len} bytes, over the limit of {max}) is \
                 too large to be saved, so its changes were undone; it is safe to call again \
                 with the same idempotency_key, with arguments that give a smaller result"
            ),
            None,
        ),
        IdemError::Fenced { name, .. } => body(
            "fenced",
            format!(
                "this `{name}` attempt was superseded by a newer attempt with the same \
                 idempotency_key and its result was not kept; retry with the same \
                 idempotency_key and arguments to get the recorded result"
            ),
            None,
        ),
        IdemError::Unrecorded { name, .. } => body(
            "outcome_unrecorded",
            format!(
                "`{name}` ran but its result could not be saved, so it may have taken effect; \
                 retry later with the same idempotency_key and arguments, never a new one"
            ),
            None,
        ),
        IdemError::EmptyKey { name } => Err(invalid_key(
            "empty_key",
            format!(
                "the idempotency key of `{name}` is empty (or has an empty part); the tool did \
                 not run: send a non-empty key, one per intended action"
            ),
        )),
        IdemError::KeyTooLong { name, len, max } => Err(invalid_key(
            "key_too_long",
            format!(
                "the idempotency key of `{name}` encodes to {len} bytes, over the cap of {max}; \
                 the tool did not run: send a shorter key, such as a UUID"
            ),
        )),
        IdemError::ScopeTooLong { name, len, max } => Err(invalid_key(
            "scope_too_long",
            format!(
                "the caller's identity scoping `{name}` encodes to {len} bytes, over the cap of \
                 {max}; the tool did not run: call it under a shorter principal"
            ),
        )),
        IdemError::Store {
            during, retryable, ..
        } => Err(ErrorData::internal_error(
            format!(
                "the idempotency store is unavailable (during {during}); the tool did not run, \
                 retry later"
            ),
            Some(serde_json::json!({ "code": "store_unavailable", "retryable": retryable })),
        )),
        IdemError::NoStore => Err(ErrorData::internal_error(
            "the server has no idempotency store configured; the tool did not run",
            Some(serde_json::json!({ "code": "no_store", "retryable": false })),
        )),
        other => Err(ErrorData::internal_error(
            other.to_string(),
            Some(serde_json::json!({ "code": "idem_error", "retryable": other.is_retryable() })),
        )),
    }
}

/// An `invalid_params` error for a key or scope idem refuses, with a `code` for clients.
fn invalid_key(code: &str, message: String) -> ErrorData {
    ErrorData::invalid_params(
        message,
        Some(serde_json::json!({ "code": code, "retryable": false })),
    )
}

/// The error type of an idempotent tool: `Result<T, ToolError>` is what rmcp calls it
/// with (`T: Serialize + DeserializeOwned` for the record, and rmcp's
/// `IntoCallToolResult` for the reply).
///
/// `From<IdemError>` applies [`tool_result`];
/// `?` on an [`ErrorData`] gives a protocol error; [`ToolError::tool`] makes a domain
/// error the model sees. With idem's default `errors = release`, an `Err` leaves the key
/// free, so a retry runs the tool again.
#[derive(Debug)]
pub enum ToolError {
    /// A tool result with `isError: true`, shown to the model.
    Tool(CallToolResult),
    /// A JSON-RPC error, for the client rather than the model.
    Protocol(ErrorData),
}

impl ToolError {
    /// A domain error the model sees: `isError: true` with a structured body
    /// `{ "code", "message" }`.
    pub fn tool(code: &str, message: impl Into<String>) -> Self {
        let body = ToolErrorBody {
            code: code.to_owned(),
            message: message.into(),
            retry_after: None,
        };
        let value = serde_json::to_value(body).expect("a struct of strings serializes");
        ToolError::Tool(CallToolResult::structured_error(value))
    }
}

impl From<IdemError> for ToolError {
    fn from(error: IdemError) -> Self {
        match tool_result(error) {
            Ok(result) => ToolError::Tool(result),
            Err(error) => ToolError::Protocol(error),
        }
    }
}

impl From<ErrorData> for ToolError {
    fn from(error: ErrorData) -> Self {
        ToolError::Protocol(error)
    }
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ToolError::Tool(result) => match &result.structured_content {
                Some(body) => write!(f, "tool error: {body}"),
                None => f.write_str("tool error"),
            },
            ToolError::Protocol(error) => write!(f, "protocol error: {}", error.message),
        }
    }
}

impl std::error::Error for ToolError {}

impl IntoCallToolResult for ToolError {
    fn into_call_tool_result(self) -> Result<CallToolResponse, ErrorData> {
        match self {
            ToolError::Tool(mut result) => {
                result.is_error = Some(true);
                Ok(result.into())
            }
            ToolError::Protocol(error) => Err(error),
        }
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

    #[test]
    fn tool_errors_reach_rmcp_as_is_error_or_protocol() {
        let tool = ToolError::tool("declined", "card declined");
        match tool.into_call_tool_result() {
            Ok(CallToolResponse::Complete(result)) => assert_eq!(result.is_error, Some(true)),
            other => panic!("{other:?}"),
        }
        assert!(
            ToolError::from(IdemError::NoStore)
                .into_call_tool_result()
                .is_err()
        );
    }

    #[test]
    fn errors_split_between_model_and_protocol() {
        let in_flight = tool_result(IdemError::InFlight {
            name: "op".into(),
            retry_after: std::time::Duration::from_millis(1500),
        })
        .unwrap();
        let body: ToolErrorBody =
            serde_json::from_value(in_flight.structured_content.unwrap()).unwrap();
        assert_eq!(
            (body.code.as_str(), body.retry_after),
            ("in_flight", Some(2))
        );
        for e in [
            IdemError::Unknown {
                name: "op".into(),
                epoch: 1,
            },
            IdemError::Fenced {
                name: "op".into(),
                epoch: 1,
            },
            IdemError::OutcomeTooLarge {
                name: "op".into(),
                len: 9,
                max: 1,
                in_doubt: true,
            },
        ] {
            assert_eq!(tool_result(e).unwrap().is_error, Some(true));
        }
        for e in [
            IdemError::EmptyKey { name: "op".into() },
            IdemError::KeyTooLong {
                name: "op".into(),
                len: 9,
                max: 1,
            },
            IdemError::ScopeTooLong {
                name: "op".into(),
                len: 9,
                max: 1,
            },
        ] {
            let refused = tool_result(e).unwrap_err();
            assert_eq!(refused.code, rmcp::model::ErrorCode::INVALID_PARAMS);
        }
        let down = IdemError::Store {
            during: "claim",
            retryable: true,
            source: "connection refused".into(),
        };
        let protocol = tool_result(down).unwrap_err();
        assert!(!protocol.message.contains("refused"));
        assert_eq!(protocol.data.unwrap()["retryable"], true);
    }
}
