//! `Idem::sqlite` and `IdemBuilder::sqlite`: the embedded store, opened by its file's
//! URL (the builder's methods are in `builder.rs`; these are SQLite's).

use crate::{Idem, IdemBuilder, IdemError};

impl Idem {
    /// The embedded store: a SQLite file (created if missing, WAL mode) or
    /// `sqlite::memory:`. The schema is created on open.
    ///
    /// ```
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::sqlite("sqlite::memory:").await?; // or "sqlite://idem.db?mode=rwc"
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub async fn sqlite(url: &str) -> Result<Idem, IdemError> {
        IdemBuilder::default().sqlite(url).await
    }
}

impl IdemBuilder {
    /// The embedded SQLite store; see [`Idem::sqlite`].
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .table("orders_idem")
    ///     .sqlite("sqlite://orders.db?mode=rwc")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub async fn sqlite(self, url: &str) -> Result<Idem, IdemError> {
        let store = super::open(url, &self.sql_options()?).await?;
        self.sql_store(store)
    }
}
