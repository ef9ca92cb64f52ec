// matmul_launch.h: how the batch products are launched: the grid of tiles, the split of
// the columns, and the choice between the tiled kernel and the skinny one. Included by
// matmul.hip, after matmul_kernel and skinny.hip.
#ifndef ROCMFORGE_DEQUANT_MATMUL_LAUNCH_H
#define ROCMFORGE_DEQUANT_MATMUL_LAUNCH_H

namespace rf {

// Room for split columns that a launch was given: partial sums and tile counters.
struct SplitRoom {
    float* partials;
    long long partial_floats;
    unsigned* counters;
    int n_counters;
};

// A launch's grid: row tiles × token tiles × column splits.
struct TileGrid {
    long long tiles, token_tiles, splits;
};

// The grid of BM-row tiles for a launch. The columns are split when the tiles alone
// leave the device short of two workgroups a multiprocessor: into as many runs as fill
// it (or, with `one_round`, as many as one round of two workgroups a multiprocessor
// holds, at least two), each of at least kSplitUnits units of columns, within the room
// given. Shorter runs lose more to the round trip of the partial sums than the extra
// workgroups bring (measured on the H100: a 576-column matrix split three ways took
// longer than unsplit).
template <typename F, int BM>
TileGrid tile_grid(const MatmulMats& mats, int cols, int n_tokens, int multiprocessors,
                   const SplitRoom& room, bool one_round = false) {
    constexpr long long kSplitUnits = 8;
    TileGrid g = {0, (n_tokens + kMmTokens - 1) / kMmTokens, 1};
    for (int m = 0; m < mats.n; ++m) g.tiles += (mats.rows[m] + BM - 1) / BM;
    const long long wgs = g.tiles * g.token_tiles;
    const long long units = (cols + split_cols<F>() - 1) / split_cols<F>();
    if (room.partials && room.counters && wgs <= room.n_counters) {
        const long long want = one_round ? max(2LL, 2LL * multiprocessors / wgs)
                                         : (2LL * multiprocessors + wgs - 1) / wgs;
        const long long fit =
            room.partial_floats / (wgs * kMmThreads * (long long)(BM * kMmTokens / kMmThreads));
        const long long splits = min(min(want, units / kSplitUnits), min(fit, 16LL));
        if (splits >= 2) g.splits = splits;
    }
    return g;
}

template <typename F, int BM, bool kExperts = false>
hipError_t launch_tiles(const MatmulMats& mats, int cols, const __half* x, const float* scales,
                        int n_tokens, int accumulate, bool staged, const TileGrid& g,
                        SplitRoom room, hipStream_t stream, ExpertTiles et = {}) {
    const int bytes = shared_bytes<F, BM>(staged);
#if defined(ROCMFORGE_HIP_NVIDIA)
    // Past 48 KB a kernel's shared memory needs raising its limit, once a device. The
    // kernel's own (static) shared memory counts in the 48 KB too: its slots of routed
    // tokens and its split's flag take well under 1 KB.
    static std::atomic<unsigned long long> raised{0};
    if (bytes > 47 * 1024) {
        const hipError_t status =
            rf_raise_shared_memory(matmul_kernel<F, BM, kExperts>, bytes, raised);
        if (status != hipSuccess) return status;
    }
#endif
    const dim3 grid((unsigned)g.token_tiles, (unsigned)g.tiles, (unsigned)g.splits);
    rfLaunchChained((matmul_kernel<F, BM, kExperts>), grid, dim3(kMmThreads), (size_t)bytes, stream,
                    mats, cols, x, scales, n_tokens, accumulate, (int)g.splits, room.partials,
                    room.counters, et);
    return hipGetLastError();
}

// The routed experts' products over `n_tiles` tiles of up to `tile_tokens` slots
// (ExpertTiles; the grid: x the tiles, y the row tiles of each matrix), unsplit: tiles
// of up to kSkinnyMaxTokens slots through the skinny kernel where it takes them, else
// 128-row tiles where they give two workgroups a multiprocessor for the tiles a routing
// fills (one per expert when every expert has slots), 64-row ones otherwise.
template <typename F>
hipError_t launch_matmul_experts(const MatmulMats& mats, int cols, const __half* x,
                                 const float* scales, int n_tiles, int tile_tokens,
                                 int n_experts, const ExpertTiles& et, int device,
                                 hipStream_t stream) {
    const DeviceFacts facts = device_facts(device);
    // (Only the types the skinny kernel reads with loads of their own get its experts'
    // code: the others would not take it.)
    if constexpr (SkinnyFast<F>::value) {
        if (skinny_experts_take<F>(mats, et, tile_tokens, facts.staged)) {
            return launch_skinny_experts<F>(mats, cols, x, scales, n_tiles, tile_tokens, et,
                                            stream);
        }
    }
    TileGrid g = {0, n_tiles, 1};
    for (int m = 0; m < mats.n; ++m) g.tiles += (mats.rows[m] + 127) / 128;
    const long long filled = (long long)min(n_tiles, n_experts) * g.tiles;
    if (filled >= 2LL * facts.multiprocessors) {
        return launch_tiles<F, 128, true>(mats, cols, x, scales, 0, 0, facts.staged, g,
                                          SplitRoom{}, stream, et);
    }
    g.tiles = 0;
    for (int m = 0; m < mats.n; ++m) g.tiles += (mats.rows[m] + 63) / 64;
    return launch_tiles<F, 64, true>(mats, cols, x, scales, 0, 0, facts.staged, g, SplitRoom{},
                                     stream, et);
}

// Token tiles from which a matrix of few rows takes 128-row tiles split in two (see
// launch_matmul).
constexpr long long kMmRoundTokenTiles = 4;

// Tokens past whole tiles that the skinny kernel takes, for matrices (all of a launch)
// of at least kMmTailMinBytes (see launch_matmul).
constexpr int kMmTailTokens = 32;
constexpr long long kMmTailMinBytes = 16ll << 20;

// The bytes of the blocks of every matrix of `mats`, `cols` wide.
template <typename F>
long long matrices_bytes(const MatmulMats& mats, int cols) {
    long long bytes = 0;
    for (int m = 0; m < mats.n; ++m) {
        bytes += (long long)mats.rows[m] * (cols / F::kValues) * F::kBytes;
    }
    return bytes;
}

// Which kernel a product takes (rf_matmul's `kernel`): the one measured fastest for its
// type and count, the tiled kernel, or the skinny one (refused where it does not apply).
enum MatmulKernel { kMatmulAuto = 0, kMatmulTiles = 1, kMatmulSkinny = 2 };

template <typename F>
hipError_t launch_matmul(const MatmulMats& mats, int cols, const __half* x, const float* scales,
                         int n_tokens, int accumulate, SplitRoom room, int kernel, int device,
                         hipStream_t stream) {
    const DeviceFacts facts = device_facts(device);
    const int sms = facts.multiprocessors;
    if (kernel != kMatmulTiles) {
        if (skinny_takes<F>(mats, n_tokens, facts.staged, kernel == kMatmulSkinny)) {
            return launch_skinny<F>(mats, cols, x, scales, n_tokens, accumulate, sms,
                                    room.partials, room.partial_floats, room.counters,
                                    room.n_counters, stream);
        }
        if (kernel == kMatmulSkinny) return hipErrorInvalidValue;
    }
    // A count just past whole tiles of tokens, on large matrices: the whole tiles here,
    // the few tokens left through the skinny kernel. A last tile of a few tokens costs
    // about as much as a full one. On the H200, a 7B's Q4_K and Q6_K products (one launch
    // of q, k and v, of gate and up, the down projection, the output) at 130 tokens took
    // 0.58-0.85x the time of tiles alone this way, at 160 tokens 0.66-0.96x; with 64
    // tokens left (192), or on the 9 MB attention output matrix, no gain or a loss.
    const int rest = n_tokens % kMmTokens;
    if (kernel == kMatmulAuto && n_tokens > kMmTokens && rest > 0 && rest <= kMmTailTokens &&
        matrices_bytes<F>(mats, cols) >= kMmTailMinBytes &&
        skinny_takes<F>(mats, rest, facts.staged, false)) {
        const int whole = n_tokens - rest;
        const hipError_t status = launch_matmul<F>(mats, cols, x, scales, whole, accumulate,
                                                   room, kMatmulTiles, device, stream);
        if (status != hipSuccess) return status;
        MatmulMats tail = mats;
        for (int m = 0; m < mats.n; ++m) tail.y[m] += (size_t)whole * mats.rows[m];
        return launch_skinny<F>(tail, cols, x + (size_t)whole * cols, scales + whole, rest,
                                accumulate, sms, room.partials, room.partial_floats,
                                room.counters, room.n_counters, stream);
    }
    const TileGrid big = tile_grid<F, 128>(mats, cols, n_tokens, sms, room);
    // 128-row tiles when they alone give two workgroups per multiprocessor (each holds
    // two); 64-row ones otherwise, split when those too leave it short. (128-row tiles
    // split instead gave the same time where 64-row ones are split too, and took 1.4x
    // as long where 64-row ones fill the device unsplit: a 7B's gate and up at 32
    // tokens on the H100.)
    if (big.tiles * big.token_tiles >= 2LL * sms) {
        return launch_tiles<F, 128>(mats, cols, x, scales, n_tokens, accumulate, facts.staged,
                                    big, room, stream);
    }
    // Except for prompts of kMmRoundTokenTiles token tiles and more, where 128-row tiles
    // split in two make one round of one to two workgroups a multiprocessor. On the H200
    // at 512 tokens, a 7B's down projection took 0.75x (Q4_K) and 0.85x (Q6_K) the time
    // of split 64-row tiles this way, its attention output 0.90x and 0.98x. At 256 tokens
    // (split in four, or in two with three workgroups a multiprocessor) they took 1.1-1.2x
    // as long, as did 96 tokens.
    const long long big_wgs = big.tiles * big.token_tiles;
    if (big.token_tiles >= kMmRoundTokenTiles && big_wgs >= sms / 2 && big_wgs <= sms) {
        const TileGrid round = tile_grid<F, 128>(mats, cols, n_tokens, sms, room, true);
        if (round.splits == 2) {
            return launch_tiles<F, 128>(mats, cols, x, scales, n_tokens, accumulate,
                                        facts.staged, round, room, stream);
        }
    }
    const TileGrid small = tile_grid<F, 64>(mats, cols, n_tokens, sms, room);
    return launch_tiles<F, 64>(mats, cols, x, scales, n_tokens, accumulate, facts.staged, small,
                               room, stream);
}

}  // namespace rf

#endif  // ROCMFORGE_DEQUANT_MATMUL_LAUNCH_H
