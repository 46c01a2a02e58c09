//! `idem`: the operator's command for idem stores.
//!
//! ```sh
//! cargo install --path idem-cli
//! idem --url sqlite://app.db stats
//! idem --url postgres://app@db/app list --state unknown --older-than 5m
//! idem --url postgres://app@db/app show acme charge order-42
//! idem --url postgres://app@db/app resolve acme charge order-42 --retry
//! idem --url mysql://app@db/app stats
//! ```

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idem_runtime::store::StoredOutcome;
use idem_runtime::{Idem, IdemError, ListFilter, OperationId, RecordDetail, Resolution, State};
use serde_json::{Value, json};

const EXIT_CODES: &str = "\
Exit codes:
  0  done
  1  the store failed or refused (unreachable, missing database or table)
  2  bad arguments (an unsupported URL, invalid JSON, an unset --secret-env)
  3  no record for that operation
  4  resolve refused: the record moved since it was read (another epoch, or no longer
     UNKNOWN or IN_PROGRESS); read it again with `show` and decide again";

/// Inspect and repair an idem store: counts, stuck and unknown operations, one record
/// in full, an operator's resolution, purging and the schema.
#[derive(Parser, Debug)]
#[command(name = "idem", version, after_help = EXIT_CODES)]
struct Cli {
    /// The store: `sqlite://PATH`, `postgres://USER@HOST[:PORT]/DB` or
    /// `mysql://USER@HOST[:PORT]/DB`.
    // The URL may hold a password: `--help` names the variable, never its value.
    #[arg(long, env = "IDEM_URL", hide_env_values = true, global = true)]
    url: Option<String>,
    /// The table the application configured with `IdemBuilder::table`.
    #[arg(long, default_value = "idem_operations", global = true)]
    table: String,
    /// The environment variable holding the secret the application passes to
    /// `IdemBuilder::hash_keys` (keys and scopes are then stored hashed).
    #[arg(long, value_name = "VAR", global = true)]
    secret_env: Option<String>,
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
    /// One record in full: state, epoch, ages, lease, outcome.
    Show(Target),
    /// Settle an UNKNOWN or stuck IN_PROGRESS operation, fenced by the epoch read.
    Resolve(ResolveArgs),
    /// Delete completed records past their retention.
    Purge,
    /// Print the DDL idem applies on open, for `migrate(false)` deployments.
    Schema {
        /// The database.
        dialect: Dialect,
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
    /// Only records in this scope (as the application passes it; see `--encoded`).
    #[arg(long)]
    scope: Option<String>,
    /// Only records of this operation name.
    #[arg(long)]
    name: Option<String>,
    /// At most this many records.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// The scope is given encoded, as `list` prints it.
    #[arg(long)]
    encoded: bool,
}

/// One operation.
#[derive(Args, Debug)]
struct Target {
    /// The scope as the application passes it (`""` for none).
    scope: String,
    /// The operation name (the function's name unless `name = ...` was given).
    name: String,
    /// The key as the application passes it: a string, or an integer with `--int-key`.
    key: String,
    /// The key is an integer.
    #[arg(long)]
    int_key: bool,
    /// SCOPE and KEY are given encoded, as `list` prints them (copy keys holding control
    /// characters, which the table shows escaped, from `list --json`).
    #[arg(long, conflicts_with = "int_key")]
    encoded: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("resolution").required(true)))]
struct ResolveArgs {
    #[command(flatten)]
    target: Target,
    /// The effect happened: record this JSON as the outcome (the function's `Ok` value).
    #[arg(long, value_name = "JSON", group = "resolution")]
    completed: Option<String>,
    /// The effect was refused: record this JSON as the error (the function's `Err`).
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

#[derive(Clone, Copy, Debug, ValueEnum)]
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
            let lines: Vec<_> = f.message.lines().map(shown).collect();
            eprintln!("idem: {}", lines.join("\n"));
            ExitCode::from(f.code)
        }
    }
}

async fn run(cli: &Cli) -> Result<(), Failure> {
    if let Command::Schema { dialect } = &cli.command {
        let sql = match dialect {
            Dialect::Sqlite => idem_runtime::schema::SQLITE_SCHEMA_SQL,
            Dialect::Postgres => idem_runtime::schema::POSTGRES_SCHEMA_SQL,
            Dialect::Mysql => idem_runtime::schema::MYSQL_SCHEMA_SQL,
        };
        // Companion objects share the table's name as a prefix.
        print!("{}", sql.replace("idem_operations", &cli.table));
        return Ok(());
    }
    let idem = open(cli).await?;
    match &cli.command {
        Command::Stats => stats(cli, &idem).await,
        Command::List(args) => list(cli, &idem, args).await,
        Command::Show(target) => show(cli, &idem, target).await,
        Command::Resolve(args) => resolve(cli, &idem, args).await,
        Command::Purge => {
            let purged = idem.purge_expired().await?;
            if cli.json {
                println!("{}", json!({ "purged": purged }));
            } else {
                println!("purged {purged} expired records");
            }
            Ok(())
        }
        Command::Schema { .. } => unreachable!("handled above"),
    }
}

async fn open(cli: &Cli) -> Result<Idem, Failure> {
    let Some(url) = cli.url.as_deref() else {
        return Err(Failure {
            code: 2,
            message: "no store given: pass --url sqlite://PATH, --url postgres://USER@HOST/DB \
                      or --url mysql://USER@HOST/DB (or set IDEM_URL)"
                .into(),
        });
    };
    // Never create or migrate from here: an operator pointing at the wrong database
    // must get an error, not a fresh empty table.
    let mut builder = Idem::builder().table(&cli.table).migrate(false);
    if let Some(var) = &cli.secret_env {
        let secret = std::env::var(var).map_err(|_| Failure {
            code: 2,
            message: format!("--secret-env {var}: the environment variable `{var}` is not set"),
        })?;
        builder = builder.hash_keys(secret);
    }
    let opened = if let Some(path) = url.strip_prefix("sqlite://") {
        if !path.starts_with(':') && !std::path::Path::new(path).exists() {
            return Err(Failure::store(format!(
                "no SQLite database at `{path}`; check the path in --url"
            )));
        }
        builder.sqlite(url).await
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        builder.postgres(url).await
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        builder.mysql(url).await
    } else {
        // Only the scheme is shown: the rest of the URL may hold a password.
        let scheme = match url.split_once("://") {
            Some((scheme, _))
                if scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                    && scheme
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
            {
                format!("with the scheme `{scheme}://`")
            }
            _ => "without a `scheme://`".to_owned(),
        };
        return Err(Failure {
            code: 2,
            message: format!(
                "unsupported store URL ({scheme}); expected sqlite://PATH, \
                 postgres://USER@HOST[:PORT]/DB or mysql://USER@HOST[:PORT]/DB"
            ),
        });
    };
    opened.map_err(|e| match e {
        IdemError::Config { message } if message.contains("missing") => Failure::store(format!(
            "{message}\nhint: pass the application's table with --table, or print its DDL \
                 with `idem schema`"
        )),
        e => e.into(),
    })
}

/// A stored name, scope or key as a terminal shows it: control characters (ESC, CR,
/// ...) and bidirectional overrides escaped, so a stored key cannot move the cursor,
/// clear the screen or disguise another row. `--json` prints them exactly.
fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| {
        c.is_control()
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.contains(unsafe_char) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.into()
}

fn state_name(state: State) -> &'static str {
    match state {
        State::InProgress => "in_progress",
        State::Completed => "completed",
        State::Unknown => "unknown",
    }
}

fn age(d: Option<Duration>) -> String {
    d.map_or_else(
        || "-".into(),
        |d| humantime::format_duration(Duration::from_secs(d.as_secs())).to_string(),
    )
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
                "oldest_in_progress_ms": millis(s.oldest_in_progress),
                "oldest_unknown_ms": millis(s.oldest_unknown),
            })
        );
    } else {
        println!("state         count  oldest");
        println!(
            "in_progress {:>7}  {}",
            s.in_progress,
            age(s.oldest_in_progress)
        );
        println!("completed   {:>7}  -", s.completed);
        println!("unknown     {:>7}  {}", s.unknown, age(s.oldest_unknown));
    }
    Ok(())
}

async fn list(cli: &Cli, idem: &Idem, args: &ListArgs) -> Result<(), Failure> {
    let scope = args.scope.as_deref().map(|s| {
        if args.encoded || s.is_empty() {
            s.to_string()
        } else {
            idem.operation("", "").scope(s).id().scope.clone()
        }
    });
    let filter = ListFilter {
        state: args.state.map(|s| match s {
            StateArg::InProgress => State::InProgress,
            StateArg::Completed => State::Completed,
            StateArg::Unknown => State::Unknown,
        }),
        name: args.name.clone(),
        scope,
        older_than: args.older_than,
        limit: Some(args.limit),
    };
    let rows = idem.list(&filter).await?;
    if cli.json {
        let rows: Vec<Value> = rows
            .iter()
            .map(|r| {
                json!({
                    "scope": r.id.scope, "name": r.id.name, "key": r.id.key,
                    "state": state_name(r.state), "epoch": r.epoch,
                    "age_ms": r.age.as_millis() as u64,
                })
            })
            .collect();
        println!("{}", Value::Array(rows));
    } else {
        println!(
            "{:<12} {:>6} {:>12}  {:<20} {:<20} key",
            "state", "epoch", "age", "scope", "name"
        );
        for r in &rows {
            println!(
                "{:<12} {:>6} {:>12}  {:<20} {:<20} {}",
                state_name(r.state),
                r.epoch,
                age(Some(r.age)),
                shown(&r.id.scope),
                shown(&r.id.name),
                shown(&r.id.key)
            );
        }
        if rows.is_empty() {
            println!("(no records)");
        }
    }
    Ok(())
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
        idem.operation(&target.name, target.key.as_str())
    };
    let op = if target.scope.is_empty() {
        op
    } else {
        op.scope(target.scope.as_str())
    };
    Ok(op.id().clone())
}

async fn read(idem: &Idem, id: &OperationId) -> Result<RecordDetail, Failure> {
    idem.get(id).await?.ok_or_else(|| Failure {
        code: 3,
        message: format!(
            "no record for operation `{}` with scope `{}` and key `{}`; check the name, and \
             pass --int-key for integer keys or --encoded for keys copied from `list`",
            shown(&id.name),
            shown(&id.scope),
            shown(&id.key)
        ),
    })
}

fn outcome_json(outcome: &StoredOutcome) -> Value {
    let body = serde_json::from_slice::<Value>(&outcome.body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&outcome.body).into_owned()));
    json!({ "is_err": outcome.is_err, "version": outcome.version, "body": body })
}

async fn show(cli: &Cli, idem: &Idem, target: &Target) -> Result<(), Failure> {
    let id = operation_id(idem, target)?;
    let d = read(idem, &id).await?;
    if cli.json {
        println!(
            "{}",
            json!({
                "scope": d.info.id.scope, "name": d.info.id.name, "key": d.info.id.key,
                "state": state_name(d.info.state), "epoch": d.info.epoch,
                "age_ms": d.info.age.as_millis() as u64,
                "lease_remaining_ms": millis(d.lease_remaining),
                "expires_in_ms": millis(d.expires_in),
                "outcome": d.outcome.as_ref().map(outcome_json),
            })
        );
    } else {
        println!("operation  {}", shown(&d.info.id.name));
        println!("scope      {}", shown(&d.info.id.scope));
        println!("key        {}", shown(&d.info.id.key));
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
            println!("{kind:<10} {}", outcome_json(outcome)["body"]);
        }
    }
    Ok(())
}

async fn resolve(cli: &Cli, idem: &Idem, args: &ResolveArgs) -> Result<(), Failure> {
    let id = operation_id(idem, &args.target)?;
    let current = read(idem, &id).await?;
    let epoch = args.epoch.unwrap_or(current.info.epoch);
    let refused = |why: String| Failure {
        code: 4,
        message: why,
    };
    if current.info.state == State::Completed {
        return Err(refused(format!(
            "operation `{}` is already COMPLETED at epoch {}; nothing to resolve",
            shown(&id.name),
            current.info.epoch
        )));
    }
    if current.info.epoch != epoch {
        return Err(refused(format!(
            "operation `{}` is at epoch {}, not {epoch}: another attempt claimed it since; \
             check it with `show` and decide again",
            shown(&id.name),
            current.info.epoch
        )));
    }
    let parse = |flag: &str, text: &str| {
        serde_json::from_str::<Value>(text).map_err(|e| Failure {
            code: 2,
            message: format!("--{flag}: not valid JSON ({e}); quote it for the shell"),
        })
    };
    let resolution = if let Some(text) = &args.completed {
        Resolution::Completed {
            outcome: parse("completed", text)?,
            version: args.version,
            retain: args.retain,
        }
    } else if let Some(text) = &args.rejected {
        Resolution::Rejected {
            error: parse("rejected", text)?,
            version: args.version,
            retain: args.retain,
        }
    } else {
        Resolution::Retry
    };
    let what = match &resolution {
        Resolution::Retry => "retry",
        Resolution::Completed { .. } => "completed",
        Resolution::Rejected { .. } => "rejected",
    };
    // The store applies it only while the record is still at `epoch`.
    idem.resolve(&id, epoch, resolution).await?;
    if cli.json {
        println!("{}", json!({ "resolved": what, "epoch": epoch }));
    } else {
        println!("resolved `{}` at epoch {epoch}: {what}", shown(&id.name));
    }
    Ok(())
}
