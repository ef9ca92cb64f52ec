//! How the routed products cut a routing into tiles: the tile sizes by slots an expert
//! and kind of products, the most tiles a routing takes, and which input each takes.

use super::experts::*;
use super::matvec::MAX_TOKENS;
use gguf_format::GgmlType;

#[test]
fn tiles_cover_every_routing() {
    // One slot a tile: a tile per slot.
    assert_eq!(tile_tokens_for(8, 128, 768, SkinnyTiles::No), 1);
    assert_eq!(max_tiles(8, 128, 1), 8);
    // Tiles of eight: 4096 slots over 128 experts take at most 512 full tiles and one
    // part-filled tile per expert.
    assert_eq!(max_tiles(4096, 128, 8), 512 + 128);
    // Fewer slots than experts: at most one part-filled tile per slot.
    assert_eq!(max_tiles(16, 32, 8), 2 + 16);
    // Prompts and batches: tiles of the matrix units from eight slots an expert on
    // average (128 sequences of Qwen3-30B-A3B's 128 experts of 768, 8 a token).
    assert_eq!(tile_tokens_for(512, 128, 768, SkinnyTiles::No), 1);
    assert_eq!(tile_tokens_for(1023, 128, 768, SkinnyTiles::No), 1);
    assert_eq!(
        tile_tokens_for(1024, 128, 768, SkinnyTiles::No),
        MATMUL_TILE_TOKENS
    );
    assert_eq!(
        tile_tokens_for(4096, 128, 768, SkinnyTiles::No),
        MATMUL_TILE_TOKENS
    );
    // Few narrow experts, the same count an expert.
    assert_eq!(tile_tokens_for(255, 32, 256, SkinnyTiles::No), 1);
    assert_eq!(
        tile_tokens_for(256, 32, 256, SkinnyTiles::No),
        MATMUL_TILE_TOKENS
    );
    // Wide experts (gpt-oss-20b's 32 of 2880, 4 a token): tiles of one to 23
    // sequences, of four to 79, the matrix units from 80.
    assert_eq!(tile_tokens_for(64, 32, 2880, SkinnyTiles::No), 1);
    assert_eq!(tile_tokens_for(95, 32, 2880, SkinnyTiles::No), 1);
    assert_eq!(
        tile_tokens_for(96, 32, 2880, SkinnyTiles::No),
        WIDE_TILE_TOKENS
    );
    assert_eq!(
        tile_tokens_for(319, 32, 2880, SkinnyTiles::No),
        WIDE_TILE_TOKENS
    );
    assert_eq!(
        tile_tokens_for(320, 32, 2880, SkinnyTiles::No),
        MATMUL_TILE_TOKENS
    );
    // Tiles of four never take more tiles than slots where they run.
    assert!(max_tiles(96, 32, WIDE_TILE_TOKENS) <= 96);
    assert_eq!(max_tiles(4096, 128, MATMUL_TILE_TOKENS), 32 + 128);
    // With the skinny products: wide experts take tiles of 32 from five slots an
    // expert (tiles of four below), others from three (tiles of one below); tiles of
    // 64 from 40 slots an expert, the tiled kernel again from 96.
    assert_eq!(tile_tokens_for(95, 32, 2880, SkinnyTiles::F16), 1);
    assert_eq!(
        tile_tokens_for(159, 32, 2880, SkinnyTiles::F16),
        WIDE_TILE_TOKENS
    );
    assert_eq!(tile_tokens_for(160, 32, 2880, SkinnyTiles::F16), 32);
    assert_eq!(tile_tokens_for(1279, 32, 2880, SkinnyTiles::F16), 32);
    assert_eq!(tile_tokens_for(2048, 32, 2880, SkinnyTiles::F16), 64);
    assert_eq!(
        tile_tokens_for(96 * 32, 32, 2880, SkinnyTiles::F16),
        MATMUL_TILE_TOKENS
    );
    assert_eq!(tile_tokens_for(383, 128, 768, SkinnyTiles::F16), 1);
    assert_eq!(tile_tokens_for(384, 128, 768, SkinnyTiles::F16), 32);
    assert_eq!(tile_tokens_for(4096, 128, 768, SkinnyTiles::F16), 32);
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
    // MXFP4's int8 products: tiles of 16 from two slots an expert, 32 from 12, 64
    // from 24 for wide experts and from 16 for others, the tiled kernel from 96.
    let q8 = SkinnyTiles::Q8;
    assert_eq!(tile_tokens_for(63, 32, 2880, q8), 1);
    assert_eq!(tile_tokens_for(64, 32, 2880, q8), 16);
    assert_eq!(tile_tokens_for(383, 32, 2880, q8), 16);
    assert_eq!(tile_tokens_for(384, 32, 2880, q8), 32);
    assert_eq!(tile_tokens_for(767, 32, 2880, q8), 32);
    assert_eq!(tile_tokens_for(768, 32, 2880, q8), 64);
    assert_eq!(tile_tokens_for(96 * 32 - 1, 32, 2880, q8), 64);
    assert_eq!(tile_tokens_for(96 * 32, 32, 2880, q8), MATMUL_TILE_TOKENS);
    assert_eq!(tile_tokens_for(12 * 128, 128, 768, q8), 32);
    assert_eq!(tile_tokens_for(16 * 128 - 1, 128, 768, q8), 32);
    assert_eq!(tile_tokens_for(16 * 128, 128, 768, q8), 64);
    // The f16 skinny tiles keep 64 from 40 for any width.
    assert_eq!(tile_tokens_for(16 * 128, 128, 768, SkinnyTiles::F16), 32);
    // MXFP4's int8 products only where every tensor is MXFP4 and the widths allow.
    use GgmlType::{MXFP4, Q4_K, Q8_0};
    assert_eq!(
        skinny_tiles(true, &[MXFP4; 3], &[2880, 2880]),
        SkinnyTiles::Q8
    );
    assert_eq!(
        skinny_tiles(true, &[MXFP4; 3], &[2880, 800]),
        SkinnyTiles::F16
    );
    assert_eq!(
        skinny_tiles(true, &[MXFP4, Q8_0], &[2880]),
        SkinnyTiles::F16
    );
    assert_eq!(
        skinny_tiles(true, &[Q4_K; 3], &[2048, 768]),
        SkinnyTiles::F16
    );
    assert_eq!(skinny_tiles(false, &[MXFP4; 3], &[2880]), SkinnyTiles::No);
    assert_eq!(
        skinny_tiles(true, &[GgmlType::IQ2_XS, Q4_K], &[2048]),
        SkinnyTiles::No
    );
}
