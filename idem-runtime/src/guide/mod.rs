//! How idem behaves and how each store keeps its promises: pages of documentation, no
//! code. They are versioned with the API, and their examples run as doctests.
//!
//! ```
//! use idem_runtime::{Idem, IdemError, observe};
//! use std::time::Duration;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), IdemError> {
//! let idem = Idem::memory();
//! let send = || {
//!     idem.operation("send_welcome_email", "user-7")
//!         .retain(Duration::from_secs(86_400))
//!         .fingerprint_none()
//!         .run(|| async { Ok::<_, IdemError>("queued".to_string()) })
//! };
//! let (first, info) = observe(send()).await;
//! assert!(!info.replayed());
//! let (again, info) = observe(send()).await;
//! assert!(info.replayed()); // the body did not run again
//! assert_eq!(first?, again?);
//! # Ok(()) }
//! ```
//!
//! | page | what it covers |
//! |---|---|
//! | [`guarantees`] | what idem promises, to whom, and where the promise ends |
//! | [`transactions`] | transactional mode: the claim and the record inside the caller's transaction |
//! | [`sqlite`] | the embedded store: WAL, `synchronous=FULL`, group commit |
//! | [`postgres`] | the production store: the claim statement, wake-ups, group commit, purge |
//! | [`mysql`] | MySQL and MariaDB: statements, locks, epochs, errors |
//! | [`store::redis`](crate::store::redis) | Redis and Valkey: scripts, keys, cluster, durability |
//! | [`operations`] | purge, stats, listing and resolving records, metrics, the `idem` command |
//! | [`stored_data`] | what each integration stores, recording a reference instead of a payload, encryption |
//!
//! The store contract itself, and how long a call may wait on a store, are in
//! [`store`](crate::store).

pub mod guarantees;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
pub mod operations;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;
pub mod stored_data;
pub mod transactions;
