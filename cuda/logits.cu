/* Logits that stay on the device: the backend's logits operations
 * (backend.h) over rows of a logits set, each a kernel whose small result is
 * copied back, checked against the host functions of src/sample.c by
 * spec/native/test_cuda_logits.c.
 *
 * Ranking: an entry's key is the 64-bit (order(value) << 32) | (0xffffffff -
 * id), order() a monotone map of the finite floats onto unsigned integers
 * that takes -0 as +0. A larger key ranks first (larger value, or equal value
 * and lower id, as src/sample.c ranks) and keys are distinct, so the k best
 * entries are exactly the keys >= the k-th key. Masked entries (-inf, and
 * NaN or +inf, which count as masked) have no key; 0 means none.
 *
 * Rooflines (H100, ~3.3 TB/s of HBM): argmax over 128 rows of 262144 reads
 * 128 MiB, ~40 us. A single row is 1 MiB (~0.3 us of bandwidth), so the
 * one-row operations are bound by latency (launches, a small copy back, the
 * wait): they spread their reading over many blocks where they can (top-k
 * of small k, sampling); top-k of large k reads the row a few times with
 * one block (from L2 after the first time).
 *
 * Each set's allocation carries a work area after its b->cap floats (the
 * argmax keys, the top-k results), so the operations need no other device
 * memory and never move a buffer a recorded step uses. Results come back
 * through a small pinned buffer of the backend. The edits (stored entries
 * among them), min_p and temperature return nothing and are only queued:
 * the next operation that returns a result waits for them. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "launch.cuh"

LUMA_TRACE_TU(logits)

#define WORK_ALIGN 256
#define WORK_MIN ((size_t)64 << 10)

static cuda_backend *cu(luma_backend *be) { return (cuda_backend *)be; }

/* The work area: after the floats, room for 8 bytes a row (argmax's keys)
 * and at least WORK_MIN (sample's sums). */
static size_t work_align(size_t bytes)
{
    return (bytes + WORK_ALIGN - 1) / WORK_ALIGN * WORK_ALIGN;
}

static size_t work_offset(const luma_buf *b)
{
    return work_align((size_t)b->cap * sizeof(float));
}

static size_t work_size(const luma_buf *b)
{
    size_t rows = b->cols > 0 ? (size_t)(b->cap / b->cols) : 0;
    return rows * 8 > WORK_MIN ? rows * 8 : WORK_MIN;
}

static void *work(const luma_buf *b)
{
    return (char *)b->data + work_offset(b);
}

/* Pinned host memory for a small result of bytes, the backend's (made at
 * its first use), so that the copy back needs no staging; NULL where bytes
 * is more or none could be had. */
#define HOST_RESULTS_BYTES ((size_t)256 << 10)

static void *host_results(cuda_backend *c, size_t bytes)
{
    if (bytes > HOST_RESULTS_BYTES) return NULL;
    if (!c->host_results && cudaMallocHost(&c->host_results, HOST_RESULTS_BYTES) != cudaSuccess) {
        cudaGetLastError();
        c->host_results = NULL;
    }
    return c->host_results;
}

/* Host memory for a result of bytes: host_results, else malloc'd (NULL
 * when out of memory); results_free gives it back. */
static void *results_get(cuda_backend *c, size_t bytes)
{
    void *p = host_results(c, bytes);
    return p ? p : malloc(bytes);
}

static void results_free(const cuda_backend *c, void *p)
{
    if (p != c->host_results) free(p);
}

/* ---- keys and block reductions ------------------------------------------ */

__device__ __forceinline__ bool is_live(float v)
{
    return fabsf(v) <= FLT_MAX;
}

__device__ __forceinline__ unsigned long long rank_key(float v, int64_t id)
{
    unsigned int b = __float_as_uint(v == 0.0f ? 0.0f : v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)b << 32) | (0xffffffffu - (unsigned int)id);
}

/* The value a key ranks (rank_key's inverse; -0 comes back as +0, equal
 * in every use). Kernels that rewrite a row in place take the row's largest
 * entry from its argmax key, not from the row: another block may already
 * have rewritten that entry. (dist_apply_kernel once read it from the row;
 * a block placed after the one holding that entry had rewritten it took
 * 1 / z or -log z for the largest. Plain runs never showed it, the
 * blocks being placed at once; under compute-sanitizer test_cuda_logits
 * found 32 to 384 of a 262,144-entry row's entries wrong in most runs.) */
__device__ __forceinline__ float key_value(unsigned long long k)
{
    unsigned int b = (unsigned int)(k >> 32);
    return __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}

/* Clamps into the finite floats, as src/sample.c's finite(). */
__device__ __forceinline__ float finite_f(float v)
{
    return v > FLT_MAX ? FLT_MAX : v < -FLT_MAX ? -FLT_MAX : v;
}

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v)
{
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

/* The largest v of the block (blockDim.x a multiple of 32), for every thread. */
__device__ unsigned long long block_max_u64(unsigned long long v, unsigned long long *sh)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max_u64(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : 0;
    if (warp == 0) v = warp_max_u64(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

/* The least power of two at or above n (1 for n <= 1). */
__device__ __forceinline__ int pow2_at_least(int n)
{
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}

/* Sorts a[0..n) (n a power of two) largest first: a bitonic network. */
__device__ void block_sort_desc(unsigned long long *a, int n)
{
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
                int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
                bool desc = (lo & size) == 0;
                unsigned long long x = a[lo], y = a[hi];
                if ((x < y) == desc) {
                    a[lo] = y;
                    a[hi] = x;
                }
            }
            __syncthreads();
        }
    }
}

/* The same for n <= blockDim.x, in registers: thread t holds a[t]; a
 * stage's strides below 32 are shuffles, the others go through a (two
 * barriers), so a sort of 256 keys has 6 barrier stages instead of 36.
 * Every thread of the block calls it; it starts and ends with the block
 * synchronized, a written back. */
__device__ void block_sort_small_desc(unsigned long long *a, int n)
{
    const int t = threadIdx.x;
    __syncthreads();
    unsigned long long v = t < n ? a[t] : 0;
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            unsigned long long o;
            if (stride >= 32) {
                __syncthreads();
                if (t < n) a[t] = v;
                __syncthreads();
                o = t < n ? a[t ^ stride] : 0;
            } else {
                o = __shfl_xor_sync(0xffffffffu, v, stride);
            }
            /* of the pair, the lower index keeps the larger where the
             * run of size sorts down */
            const bool keep_max = ((t & size) == 0) == ((t & stride) == 0);
            v = keep_max == (v > o) ? v : o;
        }
    }
    __syncthreads();
    if (t < n) a[t] = v;
    __syncthreads();
}

/* Sorts keys[0, p) best first, p a power of two, after setting keys[count,
 * p) to 0: by the small sort where the block's nt threads (blockDim.x,
 * passed as a constant where the kernel has one) cover p, else by the
 * whole block's. */
__device__ __forceinline__ void block_sort_padded_desc(unsigned long long *keys, int count, int p, int nt)
{
    const int tid = threadIdx.x;
    for (int j = count + tid; j < p; j += nt) keys[j] = 0;
    if (p <= nt) {
        block_sort_small_desc(keys, p);
    } else {
        __syncthreads();
        block_sort_desc(keys, p);
    }
}

/* ---- argmax of many rows ------------------------------------------------- */

#define ARGMAX_THREADS 256
#define ARGMAX_MIN_CHUNK 4096   /* entries a block reads at least */
/* the same for the argmax of chained decoding's one row, whose blocks'
 * keys need no atomics: one round of loads a thread, 4 times the blocks
 * (seq:greedy on the gemma3-270m synth 2,702-2,703 tokens/s against
 * 2,695 at 4096; level on the 7B, whose time is elsewhere) */
#define CHAIN_MIN_CHUNK 1024

/* The block's best key of row[lo, hi) (0 where nothing is live). */
__device__ __forceinline__ unsigned long long block_best_key(const float *__restrict__ row, int64_t lo, int64_t hi,
                                                             unsigned long long *sh)
{
    unsigned long long m = 0;
    for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += 4 * ARGMAX_THREADS) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int64_t i = i0 + j * ARGMAX_THREADS;
            v[j] = i < hi ? row[i] : -INFINITY;
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (is_live(v[j])) {
                unsigned long long k = rank_key(v[j], i0 + j * ARGMAX_THREADS);
                m = k > m ? k : m;
            }
    }
    return block_max_u64(m, sh);
}

/* Row blockIdx.y, entries [blockIdx.x * chunk, +chunk): the block's best key
 * joins best[row] (zeroed before); with PARTS it goes to best[blockIdx.y *
 * gridDim.x + blockIdx.x] instead (nothing to zero first), and
 * chain_publish_kernel takes the largest. */
template <bool PARTS>
__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_kernel(const float *__restrict__ x, int64_t cols, int64_t chunk, unsigned long long *best)
{
    follow_previous_kernel();
    __shared__ unsigned long long sh[32];
    const int64_t lo = (int64_t)blockIdx.x * chunk, hi = lo + chunk < cols ? lo + chunk : cols;
    const unsigned long long m = block_best_key(x + (int64_t)blockIdx.y * cols, lo, hi, sh);
    if (PARTS && threadIdx.x == 0) best[(int64_t)blockIdx.y * gridDim.x + blockIdx.x] = m;
    else if (threadIdx.x == 0 && m) atomicMax(&best[blockIdx.y], m);
}

/* Chained decoding's key published (one warp): the largest of parts[0, n)
 * (n = 1: the key as it is) to *host, pinned host memory the device
 * addresses, read by the host once an event after this kernel has passed;
 * and where key is not NULL also to *key on the device, where the next
 * step's embed reads it. No system fence after the host copy: the host
 * reads it only after that event, when the kernel's writes are visible to
 * it (a fence matters to a host that polls while the kernel runs), and the
 * fence kept the kernel from completing until the write had crossed the
 * bus: without it the real Gemma 3 270M's seq:greedy ran +0.2-0.4%
 * (cuda/NOTES.md, "Tried and not kept: the output projection's argmax
 * keys"). */
__global__ void chain_publish_kernel(const unsigned long long *parts, int n, unsigned long long *key,
                                     volatile unsigned long long *host)
{
    follow_previous_kernel();
    unsigned long long m = 0;
    for (int i = threadIdx.x; i < n; i += 32) m = parts[i] > m ? parts[i] : m;
    m = warp_max_u64(m);
    if (threadIdx.x == 0) {
        if (key) *key = m;
        *host = m;
    }
}

/* ---- top-k of one row ---------------------------------------------------- */

#define TOPK_THREADS 1024
#define TOPK_CAP 4096          /* candidates sorted in shared memory */
#define TOPK_BITS 12           /* radix digit */
#define TOPK_BINS (1 << TOPK_BITS)

/* Calls f(key) for every live entry of x[0..n), four loads in flight a thread. */
template <typename F> __device__ __forceinline__ void for_each_key(const float *__restrict__ x, int64_t n, F f)
{
    for (int64_t i0 = threadIdx.x; i0 < n; i0 += 4 * TOPK_THREADS) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int64_t i = i0 + j * TOPK_THREADS;
            v[j] = i < n ? x[i] : -INFINITY;
        }
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (is_live(v[j])) f(rank_key(v[j], i0 + j * TOPK_THREADS));
    }
}

/* Sum of v over the threads after this one (by index), for every thread. */
__device__ unsigned int block_suffix_excl(unsigned int v, unsigned int *sh)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x / 32;
    unsigned int s = v;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned int t = __shfl_down_sync(0xffffffffu, s, o);
        if (lane + o < 32) s += t;
    }
    if (lane == 0) sh[warp] = s;
    __syncthreads();
    unsigned int after = 0;
    for (int w = warp + 1; w < nw; w++) after += sh[w];
    __syncthreads();
    return after + s - v;
}

/* The k best live entries of x[0..n), best first, into ids/vals; their
 * number into *count (k, or fewer when fewer are live).
 *   1. A floor: with k <= TOPK_THREADS, the k-th best of the threads' own
 *      best keys; at least k entries reach it, so none below can be in.
 *   2. The keys at or above the floor are gathered; usually they fit.
 *   3. Otherwise radix passes over 12-bit digits, from the top, narrow a
 *      prefix that the k-th key has until the keys at or above it fit.
 *   4. The candidates are sorted and the first k written. */
__global__ void __launch_bounds__(TOPK_THREADS)
topk_kernel(const float *__restrict__ x, int64_t n, int32_t k, int32_t *out_ids, float *out_vals,
            int32_t *out_count)
{
    follow_previous_kernel();
    __shared__ union {
        unsigned int hist[TOPK_BINS];
        unsigned long long cand[TOPK_CAP];
    } sm;
    __shared__ unsigned int scan[32];
    __shared__ unsigned int s_count, s_bin, s_cum, s_above;
    const int tid = threadIdx.x;

    unsigned long long floor_key = 1;
    if (k <= TOPK_THREADS) {
        unsigned long long best = 0;
        for_each_key(x, n, [&](unsigned long long key) { best = key > best ? key : best; });
        sm.cand[tid] = best;
        __syncthreads();
        block_sort_desc(sm.cand, TOPK_THREADS);
        if (sm.cand[k - 1] > floor_key) floor_key = sm.cand[k - 1];
        __syncthreads();
    }

    if (tid == 0) s_count = 0;
    __syncthreads();
    for_each_key(x, n, [&](unsigned long long key) {
        if (key < floor_key) return;
        unsigned int at = atomicAdd(&s_count, 1u);
        if (at < TOPK_CAP) sm.cand[at] = key;
    });
    __syncthreads();
    unsigned int count = s_count;

    if (count > TOPK_CAP) {
        unsigned long long prefix = 0;
        int bits = 0;
        unsigned int above = 0;
        for (;;) {
            int dbits = 64 - bits < TOPK_BITS ? 64 - bits : TOPK_BITS, shift = 64 - bits - dbits;
            unsigned long long digit_mask = (1ull << dbits) - 1;
            for (int b = tid; b < TOPK_BINS; b += TOPK_THREADS) sm.hist[b] = 0;
            __syncthreads();
            for_each_key(x, n, [&](unsigned long long key) {
                if (key < floor_key || (bits > 0 && (key >> (64 - bits)) != prefix)) return;
                atomicAdd(&sm.hist[(key >> shift) & digit_mask], 1u);
            });
            __syncthreads();
            /* Each thread owns 4 bins; walking down from the top bin, the
             * boundary is where the count of keys above reaches k. */
            const int per = TOPK_BINS / TOPK_THREADS;
            unsigned int own = 0;
            for (int j = 0; j < per; j++) own += sm.hist[tid * per + j];
            unsigned int cum = above + block_suffix_excl(own, scan);
            for (int j = per - 1; j >= 0; j--) {
                unsigned int h = sm.hist[tid * per + j];
                if (cum < (unsigned int)k && cum + h >= (unsigned int)k) {
                    s_bin = tid * per + j;
                    s_cum = cum + h;
                    s_above = cum;
                }
                cum += h;
            }
            __syncthreads();
            prefix = (prefix << dbits) | s_bin;
            bits += dbits;
            above = s_above;
            if (s_cum <= TOPK_CAP || bits == 64) break;
            __syncthreads();
        }
        unsigned long long thresh = bits == 64 ? prefix : prefix << (64 - bits);
        if (thresh < floor_key) thresh = floor_key;
        __syncthreads();
        if (tid == 0) s_count = 0;
        __syncthreads();
        for_each_key(x, n, [&](unsigned long long key) {
            if (key < thresh) return;
            unsigned int at = atomicAdd(&s_count, 1u);
            if (at < TOPK_CAP) sm.cand[at] = key;
        });
        __syncthreads();
        count = s_count < TOPK_CAP ? s_count : TOPK_CAP;
    }

    const int p = pow2_at_least((int)count);
    for (int j = (int)count + tid; j < p; j += TOPK_THREADS) sm.cand[j] = 0;
    __syncthreads();
    block_sort_desc(sm.cand, p);
    int32_t got = (int32_t)count < k ? (int32_t)count : k;
    for (int j = tid; j < k; j += TOPK_THREADS) {
        /* the places past the live entries written too (id -1, -inf): every word the host copies back is set */
        int32_t id = j < got ? luma_cuda_key_id(sm.cand[j]) : -1;
        out_ids[j] = id;
        out_vals[j] = j < got ? x[id] : -INFINITY;
    }
    if (tid == 0) *out_count = got;
}

/* Small k, one launch: each block of TOPK_PART_THREADS finds the k best of
 * its TOPK_PART_CHUNK entries (all of them held as keys in shared memory)
 * and writes them to the work area; the last block to finish takes the
 * blocks' k best together and selects the k best of those. The best k
 * overall are among the blocks' best k, so the result is exact; many SMs
 * share the reading, and neither stage sorts more than the few keys that
 * can be in. */
#define TOPK_PART_THREADS 256
#define TOPK_PART_CHUNK 4096
#define TOPK_FEW 512           /* keys at or above the floor sorted alone */

/* The k best of the n keys a[0..n) in shared memory (0 for none; n <=
 * TOPK_PART_CHUNK, k <= blockDim.x, a power of two), best first: the
 * returned array's first k (0 past the live ones), in few or in a. Thread
 * t's keys are a[t], a[t + blockDim.x], ...; the k-th best of the
 * threads' maxima is a floor (k keys at least reach it, so none below it
 * can be in), and the keys at or above it, usually a little more than k,
 * are gathered into few and sorted alone. Where more than TOPK_FEW reach
 * it (the best keys crowded into a few threads) a is sorted whole. Ends
 * with the block synchronized. */
__device__ const unsigned long long *block_select(unsigned long long *a, int n, int k, unsigned long long *few,
                                                  unsigned long long *maxima, unsigned int *s_count)
{
    const int tid = threadIdx.x, nt = blockDim.x;
    unsigned long long best = 0;
    for (int j = tid; j < n; j += nt) best = a[j] > best ? a[j] : best;
    maxima[tid] = best;
    if (tid == 0) *s_count = 0;
    block_sort_small_desc(maxima, nt);
    const unsigned long long floor_key = maxima[k - 1] > 1 ? maxima[k - 1] : 1;
    for (int j = tid; j < n; j += nt) {
        unsigned long long key = a[j];
        if (key < floor_key) continue;
        unsigned int at = atomicAdd(s_count, 1u);
        if (at < TOPK_FEW) few[at] = key;
    }
    __syncthreads();
    int count = (int)*s_count;
    unsigned long long *sorted = few;
    int p = pow2_at_least(count > k ? count : k);
    if (count > TOPK_FEW) {
        sorted = a;
        p = pow2_at_least(n);
        count = n;
    }
    block_sort_padded_desc(sorted, count, p, nt);
    return sorted;
}

/* few[0, count) sorted best first over at least k places (zeros past
 * count), by nt threads (blockDim.x, a constant where the kernel has one). */
__device__ __forceinline__ void few_sort_desc(unsigned long long *few, int count, int k, int nt)
{
    block_sort_padded_desc(few, count, pow2_at_least(count > k ? count : k), nt);
}

/* The row of a launch over rows (blockIdx.y) that this block works on: x,
 * cand, arrived and out moved to it. */
__device__ __forceinline__ void topk_row_at(const float *__restrict__ &x, int64_t n, int32_t k, unsigned long long *&cand,
                                            unsigned int *&arrived, int32_t *&out)
{
    x += (int64_t)blockIdx.y * n;
    cand += (int64_t)blockIdx.y * gridDim.x * k;
    arrived += blockIdx.y;
    out += (int64_t)blockIdx.y * (2 * k + 1);
}

/* A block's k best (best) to the row's candidates; whether this block is the
 * row's last to arrive, which then sees every block's candidates. */
__device__ bool topk_block_arrive(const unsigned long long *best, int32_t k, unsigned long long *cand,
                                  unsigned int *arrived, bool *s_last)
{
    for (int j = threadIdx.x; j < k; j += TOPK_PART_THREADS) cand[(int64_t)blockIdx.x * k + j] = best[j];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *s_last = atomicAdd(arrived, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!*s_last) return false;
    __threadfence();
    return true;
}

/* The row's k best (best, selected from every block's) to out: ids [k],
 * values [k] and the count, the places past the count -1 and -inf (every
 * word the host copies back is set); the row's arrival count back to 0. */
__device__ void topk_row_write(const unsigned long long *best, int32_t k, const float *x, int32_t *out,
                               unsigned int *arrived)
{
    const int tid = threadIdx.x;
    const int got = __syncthreads_count(tid < k && best[tid] != 0);
    if (tid < got) {
        int32_t id = luma_cuda_key_id(best[tid]);
        out[tid] = id;
        out[k + tid] = __float_as_int(x[id]);
    } else if (tid < k) {
        out[tid] = -1;
        out[k + tid] = __float_as_int(-INFINITY);
    }
    if (tid == 0) {
        out[2 * k] = got;
        *arrived = 0;
    }
}

/* The k best live entries of each row of n, x[r n .. r n + n) for r =
 * blockIdx.y (k <= TOPK_PART_THREADS, gridDim.x x k <= TOPK_PART_CHUNK),
 * into out[r (2 k + 1) ...]: ids [k], values [k] and the count, as
 * topk_kernel writes them. Block b of row r's k best go to cand[(r
 * gridDim.x + b) k ...]; arrived[r] counts the row's blocks done (0 before
 * the launch, and the row's last block sets it back to 0). */
__global__ void __launch_bounds__(TOPK_PART_THREADS)
topk_small_kernel(const float *__restrict__ x, int64_t n, int32_t k, unsigned long long *cand,
                  unsigned int *arrived, int32_t *out)
{
    follow_previous_kernel();
    topk_row_at(x, n, k, cand, arrived, out);
    __shared__ unsigned long long keys[TOPK_PART_CHUNK];
    __shared__ unsigned long long few[TOPK_FEW];
    __shared__ unsigned long long maxima[TOPK_PART_THREADS];
    __shared__ unsigned int s_count;
    __shared__ bool s_last;
    const int tid = threadIdx.x;
    const int64_t lo = (int64_t)blockIdx.x * TOPK_PART_CHUNK;
    /* each thread first reads back only the keys it wrote (block_select) */
    for (int j = tid; j < TOPK_PART_CHUNK; j += TOPK_PART_THREADS) {
        int64_t i = lo + j;
        float v = i < n ? x[i] : -INFINITY;
        keys[j] = is_live(v) ? rank_key(v, i) : 0;
    }
    const unsigned long long *best = block_select(keys, TOPK_PART_CHUNK, k, few, maxima, &s_count);
    if (!topk_block_arrive(best, k, cand, arrived, &s_last)) return;
    const int m = (int)gridDim.x * k;
    for (int j = tid; j < m; j += TOPK_PART_THREADS) keys[j] = __ldcg(cand + j);
    best = block_select(keys, m, k, few, maxima, &s_count);
    topk_row_write(best, k, x, out, arrived);
}

/* The same for a batch's many rows (topk_stream_kernel below, k <=
 * TOPK_REGS_K): a thread's keys of a chunk in its registers, none written
 * to shared memory (6 KB a block instead of 37). */
#define TOPK_PER (TOPK_PART_CHUNK / TOPK_PART_THREADS)
#define TOPK_REGS_K 64

/* How many of the block's keys reach t: key(i), i < N, of every thread. */
template <int N, typename Key>
__device__ int block_count_at_least(Key key, unsigned long long t, int *s_sum)
{
    int c = 0;
#pragma unroll
    for (int i = 0; i < N; i++) c += key(i) >= t;
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    __syncthreads();
    if (threadIdx.x == 0) *s_sum = 0;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicAdd(s_sum, c);
    __syncthreads();
    return *s_sum;
}

/* The keys key(i) >= floor of every thread into few (s_count zeroed and the
 * block synchronized before; the block synchronized after). */
template <int N, typename Key>
__device__ unsigned int gather_at_least(Key key, unsigned long long floor_key, unsigned long long *few,
                                        unsigned int *s_count)
{
#pragma unroll
    for (int i = 0; i < N; i++) {
        unsigned long long q = key(i);
        if (q < floor_key) continue;
        unsigned int at = atomicAdd(s_count, 1u);
        if (at < TOPK_FEW) few[at] = q;
    }
    __syncthreads();
    return *s_count;
}

/* block_select for keys in registers: thread t's are key(0) .. key(N - 1)
 * (0 for none; live keys distinct), k <= TOPK_REGS_K. The floor is the
 * k-th best of the threads' maxima as there; where more than TOPK_FEW keys
 * reach it, it is raised by bisection to a key that at least k and at most
 * TOPK_FEW reach (one exists: the k-th best key). Returns few, sorted best
 * first; ends with the block synchronized. */
template <int N, typename Key>
__device__ const unsigned long long *regs_select(Key key, int k, unsigned long long *few,
                                                 unsigned long long *maxima, unsigned int *s_count, int *s_sum)
{
    const int tid = threadIdx.x, nt = blockDim.x;
    unsigned long long best = 0;
#pragma unroll
    for (int i = 0; i < N; i++) {
        unsigned long long q = key(i);
        best = q > best ? q : best;
    }
    maxima[tid] = best;
    if (tid == 0) *s_count = 0;
    block_sort_small_desc(maxima, nt);
    unsigned long long floor_key = maxima[k - 1] > 1 ? maxima[k - 1] : 1;
    unsigned int count = gather_at_least<N>(key, floor_key, few, s_count);
    if (count > TOPK_FEW) {
        /* at least k keys reach lo, fewer than k reach hi */
        unsigned long long lo = floor_key, hi = maxima[0] + 1;
        while (count > TOPK_FEW) {
            unsigned long long mid = lo + (hi - lo) / 2;
            int c = block_count_at_least<N>(key, mid, s_sum);
            if (c >= k) {
                lo = mid;
                count = (unsigned int)c;
            } else {
                hi = mid;
            }
        }
        if (tid == 0) *s_count = 0;
        __syncthreads();
        count = gather_at_least<N>(key, lo, few, s_count);
    }
    few_sort_desc(few, (int)count, k, nt);
    return few;
}

/* A block's k best (best, from few) to the row's candidates; the row's last
 * block to arrive takes every block's candidates and writes the row's k
 * best to out, as topk_small_kernel does. */
__device__ void topk_row_finish(const unsigned long long *best, int32_t k, unsigned long long *cand,
                                unsigned int *arrived, int32_t *out, const float *x, unsigned long long *few,
                                unsigned long long *maxima, unsigned int *s_count, int *s_sum, bool *s_last)
{
    if (!topk_block_arrive(best, k, cand, arrived, s_last)) return;
    /* the blocks' keys, read from L2 at each pass (one block a row does
     * this: no registers held for it) */
    const int tid = threadIdx.x, m = (int)gridDim.x * k;
    auto cand_key = [&](int i) -> unsigned long long {
        int j = tid + i * TOPK_PART_THREADS;
        return j < m ? __ldcg(cand + j) : 0ull;
    };
    topk_row_write(regs_select<TOPK_PER>(cand_key, k, few, maxima, s_count, s_sum), k, x, out, arrived);
}

/* Thread t's keys of chunk `part` of the row: entries part TOPK_PART_CHUNK +
 * t + i TOPK_PART_THREADS. */
__device__ __forceinline__ void chunk_keys(const float *__restrict__ x, int64_t n, int64_t part,
                                           unsigned long long (&keys)[TOPK_PER])
{
    const int64_t lo = part * TOPK_PART_CHUNK + threadIdx.x;
#pragma unroll
    for (int i = 0; i < TOPK_PER; i++) {
        const int64_t j = lo + (int64_t)i * TOPK_PART_THREADS;
        const float v = j < n ? x[j] : -INFINITY;
        keys[i] = is_live(v) ? rank_key(v, j) : 0ull;
    }
}

/* topk_small_kernel's results with a block for several chunks (blockIdx.x,
 * + gridDim.x, ...; k <= TOPK_REGS_K), for many rows: a block keeps its
 * best so far at the front of few, and of a later chunk only the keys
 * above the k-th of them are gathered and sorted in (usually none or a few
 * once a chunk or two went by), so that after its first chunk a block
 * mostly streams its entries past one compare. A chunk whose keys above it
 * are too many to gather is selected afresh with the best so far
 * (regs_select). */
__global__ void __launch_bounds__(TOPK_PART_THREADS, 4)
topk_stream_kernel(const float *__restrict__ x, int64_t n, int32_t k, unsigned long long *cand,
                   unsigned int *arrived, int32_t *out)
{
    follow_previous_kernel();
    topk_row_at(x, n, k, cand, arrived, out);
    __shared__ unsigned long long few[TOPK_FEW];
    __shared__ unsigned long long maxima[TOPK_PART_THREADS];
    /* a chunk's count, one of two by turns: a chunk that adds nothing
     * reads its count with no barrier before the next chunk sets the other */
    __shared__ unsigned int s_counts[2];
    __shared__ int s_sum;
    __shared__ bool s_last;
    const int tid = threadIdx.x;
    const int64_t parts = (n + TOPK_PART_CHUNK - 1) / TOPK_PART_CHUNK;
    for (int j = tid; j < k; j += TOPK_PART_THREADS) few[j] = 0;
    int kept = 0;   /* few[0 .. kept): the block's best so far, best first (the same in every thread) */
    int turn = 0;
    for (int64_t part = blockIdx.x; part < parts; part += gridDim.x, turn ^= 1) {
        unsigned int *const s_count = &s_counts[turn];
        unsigned long long keys[TOPK_PER];
        chunk_keys(x, n, part, keys);
        auto entry_key = [&](int i) -> unsigned long long { return keys[i]; };
        if (kept == 0) {
            regs_select<TOPK_PER>(entry_key, k, few, maxima, s_count, &s_sum);
        } else {
            const unsigned long long floor_key = kept == k ? few[k - 1] + 1 : 1;
            if (tid == 0) *s_count = (unsigned int)kept;
            __syncthreads();
            const unsigned int count = gather_at_least<TOPK_PER>(entry_key, floor_key, few, s_count);
            if (count == (unsigned int)kept) continue;
            if (count <= TOPK_FEW) {
                few_sort_desc(few, (int)count, k, TOPK_PART_THREADS);
            } else {
                const unsigned long long prev = tid < kept ? few[tid] : 0ull;
                __syncthreads();
                auto with_prev = [&](int i) -> unsigned long long { return i < TOPK_PER ? keys[i] : prev; };
                regs_select<TOPK_PER + 1>(with_prev, k, few, maxima, s_count, &s_sum);
            }
        }
        kept = __syncthreads_count(tid < k && few[tid] != 0);
    }
    topk_row_finish(few, k, cand, arrived, out, x, few, maxima, &s_counts[0], &s_sum, &s_last);
}

/* ---- edits, temperature -------------------------------------------------- */

#define EDIT_CHUNK 256         /* listed entries a launch takes as its argument */

typedef struct edit_chunk {
    int32_t n;
    int32_t ids[EDIT_CHUNK];
    float values[EDIT_CHUNK];
} edit_chunk;

/* The per-entry arithmetic of luma_logits_penalize_counted, luma_logits_bias
 * and luma_logits_mask, each operation rounded alone (no fused multiply-add)
 * as the host rounds it. */
__global__ void edit_kernel(float *x, int kind, edit_chunk e, float repeat, float frequency, float presence)
{
    follow_previous_kernel();
    int j = threadIdx.x;
    if (j >= e.n) return;
    int32_t id = e.ids[j];
    float v = x[id];
    if (kind == LUMA_EDIT_MASK || kind == LUMA_EDIT_SET) {
        x[id] = kind == LUMA_EDIT_SET ? e.values[j] : -INFINITY;
        return;
    }
    if (!is_live(v)) return;
    if (kind == LUMA_EDIT_BIAS) {
        x[id] = e.values[j] == -INFINITY ? -INFINITY : finite_f(__fadd_rn(v, e.values[j]));
        return;
    }
    v = v <= 0.0f ? __fmul_rn(v, repeat) : __fdiv_rn(v, repeat);
    x[id] = finite_f(__fsub_rn(v, __fadd_rn(__fmul_rn(e.values[j], frequency), presence)));
}

__global__ void temperature_kernel(float *x, int64_t n, float t)
{
    follow_previous_kernel();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = x[i];
        if (is_live(v)) x[i] = finite_f(__fdiv_rn(v, t));
    }
}

/* ---- sampling from the softmax ------------------------------------------- */

/* The draw of luma_logits_sample for uniform u: with m the largest live
 * entry and mass_i = exp(x_i - m) in double, the first id (in id order)
 * where the running mass passes u * (total mass). Three launches: the
 * largest key (argmax_kernel), the mass of every chunk of `ch` entries
 * (dist_sums_kernel, below: a warp each, over many SMs), then one block
 * finds the chunk where the
 * target falls and a warp walks it in order. The sums are added in another
 * order than the host's, so the id differs only where the target sits on a
 * boundary within rounding. */
#define SAMPLE_CHUNKS_MAX 2048
#define SAMPLE_THREADS 1024

/* After argmax_kernel's key for the row (*best, 0 when nothing is live):
 * each chunk's z = sum exp(x_i - m) and s = sum exp(x_i - m)(x_i - m) over
 * its live entries, a warp a chunk. */
__global__ void dist_sums_kernel(const float *__restrict__ x, int64_t n, int64_t ch, int32_t nch,
                                 const unsigned long long *best, double2 *sums)
{
    follow_previous_kernel();
    int32_t c = (int32_t)(((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32);
    int lane = threadIdx.x & 31;
    if (c >= nch) return;
    double z = 0.0, s = 0.0;
    if (*best) {
        double m = (double)key_value(*best);
        int64_t lo = (int64_t)c * ch, hi = lo + ch < n ? lo + ch : n;
        for (int64_t i = lo + lane; i < hi; i += 32) {
            float v = x[i];
            if (!is_live(v)) continue;
            double d = (double)v - m, e = exp(d);
            z += e;
            s += e * d;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        z += __shfl_xor_sync(0xffffffffu, z, o);
        s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    if (lane == 0) sums[c] = make_double2(z, s);
}

__global__ void __launch_bounds__(SAMPLE_THREADS)
sample_walk_kernel(const float *__restrict__ x, int64_t n, int64_t ch, int32_t nch,
                   const unsigned long long *best, const double2 *sums, double u, int32_t *out)
{
    follow_previous_kernel();
    __shared__ double incl[SAMPLE_CHUNKS_MAX];
    __shared__ double wsum[32];
    __shared__ int s_first, s_last;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (*best == 0) {
        if (tid == 0) *out = -1;
        return;
    }
    const double m = (double)key_value(*best);
    /* inclusive prefix sums of the chunks' masses: each thread two chunks */
    int c0 = 2 * tid;
    double a = c0 < nch ? sums[c0].x : 0.0, b = c0 + 1 < nch ? sums[c0 + 1].x : 0.0;
    double t = a + b, scan = t;
    for (int o = 1; o < 32; o <<= 1) {
        double v = __shfl_up_sync(0xffffffffu, scan, o);
        if (lane >= o) scan += v;
    }
    if (lane == 31) wsum[warp] = scan;
    if (tid == 0) {
        s_first = nch;
        s_last = -1;
    }
    __syncthreads();
    double before = 0.0;
    for (int w = 0; w < warp; w++) before += wsum[w];
    double z = 0.0;
    for (int w = 0; w < SAMPLE_THREADS / 32; w++) z += wsum[w];
    double excl = before + scan - t;
    if (c0 < nch) incl[c0] = excl + a;
    if (c0 + 1 < nch) incl[c0 + 1] = excl + a + b;
    const double target = u * z;
    if (c0 < nch && target < excl + a && a > 0.0) atomicMin(&s_first, c0);
    else if (c0 + 1 < nch && target < excl + a + b && b > 0.0) atomicMin(&s_first, c0 + 1);
    if (c0 < nch && a > 0.0) atomicMax(&s_last, c0);
    if (c0 + 1 < nch && b > 0.0) atomicMax(&s_last, c0 + 1);
    __syncthreads();
    /* Rounding left the target past the total: the last chunk with mass. */
    int c = s_first < nch ? s_first : s_last;
    if (warp != 0) return;
    double base = c > 0 ? incl[c - 1] : 0.0;
    /* The walk: lanes take consecutive pieces of the chunk; the lane where
     * the running mass passes the target walks its piece; failing that
     * (rounding), the chunk's last live entry. */
    int64_t lo = (int64_t)c * ch, hi = lo + ch < n ? lo + ch : n, per = ch / 32;
    int64_t first = lo + lane * per;
    double own = 0.0;
    int64_t last_live = -1;
    for (int64_t i = first; i < first + per && i < hi; i++)
        if (is_live(x[i])) {
            own += exp((double)x[i] - m);
            last_live = i;
        }
    double lincl = own;
    for (int o = 1; o < 32; o <<= 1) {
        double v = __shfl_up_sync(0xffffffffu, lincl, o);
        if (lane >= o) lincl += v;
    }
    unsigned int hit = __ballot_sync(0xffffffffu, target < base + lincl && own > 0.0);
    int64_t found = -1;
    if (hit && lane == __ffs(hit) - 1) {
        double mass = base + lincl - own;
        for (int64_t i = first; i < first + per && i < hi && found < 0; i++)
            if (is_live(x[i])) {
                mass += exp((double)x[i] - m);
                if (target < mass) found = i;
            }
        if (found < 0) found = last_live;
    }
    for (int o = 16; o > 0; o >>= 1) {
        int64_t f = __shfl_xor_sync(0xffffffffu, found, o);
        found = f > found ? f : found;
        int64_t l = __shfl_xor_sync(0xffffffffu, last_live, o);
        last_live = l > last_live ? l : last_live;
    }
    if (lane == 0) *out = (int32_t)(found >= 0 ? found : last_live);
}

/* ---- distributions: min_p, softmax, log_softmax, the entropy's sums ----- */

/* The chunks' sums added up, one warp, in a fixed order: out = (z, s). */
__global__ void __launch_bounds__(32) dist_total_kernel(const double2 *__restrict__ sums, int32_t nch, double2 *out)
{
    follow_previous_kernel();
    double z = 0.0, s = 0.0;
    for (int32_t c = threadIdx.x; c < nch; c += 32) {
        z += sums[c].x;
        s += sums[c].y;
    }
    for (int o = 16; o > 0; o >>= 1) {
        z += __shfl_xor_sync(0xffffffffu, z, o);
        s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    if (threadIdx.x == 0) *out = make_double2(z, s);
}

/* softmax (log 0: exp(x_i - m) rounded to float, times the float 1 / z) or
 * log_softmax (log 1: x_i - (m + log z) rounded to float; masked entries
 * -inf), as the host's functions round them; nothing when none is live. */
__global__ void dist_apply_kernel(float *x, int64_t n, const unsigned long long *best, const double2 *total, int log1)
{
    follow_previous_kernel();
    if (*best == 0) return;
    const double m = (double)key_value(*best), z = total->x;
    const float inv = (float)(1.0 / z);
    const double lse = m + log(z);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = x[i];
        if (log1) x[i] = is_live(v) ? (float)((double)v - lse) : -INFINITY;
        else x[i] = is_live(v) ? __fmul_rn((float)exp((double)v - m), inv) : 0.0f;
    }
}

/* min_p with min_keep 1: the live entries with x_i - m < lp masked (the
 * largest always stays: its difference is 0 >= log p). */
__global__ void min_p_kernel(float *x, int64_t n, const unsigned long long *best, double lp)
{
    follow_previous_kernel();
    if (*best == 0) return;
    const double m = (double)key_value(*best);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = x[i];
        if (is_live(v) && (double)v - m < lp) x[i] = -INFINITY;
    }
}

/* ---- the sampling chain on a top-k's entries ------------------------------ */

/* luma_sampler_draw (src/sample.c) past its top-k, on the device, by one
 * warp, for the k best entries of a row as queue_topk leaves them (ids
 * [k], values [k], count; k <= LUMA_SAMPLER_K_MAX = 2 x 32): the same
 * steps on the same compact form (the entries in id order), every sum
 * added in the host's order by one lane, so the id is the host's but where
 * exp or log, a last bit off the host's, moves a sum across a boundary.
 * The draw's key goes to *key (0: every entry masked), where
 * chain_argmax's would. */
#define SAMPLER_K 64
static_assert(SAMPLER_K == LUMA_SAMPLER_K_MAX, "one warp, two entries a lane");

/* The draw of n entries (n in [1, SAMPLER_K]: ids, and values as float
 * bits, best first) by one warp; its key at lane 0 (the others' is 0). */
__device__ unsigned long long draw_entries(const int32_t *__restrict__ ids, const int32_t *__restrict__ vbits, int n,
                                           float top_p, float min_p, float temp, double u)
{
    __shared__ int32_t s_id[SAMPLER_K];     /* in id order */
    __shared__ float s_x[SAMPLER_K];
    __shared__ int32_t s_at[SAMPLER_K];     /* rank r's place in id order */
    __shared__ double s_e[SAMPLER_K];
    __shared__ bool s_live[SAMPLER_K];
    const int lane = threadIdx.x;
    /* into id order: rank r (lane r and lane r - 32 hold ranks r and r + 32)
     * goes after the entries of lower id, counted from registers */
    const int32_t id0 = lane < n ? ids[lane] : INT32_MAX, id1 = lane + 32 < n ? ids[lane + 32] : INT32_MAX;
    int at0 = 0, at1 = 0;
    for (int j = 0; j < n; j++) {
        const int32_t a = __shfl_sync(0xffffffffu, id0, j & 31), b = __shfl_sync(0xffffffffu, id1, j & 31);
        const int32_t idj = j < 32 ? a : b;
        at0 += idj < id0;
        at1 += idj < id1;
    }
    if (lane < n) {
        s_at[lane] = at0;
        s_id[at0] = id0;
        s_x[at0] = __int_as_float(vbits[lane]);
        s_live[at0] = true;
    }
    if (lane + 32 < n) {
        s_at[lane + 32] = at1;
        s_id[at1] = id1;
        s_x[at1] = __int_as_float(vbits[lane + 32]);
        s_live[at1] = true;
    }
    __syncwarp();
    /* top_p (luma_logits_top_p_ordered): the entries are ranked already;
     * z sums their weights in id order, the mass in rank order */
    float m = s_x[s_at[0]];
    if (top_p < 1.0f) {
        for (int i = lane; i < n; i += 32) s_e[i] = exp((double)s_x[i] - (double)m);
        __syncwarp();
        if (lane == 0) {
            double z = 0.0, mass = 0.0;
            for (int i = 0; i < n; i++) z += s_e[i];
            int r = 0;
            for (; r < n; r++) {
                mass += s_e[s_at[r]];
                if (mass / z >= (double)top_p) break;
            }
            for (r++; r < n; r++) s_live[s_at[r]] = false;
        }
        __syncwarp();
    }
    /* min_p (luma_logits_min_p): the largest entry always stays */
    if (min_p > 0.0f) {
        const double lp = log((double)min_p);
        for (int i = lane; i < n; i += 32)
            if (s_live[i] && (double)s_x[i] - (double)m < lp) s_live[i] = false;
        __syncwarp();
    }
    /* temperature, then the draw (sample_at): weights and sums in id order */
    m = finite_f(__fdiv_rn(m, temp));
    for (int i = lane; i < n; i += 32) {
        const float v = finite_f(__fdiv_rn(s_x[i], temp));
        s_e[i] = s_live[i] ? exp((double)v - (double)m) : 0.0;
    }
    __syncwarp();
    unsigned long long key = 0;
    if (lane == 0) {
        double z = 0.0, mass = 0.0;
        for (int i = 0; i < n; i++)
            if (s_live[i]) z += s_e[i];
        const double target = u * z;
        int pick = -1;
        for (int i = 0; i < n; i++) {
            if (!s_live[i]) continue;
            mass += s_e[i];
            pick = i;
            if (target < mass) break;
        }
        key = (1ull << 32) | (0xffffffffu - (unsigned int)s_id[pick]);
    }
    return key;
}

/* The device's history of chained draws (chain_history): the last
 * LUMA_SAMPLER_WINDOW_MAX ids, id i of all at ring[i % WINDOW], and the
 * count of all. */
#define WINDOW LUMA_SAMPLER_WINDOW_MAX

struct chain_hist {
    int32_t ring[WINDOW];
    long long total;
};

/* One row, as queue_topk leaves it (ids [k], values [k], count), its key to
 * *key, where chain_argmax's goes; the id joins h (where not NULL). */
__global__ void __launch_bounds__(32)
chain_sample_kernel(const int32_t *__restrict__ res, int32_t k, float top_p, float min_p, float temp, double u,
                    unsigned long long *key, chain_hist *h)
{
    follow_previous_kernel();
    const int n = res[2 * k];
    const unsigned long long got = n < 1 ? 0 : draw_entries(res, res + k, n, top_p, min_p, temp, u);
    if (threadIdx.x == 0) {
        *key = got;
        if (h && got) {
            h->ring[h->total % WINDOW] = luma_cuda_key_id(got);
            h->total++;
        }
    }
}

/* luma_logits_penalize of x over the last last_n ids of h: a thread an
 * entry of the window; the first of each distinct id counts the window's
 * and edits x[id] as luma_logits_penalize_counted does (each operation
 * rounded alone). */
__global__ void __launch_bounds__(WINDOW)
chain_penalty_kernel(float *x, const chain_hist *__restrict__ h, int32_t last_n, float repeat, float frequency,
                     float presence)
{
    follow_previous_kernel();
    __shared__ int32_t win[WINDOW];
    const long long total = h->total;
    const int w = (int)(total < last_n ? total : last_n), t = threadIdx.x;
    if (t < w) win[t] = h->ring[(total - w + t) % WINDOW];
    __syncthreads();
    if (t >= w) return;
    const int32_t id = win[t];
    int count = 0;
    bool first = true;
    for (int j = 0; j < w; j++) {
        count += win[j] == id;
        first &= !(j < t && win[j] == id);
    }
    if (!first) return;
    float v = x[id];
    if (!is_live(v)) return;
    v = v <= 0.0f ? __fmul_rn(v, repeat) : __fdiv_rn(v, repeat);
    x[id] = finite_f(__fsub_rn(v, __fadd_rn(__fmul_rn((float)count, frequency), presence)));
}

/* Many rows' draws (sampler_draw_rows), a warp a row: row i's sampler and
 * uniform at p[i], its entries as logits_topk_rows leaves them (ids at
 * ids + i k, values at vals + i k, count at counts[i]); its id to out[i]. */
struct draw_param {
    double u;
    float top_p, min_p, temp;
    int32_t top_k;
};

__global__ void __launch_bounds__(32)
draw_rows_kernel(const draw_param *__restrict__ p, const int32_t *__restrict__ ids, const int32_t *__restrict__ vals,
                 const int32_t *__restrict__ counts, int32_t k, int32_t *out)
{
    follow_previous_kernel();
    const int64_t i = blockIdx.x;
    const draw_param q = p[i];
    const int n = counts[i] < q.top_k ? counts[i] : q.top_k;
    const unsigned long long got =
        n < 1 ? 0 : draw_entries(ids + i * k, vals + i * k, n, q.top_p, q.min_p, q.temp, q.u);
    if (threadIdx.x == 0) out[i] = luma_cuda_key_id(got);
}

/* ---- the operations ------------------------------------------------------ */

/* Checks shared by the operations; a failure an earlier step left is
 * reported first. */
static int op_begin(cuda_backend *c, const char *op, const luma_buf *b, int64_t row, luma_err *err)
{
    if (!LUMA_CUDA_OK(c)) return luma_cuda_report(c, err);
    if (b->cols < 1 || b->cols > INT32_MAX) return luma_errf(err, "%s: rows of %lld logits", op, (long long)b->cols);
    if (row < 0 || row >= b->rows)
        return luma_errf(err, "%s: row %lld of a set of %lld", op, (long long)row, (long long)b->rows);
    return 0;
}

/* Waits for the operation's work: any CUDA error since op_begin is its.
   The stream is waited for on failure too, so that no copy into the
   pinned results (host_results) is still queued when the next operation
   writes them. */
static int op_end(cuda_backend *c, const char *op, cudaError_t e, luma_err *err)
{
    if (e == cudaSuccess) e = cudaGetLastError();
    cudaError_t s = cudaStreamSynchronize(c->stream);
    if (e == cudaSuccess) e = s;
    if (e != cudaSuccess) {
        cudaGetLastError();
        return luma_errf(err, "%s on the GPU: %s", op, cudaGetErrorString(e));
    }
    return 0;
}

/* Checks that an operation with no result (an edit, temperature) was
 * queued. It is not waited for: the next operation that returns a result,
 * or reads the row, comes after it on the stream, waits for both and
 * reports a failure of either. */
static int op_queued(const char *op, cudaError_t e, luma_err *err)
{
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) return luma_errf(err, "%s on the GPU: %s", op, cudaGetErrorString(e));
    return 0;
}

int luma_cuda_logits_alloc(luma_backend *be, luma_buf *b, int64_t rows, int64_t cols, luma_err *err)
{
    cuda_backend *c = cu(be);
    size_t n, total;
    luma_buf t = { NULL, rows, cols, 0 };
    if (rows < 1 || cols < 1 || luma_mul_size((size_t)rows, (size_t)cols, &n) || n > SIZE_MAX / 2 / sizeof(float))
        return luma_errf(err, "a logits set of %lld x %lld is too large", (long long)rows, (long long)cols);
    t.cap = (int64_t)n;
    if (luma_add_size(work_offset(&t), work_size(&t), &total))
        return luma_errf(err, "a logits set of %lld x %lld is too large", (long long)rows, (long long)cols);
    void *d = NULL;
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) e = cudaMalloc(&d, total);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return luma_errf(err, "no GPU memory for %lld rows of logits (%zu MiB): %s", (long long)rows, total >> 20,
                         cudaGetErrorString(e));
    }
    b->data = (float *)d;
    b->rows = rows;
    b->cols = cols;
    b->cap = (int64_t)n;
    return 0;
}

void luma_cuda_logits_free(luma_backend *be, luma_buf *b)
{
    cuda_backend *c = cu(be);
    if (b->data) {
        cudaStreamSynchronize(c->stream);
        cudaFree(b->data);
    }
    memset(b, 0, sizeof *b);
}

/* argmax_kernel's blocks in all: about 4 a streaming multiprocessor (also
 * the size of chained decoding's parts, which one row's blocks fill). */
static int64_t argmax_grid(const cuda_backend *c) { return 4 * (int64_t)c->n_sm; }

/* argmax_kernel's blocks a row, for n rows of cols: argmax_grid in all,
 * each reading min_chunk entries at least. */
static int64_t argmax_blocks(const cuda_backend *c, int64_t cols, int64_t n, int64_t min_chunk = ARGMAX_MIN_CHUNK)
{
    const int64_t want = argmax_grid(c), most = (cols + min_chunk - 1) / min_chunk;
    int64_t per_row = (want + n - 1) / n;
    if (per_row > most) per_row = most;
    return per_row < 1 ? 1 : per_row;
}

/* Queues the best key of each of n rows from row0 into keys (zeroed
 * first): enough blocks to fill the device, each reading
 * ARGMAX_MIN_CHUNK entries at least. */
static cudaError_t queue_argmax(cuda_backend *c, const luma_buf *b, int64_t row0, int64_t n,
                                unsigned long long *keys)
{
    const int64_t cols = b->cols, per_row = argmax_blocks(c, cols, n), chunk = (cols + per_row - 1) / per_row;
    cudaError_t e = cudaMemsetAsync(keys, 0, (size_t)n * sizeof *keys, c->stream);
    for (int64_t r0 = 0; r0 < n && e == cudaSuccess; r0 += 65535) {
        int64_t rows = n - r0 < 65535 ? n - r0 : 65535;
        dim3 grid((unsigned)per_row, (unsigned)rows);
        luma_launch(c, c->stream, grid, ARGMAX_THREADS, 0, argmax_kernel<false>, b->data + (row0 + r0) * cols, cols,
                    chunk, keys + r0);
        e = cudaGetLastError();
    }
    return e;
}

int luma_cuda_logits_argmax(luma_backend *be, const luma_buf *b, int64_t row0, int64_t n, int32_t *ids,
                            luma_err *err)
{
    cuda_backend *c = cu(be);
    if (op_begin(c, "argmax", b, row0, err)) return -1;
    if (n < 1 || n > b->rows - row0)
        return luma_errf(err, "argmax: rows [%lld, +%lld) of a set of %lld", (long long)row0, (long long)n,
                         (long long)b->rows);
    unsigned long long *keys = (unsigned long long *)work(b);
    unsigned long long *host = (unsigned long long *)results_get(c, (size_t)n * sizeof *host);
    if (!host) return luma_errf(err, "argmax: out of memory for %lld rows", (long long)n);
    cudaError_t e = queue_argmax(c, b, row0, n, keys);
    if (e == cudaSuccess) e = cudaMemcpyAsync(host, keys, (size_t)n * sizeof *host, cudaMemcpyDeviceToHost, c->stream);
    int rc = op_end(c, "argmax", e, err);
    if (rc == 0)
        for (int64_t i = 0; i < n; i++) ids[i] = luma_cuda_key_id(host[i]);
    results_free(c, host);
    return rc;
}

/* Top-k's device work, the backend's (grown as asked, never shrunk): the
 * arrival counts of topk_small_kernel's rows (0 between launches: zeroed
 * when made, and set back by each row's last block), then n rows of
 * results (ids [k], values [k], count), then the blocks' keys. */
static int topk_work(cuda_backend *c, int64_t n, int32_t k, int64_t parts, unsigned int **arrived, int32_t **res,
                     unsigned long long **cand, luma_err *err)
{
    const size_t res_bytes = work_align((size_t)n * (2 * (size_t)k + 1) * sizeof(int32_t));
    const size_t cand_bytes = (size_t)n * (size_t)parts * (size_t)k * sizeof(unsigned long long);
    size_t rows = (size_t)c->topk_rows, counts = work_align(rows * sizeof(unsigned int));
    if ((size_t)n > rows || counts + res_bytes + cand_bytes > c->topk_cap) {
        if (rows < (size_t)n) rows = (size_t)n < 256 ? 256 : (size_t)n;
        counts = work_align(rows * sizeof(unsigned int));
        size_t cap = counts + res_bytes + cand_bytes;
        if (cap < 2 * c->topk_cap) cap = 2 * c->topk_cap;
        cudaStreamSynchronize(c->stream);
        cudaFree(c->topk_mem);
        c->topk_mem = NULL;
        c->topk_cap = 0;
        c->topk_rows = 0;
        cudaError_t e = cudaMalloc(&c->topk_mem, cap);
        if (e == cudaSuccess) e = cudaMemsetAsync(c->topk_mem, 0, counts, c->stream);
        if (e != cudaSuccess) {
            cudaGetLastError();
            cudaFree(c->topk_mem);
            c->topk_mem = NULL;
            return luma_errf(err, "top-k: no GPU memory for %lld rows (%zu MiB): %s", (long long)n, cap >> 20,
                             cudaGetErrorString(e));
        }
        c->topk_cap = cap;
        c->topk_rows = (int64_t)rows;
    }
    *arrived = (unsigned int *)c->topk_mem;
    *res = (int32_t *)((char *)c->topk_mem + counts);
    *cand = (unsigned long long *)((char *)c->topk_mem + counts + res_bytes);
    return 0;
}

/* Queues the k best of rows row0 .. row0 + n - 1 into *res (the rows'
 * words, 2 k + 1 each: ids [k], values [k], count): small k in one launch
 * of many blocks a row, larger k one block a row (rows and k checked by
 * the caller). */
static int queue_topk(cuda_backend *c, const luma_buf *b, int64_t row0, int64_t n, int32_t k, int32_t **res,
                      luma_err *err)
{
    const int64_t parts = (b->cols + TOPK_PART_CHUNK - 1) / TOPK_PART_CHUNK, words = 2 * (int64_t)k + 1;
    const bool small = k <= TOPK_PART_THREADS && parts * k <= TOPK_PART_CHUNK;
    unsigned int *arrived;
    unsigned long long *cand;
    if (topk_work(c, n, k, small ? parts : 0, &arrived, res, &cand, err)) return -1;
    const float *x = b->data + row0 * b->cols;
    cudaError_t e = cudaSuccess;
    for (int64_t r0 = 0; r0 < n && e == cudaSuccess; r0 += small ? 65535 : 1) {
        if (small) {
            const int64_t rows = n - r0 < 65535 ? n - r0 : 65535;
            /* many rows: a block for several chunks, about four blocks an SM in all */
            const int64_t per_row = (4 * (int64_t)c->n_sm + rows - 1) / rows;
            const unsigned blocks = (unsigned)(per_row < parts ? per_row : parts);
            if (k <= TOPK_REGS_K && c->topk_stream)
                luma_launch(c, c->stream, dim3(blocks, (unsigned)rows), TOPK_PART_THREADS, 0, topk_stream_kernel,
                            x + r0 * b->cols, b->cols, k, cand + r0 * blocks * k, arrived + r0, *res + r0 * words);
            else
                luma_launch(c, c->stream, dim3((unsigned)parts, (unsigned)rows), TOPK_PART_THREADS, 0,
                            topk_small_kernel, x + r0 * b->cols, b->cols, k, cand + r0 * parts * k, arrived + r0,
                            *res + r0 * words);
        } else {
            int32_t *o = *res + r0 * words;
            luma_launch(c, c->stream, 1, TOPK_THREADS, 0, topk_kernel, x + r0 * b->cols, b->cols, k, o,
                        (float *)(o + k), o + 2 * k);
        }
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        return luma_errf(err, "top-k on the GPU: %s", cudaGetErrorString(e));
    }
    return 0;
}

/* The k best of rows row0 .. row0 + n - 1, one wait. */
static int topk_rows(cuda_backend *c, const luma_buf *b, int64_t row0, int64_t n, int32_t k, int32_t *ids,
                     float *vals, int32_t *counts, luma_err *err)
{
    if (op_begin(c, "top-k", b, row0, err)) return -1;
    if (n < 1 || n > b->rows - row0)
        return luma_errf(err, "top-k: rows [%lld, +%lld) of a set of %lld", (long long)row0, (long long)n,
                         (long long)b->rows);
    if (k < 1 || k > LUMA_TOPK_MAX)
        return luma_errf(err, "top-k: k must be in [1, %d] (got %d)", LUMA_TOPK_MAX, (int)k);
    /* ids [k], values [k], count: a row's words, one copy back */
    static_assert(sizeof(int32_t) == sizeof(float), "ids and values pack alike");
    const int64_t words = 2 * (int64_t)k + 1;
    const size_t bytes = (size_t)(n * words) * sizeof(int32_t);
    int32_t *host = (int32_t *)results_get(c, bytes);
    if (!host) return luma_errf(err, "top-k: out of memory for %lld rows", (long long)n);
    int32_t *res;
    if (queue_topk(c, b, row0, n, k, &res, err)) {
        results_free(c, host);
        return -1;
    }
    int rc = op_end(c, "top-k", cudaMemcpyAsync(host, res, bytes, cudaMemcpyDeviceToHost, c->stream), err);
    for (int64_t i = 0; i < n && rc == 0; i++) {
        const int32_t *h = host + i * words;
        counts[i] = h[2 * k];
        memcpy(ids + i * k, h, (size_t)counts[i] * sizeof *ids);
        memcpy(vals + i * k, h + k, (size_t)counts[i] * sizeof *vals);
    }
    results_free(c, host);
    return rc;
}

int32_t luma_cuda_logits_topk(luma_backend *be, const luma_buf *b, int64_t row, int32_t k, int32_t *ids,
                              float *vals, luma_err *err)
{
    int32_t count;
    return topk_rows(cu(be), b, row, 1, k, ids, vals, &count, err) ? -1 : count;
}

int luma_cuda_logits_topk_rows(luma_backend *be, const luma_buf *b, int64_t row0, int64_t n, int32_t k,
                               int32_t *ids, float *vals, int32_t *counts, luma_err *err)
{
    return topk_rows(cu(be), b, row0, n, k, ids, vals, counts, err);
}

int luma_cuda_logits_edit(luma_backend *be, luma_buf *b, int64_t row, const luma_logits_edit *e, luma_err *err)
{
    static const char *const names[] = { "penalize", "bias", "mask", "setting an entry" };
    cuda_backend *c = cu(be);
    if (e->kind < LUMA_EDIT_PENALIZE || e->kind > LUMA_EDIT_SET) return luma_errf(err, "logits edit: unknown kind");
    if (e->kind == LUMA_EDIT_SET && !e->values) return luma_errf(err, "setting an entry: no values");
    const char *op = names[e->kind];
    if (op_begin(c, op, b, row, err)) return -1;
    if (e->n < 0) return luma_errf(err, "%s: %d entries", op, (int)e->n);
    for (int32_t i = 0; i < e->n; i++)
        if (e->ids[i] < 0 || e->ids[i] >= b->cols)
            return luma_errf(err, "%s: id %d (at index %d) is not in [0, %lld)", op, (int)e->ids[i], (int)i,
                             (long long)b->cols);
    float *x = b->data + row * b->cols;
    cudaError_t ce = cudaSuccess;
    for (int32_t i0 = 0; i0 < e->n && ce == cudaSuccess; i0 += EDIT_CHUNK) {
        edit_chunk ch;
        ch.n = e->n - i0 < EDIT_CHUNK ? e->n - i0 : EDIT_CHUNK;
        memcpy(ch.ids, e->ids + i0, (size_t)ch.n * sizeof(int32_t));
        if (e->values) memcpy(ch.values, e->values + i0, (size_t)ch.n * sizeof(float));
        else memset(ch.values, 0, sizeof ch.values);
        luma_launch(c, c->stream, 1, EDIT_CHUNK, 0, edit_kernel, x, (int)e->kind, ch, e->repeat, e->frequency,
                    e->presence);
        ce = cudaGetLastError();
    }
    return op_queued(op, ce, err);
}

/* Grid of an elementwise pass over a row: a thread an entry, at most four
 * blocks of 256 an SM. */
static unsigned row_blocks(const cuda_backend *c, int64_t n)
{
    int64_t blocks = (n + 255) / 256, most = 4 * (int64_t)c->n_sm;
    return (unsigned)(blocks < most ? blocks : most);
}

int luma_cuda_logits_temperature(luma_backend *be, luma_buf *b, int64_t row, float t, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (op_begin(c, "temperature", b, row, err)) return -1;
    if (!(t > 0.0f) || isinf(t)) return luma_errf(err, "temperature: t must be finite and > 0 (got %g)", (double)t);
    luma_launch(c, c->stream, row_blocks(c, b->cols), 256, 0, temperature_kernel, b->data + row * b->cols, b->cols,
                t);
    return op_queued("temperature", cudaSuccess, err);
}

int luma_cuda_logits_min_p(luma_backend *be, luma_buf *b, int64_t row, double lp, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (op_begin(c, "min_p", b, row, err)) return -1;
    unsigned long long *best = (unsigned long long *)work(b);
    cudaError_t e = queue_argmax(c, b, row, 1, best);
    if (e == cudaSuccess)
        luma_launch(c, c->stream, row_blocks(c, b->cols), 256, 0, min_p_kernel, b->data + row * b->cols, b->cols,
                    (const unsigned long long *)best, lp);
    return op_queued("min_p", e, err);
}

/* The sums over a row's live entries, in its work area: the largest key
 * at 0 (argmax_kernel), the chunks' (z, s) from 256 (dist_sums_kernel: nch
 * chunks of ch entries, ch a multiple of 32, 256 at least), and their
 * total, where asked, at 64 (dist_total_kernel). */
typedef struct row_sums {
    int64_t ch;
    int32_t nch;
    unsigned long long *best;
    double2 *sums, *total;
} row_sums;

static cudaError_t queue_chunk_sums(cuda_backend *c, const luma_buf *b, int64_t row, row_sums *rs)
{
    const int64_t n = b->cols;
    int64_t ch = (n + SAMPLE_CHUNKS_MAX - 1) / SAMPLE_CHUNKS_MAX;
    rs->ch = ch < 256 ? 256 : (ch + 31) / 32 * 32;
    rs->nch = (int32_t)((n + rs->ch - 1) / rs->ch);
    rs->best = (unsigned long long *)work(b);
    rs->total = (double2 *)((char *)work(b) + 64);
    rs->sums = (double2 *)((char *)work(b) + 256);
    static_assert(256 + SAMPLE_CHUNKS_MAX * sizeof(double2) <= WORK_MIN, "the chunks' sums fit the work area");
    cudaError_t e = queue_argmax(c, b, row, 1, rs->best);
    if (e != cudaSuccess) return e;
    luma_launch(c, c->stream, (unsigned)((rs->nch + 7) / 8), 256, 0, dist_sums_kernel, b->data + row * n, n, rs->ch,
                rs->nch, (const unsigned long long *)rs->best, rs->sums);
    return cudaGetLastError();
}

static cudaError_t queue_live_sums(cuda_backend *c, const luma_buf *b, int64_t row, row_sums *rs)
{
    cudaError_t e = queue_chunk_sums(c, b, row, rs);
    if (e != cudaSuccess) return e;
    luma_launch(c, c->stream, 1, 32, 0, dist_total_kernel, (const double2 *)rs->sums, rs->nch, rs->total);
    return cudaGetLastError();
}

int luma_cuda_logits_softmax(luma_backend *be, luma_buf *b, int64_t row, bool log, luma_err *err)
{
    cuda_backend *c = cu(be);
    const char *op = log ? "log_softmax" : "softmax";
    if (op_begin(c, op, b, row, err)) return -1;
    row_sums rs;
    cudaError_t e = queue_live_sums(c, b, row, &rs);
    if (e == cudaSuccess)
        e = luma_launch(c, c->stream, row_blocks(c, b->cols), 256, 0, dist_apply_kernel, b->data + row * b->cols,
                        b->cols, (const unsigned long long *)rs.best, (const double2 *)rs.total, (int)log);
    unsigned long long key = 0, *host = (unsigned long long *)host_results(c, sizeof key);
    if (!host) host = &key;
    if (e == cudaSuccess) e = cudaMemcpyAsync(host, rs.best, sizeof key, cudaMemcpyDeviceToHost, c->stream);
    if (op_end(c, op, e, err)) return -1;
    if (*host == 0) return luma_errf(err, "%s: every logit is masked", op);
    return 0;
}

int luma_cuda_logits_live_sums(luma_backend *be, const luma_buf *b, int64_t row, double *z, double *s,
                               luma_err *err)
{
    cuda_backend *c = cu(be);
    if (op_begin(c, "entropy", b, row, err)) return -1;
    row_sums rs;
    cudaError_t e = queue_live_sums(c, b, row, &rs);
    /* the key, then the total, back in one copy: 64 + 16 bytes */
    char *host = (char *)host_results(c, 80), local[80];
    if (!host) host = local;
    if (e == cudaSuccess) e = cudaMemcpyAsync(host, rs.best, 80, cudaMemcpyDeviceToHost, c->stream);
    if (op_end(c, "entropy", e, err)) return -1;
    unsigned long long key;
    double2 t;
    memcpy(&key, host, sizeof key);
    memcpy(&t, host + 64, sizeof t);
    if (key == 0) return luma_errf(err, "entropy: every logit is masked");
    *z = t.x;
    *s = t.y;
    return 0;
}

int32_t luma_cuda_logits_sample(luma_backend *be, const luma_buf *b, int64_t row, double u, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (op_begin(c, "sample", b, row, err)) return -1;
    if (!(u >= 0.0 && u < 1.0)) return luma_errf(err, "sample: the uniform %g is not in [0, 1)", u);
    /* the chunks' sums, then the id drawn at 8 in the work area */
    row_sums rs;
    int32_t *d_out = (int32_t *)((char *)work(b) + 8), id = -1;
    cudaError_t e = queue_chunk_sums(c, b, row, &rs);
    if (e == cudaSuccess) {
        luma_launch(c, c->stream, 1, SAMPLE_THREADS, 0, sample_walk_kernel, b->data + row * b->cols, b->cols, rs.ch,
                    rs.nch, (const unsigned long long *)rs.best, (const double2 *)rs.sums, u, d_out);
        e = cudaGetLastError();
    }
    int32_t *host = (int32_t *)host_results(c, sizeof id);
    if (!host) host = &id;
    if (e == cudaSuccess) e = cudaMemcpyAsync(host, d_out, sizeof id, cudaMemcpyDeviceToHost, c->stream);
    if (op_end(c, "sample", e, err)) return -1;
    id = *host;
    if (id < 0) return luma_errf(err, "sample: every logit is masked");
    return id;
}

/* ---- decoding chained on the device --------------------------------------- */

/* The chosen id's key (the argmax's, or the sampler's draw) goes to
 * chain_key, where the next step's embed reads it for a row whose token is
 * LUMA_TOKEN_CHAINED, and its copy to chain_host, after which chain_ev is
 * recorded: the host waits for that event only, while the step queued
 * after the choice runs. */

/* The pinned copy, its event and the argmax's block keys, made at the first
 * use; with zero_copy the copy's device address (NULL: the copy engine's). */
static cudaError_t chain_ready(cuda_backend *c)
{
    cudaError_t e = cudaSuccess;
    if (!c->chain_host) {
        e = cudaMallocHost((void **)&c->chain_host, sizeof *c->chain_host);
        if (e != cudaSuccess) c->chain_host = NULL;
        c->chain_host_dev = NULL;
        if (e == cudaSuccess && c->zero_copy &&
            cudaHostGetDevicePointer((void **)&c->chain_host_dev, c->chain_host, 0) != cudaSuccess) {
            cudaGetLastError();
            c->chain_host_dev = NULL;
        }
    }
    if (e == cudaSuccess && !c->chain_parts && c->chain_host_dev)
        e = cudaMalloc((void **)&c->chain_parts, (size_t)argmax_grid(c) * sizeof *c->chain_parts);
    if (e == cudaSuccess && !c->chain_ev) e = cudaEventCreateWithFlags(&c->chain_ev, cudaEventDisableTiming);
    return e;
}

/* After the key's kernels (e: how queuing them went; published: the host
 * copy made by them): the key copied back by the copy engine where it was
 * not, then the event chain_read waits for. */
static int chain_queued(cuda_backend *c, const char *op, cudaError_t e, bool published, luma_err *err)
{
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e == cudaSuccess && !published)
        e = cudaMemcpyAsync(c->chain_host, c->chain_key, sizeof *c->chain_host, cudaMemcpyDeviceToHost, c->stream);
    if (e == cudaSuccess) e = cudaEventRecord(c->chain_ev, c->stream);
    return op_queued(op, e, err);
}

int luma_cuda_chain_argmax(luma_backend *be, const luma_buf *b, int64_t row, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (op_begin(c, "greedy's argmax", b, row, err)) return -1;
    cudaError_t e = chain_ready(c);
    if (e == cudaSuccess && c->chain_host_dev) {
        /* each block's key to its part (CHAIN_MIN_CHUNK entries at least:
         * nothing to zero first), then the largest published: no memset
         * before the argmax nor copy after it on the stream (zero_copy) */
        const int64_t cols = b->cols, parts = argmax_blocks(c, cols, 1, CHAIN_MIN_CHUNK),
                      chunk = (cols + parts - 1) / parts;
        luma_launch(c, c->stream, (unsigned)parts, ARGMAX_THREADS, 0, argmax_kernel<true>, b->data + row * cols, cols,
                    chunk, c->chain_parts);
        luma_launch(c, c->stream, 1, 32, 0, chain_publish_kernel, (const unsigned long long *)c->chain_parts,
                    (int)parts, c->chain_key, c->chain_host_dev);
        return chain_queued(c, "greedy's argmax", cudaSuccess, true, err);
    }
    if (e == cudaSuccess) e = queue_argmax(c, b, row, 1, c->chain_key);
    return chain_queued(c, "greedy's argmax", e, false, err);
}

/* The sampler's draw goes where the argmax's would: the penalties over
 * the history (chain_penalty_kernel, where s penalizes), its top-k
 * (queue_topk), then chain_sample_kernel, which adds the id to the
 * history. */
int luma_cuda_chain_sample(luma_backend *be, const luma_buf *b, int64_t row, const luma_sampler *s, double u,
                           luma_err *err)
{
    cuda_backend *c = cu(be);
    if (op_begin(c, "the sampler's draw", b, row, err) || luma_sampler_check(s, err)) return -1;
    if (!(u >= 0.0 && u < 1.0)) return luma_errf(err, "sample: the uniform %g is not in [0, 1)", u);
    const bool penalizes = luma_sampler_penalizes(s);
    if (penalizes && !c->chain_hist) return luma_errf(err, "the sampler's draw: penalties with no history begun");
    const int32_t k = s->top_k < b->cols ? s->top_k : (int32_t)b->cols;
    int32_t *res;
    cudaError_t e = chain_ready(c);
    if (e != cudaSuccess) return chain_queued(c, "the sampler's draw", e, false, err);
    chain_hist *h = (chain_hist *)c->chain_hist;
    if (penalizes)
        luma_launch(c, c->stream, 1, WINDOW, 0, chain_penalty_kernel, b->data + row * b->cols, (const chain_hist *)h,
                    s->last_n, s->repeat, s->frequency, s->presence);
    if (queue_topk(c, b, row, 1, k, &res, err)) return -1;
    luma_launch(c, c->stream, 1, 32, 0, chain_sample_kernel, res, k, s->top_p, s->min_p, s->temp, u, c->chain_key,
                penalizes ? h : (chain_hist *)NULL);
    if (c->chain_host_dev)
        luma_launch(c, c->stream, 1, 32, 0, chain_publish_kernel, (const unsigned long long *)c->chain_key, 1,
                    (unsigned long long *)NULL, c->chain_host_dev);
    return chain_queued(c, "the sampler's draw", cudaSuccess, c->chain_host_dev != NULL, err);
}

int luma_cuda_chain_history(luma_backend *be, const int32_t *ids, int32_t n, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (!LUMA_CUDA_OK(c)) return luma_cuda_report(c, err);
    if (n < 0) return luma_errf(err, "chained history: %d ids", (int)n);
    cudaError_t e = cudaSuccess;
    if (!c->chain_hist) e = cudaMalloc(&c->chain_hist, sizeof(chain_hist));
    chain_hist *h = (chain_hist *)host_results(c, sizeof(chain_hist)), local;
    if (!h) h = &local;
    memset(h, 0, sizeof *h);
    for (int32_t i = n > WINDOW ? n - WINDOW : 0; i < n; i++) h->ring[i % WINDOW] = ids[i];
    h->total = n;
    /* waited for: the pinned buffer serves the next operation's result */
    if (e == cudaSuccess) e = cudaMemcpyAsync(c->chain_hist, h, sizeof *h, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return luma_errf(err, "chained history on the GPU: %s", cudaGetErrorString(e));
    }
    return 0;
}

int luma_cuda_chain_read(luma_backend *be, int32_t *id, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (!c->chain_ev) return luma_errf(err, "chained decoding: no token was queued");
    cudaError_t e = cudaEventSynchronize(c->chain_ev);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return luma_errf(err, "chained decoding's token on the GPU: %s", cudaGetErrorString(e));
    }
    *id = luma_cuda_key_id(*(volatile unsigned long long *)c->chain_host);
    return 0;
}

/* ---- many rows' draws ------------------------------------------------------ */

/* The input (draw_params, then ids, values and counts as given) goes up in
 * one copy through the pinned results buffer (or malloc'd memory past its
 * size), draw_rows_kernel writes the ids after it, and they come back
 * through the same buffer. */
int luma_cuda_sampler_draw_rows(luma_backend *be, int32_t n, int32_t k, const int32_t *ids, const float *vals,
                                const int32_t *counts, const luma_sampler *smp, const double *u, int32_t *out,
                                luma_err *err)
{
    cuda_backend *c = cu(be);
    if (!LUMA_CUDA_OK(c)) return luma_cuda_report(c, err);
    if (n < 1 || k < 1 || k > LUMA_SAMPLER_K_MAX)
        return luma_errf(err, "draw: %d rows of %d entries", (int)n, (int)k);
    const size_t pbytes = (size_t)n * sizeof(draw_param), ebytes = (size_t)n * (size_t)k * sizeof(int32_t),
                 cbytes = (size_t)n * sizeof(int32_t), in = pbytes + 2 * ebytes + cbytes, total = in + cbytes;
    if (total > c->draw_cap) {
        size_t cap = total < 2 * c->draw_cap ? 2 * c->draw_cap : total;
        cudaStreamSynchronize(c->stream);
        cudaFree(c->draw_mem);
        c->draw_mem = NULL;
        c->draw_cap = 0;
        if (cudaMalloc(&c->draw_mem, cap) != cudaSuccess) {
            cudaGetLastError();
            return luma_errf(err, "draw: no GPU memory for %d rows", (int)n);
        }
        c->draw_cap = cap;
    }
    char *host = (char *)results_get(c, in);
    if (!host) return luma_errf(err, "draw: out of memory for %d rows", (int)n);
    draw_param *p = (draw_param *)host;
    for (int32_t i = 0; i < n; i++) {
        if (!(u[i] >= 0.0 && u[i] < 1.0) || counts[i] < 0 || counts[i] > k) {
            results_free(c, host);
            return luma_errf(err, "draw: row %d: the uniform %g or the count %d is out of range", (int)i, u[i],
                             (int)counts[i]);
        }
        p[i] = draw_param{ u[i], smp[i].top_p, smp[i].min_p, smp[i].temp, smp[i].top_k };
    }
    memcpy(host + pbytes, ids, ebytes);
    memcpy(host + pbytes + ebytes, vals, ebytes);
    memcpy(host + pbytes + 2 * ebytes, counts, cbytes);
    char *d = (char *)c->draw_mem;
    cudaError_t e = cudaMemcpyAsync(d, host, in, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) {
        luma_launch(c, c->stream, (unsigned)n, 32, 0, draw_rows_kernel, (const draw_param *)d,
                    (const int32_t *)(d + pbytes), (const int32_t *)(d + pbytes + ebytes),
                    (const int32_t *)(d + pbytes + 2 * ebytes), k, (int32_t *)(d + in));
        e = cudaGetLastError();
    }
    /* the upload is done by then (the same stream): its buffer takes the ids */
    if (e == cudaSuccess) e = cudaMemcpyAsync(host, d + in, cbytes, cudaMemcpyDeviceToHost, c->stream);
    int rc = op_end(c, "draw", e, err);
    if (rc == 0) memcpy(out, host, cbytes);
    results_free(c, host);
    return rc;
}
