/* Attention over the paged KV cache on the GPU; the reference is
 * cpu_attention in src/cpu/backend.c.
 *
 * A layer's cache lives in its pool: physical block b holds, for each layer
 * of the pool, K [n_kv_head][block_tokens][head_dim_k] then V
 * [n_kv_head][block_tokens][head_dim_v], in F16 or F32. A query at position
 * p sees the keys first <= k <= p, first = window ? max(0, p - window + 1) : 0.
 *
 * Three steps per call:
 *   store    the step's k and v rows go to their positions' slots;
 *   decode   rows of short chunks (decode tokens) are computed one query row
 *            at a time: a CTA takes one row, one kv head and all the query
 *            heads sharing it (each K/V row is read once for the group), and
 *            one split of the row's keys; splits keep the GPU busy when few
 *            rows have long contexts and are merged by a second kernel
 *            (flash-decoding). The number of splits follows the step's
 *            dec_keys_bound, not its context lengths, so that a decode step
 *            recorded as a CUDA graph replays unchanged for every step of
 *            its bucket: splits past a row's keys leave empty partials.
 *   prefill  long chunks are cut into tiles of LUMA_CUDA_ATTN_TILE (128)
 *            query rows, attended with an online softmax (flash attention):
 *            no score matrix is ever materialized beyond a tile of keys.
 *            F16 caches with dk = dv in {64, 128, 256} take prefill_tc_kernel
 *            (tensor cores, mma.sync m16n8k16: f16 operands, f32 sums); the
 *            others prefill_kernel (CUDA cores, f32 arithmetic, 16 rows of a
 *            tile per CTA).
 * All copy K and V rows from the cache to shared memory with 16-byte
 * asynchronous copies (cp.async), a whole pass of keys in flight at once, so
 * a CTA waits for memory once per pass rather than once per key.
 *
 * Napkin math for decode: a context of n keys costs n * n_kv_head *
 * (dk + dv) * 2 bytes (F16) per layer and row; Gemma 3 270M at 4096 keys
 * (one kv head, 256 + 256) reads 4 MiB per layer, ~1.4 us at 3.0 TB/s.
 * Prefill is compute-bound: 2 * n_rows * n_keys * (dk + dv) flops per head
 * (half of n_rows^2 keys when causal); a 7B llama's 4096-token prompt (32
 * heads of 128) is 137 GFLOP per layer, 0.69 ms at 200 TFLOP/s, while its
 * whole K and V (16 MiB per layer) stay in the 50 MB L2. cuda/NOTES.md has
 * the measurements. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#define HEAD_MAX 256          /* largest head_dim_k / head_dim_v handled */
#define DEC_THREADS 256
#define DEC_WARPS (DEC_THREADS / 32)
#define DEC_TILE 64           /* keys scored per pass of a decode CTA */
#define DEC_HEADS 8           /* query heads per decode CTA (one kv head's group, or part of it) */
#define MIN_SPLIT_KEYS 64     /* decode splits hold at least this many keys */
#define PF_QT 16              /* query rows per CUDA-core prefill CTA */
#define PF_SUB (LUMA_CUDA_ATTN_TILE / PF_QT)   /* its CTAs per tile */
#define PF_TPR 16             /* prefill threads per query row */
#define PF_THREADS (PF_QT * PF_TPR)
#define PF_KT 32              /* keys per pass of a prefill CTA */
#define TC_WARPS 4            /* warps of a tensor-core prefill CTA */
#define TC_THREADS (TC_WARPS * 32)

static_assert(LUMA_CUDA_ATTN_TILE % PF_QT == 0 && LUMA_CUDA_ATTN_TILE % (TC_WARPS * 32) == 0,
              "a prefill tile is whole CUDA-core and tensor-core CTAs");

/* Everything the kernels need: where the layer lives, the shapes, and the
 * step's metadata on the device. */
typedef struct attn_args {
    const float *q, *k, *v;
    int64_t q_cols, k_cols, v_cols, out_cols;
    float *out;
    uint8_t *pool;             /* the pool's first block */
    size_t block_bytes;        /* one physical block: every layer of the pool */
    size_t layer_off;          /* this layer inside a block */
    size_t v_off;              /* V after K inside the layer */
    int32_t block_tokens, bt_shift, dk, dv;   /* block_tokens = 1 << bt_shift */
    int32_t n_head, n_kv_head, group;   /* group = n_head / n_kv_head */
    int32_t heads_per_cta, n_hchunks;   /* decode: query heads of a group per CTA */
    int32_t v_lanes;           /* decode: lanes covering one V row, 8 elements each */
    float scale, softcap;
    int32_t window;
    int32_t n_seqs, pool_index;
    const int32_t *pos, *row_seq, *blocks, *block_off, *seq_row0, *seq_nrows;
    const int32_t *dec_rows, *tiles;
    int32_t n_tiles;
    int32_t split_len, n_splits;
    float *part;               /* decode partials: [n_dec][n_head][n_splits][dv + 2] */
} attn_args;

/* ---- element access ------------------------------------------------------ */

__device__ static void from_float(float x, __half *dst) { *dst = __float2half_rn(x); }
__device__ static void from_float(float x, float *dst) { *dst = x; }

/* Eight consecutive elements (16-byte aligned) as floats. */
__device__ static void load8(const __half *p, float v[8])
{
    uint4 u = *(const uint4 *)p;
    const __half2 *h = (const __half2 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __half22float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

__device__ static void load8(const float *p, float v[8])
{
    float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

/* The K (or V) row of kv head h at position k of a sequence whose block
 * table is tab; NULL when the block was released. */
template <typename T>
__device__ static T *kv_row(const attn_args &a, const int32_t *tab, int32_t h, int32_t k, bool value)
{
    int32_t b = tab[k / a.block_tokens], off = k % a.block_tokens;
    if (b < 0) return NULL;
    uint8_t *layer = a.pool + (size_t)b * a.block_bytes + a.layer_off;
    size_t slot = (size_t)h * (size_t)a.block_tokens + (size_t)off;
    if (!value) return (T *)layer + slot * (size_t)a.dk;
    return (T *)(layer + a.v_off) + slot * (size_t)a.dv;
}

__device__ static const int32_t *block_table(const attn_args &a, int32_t seq)
{
    return a.blocks + a.block_off[a.pool_index * a.n_seqs + seq];
}

__device__ static int32_t first_key(const attn_args &a, int32_t p)
{
    return a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
}

__device__ static float score(const attn_args &a, float dot)
{
    float s = dot * a.scale;
    return a.softcap > 0.0f ? a.softcap * tanhf(s / a.softcap) : s;
}

/* ---- store --------------------------------------------------------------- */

/* grid (rows, kv heads): the row's k and v of head h into its slot. */
template <typename T>
__global__ static void store_kernel(const attn_args a)
{
    int32_t r = blockIdx.x, h = blockIdx.y, p = a.pos[r];
    const int32_t *tab = block_table(a, a.row_seq[r]);
    T *kd = kv_row<T>(a, tab, h, p, false), *vd = kv_row<T>(a, tab, h, p, true);
    if (!kd) return;
    const float *ks = a.k + (size_t)r * (size_t)a.k_cols + (size_t)h * (size_t)a.dk;
    const float *vs = a.v + (size_t)r * (size_t)a.v_cols + (size_t)h * (size_t)a.dv;
    for (int32_t e = threadIdx.x; e < a.dk; e += blockDim.x) from_float(ks[e], kd + e);
    for (int32_t e = threadIdx.x; e < a.dv; e += blockDim.x) from_float(vs[e], vd + e);
}

/* ---- tiles of keys in shared memory ------------------------------------- */

/* 16 bytes from global to shared memory without passing through registers;
 * when !valid nothing is read and the 16 bytes are zeros. */
__device__ static void cp_async16(void *dst, const void *src, bool valid)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}

__device__ static void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::); }

/* Waits until at most N groups of copies are still in flight. */
template <int N>
__device__ static void cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Starts copying the K (or V) rows of kv head h for keys [kb, kb + n) into
 * rows [0, n) of dst (ld elements apart), and zeros into rows [n, rows):
 * a key past the range must weigh 0 * finite, never 0 * garbage. Rows of
 * released blocks read as zeros. A warp takes a row (its lanes the row's
 * 16-byte pieces), the CTA's nwarps warps the rows in turn. */
template <typename T>
__device__ static void tile_async(const attn_args &a, const int32_t *tab, int32_t h, int32_t kb, int32_t n,
                                  int32_t rows, bool value, T *dst, int ld, int nwarps)
{
    const int per_piece = 16 / (int)sizeof(T);
    int32_t pieces = (value ? a.dv : a.dk) / per_piece;
    int lane = threadIdx.x % 32;
#pragma unroll 4
    for (int32_t kk = threadIdx.x / 32; kk < rows; kk += nwarps) {
        const T *row = kk < n ? kv_row<T>(a, tab, h, kb + kk, value) : NULL;
        for (int32_t c = lane; c < pieces; c += 32)
            cp_async16(dst + (size_t)kk * ld + c * per_piece, row ? row + c * per_piece : (const T *)a.pool,
                       row != NULL);
    }
}

/* ---- decode -------------------------------------------------------------- */

/* Dynamic shared memory of a decode CTA: q of its heads, a pass's scores,
 * and the pass's K and V rows, whose room also serves the final sum. */
static size_t decode_smem(int32_t dk, int32_t dv, int32_t heads, size_t es)
{
    size_t tile = (size_t)DEC_TILE * (size_t)(dk + dv) * es;
    size_t red = (size_t)DEC_WARPS * (size_t)heads * (size_t)dv * sizeof(float);
    return ((size_t)DEC_HEADS * (size_t)dk + (size_t)DEC_HEADS * DEC_TILE) * sizeof(float) + (tile > red ? tile : red);
}

/* grid (decode rows, splits, kv heads x head chunks). One CTA: one query
 * row, up to DEC_HEADS query heads of one kv head, keys [k0, k1) of the row,
 * DEC_TILE keys per pass:
 *   the pass's K and V rows are copied to shared memory at once (cp.async,
 *     16 bytes per copy: the whole tile is in flight together);
 *   A  scores: 8 lanes share a key (8 elements each per 64 of dk), a warp
 *      4 keys at once, every head of the group against the same K row;
 *   B  online softmax per head: running max m and sum l, and the factor
 *      that rescales the accumulators;
 *   C  acc += p V: v_lanes lanes cover a V row, 8 elements each, and every
 *      head uses the row.
 * The warps' accumulators are summed through shared memory at the end. */
template <typename T>
__global__ static void __launch_bounds__(DEC_THREADS) decode_kernel(const attn_args a)
{
    extern __shared__ __align__(16) unsigned char dsm[];
    float *qs = (float *)dsm;                    /* [DEC_HEADS][dk] */
    float *ps = qs + DEC_HEADS * a.dk;           /* [DEC_HEADS][DEC_TILE] */
    T *ks = (T *)(ps + DEC_HEADS * DEC_TILE);    /* [DEC_TILE][dk] */
    T *vs = ks + DEC_TILE * a.dk;                /* [DEC_TILE][dv] */
    float *red = (float *)ks;                    /* [DEC_WARPS][heads][dv], after the last pass */
    __shared__ float m_s[DEC_HEADS], l_s[DEC_HEADS], corr_s[DEC_HEADS];

    int32_t y = blockIdx.x, split = blockIdx.y;
    int32_t kvh = blockIdx.z / a.n_hchunks, hc0 = (int32_t)(blockIdx.z % a.n_hchunks) * a.heads_per_cta;
    int32_t nh = min(a.heads_per_cta, a.group - hc0), h0 = kvh * a.group + hc0;
    int32_t r = a.dec_rows[y], p = a.pos[r];
    int32_t k0 = first_key(a, p) + split * a.split_len, k1 = min(p + 1, k0 + a.split_len);
    const int32_t *tab = block_table(a, a.row_seq[r]);
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

    const float *q = a.q + (size_t)r * (size_t)a.q_cols + (size_t)h0 * (size_t)a.dk;
    for (int i = tid; i < nh * a.dk; i += DEC_THREADS) qs[i] = q[i];
    if (tid < DEC_HEADS) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
    float acc[DEC_HEADS][8];
#pragma unroll
    for (int g = 0; g < DEC_HEADS; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] = 0.0f;
    int kpv = 32 / a.v_lanes, vsub = lane / a.v_lanes, ve = (lane % a.v_lanes) * 8;

    for (int32_t kt = k0; kt < k1; kt += DEC_TILE) {
        int32_t n = min(DEC_TILE, k1 - kt);
        tile_async<T>(a, tab, kvh, kt, n, n, false, ks, a.dk, DEC_WARPS);
        tile_async<T>(a, tab, kvh, kt, n, n, true, vs, a.dv, DEC_WARPS);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        int sl = lane % 8;
        for (int kk = warp * 4 + lane / 8; kk < DEC_TILE; kk += 4 * DEC_WARPS) {
            float part[DEC_HEADS];
#pragma unroll
            for (int g = 0; g < DEC_HEADS; g++) part[g] = 0.0f;
            if (kk < n) {
                for (int e = sl * 8; e < a.dk; e += 64) {
                    float kv[8];
                    load8(ks + kk * a.dk + e, kv);
#pragma unroll
                    for (int g = 0; g < DEC_HEADS; g++) {
                        if (g >= nh) break;
                        const float *qg = qs + g * a.dk + e;
                        float4 q0 = *(const float4 *)qg, q1 = *(const float4 *)(qg + 4);
                        part[g] += q0.x * kv[0] + q0.y * kv[1] + q0.z * kv[2] + q0.w * kv[3] +
                                   q1.x * kv[4] + q1.y * kv[5] + q1.z * kv[6] + q1.w * kv[7];
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < DEC_HEADS; g++) {
                if (g >= nh) break;   /* nh is the same for the whole CTA */
                for (int o = 4; o > 0; o /= 2) part[g] += __shfl_xor_sync(0xffffffffu, part[g], o);
            }
            if (sl == 0)
#pragma unroll
                for (int g = 0; g < DEC_HEADS; g++) {
                    if (g >= nh) break;
                    ps[g * DEC_TILE + kk] = kk < n ? score(a, part[g]) : -INFINITY;
                }
        }
        __syncthreads();

        for (int g = warp; g < nh; g += DEC_WARPS) {
            float s0 = ps[g * DEC_TILE + lane], s1 = ps[g * DEC_TILE + lane + 32], mx = fmaxf(s0, s1);
            for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float m_new = fmaxf(m_s[g], mx);   /* finite: the pass holds key kt */
            float e0 = expf(s0 - m_new), e1 = expf(s1 - m_new), sum = e0 + e1;
            ps[g * DEC_TILE + lane] = e0;
            ps[g * DEC_TILE + lane + 32] = e1;
            for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) {
                float corr = expf(m_s[g] - m_new);
                corr_s[g] = corr;
                l_s[g] = l_s[g] * corr + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();

#pragma unroll
        for (int g = 0; g < DEC_HEADS; g++) {
            float cr = g < nh ? corr_s[g] : 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++) acc[g][j] *= cr;
        }
        if (ve < a.dv) {
            for (int kk = warp * kpv + vsub; kk < n; kk += DEC_WARPS * kpv) {
                float vv[8];
                load8(vs + kk * a.dv + ve, vv);
#pragma unroll
                for (int g = 0; g < DEC_HEADS; g++) {
                    if (g >= nh) break;
                    float pg = ps[g * DEC_TILE + kk];
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[g][j] += pg * vv[j];
                }
            }
        }
        __syncthreads();
    }

    /* lanes holding the same V elements for different keys, then warps */
    for (int o = a.v_lanes; o < 32; o *= 2)
#pragma unroll
        for (int g = 0; g < DEC_HEADS; g++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
    if (vsub == 0 && ve < a.dv)
#pragma unroll
        for (int g = 0; g < DEC_HEADS; g++) {
            if (g >= nh) break;
#pragma unroll
            for (int j = 0; j < 8; j++) red[(warp * nh + g) * a.dv + ve + j] = acc[g][j];
        }
    __syncthreads();
    for (int i = tid; i < nh * a.dv; i += DEC_THREADS) {
        int g = i / a.dv, e = i % a.dv;
        float o = 0.0f;
        for (int w = 0; w < DEC_WARPS; w++) o += red[(w * nh + g) * a.dv + e];
        if (a.n_splits == 1) {
            a.out[(size_t)r * (size_t)a.out_cols + (size_t)(h0 + g) * (size_t)a.dv + (size_t)e] = o / l_s[g];
        } else {
            float *pt = a.part + (((size_t)y * (size_t)a.n_head + (size_t)(h0 + g)) * (size_t)a.n_splits + (size_t)split) *
                                     (size_t)(a.dv + 2);
            pt[e] = o;
            if (e == 0) {
                pt[a.dv] = m_s[g];
                pt[a.dv + 1] = l_s[g];
            }
        }
    }
}

/* grid (decode rows, query heads): merges the splits' partial results, each
 * weighted by exp(m_split - m) / l (empty splits have m = -inf and l = 0).
 * The weights go to shared memory first, so the sum over the splits is a
 * stream of independent loads. */
__global__ static void combine_kernel(const attn_args a)
{
    extern __shared__ float wsm[];   /* [n_splits] m, then weights; [n_splits] l */
    __shared__ float m_s, l_s;
    int32_t y = blockIdx.x, h = blockIdx.y, r = a.dec_rows[y];
    size_t stride = (size_t)(a.dv + 2);
    const float *pt = a.part + ((size_t)y * (size_t)a.n_head + (size_t)h) * (size_t)a.n_splits * stride;
    float *ls = wsm + a.n_splits;
    for (int32_t s = threadIdx.x; s < a.n_splits; s += blockDim.x) {
        wsm[s] = pt[s * stride + a.dv];
        ls[s] = pt[s * stride + a.dv + 1];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = -INFINITY, l = 0.0f;
        for (int32_t s = 0; s < a.n_splits; s++) m = fmaxf(m, wsm[s]);
        for (int32_t s = 0; s < a.n_splits; s++)
            if (wsm[s] > -INFINITY) l += ls[s] * expf(wsm[s] - m);
        m_s = m;
        l_s = l;
    }
    __syncthreads();
    for (int32_t s = threadIdx.x; s < a.n_splits; s += blockDim.x)
        wsm[s] = wsm[s] > -INFINITY ? expf(wsm[s] - m_s) / l_s : 0.0f;
    __syncthreads();
    float *out = a.out + (size_t)r * (size_t)a.out_cols + (size_t)h * (size_t)a.dv;
    for (int32_t e = threadIdx.x; e < a.dv; e += blockDim.x) {
        float o = 0.0f;
#pragma unroll 8
        for (int32_t s = 0; s < a.n_splits; s++) o += pt[s * stride + e] * wsm[s];
        out[e] = o;
    }
}

/* ---- prefill ------------------------------------------------------------- */

/* Four consecutive elements (8-byte aligned for F16, 16 for F32) as floats. */
__device__ static float4 load4(const __half *p)
{
    uint2 u = *(const uint2 *)p;
    float2 a = __half22float2(*(const __half2 *)&u.x), b = __half22float2(*(const __half2 *)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}

__device__ static float4 load4(const float *p) { return *(const float4 *)p; }

/* Row strides in shared memory: q rows of DMAX + 4 floats, K/V rows of DMAX
 * elements plus 16 bytes; both keep 16-byte alignment and put consecutive
 * rows four banks apart. */
template <typename T, int DMAX>
struct prefill_layout {
    static const int q_ld = DMAX + 4;
    static const int kv_ld = DMAX + 16 / (int)sizeof(T);
    static const int p_ld = PF_KT + 1;
    static size_t bytes(void)
    {
        return (size_t)PF_QT * q_ld * sizeof(float) + 2 * 2 * (size_t)PF_KT * kv_ld * sizeof(T) +
               (size_t)PF_QT * p_ld * sizeof(float);
    }
};

/* grid (tiles, query heads, PF_SUB): the CTA takes rows [16 z, 16 z + 16)
 * of its tile. Thread t owns query row t / PF_TPR of them; the row's PF_TPR
 * threads split each pass's 32 keys (key kq + PF_TPR j) for the scores and
 * the dv columns (float4 columns kq + PF_TPR j) for the output, so the
 * row's running max and sum stay in registers (shuffles among the row's
 * threads combine them). K and V rows come in through two stages of shared
 * memory: the next pass's copy is in flight while this one computes. */
template <typename T, int DMAX>
__global__ static void __launch_bounds__(PF_THREADS) prefill_kernel(const attn_args a)
{
    typedef prefill_layout<T, DMAX> L;
    extern __shared__ __align__(16) unsigned char psm[];
    const int tile = PF_KT * L::kv_ld;   /* elements of one K or V tile */
    float *qs = (float *)psm;
    T *stages = (T *)(qs + PF_QT * L::q_ld);   /* [2 stages][K, V][PF_KT][kv_ld] */
    float *ps = (float *)(stages + 4 * tile);
    __shared__ int32_t kmin_s, kmax_s;

    int32_t seq = a.tiles[2 * blockIdx.x], t0 = a.tiles[2 * blockIdx.x + 1] + PF_QT * (int32_t)blockIdx.z;
    int32_t h = blockIdx.y, row0 = a.seq_row0[seq] + t0, nrows = min(PF_QT, a.seq_nrows[seq] - t0);
    if (nrows <= 0) return;   /* past the end of a short last tile */
    int32_t kvh = h / a.group;
    const int32_t *tab = block_table(a, seq);
    int tid = threadIdx.x, r = tid / PF_TPR, kq = tid % PF_TPR;
    bool live = r < nrows;
    int32_t prow = live ? a.pos[row0 + r] : -1, frow = live ? first_key(a, prow) : 0;

    if (tid == 0) {
        kmin_s = INT32_MAX;
        kmax_s = -1;
    }
    for (int i = tid; i < PF_QT * a.dk; i += PF_THREADS) {
        int rr = i / a.dk, d = i % a.dk;
        qs[rr * L::q_ld + d] =
            rr < nrows ? a.q[(size_t)(row0 + rr) * (size_t)a.q_cols + (size_t)h * (size_t)a.dk + d] : 0.0f;
    }
    __syncthreads();
    if (live && kq == 0) {
        atomicMin(&kmin_s, frow);
        atomicMax(&kmax_s, prow);
    }
    __syncthreads();
    int32_t kmin = kmin_s, kmax = kmax_s;

    float m = -INFINITY, l = 0.0f;
    const int NS = PF_KT / PF_TPR, NC = DMAX / (4 * PF_TPR);   /* keys, float4 columns per thread */
    float4 acc[NC];
#pragma unroll
    for (int j = 0; j < NC; j++) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    int32_t n0 = min(PF_KT, kmax - kmin + 1);
    tile_async<T>(a, tab, kvh, kmin, n0, PF_KT, false, stages, L::kv_ld, PF_THREADS / 32);
    tile_async<T>(a, tab, kvh, kmin, n0, PF_KT, true, stages + tile, L::kv_ld, PF_THREADS / 32);
    cp_async_commit();
    int st = 0;
    for (int32_t kb = kmin; kb <= kmax; kb += PF_KT, st ^= 1) {
        if (kb + PF_KT <= kmax) {
            int32_t n = min(PF_KT, kmax - (kb + PF_KT) + 1);
            T *next = stages + 2 * (st ^ 1) * tile;
            tile_async<T>(a, tab, kvh, kb + PF_KT, n, PF_KT, false, next, L::kv_ld, PF_THREADS / 32);
            tile_async<T>(a, tab, kvh, kb + PF_KT, n, PF_KT, true, next + tile, L::kv_ld, PF_THREADS / 32);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T *ks = stages + 2 * st * tile, *vs = ks + tile;

        float s[NS];
#pragma unroll
        for (int j = 0; j < NS; j++) s[j] = 0.0f;
        for (int d = 0; d < a.dk; d += 4) {
            float4 qv = *(const float4 *)&qs[r * L::q_ld + d];
#pragma unroll
            for (int j = 0; j < NS; j++) {
                float4 kv = load4(ks + (kq + PF_TPR * j) * L::kv_ld + d);
                s[j] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
            }
        }
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < NS; j++) {
            int32_t key = kb + kq + PF_TPR * j;
            s[j] = live && key >= frow && key <= prow ? score(a, s[j]) : -INFINITY;
            mx = fmaxf(mx, s[j]);
        }
        for (int o = 1; o < PF_TPR; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float m_new = fmaxf(m, mx);
        /* a row none of whose keys was visible yet keeps m = -inf, l = 0 */
        float corr = m_new == -INFINITY ? 1.0f : expf(m - m_new), sum = 0.0f;
#pragma unroll
        for (int j = 0; j < NS; j++) {
            float e = s[j] == -INFINITY ? 0.0f : expf(s[j] - m_new);
            ps[r * L::p_ld + kq + PF_TPR * j] = e;
            sum += e;
        }
        for (int o = 1; o < PF_TPR; o *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        l = l * corr + sum;
        m = m_new;
#pragma unroll
        for (int j = 0; j < NC; j++) {
            acc[j].x *= corr;
            acc[j].y *= corr;
            acc[j].z *= corr;
            acc[j].w *= corr;
        }
        __syncwarp();   /* the row's threads are in one warp: its p are written */
        for (int kk = 0; kk < PF_KT; kk++) {
            float pk = ps[r * L::p_ld + kk];
#pragma unroll
            for (int j = 0; j < NC; j++) {
                int col = 4 * (kq + PF_TPR * j);
                if (col >= a.dv) break;
                float4 vv = load4(vs + kk * L::kv_ld + col);
                acc[j].x += pk * vv.x;
                acc[j].y += pk * vv.y;
                acc[j].z += pk * vv.z;
                acc[j].w += pk * vv.w;
            }
        }
        __syncthreads();
    }

    if (!live) return;
    float inv = 1.0f / l;
    float *out = a.out + (size_t)(row0 + r) * (size_t)a.out_cols + (size_t)h * (size_t)a.dv;
#pragma unroll
    for (int j = 0; j < NC; j++) {
        int col = 4 * (kq + PF_TPR * j);
        if (col >= a.dv) break;
        out[col] = acc[j].x * inv;
        out[col + 1] = acc[j].y * inv;
        out[col + 2] = acc[j].z * inv;
        out[col + 3] = acc[j].w * inv;
    }
}

/* ---- prefill on the tensor cores ----------------------------------------- */

/* The shape of a tensor-core prefill CTA for heads of D dimensions: 4
 * warps, each owning MT m16 tiles (16 MT query rows), so that every K or V
 * fragment read from shared memory feeds 2 MT products (32 rows a warp as
 * in flash-attention 2; heads of 256 keep 16, their accumulators alone
 * taking 128 registers); KT keys per pass. Shared memory, in halves: Q
 * [ROWS][LD], then two stages of K [KT][LD] and V [KT][LD]. Rows are D + 8
 * halves long: the eight rows an ldmatrix reads sit 16 bytes apart in the
 * banks, so each 8 x 8 matrix is one conflict-free access. 104 KB at 128
 * dimensions and 101 KB at 256: two CTAs per SM. */
template <int D>
struct tc_layout {
    static const int MT = D > 128 ? 1 : 2;
    static const int ROWS = TC_WARPS * 16 * MT;
    static const int SUB = LUMA_CUDA_ATTN_TILE / ROWS;   /* CTAs per tile */
    static const int KT = D > 128 ? 32 : 64;
    static const int LD = D + 8;
    static size_t bytes(void) { return (size_t)(ROWS + 4 * KT) * LD * sizeof(__half); }
};

/* Four 8 x 8 matrices of halves: lane l gives the address of row l % 8 of
 * matrix l / 8 and receives, in r[i], elements (l / 4, 2 (l % 4) + {0, 1})
 * of matrix i (transposed: (2 (l % 4) + {0, 1}, l / 4)). */
__device__ static void ldsm4(uint32_t r[4], const __half *p)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ static void ldsm4_t(uint32_t r[4], const __half *p)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

/* c (16 x 8, f32) += a (16 x 16, f16, row-major) b (16 x 8, f16). With g =
 * lane / 4, t = lane % 4: a holds rows g, g + 8 at columns 2t + {0, 1} and
 * 2t + 8 + {0, 1} (a[0] (g, 2t), a[1] (g + 8, 2t), a[2] (g, 2t + 8), a[3]
 * (g + 8, 2t + 8)); b0 holds rows 2t + {0, 1} of column g, b1 rows 2t + 8 +
 * {0, 1}; c holds (g, 2t + {0, 1}) in c[0..1] and (g + 8, ...) in c[2..3]. */
__device__ static void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ static uint32_t pack_half2(float lo, float hi)
{
    __half2 h = __floats2half2_rn(lo, hi);
    return *(uint32_t *)&h;
}

__device__ static float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Starts copying the K and V rows of kv head h for keys [kb, kb + KT) into
 * a stage, zeros for keys past kend and for released blocks (they weigh
 * 0 * finite). D / 8 threads share a row, one 16-byte piece each; a row's
 * block comes from one look-up (block_tokens is a power of two: shifts). */
template <int D>
__device__ static void tc_load(const attn_args &a, const int32_t *tab, int32_t h, int32_t kb, int32_t kend,
                               __half *ks, __half *vs)
{
    typedef tc_layout<D> L;
    const int pieces = D / 8, rows_per_sweep = TC_THREADS / pieces;
    int c = threadIdx.x % pieces;
    const __half *zero = (const __half *)a.pool;
#pragma unroll
    for (int j = 0; j < L::KT / rows_per_sweep; j++) {
        int kk = (int)threadIdx.x / pieces + j * rows_per_sweep;
        int32_t key = kb + kk, b = key <= kend ? tab[key >> a.bt_shift] : -1;
        const __half *kr = zero, *vr = zero;
        if (b >= 0) {
            const uint8_t *layer = a.pool + (size_t)b * a.block_bytes + a.layer_off;
            size_t at = ((size_t)h * (size_t)a.block_tokens + (size_t)(key & (a.block_tokens - 1))) * D + c * 8;
            kr = (const __half *)layer + at;
            vr = (const __half *)(layer + a.v_off) + at;
        }
        cp_async16(ks + kk * L::LD + c * 8, kr, b >= 0);
        cp_async16(vs + kk * L::LD + c * 8, vr, b >= 0);
    }
}

/* The tensor-core state of one warp: for each of its m16 tiles, the output
 * accumulators (16 x D, as mma C fragments: columns 8 j + 2t + {0, 1} of
 * rows g and g + 8) and the running maximum and sum (this thread's share)
 * of its two rows. */
template <int D>
struct tc_rows {
    float o[tc_layout<D>::MT][D / 8][4];
    float m[tc_layout<D>::MT][2], l[tc_layout<D>::MT][2];
};

/* Where lane l points its ldmatrix row addresses: A operands (Q) and V run
 * the four 8 x 8 matrices down then across, K across then down. */
struct tc_lane {
    int a_row, a_col, k_row, k_col, t4;
};

/* One pass of a warp over the KT keys at kb in shared memory (ks, vs):
 * scores, online softmax, O += P V. CAP: the softcap's tanh (cap_in =
 * 1 / c, cap_out = c log2(e)); mask: some key of the pass is hidden from
 * some row, whose keys are [first[r], pos[r]] (pos -1: a row past the
 * chunk; r = 16 mt + 8 hf from this thread's first row). The mask is
 * applied by selects, not branches, so that a pass stays one block of
 * straight-line code for the scheduler (a second, unmasked copy spilled). */
template <int D, bool CAP>
__device__ __forceinline__ static void tc_pass(tc_rows<D> &w, const __half *q_warp, const __half *ks,
                                               const __half *vs, int32_t kb, const tc_lane &ln, bool mask,
                                               const int32_t *first, const int32_t *pos, float cap_in,
                                               float cap_out)
{
    typedef tc_layout<D> L;
    const int MT = L::MT, KT = L::KT, LD = L::LD, NJ = KT / 8;
    float s[MT][NJ][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < NJ; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc++) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) ldsm4(qa[mt], q_warp + mt * 16 * LD + kc * 16);
#pragma unroll
        for (int jj = 0; jj < KT / 16; jj++) {
            uint32_t kf[4];
            ldsm4(kf, ks + (jj * 16 + ln.k_row) * LD + kc * 16 + ln.k_col);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma16816(s[mt][2 * jj], qa[mt], kf[0], kf[1]);
                mma16816(s[mt][2 * jj + 1], qa[mt], kf[2], kf[3]);
            }
        }
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float mx[2] = { -INFINITY, -INFINITY };
        int32_t lo[2], hi[2];
        if (mask)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                lo[hf] = first[16 * mt + 8 * hf];
                hi[hf] = pos[16 * mt + 8 * hf];
            }
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[mt][j][e];
                if (CAP) x = cap_out * tanhf(x * cap_in);
                if (mask) {
                    int32_t key = kb + 8 * j + 2 * ln.t4 + (e & 1);
                    if (key < lo[e / 2] || key > hi[e / 2]) x = -INFINITY;
                }
                s[mt][j][e] = x;
                mx[e / 2] = fmaxf(mx[e / 2], x);
            }
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
            mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
            /* a row that has seen no key yet (max -inf) takes base 0, so its
             * p and corr are 0; the key of the maximum weighs exactly 1 */
            float mn = fmaxf(w.m[mt][hf], mx[hf]), base = mn == -INFINITY ? 0.0f : mn;
            float corr = fast_exp2(w.m[mt][hf] - base), sum = 0.0f;
            w.m[mt][hf] = mn;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                s[mt][j][2 * hf] = fast_exp2(s[mt][j][2 * hf] - base);
                s[mt][j][2 * hf + 1] = fast_exp2(s[mt][j][2 * hf + 1] - base);
                sum += s[mt][j][2 * hf] + s[mt][j][2 * hf + 1];
            }
            w.l[mt][hf] = w.l[mt][hf] * corr + sum;   /* this thread's share; the quad's summed at the end */
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                w.o[mt][j][2 * hf] *= corr;
                w.o[mt][j][2 * hf + 1] *= corr;
            }
        }
    }

#pragma unroll
    for (int kc = 0; kc < KT / 16; kc++) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            pa[mt][0] = pack_half2(s[mt][2 * kc][0], s[mt][2 * kc][1]);
            pa[mt][1] = pack_half2(s[mt][2 * kc][2], s[mt][2 * kc][3]);
            pa[mt][2] = pack_half2(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
            pa[mt][3] = pack_half2(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
        }
#pragma unroll
        for (int nn = 0; nn < D / 16; nn++) {
            uint32_t vf[4];
            ldsm4_t(vf, vs + (kc * 16 + ln.a_row) * LD + nn * 16 + ln.a_col);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma16816(w.o[mt][2 * nn], pa[mt], vf[0], vf[1]);
                mma16816(w.o[mt][2 * nn + 1], pa[mt], vf[2], vf[3]);
            }
        }
    }
}

/* One CTA: ROWS query rows of a tile (sub-tile blockIdx % SUB) and one
 * query head; warp w owns rows [16 MT w, 16 MT (w + 1)), one m16 tile per
 * 16. The flat grid runs the tiles from the last (the longest, when causal)
 * and the heads of a tile side by side, so the heads sharing a kv head read
 * its K and V through L2 together.
 *   Q: scaled by a.scale and, without a softcap, by log2(e), rounded to
 *      f16 into shared memory; scores are kept in base 2 (exp2 is the
 *      hardware's);
 *   a pass: K and V rows of KT keys land in one stage while the other is
 *      consumed (cp.async, two stages);
 *   S = Q K^T per warp: 16 MT x KT scores in registers, the B operand K
 *      rows as they lie (ldmatrix);
 *   online softmax on those registers: each thread holds 2 rows (g, g + 8)
 *      of each m16 tile and shares them with the 3 other threads of its
 *      quad; masks (window, causal, rows past the chunk) and the softcap as
 *      in score();
 *   O += P V: the scores' accumulator layout is the A operand's, so P goes
 *      from registers to f16 pairs with no shared memory; V through
 *      ldmatrix.trans;
 *   O / l to the output in f32.
 * A warp whose rows see none of a pass's keys skips its arithmetic. */
template <int D, bool CAP>
__global__ static void __launch_bounds__(TC_THREADS, 2) prefill_tc_kernel(const attn_args a)
{
    typedef tc_layout<D> L;
    const int MT = L::MT, ROWS = L::ROWS, KT = L::KT, LD = L::LD;
    const float L2E = 1.4426950408889634f;
    /* score() in base 2: s log2(e), the softcap's tanh taken before */
    float q_scale = CAP ? a.scale : a.scale * L2E;
    float cap_in = CAP ? 1.0f / a.softcap : 0.0f, cap_out = a.softcap * L2E;
    extern __shared__ __align__(16) unsigned char tsm[];
    __half *qs = (__half *)tsm;
    __half *stages = qs + ROWS * LD;   /* [2][K, V][KT][LD] */
    __shared__ int32_t kmin_s, kmax_s, from_s, to_s;
    __shared__ int32_t first_s[L::ROWS], pos_s[L::ROWS];   /* each row's keys; pos -1 past the chunk */

    uint32_t bid = blockIdx.x, sub = bid % L::SUB;
    int32_t h = (int32_t)(bid / L::SUB % (uint32_t)a.n_head);
    int32_t ti = a.n_tiles - 1 - (int32_t)(bid / L::SUB / (uint32_t)a.n_head);
    int32_t seq = a.tiles[2 * ti], t0 = a.tiles[2 * ti + 1] + (int32_t)sub * ROWS;
    int32_t row0 = a.seq_row0[seq] + t0, nrows = min(ROWS, a.seq_nrows[seq] - t0);
    if (nrows <= 0) return;   /* past the end of a short last tile */
    int32_t kvh = h / a.group;
    const int32_t *tab = block_table(a, seq);
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;

    if (tid == 0) {
        kmin_s = INT32_MAX;
        kmax_s = -1;
        from_s = -1;
        to_s = INT32_MAX;
    }
    for (int i = tid; i < ROWS * D / 4; i += TC_THREADS) {
        int rr = i / (D / 4), c = i % (D / 4) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (rr < nrows)
            x = *(const float4 *)(a.q + (size_t)(row0 + rr) * (size_t)a.q_cols + (size_t)h * D + c);
        __half2 *dst = (__half2 *)(qs + rr * LD + c);
        dst[0] = __floats2half2_rn(x.x * q_scale, x.y * q_scale);
        dst[1] = __floats2half2_rn(x.z * q_scale, x.w * q_scale);
    }
    __syncthreads();
    for (int i = tid; i < ROWS; i += TC_THREADS) {
        int32_t p = i < nrows ? a.pos[row0 + i] : -1, f = p >= 0 ? first_key(a, p) : 0;
        first_s[i] = f;
        pos_s[i] = p;
        if (p >= 0) {
            atomicMin(&kmin_s, f);
            atomicMax(&kmax_s, p);
            atomicMax(&from_s, f);
            atomicMin(&to_s, p);
        }
    }
    /* this thread's rows: 16 MT w + 16 mt + g + 8 hf; the warp's key range
     * is its live rows' union */
    int32_t wp = -1, wf = INT32_MAX;
    for (int i = lane; i < 16 * MT; i += 32) {
        int32_t r = warp * 16 * MT + i, p = r < nrows ? a.pos[row0 + r] : -1;
        wp = max(wp, p);
        if (p >= 0) wf = min(wf, first_key(a, p));
    }
    for (int sh = 16; sh > 0; sh /= 2) {
        wp = max(wp, __shfl_xor_sync(0xffffffffu, wp, sh));
        wf = min(wf, __shfl_xor_sync(0xffffffffu, wf, sh));
    }
    __syncthreads();
    /* keys [kmin, kmax] cover the CTA; every live row sees [all_from, all_to] */
    int32_t kmin = kmin_s, kmax = kmax_s, all_from = from_s, all_to = to_s;
    int32_t n_pass = (kmax - kmin + KT) / KT;

    tc_rows<D> w;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int j = 0; j < D / 8; j++) w.o[mt][j][0] = w.o[mt][j][1] = w.o[mt][j][2] = w.o[mt][j][3] = 0.0f;
        w.m[mt][0] = w.m[mt][1] = -INFINITY;
        w.l[mt][0] = w.l[mt][1] = 0.0f;
    }
    tc_lane ln = { lane % 8 + 8 * (lane / 8 % 2), 8 * (lane / 16), lane % 8 + 8 * (lane / 16), 8 * (lane / 8 % 2),
                   t4 };
    const __half *q_warp = qs + (warp * 16 * MT + ln.a_row) * LD + ln.a_col;
    const int32_t *first = first_s + warp * 16 * MT + g, *pos = pos_s + warp * 16 * MT + g;

    tc_load<D>(a, tab, kvh, kmin, kmax, stages, stages + KT * LD);
    cp_async_commit();
    for (int32_t it = 0; it < n_pass; it++) {
        int32_t kb = kmin + it * KT;
        if (it + 1 < n_pass) {
            __half *next = stages + ((it + 1) & 1) * 2 * KT * LD;
            tc_load<D>(a, tab, kvh, kb + KT, kmax, next, next + KT * LD);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const __half *ks = stages + (it & 1) * 2 * KT * LD, *vs = ks + KT * LD;

        if (kb <= wp && kb + KT - 1 >= wf) {
            bool mask = kb < all_from || kb + KT - 1 > all_to;
            tc_pass<D, CAP>(w, q_warp, ks, vs, kb, ln, mask, first, pos, cap_in, cap_out);
        }
        __syncthreads();
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float sum = w.l[mt][hf];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (pos[16 * mt + 8 * hf] < 0) continue;
            float inv = 1.0f / sum;
            int32_t r = warp * 16 * MT + mt * 16 + g + 8 * hf;
            float *dst = a.out + (size_t)(row0 + r) * (size_t)a.out_cols + (size_t)h * D + 2 * t4;
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *(float2 *)(dst + 8 * j) = make_float2(w.o[mt][j][2 * hf] * inv, w.o[mt][j][2 * hf + 1] * inv);
        }
}

/* ---- host side ----------------------------------------------------------- */

/* LUMA_CUDA_ATTN_PREFILL=cores when the KV cache is allocated keeps prefill
 * on the CUDA-core kernel: for measuring the two kernels on one shape. */
static bool prefill_on_cores;

int luma_cuda_attention_setup(const luma_kv_layout *l, luma_err *err)
{
    const char *path = getenv("LUMA_CUDA_ATTN_PREFILL");
    prefill_on_cores = path && strcmp(path, "cores") == 0;
    if (l->head_dim_k < 8 || l->head_dim_k > HEAD_MAX || l->head_dim_k % 8 != 0 || l->head_dim_v < 8 ||
        l->head_dim_v > HEAD_MAX || l->head_dim_v % 8 != 0)
        return luma_errf(err, "attention heads of %d (keys) and %d (values) dimensions: the CUDA backend "
                              "handles multiples of 8 up to %d",
                         l->head_dim_k, l->head_dim_v, HEAD_MAX);
    /* the largest dynamic shared memory each kernel may ask for */
    struct { const void *fn; size_t bytes; } kernels[] = {
        { (const void *)decode_kernel<__half>, decode_smem(HEAD_MAX, HEAD_MAX, DEC_HEADS, 2) },
        { (const void *)decode_kernel<float>, decode_smem(HEAD_MAX, HEAD_MAX, DEC_HEADS, 4) },
        { (const void *)prefill_kernel<__half, 128>, prefill_layout<__half, 128>::bytes() },
        { (const void *)prefill_kernel<float, 128>, prefill_layout<float, 128>::bytes() },
        { (const void *)prefill_kernel<__half, HEAD_MAX>, prefill_layout<__half, HEAD_MAX>::bytes() },
        { (const void *)prefill_kernel<float, HEAD_MAX>, prefill_layout<float, HEAD_MAX>::bytes() },
        { (const void *)prefill_tc_kernel<64, false>, tc_layout<64>::bytes() },
        { (const void *)prefill_tc_kernel<64, true>, tc_layout<64>::bytes() },
        { (const void *)prefill_tc_kernel<128, false>, tc_layout<128>::bytes() },
        { (const void *)prefill_tc_kernel<128, true>, tc_layout<128>::bytes() },
        { (const void *)prefill_tc_kernel<256, false>, tc_layout<256>::bytes() },
        { (const void *)prefill_tc_kernel<256, true>, tc_layout<256>::bytes() },
    };
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        cudaError_t e = cudaFuncSetAttribute(kernels[i].fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)kernels[i].bytes);
        if (e != cudaSuccess) return luma_errf(err, "setting up the attention kernels: %s", cudaGetErrorString(e));
    }
    return 0;
}

/* The decode partials' buffer, grown to bytes. */
static float *attn_scratch(cuda_backend *c, size_t bytes)
{
    if (bytes <= c->attn_scratch_cap) return c->attn_scratch;
    cudaStreamSynchronize(c->stream);
    cudaFree(c->attn_scratch);
    c->attn_scratch = NULL;
    c->attn_scratch_cap = 0;
    if (luma_cuda_fail(c, cudaMalloc(&c->attn_scratch, bytes), "allocating attention scratch")) {
        c->attn_scratch = NULL;
        return NULL;
    }
    c->attn_scratch_cap = bytes;
    return c->attn_scratch;
}

/* Whether prefill_tc_kernel handles this layer: F16 cache, dk = dv of 64,
 * 128 or 256, blocks of a power of two positions (luma_kv's), q rows
 * readable as float4 and out rows as float2. */
static bool tc_covers(const luma_kv_layout *l, const attn_args *a)
{
    return !prefill_on_cores && l->type == LUMA_F16 && a->dk == a->dv && a->block_tokens == 1 << a->bt_shift &&
           (a->dk == 64 || a->dk == 128 || a->dk == 256) && a->q_cols % 4 == 0 && (uintptr_t)a->q % 16 == 0 &&
           a->out_cols % 2 == 0 && (uintptr_t)a->out % 8 == 0;
}

/* prefill_tc_kernel over `tiles` (tile, head) pairs, SUB CTAs each. */
template <int D>
static void launch_tc(const attn_args *a, unsigned tiles, cudaStream_t s)
{
    typedef tc_layout<D> L;
    if (a->softcap > 0.0f) prefill_tc_kernel<D, true><<<tiles * L::SUB, TC_THREADS, L::bytes(), s>>>(*a);
    else prefill_tc_kernel<D, false><<<tiles * L::SUB, TC_THREADS, L::bytes(), s>>>(*a);
}

template <typename T>
static void launch(cuda_backend *c, attn_args *a, bool tc)
{
    const cuda_step *st = &c->step;
    cudaStream_t s = c->stream;
    store_kernel<T><<<dim3((unsigned)st->n_rows, (unsigned)a->n_kv_head), 128, 0, s>>>(*a);
    if (st->n_dec > 0) {
        dim3 grid((unsigned)st->n_dec, (unsigned)a->n_splits, (unsigned)(a->n_kv_head * a->n_hchunks));
        decode_kernel<T><<<grid, DEC_THREADS, decode_smem(a->dk, a->dv, a->heads_per_cta, sizeof(T)), s>>>(*a);
        if (a->n_splits > 1)
            combine_kernel<<<dim3((unsigned)st->n_dec, (unsigned)a->n_head), 128, 2 * a->n_splits * sizeof(float), s>>>(*a);
    }
    if (st->n_tiles > 0 && tc) {
        unsigned tiles = (unsigned)st->n_tiles * (unsigned)a->n_head;
        if (a->dk == 64) launch_tc<64>(a, tiles, s);
        else if (a->dk == 128) launch_tc<128>(a, tiles, s);
        else launch_tc<256>(a, tiles, s);
    } else if (st->n_tiles > 0) {
        dim3 grid((unsigned)st->n_tiles, (unsigned)a->n_head, PF_SUB);
        if (a->dk <= 128 && a->dv <= 128)
            prefill_kernel<T, 128><<<grid, PF_THREADS, prefill_layout<T, 128>::bytes(), s>>>(*a);
        else
            prefill_kernel<T, HEAD_MAX><<<grid, PF_THREADS, prefill_layout<T, HEAD_MAX>::bytes(), s>>>(*a);
    }
}

/* Splits of each decode row's keys: enough CTAs for every SM to hold
 * several (their copies overlap), none shorter than MIN_SPLIT_KEYS, lengths
 * a multiple of DEC_TILE. Planned for dec_keys_bound keys (the step's
 * shape), not its longest context: the splits past a row's keys find no key
 * and leave m = -inf, l = 0, which combine_kernel weighs 0. */
static void plan_splits(const cuda_backend *c, attn_args *a)
{
    int64_t keys = c->step.dec_keys_bound;
    if (a->window > 0 && a->window < keys) keys = a->window;
    int64_t ctas = (int64_t)c->step.n_dec * a->n_kv_head * a->n_hchunks;
    int64_t want = (4 * (int64_t)c->n_sm + ctas - 1) / ctas;
    int64_t most = (keys + MIN_SPLIT_KEYS - 1) / MIN_SPLIT_KEYS;
    int64_t n = want < most ? want : most;
    if (n < 1) n = 1;
    int64_t len = (keys + n - 1) / n;
    len = (len + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
    a->split_len = (int32_t)len;
    a->n_splits = (int32_t)((keys + len - 1) / len);
}

void luma_cuda_attention(cuda_backend *c, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                         const luma_step *step, const luma_attn *at, luma_buf *out)
{
    out->rows = q->rows;
    out->cols = (int64_t)at->n_head * at->head_dim_v;
    if (!LUMA_CUDA_OK(c) || step->n_rows == 0) return;
    const luma_kv_layout *l = &c->kvl;
    if (c->step.host != step) {
        luma_cuda_failf(c, "attention: step_begin was not called for this step");
        return;
    }
    if (at->pool < 0 || at->pool >= l->n_pools || at->layer < 0 || at->layer >= l->n_layers[at->pool] ||
        at->n_kv_head != l->n_kv_head || at->head_dim_k != l->head_dim_k || at->head_dim_v != l->head_dim_v ||
        at->n_head < 1 || at->n_head % at->n_kv_head != 0) {
        luma_cuda_failf(c, "attention: layer %d of pool %d with %d heads over %d kv heads does not fit the KV cache",
                        at->layer, at->pool, at->n_head, at->n_kv_head);
        return;
    }
    const cuda_step *st = &c->step;
    size_t es = l->type == LUMA_F16 ? 2 : 4;
    attn_args a;
    a.q = q->data;
    a.k = k->data;
    a.v = v->data;
    a.q_cols = q->cols;
    a.k_cols = k->cols;
    a.v_cols = v->cols;
    a.out = out->data;
    a.out_cols = out->cols;
    a.pool = c->kv_mem[at->pool];
    a.block_bytes = c->kv_block_bytes[at->pool];
    a.v_off = (size_t)l->n_kv_head * (size_t)l->block_tokens * (size_t)l->head_dim_k * es;
    a.layer_off = (size_t)at->layer * (a.v_off + (size_t)l->n_kv_head * (size_t)l->block_tokens *
                                                  (size_t)l->head_dim_v * es);
    a.block_tokens = l->block_tokens;
    a.bt_shift = 0;
    while ((1 << a.bt_shift) < a.block_tokens) a.bt_shift++;
    a.dk = at->head_dim_k;
    a.dv = at->head_dim_v;
    a.n_head = at->n_head;
    a.n_kv_head = at->n_kv_head;
    a.group = at->n_head / at->n_kv_head;
    a.heads_per_cta = a.group < DEC_HEADS ? a.group : DEC_HEADS;
    a.n_hchunks = (a.group + a.heads_per_cta - 1) / a.heads_per_cta;
    a.v_lanes = 1;
    while (a.v_lanes * 8 < a.dv) a.v_lanes *= 2;
    a.scale = at->scale;
    a.softcap = at->softcap;
    a.window = at->window;
    a.n_seqs = st->n_seqs;
    a.pool_index = at->pool;
    a.pos = st->pos;
    a.row_seq = st->row_seq;
    a.blocks = st->blocks;
    a.block_off = st->block_off;
    a.seq_row0 = st->seq_row0;
    a.seq_nrows = st->seq_nrows;
    a.dec_rows = st->dec_rows;
    a.tiles = st->tiles;
    a.n_tiles = st->n_tiles;
    a.split_len = 0;
    a.n_splits = 1;
    a.part = NULL;
    if (st->n_dec > 0) {
        plan_splits(c, &a);
        if (a.n_splits > 1) {
            size_t bytes = (size_t)st->n_dec * (size_t)a.n_head * (size_t)a.n_splits * (size_t)(a.dv + 2) * sizeof(float);
            a.part = attn_scratch(c, bytes);
            if (!a.part) return;
        }
    }
    bool tc = tc_covers(l, &a);
    if (tc && (int64_t)st->n_tiles * a.n_head * (LUMA_CUDA_ATTN_TILE / (TC_WARPS * 16)) > INT32_MAX) {
        luma_cuda_failf(c, "attention: %d tiles of %d heads are too many CTAs", st->n_tiles, a.n_head);
        return;
    }
    if (l->type == LUMA_F16) launch<__half>(c, &a, tc);
    else launch<float>(c, &a, tc);
    luma_cuda_fail(c, cudaGetLastError(), "attention");
}
