//! Events of an idempotent call carry its scope, name and key, quoted so that a key
//! cannot forge fields or lines in text logs.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use idem_runtime::{Idem, IdemError};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Remembers each span's fields and, for each event, its message and the fields of the
/// spans entered around it (a current-thread runtime keeps one stack).
#[derive(Default)]
struct Capture {
    next: AtomicU64,
    spans: Mutex<Vec<(u64, String)>>,
    stack: Mutex<Vec<u64>>,
    events: Arc<Mutex<Vec<(String, String)>>>,
}

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={:?} ", field.name(), value));
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        let mut fields = Fields(String::new());
        span.record(&mut fields);
        self.spans.lock().unwrap().push((id, fields.0));
        Id::from_u64(id)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut message = Fields(String::new());
        event.record(&mut message);
        let spans = self.spans.lock().unwrap();
        let context: String = self
            .stack
            .lock()
            .unwrap()
            .iter()
            .filter_map(|id| spans.iter().find(|(s, _)| s == id).map(|(_, f)| f.clone()))
            .collect();
        self.events.lock().unwrap().push((message.0, context));
    }
    fn enter(&self, span: &Id) {
        self.stack.lock().unwrap().push(span.into_u64());
    }
    fn exit(&self, span: &Id) {
        let mut stack = self.stack.lock().unwrap();
        if let Some(at) = stack.iter().rposition(|s| *s == span.into_u64()) {
            stack.remove(at);
        }
    }
}

#[test]
fn claim_replay_and_mismatch_events_carry_the_operation() {
    let capture = Capture::default();
    let events = capture.events.clone();
    tracing::subscriber::with_default(capture, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let idem = Idem::memory();
            let call = |amount: u32| {
                idem.operation("charge", "order-1")
                    .scope("acme")
                    .fingerprint(&amount)
                    .retain(std::time::Duration::from_secs(86_400))
                    .run(move || async move {
                        tracing::info!("inside the body");
                        Ok::<_, IdemError>(amount)
                    })
            };
            call(1).await.unwrap();
            call(1).await.unwrap();
            assert!(call(2).await.is_err());
        });
    });
    let events = events.lock().unwrap();
    for wanted in [
        "claimed",
        "inside the body",
        "recorded",
        "replay",
        "fingerprint mismatch",
    ] {
        let (_, context) = events
            .iter()
            .find(|(m, _)| m.contains(wanted))
            .unwrap_or_else(|| panic!("no `{wanted}` event in {events:?}"));
        for field in [r#"scope="acme""#, r#"name="charge""#, r#"key="order-1""#] {
            assert!(
                context.contains(field),
                "`{wanted}` lacks {field}: {context}"
            );
        }
    }
}

/// An `io::Write` into a shared buffer, for a formatting subscriber's output.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A key or scope holding spaces, `=` or a newline shows in text logs as one quoted,
/// escaped value: it cannot add a `name=refund` field, nor a line of its own.
#[test]
fn keys_cannot_forge_fields_or_lines_in_text_logs() {
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let idem = Idem::memory();
            idem.operation("charge", "k name=refund key=x")
                .scope("acme\nINFO forged: line")
                .retain(std::time::Duration::from_secs(60))
                .fingerprint_none()
                .run(|| async {
                    tracing::info!("inside the body");
                    Ok::<_, IdemError>(1)
                })
                .await
                .unwrap();
        });
    });
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("inside the body"))
        .unwrap_or_else(|| panic!("no body event in {text}"));
    assert!(
        line.contains(r#"key="\"k name=refund key=x\"""#),
        "the key is not one quoted value: {line}"
    );
    assert!(
        line.contains(r#"scope="\"acme\nINFO forged: line\"""#),
        "the scope is not one escaped value: {line}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("INFO forged")),
        "the scope's newline started a line: {text}"
    );
}
