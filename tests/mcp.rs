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
        let idem = Idem::builder()
            .max_outcome_bytes(CAP)
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
