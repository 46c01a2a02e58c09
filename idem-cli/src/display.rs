//! How records look on a terminal: keys and scopes as the application passed them,
//! durations in their two largest units, and stored text made safe to print.

use std::borrow::Cow;
use std::fmt::Write;
use std::time::Duration;

/// A stored name, scope or key as a terminal shows it: control characters (ESC, CR,
/// ...) and bidirectional overrides escaped, so a stored key cannot move the cursor,
/// clear the screen or disguise another row. `--json` prints them exactly.
pub(crate) fn shown(text: &str) -> Cow<'_, str> {
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

/// An encoded scope or key (idem's typed encoding, `idem_runtime::KeyPart`) as the
/// application passed it, ready to print: strings bare (`order-42`) or quoted when they
/// could be read as something else (`"42"`, `"two words"`), integers (`42`), tuples
/// (`(acme, 7)`), `true`, `()`, `None`, `Some(..)`, `'c'`, `Uuid(..)`; a key too long for
/// the store, kept as its digest, as `sha256:…`; a keyed-hashed one (`hash_keys`) as
/// stored, `h:…`; the empty scope as `-`. What does not decode (a `KeyPart` of the
/// application's own) is shown as stored. Control characters come out escaped.
pub(crate) fn decoded(encoded: &str) -> String {
    if encoded.is_empty() {
        return "-".to_owned();
    }
    if encoded.starts_with("h:") {
        return shown(encoded).into_owned();
    }
    let mut out = String::with_capacity(encoded.len());
    match Part::parse(encoded) {
        Some((part, "")) => part.write(&mut out),
        _ => out.push_str(encoded),
    }
    shown(&out).into_owned()
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
        let rest = &s[1..];
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

/// A key or scope as an operator typed it: `"..."` (as `list` prints a string that
/// needs quotes) is that string, unescaped; anything else is the text itself.
pub(crate) fn unquoted(arg: &str) -> Cow<'_, str> {
    let Some(inner) = arg
        .strip_prefix('"')
        .and_then(|a| a.strip_suffix('"'))
        .filter(|_| arg.len() >= 2)
    else {
        return arg.into();
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(escaped @ ('"' | '\\')) => out.push(escaped),
                _ => return arg.into(),
            },
            '"' => return arg.into(),
            c => out.push(c),
        }
    }
    out.into()
}

/// A duration in its two largest units, truncated: `6d 23h`, `59m 58s`, `1.2s` is
/// `1s 200ms`; `0s` for nothing. Operators compare ages and leases at a glance; the
/// milliseconds of a week-old record are noise (`--json` has them exactly).
pub(crate) fn duration(d: Duration) -> String {
    const UNITS: [(&str, u128); 5] = [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
        ("ms", 1),
    ];
    let mut left = d.as_millis();
    let mut shown = Vec::with_capacity(2);
    for (unit, ms) in UNITS {
        let n = left / ms;
        left %= ms;
        if n > 0 || !shown.is_empty() {
            shown.push((n, unit));
        }
        if shown.len() == 2 {
            break;
        }
    }
    match shown.as_slice() {
        [] => "0s".to_owned(),
        [(n, unit)] | [(n, unit), (0, _)] => format!("{n}{unit}"),
        [(a, first), (b, second)] => format!("{a}{first} {b}{second}"),
        _ => unreachable!("at most two units"),
    }
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
            assert_eq!(decoded(encoded), shown, "{encoded:?}");
        }
        let digest = format!("h{}", "ab".repeat(32));
        assert_eq!(decoded(&digest), format!("sha256:{}", "ab".repeat(32)));
    }

    #[test]
    fn control_characters_stay_escaped() {
        assert_eq!(decoded("s3:a\x1bb"), r#""a\u{1b}b""#);
        assert_eq!(decoded("s4:a\u{202e}"), r#""a\u{202e}""#);
        assert!(!decoded("t1(s2:\r\n)").contains(['\r', '\n']));
    }

    #[test]
    fn quoted_keys_read_back() {
        for key in ["42", "two words", "a\"b", "back\\slash", "", "-"] {
            let mut out = String::new();
            quoted('"', key, &mut out);
            assert_eq!(unquoted(&out), key, "{out}");
        }
        assert_eq!(unquoted("order-42"), "order-42");
        assert_eq!(unquoted("\""), "\"");
        assert_eq!(unquoted(r#""a"b""#), r#""a"b""#, "not one quoted string");
    }

    #[test]
    fn durations_in_their_two_largest_units() {
        let ms = Duration::from_millis;
        assert_eq!(duration(ms(7 * 86_400_000 - 1_235)), "6d 23h");
        assert_eq!(duration(ms(3_598_765)), "59m 58s");
        assert_eq!(duration(ms(3_600_000)), "1h");
        assert_eq!(duration(ms(3_660_000)), "1h 1m");
        assert_eq!(duration(ms(1_200)), "1s 200ms");
        assert_eq!(duration(ms(765)), "765ms");
        assert_eq!(duration(Duration::ZERO), "0s");
        assert_eq!(
            duration(Duration::MAX),
            format!("{}d 7h", u64::MAX / 86_400)
        );
    }
}
