//! The canonical request fingerprint: SHA-256 over a typed, length-prefixed (LEB128),
//! versioned encoding of any `Serialize` value, with map and struct entries sorted so
//! that `HashMap` iteration order and serde_json's feature flags cannot change it (a
//! part of [`LARGE_PART`] bytes or more enters as the BLAKE3 digest of its encoding,
//! zero-padded); and under
//! `hash_keys`, the keyed form of it that the store holds.

use hmac::{Hmac, Mac};
use serde::ser::{self, Serialize};
use sha2::{Digest, Sha256};

/// Bumped if the encoding below ever changes, so old and new fingerprints never collide.
const ENCODING_VERSION: u8 = 4;

/// An encoded part this long or longer enters the SHA-256 stream as `D` and the BLAKE3
/// digest of its encoding padded with zeros to a multiple of [`BLAKE3_PAD`].
///
/// BLAKE3 hashes its 1 KiB chunks side by side only in groups of four or more whole
/// ones, and a partial last chunk one block after another: a 3,622-byte encoding takes
/// longer than SHA-256 on the CPU's SHA extensions, and the same bytes padded to 4 KiB
/// less than half as long (BENCHMARKS.md, "Fingerprint"). From about 2 KiB, padded
/// BLAKE3 is the faster; under it, SHA-256.
///
/// Every part's own encoding starts with `P` and is self-delimiting, so the zeros after
/// it and the stream around it still read back one way only, and the fingerprint is as
/// collision-resistant as the weaker of the two hashes.
const LARGE_PART: usize = 2 * 1024;

/// What a large part's encoding is padded to a multiple of: four BLAKE3 chunks.
const BLAKE3_PAD: usize = 4 * 1024;

/// A request fingerprint being built from named parts: each part is encoded into this
/// thread's scratch buffer and hashed at once, so a call allocates nothing for it.
#[derive(Clone, Debug)]
pub(crate) struct FingerprintBuilder {
    /// The digest so far, the encoding version first.
    hasher: Sha256,
}

impl Default for FingerprintBuilder {
    fn default() -> Self {
        FingerprintBuilder {
            hasher: Sha256::new_with_prefix([ENCODING_VERSION]),
        }
    }
}

thread_local! {
    /// The encoding buffers every fingerprint on this thread reuses.
    static SCRATCH: std::cell::RefCell<Out> = std::cell::RefCell::new(Out::default());
}

/// A scratch buffer grown past this by one large request is dropped after it, not kept.
const SCRATCH_KEPT: usize = 64 * 1024;

/// The encoding being written, with room every map within it reuses: no allocation per
/// map or struct.
#[derive(Clone, Debug, Default)]
struct Out {
    buf: Vec<u8>,
    /// The entries of the maps being written, the innermost last (each map's from where
    /// it started).
    spans: Vec<Entry>,
    /// Where an unsorted map's entries are copied while they are put in order.
    scratch: Vec<u8>,
    /// The field names of the last struct put in order, as they arrived, and the order
    /// its entries went in: the next struct whose fields arrive as the same names (a
    /// list of one type) goes in that order without sorting.
    order_names: Vec<&'static str>,
    order: Vec<usize>,
}

impl FingerprintBuilder {
    pub(crate) fn add<T: Serialize + ?Sized>(
        &mut self,
        name: &str,
        value: &T,
    ) -> Result<(), String> {
        self.add_bounded(name, value, LARGE_PART)
    }

    /// [`add`](Self::add), with parts of `large` bytes or more entering as their padded
    /// encoding's BLAKE3 digest.
    fn add_bounded<T: Serialize + ?Sized>(
        &mut self,
        name: &str,
        value: &T,
        large: usize,
    ) -> Result<(), String> {
        SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
            Ok(mut out) => self.add_with(&mut out, name, value, large),
            // A `Serialize` impl that fingerprints something itself, inside this one.
            Err(_) => self.add_with(&mut Out::default(), name, value, large),
        })
    }

    fn add_with<T: Serialize + ?Sized>(
        &mut self,
        out: &mut Out,
        name: &str,
        value: &T,
        large: usize,
    ) -> Result<(), String> {
        let encoded = encode_part(out, name, value);
        if encoded.is_ok() {
            if out.buf.len() >= large {
                out.buf
                    .resize(out.buf.len().next_multiple_of(BLAKE3_PAD), 0);
                self.hasher.update([b'D']);
                self.hasher.update(blake3::hash(&out.buf).as_bytes());
            } else {
                self.hasher.update(&out.buf);
            }
        }
        if out.buf.capacity() > SCRATCH_KEPT || out.scratch.capacity() > SCRATCH_KEPT {
            *out = Out::default();
        }
        encoded.map_err(|e| e.0)
    }

    pub(crate) fn finish(&self) -> [u8; 32] {
        self.hasher.clone().finalize().into()
    }
}

/// Writes the canonical encoding of the part `name` = `value` into `out.buf`, replacing
/// what was there.
fn encode_part<T: Serialize + ?Sized>(
    out: &mut Out,
    name: &str,
    value: &T,
) -> Result<(), CanonError> {
    out.buf.clear();
    out.spans.clear();
    write_tagged_bytes(&mut out.buf, b'P', name.as_bytes());
    value.serialize(Canonical { out: &mut *out })
}

/// The bytes [`fingerprint`] hashes for `value`, where its encoding is under
/// [`LARGE_PART`]: the encoding version, then `value` as its one part. Not a stable
/// API; the benches hash it.
#[doc(hidden)]
pub fn canonical_encoding<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, String> {
    let mut out = Out::default();
    encode_part(&mut out, "", value).map_err(|e| e.0)?;
    let mut bytes = Vec::with_capacity(1 + out.buf.len());
    bytes.push(ENCODING_VERSION);
    bytes.extend_from_slice(&out.buf);
    Ok(bytes)
}

/// The length of `value`'s encoding as a part, written where [`fingerprint`] writes it
/// (the thread's kept buffer) and not hashed: the encoding's share of a fingerprint.
/// Not a stable API; the benches time it.
#[doc(hidden)]
pub fn encoded_len<T: Serialize + ?Sized>(value: &T) -> Result<usize, String> {
    SCRATCH.with(|scratch| {
        let mut out = scratch.try_borrow_mut().map_err(|e| e.to_string())?;
        encode_part(&mut out, "", value).map_err(|e| e.0)?;
        Ok(out.buf.len())
    })
}

/// [`fingerprint`] with parts of `large` bytes or more, instead of [`LARGE_PART`],
/// entering as their padded BLAKE3 digest: the benches weigh the bound with it. Not a
/// stable API.
#[doc(hidden)]
pub fn fingerprint_with_bound<T: Serialize + ?Sized>(
    value: &T,
    large: usize,
) -> Result<[u8; 32], String> {
    let mut b = FingerprintBuilder::default();
    b.add_bounded("", value, large)?;
    Ok(b.finish())
}

/// What the store holds for a fingerprint under `hash_keys`: HMAC-SHA256 of the
/// fingerprint, so a dictionary of likely requests (tenant, order number, amount) cannot
/// be checked against a stolen table without the secret.
///
/// Keyed with a key derived from the secret rather than the secret itself, so no
/// stored fingerprint can equal the digest of a key or scope beside it. The MAC covers
/// the SHA-256 of the encoding, not the encoding: one MAC over 32 bytes per call, and the
/// fingerprint stays collision-resistant (a collision of the MAC input is one of SHA-256).
#[derive(Clone)]
pub(crate) struct FingerprintKey(Hmac<Sha256>);

impl FingerprintKey {
    /// What the fingerprint key is derived with, under the `hash_keys` secret.
    const LABEL: &'static [u8] = b"idem fingerprint key v1";

    pub(crate) fn new(secret: &[u8]) -> FingerprintKey {
        let derived = Hmac::<Sha256>::new_from_slice(secret)
            .expect("HMAC takes a key of any length")
            .chain_update(Self::LABEL)
            .finalize()
            .into_bytes();
        // The inner and outer pads are hashed here once; each call clones the state.
        FingerprintKey(
            Hmac::<Sha256>::new_from_slice(&derived).expect("HMAC takes a key of any length"),
        )
    }

    /// The stored form of `fingerprint`.
    pub(crate) fn apply(&self, fingerprint: [u8; 32]) -> [u8; 32] {
        self.0
            .clone()
            .chain_update(fingerprint)
            .finalize()
            .into_bytes()
            .into()
    }
}

impl std::fmt::Debug for FingerprintKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FingerprintKey(***)")
    }
}

/// The fingerprint of one value, as `Operation::fingerprint` computes it.
///
/// Stable across processes and builds: a struct holding a `HashMap` fingerprints the
/// same whatever the map's iteration order. An [`Idem`](crate::Idem) built with
/// [`hash_keys`](crate::IdemBuilder::hash_keys) stores not this value but an
/// HMAC-SHA256 of it under a key derived from the secret.
///
/// ```
/// use std::collections::HashMap;
/// let a: HashMap<&str, i32> = [("x", 1), ("y", 2)].into_iter().collect();
/// let b: HashMap<&str, i32> = [("y", 2), ("x", 1)].into_iter().collect();
/// assert_eq!(idem_runtime::fingerprint(&a).unwrap(), idem_runtime::fingerprint(&b).unwrap());
/// assert_ne!(idem_runtime::fingerprint(&1).unwrap(), idem_runtime::fingerprint(&"1").unwrap());
/// ```
pub fn fingerprint<T: Serialize + ?Sized>(value: &T) -> Result<[u8; 32], crate::IdemError> {
    fingerprint_with_bound(value, LARGE_PART).map_err(|message| crate::IdemError::Codec {
        name: String::new(),
        message: format!("cannot fingerprint the value: {message}"),
    })
}

/// The struct name serde_json gives a `Number` under its `arbitrary_precision` feature
/// (the digits travel as a string field of the same name).
const JSON_NUMBER: &str = "$serde_json::private::Number";
/// The struct name serde_json gives a `RawValue` (the JSON text as a string field).
const JSON_RAW: &str = "$serde_json::private::RawValue";

/// `a <= b` for two encoded map entries. Entries nearly always differ within their first
/// bytes (the key's tag, length and first letters), which are compared here without a
/// call into the C library's `memcmp`.
#[inline]
fn entry_le(a: &[u8], b: &[u8]) -> bool {
    for (x, y) in a.iter().zip(b).take(16) {
        if x != y {
            return x < y;
        }
    }
    a <= b
}

/// `n` in LEB128, and how many of the array's bytes that takes.
#[inline]
fn leb128(mut n: u64) -> ([u8; 10], usize) {
    let mut bytes = [0u8; 10];
    let mut i = 0;
    while n >= 0x80 {
        bytes[i] = (n as u8) | 0x80;
        n >>= 7;
        i += 1;
    }
    bytes[i] = n as u8;
    (bytes, i + 1)
}

/// A one-byte tag and `n` in unsigned LEB128: seven bits a byte, low first, the high bit
/// set on all but the last. Minimal by construction, so one length has one encoding; a
/// length under 128 (every field name, most strings) costs one byte where a fixed `u64`
/// would cost eight, which keeps a small request within fewer hash blocks. The one- and
/// two-byte forms (every length under 16 KiB, most integers) are fixed-size copies of a
/// few bytes built in registers.
#[inline(always)]
fn write_tagged(out: &mut Vec<u8>, tag: u8, n: u64) {
    if n < 0x80 {
        out.extend_from_slice(&[tag, n as u8]);
    } else if n < 0x4000 {
        out.extend_from_slice(&[tag, (n as u8) | 0x80, (n >> 7) as u8]);
    } else {
        write_tagged_long(out, tag, n);
    }
}

#[cold]
fn write_tagged_long(out: &mut Vec<u8>, tag: u8, n: u64) {
    out.push(tag);
    let (bytes, len) = leb128(n);
    out.extend_from_slice(&bytes[..len]);
}

/// Appends `bytes`; one of 16 bytes or fewer with fixed-size copies rather than a call
/// to `memcpy`, whose start-up costs more than such a copy (most field names and many
/// values are this short).
#[inline]
fn append(out: &mut Vec<u8>, bytes: &[u8]) {
    let n = bytes.len();
    if n > 16 {
        out.extend_from_slice(bytes);
        return;
    }
    let start = out.len();
    out.extend_from_slice(&[0u8; 16]);
    let dst = &mut out[start..start + 16];
    if n >= 8 {
        dst[..8].copy_from_slice(&bytes[..8]);
        dst[n - 8..n].copy_from_slice(&bytes[n - 8..]);
    } else if n >= 4 {
        dst[..4].copy_from_slice(&bytes[..4]);
        dst[n - 4..n].copy_from_slice(&bytes[n - 4..]);
    } else {
        for (d, b) in dst.iter_mut().zip(bytes) {
            *d = *b;
        }
    }
    out.truncate(start + n);
}

fn write_varint(out: &mut Vec<u8>, mut n: u128) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// Reads a length as [`write_tagged`] wrote it (after the tag) at the start of `bytes`:
/// the length and the rest.
fn read_len(bytes: &[u8]) -> Option<(usize, &[u8])> {
    let mut n: usize = 0;
    for (i, &b) in bytes.iter().enumerate().take(10) {
        n |= usize::from(b & 0x7f).checked_shl(7 * i as u32)?;
        if b & 0x80 == 0 {
            return Some((n, &bytes[i + 1..]));
        }
    }
    None
}

/// A string with its tag: `s`, its length, its bytes.
#[inline]
fn write_tagged_str(out: &mut Vec<u8>, s: &str) {
    write_tagged_bytes(out, b's', s.as_bytes());
}

/// `tag`, the length of `bytes`, and `bytes`.
#[inline]
fn write_tagged_bytes(out: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
    // The tag, the longest length, and the 16-byte block `append` writes at most.
    out.reserve(27 + bytes.len());
    write_tagged(out, tag, bytes.len() as u64);
    append(out, bytes);
}

#[derive(Debug)]
pub(crate) struct CanonError(String);

impl std::fmt::Display for CanonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for CanonError {}

impl ser::Error for CanonError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        CanonError(msg.to_string())
    }
}

struct Canonical<'a> {
    out: &'a mut Out,
}

/// One entry of a map or struct being written: its bytes in `Out::buf`, key first, and
/// a struct field's name.
#[derive(Clone, Copy, Debug)]
struct Entry {
    start: usize,
    end: usize,
    name: Option<&'static str>,
}

/// Collects sequence items in order, or map entries to be sorted on `end`; or stands for
/// one of serde_json's private number or raw-JSON structs, encoded as the value it holds.
struct Compound<'a> {
    out: &'a mut Out,
    /// For a map or struct: where its first entry starts and where its spans start in
    /// `out.spans`. Entries are written in place and reordered on `finish` only if they
    /// arrived out of order. No count: every value starts with a tag and `E` is none of
    /// them, so the closing `E` ends the entries unambiguously.
    map: Option<(usize, usize)>,
    /// Where the pending map key starts in `out`.
    key_start: usize,
    json: Option<&'static str>,
    /// For a struct: whether its fields arrived in the encoding's order so far, judged by
    /// their names alone, and the last name. Spares `finish` comparing the entries.
    names: Option<(bool, Option<&'static str>)>,
}

/// Whether a field named `a` encodes before one named `b`: shorter first (the LEB128
/// length comes first), then by bytes. Only for lengths of one LEB128 byte, where byte
/// order is numeric order; longer names are left to `finish`'s comparison.
#[inline]
fn name_before(a: &str, b: &str) -> bool {
    if a.len() >= 0x80 || b.len() >= 0x80 {
        return false;
    }
    if a.len() != b.len() {
        return a.len() < b.len();
    }
    !entry_le(b.as_bytes(), a.as_bytes())
}

impl<'a> Compound<'a> {
    #[inline]
    fn seq(out: &'a mut Out) -> Self {
        out.buf.push(b'L');
        Compound {
            out,
            map: None,
            key_start: 0,
            json: None,
            names: None,
        }
    }
    #[inline]
    fn map(out: &'a mut Out) -> Self {
        out.buf.push(b'M');
        let key_start = out.buf.len();
        let spans_from = out.spans.len();
        Compound {
            out,
            map: Some((key_start, spans_from)),
            key_start,
            json: None,
            names: None,
        }
    }
    #[inline]
    fn structure(out: &'a mut Out) -> Self {
        Compound {
            names: Some((true, None)),
            ..Compound::map(out)
        }
    }
    fn json(out: &'a mut Out, token: &'static str) -> Self {
        Compound {
            out,
            map: None,
            key_start: 0,
            json: Some(token),
            names: None,
        }
    }

    /// A serde_json number or raw value, encoded exactly as serde_json's default build
    /// would have serialized it, so enabling `arbitrary_precision` or `raw_value`
    /// anywhere in an application's graph changes no fingerprint. Kept out of line, so
    /// that every other struct's fields stay small enough to inline.
    #[cold]
    #[inline(never)]
    fn json_field<T: Serialize + ?Sized>(&mut self, token: &str, v: &T) -> Result<(), CanonError> {
        let mut field = Out::default();
        v.serialize(Canonical { out: &mut field })?;
        // The field is a string; its canonical form is `s`, its length, the bytes.
        let text = match field
            .buf
            .split_first()
            .and_then(|(tag, rest)| (*tag == b's').then(|| read_len(rest)).flatten())
        {
            Some((len, bytes)) if bytes.len() == len => std::str::from_utf8(bytes)
                .map_err(|e| CanonError(format!("serde_json sent a non-UTF-8 number: {e}")))?
                .to_owned(),
            _ => {
                return Err(CanonError(format!("`{token}` without its string field")));
            }
        };
        let out = Canonical { out: self.out };
        if token == JSON_NUMBER {
            // serde_json's default keeps u64, then i64, else f64.
            if let Ok(n) = text.parse::<u64>() {
                return ser::Serializer::serialize_u64(out, n);
            }
            if let Ok(n) = text.parse::<i64>() {
                return ser::Serializer::serialize_i64(out, n);
            }
            return match text.parse::<f64>() {
                Ok(n) => ser::Serializer::serialize_f64(out, n),
                Err(e) => Err(CanonError(format!("invalid JSON number `{text}`: {e}"))),
            };
        }
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| CanonError(format!("invalid raw JSON: {e}")))?;
        value.serialize(out)
    }
    #[inline]
    fn item<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), CanonError> {
        v.serialize(Canonical { out: self.out })
    }
    #[inline]
    fn key<T: Serialize + ?Sized>(&mut self, k: &T) -> Result<(), CanonError> {
        self.key_start = self.out.buf.len();
        k.serialize(Canonical { out: self.out })
    }
    #[inline]
    fn value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), CanonError> {
        self.entry(v, None)
    }
    /// Writes the value of the entry whose key starts at `key_start`, and notes the
    /// entry.
    #[inline]
    fn entry<T: Serialize + ?Sized>(
        &mut self,
        v: &T,
        name: Option<&'static str>,
    ) -> Result<(), CanonError> {
        v.serialize(Canonical { out: self.out })?;
        self.out.spans.push(Entry {
            start: self.key_start,
            end: self.out.buf.len(),
            name,
        });
        Ok(())
    }
    #[inline]
    fn field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        v: &T,
    ) -> Result<(), CanonError> {
        if let Some(token) = self.json {
            return self.json_field(token, v);
        }
        if let Some((in_order, last)) = &mut self.names {
            *in_order = *in_order && last.is_none_or(|last| name_before(last, name));
            *last = Some(name);
        }
        self.key_start = self.out.buf.len();
        write_tagged_str(&mut self.out.buf, name);
        self.entry(v, Some(name))
    }
    #[inline]
    fn finish(self) -> Result<(), CanonError> {
        if self.json.is_some() {
            return Ok(());
        }
        if let Some((start, spans_from)) = self.map {
            if !matches!(self.names, Some((true, _))) {
                order_entries(self.out, start, spans_from);
            }
            self.out.spans.truncate(spans_from);
        }
        self.out.buf.push(b'E');
        Ok(())
    }
}

/// Puts the entries of the map being finished in order: they were written in arrival
/// order, and are moved only if they did not arrive in it. Keys are self-delimiting, so
/// ordering whole entries orders them by key first.
#[inline(never)]
fn order_entries(out: &mut Out, start: usize, spans_from: usize) {
    let Out {
        buf,
        spans,
        scratch,
        order_names,
        order,
    } = out;
    let entries = &spans[spans_from..];
    let bytes = |e: &Entry| &buf[e.start..e.end];
    // A struct's fields whose names are all under 128 bytes: an entry starts with its
    // name's tag, one length byte and the name, so distinct names order the entries
    // (shorter first, then by bytes) whatever their values. The fields' names already
    // said they are out of order.
    let named = entries
        .iter()
        .all(|e| e.name.is_some_and(|n| n.len() < 0x80));
    let same_names = named
        && !order_names.is_empty()
        && order_names.len() == entries.len()
        && order_names
            .iter()
            .zip(entries)
            .all(|(n, e)| e.name.is_some_and(|m| std::ptr::eq(*n, m)));
    if !same_names {
        order_names.clear();
        order.clear();
        order.extend(0..entries.len());
        if !named
            && entries
                .windows(2)
                .all(|w| entry_le(bytes(&w[0]), bytes(&w[1])))
        {
            return;
        }
        let key = |e: &Entry| {
            let name = e.name.unwrap_or("");
            (name.len(), name.as_bytes())
        };
        order.sort_unstable_by(|&a, &b| {
            let (a, b) = (&entries[a], &entries[b]);
            if named {
                key(a).cmp(&key(b)).then_with(|| bytes(a).cmp(bytes(b)))
            } else {
                bytes(a).cmp(bytes(b))
            }
        });
        // Fields of one name twice (a hand-written `Serialize`) order by their values:
        // that order is this struct's alone.
        let distinct = named
            && order
                .windows(2)
                .all(|w| key(&entries[w[0]]) != key(&entries[w[1]]));
        if distinct {
            order_names.extend(entries.iter().filter_map(|e| e.name));
        }
    }
    scratch.clear();
    for &i in order.iter() {
        append(scratch, bytes(&entries[i]));
    }
    buf.truncate(start);
    buf.extend_from_slice(scratch);
}

impl<'a> ser::Serializer for Canonical<'a> {
    type Ok = ();
    type Error = CanonError;
    type SerializeSeq = Compound<'a>;
    type SerializeTuple = Compound<'a>;
    type SerializeTupleStruct = Compound<'a>;
    type SerializeTupleVariant = Compound<'a>;
    type SerializeMap = Compound<'a>;
    type SerializeStruct = Compound<'a>;
    type SerializeStructVariant = Compound<'a>;

    #[inline]
    fn serialize_bool(self, v: bool) -> Result<(), CanonError> {
        self.out.buf.extend_from_slice(&[b'B', v as u8]);
        Ok(())
    }
    fn serialize_i8(self, v: i8) -> Result<(), CanonError> {
        self.serialize_i64(v.into())
    }
    fn serialize_i16(self, v: i16) -> Result<(), CanonError> {
        self.serialize_i64(v.into())
    }
    fn serialize_i32(self, v: i32) -> Result<(), CanonError> {
        self.serialize_i64(v.into())
    }
    #[inline]
    fn serialize_i64(self, v: i64) -> Result<(), CanonError> {
        // The zigzag of an `i64` fits a `u64`: the same bytes as the `i128` path.
        write_tagged(&mut self.out.buf, b'I', ((v << 1) ^ (v >> 63)) as u64);
        Ok(())
    }
    fn serialize_i128(self, v: i128) -> Result<(), CanonError> {
        // Zigzag, then LEB128: small magnitudes of either sign take a byte or two, and
        // every integer type shares the one encoding of its value.
        self.out.buf.push(b'I');
        write_varint(&mut self.out.buf, ((v << 1) ^ (v >> 127)) as u128);
        Ok(())
    }
    fn serialize_u8(self, v: u8) -> Result<(), CanonError> {
        self.serialize_u64(v.into())
    }
    fn serialize_u16(self, v: u16) -> Result<(), CanonError> {
        self.serialize_u64(v.into())
    }
    fn serialize_u32(self, v: u32) -> Result<(), CanonError> {
        self.serialize_u64(v.into())
    }
    #[inline]
    fn serialize_u64(self, v: u64) -> Result<(), CanonError> {
        match v.checked_mul(2) {
            Some(zigzag) => {
                write_tagged(&mut self.out.buf, b'I', zigzag);
                Ok(())
            }
            None => self.serialize_i128(v.into()),
        }
    }
    fn serialize_u128(self, v: u128) -> Result<(), CanonError> {
        match i128::try_from(v) {
            Ok(v) => self.serialize_i128(v),
            Err(_) => {
                self.out.buf.push(b'U');
                self.out.buf.extend_from_slice(&v.to_be_bytes());
                Ok(())
            }
        }
    }
    fn serialize_f32(self, v: f32) -> Result<(), CanonError> {
        self.serialize_f64(v.into())
    }
    fn serialize_f64(self, v: f64) -> Result<(), CanonError> {
        self.out.buf.push(b'F');
        self.out.buf.extend_from_slice(&v.to_bits().to_be_bytes());
        Ok(())
    }
    fn serialize_char(self, v: char) -> Result<(), CanonError> {
        self.serialize_str(v.encode_utf8(&mut [0; 4]))
    }
    #[inline]
    fn serialize_str(self, v: &str) -> Result<(), CanonError> {
        write_tagged_str(&mut self.out.buf, v);
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), CanonError> {
        write_tagged_bytes(&mut self.out.buf, b'b', v);
        Ok(())
    }
    #[inline]
    fn serialize_none(self) -> Result<(), CanonError> {
        self.out.buf.push(b'N');
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), CanonError> {
        self.out.buf.push(b'S');
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), CanonError> {
        self.serialize_none()
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), CanonError> {
        self.serialize_none()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), CanonError> {
        // Variant names, not indices: reordering an enum must not change fingerprints.
        write_tagged_bytes(&mut self.out.buf, b'V', variant.as_bytes());
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), CanonError> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), CanonError> {
        write_tagged_bytes(&mut self.out.buf, b'V', variant.as_bytes());
        value.serialize(self)
    }
    #[inline]
    fn serialize_seq(self, _: Option<usize>) -> Result<Compound<'a>, CanonError> {
        Ok(Compound::seq(self.out))
    }
    #[inline]
    fn serialize_tuple(self, _: usize) -> Result<Compound<'a>, CanonError> {
        Ok(Compound::seq(self.out))
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Compound<'a>, CanonError> {
        Ok(Compound::seq(self.out))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'a>, CanonError> {
        write_tagged_bytes(&mut self.out.buf, b'V', variant.as_bytes());
        Ok(Compound::seq(self.out))
    }
    #[inline]
    fn serialize_map(self, _: Option<usize>) -> Result<Compound<'a>, CanonError> {
        Ok(Compound::map(self.out))
    }
    #[inline]
    fn serialize_struct(self, name: &'static str, _: usize) -> Result<Compound<'a>, CanonError> {
        Ok(match name {
            JSON_NUMBER => Compound::json(self.out, JSON_NUMBER),
            JSON_RAW => Compound::json(self.out, JSON_RAW),
            _ => Compound::structure(self.out),
        })
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'a>, CanonError> {
        write_tagged_bytes(&mut self.out.buf, b'V', variant.as_bytes());
        Ok(Compound::structure(self.out))
    }
}

impl ser::SerializeSeq for Compound<'_> {
    type Ok = ();
    type Error = CanonError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), CanonError> {
        self.item(v)
    }
    fn end(self) -> Result<(), CanonError> {
        self.finish()
    }
}
impl ser::SerializeTuple for Compound<'_> {
    type Ok = ();
    type Error = CanonError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), CanonError> {
        self.item(v)
    }
    fn end(self) -> Result<(), CanonError> {
        self.finish()
    }
}
impl ser::SerializeTupleStruct for Compound<'_> {
    type Ok = ();
    type Error = CanonError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), CanonError> {
        self.item(v)
    }
    fn end(self) -> Result<(), CanonError> {
        self.finish()
    }
}
impl ser::SerializeTupleVariant for Compound<'_> {
    type Ok = ();
    type Error = CanonError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), CanonError> {
        self.item(v)
    }
    fn end(self) -> Result<(), CanonError> {
        self.finish()
    }
}
impl ser::SerializeMap for Compound<'_> {
    type Ok = ();
    type Error = CanonError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> Result<(), CanonError> {
        self.key(k)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), CanonError> {
        self.value(v)
    }
    fn end(self) -> Result<(), CanonError> {
        self.finish()
    }
}
impl ser::SerializeStruct for Compound<'_> {
    type Ok = ();
    type Error = CanonError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        v: &T,
    ) -> Result<(), CanonError> {
        self.field(name, v)
    }
    fn end(self) -> Result<(), CanonError> {
        self.finish()
    }
}
impl ser::SerializeStructVariant for Compound<'_> {
    type Ok = ();
    type Error = CanonError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        v: &T,
    ) -> Result<(), CanonError> {
        self.field(name, v)
    }
    fn end(self) -> Result<(), CanonError> {
        self.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::fingerprint;
    use std::collections::{BTreeMap, HashMap};

    #[test]
    fn maps_are_order_independent_and_typed() {
        let h: HashMap<String, u32> = (0..50).map(|i| (format!("k{i}"), i)).collect();
        let b: BTreeMap<String, u32> = h.clone().into_iter().collect();
        assert_eq!(fingerprint(&h).unwrap(), fingerprint(&b).unwrap());
        assert_ne!(
            fingerprint(&("a:b", "c")).unwrap(),
            fingerprint(&("a", "b:c")).unwrap()
        );
        assert_ne!(fingerprint(&Some(1)).unwrap(), fingerprint(&1).unwrap());
        assert_ne!(
            fingerprint(&vec![1, 2]).unwrap(),
            fingerprint(&vec![2, 1]).unwrap()
        );
    }

    #[test]
    fn encoding_is_pinned() {
        // A change to the canonical encoding would silently turn every retry into a
        // mismatch; this pins it.
        let v: BTreeMap<&str, (i32, &str)> = [("a", (1, "x"))].into_iter().collect();
        let hex: String = fingerprint(&v)
            .unwrap()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hex, PINNED);
    }
    const PINNED: &str = "cb4a564f9eb794e98d0e54d397273d45fbea825a15911146645abe75e507ad4d";
    #[test]
    fn nested_sorted_encoding_is_pinned() {
        // Entries arrive out of order at two depths (struct fields, map keys) and nest a
        // sorted map inside a sorted struct: the in-place reordering is pinned too.
        #[derive(serde::Serialize)]
        struct Inner {
            zeta: u8,
            alpha: Vec<&'static str>,
        }
        #[derive(serde::Serialize)]
        struct Outer {
            name: &'static str,
            tags: HashMap<&'static str, Inner>,
            amount: u64,
            empty: BTreeMap<u8, u8>,
        }
        let tags = [
            (
                "y",
                Inner {
                    zeta: 2,
                    alpha: vec!["q"],
                },
            ),
            (
                "b",
                Inner {
                    zeta: 1,
                    alpha: vec![],
                },
            ),
            (
                "m",
                Inner {
                    zeta: 9,
                    alpha: vec!["r", "s"],
                },
            ),
        ]
        .into_iter()
        .collect();
        let v = Outer {
            name: "n",
            tags,
            amount: 42,
            empty: BTreeMap::new(),
        };
        let hex: String = fingerprint(&v)
            .unwrap()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hex, NESTED_PINNED);
    }
    const NESTED_PINNED: &str = "f4e463700d0bf3efb987d48deb910726d9d557544d3a615d1e6dec2c4e8de01e";

    /// The encoding byte by byte: LEB128 lengths, zigzag LEB128 integers, maps closed by
    /// `E` without a count.
    #[test]
    fn the_encoding_is_pinned_byte_by_byte() {
        let v: BTreeMap<&str, (i32, &str)> = [("a", (1, "x"))].into_iter().collect();
        let expected = [
            &[super::ENCODING_VERSION, b'P', 0][..], // version, the part, its empty name
            b"Ms\x01a",                              // a map; the key "a"
            b"LI\x02s\x01xE",                        // (1, "x"): 1 zigzags to 2
            b"E",                                    // the map's end
        ]
        .concat();
        assert_eq!(super::canonical_encoding(&v).unwrap(), expected);

        let long = "y".repeat(300);
        let bytes = super::canonical_encoding(&(-3i64, u64::MAX, &long[..])).unwrap();
        let mut expected = vec![super::ENCODING_VERSION, b'P', 0, b'L'];
        expected.extend_from_slice(b"I\x05"); // -3 zigzags to 5
        expected.extend_from_slice(&[
            b'I', 0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x03,
        ]);
        expected.extend_from_slice(&[b's', 0xac, 0x02]); // 300 in LEB128
        expected.extend_from_slice(long.as_bytes());
        expected.push(b'E');
        assert_eq!(bytes, expected);
    }

    /// Variants and byte strings, byte by byte: `V` and `b`, each with its LEB128 length.
    #[test]
    fn variants_and_bytes_are_pinned_byte_by_byte() {
        #[derive(serde::Serialize)]
        enum Shape {
            Unit,
            Newtype(u8),
        }
        struct Raw(&'static [u8]);
        impl serde::Serialize for Raw {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(self.0)
            }
        }
        let head = [super::ENCODING_VERSION, b'P', 0];
        let bytes = super::canonical_encoding(&(Shape::Unit, Shape::Newtype(3))).unwrap();
        let expected = [&head[..], b"L", b"V\x04Unit", b"V\x07NewtypeI\x06", b"E"].concat();
        assert_eq!(bytes, expected);
        static LONG: [u8; 200] = [7; 200];
        let long = &LONG;
        let bytes = super::canonical_encoding(&(Raw(b"ab"), Raw(long))).unwrap();
        let mut expected = [&head[..], b"L", b"b\x02ab", &[b'b', 0xc8, 0x01]].concat();
        expected.extend_from_slice(long);
        expected.push(b'E');
        assert_eq!(bytes, expected);
    }

    #[test]
    fn the_bench_hook_encodes_what_is_hashed() {
        use sha2::{Digest, Sha256};
        let v: BTreeMap<&str, (i32, &str)> = [("a", (1, "x"))].into_iter().collect();
        let bytes = super::canonical_encoding(&v).unwrap();
        assert_eq!(bytes[0], super::ENCODING_VERSION);
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        assert_eq!(digest, fingerprint(&v).unwrap());
    }

    /// A part whose encoding reaches `LARGE_PART` enters as `D` and the BLAKE3 digest of
    /// its encoding padded with zeros to a multiple of 4 KiB; one just under it, as
    /// itself. Both pinned.
    #[test]
    fn a_large_part_enters_as_its_blake3_digest() {
        use sha2::{Digest, Sha256};
        let hex = |d: [u8; 32]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let large = "x".repeat(super::LARGE_PART);
        let bytes = super::canonical_encoding(&large).unwrap();
        assert!(
            bytes.len() > super::LARGE_PART,
            "the part alone reaches the bound"
        );
        let mut padded = bytes[1..].to_vec();
        padded.resize(4096, 0);
        let mut h = Sha256::new_with_prefix([super::ENCODING_VERSION, b'D']);
        h.update(blake3::hash(&padded).as_bytes());
        let digest: [u8; 32] = h.finalize().into();
        assert_eq!(digest, fingerprint(&large).unwrap());
        assert_eq!(hex(digest), LARGE_PINNED);

        let small = "x".repeat(super::LARGE_PART - 32);
        let bytes = super::canonical_encoding(&small).unwrap();
        assert!(bytes.len() - 1 < super::LARGE_PART, "{}", bytes.len());
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        assert_eq!(digest, fingerprint(&small).unwrap());
    }
    const LARGE_PINNED: &str = "ac9b5310c0606f3c5fd1c222a7d6c1785ae9e44e45950077b0e16ba07b1f2c68";

    /// Strings of every length around the inline copies' bounds, and integers at each
    /// LEB128 width's edges, byte by byte.
    #[test]
    fn short_copies_and_varint_widths_write_exact_bytes() {
        let text: String = ('a'..='z').cycle().take(40).collect();
        for n in 0..=40 {
            let s = &text[..n];
            let mut expected = vec![super::ENCODING_VERSION, b'P', 0, b's', n as u8];
            expected.extend_from_slice(s.as_bytes());
            assert_eq!(
                super::canonical_encoding(s).unwrap(),
                expected,
                "length {n}"
            );
        }
        let leb = |mut n: u128| {
            let mut out = Vec::new();
            while n >= 0x80 {
                out.push(n as u8 | 0x80);
                n >>= 7;
            }
            out.push(n as u8);
            out
        };
        for v in [
            0u64,
            63,
            64,
            8191,
            8192,
            (1 << 62) - 1,
            1 << 62,
            u64::MAX / 2,
            u64::MAX,
        ] {
            let mut expected = vec![super::ENCODING_VERSION, b'P', 0, b'I'];
            expected.extend(leb(u128::from(v) * 2));
            assert_eq!(super::canonical_encoding(&v).unwrap(), expected, "{v}");
        }
        for v in [-1i64, -64, -65, -8193, i64::MIN, i64::MAX] {
            let zigzag = ((i128::from(v) << 1) ^ (i128::from(v) >> 127)) as u128;
            let mut expected = vec![super::ENCODING_VERSION, b'P', 0, b'I'];
            expected.extend(leb(zigzag));
            assert_eq!(super::canonical_encoding(&v).unwrap(), expected, "{v}");
        }
    }

    /// A struct's fields, in whatever order they arrive and however long their names,
    /// fingerprint as the map of the same entries: the check on names alone that spares
    /// sorting must agree with sorting the encoded entries.
    #[test]
    fn struct_fields_fingerprint_as_the_map_of_them() {
        // 200 bytes, whose LEB128 length starts 0xc8, and 300, whose starts 0xac: the
        // shorter sorts first by number and last by bytes.
        let long: &'static str = "l".repeat(200).leak();
        let longer: &'static str = "k".repeat(300).leak();
        let cases = [
            vec![("zz", 1), ("aaa", 2)],
            vec![("aaa", 2), ("zz", 1)],
            vec![("b", 1), ("a", 2)],
            vec![("a", 2), ("b", 1)],
            vec![
                ("order", 1),
                ("amount", 2),
                ("currency", 3),
                ("customer", 4),
            ],
            vec![
                ("customer", 4),
                ("currency", 3),
                ("amount", 2),
                ("order", 1),
            ],
            vec![("x", 1), (long, 2), (longer, 3)],
            vec![("x", 1), (longer, 3), (long, 2)],
            vec![(long, 2), ("x", 1), (longer, 3)],
        ];
        for fields in cases {
            let map: BTreeMap<&str, u32> = fields.iter().copied().collect();
            assert_eq!(
                fingerprint(&map).unwrap(),
                fingerprint(&Fields(fields.clone())).unwrap(),
                "{fields:?}"
            );
        }
    }

    /// A struct of the fields given, in the order given.
    struct Fields(Vec<(&'static str, u32)>);

    impl serde::Serialize for Fields {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct;
            let mut st = s.serialize_struct("Fields", self.0.len())?;
            for (name, v) in &self.0 {
                st.serialize_field(name, v)?;
            }
            st.end()
        }
    }

    /// A list's item: a struct, or a map of the same entries.
    enum Item {
        Struct(Fields),
        Map(BTreeMap<&'static str, u32>),
    }

    impl serde::Serialize for Item {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            match self {
                Item::Struct(f) => f.serialize(s),
                Item::Map(m) => m.serialize(s),
            }
        }
    }

    /// Structs put in order one after another (a list of one type reuses the order the
    /// first took): each fingerprints as its map, whatever came before it.
    #[test]
    fn lists_of_structs_fingerprint_as_lists_of_their_maps() {
        let shapes: [&[(&'static str, u32)]; 8] = [
            &[
                ("order", 1),
                ("amount", 2),
                ("currency", 3),
                ("customer", 4),
            ],
            &[("b", 1), ("a", 2)],
            &[("a", 1), ("b", 2)],
            &[("b", 1), ("a", 2), ("c", 0)],
            &[("c", 0), ("b", 1), ("a", 2)],
            &[("zz", 1), ("aaa", 2)],
            &[("a", 1)],
            &[],
        ];
        let n = shapes.len();
        for (a, b, c) in (0..n * n * n).map(|i| (i / (n * n), i / n % n, i % n)) {
            for as_map in [false, true] {
                let items: Vec<Item> = [a, b, c, a, b]
                    .iter()
                    .enumerate()
                    .map(|(k, &i)| {
                        let fields = shapes[i].iter().map(|&(name, v)| (name, v + k as u32));
                        // The middle item as a map, or as a struct.
                        if as_map && k == 2 {
                            Item::Map(fields.collect())
                        } else {
                            Item::Struct(Fields(fields.collect()))
                        }
                    })
                    .collect();
                let maps: Vec<BTreeMap<&str, u32>> = items
                    .iter()
                    .map(|item| match item {
                        Item::Struct(f) => f.0.iter().copied().collect(),
                        Item::Map(m) => m.clone(),
                    })
                    .collect();
                assert_eq!(
                    fingerprint(&items).unwrap(),
                    fingerprint(&maps).unwrap(),
                    "shapes {a}, {b}, {c}"
                );
            }
        }
        // A field named twice orders by its values, after a struct of the same names.
        let twice = |fields: &[(&'static str, u32)]| {
            fingerprint(&[Fields(vec![("b", 1), ("a", 2)]), Fields(fields.to_vec())]).unwrap()
        };
        assert_eq!(
            twice(&[("b", 1), ("a", 2), ("a", 1)]),
            twice(&[("a", 1), ("a", 2), ("b", 1)])
        );
        let pair = |x, y| Fields(vec![("a", x), ("a", y)]);
        assert_eq!(
            fingerprint(&[pair(2, 1), pair(1, 2)]).unwrap(),
            fingerprint(&[pair(1, 2), pair(1, 2)]).unwrap()
        );
    }

    /// What serde_json's `Number` and `RawValue` serialize as under `arbitrary_precision`
    /// and `raw_value`: a private struct with one string field. Features unify across a
    /// whole build, so this stands in for a build where another crate turned them on.
    struct Private(&'static str, &'static str);

    impl serde::Serialize for Private {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct;
            let mut st = s.serialize_struct(self.0, 1)?;
            st.serialize_field(self.0, self.1)?;
            st.end()
        }
    }

    #[test]
    fn serde_json_features_change_no_fingerprint() {
        const NUMBER: &str = "$serde_json::private::Number";
        const RAW: &str = "$serde_json::private::RawValue";
        let plain = serde_json::json!({"amount": 1999, "rate": 0.25, "delta": -3});
        let as_features = BTreeMap::from([
            ("amount", Private(NUMBER, "1999")),
            ("rate", Private(NUMBER, "0.25")),
            ("delta", Private(NUMBER, "-3")),
        ]);
        assert_eq!(
            fingerprint(&plain).unwrap(),
            fingerprint(&as_features).unwrap()
        );
        assert_eq!(
            fingerprint(&plain).unwrap(),
            fingerprint(&Private(RAW, r#"{"rate":0.25,"delta":-3,"amount":1999}"#)).unwrap()
        );
        assert_ne!(
            fingerprint(&Private(NUMBER, "1999")).unwrap(),
            fingerprint(&Private(NUMBER, "2000")).unwrap()
        );
    }
}
