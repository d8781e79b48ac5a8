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
//! final `NO_TILE`. A stage's `full` barrier expects one arrival per lane and lane 0's: each
//! lane's copies make its arrival when they land (`cp.async.mbarrier.arrive.noinc`), lane 0
//! arrives after issuing its TMA copy, and a stage lane 0 produces alone (a TMA phase's, one
//! without copies) gets all the arrivals from lane 0 at once. It checks what the kernel relies
//! on and cannot be run here: no copy is issued into a stage before the consumers released its
//! previous use, nor while a copy of that use is in flight (a thread never writes over its own
//! copies before they land: the order runs through the `full` barrier and the consumers'
//! release, which compute-sanitizer's racecheck does not follow), no consumer passes a `full`
//! wait before every copy of that use has landed, and the walk completes.
//!
//! With several gathering warps (half the walks) lane 0 also hands each tile to the others
//! through a shared word and a named barrier: the model checks that no thread reads another
//! tile than its use's and that lane 0 never overwrites the word before every thread read it.
//!
//! It also shows the model can fail, on six weaker walks:
//! - only lane 0 waits at copy-less stages: the other lanes run a ring ahead, where an `empty`
//!   wait passes on a parity two phases back;
//! - every lane waits there but the warp does not meet: lane 0 runs two rounds ahead of a slow
//!   lane, whose wait then never passes (the model found this one; the kernel's copy-less
//!   stages end with the threads meeting);
//! - the threads do not meet where a gathering phase starts;
//! - the threads read the hand-out word without meeting after lane 0's write;
//! - the threads do not meet after reading it (lane 0 then overwrites it before a slow thread
//!   read it: a tile's stages end without a meeting);
//! - the copies are not bound to the barrier (it expects lane 0's arrival alone).

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

    fn arrive(&mut self, count: i32) {
        self.pending -= count;
        assert!(self.pending >= 0, "more arrivals than a phase expects");
        self.settle();
    }

    fn complete_tx(&mut self, bytes: i32) {
        self.tx -= bytes;
        self.settle();
    }
}

/// What lands asynchronously: a lane's copies of use `u` (then its arrival), or lane 0's TMA
/// copy of use `u` (its transaction bytes).
#[derive(Clone, Copy, Debug)]
enum Landing {
    Copies { u: usize },
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
    WaitEmpty,
    Issue,
    /// A stage without copies in a gathering phase: the lanes meet before lane 0 names it.
    StageMeet,
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
    /// The arrivals each `full` phase expects.
    full_arrivals: i32,
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
    /// Faulty: the copies' landing makes no arrival, and `full` expects lane 0's alone.
    CopiesUnbound,
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
        let full_arrivals = if walking == Walking::CopiesUnbound { 1 } else { 1 + lanes as i32 };
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
            full: vec![Barrier::new(full_arrivals); stages],
            empty: vec![Barrier::new(consumers as i32); stages],
            lane_at: vec![(0, Step::WaitEmpty); lanes],
            consumer_at: vec![(0, false); consumers],
            in_flight: Vec::new(),
            landed: vec![0; uses],
            walking,
            full_arrivals,
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
            Step::WaitEmpty
        }
    }

    /// Whether every lane is at use `u`'s meeting `step` or past it (a faulty walk's lanes may
    /// be past it without having met).
    fn all_at(&self, u: usize, step: Step) -> bool {
        self.lane_at.iter().all(|&(v, st)| v > u || (v == u && st.order() >= step.order()))
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
                // Every copy of the stage's previous use has landed (through `full` and the
                // consumers' release; racecheck reports the rewrite, not seeing that order).
                let previous = u.checked_sub(self.stages);
                if self
                    .in_flight
                    .iter()
                    .any(|&landing| matches!(landing, Landing::Copies { u: v } if Some(v) == previous))
                {
                    return Err(format!(
                        "lane {l} copies use {u} into stage {s} with copies of its previous use in flight"
                    ));
                }
                if l == 0 {
                    self.full[s].tx += 1;
                    self.in_flight.push(Landing::Tma { u });
                }
                // The copies, bound to the stage's `full` phase (`.noinc`: their landing is one of
                // the arrivals it expects); then lane 0's own arrival, no meeting.
                self.in_flight.push(Landing::Copies { u });
                self.lane_at[l] = next(if l == 0 { Step::Arrive } else { Step::Done });
            }
            Step::StageMeet => {
                // A copy-less stage's meeting (named barrier 3), then lane 0 names it.
                if !self.all_at(u, Step::StageMeet) {
                    return Ok(false);
                }
                self.lane_at[l] = next(if l == 0 { Step::Arrive } else { Step::Done });
            }
            Step::Arrive => {
                // Lane 0's arrival: its own after a gathered stage's copies; all the phase expects
                // where it produces the stage alone (a TMA phase's, after naming a copy-less one).
                let count = if gathered && copies { 1 } else { self.full_arrivals };
                self.full[s].arrive(count);
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
            self.empty[s].arrive(1);
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
            Landing::Copies { u } => {
                self.landed[u] += 1;
                // The lane's arrival, made once its copies landed.
                if self.walking != Walking::CopiesUnbound {
                    self.full[u % self.stages].arrive(1);
                }
            }
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
    let mut faulty_broke = [0; 6];
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
            Walking::CopiesUnbound,
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
    // after its write or without meeting after the read, or leave the copies unbound to the
    // barrier, break it.
    println!(
        "faulty walks broken (of 3000): lanes waiting without meeting {}, lane 0 alone {}, no meeting at a phase {}, \
         hand-out read without meeting {}, no meeting after the read {}, copies unbound {}",
        faulty_broke[0], faulty_broke[1], faulty_broke[2], faulty_broke[3], faulty_broke[4], faulty_broke[5]
    );
    assert!(faulty_broke.iter().all(|&n| n > 0), "a faulty walk never broke the model: {faulty_broke:?}");
}
