// FP8 (e4m3) paged decode attention in CUDA C++, compiled at run time by NVRTC (cuda_fp8_decode.py).
//
// One block per (KV head, request, split), as the Triton kernel's programs, over a head-major pool
// [kv_heads, tokens, HEAD_DIM] of e4m3 rows with page size 1 (one row per token location).
//
// Why below Triton: Triton's FP8 kernel gathers each block of keys into registers, so a program
// holds one block in flight and the register file caps a multiprocessor at 12 warps waiting on
// their loads (about 65% of copy bandwidth). Here every thread copies its own 16-byte chunks of
// K and V rows into shared memory with cp.async, STAGES tiles ahead, and computes only on the
// chunks it copied itself: no block-wide barrier in the loop, and the bytes in flight are set by
// STAGES, not by registers. A row is HEAD_DIM bytes: LANES = HEAD_DIM / 16 neighbouring lanes
// hold one token's row, so a warp covers 32 / LANES tokens per pass and each lane's 16 dimensions
// are fixed (its query slice stays in registers).
//
// Scores are in log2 units (the query is scaled by sm_scale * log2(e)); the log-sum-exp written
// for a split's merge is in natural units, as the Triton kernels write it.
//
// Products are fp32 FMAs on CUDA cores. A tensor-core variant (mma.m16n8k16 with fragments laid
// out as whole 16-byte chunks) ran 57% of the instructions but was latency-bound and slower, 105-114
// against 97 us at 256 x 600 (docs/attention-kernels.md; its code is in commit 37d3605).
//
// No header is included (NVRTC finds none without a toolkit): the e4m3 conversions, cp.async and
// the bf16/fp16 stores are inline PTX for sm_89 and later.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 2
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef TILE
#define TILE 64
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef OUT_BF16
#define OUT_BF16 1
#endif
#ifndef SEQ_T  // the sequence lengths' type: int (the backend's plan) or long long (a CUDA graph's)
#define SEQ_T int
#endif
#ifndef LOADS_ONLY  // 1: copy the rows and skip the arithmetic (the access pattern's bandwidth)
#define LOADS_ONLY 0
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

constexpr int LANES = HEAD_DIM / 16;
constexpr int THREADS = WARPS * 32;
constexpr int TOKENS_PER_PASS = THREADS / LANES;
constexpr int PASSES = TILE / TOKENS_PER_PASS;
#define NEG_INF (__int_as_float(0xff800000))
constexpr float LN2 = 0.6931471805599453f;
constexpr float LOG2E = 1.4426950408889634f;

static_assert(HEAD_DIM % 16 == 0 && 32 % LANES == 0, "HEAD_DIM must be 16, 32, 64, 128 or 256");
static_assert(TILE % TOKENS_PER_PASS == 0, "TILE must be a multiple of THREADS * 16 / HEAD_DIM");
static_assert(STAGES >= 2, "at least two stages");

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes from global into shared memory, asynchronously; zero-filled when !valid
__device__ __forceinline__ void copy16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void wait_pending() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// four e4m3 values (byte 0 first) to floats
__device__ __forceinline__ void e4m3x4(u32 x, float* f) {
    u32 lo, hi;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi)
        : "r"(x));
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(f[0]), "=f"(f[1])
        : "r"(lo));
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
        : "=f"(f[2]), "=f"(f[3])
        : "r"(hi));
}

__device__ __forceinline__ void e4m3x16(uint4 c, float* f) {
    e4m3x4(c.x, f);
    e4m3x4(c.y, f + 4);
    e4m3x4(c.z, f + 8);
    e4m3x4(c.w, f + 12);
}

__device__ __forceinline__ float half_bits_to_float(u16 h) {
#if OUT_BF16
    return __int_as_float(((u32)h) << 16);
#else
    float f;
    asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ u16 float_to_half_bits(float f) {
    u16 h;
#if OUT_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("{ .reg .f16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
#endif
    return h;
}

__device__ __forceinline__ float warp_max_across_tokens(float x) {
#pragma unroll
    for (int o = LANES; o < 32; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum_across_tokens(float x) {
#pragma unroll
    for (int o = LANES; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float sum_across_row(float x) {
#pragma unroll
    for (int o = 1; o < LANES; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

struct KeyRange {
    int start, end;
};

// Split `split` of request b's keys, in whole tiles. With shared prefixes (cascade attention,
// prefix_splits > 0) the row's own keys start at START[b] (the prefix kernel attends to the rest),
// and split 0 of a row in no group marks its prefix slots empty for the merge, as the Triton
// kernel does.
__device__ __forceinline__ KeyRange split_range(int seq_len, int b, int kv_head, int split, int num_splits,
                                                int prefix_splits, int tile, const int* START, float* PART_LSE,
                                                i64 stride_lb, i64 stride_lh) {
    int first = 0;
    if (prefix_splits > 0) {
        first = START[b];
        if (split == 0 && first == 0)
            for (int i = threadIdx.x; i < GROUP * prefix_splits; i += blockDim.x)
                PART_LSE[b * stride_lb + (kv_head * GROUP + i / prefix_splits) * stride_lh + num_splits +
                         i % prefix_splits] = NEG_INF;
    }
    const int per_split = ((seq_len - first + num_splits - 1) / num_splits + tile - 1) / tile * tile;
    const int start = first + split * per_split;
    return {start, min(start + per_split, seq_len)};
}

extern "C" __global__ void __launch_bounds__(THREADS) fp8_decode_split(
    const u16* __restrict__ Q,               // [B, heads, HEAD_DIM], bf16 or fp16
    const unsigned char* __restrict__ K,     // one layer: [kv_heads, tokens, HEAD_DIM] e4m3
    const unsigned char* __restrict__ V,
    const int* __restrict__ TABLE,           // [rows, stride_tr] token locations
    const i64* __restrict__ ROWS,            // [B] each request's table row (int64)
    const SEQ_T* __restrict__ SEQ_LEN,       // [B] int32 or int64 (SEQ_T)
    const int* __restrict__ ORDER,           // [B] longest first (read when ordered)
    const int* __restrict__ START,           // [B] where a row's own keys start (read when prefix_splits > 0)
    float* __restrict__ PART_O,              // [B, heads, slots, HEAD_DIM] (more than one slot)
    float* __restrict__ PART_LSE,            // [B, heads, slots]
    u16* __restrict__ O,                     // [B, heads, HEAD_DIM] (one slot: no merge)
    i64 stride_qb, i64 stride_qh, i64 stride_kn, i64 stride_kh, i64 stride_tr,
    i64 stride_pb, i64 stride_ph, i64 stride_ps, i64 stride_lb, i64 stride_lh,
    i64 stride_ob, i64 stride_oh,
    float sm_scale, float v_scale, int num_splits, int ordered, int prefix_splits) {
    extern __shared__ uint4 smem[];  // [STAGES][2 (K, V)][PASSES][THREADS]; reused for the reduction

    const int kv_head = blockIdx.x;
    const int b = ordered ? ORDER[blockIdx.y] : (int)blockIdx.y;
    const int split = blockIdx.z;
    const int seq_len = (int)SEQ_LEN[b];
    const int* table = TABLE + (i64)ROWS[b] * stride_tr;
    const KeyRange range = split_range(seq_len, b, kv_head, split, num_splits, prefix_splits, TILE, START, PART_LSE,
                                       stride_lb, stride_lh);
    const int start = range.start, end = range.end;
    const int tiles = end > start ? (end - start + TILE - 1) / TILE : 0;

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int part = tid % LANES;    // which 16 bytes (16 dimensions) of a row
    const int first = tid / LANES;   // this thread's first token in a tile; then every TOKENS_PER_PASS
    const unsigned char* k_base = K + kv_head * stride_kh + part * 16;
    const unsigned char* v_base = V + kv_head * stride_kh + part * 16;
    const u32 smem_base = shared_address(smem);

    float q[GROUP][16];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const uint4* src = reinterpret_cast<const uint4*>(Q + b * stride_qb + (kv_head * GROUP + g) * stride_qh + part * 16);
        const uint4 w[2] = {src[0], src[1]};
        const u16* h = reinterpret_cast<const u16*>(w);
#pragma unroll
        for (int d = 0; d < 16; ++d) q[g][d] = half_bits_to_float(h[d]) * (sm_scale * LOG2E);
    }

    // table entries of tile `t` for this thread's tokens
    int loc_next[PASSES];
    auto read_locations = [&](int t, int* loc) {
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            const int token = start + t * TILE + first + p * TOKENS_PER_PASS;
            loc[p] = (t < tiles && token < end) ? table[token] : -1;
        }
    };
    auto issue = [&](int slot, const int* loc) {
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            const i64 offset = loc[p] >= 0 ? (i64)loc[p] * stride_kn : 0;
            const u32 k_dst = smem_base + (((slot * 2 + 0) * PASSES + p) * THREADS + tid) * 16;
            const u32 v_dst = smem_base + (((slot * 2 + 1) * PASSES + p) * THREADS + tid) * 16;
            copy16(k_dst, k_base + offset, loc[p] >= 0);
            copy16(v_dst, v_base + offset, loc[p] >= 0);
        }
        commit();  // one group per tile, empty past the last, so that wait_pending counts tiles
    };

#pragma unroll
    for (int t = 0; t < STAGES; ++t) {
        int loc[PASSES];
        read_locations(t, loc);
        issue(t, loc);
    }
    read_locations(STAGES, loc_next);

    float m[GROUP], l[GROUP], acc[GROUP][16];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int d = 0; d < 16; ++d) acc[g][d] = 0.f;
    }
#if LOADS_ONLY
    u32 sink = 0;
#endif

    for (int t = 0; t < tiles; ++t) {
        int loc_after[PASSES];
        read_locations(t + STAGES + 1, loc_after);  // consumed next iteration: its latency is hidden
        wait_pending<STAGES - 1>();
        const int slot = t % STAGES;
        const uint4* k_tile = smem + (slot * 2 + 0) * PASSES * THREADS + tid;
        const uint4* v_tile = smem + (slot * 2 + 1) * PASSES * THREADS + tid;
#if LOADS_ONLY
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            const uint4 kc = k_tile[p * THREADS], vc = v_tile[p * THREADS];
            sink ^= kc.x ^ kc.y ^ kc.z ^ kc.w ^ vc.x ^ vc.y ^ vc.z ^ vc.w;
        }
#else
        float s[PASSES][GROUP];
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            float k[16];
            e4m3x16(k_tile[p * THREADS], k);
            const bool valid = start + t * TILE + first + p * TOKENS_PER_PASS < end;
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int d = 0; d < 16; ++d) dot = fmaf(q[g][d], k[d], dot);
                dot = sum_across_row(dot);
                s[p][g] = valid ? dot : NEG_INF;
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float tile_max = s[0][g];
#pragma unroll
            for (int p = 1; p < PASSES; ++p) tile_max = fmaxf(tile_max, s[p][g]);
            const float m_new = fmaxf(m[g], warp_max_across_tokens(tile_max));
            // a warp with no key yet keeps m = -inf: nothing to rescale, every p is 0
            const float alpha = m_new == NEG_INF ? 1.f : exp2f(m[g] - m_new);
            m[g] = m_new;
            l[g] *= alpha;
            if (alpha != 1.f) {  // warp-uniform; rare once the first keys are in
#pragma unroll
                for (int d = 0; d < 16; ++d) acc[g][d] *= alpha;
            }
#pragma unroll
            for (int p = 0; p < PASSES; ++p) s[p][g] = m_new == NEG_INF ? 0.f : exp2f(s[p][g] - m_new);
        }
#pragma unroll
        for (int p = 0; p < PASSES; ++p) {
            float v[16];
            e4m3x16(v_tile[p * THREADS], v);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                l[g] += s[p][g];
#pragma unroll
                for (int d = 0; d < 16; ++d) acc[g][d] = fmaf(s[p][g], v[d], acc[g][d]);
            }
        }
#endif
        // this thread's chunks of the slot are in registers: refill it with tile t + STAGES
        issue(slot, loc_next);
#pragma unroll
        for (int p = 0; p < PASSES; ++p) loc_next[p] = loc_after[p];
    }
    wait_pending<0>();
    __syncthreads();  // every warp is done with the pipeline's buffers: reuse them

#if LOADS_ONLY
    if (sink == 0x9e3779b9u) acc[0][0] = 1.f;  // keeps the loads; never true for real data in practice
#endif
    // the warp's sums over its tokens: lanes of one row position hold the same dimensions
    float* red = reinterpret_cast<float*>(smem);  // [WARPS][GROUP][HEAD_DIM + 2]: acc, then m, l
    constexpr int RED = HEAD_DIM + 2;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const float lw = warp_sum_across_tokens(l[g]);
#pragma unroll
        for (int d = 0; d < 16; ++d) {
            const float a = warp_sum_across_tokens(acc[g][d]);
            if (lane < LANES) red[(warp * GROUP + g) * RED + part * 16 + d] = a;
        }
        if (lane == 0) {
            red[(warp * GROUP + g) * RED + HEAD_DIM] = m[g];
            red[(warp * GROUP + g) * RED + HEAD_DIM + 1] = lw;
        }
    }
    __syncthreads();

    for (int i = tid; i < GROUP * HEAD_DIM; i += THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, red[(w * GROUP + g) * RED + HEAD_DIM]);
        float total = 0.f, sum = 0.f;
        if (mx != NEG_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float scale = exp2f(red[(w * GROUP + g) * RED + HEAD_DIM] - mx);
                total += scale * red[(w * GROUP + g) * RED + d];
                sum += scale * red[(w * GROUP + g) * RED + HEAD_DIM + 1];
            }
        }
        // an empty split (past a short request's end) writes 0 and -inf, as the Triton kernel does
        const float out = sum > 0.f ? total * v_scale / sum : 0.f;
        const int head = kv_head * GROUP + g;
        if (num_splits + prefix_splits == 1) {
            O[b * stride_ob + head * stride_oh + d] = float_to_half_bits(out);
        } else {
            PART_O[b * stride_pb + head * stride_ph + split * stride_ps + d] = out;
            if (d == 0) PART_LSE[b * stride_lb + head * stride_lh + split] = sum > 0.f ? mx * LN2 + logf(sum) : NEG_INF;
        }
    }
}
