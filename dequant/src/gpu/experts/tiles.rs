//! How the routed products cut a routing into tiles: how many slots a tile of one expert
//! holds for a count of slots an expert, which products (and so which input) each size
//! takes, and the most tiles a routing can take. The sizes come from measurements on an
//! H200, quoted beside each rule.

use gguf_format::GgmlType;

use crate::gpu::matmul;

/// Slots a tile of the routed products on the matrix units takes at most (f16 input to
/// [`routed_products`](super::routed_products); the tiles of tokens of
/// `kernels/matmul.hip`).
pub const MATMUL_TILE_TOKENS: usize = 128;

/// Slots an expert gets on average from which the routed products take the matrix units
/// rather than the decode products in tiles of one slot.
pub const MATMUL_FROM_SLOTS_PER_EXPERT: usize = 8;

/// Experts at least this wide (their feed-forward width, the rows of gate and up and the
/// columns of down) are *wide*: from [`WIDE_TILES_FROM_SLOTS_PER_EXPERT`] slots an expert
/// their products take tiles of [`WIDE_TILE_TOKENS`] slots, and the matrix units from
/// [`WIDE_MATMUL_FROM_SLOTS_PER_EXPERT`].
pub const WIDE_EXPERT_FF: usize = 2048;

/// Slots a tile of a wide expert's decode products holds.
pub const WIDE_TILE_TOKENS: usize = 4;

/// Slots a wide expert gets on average from which its products take tiles of
/// [`WIDE_TILE_TOKENS`].
pub const WIDE_TILES_FROM_SLOTS_PER_EXPERT: usize = 3;

/// Slots a wide expert gets on average from which its products take the matrix units.
pub const WIDE_MATMUL_FROM_SLOTS_PER_EXPERT: usize = 10;

/// Slots a tile of the skinny routed products may hold (f16 input, the matrix units, each
/// warp decoding its expert's rows straight into the matrix instructions' registers:
/// `kernels/skinny.hip`), where the device and the experts' types take them
/// ([`skinny_tiles`]). Elsewhere such tiles run the tiled kernel of the matrix units.
pub const SKINNY_TILE_TOKENS: [usize; 3] = [16, 32, 64];

/// Slots a wide expert gets on average from which its products take the skinny tiles
/// ([`skinny_tiles`]), of 32 slots.
pub const WIDE_SKINNY_FROM_SLOTS_PER_EXPERT: usize = 5;

/// Slots an expert of another width gets on average from which its products take the
/// skinny tiles, of 32 slots.
pub const SKINNY_FROM_SLOTS_PER_EXPERT: usize = 3;

/// Slots an expert gets on average from which MXFP4's int8 products ([`SkinnyTiles::Q8`])
/// take tiles of 16 slots.
pub const Q8_SKINNY_FROM_SLOTS_PER_EXPERT: usize = 2;

/// Slots an expert gets on average from which MXFP4's int8 products take tiles of 32.
pub const Q8_SKINNY_32_FROM_SLOTS_PER_EXPERT: usize = 12;

/// Slots an expert gets on average from which the skinny tiles hold 64 slots.
pub const SKINNY_64_FROM_SLOTS_PER_EXPERT: usize = 40;

/// Slots an expert narrower than [`WIDE_EXPERT_FF`] gets on average from which MXFP4's
/// int8 products take tiles of 64.
pub const Q8_SKINNY_64_FROM_SLOTS_PER_EXPERT: usize = 16;

/// Slots a wide expert gets on average from which MXFP4's int8 products take tiles of 64.
pub const WIDE_Q8_SKINNY_64_FROM_SLOTS_PER_EXPERT: usize = 24;

/// Slots an expert gets on average from which its products take the tiled kernel of the
/// matrix units again (tiles of [`MATMUL_TILE_TOKENS`]) rather than the skinny tiles.
pub const SKINNY_UNTIL_SLOTS_PER_EXPERT: usize = 96;

/// Which skinny products a mixture's routed products may take in tiles of
/// [`SKINNY_TILE_TOKENS`] ([`skinny_tiles`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkinnyTiles {
    /// None: the device does not run them, or they do not read every tensor's type.
    No,
    /// The f16 products (`kernels/skinny.hip`), from f16 input.
    F16,
    /// MXFP4's products on the int8 matrix units (`kernels/skinny_q8.h`), from the Q8
    /// input the decode products take.
    Q8,
}

/// Whether tiles of `tile_tokens` slots take f16 input and the matrix units (tiles of
/// [`SKINNY_TILE_TOKENS`] through [`SkinnyTiles::F16`], or of [`MATMUL_TILE_TOKENS`])
/// rather than Q8 input (tiles of one, [`WIDE_TILE_TOKENS`] or
/// [`MAX_TOKENS`](crate::gpu::matvec::MAX_TOKENS) in the
/// decode products, or of [`SKINNY_TILE_TOKENS`] through [`SkinnyTiles::Q8`]).
pub fn takes_f16(tile_tokens: usize, skinny: SkinnyTiles) -> bool {
    tile_tokens == MATMUL_TILE_TOKENS
        || (tile_tokens >= SKINNY_TILE_TOKENS[0] && skinny != SkinnyTiles::Q8)
}

/// Which skinny products a mixture's routed products may take on the device, for expert
/// tensors of `types` whose rows are `widths` wide (the model's width, and the experts'
/// feed-forward width): none where the device does not run the skinny products
/// ([`skinny_available`](matmul::skinny_available)) or a type is not one they read
/// with loads of their own ([`skinny_prefers`](matmul::skinny_prefers)); MXFP4's
/// int8 products where every tensor is MXFP4 and every width a multiple of 64 (whole
/// pairs of Q8 blocks); else the f16 ones.
pub fn skinny_tiles(device_runs_skinny: bool, types: &[GgmlType], widths: &[usize]) -> SkinnyTiles {
    if !device_runs_skinny || !types.iter().all(|&ty| matmul::skinny_prefers(ty)) {
        SkinnyTiles::No
    } else if types.iter().all(|&ty| ty == GgmlType::MXFP4) && widths.iter().all(|w| w % 64 == 0) {
        SkinnyTiles::Q8
    } else {
        SkinnyTiles::F16
    }
}

/// Slots a tile takes for `n_slots` slots over `n_experts` experts of feed-forward width
/// `n_ff`, which also says which products run
/// ([`routed_products`](super::routed_products)): one, or four for
/// wide experts ([`WIDE_EXPERT_FF`]) with a few slots each (the decode products, Q8
/// input) while the experts get fewer than [`MATMUL_FROM_SLOTS_PER_EXPERT`] (wide:
/// [`WIDE_MATMUL_FROM_SLOTS_PER_EXPERT`]) on average (decoding up to a few dozen
/// sequences), else [`MATMUL_TILE_TOKENS`] (the matrix units, f16 input: prompts and
/// larger batches).
///
/// Each slot of a tile of one reads its expert's rows on its own; a tile of four reads
/// them once for its slots and computes four slots' dot products from each weight; a
/// tile of the matrix units reads them once for all its slots but computes 128 slots'
/// products whatever its count. Measured on an H200 (`cargo xtask bench-gpu --tokens 32
/// or 64 --prompt 0 --parallel N`, S_TG in tokens/s, the tiles set by a build made for
/// it), with the one-slot products on 16 threads a narrow row (`kernels/matvec.hip`,
/// `kOneTokenMaxRows`):
/// - Qwen3-30B-A3B's shape (128 experts of 768, 8 a token): tiles of one / matrix
///   units at 64 sequences (four slots an expert) 2,059 / 1,520, at 96 (six) 2,047 /
///   2,017; tiles of one / two / four at 32 sequences 1,843 / 1,305 / 1,128, at 64
///   2,110 / 1,605 / 1,499. Its products of more than one slot run rows of 32 threads or
///   more, which its narrow rows leave idle.
/// - gpt-oss-20b's (32 experts of 2880 by 2880, 4 a token), tiles of one / two / four /
///   eight / matrix units: 16 sequences (two slots an expert) 1,443 / 1,359 / 1,417 /
///   1,012 / 714; 32 (four) 1,578 / 1,710 / 1,937 / 1,516 / 1,226; 64 (eight) tiles of
///   four 2,437, eight 2,036, matrix units 2,214; 96 (twelve) four 2,546, matrix units
///   2,977. Where the counts between those measured go is interpolated.
///
/// With `skinny` ([`skinny_tiles`]: the device and the experts' types take the skinny
/// products), tiles of 32 slots through them from [`SKINNY_FROM_SLOTS_PER_EXPERT`] (wide:
/// [`WIDE_SKINNY_FROM_SLOTS_PER_EXPERT`]) slots an expert, of 64 from
/// [`SKINNY_64_FROM_SLOTS_PER_EXPERT`], the tiled kernel from
/// [`SKINNY_UNTIL_SLOTS_PER_EXPERT`]. Each tile reads its expert's rows once for its
/// slots, and a token group of 8 without slots skips its matrix instructions. H200, the
/// tiles forced by a build made for it (`--tokens 64 --prompt 512 --parallel N --npp 32
/// --ntg 32`, S_TG in tokens/s; tiles of one / four / skinny 16 / 32 / 64 / tiled 128):
/// - Qwen3-30B-A3B's shape: 32 sequences (two slots an expert) 1,965 / – / 1,863 / 1,972
///   / 1,589 / 898; 64 (four) 2,197 / – / 3,190 / 3,387 / 2,751 / 1,578; 128 (eight)
///   2,163 / – / 4,546 / 4,568 / 3,940 / 2,609; 192 (twelve) 2,263 / – / 6,227 / 6,708
///   / 5,432 / 3,812; its 512-token prompt (32 slots an expert) skinny 16 / 32 / 64 /
///   tiled 9,070 / 11,567 / 11,026 / 8,371 tokens/s.
/// - gpt-oss-20b's: 32 sequences (four) 1,571 / 1,983 / 1,872 / 1,901 / 1,735 / 1,241;
///   48 (six) 1,633 / 2,309 / 2,625 / 2,666 / 2,430 / 1,762; 64 (eight) 1,660 / 2,508 /
///   3,251 / 3,367 / 3,096 / 2,263; 128 (sixteen) – / 2,783 / 4,451 / 5,395 / 5,103 /
///   3,948; its 512-token prompt (64 slots an expert) skinny 32 / 64 / tiled 9,933 /
///   11,874 / 11,840.
///
/// With [`SkinnyTiles::Q8`] (MXFP4's int8 products), tiles of 16 from
/// [`Q8_SKINNY_FROM_SLOTS_PER_EXPERT`] slots an expert, 32 from
/// [`Q8_SKINNY_32_FROM_SLOTS_PER_EXPERT`], 64 from
/// [`Q8_SKINNY_64_FROM_SLOTS_PER_EXPERT`] (wide:
/// [`WIDE_Q8_SKINNY_64_FROM_SLOTS_PER_EXPERT`]),
/// the tiled kernel from [`SKINNY_UNTIL_SLOTS_PER_EXPERT`]. gpt-oss-20b's shape, one call
/// (`--parallel N --npp 32 --ntg 32`; int8 tiles of 16 / 32 / 64): 16 sequences 1,637 /
/// 1,579 / 1,539 (tiles of one 1,471), 32 sequences 2,672 / 2,595 / 2,523 (tiles of four
/// 1,971), 64 sequences 4,571 / 4,533 / 4,411, 128 sequences 6,109 / 6,799 / 6,668, its
/// 512-token prompt 9,692 / 12,566 / 14,534 (f16 skinny tiles of 64: 11,881). Prompts
/// (`--tokens 1 --prompt N --repeat 2`, tiles of 32 / 64, both runs within 0.3%):
/// gpt-oss-20b's 128 tokens (16 slots an expert) 7,191 / 7,006, 192 (24) 9,041 / 9,286,
/// 256 (32) 10,425 / 11,208, 320 (40) 10,956 / 12,105; Qwen3-30B-A3B's shape in MXFP4
/// (`qwen3moe-30b-a3b-mxfp4`, experts of 768) 192 tokens (12) 8,653 / 8,872, 256 (16)
/// 10,030 / 10,545, 320 (20) 10,397 / 11,051, 384 (24) 11,362 / 12,278, 512 (32) 12,682 /
/// 13,966; its batches of 192 sequences (12 slots an expert) 6,658 with tiles of 32,
/// 6,503 with 64.
///
/// A prompt of a few tokens over few experts (the GPU tests' gpt-oss model: 8 experts, 4
/// a token) also runs in tiles of one (or, where the device runs them, in MXFP4's int8
/// tiles), whose Q8 input rounds the GPU's activations as the CPU rounds its own; those
/// tests hold such rows to bounds widened by the CPU's own
/// distance from the exact products (`model/tests/real_models/synthetic/gpu.rs`,
/// `Exact`).
pub fn tile_tokens_for(
    n_slots: usize,
    n_experts: usize,
    n_ff: usize,
    skinny: SkinnyTiles,
) -> usize {
    let wide = n_ff >= WIDE_EXPERT_FF;
    if skinny != SkinnyTiles::No {
        let from = if skinny == SkinnyTiles::Q8 {
            Q8_SKINNY_FROM_SLOTS_PER_EXPERT
        } else if wide {
            WIDE_SKINNY_FROM_SLOTS_PER_EXPERT
        } else {
            SKINNY_FROM_SLOTS_PER_EXPERT
        };
        if n_slots >= from * n_experts {
            if skinny == SkinnyTiles::Q8 && n_slots < Q8_SKINNY_32_FROM_SLOTS_PER_EXPERT * n_experts
            {
                return 16;
            }
            let from_64 = match (skinny, wide) {
                (SkinnyTiles::Q8, false) => Q8_SKINNY_64_FROM_SLOTS_PER_EXPERT,
                (SkinnyTiles::Q8, true) => WIDE_Q8_SKINNY_64_FROM_SLOTS_PER_EXPERT,
                _ => SKINNY_64_FROM_SLOTS_PER_EXPERT,
            };
            if n_slots < from_64 * n_experts {
                return 32;
            }
            if n_slots < SKINNY_UNTIL_SLOTS_PER_EXPERT * n_experts {
                return 64;
            }
        }
    }
    let matmul_from = if wide {
        WIDE_MATMUL_FROM_SLOTS_PER_EXPERT
    } else {
        MATMUL_FROM_SLOTS_PER_EXPERT
    };
    if n_slots >= matmul_from * n_experts {
        MATMUL_TILE_TOKENS
    } else if wide && n_slots >= WIDE_TILES_FROM_SLOTS_PER_EXPERT * n_experts {
        WIDE_TILE_TOKENS
    } else {
        1
    }
}

/// The most tiles `n_slots` slots over `n_experts` experts take in tiles of
/// `tile_tokens`: every slot its own, or the full tiles plus one part-filled tile for
/// each expert with slots.
pub fn max_tiles(n_slots: usize, n_experts: usize, tile_tokens: usize) -> usize {
    if tile_tokens <= 1 {
        n_slots
    } else {
        n_slots.div_ceil(tile_tokens) + n_experts.min(n_slots)
    }
}
