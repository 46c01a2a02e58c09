//! Why an `Idempotency-Key` header is refused, and the length rule: what the key's
//! parser reports and the problem+json answer names.

/// The longest key accepted, in characters (all ASCII, so also bytes).
pub const MAX_KEY_LEN: usize = 255;

/// Why an `Idempotency-Key` header was refused. Each becomes a 400 problem+json whose
/// `rule` member is [`KeyRejection::rule`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyRejection {
    /// The header is absent where a key is required.
    Missing,
    /// The header was sent more than once.
    Repeated,
    /// The header (or the quoted string in it) is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    TooLong {
        /// The key's length.
        len: usize,
    },
    /// The value holds a character outside printable ASCII.
    NotAscii,
    /// The value is neither a structured-field string nor a bare key.
    Malformed,
}

impl KeyRejection {
    /// A short, stable name for the rule that was broken.
    pub fn rule(&self) -> &'static str {
        match self {
            KeyRejection::Missing => "required",
            KeyRejection::Repeated => "single",
            KeyRejection::Empty => "non-empty",
            KeyRejection::TooLong { .. } => "max-length-255",
            KeyRejection::NotAscii => "printable-ascii",
            KeyRejection::Malformed => "sf-string-or-bare-key",
        }
    }

    /// What is wrong and what to send instead.
    pub fn detail(&self) -> String {
        match self {
            KeyRejection::Missing => "this request needs an Idempotency-Key header: a unique \
                value per intended operation (a UUID), sent again unchanged on every retry"
                .into(),
            KeyRejection::Repeated => {
                "the Idempotency-Key header was sent more than once; send it once".into()
            }
            KeyRejection::Empty => "the Idempotency-Key header is empty".into(),
            KeyRejection::TooLong { len } => format!(
                "the Idempotency-Key is {len} characters long; at most {MAX_KEY_LEN} are accepted"
            ),
            KeyRejection::NotAscii => "the Idempotency-Key may hold printable ASCII characters \
                only (a quoted key may contain spaces, a bare one may not)"
                .into(),
            KeyRejection::Malformed => "the Idempotency-Key must be a structured-field string \
                (\"...\", RFC 9651) or a bare key of visible ASCII characters without spaces"
                .into(),
        }
    }
}

impl std::fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail())
    }
}

impl std::error::Error for KeyRejection {}
