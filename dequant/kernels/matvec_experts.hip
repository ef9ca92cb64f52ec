// matvec_experts.hip: the decode products of a mixture of experts' routed experts, for a
// few tokens: the gate and up products of tiles of slots routed to one expert, and the
// down products with the slots' weighted sum fused.
//
// Included by matvec.hip at the end of each weight type's unit, so that a type's expert
// products share its module with its dense ones. They run on the dense products' parts:
// the weight tasks and the Q8 activations (row_dots), the row reductions (reduce_row),
// and the rows a workgroup takes, chosen as for a dense product of the same width
// (with_group_rows), with 8 rows (16 threads a row) among the choices for one slot a
// tile.
//
// Launchers, all returning the platform's native status (0 on success); only the
// quantized types' units run them, the float types' return hipErrorInvalidValue:
//   rf_matvec_experts_NAME(weights, outs, n_mats, rows, n_cols, expert_bytes, tiles,
//                          n_tiles, tile_tokens, order, slot_div, xq, n_x, device, stream)
//   rf_matvec_experts_sum_NAME(weights, expert_bytes, rows, n_cols, ids, slot_weights, k,
//                              n_tokens, xq, n_x, out, device, stream)
// The Rust wrappers in src/gpu/matvec.rs are their only callers and check every length.

namespace rf {

// The products of routed experts (a mixture of experts), by tiles of up to NT tokens
// routed to one expert: tile blockIdx.y is (expert, first, count) in `tiles`, its
// tokens the slots order[first .. first + count). A slot is one token's choice of one
// expert; its activations are row slot / slot_div of the Q8 input (n_x rows): the
// token's (slot_div = experts per token) or the slot's own (slot_div = 1). Each matrix
// m (one or two: gate and up) is `experts` matrices of `rows` rows one after the other,
// expert_bytes apart; slot s's output is row s of y[m] (rows values each). A tile with
// no tokens (the grid is sized for the most tiles a routing can take) does nothing.
//
// With expert_bytes 0 (tiles of one slot only), w[m] is instead a table of `experts`
// addresses, one matrix each (device memory, or host memory mapped for the device: a
// mixture larger than its budget reads the experts it does not hold where they lie).
struct ExpertMats {
    const uint8_t* w[2];
    float* y[2];
    int n_mats;
    int rows;
    size_t expert_bytes;
};

// Expert `expert`'s matrix: expert_bytes apart from w, or, for kTable (expert_bytes 0),
// where the table w says (see ExpertMats). A kernel of its own for each: a choice at run
// time made the packed products slower (one to four percent on an H200).
template <bool kTable>
__device__ __forceinline__ const uint8_t* expert_matrix(const uint8_t* w, size_t expert_bytes,
                                                        int expert) {
    if constexpr (kTable) {
        return reinterpret_cast<const uint8_t* const*>(w)[expert];
    } else {
        return w + (size_t)expert * expert_bytes;
    }
}

template <typename W, int NT, int kRows, int RPT, bool kTable>
__global__ void __launch_bounds__(kMatvecThreads)
    matvec_experts_kernel(ExpertMats mats, int n_cols, const int* __restrict__ tiles,
                          const int* __restrict__ order, int slot_div,
                          const uint8_t* __restrict__ xq, int n_x) {
    constexpr int tpr = kMatvecThreads / kRows;
    const int sub = threadIdx.x / tpr, lane = threadIdx.x % tpr;
    rf_chain_wait();  // the tiles and the activations come from the kernels before
    const int expert = tiles[3 * blockIdx.y];
    const int first = tiles[3 * blockIdx.y + 1];
    const int count = tiles[3 * blockIdx.y + 2];
    if (count <= 0) return;  // the whole workgroup leaves together
    int slot[NT], xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        // A tile of fewer tokens repeats its last (its results are dropped): measured on
        // an H200, skipping the missing tokens' dot products instead made the launches
        // slower (the unrolled loops then branch per token).
        slot[j] = order[first + (j < count ? j : count - 1)];
        xr[j] = slot[j] / slot_div;
    }
    const int total = mats.n_mats * mats.rows;
    const size_t row_bytes = (size_t)(n_cols / W::kValues) * W::kBytes;
    const uint8_t* rows[RPT];
    bool live[RPT];
    int mat[RPT], local[RPT];
    bool any = false;
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) {
        const int g = (blockIdx.x * kRows + sub) * RPT + rr;
        live[rr] = g < total;
        any = any || live[rr];
        const int gg = live[rr] ? g : 0;
        mat[rr] = gg >= mats.rows ? 1 : 0;
        local[rr] = gg - mat[rr] * mats.rows;
        const uint8_t* base = mat[rr] ? mats.w[1] : mats.w[0];
        rows[rr] = expert_matrix<kTable>(base, mats.expert_bytes, expert) +
                   (size_t)local[rr] * row_bytes;
    }
    const int8_t* xqs = reinterpret_cast<const int8_t*>(xq);
    const float* xd = reinterpret_cast<const float*>(xq + (size_t)n_x * n_cols);
    const int* xsums = reinterpret_cast<const int*>(xd + (size_t)n_x * (n_cols / 32));
    float acc[RPT][NT];
    row_dots<W, NT, RPT, false>(rows, any, lane, tpr, n_cols, xqs, xd, xsums,
                                [&](int j) { return xr[j]; }, acc);
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) {
        reduce_row<NT>(acc[rr], tpr, [&](int j, float s) {
            if (!live[rr] || j >= count) return;
            float* y = (mat[rr] ? mats.y[1] : mats.y[0]) + (size_t)slot[j] * mats.rows + local[rr];
            *y = s;
        });
        if constexpr (reduce_needs_barrier(tpr)) __syncthreads();
    }
}

// The down products of a few tokens' routed slots with their weighted sum fused: the
// workgroup (x: its rows, y: token t) runs token t's k slots t·k .. t·k + k - 1 in rank
// order, slot s through expert ids[s] (`experts` matrices of `rows` rows, expert_bytes
// apart) on row s of the Q8 input (n_x rows), and adds Σ_r weights[s] · (slot s's
// product) to row t of out, summing the ranks in order as a separate weighted sum would.
// Each slot's product is matvec_experts_kernel's for a tile of that one slot; with
// expert_bytes 0, w is a table of the experts' addresses as there.
template <typename W, int kRows, int RPT, bool kTable>
__global__ void __launch_bounds__(kMatvecThreads)
    matvec_experts_sum_kernel(const uint8_t* __restrict__ w, size_t expert_bytes, int rows,
                              int n_cols, const int* __restrict__ ids,
                              const float* __restrict__ weights, int k,
                              const uint8_t* __restrict__ xq, int n_x, float* __restrict__ out) {
    constexpr int tpr = kMatvecThreads / kRows;
    const int sub = threadIdx.x / tpr, lane = threadIdx.x % tpr;
    rf_chain_wait();  // the routing and the activations come from the kernels before
    const int t = blockIdx.y;
    const size_t row_bytes = (size_t)(n_cols / W::kValues) * W::kBytes;
    int local[RPT];
    bool live[RPT];
    bool any = false;
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) {
        const int g = (blockIdx.x * kRows + sub) * RPT + rr;
        live[rr] = g < rows;
        any = any || live[rr];
        local[rr] = live[rr] ? g : 0;
    }
    const int8_t* xqs = reinterpret_cast<const int8_t*>(xq);
    const float* xd = reinterpret_cast<const float*>(xq + (size_t)n_x * n_cols);
    const int* xsums = reinterpret_cast<const int*>(xd + (size_t)n_x * (n_cols / 32));
    float total[RPT];
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) total[rr] = 0.0f;
    for (int r = 0; r < k; ++r) {
        const int s = t * k + r;
        const uint8_t* expert = expert_matrix<kTable>(w, expert_bytes, ids[s]);
        const float weight = weights[s];
        const uint8_t* slot_rows[RPT];
#pragma unroll
        for (int rr = 0; rr < RPT; ++rr) slot_rows[rr] = expert + (size_t)local[rr] * row_bytes;
        float acc[RPT][1];
        row_dots<W, 1, RPT, false>(slot_rows, any, lane, tpr, n_cols, xqs, xd, xsums,
                                   [&](int) { return s; }, acc);
#pragma unroll
        for (int rr = 0; rr < RPT; ++rr) {
            reduce_row<1>(acc[rr], tpr, [&](int, float dot) { total[rr] += dot * weight; });
            // The reduction's shared memory is used again next.
            if constexpr (reduce_needs_barrier(tpr)) __syncthreads();
        }
    }
#pragma unroll
    for (int rr = 0; rr < RPT; ++rr) {
        if (live[rr] && lane == 0) out[(size_t)t * rows + local[rr]] += total[rr];
    }
}

// Launches matvec_experts_kernel for tiles of NT tokens (1, 4 or kMaxTokens), with the rows
// a workgroup takes chosen as for the dense products.
template <typename T>
hipError_t launch_experts(const ExpertMats& mats, int n_cols, const int* tiles, int n_tiles,
                          int tile_tokens, const int* order, int slot_div, const uint8_t* xq,
                          int n_x, hipStream_t stream) {
    const unsigned total = (unsigned)(mats.n_mats * mats.rows);
    auto go = [&](auto nt) {
        constexpr int NT = decltype(nt)::value;
        constexpr int rpt = kRowsPerThread<NT>;
        auto shape = [&](auto rows, auto table) {
            constexpr int kRows = decltype(rows)::value;
            const unsigned groups = (total + kRows - 1) / kRows;
            rfLaunchChained((matvec_experts_kernel<T, NT, kRows, rpt, decltype(table)::value>),
                            dim3((groups + rpt - 1) / rpt, (unsigned)n_tiles),
                            dim3(kMatvecThreads), 0, stream, mats, n_cols, tiles, order,
                            slot_div, xq, n_x);
            return hipGetLastError();
        };
        auto packed = [&](auto rows) { return shape(rows, std::false_type{}); };
        if constexpr (NT == 1) {
            // Experts placed by a table: tiles of one slot alone.
            if (mats.expert_bytes == 0) {
                return with_group_rows<T, uint8_t, kOneTokenMaxRows>(
                    n_cols, [&](auto rows) { return shape(rows, std::true_type{}); });
            }
            return with_group_rows<T, uint8_t, kOneTokenMaxRows>(n_cols, packed);
        }
        if (mats.expert_bytes == 0) return hipErrorInvalidValue;
        return with_group_rows<T, uint8_t>(n_cols, packed);
    };
    if (tile_tokens == 1) return go(std::integral_constant<int, 1>{});
    if (tile_tokens == 4) return go(std::integral_constant<int, 4>{});
    if (tile_tokens == kMaxTokens) return go(std::integral_constant<int, kMaxTokens>{});
    return hipErrorInvalidValue;
}

// Launches matvec_experts_sum_kernel for n_tokens tokens of k slots each, the rows a
// workgroup takes chosen as for one-slot tiles; the float types return
// hipErrorInvalidValue (they take no expert products).
template <typename T, typename X>
hipError_t launch_experts_sum(const uint8_t* w, size_t expert_bytes, int rows, int n_cols,
                              const int* ids, const float* weights, int k, int n_tokens,
                              const uint8_t* xq, int n_x, float* out, hipStream_t stream) {
    if constexpr (std::is_same<X, uint8_t>::value) {
        constexpr int rpt = kRowsPerThread<1>;
        auto shape = [&](auto group, auto table) {
            constexpr int kRows = decltype(group)::value;
            const unsigned groups = ((unsigned)rows + kRows - 1) / kRows;
            rfLaunchChained((matvec_experts_sum_kernel<T, kRows, rpt, decltype(table)::value>),
                            dim3((groups + rpt - 1) / rpt, (unsigned)n_tokens),
                            dim3(kMatvecThreads), 0, stream, w, expert_bytes, rows, n_cols, ids,
                            weights, k, xq, n_x, out);
            return hipGetLastError();
        };
        if (expert_bytes == 0) {
            return with_group_rows<T, uint8_t, kOneTokenMaxRows>(
                n_cols, [&](auto group) { return shape(group, std::true_type{}); });
        }
        return with_group_rows<T, uint8_t, kOneTokenMaxRows>(
            n_cols, [&](auto group) { return shape(group, std::false_type{}); });
    } else {
        return hipErrorInvalidValue;
    }
}

// launch_experts for the quantized types; the float types take no expert products.
template <typename T, typename X>
hipError_t launch_experts_of(const ExpertMats& mats, int n_cols, const int* tiles, int n_tiles,
                             int tile_tokens, const int* order, int slot_div, const uint8_t* xq,
                             int n_x, hipStream_t stream) {
    if constexpr (std::is_same<X, uint8_t>::value) {
        return launch_experts<T>(mats, n_cols, tiles, n_tiles, tile_tokens, order, slot_div, xq,
                                 n_x, stream);
    } else {
        return hipErrorInvalidValue;
    }
}

}  // namespace rf

extern "C" {

// The products of routed experts (see matvec_experts_kernel): weights[m] (n_mats of 1
// or 2) hold the experts' matrices of `rows` × n_cols, expert_bytes apart (or, with
// expert_bytes 0, a table of their addresses); outs[m] one row per slot. tiles: n_tiles triples (expert, first, count) of at most tile_tokens (1,
// 4 or 8) slots each, order the slots grouped by expert; xq: Q8 blocks of n_x rows. Only
// the quantized types' units run it; the float types' return hipErrorInvalidValue.
int RF_MATVEC_JOIN(rf_matvec_experts, RF_MATVEC_NAME)(
    const void* const* weights, void* const* outs, int n_mats, int rows, int n_cols,
    size_t expert_bytes, const void* tiles, int n_tiles, int tile_tokens, const void* order,
    int slot_div, const void* xq, int n_x, int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (n_mats < 1 || n_mats > 2 || rows < 1 || n_tiles < 1 || n_tiles > 65535 || slot_div < 1)
        return (int)hipErrorInvalidValue;
    rf::ExpertMats mats = {};
    for (int m = 0; m < n_mats; ++m) {
        mats.w[m] = (const uint8_t*)weights[m];
        mats.y[m] = (float*)outs[m];
    }
    mats.n_mats = n_mats;
    mats.rows = rows;
    mats.expert_bytes = expert_bytes;
    return (int)rf::launch_experts_of<rf::UnitType, rf::UnitInput>(
        mats, n_cols, (const int*)tiles, n_tiles, tile_tokens, (const int*)order, slot_div,
        (const uint8_t*)xq, n_x, (hipStream_t)stream);
}

// Routed down products with the weighted sum fused (see matvec_experts_sum_kernel):
// weights: `experts` matrices of rows × n_cols, expert_bytes apart (or, with expert_bytes
// 0, a table of their addresses); ids and slot_weights:
// n_tokens × k slots in rank order; xq: Q8 blocks of n_x = n_tokens × k rows, one a slot;
// out: n_tokens × rows, added to. Only the quantized types' units run it.
int RF_MATVEC_JOIN(rf_matvec_experts_sum, RF_MATVEC_NAME)(
    const void* weights, size_t expert_bytes, int rows, int n_cols, const void* ids,
    const void* slot_weights, int k, int n_tokens, const void* xq, int n_x, void* out,
    int device, void* stream) {
    hipError_t status = hipSetDevice(device);
    if (status != hipSuccess) return (int)status;
    if (rows < 1 || k < 1 || n_tokens < 1 || n_tokens > 65535 || n_x != n_tokens * k)
        return (int)hipErrorInvalidValue;
    return (int)rf::launch_experts_sum<rf::UnitType, rf::UnitInput>(
        (const uint8_t*)weights, expert_bytes, rows, n_cols, (const int*)ids,
        (const float*)slot_weights, k, n_tokens, (const uint8_t*)xq, n_x, (float*)out,
        (hipStream_t)stream);
}

}  // extern "C"
