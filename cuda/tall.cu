/* Products of tall Q8_0 matrices on the tensor cores: y[i] = W x[i] for a
 * few dozen activation rows (TALL_LO to TALL_HI by the rule; the kernel
 * runs 1 to 128 where its shared memory holds them) where W has a
 * vocabulary's rows of a few hundred to a few thousand columns (the output
 * projections of Gemma 3 and Qwen2, tied to their Q8_0 embeddings). cuBLAS on the resident f16 copy
 * reads twice the Q8_0 bytes (335 MB against 178 for Gemma 3's 262,144 x
 * 640), and the narrow matrix-vector kernel, a group of lanes a row, is
 * bound by its activation loads past a row or two (cuda/NOTES.md, "Tall
 * Q8_0 products on the tensor cores").
 *
 * tall_kernel<NT>: a persistent grid of CTAs of TALL_WARPS warps. A CTA
 * first copies the step's activations (the f16 of their 8-bit values,
 * tensor_act's, up to 8 NT rows, zeros past m) into shared memory, where
 * they stay; then each warp takes slabs of 16 weight rows in turn (slab
 * s, s + warps of the grid, ...) and walks a slab's 128-element groups of
 * the x4 copy (matmul.cu's x4_q8_0: four blocks' 128 int8 values, then
 * their four f16 scales). Thread (g, t) of a warp fetches rows g and g + 8
 * of the slab, bytes 8 t .. 8 t + 7 of each block: with mma.sync.m16n8k16's
 * free k order (mmq.cu's note: thread t's k slots 2t, 2t + 1, 2t + 8,
 * 2t + 9 of two chunks are elements 8 t .. 8 t + 7 of the block), those
 * are its A fragments, and its B fragments are 16 contiguous bytes of an
 * activation row in shared memory. A weight is (q + 1152 - 1152) d in f16,
 * q placed under an f16 exponent by one byte permute: exactly the resident
 * copy's f16 of d q, so the product is cuBLAS's on that copy but for the
 * order of the f32 sums. The next group's bytes are fetched (two register
 * sets in turn) while this one is multiplied; the weights of a warp's first
 * group are fetched before the wait for the kernel before.
 *
 * Every launch parameter depends on (m, rows, cols) and the device only:
 * the product can be recorded into a CUDA graph. */
#include "cuda_internal.h"
#include "blocks.cuh"
#include "launch.cuh"

#define TALL_WARPS 8
#define TALL_ROWS_MIN 65536      /* weights of at least this many rows ... */
#define TALL_COLS_MAX 4096       /* ... and at most this many columns */
#define TALL_LO 4                /* the rule's activation rows (luma_cuda_tall_takes) */
#define TALL_HI 32
#define TALL_SMEM_MAX (227 * 1024)

/* A warp's fetch of one group for its rows g and g + 8: per block k the
 * thread's 8 bytes of values, and the group's four scales. */
struct tall_raw {
    uint2 qa[4], qb[4], da, db;
};

static __device__ __forceinline__ void tall_fetch(tall_raw &r, const uint8_t *pa, const uint8_t *pb, int t)
{
#pragma unroll
    for (int k = 0; k < 4; k++) {
        r.qa[k] = __ldcs((const uint2 *)(pa + 32 * k + 8 * t));
        r.qb[k] = __ldcs((const uint2 *)(pb + 32 * k + 8 * t));
    }
    r.da = __ldcs((const uint2 *)(pa + 128));
    r.db = __ldcs((const uint2 *)(pb + 128));
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

/* w: the x4 copy (rows x groups x 136 bytes); x: m x cols f16 (cols = 128
 * groups); y: m x rows. Shared memory: 8 NT activation rows of cols + 32
 * halves (a row's stride 16 words off a multiple of 32: the two rows a
 * quarter-warp's 16-byte loads touch fall in distinct banks). */
template <int NT>
static __global__ void __launch_bounds__(TALL_WARPS * 32, NT >= 16 ? 1 : 2)
    tall_kernel(const uint8_t *__restrict__ w, int rows, int groups, const __half *__restrict__ x, int m,
                float *__restrict__ y)
{
    extern __shared__ __align__(16) __half tall_xs[];
    const int cols = 128 * groups, ld = cols + 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int slabs = (rows + 15) / 16, step = gridDim.x * TALL_WARPS;
    const int64_t row_bytes = (int64_t)groups * 136;
    int s = blockIdx.x * TALL_WARPS + warp, G = 0;
    /* the weight rows of slab sl for this thread (the last row again past the end) */
    auto rows_of = [&](int sl, const uint8_t *&pa, const uint8_t *&pb) {
        const int ra = 16 * sl + g, rb = ra + 8;
        pa = w + (int64_t)(ra < rows ? ra : rows - 1) * row_bytes;
        pb = w + (int64_t)(rb < rows ? rb : rows - 1) * row_bytes;
    };
    const uint8_t *pa = w, *pb = w;
    tall_raw r0, r1;
    if (s < slabs) {
        rows_of(s, pa, pb);
        tall_fetch(r0, pa, pb, t);   /* weights only: before the wait */
    }
    wait_for_previous_kernel();
    const int chunks = cols / 8;   /* 16-byte pieces of a row */
    for (int i = threadIdx.x; i < 8 * NT * chunks; i += TALL_WARPS * 32) {
        const int n = i / chunks, c = i % chunks;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (n < m) v = *(const uint4 *)(x + (int64_t)n * cols + 8 * c);
        *(uint4 *)(tall_xs + (size_t)n * ld + 8 * c) = v;
    }
    __syncthreads();
    let_next_kernel_start();
    if (s >= slabs) return;

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    const __half *xt = tall_xs + (size_t)g * ld + 8 * t;   /* this thread's activation row g, bytes 16 t */
    /* one group: fetch the next into nxt, multiply cur, store a finished
     * slab; false once the warp's last group is done. The two register
     * sets take turns (the loop below), so that no copy between them waits
     * for a fetch. */
    auto advance = [&](tall_raw &cur, tall_raw &nxt) -> bool {
        int s2 = s, G2 = G + 1;
        if (G2 == groups) {
            G2 = 0;
            s2 = s + step;
        }
        const bool more = s2 < slabs;
        if (more) {
            if (s2 != s) rows_of(s2, pa, pb);
            tall_fetch(nxt, pa + (int64_t)G2 * 136, pb + (int64_t)G2 * 136, t);
        }
        tall_group<NT>(cur, xt + 128 * G, ld, acc);
        if (G == groups - 1) {
            const int ra = 16 * s + g, rb = ra + 8;
#pragma unroll
            for (int n = 0; n < NT; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = 8 * n + 2 * t + e;
                    if (col < m) {
                        if (ra < rows) y[(int64_t)col * rows + ra] = acc[n][e];
                        if (rb < rows) y[(int64_t)col * rows + rb] = acc[n][2 + e];
                    }
                }
                acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
            }
        }
        s = s2;
        G = G2;
        return more;
    };
    while (advance(r0, r1) && advance(r1, r0)) {
    }
}

/* The n8 tiles a launch of m activation rows takes: 1, 2, 4, 8 or 16. */
static int tall_tiles(int64_t m)
{
    int nt = 1;
    while (8 * nt < m) nt *= 2;
    return nt;
}

static size_t tall_smem(int nt, int64_t cols)
{
    return (size_t)8 * (size_t)nt * (size_t)(cols + 32) * sizeof(__half);
}

bool luma_cuda_tall_takes(const cuda_backend *c, const luma_weight *w, int64_t m)
{
    return !c->invariant && !c->float_act && m >= c->tall_lo && m <= c->tall_hi && m <= 128 &&
           w->type == LUMA_Q8_0 && w->rows >= TALL_ROWS_MIN && w->rows <= INT_MAX / 2 && w->cols <= TALL_COLS_MAX &&
           w->cols % 128 == 0 && luma_cuda_x4(c, w) != NULL && tall_smem(tall_tiles(m), w->cols) <= TALL_SMEM_MAX;
}

void luma_cuda_tall_init(cuda_backend *c)
{
    env_rows env;
    const bool set = env_rows_set(env, "LUMA_CUDA_TALL");
    c->tall_lo = set ? env.lo : TALL_LO;
    c->tall_hi = set ? env.hi : TALL_HI;
}

template <int NT>
static void tall_launch(cuda_backend *c, const luma_weight *w, const __half *xh, int64_t m, float *y)
{
    const void *fn = (const void *)tall_kernel<NT>;
    static uint64_t ready;   /* devices whose shared memory limit is set */
    const uint64_t bit = c->device < 64 ? (uint64_t)1 << c->device : 0;
    const size_t smem = tall_smem(NT, w->cols);
    if (!(bit && (ready & bit))) {
        if (luma_cuda_fail(c, cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, TALL_SMEM_MAX),
                           "matmul (tall kernel shared memory limit)"))
            return;
        ready |= bit;
    }
    int per_sm = 0;
    if (luma_cuda_fail(c, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, TALL_WARPS * 32, smem),
                       "matmul (tall kernel occupancy)"))
        return;
    if (per_sm < 1) {
        luma_cuda_failf(c, "matmul: the tall kernel does not fit an SM (%zu bytes of shared memory)", smem);
        return;
    }
    const int64_t slabs = (w->rows + 15) / 16, need = (slabs + TALL_WARPS - 1) / TALL_WARPS;
    const int64_t ctas = need < (int64_t)per_sm * c->n_sm ? need : (int64_t)per_sm * c->n_sm;
    luma_launch(c, c->stream, dim3((unsigned)ctas), dim3(TALL_WARPS * 32), smem, tall_kernel<NT>, luma_cuda_x4(c, w),
                (int)w->rows, (int)(w->cols / 128), xh, (int)m, y);
    if (!luma_cuda_fail(c, cudaGetLastError(), "matmul (tall kernel)")) c->talls++;
}

void luma_cuda_tall(cuda_backend *c, const luma_weight *w, const __half *xh, int64_t m, float *y)
{
    switch (tall_tiles(m)) {
    case 1: tall_launch<1>(c, w, xh, m, y); break;
    case 2: tall_launch<2>(c, w, xh, m, y); break;
    case 4: tall_launch<4>(c, w, xh, m, y); break;
    case 8: tall_launch<8>(c, w, xh, m, y); break;
    default: tall_launch<16>(c, w, xh, m, y); break;   /* where its shared memory fits */
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
