//! An MCP server whose side-effecting tools run once per intent, however often an
//! agent repeats the call.
//!
//! Run it:
//!   cargo run -p idem-tests --example agent_tools                          # stdio
//!   cargo run -p idem-tests --example agent_tools -- --http 127.0.0.1:8080 # HTTP at /mcp
//! Point an MCP client at it:
//!   stdio: command `cargo`, arguments `run --quiet -p idem-tests --example agent_tools`
//!          (or the built `target/debug/examples/agent_tools`), environment
//!          `IDEM_PRINCIPAL=ana`;
//!   HTTP:  URL `http://127.0.0.1:8080/mcp`, header `Authorization: Bearer ana` (the toy
//!          auth layer takes the token as the caller's name; no header is a 401).
//! Environment: `IDEM_EXAMPLE_DB` (default `./agent_tools.db`), `IDEM_PRINCIPAL` (the
//! caller on stdio, default `local`). Every effect is one row of the `outbox` table in
//! that same file: `sqlite3 agent_tools.db 'SELECT * FROM outbox'`.
//!
//! `send_email` and `refund` take an `idempotency_key` the model generates once per
//! intent and repeats on retry. Their handlers carry `#[idempotent]` above `#[tool]`,
//! keyed on it and scoped to the caller. They run in transactional mode: the claim, the
//! outbox row and the recorded result commit together in one SQLite transaction, so a
//! crash mid-way leaves nothing behind and the retry runs once. `get_balance` is
//! read-only and takes no key.
//!
//! A tool's arguments come from a model, which may have read them anywhere (a web
//! page, an email): every account is owned by one principal (the `accounts` table,
//! seeded with [`DEMO_ACCOUNTS`]), tools act only on the caller's own accounts and
//! match them exactly, and an internal error reaches the client as a reference to the
//! log line that holds its detail, never as the database's own text.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_runtime::mcp::{IdempotencyKey, Principal, ToolError};
use idem_runtime::{BoxError, Idem, idempotent};
use rmcp::handler::server::common::FromContextPart;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::{IntoCallToolResult, ToolCallContext};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, Extensions};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::{
    StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt, tool, tool_handler, tool_router};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqliteConnection, SqlitePool, Transaction};

/// The tools whose handler runs in the transaction `call_tool` begins and commits.
const TRANSACTIONAL_TOOLS: [&str; 2] = ["send_email", "refund"];

/// The demo's accounts and their owners, created on open; a real service has its own.
const DEMO_ACCOUNTS: [(&str, &str); 4] = [
    ("acct-1", "ana"),
    ("acct-a", "ana"),
    ("acct-b", "bob"),
    ("acct-local", "local"),
];

#[derive(Debug, Serialize, Deserialize, JsonSchema)]
struct SendEmail {
    /// The recipient's address.
    to: String,
    /// The subject line.
    subject: String,
    /// The plain-text body.
    body: String,
    idempotency_key: IdempotencyKey,
}

#[derive(Debug, Serialize, Deserialize, JsonSchema)]
struct Refund {
    /// The charge to refund, as `<account>/<charge>`; the refund is credited to the account.
    charge_id: String,
    /// The amount to refund, in cents.
    amount_cents: u64,
    idempotency_key: IdempotencyKey,
}

#[derive(Debug, Deserialize, JsonSchema)]
struct GetBalance {
    /// The account whose refunded total to read: one of yours, by its exact id.
    account: String,
}

/// What `send_email` records and every retry of it gets back.
#[derive(Debug, Serialize, Deserialize)]
struct Sent {
    /// The outbox row: one per email actually sent.
    message_id: i64,
    to: String,
}

/// What `refund` records and every retry of it gets back.
#[derive(Debug, Serialize, Deserialize)]
struct Refunded {
    /// The outbox row: one per refund actually made.
    refund_id: i64,
    charge_id: String,
    amount_cents: u64,
}

#[derive(Debug, Serialize)]
struct Balance {
    account: String,
    refunded_cents: i64,
}

/// Replies as structured content (the recorded types, not `rmcp::Json`, which has no
/// serde impls and so cannot be recorded).
fn structured<T: Serialize>(value: &T) -> Result<CallToolResponse, ErrorData> {
    let value = serde_json::to_value(value).map_err(internal)?;
    Ok(CallToolResult::structured(value).into())
}

impl IntoCallToolResult for Sent {
    fn into_call_tool_result(self) -> Result<CallToolResponse, ErrorData> {
        structured(&self)
    }
}

impl IntoCallToolResult for Refunded {
    fn into_call_tool_result(self) -> Result<CallToolResponse, ErrorData> {
        structured(&self)
    }
}

impl IntoCallToolResult for Balance {
    fn into_call_tool_result(self) -> Result<CallToolResponse, ErrorData> {
        structured(&self)
    }
}

/// An internal error as the client sees it: a reference to the log line with the
/// detail. The detail (database text, table names, paths) is the operator's, not the
/// client's, and a model would repeat it to whoever prompted it.
fn internal(e: impl std::fmt::Display) -> ErrorData {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    // A randomly keyed hash of a counter: unique in practice, and unguessable.
    let random = std::collections::hash_map::RandomState::new();
    let reference = format!(
        "{:016x}",
        random.hash_one(COUNT.fetch_add(1, Ordering::Relaxed))
    );
    // stderr: on stdio, stdout is the protocol.
    eprintln!("agent_tools: internal error, reference {reference}: {e}");
    ErrorData::internal_error(format!("internal error, reference {reference}"), None)
}

/// The tool error for an account that is not the caller's, whether it is another's or
/// no one's: the answer does not tell which.
fn unknown_account(account: &str) -> ToolError {
    ToolError::tool(
        "unknown_account",
        format!("you have no account `{account}`; name one of your own accounts by its exact id"),
    )
}

/// Whether `principal` owns `account`, by exact match.
async fn owns(
    conn: &mut SqliteConnection,
    principal: &Principal,
    account: &str,
) -> Result<bool, ErrorData> {
    let owned: Option<i64> =
        sqlx::query_scalar("SELECT 1 FROM accounts WHERE id = ?1 AND principal = ?2")
            .bind(account)
            .bind(principal.as_str())
            .fetch_optional(conn)
            .await
            .map_err(internal)?;
    Ok(owned.is_some())
}

/// The transaction of one tool call, shared between `call_tool` (which begins and
/// commits it) and the tool's `OutboxTx` parameter (which runs in it). rmcp extracts
/// parameters synchronously and by value, so the transaction travels in the request's
/// extensions.
#[derive(Clone)]
struct TxSlot(Arc<Mutex<Option<Transaction<'static, Sqlite>>>>);

impl TxSlot {
    fn take(&self) -> Option<Transaction<'static, Sqlite>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// A tool's view of its call's transaction, for `#[idempotent(tx = tx)]`: idem claims
/// and records in it, and the body (where `tx` is the `&mut Transaction`) writes its
/// outbox row through it. Dropped when the
/// tool returns, it hands the transaction back for `call_tool` to commit.
struct OutboxTx {
    tx: Option<Transaction<'static, Sqlite>>,
    slot: TxSlot,
}

impl Deref for OutboxTx {
    type Target = Transaction<'static, Sqlite>;
    fn deref(&self) -> &Self::Target {
        self.tx.as_ref().expect("present until dropped")
    }
}

impl DerefMut for OutboxTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.tx.as_mut().expect("present until dropped")
    }
}

impl Drop for OutboxTx {
    fn drop(&mut self) {
        *self.slot.0.lock().unwrap_or_else(|e| e.into_inner()) = self.tx.take();
    }
}

impl<S> FromContextPart<ToolCallContext<'_, S>> for OutboxTx {
    fn from_context_part(context: &mut ToolCallContext<'_, S>) -> Result<Self, ErrorData> {
        let slot = context.request_context.extensions.get::<TxSlot>().cloned();
        let slot = slot.ok_or_else(|| internal("tool called without its transaction"))?;
        let tx = slot.take();
        let tx = tx.ok_or_else(|| internal("the call's transaction is already taken"))?;
        Ok(OutboxTx { tx: Some(tx), slot })
    }
}

#[derive(Clone)]
struct AgentTools {
    idem: Idem,
    pool: SqlitePool,
    /// The caller on stdio; on HTTP the auth layer names it per request.
    stdio_principal: Principal,
    /// Test hook: `send_email` creates this file mid-body, then waits forever.
    pause_file: Option<PathBuf>,
    tool_router: ToolRouter<Self>,
}

/// One outbox row: the effect, visible to anyone reading the database.
async fn outbox(
    conn: &mut SqliteConnection,
    tool: &str,
    principal: &Principal,
    key: &IdempotencyKey,
    args: &impl Serialize,
) -> Result<i64, ErrorData> {
    let args = serde_json::to_string(args).map_err(internal)?;
    sqlx::query_scalar(
        "INSERT INTO outbox (tool, principal, idempotency_key, args) VALUES (?1, ?2, ?3, ?4) \
         RETURNING id",
    )
    .bind(tool)
    .bind(principal.as_str())
    .bind(key.as_str())
    .bind(args)
    .fetch_one(conn)
    .await
    .map_err(internal)
}

#[tool_router]
impl AgentTools {
    fn new(idem: Idem, pool: SqlitePool, stdio_principal: Principal) -> Self {
        AgentTools {
            idem,
            pool,
            stdio_principal,
            pause_file: std::env::var_os("IDEM_EXAMPLE_PAUSE_FILE").map(PathBuf::from),
            // Replays carry `_meta: {"io.idem/replayed": true}`, so the model can tell them.
            tool_router: idem_runtime::mcp::mark_replays(Self::tool_router()),
        }
    }

    #[idempotent(
        store = self.idem,
        tx = tx,
        key = args.idempotency_key,
        scope = Principal::caller(&ext, &self.stdio_principal)?,
        retain = "30d"
    )]
    #[tool(
        description = "Send an email. Give a new idempotency_key per email you mean to send \
                       and repeat it, with the same arguments, when retrying.",
        annotations(destructive_hint = true, idempotent_hint = true)
    )]
    async fn send_email(
        &self,
        Parameters(args): Parameters<SendEmail>,
        mut tx: OutboxTx,
        #[idem(skip)] ext: Extensions,
    ) -> Result<Sent, ToolError> {
        let principal = Principal::caller(&ext, &self.stdio_principal)?;
        let message_id = outbox(tx, "send_email", &principal, &args.idempotency_key, &args).await?;
        if let Some(pause) = &self.pause_file {
            // The row is written but not committed: a crash here must leave nothing.
            std::fs::write(pause, b"paused").map_err(internal)?;
            std::future::pending::<()>().await;
        }
        Ok(Sent {
            message_id,
            to: args.to,
        })
    }

    #[idempotent(
        store = self.idem,
        tx = tx,
        key = args.idempotency_key,
        scope = Principal::caller(&ext, &self.stdio_principal)?,
        retain = "30d"
    )]
    #[tool(
        description = "Refund part or all of a charge. Give a new idempotency_key per refund \
                       you mean to make and repeat it, with the same arguments, when retrying.",
        annotations(destructive_hint = true, idempotent_hint = true)
    )]
    async fn refund(
        &self,
        Parameters(args): Parameters<Refund>,
        mut tx: OutboxTx,
        #[idem(skip)] ext: Extensions,
    ) -> Result<Refunded, ToolError> {
        let account = args.charge_id.split_once('/').map(|(account, _)| account);
        let Some(account) = account.filter(|_| args.amount_cents > 0) else {
            // Released, not recorded: a corrected retry under the same key may run.
            return Err(ToolError::tool(
                "invalid_refund",
                "amount_cents must be positive and charge_id of the form <account>/<charge>",
            ));
        };
        let principal = Principal::caller(&ext, &self.stdio_principal)?;
        // The arguments name the account; only the caller's own may be credited.
        if !owns(tx, &principal, account).await? {
            return Err(unknown_account(account));
        }
        let refund_id = outbox(tx, "refund", &principal, &args.idempotency_key, &args).await?;
        Ok(Refunded {
            refund_id,
            charge_id: args.charge_id,
            amount_cents: args.amount_cents,
        })
    }

    #[tool(
        description = "The total refunded to one of your accounts, in cents.",
        annotations(read_only_hint = true)
    )]
    async fn get_balance(
        &self,
        Parameters(args): Parameters<GetBalance>,
        ext: Extensions,
    ) -> Result<Balance, ToolError> {
        let principal = Principal::caller(&ext, &self.stdio_principal)?;
        let mut conn = self.pool.acquire().await.map_err(internal)?;
        if !owns(&mut conn, &principal, &args.account).await? {
            return Err(unknown_account(&args.account));
        }
        // Compared exactly, never with LIKE: an account id is data, not a pattern.
        let refunded_cents: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(json_extract(args, '$.amount_cents')), 0) FROM outbox \
             WHERE tool = 'refund' AND principal = ?2 \
             AND substr(json_extract(args, '$.charge_id'), 1, length(?1) + 1) = ?1 || '/'",
        )
        .bind(&args.account)
        .bind(principal.as_str())
        .fetch_one(&mut *conn)
        .await
        .map_err(internal)?;
        Ok(Balance {
            account: args.account,
            refunded_cents,
        })
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for AgentTools {
    /// Side-effecting tools run in one transaction begun here and committed after the
    /// tool returned (with its result recorded in it, or released to a savepoint).
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        mut context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let slot = if TRANSACTIONAL_TOOLS.contains(&request.name.as_ref()) {
            // SQLite has no row locks: a duplicate waits on the write lock, then replays.
            let tx = self
                .pool
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(internal)?;
            let slot = TxSlot(Arc::new(Mutex::new(Some(tx))));
            context.extensions.insert(slot.clone());
            Some(slot)
        } else {
            None
        };
        let response = self
            .tool_router
            .call(ToolCallContext::new(self, request, context))
            .await;
        match (slot.and_then(|slot| slot.take()), &response) {
            (Some(tx), Ok(_)) => tx.commit().await.map_err(internal)?,
            // A protocol error (bad arguments, store down): nothing of it is kept.
            (Some(tx), Err(_)) => tx.rollback().await.map_err(internal)?,
            (None, _) => {}
        }
        response
    }
}

/// The toy authentication layer: `Authorization: Bearer <name>` makes `<name>` the
/// caller. A real server verifies a token here and inserts the principal it names.
async fn auth(mut request: Request, next: Next) -> Response {
    let name = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .filter(|name| !name.is_empty())
        .map(str::to_owned);
    match name {
        Some(name) => {
            request.extensions_mut().insert(Principal::new(name));
            next.run(request).await
        }
        None => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "missing `Authorization: Bearer <name>`",
        )
            .into_response(),
    }
}

async fn open(path: &str) -> Result<(SqlitePool, Idem), BoxError> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(std::time::Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS outbox (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            tool TEXT NOT NULL,
            principal TEXT NOT NULL,
            idempotency_key TEXT NOT NULL,
            args TEXT NOT NULL,
            created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP
        )",
    )
    .execute(&pool)
    .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (
            id TEXT PRIMARY KEY,
            principal TEXT NOT NULL
        )",
    )
    .execute(&pool)
    .await?;
    for (account, principal) in DEMO_ACCOUNTS {
        sqlx::query("INSERT OR IGNORE INTO accounts (id, principal) VALUES (?1, ?2)")
            .bind(account)
            .bind(principal)
            .execute(&pool)
            .await?;
    }
    // idem's table in the same database, so transactional mode can claim beside the outbox.
    let idem = Idem::from_pool(pool.clone()).await?;
    Ok((pool, idem))
}

#[tokio::main]
pub async fn main() -> Result<(), BoxError> {
    let db = std::env::var("IDEM_EXAMPLE_DB").unwrap_or_else(|_| "agent_tools.db".into());
    let (pool, idem) = open(&db).await?;
    let stdio_principal = Principal::from_env("IDEM_PRINCIPAL", "local");
    let server = AgentTools::new(idem, pool, stdio_principal);

    let mut args = std::env::args().skip(1);
    match (args.next().as_deref(), args.next()) {
        (None, _) => {
            // stdout is the protocol: nothing else may be printed there.
            server
                .serve(rmcp::transport::stdio())
                .await?
                .waiting()
                .await?;
        }
        (Some("--http"), Some(addr)) => {
            let service = StreamableHttpService::new(
                move || Ok(server.clone()),
                LocalSessionManager::default().into(),
                StreamableHttpServerConfig::default(),
            );
            let app = axum::Router::new()
                .nest_service("/mcp", service)
                .layer(axum::middleware::from_fn(auth));
            let listener = tokio::net::TcpListener::bind(&addr).await?;
            // The bound address (the port may have been 0), for people and for tests.
            println!("listening on http://{}/mcp", listener.local_addr()?);
            axum::serve(listener, app).await?;
        }
        _ => return Err("usage: agent_tools [--http 127.0.0.1:PORT]".into()),
    }
    Ok(())
}
