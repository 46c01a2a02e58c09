//! Encrypted outcomes: the sealed body format, the [`Keyring`] (feature `encryption`),
//! and the two calls every outcome, recorded error and step value goes through on its
//! way to and from a store (`Idem::seal`, `Idem::open`).
//!
//! # Where sealing happens
//!
//! Where outcomes are encoded and decoded, not in a store wrapper: `Operation::encode`
//! and `Operation::decode_outcome` (`op.rs`, which the leased machine, transactional
//! mode, the HTTP layer and MCP tools all record and replay through), the step's own
//! encode and decode (`step.rs`), and the operator's `Idem::resolve` and `Idem::get`
//! (`idem.rs`). A wrapper around `Store` would have been one place too, but it would
//! miss transactional mode, which runs its statements on the caller's connection
//! without the `Store` trait, and it would not know a step's label from its bytes. Here
//! one place covers every store (memory, SQLite, PostgreSQL, MySQL, Redis, a store of
//! the application's own) and both modes, and a store only ever sees sealed bytes.
//!
//! # The sealed body
//!
//! ```text
//! 0x00 | 0x01 (format) | key id length (1..=255) | key id | 24-byte nonce | ciphertext and 16-byte tag
//! ```
//!
//! No JSON text starts with a NUL byte, so a clear body (recorded before encryption
//! was turned on) is told from a sealed one by its first byte and still replays until
//! it expires. The cipher is XChaCha20-Poly1305 with a fresh random nonce from the
//! operating system per write (192-bit nonces: no counter to keep across processes).
//! The associated data binds the ciphertext to its record: a domain string, whether it
//! is an operation's outcome or a step's value, the operation's identity as stored
//! (scope, name and key, keyed-hashed under `hash_keys`), the step's label, whether it
//! is a recorded `Err`, its schema version, and the header itself (format and key id).
//! A ciphertext copied onto another record, another step, or with its `is_err` or
//! version columns changed fails to open.
//!
//! A sealed body that cannot be opened (its key id is not in the keyring, this `Idem`
//! has no keyring, or it fails authentication) is [`IdemError::Undecryptable`], naming
//! the key id: never a panic, and never decoded as if it were clear text.

use std::borrow::Cow;

use crate::error::{IdemError, OpenFailure};
use crate::store::{OperationId, StoredOutcome};

/// The first byte of a sealed body.
const MARKER: u8 = 0x00;
/// The sealed body format this build writes and reads.
const FORMAT: u8 = 1;
#[cfg_attr(not(feature = "encryption"), allow(dead_code))]
const NONCE_LEN: usize = 24;
#[cfg_attr(not(feature = "encryption"), allow(dead_code))]
const TAG_LEN: usize = 16;

/// What a sealed body belongs to, beside the operation's identity.
#[derive(Clone, Copy)]
pub(crate) enum Part<'a> {
    /// The operation's outcome or recorded error.
    Outcome,
    /// The value of the step with this label.
    Step(&'a str),
}

/// A sealed body, parsed.
#[cfg_attr(not(feature = "encryption"), allow(dead_code))]
struct Envelope<'a> {
    /// The marker, format and key id: authenticated as associated data.
    header: &'a [u8],
    key_id: &'a [u8],
    nonce: &'a [u8],
    /// The ciphertext and its tag.
    sealed: &'a [u8],
}

/// A key id as messages show it.
fn shown(key_id: &[u8]) -> String {
    String::from_utf8_lossy(key_id).escape_debug().to_string()
}

/// `body` as a sealed body, or `None` when it is clear (its first byte is not the
/// marker); `Err` with the key id as far as it could be read when it is malformed.
fn parse(body: &[u8]) -> Option<Result<Envelope<'_>, String>> {
    if body.first() != Some(&MARKER) {
        return None;
    }
    let malformed = |key_id: &[u8]| Err(shown(key_id));
    let (Some(&format), Some(&len)) = (body.get(1), body.get(2)) else {
        return Some(malformed(b""));
    };
    let len = usize::from(len);
    let Some(key_id) = body.get(3..3 + len) else {
        return Some(malformed(&body[3.min(body.len())..]));
    };
    if format != FORMAT || len == 0 || body.len() < 3 + len + NONCE_LEN + TAG_LEN {
        return Some(malformed(key_id));
    }
    let (header, rest) = body.split_at(3 + len);
    let (nonce, sealed) = rest.split_at(NONCE_LEN);
    Some(Ok(Envelope {
        header,
        key_id,
        nonce,
        sealed,
    }))
}

impl StoredOutcome {
    /// The id of the key this outcome is sealed under, or `None` when it is stored in
    /// clear (recorded without [`IdemBuilder::encrypt`](crate::IdemBuilder::encrypt),
    /// or before it was turned on). What [`Idem::get`](crate::Idem::get) returns is opened already where
    /// its keyring could; a body still sealed is one it could not open.
    ///
    /// ```
    /// use idem_runtime::store::StoredOutcome;
    /// let clear = StoredOutcome::new(b"{\"id\":7}".to_vec(), false, 1);
    /// assert_eq!(clear.sealed_key_id(), None);
    /// ```
    pub fn sealed_key_id(&self) -> Option<String> {
        parse(&self.body).map(|parsed| match parsed {
            Ok(envelope) => shown(envelope.key_id),
            Err(key_id) => key_id,
        })
    }
}

/// What an `Idem` seals with: its keyring, when it encrypts (never one without the
/// `encryption` feature).
#[cfg(feature = "encryption")]
pub(crate) type Keys<'a> = Option<&'a Keyring>;
/// What an `Idem` seals with: never a keyring without the `encryption` feature.
#[cfg(not(feature = "encryption"))]
pub(crate) type Keys<'a> = Option<&'a std::convert::Infallible>;

/// `body` as it is stored for `part` of `id`: sealed under the keyring's current key
/// when there is one, else as it is.
#[cfg_attr(not(feature = "encryption"), allow(unused_variables))]
pub(crate) fn seal(
    keys: Keys<'_>,
    id: &OperationId,
    part: Part<'_>,
    is_err: bool,
    version: u32,
    body: Vec<u8>,
) -> Result<Vec<u8>, IdemError> {
    #[cfg(feature = "encryption")]
    if let Some(keyring) = keys {
        return keyring.seal(id, part, is_err, version, &body);
    }
    Ok(body)
}

/// The clear body of a stored one: as it is when it was stored in clear, opened when
/// sealed; [`IdemError::Undecryptable`] when it is sealed and `keys` cannot open it.
#[cfg_attr(not(feature = "encryption"), allow(unused_variables))]
pub(crate) fn open<'b>(
    keys: Keys<'_>,
    id: &OperationId,
    part: Part<'_>,
    is_err: bool,
    version: u32,
    body: &'b [u8],
) -> Result<Cow<'b, [u8]>, IdemError> {
    let undecryptable = |key_id: String, reason: OpenFailure| IdemError::Undecryptable {
        name: match part {
            Part::Outcome => id.name.clone(),
            Part::Step(label) => format!("{}` step `{label}", id.name),
        },
        key_id,
        reason,
    };
    let envelope = match parse(body) {
        None => return Ok(Cow::Borrowed(body)),
        Some(Ok(envelope)) => envelope,
        Some(Err(key_id)) => return Err(undecryptable(key_id, OpenFailure::Malformed)),
    };
    #[cfg(feature = "encryption")]
    if let Some(keyring) = keys {
        let key_id = || shown(envelope.key_id);
        let Some(cipher) = keyring.find(envelope.key_id) else {
            return Err(undecryptable(key_id(), OpenFailure::UnknownKey));
        };
        return match keyring::open(cipher, &envelope, id, part, is_err, version) {
            Some(clear) => Ok(Cow::Owned(clear)),
            None => Err(undecryptable(key_id(), OpenFailure::Unauthentic)),
        };
    }
    Err(undecryptable(
        shown(envelope.key_id),
        OpenFailure::NoKeyring,
    ))
}

/// `outcome` opened in place where `keys` can open it; left as stored (sealed) where
/// they cannot, for an operator's view of the record.
pub(crate) fn open_in_place(
    keys: Keys<'_>,
    id: &OperationId,
    part: Part<'_>,
    outcome: &mut StoredOutcome,
) {
    let (is_err, version) = (outcome.is_err, outcome.version);
    if let Ok(Cow::Owned(clear)) = open(keys, id, part, is_err, version, &outcome.body) {
        outcome.body = clear.into();
    }
}

/// The associated data of a sealed body: everything that says which record it belongs
/// to, each part length-prefixed so no two records' data can run together.
#[cfg_attr(not(feature = "encryption"), allow(dead_code))]
fn associated_data(
    id: &OperationId,
    part: Part<'_>,
    is_err: bool,
    version: u32,
    header: &[u8],
) -> Vec<u8> {
    let label = match part {
        Part::Outcome => None,
        Part::Step(label) => Some(label),
    };
    let fields = [
        id.scope.as_bytes(),
        id.name.as_bytes(),
        id.key.as_bytes(),
        label.unwrap_or_default().as_bytes(),
        header,
    ];
    let mut aad = Vec::with_capacity(32 + fields.iter().map(|f| f.len() + 4).sum::<usize>());
    aad.extend_from_slice(b"idem sealed body v1");
    aad.push(if label.is_some() { b's' } else { b'o' });
    aad.push(u8::from(is_err));
    aad.extend_from_slice(&version.to_be_bytes());
    for field in fields {
        aad.extend_from_slice(&(field.len() as u32).to_be_bytes());
        aad.extend_from_slice(field);
    }
    aad
}

#[cfg(feature = "encryption")]
pub use keyring::Keyring;

#[cfg(feature = "encryption")]
mod keyring {
    use std::sync::Arc;

    use chacha20poly1305::aead::{AeadCore, AeadInPlace, KeyInit, OsRng};
    use chacha20poly1305::{Tag, XChaCha20Poly1305, XNonce};

    use super::{Envelope, FORMAT, MARKER, NONCE_LEN, Part, TAG_LEN, associated_data};
    use crate::error::IdemError;
    use crate::store::OperationId;

    /// The keys outcomes are sealed with ([`IdemBuilder::encrypt`]): one current key,
    /// which every write uses, and any number of retired keys, which reads still open.
    /// Each key is 32 bytes (from a secrets manager, never from source code) under a
    /// short id, 1 to 255 bytes of printable ASCII other than `:` and `,`, stored beside
    /// every ciphertext.
    ///
    /// Rotation: open with the new key current and the old one retired; new records are
    /// sealed under the new key while the old ones still replay. Once every record sealed
    /// under the old key has expired (its operations' `retain`), drop it. A record whose
    /// key id the keyring does not hold is [`IdemError::Undecryptable`].
    ///
    /// `Debug` shows the ids only; the key material is zeroed when the last clone drops.
    ///
    /// [`IdemBuilder::encrypt`]: crate::IdemBuilder::encrypt
    ///
    /// ```
    /// use idem_runtime::Keyring;
    ///
    /// let keys = Keyring::new("2026-03", [7u8; 32])?.with_retired("2025-09", [9u8; 32])?;
    /// assert_eq!(keys.current_id(), "2026-03");
    /// assert_eq!(format!("{keys:?}"), r#"Keyring { current: "2026-03", retired: ["2025-09"] }"#);
    /// // The same keyring from its text form, as an environment variable would hold it.
    /// let hex = |b: u8| format!("{b:02x}").repeat(32);
    /// let parsed: Keyring = format!("2026-03:{},2025-09:{}", hex(7), hex(9)).parse()?;
    /// assert_eq!(parsed.ids().collect::<Vec<_>>(), ["2026-03", "2025-09"]);
    /// # Ok::<(), idem_runtime::IdemError>(())
    /// ```
    #[derive(Clone)]
    pub struct Keyring {
        /// The current key first, then the retired ones.
        keys: Arc<Vec<(String, XChaCha20Poly1305)>>,
    }

    impl std::fmt::Debug for Keyring {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let ids: Vec<&str> = self.ids().collect();
            f.debug_struct("Keyring")
                .field("current", &ids[0])
                .field("retired", &&ids[1..])
                .finish()
        }
    }

    fn config(message: String) -> IdemError {
        IdemError::Config { message }
    }

    fn check_id(id: &str) -> Result<(), IdemError> {
        let printable = id
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b':' && b != b',');
        if id.is_empty() || id.len() > 255 || !printable {
            return Err(config(format!(
                "keyring key id {:?} must be 1 to 255 bytes of printable ASCII other than \
                 `:` and `,` (a date or a counter: \"2026-03\", \"k7\")",
                id.escape_debug().to_string()
            )));
        }
        Ok(())
    }

    fn cipher(id: &str, key: &[u8]) -> Result<XChaCha20Poly1305, IdemError> {
        check_id(id)?;
        XChaCha20Poly1305::new_from_slice(key).map_err(|_| {
            // The length only: the material is never in a message.
            config(format!(
                "keyring key {id:?} is {} bytes; a key is 32 random bytes",
                key.len()
            ))
        })
    }

    impl Keyring {
        /// A keyring whose current key is `key` (32 bytes) under `id`. An id or a key of
        /// the wrong shape is an [`IdemError::Config`], which never shows the key.
        pub fn new(id: &str, key: impl AsRef<[u8]>) -> Result<Keyring, IdemError> {
            let cipher = cipher(id, key.as_ref())?;
            Ok(Keyring {
                keys: Arc::new(vec![(id.to_owned(), cipher)]),
            })
        }

        /// This keyring with a retired key: records sealed under `id` still open; new
        /// ones are sealed under the current key. An id the keyring holds already is an
        /// [`IdemError::Config`].
        pub fn with_retired(self, id: &str, key: impl AsRef<[u8]>) -> Result<Keyring, IdemError> {
            let cipher = cipher(id, key.as_ref())?;
            if self.ids().any(|known| known == id) {
                return Err(config(format!("keyring key id {id:?} is given twice")));
            }
            let mut keys: Vec<_> = self.keys.iter().cloned().collect();
            keys.push((id.to_owned(), cipher));
            Ok(Keyring {
                keys: Arc::new(keys),
            })
        }

        /// The id new records are sealed under.
        pub fn current_id(&self) -> &str {
            &self.keys[0].0
        }

        /// Every key id, the current one first.
        pub fn ids(&self) -> impl Iterator<Item = &str> {
            self.keys.iter().map(|(id, _)| id.as_str())
        }

        pub(super) fn find(&self, key_id: &[u8]) -> Option<&XChaCha20Poly1305> {
            let found = self.keys.iter().find(|(id, _)| id.as_bytes() == key_id);
            found.map(|(_, cipher)| cipher)
        }

        /// `clear` sealed under the current key for `part` of `id`.
        pub(super) fn seal(
            &self,
            id: &OperationId,
            part: Part<'_>,
            is_err: bool,
            version: u32,
            clear: &[u8],
        ) -> Result<Vec<u8>, IdemError> {
            let (key_id, cipher) = &self.keys[0];
            let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
            let head = 3 + key_id.len();
            let mut out = Vec::with_capacity(head + NONCE_LEN + clear.len() + TAG_LEN);
            out.extend_from_slice(&[MARKER, FORMAT, key_id.len() as u8]);
            out.extend_from_slice(key_id.as_bytes());
            let aad = associated_data(id, part, is_err, version, &out);
            out.extend_from_slice(&nonce);
            out.extend_from_slice(clear);
            let start = head + NONCE_LEN;
            let tag = cipher
                .encrypt_in_place_detached(&nonce, &aad, &mut out[start..])
                .map_err(|_| IdemError::Codec {
                    name: id.name.clone(),
                    message: "the outcome could not be encrypted".into(),
                })?;
            out.extend_from_slice(&tag);
            Ok(out)
        }
    }

    /// The clear body of `envelope`, or `None` when it fails authentication.
    pub(super) fn open(
        cipher: &XChaCha20Poly1305,
        envelope: &Envelope<'_>,
        id: &OperationId,
        part: Part<'_>,
        is_err: bool,
        version: u32,
    ) -> Option<Vec<u8>> {
        let aad = associated_data(id, part, is_err, version, envelope.header);
        let (text, tag) = envelope.sealed.split_at(envelope.sealed.len() - TAG_LEN);
        let mut clear = text.to_vec();
        let nonce = XNonce::from_slice(envelope.nonce);
        cipher
            .decrypt_in_place_detached(nonce, &aad, &mut clear, Tag::from_slice(tag))
            .ok()?;
        Some(clear)
    }

    /// The text form `--keyring-env` and configuration files hold: `id:hex` entries
    /// separated by commas, the current key first, each key 64 hex digits.
    impl std::str::FromStr for Keyring {
        type Err = IdemError;

        fn from_str(text: &str) -> Result<Keyring, IdemError> {
            let mut keyring: Option<Keyring> = None;
            for (n, entry) in text.split(',').map(str::trim).enumerate() {
                let Some((id, hex)) = entry.split_once(':') else {
                    return Err(config(format!(
                        "keyring entry {} is not `id:hex` (the current key first, then retired \
                         ones, separated by commas)",
                        n + 1
                    )));
                };
                let key = unhex(hex.trim()).ok_or_else(|| {
                    config(format!(
                        "keyring key {id:?} is not 64 hex digits (32 bytes)"
                    ))
                })?;
                keyring = Some(match keyring {
                    None => Keyring::new(id, key)?,
                    Some(k) => k.with_retired(id, key)?,
                });
            }
            keyring.ok_or_else(|| config("the keyring is empty".into()))
        }
    }

    fn unhex(hex: &str) -> Option<[u8; 32]> {
        let digits = hex.as_bytes();
        if digits.len() != 64 {
            return None;
        }
        let mut key = [0u8; 32];
        for (byte, pair) in key.iter_mut().zip(digits.chunks(2)) {
            let s = std::str::from_utf8(pair).ok()?;
            *byte = u8::from_str_radix(s, 16).ok()?;
        }
        Some(key)
    }
}

#[cfg(all(test, feature = "encryption"))]
mod tests {
    use super::*;
    use crate::Idem;

    fn id(key: &str) -> OperationId {
        OperationId {
            scope: "tenant-a".into(),
            name: "charge".into(),
            key: key.into(),
        }
    }

    fn idem(keyring: Option<Keyring>) -> Idem {
        match keyring {
            Some(k) => Idem::builder().encrypt(k).memory(),
            None => Idem::memory(),
        }
    }

    const CLEAR: &[u8] = br#"{"card":"4242","cents":1999}"#;

    #[test]
    fn the_envelope_is_marker_format_key_id_nonce_ciphertext_tag() {
        let a = idem(Some(Keyring::new("k1", [1u8; 32]).unwrap()));
        let sealed = a
            .seal(&id("o1"), Part::Outcome, false, 1, CLEAR.to_vec())
            .unwrap();
        assert_eq!(&sealed[..5], &[0x00, 0x01, 2, b'k', b'1']);
        assert_eq!(sealed.len(), 5 + NONCE_LEN + CLEAR.len() + TAG_LEN);
        assert!(
            !sealed.windows(4).any(|w| w == b"4242"),
            "the clear text leaked"
        );
        let again = a
            .seal(&id("o1"), Part::Outcome, false, 1, CLEAR.to_vec())
            .unwrap();
        assert_ne!(
            sealed[5..5 + NONCE_LEN],
            again[5..5 + NONCE_LEN],
            "a nonce repeated"
        );
        let stored = StoredOutcome::new(sealed.clone(), false, 1);
        assert_eq!(stored.sealed_key_id().as_deref(), Some("k1"));
        let open = a.open(&id("o1"), Part::Outcome, false, 1, &sealed).unwrap();
        assert_eq!(&*open, CLEAR);
        // A clear body reads as it is, with a keyring or without.
        assert_eq!(
            &*a.open(&id("o1"), Part::Outcome, false, 1, CLEAR).unwrap(),
            CLEAR
        );
    }

    #[test]
    fn a_body_opens_only_for_its_own_record() {
        let a = idem(Some(Keyring::new("k1", [1u8; 32]).unwrap()));
        let sealed = a
            .seal(&id("o1"), Part::Outcome, false, 1, CLEAR.to_vec())
            .unwrap();
        let refused = |r: Result<Cow<'_, [u8]>, IdemError>| match r {
            Err(IdemError::Undecryptable {
                key_id,
                reason: OpenFailure::Unauthentic,
                ..
            }) => {
                assert_eq!(key_id, "k1")
            }
            other => panic!("{other:?}"),
        };
        refused(a.open(&id("o2"), Part::Outcome, false, 1, &sealed));
        refused(a.open(&id("o1"), Part::Step("o"), false, 1, &sealed));
        refused(a.open(&id("o1"), Part::Outcome, true, 1, &sealed));
        refused(a.open(&id("o1"), Part::Outcome, false, 2, &sealed));
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        refused(a.open(&id("o1"), Part::Outcome, false, 1, &flipped));
        // Another key under the same id.
        let b = idem(Some(Keyring::new("k1", [2u8; 32]).unwrap()));
        refused(b.open(&id("o1"), Part::Outcome, false, 1, &sealed));
        // Truncated: refused, never read as clear text.
        let r = a.open(&id("o1"), Part::Outcome, false, 1, &sealed[..20]);
        assert!(matches!(r, Err(IdemError::Undecryptable { .. })), "{r:?}");
        let r = a.open(&id("o1"), Part::Outcome, false, 1, &[0u8]);
        assert!(matches!(r, Err(IdemError::Undecryptable { .. })), "{r:?}");
    }

    #[test]
    fn rotation_reads_retired_keys_and_names_unknown_ones() {
        let old = idem(Some(Keyring::new("a", [1u8; 32]).unwrap()));
        let sealed = old
            .seal(&id("o1"), Part::Step("charge"), false, 1, CLEAR.to_vec())
            .unwrap();
        let rotated = Keyring::new("b", [2u8; 32])
            .unwrap()
            .with_retired("a", [1u8; 32])
            .unwrap();
        let new = idem(Some(rotated));
        let open = new
            .open(&id("o1"), Part::Step("charge"), false, 1, &sealed)
            .unwrap();
        assert_eq!(&*open, CLEAR);
        let fresh = new
            .seal(&id("o1"), Part::Outcome, false, 1, CLEAR.to_vec())
            .unwrap();
        assert_eq!(&fresh[..4], &[0x00, 0x01, 1, b'b']);
        for without in [
            idem(Some(Keyring::new("b", [2u8; 32]).unwrap())),
            idem(None),
        ] {
            match without.open(&id("o1"), Part::Step("charge"), false, 1, &sealed) {
                Err(e @ IdemError::Undecryptable { reason, .. }) if reason.is_missing_key() => {
                    assert!(e.to_string().contains("key `a`"), "{e}");
                    assert!(e.to_string().contains("charge` step `charge"), "{e}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn keyrings_refuse_bad_ids_and_keys_and_never_show_keys() {
        assert!(Keyring::new("", [1u8; 32]).is_err());
        assert!(Keyring::new("a:b", [1u8; 32]).is_err());
        assert!(Keyring::new(&"x".repeat(256), [1u8; 32]).is_err());
        let short = Keyring::new("a", [0xabu8; 16]).unwrap_err().to_string();
        assert!(
            short.contains("16 bytes") && !short.contains("ab"),
            "{short}"
        );
        let k = Keyring::new("a", [0xabu8; 32]).unwrap();
        assert!(k.clone().with_retired("a", [1u8; 32]).is_err());
        let text = format!("a:{},b:{}", "ab".repeat(32), "cd".repeat(32));
        let parsed: Keyring = text.parse().unwrap();
        let shown = format!("{parsed:?}");
        assert_eq!(shown, r#"Keyring { current: "a", retired: ["b"] }"#);
        assert!(!shown.contains("abab"));
        assert!("a:abcd".parse::<Keyring>().is_err());
        assert!("".parse::<Keyring>().is_err());
        let idem = Idem::builder().encrypt(parsed).memory();
        assert!(!format!("{idem:?}").contains("abab"));
    }
}
