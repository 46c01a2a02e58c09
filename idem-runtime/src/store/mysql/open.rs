//! `Idem::mysql` and `IdemBuilder::mysql`: the store on MySQL or MariaDB, opened by
//! its server's URL (the builder's other methods are in `builder.rs`).

use crate::{Idem, IdemBuilder, IdemError};

impl Idem {
    /// The store on MySQL or MariaDB (`mysql://…`, InnoDB), with a sqlx pool. The claim
    /// is an upsert that decides, read back in the same transaction; leases and expiry
    /// use the database's clock. Migrations run on open. Transactional mode works on a
    /// `sqlx::Transaction<'_, MySql>`.
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::mysql("mysql://app@db.internal:3306/app").await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub async fn mysql(url: &str) -> Result<Idem, IdemError> {
        IdemBuilder::default().mysql(url).await
    }
}

impl IdemBuilder {
    /// The MySQL or MariaDB store; see [`Idem::mysql`].
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .max_connections(32)
    ///     .mysql("mysql://app@db.internal:3306/app")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub async fn mysql(self, url: &str) -> Result<Idem, IdemError> {
        let store = super::open(url, &self.sql_options()?).await?;
        self.sql_store(store)
    }
}
