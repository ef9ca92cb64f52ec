//! How the routed products cut a routing into tiles: the tile sizes by slots an expert
//! and kind of products, the most tiles a routing takes, and which input each takes.

use super::experts::*;
use super::matvec::MAX_TOKENS;
use gguf_format::GgmlType;

/// Slots, experts, their width, the skinny products the device and types allow, and the
/// tile size [`tile_tokens_for`] must give.
const TILE_SIZES: &[(usize, usize, usize, SkinnyTiles, usize)] = {
    use SkinnyTiles::{No, F16, Q8};
    const MM: usize = MATMUL_TILE_TOKENS;
    const WIDE: usize = WIDE_TILE_TOKENS;
    &[
        // One slot a tile while the experts get few; the matrix units from eight slots
        // an expert on average (128 sequences of Qwen3-30B-A3B's 128 experts of 768).
        (8, 128, 768, No, 1),
        (512, 128, 768, No, 1),
        (1023, 128, 768, No, 1),
        (1024, 128, 768, No, MM),
        (4096, 128, 768, No, MM),
        // Few narrow experts, the same count an expert.
        (255, 32, 256, No, 1),
        (256, 32, 256, No, MM),
        // Wide experts (gpt-oss-20b's 32 of 2880, 4 a token): tiles of one to 23
        // sequences, of four to 79, the matrix units from 80.
        (64, 32, 2880, No, 1),
        (95, 32, 2880, No, 1),
        (96, 32, 2880, No, WIDE),
        (319, 32, 2880, No, WIDE),
        (320, 32, 2880, No, MM),
        // The f16 skinny products: wide experts take tiles of 32 from five slots an
        // expert (tiles of four below), others from three (tiles of one below); 64 from
        // 40 slots an expert whatever the width, the tiled kernel again from 96.
        (95, 32, 2880, F16, 1),
        (159, 32, 2880, F16, WIDE),
        (160, 32, 2880, F16, 32),
        (1279, 32, 2880, F16, 32),
        (2048, 32, 2880, F16, 64),
        (96 * 32, 32, 2880, F16, MM),
        (383, 128, 768, F16, 1),
        (384, 128, 768, F16, 32),
        (16 * 128, 128, 768, F16, 32),
        (4096, 128, 768, F16, 32),
        // MXFP4's int8 products: 16 from two slots an expert, 32 from 12, 64 from 24 for
        // wide experts and from 16 for others, the tiled kernel from 96.
        (63, 32, 2880, Q8, 1),
        (64, 32, 2880, Q8, 16),
        (383, 32, 2880, Q8, 16),
        (384, 32, 2880, Q8, 32),
        (767, 32, 2880, Q8, 32),
        (768, 32, 2880, Q8, 64),
        (96 * 32 - 1, 32, 2880, Q8, 64),
        (96 * 32, 32, 2880, Q8, MM),
        (12 * 128, 128, 768, Q8, 32),
        (16 * 128 - 1, 128, 768, Q8, 32),
        (16 * 128, 128, 768, Q8, 64),
    ]
};

#[test]
fn tile_sizes_follow_the_slots_an_expert() {
    for &(slots, experts, ff, skinny, tile) in TILE_SIZES {
        assert_eq!(
            tile_tokens_for(slots, experts, ff, skinny),
            tile,
            "{slots} slots over {experts} experts of {ff}, {skinny:?}"
        );
    }
}

#[test]
fn tiles_cover_every_routing() {
    // One slot a tile: a tile per slot.
    assert_eq!(max_tiles(8, 128, 1), 8);
    // Tiles of eight: 4096 slots over 128 experts take at most 512 full tiles and one
    // part-filled tile per expert.
    assert_eq!(max_tiles(4096, 128, 8), 512 + 128);
    // Fewer slots than experts: at most one part-filled tile per slot.
    assert_eq!(max_tiles(16, 32, 8), 2 + 16);
    // Tiles of four never take more tiles than slots where they run.
    assert!(max_tiles(96, 32, WIDE_TILE_TOKENS) <= 96);
    assert_eq!(max_tiles(4096, 128, MATMUL_TILE_TOKENS), 32 + 128);
}

#[test]
fn the_tiles_say_which_input_they_take() {
    assert!(SKINNY_TILE_TOKENS
        .iter()
        .all(|&t| takes_f16(t, SkinnyTiles::F16)));
    assert!(!SKINNY_TILE_TOKENS
        .iter()
        .any(|&t| takes_f16(t, SkinnyTiles::Q8)));
    assert!(takes_f16(MATMUL_TILE_TOKENS, SkinnyTiles::Q8));
    for skinny in [SkinnyTiles::No, SkinnyTiles::F16, SkinnyTiles::Q8] {
        assert!([1, WIDE_TILE_TOKENS, MAX_TOKENS]
            .iter()
            .all(|&t| !takes_f16(t, skinny)));
    }
}

#[test]
fn mxfp4_takes_the_int8_products_only_where_every_tensor_and_width_allow() {
    use GgmlType::{IQ2_XS, MXFP4, Q4_K, Q8_0};
    let cases: [(bool, &[GgmlType], &[usize], SkinnyTiles); 6] = [
        (true, &[MXFP4; 3], &[2880, 2880], SkinnyTiles::Q8),
        (true, &[MXFP4; 3], &[2880, 800], SkinnyTiles::F16),
        (true, &[MXFP4, Q8_0], &[2880], SkinnyTiles::F16),
        (true, &[Q4_K; 3], &[2048, 768], SkinnyTiles::F16),
        (false, &[MXFP4; 3], &[2880], SkinnyTiles::No),
        (true, &[IQ2_XS, Q4_K], &[2048], SkinnyTiles::No),
    ];
    for (device, types, widths, want) in cases {
        assert_eq!(
            skinny_tiles(device, types, widths),
            want,
            "{types:?} {widths:?}"
        );
    }
}
