//! What the SQL stores on a database server reached by URL share (PostgreSQL, MySQL):
//! the first connection of an open, and why it failed in words an operator can act on
//! (refused, no slot left, a TLS handshake refused); URLs with their secrets redacted
//! for messages; and pools that ping a connection only after it sat idle.

use std::time::Duration;

use crate::error::{IdemError, StoreError};

/// How long opening a server store waits for its first connection: sqlx's default
/// acquire timeout, which bounded the open before.
const FIRST_CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a server store connects, and how its errors read, for [`first_connection`].
pub(crate) struct Server<'a> {
    /// The database's name in messages: `PostgreSQL`, `MySQL`.
    pub(crate) db: &'static str,
    /// The URL with its password redacted.
    pub(crate) shown: &'a str,
    /// `host:port`, or the Unix socket's path.
    pub(crate) at: String,
    /// The dialect's error mapping.
    pub(crate) map_err: fn(sqlx::Error) -> StoreError,
    /// Whether an error says the server has no connection slot left (PostgreSQL's
    /// SQLSTATE 53300, MySQL's 1040).
    pub(crate) is_full: fn(&sqlx::Error) -> bool,
    /// The connections idem holds to the server, at most, for messages.
    pub(crate) footprint: String,
    /// The URL parameters that ask for TLS and name the server's CA (`sslmode` and
    /// `sslrootcert` on PostgreSQL), for messages.
    pub(crate) tls_params: (&'static str, &'static str),
}

/// Opens one connection to the server, once, and says why it failed. A sqlx pool
/// retries a refused connection, and a server with no connection slot left, until its
/// acquire timeout and then reports only that it timed out; opening with one
/// connection first reports the cause at once, with the connections idem would hold.
pub(crate) async fn first_connection<O: sqlx::ConnectOptions>(
    server: &Server<'_>,
    options: &O,
) -> Result<O::Connection, IdemError>
where
    O::Connection: Sized,
{
    let Server {
        db,
        shown,
        at,
        map_err,
        is_full,
        footprint,
        tls_params,
    } = server;
    let (cause, retryable, unreachable) =
        match tokio::time::timeout(FIRST_CONNECTION_TIMEOUT, options.connect()).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(sqlx::Error::Io(e))) if e.kind() == std::io::ErrorKind::ConnectionRefused => (
                format!(
                    "connection refused at {at}: nothing listens there; check the server is up \
                     and the URL's host and port"
                ),
                true,
                true,
            ),
            Ok(Err(sqlx::Error::Tls(e))) => (tls_failure(*tls_params, &*e), false, false),
            // A handshake the TLS library refused (an untrusted certificate, another
            // host's name) reaches sqlx as an I/O error carrying the TLS error.
            Ok(Err(sqlx::Error::Io(e)))
                if e.kind() == std::io::ErrorKind::InvalidData && e.get_ref().is_some() =>
            {
                (tls_failure(*tls_params, &e), false, false)
            }
            Ok(Err(e)) if is_full(&e) => {
                let e = map_err(e);
                let cause = format!(
                    "the server has no connection slot left (too many connections: {}); \
                     {footprint}: free slots on the server (raise its `max_connections`, or \
                     close idle sessions), or lower idem's with `IdemBuilder::max_connections`",
                    e.source
                );
                (cause, e.retryable, e.unreachable)
            }
            Ok(Err(e)) => {
                let e = map_err(e);
                let cause = format!(
                    "{}; check the server is up and the URL's host, port, user and database",
                    e.source
                );
                (cause, e.retryable, e.unreachable)
            }
            Err(_) => (
                format!(
                    "no connection to {at} within {}s; check the URL's host and port, and that \
                     no firewall drops the traffic",
                    FIRST_CONNECTION_TIMEOUT.as_secs()
                ),
                true,
                true,
            ),
        };
    let mut err = StoreError::new(
        retryable,
        format!("cannot connect to {db} at `{shown}`: {cause}"),
    );
    err.unreachable = unreachable;
    Err(IdemError::store("connecting", err))
}

/// Why a TLS handshake failed, and what to change: the feature that brings TLS, or the
/// URL parameter (`ca` of the server's `(mode, ca)`) that names the server's CA.
fn tls_failure((mode, ca): (&str, &str), e: &(dyn std::error::Error + Send + Sync)) -> String {
    let text = e.to_string();
    if text.contains("without TLS support") {
        return format!(
            "the URL asks for TLS ({mode}) and idem-runtime was built without it: enable its \
             `tls-rustls` (or `tls-native-tls`) feature"
        );
    }
    format!(
        "the TLS handshake failed: {text}; check that the server's certificate is signed by \
         a CA this process trusts (name the server's CA file with `{ca}=` in the URL) and \
         that it names the host the URL gives, or lower `{mode}` only if you accept an \
         unverified server"
    )
}

/// A database URL as messages show it: the password, and the value of every query
/// parameter that may hold a secret, replaced by `***`.
///
/// Read as the driver reads it where it parses. A password with an unencoded `/`, `?`
/// or `#` makes the parser end the user info early (or fail), so where the URL does not
/// parse, or leaves an `@` outside the user info, everything from `://` to the last `@`
/// is taken for the user info: a message may then show less than it could, never a
/// password.
pub(crate) fn redact_url(url: &str) -> String {
    let shown = redact_parsed(url).unwrap_or_else(|| redact_user_info(url));
    redact_query(&shown)
}

/// The URL with its password redacted, or `None` when it does not parse, or parses with
/// an `@` outside the user info.
fn redact_parsed(raw: &str) -> Option<String> {
    let mut url = url::Url::parse(raw).ok()?;
    let stray_at = [Some(url.path()), url.query(), url.fragment()]
        .into_iter()
        .flatten()
        .any(|part| part.contains('@') || part.to_ascii_lowercase().contains("%40"));
    if stray_at {
        return None;
    }
    if url.password().is_some_and(|p| !p.is_empty()) {
        url.set_password(Some("***")).ok()?;
    }
    Some(url.into())
}

/// Everything between `://` and the last `@` redacted, keeping a user name that stands
/// plainly before the first `:`.
fn redact_user_info(raw: &str) -> String {
    let Some((scheme, rest)) = raw.split_once("://") else {
        return raw.to_owned();
    };
    let Some((user_info, host)) = rest.rsplit_once('@') else {
        return raw.to_owned();
    };
    match user_info.split_once(':') {
        Some((user, _)) if !user.contains(['/', '?', '#', '@']) => {
            format!("{scheme}://{user}:***@{host}")
        }
        _ => format!("{scheme}://***@{host}"),
    }
}

/// Query parameter names that may hold a secret, as parts of the decoded, lowercased
/// name (`password`, `sslpassword`, `pass`, `pwd`, `secret`, `token`, `api_key`, ...).
const SECRET_PARAMS: [&str; 7] = [
    "pass",
    "pwd",
    "secret",
    "token",
    "key",
    "auth",
    "credential",
];

/// The values of secret-bearing query parameters redacted. A value with an unencoded
/// `&` reads as more parameters; the pieces after it without a `=` are taken for the
/// rest of the value.
fn redact_query(url: &str) -> String {
    let Some((head, rest)) = url.split_once('?') else {
        return url.to_owned();
    };
    let (query, fragment) = match rest.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (rest, None),
    };
    let mut out = format!("{head}?");
    let mut in_secret = false;
    for (i, param) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match param.split_once('=') {
            Some((name, _)) => {
                let decoded = url::form_urlencoded::parse(name.as_bytes())
                    .next()
                    .map_or_else(|| name.to_owned(), |(n, _)| n.into_owned())
                    .to_ascii_lowercase();
                in_secret = SECRET_PARAMS.iter().any(|s| decoded.contains(s));
                out.push_str(name);
                out.push('=');
                if in_secret {
                    out.push_str("***");
                } else {
                    out.push_str(&param[name.len() + 1..]);
                }
            }
            None if in_secret => out.push_str("***"),
            None => out.push_str(param),
        }
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

/// A connection idle for longer than this is pinged before use: short enough that a
/// server restart is caught before a statement fails on a dead connection (restarts take
/// longer than this), long enough that a busy connection is never pinged.
pub(crate) const IDLE_BEFORE_PING: Duration = Duration::from_secs(1);

/// Pool options that ping a connection before use only when it sat idle past
/// [`IDLE_BEFORE_PING`]: sqlx's own test pings every connection it hands out, one extra
/// round trip per statement.
pub(crate) fn pinged_when_idle<DB: sqlx::Database>(
    options: sqlx::pool::PoolOptions<DB>,
) -> sqlx::pool::PoolOptions<DB> {
    options
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > IDLE_BEFORE_PING {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_say_what_to_change() {
        let unbuilt = std::io::Error::other(
            "TLS upgrade required by connect options but SQLx was built without TLS support \
             enabled",
        );
        let message = tls_failure(("sslmode", "sslrootcert"), &unbuilt);
        assert!(message.contains("enable its `tls-rustls`"), "{message}");
        let untrusted = std::io::Error::other("invalid peer certificate: UnknownIssuer");
        let message = tls_failure(("ssl-mode", "ssl-ca"), &untrusted);
        assert!(
            message.contains("UnknownIssuer") && message.contains("`ssl-ca=`"),
            "{message}"
        );
    }

    #[test]
    fn urls_are_redacted() {
        let cases = [
            (
                "postgres://u:secret@127.0.0.1:5432/db",
                "postgres://u:***@127.0.0.1:5432/db",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("sqlite::memory:", "sqlite::memory:"),
            ("postgres://u:p@ss@h/db?x=1", "postgres://u:***@h/db?x=1"),
            // Percent-encoded, and in the query under the names drivers read.
            (
                "postgres://u:s3cr%2Ft@127.0.0.1:1/db?password=hunter2",
                "postgres://u:***@127.0.0.1:1/db?password=***",
            ),
            (
                "mysql://u@h/db?ssl-mode=required&Pass%77ord=hunter2&pwd=x&token=y",
                "mysql://u@h/db?ssl-mode=required&Pass%77ord=***&pwd=***&token=***",
            ),
            // A value with an unencoded `&`: its tail is redacted with it.
            (
                "postgres://h/db?password=hun&ter2&sslmode=disable",
                "postgres://h/db?password=***&***&sslmode=disable",
            ),
            // Unencoded `/`, `?` and `#` in the password: the URL does not parse, or
            // parses with the password taken for a port and a path, query or fragment.
            (
                "postgres://u:s3cr/t@h:5432/db",
                "postgres://u:***@h:5432/db",
            ),
            ("postgres://u:12/cd@h/db", "postgres://u:***@h/db"),
            ("postgres://u:pa?ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u:12?ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u:12#ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u/x:pw@h/db", "postgres://***@h/db"),
            (
                "postgres://u:pw@[::1]:5432/db",
                "postgres://u:***@[::1]:5432/db",
            ),
            ("postgres://:pw@h/db", "postgres://:***@h/db"),
        ];
        for (url, shown) in cases {
            assert_eq!(redact_url(url), shown, "{url}");
        }
        for secret in [
            "hunter2", "s3cr", "12/cd", "12?ss", "pa?ss", "12#ss", "ter2", "x:pw",
        ] {
            for (url, _) in cases {
                if url.contains(secret) {
                    assert!(!redact_url(url).contains(secret), "{url}");
                }
            }
        }
    }
}
