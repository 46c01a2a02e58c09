//! [`mark_replays`]: the `_meta` entry that tells a replayed tool result from a first
//! run.

use rmcp::handler::server::router::tool::{ToolRoute, ToolRouter};
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::model::{CallToolResponse, MetaObject};
use serde_json::Value;

/// The `_meta` entry [`mark_replays`] sets to `true` on a replayed tool result.
pub const REPLAYED_META: &str = "io.idem/replayed";

/// Wraps every tool of `router` so that a result replayed by idem (a recorded success
/// or a recorded error alike, as [`observe`](crate::observe) reports it) carries
/// `"_meta": { "io.idem/replayed": true }` ([`REPLAYED_META`]). A first run, a tool
/// without `#[idempotent]` and a protocol error are passed on as they are; the result's
/// content and `structuredContent` are never changed. With several idempotent calls in
/// one tool, the last one decides. See [the module docs](super#telling-a-replay-from-a-first-run).
pub fn mark_replays<S: Send + Sync + 'static>(mut router: ToolRouter<S>) -> ToolRouter<S> {
    for route in router.map.values_mut() {
        let call = route.call.clone();
        let marked = ToolRoute::new_dyn(
            route.attr.clone(),
            move |context: ToolCallContext<'_, S>| {
                let result = call(context);
                Box::pin(async move {
                    let (result, info) = crate::observe(result).await;
                    if info.replayed() {
                        result.map(mark_replayed)
                    } else {
                        result
                    }
                })
            },
        );
        *route = marked;
    }
    router
}

fn mark_replayed(response: CallToolResponse) -> CallToolResponse {
    match response {
        CallToolResponse::Complete(mut result) => {
            let meta = result.meta.get_or_insert_with(MetaObject::new);
            meta.insert(REPLAYED_META.to_owned(), Value::Bool(true));
            CallToolResponse::Complete(result)
        }
        other => other,
    }
}
