//! What idem stores, and how to store less of it.
//!
//! Every operation leaves one record in the store for its `retain`: what is needed to
//! answer a duplicate, and nothing about the request beyond its fingerprint.
//!
//! | part of the record | held as | protected by |
//! |---|---|---|
//! | scope and key | their encoding, as the application passed them | [`hash_keys`](crate::IdemBuilder::hash_keys): an HMAC under your secret |
//! | operation name | as given | (a name from your code, not data) |
//! | request fingerprint | SHA-256 of the canonical request | `hash_keys`: an HMAC, so a dictionary of likely requests finds nothing |
//! | state, epoch, times, lease | numbers | |
//! | outcome | the JSON of what the call returned | [`encrypt`](crate::IdemBuilder::encrypt) (feature `encryption`) |
//! | step values | the JSON of each [`step`](crate::step)'s `Ok` value, under its label | `encrypt` |
//!
//! # What each integration records as the outcome
//!
//! - **`#[idempotent]` and [`Operation::run`](crate::Operation::run)**: the function's
//!   `Ok` value; its `Err` too under `errors = record` or a `classify` that records.
//!   [Transactional mode](crate::guide::transactions) records the same, in your
//!   database's table, in your transaction.
//! - **HTTP** ([`http`](crate::http), feature `axum`): the handler's response: status,
//!   the headers chosen for recording, and the body (JSON as JSON, other bytes as
//!   base64). A response body is often the most sensitive thing in the request.
//! - **MCP tools** ([`mcp`](crate::mcp)): the tool's result value (or recorded error),
//!   which a model may have filled with a customer's data.
//! - **Queue consumers** ([`queue`](crate::queue)): whatever the handler returns, often
//!   `()`: nothing but the fact that the message was handled.
//! - **The client layers** ([`client`](crate::client)): nothing; they send a key.
//!
//! # Recording a reference instead of a payload
//!
//! A duplicate needs the *same answer*, not necessarily the same bytes: record what
//! identifies the answer (the id of the charge, the row, the document in your own
//! database, already protected there) and load it on the way out, after authorizing the
//! caller as you would for a read. The store then holds an id; a replay costs one read
//! of your own data.
//!
//! ```
//! use idem_runtime::{Idem, IdemError};
//! use std::time::Duration;
//!
//! #[derive(Debug, serde::Serialize, serde::Deserialize)]
//! struct ChargeId(u64); // recorded: an id, not the card, address or receipt
//!
//! struct Receipt { charge: u64, card_last4: String } // built from your own tables
//!
//! async fn load_receipt(id: ChargeId) -> Receipt {
//!     Receipt { charge: id.0, card_last4: "4242".into() } // a read your database protects
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), IdemError> {
//! let idem = Idem::memory();
//! let charge = || {
//!     idem.operation("charge", "order-7")
//!         .retain(Duration::from_secs(86_400))
//!         .fingerprint_none()
//!         .run(|| async { Ok::<_, IdemError>(ChargeId(981)) })
//! };
//! let receipt = load_receipt(charge().await?).await; // first call: ran
//! let again = load_receipt(charge().await?).await; // replay: the same id, loaded again
//! assert_eq!((receipt.charge, again.card_last4.as_str()), (981, "4242"));
//! # Ok(()) }
//! ```
//!
//! Over HTTP the same holds: have the idempotent part return the created resource's id
//! and build the full response outside it, or answer `201` with a `Location` and a small
//! body. Where the payload itself must be replayed, seal it with
//! [`IdemBuilder::encrypt`](crate::IdemBuilder::encrypt), keep `retain` as short as your
//! clients' retry window, and key identities with `hash_keys`.
//!
//! # Encrypted records
//!
//! With `encrypt`, outcomes, recorded errors, step values and operators' resolutions
//! are sealed with XChaCha20-Poly1305 before any store sees them (every store, and
//! transactional mode), bound to their record; keys rotate through the
//! `Keyring`'s retired keys. Records written in clear before encryption was turned on
//! still replay until they expire. A record that cannot be opened is
//! [`IdemError::Undecryptable`](crate::IdemError::Undecryptable), never replayed. The
//! `idem` command shows an encrypted value as `encrypted (key <id>, N bytes)`.
//!
//! # How much a caller can make the store keep
//!
//! Every new key a caller sends is a record kept for `retain`, a write and a body run.
//! [`IdemBuilder::limit_new_claims`](crate::IdemBuilder::limit_new_claims) bounds that
//! per scope (the HTTP layer's principal, an MCP caller, a queue producer), counting
//! only calls that would create a record; replays stay as cheap and unlimited as reads.
//! Over the limit a call writes nothing and fails with
//! [`IdemError::RateLimited`](crate::IdemError::RateLimited). A count per process
//! allows each instance its own; [`ClaimLimit::shared`](crate::ClaimLimit::shared)
//! keeps one in PostgreSQL (a row a key) or Redis (a key a key, expiring once the
//! allowance is whole), named by a digest of the limit's key.
