//! A CPU model of the gathering producer's stage ring (`kernels/src/gemm/gather.rs`), run over
//! random walks and interleavings: the gathering threads (called lanes here: the producer
//! warpgroup's four warps, which meet at named barrier 3; half the walks also leave out the
//! tile hand-out word, a weaker protocol the kernel does not use, kept as a wider search of the
//! stage walk), the consumer warps, the mbarriers
//! with their phase parities, and the asynchronous copies as events that land at any later
//! moment. A walk is a persistent kernel's: phases that lane 0 produces alone with TMA (the
//! data gradients, the downs, the shared expert's) while the other lanes wait to be told where
//! the walk stands (`share_walk`: the threads meet), and gathering phases all of them
//! produce, with runs of copy-less stages (empty-group weight gradients) and each phase's
//! final `NO_TILE`. Each lane waits for its own copies of a stage (`cp.async.wait_group`) a
//! fixed lag of stages after issuing them (the ring's stages less 2), the lanes meet, and lane 0
//! publishes that stage (its `full` arrival); a stage without copies first publishes every
//! stage still unpublished. It checks what the kernel relies on and cannot be run here: no copy
//! is issued into a stage before the consumers released its previous use, no consumer passes a
//! `full` wait before every copy of that use has landed, and the walk completes.
//!
//! With several gathering warps (half the walks) lane 0 also hands each tile to the others
//! through a shared word and a named barrier: the model checks that no thread reads another
//! tile than its use's and that lane 0 never overwrites the word before every thread read it.
//!
//! It also shows the model can fail, on seven weaker walks:
//! - only lane 0 waits at copy-less stages: the other lanes run a ring ahead, where an `empty`
//!   wait passes on a parity two phases back;
//! - every lane waits there but the warp does not meet: lane 0 runs two rounds ahead of a slow
//!   lane, whose wait then never passes (the model found this one; the kernel's copy-less
//!   stages end with the threads meeting);
//! - the threads do not meet where a gathering phase starts;
//! - the threads read the hand-out word without meeting after lane 0's write;
//! - the threads do not meet after reading it (lane 0 then overwrites it before a slow thread
//!   read it, where a tile's stages end without a meeting);
//! - lane 0 publishes a stage without the lanes waiting for their copies of it;
//! - the lag is the ring's stages: a lane then waits for a stage whose release needs one of the
//!   stages it has not yet published.

// Deterministic xorshift for the walks and the interleavings (the work-order model's).
use crate::megakernel::work_order_model::Rng;

/// An mbarrier: completed phases, the arrivals still pending in the current one, the
/// transaction count, and the arrivals each phase expects.
#[derive(Clone, Copy, Debug)]
struct Barrier {
    completed: u32,
    pending: i32,
    tx: i32,
    expected: i32,
}

impl Barrier {
    fn new(expected: i32) -> Self {
        Barrier { completed: 0, pending: expected, tx: 0, expected }
    }

    /// `mbarrier.try_wait.parity`: whether the phase of parity `parity` has completed, as the
    /// hardware answers it (from the current phase's parity alone).
    fn passed(&self, parity: u32) -> bool {
        self.completed % 2 != parity
    }

    fn settle(&mut self) {
        if self.pending == 0 && self.tx == 0 {
            self.completed += 1;
            self.pending = self.expected;
        }
    }

    fn arrive(&mut self) {
        self.pending -= 1;
        assert!(self.pending >= 0, "more arrivals than a phase expects");
        self.settle();
    }

    fn complete_tx(&mut self, bytes: i32) {
        self.tx -= bytes;
        self.settle();
    }
}

/// What lands asynchronously: lane `lane`'s copies of use `u`, or lane 0's TMA copy of use `u`
/// (its transaction bytes).
#[derive(Clone, Copy, Debug)]
enum Landing {
    Copies { u: usize, lane: usize },
    Tma { u: usize },
}

/// Where a producer lane stands in a use (a stage of the walk).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    /// The warp meets at the start of a gathering phase (lane 0's walk broadcast).
    Meet,
    /// The gathering warps: lane 0 writes the tile it took into the shared hand-out word,
    /// the lanes meet, each reads it, and they meet again (at every tile's first use; the tile
    /// is its first use).
    HandOut,
    HandOutMeet,
    HandOutRead,
    /// The lanes meet again once each read the word, before lane 0 can write the next tile.
    HandOutReadMeet,
    /// Before a stage without copies: each lane waits for all its copies, the lanes meet, and
    /// lane 0 publishes every unpublished stage (skipped when none is).
    Flush,
    FlushMeet,
    FlushPublish,
    WaitEmpty,
    Issue,
    /// After issuing a stage's copies with `lag` stages unpublished: the lane waits for its
    /// copies of the stage `lag` back, the lanes meet, lane 0 publishes that stage.
    WaitCopies,
    StageMeet,
    Publish,
    Arrive,
    Done,
}

impl Step {
    /// The step's place in a use: a meeting holds a lane until every lane is at it or past it.
    fn order(self) -> u8 {
        self as u8
    }
}

struct Model {
    stages: usize,
    lanes: usize,
    consumers: usize,
    /// Per use of the walk: whether it carries copies (a tile's K block, not a copy-less stage).
    copies: Vec<bool>,
    /// Per use: whether the whole warp produces it (a gathering phase) or lane 0 alone (TMA).
    gathered: Vec<bool>,
    /// Per use: whether a gathering phase starts there (the threads meet).
    meets: Vec<bool>,
    /// Per use: whether a tile starts there (in a gathering phase with several warps, lane 0
    /// hands it out).
    tile_starts: Vec<bool>,
    /// Whether tiles are handed out through the shared word (several gathering warps).
    hand_out: bool,
    /// The hand-out word (the use of the tile last written) and the lanes yet to read it.
    handout_word: Option<usize>,
    unread: usize,
    full: Vec<Barrier>,
    empty: Vec<Barrier>,
    /// Per lane: the use it is at and its step in it.
    lane_at: Vec<(usize, Step)>,
    /// Per consumer: the use it is at, and whether it is reading it.
    consumer_at: Vec<(usize, bool)>,
    in_flight: Vec<Landing>,
    /// Per use: copies landed (lanes plus the TMA).
    landed: Vec<usize>,
    /// How the warp walks the ring together.
    walking: Walking,
    /// Stages after its copies' issue that a lane waits for them and the stage is published.
    lag: usize,
    /// Per lane: the stages right before its current one whose copies it has not waited for.
    unpublished: Vec<usize>,
}

/// How the producer warp walks the ring together (lane 0 names the tile and arrives in each
/// copy-less stage).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Walking {
    /// The kernel's: every lane waits for a copy-less stage, then the threads meet; they meet
    /// where a gathering phase starts too.
    Kernel,
    /// Faulty: every lane waits for a copy-less stage without meeting (lane 0 can run two
    /// rounds ahead of a lane).
    CopylessWithoutMeeting,
    /// Faulty: lane 0 alone waits for a copy-less stage (the others can run a ring ahead).
    CopylessLane0Alone,
    /// Faulty: no meeting where a gathering phase starts (the other lanes start it while lane 0
    /// still produces the phases before).
    PhaseWithoutMeeting,
    /// Faulty: the threads read the hand-out word without meeting after lane 0's write.
    HandOutWithoutMeeting,
    /// Faulty: the threads do not meet after reading the hand-out word (lane 0 can write the
    /// next tile before a slow thread read this one, when the tile's stages end without a
    /// meeting).
    HandOutWithoutSecondMeeting,
    /// Faulty: lane 0 publishes stages without any lane waiting for its copies.
    PublishWithoutWaiting,
    /// Faulty: the lag is the ring's stages, not 2 less.
    LagOfTheRing,
}

/// A broken property, named.
type Broken = String;

impl Model {
    fn new(
        Walk { copies, gathered, meets, tile_starts }: Walk,
        (stages, lanes, consumers, hand_out): (usize, usize, usize, bool),
        walking: Walking,
    ) -> Self {
        let uses = copies.len();
        let mut model = Model {
            stages,
            lanes,
            consumers,
            copies,
            gathered,
            meets,
            tile_starts,
            hand_out,
            handout_word: None,
            unread: 0,
            full: vec![Barrier::new(1); stages],
            empty: vec![Barrier::new(consumers as i32); stages],
            lane_at: vec![(0, Step::WaitEmpty); lanes],
            consumer_at: vec![(0, false); consumers],
            in_flight: Vec::new(),
            landed: vec![0; uses],
            walking,
            lag: if walking == Walking::LagOfTheRing { stages } else { stages - 2 },
            unpublished: vec![0; lanes],
        };
        for l in 0..lanes {
            model.lane_at[l] = model.entry(l, 0);
        }
        model
    }

    /// Where lane `l` enters the walk at use `u`: lane 0 everywhere; the others only in
    /// gathering phases (from a lane-0 phase they go to the next gathering use, or the end),
    /// meeting the warp at a gathering phase's first use.
    fn entry(&self, l: usize, u: usize) -> (usize, Step) {
        let uses = self.copies.len();
        let v = if l == 0 { u } else { (u..uses).find(|&v| self.gathered[v]).unwrap_or(uses) };
        (v, if v < uses && self.meets[v] { Step::Meet } else { self.after_meet(v) })
    }

    /// A lane's first step in use `u` after any phase meeting: the tile hand-out where a tile
    /// starts in a gathering phase with several warps, else the stage's own.
    fn after_meet(&self, u: usize) -> Step {
        if u < self.copies.len() && self.hand_out && self.gathered[u] && self.tile_starts[u] {
            Step::HandOut
        } else {
            self.stage_entry(u)
        }
    }

    /// The first step of use `u`'s stage: a gathered stage without copies publishes the
    /// unpublished stages first; any other waits for the stage to be free.
    fn stage_entry(&self, u: usize) -> Step {
        if u < self.copies.len() && self.gathered[u] && !self.copies[u] { Step::Flush } else { Step::WaitEmpty }
    }

    /// Whether every lane is at use `u`'s meeting `step` or past it (a faulty walk's lanes may
    /// be past it without having met).
    fn all_at(&self, u: usize, step: Step) -> bool {
        self.lane_at.iter().all(|&(v, st)| v > u || (v == u && st.order() >= step.order()))
    }

    /// Whether lane `l` still has copies in flight of a use at or before `u`.
    fn copies_in_flight(&self, l: usize, u: usize) -> bool {
        self.in_flight.iter().any(|landing| matches!(*landing, Landing::Copies { u: v, lane } if lane == l && v <= u))
    }

    fn stage_round(&self, u: usize) -> (usize, u32) {
        (u % self.stages, (u / self.stages) as u32)
    }

    /// Lane `l`'s next action, if it can take one now; `Err` when a property breaks.
    fn step_lane(&mut self, l: usize) -> Result<bool, Broken> {
        let (u, step) = self.lane_at[l];
        if u >= self.copies.len() {
            return Ok(false);
        }
        let (s, round) = self.stage_round(u);
        let (copies, gathered) = (self.copies[u], self.gathered[u]);
        let next = |step| (u, step);
        match step {
            Step::Meet => {
                // Every lane at this use (`share_walk`'s named barrier).
                if self.walking != Walking::PhaseWithoutMeeting && !self.lane_at.iter().all(|&(v, _)| v >= u) {
                    return Ok(false);
                }
                self.lane_at[l] = next(self.after_meet(u));
            }
            Step::HandOut => {
                if l == 0 {
                    // The write: every lane must have read the tile before it.
                    if self.unread > 0 {
                        return Err(format!("lane 0 hands out use {u}'s tile with {} lanes yet to read", self.unread));
                    }
                    self.handout_word = Some(u);
                    self.unread = self.lanes;
                }
                self.lane_at[l] = next(Step::HandOutMeet);
            }
            Step::HandOutMeet => {
                // `bar.sync`: every lane at this use's meeting or past it.
                if self.walking != Walking::HandOutWithoutMeeting && !self.all_at(u, Step::HandOutMeet) {
                    return Ok(false);
                }
                self.lane_at[l] = next(Step::HandOutRead);
            }
            Step::HandOutRead => {
                if self.handout_word != Some(u) {
                    return Err(format!("lane {l} reads tile {:?} for use {u}", self.handout_word));
                }
                self.unread -= 1;
                self.lane_at[l] = next(Step::HandOutReadMeet);
            }
            Step::HandOutReadMeet => {
                if self.walking != Walking::HandOutWithoutSecondMeeting && !self.all_at(u, Step::HandOutReadMeet) {
                    return Ok(false);
                }
                self.lane_at[l] = next(self.stage_entry(u));
            }
            Step::Flush => {
                if self.walking != Walking::PublishWithoutWaiting && self.copies_in_flight(l, u) {
                    return Ok(false);
                }
                self.lane_at[l] = next(if self.unpublished[l] > 0 { Step::FlushMeet } else { Step::WaitEmpty });
            }
            Step::FlushMeet => {
                if !self.all_at(u, Step::FlushMeet) {
                    return Ok(false);
                }
                if l == 0 {
                    self.lane_at[l] = next(Step::FlushPublish);
                } else {
                    self.unpublished[l] = 0;
                    self.lane_at[l] = next(Step::WaitEmpty);
                }
            }
            Step::FlushPublish => {
                // The kernel's `stage_back`: the `unpublished` stages right before this one.
                for back in 1..=self.unpublished[0] {
                    self.full[(u - back) % self.stages].arrive();
                }
                self.unpublished[0] = 0;
                self.lane_at[l] = next(Step::WaitEmpty);
            }
            Step::WaitEmpty if !gathered => {
                // Lane 0 alone (a TMA phase): the stage, then its copy or its naming arrival.
                if !self.empty[s].passed((round & 1) ^ 1) {
                    return Ok(false);
                }
                self.lane_at[l] = next(if copies { Step::Issue } else { Step::Arrive });
            }
            Step::Issue if !gathered => {
                if self.empty[s].completed < round {
                    return Err(format!("lane 0 loads use {u} into stage {s} before its earlier uses were released"));
                }
                self.full[s].tx += 1;
                self.in_flight.push(Landing::Tma { u });
                self.lane_at[l] = next(Step::Arrive);
            }
            Step::WaitEmpty => {
                if !copies && l != 0 && self.walking == Walking::CopylessLane0Alone {
                    self.lane_at[l] = self.entry(l, u + 1);
                    return Ok(true);
                }
                // The producer's phase is the round's parity; it waits for parity phase ^ 1.
                if !self.empty[s].passed((round & 1) ^ 1) {
                    return Ok(false);
                }
                self.lane_at[l] = next(match (copies, self.walking) {
                    (true, _) => Step::Issue,
                    // Faulty: straight on (lane 0 to its arrival).
                    (false, Walking::CopylessWithoutMeeting | Walking::CopylessLane0Alone) if l == 0 => Step::Arrive,
                    (false, Walking::CopylessWithoutMeeting | Walking::CopylessLane0Alone) => Step::Done,
                    // The kernel: the threads meet after the wait, then lane 0 names and arrives.
                    (false, _) => Step::StageMeet,
                });
            }
            Step::Issue => {
                // A write into the stage: its previous use must be released by every consumer.
                if self.empty[s].completed < round {
                    return Err(format!(
                        "lane {l} copies use {u} into stage {s} with {} of its {round} earlier uses released",
                        self.empty[s].completed
                    ));
                }
                if l == 0 {
                    self.full[s].tx += 1;
                    self.in_flight.push(Landing::Tma { u });
                }
                // The copies, committed as one group.
                self.in_flight.push(Landing::Copies { u, lane: l });
                if self.unpublished[l] < self.lag {
                    self.unpublished[l] += 1;
                    self.lane_at[l] = next(Step::Done);
                } else {
                    self.lane_at[l] = next(Step::WaitCopies);
                }
            }
            Step::WaitCopies => {
                // `cp.async.wait_group lag`: the copies of the stage `lag` back (and older).
                if self.walking != Walking::PublishWithoutWaiting && self.copies_in_flight(l, u - self.lag) {
                    return Ok(false);
                }
                self.lane_at[l] = next(Step::StageMeet);
            }
            Step::StageMeet => {
                // The threads' meeting at the stage's end (named barrier 3).
                if !self.all_at(u, Step::StageMeet) {
                    return Ok(false);
                }
                self.lane_at[l] = next(match (l, copies) {
                    (0, true) => Step::Publish,
                    (0, false) => Step::Arrive,
                    _ => Step::Done,
                });
            }
            Step::Publish => {
                // Lane 0 publishes the stage `lag` back (`stage_back`).
                self.full[(u - self.lag) % self.stages].arrive();
                self.lane_at[l] = next(Step::Done);
            }
            Step::Arrive => {
                // Lane 0's one expected arrival (after naming the tile in a copy-less stage).
                self.full[s].arrive();
                self.lane_at[l] = next(Step::Done);
            }
            Step::Done => self.lane_at[l] = self.entry(l, u + 1),
        }
        Ok(true)
    }

    /// Consumer `c`'s next action.
    fn step_consumer(&mut self, c: usize) -> Result<bool, Broken> {
        let (u, reading) = self.consumer_at[c];
        if u >= self.copies.len() {
            return Ok(false);
        }
        let (s, round) = self.stage_round(u);
        if reading {
            // Done reading: release the stage (one arrival per consumer warp).
            self.empty[s].arrive();
            self.consumer_at[c] = (u + 1, false);
            return Ok(true);
        }
        if !self.full[s].passed(round & 1) {
            return Ok(false);
        }
        let want = match (self.copies[u], self.gathered[u]) {
            (false, _) => 0,
            (true, true) => self.lanes + 1,
            (true, false) => 1,
        };
        if self.landed[u] != want {
            return Err(format!("consumer {c} reads use {u} with {} of its {want} copies landed", self.landed[u]));
        }
        self.consumer_at[c] = (u, true);
        Ok(true)
    }

    fn land(&mut self, i: usize) {
        let landing = self.in_flight.swap_remove(i);
        match landing {
            Landing::Tma { u } => {
                self.landed[u] += 1;
                self.full[u % self.stages].complete_tx(1);
            }
            Landing::Copies { u, .. } => self.landed[u] += 1,
        }
    }

    /// Runs to the end with random choices: `Ok` when every agent finished, `Err` when a
    /// property broke or nothing could move.
    fn run(&mut self, rng: &mut Rng) -> Result<(), Broken> {
        loop {
            let agents = self.lanes + self.consumers + self.in_flight.len();
            let done = self.lane_at.iter().all(|&(u, _)| u >= self.copies.len())
                && self.consumer_at.iter().all(|&(u, _)| u >= self.copies.len())
                && self.in_flight.is_empty();
            if done {
                return Ok(());
            }
            // Try the agents from a random one on until one moves.
            let start = rng.below(agents);
            let mut moved = false;
            for k in 0..agents {
                let a = (start + k) % agents;
                moved = if a < self.lanes {
                    self.step_lane(a)?
                } else if a < self.lanes + self.consumers {
                    self.step_consumer(a - self.lanes)?
                } else {
                    self.land(a - self.lanes - self.consumers);
                    true
                };
                if moved {
                    break;
                }
            }
            if !moved {
                return Err(format!("stuck: lanes {:?}, consumers {:?}", self.lane_at, self.consumer_at));
            }
        }
    }
}

/// A random walk of 1–4 phases, each gathering or lane 0's alone: tiles of 1–4 K blocks and
/// runs of empty-group tiles (copy-less stages), then the phase's final `NO_TILE`.
fn random_walk(rng: &mut Rng) -> Walk {
    let (mut copies, mut gathered, mut meets, mut tile_starts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..1 + rng.below(4) {
        let gathering = rng.below(2) == 0;
        let start = copies.len();
        for _ in 0..1 + rng.below(8) {
            if rng.below(3) == 0 {
                // Empty-group tiles: one copy-less use each.
                let run = 1 + rng.below(9);
                copies.extend(std::iter::repeat_n(false, run));
                tile_starts.extend(std::iter::repeat_n(true, run));
            } else {
                let k_blocks = 1 + rng.below(4);
                copies.extend(std::iter::repeat_n(true, k_blocks));
                tile_starts.extend((0..k_blocks).map(|k| k == 0));
            }
        }
        copies.push(false);
        tile_starts.push(true);
        gathered.extend(std::iter::repeat_n(gathering, copies.len() - start));
        meets.extend((start..copies.len()).map(|u| gathering && u == start));
    }
    Walk { copies, gathered, meets, tile_starts }
}

/// A producer's walk over its phases, per use (a stage of the ring in walk order).
#[derive(Clone, Debug)]
struct Walk {
    /// Whether the use carries copies (a tile's K block) or none (an empty group, `NO_TILE`).
    copies: Vec<bool>,
    /// Whether the whole warp produces it (a gathering phase) or lane 0 alone (TMA).
    gathered: Vec<bool>,
    /// Whether a gathering phase starts at it (the threads meet).
    meets: Vec<bool>,
    /// Whether a tile starts at it (its first K block, an empty group's one stage, `NO_TILE`).
    tile_starts: Vec<bool>,
}

#[test]
fn the_gathering_ring_keeps_every_stage_in_order() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut faulty_broke = [0; 7];
    for case in 0..3000 {
        let walk = random_walk(&mut rng);
        // 3 or 4 stages (the standalone weight gradient's ring, the others'), 2–4 lanes (the
        // kernel's 32 or 128 behave alike), 1–3 consumer warps, tiles handed out through the
        // shared word (the kernel's) or not (a wider search of the stage walk alone).
        let shape = (3 + rng.below(2), 2 + rng.below(3), 1 + rng.below(3), rng.below(2) == 0);
        let seed = rng.0;
        let mut kernel = Model::new(walk.clone(), shape, Walking::Kernel);
        if let Err(broken) = kernel.run(&mut rng) {
            panic!("case {case} {shape:?} walk {walk:?}: {broken}");
        }
        for (n, walking) in [
            Walking::CopylessWithoutMeeting,
            Walking::CopylessLane0Alone,
            Walking::PhaseWithoutMeeting,
            Walking::HandOutWithoutMeeting,
            Walking::HandOutWithoutSecondMeeting,
            Walking::PublishWithoutWaiting,
            Walking::LagOfTheRing,
        ]
        .into_iter()
        .enumerate()
        {
            // The hand-out's faulty walk needs the hand-out.
            let shape = if matches!(walking, Walking::HandOutWithoutMeeting | Walking::HandOutWithoutSecondMeeting) {
                (shape.0, shape.1, shape.2, true)
            } else {
                shape
            };
            let mut faulty = Model::new(walk.clone(), shape, walking);
            faulty_broke[n] += faulty.run(&mut Rng(seed | 1)).is_err() as usize;
        }
    }
    // The model can fail: lanes that do not meet at copy-less stages, skip their wait there,
    // start a gathering phase without meeting lane 0, read the hand-out word without meeting
    // after its write or without meeting after the read, publish stages without waiting for
    // their copies, or wait a ring's stages before publishing, break it.
    println!(
        "faulty walks broken (of 3000): lanes waiting without meeting {}, lane 0 alone {}, no meeting at a phase {}, \
         hand-out read without meeting {}, no meeting after the read {}, publishing without waiting {}, \
         a lag of the ring {}",
        faulty_broke[0],
        faulty_broke[1],
        faulty_broke[2],
        faulty_broke[3],
        faulty_broke[4],
        faulty_broke[5],
        faulty_broke[6]
    );
    assert!(faulty_broke.iter().all(|&n| n > 0), "a faulty walk never broke the model: {faulty_broke:?}");
}
