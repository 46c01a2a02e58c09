//! An operation's identity packed into one string, for the tables that keep many.

use compact_str::CompactString;

use super::OperationId;

/// An operation's identity as the memory store and the replay cache keep it: scope,
/// name and key side by side in one string, held inline up to 24 bytes (most
/// identities: a name and an order or message id) and in one allocation past that. An
/// `OperationId` holds three allocations, so each kept identity would cost up to three
/// more, and a lookup would compare through three pointers where this compares through
/// at most one.
#[derive(Debug)]
pub(crate) struct Packed {
    text: CompactString,
    scope_end: u32,
    name_end: u32,
}

impl Packed {
    pub(crate) fn new(id: &OperationId) -> Packed {
        let mut text = CompactString::with_capacity(id.scope.len() + id.name.len() + id.key.len());
        text.push_str(&id.scope);
        text.push_str(&id.name);
        text.push_str(&id.key);
        Packed {
            text,
            scope_end: len32(id.scope.len()),
            name_end: len32(id.scope.len() + id.name.len()),
        }
    }

    /// Scope, name and key.
    pub(crate) fn parts(&self) -> [&str; 3] {
        let (scope, rest) = self.text.split_at(self.scope_end as usize);
        let (name, key) = rest.split_at((self.name_end - self.scope_end) as usize);
        [scope, name, key]
    }

    /// The bytes this identity asks of the heap: none when held inline.
    pub(crate) fn heap_len(&self) -> usize {
        if self.text.is_heap_allocated() {
            self.text.capacity()
        } else {
            0
        }
    }

    /// Whether this is `id`: each part the same, so ids whose parts run together into
    /// the same text stay apart.
    pub(crate) fn is(&self, id: &OperationId) -> bool {
        self.parts() == [id.scope.as_str(), &id.name, &id.key]
    }

    pub(crate) fn id(&self) -> OperationId {
        let [scope, name, key] = self.parts();
        OperationId {
            scope: scope.to_owned(),
            name: name.to_owned(),
            key: key.to_owned(),
        }
    }
}

/// A length as `Packed` files it. The runtime caps each part at 255 bytes; a store used
/// directly with parts past 4 GiB is refused loudly rather than mis-split.
fn len32(n: usize) -> u32 {
    u32::try_from(n).expect("an operation id of 4 GiB or more")
}
