//! idem's behaviour suite, one test binary: each module is one topic (claims, replays,
//! leases, faults, each store, each integration), most of them written once and run on
//! every store through `common::suite!`. One binary links the dependency graph once.
//!
//! Three tests need a process of their own and are binaries of their own:
//! `tests/names.rs` (functions sharing a defaulted name, across the process),
//! `tests/metrics.rs` (the process's one metrics recorder) and `tests/bounds_load.rs`
//! (the process's live heap).

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/own_servers.rs"]
mod own_servers;
#[path = "../common/provider.rs"]
mod provider;
#[path = "../common/proxy.rs"]
mod proxy;
#[path = "../common/worker.rs"]
mod worker;

mod attribute;
mod bounds;
mod checkout_example;
mod claim;
mod claim_limits;
mod client;
mod concurrent;
mod conformance;
mod connect;
mod connection_slots;
mod dynamodb;
mod encryption;
mod errors;
mod faults;
mod fingerprint;
mod http;
mod http_accepted;
mod in_flight;
mod lambda;
mod lease;
mod log_spans;
mod mcp;
mod model;
mod mysql;
mod open;
mod pg_processes;
mod pg_reconnect;
mod pg_restart;
mod purge_plan;
mod queue;
mod readonly;
mod redis_cluster;
mod redis_store;
mod replay;
mod retention;
mod secrets;
mod sqlite;
mod steps;
mod steps_faults;
mod store_errors;
mod tls;
mod transactional;
mod version;
mod wire_faults;
