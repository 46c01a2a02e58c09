//! `Idem::dynamodb` and `IdemBuilder::dynamodb`: the table, created on request, and the
//! key mode recorded in it.

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType, TableStatus, TimeToLiveSpecification,
};

use super::DynamoStore;
use super::codec::{META_PK, errors};
use crate::{Idem, IdemBuilder, IdemError};

/// A client configured from the environment alone (see [`Idem::connect`] for the
/// variables), with rustls for HTTPS.
pub(crate) fn client_from_env() -> Client {
    client_from(|name| std::env::var(name).ok())
}

/// A client configured from the variables `lookup` finds.
fn client_from(lookup: impl Fn(&str) -> Option<String>) -> Client {
    use aws_sdk_dynamodb::config::{Credentials, Region};
    use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
    let var = |name: &str| lookup(name).filter(|v| !v.is_empty());
    let region = var("AWS_REGION")
        .or_else(|| var("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|| "us-east-1".to_owned());
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let mut config = aws_sdk_dynamodb::Config::builder()
        .behavior_version_latest()
        .region(Region::new(region))
        .http_client(http);
    if let (Some(id), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
        let token = var("AWS_SESSION_TOKEN");
        config =
            config.credentials_provider(Credentials::new(id, secret, token, None, "environment"));
    }
    if let Some(endpoint) = var("AWS_ENDPOINT_URL_DYNAMODB").or_else(|| var("AWS_ENDPOINT_URL")) {
        config = config.endpoint_url(endpoint);
    }
    Client::from_conf(config.build())
}

/// How long a table idem created may take to become active.
const CREATION_WAIT: Duration = Duration::from_secs(120);

impl Idem {
    /// The store on the DynamoDB table `table`, through the application's `client`
    /// (built with `aws-config` as the application builds its other AWS clients). The
    /// table is created if missing; see [`store::dynamodb`](crate::store::dynamodb) for
    /// its schema and the IAM actions idem needs.
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # async fn f(client: aws_sdk_dynamodb::Client) -> Result<(), IdemError> {
    /// // let config = aws_config::load_from_env().await;
    /// // let client = aws_sdk_dynamodb::Client::new(&config);
    /// let idem = Idem::dynamodb(client, "idem_operations").await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
    pub async fn dynamodb(client: Client, table: &str) -> Result<Idem, IdemError> {
        IdemBuilder::default().dynamodb(client, table).await
    }
}

impl IdemBuilder {
    /// The DynamoDB store; see [`Idem::dynamodb`]. With [`migrate(false)`](Self::migrate)
    /// the table must exist and have been opened by idem before (its key mode is
    /// recorded in it); nothing is created or written on open.
    ///
    /// ```no_run
    /// # use idem_runtime::{Idem, IdemError};
    /// # async fn f(client: aws_sdk_dynamodb::Client) -> Result<(), IdemError> {
    /// let idem = Idem::builder()
    ///     .hash_keys(std::env::var("IDEM_KEY_SECRET").unwrap())
    ///     .dynamodb(client, "payments_idem")
    ///     .await?;
    /// # let _ = idem;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
    pub async fn dynamodb(self, client: Client, table: &str) -> Result<Idem, IdemError> {
        self.check_secret()?;
        if self.migrate {
            create_table(&client, table).await?;
        }
        let store = DynamoStore::new(client, table);
        let wanted = crate::secret::key_mode(self.hash_keys.as_ref());
        check_key_mode(&store, &wanted, self.migrate).await?;
        self.try_store(store)
    }
}

fn open_error(table: &str, e: crate::store::StoreError) -> IdemError {
    IdemError::Config {
        message: format!(
            "cannot open the DynamoDB table `{table}`: {e}; check the table's name and \
             region, and that the credentials allow the actions idem needs (see \
             `idem_runtime::store::dynamodb`)"
        ),
    }
}

/// Creates `table` unless it exists, waits for it, and turns its TTL on.
async fn create_table(client: &Client, table: &str) -> Result<(), IdemError> {
    let described = client.describe_table().table_name(table).send().await;
    match described {
        Ok(_) => return Ok(()),
        Err(e)
            if e.as_service_error()
                .is_some_and(|s| s.is_resource_not_found_exception()) => {}
        Err(e) => return Err(open_error(table, errors::store(e))),
    }
    let key = |kind| {
        KeySchemaElement::builder()
            .attribute_name("pk")
            .key_type(kind)
            .build()
            .expect("a key element names its attribute and type")
    };
    let created = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("an attribute definition names its attribute and type"),
        )
        .key_schema(key(KeyType::Hash))
        .send()
        .await;
    match created {
        Ok(_) => {}
        // Another process created it meanwhile.
        Err(e)
            if e.as_service_error()
                .is_some_and(|s| s.is_resource_in_use_exception()) => {}
        Err(e) => return Err(open_error(table, errors::store(e))),
    }
    let deadline = tokio::time::Instant::now() + CREATION_WAIT;
    loop {
        let described = client.describe_table().table_name(table).send().await;
        let status = described
            .map_err(|e| open_error(table, errors::store(e)))?
            .table
            .and_then(|t| t.table_status);
        if status == Some(TableStatus::Active) {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(IdemError::Config {
                message: format!(
                    "the DynamoDB table `{table}` idem created is not active after \
                     {CREATION_WAIT:?}; open it again once it is"
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Expiry works without TTL (idem treats expired items as absent, and purge deletes
    // them); TTL only spares the purge.
    let ttl = TimeToLiveSpecification::builder()
        .enabled(true)
        .attribute_name("expires_ttl")
        .build()
        .expect("a TTL specification names its attribute");
    if let Err(e) = client
        .update_time_to_live()
        .table_name(table)
        .time_to_live_specification(ttl)
        .send()
        .await
    {
        tracing::warn!(table, error = %errors::store(e), "cannot turn TTL on; purge expired records");
    }
    Ok(())
}

/// Records the key mode in the table (or finds the same one there); with `write`
/// false, requires a table already opened by idem.
async fn check_key_mode(store: &DynamoStore, wanted: &str, write: bool) -> Result<(), IdemError> {
    let table = store.table();
    let key = || AttributeValue::S(META_PK.into());
    if write {
        let put = store
            .client
            .put_item()
            .table_name(table)
            .item("pk", key())
            .item("km", AttributeValue::S(wanted.into()))
            .condition_expression("attribute_not_exists(pk)")
            .send()
            .await;
        match put {
            Ok(_) => return Ok(()),
            Err(e) if errors::lost_race(&e) => {}
            Err(e) => return Err(open_error(table, errors::store(e))),
        }
    }
    let got = store
        .client
        .get_item()
        .table_name(table)
        .key("pk", key())
        .consistent_read(true)
        .send()
        .await
        .map_err(|e| open_error(table, errors::store(e)))?;
    let recorded = match got.item.as_ref().and_then(|i| i.get("km")) {
        Some(AttributeValue::S(mode)) => mode.clone(),
        _ => {
            return Err(IdemError::Config {
                message: format!(
                    "the DynamoDB table `{table}` holds no idem store (no key mode is \
                     recorded in it); open it once with `migrate(true)`, or check its name"
                ),
            });
        }
    };
    crate::secret::check_key_mode(
        &format!("the DynamoDB table `{table}`"),
        "another table",
        Some(&recorded),
        wanted,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_from_the_environment_takes_its_region() {
        let env = |name: &str| {
            let value = match name {
                "AWS_DEFAULT_REGION" => "eu-west-3",
                _ => return None,
            };
            Some(value.to_owned())
        };
        let client = client_from(env);
        let config = client.config();
        assert_eq!(config.region().map(|r| r.as_ref()), Some("eu-west-3"));
        let bare = client_from(|_| None);
        assert_eq!(
            bare.config().region().map(|r| r.as_ref()),
            Some("us-east-1")
        );
    }
}
