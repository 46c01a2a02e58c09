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
//! its schema, the conversions of [`IdemError`](crate::IdemError) into what a tool returns (the orphan
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
//!   `retry_after` in seconds), `rate_limited` (the caller started too many new actions
//!   for now, [`IdemBuilder::limit_new_claims`](crate::IdemBuilder::limit_new_claims);
//!   nothing ran; `retry_after` in seconds), `outcome_unknown` (this attempt or an earlier one may
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

// One file a concern: the key type and its schema, the caller, the replay marker, the
// schema audit, and idem's errors as tool results.
mod error;
mod key;
mod principal;
mod replay;
mod schema_audit;

pub use error::{ToolError, ToolErrorBody, tool_result};
pub use key::{IdempotencyKey, InvalidIdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN};
pub use principal::Principal;
pub use replay::{REPLAYED_META, mark_replays};
pub use schema_audit::{Finding, FindingKind, audit, audit_tools};
