//! A record and its transitions, as the stores that keep whole records decide them
//! in the process (the memory store under its lock, DynamoDB between a read and a
//! conditional write): the contract's decision table in one place.

use std::time::Duration;

use super::{
    Claim, ClaimRequest, ListFilter, Mismatched, OperationId, RecordDetail, RecordInfo, State,
    StepRecord, StoredOutcome, Takeover,
};

/// An instant as a store files it: nanoseconds since the store's own origin (the
/// memory store's start, the UNIX epoch for a store shared by processes), half the size
/// of an `Instant`. A record holds three, and the memory store's table is what a fresh
/// call's insert touches and what grows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Tick(pub(crate) u64);

impl Tick {
    /// Later than any instant: a retention too long to count.
    pub(crate) const NEVER: Tick = Tick(u64::MAX);

    pub(crate) fn after(self, d: Duration) -> Tick {
        Tick(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }

    /// How long after `earlier` this is; zero if it is not after it.
    pub(crate) fn since(self, earlier: Tick) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Record {
    pub(crate) state: State,
    pub(crate) epoch: u64,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) lease_until: Tick,
    pub(crate) claimed_at: Tick,
    /// When a completed record, or one released with its steps, expires
    /// ([`Tick::NEVER`] while a claim holds it).
    pub(crate) expires_at: Tick,
    /// Shared with the replays that read it: a replay copies nothing.
    pub(crate) outcome: Option<StoredOutcome>,
    /// The steps of this life of the record, boxed: most records have none, and every
    /// record pays for the field.
    pub(crate) steps: Option<Box<Steps>>,
}

/// An operation's recorded steps.
#[derive(Clone, Debug, Default)]
pub(crate) struct Steps {
    pub(crate) done: Vec<Step>,
    /// Released with its steps kept: no lease, and the next claim with the same
    /// fingerprint resumes it.
    pub(crate) released: bool,
}

#[derive(Clone, Debug)]
pub(crate) struct Step {
    pub(crate) label: Box<str>,
    pub(crate) epoch: u64,
    pub(crate) at: Tick,
    pub(crate) outcome: StoredOutcome,
}

impl Record {
    /// Past its retention: a completed record, or one released with its steps (in
    /// progress, but held by no claim).
    pub(crate) fn expired(&self, now: Tick) -> bool {
        (self.state == State::Completed || self.released()) && self.expires_at <= now
    }

    /// How long the lease still runs.
    pub(crate) fn lease_left(&self, now: Tick) -> Duration {
        if self.released() {
            Duration::ZERO
        } else {
            self.lease_until.since(now)
        }
    }

    /// Completes the record with `outcome`, kept until `expires_at`. Its steps go: the
    /// final outcome is what a completed operation replays.
    pub(crate) fn complete(&mut self, outcome: StoredOutcome, expires_at: Tick) {
        self.steps = None;
        self.state = State::Completed;
        self.outcome = Some(outcome);
        self.expires_at = expires_at;
    }

    pub(crate) fn has_steps(&self) -> bool {
        self.steps.as_ref().is_some_and(|s| !s.done.is_empty())
    }

    pub(crate) fn released(&self) -> bool {
        self.steps.as_ref().is_some_and(|s| s.released)
    }

    /// Whether the claim of `epoch` holds the record, for its own writes: in progress at
    /// that epoch, and not released.
    pub(crate) fn held_by(&self, epoch: u64) -> bool {
        self.epoch == epoch && self.state == State::InProgress && !self.released()
    }

    /// Whether an operator may settle the record at `epoch`: in progress (released or
    /// not) or UNKNOWN.
    pub(crate) fn settles_at(&self, epoch: u64) -> bool {
        self.epoch == epoch && matches!(self.state, State::InProgress | State::Unknown)
    }

    /// Gives the claim up: `true` when the record must go (it has no steps), else it
    /// stays IN_PROGRESS, released, for the next claim to resume until `expires_at`.
    pub(crate) fn release(&mut self, expires_at: Tick) -> bool {
        match &mut self.steps {
            Some(steps) if !steps.done.is_empty() => {
                steps.released = true;
                self.state = State::InProgress;
                self.expires_at = expires_at;
                false
            }
            _ => true,
        }
    }
}

impl Record {
    /// A record claimed afresh at `now`, at `epoch`.
    pub(crate) fn fresh(req: &ClaimRequest<'_>, now: Tick, epoch: u64) -> Record {
        Record {
            state: State::InProgress,
            epoch,
            fingerprint: req.fingerprint,
            lease_until: now.after(req.lease),
            claimed_at: now,
            expires_at: Tick::NEVER,
            outcome: None,
            steps: None,
        }
    }

    /// The claim of an existing record, as the contract's decision table says, with the
    /// record changed in place where the claim writes (a fresh life, a resume, a
    /// takeover, a move to UNKNOWN). `next_epoch` gives the epoch of a claim that takes
    /// it.
    pub(crate) fn claim(
        &mut self,
        req: &ClaimRequest<'_>,
        now: Tick,
        next_epoch: impl FnOnce() -> u64,
    ) -> Claim {
        if self.expired(now) {
            *self = Record::fresh(req, now, next_epoch());
            return Claim::Acquired {
                epoch: self.epoch,
                takeover: false,
                resume: false,
            };
        }
        if self.fingerprint != req.fingerprint {
            return Claim::Mismatch;
        }
        // Released with its steps: resumed at once, whatever `on_takeover` says, since
        // its last attempt ended knowing what it had done.
        if self.state == State::InProgress && self.released() {
            self.epoch = next_epoch();
            self.lease_until = now.after(req.lease);
            self.claimed_at = now;
            self.expires_at = Tick::NEVER;
            if let Some(steps) = &mut self.steps {
                steps.released = false;
            }
            return Claim::Acquired {
                epoch: self.epoch,
                takeover: false,
                resume: true,
            };
        }
        match self.state {
            State::Completed => Claim::Completed(
                self.outcome
                    .clone()
                    .expect("completed record has an outcome"),
            ),
            State::Unknown => Claim::Unknown {
                epoch: self.epoch,
                now: false,
            },
            State::InProgress if self.lease_until > now => Claim::InFlight {
                retry_after: self.lease_left(now),
            },
            State::InProgress => match req.on_takeover {
                Takeover::Rerun => {
                    self.epoch = next_epoch();
                    self.lease_until = now.after(req.lease);
                    self.claimed_at = now;
                    Claim::Acquired {
                        epoch: self.epoch,
                        takeover: true,
                        resume: self.has_steps(),
                    }
                }
                Takeover::Unknown => {
                    self.state = State::Unknown;
                    Claim::Unknown {
                        epoch: self.epoch,
                        now: true,
                    }
                }
            },
        }
    }

    /// The replay read: a completed, unexpired outcome, or a mismatch.
    pub(crate) fn peek(
        &self,
        fingerprint: &[u8; 32],
        now: Tick,
    ) -> Option<Result<StoredOutcome, Mismatched>> {
        if self.state != State::Completed || self.expired(now) {
            return None;
        }
        if self.fingerprint != *fingerprint {
            return Some(Err(Mismatched));
        }
        self.outcome.clone().map(Ok)
    }

    /// Records `outcome` for the claim of `epoch`: `Some(true)` when it completed the
    /// record now, `Some(false)` when it already had (a retry whose reply was lost),
    /// `None` when the claim is lost.
    pub(crate) fn record(
        &mut self,
        epoch: u64,
        outcome: &StoredOutcome,
        expires_at: Tick,
    ) -> Option<bool> {
        if self.held_by(epoch) {
            self.complete(outcome.clone(), expires_at);
            return Some(true);
        }
        let again = self.epoch == epoch
            && self.state == State::Completed
            && self.outcome.as_ref() == Some(outcome);
        again.then_some(false)
    }

    /// Records step `label` under the claim of `epoch`; `false` when the claim is lost.
    pub(crate) fn record_step(
        &mut self,
        epoch: u64,
        label: &str,
        outcome: &StoredOutcome,
        at: Tick,
    ) -> bool {
        if !self.held_by(epoch) {
            return false;
        }
        let steps = self.steps.get_or_insert_with(Box::default);
        let step = Step {
            label: label.into(),
            epoch,
            at,
            outcome: outcome.clone(),
        };
        match steps.done.iter_mut().find(|s| &*s.label == label) {
            Some(old) => *old = step,
            None => steps.done.push(step),
        }
        true
    }

    /// The steps of this life, oldest first.
    pub(crate) fn steps(&self, now: Tick) -> Vec<StepRecord> {
        let Some(steps) = &self.steps else {
            return Vec::new();
        };
        steps
            .done
            .iter()
            .map(|s| StepRecord {
                label: s.label.to_string(),
                epoch: s.epoch,
                age: now.since(s.at),
                outcome: s.outcome.clone(),
            })
            .collect()
    }

    /// Whether an operator may forget the record: settled, released, or its lease lapsed.
    pub(crate) fn forgettable(&self, now: Tick) -> bool {
        match self.state {
            State::Completed | State::Unknown => true,
            State::InProgress => self.released() || self.lease_until <= now,
        }
    }

    /// The record as an operator sees it.
    pub(crate) fn info(&self, id: OperationId, now: Tick) -> RecordInfo {
        RecordInfo {
            id,
            state: self.state,
            epoch: self.epoch,
            age: now.since(self.claimed_at),
        }
    }

    /// The record in full, as an operator sees it.
    pub(crate) fn detail(&self, id: OperationId, now: Tick) -> RecordDetail {
        RecordDetail {
            info: self.info(id, now),
            lease_remaining: (self.state == State::InProgress).then(|| self.lease_left(now)),
            expires_in: (self.state == State::Completed || self.released()).then(|| {
                if self.expires_at == Tick::NEVER {
                    Duration::MAX
                } else {
                    self.expires_at.since(now)
                }
            }),
            outcome: self.outcome.clone(),
            steps: Vec::new(),
        }
    }

    /// Whether the record matches `filter`'s state and ages (its name and scope are the
    /// caller's to check).
    pub(crate) fn listed(&self, filter: &ListFilter, now: Tick) -> bool {
        let age = now.since(self.claimed_at);
        filter.state.is_none_or(|s| s == self.state)
            && filter.older_than.is_none_or(|a| age > a)
            && filter.newer_than.is_none_or(|a| age <= a)
    }
}
