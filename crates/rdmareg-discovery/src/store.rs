//! Telling one etcd store from another by the headers of its responses.
//!
//! Within one store a linearizable read after revision `r` responds at `r`
//! or later, and a member's raft term never goes down; a store that lost its
//! data breaks one of them (or changes cluster id). Why and what that
//! cannot catch: `docs/discovery.md`, "A wiped store".

use std::collections::BTreeMap;
use std::fmt;

/// The parts of an etcd response header that identify a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) cluster_id: u64,
    pub(crate) member_id: u64,
    pub(crate) raft_term: u64,
    pub(crate) revision: i64,
}

impl From<&etcd_client::ResponseHeader> for Header {
    fn from(header: &etcd_client::ResponseHeader) -> Self {
        Self {
            cluster_id: header.cluster_id(),
            member_id: header.member_id(),
            raft_term: header.raft_term(),
            revision: header.revision(),
        }
    }
}

/// Why a response comes from another store than the one known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Replacement {
    /// The cluster id differs.
    ClusterId { was: u64, now: u64 },
    /// The revision is lower than one observed before the request was issued.
    RevisionWentBack { was: i64, now: i64 },
    /// The same member responded at a lower raft term than before.
    TermWentBack { member: u64, was: u64, now: u64 },
}

impl fmt::Display for Replacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ClusterId { was, now } => {
                write!(f, "the cluster id changed from {was:x} to {now:x}")
            }
            Self::RevisionWentBack { was, now } => {
                write!(f, "the revision went back from {was} to {now}")
            }
            Self::TermWentBack { member, was, now } => write!(
                f,
                "member {member:x}'s raft term went back from {was} to {now}"
            ),
        }
    }
}

/// What a response says about the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Observation {
    /// The same store as before (or the first response).
    Same,
    /// Another store: the view now describes it alone.
    Replaced(Replacement),
    /// The request predates a replacement already taken in: the response
    /// proves nothing and its data must not be used.
    Late,
}

/// What is known of the store behind a client: the highest revision and,
/// per member, the highest raft term observed, and how many replacements
/// were seen (the epoch).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StoreView {
    cluster_id: Option<u64>,
    revision: i64,
    terms: BTreeMap<u64, u64>,
    epoch: u64,
}

impl StoreView {
    /// How many replacements this view has taken in.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The highest revision observed in the current store.
    #[cfg(test)]
    pub(crate) fn revision(&self) -> i64 {
        self.revision
    }

    /// Whether `header`, a linearizable response to a request issued while
    /// `self` was current, comes from another store.
    pub(crate) fn judge(&self, header: &Header) -> Option<Replacement> {
        let cluster_id = self.cluster_id?;
        if header.cluster_id != cluster_id {
            return Some(Replacement::ClusterId {
                was: cluster_id,
                now: header.cluster_id,
            });
        }
        if header.revision < self.revision {
            return Some(Replacement::RevisionWentBack {
                was: self.revision,
                now: header.revision,
            });
        }
        match self.terms.get(&header.member_id) {
            Some(&was) if header.raft_term < was => Some(Replacement::TermWentBack {
                member: header.member_id,
                was,
                now: header.raft_term,
            }),
            _ => None,
        }
    }

    /// Takes in `header`, the response to a request issued while `before`
    /// (a copy taken then) was the view.
    pub(crate) fn observe(&mut self, before: &StoreView, header: &Header) -> Observation {
        if before.epoch != self.epoch {
            return Observation::Late;
        }
        match before.judge(header) {
            Some(replacement) => {
                *self = StoreView {
                    epoch: self.epoch + 1,
                    ..StoreView::default()
                };
                self.absorb(header);
                Observation::Replaced(replacement)
            }
            None => {
                self.absorb(header);
                Observation::Same
            }
        }
    }

    fn absorb(&mut self, header: &Header) {
        self.cluster_id = Some(header.cluster_id);
        self.revision = self.revision.max(header.revision);
        let term = self.terms.entry(header.member_id).or_default();
        *term = (*term).max(header.raft_term);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: u64 = 0xd1ce;
    const MEMBER: u64 = 0xbeef;

    fn header(revision: i64, raft_term: u64) -> Header {
        Header {
            cluster_id: CLUSTER,
            member_id: MEMBER,
            raft_term,
            revision,
        }
    }

    /// A view that has seen one response.
    fn seen(revision: i64, raft_term: u64) -> StoreView {
        let mut view = StoreView::default();
        assert_eq!(
            view.observe(&StoreView::default(), &header(revision, raft_term)),
            Observation::Same
        );
        view
    }

    #[test]
    fn the_first_response_is_always_the_same_store() {
        let mut view = StoreView::default();
        let before = view.clone();
        assert_eq!(view.observe(&before, &header(6, 2)), Observation::Same);
        assert_eq!(view.revision(), 6);
        assert_eq!(view.epoch(), 0);
    }

    #[test]
    fn revisions_that_grow_at_the_same_term_are_the_same_store() {
        let mut view = seen(303, 2);
        let before = view.clone();
        assert_eq!(view.observe(&before, &header(303, 2)), Observation::Same);
        assert_eq!(view.observe(&before, &header(400, 3)), Observation::Same);
        assert_eq!(view.revision(), 400);
    }

    /// The case: a store at revision 303 killed and restarted on an
    /// empty data directory responds at revision 6.
    #[test]
    fn a_revision_lower_than_one_seen_is_another_store() {
        let mut view = seen(303, 2);
        let before = view.clone();
        assert_eq!(
            view.observe(&before, &header(6, 2)),
            Observation::Replaced(Replacement::RevisionWentBack { was: 303, now: 6 })
        );
        // The view now describes the new store alone.
        assert_eq!(view.revision(), 6);
        assert_eq!(view.epoch(), 1);
        let before = view.clone();
        assert_eq!(view.observe(&before, &header(7, 2)), Observation::Same);
    }

    #[test]
    fn another_cluster_id_is_another_store_whatever_its_revision() {
        let mut view = seen(303, 2);
        let before = view.clone();
        let other = Header {
            cluster_id: CLUSTER + 1,
            ..header(900, 5)
        };
        assert_eq!(
            view.observe(&before, &other),
            Observation::Replaced(Replacement::ClusterId {
                was: CLUSTER,
                now: CLUSTER + 1
            })
        );
    }

    /// A wiped store that has passed the old revision before anyone looked,
    /// from an etcd that had been restarted (term 3) before it was wiped
    /// (term 2 again).
    #[test]
    fn a_lower_term_of_the_same_member_is_another_store() {
        let mut view = seen(303, 3);
        let before = view.clone();
        assert_eq!(
            view.observe(&before, &header(500, 2)),
            Observation::Replaced(Replacement::TermWentBack {
                member: MEMBER,
                was: 3,
                now: 2
            })
        );
    }

    #[test]
    fn another_member_of_the_same_cluster_is_the_same_store() {
        let mut view = seen(303, 3);
        let before = view.clone();
        let other = Header {
            member_id: MEMBER + 1,
            ..header(303, 2)
        };
        assert_eq!(view.observe(&before, &other), Observation::Same);
    }

    /// Two reads in flight at once: the one issued first may get its
    /// response at a lower revision than the one issued second, and must not
    /// look like a replacement when it is taken in last.
    #[test]
    fn responses_are_judged_against_what_was_known_when_sent() {
        let mut view = seen(100, 2);
        let first = view.clone();
        let second = view.clone();
        assert_eq!(view.observe(&second, &header(102, 2)), Observation::Same);
        assert_eq!(view.observe(&first, &header(101, 2)), Observation::Same);
        assert_eq!(view.revision(), 102);
    }

    #[test]
    fn a_response_sent_before_a_replacement_is_late() {
        let mut view = seen(303, 2);
        let before = view.clone();
        assert!(matches!(
            view.observe(&before, &header(6, 2)),
            Observation::Replaced(_)
        ));
        // Issued to the old store, responded to (or taken in) after the new one
        // showed: it proves nothing either way.
        assert_eq!(view.observe(&before, &header(304, 2)), Observation::Late);
        assert_eq!(view.revision(), 6);
    }
}
