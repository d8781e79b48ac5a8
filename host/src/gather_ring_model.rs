//! A CPU model of the gathering producer's stage ring (`kernels/src/gemm/gather.rs`), run over
//! random tile lists and interleavings: the producer warp's lanes, the consumer warps, the
//! mbarriers with their phase parities, and the asynchronous copies as events that land at any
//! later moment. It checks what the kernel relies on and cannot be run here: no copy is issued
//! into a stage before the consumers released its previous use, no consumer passes a `full`
//! wait before every copy of that use has landed, and the walk completes. It also shows the
//! model can fail: a walk in which only lane 0 waits at copy-less stages (empty-group weight
//! gradients, the final `NO_TILE`) lets the other lanes run a ring ahead, where an `empty` wait
//! passes on a parity two phases back; and a walk whose lanes all wait there but do not meet
//! lets lane 0 run two rounds ahead of a slow lane, whose wait then never passes (the model
//! found that one: the kernel's copy-less stages end with a warp barrier).

/// Deterministic xorshift for the walks and the interleavings.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

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

/// What lands asynchronously: a lane's copies of use `u` (then its tracked arrival), or lane
/// 0's TMA copy of use `u` (its transaction bytes).
#[derive(Clone, Copy, Debug)]
enum Landing {
    Copies { u: usize },
    Tma { u: usize },
}

/// Where a producer lane stands in a use (a stage of the walk).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    WaitEmpty,
    Issue,
    WarpSync,
    Arrive,
    Done,
}

struct Model {
    stages: usize,
    lanes: usize,
    consumers: usize,
    /// Per use of the walk: whether it carries copies.
    copies: Vec<bool>,
    full: Vec<Barrier>,
    empty: Vec<Barrier>,
    /// Per lane: the use it is at and its step in it.
    lane_at: Vec<(usize, Step)>,
    /// Per consumer: the use it is at, and whether it is reading it.
    consumer_at: Vec<(usize, bool)>,
    in_flight: Vec<Landing>,
    /// Per use: copies landed (lanes plus the TMA).
    landed: Vec<usize>,
    /// What the lanes do at a copy-less stage.
    copyless: Copyless,
}

/// The lanes at a copy-less stage (lane 0 names the tile and arrives in each).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Copyless {
    /// Every lane waits for the stage, then the warp meets (the kernel).
    WaitThenMeet,
    /// Every lane waits, without meeting (faulty: lane 0 can run two rounds ahead of a lane).
    Wait,
    /// Lane 0 alone waits (faulty: the others can run a ring ahead).
    Lane0Only,
}

/// A broken property, named.
type Broken = String;

impl Model {
    fn new(copies: Vec<bool>, (stages, lanes, consumers): (usize, usize, usize), copyless: Copyless) -> Self {
        let uses = copies.len();
        Model {
            stages,
            lanes,
            consumers,
            copies,
            full: vec![Barrier::new(1); stages],
            empty: vec![Barrier::new(consumers as i32); stages],
            lane_at: vec![(0, Step::WaitEmpty); lanes],
            consumer_at: vec![(0, false); consumers],
            in_flight: Vec::new(),
            landed: vec![0; uses],
            copyless,
        }
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
        let copies = self.copies[u];
        let next = |step| (u, step);
        match step {
            Step::WaitEmpty => {
                if !copies && l != 0 && self.copyless == Copyless::Lane0Only {
                    self.lane_at[l] = (u + 1, Step::WaitEmpty);
                    return Ok(true);
                }
                // The producer's phase is the round's parity; it waits for parity phase ^ 1.
                if !self.empty[s].passed((round & 1) ^ 1) {
                    return Ok(false);
                }
                self.lane_at[l] = next(match (copies, self.copyless) {
                    (true, _) => Step::Issue,
                    // The kernel: the warp meets after the wait, then lane 0 names and arrives.
                    (false, Copyless::WaitThenMeet) => Step::WarpSync,
                    // Faulty: straight on (lane 0 to its arrival).
                    (false, _) if l == 0 => Step::Arrive,
                    (false, _) => Step::Done,
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
                // `cp.async.mbarrier.arrive` (counted): one more pending arrival now.
                self.full[s].pending += 1;
                self.in_flight.push(Landing::Copies { u });
                self.lane_at[l] = next(Step::WarpSync);
            }
            Step::WarpSync => {
                // `bar.warp.sync`: every lane at this use's barrier (or past it: a faulty walk's
                // lanes may be).
                let all_here =
                    self.lane_at.iter().all(|&(v, st)| v > u || (v == u && st != Step::WaitEmpty && st != Step::Issue));
                if !all_here {
                    return Ok(false);
                }
                self.lane_at[l] = next(if l == 0 { Step::Arrive } else { Step::Done });
            }
            Step::Arrive => {
                // Lane 0's one expected arrival (after naming the tile in a copy-less stage).
                self.full[s].arrive();
                self.lane_at[l] = next(Step::Done);
            }
            Step::Done => self.lane_at[l] = (u + 1, Step::WaitEmpty),
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
        let want = if self.copies[u] { self.lanes + 1 } else { 0 };
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
                // The tracked arrival, once the lane's copies landed.
                self.full[u % self.stages].arrive();
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

/// A random walk: tiles of 1–4 K blocks and runs of empty-group tiles (copy-less stages), then
/// the final `NO_TILE`.
fn random_walk(rng: &mut Rng) -> Vec<bool> {
    let mut copies = Vec::new();
    for _ in 0..1 + rng.below(12) {
        if rng.below(3) == 0 {
            copies.extend(std::iter::repeat_n(false, 1 + rng.below(9)));
        } else {
            copies.extend(std::iter::repeat_n(true, 1 + rng.below(4)));
        }
    }
    copies.push(false);
    copies
}

#[test]
fn the_gathering_ring_keeps_every_stage_in_order() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut faulty_broke = [0, 0];
    for case in 0..3000 {
        let walk = random_walk(&mut rng);
        // 3 or 4 stages (the standalone weight gradient's ring, the others'), 2–4 lanes (the
        // kernel's 32 behave alike), 1–3 consumer warps.
        let shape = (3 + rng.below(2), 2 + rng.below(3), 1 + rng.below(3));
        let seed = rng.0;
        let mut kernel = Model::new(walk.clone(), shape, Copyless::WaitThenMeet);
        if let Err(broken) = kernel.run(&mut rng) {
            panic!("case {case} {shape:?} walk {walk:?}: {broken}");
        }
        for (n, copyless) in [Copyless::Wait, Copyless::Lane0Only].into_iter().enumerate() {
            let mut faulty = Model::new(walk.clone(), shape, copyless);
            faulty_broke[n] += faulty.run(&mut Rng(seed | 1)).is_err() as usize;
        }
    }
    // The model can fail: lanes that do not meet at copy-less stages, or skip their wait,
    // break it.
    println!(
        "faulty walks broken (of 3000): lanes waiting without meeting {}, lane 0 alone {}",
        faulty_broke[0], faulty_broke[1]
    );
    assert!(faulty_broke.iter().all(|&n| n > 0), "a faulty walk never broke the model: {faulty_broke:?}");
}
