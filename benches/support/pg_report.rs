//! The `pg` bench's report: one row per phase, the rounds, the counted statements and,
//! with `IDEM_BENCH_EXPERIMENTS=1`, where the time goes.

use std::collections::BTreeMap;

use crate::pg_config::{Config, quoted};
use crate::pg_proxy::{COUNTED, Count};
use crate::pg_subject::{Sql, Templates};
use crate::support::POOL;
use crate::support::driver::median;

// The subjects' labels, by which the report finds their rounds.
pub const IDEM: &str = "idem";
pub const SQLX: &str = "sqlx baseline";
pub const IDEM_OWN: &str = "idem on its own connections (Idem::postgres)";
pub const IDEM_QUIET: &str = "idem, pool without the acquire ping";
pub const IDEM_NO_RENEW: &str = "idem, no lease renewal task";
pub const SQLX_QUIET: &str = "sqlx, pool without the acquire ping";
pub const SQLX_HELD: &str = "sqlx, one held connection per task";
pub const SQLX_TX: &str = "sqlx, idem's transactional statements";
pub const SQLX_TX_NO_SAVEPOINT: &str = "sqlx, the same without the savepoint";

pub const FRESH: usize = 0;
pub const REPLAY: usize = 1;
pub const TX: usize = 2;
/// No pgbench floor: the 50% duplicate mix.
pub const MIX: usize = 3;

/// One row of the report.
pub struct Line {
    pub label: &'static str,
    pub concurrency: usize,
    /// Which pgbench script is its floor: [`FRESH`], [`REPLAY`] or [`TX`]; none for
    /// [`MIX`].
    pub script: usize,
    /// Rounds of idem, of the baseline, then of the experiments.
    pub rounds: Vec<(&'static str, Vec<f64>)>,
    pub floor: Option<f64>,
    /// pgbench running idem's SQL (experiments).
    pub floor_idem_sql: Option<f64>,
    pub count: Option<(Count, Count)>,
    pub floor_count: Option<(f64, f64)>,
}

impl Line {
    pub fn new(label: &'static str, concurrency: usize, script: usize) -> Line {
        Line {
            label,
            concurrency,
            script,
            rounds: Vec::new(),
            floor: None,
            floor_idem_sql: None,
            count: None,
            floor_count: None,
        }
    }

    fn median(&self, label: &str) -> Option<f64> {
        self.rounds
            .iter()
            .find(|(l, _)| *l == label)
            .map(|(_, r)| median(r))
    }
}

fn fmt_opt(x: Option<f64>, digits: usize) -> String {
    x.map_or_else(|| "—".into(), |x| format!("{x:.digits$}"))
}

fn ratio(a: Option<f64>, b: Option<f64>, goal: f64) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => {
            let r = a / b;
            format!("{r:.2}{}", if r >= goal { "" } else { " ✗" })
        }
        _ => "—".into(),
    }
}

/// A statement's text on one line, with the tables named `T` (idem's) and `O` (orders).
fn describe(sql: &str, names: &[(&str, &str)], known: &[(&str, &Sql)]) -> String {
    let sql = names
        .iter()
        .fold(sql.to_owned(), |s, (from, to)| s.replace(&quoted(from), to));
    for (table, statements) in known {
        let rename = |s: &str| s.replace(&quoted(table), "T");
        for (name, text) in [
            ("PEEK", &statements.peek),
            ("CLAIM", &statements.claim),
            ("CLAIM_FRESH", &statements.claim_fresh),
            ("RECORD", &statements.record),
            ("TX_CLAIM", &statements.tx_claim),
            ("TX_RECORD", &statements.tx_record),
            ("CLAIM_BATCH", &statements.claim_batch),
            ("RECORD_BATCH", &statements.record_batch),
        ] {
            if rename(text) == sql {
                return name.into();
            }
        }
    }
    let flat = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(48) {
        Some((at, _)) => format!("{}…", &flat[..at]),
        None => flat,
    }
}

pub struct Report<'a> {
    pub cfg: &'a Config,
    pub server: String,
    pub lines: Vec<Line>,
    /// Per counted line: idem's table, the baseline's, and the orders tables.
    pub names: Vec<[(String, &'static str); 4]>,
    pub templates: Templates,
}

impl Report<'_> {
    pub fn print(&self) {
        let cfg = self.cfg;
        println!();
        println!(
            "| phase | idem ops/s | sqlx baseline ops/s | idem/sqlx | pgbench floor tps | \
             idem/pgbench | Idem::postgres ops/s | Idem::postgres/pgbench | \
             statements/op idem (sqlx, floor) | round trips/op idem (sqlx, floor) |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---|---|");
        for line in &self.lines {
            let (idem, base) = (line.median(IDEM), line.median(SQLX));
            let own = line.median(IDEM_OWN);
            let (stmts, trips) = match &line.count {
                Some((i, b)) => {
                    let f = |x: Option<f64>| fmt_opt(x, 2);
                    let floor = line.floor_count;
                    let added = if line.script == TX {
                        format!("; idem adds {:.2}", i.statements - b.statements)
                    } else {
                        String::new()
                    };
                    (
                        format!(
                            "{:.2} ({:.2}, {}){added}",
                            i.statements,
                            b.statements,
                            f(floor.map(|f| f.0))
                        ),
                        format!(
                            "{:.2} ({:.2}, {})",
                            i.round_trips,
                            b.round_trips,
                            f(floor.map(|f| f.1))
                        ),
                    )
                }
                None => ("—".into(), "—".into()),
            };
            println!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {stmts} | {trips} |",
                line.label,
                fmt_opt(idem, 0),
                fmt_opt(base, 0),
                ratio(idem, base, 0.9),
                fmt_opt(line.floor, 0),
                ratio(idem, line.floor, 0.8),
                fmt_opt(own, 0),
                ratio(own, line.floor, 0.8),
            );
        }
        println!();
        println!(
            "Medians of {} rounds of {:.1}s, idem and sqlx alternating; pgbench -T {} -j 2 -n \
             -M prepared right after each row. ✗: below the goal (idem/sqlx ≥ 0.9, \
             idem/pgbench ≥ 0.8).",
            cfg.knobs.rounds,
            cfg.knobs.measure.as_secs_f64(),
            cfg.pgbench_secs
        );
        println!("{}", self.server);
        println!(
            "Pools: {POOL} connections each, sqlx defaults otherwise (test_before_acquire({})); \
             idem lease renewal {}.",
            cfg.knobs.ping,
            if cfg.renew { "on" } else { "off" }
        );
        println!();
        println!("Rounds (ops/s):");
        for line in &self.lines {
            for (i, (label, r)) in line.rounds.iter().enumerate() {
                let r: Vec<_> = r.iter().map(|x| format!("{x:.0}")).collect();
                let phase = if i == 0 { line.label } else { "" };
                println!("  {phase:<13} {label:<44} [{}]", r.join(", "));
            }
        }
        self.print_counts();
        if cfg.experiments {
            self.print_experiments();
        }
    }

    fn print_counts(&self) {
        println!();
        println!(
            "Counted runs through the wire proxy ({COUNTED} operations each, after {COUNTED} \
             to warm up); statements executed per operation:"
        );
        for (line, names) in self.lines.iter().zip(&self.names) {
            let Some((i, b)) = &line.count else { continue };
            let renames: Vec<(&str, &str)> = names.iter().map(|(t, n)| (t.as_str(), *n)).collect();
            let (idem_sql, base_sql) = (
                self.templates.render(&names[0].0),
                self.templates.render(&names[1].0),
            );
            let known = [
                (names[0].0.as_str(), &idem_sql),
                (names[1].0.as_str(), &base_sql),
            ];
            let show = |count: &Count| {
                let per: BTreeMap<String, f64> =
                    count
                        .executed
                        .iter()
                        .fold(BTreeMap::new(), |mut m, (sql, n)| {
                            *m.entry(describe(sql, &renames, &known)).or_default() += n;
                            m
                        });
                per.iter()
                    .map(|(s, n)| format!("{s} ×{n:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let (idem, base) = (show(i), show(b));
            println!("  {:<13} idem: {idem}", line.label);
            println!("  {:<13} sqlx: {base}", "");
            // Under concurrency idem gathers claims and records into batch statements.
            if line.script != TX && idem != base && !idem.contains("_BATCH") {
                println!(
                    "  {:<13} WARNING: idem and the baseline executed different statements",
                    ""
                );
            }
            println!(
                "  {:<13} server commits/op idem {:.2}, sqlx {:.2}; rows written idem {}, sqlx \
                 {}; bodies run (claims won) idem {}, sqlx {}",
                "", i.xacts, b.xacts, i.writes, b.writes, i.runs, b.runs
            );
        }
    }

    fn print_experiments(&self) {
        println!();
        println!(
            "Where the time goes (IDEM_BENCH_EXPERIMENTS=1): medians in ops/s, and their ratio \
             to idem's."
        );
        for line in &self.lines {
            let idem = line.median(IDEM);
            let mut cells: Vec<_> = line
                .rounds
                .iter()
                .map(|(label, r)| (label.to_string(), Some(median(r))))
                .collect();
            cells.push(("pgbench, idem's SQL".into(), line.floor_idem_sql));
            cells.push(("pgbench floor".into(), line.floor));
            println!("  {}", line.label);
            for (label, x) in cells.iter().filter(|c| c.1.is_some()) {
                let vs = match (x, idem) {
                    (Some(x), Some(i)) if i > 0.0 => format!("{:.2}", x / i),
                    _ => "—".into(),
                };
                println!("    {label:<46} {:>7}  ×{vs}", fmt_opt(*x, 0));
            }
        }
    }
}
