#!/usr/bin/env bash
# Every benchmark, each beside its baseline in the same run, into one report:
#
#   bash benches/run.sh           # the README's figures, about 25 minutes on 2 cores
#   bash benches/run.sh --short   # every bench once, briefly: a few minutes, noisier
#
# Starts the local services that are down (127.0.0.1 only) and writes the report to
# bench-report.md in the workspace's target directory (`target/`, or wherever
# CARGO_TARGET_DIR or cargo's configuration puts it) as well as to the terminal.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/services.sh

peer_args=()
criterion_secs=5
if [ "${1:-}" = "--short" ]; then
    criterion_secs=1
    export IDEM_BENCH_SECS=0.5 IDEM_BENCH_ROUNDS=1 IDEM_BENCH_PGBENCH_SECS=1 IDEM_BENCH_CALLS=2000
    export IDEM_BENCH_LIVE=100000 IDEM_BENCH_EXPIRED=10000 IDEM_BENCH_GROWTH_MAX=100000
    peer_args=(--secs 0.5 --rounds 1 --records 20000)
elif [ -n "${1:-}" ]; then
    echo "usage: bash benches/run.sh [--short]" >&2
    exit 2
elif [ "$(df --output=avail -B1G . | tail -1)" -ge 10 ]; then
    # The growth bench's 10⁷ records want about 10 GB.
    export IDEM_BENCH_GROWTH_MAX=10000000
fi

# Where cargo puts a package's builds: CARGO_TARGET_DIR, a configured `build.target-dir`
# or the package's own `target/`, as cargo itself resolves it.
target_dir() { # the package's manifest
    cargo metadata --format-version 1 --no-deps --manifest-path "$1" |
        grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4
}
workspace_target=$(target_dir Cargo.toml)
peer_bench="$(target_dir benches/peers/Cargo.toml)/release/idem-peer-bench"

report=$workspace_target/bench-report.md
mkdir -p "$workspace_target"
: >"$report"
section() { # title, then the command whose output goes under it
    local title=$1
    shift
    printf '\n# %s\n\n`%s`\n\n' "$title" "$*" | tee -a "$report"
    "$@" 2>&1 | grep -v '^ *\(Compiling\|Finished\|Running\)' | tee -a "$report"
}

# Client and server share 2 cores: the peer bench pins itself to core 0 and its Redis
# to core 1; the database benches leave scheduling to the kernel.
pin=()
if command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then
    pin=(taskset -c 0)
fi

cargo build --release --benches --quiet -p idem-tests
cargo build --release --quiet --manifest-path benches/peers/Cargo.toml
section "PostgreSQL: idem, the same SQL via sqlx, the pgbench floor" \
    env IDEM_BENCH_NO_PING=1 cargo bench --quiet -p idem-tests --bench pg
section "PostgreSQL: idem's own connections against sqlx's pools, group commit on and off" \
    cargo bench --quiet -p idem-tests --bench pg_pools
section "The same at 64 callers" env IDEM_BENCH_CALLERS=64 cargo bench --quiet -p idem-tests --bench pg_pools
section "MariaDB: idem and the same statements via sqlx" \
    env IDEM_BENCH_NO_PING=1 cargo bench --quiet -p idem-tests --bench mysql
section "Steps: one operation of two steps against two operations" \
    cargo bench --quiet -p idem-tests --bench steps
section "Encrypted outcomes beside clear ones" cargo bench --quiet -p idem-tests --bench encryption
section "A claim limit and the client layer, each beside the same calls without" \
    cargo bench --quiet -p idem-tests --bench features
section "DynamoDB: idem beside the raw PutItem and GetItem on the same server" \
    cargo bench --quiet -p idem-tests --bench dynamodb
section "PostgreSQL purge" cargo bench --quiet -p idem-tests --bench purge
section "PostgreSQL: throughput as the table grows" cargo bench --quiet -p idem-tests --bench growth
section "SQLite: group commit by callers, beside two bare commits" \
    cargo bench --quiet -p idem-tests --bench sqlite
section "Beside the idempotent crate, redis-benchmark and two trivial scripts" \
    env IDEM_BENCH_COMMANDS=1 "${pin[@]}" "$peer_bench" "${peer_args[@]}"
section "In process under criterion: idem and the idempotent crate" \
    "${pin[@]}" cargo bench --quiet --manifest-path benches/peers/Cargo.toml --bench in_process \
    -- --warm-up-time 1 --measurement-time "${criterion_secs}"
echo "report: $report"
