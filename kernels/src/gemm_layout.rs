//! Layout arithmetic of the sm_90 tensor-core GEMM engine, shared by host and device: shared
//! memory matrix descriptors, the 128-byte swizzle, the engine's tile shape and its parameter
//! block.
//!
//! Shared-memory tiles are rows of 128 bytes (64 bf16) in the 128B-swizzle layout that TMA
//! writes and wgmma reads: the 16-byte chunk `c` of row `r` sits at chunk `c ^ (r % 8)`, with the
//! tile base 1024-byte aligned. A K-major tile has one row per M/N index (64 K values per row);
//! an MN-major tile has one row per K index (64 M/N values per row).

/// Rows of a block tile: two consumer warpgroups × 64.
pub const TILE_M: u32 = 128;
/// Columns of a block tile (one `m64n256` accumulator per consumer warpgroup). The SwiGLU tile
/// holds 128 gate and 128 up columns of 128 hidden columns.
pub const TILE_N: u32 = 256;
/// K depth of one pipeline stage: one 128-byte swizzle row of bf16.
pub const TILE_K: u32 = 64;
/// Bytes of a 64 × 64 bf16 block (64 rows of one 128-byte swizzle row): the unit TMA boxes and
/// M/N-major operands are laid out in.
pub const BLOCK_64_BYTES: u32 = 64 * TILE_K * 2;
/// Bytes of a stage's A tile (128 × 64 bf16).
pub const A_TILE_BYTES: u32 = TILE_M * TILE_K * 2;
/// Bytes of a stage's B tile (256 × 64 bf16).
pub const B_TILE_BYTES: u32 = TILE_N * TILE_K * 2;
/// Bytes of one stage (A and B tiles).
pub const STAGE_BYTES: u32 = A_TILE_BYTES + B_TILE_BYTES;
/// Threads of an engine block: a producer warpgroup and two consumer warpgroups.
pub const ENGINE_THREADS: u32 = 384;
/// Registers per thread the producer warpgroup keeps after `setmaxnreg.dec` ...
pub const PRODUCER_REGISTERS: u32 = 56;
/// ... and what each consumer warpgroup takes (`setmaxnreg.inc`): the 128 accumulators of an
/// `m64n256` tile plus addressing. The block starts with 65536 / 384 = 168 per thread (the
/// kernel is built with `.maxntid 384`), and 128 · 56 + 256 · 224 = 384 · 168. For the weight
/// gradient, which runs alone.
pub const CONSUMER_REGISTERS: u32 = 224;
/// The split of the variants that run in pairs: their producer finds its tile's group and
/// pair mode with more live values, and spilled with 56 (consumers keep 0 spills with 216).
pub const PAIRED_PRODUCER_REGISTERS: u32 = 64;
/// See [`PAIRED_PRODUCER_REGISTERS`].
pub const PAIRED_CONSUMER_REGISTERS: u32 = 216;
/// The producer warpgroup's registers in the megakernels' GEMM phases (with
/// [`PAIRED_CONSUMER_REGISTERS`] for the consumers: the whole pool): besides the producer
/// thread, its three spare warps move rows there (the forward's dispatch, the backward's
/// SwiGLU chunks), whose loads in flight need the registers.
pub const MEGAKERNEL_PRODUCER_REGISTERS: u32 = 72;
/// Which product an engine instance computes (the kernels' const generic).
pub struct Variant;

impl Variant {
    /// Forward gate/up with SwiGLU.
    pub const GATE_UP: u32 = 0;
    /// Row-grouped `A · Bᵀ` (K-major weights), f32 out.
    pub const ROWS_NT: u32 = 1;
    /// [`Variant::ROWS_NT`] with bf16 out (its own kernel: a runtime choice of epilogue costs
    /// the f32 kernel registers).
    pub const ROWS_NT_BF16: u32 = 4;
    /// Row-grouped `A · B` (N-major weights, up to two K segments), f32 out.
    pub const ROWS_NN: u32 = 2;
    /// Per-group weight gradient, rows reduced in order.
    pub const WGRAD: u32 = 3;
    /// [`Variant::WGRAD`] on the ring of a persistent kernel that runs in 2-block clusters (the
    /// backward megakernel): each block still computes its own tiles alone (no multicast, no
    /// partner), walking them with a fixed stride over the blocks that run the phase (the
    /// hooks' `weight_tile_walk`), but the ring's `empty` barriers count the consumer warps of
    /// both blocks, so each warp arrives twice on its own block's barrier.
    pub const WGRAD_IN_PAIR: u32 = 6;
}

/// Whether `variant` is a weight gradient (K over a group's rows, `[G][M][N]` out).
pub const fn is_wgrad(variant: u32) -> bool {
    variant == Variant::WGRAD || variant == Variant::WGRAD_IN_PAIR
}

/// Tiles of a weight gradient's `[groups][m][n]` output: every group's `m × n` in block tiles.
pub const fn weight_gradient_tiles(groups: u32, m: u32, n: u32) -> u32 {
    groups * m.div_ceil(TILE_M) * n.div_ceil(TILE_N)
}

/// Arrivals of each consumer warp on its own block's `empty` barrier when it releases a stage:
/// 1, except for [`Variant::WGRAD_IN_PAIR`], whose ring counts a pair's 16 warps while only this
/// block's 8 use its stages.
pub const fn own_empty_arrivals(variant: u32) -> u32 {
    if variant == Variant::WGRAD_IN_PAIR { 2 } else { 1 }
}

/// Pipeline stages in shared memory (every engine kernel but the standalone weight gradient:
/// [`ring_stages`]).
pub const STAGES: u32 = 4;

/// Blocks per cluster. The row-grouped variants run in pairs that share one operand by TMA
/// multicast: an M-pair takes the two 128-row halves of a 256-row entry and shares the weight
/// tile (each block loads half of it into both); an N-pair takes one M tile and two neighbouring
/// N tiles and shares the rows (each block loads a 64-row half into both). A weight gradient's
/// tiles run alone.
pub const fn cluster_blocks(variant: u32) -> u32 {
    if is_wgrad(variant) { 1 } else { 2 }
}

/// Boxes of output staging per consumer warpgroup (TMA-store epilogue), each 64 rows × 128
/// bytes: a pass stages this many boxes of 64 bf16 or 32 f32 columns of its 64 rows. It must
/// divide a tile's 4 bf16 and 8 f32 boxes and be at least the SwiGLU pass's 2, i.e. 2 or 4; 4
/// fits in shared memory only with 3 stages (measured slower for the row-grouped variants,
/// docs/PERF.md v11, faster for the standalone weight gradient: [`staging_boxes`]).
pub const STAGING_BOXES: u32 = 2;

/// Bytes of output staging per consumer warpgroup.
pub const STAGING_BYTES_PER_WARPGROUP: u32 = STAGING_BOXES * BLOCK_64_BYTES;

/// The ring's stages in `variant`'s standalone kernel: [`STAGES`], except 3 for the weight
/// gradient, whose tiles are a few K blocks (a group's rows) and whose epilogue writes a whole
/// 64 × 256 bf16 output per warpgroup: with 32 of a fourth stage's 48 KiB as more staging
/// ([`staging_boxes`]) it stages that output in one pass, where two passes waited for the
/// first pass's bulk stores to read the staging (a fifth of the consumers' samples, docs/PERF.md
/// "v21"). The megakernels run every phase on one ring of [`STAGES`] and [`STAGING_BOXES`].
pub const fn ring_stages(variant: u32) -> u32 {
    if variant == Variant::WGRAD { 3 } else { STAGES }
}

/// Staging boxes per consumer warpgroup in `variant`'s standalone kernel (see [`ring_stages`]).
pub const fn staging_boxes(variant: u32) -> u32 {
    if variant == Variant::WGRAD { 4 } else { STAGING_BOXES }
}

/// Shared memory a ring of `stages` stages and `boxes` staging boxes per consumer warpgroup
/// uses: the stages, the two consumers' output staging, then per stage a `full` and an `empty`
/// mbarrier, an 8-byte tile slot and a mailbox mbarrier (a pair's second block learns its tiles
/// through it), then 16 bytes for the gathering warps' tile and walk hand-out, then per stage a
/// work slot of [`WORK_SLOT_WORDS`] words, then 16 bytes whose first word holds a megakernel's
/// rank, where the launch hosts ranks (`megakernel::forward::shared_rank_of_block`), then
/// [`PARAMS_COPY_BYTES`] for a persistent kernel's copy of its parameter blocks; plus 1 KiB so
/// the stages can start on a 1024-byte boundary whatever the window's base.
pub const fn ring_smem_bytes(stages: u32, boxes: u32) -> u32 {
    stages * STAGE_BYTES
        + 2 * boxes * BLOCK_64_BYTES
        + 4 * stages * 8
        + 16
        + stages * 4 * WORK_SLOT_WORDS
        + 16
        + PARAMS_COPY_BYTES
        + 1024
}

/// Shared memory after the work slots where the one-GPU backward megakernel keeps a copy of its
/// parameter block and its five routed plans (`megakernel_layout::BackwardParams`, checked
/// there): read there, their fields survive the L1 invalidations of every acquire and proxy
/// fence, where the global copies go back to L2 after each. 16-byte aligned.
pub const PARAMS_COPY_BYTES: u32 = 1344;

/// Words of a stage's work slot: a tile's lookup, packed (`gemm::source::Work`: nine words,
/// padded to three 16-byte vectors).
pub const WORK_SLOT_WORDS: u32 = 12;

/// Dynamic shared memory of an engine block: the default ring's ([`STAGES`],
/// [`STAGING_BOXES`]), which is at least every variant's.
pub const ENGINE_SMEM_BYTES: u32 = ring_smem_bytes(STAGES, STAGING_BOXES);
const _: () = assert!(
    ring_smem_bytes(ring_stages(Variant::WGRAD), staging_boxes(Variant::WGRAD)) <= ENGINE_SMEM_BYTES
        && (ring_stages(Variant::WGRAD) * STAGE_BYTES).is_multiple_of(1024)
);

/// The tile slot value that tells the consumers there is no further tile.
pub const NO_TILE: u32 = u32::MAX;

/// Swizzle mode field of a descriptor: 128-byte swizzle.
const SWIZZLE_128B: u64 = 1;

/// A wgmma shared-memory matrix descriptor for a 128B-swizzled tile starting at shared address
/// `start` (its 1024-byte pattern base aligned, so the base-offset field is 0).
///
/// `leading_bytes` / `stride_bytes` (PTX ISA §9.7.15.5.1.2): for K-major tiles the stride is
/// the distance between groups of 8 rows (1024) and the leading offset is unused; for MN-major
/// tiles the leading offset is the distance between 64-wide M/N blocks and the stride the
/// distance between groups of 8 K rows (1024).
#[inline(always)]
pub const fn smem_descriptor(start: u32, leading_bytes: u32, stride_bytes: u32) -> u64 {
    encode_field(start)
        | (encode_field(leading_bytes) << 16)
        | (encode_field(stride_bytes) << 32)
        | (SWIZZLE_128B << 62)
}

/// `matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4`.
#[inline(always)]
const fn encode_field(x: u32) -> u64 {
    ((x & 0x3ffff) >> 4) as u64
}

/// Byte offset of the 16-byte chunk `chunk` (0..8) of row `row` in a 128B-swizzled tile.
#[inline(always)]
pub const fn swizzled_chunk_offset(row: u32, chunk: u32) -> u32 {
    row * 128 + ((chunk ^ (row % 8)) * 16)
}

/// Rows (gate/up) or K rows (weight gradient) of a gathering stage whose token each lane
/// looks up: its copies touch only those.
pub const GATHERED_ROWS_PER_LANE: u32 = 8;

/// What lane `lane` of a gathering producer's warp copies in copy `copy` (0..32) of a gate/up
/// stage: (row of the 128-row A tile, chunk of the row's 64 K values). Two lanes take a 32-byte
/// sector (chunks `2s`, `2s + 1`), so a warp-wide copy reads 16 whole sectors of 16 rows and,
/// the rows' swizzles differing, writes each of the 8 chunk places of a 128-byte shared row
/// 4 times: 4 wavefronts for 512 bytes. Lane `lane` copies rows `lane / 2 + 16j` (copies `4j ..
/// 4j + 4`, token `j` of [`GATHERED_ROWS_PER_LANE`]), so it holds 8 tokens and needs no shuffle.
/// (A lane per row read half sectors of 32 lines per copy and wrote one bank group of 32 rows;
/// 8 lanes per row needed a shuffle for each copy's token, which serialised the copies.)
#[inline(always)]
pub const fn gathered_a_chunk(copy: u32, lane: u32) -> (u32, u32) {
    (lane / 2 + 16 * (copy / 4), 2 * (copy % 4) + lane % 2)
}

/// What lane `lane` copies in copy `copy` (0..64) of a weight gradient's gathered B stage: (K
/// row, 64-wide column block, chunk in the block's K row) of the stage's 64 K rows × 256
/// columns (N-major: chunk `q` of a row's 256 columns is chunk `q % 8` of block `q / 8`). Two
/// lanes take a sector; a copy covers 2 adjacent sectors of each of 8 K rows. Lane `lane`
/// copies K rows `(lane / 2) % 8 + 8j` (copies `8j .. 8j + 8`, token `j`).
#[inline(always)]
pub const fn gathered_b_chunk(copy: u32, lane: u32) -> (u32, u32, u32) {
    let pair = lane / 2;
    let q = 4 * (copy % 8) + 2 * (pair / 8) + lane % 2;
    (pair % 8 + 8 * (copy / 8), q / 8, q % 8)
}

/// Lane `lane`'s copy `s` (0..4) of its row `j` (copy `4j + s` of [`gathered_a_chunk`]) in a
/// gate/up stage: (the byte of the row's 128-byte stage span it reads, the offset in the
/// stage's A tile it writes). Written with `j` and `s` apart from the lane's part, so with
/// constant `j` and `s` a kernel computes a handful of per-lane values and adds constants.
#[inline(always)]
pub const fn gathered_a_copy(j: u32, s: u32, lane: u32) -> (u32, u32) {
    let (pair, half) = (lane / 2, lane % 2);
    // Row pair + 16j: 64-row block j / 4, row pair + 16 (j % 4) of it, swizzled by pair % 8.
    let place = (j / 4) * BLOCK_64_BYTES + 16 * (j % 4) * 128 + pair * 128 + 16 * ((2 * s + half) ^ (pair % 8));
    (32 * s + 16 * half, place)
}

/// Lane `lane`'s copy `i` (0..8) of its K row `j` (copy `8j + i` of [`gathered_b_chunk`]) in
/// a weight gradient's B stage: (the byte of the K row's 512-byte stage span it reads, the
/// offset in the stage's B tile it writes), split as [`gathered_a_copy`].
#[inline(always)]
pub const fn gathered_b_copy(j: u32, i: u32, lane: u32) -> (u32, u32) {
    let (pair, half) = (lane / 2, lane % 2);
    // K row pair % 8 + 8j, in column block i / 2, chunk 4 (i % 2) + 2 (pair / 8) + half of the
    // block's row, swizzled by pair % 8.
    let chunk = 4 * (i % 2) + 2 * (pair / 8) + half;
    let place = (i / 2) * BLOCK_64_BYTES + 1024 * j + (pair % 8) * 128 + 16 * (chunk ^ (pair % 8));
    (64 * i + 32 * (pair / 8) + 16 * half, place)
}

/// A consumer thread's staging offset of its bf16 pair in n8 block 0 of a staged pass (row
/// `16 · warp + lane / 4`, byte `4 · (lane % 4)` of chunk 0); see [`staged_pair_address`].
#[inline(always)]
pub const fn staged_pair_base(thread_in_wg: u32) -> u32 {
    let (warp, lane) = (thread_in_wg / 32, thread_in_wg % 32);
    swizzled_chunk_offset(warp * 16 + lane / 4, 0) + 4 * (lane % 4)
}

/// The address of a thread's bf16 pair in n8 block `j` of a staged pass, from `s`, a 1024-aligned
/// staging address plus [`staged_pair_base`]: block j is chunk j % 8 of box j / 8, and the
/// swizzle's XOR only touches bits 4–6, which neither the aligned base nor the box offset use,
/// so `s ^ 16 · (j % 8)` is the swizzled chunk (the pair 8 rows down is 1024 bytes further).
#[inline(always)]
pub const fn staged_pair_address(s: u32, j: u32) -> u32 {
    (s ^ (16 * (j % 8))) + j / 8 * BLOCK_64_BYTES
}

/// Bytes of a tensor map (`CUtensorMap`).
pub const TENSOR_MAP_BYTES: u32 = 128;

/// Maps per group cut at the group's last row (see [`GemmParams::group_maps`]).
pub const GROUP_MAP_SLOTS: u32 = 3;

/// Warps (one group each) per block of the kernel that writes the group maps.
pub const GROUP_MAP_WARPS: u32 = 4;

/// Dynamic shared memory of that kernel: one staging map per warp and slot.
pub const GROUP_MAP_SMEM_BYTES: u32 = GROUP_MAP_WARPS * GROUP_MAP_SLOTS * TENSOR_MAP_BYTES;

/// The readiness counters of one hooked engine launch (the persistent kernel's hand-over, see
/// `gemm::hooks`), in device memory. All pointers are device addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TileCounters {
    /// `[M tiles]` u32, one per engine M tile over all groups: the epoch of the last pass whose
    /// rows of that tile have all landed (set by the comm side with a release).
    pub rows_landed: u64,
    /// `[M tiles]` u32: the stored parts of each tile's output, one per (N tile, consumer
    /// warpgroup with rows); cleared in stream order before the pass.
    pub tiles_stored: u64,
    /// `comm::params::ERROR_WORDS` u32: the launch's first failure, in the exchange's error
    /// record format (`comm::error`; all zero if none).
    pub error: u64,
    /// How long a wait may take, in `%globaltimer` nanoseconds.
    pub timeout_ns: u64,
    /// This pass's epoch (what `rows_landed` must reach).
    pub epoch: u32,
    /// Keeps the size a multiple of 8.
    pub reserved: u32,
}

// The host writes this block byte for byte: five 8-byte fields, then two u32.
const _: () = assert!(size_of::<TileCounters>() == 40);

/// What one engine launch computes (see `kernels/src/gemm/`). Written by the host into device
/// memory, read by every block. All pointers are device addresses; unused ones are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GemmParams {
    /// Tensor map of A (see the engine's variant docs for its shape).
    pub map_a: u64,
    /// Tensor map of B (first K segment / gate weights).
    pub map_b: u64,
    /// Tensor map of the second B (up weights, or the second dgrad segment's weights).
    pub map_b2: u64,
    /// Tensor map of the second A (second dgrad segment).
    pub map_a2: u64,
    /// The tensors whose rows are grouped, per slot: 0 is A; 1 is the second A (data
    /// gradients) or B (weight gradient, whose rows are the K dimension); 2 is the output rows
    /// (row-grouped variants); 0 for none. Their host-encoded maps over the whole buffer...
    pub cut_maps: [u64; GROUP_MAP_SLOTS as usize],
    /// ... the buffers' device addresses ...
    pub cut_bases: [u64; GROUP_MAP_SLOTS as usize],
    /// `[groups][GROUP_MAP_SLOTS]` tensor maps of 128 bytes, rewritten before every engine launch
    /// by `mok_sm90_group_maps` from `cut_maps` and the device-written offsets: each covers only
    /// its group's rows, so a ragged tile (or a weight gradient's last K block) is one TMA copy
    /// whose rows past the group read as zero — never the next group's rows.
    pub group_maps: u64,
    /// TMA-store map of the output over its whole buffer: row-grouped `[rows][N]` (hidden bf16,
    /// else f32), weight gradient `[G][M][N]` (bf16, or f32 when `out1` is set).
    pub map_out: u64,
    /// `[groups + 1]` first row of each group (device-written).
    pub row_offsets: u64,
    /// Row-grouped variants: `[2 · (groups + 1)]`, the first M tile of each group in tiles of
    /// [`TILE_M`] (`[0, G]`), then the number of groups before each with an odd M tile count
    /// (`[G + 1, 2G + 1]`); device-written (`mok_tile_offsets`).
    pub tile_offsets: u64,
    /// Output 0 (hidden bf16, f32 rows, or weight gradient).
    pub out0: u64,
    /// Output 1 (gate pre-activations f32, optional).
    pub out1: u64,
    /// Output 2 (up pre-activations f32, optional).
    pub out2: u64,
    /// One u32: the next tile to hand out. Blocks (the first block of each pair) take tiles from
    /// it with an atomic add, in list order, so tiles next to each other in the walk run at the
    /// same time wherever their blocks are (a static stride lets blocks drift apart by whole tiles). Which block computes
    /// a tile does not change its result. Zeroed by `mok_sm90_group_maps` before every launch.
    pub tile_counter: u64,
    /// ... and the bytes between their rows.
    pub cut_pitches: [u32; GROUP_MAP_SLOTS as usize],
    /// Row-grouped variants: nonzero to pair the blocks by M where a group has two 128-row M
    /// tiles for them (they split the loading of the weight tile they share), 0 to pair every M
    /// tile by N (the blocks share its rows and take two N tiles); see the engine's list walk.
    pub m_pairs: u32,
    /// Groups (experts).
    pub groups: u32,
    /// Output width N of the product (per group).
    pub n: u32,
    /// K of the first segment.
    pub k: u32,
    /// K of the second segment (0: none).
    pub k2: u32,
    /// Output rows M for weight-gradient variants (per group).
    pub m: u32,
    /// SwiGLU clamp (+inf for none).
    pub swiglu_limit: f32,
}

impl GemmParams {
    /// Device address of group `group`'s map in `slot` (see [`GemmParams::group_maps`]).
    #[inline(always)]
    pub const fn group_map(&self, group: u32, slot: u32) -> u64 {
        self.group_maps + (group as u64 * GROUP_MAP_SLOTS as u64 + slot as u64) * TENSOR_MAP_BYTES as u64
    }
}

/// M tiles per band of the row-grouped tile walk (see [`banded_row_tile`]). 8 × 4 was the best
/// of 4 × all, 16 × 8, 8 × 4 and 16 × 4 in one call (docs/PERF.md v13).
pub const ROW_TILE_BAND: u32 = 8;
/// N tiles per block inside a band (see [`banded_row_tile`]).
pub const ROW_TILE_BAND_N: u32 = 4;

/// A group's `local`-th tile (of `m_tiles` × `n_tiles`) → (M tile, N tile): the group's M tiles
/// are walked in bands of up to `band_m`; a band in blocks of up to `band_n` N tiles; a block M
/// fastest, then N. Blocks that run at the same time then take all M tiles of a small group for
/// the same N tile — they read the same weight tile within microseconds, so the second read
/// hits L2 — while a large group is walked ~`band_m` M tiles × `band_n` N tiles at a time, which
/// bounds the row and weight panels that must stay in L2 together.
#[inline(always)]
pub const fn banded_row_tile(local: u32, m_tiles: u32, n_tiles: u32, band_m: u32, band_n: u32) -> (u32, u32) {
    let band_tiles = band_m * n_tiles;
    let first_m = local / band_tiles * band_m;
    let height = if m_tiles - first_m < band_m { m_tiles - first_m } else { band_m };
    let within = local % band_tiles;
    let block_tiles = height * band_n;
    let first_n = within / block_tiles * band_n;
    let inside = within % block_tiles;
    (first_m + inside % height, first_n + inside / height)
}

/// One block's share of a row-grouped list entry (see [`pair_tile`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairTile {
    /// The group (expert) the tile belongs to.
    pub group: u32,
    /// First row of the block's M tile (global row index).
    pub m0: u32,
    /// The block's N tile (`n_tiles` or more: an N-pair's second block without columns).
    pub n_tile: u32,
    /// An M-pair: the blocks take the two 128-row halves of a 256-row entry and share the weight
    /// tile; otherwise an N-pair: they share the ≤ 128 rows and take neighbouring N tiles.
    pub shares_weights: bool,
}

/// (M-pair entries, N-paired M tiles) of the groups before `group`, from `tile_offsets` (read
/// through `offset(i)`: `[0, G]` the groups' first M tiles, `[G + 1, 2G + 1]` the count of groups
/// with an odd number of M tiles before each). With `m_pairs`, a group of `t` M tiles has `t / 2`
/// M-pair entries and, when `t` is odd, its last M tile N-paired; without, all `t` are N-paired.
#[inline(always)]
pub fn pair_entries_before(group: u32, groups: u32, m_pairs: bool, offset: &impl Fn(u32) -> u32) -> (u32, u32) {
    let (tiles, odd) = (offset(group), offset(groups + 1 + group));
    if m_pairs { ((tiles - odd) / 2, odd) } else { (0, tiles) }
}

/// List entries of the groups before `group` (`group` ≤ `groups`; `groups` gives the list's
/// length): an M-pair entry per N tile, an N-paired M tile per pair of N tiles.
#[inline(always)]
pub fn pair_entries_list_before(
    group: u32,
    groups: u32,
    n_tiles: u32,
    m_pairs: bool,
    offset: &impl Fn(u32) -> u32,
) -> u32 {
    let (m, n) = pair_entries_before(group, groups, m_pairs, offset);
    m * n_tiles + n * n_tiles.div_ceil(2)
}

/// The group of list entry `tile` of a row-grouped launch in pairs, as [`pair_tile`] finds it
/// (the last group with no more entries before it than `tile`: empty groups are skipped),
/// searched from `from`, a group at or before it — a block's previous tile's group in the same
/// list, as a block takes its tiles in increasing order. It probes `from` + 1, + 2, + 4, …
/// until one lies past the tile, then halves that bracket: a few probes where the tile lies a
/// few groups on, as in a persistent walk over many blocks, against log2(groups) dependent
/// probes for a search over them all (each probe two loads of the tile offsets).
#[inline(always)]
pub fn pair_group_from(
    tile: u32,
    from: u32,
    groups: u32,
    n_tiles: u32,
    m_pairs: bool,
    offset: &impl Fn(u32) -> u32,
) -> u32 {
    let before = |g| pair_entries_list_before(g, groups, n_tiles, m_pairs, offset);
    let (mut lo, mut hi, mut step) = (from, groups, 1u32);
    while lo + step < groups {
        if before(lo + step) <= tile {
            lo += step;
            step *= 2;
        } else {
            hi = lo + step;
            break;
        }
    }
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if before(mid) <= tile { lo = mid } else { hi = mid }
    }
    lo
}

/// Block `rank`'s share of list entry `tile` (< the list's length) of a row-grouped launch in
/// pairs: the group (the last one with no more entries before it than `tile`; empty groups are
/// skipped), then within it the M-pair entries walked by [`banded_row_tile`] over (entries × N
/// tiles), then the N-paired M tiles over (tiles × pairs of N tiles). `offset(i)` reads
/// `tile_offsets[i]`, `row_offset(g)` the group's first row.
#[inline(always)]
pub fn pair_tile(
    tile: u32,
    rank: u32,
    groups: u32,
    n_tiles: u32,
    m_pairs: bool,
    offset: &impl Fn(u32) -> u32,
    row_offset: &impl Fn(u32) -> u32,
) -> PairTile {
    let (mut lo, mut hi) = (0u32, groups);
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        if pair_entries_list_before(mid, groups, n_tiles, m_pairs, offset) <= tile { lo = mid } else { hi = mid }
    }
    pair_tile_in_group(tile, lo, rank, (groups, n_tiles, m_pairs), offset, row_offset)
}

/// [`pair_tile`] once the tile's `group` is known (from its search, or [`pair_group_from`]).
#[inline(always)]
pub fn pair_tile_in_group(
    tile: u32,
    group: u32,
    rank: u32,
    (groups, n_tiles, m_pairs): (u32, u32, bool),
    offset: &impl Fn(u32) -> u32,
    row_offset: &impl Fn(u32) -> u32,
) -> PairTile {
    let (m_first, n_first) = pair_entries_before(group, groups, m_pairs, offset);
    let (m_next, n_next) = pair_entries_before(group + 1, groups, m_pairs, offset);
    let local = tile - (m_first * n_tiles + n_first * n_tiles.div_ceil(2));
    let (begin, m_entries) = (row_offset(group), m_next - m_first);
    if local < m_entries * n_tiles {
        let (m_local, n_tile) = banded_row_tile(local, m_entries, n_tiles, ROW_TILE_BAND, ROW_TILE_BAND_N);
        PairTile { group, m0: begin + m_local * 2 * TILE_M + rank * TILE_M, n_tile, shares_weights: true }
    } else {
        let local = local - m_entries * n_tiles;
        let (m_local, n_pair) =
            banded_row_tile(local, n_next - n_first, n_tiles.div_ceil(2), ROW_TILE_BAND, ROW_TILE_BAND_N);
        PairTile {
            group,
            m0: begin + m_entries * 2 * TILE_M + m_local * TILE_M,
            n_tile: 2 * n_pair + rank,
            shares_weights: false,
        }
    }
}

// The host uploads GemmParams as raw bytes: keep it free of padding. And the ring must fit in
// an SM's shared memory (227 KiB on sm_90).
const _: () = assert!(core::mem::size_of::<GemmParams>() == 184);
const _: () = assert!(ENGINE_SMEM_BYTES <= 227 * 1024);
const _: () = assert!(STAGE_BYTES.is_multiple_of(1024));
const fn fits(producer: u32, consumer: u32) -> bool {
    // setmaxnreg can only hand out what the block was launched with (168 · 384 at .maxntid 384).
    producer * 128 + consumer * 256 <= 65536 / ENGINE_THREADS / 8 * 8 * ENGINE_THREADS
        && producer.is_multiple_of(8)
        && consumer.is_multiple_of(8)
}
const _: () = assert!(fits(PRODUCER_REGISTERS, CONSUMER_REGISTERS));
const _: () = assert!(fits(PAIRED_PRODUCER_REGISTERS, PAIRED_CONSUMER_REGISTERS));
const _: () = assert!(fits(MEGAKERNEL_PRODUCER_REGISTERS, PAIRED_CONSUMER_REGISTERS));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_staged_pair_addresses_are_the_swizzled_layout() {
        // Every thread, n8 block and 1024-aligned staging base: the address of each of the
        // thread's two pairs is the one the general epilogue computes from row and column.
        for staging in [0u32, 1024, 196608, 196608 + 16384, 229376 - 16384] {
            for t in 0..128u32 {
                let s = staging + staged_pair_base(t);
                let (warp, lane) = (t / 32, t % 32);
                for j in 0..16u32 {
                    let col = 8 * j + 2 * (lane % 4);
                    let (box_index, byte) = (col / 64, (col % 64) * 2);
                    for (row, extra) in [(warp * 16 + lane / 4, 0), (warp * 16 + lane / 4 + 8, 8 * 128)] {
                        let expected =
                            staging + box_index * BLOCK_64_BYTES + swizzled_chunk_offset(row, byte / 16) + byte % 16;
                        assert_eq!(staged_pair_address(s, j) + extra, expected, "t {t} j {j} row {row}");
                    }
                }
            }
        }
    }

    #[test]
    fn descriptor_fields() {
        let d = smem_descriptor(0x1_0400, 8192, 1024);
        assert_eq!(d & 0x3fff, (0x1_0400 >> 4) & 0x3fff);
        assert_eq!((d >> 16) & 0x3fff, 8192 >> 4);
        assert_eq!((d >> 32) & 0x3fff, 1024 >> 4);
        assert_eq!((d >> 49) & 0x7, 0);
        assert_eq!(d >> 62, 1);
    }

    #[test]
    fn banded_walk_visits_every_tile_once() {
        for (m_tiles, n_tiles) in [(1, 16), (2, 16), (3, 28), (6, 8), (64, 16), (5, 1), (7, 3), (17, 28)] {
            for (band_m, band_n) in [(4, 1024), (16, 8), (8, 3), (2, 1), (1, 5)] {
                let mut seen = vec![false; (m_tiles * n_tiles) as usize];
                for local in 0..m_tiles * n_tiles {
                    let (m, n) = banded_row_tile(local, m_tiles, n_tiles, band_m, band_n);
                    let case = format!("{m_tiles}x{n_tiles} in {band_m}x{band_n}: {local} -> ({m}, {n})");
                    assert!(m < m_tiles && n < n_tiles, "{case}");
                    let slot = &mut seen[(m * n_tiles + n) as usize];
                    assert!(!*slot, "{case}: twice");
                    *slot = true;
                }
            }
        }
        // A two-tile group: both M tiles of an N tile are consecutive.
        assert_eq!([banded_row_tile(0, 2, 16, 4, 8), banded_row_tile(1, 2, 16, 4, 8)], [(0, 0), (1, 0)]);
        // A large group: a block of 16 M × 8 N tiles is walked before the next N block.
        assert_eq!(banded_row_tile(16 * 8 - 1, 64, 16, 16, 8), (15, 7));
        assert_eq!(banded_row_tile(16 * 8, 64, 16, 16, 8), (0, 8));
    }

    /// `tile_offsets` as `mok_tile_offsets` writes them for groups of `rows` rows.
    fn tile_and_odd_offsets(rows: &[u32]) -> Vec<u32> {
        let tiles: Vec<u32> = rows.iter().map(|r| r.div_ceil(TILE_M)).collect();
        let mut out = vec![0; 2 * (rows.len() + 1)];
        for g in 0..rows.len() {
            out[g + 1] = out[g] + tiles[g];
            out[rows.len() + 2 + g] = out[rows.len() + 1 + g] + tiles[g] % 2;
        }
        out
    }

    /// Each group's first row, and the total last (`[G + 1]`), for groups of `rows` rows.
    fn first_rows(rows: &[u32]) -> Vec<u32> {
        let mut first = vec![0u32];
        for r in rows {
            first.push(first.last().unwrap() + r);
        }
        first
    }

    #[test]
    fn pair_list_computes_every_tile_once_and_both_blocks_agree() {
        // Also: `pair_group_from`, from any earlier tile's group (a block's walk) or from group
        // 0, finds `pair_tile`'s group.
        let sizes: &[&[u32]] = &[
            &[170, 0, 42, 256, 257, 383, 384, 385, 1, 683],
            &[0, 0, 128, 0],
            &[640, 641, 768, 769, 8192],
            &[64, 65, 127, 129, 255],
            &[0, 1, 0, 0, 0, 300, 0, 129, 0, 0, 0, 0, 5],
            &[],
            &[0],
        ];
        for rows in sizes {
            let offsets = tile_and_odd_offsets(rows);
            let first_rows = first_rows(rows);
            let groups = rows.len() as u32;
            for n_tiles in [1, 2, 3, 5, 8, 28] {
                for m_pairs in [true, false] {
                    let offset = |i: u32| offsets[i as usize];
                    let row_offset = |g: u32| first_rows[g as usize];
                    let len = pair_entries_list_before(groups, groups, n_tiles, m_pairs, &offset);
                    // (group, M tile, N tile) → times computed.
                    let mut seen = std::collections::HashMap::new();
                    for tile in 0..len {
                        let [a, b] =
                            [0, 1].map(|rank| pair_tile(tile, rank, groups, n_tiles, m_pairs, &offset, &row_offset));
                        let case = format!("{rows:?} n_tiles {n_tiles} m_pairs {m_pairs} tile {tile}: {a:?} {b:?}");
                        assert_eq!((a.group, a.shares_weights), (b.group, b.shares_weights), "{case}");
                        let (begin, end) = (first_rows[a.group as usize], first_rows[a.group as usize + 1]);
                        if a.shares_weights {
                            // Both blocks have rows; the first a whole M tile; one N tile.
                            assert!(a.m0 + TILE_M <= end && b.m0 == a.m0 + TILE_M && b.m0 < end, "{case}");
                            assert!(a.n_tile == b.n_tile && a.n_tile < n_tiles, "{case}");
                        } else {
                            // The same rows; neighbouring N tiles, the first always real.
                            assert!(
                                a.m0 == b.m0 && a.m0 < end && a.n_tile < n_tiles && b.n_tile == a.n_tile + 1,
                                "{case}"
                            );
                        }
                        for t in [a, b].into_iter().filter(|t| t.n_tile < n_tiles) {
                            assert!(t.m0 >= begin && (t.m0 - begin) % TILE_M == 0, "{case}");
                            *seen.entry((t.group, (t.m0 - begin) / TILE_M, t.n_tile)).or_insert(0) += 1;
                        }
                    }
                    let expected: u32 = rows.iter().map(|r| r.div_ceil(TILE_M) * n_tiles).sum();
                    assert_eq!(seen.len() as u32, expected, "{rows:?} n_tiles {n_tiles} m_pairs {m_pairs}");
                    assert!(seen.values().all(|&n| n == 1), "{rows:?} n_tiles {n_tiles}: a tile computed twice");
                    let group = |tile| pair_tile(tile, 0, groups, n_tiles, m_pairs, &offset, &row_offset).group;
                    for earlier in 0..len {
                        let from = group(earlier);
                        for tile in earlier..len {
                            let found = pair_group_from(tile, from, groups, n_tiles, m_pairs, &offset);
                            let case = format!("{rows:?} n_tiles {n_tiles} m_pairs {m_pairs}: {earlier} → {tile}");
                            assert_eq!(found, group(tile), "{case}");
                        }
                        let found = pair_group_from(earlier, 0, groups, n_tiles, m_pairs, &offset);
                        assert_eq!(found, from, "{rows:?} n_tiles {n_tiles} m_pairs {m_pairs}: 0 → {earlier}");
                    }
                }
            }
        }
    }

    #[test]
    fn hooked_store_counts_are_n_tiles_times_the_warpgroups_with_rows() {
        // The contract of `gemm::hooks::Counters`: a consumer warpgroup counts its part of a tile
        // when it runs the epilogue — it has rows (`64·wg < rows`) and its block has columns —
        // at M tile `tile_offsets[g] + (m0 − row_begin) / TILE_M`. Over the whole pair list each
        // M tile then counts exactly `n_tiles · ⌈rows in the tile / 64⌉`, whatever the pairing.
        let sizes: &[&[u32]] = &[&[170, 0, 42, 256, 257, 383, 384, 385, 1, 683], &[64, 65, 127, 129, 255], &[0, 1]];
        for rows in sizes {
            let offsets = tile_and_odd_offsets(rows);
            let first_rows = first_rows(rows);
            let groups = rows.len() as u32;
            let m_tiles = offsets[groups as usize] as usize;
            for n_tiles in [1, 2, 3, 8] {
                for m_pairs in [true, false] {
                    let offset = |i: u32| offsets[i as usize];
                    let row_offset = |g: u32| first_rows[g as usize];
                    let mut counted = vec![0u32; m_tiles];
                    for tile in 0..pair_entries_list_before(groups, groups, n_tiles, m_pairs, &offset) {
                        for rank in [0, 1] {
                            let t = pair_tile(tile, rank, groups, n_tiles, m_pairs, &offset, &row_offset);
                            let (begin, end) = (first_rows[t.group as usize], first_rows[t.group as usize + 1]);
                            if t.n_tile >= n_tiles || t.m0 >= end {
                                continue; // no columns (or no rows): the consumers skip the epilogue
                            }
                            let in_tile = (end - t.m0).min(TILE_M);
                            let m_tile = (offsets[t.group as usize] + (t.m0 - begin) / TILE_M) as usize;
                            counted[m_tile] += (0..2).filter(|wg| 64 * wg < in_tile).count() as u32;
                        }
                    }
                    let mut expected = vec![0u32; m_tiles];
                    for (g, r) in rows.iter().enumerate() {
                        for j in 0..r.div_ceil(TILE_M) {
                            let in_tile = (r - TILE_M * j).min(TILE_M);
                            expected[(offsets[g] + j) as usize] = n_tiles * in_tile.div_ceil(64);
                        }
                    }
                    assert_eq!(counted, expected, "{rows:?} n_tiles {n_tiles} m_pairs {m_pairs}");
                }
            }
        }
    }

    #[test]
    fn group_maps_are_consecutive_128_byte_slots() {
        let p = GemmParams { group_maps: 0x7f00_0000_0000, ..GemmParams::default() };
        assert_eq!(p.group_map(0, 0), 0x7f00_0000_0000);
        assert_eq!(p.group_map(0, GROUP_MAP_SLOTS - 1), 0x7f00_0000_0000 + 128 * (GROUP_MAP_SLOTS as u64 - 1));
        assert_eq!(p.group_map(1, 0), 0x7f00_0000_0000 + 128 * GROUP_MAP_SLOTS as u64);
        // 8192 groups (MAX_EXPERTS) stay exact: the offset is computed in 64 bits.
        assert_eq!(p.group_map(8191, 2) - p.group_map(0, 0), (8191 * GROUP_MAP_SLOTS as u64 + 2) * 128);
    }

    /// One warp-wide copy of a gathering stage, as (lane, global row, byte in the row's
    /// stage span, shared place): checks whole 32-byte sectors are read (pairs of lanes,
    /// adjacent chunks) and the shared writes take 4 wavefronts (each of the 8 16-byte bank
    /// groups written by 4 lanes).
    fn check_gathering_copy(what: &str, copy: u32, lanes: &[(u32, u32, u32, u32)]) {
        for pair in lanes.chunks(2) {
            let ((_, row0, byte0, _), (_, row1, byte1, _)) = (pair[0], pair[1]);
            assert!(row0 == row1 && byte0 % 32 == 0 && byte1 == byte0 + 16, "{what} copy {copy}: a sector split");
        }
        let mut per_bank_group = [0u32; 8];
        for &(_, _, _, place) in lanes {
            per_bank_group[(place % 128 / 16) as usize] += 1;
        }
        assert_eq!(per_bank_group, [4; 8], "{what} copy {copy}: shared-memory wavefronts");
    }

    #[test]
    fn gathering_copies_fill_the_tiles_once_coalesced_and_conflict_free() {
        // Gate/up A: 32 copies of a 128-row tile; weight-gradient B: 64 copies of 4 column
        // blocks of 64 K rows. Every chunk of the tile is written once, each copy reads whole
        // sectors and writes in 4 wavefronts, and a lane touches only the rows of its 8 tokens.
        let mut written = vec![0u32; 128 * 8];
        for copy in 0..32 {
            let mut lanes = Vec::new();
            for lane in 0..32 {
                let (row, chunk) = gathered_a_chunk(copy, lane);
                let j = copy / 4;
                assert!(j < GATHERED_ROWS_PER_LANE && row == lane / 2 + 16 * j, "A copy {copy} lane {lane}");
                written[(row * 8 + chunk) as usize] += 1;
                let place = (row / 64) * BLOCK_64_BYTES + swizzled_chunk_offset(row % 64, chunk);
                assert_eq!(gathered_a_copy(j, copy % 4, lane), (16 * chunk, place), "A copy {copy} lane {lane}");
                lanes.push((lane, row, 16 * chunk, place));
            }
            check_gathering_copy("A", copy, &lanes);
        }
        assert!(written.iter().all(|&n| n == 1), "A chunks written other than once");
        let mut written = vec![0u32; 4 * 64 * 8];
        for copy in 0..64 {
            let mut lanes = Vec::new();
            for lane in 0..32 {
                let (k_row, block, chunk) = gathered_b_chunk(copy, lane);
                let j = copy / 8;
                assert!(j < GATHERED_ROWS_PER_LANE && k_row == (lane / 2) % 8 + 8 * j, "B copy {copy} lane {lane}");
                assert!(k_row < 64 && block < 4 && chunk < 8);
                written[((block * 64 + k_row) * 8 + chunk) as usize] += 1;
                let place = block * BLOCK_64_BYTES + swizzled_chunk_offset(k_row, chunk);
                let byte = 16 * (8 * block + chunk);
                assert_eq!(gathered_b_copy(j, copy % 8, lane), (byte, place), "B copy {copy} lane {lane}");
                lanes.push((lane, k_row, byte, place));
            }
            check_gathering_copy("B", copy, &lanes);
        }
        assert!(written.iter().all(|&n| n == 1), "B chunks written other than once");
    }

    #[test]
    fn swizzle_permutes_chunks_within_each_row() {
        for row in 0..16 {
            let mut seen = [false; 8];
            for chunk in 0..8 {
                let offset = swizzled_chunk_offset(row, chunk);
                assert_eq!(offset / 128, row);
                seen[((offset % 128) / 16) as usize] = true;
            }
            assert!(seen.iter().all(|&s| s));
        }
        assert_eq!(swizzled_chunk_offset(3, 1), 3 * 128 + 2 * 16);
    }
}
