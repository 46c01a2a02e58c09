//! Events of an idempotent call carry its scope, name and key.
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
        for field in ["scope=s4:acme", "name=charge", "key=s7:order-1"] {
            assert!(
                context.contains(field),
                "`{wanted}` lacks {field}: {context}"
            );
        }
    }
}
