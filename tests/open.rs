//! What opening a server store reports when the server cannot be reached: the cause,
//! at once, with the URL's password redacted.
use std::time::Duration;

use idem_runtime::{Idem, IdemError};

/// A port on 127.0.0.1 where nothing listens: bound, read, and closed again.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Awaits an open, bounded so a regression to waiting out a pool timeout fails the test
/// rather than hanging it (an outer bound, not a measurement).
async fn refused<F>(open: F) -> IdemError
where
    F: std::future::Future<Output = Result<Idem, IdemError>>,
{
    match tokio::time::timeout(Duration::from_secs(5), open).await {
        Ok(Ok(_)) => panic!("opened a store where nothing listens"),
        Ok(Err(e)) => e,
        Err(_) => panic!("the open waited instead of reporting the refused connection"),
    }
}

fn assert_names_the_refusal(e: &IdemError, port: u16) {
    let message = e.to_string();
    assert!(
        message.contains(&format!("connection refused at 127.0.0.1:{port}")),
        "{message}"
    );
    assert!(
        !message.contains("hunter2"),
        "the password leaked: {message}"
    );
    assert!(e.is_retryable(), "{message}");
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_on_a_closed_port_names_the_refusal() {
    let port = closed_port();
    let url = format!("postgres://idem:hunter2@127.0.0.1:{port}/test");
    let e = refused(Idem::postgres(&url)).await;
    assert_names_the_refusal(&e, port);
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mysql_on_a_closed_port_names_the_refusal() {
    let port = closed_port();
    let url = format!("mysql://idem:hunter2@127.0.0.1:{port}/test");
    let e = refused(Idem::mysql(&url)).await;
    assert_names_the_refusal(&e, port);
}
