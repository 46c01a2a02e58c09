//! The state of a running body's steps, which the body's context carries: how they are
//! kept ([`StepsMode`]) and what this run has done with them ([`StepsRun`]).

use std::collections::{HashMap, HashSet};

use crate::idem::Idem;
use crate::lease::Held;
use crate::store::StoredOutcome;

/// How a body's steps are kept.
pub(crate) enum StepsMode {
    /// Under a leased claim: recorded in the store, fenced by the body's epoch; with
    /// what the claim's renewals learn of it, where it is renewed.
    Leased(Idem, Option<Held>),
    /// The same, for a claim that found recorded steps: read at the first step.
    Resumed(Idem, Option<Held>),
    /// Run unprotected (`fail_open` with the store down): nothing can be recorded.
    Unprotected,
    /// Inside the caller's transaction, which is already one unit.
    Transactional,
}

/// What one run of a body has done with its steps.
#[derive(Default)]
pub(crate) struct StepsRun {
    /// The recorded steps by label, once read (resumed runs only).
    pub(crate) recorded: Option<HashMap<String, StoredOutcome>>,
    /// The labels this run has used.
    pub(crate) labels: Option<HashSet<Box<str>>>,
    /// A step ran and its value was not recorded.
    pub(crate) unrecorded: bool,
}

impl StepsRun {
    pub(crate) fn unrecorded(&self) -> bool {
        self.unrecorded
    }
}
