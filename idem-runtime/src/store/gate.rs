//! When a store reads before it claims.

/// Whether replays were seen lately, for stores that read before claiming only then.
///
/// A score: each replay adds [`ReplayGate::STEP`] (up to [`ReplayGate::CAP`]), each fresh
/// claim takes one away, and the read runs while it is above zero. Traffic of fresh
/// calls keeps it shut, so they pay no extra round trip; a retry storm opens it at its
/// first replay, so the rest are answered by a read that takes no lock. A replay while
/// it is shut is still a replay: the claim decides it, one transaction dearer.
///
/// [`hold_open`](ReplayGate::hold_open) keeps it open for good: a claim limit must tell
/// a replay from a call that may create a record before it counts the call.
#[derive(Debug, Default)]
pub(crate) struct ReplayGate(std::sync::atomic::AtomicU32, std::sync::atomic::AtomicBool);

impl ReplayGate {
    const STEP: u32 = 8;
    const CAP: u32 = 64;

    pub(crate) fn open(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.0.load(Relaxed) > 0 || self.1.load(Relaxed)
    }

    /// Reads before every claim from now on.
    pub(crate) fn hold_open(&self) {
        self.1.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn saw(&self, replay: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let _ = self.0.fetch_update(Relaxed, Relaxed, |n| {
            Some(if replay {
                (n + Self::STEP).min(Self::CAP)
            } else {
                n.saturating_sub(1)
            })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::ReplayGate;

    #[test]
    fn the_replay_gate_opens_on_a_replay_and_shuts_after_fresh_claims() {
        let gate = ReplayGate::default();
        assert!(!gate.open(), "fresh traffic reads nothing first");
        gate.saw(true);
        for _ in 1..ReplayGate::STEP {
            gate.saw(false);
            assert!(gate.open());
        }
        gate.saw(false);
        assert!(
            !gate.open(),
            "shut after as many fresh claims as one replay's step"
        );
        gate.saw(false);
        assert!(!gate.open(), "the score does not go below zero");
        for _ in 0..100 {
            gate.saw(true);
        }
        for _ in 0..ReplayGate::CAP - 1 {
            gate.saw(false);
        }
        assert!(gate.open());
        gate.saw(false);
        assert!(
            !gate.open(),
            "a long storm keeps it open no longer than the cap"
        );
        gate.hold_open();
        gate.saw(false);
        assert!(gate.open(), "held open whatever the traffic");
    }
}
