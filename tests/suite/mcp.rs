//! Idempotent MCP tools end to end: the `agent_tools` example runs as a child process
//! and rmcp's own client drives it, over stdio and over streamable HTTP on 127.0.0.1.
//! Effects are counted from outside, in the example's `outbox` table.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use rmcp::model::{CallToolRequestParams, CallToolResult, Tool};
use rmcp::service::{Peer, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{ConfigureCommandExt, StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// The example, built by cargo for this test (see tests/bin/agent_tools.rs).
const EXE: &str = env!("CARGO_BIN_EXE_idem-agent-tools");

type Client = RunningService<RoleClient, ()>;

struct Db {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn db() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent_tools.db");
    Db { _dir: dir, path }
}

/// One row of the outbox.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    id: i64,
    tool: String,
    principal: String,
    key: String,
    args: Value,
}

async fn outbox(db: &Path) -> Vec<Row> {
    let url = format!("sqlite://{}?mode=ro", db.display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let rows: Vec<(i64, String, String, String, String)> =
        sqlx::query_as("SELECT id, tool, principal, idempotency_key, args FROM outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    pool.close().await;
    rows.into_iter()
        .map(|(id, tool, principal, key, args)| Row {
            id,
            tool,
            principal,
            key,
            args: serde_json::from_str(&args).unwrap(),
        })
        .collect()
}

async fn stdio_client(db: &Path, principal: &str) -> Client {
    let command = Command::new(EXE).configure(|cmd| {
        cmd.env("IDEM_EXAMPLE_DB", db)
            .env("IDEM_PRINCIPAL", principal)
            .env_remove("IDEM_EXAMPLE_PAUSE_FILE");
    });
    let transport = TokioChildProcess::new(command).unwrap();
    ().serve(transport).await.unwrap()
}

/// The example serving streamable HTTP on a free port of 127.0.0.1.
struct HttpServer {
    child: Child,
    url: String,
}

async fn http_server(db: &Path, pause_file: Option<&Path>) -> HttpServer {
    let mut cmd = Command::new(EXE);
    cmd.args(["--http", "127.0.0.1:0"])
        .env("IDEM_EXAMPLE_DB", db)
        .env_remove("IDEM_EXAMPLE_PAUSE_FILE")
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    if let Some(pause) = pause_file {
        cmd.env("IDEM_EXAMPLE_PAUSE_FILE", pause);
    }
    let mut child = cmd.spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).await.unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    HttpServer { child, url }
}

async fn http_client(server: &HttpServer, principal: &str) -> Client {
    let config =
        StreamableHttpClientTransportConfig::with_uri(server.url.as_str()).auth_header(principal);
    let transport = StreamableHttpClientTransport::from_config(config);
    ().serve(transport).await.unwrap()
}

async fn call(peer: &Peer<RoleClient>, tool: &str, args: Value) -> CallToolResult {
    let Value::Object(args) = args else {
        panic!("arguments must be an object")
    };
    peer.call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(args))
        .await
        .unwrap()
}

/// A successful result's structured content.
fn ok(result: &CallToolResult) -> Value {
    assert_ne!(result.is_error, Some(true), "tool error: {result:?}");
    result.structured_content.clone().unwrap()
}

fn email(key: &str, to: &str, subject: &str) -> Value {
    json!({ "to": to, "subject": subject, "body": "Hello", "idempotency_key": key })
}

fn refund(key: &str, charge: &str, cents: u64) -> Value {
    json!({ "charge_id": charge, "amount_cents": cents, "idempotency_key": key })
}

/// Input schemas and annotations as a model sees them.
async fn check_tools(peer: &Peer<RoleClient>) {
    let tools: BTreeMap<String, Tool> = peer
        .list_all_tools()
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.name.to_string(), t))
        .collect();
    assert_eq!(
        tools.keys().collect::<Vec<_>>(),
        ["get_balance", "refund", "send_email"]
    );
    for name in ["send_email", "refund"] {
        let tool = &tools[name];
        let schema = Value::Object((*tool.input_schema).clone());
        let key = &schema["properties"]["idempotency_key"];
        assert_eq!(key["type"], "string", "{name}: {schema}");
        let description = key["description"].as_str().unwrap_or_default();
        assert!(
            description.contains("once per intended action") && description.contains("retry"),
            "{name}: {description:?}"
        );
        let required: Vec<&str> = schema["required"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(required.contains(&"idempotency_key"), "{name}: {schema}");
        let hints = tool.annotations.as_ref().unwrap();
        assert_eq!(hints.destructive_hint, Some(true), "{name}");
        assert_eq!(hints.idempotent_hint, Some(true), "{name}");
        assert_ne!(hints.read_only_hint, Some(true), "{name}");
    }
    let balance = &tools["get_balance"];
    let schema = Value::Object((*balance.input_schema).clone());
    assert!(schema["properties"]["account"].is_object(), "{schema}");
    assert!(schema["properties"].get("idempotency_key").is_none());
    assert_eq!(
        balance.annotations.as_ref().unwrap().read_only_hint,
        Some(true)
    );
}

/// A conversation with repeats, 20 concurrent duplicates, interleaved and reordered
/// intents and a key reused for another request. Returns each intent's key with the
/// first result it got; every later call of the intent is checked against it.
async fn transcript(peer: &Peer<RoleClient>) -> BTreeMap<String, Value> {
    let mut first: BTreeMap<String, Value> = BTreeMap::new();
    let mut expect = |key: &str, result: &CallToolResult| {
        let value = ok(result);
        let recorded = first.entry(key.to_owned()).or_insert_with(|| value.clone());
        assert_eq!(&value, recorded, "a repeat of {key} got another result");
    };

    // The same intent three times: new request ids, one effect.
    for _ in 0..3 {
        let result = call(peer, "send_email", email("e-1", "ana@example.com", "Hi")).await;
        expect("e-1", &result);
    }

    // 20 concurrent identical calls.
    let calls = (0..20).map(|_| {
        let peer = peer.clone();
        tokio::spawn(async move { call(&peer, "refund", refund("r-1", "acct-1/ch-1", 500)).await })
    });
    for handle in calls.collect::<Vec<_>>() {
        expect("r-1", &handle.await.unwrap());
    }

    // Several intents, interleaved, then again in another order and concurrently.
    let a = || call(peer, "send_email", email("a", "bo@example.com", "Invoice"));
    let b = || call(peer, "refund", refund("b", "acct-1/ch-2", 250));
    let c = || call(peer, "send_email", email("c", "cy@example.com", "Receipt"));
    expect("a", &a().await);
    expect("b", &b().await);
    expect("c", &c().await);
    expect("c", &c().await);
    expect("a", &a().await);
    expect("b", &b().await);
    let (c2, b2, a2, c3) = tokio::join!(c(), b(), a(), c());
    for (key, result) in [("c", c2), ("b", b2), ("a", a2), ("c", c3)] {
        expect(key, &result);
    }
    expect(
        "e-1",
        &call(peer, "send_email", email("e-1", "ana@example.com", "Hi")).await,
    );

    // A key reused with other arguments: refused, in words the model can act on.
    let reused = call(peer, "send_email", email("a", "bo@example.com", "Other")).await;
    assert_eq!(reused.is_error, Some(true), "{reused:?}");
    let body = reused.structured_content.clone().unwrap();
    assert_eq!(body["code"], "idempotency_key_mismatch", "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("different arguments")
    );
    // A key that is not one (whitespace) never reaches the tool: invalid params.
    let Value::Object(bad) = email("has space", "bo@example.com", "Invoice") else {
        unreachable!()
    };
    let refused = peer
        .call_tool(CallToolRequestParams::new("send_email").with_arguments(bad))
        .await;
    assert!(
        format!("{refused:?}").contains("idempotency key"),
        "{refused:?}"
    );
    // ...and the intent itself still replays.
    expect("a", &a().await);

    // The read-only tool sees the two refunds once each.
    let balance = ok(&call(peer, "get_balance", json!({ "account": "acct-1" })).await);
    assert_eq!(balance["refunded_cents"], 750, "{balance}");
    first
}

/// The outbox holds exactly one row per intent, the first call's, for `principal`;
/// every result names its own row.
fn check_outbox(rows: &[Row], principal: &str, first: &BTreeMap<String, Value>) {
    let mine: Vec<&Row> = rows.iter().filter(|r| r.principal == principal).collect();
    let keys: Vec<&str> = mine.iter().map(|r| r.key.as_str()).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(sorted, ["a", "b", "c", "e-1", "r-1"], "{mine:#?}");
    for row in mine {
        let result = &first[&row.key];
        let id = result
            .get("message_id")
            .or_else(|| result.get("refund_id"))
            .unwrap();
        assert_eq!(id, row.id, "{row:?} vs {result}");
        if row.key == "a" {
            assert_eq!(
                row.args["subject"], "Invoice",
                "the reused key sent nothing"
            );
        }
        assert_eq!(
            row.tool,
            if row.key.starts_with('r') || row.key == "b" {
                "refund"
            } else {
                "send_email"
            }
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stdio_tools_run_once_per_intent() {
    let db = db();
    let client = stdio_client(&db.path, "ana").await;
    check_tools(&client).await;
    let first = transcript(&client).await;
    client.cancel().await.unwrap();
    check_outbox(&outbox(&db.path).await, "ana", &first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_tools_run_once_per_intent() {
    let db = db();
    let server = http_server(&db.path, None).await;
    let client = http_client(&server, "ana").await;
    check_tools(&client).await;
    let first = transcript(&client).await;
    // A second session of the same principal (a restarted agent) gets the same results.
    let again = http_client(&server, "ana").await;
    let a = call(
        &again,
        "send_email",
        email("a", "bo@example.com", "Invoice"),
    )
    .await;
    assert_eq!(ok(&a), first["a"]);
    client.cancel().await.unwrap();
    again.cancel().await.unwrap();
    check_outbox(&outbox(&db.path).await, "ana", &first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_principals_with_one_key_are_independent() {
    let db = db();
    let server = http_server(&db.path, None).await;
    let ana = http_client(&server, "ana").await;
    let bob = http_client(&server, "bob").await;
    // Same key, same arguments: two operations, two effects.
    let ana_first = ok(&call(&ana, "send_email", email("shared", "x@example.com", "Hi")).await);
    let bob_first = ok(&call(&bob, "send_email", email("shared", "x@example.com", "Hi")).await);
    assert_ne!(ana_first, bob_first);
    // Same key, other arguments: not a mismatch across principals.
    let ana_refund = ok(&call(&ana, "refund", refund("k", "acct-a/ch", 100)).await);
    let bob_refund = ok(&call(&bob, "refund", refund("k", "acct-b/ch", 900)).await);
    assert_eq!(ana_refund["charge_id"], "acct-a/ch");
    assert_eq!(bob_refund["charge_id"], "acct-b/ch");
    // Each replays its own, never the other's.
    let (a, b) = tokio::join!(
        call(&ana, "send_email", email("shared", "x@example.com", "Hi")),
        call(&bob, "send_email", email("shared", "x@example.com", "Hi")),
    );
    assert_eq!(ok(&a), ana_first);
    assert_eq!(ok(&b), bob_first);
    assert_eq!(
        ok(&call(&bob, "refund", refund("k", "acct-b/ch", 900)).await),
        bob_refund
    );
    ana.cancel().await.unwrap();
    bob.cancel().await.unwrap();
    let rows = outbox(&db.path).await;
    let by: Vec<(&str, &str, &str)> = rows
        .iter()
        .map(|r| (r.principal.as_str(), r.tool.as_str(), r.key.as_str()))
        .collect();
    assert_eq!(
        by,
        [
            ("ana", "send_email", "shared"),
            ("bob", "send_email", "shared"),
            ("ana", "refund", "k"),
            ("bob", "refund", "k"),
        ]
    );
}

/// A tool error's structured body.
fn tool_error(result: &CallToolResult) -> Value {
    assert_eq!(result.is_error, Some(true), "not a tool error: {result:?}");
    result.structured_content.clone().unwrap()
}

/// Accounts are owned and matched exactly: `%` is no account (not a `LIKE` pattern
/// that would read every account), another principal's account is refused for
/// reading and for refunds alike, in the same words as an account that does not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tools_act_only_on_the_callers_own_accounts_exactly() {
    let db = db();
    let server = http_server(&db.path, None).await;
    let ana = http_client(&server, "ana").await;
    let bob = http_client(&server, "bob").await;
    ok(&call(&ana, "refund", refund("r-a", "acct-1/ch-1", 500)).await);
    ok(&call(&bob, "refund", refund("r-b", "acct-b/ch-1", 900)).await);
    let balance = |peer: &Client, account: &str| {
        let peer = peer.peer().clone();
        let args = json!({ "account": account });
        async move { call(&peer, "get_balance", args).await }
    };
    assert_eq!(ok(&balance(&ana, "acct-1").await)["refunded_cents"], 500);
    for account in [
        "%",
        "acct-%",
        "acct-_",
        "acct",
        "acct-b",
        "acct-1/ch-1",
        "nobody",
    ] {
        let refused = tool_error(&balance(&ana, account).await);
        assert_eq!(refused["code"], "unknown_account", "{account}: {refused}");
        let message = refused["message"].as_str().unwrap();
        assert!(
            message.contains("your own accounts"),
            "{account}: {message}"
        );
        assert!(
            !message.contains("900") && !message.contains("bob"),
            "{message}"
        );
    }
    // Refunds: another's account is refused and nothing is written.
    let refused = tool_error(&call(&ana, "refund", refund("r-x", "acct-b/ch-1", 100)).await);
    assert_eq!(refused["code"], "unknown_account", "{refused}");
    let refused = tool_error(&call(&ana, "refund", refund("r-y", "%/ch-1", 100)).await);
    assert_eq!(refused["code"], "unknown_account", "{refused}");
    assert_eq!(ok(&balance(&bob, "acct-b").await)["refunded_cents"], 900);
    ana.cancel().await.unwrap();
    bob.cancel().await.unwrap();
    let keys: Vec<(String, String)> = outbox(&db.path)
        .await
        .into_iter()
        .map(|r| (r.principal, r.key))
        .collect();
    assert_eq!(
        keys,
        [("ana".into(), "r-a".into()), ("bob".into(), "r-b".into())]
    );
}

/// An internal error reaches the client as a reference, never as the database's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn internal_errors_are_opaque_references() {
    let db = db();
    let server = http_server(&db.path, None).await;
    let ana = http_client(&server, "ana").await;
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.path.display()))
        .await
        .unwrap();
    sqlx::query("DROP TABLE outbox")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let Value::Object(args) = json!({ "account": "acct-1" }) else {
        unreachable!()
    };
    let answer = ana
        .call_tool(CallToolRequestParams::new("get_balance").with_arguments(args))
        .await;
    let Err(rmcp::ServiceError::McpError(error)) = answer else {
        panic!("expected a protocol error, got {answer:?}")
    };
    assert!(
        error.message.starts_with("internal error, reference "),
        "{error:?}"
    );
    assert!(
        !error.message.contains("outbox") && !error.message.contains("table"),
        "{error:?}"
    );
    ana.cancel().await.unwrap();
}

#[tokio::test]
async fn http_without_bearer_is_refused() {
    let db = db();
    let server = http_server(&db.path, None).await;
    let addr = server
        .url
        .strip_prefix("http://")
        .and_then(|rest| rest.strip_suffix("/mcp"))
        .unwrap();
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#;
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 401"), "{response}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_mid_body_then_retried_sends_once() {
    let db = db();
    let pause = db.path.with_file_name("paused");
    let mut server = http_server(&db.path, Some(&pause)).await;
    let client = http_client(&server, "ana").await;
    let args = email("crash-1", "ana@example.com", "Once");
    let pending = {
        let peer = client.peer().clone();
        let args = args.clone();
        tokio::spawn(async move {
            let Value::Object(args) = args else {
                unreachable!()
            };
            peer.call_tool(CallToolRequestParams::new("send_email").with_arguments(args))
                .await
        })
    };
    // The body has written its outbox row (uncommitted) and stopped: kill the server.
    while !pause.exists() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    server.child.kill().await.unwrap(); // SIGKILL
    pending.abort();
    drop(client);
    assert_eq!(
        outbox(&db.path).await,
        [],
        "nothing of the killed call survives"
    );

    // Restarted on the same database, the agent's retry runs once and then replays.
    let server = http_server(&db.path, None).await;
    let client = http_client(&server, "ana").await;
    let first = ok(&call(&client, "send_email", args.clone()).await);
    let again = ok(&call(&client, "send_email", args).await);
    assert_eq!(first, again);
    client.cancel().await.unwrap();
    let rows = outbox(&db.path).await;
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0].key, "crash-1");
    assert_eq!(first["message_id"], rows[0].id);
}

/// An in-process server, driven by rmcp's client over a duplex pipe, for what the
/// example does not reach: a tool whose result is over the store's outcome cap, and
/// keys and scopes idem refuses.
mod exports {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use idem_runtime::mcp::{Principal, ToolError};
    use idem_runtime::{Idem, idempotent};
    use rmcp::handler::server::router::tool::ToolRouter;
    use rmcp::handler::server::wrapper::Parameters;
    use rmcp::model::Extensions;
    use rmcp::{ServerHandler, ServiceExt, tool, tool_handler, tool_router};
    use schemars::JsonSchema;
    use serde::{Deserialize, Serialize};

    use super::Client;

    /// The store's outcome cap on this server, in bytes.
    pub const CAP: usize = 1024;

    #[derive(Debug, Serialize, Deserialize, JsonSchema)]
    pub struct Export {
        /// The order whose export this is: the key, as a tool keyed on a business id has it.
        order_id: String,
        /// How large a report to produce.
        bytes: usize,
    }

    #[derive(Clone)]
    pub struct Exports {
        idem: Idem,
        principal: Principal,
        pub runs: Arc<AtomicUsize>,
        tool_router: ToolRouter<Self>,
    }

    #[tool_router]
    impl Exports {
        #[idempotent(
            store = self.idem,
            key = args.order_id,
            scope = Principal::caller(&ext, &self.principal)?,
            retain = "1h"
        )]
        #[tool(description = "Export an order's report.")]
        async fn export(
            &self,
            Parameters(args): Parameters<Export>,
            #[idem(skip)] ext: Extensions,
        ) -> Result<String, ToolError> {
            self.runs.fetch_add(1, Ordering::SeqCst);
            Ok("r".repeat(args.bytes))
        }
    }

    #[tool_handler(router = self.tool_router)]
    impl ServerHandler for Exports {}

    /// Serves a fresh store, as `principal`, to a client of its own.
    pub async fn serve(principal: &str) -> (Client, Arc<AtomicUsize>) {
        serve_with(principal, |b| b).await
    }

    /// [`serve`], with the store's builder as `f` makes it.
    pub async fn serve_with(
        principal: &str,
        f: impl FnOnce(idem_runtime::IdemBuilder) -> idem_runtime::IdemBuilder,
    ) -> (Client, Arc<AtomicUsize>) {
        let idem = f(Idem::builder().max_outcome_bytes(CAP))
            .sqlite("sqlite::memory:")
            .await
            .unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let server = Exports {
            idem,
            principal: Principal::new(principal),
            runs: runs.clone(),
            tool_router: Exports::tool_router(),
        };
        let (server_io, client_io) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let running = server.serve(server_io).await.unwrap();
            let _ = running.waiting().await;
        });
        (().serve(client_io).await.unwrap(), runs)
    }
}

/// A caller over its allowance of new claims gets a `rate_limited` tool result with the
/// seconds to wait, through rmcp's client; its replays still answer, and the refused call
/// ran nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_over_its_claim_limit_is_told_to_wait() {
    use idem_runtime::ClaimLimit;
    let hour = std::time::Duration::from_secs(3600);
    let (client, runs) =
        exports::serve_with("ana", |b| b.limit_new_claims(ClaimLimit::new(1, hour))).await;
    let export = |order: &str| {
        let Value::Object(args) = json!({ "order_id": order, "bytes": 3 }) else {
            unreachable!()
        };
        client.call_tool(CallToolRequestParams::new("export").with_arguments(args))
    };
    for attempt in ["the first call", "its replay"] {
        let result = export("o-1").await.unwrap();
        assert_ne!(result.is_error, Some(true), "{attempt}: {result:?}");
    }
    let refused = export("o-2").await.unwrap();
    assert_eq!(refused.is_error, Some(true), "{refused:?}");
    let body = refused.structured_content.clone().unwrap();
    assert_eq!(body["code"], "rate_limited", "{body}");
    let wait = body["retry_after"].as_u64().unwrap();
    assert!(wait > 3000 && wait <= 3600, "{body}");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    client.cancel().await.unwrap();
}

/// A call whose tool ran and whose result is over the outcome cap is answered as its
/// retry is: an `outcome_unknown` tool result the model can act on, never a protocol
/// error; and the tool does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_over_the_cap_is_outcome_unknown_on_the_call_and_its_retry() {
    let (client, runs) = exports::serve("ana").await;
    let args = json!({ "order_id": "o-1", "bytes": 4 * exports::CAP });
    for attempt in ["the call", "its retry"] {
        let Value::Object(args) = args.clone() else {
            unreachable!()
        };
        let answer = client
            .call_tool(CallToolRequestParams::new("export").with_arguments(args))
            .await;
        let result = match answer {
            Ok(result) => result,
            Err(e) => panic!("{attempt}: a protocol error where a tool result was due: {e:?}"),
        };
        assert_eq!(result.is_error, Some(true), "{attempt}: {result:?}");
        let body = result.structured_content.clone().unwrap();
        assert_eq!(body["code"], "outcome_unknown", "{attempt}: {body}");
        assert!(
            body["message"].as_str().unwrap().contains("new key"),
            "{attempt}: {body}"
        );
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    client.cancel().await.unwrap();
}

/// A transactional tool whose result is over the cap did nothing: its outbox row was
/// rolled back with its claim. The model is told so (`outcome_too_large`, not
/// `outcome_unknown`), the retry runs the tool again and does nothing again, and the key
/// stays free: the same key then sends a smaller email once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transactional_tool_over_the_cap_did_nothing_and_may_be_retried() {
    let db = db();
    let client = stdio_client(&db.path, "ana").await;
    // `send_email` records the address it sent to: over the example's 64 KiB cap.
    let huge = format!("{}@example.com", "a".repeat(70_000));
    for attempt in ["the call", "its retry"] {
        let result = call(&client, "send_email", email("big-1", &huge, "Hi")).await;
        let body = tool_error(&result);
        assert_eq!(body["code"], "outcome_too_large", "{attempt}: {body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("safe to call again"),
            "{attempt}: {body}"
        );
        assert!(outbox(&db.path).await.is_empty(), "{attempt}: rolled back");
    }
    let sent = ok(&call(
        &client,
        "send_email",
        email("big-1", "ana@example.com", "Hi"),
    )
    .await);
    let again = ok(&call(
        &client,
        "send_email",
        email("big-1", "ana@example.com", "Hi"),
    )
    .await);
    assert_eq!(sent, again);
    let rows = outbox(&db.path).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(sent["message_id"], rows[0].id);
    client.cancel().await.unwrap();
}

/// A key idem refuses (empty, or over its cap) and a scope over its cap are
/// `invalid_params`, as an `IdempotencyKey` argument that fails validation is; the tool
/// does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_keys_and_scopes_are_invalid_params() {
    let long_key = "k".repeat(300);
    let long_principal = "p".repeat(300);
    let cases = [
        ("ana", "", "empty_key"),
        ("ana", long_key.as_str(), "key_too_long"),
        (long_principal.as_str(), "o-1", "scope_too_long"),
    ];
    for (principal, key, code) in cases {
        let (client, runs) = exports::serve(principal).await;
        let Value::Object(args) = json!({ "order_id": key, "bytes": 1 }) else {
            unreachable!()
        };
        let answer = client
            .call_tool(CallToolRequestParams::new("export").with_arguments(args))
            .await;
        let Err(rmcp::ServiceError::McpError(error)) = answer else {
            panic!("{code}: expected a protocol error, got {answer:?}")
        };
        assert_eq!(
            error.code,
            rmcp::model::ErrorCode::INVALID_PARAMS,
            "{code}: {error:?}"
        );
        assert_eq!(error.data.unwrap()["code"], code);
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 0, "{code}");
        client.cancel().await.unwrap();
    }
}

/// An in-process server whose side-effecting tool takes an `IdempotencyKey`, with its
/// router wrapped by `mark_replays`; and one whose tools `audit` must flag.
mod keyed {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use idem_runtime::mcp::{IdempotencyKey, Principal, ToolError, mark_replays};
    use idem_runtime::{Idem, idempotent};
    use rmcp::handler::server::router::tool::ToolRouter;
    use rmcp::handler::server::wrapper::Parameters;
    use rmcp::model::{Extensions, JsonObject};
    use rmcp::{ServerHandler, ServiceExt, tool, tool_handler, tool_router};
    use schemars::JsonSchema;
    use serde::{Deserialize, Serialize};

    use super::Client;

    #[derive(Debug, Serialize, Deserialize, JsonSchema)]
    pub struct Transfer {
        /// The amount to move, in cents.
        amount_cents: u64,
        idempotency_key: IdempotencyKey,
    }

    #[derive(Debug, Deserialize, JsonSchema)]
    pub struct Lookup {
        /// What to look up.
        id: String,
    }

    #[derive(Clone)]
    pub struct Bank {
        idem: Idem,
        principal: Principal,
        pub runs: Arc<AtomicUsize>,
        tool_router: ToolRouter<Self>,
    }

    #[tool_router]
    impl Bank {
        #[idempotent(
            store = self.idem,
            key = args.idempotency_key,
            scope = Principal::caller(&ext, &self.principal)?,
            retain = "1h"
        )]
        #[tool(
            description = "Move money.",
            annotations(destructive_hint = true, idempotent_hint = true)
        )]
        async fn transfer(
            &self,
            Parameters(args): Parameters<Transfer>,
            #[idem(skip)] ext: Extensions,
        ) -> Result<rmcp::model::CallToolResult, ToolError> {
            let n = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
            let content = serde_json::json!({ "transfer": n, "amount_cents": args.amount_cents });
            Ok(rmcp::model::CallToolResult::structured(content))
        }

        #[tool(description = "Look something up.", annotations(read_only_hint = true))]
        async fn lookup(&self, Parameters(args): Parameters<Lookup>) -> String {
            args.id
        }
    }

    #[tool_handler(router = self.tool_router)]
    impl ServerHandler for Bank {}

    /// Serves a fresh store to a client of its own, the router wrapped by `mark_replays`.
    pub async fn serve() -> (Client, Arc<AtomicUsize>) {
        let idem = Idem::sqlite("sqlite::memory:").await.unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let server = Bank {
            idem,
            principal: Principal::new("ana"),
            runs: runs.clone(),
            tool_router: mark_replays(Bank::tool_router()),
        };
        let (server_io, client_io) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let running = server.serve(server_io).await.unwrap();
            let _ = running.waiting().await;
        });
        (().serve(client_io).await.unwrap(), runs)
    }

    pub fn transfer_args(key: &str, cents: u64) -> JsonObject {
        let args = serde_json::json!({ "amount_cents": cents, "idempotency_key": key });
        let serde_json::Value::Object(args) = args else {
            unreachable!()
        };
        args
    }

    #[derive(Debug, Deserialize, JsonSchema)]
    pub struct Sms {
        to: String,
    }

    #[derive(Debug, Deserialize, JsonSchema)]
    pub struct MaybeKeyed {
        to: String,
        /// A key the caller may leave out.
        request_key: Option<IdempotencyKey>,
    }

    /// Tools `audit` must flag, beside ones it must not.
    #[derive(Clone)]
    pub struct Careless;

    #[tool_router(vis = "pub")]
    impl Careless {
        #[tool(description = "Send a text message.")]
        async fn send_sms(&self, Parameters(sms): Parameters<Sms>) -> String {
            sms.to
        }

        #[tool(description = "Send a text message, perhaps once.")]
        async fn send_sms_maybe_once(&self, Parameters(sms): Parameters<MaybeKeyed>) -> String {
            format!("{} {:?}", sms.to, sms.request_key)
        }

        #[tool(description = "Move money.", annotations(destructive_hint = true))]
        async fn transfer(&self, Parameters(t): Parameters<Transfer>) -> String {
            t.idempotency_key.to_string()
        }

        #[tool(description = "Read a message.", annotations(read_only_hint = true))]
        async fn read_sms(&self, Parameters(sms): Parameters<Sms>) -> String {
            sms.to
        }
    }

    #[tool_handler(router = Self::tool_router())]
    impl ServerHandler for Careless {}

    pub async fn serve_careless() -> Client {
        let (server_io, client_io) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let running = Careless.serve(server_io).await.unwrap();
            let _ = running.waiting().await;
        });
        ().serve(client_io).await.unwrap()
    }
}

/// The replay flag a result carries in `_meta`, if any.
fn replayed_meta(result: &CallToolResult) -> Option<&Value> {
    result.meta.as_ref()?.get(idem_runtime::mcp::REPLAYED_META)
}

/// A replayed result says so in `_meta` under a prefixed name (`io.idem/replayed`), the
/// first run carries no such entry, and `structuredContent` is the same in both; a tool
/// without idem's attribute is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_tool_results_carry_io_idem_replayed_in_meta() {
    assert_eq!(idem_runtime::mcp::REPLAYED_META, "io.idem/replayed");
    let (client, runs) = keyed::serve().await;
    let call = |key: &str| {
        let peer = client.peer().clone();
        let args = keyed::transfer_args(key, 500);
        async move {
            peer.call_tool(CallToolRequestParams::new("transfer").with_arguments(args))
                .await
                .unwrap()
        }
    };
    let first = call("t-1").await;
    assert_eq!(replayed_meta(&first), None, "a first run: {first:?}");
    for _ in 0..2 {
        let again = call("t-1").await;
        assert_eq!(replayed_meta(&again), Some(&json!(true)), "{again:?}");
        assert_eq!(again.structured_content, first.structured_content);
        assert_eq!(again.is_error, first.is_error);
    }
    let other = call("t-2").await;
    assert_eq!(
        replayed_meta(&other),
        None,
        "another intent runs: {other:?}"
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    let Value::Object(args) = json!({ "id": "x" }) else {
        unreachable!()
    };
    let lookup = client
        .call_tool(CallToolRequestParams::new("lookup").with_arguments(args))
        .await
        .unwrap();
    assert_eq!(replayed_meta(&lookup), None);
    client.cancel().await.unwrap();
}

/// MCP keys take the HTTP header's cap, 255 characters: a key of 255 runs once and
/// replays, and differs from one that differs only in its last character; a key of 256
/// never reaches the tool (rmcp refuses its arguments). The schema says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_up_to_the_http_cap_of_255_are_taken() {
    use idem_runtime::mcp::MAX_IDEMPOTENCY_KEY_LEN;
    assert_eq!(MAX_IDEMPOTENCY_KEY_LEN, idem_runtime::http::MAX_KEY_LEN);
    assert_eq!(MAX_IDEMPOTENCY_KEY_LEN, 255);
    let (client, runs) = keyed::serve().await;
    let tools = client.list_all_tools().await.unwrap();
    let transfer = tools.iter().find(|t| t.name == "transfer").unwrap();
    let key_schema = &transfer.input_schema["properties"]["idempotency_key"];
    assert_eq!(key_schema["maxLength"], 255, "{key_schema}");

    let call = |key: String| {
        let peer = client.peer().clone();
        async move {
            peer.call_tool(
                CallToolRequestParams::new("transfer")
                    .with_arguments(keyed::transfer_args(&key, 7)),
            )
            .await
        }
    };
    let longest = "k".repeat(255);
    let first = call(longest.clone()).await.unwrap();
    let again = call(longest.clone()).await.unwrap();
    assert_eq!(replayed_meta(&again), Some(&json!(true)));
    assert_eq!(again.structured_content, first.structured_content);
    let sibling = format!("{}j", "k".repeat(254));
    let other = call(sibling).await.unwrap();
    assert_ne!(other.structured_content, first.structured_content);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);

    // rmcp answers arguments that do not deserialize with a tool error the model reads.
    let refused = call("k".repeat(256)).await.unwrap();
    assert_eq!(refused.is_error, Some(true), "{refused:?}");
    let said = format!("{:?}", refused.content);
    assert!(
        said.contains("idempotency key is 256 bytes, over the cap of 255"),
        "{said}"
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    client.cancel().await.unwrap();
}

/// `audit` finds no side-effecting tool without a key in the example's server (as a
/// client lists its tools) and in the keyed server's router; it names the tool without
/// a key and the one whose key is optional in a careless server, by its router and over
/// the protocol alike, and lets read-only tools be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_flags_side_effecting_tools_without_a_key() {
    use idem_runtime::mcp::{FindingKind, audit, audit_tools};
    let db = db();
    let example = stdio_client(&db.path, "ana").await;
    let tools = example.list_all_tools().await.unwrap();
    assert_eq!(tools.len(), 3, "{tools:?}");
    let findings = audit_tools(&tools);
    assert!(findings.is_empty(), "the example: {findings:#?}");
    example.cancel().await.unwrap();

    let (keyed, _) = keyed::serve().await;
    let findings = audit_tools(&keyed.list_all_tools().await.unwrap());
    assert!(findings.is_empty(), "{findings:#?}");
    keyed.cancel().await.unwrap();

    let expected = [
        ("send_sms", FindingKind::NoKey),
        ("send_sms_maybe_once", FindingKind::OptionalKey),
    ];
    let by_router = audit(&keyed::Careless::tool_router());
    let careless = keyed::serve_careless().await;
    let by_protocol = audit_tools(&careless.list_all_tools().await.unwrap());
    careless.cancel().await.unwrap();
    for findings in [by_router, by_protocol] {
        let mut found: Vec<(&str, FindingKind)> =
            findings.iter().map(|f| (f.tool.as_str(), f.kind)).collect();
        found.sort();
        assert_eq!(found, expected, "{findings:#?}");
        let no_key = &findings
            .iter()
            .find(|f| f.kind == FindingKind::NoKey)
            .unwrap()
            .message;
        for says in [
            "`send_sms`",
            "IdempotencyKey",
            "#[idempotent",
            "read_only_hint",
        ] {
            assert!(no_key.contains(says), "{says}: {no_key}");
        }
    }
}
