//! `Idem::postgres` and `IdemBuilder::postgres`, and `IdemBuilder::group_commit`: the
//! production store, opened by its server's URL (the builder's other methods are in
//! `builder.rs`).

use crate::{Idem, IdemBuilder, IdemError};

impl Idem {
    /// The production store on PostgreSQL (`postgres://…`), with a sqlx pool. Leases and
    /// expiry use the database's clock. Migrations run on open.
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::postgres("postgres://app@db.internal:5432/app").await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn postgres(url: &str) -> Result<Idem, IdemError> {
        IdemBuilder::default().postgres(url).await
    }
}

impl IdemBuilder {
    /// Whether concurrent claims, and concurrent records, are gathered into one
    /// statement and one commit on PostgreSQL (default `true`). A lone call runs alone
    /// and waits on nothing; under concurrency the statement takes whatever is waiting,
    /// each row decided as its own call would be. Off, every claim and record is its
    /// own statement, as a comparison for benchmarks or to keep statements per call
    /// fixed.
    ///
    /// ```no_run
    /// # async fn open() -> Result<(), idem_runtime::IdemError> {
    /// let idem = idem_runtime::Idem::builder()
    ///     .group_commit(false)
    ///     .postgres("postgres://postgres@127.0.0.1:5432/app")
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn group_commit(mut self, on: bool) -> Self {
        self.group_commit = on;
        self
    }

    /// The PostgreSQL store; see [`Idem::postgres`].
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .table("billing.idem_operations")
    ///     .postgres("postgres://app@db.internal:5432/app?sslmode=require")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn postgres(self, url: &str) -> Result<Idem, IdemError> {
        let store = super::open(url, &self.sql_options()?).await?;
        self.sql_store(store)
    }
}
