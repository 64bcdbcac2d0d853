/* Attention over the paged KV cache on the GPU; the reference is
 * cpu_attention in src/cpu/backend.c.
 *
 * A layer's cache lives in its pool: physical block b holds, for each layer
 * of the pool, K [n_kv_head][block_tokens][head_dim_k] then V
 * [n_kv_head][block_tokens][head_dim_v], in F16 or F32. A query at position
 * p sees the keys first <= k <= p, first = window ? max(0, p - window + 1) : 0.
 *
 * Per call:
 *   store    the k and v rows of prefill chunks go to their positions'
 *            slots (store_kernel, only when the step has such chunks);
 *   decode   rows of short chunks (decode tokens) are computed one query row
 *            at a time (decode_kernel): a CTA takes one row, one kv head and
 *            all the query heads sharing it (each K/V row is read once for
 *            the group), and one split of the row's keys; its warps each
 *            stream their own tiles of 16 keys through a ring of cp.async
 *            stages, scores and p V on the tensor cores (F16 caches). The
 *            kernel stores the decode rows' own k and v itself and reads the
 *            keys a step stores from the step, not the cache: a decode-only
 *            step is one kernel. Splits keep the GPU busy when few rows have
 *            long contexts; the last split of a row merges the others' partial
 *            results (flash-decoding), or combine_kernel when they are many.
 *            The number of splits follows the step's dec_keys_bound, not its
 *            context lengths, so that a decode step recorded as a CUDA graph
 *            replays unchanged for every step of its bucket: splits past a
 *            row's keys return at once. Every row count and context length
 *            of F16 caches with dk = dv in {64, 128, 256} (heads of 256 on
 *            two warps a part) takes decode_lean_kernel instead
 *            (lean_covers; under batch invariance with a fixed split of a
 *            unit and split length): one to eight warps
 *            per row and kv head (eight at a few rows, their sums merged in
 *            shared memory; one from a few dozen rows, nothing shared
 *            between warps), over all its keys or, past what its warps go
 *            through quickly, split over CTAs whose partial results the
 *            last to finish merges (lean_splits). decode_kernel keeps the
 *            rest. Both merge splits with merge_splits.
 *   prefill  long chunks are cut into tiles of LUMA_CUDA_ATTN_TILE (128)
 *            query rows, attended with an online softmax (flash attention):
 *            no score matrix is ever materialized beyond a tile of keys.
 *            F16 caches with dk = dv in {64, 128, 256} take prefill_tc_kernel
 *            (tensor cores, mma.sync m16n8k16: f16 operands, f32 sums); the
 *            others prefill_kernel (CUDA cores, f32 arithmetic, 16 rows of a
 *            tile per CTA).
 * All copy K and V rows from the cache to shared memory with 16-byte
 * asynchronous copies (cp.async), whole tiles of keys in flight at once, so
 * that a CTA waits for memory once per tile rather than once per key.
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "launch.cuh"
#include "quant8.cuh"

LUMA_TRACE_TU(attention)

#define HEAD_MAX 256          /* largest head_dim_k / head_dim_v handled */
#define DEC_MAX_WARPS 8       /* warps of a decode CTA at most */
#define DEC_MAX_STAGES 4      /* stages of a decode warp's ring at most */
#define DEC_HEADS 8           /* query heads per decode CTA: a kv head's group or part of it (4 when dv > 128) */
#define DEC_MAX_SPLITS 256    /* splits of a decode row's keys at most */
#define DEC_LEAN_WARPS 8      /* warps of a decode_lean_kernel CTA at most (a unit split 8 ways) */
#define DEC_LEAN_CTA_WARPS 4  /* units of fewer warps share a CTA up to this many warps */
#define DEC_LEAN_MIN 1        /* decode_lean_kernel from this many units (dec_tuning) */
#define DEC_LEAN_KEYS 1024    /* and at most this many keys a row (lean_covers: by heads and units) */
#define DEC_LEAN_WIDE 4       /* heads of up to 128: DEC_LEAN_KEYS from twice this many units, a quarter below
                               * (heads of 256, one warp a part: a quarter from this many, an eighth below) */
#define DEC_LEAN_LONG 64      /* twice DEC_LEAN_KEYS from this many units (heads of 256: DEC_LEAN_KEYS; from
                               * half as many with two warps a part) */
#define DEC_P_SCALE 16384.0f  /* softmax weights (<= 1) times this on the tensor cores: f16 stays normal longer */
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
    float scale, softcap;
    int32_t window;
    int32_t n_seqs, pool_index;
    const int32_t *pos, *row_seq, *blocks, *block_off, *seq_row0, *seq_nrows, *seq_pos0;
    const int32_t *dec_rows, *tiles;
    int32_t n_tiles;
    int32_t prefill_min;       /* a sequence of fewer rows is decoded (luma_cuda_prefill_rows) */
    int32_t split_len, n_splits;   /* decode: split_unit 0: every row's splits split_len keys long */
    int32_t split_unit;        /* else a row's n_splits splits share its own keys (row_split_len) */
    int32_t dec_tk, dec_warps, dec_stages;   /* decode: keys per tile, warps per CTA, stages per warp */
    int32_t ldk, ldv, stage_elems;   /* decode: K and V row strides and a stage in a warp's ring, in elements */
    float *part;               /* decode partial sums: [n_dec][n_head][n_splits][dv] */
    float *part_ml;            /* their (m, l): [n_dec][n_head][n_splits][2] */
    int32_t *counters;         /* decode: [n_dec][kv heads x head chunks] splits arrived */
    int32_t merge_here;        /* decode: the last split of a row merges the partials (no combine_kernel) */
    int32_t early;             /* decode_kernel: metadata and the first tiles of earlier steps' keys before the wait */
    /* decode_lean_kernel of 2 to 8 parts a unit: the output also quantized
     * for the product after it, as quantize_act makes it (scheme q_scheme,
     * an act_scheme), into qo and qds; NULL: not */
    int8_t *qo;
    float2 *qds;
    int32_t q_scheme;
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

/* Four consecutive elements (8-byte aligned for F16, 16 for F32) as floats. */
__device__ static float4 load4(const __half *p)
{
    uint2 u = *(const uint2 *)p;
    float2 a = __half22float2(*(const __half2 *)&u.x), b = __half22float2(*(const __half2 *)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}

__device__ static float4 load4(const float *p) { return *(const float4 *)p; }

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

/* The cache blocks of a decode row's keys [k0, k1): the first 32 block
 * table entries are held one a lane, so that a key's lookup is a shuffle,
 * not a load on its copies' path. Every lane of the warp calls of()
 * together. */
struct lane_blocks {
    const attn_args &a;
    const int32_t *tab;
    int32_t tb0, mine;
    __device__ lane_blocks(const attn_args &args, const int32_t *table, int32_t k0, int32_t k1)
        : a(args), tab(table), tb0(k0 >> args.bt_shift)
    {
        const int32_t n = ((k1 - 1) >> a.bt_shift) - tb0 + 1, lane = (int32_t)(threadIdx.x % 32);
        mine = lane < n ? tab[tb0 + lane] : -1;
    }
    __device__ int32_t of(int32_t key) const
    {
        const int32_t i = (key >> a.bt_shift) - tb0;
        const int32_t v = __shfl_sync(0xffffffffu, mine, i & 31);
        return i < 32 ? v : tab[key >> a.bt_shift];
    }
};

__device__ static int32_t first_key(const attn_args &a, int32_t p)
{
    return a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
}

/* The keys of each split of a decode row whose first key is first and
 * whose last is p. With split_unit 0 (batch invariance) the planned
 * split_len; else the row's own keys over the step's n_splits, rounded up
 * to split_unit (the keys the CTA's warps take in one round) and at least
 * split_len (the planned floor): the step's splits are planned for its
 * bucket of context lengths (a power of two, so that a recorded step
 * replays for every length of it), and a row just past the bucket's lower
 * end would otherwise leave half its splits with no keys and the others
 * twice as many (cuda/NOTES.md, "Decode at depth"). */
__device__ static int32_t row_split_len(const attn_args &a, int32_t first, int32_t p)
{
    if (a.split_unit == 0) return a.split_len;
    int32_t len = (p - first + a.n_splits) / a.n_splits;   /* ceil((p - first + 1) / n_splits) */
    len = (len + a.split_unit - 1) / a.split_unit * a.split_unit;
    return len > a.split_len ? len : a.split_len;
}

__device__ static float score(const attn_args &a, float dot)
{
    float s = dot * a.scale;
    return a.softcap > 0.0f ? a.softcap * tanhf(s / a.softcap) : s;
}

/* ---- store --------------------------------------------------------------- */

/* grid (rows, kv heads): the row's k and v of head h into its slot, for
 * the rows of prefill chunks; decode_kernel stores the decode rows. */
template <typename T>
__global__ static void store_kernel(const attn_args a)
{
    follow_previous_kernel();
    int32_t r = blockIdx.x, h = blockIdx.y, p = a.pos[r], seq = a.row_seq[r];
    /* decode rows (luma_cuda_prefill_rows: fewer rows of their sequence;
     * with batch invariance every row, and this kernel does not run) */
    if (a.seq_nrows[seq] < a.prefill_min) return;
    const int32_t *tab = block_table(a, seq);
    T *kd = kv_row<T>(a, tab, h, p, false), *vd = kv_row<T>(a, tab, h, p, true);
    if (!kd) return;
    const float *ks = a.k + (size_t)r * (size_t)a.k_cols + (size_t)h * (size_t)a.dk;
    const float *vs = a.v + (size_t)r * (size_t)a.v_cols + (size_t)h * (size_t)a.dv;
    for (int32_t e = threadIdx.x; e < a.dk; e += blockDim.x) from_float(ks[e], kd + e);
    for (int32_t e = threadIdx.x; e < a.dv; e += blockDim.x) from_float(vs[e], vd + e);
}

/* ---- tiles of keys in shared memory ------------------------------------- */

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

/* ---- tensor-core fragments ---------------------------------------------- */

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

/* ---- decode -------------------------------------------------------------- */

/* Eight elements of a step row (f32, any alignment) rounded to the cache's
 * type, as the store would have written them, into 16 bytes of shared
 * memory. */
__device__ static void piece_from_floats(const float *x, __half *dst)
{
    __half2 h[4];
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
    *(uint4 *)dst = *(const uint4 *)h;
}

__device__ static void piece_from_floats(const float *x, float *dst)
{
    *(float4 *)dst = make_float4(x[0], x[1], x[2], x[3]);
}

__device__ static float component(const float4 &v, int i)
{
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* Waits until at most n (a run-time count below 4) groups are in flight. */
__device__ static void cp_async_wait_n(int n)
{
    if (n <= 0) cp_async_wait<0>();
    else if (n == 1) cp_async_wait<1>();
    else if (n == 2) cp_async_wait<2>();
    else cp_async_wait<3>();
}

/* A lane's share of copying the K (or V) rows of a decode tile, the same
 * for every tile: a row has ppr 16-byte pieces; the lane takes piece col
 * (and col + 32, ...) of rows row0, row0 + rpp, ... (rpp rows side by side
 * when a row has fewer than 32 pieces). lane_off: from a block's start to
 * the lane's first piece in the head's first slot. */
struct dec_copy {
    int ppr, rpp, row0, col, passes, ld;
    bool active;
    int32_t row_bytes;
    size_t lane_off;
};

template <typename T>
__device__ static dec_copy dec_copy_for(const attn_args &a, int32_t kvh, bool value, int ld, int tk)
{
    dec_copy c;
    int32_t d = value ? a.dv : a.dk;
    int lane = threadIdx.x % 32;
    c.ppr = d * (int)sizeof(T) / 16;
    if ((c.ppr & (c.ppr - 1)) == 0) {   /* the usual heads (64, 128, 256): shifts, not divisions */
        int sh = __ffs(c.ppr) - 1;
        c.rpp = max(1, 32 >> sh);
        c.row0 = lane >> sh;
        c.col = lane & (c.ppr - 1);
        c.passes = (tk + c.rpp - 1) >> (__ffs(c.rpp) - 1);
    } else {
        c.rpp = max(1, 32 / c.ppr);
        c.row0 = lane / c.ppr;
        c.col = lane % c.ppr;
        c.passes = (tk + c.rpp - 1) / c.rpp;
    }
    c.active = c.row0 < c.rpp;
    c.ld = ld;
    c.row_bytes = d * (int32_t)sizeof(T);
    c.lane_off = a.layer_off + (value ? a.v_off : 0) + (size_t)kvh * (size_t)a.block_tokens * (size_t)c.row_bytes +
                 (size_t)c.col * 16;
    return c;
}

/* Starts copying the K (or V) rows of the tile at key kt into dst. src, in
 * lane t < tk, says where the tile's key t comes from: a block of the
 * cache (>= 0), nowhere (-1: past the split or a released block, read as
 * zeros), or step row -2 - src (a key this step stores: taken from the
 * step's k or v, rounded as the store rounds). */
template <typename T>
__device__ static void copy_rows(const attn_args &a, const dec_copy &cp, T *dst, int32_t src, int32_t kt, int32_t kvh,
                                 bool value)
{
    const int PER = 16 / (int)sizeof(T);
    for (int i = 0; i < cp.passes; i++) {
        int rr = cp.row0 + i * cp.rpp;
        int32_t s = __shfl_sync(0xffffffffu, src, rr & 31);
        if (!cp.active || rr >= a.dec_tk) continue;
        T *to = dst + rr * cp.ld + cp.col * PER;
        if (s >= 0) {
            const uint8_t *from = a.pool + (size_t)s * a.block_bytes + cp.lane_off +
                                  (size_t)((kt + rr) & (a.block_tokens - 1)) * (size_t)cp.row_bytes;
            for (int c = 0; c < cp.ppr - cp.col; c += 32) cp_async16(to + c * PER, from + c * 16, true);
        } else if (s == -1) {
            for (int c = 0; c < cp.ppr - cp.col; c += 32) cp_async16(to + c * PER, a.pool, false);
        } else {
            int32_t d = value ? a.dv : a.dk, r = -2 - s;
            const float *from = (value ? a.v + (size_t)r * (size_t)a.v_cols : a.k + (size_t)r * (size_t)a.k_cols) +
                                (size_t)kvh * (size_t)d + (size_t)cp.col * PER;
            for (int c = 0; c < cp.ppr - cp.col; c += 32) piece_from_floats(from + c * PER, to + c * PER);
        }
    }
}

/* copy_rows for a tile whose tk keys all lie in cache block b (a tile
 * that starts inside the block and ends in it, every key before the
 * sequence's first key of this step): one address for the tile, advanced
 * by rows, instead of a block lookup per pass of rows. */
template <typename T>
__device__ static void copy_block_rows(const attn_args &a, const dec_copy &cp, T *dst, int32_t b, int32_t kt)
{
    const int PER = 16 / (int)sizeof(T);
    if (!cp.active) return;
    const uint8_t *from = a.pool + (size_t)b * a.block_bytes + cp.lane_off +
                          (size_t)((kt & (a.block_tokens - 1)) + cp.row0) * (size_t)cp.row_bytes;
    T *to = dst + cp.row0 * cp.ld + cp.col * PER;
    if (cp.ppr <= 32) {   /* a piece a lane in each of its rows: straight-line copies */
        const size_t from_step = (size_t)cp.rpp * (size_t)cp.row_bytes;
        const int to_step = cp.rpp * cp.ld;
#pragma unroll 8
        for (int i = 0; i < cp.passes; i++) {
            if (cp.row0 + i * cp.rpp < a.dec_tk) cp_async16(to, from, true);
            to += to_step;
            from += from_step;
        }
        return;
    }
    for (int rr = cp.row0; rr < a.dec_tk; rr += cp.rpp) {
        for (int c = 0; c < cp.ppr - cp.col; c += 32) cp_async16(to + c * PER, from + c * 16, true);
        to += cp.rpp * cp.ld;
        from += (size_t)cp.rpp * (size_t)cp.row_bytes;
    }
}

/* One warp: the weights exp(m_s - m) / l of the n_live splits whose (m, l)
 * are at part_ml[2 (at + s)], into wt (shared memory). Every live split
 * holds a key: its m is finite. */
__device__ static void split_weights(const attn_args &a, size_t at, int32_t n_live, float *wt)
{
    int lane = threadIdx.x % 32;
    const float *ml = a.part_ml + 2 * at;
    float mx = -INFINITY, sum = 0.0f;
    for (int32_t s = lane; s < n_live; s += 32) mx = fmaxf(mx, __ldcg(ml + 2 * s));
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    for (int32_t s = lane; s < n_live; s += 32) sum += __ldcg(ml + 2 * s + 1) * expf(__ldcg(ml + 2 * s) - mx);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    for (int32_t s = lane; s < n_live; s += 32) wt[s] = expf(__ldcg(ml + 2 * s) - mx) / sum;
}

/* The merged sums of 4 columns (from e) of one head over the n_live
 * splits whose partials start at part[at0 dv] (dv floats a split, not yet
 * divided by l) and part_ml[2 at0] ((m, l) a split), divided by the
 * merged l. The splits are taken with a running maximum, as the online
 * softmax takes keys: 8 splits' (m, l) and sums are loaded with no wait
 * between them, so the merge costs one round trip to L2 per 8 splits
 * rather than one per reduction (split_weights: three passes, then the
 * sums). Every live split holds a key: its m is finite. */
__device__ static float4 merge_splits(const attn_args &a, size_t at0, int32_t n_live, int32_t dv, int32_t e)
{
    const float *pt = a.part + at0 * (size_t)dv + (size_t)e;
    const float2 *mlp = (const float2 *)a.part_ml + at0;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float mx = -INFINITY, l = 0.0f;
    for (int32_t s0 = 0; s0 < n_live; s0 += 8) {
        float2 ml[8];
        float4 x[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const bool live = s0 + j < n_live;
            ml[j] = live ? __ldcg(mlp + s0 + j) : make_float2(-INFINITY, 0.0f);
            x[j] = live ? __ldcg((const float4 *)(pt + (size_t)(s0 + j) * (size_t)dv)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        float m_new = mx;
#pragma unroll
        for (int j = 0; j < 8; j++) m_new = fmaxf(m_new, ml[j].x);   /* finite: split s0 is live */
        const float cr = expf(mx - m_new);
        acc.x *= cr;
        acc.y *= cr;
        acc.z *= cr;
        acc.w *= cr;
        l *= cr;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float f = expf(ml[j].x - m_new);   /* 0 past the live splits */
            l += f * ml[j].y;
            acc.x += f * x[j].x;
            acc.y += f * x[j].y;
            acc.z += f * x[j].z;
            acc.w += f * x[j].w;
        }
        mx = m_new;
    }
    const float inv = 1.0f / l;
    acc.x *= inv;
    acc.y *= inv;
    acc.z *= inv;
    acc.w *= inv;
    return acc;
}

/* x as f16 hi + lo: hi its rounding, lo the rounding of what hi left out
 * (q's two parts on the tensor cores, below). */
__device__ __forceinline__ static void split_hi_lo(float x, __half &hi, __half &lo)
{
    hi = __float2half_rn(x);
    lo = __float2half_rn(x - __half2float(hi));
}

/* The scores of a decode tile in an F16 cache on the tensor cores: the
 * CTA's query heads are the rows of an m16n8k16 product (rows past H are
 * zero), the tile's 16 keys its columns (two n8 halves), K rows as they lie
 * in the stage (ldmatrix, rows dk + 8 halves apart). q is split into f16
 * hi + lo parts (qh, ql: [H][dk + 8] halves), two products summed in f32,
 * so that the scores keep f32 accuracy against the f16 keys. Lane l gets
 * the dot products of head l / 4 with keys 2 (l % 4) + {0, 1} (x[0..1])
 * and 8 + 2 (l % 4) + {0, 1} (x[2..3]). */
template <int H>
__device__ static void tile_scores_mma(const attn_args &a, const __half *qh, const __half *ql, const __half *ks,
                                       float x[4])
{
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, ldq = a.dk + 8;
    int k_row = lane % 8 + 8 * (lane / 16), k_col = 8 * (lane / 8 % 2);
    float s[4][4] = {};   /* keys 0-7 and 8-15 against hi, then against lo: four chains of products */
    for (int kc = 0; kc < a.dk / 16; kc++) {
        uint32_t kf[4], hi[4] = { 0, 0, 0, 0 }, lo[4] = { 0, 0, 0, 0 };
        ldsm4(kf, ks + k_row * a.ldk + kc * 16 + k_col);
        if (g < H) {
            int at = g * ldq + kc * 16 + 2 * t;
            hi[0] = *(const uint32_t *)(qh + at);
            hi[2] = *(const uint32_t *)(qh + at + 8);
            lo[0] = *(const uint32_t *)(ql + at);
            lo[2] = *(const uint32_t *)(ql + at + 8);
        }
        mma16816(s[0], hi, kf[0], kf[1]);
        mma16816(s[1], hi, kf[2], kf[3]);
        mma16816(s[2], lo, kf[0], kf[1]);
        mma16816(s[3], lo, kf[2], kf[3]);
    }
    x[0] = s[0][0] + s[2][0];
    x[1] = s[0][1] + s[2][1];
    x[2] = s[1][0] + s[3][0];
    x[3] = s[1][1] + s[3][1];
}

/* The online softmax of a decode tile on the tensor cores and its p V:
 * x holds this lane's scores (keys 2t + {0, 1} and 8 + 2t + {0, 1} of head
 * lane / 4, t = lane % 4; keys from n on are past the range), m_row and
 * l_row its head's running maximum and share of the sum; o[i] the O^T
 * fragments of value columns [16 i, 16 i + 16) for i < nvt, the tile's V
 * rows at vs, ldv halves apart. The weights go to the tensor cores as the
 * B operand of O^T += V^T P^T (the scores' accumulator layout is B's),
 * times DEC_P_SCALE (in (0, 1] they would reach f16's subnormals early),
 * split into f16 hi + lo parts like q; the rescale of heads 2t and
 * 2t + 1, whose quads start at lanes 8t and 8t + 4. */
template <int MT>
__device__ __forceinline__ static void tile_softmax_pv(const attn_args &a, float (&x)[4], int32_t n, const __half *vs,
                                                       int ldv, int nvt, float &m_row, float &l_row, float (&o)[MT][4])
{
    const int lane = threadIdx.x % 32, t = lane % 4;
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int key = (i / 2) * 8 + 2 * t + (i & 1);
        x[i] = key < n ? score(a, x[i]) : -INFINITY;
        mx = fmaxf(mx, x[i]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_row, mx);   /* finite: every tile holds a key of the range */
    const float cr = expf(m_row - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[i] = expf(x[i] - m_new);
        sum += x[i];
    }
    l_row = l_row * cr + sum;
    m_row = m_new;
#pragma unroll
    for (int i = 0; i < 4; i++) x[i] *= DEC_P_SCALE;
    const uint32_t bh0 = pack_half2(x[0], x[1]), bh1 = pack_half2(x[2], x[3]);
    const float2 r0 = __half22float2(*(const __half2 *)&bh0), r1 = __half22float2(*(const __half2 *)&bh1);
    const uint32_t bl0 = pack_half2(x[0] - r0.x, x[1] - r0.y), bl1 = pack_half2(x[2] - r1.x, x[3] - r1.y);
    const float c0 = __shfl_sync(0xffffffffu, cr, 8 * t), c1 = __shfl_sync(0xffffffffu, cr, 8 * t + 4);
    const __half *vh = vs + (lane % 8 + 8 * (lane / 16)) * ldv + 8 * (lane / 8 % 2);
#pragma unroll
    for (int i = 0; i < MT; i++) {
        if (i >= nvt) break;
        o[i][0] *= c0;
        o[i][1] *= c1;
        o[i][2] *= c0;
        o[i][3] *= c1;
        uint32_t vf[4];
        ldsm4_t(vf, vh + i * 16);
        mma16816(o[i], vf, bh0, bh1);
        mma16816(o[i], vf, bl0, bl1);
    }
}

/* grid (decode rows, splits, kv heads x head chunks), dec_warps warps. One
 * CTA: one query row, up to H query heads of one kv head (each K and V row
 * is read once for them all), keys [k0, k1) of the row. The keys are cut
 * into tiles of tk; warp w takes tiles w, w + warps, ... and runs alone:
 * its own ring of dec_stages stages in shared memory, filled by cp.async
 * (stages - 1 tiles in flight while it computes one), its own online
 * softmax. Per tile, MMA (F16 caches, dk and dv multiples of 16):
 *   scores  tile_scores_mma: lane l holds 4 scores of head l / 4;
 *   softmax the tile's max over the lane's quad, exp, the rescale;
 *   p V     on the tensor cores as O^T += V^T P^T: V^T (16 value columns
 *           by 16 keys, ldmatrix.trans of the V rows) is the A operand and
 *           the weights stay in registers as the B operand (the scores'
 *           accumulator layout is B's), split into f16 hi + lo parts like
 *           q; lane l then holds columns 16 i + l / 4 (+ 8) of heads
 *           2 (l % 4) + {0, 1};
 * otherwise (F32 caches) on the CUDA cores:
 *   scores  32 / tk lanes share a key (a lane's part of dk against q of
 *           every head from shared memory), summed by shuffles;
 *   softmax per head, the weights to shared memory;
 *   p V     a lane owns 4 of every 128 value columns for every head; the
 *           weights of 4 keys come from shared memory as one float4.
 * Heads past the CTA's own (H above the group) are computed on zero q and
 * never written. Then the warps' results merge in shared memory. A row
 * whose keys fit one split writes its output; otherwise each split writes
 * a partial (sums, m, l), merged by the row's last split to arrive (a
 * counter per row and head chunk, reset by it) when they are few
 * (merge_here), else by combine_kernel.
 * The row's own key, and every key its sequence stores in this step, comes
 * from the step's k and v rather than from the cache: the split holding the
 * row's position (head chunk 0) also stores the row into the cache, with no
 * kernel before this one. */
template <typename T, int H, int MMA>
__global__ static void __launch_bounds__(DEC_MAX_WARPS * 32, MMA == 128 ? 2 : 1) decode_kernel(const attn_args a)
{
    if (!a.early) follow_previous_kernel();
    const int VC = H == 8 ? 1 : 2;   /* CUDA cores: 128 value columns per lane group (H = 8 only for dv <= 128) */
    const int MT = MMA > 0 ? MMA / 16 : 1;   /* MMA: m16 tiles of value columns (dv <= MMA) */
    extern __shared__ __align__(16) unsigned char dsm[];
    const int TK = MMA ? 16 : a.dec_tk, W = a.dec_warps, S = a.dec_stages;   /* decode_shape: 16 on the tensor cores */
    /* q: MMA [2][H][dk + 8] halves (hi, lo), else [H][dk] floats; then the
     * CUDA cores' weights [W][H][TK] */
    float *qs = (float *)dsm;
    __half *qh = (__half *)dsm, *ql = qh + H * (a.dk + 8);
    float *ps_all = (float *)(dsm + (MMA ? (size_t)4 * H * (a.dk + 8) : (size_t)4 * H * a.dk));
    T *rings = (T *)(ps_all + (MMA ? 0 : W * H * TK));   /* [W][S][stage_elems]; later the merge */
    __shared__ int last_s;
    __shared__ float merge_f[DEC_MAX_WARPS * DEC_HEADS], merge_m[DEC_HEADS], merge_l[DEC_HEADS];

    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int32_t y = blockIdx.x, split = blockIdx.y;
    int32_t kvh = (int32_t)blockIdx.z / a.n_hchunks, hc0 = (int32_t)(blockIdx.z % a.n_hchunks) * a.heads_per_cta;
    int32_t nh = min(a.heads_per_cta, a.group - hc0), h0 = kvh * a.group + hc0;
    int32_t r = a.dec_rows[y], p = a.pos[r], seq = a.row_seq[r], first = first_key(a, p);
    const int32_t split_len = row_split_len(a, first, p);
    int32_t k0 = first + split * split_len;
    if (k0 > p) return;   /* past the row's keys: no work, no partial */
    int32_t k1 = min(p + 1, k0 + split_len), n_live = (p - first) / split_len + 1;
    const int32_t *tab = block_table(a, seq);
    int32_t spos0 = a.seq_pos0[seq], srow0 = a.seq_row0[seq];

    /* this warp's tiles and its parts of the copies */
    int32_t n_tiles = (k1 - k0 + TK - 1) / TK, nt = n_tiles > warp ? (n_tiles - warp + W - 1) / W : 0;
    T *ring = rings + (size_t)warp * S * a.stage_elems;
    int key_l = lane % TK;
    dec_copy kcp = dec_copy_for<T>(a, kvh, false, a.ldk, TK), vcp = dec_copy_for<T>(a, kvh, true, a.ldv, TK);
    const lane_blocks blocks(a, tab, k0, k1);   /* the split's */
    auto issue = [&](int j) {
        int32_t kt = k0 + (warp + j * W) * TK, src = -1, key = kt + key_l;
        T *st = ring + (j % S) * a.stage_elems;
        if (kt + TK <= k1 && kt + TK <= spos0 && (kt & (a.block_tokens - 1)) + TK <= a.block_tokens) {
            int32_t b = blocks.of(kt);
            if (b >= 0) {
                copy_block_rows<T>(a, kcp, st, b, kt);
                copy_block_rows<T>(a, vcp, st + TK * a.ldk, b, kt);
                return;
            }
        }
        int32_t kb = blocks.of(key < k1 ? key : kt);
        if (key < k1) src = key >= spos0 ? -2 - (srow0 + key - spos0) : kb;
        copy_rows<T>(a, kcp, st, src, kt, kvh, false);
        copy_rows<T>(a, vcp, st + TK * a.ldk, src, kt, kvh, true);
    };
    /* q of the CTA's heads to shared memory and, in the CTA holding the
     * row's position, the row's k and v to its cache slot. Their loads go
     * out first, before the first tiles' copies, and the slot's stores wait
     * until after the barrier: the CTA waits once for what the kernel before
     * wrote (q cost a quarter of the warps' stalls at 128 rows when each
     * element's load was followed by its conversion, behind the copies) */
    const float *q = a.q + (size_t)r * (size_t)a.q_cols + (size_t)h0 * (size_t)a.dk;
    const float *k_row = a.k + (size_t)r * (size_t)a.k_cols + (size_t)kvh * (size_t)a.dk;
    const float *v_row = a.v + (size_t)r * (size_t)a.v_cols + (size_t)kvh * (size_t)a.dv;
    T *kd = NULL, *vd = NULL;
    if (hc0 == 0 && p < k1) {
        int32_t b = tab[p >> a.bt_shift];
        if (b >= 0) {
            size_t slot = (size_t)kvh * (size_t)a.block_tokens + (size_t)(p & (a.block_tokens - 1));
            uint8_t *layer = a.pool + (size_t)b * a.block_bytes + a.layer_off;
            kd = (T *)layer + slot * (size_t)a.dk;
            vd = (T *)(layer + a.v_off) + slot * (size_t)a.dv;
        }
    }
    /* float4 pieces when every row and head starts on 16 bytes (dk % 4 == 0:
     * a piece is one head's) */
    const bool vec = ((a.q_cols | a.k_cols | a.v_cols | a.dk | a.dv) & 3) == 0 &&
                     (((uintptr_t)a.q | (uintptr_t)a.k | (uintptr_t)a.v) & 15) == 0;
    const int QJ = 2;   /* pieces of q a thread has in flight */
    const int32_t nq = nh * a.dk, nq_all = H * a.dk, nkv = a.dk + a.dv, step4 = 4 * (int32_t)blockDim.x;
    const int32_t kv_at = 4 * tid;   /* this thread's first piece of k then v */
    float4 xq[QJ], kv4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    auto load_q = [&](int32_t i0) {
#pragma unroll
        for (int j = 0; j < QJ; j++) {
            int32_t i = i0 + j * step4;
            xq[j] = i < nq ? *(const float4 *)(q + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    auto store_q = [&](int32_t i0) {
#pragma unroll
        for (int j = 0; j < QJ; j++) {
            int32_t i = i0 + j * step4;
            if (i >= nq_all) break;
            int32_t g = i / a.dk, e = i - g * a.dk;
            float v[4] = { xq[j].x, xq[j].y, xq[j].z, xq[j].w };
            if (MMA) {
                __half hv[4], lv[4];
#pragma unroll
                for (int u = 0; u < 4; u++) split_hi_lo(v[u], hv[u], lv[u]);
                *(uint2 *)(qh + g * (a.dk + 8) + e) = *(const uint2 *)hv;
                *(uint2 *)(ql + g * (a.dk + 8) + e) = *(const uint2 *)lv;
            } else {
                *(float4 *)(qs + g * a.dk + e) = xq[j];
            }
        }
    };
    /* a.early: before the wait for the kernel before, the step's metadata
     * (above) and the first tiles that hold only keys of earlier steps
     * (which no kernel of the step writes: cuda/launch.cuh); the chain of
     * loads to a tile's first address is then off the path after the wait,
     * as in decode_lean_kernel */
    int pre = 0;
    if (a.early) {
        for (; pre < S - 1 && pre < nt && k0 + (warp + pre * W + 1) * TK <= spos0; pre++) {
            issue(pre);
            cp_async_commit();
        }
        wait_for_previous_kernel();
        let_next_kernel_start();
    }
    if (vec) {
        if (kd && kv_at < nkv) kv4 = *(const float4 *)(kv_at < a.dk ? k_row + kv_at : v_row + (kv_at - a.dk));
        load_q(kv_at);
    }
    for (int j = pre; j < S - 1; j++) {
        if (j < nt) issue(j);
        cp_async_commit();
    }
    if (vec) {
        store_q(kv_at);
        for (int32_t i0 = kv_at + QJ * step4; i0 < nq_all; i0 += QJ * step4) {
            load_q(i0);
            store_q(i0);
        }
    } else {
#pragma unroll
        for (int g = 0; g < H; g++)
            for (int e = tid; e < a.dk; e += blockDim.x) {
                float x = g < nh ? q[g * a.dk + e] : 0.0f;
                if (MMA) {
                    split_hi_lo(x, qh[g * (a.dk + 8) + e], ql[g * (a.dk + 8) + e]);
                } else {
                    qs[g * a.dk + e] = x;
                }
            }
    }
    __syncthreads();
    if (kd) {
        if (vec) {
            for (int32_t e = kv_at; e < nkv; e += step4) {
                float4 x = e == kv_at ? kv4 : *(const float4 *)(e < a.dk ? k_row + e : v_row + (e - a.dk));
                float v[4] = { x.x, x.y, x.z, x.w };
                T *to = e < a.dk ? kd + e : vd + (e - a.dk);
#pragma unroll
                for (int u = 0; u < 4; u++) from_float(v[u], to + u);
            }
        } else {
            for (int32_t e = tid; e < a.dk; e += blockDim.x) from_float(k_row[e], kd + e);
            for (int32_t e = tid; e < a.dv; e += blockDim.x) from_float(v_row[e], vd + e);
        }
    }

    /* MMA: o[i] holds O^T fragments of value columns [16 i, 16 i + 16),
     * m_row and l_row this lane's head's (lane / 4) maximum and share of
     * the sum; CUDA cores: acc, m and l of every head in every lane */
    float o[MMA ? MT : 1][4], m_row = -INFINITY, l_row = 0.0f;
    float acc[MMA ? 1 : H][VC][4], m[H], l[H];
#pragma unroll
    for (int i = 0; i < (MMA ? MT : 1); i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
#pragma unroll
    for (int g = 0; g < H; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
#pragma unroll
    for (int g = 0; g < (MMA ? 1 : H); g++)
#pragma unroll
        for (int c = 0; c < VC; c++) acc[g][c][0] = acc[g][c][1] = acc[g][c][2] = acc[g][c][3] = 0.0f;

    for (int j = 0; j < nt; j++) {
        if (j + S - 1 < nt) issue(j + S - 1);
        cp_async_commit();
        cp_async_wait_n(S - 1);
        __syncwarp();
        int32_t kt = k0 + (warp + j * W) * TK, n = min(TK, k1 - kt);
        const T *ks = ring + (j % S) * a.stage_elems, *vs = ks + TK * a.ldk;

        if (MMA) {
            float x[4];
            tile_scores_mma<H>(a, qh, ql, (const __half *)ks, x);
            tile_softmax_pv<MT>(a, x, n, (const __half *)vs, a.ldv, a.dv / 16, m_row, l_row, o);
        } else {
            float *ps = ps_all + warp * H * TK, corr[H];
            int part = lane / TK, lpk = 32 / TK;
            float dot[H];
#pragma unroll
            for (int g = 0; g < H; g++) dot[g] = 0.0f;
            for (int c = part * 8; c < a.dk; c += lpk * 8) {
                float kv[8];
                load8(ks + key_l * a.ldk + c, kv);
#pragma unroll
                for (int g = 0; g < H; g++) {
                    float4 q0 = *(const float4 *)(qs + g * a.dk + c), q1 = *(const float4 *)(qs + g * a.dk + c + 4);
                    dot[g] += q0.x * kv[0] + q0.y * kv[1] + q0.z * kv[2] + q0.w * kv[3] + q1.x * kv[4] +
                              q1.y * kv[5] + q1.z * kv[6] + q1.w * kv[7];
                }
            }
#pragma unroll
            for (int g = 0; g < H; g++) {
                for (int o2 = TK; o2 < 32; o2 *= 2) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o2);
                float s = key_l < n ? score(a, dot[g]) : -INFINITY, mx = s;
                for (int o2 = 1; o2 < TK; o2 *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
                float m_new = fmaxf(m[g], mx);   /* finite: the tile holds key kt */
                float e = expf(s - m_new);
                corr[g] = expf(m[g] - m_new);
                l[g] = l[g] * corr[g] + (part == 0 ? e : 0.0f);
                m[g] = m_new;
                if (part == 0) ps[g * TK + key_l] = e;
#pragma unroll
                for (int c = 0; c < VC; c++) {
                    acc[g][c][0] *= corr[g];
                    acc[g][c][1] *= corr[g];
                    acc[g][c][2] *= corr[g];
                    acc[g][c][3] *= corr[g];
                }
            }
            __syncwarp();
            /* keys [n, TK) weigh 0 and their rows are zeros */
            for (int kk = 0; kk < n; kk += 4) {
                float4 w[H];
#pragma unroll
                for (int g = 0; g < H; g++) w[g] = *(const float4 *)(ps + g * TK + kk);
#pragma unroll
                for (int u = 0; u < 4; u++)
#pragma unroll
                    for (int c = 0; c < VC; c++) {
                        int col = lane * 4 + c * 128;
                        if (col >= a.dv) continue;
                        float4 v = load4(vs + (kk + u) * a.ldv + col);
#pragma unroll
                        for (int g = 0; g < H; g++) {
                            float pg = component(w[g], u);
                            acc[g][c][0] += pg * v.x;
                            acc[g][c][1] += pg * v.y;
                            acc[g][c][2] += pg * v.z;
                            acc[g][c][3] += pg * v.w;
                        }
                    }
            }
        }
        __syncwarp();
    }

    /* the warps' results (sums, m, l) to shared memory, each then weighed
     * by exp(m_w - m) */
    __syncthreads();   /* every ring is spent: it becomes the merge area */
    float *mo = (float *)rings, *mm = mo + W * H * a.dv, *ml = mm + W * H;   /* [W][H][dv], [W][H], [W][H] */
    if (MMA) {
        l_row += __shfl_xor_sync(0xffffffffu, l_row, 1);
        l_row += __shfl_xor_sync(0xffffffffu, l_row, 2);
        int g = lane / 4, t = lane % 4;
        if (t == 0 && g < nh) {
            mm[warp * H + g] = m_row;
            ml[warp * H + g] = l_row;
        }
#pragma unroll
        for (int i = 0; i < MT; i++) {
            if (i >= a.dv / 16) break;
            int col = 16 * i + g;
            const float unscale = 1.0f / DEC_P_SCALE;
            if (2 * t < nh) {
                mo[(warp * H + 2 * t) * a.dv + col] = o[i][0] * unscale;
                mo[(warp * H + 2 * t) * a.dv + col + 8] = o[i][2] * unscale;
            }
            if (2 * t + 1 < nh) {
                mo[(warp * H + 2 * t + 1) * a.dv + col] = o[i][1] * unscale;
                mo[(warp * H + 2 * t + 1) * a.dv + col + 8] = o[i][3] * unscale;
            }
        }
    } else {
#pragma unroll
        for (int g = 0; g < H; g++) {
            for (int o2 = 16; o2 > 0; o2 /= 2) l[g] += __shfl_xor_sync(0xffffffffu, l[g], o2);
            if (lane == 0 && g < nh) {
                mm[warp * H + g] = m[g];
                ml[warp * H + g] = l[g];
            }
            if (g >= nh) continue;
#pragma unroll
            for (int c = 0; c < VC; c++) {
                int col = lane * 4 + c * 128;
                if (col < a.dv)
                    *(float4 *)(mo + (warp * H + g) * a.dv + col) =
                        make_float4(acc[g][c][0], acc[g][c][1], acc[g][c][2], acc[g][c][3]);
            }
        }
    }
    __syncthreads();
    /* each head's weights of the warps, exp(m_w - m), and its m and l, once
     * (a warp with no tile weighs 0: its sums are zeros) */
    if (tid < nh) {
        float mx = -INFINITY, sum = 0.0f;
        for (int w = 0; w < W; w++) mx = fmaxf(mx, mm[w * H + tid]);
        for (int w = 0; w < W; w++) {
            float mw = mm[w * H + tid], f = 0.0f;
            if (mw != -INFINITY) {
                f = expf(mw - mx);
                sum += f * ml[w * H + tid];
            }
            merge_f[w * H + tid] = f;
        }
        merge_m[tid] = mx;
        merge_l[tid] = sum;
    }
    __syncthreads();
    size_t pl = ((size_t)y * (size_t)a.n_head + (size_t)h0) * (size_t)a.n_splits;   /* partial of head h0, split 0 */
    auto emit = [&](int g, int e, float acc_o) {
        if (n_live == 1) {
            a.out[(size_t)r * (size_t)a.out_cols + (size_t)(h0 + g) * (size_t)a.dv + (size_t)e] = acc_o / merge_l[g];
        } else {
            size_t at = pl + (size_t)g * (size_t)a.n_splits + (size_t)split;
            a.part[at * (size_t)a.dv + (size_t)e] = acc_o;
            if (e == 0) {
                a.part_ml[2 * at] = merge_m[g];
                a.part_ml[2 * at + 1] = merge_l[g];
            }
        }
    };
    if ((a.dv & 3) == 0) {
        /* 4 columns a thread: one shared-memory load of each warp's sums
         * for them (the same sums in the same order as one at a time) */
        for (int32_t i = 4 * tid; i < nh * a.dv; i += 4 * (int32_t)blockDim.x) {
            int g = i / a.dv, e = i - g * a.dv;
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int w = 0; w < W; w++) {
                float f = merge_f[w * H + g];
                float4 x = *(const float4 *)(mo + (w * H + g) * a.dv + e);
                acc.x += f * x.x;
                acc.y += f * x.y;
                acc.z += f * x.z;
                acc.w += f * x.w;
            }
            emit(g, e, acc.x);
            emit(g, e + 1, acc.y);
            emit(g, e + 2, acc.z);
            emit(g, e + 3, acc.w);
        }
    } else {
        for (int i = tid, g = tid / a.dv, e = tid % a.dv; i < nh * a.dv; i += blockDim.x, e += blockDim.x) {
            while (e >= a.dv) {
                e -= a.dv;
                g++;
            }
            float acc_o = 0.0f;
            for (int w = 0; w < W; w++) acc_o += merge_f[w * H + g] * mo[(w * H + g) * a.dv + e];
            emit(g, e, acc_o);
        }
    }
    if (n_live == 1 || !a.merge_here) return;

    /* the last split of the row to finish merges them all (few: merge_here);
     * a thread sums 4 columns of one head over every split */
    __threadfence();
    __syncthreads();
    int32_t *counter = a.counters + (size_t)y * gridDim.z + blockIdx.z;
    if (tid == 0) last_s = atomicAdd(counter, 1) == n_live - 1;
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    for (int i = tid; i < nh * a.dv / 4; i += blockDim.x) {
        int g = i / (a.dv / 4), e = i % (a.dv / 4) * 4;
        float4 sum = merge_splits(a, pl + (size_t)g * (size_t)a.n_splits, n_live, a.dv, e);
        float *to = a.out + (size_t)r * (size_t)a.out_cols + (size_t)(h0 + g) * (size_t)a.dv + (size_t)e;
        to[0] = sum.x;
        to[1] = sum.y;
        to[2] = sum.z;
        to[3] = sum.w;
    }
    if (tid == 0) *counter = 0;
}

/* ---- decode, a warp a unit ----------------------------------------------- */

/* Floats of a part's ring that decode_lean_kernel's merge takes: a warp's
 * o values ((D / 16 / DS) * 4 a lane), m and l, lane-major, for each of
 * the part's DS warps. Its staged output for the quantizer follows them. */
static __host__ __device__ constexpr int lean_merge_floats(int D, int DS)
{
    return DS * ((D / 16 / DS) * 4 + 2) * 32;
}

/* The decode kernel for rows of F16 caches with heads of 64, 128 or 256
 * (decode_lean_launch, lean_covers): grid (decode rows, units / units a
 * CTA, splits), SP warps per unit, a unit being one row, one kv head and the
 * query heads of it that decode_kernel's CTA would take (H <= 8: the rows
 * of the scores' m16 tiles), over all of the row's keys or (SPLIT) over
 * split blockIdx.z of them. F16 caches with dk = dv = D (64, 128 or 256:
 * heads of 256 take 4 warps a unit at most). With one
 * warp a unit (many rows) nothing is shared between warps: no q staging, no
 * barrier, no merge. With 2, 4 or 8 (few rows: batch 1's 8 units would
 * leave a warp going through all the row's tiles alone), the unit's warps
 * take its tiles in turn (warp part p: tiles p, p + SP, ...), each with its
 * own q, ring and online softmax; after a barrier of the unit's warps only,
 * each part merges its share of the columns over all the parts through
 * shared memory (their rings, spent) and writes them. The unit's q stays in
 * registers as the A fragments of the scores (f16 hi + lo, as
 * decode_kernel's), its keys stream in tiles of 16 through the warp's own
 * ring of dec_stages stages (cp.async; a tile inside one cache block is one
 * running address: its K and V are 4 KB each for D = 128), and the per-tile
 * work is decode_kernel's tensor-core path. The row's own k and v: as
 * decode_kernel (taken from the step, stored by the unit of head chunk 0,
 * in the split that holds the row's position). SPLIT (lean_splits: rows
 * of more keys than a CTA's parts go through quickly, and every row under
 * batch invariance): each split's
 * CTA writes its parts' merged sums, m and l as a partial result, and the
 * last of the row's splits to arrive (a counter a row and unit) merges
 * them, writes the row and quantizes it; without SPLIT the kernel is the
 * one-CTA-a-unit kernel it was (a separate instance: with the split's
 * code in it heads of 256, at 255 registers, ran 3% slower at short
 * contexts). SP is a template argument: at batch 1 the kernel is a latency
 * chain run once an SM a layer, and each split's code is only its own
 * (cuda/NOTES.md). */
template <int D, int SP, int DS, bool SPLIT>
__global__ static void __launch_bounds__(SP * DS > DEC_LEAN_CTA_WARPS ? SP * DS * 32 : DEC_LEAN_CTA_WARPS * 32, 1)
    decode_lean_kernel(const attn_args a)
{
    static_assert(SP == 1 || SP == 2 || SP == 4 || SP == 8, "a unit's parts");
    static_assert(!SPLIT || SP > 1, "splits merge through the parts' merge");
    static_assert(DS == 1 || (DS == 2 && SP <= 4 && D >= 128), "a part's warps");
    constexpr int LD = D + 8, TILE = 16 * LD, STAGE = 2 * TILE, KC = D / 16, KCD = KC / DS, UW = SP * DS;
    constexpr int PPR = D / 8, RPP = 32 / PPR, PASSES = 16 / RPP;   /* 16-byte pieces of a row; rows a pass */
    static_assert(16 * PPR % (32 * DS) == 0 && PASSES % DS == 0, "a tile's copies shared by a part's warps");
    extern __shared__ __align__(16) unsigned char dsm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, S = a.dec_stages;
    const int uw = warp % UW, part = uw / DS, dh = uw % DS;   /* the unit's warp, its part, its half of the values */
    const int32_t z = a.n_kv_head * a.n_hchunks;
    const int32_t zz = (int32_t)blockIdx.y * (int32_t)(blockDim.x / 32 / UW) + warp / UW;
    if (zz >= z) return;   /* the unit's warps together */
    const int32_t y = (int32_t)blockIdx.x;
    const int32_t kvh = zz / a.n_hchunks, hc0 = zz % a.n_hchunks * a.heads_per_cta;
    const int32_t nh = min(a.heads_per_cta, a.group - hc0), h0 = kvh * a.group + hc0;
    const int32_t r = a.dec_rows[y], p = a.pos[r], seq = a.row_seq[r], row_first = first_key(a, p);
    /* SPLIT: split blockIdx.z of the row's keys (lean_splits), else all of them */
    const int32_t split_len = SPLIT ? row_split_len(a, row_first, p) : 0;
    const int32_t k0 = SPLIT ? row_first + (int32_t)blockIdx.z * split_len : row_first;
    if (SPLIT && k0 > p) return;   /* past the row's keys: the CTA's units alike, no partial */
    const int32_t k1 = SPLIT ? min(p + 1, k0 + split_len) : p + 1;
    /* this warp stores the row's own k and v: the unit of head chunk 0, in
     * the split that holds the row's position */
    const bool own = hc0 == 0 && uw == 0 && k1 == p + 1;
    const int32_t *tab = block_table(a, seq);
    const int32_t spos0 = a.seq_pos0[seq], srow0 = a.seq_row0[seq];
    __half *ring = (__half *)dsm + (size_t)(warp / DS) * (size_t)S * STAGE;   /* the part's */

    const lane_blocks blocks(a, tab, k0, k1);   /* the row's */
    const size_t head_off = a.layer_off + (size_t)kvh * (size_t)a.block_tokens * (size_t)(D * 2);
    const int32_t n_tiles = (k1 - k0 + 15) / 16;
    const int32_t nt = n_tiles > part ? (n_tiles - part + SP - 1) / SP : 0;   /* this warp's: part + i SP */
    /* tile j's K rows to stage `slot` of the ring, its V rows TILE halves after them */
    auto issue = [&](int32_t j, int slot) {
        const int32_t kt = k0 + 16 * j;
        __half *st = ring + slot * STAGE;
        const int32_t in_block = kt & (a.block_tokens - 1);
        if (kt + 16 <= k1 && kt + 16 <= spos0 && in_block + 16 <= a.block_tokens) {
            const int32_t b = blocks.of(kt);
            if (b >= 0) {
                const uint8_t *kb = a.pool + (size_t)b * a.block_bytes + head_off + (size_t)in_block * (D * 2);
#pragma unroll
                for (int i = 0; i < 16 * PPR / (32 * DS); i++) {
                    const int q = dh * 32 + lane + 32 * DS * i, row = q / PPR, col = q % PPR;
                    cp_async16(st + row * LD + col * 8, kb + (size_t)q * 16, true);
                    cp_async16(st + TILE + row * LD + col * 8, kb + a.v_off + (size_t)q * 16, true);
                }
                return;
            }
        }
        /* not unrolled: of a decode row's tile only the row's own key
         * waits for its loads (the step's k and v), the others are
         * copies, so the passes cost no trips to memory one after
         * another, and the code stays short (cuda/NOTES.md) */
        const int row0 = lane / PPR, col = lane % PPR;
#pragma unroll 1
        for (int ii = 0; ii < PASSES / DS; ii++) {
            const int rr = row0 + (ii * DS + dh) * RPP;
            const int32_t key = kt + rr;
            __half *kd = st + rr * LD + col * 8, *vd = kd + TILE;
            const int32_t kb = blocks.of(min(key, k1 - 1));   /* every lane takes part in the shuffle */
            const int32_t b = key < k1 && key < spos0 ? kb : -1;
            if (key >= k1) {
                cp_async16(kd, a.pool, false);
                cp_async16(vd, a.pool, false);
            } else if (key >= spos0) {
                const int32_t sr = srow0 + key - spos0;
                piece_from_floats(a.k + (size_t)sr * (size_t)a.k_cols + (size_t)kvh * D + col * 8, kd);
                piece_from_floats(a.v + (size_t)sr * (size_t)a.v_cols + (size_t)kvh * D + col * 8, vd);
            } else {
                const uint8_t *from = a.pool + (size_t)(b < 0 ? 0 : b) * a.block_bytes + head_off +
                                      (size_t)(key & (a.block_tokens - 1)) * (D * 2) + (size_t)col * 16;
                cp_async16(kd, from, b >= 0);
                cp_async16(vd, from + a.v_off, b >= 0);
            }
        }
    };
    /* Before the wait for the kernel before: the step's metadata and the
     * cache's keys of earlier steps are written by no kernel of the step,
     * so the first tiles that hold only such keys go out now (the chain of
     * loads to a tile's address is the longest wait of a unit). q, the
     * step's k and v rows and the stores come after the wait. */
    const int32_t own_b = blocks.of(p);   /* every lane: the shuffle */
    /* one loop for the ring's first S - 1 tiles, waiting at the first
     * that holds a key of the step (one place of issue's code, not two) */
    bool waited = false;
    for (int i = 0; i < S - 1; i++) {
        if (!waited && !(i < nt && k0 + 16 * (part + i * SP + 1) <= spos0)) {
            wait_for_previous_kernel();
            let_next_kernel_start();
            waited = true;
        }
        if (i < nt) issue(part + i * SP, i);
        cp_async_commit();
    }
    if (!waited) {
        wait_for_previous_kernel();
        let_next_kernel_start();
    }

    /* q of the unit's heads (rows g < nh of the A fragments) and the row's
     * own k and v (head chunk 0 stores them): loaded now, used once the
     * first tile has come, so that their latency hides behind its */
    /* lean_covers: q, k and v and their rows 16-byte aligned */
    const float *q = a.q + (size_t)r * (size_t)a.q_cols + (size_t)(h0 + g) * D + 2 * t;
    float2 qf[KC][2];
    auto load_q = [&]() {
#pragma unroll
        for (int kc = 0; kc < KC; kc++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                qf[kc][hf] = g < nh ? *(const float2 *)(q + kc * 16 + 8 * hf) : make_float2(0.0f, 0.0f);
    };
    /* heads of 256 too (q's 64 registers a lane): they were loaded at the
     * first tile while the kernel's code was longer and spilled at 255
     * registers; at 245 here, without spills, they gain a little
     * (cuda/NOTES.md) */
    load_q();
    /* the row's own k and v, columns OWN lane + [0, OWN) */
    constexpr int OWN = D / 32;
    float k_own[OWN], v_own[OWN];
    {
        const float *kr = a.k + (size_t)r * (size_t)a.k_cols + (size_t)kvh * D + lane * OWN;
        const float *vr = a.v + (size_t)r * (size_t)a.v_cols + (size_t)kvh * D + lane * OWN;
#pragma unroll
        for (int i = 0; i < OWN; i += 4) {
            if (OWN == 2) {
                *(float2 *)k_own = own ? *(const float2 *)kr : make_float2(0.0f, 0.0f);
                *(float2 *)v_own = own ? *(const float2 *)vr : make_float2(0.0f, 0.0f);
            } else {
                *(float4 *)(k_own + i) = own ? *(const float4 *)(kr + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                *(float4 *)(v_own + i) = own ? *(const float4 *)(vr + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
    }
    uint32_t qh[KC][2], ql[KC][2];   /* q as f16 hi + lo A fragments */
    auto first_tile = [&]() {
#pragma unroll
        for (int kc = 0; kc < KC; kc++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                __half h0h, h0l, h1h, h1l;
                split_hi_lo(qf[kc][hf].x, h0h, h0l);
                split_hi_lo(qf[kc][hf].y, h1h, h1l);
                __half2 hh = __halves2half2(h0h, h1h), hl = __halves2half2(h0l, h1l);
                qh[kc][hf] = *(const uint32_t *)&hh;
                ql[kc][hf] = *(const uint32_t *)&hl;
            }
        if (own && own_b >= 0) {
            __half *slot = (__half *)(a.pool + (size_t)own_b * a.block_bytes + head_off +
                                      (size_t)(p & (a.block_tokens - 1)) * (D * 2)) + lane * (D / 32);
            __half2 kh[OWN / 2], vh[OWN / 2];
#pragma unroll
            for (int i = 0; i < OWN / 2; i++) {
                kh[i] = __floats2half2_rn(k_own[2 * i], k_own[2 * i + 1]);
                vh[i] = __floats2half2_rn(v_own[2 * i], v_own[2 * i + 1]);
            }
            if (OWN == 2) {
                *(__half2 *)slot = kh[0];
                *(__half2 *)((uint8_t *)slot + a.v_off) = vh[0];
            } else {
#pragma unroll
                for (int i = 0; i < OWN / 2; i += 2) {
                    *(uint2 *)(slot + 2 * i) = *(const uint2 *)(kh + i);
                    *(uint2 *)((uint8_t *)(slot + 2 * i) + a.v_off) = *(const uint2 *)(vh + i);
                }
            }
        }
    };

    float o[KCD][4], m_row = -INFINITY, l_row = 0.0f;   /* this warp's values: columns dh D / DS on */
#pragma unroll
    for (int i = 0; i < KCD; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    const int lrow = lane % 8 + 8 * (lane / 16), lcol = 8 * (lane / 8 % 2);   /* ldmatrix addresses */
    /* a part of DS warps shares its ring: its barrier (ids 8 on; the
     * units' merges take 1 to 4) */
    auto part_barrier = [&]() { team_barrier(8 + warp / DS, DS * 32); };
    /* rd: this part's tile i's stage, wr: its tile i + S - 1's. With two
     * warps a part every part goes round as often as part 0 (the most
     * tiles), its rounds past its own tiles only the barrier, so that all
     * of a unit's warps have passed as many barriers when they meet at the
     * merge's */
    const int32_t rounds = DS == 1 || n_tiles == 0 ? nt : (n_tiles + SP - 1) / SP;
    for (int32_t i = 0, rd = 0, wr = S - 1; i < rounds; i++) {
        if (DS == 1) {
            if (i + S - 1 < nt) issue(part + (i + S - 1) * SP, wr);
            cp_async_commit();
            cp_async_wait_n(S - 1);
            __syncwarp();
        } else {
            /* tile i's copies, this warp's then (the barrier) the other's;
             * past the barrier both have read tile i - 1, whose stage the
             * next copies refill */
            cp_async_wait_n(S - 2);
            part_barrier();
            if (i >= nt) continue;
            if (i + S - 1 < nt) issue(part + (i + S - 1) * SP, wr);
            cp_async_commit();
        }
        if (i == 0) first_tile();
        const int32_t kt = k0 + 16 * (part + i * SP), n = min(16, k1 - kt);
        const __half *ks = ring + rd * STAGE, *vs = ks + TILE;
        rd = rd + 1 == S ? 0 : rd + 1;
        wr = wr + 1 == S ? 0 : wr + 1;
        float s[4][4] = {};   /* four chains of products, as tile_scores_mma's */
#pragma unroll
        for (int kc = 0; kc < KC; kc++) {
            uint32_t kf[4];
            ldsm4(kf, ks + lrow * LD + kc * 16 + lcol);
            const uint32_t hi[4] = { qh[kc][0], 0u, qh[kc][1], 0u }, lo[4] = { ql[kc][0], 0u, ql[kc][1], 0u };
            mma16816(s[0], hi, kf[0], kf[1]);
            mma16816(s[1], hi, kf[2], kf[3]);
            mma16816(s[2], lo, kf[0], kf[1]);
            mma16816(s[3], lo, kf[2], kf[3]);
        }
        float x[4] = { s[0][0] + s[2][0], s[0][1] + s[2][1], s[1][0] + s[3][0], s[1][1] + s[3][1] };
        tile_softmax_pv<KCD>(a, x, n, vs + dh * (D / DS), LD, KCD, m_row, l_row, o);
        if (DS == 1) __syncwarp();   /* the stage is read before the next issue rewrites it */
    }

    /* heads 2t and 2t + 1 of this lane's columns: their m and sums l sit
     * in the quads at lanes 8t and 8t + 4 */
    l_row += __shfl_xor_sync(0xffffffffu, l_row, 1);
    l_row += __shfl_xor_sync(0xffffffffu, l_row, 2);
    const float unscale = 1.0f / DEC_P_SCALE;
    const int hd[2] = { 2 * t, 2 * t + 1 };
    float *const out = a.out + (size_t)r * (size_t)a.out_cols + (size_t)h0 * D + g +
                       dh * (D / DS);   /* + head * D + column */
    if (SP == 1) {
        const float lh[2] = { __shfl_sync(0xffffffffu, l_row, 8 * t), __shfl_sync(0xffffffffu, l_row, 8 * t + 4) };
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (hd[u] >= nh) continue;
            const float w = unscale / lh[u];
#pragma unroll
            for (int i = 0; i < KCD; i++) {
                out[hd[u] * D + 16 * i] = o[i][u] * w;
                out[hd[u] * D + 16 * i + 8] = o[i][2 + u] * w;
            }
        }
        return;
    }
    /* The unit's warps' o, m and l to their rings ([KC * 4 + 2][32] floats
     * a warp, lane-major: value v of lane l at v * 32 + l), then every part
     * merges its share of the values (o[i][c] is value 4 i + c; part q
     * takes values q KC * 4 / SP and on) over the SP parts, each weighed by
     * exp(m_part - m) for its head, and writes them: the merge's loads are
     * KC * 4 a lane whatever the split, spread over the unit's warps. */
    constexpr int NF = KCD * 4 + 2;
    static_assert(lean_merge_floats(D, DS) == DS * NF * 32 && lean_merge_floats(D, DS) * 4 <= STAGE * 2,
                  "a part's merge fits one stage of its ring");
    if (DS == 1) __syncwarp();
    else part_barrier();   /* both have read the part's last tile */
    float *mine = (float *)ring + dh * NF * 32;
#pragma unroll
    for (int i = 0; i < KCD; i++)
#pragma unroll
        for (int c = 0; c < 4; c++) mine[(4 * i + c) * 32 + lane] = o[i][c];
    mine[4 * KCD * 32 + lane] = m_row;
    mine[(4 * KCD + 1) * 32 + lane] = l_row;
    team_barrier(1 + warp / UW, UW * 32);
    const float *first = (const float *)((__half *)dsm + (size_t)((warp - uw) / DS) * (size_t)S * STAGE) + dh * NF * 32;
    const size_t ring_floats = (size_t)S * STAGE / 2;
    float mh[2] = { -INFINITY, -INFINITY }, f[SP][2], w[2], lsum[2];
#pragma unroll
    for (int u = 0; u < 2; u++)
#pragma unroll
        for (int q = 0; q < SP; q++) mh[u] = fmaxf(mh[u], first[q * ring_floats + 4 * KCD * 32 + 8 * t + 4 * u]);
#pragma unroll
    for (int u = 0; u < 2; u++) {
        float l = 0.0f;
#pragma unroll
        for (int q = 0; q < SP; q++) {
            /* a part with no tile has m = -inf: weight 0 (part 0 always has one) */
            f[q][u] = expf(first[q * ring_floats + 4 * KCD * 32 + 8 * t + 4 * u] - mh[u]);
            l += f[q][u] * first[q * ring_floats + (4 * KCD + 1) * 32 + 8 * t + 4 * u];
        }
        lsum[u] = l;
        w[u] = unscale / l;
    }
    /* with splits the CTA's partial result of each head (sums, m, l: as
     * decode_kernel's) goes to a.part and a.part_ml, the row's last split
     * to arrive merging them below */
    const int32_t n_live = SPLIT ? (p - row_first) / split_len + 1 : 1;
    const bool split = SPLIT && n_live > 1;
    const size_t pl = ((size_t)y * (size_t)a.n_head + (size_t)h0) * (size_t)a.n_splits;   /* head h0, split 0 */
    auto part_at = [&](int head) { return pl + (size_t)head * (size_t)a.n_splits + blockIdx.z; };   /* this split's */
    const int own_col = g + dh * (D / DS);   /* this lane's first column of a head (out's offset) */
    constexpr int PER = 4 * KCD / SP;   /* even: a value's head (u = v & 1) is j's */
    static_assert(PER % 2 == 0, "a part's values pair up by head");
    /* with a.qo the unit's values also go to shared memory (the first
     * part's ring past the merge's rings: [nh][D] floats, decode_lean_go
     * checks the room), to be quantized below */
    float *const staged =
        (float *)((__half *)dsm + (size_t)((warp - uw) / DS) * (size_t)S * STAGE) + lean_merge_floats(D, DS);
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int v = part * PER + j, u = j & 1;
        float sum = 0.0f;
#pragma unroll
        for (int q = 0; q < SP; q++) sum += f[q][u] * first[q * ring_floats + v * 32 + lane];
        const int head = 2 * t + u, col = 16 * (v / 4) + 8 * (v % 4 / 2), at = head * D + col;
        if (head >= nh) continue;
        if (split) {
            a.part[part_at(head) * D + (size_t)(col + own_col)] = sum * unscale;
        } else {
            const float value = sum * w[u];
            out[at] = value;
            if (a.qo) staged[at + own_col] = value;
        }
    }
    if (split) {
        if (uw == 0 && g == 0)
#pragma unroll
            for (int u = 0; u < 2; u++)
                if (2 * t + u < nh) {
                    a.part_ml[2 * part_at(2 * t + u)] = mh[u];
                    a.part_ml[2 * part_at(2 * t + u) + 1] = lsum[u];
                }
        /* the last of the row's live splits to arrive (a counter a row and
         * unit, reset by it) merges them, as decode_kernel's merge_here */
        __shared__ int lean_last[DEC_LEAN_CTA_WARPS];
        __threadfence();
        team_barrier(1 + warp / UW, UW * 32);
        int32_t *const counter = a.counters + (size_t)y * (size_t)z + (size_t)zz;
        if (uw == 0 && lane == 0) lean_last[warp / UW] = atomicAdd(counter, 1) == n_live - 1;
        team_barrier(1 + warp / UW, UW * 32);
        if (!lean_last[warp / UW]) return;
        __threadfence();
        /* a thread takes 4 columns of a head (merge_splits) */
        float *const row = a.out + (size_t)r * (size_t)a.out_cols + (size_t)h0 * D;
        for (int i = uw * 32 + lane; i < nh * D / 4; i += UW * 32) {
            const int hh = i / (D / 4), e = i % (D / 4) * 4;
            const float4 acc = merge_splits(a, pl + (size_t)hh * (size_t)a.n_splits, n_live, D, e);
            float *to = row + hh * D + e;
            to[0] = acc.x;
            to[1] = acc.y;
            to[2] = acc.z;
            to[3] = acc.w;
            if (a.qo) *(float4 *)(staged + hh * D + e) = acc;
        }
        if (uw == 0 && lane == 0) *counter = 0;
    }
    if (!a.qo) return;
    /* The unit's nh x D values quantized as quantize_act does for the
     * product after it (quant8.cuh): a unit of 8 values a lane, a warp's
     * lanes 32 consecutive units (a super-block of 256 for ACT_Q8_K, whose
     * starts decode_lean_go checks fall on the unit's), so every value,
     * lane and shuffle is the one quantize_act would have. */
    team_barrier(1 + warp / UW, UW * 32);
    const int n8 = nh * D / 8;
    const int64_t base = ((int64_t)r * a.out_cols + (int64_t)h0 * D) / 8;
    for (int u0 = uw * 32; u0 < n8; u0 += UW * 32) {
        const int i = u0 + lane;
        const bool live = i < n8;
        float x[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
        if (live) {
            const float4 x0 = ((const float4 *)staged)[2 * i], x1 = ((const float4 *)staged)[2 * i + 1];
            x[0] = x0.x; x[1] = x0.y; x[2] = x0.z; x[3] = x0.w;
            x[4] = x1.x; x[5] = x1.y; x[6] = x1.z; x[7] = x1.w;
        }
        int iq[8];
        const float d = a.q_scheme == ACT_Q8_K ? q8_scale<ACT_Q8_K>(x, lane, iq) : q8_scale<ACT_Q8_0>(x, lane, iq);
        q8_put(iq, d, base + i, live, lane, a.qo, a.qds);
    }
}

/* grid (decode rows, query heads, dv / 128 rounded up), 8 warps: merges 128
 * columns of the live splits' partial results of rows that split into more
 * than merge_here allows; a lane sums 4 columns, warp w the splits w, w +
 * 8, ..., then the warps' sums add up in shared memory. */
__global__ static void __launch_bounds__(256) combine_kernel(const attn_args a)
{
    follow_previous_kernel();
    extern __shared__ float wt[];   /* [n_splits] */
    __shared__ __align__(16) float red[8][128];
    int32_t y = blockIdx.x, h = blockIdx.y, col = (int32_t)blockIdx.z * 128 + (int32_t)(threadIdx.x % 32) * 4;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int32_t r = a.dec_rows[y], p = a.pos[r], first = first_key(a, p);
    int32_t n_live = (p - first) / row_split_len(a, first, p) + 1;
    if (n_live == 1) return;   /* decode_kernel wrote the row */
    size_t pl = ((size_t)y * (size_t)a.n_head + (size_t)h) * (size_t)a.n_splits;
    if (warp == 0) split_weights(a, pl, n_live, wt);
    __syncthreads();
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (col < a.dv) {
#pragma unroll 4
        for (int32_t s = warp; s < n_live; s += 8) {
            float4 x = __ldcg((const float4 *)(a.part + (pl + (size_t)s) * (size_t)a.dv + col));
            float w = wt[s];
            o.x += w * x.x;
            o.y += w * x.y;
            o.z += w * x.z;
            o.w += w * x.w;
        }
    }
    *(float4 *)&red[warp][lane * 4] = o;
    __syncthreads();
    int t = threadIdx.x, c = (int)blockIdx.z * 128 + t;
    if (t < 128 && c < a.dv) {
        float sum = 0.0f;
        for (int w = 0; w < 8; w++) sum += red[w][t];
        a.out[(size_t)r * (size_t)a.out_cols + (size_t)h * (size_t)a.dv + (size_t)c] = sum;
    }
}

/* ---- prefill ------------------------------------------------------------- */

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
    follow_previous_kernel();
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
    follow_previous_kernel();
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
/* The device's largest dynamic shared memory of a CTA, read by setup. */
static size_t dec_smem_max;

int luma_cuda_attention_setup(const luma_kv_layout *l, luma_err *err)
{
    const char *path = getenv("LUMA_CUDA_ATTN_PREFILL");
    prefill_on_cores = path && strcmp(path, "cores") == 0;
    if (l->head_dim_k < 8 || l->head_dim_k > HEAD_MAX || l->head_dim_k % 8 != 0 || l->head_dim_v < 8 ||
        l->head_dim_v > HEAD_MAX || l->head_dim_v % 8 != 0)
        return luma_errf(err, "attention heads of %d (keys) and %d (values) dimensions: the CUDA backend "
                              "handles multiples of 8 up to %d",
                         l->head_dim_k, l->head_dim_v, HEAD_MAX);
    if (l->block_tokens < 1 || (l->block_tokens & (l->block_tokens - 1)) != 0)
        return luma_errf(err, "KV blocks of %d positions: the CUDA backend handles powers of two", l->block_tokens);
    int dev = 0, optin = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return luma_errf(err, "setting up the attention kernels: %s", cudaGetErrorString(e));
    /* the decode kernel's shared memory depends on its tuning, checked at
     * launch: each may take what the device allows beside its static part */
#define LEAN_KERNELS(SPLIT)                                                                                        \
    (const void *)decode_lean_kernel<64, 2, 1, SPLIT>, (const void *)decode_lean_kernel<64, 4, 1, SPLIT>,          \
        (const void *)decode_lean_kernel<64, 8, 1, SPLIT>, (const void *)decode_lean_kernel<128, 2, 1, SPLIT>,     \
        (const void *)decode_lean_kernel<128, 4, 1, SPLIT>, (const void *)decode_lean_kernel<128, 8, 1, SPLIT>,    \
        (const void *)decode_lean_kernel<256, 2, 1, SPLIT>, (const void *)decode_lean_kernel<256, 4, 1, SPLIT>,    \
        (const void *)decode_lean_kernel<128, 2, 2, SPLIT>, (const void *)decode_lean_kernel<128, 4, 2, SPLIT>,    \
        (const void *)decode_lean_kernel<256, 2, 2, SPLIT>, (const void *)decode_lean_kernel<256, 4, 2, SPLIT>
    const void *decoders[] = {
        (const void *)decode_kernel<__half, 1, 128>, (const void *)decode_kernel<__half, 2, 128>,
        (const void *)decode_kernel<__half, 4, 128>, (const void *)decode_kernel<__half, 8, 128>,
        (const void *)decode_kernel<__half, 1, 256>, (const void *)decode_kernel<__half, 2, 256>,
        (const void *)decode_kernel<__half, 4, 256>, (const void *)decode_kernel<__half, 8, 256>,
        (const void *)decode_kernel<__half, 1, 0>,   (const void *)decode_kernel<__half, 2, 0>,
        (const void *)decode_kernel<__half, 4, 0>,   (const void *)decode_kernel<__half, 8, 0>,
        (const void *)decode_kernel<float, 1, 0>,    (const void *)decode_kernel<float, 2, 0>,
        (const void *)decode_kernel<float, 4, 0>,    (const void *)decode_kernel<float, 8, 0>,
        LEAN_KERNELS(false), LEAN_KERNELS(true),
        (const void *)decode_lean_kernel<64, 1, 1, false>, (const void *)decode_lean_kernel<128, 1, 1, false>,
        (const void *)decode_lean_kernel<256, 1, 1, false>, (const void *)decode_lean_kernel<128, 1, 2, false>,
        (const void *)decode_lean_kernel<256, 1, 2, false>,
    };
#undef LEAN_KERNELS
    dec_smem_max = (size_t)optin;
    for (size_t i = 0; i < sizeof decoders / sizeof decoders[0]; i++) {
        cudaFuncAttributes fa;
        e = cudaFuncGetAttributes(&fa, decoders[i]);
        size_t bytes = (size_t)optin > fa.sharedSizeBytes ? (size_t)optin - fa.sharedSizeBytes : 0;
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(decoders[i], cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
        if (e != cudaSuccess) return luma_errf(err, "setting up the attention kernels: %s", cudaGetErrorString(e));
        if (bytes < dec_smem_max) dec_smem_max = bytes;
    }
    /* the largest dynamic shared memory each of the others may ask for */
    struct { const void *fn; size_t bytes; } kernels[] = {
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
        e = cudaFuncSetAttribute(kernels[i].fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kernels[i].bytes);
        if (e != cudaSuccess) return luma_errf(err, "setting up the attention kernels: %s", cudaGetErrorString(e));
    }
    return 0;
}

/* The decode scratch (attn_scratch): the splits' arrival counters (the
 * last split of a row resets its own), then their partial results. */
static bool decode_scratch(cuda_backend *c, size_t counters, size_t part_bytes, attn_args *a)
{
    void *part;
    if (!luma_cuda_partials(c, &c->attn_scratch, counters, part_bytes, "the attention scratch", &a->counters, &part))
        return false;
    a->part = (float *)part;
    return true;
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
static void launch_tc(const cuda_backend *c, const attn_args *a, unsigned tiles, cudaStream_t s)
{
    typedef tc_layout<D> L;
    if (a->softcap > 0.0f) luma_launch(c, s, tiles * L::SUB, TC_THREADS, L::bytes(), prefill_tc_kernel<D, true>, *a);
    else luma_launch(c, s, tiles * L::SUB, TC_THREADS, L::bytes(), prefill_tc_kernel<D, false>, *a);
}

/* Decode tuning: stages of a warp's ring, the bytes of one stage (a tile
 * of K and V rows: they set the keys per tile on the CUDA cores; the tensor
 * cores take 16), warps per CTA, the waves of resident CTAs the splits aim
 * at, the fewest keys of a split. The defaults are the best of those
 * measured (cuda/NOTES.md); LUMA_CUDA_ATTN_DECODE, read at every call,
 * replaces them for measuring (spec/native/test_cuda.c sweeps it). */
typedef struct dec_tuning {
    int stages, stage_bytes, warps, waves, min_split;
    int merge_kb;              /* partials a row's last split merges itself at most; more: combine_kernel
                                * (-1: 64 KB when the step's CTAs fill the SMs, else 0: dec_defaults) */
    int mma;                   /* F16 caches on the tensor cores (dk, dv multiples of 16) */
    int one_split;             /* steps whose keys bound is at most this many: one split a row */
    int lean_min;              /* decode_lean_kernel from this many units (rows x kv heads x head chunks) */
    int lean_keys;             /* and at most this many keys a row (lean_covers: by heads and units) */
    int lean_split;            /* its warps a unit: 1, 2, 4 or 8 (0: by the step's units, lean_split_for) */
    int lean_wide;             /* heads of up to 128: lean_keys from twice this many units, a quarter below;
                                * heads of 256, one warp a part: a quarter from this many, an eighth below */
    int lean_long;             /* twice lean_keys from this many units (heads of 256: lean_keys; two warps a
                                * part: from half as many) */
    int lean_ds;               /* warps a part of a unit: 2 (each half of the values), 1, or 0: by the heads
                                * (lean_ds_for) */
    int lean_tiles;            /* a row's keys split over CTAs so that each part of a unit takes about this
                                * many tiles of a split (0: one CTA a unit, and lean_keys its reach at few
                                * units too; -1: lean_tiles_for) */
    int lean_solo;             /* ... once its parts would take more than this many tiles each in one CTA
                                * (-1: lean_solo_for) */
    int lean_many;             /* below this many units (half for heads of 256) the lean kernel takes rows
                                * of any length, split past its reach (lean_long_rows; -1: at any number) */
} dec_tuning;

/* LUMA_CUDA_ATTN_DECODE="stages,stage_bytes,warps,waves,min_split,merge_kb,mma,one_split,lean_min,lean_keys,
 * lean_split,lean_wide,lean_long,lean_ds,lean_tiles,lean_solo,lean_many" */
static dec_tuning dec_tuning_get(void);

/* The defaults that depend on the heads (cuda/NOTES.md, "Decode:
 * occupancy"): heads of up to 128 values on the tensor cores with 4 warps
 * a CTA; larger heads (Gemma's 256) on the CUDA cores with 8 warps, whose
 * 8 KB stages leave more warps an SM than the tensor cores' 34 KB tiles of
 * 16 keys (10-30% faster on every case measured). */
static dec_tuning dec_defaults(dec_tuning t, int32_t dv, int64_t ctas, int n_sm)
{
    if (t.mma < 0) t.mma = dv <= 128;
    /* 4 warps a CTA on the tensor cores. (8 when the step's rows and kv
     * heads gave fewer CTAs than SMs was faster when this kernel took the
     * short contexts of batch 1, which decode_lean_kernel now takes; at
     * batch 1 past 1,024 keys 4 warps, three CTAs an SM, are faster: the
     * 7B at 3,000 to 8,192 keys 2.37-2.45 against 2.52-2.59 ms a token,
     * cuda/NOTES.md, "Decode at depth") */
    if (t.warps == 0) t.warps = dv <= 128 ? 4 : 8;
    /* the last split merges a row's partials where the step has CTAs
     * enough to spread the merges over; with fewer (a few long rows)
     * combine_kernel's CTA a head merges them faster than one CTA a kv head
     * (the same measurement) */
    if (t.merge_kb < 0) t.merge_kb = ctas >= n_sm ? 64 : 0;
    /* one split for short contexts on the tensor cores (7B at batch 1: 368
     * to 373 tokens/s, 32 sequences 4,076 to 4,211), not on the CUDA cores
     * (Gemma 3 270M at batch 1: 1,164 to 1,071; 8 sequences 6,070 to 5,137:
     * its one kv head leaves a row a single CTA) */
    if (t.one_split < 0) t.one_split = t.mma ? 256 : 0;
    return t;
}

static dec_tuning dec_tuning_get(void)
{
    /* stages 0, warps 0, merge_kb -1, mma -1 and one_split -1: the defaults for the layer's heads
     * and the step (dec_defaults, decode_launch) */
    dec_tuning t = { 0, 8192, 0, 1, 64, -1, -1, -1, DEC_LEAN_MIN, DEC_LEAN_KEYS, 0, DEC_LEAN_WIDE,
                     DEC_LEAN_LONG, 0, -1, -1, -1 };
    const char *s = getenv("LUMA_CUDA_ATTN_DECODE");
    if (s && *s)
        sscanf(s, "%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d,%d", &t.stages, &t.stage_bytes, &t.warps,
               &t.waves, &t.min_split, &t.merge_kb, &t.mma, &t.one_split, &t.lean_min, &t.lean_keys, &t.lean_split,
               &t.lean_wide, &t.lean_long, &t.lean_ds, &t.lean_tiles, &t.lean_solo, &t.lean_many);
    if (t.stages != 0) t.stages = t.stages < 2 ? 2 : t.stages > DEC_MAX_STAGES ? DEC_MAX_STAGES : t.stages;
    if (t.warps != 0) t.warps = t.warps < 1 ? 1 : t.warps > DEC_MAX_WARPS ? DEC_MAX_WARPS : t.warps;
    if (t.waves < 1) t.waves = 1;
    if (t.min_split < 1) t.min_split = 1;
    return t;
}

/* The decode kernel's tile and shared memory for a layer: q of the CTA's
 * heads (and, on the CUDA cores, each warp's softmax weights), then the
 * warps' rings, whose room later holds the merge of the warps ([warps][H]
 * [dv + 2] floats). K and V rows are 16 bytes longer than a head:
 * the rows an ldmatrix or a column of lanes reads fall in distinct banks. */
typedef struct dec_shape {
    int32_t tk, ldk, ldv, stage_elems;
    size_t fixed_bytes, ring_bytes;
} dec_shape;

static dec_shape decode_shape(const attn_args *a, size_t es, const dec_tuning &tu, int H, bool mma)
{
    dec_shape d;
    d.tk = 32;
    while (d.tk > 4 && (size_t)d.tk * (size_t)(a->dk + a->dv) * es > (size_t)tu.stage_bytes) d.tk /= 2;
    if (mma) d.tk = 16;   /* the k16 of the products with V, two n8 halves of the scores */
    d.ldk = a->dk + (int32_t)(16 / es);
    d.ldv = a->dv + (int32_t)(16 / es);
    d.stage_elems = d.tk * (d.ldk + d.ldv);
    d.fixed_bytes = mma ? (size_t)4 * H * (size_t)(a->dk + 8)
                        : (size_t)4 * H * (size_t)a->dk + (size_t)tu.warps * H * d.tk * sizeof(float);
    size_t ring = (size_t)tu.warps * tu.stages * (size_t)d.stage_elems * es;
    size_t merge = (size_t)tu.warps * H * (size_t)(a->dv + 2) * sizeof(float);
    d.ring_bytes = ring > merge ? ring : merge;
    return d;
}

/* CTAs of the decode kernel an SM holds (an H100's limits: 2048 threads,
 * 64 K registers allocated 256 to a warp, 228 KB of shared memory with 1 KB
 * reserved per CTA); computed rather than asked of the runtime, which a
 * recording stream may not allow. */
static int decode_occupancy(const cudaFuncAttributes &fa, int threads, size_t smem)
{
    int by_threads = 2048 / threads;
    int warp_regs = (fa.numRegs * 32 + 255) / 256 * 256;
    int by_regs = warp_regs > 0 ? 65536 / warp_regs / (threads / 32) : by_threads;
    int by_smem = (int)((size_t)(228 << 10) / (smem + fa.sharedSizeBytes + 1024));
    int n = by_threads < by_regs ? by_threads : by_regs;
    return n < by_smem ? n : by_smem;
}

/* The most keys a decode row of the step sees: its keys bound, capped at
 * the layer's window (what the splits are planned for). */
static int64_t dec_keys(const cuda_backend *c, const attn_args *a)
{
    const int64_t keys = c->step.dec_keys_bound;
    return a->window > 0 && a->window < keys ? a->window : keys;
}

/* Under batch invariance a row's splits depend on nothing but its own
 * keys: one length for every step, long enough that the most keys the
 * cache can hold take at most DEC_MAX_SPLITS splits, at least min_split,
 * a multiple of unit; the step's number of splits follows (plan_splits,
 * lean_splits). Sets the args' split fields and returns the number. */
static int32_t invariant_splits(const cuda_backend *c, attn_args *a, const dec_tuning &tu, int64_t unit)
{
    int64_t cap = 0;
    for (int p = 0; p < c->kvl.n_pools; p++) {
        int64_t t = (int64_t)c->kvl.n_blocks[p] * c->kvl.block_tokens;
        if (t > cap) cap = t;
    }
    int64_t len = (cap + DEC_MAX_SPLITS - 1) / DEC_MAX_SPLITS;
    if (len < tu.min_split) len = tu.min_split;
    len = (len + unit - 1) / unit * unit;
    const int64_t n = (dec_keys(c, a) + len - 1) / len;
    a->split_len = (int32_t)len;
    a->split_unit = 0;
    a->n_splits = (int32_t)(n < 1 ? 1 : n);
    return a->n_splits;
}

/* Splits of each decode row's keys: about `waves` rounds of the CTAs that
 * stay resident, none shorter than min_split keys, lengths a multiple of
 * the keys the warps take in one round. Their number is planned for
 * dec_keys_bound keys (the step's shape), not its longest context, so that
 * a decode step recorded as a CUDA graph replays unchanged for every step
 * of its bucket; each row's length follows its own keys on the device
 * (row_split_len), and splits past a row's keys return at once. */
static void plan_splits(const cuda_backend *c, attn_args *a, const dec_tuning &tu, int32_t tk, int occ)
{
    const int64_t keys = dec_keys(c, a);
    if (a->dv % 4 != 0) {
        /* both merges of splits read a split's sums 4 columns at once:
         * such heads take a row's keys in one split */
        a->n_splits = 1;
        a->split_unit = 1;
        a->split_len = 1;
        return;
    }
    if (c->invariant) {
        invariant_splits(c, a, tu, (int64_t)tk * tu.warps);
        return;
    }
    int64_t ctas = (int64_t)c->step.n_dec * a->n_kv_head * a->n_hchunks;
    /* as many as fit the waves whole: one CTA past them would take a
     * round of its own (4 rows of the 7B at 3,000 keys: 5 splits, 160 CTAs
     * where 132 fit, 6% slower than 4) */
    int64_t want = (int64_t)c->n_sm * occ * tu.waves / ctas;
    /* short contexts (a decode step of at most one_split keys) in one
     * split where dec_defaults says so: merging splits (their partials
     * written, an arrival counter, the last split reading them back) costs
     * more there than the parallelism gains */
    if (keys <= tu.one_split) want = 1;
    int64_t most = (keys + tu.min_split - 1) / tu.min_split;
    if (most > DEC_MAX_SPLITS) most = DEC_MAX_SPLITS;
    int64_t n = want < most ? want : most, unit = (int64_t)tk * tu.warps;
    if (n < 1) n = 1;
    int64_t len = (keys + n - 1) / n;
    len = (len + unit - 1) / unit * unit;
    a->n_splits = (int32_t)((keys + len - 1) / len);
    /* each row then shares its own keys among the n_splits
     * (row_split_len), in splits of at least min_split keys */
    a->split_unit = (int32_t)unit;
    a->split_len = (int32_t)((tu.min_split + unit - 1) / unit * unit);
}

/* Plans and launches decode_kernel<T, H, MMA> over the step's decode rows. */
template <typename T, int H, int MMA>
static void decode_launch(cuda_backend *c, attn_args *a, const dec_tuning &tuning)
{
    /* Stages by default: 2 for heads of up to 128 on the tensor cores, so
     * that three CTAs of 4 warps fit an SM (registers capped at 128 by the
     * kernel's bounds, 75 KB of shared memory each): the kernel waits on
     * latency, and more resident warps is what speeds it (cuda/NOTES.md);
     * 3 otherwise (one or two CTAs an SM whatever the stages). */
    dec_tuning tu = tuning;
    if (tu.stages == 0) tu.stages = MMA == 128 ? 2 : 3;
    static cudaFuncAttributes fa;
    static const cudaError_t setup = cudaFuncGetAttributes(&fa, (const void *)decode_kernel<T, H, MMA>);
    if (luma_cuda_fail(c, setup, "attention (decode kernel)")) return;
    const cuda_step *st = &c->step;
    dec_shape d = decode_shape(a, sizeof(T), tu, H, MMA > 0);
    int threads = tu.warps * 32, occ = decode_occupancy(fa, threads, d.fixed_bytes + d.ring_bytes);
    if (occ < 1 || d.fixed_bytes + d.ring_bytes > dec_smem_max) {
        luma_cuda_failf(c, "attention: the decode kernel does not fit an SM (%zu bytes of shared memory)",
                        d.fixed_bytes + d.ring_bytes);
        return;
    }
    plan_splits(c, a, tu, d.tk, occ);
    size_t merge = (size_t)a->n_splits * (size_t)a->heads_per_cta * (size_t)a->dv * sizeof(float);
    /* with batch invariance always combine_kernel, whose order of the
     * splits is not the merge_here path's */
    a->merge_here = a->n_splits > 1 && merge <= (size_t)tu.merge_kb << 10 && !c->invariant;
    size_t smem = d.fixed_bytes + d.ring_bytes;
    a->dec_tk = d.tk;
    a->dec_warps = tu.warps;
    a->dec_stages = tu.stages;
    a->ldk = d.ldk;
    a->ldv = d.ldv;
    a->stage_elems = d.stage_elems;
    a->part = a->part_ml = NULL;
    a->counters = NULL;
    unsigned z = (unsigned)(a->n_kv_head * a->n_hchunks);
    if (a->n_splits > 1) {
        size_t n = (size_t)st->n_dec * (size_t)a->n_head * (size_t)a->n_splits;
        if (!decode_scratch(c, a->merge_here ? (size_t)st->n_dec * z : 0, n * (size_t)(a->dv + 2) * sizeof(float), a))
            return;
        a->part_ml = a->part + n * (size_t)a->dv;
    }
    luma_launch(c, c->stream, dim3((unsigned)st->n_dec, (unsigned)a->n_splits, z), threads, smem,
                decode_kernel<T, H, MMA>, *a);
    if (a->n_splits > 1 && !a->merge_here)
        luma_launch(c, c->stream, dim3((unsigned)st->n_dec, (unsigned)a->n_head, (unsigned)(a->dv + 127) / 128), 256,
                    (size_t)a->n_splits * sizeof(float), combine_kernel, *a);
}

/* Units of the step's decode rows for decode_lean_kernel: rows x kv heads x
 * head chunks. */
static int64_t lean_units(const cuda_backend *c, const attn_args *a)
{
    return (int64_t)c->step.n_dec * a->n_kv_head * a->n_hchunks;
}

/* Warps a unit of decode_lean_kernel: the tuning's, else 8 while the
 * step's units times 8 stay within LEAN_WARPS_SM warps an SM, then 4, 2,
 * 1 (the 7B on 132 SMs: 8 up to 12 rows, 4 up to 24, 2 up to 48, then 1,
 * without a merge). Six: on the H200 the 7B's aggregate decode at 16 / 24
 * / 32 / 64 / 128 sequences measured best with splits 4 / 4 / 2 / 1 or 2 /
 * 1, where a bound of two warps an SM gave 2 / 1 / 1 / 1 / 1; 8 beat 4 at
 * 1, 4 and 8 sequences, not at 16 (cuda/NOTES.md). */
#define LEAN_WARPS_SM 6

/* One decode row of heads of 128 within LEAN_PAIRS_KEYS keys: 4 parts of
 * two warps a unit (decode_lean_kernel<128, 4, 2>) instead of 8 parts of
 * one. Measured on the H200, the 7B synth at batch 1: up to 144 keys
 * 549.7-549.9 against 539.0-539.4 tokens/s (4 parts of one warp: 528.7);
 * after 300 / 600 / 1,000 tokens 525.7-526.3 / 520.6-522.6 / 494.7-508.3
 * against 511.9-512.8 / 514.7-515.1 / 468.5-484.5 (past 256 keys both
 * split over CTAs, lean_splits); at 2 and 4 rows level, at 8 rows 1.5%
 * slower, so one row only (cuda/NOTES.md, "A decode step's chain,
 * traced"). Longer rows were not measured. */
#define LEAN_PAIRS_KEYS 1024
static bool lean_row_pairs(const cuda_backend *c, const attn_args *a, const dec_tuning &tu)
{
    return a->dk == 128 && !c->invariant && tu.lean_split == 0 && tu.lean_ds == 0 && c->step.n_dec == 1 &&
           dec_keys(c, a) <= LEAN_PAIRS_KEYS;
}

static int lean_split_for(const cuda_backend *c, const attn_args *a, const dec_tuning &tu)
{
    /* heads of 256: 4 at most (8 warps' rings of 2 stages of 16 keys are
     * 270 KB; 8 warps of one stage each measured no faster, cuda/NOTES.md) */
    const int most = a->dk > 128 ? 4 : DEC_LEAN_WARPS;
    if (tu.lean_split > 0) {
        const int sp = tu.lean_split >= 8 ? 8 : tu.lean_split >= 4 ? 4 : tu.lean_split >= 2 ? 2 : 1;
        return sp < most ? sp : most;
    }
    /* under batch invariance the parts (whose sums a unit merges in their
     * order) may not follow the step's units: 4 for heads of up to 128, 2
     * (of two warps) for heads of 256. Measured with --batch-invariant on
     * the H200 (prefill of 512 tokens, ms a token at batch 1, after 1,024
     * tokens): the 7B 1,016 / 1.94 / 2.09 at 4 against 1,029 / 1.93 / 2.25
     * at 2; Gemma 3 270M 6,544 / 0.54 at 4 against 7,260 / 0.54 at 2
     * (decode_kernel before: 999 / 2.08 / 2.31 and 7,751 / 0.62) */
    if (c->invariant) return a->dk > 128 ? 2 : 4;
    if (lean_row_pairs(c, a, tu)) return 4;
    const int64_t units = lean_units(c, a);
    int sp = most;
    while (sp > 1 && units * sp > LEAN_WARPS_SM * (int64_t)c->n_sm) sp /= 2;
    return sp;
}

/* The warps of a part: 2 (each taking half of the values, both the
 * scores; the part's ring shared, a named barrier of the two a tile) for
 * heads of 256 at up to 4 parts a unit, or for heads of 128 when the
 * tuning's lean_ds asks or at one short row (lean_row_pairs); else 1
 * (lean_ds 1: always). Measured for heads of
 * 256 (Gemma 3 270M: batch 1 0.61 to 0.55 ms, 4 to 128 sequences 16 to
 * 23% more tokens/s); for heads of 128 (the 7B) level or slower at 8 to
 * 128 rows, so not taken there by default (cuda/NOTES.md, "Two warps a
 * part"). */
static int lean_ds_for(const cuda_backend *c, const attn_args *a, const dec_tuning &tu, int sp)
{
    const int ds = tu.lean_ds > 0 ? tu.lean_ds : a->dk >= 256 || lean_row_pairs(c, a, tu) ? 2 : 1;
    return ds >= 2 && a->dk >= 128 && sp <= 4 ? 2 : 1;
}

/* The tiles each part of a unit takes in one split of decode_lean_kernel:
 * the tuning's, else 1 (2 measured slower on a gemma3-1b synth past 256
 * keys, level on the 7B). */
static int lean_tiles_for(const dec_tuning &tu)
{
    return tu.lean_tiles >= 0 ? tu.lean_tiles : 1;
}

/* How far decode_lean_kernel reaches with a CTA a unit (no splits),
 * measured against decode_kernel on the H200 with whole models
 * (cuda/NOTES.md, "Decode attention past 256 keys"). Heads of up to 128
 * (the 7B, 8 units a row): level or
 * faster at 1 to 4 rows up to 1,024 keys, 2 to 25% faster from 4 rows,
 * and from 16 rows up to 2,048 keys (20%); decode_kernel's splits keep
 * longer rows. Fewer than the 7B's one row of units (Qwen2 0.5B's 2 kv
 * heads at 1 to 3 rows: not measured) keep a quarter of lean_keys (256,
 * as before). Heads of 256 (Gemma 3; 4 parts a unit at most, their
 * tiles twice as long, against decode_kernel on the CUDA cores): with
 * one warp a part, at 1 and 2 units faster up to about 150 keys and
 * slower from 128 to 256, so up to an eighth of lean_keys (128: a step
 * bound of 128, the first bucket); from lean_wide units faster up to
 * 256 keys (2 to 20%); from lean_long units faster at 385 to 960 keys
 * too (8 to 21%), where at 8 rows it lost and at 32 was level. With two
 * warps a part (their default, lean_ds_for): a quarter of lean_keys at
 * any units (1 and 2 rows of 160 to 256 keys 8 to 23% faster), and
 * lean_keys from half of lean_long units (32 rows of 400 to 928 keys 5
 * to 11% faster; 8 and 16 rows lost 3 to 13% at 800 to 928). */
static int64_t lean_reach(const cuda_backend *c, const attn_args *a, const dec_tuning &tu)
{
    const int64_t units = lean_units(c, a);
    if (a->dk <= 128)
        return units >= tu.lean_long ? 2 * (int64_t)tu.lean_keys
               : units >= 2 * tu.lean_wide ? tu.lean_keys
                                           : tu.lean_keys / 4;
    if (lean_ds_for(c, a, tu, 1) == 2)   /* heads of 256 split at most 4 ways: the split does not decide */
        return units >= tu.lean_long / 2 ? tu.lean_keys : tu.lean_keys / 4;
    return units >= tu.lean_long ? tu.lean_keys : units >= tu.lean_wide ? tu.lean_keys / 4 : tu.lean_keys / 8;
}

/* Whether decode_lean_kernel takes the step's rows at any length, split
 * over CTAs past lean_reach (lean_splits): at any number of units by
 * default (lean_many -1; else below lean_many units for heads of up to
 * 128, half of it for heads of 256), for heads of 256 on two warps a
 * part. Against decode_kernel (and its combine_kernel and, at one row,
 * the quantizer after it): the 7B at batch 1 past 1,024 keys 6 to 13%
 * faster, 2 / 4 / 8 / 16 rows of 3,000 keys 13 / 9 / 15 / 7%, 32 / 64 /
 * 128 rows of 3,000 keys 8 / 16 / 8%, 256 rows of 2,200 keys 7%; Gemma 3
 * 270M at batch 1 past 256 keys 16 to 19%, 4 rows of 1,000 keys 10 to
 * 14%; a gemma3-1b synth at 32 and 64 rows of 3,000 keys 10 and 7%, 128
 * and 256 rows 5 and 18%, 512 rows of 1,500 keys 9 to 15% (cuda/NOTES.md,
 * "Decode attention split over CTAs" and "The lean kernel at every row
 * count"). */
static bool lean_long_rows(const cuda_backend *c, const attn_args *a, const dec_tuning &tu)
{
    const int64_t units = lean_units(c, a);
    if (lean_tiles_for(tu) <= 0) return false;
    if (a->dk <= 128) return tu.lean_many < 0 || units < tu.lean_many;
    return lean_ds_for(c, a, tu, 1) == 2 && (tu.lean_many < 0 || units < tu.lean_many / 2);
}

/* The tiles each part of a unit takes in one CTA before a row splits over
 * CTAs (lean_splits), by default: 512 / the head's dimensions, where a
 * split's merge stopped paying; heads of 64 at one decode row 2, measured
 * on the H200 at batch 1 (Qwen2 0.5B and llama-1b synths, 8 parts a unit):
 * after 300 / 600 / 1,000 tokens 1,717 / 1,695-1,698 / 1,657-1,660 tokens/s
 * against 1,679-1,682 / 1,538-1,542 / 1,601-1,606 (Qwen2 0.5B), 1,860 /
 * 1,856-1,858 / 1,798-1,800 against 1,820 / 1,678-1,680 / 1,743-1,748
 * (llama-1b), level within 144 keys; the 7B's heads of 128 gained under
 * 0.5% at 2, so keep 4 (cuda/NOTES.md, "A decode step's chain, traced"). */
static int lean_solo_for(const cuda_backend *c, int d)
{
    return d <= 64 && c->step.n_dec == 1 ? 2 : 512 / d;
}

/* Splits of a decode_lean_kernel row over CTAs (grid z), planned as
 * plan_splits plans decode_kernel's: for the step's dec_keys_bound (capped
 * at the window) so that a recorded graph replays for its bucket, each
 * row sharing its own keys among them (row_split_len) in rounds of the
 * unit's sp parts (16 keys a part), about `tiles` such rounds a split; no
 * more than `fit` a row (the resident CTAs' one wave over the step's
 * rows). No splits while each part would take at most `solo` tiles in
 * one CTA (lean_solo_for: 512 / d by default, where the split's merge, a
 * partial result written, a counter, one CTA reading them all back: about
 * 2 us, stopped paying; heads of 128 split from a bound of 1,024 keys at
 * batch 1, of 256 from 256: measured on the H200, cuda/NOTES.md; heads of
 * 64 at one row sooner). Sets the args' split fields; 1: no splits (the
 * kernel without SPLIT, which reads none of them). */
static int32_t lean_splits(const cuda_backend *c, attn_args *a, const dec_tuning &tu, int d, int sp, int64_t fit)
{
    /* under invariance a split length for every step (decode_lean_go then
     * takes the SPLIT kernel at any number of splits, so that a row of one
     * split runs the same code in every step) */
    if (c->invariant) return invariant_splits(c, a, tu, (int64_t)16 * sp);
    const int64_t keys = dec_keys(c, a);
    int64_t ns = 1;
    const int tiles = lean_tiles_for(tu), solo = tu.lean_solo >= 0 ? tu.lean_solo : lean_solo_for(c, d);
    /* past the reach of a CTA a unit, and within it at one or two rows
     * (more, the splits' merges cost more than they save: Gemma 3 270M at 8
     * rows of up to 256 keys 4% slower, the 7B at 32 rows 10%) */
    const bool want = keys > lean_reach(c, a, tu) || c->step.n_dec <= 2;
    if (sp > 1 && tiles > 0 && want && keys > (int64_t)16 * sp * solo) {
        const int64_t per = (int64_t)16 * sp * tiles;
        ns = (keys + per - 1) / per;
        if (ns > fit) ns = fit;
        if (ns > DEC_MAX_SPLITS) ns = DEC_MAX_SPLITS;
        if (ns < 1) ns = 1;
    }
    a->n_splits = (int32_t)ns;
    if (ns > 1) a->split_unit = a->split_len = 16 * sp;   /* row_split_len's: rounds of the parts */
    return (int32_t)ns;
}

/* Launches decode_lean_kernel<D, SP, DS> over the step's decode rows: SP
 * parts of DS warps a unit (a ring a part), units sharing a CTA of up to
 * DEC_LEAN_CTA_WARPS warps. */
template <int D, int SP, int DS>
static void decode_lean_go(cuda_backend *c, attn_args *a, const dec_tuning &tu)
{
    static cudaFuncAttributes fa;
    static const cudaError_t setup = cudaFuncGetAttributes(&fa, (const void *)decode_lean_kernel<D, SP, DS, false>);
    if (luma_cuda_fail(c, setup, "attention (decode kernel)")) return;
    const cuda_step *st = &c->step;
    const int32_t z = a->n_kv_head * a->n_hchunks;
    const int uw = SP * DS, most = uw < DEC_LEAN_CTA_WARPS ? DEC_LEAN_CTA_WARPS / uw : 1;
    const int upc = z < most ? z : most, warps = upc * uw;
    /* 2 stages at a split of 8 (a few rows: measured level with the 7B's
     * one row of up to 1,024 keys, 8 tiles a warp) */
    const int stages = tu.stages ? tu.stages : SP == 8 ? 2 : 3;
    const size_t ring = (size_t)stages * 2 * 16 * (D + 8) * sizeof(__half), smem = (size_t)(warps / DS) * ring;
    const int occ = decode_occupancy(fa, warps * 32, smem);
    if (occ < 1 || smem > dec_smem_max) {
        luma_cuda_failf(c, "attention: the decode kernel does not fit an SM (%zu bytes of shared memory)", smem);
        return;
    }
    a->dec_stages = stages;
    /* the quantized output: parts that merge, and room in the first part's
     * ring for the unit's values past the merge's rings (decode_lean_kernel) */
    if (SP == 1 || ((size_t)lean_merge_floats(D, DS) + (size_t)a->heads_per_cta * D) * sizeof(float) > ring)
        a->qo = NULL;
    const unsigned ctas = (unsigned)((z + upc - 1) / upc);
    const int32_t ns = lean_splits(c, a, tu, D, SP, (int64_t)c->n_sm * occ / ((int64_t)st->n_dec * ctas));
    if constexpr (SP > 1) {
        if (ns > 1 || c->invariant) {
            const size_t n = (size_t)st->n_dec * (size_t)a->n_head * (size_t)ns;
            if (!decode_scratch(c, (size_t)st->n_dec * (size_t)z, n * (size_t)(D + 2) * sizeof(float), a)) return;
            a->part_ml = a->part + n * (size_t)D;
            luma_launch(c, c->stream, dim3((unsigned)st->n_dec, ctas, (unsigned)ns), warps * 32, smem,
                        decode_lean_kernel<D, SP, DS, true>, *a);
            return;
        }
    }
    luma_launch(c, c->stream, dim3((unsigned)st->n_dec, ctas), warps * 32, smem, decode_lean_kernel<D, SP, DS, false>,
                *a);
}

template <int D, int DS>
static void decode_lean_parts(cuda_backend *c, attn_args *a, const dec_tuning &tu, int sp)
{
    switch (sp) {
    case 8:
        /* not for heads of 256, which lean_split_for caps at 4, nor with 2 warps a part */
        if constexpr (D <= 128 && DS == 1) {
            decode_lean_go<D, 8, DS>(c, a, tu);
            break;
        }
        [[fallthrough]];
    case 4: decode_lean_go<D, 4, DS>(c, a, tu); break;
    case 2: decode_lean_go<D, 2, DS>(c, a, tu); break;
    default: decode_lean_go<D, 1, DS>(c, a, tu);
    }
}

template <int D>
static void decode_lean_launch(cuda_backend *c, attn_args *a, const dec_tuning &tu)
{
    const int sp = lean_split_for(c, a, tu);
    if constexpr (D >= 128) {
        if (lean_ds_for(c, a, tu, sp) == 2) {
            decode_lean_parts<D, 2>(c, a, tu, sp);
            return;
        }
    }
    decode_lean_parts<D, 1>(c, a, tu, sp);
}

/* Whether decode_lean_kernel takes the step's decode rows: F16 caches with
 * dk = dv of 64, 128 or 256 on the tensor cores, at least lean_min units
 * (rows x kv heads x head chunks; 1 by default: with its warps a unit it
 * beats decode_kernel from batch 1 on, cuda/NOTES.md), keys a row (the
 * step's bound) within lean_reach or split over CTAs past it
 * (lean_long_rows). Under batch invariance every such row, whatever the
 * step (the kernel taken may not follow the step's rows), with a fixed
 * split of a unit and split length (lean_split_for, lean_splits). */
static bool lean_covers(const cuda_backend *c, const attn_args *a, const dec_tuning &tu)
{
    const int64_t units = lean_units(c, a), keys = dec_keys(c, a);
    const bool aligned = (((uintptr_t)a->q | (uintptr_t)a->k | (uintptr_t)a->v) & 15) == 0 &&
                         ((a->q_cols | a->k_cols | a->v_cols) & 3) == 0;   /* its q, k and v loads */
    return a->dk == a->dv && (a->dk == 64 || a->dk == 128 || a->dk == 256) && a->heads_per_cta <= 8 && aligned &&
           (c->invariant || (units >= tu.lean_min && (keys <= lean_reach(c, a, tu) || lean_long_rows(c, a, tu))));
}

template <typename T, int MMA>
static void decode_heads(cuda_backend *c, attn_args *a, const dec_tuning &tu)
{
    if (a->heads_per_cta <= 1) decode_launch<T, 1, MMA>(c, a, tu);
    else if (a->heads_per_cta <= 2) decode_launch<T, 2, MMA>(c, a, tu);
    else if (a->heads_per_cta <= 4) decode_launch<T, 4, MMA>(c, a, tu);
    else decode_launch<T, 8, MMA>(c, a, tu);
}

template <typename T>
static void launch(cuda_backend *c, attn_args *a, bool tc)
{
    const cuda_step *st = &c->step;
    cudaStream_t s = c->stream;
    if (st->n_tiles > 0) luma_launch(c, s, dim3((unsigned)st->n_rows, (unsigned)a->n_kv_head), 128, 0, store_kernel<T>,
                                     *a);
    if (st->n_dec > 0) {
        /* with batch invariance the warps (whose partial results a CTA
         * merges in their order) may not follow the step's rows */
        int64_t ctas = c->invariant ? INT64_MAX : (int64_t)st->n_dec * a->n_kv_head * a->n_hchunks;
        const dec_tuning raw = dec_tuning_get();
        dec_tuning tu = dec_defaults(raw, a->dv, ctas, c->n_sm);
        bool mma = false, lean = false;
        if constexpr (sizeof(T) == 2) {
            mma = tu.mma && a->dk % 16 == 0 && a->dv % 16 == 0;
            /* the lean kernel is on the tensor cores for heads of 256 too
             * (where decode_kernel takes the CUDA cores by default), unless
             * the tuning turns them off */
            lean = raw.mma != 0 && lean_covers(c, a, tu);
            if (lean) {
                if (a->dk == 64) decode_lean_launch<64>(c, a, tu);
                else if (a->dk == 128) decode_lean_launch<128>(c, a, tu);
                else decode_lean_launch<256>(c, a, tu);
            } else if (mma && a->dv <= 128) decode_heads<T, 128>(c, a, tu);
            else if (mma) decode_heads<T, 256>(c, a, tu);
        }
        if (!lean) a->qo = NULL;   /* only decode_lean_kernel quantizes its output */
        if (!mma && !lean) decode_heads<T, 0>(c, a, tu);
        if (!LUMA_CUDA_OK(c)) return;
    }
    if (st->n_tiles > 0 && tc) {
        unsigned tiles = (unsigned)st->n_tiles * (unsigned)a->n_head;
        if (a->dk == 64) launch_tc<64>(c, a, tiles, s);
        else if (a->dk == 128) launch_tc<128>(c, a, tiles, s);
        else launch_tc<256>(c, a, tiles, s);
    } else if (st->n_tiles > 0) {
        dim3 grid((unsigned)st->n_tiles, (unsigned)a->n_head, PF_SUB);
        if (a->dk <= 128 && a->dv <= 128)
            luma_launch(c, s, grid, PF_THREADS, prefill_layout<T, 128>::bytes(), prefill_kernel<T, 128>, *a);
        else
            luma_launch(c, s, grid, PF_THREADS, prefill_layout<T, HEAD_MAX>::bytes(), prefill_kernel<T, HEAD_MAX>, *a);
    }
}

/* The attention's output: a row of every head's values for each row of q. */
static void attn_out_shape(const luma_buf *q, const luma_attn *at, luma_buf *out)
{
    out->rows = q->rows;
    out->cols = (int64_t)at->n_head * at->head_dim_v;
}

bool luma_cuda_attention_quant(cuda_backend *c, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                               const luma_step *step, const luma_attn *at, luma_buf *out, const cuda_attn_quant *aq)
{
    attn_out_shape(q, at, out);
    if (!LUMA_CUDA_OK(c) || step->n_rows == 0) return false;
    const luma_kv_layout *l = &c->kvl;
    if (c->step.host != step) {
        luma_cuda_failf(c, "attention: step_begin was not called for this step");
        return false;
    }
    if (at->pool < 0 || at->pool >= l->n_pools || at->layer < 0 || at->layer >= l->n_layers[at->pool] ||
        at->n_kv_head != l->n_kv_head || at->head_dim_k != l->head_dim_k || at->head_dim_v != l->head_dim_v ||
        at->n_head < 1 || at->n_head % at->n_kv_head != 0) {
        luma_cuda_failf(c, "attention: layer %d of pool %d with %d heads over %d kv heads does not fit the KV cache",
                        at->layer, at->pool, at->n_head, at->n_kv_head);
        return false;
    }
    const cuda_step *st = &c->step;
    size_t es = luma_kv_elem_size(l);
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
    int32_t most_heads = a.dv > 128 ? DEC_HEADS / 2 : DEC_HEADS;   /* the kernel's registers */
    a.heads_per_cta = a.group < most_heads ? a.group : most_heads;
    a.n_hchunks = (a.group + a.heads_per_cta - 1) / a.heads_per_cta;
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
    a.seq_pos0 = st->seq_pos0;
    a.dec_rows = st->dec_rows;
    a.tiles = st->tiles;
    a.n_tiles = st->n_tiles;
    a.prefill_min = c->prefill_min_rows;
    a.split_len = 0;
    a.split_unit = 0;
    a.n_splits = 1;
    a.dec_tk = a.dec_warps = a.dec_stages = a.ldk = a.ldv = a.stage_elems = 0;
    a.part = a.part_ml = NULL;
    a.counters = NULL;
    a.merge_here = 0;
    a.early = c->attn_early;
    bool tc = tc_covers(l, &a);
    if (tc && (int64_t)st->n_tiles * a.n_head * (LUMA_CUDA_ATTN_TILE / (TC_WARPS * 16)) > INT32_MAX) {
        luma_cuda_failf(c, "attention: %d tiles of %d heads are too many CTAs", st->n_tiles, a.n_head);
        return false;
    }
    /* o's input quantized here: every row a decode row, every unit of a
     * CTA's heads whole (nh = heads_per_cta), and for ACT_Q8_K each unit's
     * and row's columns whole super-blocks of 256 (the rest decode_lean_go
     * and launch decide) */
    a.qo = NULL;
    a.qds = NULL;
    a.q_scheme = ACT_Q8_0;
    if (aq && st->n_tiles == 0 && (int64_t)st->n_dec == q->rows && a.group % a.heads_per_cta == 0 &&
        (aq->scheme == ACT_Q8_0 || ((int64_t)a.heads_per_cta * a.dv % 256 == 0 && (int64_t)a.group * a.dv % 256 == 0))) {
        a.qo = aq->q;
        a.qds = aq->ds;
        a.q_scheme = aq->scheme;
    }
    if (l->type == LUMA_F16) launch<__half>(c, &a, tc);
    else launch<float>(c, &a, tc);
    luma_cuda_fail(c, cudaGetLastError(), "attention");
    return a.qo != NULL && LUMA_CUDA_OK(c);
}

void luma_cuda_attention(cuda_backend *c, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                         const luma_step *step, const luma_attn *at, luma_buf *out)
{
    luma_cuda_attention_quant(c, q, k, v, step, at, out, NULL);
}

bool luma_cuda_attn_pend(cuda_backend *c, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                         const luma_step *step, const luma_attn *at, luma_buf *out)
{
    /* a step of one row (the o product's matrix-vector path), not while
     * programs capture products (one would read out before its attention
     * ran), nor under batch invariance or float activations (where the
     * lean kernel or the quantizer is not taken) */
    if (!c->attnq_on || !c->in_step || c->prog_on || c->float_act || c->invariant || !LUMA_CUDA_OK(c) ||
        c->pend_attn.on || c->pend_norm.on || q->rows != 1 || step != c->step.host || step->n_rows != 1)
        return false;
    attn_out_shape(q, at, out);
    c->pend_attn.on = true;
    c->pend_attn.q = *q;
    c->pend_attn.k = *k;
    c->pend_attn.v = *v;
    c->pend_attn.step = step;
    c->pend_attn.at = *at;
    c->pend_attn.out = *out;
    return true;
}
