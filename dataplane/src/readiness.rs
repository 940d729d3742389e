//! Readiness aggregation: turns per-rank terminal statuses into one outcome per request.
//!
//! There are no barriers anywhere in the data plane (a barrier that ranks reach a different number of
//! times is the cross-rank deadlock of LMCache's PD backend). Each rank emits exactly one terminal
//! status per request; the aggregator is idempotent (a repeated status changes nothing) and
//! order-independent (any arrival order gives the same outcome), completes when every rank is READY,
//! fails at the first rank that is not, and times out at its deadline. Memory is bounded: ranks per
//! request by [`MAX_RANKS`]; a status for another request is refused, never stored. (The gateway
//! keeps one aggregator per waiting request, routed by its event feeds.)

use std::time::Instant;

use thiserror::Error;

use crate::events::{RankStatus, TerminalState};
use crate::ids::{Rank, RequestKey};

/// Most ranks one request may span (TP × PP of the largest decoder we expect, with room to spare).
pub const MAX_RANKS: u32 = 1024;

/// The outcome of a request's readiness.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Outcome {
    /// Every rank is READY.
    Ready,
    /// A rank reported a terminal state other than READY; the first such rank decides.
    Failed { rank: Rank, state: TerminalState },
    /// The deadline passed with `missing` ranks silent.
    TimedOut { missing: u32 },
}

/// Where a request stands after a status.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Progress {
    Pending { ready: u32, ranks: u32 },
    Done(Outcome),
}

#[derive(Debug, Error, PartialEq, Eq, Clone)]
#[non_exhaustive]
pub enum ObserveError {
    /// A status of another request (a caller's routing bug).
    #[error("status for {got} sent to the aggregator of {want}")]
    WrongRequest { got: RequestKey, want: RequestKey },
    /// A status from a rank the request does not span.
    #[error("status from rank {rank}, but the request spans {ranks} ranks")]
    UnknownRank { rank: Rank, ranks: u32 },
    /// A rank reported a second, different terminal state; the first stands.
    #[error("rank {rank} already reported {first:?}, now {then:?}; the first status stands")]
    Conflict { rank: Rank, first: TerminalState, then: TerminalState },
    /// More ranks than an aggregator tracks.
    #[error("{ranks} ranks is more than the limit of {limit}")]
    TooManyRanks { ranks: u32, limit: u32 },
}

/// Readiness of one request across its ranks.
#[derive(Clone, Debug)]
pub struct Aggregator {
    key: RequestKey,
    states: Vec<Option<TerminalState>>,
    ready: u32,
    deadline: Instant,
    outcome: Option<Outcome>,
}

impl Aggregator {
    pub fn new(key: RequestKey, ranks: u32, deadline: Instant) -> Result<Self, ObserveError> {
        if ranks == 0 || ranks > MAX_RANKS {
            return Err(ObserveError::TooManyRanks { ranks, limit: MAX_RANKS });
        }
        Ok(Self { key, states: vec![None; ranks as usize], ready: 0, deadline, outcome: None })
    }

    pub fn key(&self) -> RequestKey {
        self.key
    }

    fn ranks(&self) -> u32 {
        u32::try_from(self.states.len()).unwrap_or(u32::MAX)
    }

    fn progress(&self) -> Progress {
        match self.outcome {
            Some(o) => Progress::Done(o),
            None => Progress::Pending { ready: self.ready, ranks: self.ranks() },
        }
    }

    /// Takes one rank's status. Idempotent; a conflicting second status for a rank is an error and
    /// changes nothing.
    pub fn observe(&mut self, s: &RankStatus, now: Instant) -> Result<Progress, ObserveError> {
        if s.key() != self.key {
            return Err(ObserveError::WrongRequest { got: s.key(), want: self.key });
        }
        let ranks = self.ranks();
        let slot =
            self.states.get_mut(s.rank as usize).ok_or(ObserveError::UnknownRank { rank: s.rank, ranks })?;
        if let Some(first) = *slot {
            if first != s.state {
                return Err(ObserveError::Conflict { rank: s.rank, first, then: s.state });
            }
            return Ok(self.progress());
        }
        *slot = Some(s.state);
        if self.outcome.is_some() {
            return Ok(self.progress());
        }
        if s.state == TerminalState::Ready {
            self.ready += 1;
            if self.ready == ranks {
                self.outcome = Some(Outcome::Ready);
                return Ok(self.progress());
            }
        } else {
            self.outcome = Some(Outcome::Failed { rank: s.rank, state: s.state });
            return Ok(self.progress());
        }
        self.poll(now);
        Ok(self.progress())
    }

    /// The outcome at `now`: decided, timed out, or still pending (`None`).
    pub fn poll(&mut self, now: Instant) -> Option<Outcome> {
        if self.outcome.is_none() && now >= self.deadline {
            let missing =
                u32::try_from(self.states.iter().filter(|s| s.is_none()).count()).unwrap_or(u32::MAX);
            self.outcome = Some(Outcome::TimedOut { missing });
        }
        self.outcome
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ids::RequestId;

    fn st(key: RequestKey, rank: Rank, state: TerminalState) -> RankStatus {
        RankStatus { request: key.request, epoch: key.epoch, rank, state, chunks: 1, bytes: 0 }
    }

    #[test]
    fn table_of_edge_cases() {
        let key = RequestKey::new(RequestId(7), 2);
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(1);
        use TerminalState::*;
        // (name, statuses, expected final progress)
        type Case = (&'static str, Vec<(Rank, TerminalState)>, Progress);
        let cases: Vec<Case> = vec![
            ("all ready", vec![(0, Ready), (1, Ready)], Progress::Done(Outcome::Ready)),
            ("reverse order", vec![(1, Ready), (0, Ready)], Progress::Done(Outcome::Ready)),
            (
                "duplicate ready does not count twice",
                vec![(0, Ready), (0, Ready)],
                Progress::Pending { ready: 1, ranks: 2 },
            ),
            (
                "failure first wins",
                vec![(0, Failed), (1, Expired)],
                Progress::Done(Outcome::Failed { rank: 0, state: Failed }),
            ),
            (
                "failure after ready",
                vec![(0, Ready), (1, Cancelled)],
                Progress::Done(Outcome::Failed { rank: 1, state: Cancelled }),
            ),
        ];
        for (name, statuses, want) in cases {
            let mut a = Aggregator::new(key, 2, deadline).unwrap();
            let mut last = None;
            for (r, s) in statuses {
                last = Some(a.observe(&st(key, r, s), t0).unwrap());
            }
            assert_eq!(last, Some(want), "{name}");
        }
    }

    #[test]
    fn rejects_foreign_statuses() {
        let key = RequestKey::new(RequestId(7), 2);
        let t0 = Instant::now();
        let mut a = Aggregator::new(key, 2, t0 + Duration::from_secs(1)).unwrap();
        let other_epoch = RequestKey::new(RequestId(7), 1);
        assert!(matches!(
            a.observe(&st(other_epoch, 0, TerminalState::Ready), t0),
            Err(ObserveError::WrongRequest { .. })
        ));
        assert!(matches!(
            a.observe(&st(key, 2, TerminalState::Ready), t0),
            Err(ObserveError::UnknownRank { rank: 2, ranks: 2 })
        ));
        a.observe(&st(key, 0, TerminalState::Ready), t0).unwrap();
        assert!(matches!(
            a.observe(&st(key, 0, TerminalState::Failed), t0),
            Err(ObserveError::Conflict { .. })
        ));
        assert_eq!(a.poll(t0), None);
        assert_eq!(a.poll(t0 + Duration::from_secs(1)), Some(Outcome::TimedOut { missing: 1 }));
        assert!(Aggregator::new(key, MAX_RANKS + 1, t0).is_err());
    }
}
