//! Opening any store by URL: [`Idem::connect`] and [`IdemBuilder::connect`] read the
//! URL's scheme and open the store it names with the builder's method for that store,
//! so the builder's options and the URL's parameters apply as they do there.

use crate::{Idem, IdemBuilder, IdemError};

/// The URL forms [`IdemBuilder::connect`] takes, as its refusal of another lists them.
const EXPECTED: &str = "expected sqlite://PATH or sqlite::memory:, \
    postgres://USER@HOST[:PORT]/DB (or postgresql://), mysql://USER@HOST[:PORT]/DB (or \
    mariadb://), redis://HOST[:PORT] (or rediss://, valkey://, valkeys://, redis+unix://), \
    redis+cluster://HOST:PORT,HOST:PORT (or rediss+cluster://), dynamodb://TABLE, or memory:";

/// The schemes of one Redis server or cluster node reached over TCP.
const REDIS_NODE_SCHEMES: [&str; 4] = ["redis", "rediss", "valkey", "valkeys"];

impl Idem {
    /// Opens the store `url` names, chosen by its scheme as sqlx's `Any` driver chooses
    /// a database. Each store is opened by its own method ([`Idem::sqlite`],
    /// [`Idem::postgres`], ...), which reads the rest of the URL as it always does (a
    /// SQLite file is created if missing, TLS as `sslmode=` or `rediss://` asks). With
    /// builder options (table, key prefix, `hash_keys`, a TLS root certificate), use
    /// [`IdemBuilder::connect`].
    ///
    /// | URL | store | feature of idem-runtime |
    /// |---|---|---|
    /// | `sqlite://PATH`, `sqlite:PATH`, `sqlite::memory:` | [`IdemBuilder::sqlite`] | `sqlite` (default) |
    /// | `postgres://…`, `postgresql://…` | [`IdemBuilder::postgres`] | `postgres` |
    /// | `mysql://…`, `mariadb://…` (read as `mysql://…`) | [`IdemBuilder::mysql`] | `mysql` |
    /// | `redis://…`, `rediss://…`, `valkey://…`, `valkeys://…`, `redis+unix://…`, `valkey+unix://…` | [`IdemBuilder::redis`] | `redis` |
    /// | `redis+cluster://[USER:PASSWORD@]HOST:PORT,HOST:PORT[/…]` (`rediss+cluster://` with TLS), or several `redis://` URLs separated by commas | [`IdemBuilder::redis_cluster`], the user, password and path given to every node | `redis` |
    /// | `dynamodb://TABLE` | [`IdemBuilder::dynamodb`], with a client from the environment: `AWS_REGION` (or `AWS_DEFAULT_REGION`), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_SESSION_TOKEN`, and `AWS_ENDPOINT_URL_DYNAMODB` (or `AWS_ENDPOINT_URL`) for a local server; for roles, SSO and the rest of the SDK's chain, build the client with `aws-config` and call [`Idem::dynamodb`] | `dynamodb` |
    /// | `memory:` | [`IdemBuilder::memory`] | none |
    ///
    /// Schemes are matched without regard to case. A scheme whose feature is off, or
    /// that no store takes, is an [`IdemError::Config`] saying which feature to enable
    /// or which schemes there are, quoting nothing of the URL but its scheme; the
    /// stores' own errors show a URL with its password redacted (Redis: its host alone).
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let embedded = Idem::connect("sqlite::memory:").await?; // Idem::sqlite("sqlite::memory:")
    /// let in_process = Idem::connect("memory:").await?; // Idem::memory()
    /// # let _ = (embedded, in_process);
    /// # Ok(()) }
    /// ```
    ///
    /// ```no_run
    /// # use idem_runtime::Idem;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let idem = Idem::connect(&std::env::var("DATABASE_URL")?).await?; // whichever store
    /// let pg = Idem::connect("postgres://app@db.internal:5432/app?sslmode=require").await?;
    /// let maria = Idem::connect("mariadb://app@db.internal:3306/app").await?;
    /// let cluster = Idem::connect("redis+cluster://10.0.0.1:6379,10.0.0.2:6379").await?;
    /// # let _ = (idem, pg, maria, cluster);
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Idem, IdemError> {
        IdemBuilder::default().connect(url).await
    }
}

impl IdemBuilder {
    /// Opens the store `url` names with this builder's options; see [`Idem::connect`]
    /// for the schemes and the feature each needs. It calls the builder's method for
    /// that store ([`sqlite`](Self::sqlite), [`postgres`](Self::postgres), ...), so
    /// every option applies as it does there: [`table`](Self::table) on the SQL
    /// stores, [`key_prefix`](Self::key_prefix) on Redis, and
    /// [`migrate`](Self::migrate), [`hash_keys`](Self::hash_keys),
    /// [`tls_root_certificate`](Self::tls_root_certificate), ... wherever their store
    /// reads them.
    ///
    /// Unlike [`memory`](Self::memory), `connect("memory:")` returns a short
    /// [`hash_keys`](Self::hash_keys) secret as an [`IdemError::Config`] rather than
    /// panicking.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let url = "sqlite::memory:"; // or postgres://…, redis://…, from configuration
    /// let idem = Idem::builder()
    ///     .table("billing_idem") // read by the SQL stores
    ///     .max_outcome_bytes(16 * 1024)
    ///     .connect(url)
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    pub async fn connect(self, url: &str) -> Result<Idem, IdemError> {
        let target = Target::parse(url)?;
        target.open(self).await
    }
}

/// The store a URL names, read before anything is opened; each URL is in the form its
/// store's method takes, the scheme lowercased.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    Memory,
    Sqlite(String),
    Postgres(String),
    MySql(String),
    Redis(String),
    /// A Redis Cluster's nodes, each a `redis://` (or `rediss://`, ...) URL.
    RedisCluster(Vec<String>),
    /// A DynamoDB table's name.
    DynamoDb(String),
}

impl Target {
    fn parse(url: &str) -> Result<Target, IdemError> {
        let url = url.trim();
        let Some((scheme, rest)) = split_scheme(url) else {
            return Err(unsupported(if url.is_empty() {
                "an empty URL".to_owned()
            } else {
                "a URL without a scheme (a SQLite file is sqlite://PATH)".to_owned()
            }));
        };
        let scheme = scheme.to_ascii_lowercase();
        let lowered = format!("{scheme}:{rest}");
        match scheme.as_str() {
            "memory" if rest.is_empty() || rest == "//" => Ok(Target::Memory),
            "memory" => Err(invalid(
                "`memory:` names the process-local store and takes nothing after its scheme",
            )),
            "sqlite" => Ok(Target::Sqlite(lowered)),
            "postgres" | "postgresql" => Ok(Target::Postgres(lowered)),
            "mysql" => Ok(Target::MySql(lowered)),
            // sqlx's MySQL driver reads both; passed on in the spelling idem's messages use.
            "mariadb" => Ok(Target::MySql(format!("mysql:{rest}"))),
            "redis" | "rediss" | "valkey" | "valkeys" | "redis+unix" | "valkey+unix" => {
                redis_urls(&lowered)
            }
            "redis+cluster" | "rediss+cluster" => cluster_nodes(&scheme, rest),
            "dynamodb" => dynamodb_table(rest),
            _ => Err(unsupported(format!(
                "with the scheme `{}`",
                shown_scheme(url)
            ))),
        }
    }

    async fn open(self, builder: IdemBuilder) -> Result<Idem, IdemError> {
        match self {
            Target::Memory => {
                // `memory` panics on a bad secret; a `Result` can say so instead.
                builder.check_secret()?;
                Ok(builder.memory())
            }
            Target::Sqlite(url) => {
                #[cfg(feature = "sqlite")]
                {
                    builder.sqlite(&url).await
                }
                #[cfg(not(feature = "sqlite"))]
                {
                    Err(feature_off("sqlite", &url))
                }
            }
            Target::Postgres(url) => {
                #[cfg(feature = "postgres")]
                {
                    builder.postgres(&url).await
                }
                #[cfg(not(feature = "postgres"))]
                {
                    Err(feature_off("postgres", &url))
                }
            }
            Target::MySql(url) => {
                #[cfg(feature = "mysql")]
                {
                    builder.mysql(&url).await
                }
                #[cfg(not(feature = "mysql"))]
                {
                    Err(feature_off("mysql", &url))
                }
            }
            Target::Redis(url) => {
                #[cfg(feature = "redis")]
                {
                    builder.redis(&url).await
                }
                #[cfg(not(feature = "redis"))]
                {
                    Err(feature_off("redis", &url))
                }
            }
            Target::DynamoDb(table) => {
                #[cfg(feature = "dynamodb")]
                {
                    let client = crate::store::dynamodb::client_from_env();
                    builder.dynamodb(client, &table).await
                }
                #[cfg(not(feature = "dynamodb"))]
                {
                    Err(feature_off("dynamodb", &format!("dynamodb://{table}")))
                }
            }
            Target::RedisCluster(nodes) => {
                #[cfg(feature = "redis")]
                {
                    let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
                    builder.redis_cluster(&nodes).await
                }
                #[cfg(not(feature = "redis"))]
                {
                    Err(feature_off("redis", &nodes[0]))
                }
            }
        }
    }
}

/// `url`'s scheme and what follows its `:`, when it starts with a well-formed scheme
/// (a letter, then letters, digits, `+`, `-` or `.`).
fn split_scheme(url: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = url.split_once(':')?;
    let well_formed = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    well_formed.then_some((scheme, rest))
}

/// The scheme of `url` as messages show it (`postgres://`, `sqlite:`), lowercased;
/// nothing else of the URL, which may hold a password.
fn shown_scheme(url: &str) -> String {
    match split_scheme(url.trim()) {
        Some((scheme, rest)) => {
            let slashes = if rest.starts_with("//") { "//" } else { "" };
            format!("{}:{slashes}", scheme.to_ascii_lowercase())
        }
        None => "(none)".to_owned(),
    }
}

/// A Redis URL, or several separated by commas (a cluster's nodes). A comma splits only
/// where another `scheme://` follows it, so a comma in a password does not.
fn redis_urls(list: &str) -> Result<Target, IdemError> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (comma, _) in list.match_indices(',') {
        let next = list[comma + 1..].trim_start();
        if split_scheme(next).is_some_and(|(_, rest)| rest.starts_with("//")) {
            parts.push(list[start..comma].trim());
            start = comma + 1;
        }
    }
    if start == 0 {
        return Ok(Target::Redis(list.to_owned()));
    }
    parts.push(list[start..].trim());
    let mut nodes = Vec::with_capacity(parts.len());
    for (i, node) in parts.into_iter().enumerate() {
        let scheme = split_scheme(node).map(|(s, _)| s.to_ascii_lowercase());
        match scheme {
            Some(s) if REDIS_NODE_SCHEMES.contains(&s.as_str()) => {
                nodes.push(format!("{s}{}", &node[s.len()..]));
            }
            _ => {
                return Err(unsupported(format!(
                    "node {} of a Redis Cluster has the scheme `{}`; each node is a \
                     redis:// or rediss:// URL",
                    i + 1,
                    shown_scheme(node)
                )));
            }
        }
    }
    Ok(Target::RedisCluster(nodes))
}

/// The nodes of `redis+cluster://[USER:PASSWORD@]HOST:PORT,HOST:PORT[/DB][?…]` (after
/// `scheme:`, as `rest`): one `redis://` URL per host, each with the user info and the
/// path and query.
fn cluster_nodes(scheme: &str, rest: &str) -> Result<Target, IdemError> {
    let node_scheme = scheme.trim_end_matches("+cluster");
    let form = format!("{scheme}://HOST:PORT,HOST:PORT");
    let Some(body) = rest.strip_prefix("//") else {
        return Err(invalid(&format!("a `{scheme}:` URL is written {form}")));
    };
    // The authority ends where the URL's path, query or fragment begins; its user info
    // ends at its last `@`.
    let end = body.find(['/', '?', '#']).unwrap_or(body.len());
    let (authority, tail) = body.split_at(end);
    let (user_info, hosts) = match authority.rfind('@') {
        Some(at) => authority.split_at(at + 1),
        None => ("", authority),
    };
    let mut nodes = Vec::new();
    for (i, host) in hosts.split(',').map(str::trim).enumerate() {
        if host.is_empty() {
            return Err(invalid(&format!(
                "node {} of the `{scheme}://` URL is empty; write {form}",
                i + 1
            )));
        }
        nodes.push(format!("{node_scheme}://{user_info}{host}{tail}"));
    }
    Ok(Target::RedisCluster(nodes))
}

/// The refusal of a URL no store takes; `what` names its scheme at most.
fn unsupported(what: String) -> IdemError {
    IdemError::Config {
        message: format!("unsupported store URL ({what}); {EXPECTED}"),
    }
}

/// The refusal of a URL of a known scheme in a shape no store takes.
fn invalid(why: &str) -> IdemError {
    IdemError::Config {
        message: format!("invalid store URL: {why}"),
    }
}

/// The table of `dynamodb://TABLE`: DynamoDB's table names are 3 to 255 of
/// `[A-Za-z0-9_.-]`.
fn dynamodb_table(rest: &str) -> Result<Target, IdemError> {
    let table = rest
        .strip_prefix("//")
        .unwrap_or(rest)
        .trim_end_matches('/');
    let valid = (3..=255).contains(&table.len())
        && table
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if valid {
        return Ok(Target::DynamoDb(table.to_owned()));
    }
    Err(invalid(
        "`dynamodb://TABLE` names a DynamoDB table: 3 to 255 letters, digits, `_`, `.` or `-`",
    ))
}

/// The refusal of a URL whose store's cargo feature is off.
#[cfg_attr(
    all(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis",
        feature = "dynamodb"
    ),
    allow(dead_code)
)]
fn feature_off(feature: &str, url: &str) -> IdemError {
    IdemError::Config {
        message: format!(
            "the `{feature}` feature of idem-runtime is off; enable it (features = \
             [\"{feature}\"] on idem-runtime in Cargo.toml) to open `{}` URLs",
            shown_scheme(url)
        ),
    }
}

/// The host (and port) of each Redis node URL, as an error may show them: without user
/// info, path or query, which may hold a password (a Unix socket's path is kept).
#[cfg(feature = "redis")]
pub(crate) fn redis_shown(nodes: &[&str]) -> String {
    let shown: Vec<String> = nodes
        .iter()
        .map(|node| {
            let Some((scheme, rest)) = node.trim().split_once("://") else {
                return "(a URL without `://`)".to_owned();
            };
            // Everything to the last `@` is user info, wherever a stray `/` or `?` in a
            // password would end it for a parser: a message may show less, never more.
            let after = rest.rfind('@').map_or(rest, |at| &rest[at + 1..]);
            let end = if scheme.ends_with("+unix") {
                after.find(['?', '#'])
            } else {
                after.find(['/', '?', '#'])
            };
            format!("{scheme}://{}", &after[..end.unwrap_or(after.len())])
        })
        .collect();
    shown.join(", ")
}

/// `e`, a failure to reach the Redis `nodes`, saying which nodes it could not reach.
#[cfg(feature = "redis")]
pub(crate) fn redis_located(e: IdemError, nodes: &[&str]) -> IdemError {
    match e {
        IdemError::Store {
            during: during @ "connect",
            retryable,
            source,
        } => IdemError::Store {
            during,
            retryable,
            source: format!(
                "cannot connect to Redis at {}: {source}",
                redis_shown(nodes)
            )
            .into(),
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(url: &str) -> Target {
        Target::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    fn refusal(url: &str) -> String {
        match Target::parse(url) {
            Ok(t) => panic!("{url} parsed as {t:?}"),
            Err(IdemError::Config { message }) => message,
            Err(e) => panic!("{url}: not a Config error: {e}"),
        }
    }

    #[test]
    fn each_scheme_names_its_store() {
        assert_eq!(parsed("memory:"), Target::Memory);
        assert_eq!(parsed(" memory:// "), Target::Memory);
        for url in [
            "sqlite::memory:",
            "sqlite://idem.db?mode=rwc",
            "sqlite:idem.db",
        ] {
            assert_eq!(parsed(url), Target::Sqlite(url.into()));
        }
        for url in [
            "postgres://u@h/db",
            "postgresql://u@h:5433/db?sslmode=require",
        ] {
            assert_eq!(parsed(url), Target::Postgres(url.into()));
        }
        assert_eq!(
            parsed("mysql://u@h/db"),
            Target::MySql("mysql://u@h/db".into())
        );
        assert_eq!(
            parsed("mariadb://u:p@h:3307/db?ssl-mode=required"),
            Target::MySql("mysql://u:p@h:3307/db?ssl-mode=required".into())
        );
        for url in [
            "redis://127.0.0.1:6379",
            "rediss://:p@cache:6380/2",
            "valkey://h",
            "redis+unix:///run/redis.sock",
        ] {
            assert_eq!(parsed(url), Target::Redis(url.into()));
        }
        // Schemes are matched without regard to case, and passed on lowercased.
        assert_eq!(
            parsed("PostgreSQL://U@H/DB"),
            Target::Postgres("postgresql://U@H/DB".into())
        );
        assert_eq!(
            parsed("SQLite::memory:"),
            Target::Sqlite("sqlite::memory:".into())
        );
        assert_eq!(parsed("MEMORY:"), Target::Memory);
    }

    #[test]
    fn cluster_urls_name_every_node() {
        assert_eq!(
            parsed("redis+cluster://10.0.0.1:6379,10.0.0.2:6379"),
            Target::RedisCluster(vec![
                "redis://10.0.0.1:6379".into(),
                "redis://10.0.0.2:6379".into()
            ])
        );
        // User info, path and query go to every node; a comma in the password is not a
        // separator.
        assert_eq!(
            parsed("rediss+cluster://u:p,w@a:1, b:2/0?protocol=resp3"),
            Target::RedisCluster(vec![
                "rediss://u:p,w@a:1/0?protocol=resp3".into(),
                "rediss://u:p,w@b:2/0?protocol=resp3".into()
            ])
        );
        // One host is still a cluster.
        assert_eq!(
            parsed("redis+cluster://a:1"),
            Target::RedisCluster(vec!["redis://a:1".into()])
        );
        // Node URLs separated by commas, as `idem --url` has taken them.
        assert_eq!(
            parsed("redis://a:1,REDISS://:p,w@b:2"),
            Target::RedisCluster(vec!["redis://a:1".into(), "rediss://:p,w@b:2".into()])
        );
        assert_eq!(
            parsed("redis://:p,w@a:1"),
            Target::Redis("redis://:p,w@a:1".into())
        );
    }

    #[test]
    fn unknown_schemes_list_the_known_ones() {
        let message = refusal("mongodb://u:hunter2@h:27017/db");
        assert!(
            message.starts_with("unsupported store URL (with the scheme `mongodb://`)"),
            "{message}"
        );
        for scheme in [
            "sqlite://",
            "sqlite::memory:",
            "postgres://",
            "postgresql://",
            "mysql://",
            "mariadb://",
            "redis://",
            "rediss://",
            "redis+cluster://",
            "memory:",
        ] {
            assert!(message.contains(scheme), "{scheme}: {message}");
        }
        assert!(refusal("").contains("an empty URL"));
        assert!(refusal("idem.db").contains("without a scheme"));
        assert!(refusal("/var/lib/idem.db").contains("sqlite://PATH"));
        assert!(refusal("memory:x").starts_with("invalid store URL"));
        let mixed = refusal("redis://a:1,postgres://u:hunter2@h/db");
        assert!(
            mixed.contains("node 2") && mixed.contains("`postgres://`"),
            "{mixed}"
        );
        assert!(refusal("redis+cluster://a:1,,b:2").contains("node 2"));
        assert!(refusal("redis+cluster://u:hunter2@").contains("node 1"));
        assert!(refusal("redis+cluster:a:1").contains("redis+cluster://HOST:PORT"));
    }

    /// No refusal quotes a URL's password, wherever it stands.
    #[test]
    fn no_refusal_shows_a_password() {
        for url in [
            "mongodb://u:hunter2@h",
            "http://u:hunter2@h/x?password=hunter2",
            "u:hunter2@db/app",
            ":hunter2@db",
            "hunter2",
            "memory://u:hunter2@h",
            "redis://a:1,postgres://u:hunter2@h/db",
            "redis+cluster://u:hunter2@a:1,",
            "redis+cluster:u:hunter2@a:1",
        ] {
            let message = refusal(url);
            assert!(!message.contains("hunter2"), "{url}: {message}");
        }
    }

    #[test]
    fn a_disabled_feature_is_named_with_what_to_enable() {
        let IdemError::Config { message } = feature_off("postgres", "postgresql://u:hunter2@h/db")
        else {
            unreachable!()
        };
        assert_eq!(
            message,
            "the `postgres` feature of idem-runtime is off; enable it (features = \
             [\"postgres\"] on idem-runtime in Cargo.toml) to open `postgresql://` URLs"
        );
    }

    /// Each store whose feature this build leaves off is refused with that feature's
    /// name, before anything is opened.
    #[tokio::test]
    async fn stores_whose_feature_is_off_are_refused() {
        let off: &[(&str, &str)] = &[
            #[cfg(not(feature = "sqlite"))]
            ("sqlite::memory:", "sqlite"),
            #[cfg(not(feature = "postgres"))]
            ("postgres://u:hunter2@127.0.0.1:1/db", "postgres"),
            #[cfg(not(feature = "mysql"))]
            ("mariadb://u:hunter2@127.0.0.1:1/db", "mysql"),
            #[cfg(not(feature = "redis"))]
            ("redis://:hunter2@127.0.0.1:1", "redis"),
            #[cfg(not(feature = "redis"))]
            ("redis+cluster://:hunter2@127.0.0.1:1,127.0.0.1:2", "redis"),
        ];
        for (url, feature) in off {
            let Err(IdemError::Config { message }) = Idem::connect(url).await else {
                panic!("{url} opened without the `{feature}` feature");
            };
            assert!(
                message.starts_with(&format!("the `{feature}` feature of idem-runtime is off")),
                "{message}"
            );
            assert!(!message.contains("hunter2"), "{message}");
        }
    }

    #[tokio::test]
    async fn memory_opens_and_refuses_a_short_secret() {
        let idem = Idem::connect("memory:").await.unwrap();
        let n = idem
            .operation("count", "c-1")
            .retain(std::time::Duration::from_secs(60))
            .fingerprint_none()
            .run(|| async { Ok::<_, IdemError>(7) })
            .await
            .unwrap();
        assert_eq!(n, 7);
        let short = Idem::builder().hash_keys(b"short").connect("memory:").await;
        assert!(matches!(short, Err(IdemError::Config { .. })), "{short:?}");
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn sqlite_opens_with_the_builders_table() {
        let idem = Idem::builder()
            .table("connect_unit")
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let listed = idem.list(&crate::ListFilter::default()).await.unwrap();
        assert!(listed.is_empty());
    }

    #[cfg(feature = "redis")]
    #[test]
    fn redis_nodes_are_shown_without_their_secrets() {
        assert_eq!(
            redis_shown(&[
                "redis://:hunter2@127.0.0.1:1/0?password=hunter2",
                "rediss://u:pa/ss?x@h:2",
                "redis+unix:///run/redis.sock?pass=hunter2",
            ]),
            "redis://127.0.0.1:1, rediss://h:2, redis+unix:///run/redis.sock"
        );
    }
}
