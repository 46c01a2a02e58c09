//! How records look on a terminal: durations in their two largest units, and keys typed
//! the way `list` prints them read back. Keys, scopes and stored text are shown through
//! `idem_runtime::DisplayKey`.

use std::borrow::Cow;
use std::time::Duration;

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
    use idem_runtime::{DisplayKey, KeyPart};

    #[test]
    fn quoted_keys_read_back() {
        for key in ["42", "two words", "a\"b", "back\\slash", "", "-"] {
            let out = DisplayKey::new(&key.encode_key()).to_string();
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
