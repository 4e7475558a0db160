//! The simulation checks itself: a seed replays exactly, and every
//! invariant is shown able to fail when the engine is broken on purpose.

use hubsync_sim::{run_seed, Breaks, Faults, SimConfig};

fn small(seed: u64) -> SimConfig {
    SimConfig {
        devices: 3,
        hubs: 2,
        groups: 1,
        ops: 12,
        faults: Faults::NONE,
        ..SimConfig::new(seed)
    }
}

fn invariants_broken(cfg: &SimConfig) -> Vec<&'static str> {
    let r = run_seed(cfg);
    let mut v: Vec<&'static str> = r.violations.iter().map(|v| v.invariant).collect();
    v.sort();
    v.dedup();
    v
}

/// Run the simulator binary on one seed in a fresh process, as a replay
/// command does, and read the run's summary.
///
/// Why a process: runs in one process carry some global state over (see
/// docs/simulations.md, "Determinism"), and the test harness runs tests on
/// parallel threads, so a seed run in-process here would not be the run
/// that `--seed N` replays.
fn run_in_process(seed: u64, ops: usize, faults: &str) -> serde_json::Value {
    run_in_process_with(seed, ops, faults, &[])
}

fn run_in_process_with(seed: u64, ops: usize, faults: &str, extra: &[&str]) -> serde_json::Value {
    let dir = std::env::temp_dir().join(format!(
        "hubsync-sim-det-{}-{seed}-{}",
        std::process::id(),
        rand_suffix()
    ));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hubsync-sim"))
        .args([
            "--seed",
            &seed.to_string(),
            "--ops",
            &ops.to_string(),
            "--faults",
            faults,
            "--report",
        ])
        .arg(&dir)
        .args(extra)
        .output()
        .expect("run hubsync-sim");
    let json: Option<serde_json::Value> = std::fs::read(dir.join("summary.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let _ = std::fs::remove_dir_all(&dir);
    match json {
        Some(j) => j["runs"][0].clone(),
        None => panic!(
            "seed {seed}: no report; the simulator printed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// The trace hash of one seed run in a fresh process, every fault on.
fn trace_hash_of(seed: u64, ops: usize) -> String {
    run_in_process(seed, ops, "all")["trace_hash"]
        .as_str()
        .expect("hash")
        .to_string()
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Each run in a fresh process, as a replayed failing seed is: the same seed
/// gives the same trace, to the byte.
///
/// Seed 7 with 15 operations replays in every process. Seed 40 with every
/// fault (a hub rewind among them) replayed differently on every run until
/// HPKE's ephemeral keys and the key package lifetimes came from the seed
/// and the simulated clock; it now replays on nearly every run, but one CI
/// run of the debug build still saw it differ once (docs/simulations.md,
/// "Determinism"), so it is not pinned here until that source is found.
#[test]
fn the_same_seed_replays_the_same_run() {
    let a = trace_hash_of(7, 15);
    let b = trace_hash_of(7, 15);
    assert_eq!(a, b, "same seed, same trace");
    assert_ne!(a, trace_hash_of(8, 15), "another seed, another run");
}

#[test]
fn pinned_seeds_with_every_fault_hold_every_invariant() {
    for seed in [4, 29, 32, 44, 145, 162] {
        // Every fault but hub rewinds (the `hub_rewind_*` seeds below run
        // every fault).
        let r = run_in_process(
            seed,
            20,
            "partitions,hub-crashes,device-crashes,latency,drops,strangers",
        );
        assert_eq!(r["violations"], serde_json::json!([]), "seed {seed}");
        assert!(
            r["messages_sent"].as_u64() > Some(0) && r["commits"].as_u64() > Some(0),
            "seed {seed} did nothing"
        );
    }
}

#[test]
fn merging_before_the_cas_answer_is_caught_as_a_fork() {
    let cfg = SimConfig {
        breaks: Breaks {
            merge_on_mismatch: true,
            ..Breaks::default()
        },
        ops: 25,
        ..small(3)
    };
    // The loser forks itself off; a rejoin may heal it by the end, but the
    // stranding is seen all the same.
    let v = invariants_broken(&cfg);
    assert!(
        v.contains(&"strand-without-cause") || v.contains(&"convergence"),
        "{v:?}"
    );
}

#[test]
fn a_broken_inbox_is_caught_as_a_duplicate() {
    let cfg = SimConfig {
        breaks: Breaks {
            double_emit: true,
            ..Breaks::default()
        },
        ..small(1)
    };
    assert!(invariants_broken(&cfg).contains(&"message-duplicated"));
}

#[test]
fn a_dead_outbox_is_caught_as_undrained() {
    let cfg = SimConfig {
        breaks: Breaks {
            blackhole_outbox: true,
            ..Breaks::default()
        },
        ..small(1)
    };
    let v = invariants_broken(&cfg);
    assert!(v.contains(&"outbox-drained"), "{v:?}");
}

#[test]
fn a_device_that_stops_following_commits_is_caught() {
    let cfg = SimConfig {
        breaks: Breaks {
            no_pull: true,
            ..Breaks::default()
        },
        ..small(1)
    };
    let v = invariants_broken(&cfg);
    assert!(
        v.contains(&"convergence") || v.contains(&"accepted-commits"),
        "{v:?}"
    );
}

#[test]
fn a_panic_anywhere_is_caught() {
    let cfg = SimConfig {
        breaks: Breaks {
            panic_on_receive: true,
            ..Breaks::default()
        },
        ..small(1)
    };
    assert!(invariants_broken(&cfg).contains(&"no-panic"));
}

/// No engine switch breaks the ledger, so this breaks one device's store
/// from outside: it loses the last entry of its stored ledger, as an engine
/// that failed to persist what a commit enacted would. Its folded ledger
/// then ends at another head than the others'.
#[test]
fn a_device_whose_ledger_diverges_is_caught() {
    let cfg = SimConfig {
        breaks: Breaks {
            forget_ledger_entry: true,
            ..Breaks::default()
        },
        ..small(1)
    };
    let v = invariants_broken(&cfg);
    assert!(v.contains(&"ledger-head"), "{v:?}");
}

/// Seeds found with every fault on (hub rewinds among them) that break an
/// invariant because of the engine, not the harness. Each replays with
/// `cargo run --release -p hubsync-sim -- --seed N` (30 operations, every
/// fault) and is explained in `docs/simulations.md`. Each broke the engine
/// until the lane learned to notice every kind of rewind and to give a
/// rewound hub back what it lost; each must hold now.
fn holds_with_every_fault(seed: u64) {
    // Every fault there was when the seed was found (`outages` came later
    // and changes the run).
    let r = run_in_process(
        seed,
        SimConfig::new(seed).ops,
        "partitions,hub-crashes,device-crashes,latency,drops,rewinds,strangers",
    );
    assert_eq!(r["violations"], serde_json::json!([]), "seed {seed}");
}

/// hub1 restarts on an empty store during the workload. Members that had
/// merged a commit the hub lost, and members that had not, go on from the
/// same epoch with different commits; re-reading the rewound log, the
/// first judge the others' commit at an epoch they passed as `History`
/// (positions from before a rewind were forgotten), so a fork at epoch 7
/// survived with nobody stranded. Now a different commit at an epoch we
/// merged, on a log that lost ours, is a fork we lost, and the members
/// that merged the lost commit give it back to the hub first.
#[test]
fn hub_rewind_workload_fork_survives() {
    holds_with_every_fault(40);
}

/// hub0 restarts from an older copy of its store (same store identity).
/// Before one member reads it again, new commits make the head climb back
/// to that member's cursor; the member reads after its stale cursor, never
/// sees the commit now at that position, and stayed at epoch 9 while the
/// group was at 11. Now a pull checks the frame at its cursor.
#[test]
fn hub_rewind_workload_head_climbs_back() {
    holds_with_every_fault(10);
}

/// hub1 restarts on an empty store (a new store identity) right after the
/// setup. A member that had not read it again reads after its old cursor on
/// the new store, skipped the first new commit, then saw a member's frame
/// at a later epoch and was stranded. Now a cursor keeps the store identity
/// it was read on.
#[test]
fn hub_rewind_workload_new_store_identity() {
    holds_with_every_fault(11);
}

/// hub1 restarts on an empty store and loses a commit one member had not
/// applied yet. Nothing was left on the log to tell it; it stayed one epoch
/// behind. Now the members that merged it give it back to the hub.
#[test]
fn hub_rewind_workload_erased_commit() {
    holds_with_every_fault(24);
}

/// hub0 restarts on an empty store at 2.4 s and stays down until about
/// 196 s. A message sent at 194.9 s (after the rewind, so judged in full)
/// reached every member but one, which noticed the rewind last. Now a
/// rewind reads the group's app topics on that hub again.
#[test]
fn hub_rewind_workload_message_after_rewind_lost() {
    holds_with_every_fault(121);
}

/// The commit that moved g0's commit hub was lost by the *old* commit
/// hub's restore from an older copy; a member still reading the old hub
/// never learned of the move, and the members that moved never read that
/// hub again. Now each member checks its former logs and gives back what
/// one lost (`check_former_logs` in lane/pull.rs).
#[test]
fn hub_rewind_former_commit_hub_lost_the_move() {
    holds_with_every_fault(80);
}

/// A joiner's peer subscribed the commit topic its add moved the log to
/// only after the next commit there: no push came, and nothing pulled
/// until the periodic tick, by when a rewind had taken that commit. Now a
/// peer pulls once its new commit topic's subscription reaches the hub.
#[test]
fn hub_rewind_new_commit_topic_read_after_subscribing() {
    holds_with_every_fault(52);
}

/// A former log found short on the commit hub was healed without being
/// called a rewind, so the app cursors read there before stayed, and a
/// message re-published on the rewound app log sat below one member's
/// cursor, never read. Now a former log found short is a rewound hub.
#[test]
fn hub_rewind_former_log_short_rereads_the_app_logs() {
    holds_with_every_fault(22);
}

/// Seeds found with long outages on (every fault but hub rewinds), each
/// fixed in the engine and pinned here.
///
/// Seed 194: dev0, away past the logs' depth, was stranded and rejoined,
/// but the gather in its new epoch found nobody in time, so its ledger
/// stayed incomplete (its stored ledger behind the others') for good: it
/// would only have gathered again at its next commit. Now the background
/// heal goes on gathering until the ledger is complete.
#[test]
fn outage_rejoin_whose_gather_found_nobody_gathers_again() {
    let r = holds_with_outages(194);
    assert!(r["rejoins"].as_u64() >= Some(1), "seed 194 rejoined: {r}");
}

/// Seed 209: the group left hub0 for hub1 while dev3 was away; back and
/// stranded, dev3 asked to rejoin only on hub0, where no member listens
/// any more, and never heard an answer. Now a rejoin asks and listens on
/// the device's own hubs too, and a rejoined device whose ledger is
/// incomplete adds the commit hub to its hubs, so its gather reaches the
/// members.
#[test]
fn outage_rejoin_reaches_a_group_that_moved_hubs() {
    let r = holds_with_outages(209);
    assert!(r["rejoins"].as_u64() >= Some(1), "seed 209 rejoined: {r}");
}

/// Seed 454: dev3 was removed while cut off from the commit hub; back
/// past the logs' depth it was stranded, every member refused its rejoin,
/// and it held the group for good. Now refusals from most of the members
/// it knows are its removal: it forgets the group.
#[test]
fn outage_removed_device_refused_by_every_member_forgets_the_group() {
    holds_with_outages(454);
}

/// Seeds found with every fault on (long outages and hub rewinds
/// together), each fixed in the engine and pinned here.
///
/// Seed 162: hub1 was restored from a copy older than two commits; dev4,
/// back, built another commit at the first of those epochs, and dev2, on
/// the lost branch, had sent a message there that only dev3 (on the same
/// branch) could read. dev2 rejoined, but the message never reached dev4
/// or dev1. Now a rejoin sends the lost branch's messages again under
/// their ids. Since a device reads its logs on every reconnect (protocol
/// version 4), dev4 sees the restore before it commits and no branch is
/// lost in this seed any more; the seed stays pinned for its invariants,
/// and the lost-branch resend is shown by the lane test
/// `the_loser_of_a_fork_rejoins_and_its_lost_entry_and_message_are_issued_again_once`.
#[test]
fn all_faults_message_of_a_lost_branch_is_sent_again() {
    holds_with_all_faults(162);
}

/// Seed 351: hub1 was restored from a copy whose commit log began, after
/// trimming, with a stranger's junk frame; re-reading it from the start,
/// both members took the trimmed prefix for commits they never read and
/// stranded each other, with nobody left to answer a rejoin. Now a
/// trimmed prefix before a commit the device merged is no gap, wherever
/// in the held frames that commit sits.
#[test]
fn all_faults_trimmed_junk_before_our_commit_is_no_gap() {
    holds_with_all_faults(351);
}

/// Seed 455: dev2, back from a long outage at epoch 1 and still cut off,
/// sent a message there while the group was at epoch 13; the outbox
/// delivered it once the network healed, and nobody could read an epoch
/// that old. dev2 then found itself left behind and rejoined, but the
/// message stayed lost. Now a device that strands sends again, after its
/// rejoin, what it sent since it last knew itself at the log's end.
#[test]
fn all_faults_message_sent_while_far_behind_is_sent_again() {
    let r = holds_with_all_faults(455);
    assert!(r["rejoins"].as_u64() >= Some(1), "seed 455 rejoined: {r}");
}

/// Seed 638: hub1 was restored from a copy taken before dev4's key
/// package was claimed for its first group; the restored hub handed the
/// same package out again, and dev4, which had deleted its keys when it
/// joined, could never read the Welcome: the roster held a member that
/// never joined. Now a device replaces its pool on a hub that holds
/// packages it has no keys for.
#[test]
fn all_faults_key_package_brought_back_by_a_restore_is_replaced() {
    holds_with_all_faults(638);
}

/// Seed 18: dev1 was invited to g1 and cut off from its commit hub at
/// once; the hub then restarted on an empty store twice, and the inviter
/// made more commits than it remembers. dev1 joined from the Welcome
/// posted again, at epoch 1, on a commit log the restore emptied, and
/// stayed there: nothing it could read said the group had moved on. Now a
/// device that joins from a Welcome asks the members by probe, strands,
/// and rejoins.
#[test]
fn all_faults_joiner_from_a_welcome_posted_again_catches_up() {
    let r = holds_with_all_faults(18);
    assert!(r["rejoins"].as_u64() >= Some(1), "seed 18 rejoined: {r}");
}

/// Seed 100: with a probe after every join, dev2's probe was still
/// running when it found its commit log rewound, and the probe that
/// rewind asked for was dropped; dev2 then stopped (a crash) and, back,
/// stayed behind, never learning of its removal. A probe asked for while
/// one runs now runs again after it, a probe is owed in the group's record
/// until one concludes, and a member's answer that the prober's log cannot
/// be read to check (a partition) strands nobody.
#[test]
fn all_faults_probe_asked_for_while_one_runs_is_not_lost() {
    holds_with_all_faults(100);
}

/// Seed 75: the group moved its commits to another hub and went on there
/// for more commits than a member kept the frames of; the former hub was
/// then restored from before the move. A member away during the move read
/// only the former hub and waited there for good: nobody could give the
/// move back. The last commit of each commit log now keeps its frame while
/// it is remembered.
#[test]
fn all_faults_move_given_back_to_a_restored_former_hub_however_old() {
    holds_with_all_faults(75);
}

/// Seed 37: a member granted admin removed dev2 and invited it back while
/// dev2 was far behind; dev2, still holding the group and not having read
/// the grant, refused the re-invite outright (not from an admin, as far as
/// it knew) and after reading its removal was out of the group for good.
/// A member's Welcome for a held group is now kept aside, one per
/// inviter, and judged by the ledger as it stood at the removal.
#[test]
fn all_faults_reinvite_from_a_member_granted_admin_unseen_is_joined() {
    holds_with_all_faults(37);
}

/// Seed 335: dev2 was removed and invited back; a member back from a
/// long outage then sent again, under its id, a message dev2 had
/// delivered before its removal, and dev2 delivered it twice: leaving the
/// group had deleted its message-id marks. They now stay.
#[test]
fn all_faults_a_message_sent_again_to_a_member_invited_back_is_not_repeated() {
    holds_with_all_faults(335);
}

/// Seed 718: a hub restored from an older copy lost an invite and its
/// Welcome. A member that read that invite gave the lost commit back
/// before the inviter's own check came round, so the inviter never saw
/// the rewind in that group and the joiner never got its Welcome. The
/// inviter saw the same hub rewind in its other group: a rewind is the
/// hub's, and the Welcomes of every group there are now posted again.
#[test]
fn all_faults_a_welcome_lost_in_a_rewind_another_member_healed_is_posted_again() {
    holds_with_all_faults(718);
}

/// Seed 802: a hub came back from an older copy of its store, without a
/// member's subscription, and two messages were published before that
/// member's link made it again; the hub never pushed them, and only a
/// rewind the member saw would have read the log. Now every new
/// connection reads the app logs from the cursor the pushes moved.
#[test]
fn all_faults_messages_published_before_a_lost_subscription_is_made_again_arrive() {
    holds_with_all_faults(802);
}

/// Seed 1105: a hub came back from an older copy of its store and took
/// new frames on an app topic at the positions it had lost. A member away
/// meanwhile read on from its cursor, past the new frame where it had read
/// another, and missed a message. The cursor now keeps the digest of the
/// frame it stands on, and another frame there is a rewind.
#[test]
fn all_faults_another_frame_at_an_app_cursor_is_a_rewind() {
    holds_with_all_faults(1105);
}

/// Seed 1256: hub0 came back from an older copy holding a key package
/// dev0 had used since, and an invite claimed it before dev0's link
/// replaced its pool there; dev0 could not read the Welcome while the
/// roster listed it. The joiner now asks its inviter to invite it again,
/// and the inviter replaces the dead leaf.
#[test]
fn all_faults_a_joiner_on_a_dead_key_package_is_invited_again() {
    holds_with_all_faults(1256);
}

/// Seed 1202: frames trimmed by the outage log depth before dev3's
/// stream pushed them; the hub's `FramesMissed` notice was only logged by
/// the link while the pushes after the gap moved the app cursor on. The
/// notice now reaches the app as `AppFramesMissed`.
#[test]
fn all_faults_frames_trimmed_before_they_were_pushed_are_reported() {
    holds_with_all_faults(1202);
}

/// Seed 1282: hub1 trimmed dev3's commit log (outage depth) while dev3
/// was down, and the frames it still held were a stranger's, one a replay
/// of the last commit dev3 merged. That copy was taken as proof that the
/// trim hid nothing, and dev3 stayed at its old epoch. Only frames
/// members published count now.
#[test]
fn all_faults_a_strangers_replay_does_not_hide_a_trim() {
    holds_with_all_faults(1282);
}

/// Seed 1511: a restore of hub1 took away the branch on which dev0 was
/// invited to g1, and the group went on without it. dev0's rejoins were
/// refused by one of the two others it knew (the other had been removed
/// and was not yet back), which is too few to be a removal, and its
/// background heal gave up there: dev0 stayed stranded, untold. It asks
/// again now and takes itself as removed once most refuse.
#[test]
fn all_faults_a_member_on_a_lost_branch_learns_it_is_not_in_the_group() {
    holds_with_all_faults(1511);
}

/// Seed 1059: dev4 rejoined g0 while its only hub was down for two
/// minutes, and its ledger gathers backed off to 160 s by the time the
/// hub came back: the next one fell after the end of the run, its ledger
/// short. A heal now asks again as soon as a hub link connects.
#[test]
fn all_faults_a_heal_asks_again_when_the_hub_is_back() {
    holds_with_all_faults(1059);
}

/// Seed 1068: hub1, restored from a copy whose depth-4 window held only
/// frames an insider had written, lost g1's commits; every member found
/// the trim, no member's frame in what was kept, and stranded itself, and
/// a stranded member answers no rejoin. They give the log back what they
/// merged now.
#[test]
fn all_faults_a_restored_log_of_junk_strands_nobody() {
    holds_with_all_faults(1068);
}

/// Seed 1145: dev4 read hub1's restored log from the start: its own
/// commit had been trimmed there, only junk was kept, and giving the
/// commit back was answered as a duplicate (the hub still knew its publish
/// id), which changed nothing; the pull gave it back again and again and
/// never returned. It gives back once per pull now, then strands and
/// rejoins.
#[test]
fn all_faults_giving_back_to_a_log_of_junk_does_not_loop() {
    holds_with_all_faults(1145);
}

/// Seed 600: hub1 was restored from a copy older than dev1's commit that
/// invited dev3, and dev0 committed in its place there; dev1 found its
/// commit lost on that former log and stranded, but dev3, which had
/// joined on dev1's branch and read only its newer log, answered dev1's
/// rejoin from that branch: two branches lived on. The request names the
/// lost branch now; dev3 learns it from it, and dev1 takes no answer
/// from it.
#[test]
fn all_faults_a_member_brought_along_on_a_lost_branch_learns_it() {
    holds_with_all_faults(600);
}

/// Seed 921: g0's two members were at one epoch when an insider's frames
/// pushed its last commit out of hub1's shallow log; each found the trim
/// with nothing a member wrote in what was kept, stranded, and answered
/// the other's rejoin with silence, for ever. They ask each other their
/// epoch now, and read on.
#[test]
fn all_faults_a_trim_of_junk_strands_no_member_at_the_groups_epoch() {
    holds_with_all_faults(921);
}

/// Seed 734: a grant's answer was lost (its hub isolated) and the
/// device's own pull merged the commit before the lane sent it again; the
/// lane took the vanished journal for a lost race, built the grant again
/// and was refused as a duplicate of itself, so the simulation believed
/// the grantee was no admin and called its later invite unauthorized. A
/// journal a pull ended is now looked up among the merged commits first.
#[test]
fn all_faults_a_commit_merged_by_a_pull_is_reported_landed() {
    holds_with_all_faults(734);
}

/// Seed 632: a hub rewound to empty; a member that had missed the last
/// commits committed there first, taking the place of another member's
/// commit. That member stranded, yet a later give-back of its commits
/// after the lost one (whose frame it no longer listed) put them behind
/// the winner's, and every reader there took them for commits from ahead
/// and stranded too: nobody was left to answer a rejoin. A commit is now
/// given back only after ours of the epoch before, where we remember it.
#[test]
fn all_faults_a_give_back_never_follows_a_lost_commit() {
    holds_with_all_faults(632);
}

/// Seed 896: a member removed while away was invited again; its Welcome
/// was kept for after the removal it had not seen, but it came back by
/// rejoining instead. Removed again later, it joined from the kept
/// Welcome and was stranded on a state the group had left, with nobody
/// to answer it. A rejoin now clears the kept Welcomes, and a Welcome to
/// an epoch the device is already past is refused, not kept.
#[test]
fn all_faults_a_rejoin_clears_welcomes_kept_for_after_a_removal() {
    holds_with_all_faults(896);
}

/// Seed 182: the first version of the fix for seed 632 stopped giving a
/// commit back whenever ours of the epoch before had no known position,
/// which after a restore from a copy is every one: the last commit of a
/// former log was never given back, and a member away meanwhile went on
/// committing on that log alone. Now only a member's other commit of the
/// epoch before, at the log's end, stops it.
#[test]
fn all_faults_a_restored_former_log_is_given_its_last_commit_back() {
    holds_with_all_faults(182);
}

/// Seed 1337: a hub restored from an older copy lost two commits; a
/// member away during them came back and wrote its own commit of that
/// epoch there, learned from the others that the group had moved on, and
/// rejoined on their branch. Later the others checked that former log,
/// met its abandoned commit where theirs had been, and stranded one after
/// another, until nobody was left to answer. A commit whose writer has
/// since committed on this device's branch no longer says ours lost.
#[test]
fn all_faults_an_abandoned_commit_on_a_former_log_strands_nobody() {
    holds_with_all_faults(1337);
}

/// Seed 1723 after two other tasks (tokio's task numbers change the order
/// a crashed hub's connections close, and so the run; see
/// docs/simulations.md, "Determinism"): a member behind when a hub lost
/// everything wrote its own commit in the place of the one it had
/// missed, learned from the others that the group had moved on, and
/// rejoined on their branch. A member that had stranded on its commit
/// before that asked to rejoin, naming its branch as lost; the others,
/// the newcomer among them, stranded on that claim, and nobody was left
/// to answer. The claim names who displaced the commit, and a member
/// that has since merged a commit of that member's answers instead.
#[test]
fn all_faults_a_stale_lost_branch_claim_strands_nobody() {
    let r = run_in_process_with(1723, 30, "all", &["--tasks-before", "2"]);
    assert_eq!(r["violations"], serde_json::json!([]));
    assert!(
        r["rejoins"].as_u64().unwrap_or(0) > 0,
        "nobody rejoined: {r}"
    );
}

/// The same seed with another task count is another run (the reason the
/// binary runs each seed of a batch in a fresh process of its own).
#[test]
fn tasks_before_a_run_change_it_and_replay_it() {
    let hash = |n: &str| {
        run_in_process_with(1723, 30, "all", &["--tasks-before", n])["trace_hash"].clone()
    };
    let (zero, two) = (hash("0"), hash("2"));
    assert_ne!(zero, two, "two task counts, one run");
    assert_eq!(two, hash("2"), "one task count, two runs");
}

/// Seed 548: a member away while a hub rewound to empty committed and
/// sent on the branch the rewind erased; it learned so later, when a
/// member of that branch asked to rejoin, and was removed (its own invite
/// was on that branch). Its commit and message are excused, as those the
/// rewind erased are, because it learned.
#[test]
fn all_faults_a_commit_on_an_erased_branch_is_learned() {
    holds_with_all_faults(548);
}

/// Tunnel calls and history syncs between members, with every fault on:
/// each call's items arrive in order exactly once, or the call says why
/// it ended (`tunnel-order`); a sync hands on no more than the group
/// allows (`history-bound`) and nothing twice (`message-duplicated`); and
/// calls and syncs do complete.
#[test]
fn tunnel_calls_and_history_syncs_hold_with_all_faults() {
    let (mut done, mut synced) = (0, 0);
    for seed in [3, 5] {
        let r = run_in_process_with(seed, 30, "all", &["--tunnels"]);
        assert_eq!(r["violations"], serde_json::json!([]), "seed {seed}");
        assert!(
            r["tunnel_calls"].as_u64().unwrap_or(0) > 0,
            "seed {seed}: {r}"
        );
        done += r["tunnels_done"].as_u64().unwrap_or(0);
        synced += r["history_syncs"].as_u64().unwrap_or(0);
    }
    assert!(done > 0, "no tunnel call got all its items");
    assert!(synced > 0, "no history sync answered");
}

/// Seed 2047: a member removed and invited again at once kept the new
/// Welcome aside (it still held the group), and once it saw its removal,
/// the Welcome named a key package a restored hub had handed out again:
/// the join of kept Welcomes reported it refused but never asked the
/// inviter to invite it again (only the mailbox's reader did), so the
/// roster listed a member that held nothing. Now whoever accepts a
/// Welcome asks.
#[test]
fn all_faults_a_kept_welcome_on_a_dead_key_package_asks_to_be_invited_again() {
    holds_with_all_faults(2047);
}

fn holds_with_all_faults(seed: u64) -> serde_json::Value {
    let r = run_in_process(seed, 30, "all");
    assert_eq!(r["violations"], serde_json::json!([]), "seed {seed}");
    r
}

fn holds_with_outages(seed: u64) -> serde_json::Value {
    let r = run_in_process(
        seed,
        30,
        "partitions,hub-crashes,device-crashes,latency,drops,strangers,outages",
    );
    assert_eq!(r["violations"], serde_json::json!([]), "seed {seed}");
    r
}

/// A small crowd (100 devices on 10 machines, 5 hubs, 20 groups) with every
/// fault on: the invariants hold, and each hub restart is measured as a
/// reconnect storm in which every device connected before comes back (the
/// full-size crowd, 1,000 devices, is `hubsync-sim --crowd`; see
/// docs/simulations.md, "Crowds").
#[test]
fn a_small_crowd_holds_and_its_reconnect_storms_settle() {
    let r = run_in_process_with(
        2,
        40,
        "all",
        &[
            "--devices",
            "100",
            "--hubs",
            "5",
            "--groups",
            "20",
            "--devices-per-host",
            "10",
        ],
    );
    assert_eq!(r["violations"], serde_json::json!([]));
    let storms = r["storms"].as_array().cloned().unwrap_or_default();
    assert!(!storms.is_empty(), "no hub restarted: {r}");
    let n = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap_or(0);
    let back = storms
        .iter()
        .filter(|s| n(s, "streams_before") >= 90 && s["settle_ms"].is_u64())
        .collect::<Vec<_>>();
    assert!(!back.is_empty(), "no crowd came back: {storms:?}");
    for s in back {
        assert!(n(s, "reconnects") >= n(s, "streams_before"), "{s}");
        assert!(n(s, "resubscriptions") >= n(s, "streams_before"), "{s}");
        assert!(n(s, "peak_reconnects_per_s") > 0, "{s}");
    }
}
