//! `idem`: the operator's command for idem stores.
//!
//! ```sh
//! cargo install --locked --path idem-cli
//! idem --url sqlite://app.db stats
//! idem --url postgres://app@db/app list --state unknown --older-than 5m
//! idem --url postgres://app@db/app show acme charge order-42
//! idem --url postgres://app@db/app resolve acme charge order-42 --retry
//! idem --url mysql://app@db/app stats
//! idem --url redis://cache:6379 --key-prefix billing list --state unknown
//! idem --node redis://node-1:6379 --node redis://node-2:6379 stats
//! idem --url redis+cluster://node-1:6379,node-2:6379 --key-prefix billing stats
//! idem --url postgres://app@db/app forget acme charge order-42
//! idem schema postgres --table payments_idem
//! idem completions bash > /etc/bash_completion.d/idem
//! ```
//!
//! It reads and settles the records of a SQLite, PostgreSQL, MySQL/MariaDB or Redis
//! store (standalone or Redis Cluster): counts and the oldest stuck ages (`stats`),
//! records by state, name, scope and age (`list`), one record in full (`show`), a fenced
//! `resolve` of an UNKNOWN or stuck operation, a fenced `forget` of a wrong record,
//! `purge` of expired records, and the DDL for `migrate(false)` (`schema`). Keys and
//! scopes are shown as the application passed them (`--encoded` shows them as stored).
//! It never creates or migrates a table, so a wrong URL, table name or key prefix is an
//! error, not an empty store. The store is `--url`, else `IDEM_URL`, else
//! `DATABASE_URL`. `--json` prints JSON for scripts. Exit codes: 0 done, 1 the store
//! failed, 2 bad arguments, 3 no such record, 4 resolve or forget refused.

mod display;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use comfy_table::{CellAlignment, ContentArrangement, Table, presets};
use display::{duration, unquoted};
use idem_runtime::store::StoredOutcome;
use idem_runtime::{
    DisplayKey, Idem, IdemError, ListFilter, OperationId, RecordDetail, RecordInfo, Resolution,
    State,
};
use serde_json::{Value, json};

const EXIT_CODES: &str = "\
Exit codes:
  0  done
  1  the store failed or refused (unreachable, missing database or table)
  2  bad arguments (an unsupported URL, invalid JSON, an unset --secret-env)
  3  no record for that operation
  4  resolve or forget refused: the record moved since it was read (another epoch, or
     no longer UNKNOWN or IN_PROGRESS), or forget found a claim whose lease holds; read
     it again with `show` and decide again";

/// Inspect and repair an idem store: counts, stuck and unknown operations, one record
/// in full, an operator's resolution or removal, purging and the schema.
#[derive(Parser, Debug)]
#[command(name = "idem", version, after_help = EXIT_CODES)]
struct Cli {
    /// The store, any URL `IdemBuilder::connect` takes: `sqlite://PATH`,
    /// `postgres://USER@HOST[:PORT]/DB`, `mysql://USER@HOST[:PORT]/DB` (or `mariadb://`),
    /// `redis://HOST[:PORT]` (`rediss://` with TLS), a Redis Cluster as
    /// `redis+cluster://HOST:PORT,HOST:PORT` or its nodes' URLs separated by commas, or
    /// `dynamodb://TABLE` (region, credentials and endpoint from the `AWS_*` variables).
    /// Without it, `IDEM_URL`, then `DATABASE_URL`. TLS as the URL asks: `?sslmode=verify-full&sslrootcert=CA.pem`
    /// (PostgreSQL), `?ssl-mode=verify_identity&ssl-ca=CA.pem` (MySQL), `rediss://`
    /// (Redis, certificates from a public CA).
    // The URL may hold a password: `--help` names the variables, never their values.
    #[arg(long, env = "IDEM_URL", hide_env_values = true, global = true)]
    url: Option<String>,
    /// A node of a Redis Cluster (`redis://HOST:PORT`); repeat it for more nodes. The
    /// store is then that cluster.
    #[arg(long = "node", value_name = "URL", global = true)]
    nodes: Vec<String>,
    /// The table the application configured with `IdemBuilder::table`.
    #[arg(long, default_value = "idem_operations", global = true)]
    table: String,
    /// Redis: the key prefix the application configured with `IdemBuilder::key_prefix`.
    #[arg(long, default_value = "idem", global = true)]
    key_prefix: String,
    /// The environment variable holding the secret the application passes to
    /// `IdemBuilder::hash_keys` (keys and scopes are then stored hashed).
    #[arg(long, value_name = "VAR", global = true)]
    secret_env: Option<String>,
    /// The environment variable holding the keyring the application passes to
    /// `IdemBuilder::encrypt`, in its text form (`ID:HEX,ID:HEX`, the current key
    /// first). With it `show` opens encrypted outcomes and `resolve` seals what it
    /// records; without it an encrypted value shows as `encrypted (key ID, N bytes)`, and
    /// a resolution is recorded in clear.
    #[arg(long, value_name = "VAR", global = true)]
    keyring_env: Option<String>,
    /// Print JSON instead of a table, for scripts.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Counts by state and the age of the oldest IN_PROGRESS and UNKNOWN records.
    Stats,
    /// Records, oldest first.
    List(ListArgs),
    /// One record in full: state, epoch, ages, lease, outcome, and the completed steps of
    /// an operation not yet completed (what happened before it stopped).
    Show(Target),
    /// Settle an UNKNOWN or stuck IN_PROGRESS operation, fenced by the epoch read.
    Resolve(ResolveArgs),
    /// Delete a COMPLETED or UNKNOWN record (or a claim whose lease lapsed), fenced by
    /// the epoch read, so the next call runs the body: the undo of a wrong outcome, such
    /// as a mistaken `resolve --completed`. A claim whose lease holds is refused.
    Forget(ForgetArgs),
    /// Delete completed records past their retention.
    Purge,
    /// Print the DDL idem applies on open, for `migrate(false)` deployments.
    Schema {
        /// The database.
        dialect: Dialect,
    },
    /// Print a shell's completion script: `idem completions bash > /etc/bash_completion.d/idem`,
    /// `idem completions zsh > "${fpath[1]}/_idem"`, `idem completions fish >
    /// ~/.config/fish/completions/idem.fish`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Args, Debug)]
struct ListArgs {
    /// Only records in this state.
    #[arg(long, value_enum)]
    state: Option<StateArg>,
    /// Only records claimed or created longer ago than this (`30s`, `5m`, `2h`).
    #[arg(long, value_parser = humantime::parse_duration)]
    older_than: Option<Duration>,
    /// Only records claimed or created at most this long ago (`1h`: the last hour's).
    #[arg(long, value_parser = humantime::parse_duration)]
    newer_than: Option<Duration>,
    /// The newest records first (oldest first by default).
    #[arg(long)]
    newest_first: bool,
    /// Only records in this scope (a string, as the application passes it; see
    /// `--encoded`).
    #[arg(long)]
    scope: Option<String>,
    /// Only records of this operation name.
    #[arg(long)]
    name: Option<String>,
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// Print scopes and keys as stored (idem's typed encoding, `s4:acme`), and take
    /// `--scope` so, as `show --encoded` takes them.
    #[arg(long)]
    encoded: bool,
}

/// One operation.
#[derive(Args, Debug)]
struct Target {
    /// The scope as the application passes it, a string (`""` for none); quoted as
    /// `list` prints it (`"two words"`) or bare.
    scope: String,
    /// The operation name (the function's name unless `name = ...` was given).
    name: String,
    /// The key as the application passes it: a string (quoted as `list` prints it, or
    /// bare), or an integer with `--int-key`. Other keys (tuples, ...) with `--encoded`.
    key: String,
    /// The key is an integer.
    #[arg(long)]
    int_key: bool,
    /// SCOPE and KEY are given as stored, as `list --encoded` and `--json` print them
    /// (copy keys holding control characters, which tables show escaped, from `--json`);
    /// `show` then prints them so too.
    #[arg(long, conflicts_with = "int_key")]
    encoded: bool,
}

#[derive(Args, Debug)]
struct ForgetArgs {
    #[command(flatten)]
    target: Target,
    /// The epoch you decided on; refused if the record is at another one. Default: the
    /// epoch read just before.
    #[arg(long)]
    epoch: Option<u64>,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("resolution").required(true)))]
struct ResolveArgs {
    #[command(flatten)]
    target: Target,
    /// The effect happened: record this JSON as the outcome (the function's `Ok` value),
    /// which every later call gets back as it is.
    #[arg(long, value_name = "JSON", group = "resolution")]
    completed: Option<String>,
    /// The effect was refused: record this JSON as the error (the function's `Err`),
    /// which every later call gets back as it is.
    #[arg(long, value_name = "JSON", group = "resolution")]
    rejected: Option<String>,
    /// The effect did not happen: delete the record so the next call runs the body.
    #[arg(long, group = "resolution")]
    retry: bool,
    /// The epoch you decided on; refused if the record is at another one. Default: the
    /// epoch read just before.
    #[arg(long)]
    epoch: Option<u64>,
    /// How long to keep a completed or rejected outcome.
    #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
    retain: Duration,
    /// The outcome's schema version (the operation's `version`).
    #[arg(long, default_value_t = 1)]
    version: u32,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum StateArg {
    InProgress,
    Completed,
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Dialect {
    Sqlite,
    Postgres,
    Mysql,
}

/// A failure with its exit code.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn store(message: impl Into<String>) -> Failure {
        Failure {
            code: 1,
            message: message.into(),
        }
    }
}

impl From<IdemError> for Failure {
    fn from(e: IdemError) -> Self {
        let code = if matches!(e, IdemError::Fenced { .. }) {
            4
        } else {
            1
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            if cli.json {
                println!("{}", json!({ "error": f.message, "exit_code": f.code }));
            }
            // Messages can quote stored names and keys: one line each, escaped.
            let lines: Vec<_> = f
                .message
                .lines()
                .map(|l| DisplayKey::plain(l).to_string())
                .collect();
            eprintln!("idem: {}", lines.join("\n"));
            ExitCode::from(f.code)
        }
    }
}

async fn run(cli: &Cli) -> Result<(), Failure> {
    match &cli.command {
        Command::Schema { dialect } => {
            print!("{}", schema(*dialect, &cli.table));
            return Ok(());
        }
        Command::Completions { shell } => {
            use std::io::Write;
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "idem", &mut script);
            // A reader that stops early (`| head`) is not a failure.
            return match std::io::stdout().write_all(&script) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Failure {
                    code: 1,
                    message: format!("could not write the completion script: {e}"),
                }),
                _ => Ok(()),
            };
        }
        _ => {}
    }
    let idem = open(cli).await?;
    match &cli.command {
        Command::Stats => stats(cli, &idem).await,
        Command::List(args) => list(cli, &idem, args).await,
        Command::Show(target) => show(cli, &idem, target).await,
        Command::Resolve(args) => resolve(cli, &idem, args).await,
        Command::Forget(args) => forget(cli, &idem, args).await,
        Command::Purge => {
            let purged = idem.purge_expired().await?;
            if cli.json {
                println!("{}", json!({ "purged": purged }));
            } else {
                println!("purged {purged} expired records");
            }
            Ok(())
        }
        Command::Schema { .. } | Command::Completions { .. } => unreachable!("handled above"),
    }
}

/// The DDL of `dialect` for `table`. Companion objects share the table's name as a
/// prefix, so every name is renamed; the comments are left as shipped. For MySQL the
/// claim's stored procedure, whose body holds `;`s, is set between `DELIMITER` lines,
/// so the output can be piped into the `mysql` command-line client.
fn schema(dialect: Dialect, table: &str) -> String {
    const DEFAULT: &str = "idem_operations";
    let sql = match dialect {
        Dialect::Sqlite => idem_runtime::schema::SQLITE_SCHEMA_SQL,
        Dialect::Postgres => idem_runtime::schema::POSTGRES_SCHEMA_SQL,
        Dialect::Mysql => idem_runtime::schema::MYSQL_SCHEMA_SQL,
    };
    let mut out = String::with_capacity(sql.len() + 128);
    if table != DEFAULT {
        out.push_str(&format!(
            "-- For the table `{table}`: the comments below name it `{DEFAULT}`, as shipped.\n"
        ));
    }
    let mut in_procedure = false;
    for line in sql.split_inclusive('\n') {
        if dialect == Dialect::Mysql {
            if line.starts_with("CREATE PROCEDURE") {
                in_procedure = true;
                out.push_str("DELIMITER $$\n");
            } else if in_procedure && line.trim_end() == "END;" {
                in_procedure = false;
                out.push_str("END$$\nDELIMITER ;\n");
                continue;
            }
        }
        // No statement holds `--` inside a string, so it starts a comment.
        let (code, comment) = line.split_at(line.find("--").unwrap_or(line.len()));
        out.push_str(&code.replace(DEFAULT, table));
        out.push_str(comment);
    }
    out
}

/// The store URL: `--url` (or `IDEM_URL`, which clap reads), else `DATABASE_URL`, the
/// variable most deployments already set; never with `--node`, which names a cluster.
fn store_url(cli: &Cli) -> Option<String> {
    cli.url.clone().or_else(|| {
        let fallback = std::env::var("DATABASE_URL").ok();
        fallback.filter(|url| !url.is_empty() && cli.nodes.is_empty())
    })
}

/// Opens the store `--url` names, by [`IdemBuilder::connect`](idem_runtime::IdemBuilder::connect)
/// (any scheme it takes), or the Redis Cluster of the `--node`s, with the application's
/// table, key prefix and secret. It never creates or migrates anything
/// (`migrate(false)`, and a SQLite file must exist), so a wrong URL, table or key prefix
/// is an error, not a fresh empty store.
async fn open(cli: &Cli) -> Result<Idem, Failure> {
    let url = store_url(cli);
    if url.is_none() && cli.nodes.is_empty() {
        return Err(Failure {
            code: 2,
            message: "no store given: pass --url sqlite://PATH, --url postgres://USER@HOST/DB, \
                      --url mysql://USER@HOST/DB or --url redis://HOST:PORT (or set IDEM_URL or \
                      DATABASE_URL), or --node URL for each node of a Redis Cluster"
                .into(),
        });
    }
    let mut builder = Idem::builder()
        .table(&cli.table)
        .key_prefix(&cli.key_prefix)
        .migrate(false);
    if let Some(var) = &cli.secret_env {
        let secret = std::env::var(var).map_err(|_| Failure {
            code: 2,
            message: format!("--secret-env {var}: the environment variable `{var}` is not set"),
        })?;
        builder = builder.hash_keys(secret);
    }
    if let Some(var) = &cli.keyring_env {
        let text = std::env::var(var).map_err(|_| Failure {
            code: 2,
            message: format!("--keyring-env {var}: the environment variable `{var}` is not set"),
        })?;
        // The parse error names the entry and the id, never the key material.
        let keyring = text.parse::<idem_runtime::Keyring>().map_err(|e| Failure {
            code: 2,
            message: format!("--keyring-env {var}: {e}"),
        })?;
        builder = builder.encrypt(keyring);
    }
    let opened = if cli.nodes.is_empty() {
        let url = url.unwrap_or_default();
        if url.trim().to_ascii_lowercase().starts_with("memory:") {
            return Err(Failure {
                code: 2,
                message: "`memory:` is a store inside the application's own process, gone \
                          with it; point --url at the application's SQLite, PostgreSQL, \
                          MySQL or Redis store"
                    .into(),
            });
        }
        if let Some(path) = sqlite_file(&url)
            && !std::path::Path::new(path).exists()
        {
            return Err(Failure::store(format!(
                "no SQLite database at `{path}`; check the path in --url"
            )));
        }
        builder.connect(&url).await
    } else {
        // A cluster however many nodes are given; a --url beside them names more of them.
        let mut nodes: Vec<&str> = cli.nodes.iter().map(String::as_str).collect();
        if let Some(url) = &url {
            nodes.extend(url.split(',').map(str::trim).filter(|n| !n.is_empty()));
        }
        builder.redis_cluster(&nodes).await.map_err(|e| match e {
            IdemError::Config { message } if message.starts_with("invalid Redis") => {
                IdemError::Config {
                    message: format!(
                        "unsupported store URL: {message}\nhint: --node names a node of a \
                         Redis Cluster (redis://HOST:PORT), and --url (or IDEM_URL) beside it \
                         more of its nodes"
                    ),
                }
            }
            e => e,
        })
    };
    opened.map_err(|e| match e {
        IdemError::Config { message }
            if message.starts_with("unsupported store URL")
                || message.starts_with("invalid store URL") =>
        {
            Failure { code: 2, message }
        }
        IdemError::Config { message } if message.contains("no idem store") => {
            Failure::store(format!(
                "{message}\nhint: pass the application's prefix with --key-prefix (default `idem`)"
            ))
        }
        IdemError::Config { message } if message.contains("hash") => Failure {
            code: 2,
            message: format!(
                "{message}\nhint: pass --secret-env with the variable holding the \
                 application's `hash_keys` secret, or leave it out if it sets none"
            ),
        },
        IdemError::Config { message } if message.contains("missing") => Failure::store(format!(
            "{message}\nhint: pass the application's table with --table, or print its DDL \
             with `idem schema`"
        )),
        e => e.into(),
    })
}

/// The file a `sqlite:` URL names (none for an in-memory database), checked before
/// opening: the store would create a missing one.
fn sqlite_file(url: &str) -> Option<&str> {
    let rest = url.trim().strip_prefix("sqlite:")?;
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let file = !path.is_empty() && !path.starts_with(':') && !query.contains("mode=memory");
    file.then_some(path)
}

/// A table for people that stays greppable: no borders and no wrapping, so each record
/// is one line, its columns two spaces apart (`right` ones, the numbers, aligned right).
fn table(header: &[&str], right: &[usize]) -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.to_vec());
    let last = header.len().saturating_sub(1);
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_padding((0, if i == last { 0 } else { 2 }));
        if right.contains(&i) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

/// Prints `t` a line at a time, each after `indent` and without the padding that ends it.
fn print_table(t: &Table, indent: &str) {
    for line in t.lines() {
        println!("{indent}{}", line.trim_end());
    }
}

fn state_name(state: State) -> &'static str {
    match state {
        State::InProgress => "in_progress",
        State::Completed => "completed",
        State::Unknown => "unknown",
        // A state a later idem-runtime adds, which this build cannot name.
        _ => "other",
    }
}

fn age(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".into(), duration)
}

fn millis(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(d.as_millis() as u64))
}

async fn stats(cli: &Cli, idem: &Idem) -> Result<(), Failure> {
    let s = idem.stats().await?;
    if cli.json {
        println!(
            "{}",
            json!({
                "in_progress": s.in_progress,
                "completed": s.completed,
                "unknown": s.unknown,
                "released": s.released,
                "oldest_in_progress_ms": millis(s.oldest_in_progress),
                "oldest_unknown_ms": millis(s.oldest_unknown),
            })
        );
    } else {
        let mut t = table(&["state", "count", "oldest"], &[1]);
        t.add_row(vec![
            "in_progress".to_owned(),
            s.in_progress.to_string(),
            age(s.oldest_in_progress),
        ]);
        t.add_row(vec![
            "completed".to_owned(),
            s.completed.to_string(),
            "-".to_owned(),
        ]);
        t.add_row(vec![
            "unknown".to_owned(),
            s.unknown.to_string(),
            age(s.oldest_unknown),
        ]);
        // Released with their steps kept: waiting for a retry, not stuck.
        t.add_row(vec![
            "released".to_owned(),
            s.released.to_string(),
            "-".to_owned(),
        ]);
        print_table(&t, "");
    }
    Ok(())
}

async fn list(cli: &Cli, idem: &Idem, args: &ListArgs) -> Result<(), Failure> {
    let scope = args.scope.as_deref().map(|s| {
        if args.encoded || s.is_empty() {
            s.to_string()
        } else {
            idem.operation("", "")
                .scope(&*unquoted(s))
                .id()
                .scope
                .clone()
        }
    });
    let mut filter = ListFilter::default().limit(args.limit);
    filter.state = args.state.map(|s| match s {
        StateArg::InProgress => State::InProgress,
        StateArg::Completed => State::Completed,
        StateArg::Unknown => State::Unknown,
    });
    filter.name = args.name.clone();
    filter.scope = scope;
    filter.older_than = args.older_than;
    filter.newer_than = args.newer_than;
    filter.newest_first = args.newest_first;
    let rows = idem.list(&filter).await?;
    if cli.json {
        let rows: Vec<Value> = rows.iter().map(record_json).collect();
        println!("{}", Value::Array(rows));
    } else {
        let part = |stored: &str| part(stored, args.encoded);
        if rows.is_empty() {
            println!("(no records)");
            return Ok(());
        }
        let mut t = table(&["state", "epoch", "age", "scope", "name", "key"], &[1, 2]);
        for r in &rows {
            t.add_row(vec![
                state_name(r.state).to_owned(),
                r.epoch.to_string(),
                age(Some(r.age)),
                part(&r.id.scope),
                DisplayKey::plain(&r.id.name).to_string(),
                part(&r.id.key),
            ]);
        }
        print_table(&t, "");
    }
    Ok(())
}

/// A record for `--json`: scope and key as the application passed them, and as stored
/// (`scope_encoded`, `key_encoded`, what `--encoded` takes back).
fn record_json(r: &RecordInfo) -> Value {
    json!({
        "scope": r.id.display_scope().decoded(),
        "scope_encoded": r.id.scope,
        "name": r.id.name,
        "key": r.id.display_key().decoded(),
        "key_encoded": r.id.key,
        "state": state_name(r.state),
        "epoch": r.epoch,
        "age_ms": r.age.as_millis() as u64,
    })
}

/// A stored scope or key for a table: as the application passed it, or as stored.
fn part(stored: &str, encoded: bool) -> String {
    if encoded {
        DisplayKey::plain(stored).to_string()
    } else {
        DisplayKey::new(stored).to_string()
    }
}

/// The stored identity of `target`, encoded (and hashed) as the application stores it.
fn operation_id(idem: &Idem, target: &Target) -> Result<OperationId, Failure> {
    if target.encoded {
        return Ok(OperationId {
            scope: target.scope.clone(),
            name: target.name.clone(),
            key: target.key.clone(),
        });
    }
    let op = if target.int_key {
        let key: i64 = target.key.parse().map_err(|_| Failure {
            code: 2,
            message: format!("--int-key: `{}` is not an integer", target.key),
        })?;
        idem.operation(&target.name, &key)
    } else {
        idem.operation(&target.name, &*unquoted(&target.key))
    };
    let op = if target.scope.is_empty() {
        op
    } else {
        op.scope(&*unquoted(&target.scope))
    };
    Ok(op.id().clone())
}

async fn read(idem: &Idem, id: &OperationId) -> Result<RecordDetail, Failure> {
    idem.get(id).await?.ok_or_else(|| Failure {
        code: 3,
        message: format!(
            "no record for operation `{}` with scope {} and key {}; check the name, and \
             pass --int-key for integer keys or --encoded for keys copied from \
             `list --encoded`",
            DisplayKey::plain(&id.name),
            DisplayKey::new(&id.scope),
            DisplayKey::new(&id.key)
        ),
    })
}

/// An encrypted value as the command shows it: its key id and size, never its bytes
/// (the command holds no keyring, so it opens nothing).
fn sealed_text(outcome: &StoredOutcome) -> Option<String> {
    let key = outcome.sealed_key_id()?;
    Some(format!(
        "encrypted (key {key}, {} bytes)",
        outcome.body.len()
    ))
}

/// A value for people: the JSON, or what `sealed_text` says of an encrypted one.
fn body_text(outcome: &StoredOutcome) -> String {
    sealed_text(outcome).unwrap_or_else(|| outcome_json(outcome)["body"].to_string())
}

fn outcome_json(outcome: &StoredOutcome) -> Value {
    if let (Some(text), Some(key)) = (sealed_text(outcome), outcome.sealed_key_id()) {
        let encrypted = json!({ "key_id": key, "bytes": outcome.body.len() });
        return json!({
            "is_err": outcome.is_err,
            "version": outcome.version,
            "body": text,
            "encrypted": encrypted,
        });
    }
    let body = serde_json::from_slice::<Value>(&outcome.body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&outcome.body).into_owned()));
    json!({ "is_err": outcome.is_err, "version": outcome.version, "body": body })
}

async fn show(cli: &Cli, idem: &Idem, target: &Target) -> Result<(), Failure> {
    let id = operation_id(idem, target)?;
    let d = read(idem, &id).await?;
    if cli.json {
        let mut v = record_json(&d.info);
        v["lease_remaining_ms"] = millis(d.lease_remaining);
        v["expires_in_ms"] = millis(d.expires_in);
        v["outcome"] = json!(d.outcome.as_ref().map(outcome_json));
        v["steps"] = d
            .steps
            .iter()
            .map(|s| {
                json!({
                    "label": s.label,
                    "epoch": s.epoch,
                    "age_ms": s.age.as_millis() as u64,
                    "value": outcome_json(&s.outcome)["body"],
                })
            })
            .collect();
        println!("{v}");
    } else {
        println!("operation  {}", DisplayKey::plain(&d.info.id.name));
        println!("scope      {}", part(&d.info.id.scope, target.encoded));
        println!("key        {}", part(&d.info.id.key, target.encoded));
        println!("state      {}", state_name(d.info.state));
        println!("epoch      {}", d.info.epoch);
        println!("age        {}", age(Some(d.info.age)));
        if let Some(lease) = d.lease_remaining {
            println!("lease      {} left", age(Some(lease)));
        }
        if let Some(expires) = d.expires_in {
            println!("expires in {}", age(Some(expires)));
        }
        if let Some(outcome) = &d.outcome {
            let kind = if outcome.is_err { "error" } else { "outcome" };
            println!("{kind:<10} {}", body_text(outcome));
        }
        if !d.steps.is_empty() {
            println!("steps      {} completed, oldest first:", d.steps.len());
        }
        let mut steps = table(&["label", "epoch", "age", "value"], &[1, 2]);
        for s in &d.steps {
            let value = body_text(&s.outcome);
            steps.add_row(vec![
                DisplayKey::plain(&s.label).to_string(),
                s.epoch.to_string(),
                age(Some(s.age)),
                DisplayKey::plain(&value).to_string(),
            ]);
        }
        if !d.steps.is_empty() {
            print_table(&steps, "  ");
        }
    }
    Ok(())
}

/// The JSON of `--completed` or `--rejected`, which callers will get back as it is.
fn resolution_json(flag: &str, text: &str) -> Result<Value, Failure> {
    serde_json::from_str::<Value>(text).map_err(|e| Failure {
        code: 2,
        message: format!(
            "--{flag}: not valid JSON ({e}); nothing was recorded. The value is replayed to \
             every later caller as it is, as the JSON of the operation's {} value, so give \
             exactly that, quoted for the shell: --{flag} '{{\"id\": 9}}', --{flag} \
             '\"text\"'",
            if flag == "completed" { "`Ok`" } else { "`Err`" }
        ),
    })
}

async fn resolve(cli: &Cli, idem: &Idem, args: &ResolveArgs) -> Result<(), Failure> {
    // The value first: a bad one is refused before anything is read or written.
    // With what to say once it is applied: its name and the value later calls replay.
    let (resolution, what, replayed) = if let Some(text) = &args.completed {
        let outcome = resolution_json("completed", text)?;
        let shown = outcome.to_string();
        let resolution = Resolution::Completed {
            outcome,
            version: args.version,
            retain: args.retain,
        };
        (resolution, "completed", Some(shown))
    } else if let Some(text) = &args.rejected {
        let error = resolution_json("rejected", text)?;
        let shown = error.to_string();
        let resolution = Resolution::Rejected {
            error,
            version: args.version,
            retain: args.retain,
        };
        (resolution, "rejected", Some(shown))
    } else {
        (Resolution::Retry, "retry", None)
    };
    let id = operation_id(idem, &args.target)?;
    let current = read(idem, &id).await?;
    let epoch = args.epoch.unwrap_or(current.info.epoch);
    let refused = |why: String| Failure {
        code: 4,
        message: why,
    };
    if current.info.state == State::Completed {
        return Err(refused(format!(
            "operation `{}` is already COMPLETED at epoch {}; nothing to resolve (to drop a \
             wrong outcome, `idem forget` it)",
            DisplayKey::plain(&id.name),
            current.info.epoch
        )));
    }
    if current.info.epoch != epoch {
        return Err(refused(format!(
            "operation `{}` is at epoch {}, not {epoch}: another attempt claimed it since; \
             check it with `show` and decide again",
            DisplayKey::plain(&id.name),
            current.info.epoch
        )));
    }
    // The store applies it only while the record is still at `epoch`.
    idem.resolve(&id, epoch, resolution).await?;
    if cli.json {
        println!("{}", json!({ "resolved": what, "epoch": epoch }));
    } else {
        println!(
            "resolved `{}` at epoch {epoch}: {what}",
            DisplayKey::plain(&id.name)
        );
        match replayed {
            Some(value) => println!(
                "every later call replays this {} as it is: {}\n(undo with `idem forget`)",
                if what == "completed" {
                    "outcome"
                } else {
                    "error"
                },
                DisplayKey::plain(&value)
            ),
            None => println!("the next call runs the body"),
        }
    }
    Ok(())
}

async fn forget(cli: &Cli, idem: &Idem, args: &ForgetArgs) -> Result<(), Failure> {
    let id = operation_id(idem, &args.target)?;
    let current = read(idem, &id).await?;
    let epoch = args.epoch.unwrap_or(current.info.epoch);
    let refused = |why: String| Failure {
        code: 4,
        message: why,
    };
    if current.info.epoch != epoch {
        return Err(refused(format!(
            "operation `{}` is at epoch {}, not {epoch}: another attempt claimed it since; \
             check it with `show` and decide again",
            DisplayKey::plain(&id.name),
            current.info.epoch
        )));
    }
    if let Some(lease) = current.lease_remaining.filter(|l| !l.is_zero()) {
        return Err(refused(format!(
            "operation `{}` is IN_PROGRESS and its lease holds for {} more: a call may be \
             running its body right now, so its record is not forgotten; wait for the lease \
             to lapse, or `resolve` it once it is stuck",
            DisplayKey::plain(&id.name),
            duration(lease)
        )));
    }
    // The store deletes it only while it is still at `epoch` and not under a live lease.
    if !idem.forget(&id, epoch).await? {
        return Err(refused(format!(
            "operation `{}` moved since it was read (another epoch, or claimed again); \
             check it with `show` and decide again",
            DisplayKey::plain(&id.name)
        )));
    }
    let state = state_name(current.info.state);
    if cli.json {
        println!(
            "{}",
            json!({ "forgotten": true, "epoch": epoch, "state": state })
        );
    } else {
        println!(
            "forgot `{}` (scope {}, key {}, {state} at epoch {epoch}): the next call runs the \
             body",
            DisplayKey::plain(&id.name),
            DisplayKey::new(&id.scope),
            DisplayKey::new(&id.key)
        );
    }
    Ok(())
}
