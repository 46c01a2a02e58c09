//! Encoded keys and scopes read back as the application passed them, for tables, logs
//! and scripts: [`DisplayKey`].

use std::borrow::Cow;
use std::fmt::{self, Write};

/// A stored scope, key or operation name as a person reads it, the way
/// [`Path::display`](std::path::Path::display) shows a path: keys and scopes decoded
/// from idem's typed encoding ([`KeyPart`](crate::KeyPart)) back to what the
/// application passed.
///
/// Strings come out bare (`order-42`) or quoted where they could be read as something
/// else (`"42"`, `"two words"`); integers (`42`), tuples (`(acme, 7)`), `true`, `()`,
/// `None`, `Some(..)`, `'c'` and `Uuid(..)` as written in Rust. A key too long for the
/// store, kept as its digest, reads `sha256:…`; a keyed-hashed one
/// ([`IdemBuilder::hash_keys`](crate::IdemBuilder::hash_keys)) reads as stored, `h:…`.
/// What does not decode (a `KeyPart` of the application's own) reads as stored.
///
/// - `Display` is for terminals: control characters and bidirectional overrides are
///   escaped, so a stored key cannot move the cursor or disguise another row; the empty
///   scope is `-`.
/// - `Debug` is for logs: the decoded text, quoted and escaped, so a key holding spaces,
///   `=` or newlines cannot forge fields or lines (idem's spans carry it so).
/// - [`decoded`](Self::decoded) is for scripts (JSON): the text exactly.
///
/// ```
/// use idem_runtime::{DisplayKey, KeyPart};
///
/// let key = ("acme", 7).encode_key();
/// assert_eq!(key, "t2(s4:acmei7;)");
/// assert_eq!(DisplayKey::new(&key).to_string(), "(acme, 7)");
/// assert_eq!(DisplayKey::new(&"42".encode_key()).to_string(), r#""42""#);
/// assert_eq!(DisplayKey::new(&42.encode_key()).to_string(), "42");
/// assert_eq!(format!("{:?}", DisplayKey::new(&"order-1".encode_key())), r#""order-1""#);
/// assert_eq!(DisplayKey::new("").to_string(), "-"); // the empty scope
/// ```
#[derive(Clone, Copy)]
pub struct DisplayKey<'a> {
    stored: &'a str,
    /// A key or scope in idem's encoding, rather than a name shown as it is.
    encoded: bool,
}

impl<'a> DisplayKey<'a> {
    /// An encoded key or scope, as [`OperationId`](crate::OperationId) holds it.
    pub fn new(encoded: &'a str) -> Self {
        DisplayKey {
            stored: encoded,
            encoded: true,
        }
    }

    /// Stored text that is not encoded (an operation name, a step label, an outcome):
    /// shown as it is, escaped for terminals.
    pub fn plain(text: &'a str) -> Self {
        DisplayKey {
            stored: text,
            encoded: false,
        }
    }

    /// The value as the application passed it, exactly (nothing escaped; the empty scope
    /// is `""`).
    ///
    /// ```
    /// use idem_runtime::{DisplayKey, KeyPart};
    /// assert_eq!(DisplayKey::new(&"a\nb".encode_key()).decoded(), "\"a\nb\"");
    /// assert_eq!(DisplayKey::new("").decoded(), "");
    /// ```
    pub fn decoded(&self) -> Cow<'a, str> {
        if self.encoded {
            decode(self.stored)
        } else {
            self.stored.into()
        }
    }
}

impl fmt::Display for DisplayKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.encoded && self.stored.is_empty() {
            return f.pad("-");
        }
        // `pad`: tables align keys with `{:<20}`.
        f.pad(&shown(&self.decoded()))
    }
}

impl fmt::Debug for DisplayKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.decoded(), f)
    }
}

/// `text` as a terminal shows it: control characters (ESC, CR, ...) and bidirectional
/// overrides escaped, so a stored key cannot move the cursor, clear the screen or
/// disguise another row.
fn shown(text: &str) -> Cow<'_, str> {
    if !text.contains(unsafe_char) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.into()
}

fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `encoded` as the application passed it, unescaped; what does not decode as it is.
fn decode(encoded: &str) -> Cow<'_, str> {
    if encoded.starts_with("h:") {
        return encoded.into();
    }
    match Part::parse(encoded) {
        Some((part, "")) => {
            let mut out = String::with_capacity(encoded.len());
            part.write(&mut out);
            out.into()
        }
        _ => encoded.into(),
    }
}

/// One value of the key encoding.
#[derive(Debug, PartialEq)]
enum Part<'a> {
    Str(&'a str),
    Char(&'a str),
    Int(&'a str),
    Bool(bool),
    Unit,
    None,
    Some(Box<Part<'a>>),
    Uuid(&'a str),
    Digest(&'a str),
    Tuple(Vec<Part<'a>>),
}

impl<'a> Part<'a> {
    /// The value at the start of `s`, and what follows it.
    fn parse(s: &'a str) -> Option<(Part<'a>, &'a str)> {
        let tag = s.chars().next()?;
        // A key of the application's own encoding may start with any character.
        let rest = &s[tag.len_utf8()..];
        match tag {
            's' | 'c' => {
                let (len, rest) = rest.split_once(':')?;
                let len: usize = digits(len)?.parse().ok()?;
                let text = rest.get(..len)?;
                let part = if tag == 's' {
                    Part::Str(text)
                } else {
                    Part::Char(text)
                };
                Some((part, &rest[len..]))
            }
            'b' => match rest.as_bytes().first()? {
                b'0' => Some((Part::Bool(false), &rest[1..])),
                b'1' => Some((Part::Bool(true), &rest[1..])),
                _ => None,
            },
            'i' => {
                let (n, rest) = rest.split_once(';')?;
                digits(n.strip_prefix('-').unwrap_or(n))?;
                Some((Part::Int(n), rest))
            }
            'n' => Some((Part::None, rest.strip_prefix(';')?)),
            'o' => {
                let (inner, rest) = Part::parse(rest)?;
                Some((Part::Some(Box::new(inner)), rest))
            }
            'u' => {
                let (uuid, rest) = rest.split_once(';')?;
                let ok =
                    uuid.len() == 36 && uuid.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
                ok.then_some((Part::Uuid(uuid), rest))
            }
            'h' => {
                let hex = rest.get(..64)?;
                hex.chars()
                    .all(|c| c.is_ascii_hexdigit())
                    .then_some((Part::Digest(hex), &rest[64..]))
            }
            't' => {
                if let Some(rest) = rest.strip_prefix("0;") {
                    return Some((Part::Unit, rest));
                }
                let (n, mut rest) = rest.split_once('(')?;
                let n: usize = digits(n)?.parse().ok()?;
                let mut parts = Vec::with_capacity(n.min(8));
                for _ in 0..n {
                    let (part, after) = Part::parse(rest)?;
                    parts.push(part);
                    rest = after;
                }
                Some((Part::Tuple(parts), rest.strip_prefix(')')?))
            }
            _ => None,
        }
    }

    fn write(&self, out: &mut String) {
        match self {
            Part::Str(s) if bare(s) => out.push_str(s),
            Part::Str(s) => quoted('"', s, out),
            Part::Char(c) => quoted('\'', c, out),
            Part::Int(n) => out.push_str(n),
            Part::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Part::Unit => out.push_str("()"),
            Part::None => out.push_str("None"),
            Part::Some(inner) => {
                out.push_str("Some(");
                inner.write(out);
                out.push(')');
            }
            Part::Uuid(u) => {
                let _ = write!(out, "Uuid({u})");
            }
            Part::Digest(hex) => {
                let _ = write!(out, "sha256:{hex}");
            }
            Part::Tuple(parts) => {
                out.push('(');
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    part.write(out);
                }
                if parts.len() == 1 {
                    out.push(',');
                }
                out.push(')');
            }
        }
    }
}

/// `s` when it is one or more ASCII digits.
fn digits(s: &str) -> Option<&str> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then_some(s)
}

/// Whether a string key reads as itself when printed without quotes: not empty, no
/// character that delimits other values or needs escaping, and not the spelling of
/// another kind of value (an integer, `true`, `None`, a digest, the empty scope).
fn bare(s: &str) -> bool {
    let delimits = |c: char| c.is_whitespace() || unsafe_char(c) || "\"'(),\\".contains(c);
    let int = digits(s.strip_prefix('-').unwrap_or(s)).is_some();
    let keyword = matches!(s, "true" | "false" | "None" | "-");
    let tagged = s.starts_with("sha256:") || s.starts_with("h:");
    !s.is_empty() && !s.contains(delimits) && !int && !keyword && !tagged
}

/// `s` between `quote`s, with backslashes and the quote escaped.
fn quoted(quote: char, s: &str, out: &mut String) {
    out.push(quote);
    for c in s.chars() {
        if c == quote || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_read_as_the_application_passed_them() {
        for (encoded, shown) in [
            ("s4:acme", "acme"),
            ("s8:order-42", "order-42"),
            ("s2:42", r#""42""#),
            ("s9:two words", r#""two words""#),
            ("s4:true", r#""true""#),
            ("s3:a\"b", r#""a\"b""#),
            ("s0:", r#""""#),
            ("i42;", "42"),
            ("i-7;", "-7"),
            ("b1", "true"),
            ("t0;", "()"),
            ("n;", "None"),
            ("os1:x", "Some(x)"),
            ("c1:'", r"'\''"),
            ("t2(s4:acmei7;)", "(acme, 7)"),
            ("t2(s3:a:bs1:c)", "(a:b, c)"),
            ("t1(i1;)", "(1,)"),
            ("t2(i1;t2(i2;i3;))", "(1, (2, 3))"),
            (
                "u67e55044-10b1-426f-9247-bb680e5fe0c8;",
                "Uuid(67e55044-10b1-426f-9247-bb680e5fe0c8)",
            ),
            ("", "-"),
            ("s1:-", r#""-""#),
            ("h:0123abcd", "h:0123abcd"),
            // Not idem's encoding (a `KeyPart` of the application's own): as stored.
            ("custom-key", "custom-key"),
            ("s9:short", "s9:short"),
            ("s4:acmetrailing", "s4:acmetrailing"),
        ] {
            assert_eq!(DisplayKey::new(encoded).to_string(), shown, "{encoded:?}");
        }
        let digest = format!("h{}", "ab".repeat(32));
        assert_eq!(
            DisplayKey::new(&digest).to_string(),
            format!("sha256:{}", "ab".repeat(32))
        );
    }

    #[test]
    fn keys_of_the_applications_own_encoding_show_as_stored() {
        for stored in ["é-7", "€", "s3:é", "t1(é)", "o€", "日本:1"] {
            assert_eq!(DisplayKey::new(stored).to_string(), stored);
        }
    }

    #[test]
    fn control_characters_stay_escaped() {
        assert_eq!(DisplayKey::new("s3:a\x1bb").to_string(), r#""a\u{1b}b""#);
        assert_eq!(
            DisplayKey::new("s4:a\u{202e}").to_string(),
            r#""a\u{202e}""#
        );
        assert!(
            !DisplayKey::new("t1(s2:\r\n)")
                .to_string()
                .contains(['\r', '\n'])
        );
    }
}
