//! [`audit`]: the tools of a server that may have side effects yet take no
//! idempotency key, found from their input schemas.

use std::fmt;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::model::Tool;
use serde_json::Value;

use super::key::KEY_TITLE;

/// What [`audit`] found wrong with one tool.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// The tool's name.
    pub tool: String,
    /// What is wrong.
    pub kind: FindingKind,
    /// What is wrong and what to do, in words.
    pub message: String,
}

/// The kinds of [`Finding`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum FindingKind {
    /// The tool is not annotated read-only and takes no [`IdempotencyKey`](super::IdempotencyKey).
    NoKey,
    /// The tool's key argument is optional: a call without one runs unprotected.
    OptionalKey,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The tools of `router` that may have side effects yet take no idempotency key: every
/// tool not annotated `read_only_hint = true` whose input schema has no
/// [`IdempotencyKey`](super::IdempotencyKey) argument (a property named `idempotency_key` or `idempotencyKey`,
/// or one whose schema is the key's), or has it only as an optional one. Each
/// [`Finding`] names the tool and what to do. An empty list is what a test asserts; see
/// [the module docs](super#auditing-a-servers-tools).
///
/// ```
/// use idem_runtime::mcp::{FindingKind, audit};
/// use rmcp::handler::server::wrapper::Parameters;
/// use rmcp::{tool, tool_router};
///
/// #[derive(serde::Deserialize, schemars::JsonSchema)]
/// struct Sms { to: String, text: String }
///
/// #[derive(Clone)]
/// struct Notifier;
///
/// #[tool_router]
/// impl Notifier {
///     #[tool(description = "Send a text message.")]
///     async fn send_sms(&self, Parameters(sms): Parameters<Sms>) -> String {
///         format!("sent to {}", sms.to)
///     }
/// }
///
/// let findings = audit(&Notifier::tool_router());
/// assert_eq!(findings.len(), 1);
/// assert_eq!((findings[0].tool.as_str(), findings[0].kind), ("send_sms", FindingKind::NoKey));
/// ```
pub fn audit<S: Send + Sync + 'static>(router: &ToolRouter<S>) -> Vec<Finding> {
    audit_tools(&router.list_all())
}

/// [`audit`] over tool definitions as a client lists them (`list_tools`), for a server
/// reached over the protocol.
pub fn audit_tools<'a>(tools: impl IntoIterator<Item = &'a Tool>) -> Vec<Finding> {
    let mut findings = Vec::new();
    for tool in tools {
        let read_only = tool
            .annotations
            .as_ref()
            .and_then(|a| a.read_only_hint)
            .unwrap_or(false);
        if read_only {
            continue;
        }
        let name = tool.name.to_string();
        let schema = &*tool.input_schema;
        let required = |property: &str| {
            schema
                .get("required")
                .and_then(Value::as_array)
                .is_some_and(|r| r.iter().any(|v| v.as_str() == Some(property)))
        };
        let properties = schema.get("properties").and_then(Value::as_object);
        let keys: Vec<&String> = properties
            .into_iter()
            .flatten()
            .filter(|(property, value)| {
                matches!(property.as_str(), "idempotency_key" | "idempotencyKey")
                    || is_key_schema(schema, value, 0)
            })
            .map(|(property, _)| property)
            .collect();
        if keys.is_empty() {
            findings.push(Finding {
                message: format!(
                    "tool `{name}` is not annotated read-only and takes no idempotency key, so \
                     a model's retry (after a timeout, a restart, a replanned step) runs its \
                     effect again: give its arguments an `idempotency_key: \
                     idem_runtime::mcp::IdempotencyKey` and put `#[idempotent(key = \
                     args.idempotency_key, scope = ..., retain = ...)]` above its `#[tool]`; \
                     if it changes nothing, annotate it `read_only_hint = true`"
                ),
                tool: name,
                kind: FindingKind::NoKey,
            });
        } else if let Some(optional) = keys.iter().find(|k| !required(k)) {
            findings.push(Finding {
                message: format!(
                    "tool `{name}` takes its idempotency key `{optional}` as optional, so a \
                     call without one runs unprotected: make it required (`IdempotencyKey`, \
                     not `Option<IdempotencyKey>`, and no `#[serde(default)]`)"
                ),
                tool: name,
                kind: FindingKind::OptionalKey,
            });
        }
    }
    findings
}

/// Whether `value` (a schema within `root`) is [`IdempotencyKey`](super::IdempotencyKey)'s, directly, as a
/// branch of `anyOf`/`oneOf`/`allOf` (an `Option`), or behind a local `$ref`.
fn is_key_schema(root: &serde_json::Map<String, Value>, value: &Value, depth: u8) -> bool {
    let Some(schema) = value.as_object() else {
        return false;
    };
    if depth > 8 {
        return false;
    }
    if schema.get("title").and_then(Value::as_str) == Some(KEY_TITLE) {
        return true;
    }
    if let Some(target) = schema.get("$ref").and_then(Value::as_str) {
        let found = target.strip_prefix("#/").map(|path| {
            path.split('/')
                .try_fold(root, |at, part| at.get(part)?.as_object())
        });
        if let Some(Some(target)) = found {
            let named = target_name(value).is_some_and(|n| n == KEY_TITLE);
            return named || is_key_schema(root, &Value::Object(target.clone()), depth + 1);
        }
    }
    ["anyOf", "oneOf", "allOf"].iter().any(|branches| {
        schema
            .get(*branches)
            .and_then(Value::as_array)
            .is_some_and(|b| b.iter().any(|v| is_key_schema(root, v, depth + 1)))
    })
}

/// The last segment of a `$ref`, the name schemars gives a definition.
fn target_name(value: &Value) -> Option<&str> {
    value.get("$ref")?.as_str()?.rsplit('/').next()
}
