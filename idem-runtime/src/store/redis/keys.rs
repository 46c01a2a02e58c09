//! The store's keys: an operation's record key and steps key, one hash tag shared by
//! both (see the module docs' "Keys").

use super::RedisStore;
use crate::store::OperationId;

impl RedisStore {
    /// The record key and the steps key of `id`.
    pub(super) fn keys(&self, id: &OperationId) -> (String, String) {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for part in [&id.scope, &id.name, &id.key] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let mut rec = String::with_capacity(self.prefix.len() + 37);
        rec.push_str(&self.prefix);
        rec.push_str(":r:{");
        crate::secret::push_hex(&mut rec, &h.finalize()[..16]);
        rec.push('}');
        // The steps key differs from the record key in the kind's letter alone.
        let kind = self.prefix.len() + 1;
        let mut steps = rec.clone();
        steps.replace_range(kind..kind + 1, "s");
        (rec, steps)
    }

    /// The steps key beside the record key `rec`, as [`keys`](Self::keys) makes both.
    pub(super) fn steps_key_of(&self, rec: &[u8]) -> Vec<u8> {
        let mut steps = rec.to_vec();
        steps[self.prefix.len() + 1] = b's';
        steps
    }

    /// Whether `key` is one of this store's record keys (and not one of a store whose
    /// prefix merely starts with ours).
    pub(super) fn is_record_key(&self, key: &[u8]) -> bool {
        let head = format!("{}:r:{{", self.prefix);
        key.len() == head.len() + 33 && key.starts_with(head.as_bytes()) && key.ends_with(b"}")
    }
}
