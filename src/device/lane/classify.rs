//! What a commit-topic frame is, judged only on authenticated evidence
//! (DESIGN.md sections 3 and 9): the MLS framing we could parse, the
//! publishing device the hub attests, and what this device itself merged.
//! Pure: the pull gathers the facts, this decides, the pull acts.
//!
//! A frame from a device outside the roster never strands anyone: anyone
//! can connect to a hub and write, and a removed member still knows old
//! topics. Only a member's frame can be evidence that the group moved on.

/// Why a commit-topic frame was skipped without being applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// Not an MLS message at all.
    Garbage,
    /// An MLS message of another group.
    OtherGroup,
    /// Published by a device that is not a member at our epoch.
    Stranger,
    /// An epoch we already passed, with the commit we merged there (or one
    /// that lost to it).
    History,
    /// MLS refused it (bad signature, bad proposals, not a commit...).
    Refused(String),
    /// The ledger entries it enacts are missing, undecodable, unauthorised,
    /// or do not match the head it installs.
    LedgerRefused(String),
    /// A leaf it installs is not its device (credential and key disagree,
    /// or an update changes a member's identity).
    ForeignLeaf(String),
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SkipReason::Garbage => f.write_str("not an MLS message"),
            SkipReason::OtherGroup => f.write_str("another group's message"),
            SkipReason::Stranger => f.write_str("published by a non-member"),
            SkipReason::History => f.write_str("an epoch already passed"),
            SkipReason::Refused(r) => write!(f, "refused by MLS: {r}"),
            SkipReason::LedgerRefused(r) => write!(f, "ledger refused: {r}"),
            SkipReason::ForeignLeaf(r) => write!(f, "leaf is not its device: {r}"),
        }
    }
}

/// What the pull knows about one frame before touching MLS state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    /// The epoch the MLS framing claims; `None` when it is not an MLS
    /// protocol message.
    pub epoch: Option<u64>,
    /// The framing names another group.
    pub other_group: bool,
    /// The hub-attested publisher is a member at our epoch.
    pub publisher_is_member: bool,
    /// The hub-attested publisher is this device.
    pub publisher_is_me: bool,
    /// The frame is byte for byte the commit this device journalled.
    pub is_journalled: bool,
    /// What this device merged at the frame's epoch, if it remembers:
    /// whether it was this very frame, and whether the merged one came
    /// from an earlier position on the same store.
    pub merged_here: Option<MergedThere>,
}

/// What this device merged at a past epoch, compared with a frame of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MergedThere {
    /// The frame is the commit we merged.
    pub same_commit: bool,
    /// The frame sits at a lower position than the one we merged, on the
    /// same store incarnation (unknown after a rewind: `false`).
    pub frame_is_earlier: bool,
}

/// The judgement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Our own journalled commit: it won its position; adopt it.
    Adopt,
    /// At our epoch from a member: hand it to MLS (which may still refuse).
    Process,
    /// Skip it and say why; the cursor moves past it.
    Skip(SkipReason),
    /// A member's commit at an epoch we passed, different from ours and
    /// earlier on the log: the group went the other way. Stranded.
    ForkLost,
    /// A member's frame at a later epoch: we missed a commit. Stranded.
    Ahead,
    /// Our own commit at our epoch that we never journalled or adopted:
    /// the others merged it, we cannot. Stranded.
    OwnUnmerged,
}

impl Verdict {
    /// Whether this verdict is positive evidence that we are stranded.
    pub fn strands(&self) -> bool {
        matches!(
            self,
            Verdict::ForkLost | Verdict::Ahead | Verdict::OwnUnmerged
        )
    }
}

/// Judge one frame against our epoch `ours`.
pub fn classify(f: &Facts, ours: u64) -> Verdict {
    let Some(epoch) = f.epoch else {
        return Verdict::Skip(SkipReason::Garbage);
    };
    if f.other_group {
        return Verdict::Skip(SkipReason::OtherGroup);
    }
    if f.is_journalled && epoch == ours {
        return Verdict::Adopt;
    }
    if !f.publisher_is_member && !f.publisher_is_me {
        // Whatever it claims, a non-member's frame is no evidence of
        // anything: a stranger cannot strand a group.
        return Verdict::Skip(SkipReason::Stranger);
    }
    if epoch < ours {
        return match f.merged_here {
            Some(m) if !m.same_commit && m.frame_is_earlier => Verdict::ForkLost,
            _ => Verdict::Skip(SkipReason::History),
        };
    }
    if epoch > ours {
        return Verdict::Ahead;
    }
    if f.publisher_is_me {
        return Verdict::OwnUnmerged;
    }
    Verdict::Process
}

/// Whether a log trimmed past this device's cursor (its oldest held frame
/// comes after the cursor's next position) may have taken commits this
/// device never read: not when a held frame is a commit it merged (a
/// rewound log read again from the start). What was trimmed came before
/// that commit on the log, so this device has it or passed it; a
/// stranger's junk at the start of what is held changes nothing.
/// `held`: digests of the frames the log still holds that members
/// published, in log order (a stranger's replay of a commit this device
/// merged sits anywhere, so it must not count);
/// `merged`: digests of the commits this device remembers merging.
pub fn trim_hides_commits<'a>(
    mut held: impl Iterator<Item = &'a [u8; 32]>,
    merged: &[[u8; 32]],
) -> bool {
    !held.any(|d| merged.contains(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trimmed_prefix_hides_commits_unless_a_held_frame_is_one_we_merged() {
        let (junk, ours, theirs) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        let merged = [ours];
        assert!(!trim_hides_commits([ours, theirs].iter(), &merged));
        assert!(
            !trim_hides_commits([junk, junk, ours].iter(), &merged),
            "junk held before our commit (sim seed 351)"
        );
        assert!(trim_hides_commits([junk, theirs].iter(), &merged));
        assert!(trim_hides_commits([].iter(), &merged));
    }

    fn member_frame(epoch: u64) -> Facts {
        Facts {
            epoch: Some(epoch),
            other_group: false,
            publisher_is_member: true,
            publisher_is_me: false,
            is_journalled: false,
            merged_here: None,
        }
    }

    #[test]
    fn a_members_commit_at_our_epoch_is_processed() {
        assert_eq!(classify(&member_frame(5), 5), Verdict::Process);
    }

    #[test]
    fn garbage_and_other_groups_are_skipped() {
        let mut f = member_frame(5);
        f.epoch = None;
        assert_eq!(classify(&f, 5), Verdict::Skip(SkipReason::Garbage));
        let mut f = member_frame(5);
        f.other_group = true;
        assert_eq!(classify(&f, 5), Verdict::Skip(SkipReason::OtherGroup));
    }

    #[test]
    fn a_stranger_claiming_a_far_future_epoch_strands_nobody() {
        let mut f = member_frame(u64::MAX);
        f.publisher_is_member = false;
        let v = classify(&f, 5);
        assert_eq!(v, Verdict::Skip(SkipReason::Stranger));
        assert!(!v.strands());
        // Nor one at our epoch or a past one.
        for e in [5, 4] {
            let mut f = member_frame(e);
            f.publisher_is_member = false;
            assert_eq!(classify(&f, 5), Verdict::Skip(SkipReason::Stranger));
        }
    }

    #[test]
    fn a_members_frame_ahead_strands() {
        let v = classify(&member_frame(7), 5);
        assert_eq!(v, Verdict::Ahead);
        assert!(v.strands());
    }

    #[test]
    fn our_journalled_commit_is_adopted() {
        let mut f = member_frame(5);
        f.publisher_is_me = true;
        f.publisher_is_member = true;
        f.is_journalled = true;
        assert_eq!(classify(&f, 5), Verdict::Adopt);
    }

    #[test]
    fn our_own_commit_we_never_adopted_strands() {
        let mut f = member_frame(5);
        f.publisher_is_me = true;
        assert_eq!(classify(&f, 5), Verdict::OwnUnmerged);
    }

    #[test]
    fn past_epochs_are_history_unless_an_earlier_different_commit_won() {
        assert_eq!(
            classify(&member_frame(3), 5),
            Verdict::Skip(SkipReason::History)
        );
        let mut f = member_frame(3);
        f.merged_here = Some(MergedThere {
            same_commit: true,
            frame_is_earlier: false,
        });
        assert_eq!(classify(&f, 5), Verdict::Skip(SkipReason::History));
        // A different commit, later on the log: it lost to ours.
        f.merged_here = Some(MergedThere {
            same_commit: false,
            frame_is_earlier: false,
        });
        assert_eq!(classify(&f, 5), Verdict::Skip(SkipReason::History));
        // A different commit, earlier on the same log: ours lost.
        f.merged_here = Some(MergedThere {
            same_commit: false,
            frame_is_earlier: true,
        });
        assert_eq!(classify(&f, 5), Verdict::ForkLost);
        // The same from a stranger is no evidence.
        f.publisher_is_member = false;
        assert_eq!(classify(&f, 5), Verdict::Skip(SkipReason::Stranger));
    }
}
