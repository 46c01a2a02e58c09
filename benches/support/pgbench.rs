//! The pgbench floor: the fewest statements that give idem's guarantee, as pgbench
//! scripts, run and counted.

use std::process::Command;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

use crate::REPLAY_KEYS;
use crate::pg_proxy::Wire;
use crate::pg_subject::Sql;
use crate::support::{FINGERPRINT, LEASE_MS, NAME, RETAIN_MS, Res};

pub const FRESH_SQL: &str = include_str!("../pgbench/fresh.sql");
pub const REPLAY_SQL: &str = include_str!("../pgbench/replay.sql");
pub const TX_SQL: &str = include_str!("../pgbench/tx.sql");

pub fn find_pgbench() -> Option<String> {
    let on_path = Command::new("pgbench").arg("--version").output();
    if on_path.is_ok_and(|o| o.status.success()) {
        return Some("pgbench".into());
    }
    let mut found: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|d| d.path().join("bin/pgbench"))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().map(|p| p.display().to_string())
}

/// One pgbench script, placeholders filled in.
pub struct Floor<'a> {
    pub bin: &'a str,
    pub name: &'static str,
    pub script: String,
    /// `-D name=value` variables.
    pub vars: Vec<String>,
}

impl Floor<'_> {
    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Res<String> {
        let path = std::env::temp_dir().join(format!(
            "idem-bench-{}-{}.sql",
            std::process::id(),
            self.name
        ));
        std::fs::write(&path, &self.script)?;
        let mut cmd = Command::new(self.bin);
        cmd.args(["-n", "-M", "prepared", "-f"]).arg(&path);
        for var in &self.vars {
            cmd.arg("-D").arg(var);
        }
        let out = cmd.args(args).envs(env.iter().copied()).output();
        let _ = std::fs::remove_file(&path);
        let out = out?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() || !stdout.contains("number of failed transactions: 0") {
            return Err(format!(
                "pgbench {} failed: {}{}",
                self.name,
                stdout,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(stdout)
    }

    /// Transactions per second at `clients`, for `secs`.
    pub fn tps(&self, url: &str, clients: usize, secs: u64) -> Res<f64> {
        let (c, t) = (clients.to_string(), secs.to_string());
        let mut tries = 0;
        let out = loop {
            match self.run(&["-c", &c, "-j", "2", "-T", &t, url], &[]) {
                // Connections the bench just dropped may not have ended on the server yet.
                Err(e) if e.to_string().contains("too many clients") && tries < 5 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_secs(1));
                }
                out => break out?,
            }
        };
        let line = out
            .lines()
            .find(|l| l.starts_with("tps = ") && l.contains("without initial connection time"))
            .ok_or("no tps line in pgbench's output")?;
        Ok(line["tps = ".len()..]
            .split_whitespace()
            .next()
            .ok_or("empty tps line")?
            .parse()?)
    }

    /// Statements and round trips per transaction, through the counting proxy.
    pub fn count(&self, connect: &PgConnectOptions, port: u16, wire: &Wire) -> Res<(f64, f64)> {
        const TRANSACTIONS: u64 = 200;
        let before = wire.tally();
        let (port, t) = (port.to_string(), TRANSACTIONS.to_string());
        let mut args = vec!["-c", "1", "-t", &t, "-h", "127.0.0.1", "-p", &port];
        args.extend(["-U", connect.get_username()]);
        args.extend(connect.get_database());
        self.run(&args, &[("PGSSLMODE", "disable")])?;
        let tally = wire.tally().since(before);
        let per = |n: u64| n as f64 / TRANSACTIONS as f64;
        Ok((per(tally.statements()), per(tally.round_trips())))
    }
}

/// idem's own statements as a pgbench script (the claim of a new key and the record;
/// for replays, the read of the completed record): the same statements, with pgbench
/// variables for the parameters (typed, as sqlx binds them) and `\gset` to carry the
/// epoch.
pub fn idem_sql_script(sql: &Sql, replay: bool) -> String {
    let vars = [
        ("$1", ":scope::text"),
        ("$2", ":name::text"),
        ("$3", ":k::text"),
        ("$4", ":fp::bytea"),
        ("$5", ":lease"),
        ("$6", ":unknown::boolean"),
    ];
    if replay {
        let peek = vars
            .iter()
            .fold(sql.peek.clone(), |s, (p, v)| s.replace(p, v));
        return format!("\\set k random(1, {REPLAY_KEYS})\n{peek};\n");
    }
    let claim = vars
        .iter()
        .fold(sql.claim_fresh.clone(), |s, (p, v)| s.replace(p, v));
    let record = [
        ("$1", ":scope::text"),
        ("$2", ":name::text"),
        ("$3", ":k::text"),
        ("$4", ":c_epoch::bigint"),
        ("$5", ":outcome::bytea"),
        ("$6", ":is_err::boolean"),
        ("$7", ":version::integer"),
        ("$8", ":retain"),
    ]
    .iter()
    .fold(sql.record.clone(), |s, (p, v)| s.replace(p, v));
    // The claim's columns go to `c_*` variables, clear of the record's parameters. Keys
    // from a range where none repeats: the claim of a new key returns no row for one.
    format!("\\set k random(1, 9000000000000000000)\n{claim} \\gset c_\n{record};\n")
}

pub fn idem_sql_vars() -> Vec<String> {
    let hex: String = FINGERPRINT.iter().map(|b| format!("{b:02x}")).collect();
    vec![
        "scope=p".into(),
        format!("name={NAME}"),
        format!("fp=\\x{hex}"),
        format!("lease={LEASE_MS}"),
        "unknown=false".into(),
        "payload={\"scope\":\"p\",\"name\":\"bench\",\"key\":\"k\"}".into(),
        "outcome=\\x31".into(),
        "is_err=false".into(),
        "version=1".into(),
        format!("retain={RETAIN_MS}"),
    ]
}
