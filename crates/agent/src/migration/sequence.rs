//! The source's side of one move as a pure state machine.
//!
//! [`next`] takes where the move stands and what the last step came to, and
//! gives the next thing to do. Nothing here waits, reads a clock, a file or
//! a socket: the executor (`Move` in this module's parent) does each step's
//! I/O (QMP, the target agent, the journal) and feeds its outcome back.
//!
//! ```text
//! Establish → Plan → Record → Skeleton → [Disks] → Connect → Stream → Copy
//!   Copy ─ completed ───────────────────────────────────────▶ Tick → Ready → Commit → Run → Cleanup → report
//!   Copy ─ post-copy wanted → PostcopyCheck → PostcopyCommit → PostcopyStart → Postcopy → Tick → Run → …
//! ```
//!
//! A failed step ends the move one of three ways, and which one follows
//! what the journal holds when it failed (read by the executor after the
//! failure, never assumed from the step):
//! - before the target heard of the move (Establish, Plan, Record): nothing
//!   to undo, the guest never stopped here;
//! - the record says `copying`: roll back (record `aborted`, QEMU's
//!   migration cancelled, the skeleton discarded, the guest resumed here);
//! - the record says `committed`, or cannot be read: never rolled back.
//!   The move is settled after the commit (`settle`): finished, recovered,
//!   or left in doubt for an answer.

use crate::commit::TargetAnswer;

/// One step of a move, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    /// `GET /host` of the target; its name must be the one asked for.
    Establish,
    /// The NIC pairs probed, the option and QEMU's compression chosen.
    Plan,
    /// The journal: `copying`, before the target hears of the move.
    Record,
    /// `POST /incoming`: the target reserves memory, starts QEMU `-S`.
    Skeleton,
    /// Shared-nothing only: each local drive mirrored until in step.
    Disks,
    /// The carriers dialled (or the target's TCP listener checked).
    Connect,
    /// QEMU's capabilities and parameters set, `migrate` sent.
    Stream,
    /// Pre-copy, watched until QEMU completes or post-copy is wanted.
    Copy,
    /// Post-copy wanted: the target must be waiting, paused.
    PostcopyCheck,
    /// The journal: `committed`, before QEMU switches to post-copy.
    PostcopyCommit,
    /// `migrate-start-postcopy`.
    PostcopyStart,
    /// Post-copy, watched until QEMU completes (recovering a broken stream).
    Postcopy,
    /// The source console's last counter read (for the guest check).
    Tick,
    /// `POST /incoming/ID/ready`: the target loaded everything, paused.
    Ready,
    /// The journal: `committed` (fsync): the commit point.
    Commit,
    /// `POST /incoming/ID/run`: the target runs the guest.
    Run,
    /// The source QEMU stopped, the record `done`; the guest checked there.
    Cleanup,
}

/// What the journal held for the move when a step failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OnDisk {
    /// No record.
    Nothing,
    Copying,
    /// `committed`, `done` or `aborted`: past the point a rollback may run.
    Past,
    /// The record could not be read: no answer, never "no record".
    Unreadable,
}

/// What a step came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The step did its part (for `Copy` and `Postcopy`: QEMU completed).
    Done,
    /// `Plan` only: its choice, and whether local drives are mirrored.
    Planned { disks: bool },
    /// `Copy` only: the copy loop wants post-copy.
    PostcopyWanted,
    /// `Run` only: the target's answer to RUN.
    Ran(TargetAnswer),
    /// The step failed; the journal then held this.
    Failed(OnDisk),
}

/// Where a move stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    /// The step running (or last run, once ended).
    pub at: Step,
    /// Local drives are mirrored (shared-nothing): the `Disks` step runs,
    /// and the mirrors end with the move.
    pub disks: bool,
    /// The mirrors are in step (the `Disks` step succeeded).
    pub mirrored: bool,
    /// Post-copy was committed: the target runs before it has every page.
    pub postcopy: bool,
    /// The move ended.
    pub ended: bool,
}

/// What the executor does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run this step and report its [`Outcome`].
    Do(Step),
    /// Ended before the target heard of it: nothing to undo.
    Fail,
    /// Ended before the commit: abort the mirrors (`mirrored`), roll back.
    RollBack { mirrored: bool },
    /// Ended after the commit (or with no telling): close the mirrors
    /// (`mirrored`: the target holds the copies now), settle, never roll
    /// back.
    AfterCommit { mirrored: bool },
    /// The target runs the guest and the source is cleaned up: report.
    Report { mirrored: bool },
}

impl State {
    /// A new move (whether it mirrors local drives, `Plan` says).
    pub fn new() -> State {
        State {
            at: Step::Establish,
            disks: false,
            mirrored: false,
            postcopy: false,
            ended: false,
        }
    }
}

/// The first thing a move does.
pub const FIRST: Action = Action::Do(Step::Establish);

/// The source's sequence: `s` ran its step to `outcome`; what now.
pub fn next(s: State, outcome: Outcome) -> (State, Action) {
    use Outcome as O;
    use Step as S;
    if s.ended {
        // an ended move takes no more steps, whatever is reported
        return (
            s,
            Action::AfterCommit {
                mirrored: s.mirrored,
            },
        );
    }
    let go = |s: State, step: Step| (State { at: step, ..s }, Action::Do(step));
    match (s.at, outcome) {
        (_, O::Failed(on_disk)) => end(s, |_| failed(s, on_disk)),
        (S::Establish, O::Done) => go(s, S::Plan),
        (S::Plan, O::Planned { disks }) => go(State { disks, ..s }, S::Record),
        (S::Record, O::Done) => go(s, S::Skeleton),
        (S::Skeleton, O::Done) if s.disks => go(s, S::Disks),
        (S::Skeleton, O::Done) => go(s, S::Connect),
        (S::Disks, O::Done) => go(
            State {
                mirrored: true,
                ..s
            },
            S::Connect,
        ),
        (S::Connect, O::Done) => go(s, S::Stream),
        (S::Stream, O::Done) => go(s, S::Copy),
        (S::Copy, O::Done) => go(s, S::Tick),
        (S::Copy, O::PostcopyWanted) => go(s, S::PostcopyCheck),
        (S::PostcopyCheck, O::Done) => go(s, S::PostcopyCommit),
        (S::PostcopyCommit, O::Done) => go(
            State {
                postcopy: true,
                ..s
            },
            S::PostcopyStart,
        ),
        (S::PostcopyStart, O::Done) => go(s, S::Postcopy),
        (S::Postcopy, O::Done) => go(s, S::Tick),
        // post-copy's target runs already: no READY, no second commit
        (S::Tick, O::Done) if s.postcopy => go(s, S::Run),
        (S::Tick, O::Done) => go(s, S::Ready),
        (S::Ready, O::Done) => go(s, S::Commit),
        (S::Commit, O::Done) => go(s, S::Run),
        (S::Run, O::Ran(TargetAnswer::Running)) => go(s, S::Cleanup),
        // a target that lost its skeleton, or waits still: after the
        // commit, the settler's to decide
        (S::Run, O::Ran(_)) => end(s, |mirrored| Action::AfterCommit { mirrored }),
        (S::Cleanup, O::Done) => end(s, |mirrored| Action::Report { mirrored }),
        // an outcome the step cannot have: the move fails where it stands,
        // as the journal says
        (_, O::PostcopyWanted | O::Ran(_) | O::Done | O::Planned { .. }) => {
            end(s, |_| failed(s, OnDisk::Unreadable))
        }
    }
}

/// The move ends where it stands with `action` (given whether the mirrors
/// are in step).
fn end(s: State, action: impl FnOnce(bool) -> Action) -> (State, Action) {
    (State { ended: true, ..s }, action(s.mirrored))
}

/// A failed step: before the target heard, before the commit, or after it.
fn failed(s: State, on_disk: OnDisk) -> Action {
    let mirrored = s.mirrored;
    match (s.at, on_disk) {
        // the target has not heard of the move and the guest never stopped
        (Step::Establish | Step::Plan | Step::Record, _) => Action::Fail,
        (_, OnDisk::Copying | OnDisk::Nothing) => Action::RollBack { mirrored },
        (_, OnDisk::Past | OnDisk::Unreadable) => Action::AfterCommit { mirrored },
    }
}

#[cfg(test)]
mod tests {
    //! Whole moves against a fake source QEMU, a fake target and a fake
    //! journal, with a failure injected at every step (before and after
    //! the step's effect). The ends are then settled as the agent does
    //! (`commit::after_commit`), and no world may run two copies, lose the
    //! guest, or stop the source QEMU while the target lacks pages.
    use super::*;
    use crate::commit::{after_commit, AfterCommitAction, SourceQemu};

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Journal {
        None,
        Copying,
        Committed,
        Aborted,
        Done,
        Unreadable,
    }

    /// The source QEMU.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Src {
        Running,
        /// Pre-copy in flight, the guest running.
        Migrating,
        /// Paused with its migration completed: the target has everything.
        Completed,
        /// In post-copy: the target runs, fetching pages from here.
        Postcopy {
            paused: bool,
        },
        Quit,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Tgt {
        None,
        /// Paused under `-S`; `loaded`: it holds the whole state.
        Skeleton {
            loaded: bool,
        },
        /// Runs the guest; `whole`: it has every page.
        Running {
            whole: bool,
        },
        Discarded,
    }

    #[derive(Debug, Clone, Copy)]
    struct World {
        journal: Journal,
        src: Src,
        tgt: Tgt,
        mirror: Option<&'static str>,
    }

    /// Where a failure is injected: the step, and whether its effect took
    /// place before the failure was seen (a reply lost, an fsync failed
    /// after the write).
    #[derive(Debug, Clone, Copy)]
    struct Fault {
        step: Step,
        after_effect: bool,
    }

    impl World {
        fn new() -> World {
            World {
                journal: Journal::None,
                src: Src::Running,
                tgt: Tgt::None,
                mirror: None,
            }
        }

        fn on_disk(&self) -> OnDisk {
            match self.journal {
                Journal::None => OnDisk::Nothing,
                Journal::Copying => OnDisk::Copying,
                Journal::Unreadable => OnDisk::Unreadable,
                _ => OnDisk::Past,
            }
        }

        /// The step's effect, as the real one has it.
        fn effect(&mut self, step: Step, (disks, postcopy): (bool, bool)) -> Outcome {
            match step {
                Step::Plan => return Outcome::Planned { disks },
                Step::Establish | Step::Connect | Step::Tick => {}
                Step::Record => self.journal = Journal::Copying,
                Step::Skeleton => self.tgt = Tgt::Skeleton { loaded: false },
                Step::Disks => self.mirror = Some("running"),
                Step::Stream => self.src = Src::Migrating,
                Step::Copy if postcopy => return Outcome::PostcopyWanted,
                Step::Copy => {
                    self.src = Src::Completed;
                    self.tgt = Tgt::Skeleton { loaded: true };
                }
                Step::PostcopyCheck => {}
                Step::PostcopyCommit | Step::Commit => self.journal = Journal::Committed,
                Step::PostcopyStart => {
                    self.src = Src::Postcopy { paused: false };
                    self.tgt = Tgt::Running { whole: false };
                }
                Step::Postcopy => {
                    self.src = Src::Completed;
                    self.tgt = Tgt::Running { whole: true };
                }
                Step::Ready => {}
                Step::Run => {
                    if let Tgt::Skeleton { loaded: true } = self.tgt {
                        self.tgt = Tgt::Running { whole: true };
                    }
                    return Outcome::Ran(self.answer().expect("the target answers"));
                }
                Step::Cleanup => {
                    self.src = Src::Quit;
                    self.journal = Journal::Done;
                }
            }
            Outcome::Done
        }

        /// A failed step leaves QEMU where a failure would: a copy that
        /// fails stops its stream (a post-copy's pauses).
        fn break_stream(&mut self, step: Step) {
            match (step, self.src) {
                (Step::Copy | Step::Stream, Src::Migrating) => self.src = Src::Running,
                (Step::Postcopy, Src::Postcopy { .. }) => self.src = Src::Postcopy { paused: true },
                _ => {}
            }
        }

        fn answer(&self) -> Option<TargetAnswer> {
            Some(match self.tgt {
                Tgt::None | Tgt::Discarded => TargetAnswer::NeverRan,
                Tgt::Skeleton { .. } => TargetAnswer::Waiting,
                Tgt::Running { .. } => TargetAnswer::Running,
            })
        }

        fn source_qemu(&self) -> SourceQemu {
            match self.src {
                Src::Running => SourceQemu::NotSwitched,
                Src::Migrating => SourceQemu::Active,
                Src::Completed => SourceQemu::Completed,
                Src::Postcopy { paused } => SourceQemu::Postcopy { paused },
                Src::Quit => SourceQemu::Gone,
            }
        }

        /// `roll_back`: only while the record says copying.
        fn roll_back(&mut self) {
            if self.journal != Journal::Copying {
                return;
            }
            self.journal = Journal::Aborted;
            if self.src == Src::Migrating || self.src == Src::Completed {
                self.src = Src::Running;
            }
            if let Tgt::Skeleton { .. } = self.tgt {
                self.tgt = Tgt::Discarded;
            }
        }

        /// The settler after the commit, until it has nothing left to do
        /// (a recovered post-copy runs to its end).
        fn settle(&mut self) {
            for _ in 0..10 {
                if self.journal == Journal::Unreadable {
                    return; // in doubt: nothing acts on a record it cannot read
                }
                if self.journal != Journal::Committed {
                    return;
                }
                match after_commit(self.answer(), self.source_qemu()) {
                    AfterCommitAction::Finish => {
                        assert!(
                            matches!(self.tgt, Tgt::Running { whole: true }),
                            "{self:?}: finished while the target lacks pages"
                        );
                        self.src = Src::Quit;
                        self.journal = Journal::Done;
                    }
                    AfterCommitAction::SendRun => {
                        if let Tgt::Skeleton { loaded: true } = self.tgt {
                            self.tgt = Tgt::Running { whole: true };
                        }
                    }
                    AfterCommitAction::Recover => {
                        self.src = Src::Completed;
                        self.tgt = Tgt::Running { whole: true };
                    }
                    AfterCommitAction::DiscardTarget => {
                        self.tgt = Tgt::Discarded;
                        self.journal = Journal::Aborted;
                    }
                    AfterCommitAction::AbortAndResume => {
                        self.journal = Journal::Aborted;
                        self.src = Src::Running;
                    }
                    AfterCommitAction::CancelAndLook => self.src = Src::Running,
                    AfterCommitAction::AskLater => return,
                }
            }
        }

        fn runs_source(&self) -> bool {
            matches!(self.src, Src::Running | Src::Migrating)
        }

        fn check(&self, what: &str) {
            let target_runs = matches!(self.tgt, Tgt::Running { .. });
            assert!(
                !(self.runs_source() && target_runs),
                "{what}: two copies run: {self:?}"
            );
            if let Tgt::Running { whole: false } = self.tgt {
                assert!(
                    matches!(self.src, Src::Postcopy { .. }),
                    "{what}: the target lacks pages the source no longer has: {self:?}"
                );
            }
            // the guest exists: running somewhere, or whole and paused in doubt
            let whole_paused = matches!(self.src, Src::Completed)
                || matches!(self.tgt, Tgt::Skeleton { loaded: true });
            assert!(
                self.runs_source() || target_runs || whole_paused,
                "{what}: the guest is lost: {self:?}"
            );
        }
    }

    /// One whole move; `fault` fails one step; `unreadable` makes the
    /// journal unreadable from that step on. Returns the end action and
    /// the world after settling.
    fn run(
        disks: bool,
        postcopy: bool,
        fault: Option<Fault>,
        unreadable: Option<Step>,
    ) -> (Action, World, Vec<Step>) {
        let mut w = World::new();
        let mut s = State::new();
        let mut a = FIRST;
        let mut steps = Vec::new();
        for _ in 0..100 {
            let Action::Do(step) = a else {
                break;
            };
            steps.push(step);
            let outcome = match fault {
                Some(f) if f.step == step => {
                    if f.after_effect {
                        w.effect(step, (disks, postcopy));
                    }
                    if unreadable == Some(step) {
                        w.journal = Journal::Unreadable;
                    }
                    w.break_stream(step);
                    Outcome::Failed(w.on_disk())
                }
                _ => w.effect(step, (disks, postcopy)),
            };
            (s, a) = next(s, outcome);
        }
        match a {
            Action::Do(_) => panic!("the move never ended: {steps:?}"),
            Action::Fail => {
                assert!(w.runs_source(), "{w:?}");
                assert!(matches!(w.tgt, Tgt::None), "{w:?}");
            }
            Action::RollBack { mirrored } => {
                assert_eq!(
                    mirrored,
                    w.mirror.is_some() && steps.contains(&Step::Connect)
                );
                w.roll_back();
            }
            Action::AfterCommit { .. } => w.settle(),
            Action::Report { .. } => {}
        }
        (a, w, steps)
    }

    const ALL: [Step; 17] = [
        Step::Establish,
        Step::Plan,
        Step::Record,
        Step::Skeleton,
        Step::Disks,
        Step::Connect,
        Step::Stream,
        Step::Copy,
        Step::PostcopyCheck,
        Step::PostcopyCommit,
        Step::PostcopyStart,
        Step::Postcopy,
        Step::Tick,
        Step::Ready,
        Step::Commit,
        Step::Run,
        Step::Cleanup,
    ];

    #[test]
    fn whole_moves_run_every_step_in_order_and_report() {
        let (a, w, steps) = run(false, false, None, None);
        assert_eq!(a, Action::Report { mirrored: false });
        assert_eq!(
            steps,
            [
                Step::Establish,
                Step::Plan,
                Step::Record,
                Step::Skeleton,
                Step::Connect,
                Step::Stream,
                Step::Copy,
                Step::Tick,
                Step::Ready,
                Step::Commit,
                Step::Run,
                Step::Cleanup
            ]
        );
        assert_eq!((w.src, w.tgt), (Src::Quit, Tgt::Running { whole: true }));
        let (a, _, steps) = run(true, true, None, None);
        assert_eq!(a, Action::Report { mirrored: true });
        assert!(steps.contains(&Step::Disks));
        // post-copy: committed before QEMU switches, no READY, no second commit
        let pc: Vec<Step> = steps
            .iter()
            .copied()
            .skip_while(|s| *s != Step::Copy)
            .collect();
        assert_eq!(
            pc,
            [
                Step::Copy,
                Step::PostcopyCheck,
                Step::PostcopyCommit,
                Step::PostcopyStart,
                Step::Postcopy,
                Step::Tick,
                Step::Run,
                Step::Cleanup
            ]
        );
    }

    #[test]
    fn a_failure_at_every_step_leaves_one_copy_running_or_in_doubt_never_two() {
        let mut seen = std::collections::BTreeSet::new();
        for disks in [false, true] {
            for postcopy in [false, true] {
                for step in ALL {
                    for after_effect in [false, true] {
                        let fault = Some(Fault { step, after_effect });
                        let (a, w, steps) = run(disks, postcopy, fault, None);
                        if !steps.contains(&step) {
                            continue;
                        }
                        seen.insert(step);
                        let what = format!(
                            "disks {disks}, post-copy {postcopy}, {step:?} fails {}",
                            if after_effect { "after" } else { "before" }
                        );
                        w.check(&what);
                        // before the commit record, a failure gives the guest
                        // back to the source
                        if !matches!(w.journal, Journal::Committed | Journal::Done)
                            && !matches!(a, Action::Report { .. })
                        {
                            assert!(w.runs_source(), "{what}: {w:?}");
                        }
                        // a failure after the commit never rolls back
                        if steps.contains(&Step::PostcopyStart) && step >= Step::PostcopyStart
                            || step >= Step::Run
                        {
                            assert!(!matches!(a, Action::RollBack { .. }), "{what}: {a:?}");
                        }
                    }
                }
            }
        }
        assert_eq!(
            seen.len(),
            ALL.len(),
            "every step was failed once: {seen:?}"
        );
    }

    #[test]
    fn an_unreadable_journal_is_no_answer_never_a_rollback() {
        for postcopy in [false, true] {
            for step in ALL {
                let (a, w, steps) = run(
                    false,
                    postcopy,
                    Some(Fault {
                        step,
                        after_effect: true,
                    }),
                    Some(step),
                );
                if !steps.contains(&step) {
                    continue;
                }
                w.check(&format!("{step:?} unreadable"));
                if step > Step::Record {
                    assert!(
                        matches!(a, Action::AfterCommit { .. }),
                        "{step:?}: an unreadable record rolled back: {a:?}"
                    );
                    // nobody resumed the source on a record nobody could read
                    // once the target may hold the guest
                    if !matches!(w.tgt, Tgt::None | Tgt::Skeleton { loaded: false }) {
                        assert!(!w.runs_source(), "{step:?}: {w:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_refused_switch_to_post_copy_discards_the_target_and_the_source_runs_on() {
        let (a, w, _) = run(
            false,
            true,
            Some(Fault {
                step: Step::PostcopyStart,
                after_effect: false,
            }),
            None,
        );
        // QEMU's pre-copy was still running: the settler cancels it first
        assert_eq!(a, Action::AfterCommit { mirrored: false });
        assert_eq!(
            (w.src, w.tgt, w.journal),
            (Src::Running, Tgt::Discarded, Journal::Aborted)
        );
    }

    #[test]
    fn a_broken_post_copy_is_recovered_and_the_source_stopped_only_after() {
        let (a, w, _) = run(
            false,
            true,
            Some(Fault {
                step: Step::Postcopy,
                after_effect: false,
            }),
            None,
        );
        assert_eq!(a, Action::AfterCommit { mirrored: false });
        assert_eq!(
            (w.src, w.tgt, w.journal),
            (Src::Quit, Tgt::Running { whole: true }, Journal::Done)
        );
    }

    #[test]
    fn an_ended_move_takes_no_more_steps() {
        let mut s = State::new();
        (s, _) = next(s, Outcome::Done);
        let (s, a) = next(s, Outcome::Failed(OnDisk::Nothing));
        assert_eq!(a, Action::Fail);
        let (_, again) = next(s, Outcome::Done);
        assert!(!matches!(again, Action::Do(_)), "{again:?}");
    }

    #[test]
    fn an_outcome_a_step_cannot_have_ends_the_move_as_the_journal_would_not_say() {
        let s = State {
            at: Step::Ready,
            ..State::new()
        };
        let (_, a) = next(s, Outcome::PostcopyWanted);
        assert_eq!(a, Action::AfterCommit { mirrored: false });
    }
}
