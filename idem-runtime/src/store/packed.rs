//! An operation's identity packed into one allocation, for the tables that keep many.

use super::OperationId;

/// An operation's identity as the memory store and the replay cache keep it: scope,
/// name and key side by side in one allocation. An `OperationId` holds three, so each
/// kept identity would cost two allocations more, and a lookup would compare through
/// three pointers where this compares through one.
#[derive(Debug)]
pub(crate) struct Packed {
    text: Box<str>,
    scope_end: u32,
    name_end: u32,
}

impl Packed {
    pub(crate) fn new(id: &OperationId) -> Packed {
        // Three copies into an exact buffer: `concat` goes through a generic join that
        // takes half again as many instructions, on every claim and every cache fill.
        let mut text = String::with_capacity(id.scope.len() + id.name.len() + id.key.len());
        text.push_str(&id.scope);
        text.push_str(&id.name);
        text.push_str(&id.key);
        Packed {
            text: text.into_boxed_str(),
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

    /// The heap this identity holds: its text.
    pub(crate) fn text_len(&self) -> usize {
        self.text.len()
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
