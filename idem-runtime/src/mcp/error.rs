//! idem's errors as what a tool returns: [`tool_result`], [`ToolError`] and the
//! structured body the model reads, [`ToolErrorBody`].

use std::fmt;

use rmcp::ErrorData;
use rmcp::handler::server::tool::IntoCallToolResult;
use rmcp::model::{CallToolResponse, CallToolResult};
use serde::{Deserialize, Serialize};

use crate::IdemError;
use crate::error::whole_secs;

/// The structured body of a tool result with `isError: true` made from an
/// [`IdemError`] (see [`tool_result`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolErrorBody {
    /// What happened, for the model to branch on: `idempotency_key_mismatch`,
    /// `in_flight`, `rate_limited` (the caller's allowance of new actions is spent:
    /// nothing ran), `outcome_unknown`, `fenced`, `outcome_unrecorded`,
    /// `outcome_unreadable`, and `outcome_too_large` (a transactional tool whose result
    /// was over the cap: its changes were undone and nothing happened).
    pub code: String,
    /// What happened and what to do, in words.
    pub message: String,
    /// For `in_flight` and `rate_limited`: seconds to wait before retrying with the same
    /// key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
}

/// Converts idem's error into what a tool returns: `Ok` a tool result with
/// `isError: true` and a [`ToolErrorBody`] as its structured content, for what the model
/// should see and act on; `Err` a JSON-RPC error: `invalid_params` for a key idem refuses
/// (empty or over its cap) or a scope over its cap, and an internal error for what the
/// model cannot act on (no store, store down, configuration or encoding errors), whose
/// message does not leak the driver's error.
///
/// ```
/// use idem_runtime::IdemError;
/// use idem_runtime::mcp::{ToolErrorBody, tool_result};
///
/// let result = tool_result(IdemError::Mismatch { name: "refund".into() }).unwrap();
/// assert_eq!(result.is_error, Some(true));
/// let body: ToolErrorBody = serde_json::from_value(result.structured_content.unwrap()).unwrap();
/// assert_eq!(body.code, "idempotency_key_mismatch");
/// assert!(tool_result(IdemError::NoStore).is_err());
/// let empty = tool_result(IdemError::EmptyKey { name: "refund".into() }).unwrap_err();
/// assert_eq!(empty.code, rmcp::model::ErrorCode::INVALID_PARAMS);
/// ```
pub fn tool_result(error: IdemError) -> Result<CallToolResult, ErrorData> {
    let body = |code: &str, message: String, retry_after: Option<u64>| {
        let body = ToolErrorBody {
            code: code.to_owned(),
            message,
            retry_after,
        };
        let value = serde_json::to_value(body).expect("a struct of strings serializes");
        Ok(CallToolResult::structured_error(value))
    };
    match error {
        IdemError::Mismatch { name } => body(
            "idempotency_key_mismatch",
            format!(
                "this idempotency_key was already used for `{name}` with different arguments, \
                 so nothing was done; for a new action generate a new idempotency_key, and to \
                 retry the earlier one send exactly its original arguments"
            ),
            None,
        ),
        IdemError::InFlight { name, retry_after }
        | IdemError::TooManyWaiters { name, retry_after } => {
            let secs = whole_secs(retry_after);
            body(
                "in_flight",
                format!(
                    "the same `{name}` call (this idempotency_key) is still running; retry with \
                     the same idempotency_key and arguments after {secs} s to get its result"
                ),
                Some(secs),
            )
        }
        IdemError::RateLimited { name, retry_after } => {
            let secs = whole_secs(retry_after);
            body(
                "rate_limited",
                format!(
                    "`{name}` was not run: this caller has started too many new actions for now, \
                     and nothing was done; retry with the same idempotency_key and arguments \
                     after {secs} s, or tell the user to wait"
                ),
                Some(secs),
            )
        }
        IdemError::Unknown { name, .. } => body(
            "outcome_unknown",
            format!(
                "an earlier `{name}` attempt with this idempotency_key may or may not have taken \
                 effect and is held for review; do not retry it under a new key, tell the user \
                 it needs checking"
            ),
            None,
        ),
        // The tool ran outside a transaction: the operation is held in UNKNOWN, and its
        // retry is answered outcome_unknown, so this call is answered alike.
        IdemError::OutcomeTooLarge {
            name,
            len,
            max,
            in_doubt: true,
        } => body(
            "outcome_unknown",
            format!(
                "`{name}` ran but its result ({len} bytes, over the limit of {max}) is too \
                 large to be saved, so it may have taken effect and is held for review; do \
                 not retry it under a new key, tell the user it needs checking"
            ),
            None,
        ),
        // A transactional tool's writes were rolled back with its claim: nothing happened.
        IdemError::OutcomeTooLarge { name, len, max, .. } => body(
            "outcome_too_large",
            format!(
                "`{name}` did nothing: its result ({len} bytes, over the limit of {max}) is \
                 too large to be saved, so its changes were undone; it is safe to call again \
                 with the same idempotency_key, with arguments that give a smaller result"
            ),
            None,
        ),
        // A recorded result sealed under a key the server's keyring lacks, or altered.
        IdemError::Undecryptable { name, .. } => body(
            "outcome_unreadable",
            format!(
                "the recorded result of `{name}` for this idempotency_key cannot be read by this \
                 server (a configuration fault); the tool was not run again; do not retry it \
                 under a new key, tell the user it needs checking"
            ),
            None,
        ),
        IdemError::Fenced { name, .. } => body(
            "fenced",
            format!(
                "this `{name}` attempt was superseded by a newer attempt with the same \
                 idempotency_key and its result was not kept; retry with the same \
                 idempotency_key and arguments to get the recorded result"
            ),
            None,
        ),
        IdemError::Unrecorded { name, .. } => body(
            "outcome_unrecorded",
            format!(
                "`{name}` ran but its result could not be saved, so it may have taken effect; \
                 retry later with the same idempotency_key and arguments, never a new one"
            ),
            None,
        ),
        IdemError::EmptyKey { name } => Err(invalid_key(
            "empty_key",
            format!(
                "the idempotency key of `{name}` is empty (or has an empty part); the tool did \
                 not run: send a non-empty key, one per intended action"
            ),
        )),
        IdemError::KeyTooLong { name, len, max } => Err(invalid_key(
            "key_too_long",
            format!(
                "the idempotency key of `{name}` encodes to {len} bytes, over the cap of {max}; \
                 the tool did not run: send a shorter key, such as a UUID"
            ),
        )),
        IdemError::ScopeTooLong { name, len, max } => Err(invalid_key(
            "scope_too_long",
            format!(
                "the caller's identity scoping `{name}` encodes to {len} bytes, over the cap of \
                 {max}; the tool did not run: call it under a shorter principal"
            ),
        )),
        IdemError::Store {
            during, retryable, ..
        } => Err(ErrorData::internal_error(
            format!(
                "the idempotency store is unavailable (during {during}); the tool did not run, \
                 retry later"
            ),
            Some(serde_json::json!({ "code": "store_unavailable", "retryable": retryable })),
        )),
        IdemError::NoStore => Err(ErrorData::internal_error(
            "the server has no idempotency store configured; the tool did not run",
            Some(serde_json::json!({ "code": "no_store", "retryable": false })),
        )),
        other => Err(ErrorData::internal_error(
            other.to_string(),
            Some(serde_json::json!({ "code": "idem_error", "retryable": other.is_retryable() })),
        )),
    }
}

/// An `invalid_params` error for a key or scope idem refuses, with a `code` for clients.
fn invalid_key(code: &str, message: String) -> ErrorData {
    ErrorData::invalid_params(
        message,
        Some(serde_json::json!({ "code": code, "retryable": false })),
    )
}

/// The error type of an idempotent tool: `Result<T, ToolError>` is what rmcp calls it
/// with (`T: Serialize + DeserializeOwned` for the record, and rmcp's
/// `IntoCallToolResult` for the reply).
///
/// `From<IdemError>` applies [`tool_result`];
/// `?` on an [`ErrorData`] gives a protocol error; [`ToolError::tool`] makes a domain
/// error the model sees. With idem's default `errors = release`, an `Err` leaves the key
/// free, so a retry runs the tool again.
#[derive(Debug)]
pub enum ToolError {
    /// A tool result with `isError: true`, shown to the model.
    Tool(CallToolResult),
    /// A JSON-RPC error, for the client rather than the model.
    Protocol(ErrorData),
}

impl ToolError {
    /// A domain error the model sees: `isError: true` with a structured body
    /// `{ "code", "message" }`.
    pub fn tool(code: &str, message: impl Into<String>) -> Self {
        let body = ToolErrorBody {
            code: code.to_owned(),
            message: message.into(),
            retry_after: None,
        };
        let value = serde_json::to_value(body).expect("a struct of strings serializes");
        ToolError::Tool(CallToolResult::structured_error(value))
    }
}

impl From<IdemError> for ToolError {
    fn from(error: IdemError) -> Self {
        match tool_result(error) {
            Ok(result) => ToolError::Tool(result),
            Err(error) => ToolError::Protocol(error),
        }
    }
}

impl From<ErrorData> for ToolError {
    fn from(error: ErrorData) -> Self {
        ToolError::Protocol(error)
    }
}

impl fmt::Display for ToolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ToolError::Tool(result) => match &result.structured_content {
                Some(body) => write!(f, "tool error: {body}"),
                None => f.write_str("tool error"),
            },
            ToolError::Protocol(error) => write!(f, "protocol error: {}", error.message),
        }
    }
}

impl std::error::Error for ToolError {}

impl IntoCallToolResult for ToolError {
    fn into_call_tool_result(self) -> Result<CallToolResponse, ErrorData> {
        match self {
            ToolError::Tool(mut result) => {
                result.is_error = Some(true);
                Ok(result.into())
            }
            ToolError::Protocol(error) => Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_errors_reach_rmcp_as_is_error_or_protocol() {
        let tool = ToolError::tool("declined", "card declined");
        match tool.into_call_tool_result() {
            Ok(CallToolResponse::Complete(result)) => assert_eq!(result.is_error, Some(true)),
            other => panic!("{other:?}"),
        }
        assert!(
            ToolError::from(IdemError::NoStore)
                .into_call_tool_result()
                .is_err()
        );
    }

    #[test]
    fn errors_split_between_model_and_protocol() {
        let in_flight = tool_result(IdemError::InFlight {
            name: "op".into(),
            retry_after: std::time::Duration::from_millis(1500),
        })
        .unwrap();
        let body: ToolErrorBody =
            serde_json::from_value(in_flight.structured_content.unwrap()).unwrap();
        assert_eq!(
            (body.code.as_str(), body.retry_after),
            ("in_flight", Some(2))
        );
        let limited = tool_result(IdemError::RateLimited {
            name: "op".into(),
            retry_after: std::time::Duration::from_millis(200),
        })
        .unwrap();
        let body: ToolErrorBody =
            serde_json::from_value(limited.structured_content.unwrap()).unwrap();
        assert_eq!(
            (body.code.as_str(), body.retry_after),
            ("rate_limited", Some(1))
        );
        for e in [
            IdemError::Unknown {
                name: "op".into(),
                epoch: 1,
            },
            IdemError::Fenced {
                name: "op".into(),
                epoch: 1,
            },
            IdemError::OutcomeTooLarge {
                name: "op".into(),
                len: 9,
                max: 1,
                in_doubt: true,
            },
        ] {
            assert_eq!(tool_result(e).unwrap().is_error, Some(true));
        }
        for e in [
            IdemError::EmptyKey { name: "op".into() },
            IdemError::KeyTooLong {
                name: "op".into(),
                len: 9,
                max: 1,
            },
            IdemError::ScopeTooLong {
                name: "op".into(),
                len: 9,
                max: 1,
            },
        ] {
            let refused = tool_result(e).unwrap_err();
            assert_eq!(refused.code, rmcp::model::ErrorCode::INVALID_PARAMS);
        }
        // A recorded result this server cannot open: a tool error the model can tell the
        // user about, naming no key.
        let unreadable = tool_result(IdemError::Undecryptable {
            name: "op".into(),
            key_id: "k1".into(),
            reason: crate::OpenFailure::UnknownKey,
        })
        .unwrap();
        assert_eq!(unreadable.is_error, Some(true));
        let body: ToolErrorBody =
            serde_json::from_value(unreadable.structured_content.unwrap()).unwrap();
        assert_eq!(body.code, "outcome_unreadable");
        let down = IdemError::Store {
            during: "claim",
            retryable: true,
            source: "connection refused".into(),
        };
        let protocol = tool_result(down).unwrap_err();
        assert!(!protocol.message.contains("refused"));
        assert_eq!(protocol.data.unwrap()["retryable"], true);
    }
}
