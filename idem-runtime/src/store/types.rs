//! The values the store contract speaks of: an operation's identity
//! ([`OperationId`]), a claim and its answer ([`ClaimRequest`], [`Claim`]), a recorded
//! outcome ([`StoredOutcome`]), whether a fenced write held ([`Fence`]), and a record as
//! the operator's side lists, shows, filters, counts and resolves it.

use std::time::Duration;

/// The identity of one operation: its scope, name and key, each already encoded.
///
/// ```
/// use idem_runtime::{Idem, IdemError, current};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// let op = idem
///     .operation("charge", "order-1")
///     .scope("acme")
///     .retain(Duration::from_secs(3600))
///     .fingerprint_none();
/// let id = op.id().clone();
/// let inside = op.run(|| async { Ok::<_, IdemError>(current().downstream_key("psp")) }).await?;
/// // What a reconciler computes from a listed record is what the body passed on.
/// assert_eq!(inside, id.downstream_key("psp"));
/// assert_eq!(id.name, "charge");
/// # Ok(()) }
/// ```
#[derive(
    Clone,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct OperationId {
    /// The encoded scope (`""` for the empty scope).
    pub scope: String,
    /// The operation's name.
    pub name: String,
    /// The encoded key.
    pub key: String,
}

impl OperationId {
    /// The scope as the application passed it, for tables and logs ([`DisplayKey`]).
    ///
    /// [`DisplayKey`]: crate::DisplayKey
    pub fn display_scope(&self) -> crate::DisplayKey<'_> {
        crate::DisplayKey::new(&self.scope)
    }

    /// The key as the application passed it, for tables and logs ([`DisplayKey`]).
    ///
    /// ```
    /// use idem_runtime::{Idem, KeyPart};
    ///
    /// let idem = Idem::memory();
    /// let op = idem.operation("charge", &("acme", 7)).scope("eu");
    /// let id = op.id();
    /// assert_eq!(id.key, ("acme", 7).encode_key());
    /// assert_eq!(id.display_key().to_string(), "(acme, 7)");
    /// assert_eq!(id.display_scope().to_string(), "eu");
    /// ```
    ///
    /// [`DisplayKey`]: crate::DisplayKey
    pub fn display_key(&self) -> crate::DisplayKey<'_> {
        crate::DisplayKey::new(&self.key)
    }

    /// The operation name made safe for a terminal (control characters escaped).
    pub fn display_name(&self) -> crate::DisplayKey<'_> {
        crate::DisplayKey::plain(&self.name)
    }

    /// The key a body passes to a downstream system for `label`, as
    /// [`Current::downstream_key`](crate::Current::downstream_key) gives it inside the
    /// body: a reconciler looking at an UNKNOWN record asks the downstream system about
    /// this key.
    pub fn downstream_key(&self, label: &str) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"idem-downstream-v1");
        for part in [
            self.scope.as_str(),
            self.name.as_str(),
            self.key.as_str(),
            label,
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let mut out = String::with_capacity(64);
        for b in h.finalize() {
            use std::fmt::Write;
            let _ = write!(out, "{b:02x}");
        }
        out
    }
}

impl std::fmt::Display for OperationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.display_scope(),
            self.display_name(),
            self.display_key()
        )
    }
}

/// What a lapsed claim turns into when another caller finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Takeover {
    /// The next claimant runs the body again, with a higher epoch.
    #[default]
    Rerun,
    /// The operation goes to UNKNOWN, for effects with no downstream deduplication.
    Unknown,
}

/// One claim attempt.
#[derive(Clone, Debug)]
pub struct ClaimRequest<'a> {
    /// The operation.
    pub id: &'a OperationId,
    /// The request fingerprint, bound to the key at first claim.
    pub fingerprint: [u8; 32],
    /// How long the claim is owned before another caller may take over.
    pub lease: Duration,
    /// What a lapsed claim turns into.
    pub on_takeover: Takeover,
}

/// A recorded outcome as the store keeps it.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredOutcome {
    /// Whether the body returned `Err` (recorded under `errors = record` or `classify`).
    pub is_err: bool,
    /// The outcome's schema version.
    pub version: u32,
    /// The outcome, as JSON: shared, so a store in this process and the replays that
    /// read it hold one copy.
    pub body: std::sync::Arc<[u8]>,
}

impl StoredOutcome {
    /// An outcome as a store read it back: its JSON `body`, whether it is a recorded
    /// `Err`, and its schema version.
    pub fn new(body: impl Into<std::sync::Arc<[u8]>>, is_err: bool, version: u32) -> Self {
        StoredOutcome {
            is_err,
            version,
            body: body.into(),
        }
    }

    pub(crate) fn view(&self) -> OutcomeRef<'_> {
        OutcomeRef {
            is_err: self.is_err,
            version: self.version,
            body: &self.body,
        }
    }
}

/// A recorded outcome borrowed from wherever it is kept, for decoding.
#[derive(Clone, Copy)]
pub(crate) struct OutcomeRef<'a> {
    pub(crate) is_err: bool,
    pub(crate) version: u32,
    pub(crate) body: &'a [u8],
}

/// What the atomic claim decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This caller owns the operation at `epoch` and must run the body.
    Acquired {
        /// The epoch to fence later writes on: 1 for a fresh claim, higher after a takeover.
        epoch: u64,
        /// Whether a lapsed claim was taken over.
        takeover: bool,
        /// Whether the operation has recorded [steps](crate::step) that this run resumes
        /// (after a takeover, a released error or `resolve(.., Retry)`): the caller reads
        /// them once with [`Store::steps`](super::Store::steps). `false` for a claim that
        /// starts the operation afresh, which then costs no read.
        resume: bool,
    },
    /// The operation completed; here is its outcome.
    Completed(StoredOutcome),
    /// Another caller holds a live claim.
    InFlight {
        /// The lease's remaining time by the store's clock.
        retry_after: Duration,
    },
    /// The key is bound to another fingerprint.
    Mismatch,
    /// The operation is UNKNOWN.
    Unknown {
        /// The epoch whose effect is unknown.
        epoch: u64,
        /// Whether this claim moved it there (a lapsed lease under [`Takeover::Unknown`]).
        now: bool,
    },
}

/// How an operator settles an UNKNOWN (or stuck IN_PROGRESS) operation, with
/// [`Idem::resolve`](crate::Idem::resolve).
///
/// ```
/// use idem_runtime::{Idem, IdemError, ListFilter, Resolution};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// # let idem = Idem::memory();
/// for record in idem.list(&ListFilter::unknown()).await? {
///     // The downstream system says the effect never happened: let the next call run.
///     idem.resolve(&record.id, record.epoch, Resolution::Retry).await?;
/// }
/// # Ok(()) }
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub enum Resolution {
    /// The effect did not happen: remove the record so the next call runs the body. An
    /// operation with recorded [steps](crate::step) keeps them and its fingerprint, and
    /// the next call with the same request resumes it: its steps replay. It keeps them
    /// for [`RESUME_WINDOW`], then expires.
    Retry,
    /// The effect happened: record this outcome (the JSON of the function's `Ok` value)
    /// so later calls replay it.
    Completed {
        /// The outcome, as the JSON of the operation's `Ok` type.
        outcome: serde_json::Value,
        /// Its schema version.
        version: u32,
        /// How long to keep it.
        retain: Duration,
    },
    /// The effect was refused: record this error (the JSON of the function's `Err`
    /// value, which must then be recordable) so later calls replay it as `Err`.
    Rejected {
        /// The error, as the JSON of the operation's `Err` type.
        error: serde_json::Value,
        /// Its schema version.
        version: u32,
        /// How long to keep it.
        retain: Duration,
    },
}

/// A record's state.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum State {
    /// A claim is held.
    InProgress,
    /// An outcome is recorded.
    Completed,
    /// The effect of an attempt is unknown.
    Unknown,
}

impl State {
    /// The state's code as stored in SQL tables.
    pub fn code(self) -> i16 {
        match self {
            State::InProgress => 0,
            State::Completed => 1,
            State::Unknown => 2,
        }
    }

    /// The state for a stored code.
    pub fn from_code(code: i64) -> Option<State> {
        match code {
            0 => Some(State::InProgress),
            1 => Some(State::Completed),
            2 => Some(State::Unknown),
            _ => None,
        }
    }
}

/// One record, as [`Idem::list`](crate::Idem::list) shows it. The outcome is left out.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordInfo {
    /// The operation.
    pub id: OperationId,
    /// Its state.
    pub state: State,
    /// Its current epoch.
    pub epoch: u64,
    /// How long ago the record was created or last claimed, by the store's clock.
    pub age: Duration,
}

impl RecordInfo {
    /// A record as a store lists it.
    pub fn new(id: OperationId, state: State, epoch: u64, age: Duration) -> Self {
        RecordInfo {
            id,
            state,
            epoch,
            age,
        }
    }
}

/// One record in full, as [`Idem::get`](crate::Idem::get) shows it.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordDetail {
    /// Its identity, state, epoch and age.
    pub info: RecordInfo,
    /// For IN_PROGRESS: how long the lease still runs by the store's clock (zero once
    /// lapsed).
    pub lease_remaining: Option<Duration>,
    /// For COMPLETED, and for IN_PROGRESS released with its steps kept
    /// ([`Store::release`](super::Store::release)): how long until the record expires
    /// (zero once expired).
    pub expires_in: Option<Duration>,
    /// For COMPLETED: the recorded outcome.
    pub outcome: Option<StoredOutcome>,
    /// The operation's completed [steps](crate::step), oldest first: what an
    /// operator reconciling an UNKNOWN operation needs to know. Empty for an operation
    /// without steps, and for a completed one (its final outcome is what counts).
    /// [`Idem::get`](crate::Idem::get) fills it; a store's `get` leaves it empty.
    pub steps: Vec<StepRecord>,
}

impl RecordDetail {
    /// A record with nothing more known of it than `info`; a store sets the fields its
    /// state has.
    pub fn new(info: RecordInfo) -> Self {
        RecordDetail {
            info,
            lease_remaining: None,
            expires_in: None,
            outcome: None,
            steps: Vec::new(),
        }
    }
}

/// One completed [step](crate::step) of an operation, as the store keeps it.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    /// The step's label, unique within its operation.
    pub label: String,
    /// The epoch of the attempt that ran and recorded it.
    pub epoch: u64,
    /// How long ago it was recorded, by the store's clock.
    pub age: Duration,
    /// The step's `Ok` value, encoded like an operation's outcome.
    pub outcome: StoredOutcome,
}

impl StepRecord {
    /// A step as a store read it back.
    pub fn new(label: String, epoch: u64, age: Duration, outcome: StoredOutcome) -> Self {
        StepRecord {
            label,
            epoch,
            age,
            outcome,
        }
    }
}

/// Which records [`Idem::list`](crate::Idem::list) returns: built from
/// [`ListFilter::default`] (every record, oldest first, at most 100) or a shorthand
/// ([`unknown`](Self::unknown), [`stuck`](Self::stuck), [`recent`](Self::recent)), then
/// narrowed by its methods.
///
/// ```
/// use idem_runtime::{Idem, IdemError, ListFilter, State};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// # let idem = Idem::memory();
/// let stuck = idem.list(&ListFilter::stuck(Duration::from_secs(300))).await?;
/// // The last hour's charges, newest first.
/// let charges = ListFilter::recent(Duration::from_secs(3600))
///     .state(State::Completed)
///     .name("charge")
///     .limit(20);
/// let recent = idem.list(&charges).await?;
/// # assert!(stuck.is_empty() && recent.is_empty());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ListFilter {
    /// Only records in this state.
    pub state: Option<State>,
    /// Only records of this operation name.
    pub name: Option<String>,
    /// Only records in this scope, encoded as [`OperationId::scope`] holds it.
    pub scope: Option<String>,
    /// Only records claimed longer ago than this.
    pub older_than: Option<Duration>,
    /// Only records claimed at most this long ago.
    pub newer_than: Option<Duration>,
    /// Newest first (by claim time); oldest first otherwise.
    pub newest_first: bool,
    /// At most this many (default 100).
    pub limit: Option<u32>,
}

impl ListFilter {
    /// Records in the UNKNOWN state: the reconciliation queue.
    pub fn unknown() -> Self {
        ListFilter::default().state(State::Unknown)
    }

    /// Records in progress for longer than `age`: claims that may be stuck.
    pub fn stuck(age: Duration) -> Self {
        ListFilter::default()
            .state(State::InProgress)
            .older_than(age)
    }

    /// Records claimed within the last `age`, newest first: what just happened.
    pub fn recent(age: Duration) -> Self {
        ListFilter::default().newer_than(age).newest_first()
    }

    /// Only records in `state`.
    pub fn state(mut self, state: State) -> Self {
        self.state = Some(state);
        self
    }

    /// Only records of the operation `name`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Only records in the scope `encoded`, as [`OperationId::scope`] holds it: take it
    /// from an [`Operation::id`](crate::Operation::id), which applies the store's key
    /// mode (`hash_keys`), or encode it with [`KeyPart::encode_key`](crate::KeyPart).
    ///
    /// ```
    /// use idem_runtime::{Idem, ListFilter};
    /// let idem = Idem::memory();
    /// let acme = idem.operation("", "").scope("acme").id().scope.clone();
    /// let filter = ListFilter::default().scope(acme);
    /// # let _ = filter;
    /// ```
    pub fn scope(mut self, encoded: impl Into<String>) -> Self {
        self.scope = Some(encoded.into());
        self
    }

    /// Only records claimed longer ago than `age`.
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Only records claimed at most `age` ago.
    pub fn newer_than(mut self, age: Duration) -> Self {
        self.newer_than = Some(age);
        self
    }

    /// Newest records first.
    pub fn newest_first(mut self) -> Self {
        self.newest_first = true;
        self
    }

    /// At most `n` records.
    pub fn limit(mut self, n: u32) -> Self {
        self.limit = Some(n);
        self
    }

    pub(crate) fn max_rows(&self) -> u32 {
        self.limit.unwrap_or(100)
    }
}

/// Orders and cuts the records a store that filters in memory listed, as the SQL stores'
/// `ORDER BY` and `LIMIT` do: by claim time, oldest or newest first, then by identity.
pub(crate) fn sort_listed(rows: &mut Vec<RecordInfo>, filter: &ListFilter) {
    if filter.newest_first {
        rows.sort_by(|a, b| a.age.cmp(&b.age).then_with(|| a.id.cmp(&b.id)));
    } else {
        rows.sort_by(|a, b| b.age.cmp(&a.age).then_with(|| a.id.cmp(&b.id)));
    }
    rows.truncate(filter.max_rows() as usize);
}

/// Counts by state, for alerting on stuck claims; [`Idem::stats`](crate::Idem::stats)
/// reads them.
///
/// ```
/// use idem_runtime::{Idem, IdemError};
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), IdemError> {
/// let idem = Idem::memory();
/// idem.operation("charge", "order-1")
///     .retain(Duration::from_secs(3600))
///     .fingerprint_none()
///     .run(|| async { Ok::<_, IdemError>(()) })
///     .await?;
/// let stats = idem.stats().await?;
/// assert_eq!((stats.completed, stats.in_progress, stats.unknown), (1, 0, 0));
/// assert!(stats.oldest_unknown.is_none()); // alert when this grows
/// # Ok(()) }
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Records IN_PROGRESS under a claim (not those counted in `released`).
    pub in_progress: u64,
    /// Records COMPLETED (including those past retention, not yet purged).
    pub completed: u64,
    /// Records UNKNOWN.
    pub unknown: u64,
    /// Records IN_PROGRESS that their last call released with its [steps](crate::step)
    /// kept, for a retry to resume until they expire
    /// ([`Store::release`](super::Store::release)). No call holds them, so they are not
    /// stuck claims.
    pub released: u64,
    /// Age of the oldest IN_PROGRESS record counted in `in_progress`.
    pub oldest_in_progress: Option<Duration>,
    /// Age of the oldest UNKNOWN record.
    pub oldest_unknown: Option<Duration>,
}

impl Stats {
    /// Counts one record in `state`, `age` since its claim, for stores that tally
    /// their records one by one; `released` for an IN_PROGRESS record released with
    /// its steps kept.
    pub(crate) fn count(&mut self, state: State, released: bool, age: Duration) {
        match state {
            State::InProgress if released => self.released += 1,
            State::InProgress => {
                self.in_progress += 1;
                self.oldest_in_progress = self.oldest_in_progress.max(Some(age));
            }
            State::Completed => self.completed += 1,
            State::Unknown => {
                self.unknown += 1;
                self.oldest_unknown = self.oldest_unknown.max(Some(age));
            }
        }
    }
}

/// How long an operation with recorded [steps](crate::step) is kept for its next call
/// to resume after an operator's [`Resolution::Retry`]:
/// [`Admin::resolve`](super::Admin::resolve) is not told the operation's retention, so
/// this stands in for it. Past it the record expires, as one released by its own call
/// does past its retention ([`Store::release`](super::Store::release)).
pub const RESUME_WINDOW: Duration = Duration::from_secs(7 * 86_400);

/// Whether a fenced write took effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// The epoch still held the claim; the write happened.
    Held,
    /// Another epoch owns the record now (or it is gone); nothing was written.
    Lost,
}

/// A completed record exists but is bound to another fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mismatched;
