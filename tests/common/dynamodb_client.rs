//! A DynamoDB client of the local server (`IDEM_DYNAMODB_URL`), for the tests and the
//! DynamoDB bench.

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::{Credentials, Region};

/// A client of the local server, with the credentials and region it takes.
pub fn client() -> Client {
    use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version_latest()
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "local"))
        .endpoint_url(idem_test_support::dynamodb_url())
        .http_client(http)
        .build();
    Client::from_conf(config)
}
