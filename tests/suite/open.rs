//! What opening a server store reports when the server cannot be reached (the cause,
//! at once, with the URL's password redacted), and that opening a store whose tables
//! exist logs nothing from the server.
use crate::common;

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

/// The server's notices that sqlx logs (target `sqlx::postgres::notice`), as their
/// messages.
#[cfg(feature = "postgres")]
#[derive(Clone, Default)]
struct Notices(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

#[cfg(feature = "postgres")]
impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Notices {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message<'a>(&'a mut String);
        impl tracing::field::Visit for Message<'_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0.push_str(&format!("{value:?}"));
                }
            }
        }
        if event.metadata().target() == "sqlx::postgres::notice" {
            let mut message = String::new();
            event.record(&mut Message(&mut message));
            self.0.lock().unwrap().push(message);
        }
    }
}

/// The second open of a table finds every migration applied and creates nothing, so
/// the server has nothing to say: no "relation ... already exists, skipping" notice on
/// every start of every process.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_reopening_logs_no_notice() {
    use tracing_subscriber::layer::SubscriberExt;

    if common::postgres_skip("postgres_reopening_logs_no_notice").is_some() {
        return;
    }
    let notices = Notices::default();
    // A current-thread runtime: every task of the open runs on this thread, under this
    // subscriber.
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(notices.clone()));
    let url = common::postgres_url();
    let table = common::unique_table("reopen_notice");
    let open = || Idem::builder().table(&table).postgres(&url);
    drop(open().await.expect("first open"));
    notices.0.lock().unwrap().clear();
    drop(open().await.expect("second open"));
    let seen = notices.0.lock().unwrap().clone();
    common::Cleanup::for_table(&table).run().await;
    assert!(seen.is_empty(), "notices on the second open: {seen:?}");
}
