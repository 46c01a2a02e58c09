//! Typed, unambiguous encoding of keys and scopes.

/// A value that can be part of an operation's key or scope.
///
/// The encoding is typed and length-prefixed, so `42` and `"42"` are different keys,
/// and so are `("a:b", "c")` and `("a", "b:c")`. All integer types of the same value
/// encode alike (`42u8` is `42i64`), so widening a column does not change keys.
///
/// ```
/// use idem_runtime::KeyPart;
/// assert_ne!(42.encode_key(), "42".encode_key());
/// assert_ne!(("a:b", "c").encode_key(), ("a", "b:c").encode_key());
/// assert_eq!(42u8.encode_key(), 42i64.encode_key());
/// ```
///
/// # Empty keys
///
/// A key with an empty text part (`""`, or `("acme", "")`) is refused with
/// [`IdemError::EmptyKey`](crate::IdemError::EmptyKey) before anything is written: an
/// empty identifier is almost always a missing one (a field defaulted to `""`, an unset
/// header), and accepting it would answer every such request with the first one's
/// outcome. Every part of a composite key is checked, since `(tenant, "")` is just as
/// much a missing order id. Integers, booleans, `()`, `None` and UUIDs are values, never
/// empty. The scope may be empty: the empty scope is the documented default namespace,
/// and a missing tenant is caught by authorization, which runs before the call.
///
/// ```
/// use idem_runtime::KeyPart;
/// assert!("".is_empty_key());
/// assert!(("acme", "").is_empty_key());
/// assert!(("", 7).is_empty_key());
/// assert!(!0u64.is_empty_key());
/// ```
pub trait KeyPart {
    /// Appends this value's encoding to `out`.
    fn write_key(&self, out: &mut String);

    /// Whether this value, or any text part of it, is empty (see [Empty keys](#empty-keys)).
    /// Implementations for types without text keep the default, `false`.
    fn is_empty_key(&self) -> bool {
        false
    }

    /// This value's encoding on its own.
    fn encode_key(&self) -> String {
        let mut out = String::new();
        self.write_key(&mut out);
        out
    }
}

/// A client-chosen key (an HTTP or MCP `IdempotencyKey`) as stored: as a string where
/// the encoding fits the store's cap (`s<len>:` costs up to 5 bytes), else by its
/// SHA-256 under a tag of its own, so it never meets a plain string's encoding.
#[cfg(any(feature = "axum", feature = "mcp"))]
pub(crate) fn write_client_key(key: &str, out: &mut String) {
    if key.len() + 5 <= crate::MAX_KEY_BYTES {
        key.write_key(out);
    } else {
        use sha2::{Digest, Sha256};
        use std::fmt::Write;
        out.push('h');
        for b in Sha256::digest(key.as_bytes()) {
            let _ = write!(out, "{b:02x}");
        }
    }
}

fn write_str(tag: char, s: &str, out: &mut String) {
    // Tag and byte length first: the reader never needs to look inside the text.
    out.reserve(s.len() + 8);
    out.push(tag);
    out.push_str(itoa::Buffer::new().format(s.len()));
    out.push(':');
    out.push_str(s);
}

impl KeyPart for str {
    fn write_key(&self, out: &mut String) {
        write_str('s', self, out);
    }
    fn is_empty_key(&self) -> bool {
        self.is_empty()
    }
}

impl KeyPart for String {
    fn write_key(&self, out: &mut String) {
        self.as_str().write_key(out);
    }
    fn is_empty_key(&self) -> bool {
        self.is_empty()
    }
}

impl KeyPart for std::borrow::Cow<'_, str> {
    fn write_key(&self, out: &mut String) {
        self.as_ref().write_key(out);
    }
    fn is_empty_key(&self) -> bool {
        self.is_empty()
    }
}

impl KeyPart for bool {
    fn write_key(&self, out: &mut String) {
        out.push_str(if *self { "b1" } else { "b0" });
    }
}

impl KeyPart for char {
    fn write_key(&self, out: &mut String) {
        write_str('c', self.encode_utf8(&mut [0; 4]), out);
    }
}

impl KeyPart for () {
    fn write_key(&self, out: &mut String) {
        out.push_str("t0;");
    }
}

macro_rules! int_key {
    ($($t:ty)*) => {$(
        impl KeyPart for $t {
            fn write_key(&self, out: &mut String) {
                out.push('i');
                out.push_str(itoa::Buffer::new().format(*self));
                out.push(';');
            }
        }
    )*};
}
int_key!(i8 i16 i32 i64 i128 isize u8 u16 u32 u64 u128 usize);

impl<T: KeyPart + ?Sized> KeyPart for &T {
    fn write_key(&self, out: &mut String) {
        (**self).write_key(out);
    }
    fn is_empty_key(&self) -> bool {
        (**self).is_empty_key()
    }
}

impl<T: KeyPart + ?Sized> KeyPart for &mut T {
    fn write_key(&self, out: &mut String) {
        (**self).write_key(out);
    }
    fn is_empty_key(&self) -> bool {
        (**self).is_empty_key()
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Box<T> {
    fn write_key(&self, out: &mut String) {
        (**self).write_key(out);
    }
    fn is_empty_key(&self) -> bool {
        (**self).is_empty_key()
    }
}

impl<T: KeyPart + ?Sized> KeyPart for std::sync::Arc<T> {
    fn write_key(&self, out: &mut String) {
        (**self).write_key(out);
    }
    fn is_empty_key(&self) -> bool {
        (**self).is_empty_key()
    }
}

impl<T: KeyPart> KeyPart for Option<T> {
    fn write_key(&self, out: &mut String) {
        match self {
            None => out.push_str("n;"),
            Some(v) => {
                out.push('o');
                v.write_key(out);
            }
        }
    }
    fn is_empty_key(&self) -> bool {
        self.as_ref().is_some_and(KeyPart::is_empty_key)
    }
}

#[cfg(feature = "uuid")]
#[cfg_attr(docsrs, doc(cfg(feature = "uuid")))]
impl KeyPart for uuid::Uuid {
    fn write_key(&self, out: &mut String) {
        out.push('u');
        out.push_str(
            self.as_hyphenated()
                .encode_lower(&mut uuid::Uuid::encode_buffer()),
        );
        out.push(';');
    }
}

macro_rules! tuple_key {
    ($n:literal: $($name:ident)+) => {
        impl<$($name: KeyPart),+> KeyPart for ($($name,)+) {
            fn write_key(&self, out: &mut String) {
                #[allow(non_snake_case)]
                let ($($name,)+) = self;
                out.push_str(concat!("t", $n, "("));
                $($name.write_key(out);)+
                out.push(')');
            }
            fn is_empty_key(&self) -> bool {
                #[allow(non_snake_case)]
                let ($($name,)+) = self;
                false $(|| $name.is_empty_key())+
            }
        }
    };
}
tuple_key!(1: A);
tuple_key!(2: A B);
tuple_key!(3: A B C);
tuple_key!(4: A B C D);
tuple_key!(5: A B C D E);
tuple_key!(6: A B C D E F);
tuple_key!(7: A B C D E F G);
tuple_key!(8: A B C D E F G H);

#[cfg(test)]
mod tests {
    use super::KeyPart;

    #[test]
    fn typed_and_unambiguous() {
        assert_ne!(42.encode_key(), "42".encode_key());
        assert_ne!(true.encode_key(), "b1".encode_key());
        assert_ne!(("a:b", "c").encode_key(), ("a", "b:c").encode_key());
        assert_ne!((1, (2, 3)).encode_key(), ((1, 2), 3).encode_key());
        assert_ne!(Some("x").encode_key(), "x".encode_key());
        assert_eq!(7u16.encode_key(), 7i128.encode_key());
        assert_eq!(String::from("k").encode_key(), "k".encode_key());
        assert_eq!("héllo".encode_key(), "s6:héllo");
    }

    #[test]
    fn empty_text_anywhere_is_an_empty_key() {
        assert!("".is_empty_key());
        assert!(String::new().is_empty_key());
        assert!((&"").is_empty_key());
        assert!(("acme", "").is_empty_key());
        assert!((1, ("", 2)).is_empty_key());
        assert!(Some("").is_empty_key());
        assert!(!"k".is_empty_key());
        assert!(!(0u64, false).is_empty_key());
        assert!(!None::<&str>.is_empty_key());
        assert!(!().is_empty_key());
    }
}
