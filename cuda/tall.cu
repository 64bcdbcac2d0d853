/* Products of tall Q8_0 matrices on the tensor cores: y[i] = W x[i] for 2
 * to 64 activation rows (TALL_LO to TALL_HI by the rule; the kernel runs
 * 1 to 64 where shared memory holds its slabs and activations) where W has
 * a vocabulary's rows of a few hundred to a few thousand columns (the
 * output projections of Gemma 3 and Qwen2, tied to their Q8_0
 * embeddings). cuBLAS on the resident f16 copy reads twice the Q8_0 bytes
 * (335 MB against 178 for Gemma 3's 262,144 x 640), and the narrow
 * matrix-vector kernel, a group of lanes a row, is bound by its activation
 * loads past a row or two (cuda/NOTES.md, "Tall Q8_0 products on the
 * tensor cores").
 *
 * tall_kernel<NT>: a persistent grid of CTAs of up to 8 warps. A CTA
 * first writes the step's activations into shared memory as the f16 of
 * their 8-bit values (from the matrix-vector path's int8 values and
 * scales, so that a residual norm stays joined to their quantizer; the
 * f16 of d q, as the cuBLAS path's conversion makes them; up to 8 NT rows,
 * zeros past m), where they stay; then each warp takes slabs of 16 weight rows in turn (slab
 * s, s + warps of the grid, ...), each brought into shared memory whole by
 * one bulk copy, and walks a slab's 128-element groups of the x4 copy
 * (matmul.cu's x4_q8_0: four blocks' 128 int8 values, then their four f16
 * scales). Thread (g, t) of a warp reads rows g and g + 8 of the slab,
 * bytes 8 t .. 8 t + 7 of each block: with mma.sync.m16n8k16's free k
 * order (mmq.cu's note: thread t's k slots 2t, 2t + 1, 2t + 8, 2t + 9 of
 * two chunks are elements 8 t .. 8 t + 7 of the block), those are its A
 * fragments, and its B fragments are 16 contiguous bytes of an activation
 * row. A weight is (q + 1152 - 1152) d in f16, q placed under an f16
 * exponent by one byte permute: exactly the resident copy's f16 of d q,
 * so the product is cuBLAS's on that copy but for the order of the f32
 * sums.
 *
 * Every launch parameter depends on (m, rows, cols) and the device only:
 * the product can be recorded into a CUDA graph. */
#include "cuda_internal.h"
#include "blocks.cuh"
#include "launch.cuh"

LUMA_TRACE_TU(tall)

#define TALL_WARPS_MAX 8         /* warps of a CTA at most */
#define TALL_NT_MAX 8            /* n8 tiles at most: 64 activation rows */
#define TALL_BARS 128            /* shared memory before the slab buffers: the mbarriers */
#define TALL_ROWS_MIN 65536      /* weights of at least this many rows ... */
#define TALL_COLS_MAX 4096       /* ... and at most this many columns */
#define TALL_LO 2                /* the rule's activation rows (luma_cuda_tall_takes) */
#define TALL_HI 64
#define TALL_SMEM_MAX (227 * 1024)

/* A thread's bytes of one group for its rows g and g + 8: per block k its
 * 8 bytes of values, and the group's four scales. */
struct tall_raw {
    uint2 qa[4], qb[4], da, db;
};

/* The group of rows at pa and pb (in shared memory) that thread t takes. */
static __device__ __forceinline__ void tall_read(tall_raw &r, const uint8_t *pa, const uint8_t *pb, int t)
{
#pragma unroll
    for (int k = 0; k < 4; k++) {
        r.qa[k] = *(const uint2 *)(pa + 32 * k + 8 * t);
        r.qb[k] = *(const uint2 *)(pb + 32 * k + 8 * t);
    }
    r.da = *(const uint2 *)(pa + 128);
    r.db = *(const uint2 *)(pb + 128);
}

/* The f16 pair d q of the two int8 values of w that sel picks (0x4140:
 * bytes 0 and 1; 0x4342: 2 and 3) after w's bytes were offset by 128 (w ^
 * 0x80808080); d2 is (d, d). 0x64 above the byte q + 128 is the f16 of
 * 1024 + 128 + q; minus 1152 is q, exactly; the product rounds once. */
static __device__ __forceinline__ uint32_t tall_deq(uint32_t w, uint32_t sel, __half2 d2)
{
    uint32_t h = __byte_perm(w, 0x64646464u, sel);
    __half2 q = __hsub2(*(const __half2 *)&h, __half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480)));
    __half2 r = __hmul2(q, d2);
    return *(const uint32_t *)&r;
}

template <int NT>
static __device__ __forceinline__ void tall_group(const tall_raw &r, const __half *xg, int ld, float (&acc)[NT][4])
{
#pragma unroll
    for (int k = 0; k < 4; k++) {
        /* scale k of each row as (d, d): halves k % 2 of word k / 2 */
        const uint32_t sa = k < 2 ? r.da.x : r.da.y, sb = k < 2 ? r.db.x : r.db.y;
        const uint32_t selk = k % 2 ? 0x3232u : 0x1010u;
        const uint32_t dwa = __byte_perm(sa, 0, selk), dwb = __byte_perm(sb, 0, selk);
        const __half2 dA = *(const __half2 *)&dwa, dB = *(const __half2 *)&dwb;
        const uint32_t wa0 = r.qa[k].x ^ 0x80808080u, wa1 = r.qa[k].y ^ 0x80808080u;
        const uint32_t wb0 = r.qb[k].x ^ 0x80808080u, wb1 = r.qb[k].y ^ 0x80808080u;
        /* chunk 0: the thread's bytes 0..3 of the block, chunk 1: 4..7 */
        const uint32_t a0[4] = { tall_deq(wa0, 0x4140u, dA), tall_deq(wb0, 0x4140u, dB), tall_deq(wa0, 0x4342u, dA),
                                 tall_deq(wb0, 0x4342u, dB) };
        const uint32_t a1[4] = { tall_deq(wa1, 0x4140u, dA), tall_deq(wb1, 0x4140u, dB), tall_deq(wa1, 0x4342u, dA),
                                 tall_deq(wb1, 0x4342u, dB) };
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const uint4 b = *(const uint4 *)(xg + (size_t)(8 * n) * ld + 32 * k);
            mma16816(acc[n], a0, b.x, b.y);
            mma16816(acc[n], a1, b.z, b.w);
        }
    }
}

/* w: the x4 copy (rows x groups x 136 bytes, rows a multiple of 16, 16-byte
 * aligned); xq, xds: the activations' int8 values (m x cols, cols = 128
 * groups) and their blocks' (d, d * sum); y: m x rows. A slab (16 rows,
 * 2,176 groups bytes) is contiguous, so a warp's lane 0 brings each of
 * its slabs into shared memory with one bulk copy (the tensor memory
 * accelerator's, off the load path that the lanes' own 8-byte loads of 8
 * rows at a time kept busy), into two buffers in turn: the next slab comes
 * while this one is multiplied, the first two before the wait for the
 * kernel before (weights only). Shared memory: the warps' mbarriers (two a
 * warp), their buffers, then 8 NT activation rows of cols + 32 halves (a
 * row's stride 16 words off a multiple of 32: the two rows a quarter-warp's
 * 16-byte loads touch fall in distinct banks). */
template <int NT>
static __global__ void __launch_bounds__(TALL_WARPS_MAX * 32, 1)
    tall_kernel(const uint8_t *__restrict__ w, int rows, int groups, const int8_t *__restrict__ xq,
                const float2 *__restrict__ xds, int m, float *__restrict__ y)
{
    extern __shared__ __align__(128) uint8_t tall_smem_buf[];
    const int cols = 128 * groups, ld = cols + 32, warps = blockDim.x / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int slabs = rows / 16, step = gridDim.x * warps, row_bytes = groups * 136, slab_bytes = 16 * row_bytes;
    uint64_t *bar = (uint64_t *)tall_smem_buf + 2 * warp;
    uint8_t *buf = tall_smem_buf + TALL_BARS + (size_t)(2 * warp) * slab_bytes;
    __half *xs = (__half *)(tall_smem_buf + TALL_BARS + (size_t)(2 * warps) * slab_bytes);
    int s = blockIdx.x * warps + warp;
    if (lane == 0) {
        mbar_init(&bar[0], 1);
        mbar_init(&bar[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int b = 0; b < 2; b++)
            if (s + b * step < slabs) {
                mbar_expect(&bar[b], (uint32_t)slab_bytes);
                bulk_copy(buf + b * slab_bytes, w + (int64_t)(s + b * step) * slab_bytes, (uint32_t)slab_bytes, &bar[b]);
            }
    }
    wait_for_previous_kernel();
    const int chunks = cols / 8;   /* pieces of 8 values of a row */
    for (int i = threadIdx.x; i < 8 * NT * chunks; i += blockDim.x) {
        const int n = i / chunks, c = i % chunks;
        uint32_t h[4] = { 0, 0, 0, 0 };
        if (n < m) {
            const uint2 q = *(const uint2 *)(xq + (int64_t)n * cols + 8 * c);
            const float d = xds[(int64_t)n * (cols / 32) + c / 4].x;
            const uint32_t qw[2] = { q.x, q.y };
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int q0 = (int)(int8_t)(qw[j / 2] >> (16 * (j % 2))), q1 = (int)(int8_t)(qw[j / 2] >> (16 * (j % 2) + 8));
                const __half2 v = __halves2half2(__float2half_rn(d * (float)q0), __float2half_rn(d * (float)q1));
                h[j] = *(const uint32_t *)&v;
            }
        }
        *(uint4 *)(xs + (size_t)n * ld + 8 * c) = make_uint4(h[0], h[1], h[2], h[3]);
    }
    __syncthreads();
    let_next_kernel_start();

    const __half *xt = xs + (size_t)g * ld + 8 * t;   /* this thread's activation row g, bytes 16 t */
    uint32_t phase = 0;                               /* bit b: buffer b's parity */
    for (int b = 0; s < slabs; s += step, b ^= 1) {
        mbar_wait(&bar[b], (phase >> b) & 1);
        phase ^= 1u << b;
        const uint8_t *pa = buf + b * slab_bytes + g * row_bytes, *pb = pa + 8 * row_bytes;
        float acc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        for (int G = 0; G < groups; G++) {
            tall_raw r;
            tall_read(r, pa + G * 136, pb + G * 136, t);
            tall_group<NT>(r, xt + 128 * G, ld, acc);
        }
        /* the buffer's reads are done (their values went into the
         * products) before its next copy is issued */
        __syncwarp();
        if (lane == 0 && s + 2 * step < slabs) {
            fence_proxy_async();
            mbar_expect(&bar[b], (uint32_t)slab_bytes);
            bulk_copy(buf + b * slab_bytes, w + (int64_t)(s + 2 * step) * slab_bytes, (uint32_t)slab_bytes, &bar[b]);
        }
        const int ra = 16 * s + g, rb = ra + 8;
#pragma unroll
        for (int n = 0; n < NT; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = 8 * n + 2 * t + e;
                if (col < m) {
                    y[(int64_t)col * rows + ra] = acc[n][e];
                    y[(int64_t)col * rows + rb] = acc[n][2 + e];
                }
            }
        }
    }
}

/* The n8 tiles a launch of m activation rows takes: 1, 2, 4 or 8. */
static int tall_tiles(int64_t m)
{
    int nt = 1;
    while (8 * nt < m) nt *= 2;
    return nt;
}

/* A launch at m rows: its warps a CTA (as many as the shared memory holds
 * with two slab buffers each, at most TALL_WARPS_MAX) and its shared
 * memory; false where fewer than two warps fit. */
static bool tall_plan(int64_t m, int64_t cols, int *warps, size_t *smem)
{
    const size_t slab = (size_t)16 * (size_t)(cols / 128) * 136;
    const size_t act = (size_t)8 * (size_t)tall_tiles(m) * (size_t)(cols + 32) * sizeof(__half);
    if (act + TALL_BARS + 2 * 2 * slab > TALL_SMEM_MAX) return false;
    size_t n = (TALL_SMEM_MAX - act - TALL_BARS) / (2 * slab);
    if (n > TALL_WARPS_MAX) n = TALL_WARPS_MAX;
    *warps = (int)n;
    *smem = TALL_BARS + 2 * n * slab + act;
    return true;
}

bool luma_cuda_tall_takes(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    int warps;
    size_t smem;
    const uint8_t *x4 = luma_cuda_x4(c, w);
    return !c->invariant && !c->float_act && m >= c->tall_lo && m <= c->tall_hi && m <= 8 * TALL_NT_MAX &&
           w->type == LUMA_Q8_0 && w->rows >= TALL_ROWS_MIN && w->rows % 16 == 0 && w->rows <= INT_MAX / 2 &&
           w->cols <= TALL_COLS_MAX && w->cols % 128 == 0 && x4 != NULL && ((uintptr_t)x4 & 15) == 0 &&
           tall_plan(m, w->cols, &warps, &smem);
}

void luma_cuda_tall_init(cuda_backend *c)
{
    env_rows env;
    const bool set = env_rows_set(env, "LUMA_CUDA_TALL");
    c->tall_lo = set ? env.lo : TALL_LO;
    c->tall_hi = set ? env.hi : TALL_HI;
}

template <int NT>
static void tall_launch(cuda_backend *c, const luma_weight *w, const int8_t *xq, const float2 *xds, int64_t m,
                        float *y)
{
    const void *fn = (const void *)tall_kernel<NT>;
    static uint64_t ready;   /* devices whose shared memory limit is set */
    const uint64_t bit = c->device < 64 ? (uint64_t)1 << c->device : 0;
    int warps;
    size_t smem;
    if (!tall_plan(m, w->cols, &warps, &smem)) {
        luma_cuda_failf(c, "matmul: the tall kernel does not fit %lld rows of %lld", (long long)m,
                        (long long)w->cols);
        return;
    }
    if (!(bit && (ready & bit))) {
        if (luma_cuda_fail(c, cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, TALL_SMEM_MAX),
                           "matmul (tall kernel shared memory limit)"))
            return;
        ready |= bit;
    }
    int per_sm = 0;
    if (luma_cuda_fail(c, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, warps * 32, smem),
                       "matmul (tall kernel occupancy)"))
        return;
    if (per_sm < 1) {
        luma_cuda_failf(c, "matmul: the tall kernel does not fit an SM (%zu bytes of shared memory)", smem);
        return;
    }
    const int64_t slabs = w->rows / 16, need = (slabs + warps - 1) / warps;
    const int64_t ctas = need < (int64_t)per_sm * c->n_sm ? need : (int64_t)per_sm * c->n_sm;
    luma_launch(c, c->stream, dim3((unsigned)ctas), dim3((unsigned)warps * 32), smem, tall_kernel<NT>,
                luma_cuda_x4(c, w), (int)w->rows, (int)(w->cols / 128), xq, xds, (int)m, y);
    if (!luma_cuda_fail(c, cudaGetLastError(), "matmul (tall kernel)")) c->talls++;
}

void luma_cuda_tall(cuda_backend *c, const luma_weight *w, const int8_t *xq, const float2 *xds, int64_t m, float *y)
{
    switch (tall_tiles(m)) {
    case 1: tall_launch<1>(c, w, xq, xds, m, y); break;
    case 2: tall_launch<2>(c, w, xq, xds, m, y); break;
    case 4: tall_launch<4>(c, w, xq, xds, m, y); break;
    default: tall_launch<8>(c, w, xq, xds, m, y); break;   /* TALL_NT_MAX */
    }
}

/* ---- for measuring (spec/native/test_cuda_matmul.c) --------------------------- */

/* The activation rows the tall kernel takes (lo > hi: none; lo < 0: the
 * rule's again); the launches it has made. */
extern "C" void luma_cuda_tall_range(luma_backend *be, int lo, int hi)
{
    cuda_backend *c = (cuda_backend *)be;
    c->tall_lo = lo;
    c->tall_hi = hi;
    if (lo < 0) luma_cuda_tall_init(c);
}

extern "C" long long luma_cuda_talls(luma_backend *be)
{
    return ((cuda_backend *)be)->talls;
}
