/* The CUDA backend's small operations: embedding rows, gather, RMSNorm,
 * RoPE, bias, residual add and the gated activations. Each is one pass over
 * its activations; the reference is src/cpu/backend.c.
 *
 * All of them are memory-bound. At the H100's ~3.0 TB/s an add of two
 * 512 x 4096 activations (8 MiB each: 16 MiB read, 8 MiB written) is worth
 * ~8 us; a decode step's versions (one row, a few KiB) cost their launch,
 * which CUDA graphs address.
 * Threads move 16 bytes at a time (float4) when the rows are 16-byte aligned,
 * and fall back to single floats otherwise.
 *
 * Dequantization in embed multiplies and adds with explicit rounding
 * (__fmul_rn, __fsub_rn: no fused multiply-add) so the rows equal the CPU's
 * luma_dequantize_row bit for bit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "launch.cuh"
#include "act.cuh"
#include "rope.cuh"
#include "norm.cuh"

LUMA_TRACE_TU(ops)

#define THREADS NORM_THREADS

static cuda_backend *cu(luma_backend *be) { return (cuda_backend *)be; }

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

static unsigned blocks_for(int64_t n, int per_block) { return (unsigned)((n + per_block - 1) / per_block); }

/* ---- embedding rows ------------------------------------------------------ */

__device__ static float half_at(const uint8_t *p)
{
    return __half2float(__ushort_as_half((unsigned short)(p[0] | p[1] << 8)));
}

/* Q4_K and Q5_K: the 6-bit scale and minimum of sub-block s (quant.c's scale_min_k4). */
__device__ static void scale_min_k4(int s, const uint8_t *q, int *sc, int *m)
{
    if (s < 4) {
        *sc = q[s] & 63;
        *m = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
        *m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

/* Element i (< block size) of the block at b. Offsets are those of the
 * luma_block_* structs in quant.h. */
__device__ static float dequant(int type, const uint8_t *b, int i)
{
    switch (type) {
    case LUMA_F32: return *(const float *)b;
    case LUMA_F16: return half_at(b);
    case LUMA_BF16: return __uint_as_float((uint32_t)(b[0] | b[1] << 8) << 16);
    case LUMA_Q4_0: {
        int q = i < 16 ? b[2 + i] & 0xF : b[2 + i - 16] >> 4;
        return __fmul_rn(half_at(b), (float)(q - 8));
    }
    case LUMA_Q4_1: {
        int q = i < 16 ? b[4 + i] & 0xF : b[4 + i - 16] >> 4;
        return __fadd_rn(__fmul_rn(half_at(b), (float)q), half_at(b + 2));
    }
    case LUMA_Q5_0: {
        uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
        int q = (i < 16 ? b[6 + i] & 0xF : b[6 + i - 16] >> 4) | (int)((qh >> i) & 1) << 4;
        return __fmul_rn(half_at(b), (float)(q - 16));
    }
    case LUMA_Q5_1: {
        uint32_t qh = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
        int q = (i < 16 ? b[8 + i] & 0xF : b[8 + i - 16] >> 4) | (int)((qh >> i) & 1) << 4;
        return __fadd_rn(__fmul_rn(half_at(b), (float)q), half_at(b + 2));
    }
    case LUMA_Q8_0: return __fmul_rn(half_at(b), (float)(int8_t)b[2 + i]);
    case LUMA_Q2_K: {
        /* element 128c + 32k + l: bit pair k of qs[32c + l], scale 8c + 2k + l/16 */
        int c = i / 128, k = i % 128 / 32, l = i % 32, sc = b[8 * c + 2 * k + l / 16];
        float dl = __fmul_rn(half_at(b + 80), (float)(sc & 0xF));
        float ml = __fmul_rn(half_at(b + 82), (float)(sc >> 4));
        int q = (b[16 + 32 * c + l] >> (2 * k)) & 3;
        return __fsub_rn(__fmul_rn(dl, (float)q), ml);
    }
    case LUMA_Q3_K: {
        int c = i / 128, k = i % 128 / 32, l = i % 32, g = 8 * c + 2 * k + l / 16;
        const uint8_t *s = b + 96;
        int lo = g < 8 ? s[g] & 0xF : s[g - 8] >> 4;
        int hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        int v = (b[32 + 32 * c + l] >> (2 * k)) & 3;
        if (!((b[l] >> (4 * c + k)) & 1)) v -= 4;
        return __fmul_rn(__fmul_rn(half_at(b + 108), (float)((lo | hi << 4) - 32)), (float)v);
    }
    case LUMA_Q4_K:
    case LUMA_Q5_K: {
        /* sub-block s = i / 32: low (s even) or high nibbles of qs[32 (s/2) + l] */
        int s = i / 32, l = i % 32, sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        float d1 = __fmul_rn(half_at(b), (float)sc), m1 = __fmul_rn(half_at(b + 2), (float)m);
        int q;
        if (type == LUMA_Q4_K) q = (b[16 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF;
        else q = ((b[48 + 32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF) | ((b[16 + l] >> s) & 1) << 4;
        return __fsub_rn(__fmul_rn(d1, (float)q), m1);
    }
    case LUMA_Q6_K: {
        int c = i / 128, k = i % 128 / 32, l = i % 32;
        float dl = __fmul_rn(half_at(b + 208), (float)(int8_t)b[192 + 8 * c + 2 * k + l / 16]);
        int lo = (b[64 * c + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
        int hi = (b[128 + 32 * c + l] >> (2 * k)) & 3;
        return __fmul_rn(dl, (float)((lo | hi << 4) - 32));
    }
    }
    return 0.0f;
}

static bool embed_supports(enum luma_type t)
{
    switch (t) {
    case LUMA_F32: case LUMA_F16: case LUMA_BF16: case LUMA_Q4_0: case LUMA_Q4_1: case LUMA_Q5_0:
    case LUMA_Q5_1: case LUMA_Q8_0: case LUMA_Q2_K: case LUMA_Q3_K: case LUMA_Q4_K: case LUMA_Q5_K:
    case LUMA_Q6_K:
        return true;
    default:
        return false;
    }
}

/* grid (column blocks, n): out[y][j] = w[ids[y]][j] * scale, where an id
 * LUMA_TOKEN_CHAINED is the one the argmax key *chain names. An id outside
 * the table (the batch rejects those before a step; a chained argmax of a
 * row all masked) gives a row of zeros. */
__global__ static void embed_kernel(const uint8_t *w, int type, int64_t rows, int64_t cols, size_t row_size,
                                    int block_size, int type_size, const int32_t *ids,
                                    const unsigned long long *chain, float scale, float *out)
{
    follow_previous_kernel();
    int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    int32_t id = ids[blockIdx.y];
    if (id == LUMA_TOKEN_CHAINED) id = luma_cuda_key_id(*chain);
    float v = 0.0f;
    if (id >= 0 && id < rows) {
        const uint8_t *b = w + (size_t)id * row_size + (size_t)(j / block_size) * (size_t)type_size;
        v = __fmul_rn(dequant(type, b, (int)(j % block_size)), scale);
    }
    out[(size_t)blockIdx.y * (size_t)cols + (size_t)j] = v;
}

void luma_cuda_embed(luma_backend *be, const luma_weight *w, const int32_t *ids, int32_t n, float scale,
                     luma_buf *out)
{
    cuda_backend *c = cu(be);
    out->rows = n;
    out->cols = w->cols;
    if (!LUMA_CUDA_OK(c) || n <= 0) return;
    if (!embed_supports(w->type)) {
        luma_cuda_failf(c, "embed: tensor type %s is not supported by the CUDA backend", luma_type_name(w->type));
        return;
    }
    const int32_t *d_ids = luma_cuda_step_array(c, ids, n, "embed");
    if (!d_ids) return;
    const luma_type_traits *tr = luma_type_get(w->type);
    dim3 grid(blocks_for(w->cols, THREADS), (unsigned)n);
    luma_launch(c, c->stream, grid, THREADS, 0, embed_kernel, (const uint8_t *)w->dev, (int)w->type, w->rows, w->cols,
                luma_row_size(w->type, w->cols), (int)tr->block_size, (int)tr->type_size, d_ids, c->chain_key, scale,
                out->data);
    luma_cuda_fail(c, cudaGetLastError(), "embed");
}

/* ---- gather ------------------------------------------------------------- */

/* One block per output row: out[y] = x[rows[y]]; cols counts floats, or
 * float4s when VEC. */
template <typename T>
__global__ static void gather_kernel(const T *x, const int32_t *rows, int64_t cols, T *out)
{
    follow_previous_kernel();
    const T *src = x + (size_t)rows[blockIdx.x] * (size_t)cols;
    T *dst = out + (size_t)blockIdx.x * (size_t)cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

void luma_cuda_gather(luma_backend *be, const luma_buf *x, const int32_t *rows, int32_t n, luma_buf *out)
{
    cuda_backend *c = cu(be);
    out->rows = n;
    out->cols = x->cols;
    if (!LUMA_CUDA_OK(c) || n <= 0 || x->cols == 0) return;
    const int32_t *d_rows = luma_cuda_step_array(c, rows, n, "gather");
    if (!d_rows) return;
    if (x->cols % 4 == 0 && aligned16(x->data) && aligned16(out->data))
        luma_launch(c, c->stream, n, THREADS, 0, gather_kernel<float4>, (const float4 *)x->data, d_rows, x->cols / 4,
                    (float4 *)out->data);
    else
        luma_launch(c, c->stream, n, THREADS, 0, gather_kernel<float>, x->data, d_rows, x->cols, out->data);
    luma_cuda_fail(c, cudaGetLastError(), "gather");
}

/* ---- RMSNorm ------------------------------------------------------------- */

template <bool VEC>
__device__ static float sum_squares(const float *x, int64_t n, int lane, int width)
{
    float ss = 0.0f;
    if (VEC) {
        for (int64_t k = lane; k < n / 4; k += width) ss += sq4(((const float4 *)x)[k]);
    } else {
        for (int64_t k = lane; k < n; k += width) ss = fmaf(x[k], x[k], ss);
    }
    return ss;
}

/* TPG threads normalize one group (TPG 32: a warp, several groups per block;
 * TPG = THREADS: the whole block). The sum of squares is reduced in float,
 * then every element is read again (from L1/L2) and scaled. */
template <int TPG, bool VEC>
__global__ static void rmsnorm_kernel(const float *x, const float *g, int64_t group, int64_t n_groups, float eps,
                                      float *out)
{
    follow_previous_kernel();
    __shared__ float partial[THREADS / 32];
    int lane = threadIdx.x % TPG;
    int64_t gi = (int64_t)blockIdx.x * (THREADS / TPG) + threadIdx.x / TPG;
    bool live = gi < n_groups;
    const float *src = x + (size_t)(live ? gi : 0) * (size_t)group;
    float ss = live ? sum_squares<VEC>(src, group, lane, TPG) : 0.0f;
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (TPG > 32) {
        if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
        __syncthreads();
        ss = 0.0f;
        for (int w = 0; w < TPG / 32; w++) ss += partial[w];
    }
    if (!live) return;
    float s = 1.0f / sqrtf(ss / (float)group + eps);
    float *dst = out + (size_t)gi * (size_t)group;
    if (VEC) {
        for (int64_t k = lane; k < group / 4; k += TPG) {
            float4 v = ((const float4 *)src)[k], w = ((const float4 *)g)[k];
            ((float4 *)dst)[k] = make_float4(v.x * s * w.x, v.y * s * w.y, v.z * s * w.z, v.w * s * w.w);
        }
    } else {
        for (int64_t k = lane; k < group; k += TPG) dst[k] = src[k] * s * g[k];
    }
}

template <int TPG>
static void rmsnorm_launch(cuda_backend *c, const luma_buf *x, const float *g, int64_t group, int64_t n_groups,
                           float eps, luma_buf *out)
{
    unsigned grid = blocks_for(n_groups, THREADS / TPG);
    if (group % 4 == 0 && aligned16(x->data) && aligned16(out->data) && aligned16(g))
        luma_launch(c, c->stream, grid, THREADS, 0, rmsnorm_kernel<TPG, true>, x->data, g, group, n_groups, eps,
                    out->data);
    else
        luma_launch(c, c->stream, grid, THREADS, 0, rmsnorm_kernel<TPG, false>, x->data, g, group, n_groups, eps,
                    out->data);
}

/* rmsnorm_kernel over x's rows in groups of `group`: a warp per head-sized
 * group, a block per model-width row. */
static void rmsnorm_groups(cuda_backend *c, const luma_buf *x, const float *g, int64_t group, float eps,
                           luma_buf *out)
{
    const int64_t n_groups = x->rows * (x->cols / group);
    if (group <= 1024) rmsnorm_launch<32>(c, x, g, group, n_groups, eps, out);
    else rmsnorm_launch<THREADS>(c, x, g, group, n_groups, eps, out);
}

void luma_cuda_rmsnorm(luma_backend *be, const luma_buf *x, const luma_weight *g, int64_t group, float eps,
                       luma_buf *out)
{
    cuda_backend *c = cu(be);
    out->rows = x->rows;
    out->cols = x->cols;
    if (!LUMA_CUDA_OK(c) || x->rows * x->cols == 0) return;
    if (group <= 0 || x->cols % group != 0 || g->cols != group) {
        luma_cuda_failf(c, "rmsnorm: groups of %lld do not divide rows of %lld (gain of %lld)", (long long)group,
                        (long long)x->cols, (long long)g->cols);
        return;
    }
    if (group == x->cols) {
        /* a whole row's norm as add_rmsnorm's without the add (the row in
         * registers where it fits): the bits of the norm joined to the next
         * product's quantizer (luma_cuda_norm_pend), at any row count */
        luma_cuda_add_rmsnorm(be, (luma_buf *)x, NULL, NULL, g, eps, out);
        return;
    }
    rmsnorm_groups(c, x, (const float *)g->dev, group, eps, out);
    luma_cuda_fail(c, cudaGetLastError(), "rmsnorm");
}

/* ---- residual add + RMSNorm ---------------------------------------------- */

template <bool VEC>
__device__ static float row_inv_rms(const float *src, int64_t cols, float eps, float *partial)
{
    return block_inv_rms(sum_squares<VEC>(src, cols, threadIdx.x, THREADS), cols, eps, partial);
}

/* add_rmsnorm_kernel<true> for rows of at most THREADS * 4 * F floats with
 * the row in registers (norm.cuh): every load of the row (x, y and both
 * gains) is issued at once, where the loops below wait for one load after
 * another (a store to x may alias the next load): a decode step's row of
 * 4096 took 6 us that way. Same operations in the same order, so the same
 * bits. */
template <int F>
__global__ static void add_rmsnorm_regs(float *x, const float *y, const float *yg, const float *g, int64_t cols,
                                        float eps, float *out, bool early)
{
    follow_previous_kernel(early);
    __shared__ float partial[THREADS / 32];
    float4 o[F];
    add_rmsnorm_row<F>(x, y, yg, g, cols, eps, out, partial, o);
}

/* A block per row: x += (yg ? y * rms(y) * yg : y), out = x * rms(x) * g.
 * Each thread adds, then scales, the same elements, so it reads back only
 * its own writes; the row stays in L1 between the passes. */
template <bool VEC>
__global__ static void add_rmsnorm_kernel(float *x, const float *y, const float *yg, const float *g, int64_t cols,
                                          float eps, float *out, bool early)
{
    follow_previous_kernel(early);
    __shared__ float partial[THREADS / 32];
    size_t off = (size_t)blockIdx.x * (size_t)cols;
    float *xr = x + off, *dst = out + off;
    const float *yr = y + off;
    float sy = yg ? row_inv_rms<VEC>(yr, cols, eps, partial) : 1.0f;
    if (VEC) {
        for (int64_t k = threadIdx.x; k < cols / 4; k += THREADS) {
            float4 a = ((float4 *)xr)[k], b = ((const float4 *)yr)[k];
            ((float4 *)xr)[k] = yg ? add_scaled(a, b, sy, ((const float4 *)yg)[k])
                                   : make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
    } else {
        for (int64_t k = threadIdx.x; k < cols; k += THREADS) xr[k] = yg ? fmaf(yr[k] * sy, yg[k], xr[k]) : xr[k] + yr[k];
    }
    float sx = row_inv_rms<VEC>(xr, cols, eps, partial);
    if (VEC) {
        for (int64_t k = threadIdx.x; k < cols / 4; k += THREADS) {
            float4 v = ((const float4 *)xr)[k], w = ((const float4 *)g)[k];
            ((float4 *)dst)[k] = make_float4(v.x * sx * w.x, v.y * sx * w.y, v.z * sx * w.z, v.w * sx * w.w);
        }
    } else {
        for (int64_t k = threadIdx.x; k < cols; k += THREADS) dst[k] = xr[k] * sx * g[k];
    }
}

/* Whether add_rmsnorm's operands fit x: y (NULL: none) of x's shape, the
 * gains of its width, and yg only beside a y. */
static bool add_rmsnorm_shapes(const luma_buf *x, const luma_buf *y, const luma_weight *yg, const luma_weight *g)
{
    return (!y || (y->rows == x->rows && y->cols == x->cols)) && g->cols == x->cols &&
           (!yg || (y && yg->cols == x->cols));
}

/* Whether add_rmsnorm's rows may be read as float4s (the VEC kernels; y
 * NULL: none). */
static bool add_rmsnorm_vec(const luma_buf *x, const luma_buf *y, const float *ygd, const float *gd,
                            const luma_buf *out)
{
    return x->cols % 4 == 0 && aligned16(x->data) && (!y || aligned16(y->data)) && aligned16(out->data) &&
           aligned16(gd) && (!ygd || aligned16(ygd));
}

/* add_rmsnorm_regs' F for a row of cols, 0 for the loops: past 8 float4s a
 * thread, or with LUMA_CUDA_NORM_REGS=0 in the environment (read at every
 * call, for test_cuda's bit comparison). */
static int add_rmsnorm_f(int64_t cols)
{
    const char *regs = getenv("LUMA_CUDA_NORM_REGS");
    return regs && strcmp(regs, "0") == 0 ? 0 : norm_regs_f(cols);
}

void luma_cuda_add_rmsnorm(luma_backend *be, luma_buf *x, const luma_buf *y, const luma_weight *yg,
                           const luma_weight *g, float eps, luma_buf *out)
{
    cuda_backend *c = cu(be);
    out->rows = x->rows;
    out->cols = x->cols;
    if (!LUMA_CUDA_OK(c) || x->rows * x->cols == 0) return;
    if (!add_rmsnorm_shapes(x, y, yg, g)) {
        luma_cuda_failf(c, "add_rmsnorm: %lld x %lld plus %lld x %lld with gains of %lld", (long long)x->rows,
                        (long long)x->cols, (long long)(y ? y->rows : 0), (long long)(y ? y->cols : 0),
                        (long long)g->cols);
        return;
    }
    const float *ygd = yg ? (const float *)yg->dev : NULL, *gd = (const float *)g->dev;
    const bool vec = add_rmsnorm_vec(x, y, ygd, gd, out);
    const int f = add_rmsnorm_f(x->cols);   /* float4s a thread of the row in registers */
    unsigned grid = (unsigned)x->rows;
    const bool early = c->early >= 2;
    float *yd = y ? y->data : NULL;
    if (!yd && !(vec && f))
        rmsnorm_groups(c, x, gd, x->cols, eps, out);   /* the norm alone, past the register kernel */
    else if (vec && f == 1)
        luma_launch(c, c->stream, grid, THREADS, 0, add_rmsnorm_regs<1>, x->data, yd, ygd, gd, x->cols, eps,
                    out->data, early);
    else if (vec && f == 2)
        luma_launch(c, c->stream, grid, THREADS, 0, add_rmsnorm_regs<2>, x->data, yd, ygd, gd, x->cols, eps,
                    out->data, early);
    else if (vec && f == 4)
        luma_launch(c, c->stream, grid, THREADS, 0, add_rmsnorm_regs<4>, x->data, yd, ygd, gd, x->cols, eps,
                    out->data, early);
    else if (vec && f == 8)
        luma_launch(c, c->stream, grid, THREADS, 0, add_rmsnorm_regs<8>, x->data, yd, ygd, gd, x->cols, eps,
                    out->data, early);
    else if (vec)
        luma_launch(c, c->stream, grid, THREADS, 0, add_rmsnorm_kernel<true>, x->data, y->data, ygd, gd,
                    x->cols, eps, out->data, early);
    else
        luma_launch(c, c->stream, (unsigned)x->rows, THREADS, 0, add_rmsnorm_kernel<false>, x->data, y->data, ygd, gd,
                    x->cols, eps, out->data, early);
    luma_cuda_fail(c, cudaGetLastError(), "add_rmsnorm");
}

/* The most rows whose norm waits for the quantizer (LUMA_CUDA_NORMQ_ROWS
 * in the environment, read once; 8 by default): joined, Gemma 3's batch 1
 * measured about 3% faster and the 7B's 1 to 8 rows about 1%, but the 7B's
 * 16 and 32 rows 2 to 4% slower (cuda/NOTES.md, "A residual norm joined to
 * the quantizer after it"). */
static int64_t normq_max_rows(void)
{
    static const int64_t n = [] {
        const char *e = getenv("LUMA_CUDA_NORMQ_ROWS");
        return e && *e ? (int64_t)strtoll(e, NULL, 10) : (int64_t)8;
    }();
    return n;
}

bool luma_cuda_norm_pend(cuda_backend *c, luma_buf *x, const luma_buf *y, const luma_weight *yg,
                         const luma_weight *g, float eps, luma_buf *out)
{
    /* a norm the register kernel takes (the loops, asked for or not, are
     * launched as they are), of valid shapes (luma_cuda_add_rmsnorm reports
     * the others), not in place */
    if (!c->normq_on || !c->in_step || c->float_act || luma_cuda_prog_active(c) || !LUMA_CUDA_OK(c) ||
        c->pend_norm.on || x->rows < 1 || x->rows > normq_max_rows() || x->cols < 1 ||
        !add_rmsnorm_shapes(x, y, yg, g) ||
        !add_rmsnorm_vec(x, y, yg ? (const float *)yg->dev : NULL, (const float *)g->dev, out) ||
        add_rmsnorm_f(x->cols) == 0 || out->data == x->data || (y && out->data == y->data))
        return false;
    out->rows = x->rows;
    out->cols = x->cols;
    c->pend_norm.on = true;
    c->pend_norm.x = *x;
    c->pend_norm.y = y ? *y : luma_buf{};
    c->pend_norm.out = *out;
    c->pend_norm.yg = yg;
    c->pend_norm.g = g;
    c->pend_norm.eps = eps;
    return true;
}

void luma_cuda_pending_flush(cuda_backend *c)
{
    if (c->pend_attn.on) {
        c->pend_attn.on = false;
        luma_cuda_attention(c, &c->pend_attn.q, &c->pend_attn.k, &c->pend_attn.v, c->pend_attn.step,
                            &c->pend_attn.at, &c->pend_attn.out);
    }
    if (!c->pend_norm.on) return;
    c->pend_norm.on = false;
    luma_cuda_add_rmsnorm(&c->base, &c->pend_norm.x, c->pend_norm.y.data ? &c->pend_norm.y : NULL,
                          c->pend_norm.yg, c->pend_norm.g, c->pend_norm.eps, &c->pend_norm.out);
}

/* ---- RoPE ---------------------------------------------------------------- */

/* One thread per (row, head, frequency): the angle's sine and cosine, then
 * the pair (2i, 2i + 1) for NORM, (i, i + half) for NEOX. Every head of a
 * row computes the same angle the same way, so the heads of a row are as
 * many independent threads (a decode step's one row: heads x half threads,
 * not half threads each walking every head). */
__global__ static void rope_kernel(float *x, int64_t cols, const int32_t *pos, int64_t n, const rope_args a)
{
    follow_previous_kernel();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    int32_t i = (int32_t)(t % a.half);
    int64_t rh = t / a.half, row = rh / a.heads, h = rh % a.heads;
    float angle = rope_angle(a, (float)pos[row], i);
    float sn = sinf(angle), cs = cosf(angle);
    int32_t ia = a.neox ? i : 2 * i, ib = a.neox ? i + a.half : 2 * i + 1;
    float *v = x + (size_t)row * (size_t)cols + (size_t)h * (size_t)a.head_dim;
    rope_rotate(v[ia], v[ib], sn, cs, v[ia], v[ib]);
}

/* The frequencies of r for heads of head_dim in rows of cols; false when
 * they are not supported (recorded). */
bool luma_cuda_rope_args(cuda_backend *c, const luma_rope *r, int32_t head_dim, int64_t cols, rope_args *a)
{
    int32_t half = r->n_dims / 2;
    if (head_dim <= 0 || cols % head_dim != 0 || r->n_dims > head_dim || half > ROPE_MAX_HALF) {
        luma_cuda_failf(c, "rope: %d rotated dimensions in heads of %d (rows of %lld) are not supported",
                        r->n_dims, head_dim, (long long)cols);
        return false;
    }
    for (int32_t i = 0; i < half; i++) {
        a->ff[i] = r->freq_factors ? r->freq_factors[i] : 1.0f;
        a->pw[i] = powf(r->base, -2.0f * (float)i / (float)r->n_dims);
    }
    a->half = half;
    a->head_dim = head_dim;
    a->heads = (int32_t)(cols / head_dim);
    a->neox = r->kind == LUMA_ROPE_NEOX;
    a->pos_scale = r->pos_scale;
    return true;
}

/* The frequencies of r for heads of head_dim in x's rows, and the step's
 * positions of x's rows on the device: NULL where there is nothing to
 * rotate (no rows) or the setup failed (recorded). */
static const int32_t *rope_setup(cuda_backend *c, const luma_buf *x, int32_t head_dim, const int32_t *pos,
                                 const luma_rope *r, rope_args *a)
{
    if (x->rows == 0 || !luma_cuda_rope_args(c, r, head_dim, x->cols, a)) return NULL;
    return luma_cuda_step_array(c, pos, (int32_t)x->rows, "rope");
}

void luma_cuda_rope(luma_backend *be, luma_buf *x, int32_t head_dim, const int32_t *pos, const luma_rope *r)
{
    cuda_backend *c = cu(be);
    if (!LUMA_CUDA_OK(c) || r->n_dims < 2) return;
    rope_args a;
    const int32_t *d_pos = rope_setup(c, x, head_dim, pos, r, &a);
    if (!d_pos) return;
    int64_t half = a.half;
    int64_t n = x->rows * a.heads * half;
    luma_launch(c, c->stream, blocks_for(n, THREADS), THREADS, 0, rope_kernel, x->data, x->cols, d_pos, n, a);
    luma_cuda_fail(c, cudaGetLastError(), "rope");
}

/* ---- q and k: per-head norm and RoPE in one launch ---------------------- */

/* A warp per head of a row of q or of k: qk_head (rope.cuh). */
template <int D>
__global__ static void qk_rope_kernel(float *q, float *k, int64_t q_cols, int64_t k_cols, int32_t hq, int32_t hk,
                                      int64_t items, const float *gq, const float *gk, float eps,
                                      const int32_t *pos, const rope_args a)
{
    follow_previous_kernel();
    int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (w >= items) return;   /* the whole warp */
    int64_t row = w / (hq + hk);
    int32_t h = (int32_t)(w % (hq + hk));
    bool is_q = h < hq;
    float4 *x = (float4 *)(is_q ? q + row * q_cols + (int64_t)h * D : k + row * k_cols + (int64_t)(h - hq) * D);
    qk_head<D>(x, x, (const float4 *)(is_q ? gq : gk), eps, (float)pos[row], a);
}

void luma_cuda_qk_rope(luma_backend *be, luma_buf *q, luma_buf *k, const luma_weight *gq, const luma_weight *gk,
                       int32_t head_dim, float eps, const int32_t *pos, const luma_rope *r)
{
    cuda_backend *c = cu(be);
    if (!LUMA_CUDA_OK(c)) return;
    const float *gqd = gq ? (const float *)gq->dev : NULL, *gkd = gk ? (const float *)gk->dev : NULL;
    bool fused = (head_dim == 128 || head_dim == 256) && r->n_dims == head_dim && q->rows == k->rows &&
                 q->cols % head_dim == 0 && k->cols % head_dim == 0 && aligned16(q->data) && aligned16(k->data) &&
                 (gq != NULL) == (gk != NULL) && (!gq || (gq->cols == head_dim && gk->cols == head_dim &&
                                                          aligned16(gqd) && aligned16(gkd)));
    if (!fused) {
        if (gq) luma_cuda_rmsnorm(be, q, gq, head_dim, eps, q);
        if (gk) luma_cuda_rmsnorm(be, k, gk, head_dim, eps, k);
        luma_cuda_rope(be, q, head_dim, pos, r);
        luma_cuda_rope(be, k, head_dim, pos, r);
        return;
    }
    rope_args a;
    const int32_t *d_pos = rope_setup(c, q, head_dim, pos, r, &a);
    if (!d_pos) return;
    int32_t hq = (int32_t)(q->cols / head_dim), hk = (int32_t)(k->cols / head_dim);
    int64_t items = q->rows * (hq + hk);
    unsigned grid = blocks_for(items * 32, THREADS);
    if (head_dim == 128)
        luma_launch(c, c->stream, grid, THREADS, 0, qk_rope_kernel<128>, q->data, k->data, q->cols, k->cols, hq, hk,
                    items, gqd, gkd, eps, d_pos, a);
    else
        luma_launch(c, c->stream, grid, THREADS, 0, qk_rope_kernel<256>, q->data, k->data, q->cols, k->cols, hq, hk,
                    items, gqd, gkd, eps, d_pos, a);
    luma_cuda_fail(c, cudaGetLastError(), "qk_rope");
}

/* ---- qwen2's q, k and v: biases and RoPE in one launch ------------------- */

/* Threads (row, head, i) of q's heads, then of k's (a rotation pair each:
 * both entries plus their biases, then rotated as rope_kernel rotates
 * them), then v's entries (plus its bias): the bits of add_bias_kernel
 * and rope_kernel, one launch where they were five (Qwen2.5's heads of
 * 64 columns, which qk_rope_kernel does not take) or four. Every column
 * of a head is rotated (n_dims == head_dim). */
__global__ static void qkv_bias_rope_kernel(float *q, float *k, float *v, const float *bq, const float *bk,
                                            const float *bv, int64_t q_cols, int64_t k_cols, int64_t v_cols,
                                            int32_t hq, int32_t hk, int64_t rows, const int32_t *pos,
                                            const rope_args a)
{
    follow_previous_kernel();
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t nq = rows * hq * a.half, nk = rows * hk * a.half;
    if (t < nq + nk) {
        const bool is_q = t < nq;
        const int64_t u = is_q ? t : t - nq;
        const int32_t heads = is_q ? hq : hk, i = (int32_t)(u % a.half);
        const int64_t rh = u / a.half, row = rh / heads, h = rh % heads;
        float *x = (is_q ? q + row * q_cols : k + row * k_cols) + h * a.head_dim;
        const float *b = is_q ? bq : bk;
        const int32_t ia = a.neox ? i : 2 * i, ib = a.neox ? i + a.half : 2 * i + 1;
        float x0 = x[ia], x1 = x[ib];
        if (b) {
            x0 = x0 + b[h * a.head_dim + ia];
            x1 = x1 + b[h * a.head_dim + ib];
        }
        const float angle = rope_angle(a, (float)pos[row], i);
        rope_rotate(x0, x1, sinf(angle), cosf(angle), x[ia], x[ib]);
    } else if (bv && t < nq + nk + rows * v_cols) {
        const int64_t u = t - nq - nk;
        v[u] = v[u] + bv[u % v_cols];
    }
}

void luma_cuda_qkv_bias_rope(luma_backend *be, luma_buf *q, luma_buf *k, luma_buf *v, const luma_weight *bq,
                             const luma_weight *bk, const luma_weight *bv, int32_t head_dim, const int32_t *pos,
                             const luma_rope *r)
{
    cuda_backend *c = cu(be);
    if (!LUMA_CUDA_OK(c)) return;
    /* LUMA_CUDA_BIAS_ROPE=0 in the environment: the separate launches, for
     * measuring (read once) */
    static const int on = luma_cuda_env_digit("LUMA_CUDA_BIAS_ROPE", 1);
    const bool fused = on && r->n_dims == head_dim && head_dim >= 2 && head_dim % 2 == 0 && q->rows == k->rows &&
                       v->rows == q->rows && q->cols % head_dim == 0 && k->cols % head_dim == 0 &&
                       (!bq || bq->cols == q->cols) && (!bk || bk->cols == k->cols) && (!bv || bv->cols == v->cols);
    if (!fused) {
        if (bq) luma_cuda_add_bias(be, q, bq);
        if (bk) luma_cuda_add_bias(be, k, bk);
        if (bv) luma_cuda_add_bias(be, v, bv);
        luma_cuda_qk_rope(be, q, k, NULL, NULL, head_dim, 0.0f, pos, r);
        return;
    }
    rope_args a;
    const int32_t *d_pos = rope_setup(c, q, head_dim, pos, r, &a);
    if (!d_pos) return;
    const int32_t hq = (int32_t)(q->cols / head_dim), hk = (int32_t)(k->cols / head_dim);
    const int64_t n = q->rows * (hq + hk) * a.half + (bv ? v->rows * v->cols : 0);
    luma_launch(c, c->stream, blocks_for(n, THREADS), THREADS, 0, qkv_bias_rope_kernel, q->data, k->data, v->data,
                bq ? (const float *)bq->dev : NULL, bk ? (const float *)bk->dev : NULL,
                bv ? (const float *)bv->dev : NULL, q->cols, k->cols, v->cols, hq, hk, q->rows, d_pos, a);
    luma_cuda_fail(c, cudaGetLastError(), "qkv_bias_rope");
}

/* ---- elementwise --------------------------------------------------------- */

enum { EW_ADD, EW_GELU_MUL, EW_SILU_MUL };

template <int OP>
__device__ static float ew(float a, float b)
{
    if (OP == EW_ADD) return a + b;
    if (OP == EW_GELU_MUL) return act_gated<LUMA_ACT_GELU>(a, b);
    return act_gated<LUMA_ACT_SILU>(a, b);
}

/* a[i] = op(a[i], b[i]) for n floats; the float4 body covers n / 4 and the
 * first threads finish the tail. */
template <int OP, bool VEC>
__global__ static void ew_kernel(float *a, const float *b, int64_t n)
{
    follow_previous_kernel();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (VEC) {
        if (t < n / 4) {
            float4 x = ((float4 *)a)[t], y = ((const float4 *)b)[t];
            ((float4 *)a)[t] = make_float4(ew<OP>(x.x, y.x), ew<OP>(x.y, y.y), ew<OP>(x.z, y.z), ew<OP>(x.w, y.w));
        }
        int64_t tail = n / 4 * 4 + t;
        if (t < n % 4) a[tail] = ew<OP>(a[tail], b[tail]);
    } else if (t < n) {
        a[t] = ew<OP>(a[t], b[t]);
    }
}

template <int OP>
static void elementwise(luma_backend *be, luma_buf *x, const luma_buf *y, const char *what)
{
    cuda_backend *c = cu(be);
    int64_t n = x->rows * x->cols;
    if (!LUMA_CUDA_OK(c) || n == 0) return;
    if (aligned16(x->data) && aligned16(y->data))
        luma_launch(c, c->stream, blocks_for(n / 4 + 1, THREADS), THREADS, 0, ew_kernel<OP, true>, x->data, y->data, n);
    else
        luma_launch(c, c->stream, blocks_for(n, THREADS), THREADS, 0, ew_kernel<OP, false>, x->data, y->data, n);
    luma_cuda_fail(c, cudaGetLastError(), what);
}

void luma_cuda_add(luma_backend *be, luma_buf *x, const luma_buf *y) { elementwise<EW_ADD>(be, x, y, "add"); }

void luma_cuda_gelu_mul(luma_backend *be, luma_buf *gate, const luma_buf *up)
{
    elementwise<EW_GELU_MUL>(be, gate, up, "gelu_mul");
}

void luma_cuda_silu_mul(luma_backend *be, luma_buf *gate, const luma_buf *up)
{
    elementwise<EW_SILU_MUL>(be, gate, up, "silu_mul");
}

/* x[r][j] += b[j]; cols counts floats, or float4s when VEC. */
template <typename T>
__global__ static void add_bias_kernel(T *x, const T *b, int64_t cols, int64_t n)
{
    follow_previous_kernel();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    T v = x[t], w = b[t % cols];
    if constexpr (sizeof(T) == sizeof(float4)) {
        v.x += w.x;
        v.y += w.y;
        v.z += w.z;
        v.w += w.w;
        x[t] = v;
    } else {
        x[t] = v + w;
    }
}

void luma_cuda_add_bias(luma_backend *be, luma_buf *x, const luma_weight *b)
{
    cuda_backend *c = cu(be);
    int64_t n = x->rows * x->cols;
    if (!LUMA_CUDA_OK(c) || n == 0) return;
    const float *bv = (const float *)b->dev;
    if (x->cols % 4 == 0 && aligned16(x->data) && aligned16(bv))
        luma_launch(c, c->stream, blocks_for(n / 4, THREADS), THREADS, 0, add_bias_kernel<float4>, (float4 *)x->data,
                    (const float4 *)bv, x->cols / 4, n / 4);
    else
        luma_launch(c, c->stream, blocks_for(n, THREADS), THREADS, 0, add_bias_kernel<float>, x->data, bv, x->cols, n);
    luma_cuda_fail(c, cudaGetLastError(), "add_bias");
}
