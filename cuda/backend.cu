/* The CUDA backend: device memory, the step upload, and the table of
 * operations (kernels in ops.cu, attention.cu and matmul.cu).
 *
 * Everything lives on one device and is queued on one stream. Weights are
 * copied once, byte for byte, from the mapped file; while the device has
 * room (keep_f16), each matrix is also dequantized once into an f16 copy
 * that the tensor-core path of matmul reads instead of dequantizing per
 * call. A step's metadata (tokens, positions, out rows, the row -> sequence
 * map, per-sequence ranges, block tables and the attention work lists) is
 * packed on the host into a pinned buffer and sent in one copy, so a decode
 * step pays for a single small transfer. Operations never return errors:
 * the first failure is kept in c->failure, later operations are skipped,
 * and sync (or buf_read) reports it. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "rope.cuh"

static cuda_backend *cu(luma_backend *be) { return (cuda_backend *)be; }

/* What waits to be launched, launched: the open program (program.cu), the
 * pending attention or norm (luma_cuda_pending_flush). The products take
 * those themselves (matmul.cu, quantize_into) and flush only the program. */
static void flush_all(cuda_backend *c)
{
    luma_cuda_prog_flush(c);
    luma_cuda_pending_flush(c);
}

bool luma_cuda_fail(cuda_backend *c, cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return false;
    if (c->failure[0] == 0)
        snprintf(c->failure, sizeof c->failure, "CUDA error in %s: %s", what, cudaGetErrorString(e));
    return true;
}

void luma_cuda_failf(cuda_backend *c, const char *fmt, ...)
{
    if (c->failure[0] != 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->failure, sizeof c->failure, fmt, ap);
    va_end(ap);
}

int luma_cuda_report(cuda_backend *c, luma_err *err)
{
    luma_errf(err, "%s", c->failure);
    c->failure[0] = 0;
    return -1;
}

/* Frees device memory that queued work may still be using. */
static void free_after_stream(cuda_backend *c, void *p)
{
    if (!p) return;
    cudaStreamSynchronize(c->stream);
    cudaFree(p);
}

void *luma_cuda_scratch(cuda_backend *c, size_t n)
{
    if (!LUMA_CUDA_OK(c)) return NULL;
    const bool side = c->side && c->stream == c->side;
    void **mem = side ? &c->side_scratch : &c->scratch;
    size_t *cap = side ? &c->side_scratch_cap : &c->scratch_cap;
    if (n <= *cap) return *mem;
    if (c->capturing) {
        luma_cuda_failf(c, "matmul scratch must grow while a step is being recorded");
        return NULL;
    }
    free_after_stream(c, *mem);
    *mem = NULL;
    *cap = 0;
    if (luma_cuda_fail(c, cudaMalloc(mem, n), "allocating matmul scratch")) {
        *mem = NULL;
        return NULL;
    }
    *cap = n;
    return *mem;
}

bool luma_cuda_partials(cuda_backend *c, cuda_partials *s, size_t counters, size_t part_bytes, const char *what,
                        int32_t **ctr, void **part)
{
    size_t cbytes = (s->counters * sizeof(int32_t) + 255) & ~(size_t)255;
    if (counters > s->counters || part_bytes > s->part_cap) {
        if (c->capturing) {
            luma_cuda_failf(c, "%s must grow while a step is being recorded", what);
            return false;
        }
        if (counters < s->counters) counters = s->counters;
        if (part_bytes < s->part_cap) part_bytes = s->part_cap;
        cbytes = (counters * sizeof(int32_t) + 255) & ~(size_t)255;
        free_after_stream(c, s->mem);
        s->mem = NULL;
        s->counters = s->part_cap = 0;
        char msg[64];
        snprintf(msg, sizeof msg, "allocating %s", what);
        void *mem = NULL;
        if (luma_cuda_fail(c, cudaMalloc(&mem, cbytes + part_bytes), msg)) return false;
        s->mem = mem;
        snprintf(msg, sizeof msg, "clearing the counters of %s", what);
        if (luma_cuda_fail(c, cudaMemsetAsync(mem, 0, cbytes, c->stream), msg)) return false;
        s->counters = counters;
        s->part_cap = part_bytes;
    }
    *ctr = (int32_t *)s->mem;
    *part = (uint8_t *)s->mem + cbytes;
    return true;
}

/* Whether the switch `name` is turned off in the environment (set to 0):
 * the backend's paths that can be turned off for measuring. */
static bool env_off(const char *name)
{
    const char *v = getenv(name);
    return v && strcmp(v, "0") == 0;
}

/* The integer `name` in the environment, within [lo, hi]; dflt when unset
 * or not a number. */
static int env_int(const char *name, int dflt, int lo, int hi)
{
    const char *v = getenv(name);
    char *end;
    long n = v && *v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end) return dflt;
    return n < lo ? lo : n > hi ? hi : (int)n;
}

/* The warm-up at load (luma_backend.warmup): a process's first step of 9
 * rows or more took 55-80 ms more than the next, its first of 9-31 rows of
 * one sequence decoded 5-10 ms more (cuda/NOTES.md, "The first prompt's
 * set-up moved into the load", "Warm-up steps of each kind"); so a step
 * of 40 rows (a tile of prefill), then one of 12 (a short chunk decoded).
 * LUMA_CUDA_WARMUP=a,b,... gives the list (0: none). */
static void warmup_steps(cuda_backend *c)
{
    static const int32_t dflt[] = { 40, 12 };
    memset(c->base.warmup, 0, sizeof c->base.warmup);
    const char *v = getenv("LUMA_CUDA_WARMUP");
    if (!v || !*v) {
        memcpy(c->base.warmup, dflt, sizeof dflt);
        return;
    }
    for (int i = 0; i < LUMA_WARMUP_STEPS && *v; i++) {
        char *end;
        long n = strtol(v, &end, 10);
        if (end == v || n < 1 || n > 4096) break;
        c->base.warmup[i] = (int32_t)n;
        v = *end == ',' ? end + 1 : end;
    }
}

int luma_cuda_env_digit(const char *name, int dflt)
{
    const char *v = getenv(name);
    return v && v[0] >= '0' && v[0] <= '9' && v[1] == 0 ? v[0] - '0' : dflt;
}

/* ---- memory ------------------------------------------------------------- */

/* The f16 copies of the weights may take 3/5 of the memory free at the first
 * weight_load; the rest is for the quantized weights, the KV cache, the
 * activations and scratch. A 7B model in Q4_K_M needs 13.5 GiB of copies. */
#define F16_SHARE_NUM 3
#define F16_SHARE_DEN 5

/* Frees the copy `which` of every weight, once the queued work that may
 * read the n there are has finished. */
static void free_copies(cuda_backend *c, int32_t n, void *cuda_weight_copy::*which)
{
    if (n > 0) cudaStreamSynchronize(c->stream);
    for (int32_t i = 0; i < c->n_weights; i++) {
        cudaFree(c->weights[i].*which);
        c->weights[i].*which = NULL;
    }
}

/* Frees every f16 copy and makes no more: large products dequantize per
 * call from now on. */
static void drop_f16(cuda_backend *c)
{
    free_copies(c, c->n_f16, &cuda_weight_copy::f16);
    c->f16_bytes = 0;
    c->n_f16 = 0;
    c->f16_mode = CUDA_F16_PER_CALL;
}

/* Frees every repacked copy and makes no more: the matrix-vector kernels
 * read the file's blocks from now on (luma_weight.dev_mmv still names the
 * freed copies; mmv_on tells the kernels' dispatch not to). Recorded steps
 * that read them are recorded again: graph_where hashes mmv_on. */
static void drop_mmv(cuda_backend *c)
{
    free_copies(c, c->n_mmv, &cuda_weight_copy::mmv);
    c->n_mmv = 0;
    c->mmv_on = false;
}

/* cudaMalloc that, when the device is full, makes room by dropping the f16
 * copies, then the repacked ones: they never cost an allocation the backend
 * could make without them. */
static cudaError_t dev_malloc(cuda_backend *c, void **p, size_t n)
{
    cudaError_t e = cudaMalloc(p, n);
    if (e == cudaErrorMemoryAllocation && c->n_f16 > 0) {
        cudaGetLastError();
        drop_f16(c);
        e = cudaMalloc(p, n);
    }
    if (e == cudaErrorMemoryAllocation && c->n_mmv > 0) {
        cudaGetLastError();
        drop_mmv(c);
        e = cudaMalloc(p, n);
    }
    return e;
}

/* At the first weight_load: the copies' budget out of the memory free now. */
static void decide_f16(cuda_backend *c)
{
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
        cudaGetLastError();
        c->f16_mode = CUDA_F16_PER_CALL;
        return;
    }
    c->f16_free_at_load = free_bytes;
    c->f16_budget = free_bytes / F16_SHARE_DEN * F16_SHARE_NUM;
    c->f16_mode = CUDA_F16_RESIDENT;
}

/* Waits for the kernel that fills a weight's copy p; on a failure frees p
 * and hands the failure to err (-1). */
static int await_copy(cuda_backend *c, void *p, const char *what, luma_err *err)
{
    if (LUMA_CUDA_OK(c)) luma_cuda_fail(c, cudaStreamSynchronize(c->stream), what);
    if (LUMA_CUDA_OK(c)) return 0;
    cudaFree(p);
    return luma_cuda_report(c, err);
}

/* Gives the matrix w (just loaded into slot) its f16 copy while the backend
 * keeps copies. A copy that would take their total past the budget, or that
 * finds no memory, ends the policy instead: all copies are freed, so a
 * model is cached whole or not at all. F16 weights are their own copy; a
 * vector is never multiplied. Fails only when the dequantization does. */
static int keep_f16(cuda_backend *c, luma_weight *w, cuda_weight_copy *slot, luma_err *err)
{
    if (c->f16_mode != CUDA_F16_RESIDENT || w->rows < 2 || w->type == LUMA_F16) return 0;
    if (!LUMA_CUDA_OK(c)) return luma_cuda_report(c, err);
    size_t bytes;
    if (luma_mul_size((size_t)w->rows, (size_t)w->cols, &bytes) ||
        luma_mul_size(bytes, sizeof(__half), &bytes) || bytes > c->f16_budget - c->f16_bytes) {
        drop_f16(c);
        return 0;
    }
    void *h = NULL;
    if (cudaMalloc(&h, bytes) != cudaSuccess) {
        cudaGetLastError();
        drop_f16(c);
        return 0;
    }
    luma_cuda_weight_to_f16(c, w, (__half *)h);
    if (await_copy(c, h, "dequantizing a weight to f16", err)) return -1;
    slot->f16 = h;
    w->dev_f16 = h;
    c->f16_bytes += bytes;
    c->n_f16++;
    return 0;
}

/* Gives a Q6_K, Q4_0, Q5_0, Q8_0, Q4_K or Q5_K matrix its repacked copy for
 * the matrix-vector kernels (luma_cuda_repack): Q6_K in 224 bytes a block
 * against the file's 210, read with 4 loads a lane instead of 11; Q4_0,
 * Q5_0 and Q8_0 as four blocks in the same bytes, read with 8-byte loads
 * instead of 2-byte ones; Q4_K and Q5_K in tiles of 16 rows for mmv_tc,
 * whose loads then read whole lines (Q6_K's tiles follow its other
 * layouts). Where the device has no room for it the weight goes without
 * (the kernels then read the file's layout), and a later allocation that
 * finds the device full frees them all (dev_malloc). */
static int keep_mmv(cuda_backend *c, luma_weight *w, cuda_weight_copy *slot, luma_err *err)
{
    const bool tc = w->type == LUMA_Q4_K || w->type == LUMA_Q5_K;
    if (!c->mmv_on || (w->type == LUMA_Q6_K ? !c->repack_q6k : tc ? !c->repack_tc : !c->repack_x4)) return 0;
    size_t bytes = luma_cuda_mmv_bytes(c, w);
    if (bytes == 0) return 0;
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    luma_cuda_repack(c, w, (uint8_t *)p);
    if (await_copy(c, p, "repacking a weight for the matrix-vector kernels", err)) return -1;
    slot->mmv = p;
    w->dev_mmv = p;
    c->n_mmv++;
    return 0;
}

#define WEIGHT_PAD 16

/* A copy of w's bytes with each head's NEOX pairs (i, i + h / 2) at (2i,
 * 2i + 1) (backend.h, luma_weight.neox_head): rows of row_bytes, or a
 * vector's floats. NULL where w takes none (no neox_head, a head that does
 * not divide it, or LUMA_CUDA_NEOX_PAIRS=0 in the environment, for
 * measuring; read once) or where memory runs out (*oom set). */
static void *pairs_adjacent_copy(const luma_weight *w, size_t row_bytes, bool *oom)
{
    static const int on = luma_cuda_env_digit("LUMA_CUDA_NEOX_PAIRS", 1);
    const int64_t h = w->neox_head, n = w->rows > 1 ? w->rows : w->cols;
    const size_t unit = w->rows > 1 ? row_bytes : sizeof(float);
    *oom = false;
    if (!on || h < 2 || h % 2 != 0 || n % h != 0 || (w->rows == 1 && w->type != LUMA_F32)) return NULL;
    uint8_t *p = (uint8_t *)malloc((size_t)n * unit);
    if (!p) {
        *oom = true;
        return NULL;
    }
    const uint8_t *src = (const uint8_t *)w->host;
    for (int64_t r = 0; r < n; r++) {
        const int64_t head = r / h, i = r % h, to = head * h + (i < h / 2 ? 2 * i : 2 * (i - h / 2) + 1);
        memcpy(p + (size_t)to * unit, src + (size_t)r * unit, unit);
    }
    return p;
}

static int cuda_weight_load(luma_backend *be, luma_weight *w, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (w->rows > 1 && !luma_cuda_matmul_supports(w->type))
        return luma_errf(err, "tensor type %s is not supported by the CUDA backend",
                         luma_type_name(w->type));
    size_t row = luma_row_size(w->type, w->cols), bytes;
    if (row == 0 || w->rows < 1 || luma_mul_size(row, (size_t)w->rows, &bytes))
        return luma_errf(err, "a %s weight of %lld x %lld has no valid size", luma_type_name(w->type),
                         (long long)w->rows, (long long)w->cols);
    if (c->n_weights == c->weights_cap) {
        int32_t cap = c->weights_cap ? 2 * c->weights_cap : 256;
        cuda_weight_copy *list = (cuda_weight_copy *)realloc(c->weights, (size_t)cap * sizeof *list);
        if (!list) return luma_errf(err, "out of memory");
        c->weights = list;
        c->weights_cap = cap;
    }
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess && c->f16_mode == CUDA_F16_UNDECIDED) decide_f16(c);
    /* WEIGHT_PAD zero bytes after the last block: kernels that copy blocks
     * in 16-byte pieces (mmq's tiles of 210-byte Q6_K blocks) may read up to
     * 15 bytes past a weight's end */
    void *d = NULL;
    if (e == cudaSuccess) e = dev_malloc(c, &d, bytes + WEIGHT_PAD);
    if (e == cudaSuccess) e = cudaMemsetAsync((uint8_t *)d + bytes, 0, WEIGHT_PAD, c->stream);
    if (e != cudaSuccess)
        return luma_errf(err, "no GPU memory for a %s weight of %zu MiB: %s", luma_type_name(w->type),
                         bytes >> 20, cudaGetErrorString(e));
    bool oom;
    void *adjacent = pairs_adjacent_copy(w, row, &oom);
    if (oom) {
        cudaFree(d);
        return luma_errf(err, "out of memory");
    }
    e = cudaMemcpyAsync(d, adjacent ? adjacent : w->host, bytes, cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    free(adjacent);
    w->pairs_adjacent = adjacent != NULL;
    if (e != cudaSuccess) {
        cudaFree(d);
        return luma_errf(err, "copying a %s weight to the GPU: %s", luma_type_name(w->type),
                         cudaGetErrorString(e));
    }
    c->buf_gen++;
    cuda_weight_copy *slot = &c->weights[c->n_weights++];
    slot->dev = d;
    slot->f16 = slot->mmv = NULL;
    w->dev = d;
    w->dev_f16 = w->dev_mmv = NULL;
    if (keep_mmv(c, w, slot, err)) return -1;
    return keep_f16(c, w, slot, err);
}

static int cuda_buf_alloc(luma_backend *be, luma_buf *b, int64_t rows, int64_t cols, luma_err *err)
{
    cuda_backend *c = cu(be);
    size_t n;
    if (rows < 0 || cols < 0 || luma_mul_size((size_t)rows, (size_t)cols, &n) ||
        n > SIZE_MAX / sizeof(float))
        return luma_errf(err, "activation buffer of %lld x %lld is too large", (long long)rows,
                         (long long)cols);
    void *d = NULL;
    size_t bytes = (n ? n : 1) * sizeof(float);
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess) e = dev_malloc(c, &d, bytes);
    if (e == cudaSuccess) e = cudaMemsetAsync(d, 0, bytes, c->stream);
    if (e != cudaSuccess) {
        cudaFree(d);
        return luma_errf(err, "no GPU memory for a %lld x %lld activation buffer: %s", (long long)rows,
                         (long long)cols, cudaGetErrorString(e));
    }
    c->buf_gen++;
    b->data = (float *)d;
    b->rows = rows;
    b->cols = cols;
    b->cap = (int64_t)n;
    return 0;
}

static void cuda_buf_free(luma_backend *be, luma_buf *b)
{
    cu(be)->buf_gen++;
    free_after_stream(cu(be), b->data);
    memset(b, 0, sizeof *b);
}

static int cuda_buf_read(luma_backend *be, const luma_buf *b, float *dst, luma_err *err)
{
    cuda_backend *c = cu(be);
    flush_all(c);
    size_t bytes = (size_t)b->rows * (size_t)b->cols * sizeof(float);
    if (LUMA_CUDA_OK(c) && bytes)
        luma_cuda_fail(c, cudaMemcpyAsync(dst, b->data, bytes, cudaMemcpyDeviceToHost, c->stream),
                       "reading an activation buffer");
    if (LUMA_CUDA_OK(c)) luma_cuda_fail(c, cudaStreamSynchronize(c->stream), "reading an activation buffer");
    return LUMA_CUDA_OK(c) ? 0 : luma_cuda_report(c, err);
}

static int cuda_kv_alloc(luma_backend *be, const luma_kv_layout *l, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (l->type != LUMA_F16 && l->type != LUMA_F32)
        return luma_errf(err, "KV cache type %s: the CUDA backend stores F16 or F32", luma_type_name(l->type));
    if (l->n_pools < 1 || l->n_pools > LUMA_KV_MAX_POOLS || l->block_tokens < 1 || l->n_kv_head < 1)
        return luma_errf(err, "invalid KV cache layout");
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) return luma_errf(err, "selecting the GPU: %s", cudaGetErrorString(e));
    if (luma_cuda_attention_setup(l, err)) return -1;
    for (int p = 0; p < LUMA_KV_MAX_POOLS; p++) {
        free_after_stream(c, c->kv_mem[p]);
        c->kv_mem[p] = NULL;
        c->kv_block_bytes[p] = 0;
    }
    c->kvl = *l;
    c->buf_gen++;
    /* K [n_kv_head][block_tokens][head_dim_k] then V, per layer of the pool */
    size_t layer = (size_t)l->block_tokens * luma_kv_token_bytes(l);
    for (int p = 0; p < l->n_pools && e == cudaSuccess; p++) {
        size_t block, total;
        if (l->n_layers[p] < 0 || l->n_blocks[p] < 0 ||
            luma_mul_size(layer, (size_t)l->n_layers[p], &block) ||
            luma_mul_size(block, (size_t)l->n_blocks[p], &total))
            return luma_errf(err, "KV cache pool %d is too large", p);
        c->kv_block_bytes[p] = block;
        void *mem = NULL;
        e = dev_malloc(c, &mem, total ? total : 1);
        if (e != cudaSuccess)
            return luma_errf(err, "no GPU memory for the KV cache (%zu MiB in pool %d): %s", total >> 20, p,
                             cudaGetErrorString(e));
        c->kv_mem[p] = (uint8_t *)mem;
        /* Slots never written still hold finite values. */
        e = cudaMemsetAsync(c->kv_mem[p], 0, total ? total : 1, c->stream);
    }
    if (e != cudaSuccess) return luma_errf(err, "allocating the KV cache: %s", cudaGetErrorString(e));
    return 0;
}

static void cuda_kv_copy_block(luma_backend *be, int pool, int32_t src, int32_t dst)
{
    cuda_backend *c = cu(be);
    flush_all(c);
    if (!LUMA_CUDA_OK(c)) return;
    size_t bb = c->kv_block_bytes[pool];
    luma_cuda_fail(c, cudaMemcpyAsync(c->kv_mem[pool] + (size_t)dst * bb, c->kv_mem[pool] + (size_t)src * bb,
                                      bb, cudaMemcpyDeviceToDevice, c->stream),
                   "copying a KV block");
}

/* The device-to-device copy rate (luma_backend_ops.copy_rate): cudaMemcpy
 * between two buffers of its own, timed by events on the stream. An
 * allocation that fails is reported and leaves the backend as it was. */
static int cuda_copy_rate(luma_backend *be, size_t bytes, int reps, double *rate, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (bytes < 1 || reps < 1) return luma_errf(err, "copy rate: %zu bytes, %d copies", bytes, reps);
    if (c->capturing) return luma_errf(err, "copy rate: a step is being recorded");
    flush_all(c);
    if (!LUMA_CUDA_OK(c)) return luma_cuda_report(c, err);
    void *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaError_t e = cudaMalloc(&a, bytes);
    if (e == cudaSuccess) e = cudaMalloc(&b, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();   /* an allocation's failure is not the stream's */
        cudaFree(a);
        return luma_errf(err, "copy rate: two buffers of %zu bytes: %s", bytes, cudaGetErrorString(e));
    }
    double best = 0.0;
    e = cudaEventCreate(&e0);
    if (e == cudaSuccess) e = cudaEventCreate(&e1);
    /* both written once, so no page is first touched by a timed copy */
    if (e == cudaSuccess) e = cudaMemsetAsync(a, 1, bytes, c->stream);
    if (e == cudaSuccess) e = cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, c->stream);
    for (int i = 0; i < reps && e == cudaSuccess; i++) {
        e = cudaEventRecord(e0, c->stream);
        if (e == cudaSuccess) e = cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice,
                                                  c->stream);
        if (e == cudaSuccess) e = cudaEventRecord(e1, c->stream);
        if (e == cudaSuccess) e = cudaEventSynchronize(e1);
        float ms = 0.0f;
        if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
        if (e == cudaSuccess && ms > 0.0f && 2.0 * (double)bytes / (ms * 1e-3) > best)
            best = 2.0 * (double)bytes / (ms * 1e-3);
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    free_after_stream(c, a);
    cudaFree(b);
    if (e != cudaSuccess) return luma_errf(err, "copy rate: %s", cudaGetErrorString(e));
    *rate = best;
    return 0;
}

/* ---- the step upload ---------------------------------------------------- */

/* Offsets, in int32 entries, of the step's arrays inside the upload. */
typedef struct step_plan {
    size_t tokens, pos, out_rows, row_seq, seq_row0, seq_nrows, seq_pos0;
    size_t block_off, block_n, dec_rows, tiles, blocks, total;
} step_plan;

static int plan_step(const cuda_backend *c, const luma_step *s, step_plan *p, int32_t *n_dec,
                     int32_t *n_tiles, luma_err *err)
{
    if (s->n_rows < 0 || s->n_seqs < 0 || s->n_out < 0 || s->n_out > s->n_rows)
        return luma_errf(err, "step of %d rows, %d sequences and %d out rows is inconsistent", s->n_rows,
                         s->n_seqs, s->n_out);
    int np = c->kvl.n_pools;
    size_t blocks = 0, dec = 0, tiles = 0, covered = 0;
    for (int32_t i = 0; i < s->n_seqs; i++) {
        const luma_step_seq *q = &s->seqs[i];
        if (q->row0 < 0 || q->n_rows < 0 || q->row0 > s->n_rows - q->n_rows || q->pos0 < 0 ||
            q->pos0 > INT32_MAX - q->n_rows)
            return luma_errf(err, "step sequence %d covers rows [%d, %d + %d) of %d", i, q->row0, q->row0,
                             q->n_rows, s->n_rows);
        for (int p = 0; p < np; p++) {
            if (q->n_blocks[p] < 0) return luma_errf(err, "step sequence %d has a negative block count", i);
            blocks += (size_t)q->n_blocks[p];
        }
        if (luma_cuda_prefill_rows(c, q->n_rows))
            tiles += ((size_t)q->n_rows + LUMA_CUDA_ATTN_TILE - 1) / LUMA_CUDA_ATTN_TILE;
        else
            dec += (size_t)q->n_rows;
        covered += (size_t)q->n_rows;
    }
    if (covered != (size_t)s->n_rows)
        return luma_errf(err, "the step's sequences cover %zu rows, not its %d", covered, s->n_rows);
    size_t R = (size_t)s->n_rows, S = (size_t)s->n_seqs, at = 0;
    p->tokens = at; at += R;
    p->pos = at; at += R;
    p->out_rows = at; at += (size_t)s->n_out;
    p->row_seq = at; at += R;
    p->seq_row0 = at; at += S;
    p->seq_nrows = at; at += S;
    p->seq_pos0 = at; at += S;
    p->block_off = at; at += (size_t)np * S;
    p->block_n = at; at += (size_t)np * S;
    p->dec_rows = at; at += dec;
    p->tiles = at; at += 2 * tiles;
    p->blocks = at; at += blocks;
    p->total = at;
    if (at > (size_t)INT32_MAX) return luma_errf(err, "step metadata is too large");
    *n_dec = (int32_t)dec;
    *n_tiles = (int32_t)tiles;
    return 0;
}

/* Grows the pinned staging buffer and the device arena to hold bytes. */
static int reserve_step(cuda_backend *c, size_t bytes, luma_err *err)
{
    if (bytes > c->stage_cap) {
        cudaEventSynchronize(c->staged);
        cudaFreeHost(c->host_stage);
        c->host_stage = NULL;
        c->stage_cap = 0;
        size_t cap = bytes < 65536 ? 65536 : 2 * bytes;
        cudaError_t e = cudaMallocHost(&c->host_stage, cap);
        if (e != cudaSuccess) {
            c->host_stage = NULL;
            return luma_errf(err, "no pinned host memory for the step upload: %s", cudaGetErrorString(e));
        }
        c->stage_cap = cap;
    }
    if (bytes > c->step_cap) {
        free_after_stream(c, c->step_mem);
        c->step_mem = NULL;
        c->step_cap = 0;
        cudaError_t e = cudaMalloc(&c->step_mem, c->stage_cap);
        if (e != cudaSuccess) {
            c->step_mem = NULL;
            return luma_errf(err, "no GPU memory for the step metadata: %s", cudaGetErrorString(e));
        }
        c->step_cap = c->stage_cap;
    }
    return 0;
}

static int cuda_step_begin(luma_backend *be, const luma_step *s, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (!LUMA_CUDA_OK(c)) return luma_cuda_report(c, err);
    step_plan p;
    int32_t n_dec, n_tiles;
    if (plan_step(c, s, &p, &n_dec, &n_tiles, err) || reserve_step(c, p.total * sizeof(int32_t), err))
        return -1;
    /* The previous upload must be out of the staging buffer before it is rewritten. */
    if (luma_cuda_fail(c, cudaEventSynchronize(c->staged), "waiting for the last step upload"))
        return luma_cuda_report(c, err);
    int32_t *h = (int32_t *)c->host_stage;
    int32_t R = s->n_rows, S = s->n_seqs, np = c->kvl.n_pools;
    int32_t max_pos = 0, dec_max_pos = 0;
    bool dec_chunks = false;
    memcpy(h + p.tokens, s->tokens, (size_t)R * sizeof(int32_t));
    memcpy(h + p.pos, s->pos, (size_t)R * sizeof(int32_t));
    memcpy(h + p.out_rows, s->out_rows, (size_t)s->n_out * sizeof(int32_t));
    for (int32_t r = 0; r < R; r++) {
        h[p.row_seq + r] = -1;
        if (s->pos[r] < 0) return luma_errf(err, "step row %d has position %d", r, s->pos[r]);
        if (s->pos[r] + 1 > max_pos) max_pos = s->pos[r] + 1;
    }
    for (int32_t j = 0; j < s->n_out; j++)
        if (s->out_rows[j] < 0 || s->out_rows[j] >= R)
            return luma_errf(err, "step out row %d is %d, outside [0, %d)", j, s->out_rows[j], R);
    size_t blk = p.blocks, dec = p.dec_rows, tile = p.tiles;
    for (int32_t i = 0; i < S; i++) {
        const luma_step_seq *q = &s->seqs[i];
        for (int32_t r = q->row0; r < q->row0 + q->n_rows; r++) {
            if (h[p.row_seq + r] != -1) return luma_errf(err, "step row %d belongs to two sequences", r);
            h[p.row_seq + r] = i;
            /* the kernels index the block tables by position */
            for (int pool = 0; pool < np; pool++)
                if (s->pos[r] / c->kvl.block_tokens >= q->n_blocks[pool])
                    return luma_errf(err, "step row %d at position %d is past the %d blocks of its table in pool %d",
                                     r, s->pos[r], q->n_blocks[pool], pool);
        }
        h[p.seq_row0 + i] = q->row0;
        h[p.seq_nrows + i] = q->n_rows;
        h[p.seq_pos0 + i] = q->pos0;
        for (int pool = 0; pool < np; pool++) {
            h[p.block_off + (size_t)pool * S + i] = (int32_t)(blk - p.blocks);
            h[p.block_n + (size_t)pool * S + i] = q->n_blocks[pool];
            if (q->n_blocks[pool] > 0)
                memcpy(h + blk, q->blocks[pool], (size_t)q->n_blocks[pool] * sizeof(int32_t));
            blk += (size_t)q->n_blocks[pool];
        }
        if (luma_cuda_prefill_rows(c, q->n_rows)) {
            for (int32_t t = 0; t < q->n_rows; t += LUMA_CUDA_ATTN_TILE) {
                h[tile++] = i;
                h[tile++] = t;
            }
        } else {
            dec_chunks = dec_chunks || q->n_rows > 1;
            for (int32_t r = q->row0; r < q->row0 + q->n_rows; r++) {
                h[dec++] = r;
                if (s->pos[r] + 1 > dec_max_pos) dec_max_pos = s->pos[r] + 1;
            }
        }
    }
    int32_t *d = (int32_t *)c->step_mem;
    if (luma_cuda_fail(c, cudaMemcpyAsync(d, h, p.total * sizeof(int32_t), cudaMemcpyHostToDevice, c->stream),
                       "uploading the step") ||
        luma_cuda_fail(c, cudaEventRecord(c->staged, c->stream), "uploading the step"))
        return luma_cuda_report(c, err);
    cuda_step *cs = &c->step;
    cs->host = s;
    cs->n_rows = R;
    cs->n_seqs = S;
    cs->n_out = s->n_out;
    cs->tokens = d + p.tokens;
    cs->pos = d + p.pos;
    cs->out_rows = d + p.out_rows;
    cs->row_seq = d + p.row_seq;
    cs->seq_row0 = d + p.seq_row0;
    cs->seq_nrows = d + p.seq_nrows;
    cs->seq_pos0 = d + p.seq_pos0;
    cs->blocks = d + p.blocks;
    cs->block_off = d + p.block_off;
    cs->block_n = d + p.block_n;
    cs->max_pos = max_pos;
    cs->n_dec = n_dec;
    cs->n_tiles = n_tiles;
    cs->dec_rows = d + p.dec_rows;
    cs->tiles = d + p.tiles;
    cs->dec_max_pos = dec_max_pos;
    cs->dec_chunks = dec_chunks;
    cs->dec_keys_bound = 128;
    while (cs->dec_keys_bound < dec_max_pos) cs->dec_keys_bound *= 2;
    return 0;
}

const int32_t *luma_cuda_step_array(cuda_backend *c, const int32_t *host, int32_t n, const char *op)
{
    const luma_step *s = c->step.host;
    uintptr_t at = (uintptr_t)host, end = at + (size_t)(n > 0 ? n : 0) * sizeof(int32_t);
    struct { const int32_t *h; int32_t *d; int32_t n; } arrays[3];
    if (s) {
        arrays[0] = { s->tokens, c->step.tokens, s->n_rows };
        arrays[1] = { s->pos, c->step.pos, s->n_rows };
        arrays[2] = { s->out_rows, c->step.out_rows, s->n_out };
        for (int i = 0; i < 3; i++) {
            uintptr_t lo = (uintptr_t)arrays[i].h, hi = lo + (size_t)arrays[i].n * sizeof(int32_t);
            if (n >= 0 && at >= lo && end <= hi) return arrays[i].d + (host - arrays[i].h);
        }
    }
    luma_cuda_failf(c, "%s: the row indices are not the current step's (was step_begin called?)", op);
    return NULL;
}

/* ---- CUDA graphs of decode steps ------------------------------------------ */

/* The shape of a step whose operations can be recorded: decode rows only
 * (no prefill tiles), so that every launch depends on (rows, sequences, out
 * rows, the bucket of context lengths). 0 for a step that runs eagerly. */
static uint64_t graph_key(const cuda_backend *c)
{
    const cuda_step *st = &c->step;
    if (!c->graphs_on || st->n_tiles > 0 || st->n_rows < 1 || st->n_rows > 4096 || st->n_seqs > 4096 ||
        st->n_out > 4096)
        return 0;
    int lg = 0;
    while ((1 << lg) < st->dec_keys_bound) lg++;
    return (uint64_t)st->n_rows | (uint64_t)st->n_seqs << 13 | (uint64_t)st->n_out << 26 |
           (uint64_t)lg << 39 | (uint64_t)1 << 63;
}

/* Where the buffers a recording names are: any that moved since makes it stale. */
static uint64_t graph_where(const cuda_backend *c)
{
    uint64_t h = 1469598103934665603ull;
    uint64_t v[] = { (uint64_t)(uintptr_t)c->step_mem, (uint64_t)(uintptr_t)c->scratch, (uint64_t)(uintptr_t)c->side_scratch,
                     (uint64_t)(uintptr_t)c->attn_scratch.mem, (uint64_t)(uintptr_t)c->sk_scratch.mem, c->buf_gen, (uint64_t)c->f16_mode,
                     (uint64_t)c->n_f16, (uint64_t)c->mmv_on, (uint64_t)c->prog_on, (uint64_t)c->normq_on,
                     (uint64_t)c->attnq_on };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) h = (h ^ v[i]) * 1099511628211ull;
    return h;
}

static void graph_drop(cuda_graph *g)
{
    if (g->exec) cudaGraphExecDestroy(g->exec);
    memset(g, 0, sizeof *g);
}

/* The slot of key: its own, else a free one, else the least recently used. */
static cuda_graph *graph_slot(cuda_backend *c, uint64_t key)
{
    cuda_graph *lru = &c->graphs[0];
    for (int i = 0; i < c->graph_slots; i++) {
        cuda_graph *g = &c->graphs[i];
        if (g->key == key) return g;
        if (g->key == 0 || g->used < lru->used) lru = g;
        if (g->key == 0) break;
    }
    graph_drop(lru);
    lru->key = key;
    return lru;
}

/* forward(ctx) with the step's operations of one row collected into
 * programs (program.cu), the last one queued before it returns. */
static int run_forward(cuda_backend *c, int (*forward)(void *, luma_err *), void *ctx, luma_err *err)
{
    /* every forward makes its rotations' angles at its own first launches
     * (mmv_heads): a recording that failed part way ran none of its own,
     * and the eager run or the recording after it must not read them */
    c->n_angles = 0;
    c->in_step = true;
    int rc = forward(ctx, err);
    flush_all(c);
    c->in_step = false;
    return rc;
}

/* Records forward(ctx) into g. On failure nothing has run: the caller runs
 * the step eagerly. */
static bool graph_record(cuda_backend *c, cuda_graph *g, int (*forward)(void *, luma_err *), void *ctx)
{
    luma_err ignored;
    uint64_t where = graph_where(c);
    cudaGraph_t graph = NULL;
    if (cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    c->capturing = true;
    int rc = run_forward(c, forward, ctx, &ignored);
    c->capturing = false;
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    bool ok = rc == 0 && e == cudaSuccess && LUMA_CUDA_OK(c) && graph_where(c) == where;
    cudaGraphExec_t exec = NULL;
    if (ok) ok = cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    if (graph) cudaGraphDestroy(graph);
    if (!ok) {
        cudaGetLastError();
        c->failure[0] = 0;   /* nothing ran; the eager run reports real failures */
        c->n_rec_failed++;
        return false;
    }
    if (g->exec) cudaGraphExecDestroy(g->exec);
    g->exec = exec;
    g->where = where;
    c->n_recorded++;
    return true;
}

static int cuda_step_run(luma_backend *be, const luma_step *step, int (*forward)(void *ctx, luma_err *err),
                         void *ctx, luma_err *err)
{
    cuda_backend *c = cu(be);
    if (c->step.host != step) return luma_errf(err, "step_run: step_begin was not called for this step");
    uint64_t key = graph_key(c);
    if (key == 0) return run_forward(c, forward, ctx, err);
    cuda_graph *g = graph_slot(c, key);
    g->used = ++c->n_steps;
    if (g->exec && g->where != graph_where(c)) {
        cudaGraphExecDestroy(g->exec);
        g->exec = NULL;
    }
    if (!g->exec) {
        /* a recording that fails (a scratch buffer must grow) runs eagerly */
        const int after = c->step.dec_chunks && c->graph_after < 1 ? 1 : c->graph_after;
        if (g->failures >= CUDA_GRAPH_TRIES || !LUMA_CUDA_OK(c) || g->seen++ < after)
            return run_forward(c, forward, ctx, err);
        if (!graph_record(c, g, forward, ctx)) {
            g->failures++;
            const int rc = run_forward(c, forward, ctx, err);
            /* the buffer that had to grow has grown in the eager run:
             * recorded now, the next step of the shape replays instead of
             * recording (a long prompt's first decode steps, whose
             * attention splits grow its scratch, no longer pay for a
             * recording on their second step) */
            if (rc == 0 && LUMA_CUDA_OK(c) && g->failures < CUDA_GRAPH_TRIES) graph_record(c, g, forward, ctx);
            return rc;
        }
    }
    if (luma_cuda_fail(c, cudaGraphLaunch(g->exec, c->stream), "replaying a recorded decode step"))
        return luma_cuda_report(c, err);
    c->n_replays++;
    return 0;
}

static void cuda_warmed(luma_backend *be)
{
    cuda_backend *c = cu(be);
    for (int i = 0; i < CUDA_GRAPHS; i++) graph_drop(&c->graphs[i]);
    c->n_steps = 0;
    c->n_recorded = c->n_replays = c->n_rec_failed = 0;
}

/* How many steps have been recorded, and replayed (for the tests). */
extern "C" void luma_cuda_graph_counts(luma_backend *be, long long *recorded, long long *replays)
{
    *recorded = (long long)cu(be)->n_recorded;
    *replays = (long long)cu(be)->n_replays;
}

/* How many recordings were given up and the step run eagerly (for the tests). */
extern "C" long long luma_cuda_graph_failures(luma_backend *be)
{
    return (long long)cu(be)->n_rec_failed;
}

/* ---- operations kept here ----------------------------------------------- */

static void cuda_matmul(luma_backend *be, const luma_weight *w, const luma_buf *x, luma_buf *y)
{
    cuda_backend *c = cu(be);
    luma_buf *const ys[1] = { y };
    if (luma_cuda_prog_matmul(c, 1, &w, x, ys)) return;
    luma_cuda_prog_flush(c);
    if (LUMA_CUDA_OK(c)) luma_cuda_matmul(c, w, x->data, x->rows, y->data);
    y->rows = x->rows;
    y->cols = w->rows;
}

static void cuda_attention(luma_backend *be, const luma_buf *q, const luma_buf *k, const luma_buf *v,
                           const luma_step *step, const luma_attn *a, luma_buf *out)
{
    flush_all(cu(be));
    if (luma_cuda_attn_pend(cu(be), q, k, v, step, a, out)) return;
    luma_cuda_attention(cu(be), q, k, v, step, a, out);
}

static int cuda_sync(luma_backend *be, luma_err *err)
{
    cuda_backend *c = cu(be);
    flush_all(c);
    if (c->capturing) return LUMA_CUDA_OK(c) ? 0 : -1;   /* step_run reports it */
    luma_cuda_fail(c, cudaStreamSynchronize(c->stream), "the step's kernels");
    return LUMA_CUDA_OK(c) ? 0 : luma_cuda_report(c, err);
}

#ifdef LUMA_CUDA_TRACE
#include "launch.cuh"   /* LUMA_TRACE_MAX */

extern "C" {
void luma_cuda_trace_bind_attention(unsigned long long *p);
void luma_cuda_trace_bind_logits(unsigned long long *p);
void luma_cuda_trace_bind_matmul(unsigned long long *p);
void luma_cuda_trace_bind_mmq(unsigned long long *p);
void luma_cuda_trace_bind_ops(unsigned long long *p);
void luma_cuda_trace_bind_tall(unsigned long long *p);
}
static unsigned long long *trace_dev;

static void trace_bind(unsigned long long *p)
{
    luma_cuda_trace_bind_attention(p);
    luma_cuda_trace_bind_logits(p);
    luma_cuda_trace_bind_matmul(p);
    luma_cuda_trace_bind_mmq(p);
    luma_cuda_trace_bind_ops(p);
    luma_cuda_trace_bind_tall(p);
}

static void trace_start(void)
{
    const size_t bytes = (1 + 4 * (size_t)LUMA_TRACE_MAX) * sizeof(unsigned long long);
    if (trace_dev || cudaMalloc((void **)&trace_dev, bytes) != cudaSuccess) return;
    cudaMemset(trace_dev, 0, bytes);
    trace_bind(trace_dev);
}

static void trace_write(void)
{
    const char *path = getenv("LUMA_CUDA_TRACE_FILE");
    unsigned long long n = 0;
    if (!trace_dev || cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(&n, trace_dev, sizeof n, cudaMemcpyDeviceToHost) != cudaSuccess)
        return;
    n = n < LUMA_TRACE_MAX ? n : LUMA_TRACE_MAX;
    unsigned long long *h = (unsigned long long *)malloc((size_t)(4 * n + 1) * sizeof *h);
    FILE *f = path ? fopen(path, "a") : NULL;
    if (h && f && cudaMemcpy(h, trace_dev + 1, (size_t)(4 * n) * sizeof *h, cudaMemcpyDeviceToHost) == cudaSuccess)
        for (unsigned long long i = 0; i < n; i++) {
            const unsigned long long *r = h + 4 * i;
            fprintf(f, "@T %llu %llu %llu %llu %llu %llu\n", r[0], r[1], r[2] >> 32, r[2] & 0xffffffffu, r[3] >> 32,
                    r[3] & 0xffffffffu);
        }
    if (f) fclose(f);
    free(h);
    cudaMemset(trace_dev, 0, sizeof n);
}
#endif

static void cuda_free(luma_backend *be)
{
#ifdef LUMA_CUDA_TRACE
    trace_write();
#endif
    cuda_backend *c = cu(be);
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->stream) cudaStreamSynchronize(c->stream);
    for (int32_t i = 0; i < c->n_weights; i++) {
        cudaFree(c->weights[i].dev);
        cudaFree(c->weights[i].f16);
        cudaFree(c->weights[i].mmv);
    }
    free(c->weights);
    luma_cuda_prog_free(c);
    for (int i = 0; i < CUDA_GRAPHS; i++) graph_drop(&c->graphs[i]);
    cudaFree(c->cublas_ws);
    cudaFree(c->side_ws);
    cudaFree(c->tab_dev);
    cudaFreeHost(c->tab_host);
    free(c->tab_k);
    cudaFree(c->side_scratch);
    for (int p = 0; p < LUMA_KV_MAX_POOLS; p++) cudaFree(c->kv_mem[p]);
    cudaFree(c->step_mem);
    cudaFree(c->scratch);
    cudaFree(c->attn_scratch.mem);
    cudaFree(c->sk_scratch.mem);
    cudaFree(c->topk_mem);
    cudaFree(c->draw_mem);
    cudaFree(c->chain_key);
    cudaFree(c->chain_parts);
    cudaFree(c->angles);
    free(c->angle_args);
    cudaFree(c->chain_hist);
    if (c->staged) cudaEventSynchronize(c->staged);
    cudaFreeHost(c->host_stage);
    cudaFreeHost(c->host_results);
    cudaFreeHost(c->chain_host);
    if (c->chain_ev) cudaEventDestroy(c->chain_ev);
    if (c->staged) cudaEventDestroy(c->staged);
    luma_cuda_lt_free(c);
    if (c->cublas) cublasDestroy(c->cublas);
    if (c->fork_ev) cudaEventDestroy(c->fork_ev);
    if (c->join_ev) cudaEventDestroy(c->join_ev);
    if (c->side) cudaStreamDestroy(c->side);
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
}

/* ys[i] shaped as ws[i] x (x->rows by ws[i]->rows), their data into y. */
static void many_outputs(int n, const luma_weight *const *ws, const luma_buf *x, luma_buf *const *ys, float **y)
{
    for (int i = 0; i < n && i < LUMA_MATMUL_MANY; i++) {
        y[i] = ys[i]->data;
        ys[i]->rows = x->rows;
        ys[i]->cols = ws[i]->rows;
    }
}

static void cuda_matmul_many(luma_backend *be, int n, const luma_weight *const *ws, const luma_buf *x,
                             luma_buf *const *ys)
{
    cuda_backend *c = cu(be);
    if (luma_cuda_prog_matmul(c, n, ws, x, ys)) return;
    luma_cuda_prog_flush(c);
    float *y[LUMA_MATMUL_MANY];
    many_outputs(n, ws, x, ys, y);
    if (LUMA_CUDA_OK(c)) luma_cuda_matmul_many(c, n, ws, x->data, x->rows, y);
}

static void cuda_gated_matmul(luma_backend *be, const luma_weight *w, luma_buf *gate, const luma_buf *up, int act,
                              luma_buf *y)
{
    cuda_backend *c = cu(be);
    if (luma_cuda_prog_gated(c, w, gate, up, act, y)) return;
    flush_all(c);
    if (up->rows != gate->rows || up->cols != gate->cols || gate->cols != w->cols)
        luma_cuda_failf(c, "gated_matmul: gate %lld x %lld, up %lld x %lld, weight of %lld columns",
                        (long long)gate->rows, (long long)gate->cols, (long long)up->rows, (long long)up->cols,
                        (long long)w->cols);
    if (!LUMA_CUDA_OK(c) || !luma_cuda_gated_matmul(c, w, gate->data, up->data, act, gate->rows, y->data)) {
        if (act == LUMA_ACT_GELU) luma_cuda_gelu_mul(be, gate, up);
        else luma_cuda_silu_mul(be, gate, up);
        cuda_matmul(be, w, gate, y);
        return;
    }
    y->rows = gate->rows;
    y->cols = w->rows;
}

/* gate and up, then the down of act(gate) * up, where luma_cuda_ffn fuses
 * them (one row); false, doing nothing, elsewhere: the forward then runs
 * matmul_many and gated_matmul. Programs take those calls themselves. */
static bool cuda_ffn(luma_backend *be, const luma_weight *const *w, int act, const luma_buf *x, luma_buf *gate,
                     luma_buf *up, luma_buf *y)
{
    cuda_backend *c = cu(be);
    if (luma_cuda_prog_active(c) || !LUMA_CUDA_OK(c) || x->rows != 1 || w[0]->cols != x->cols ||
        w[1]->cols != x->cols || w[0]->rows != w[1]->rows || w[2]->cols != w[0]->rows)
        return false;
    luma_cuda_prog_flush(c);
    if (!luma_cuda_ffn(c, w, act, x->data, x->rows, gate->data, up->data, y->data)) return false;
    gate->rows = up->rows = y->rows = x->rows;
    gate->cols = up->cols = w[0]->rows;
    y->cols = w[2]->rows;
    return true;
}

/* What qkv_rope's products left to do: the bias of each output whose bit
 * (q 1, k 2, v 4) is clear in done, and the norms and rotation of q and k
 * where clear; one launch when the products did nothing. */
static void qkv_rest(luma_backend *be, luma_buf *const *ys, const luma_qkv *p, int32_t head_dim, const int32_t *pos,
                     const luma_rope *r, int done)
{
    const luma_weight *const *b = p->b, *g[2] = { p->gq, p->gk };
    if (done == 0 && !p->gq && (b[0] || b[1] || b[2])) {
        luma_cuda_qkv_bias_rope(be, ys[0], ys[1], ys[2], b[0], b[1], b[2], head_dim, pos, r);
        return;
    }
    if (done == 0) {
        for (int i = 0; i < 3; i++)
            if (b[i]) luma_cuda_add_bias(be, ys[i], b[i]);
        luma_cuda_qk_rope(be, ys[0], ys[1], p->gq, p->gk, head_dim, p->eps, pos, r);
        return;
    }
    for (int i = 0; i < 3; i++) {
        if (done >> i & 1) continue;
        if (b[i]) luma_cuda_add_bias(be, ys[i], b[i]);
        if (i < 2 && g[i]) luma_cuda_rmsnorm(be, ys[i], g[i], head_dim, p->eps, ys[i]);
        if (i < 2) luma_cuda_rope(be, ys[i], head_dim, pos, r);
    }
}

/* q, k, v plus their biases, with q and k rotated where the direct
 * matrix-vector kernel writes them (RoPE NORM over whole heads, 8-bit
 * activations, decode row counts), or normalized and rotated where a CTA
 * makes a whole head (Gemma 3's norms at one row: mmv_heads); what the
 * products did not do, qkv_rest does. Where weight_load stored q's and k's
 * NEOX pairs adjacent, their rotation is NORM over the stored order, and
 * every call is taken here. */
static bool cuda_qkv_rope(luma_backend *be, const luma_qkv *p, const luma_buf *x, luma_buf *const *ys,
                          int32_t head_dim, const int32_t *pos, const luma_rope *r)
{
    cuda_backend *c = cu(be);
    /* LUMA_CUDA_QKV_ROPE=0 in the environment: separate products and
     * rotation (for measuring); read once */
    static const bool off = env_off("LUMA_CUDA_QKV_ROPE");
    const luma_weight *const *ws = p->w, *const *b = p->b;
    const bool adjacent = ws[0]->pairs_adjacent || ws[1]->pairs_adjacent;
    luma_rope norm;
    if (adjacent) {
        if (!ws[0]->pairs_adjacent || !ws[1]->pairs_adjacent || r->kind != LUMA_ROPE_NEOX ||
            r->n_dims != head_dim || ws[0]->neox_head != head_dim || (b[0] && !b[0]->pairs_adjacent) ||
            (b[1] && !b[1]->pairs_adjacent) || p->gq) {
            luma_cuda_failf(c, "qkv_rope: q's and k's weights and biases were not all stored with their RoPE "
                               "pairs adjacent for heads of %d",
                            (int)head_dim);
            return true;
        }
        norm = *r;
        norm.kind = LUMA_ROPE_NORM;
        r = &norm;
    }
    const bool biased = b[0] || b[1] || b[2];
    if (!biased && !p->gq && luma_cuda_prog_qkv_rope(c, ws, x, ys, head_dim, pos, r)) return true;
    luma_cuda_prog_flush(c);
    /* the rotation by the direct kernels needs NORM pairs; the norms need
     * mmv_heads, which takes one row and either pairing */
    const bool take = p->gq ? p->gk && x->rows == 1 : r->kind == LUMA_ROPE_NORM && x->rows <= luma_cuda_qkv_rope_max_m();
    if (off || !take || r->n_dims != head_dim || c->float_act || !LUMA_CUDA_OK(c)) {
        if (!adjacent) return false;
        cuda_matmul_many(be, 3, ws, x, ys);
        flush_all(c);   /* the products may have gone into a program */
        qkv_rest(be, ys, p, head_dim, pos, r, 0);
        return true;
    }
    float *y[3];
    many_outputs(3, ws, x, ys, y);
    rope_args a;
    const int32_t *d_pos = NULL;
    if (!luma_cuda_rope_args(c, r, head_dim, ws[0]->rows, &a) ||
        !(d_pos = luma_cuda_step_array(c, pos, (int32_t)x->rows, "rope")))
        return true;   /* recorded: sync reports it */
    const float *bd[3];
    for (int i = 0; i < 3; i++) bd[i] = b[i] ? (const float *)b[i]->dev : NULL;
    int done = luma_cuda_matmul_qkv_rope(c, ws, bd, p->gq ? (const float *)p->gq->dev : NULL,
                                         p->gk ? (const float *)p->gk->dev : NULL, p->eps, x->data, x->rows, y,
                                         head_dim, &a, d_pos);
    qkv_rest(be, ys, p, head_dim, pos, r, done);
    return true;
}

/* The other operations of a step: into the open program, or after it. */
static void cuda_embed(luma_backend *be, const luma_weight *w, const int32_t *ids, int32_t n, float scale,
                       luma_buf *out)
{
    flush_all(cu(be));
    luma_cuda_embed(be, w, ids, n, scale, out);
}

static void cuda_gather(luma_backend *be, const luma_buf *x, const int32_t *rows, int32_t n, luma_buf *out)
{
    flush_all(cu(be));
    luma_cuda_gather(be, x, rows, n, out);
}

static void cuda_add_bias(luma_backend *be, luma_buf *x, const luma_weight *b)
{
    flush_all(cu(be));
    luma_cuda_add_bias(be, x, b);
}

static void cuda_rmsnorm(luma_backend *be, const luma_buf *x, const luma_weight *g, int64_t group, float eps,
                         luma_buf *out)
{
    if (luma_cuda_prog_rmsnorm(cu(be), x, g, group, eps, out)) return;
    flush_all(cu(be));
    /* a whole row's norm waits for the next product's quantizer, as the
     * residual norms do (the first layer's, after the embedding) */
    if (group == x->cols && luma_cuda_norm_pend(cu(be), (luma_buf *)x, NULL, NULL, g, eps, out)) return;
    luma_cuda_rmsnorm(be, x, g, group, eps, out);
}

static void cuda_add_rmsnorm(luma_backend *be, luma_buf *x, const luma_buf *y, const luma_weight *yg,
                             const luma_weight *g, float eps, luma_buf *out)
{
    if (luma_cuda_prog_add_rmsnorm(cu(be), x, y, yg, g, eps, out)) return;
    flush_all(cu(be));
    if (luma_cuda_norm_pend(cu(be), x, y, yg, g, eps, out)) return;
    luma_cuda_add_rmsnorm(be, x, y, yg, g, eps, out);
}

static void cuda_rope(luma_backend *be, luma_buf *x, int32_t head_dim, const int32_t *pos, const luma_rope *r)
{
    flush_all(cu(be));
    luma_cuda_rope(be, x, head_dim, pos, r);
}

static void cuda_qk_rope(luma_backend *be, luma_buf *q, luma_buf *k, const luma_weight *gq, const luma_weight *gk,
                         int32_t head_dim, float eps, const int32_t *pos, const luma_rope *r)
{
    flush_all(cu(be));
    luma_cuda_qk_rope(be, q, k, gq, gk, head_dim, eps, pos, r);
}

static void cuda_qkv_bias_rope(luma_backend *be, luma_buf *q, luma_buf *k, luma_buf *v, const luma_weight *bq,
                               const luma_weight *bk, const luma_weight *bv, int32_t head_dim, const int32_t *pos,
                               const luma_rope *r)
{
    flush_all(cu(be));
    luma_cuda_qkv_bias_rope(be, q, k, v, bq, bk, bv, head_dim, pos, r);
}

static void cuda_gelu_mul(luma_backend *be, luma_buf *gate, const luma_buf *up)
{
    flush_all(cu(be));
    luma_cuda_gelu_mul(be, gate, up);
}

static void cuda_silu_mul(luma_backend *be, luma_buf *gate, const luma_buf *up)
{
    flush_all(cu(be));
    luma_cuda_silu_mul(be, gate, up);
}

static void cuda_add(luma_backend *be, luma_buf *x, const luma_buf *y)
{
    if (luma_cuda_prog_add(cu(be), x, y)) return;
    flush_all(cu(be));
    luma_cuda_add(be, x, y);
}

/* Before any weight: with batch invariance no product takes the tensor
 * cores, so no weight gets an f16 copy. */
static int cuda_set_batch_invariant(luma_backend *be, bool on, luma_err *err)
{
    cuda_backend *c = (cuda_backend *)be;
    if (c->f16_mode != CUDA_F16_UNDECIDED && on != c->invariant)
        return luma_errf(err, "batch invariance is set before the weights are loaded");
    c->invariant = on;
    if (on) c->f16_mode = CUDA_F16_PER_CALL;
    return 0;
}

/* Before any weight, as batch invariance (mmq is not used with float
 * activations). */
static int cuda_set_float_act(luma_backend *be, bool on, luma_err *err)
{
    cuda_backend *c = (cuda_backend *)be;
    if (c->n_weights > 0 && on != c->float_act)
        return luma_errf(err, "float activations are set before the weights are loaded");
    c->float_act = on;
    return 0;
}

static const luma_backend_ops cuda_ops = {
    .name = "cuda",
    .free = cuda_free,
    .weight_load = cuda_weight_load,
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .buf_read = cuda_buf_read,
    .kv_alloc = cuda_kv_alloc,
    .step_begin = cuda_step_begin,
    .step_run = cuda_step_run,
    .kv_copy_block = cuda_kv_copy_block,
    .embed = cuda_embed,
    .matmul = cuda_matmul,
    .matmul_many = cuda_matmul_many,
    .gather = cuda_gather,
    .add_bias = cuda_add_bias,
    .rmsnorm = cuda_rmsnorm,
    .add_rmsnorm = cuda_add_rmsnorm,
    .rope = cuda_rope,
    .qk_rope = cuda_qk_rope,
    .qkv_bias_rope = cuda_qkv_bias_rope,
    .qkv_rope = cuda_qkv_rope,
    .attention = cuda_attention,
    .gelu_mul = cuda_gelu_mul,
    .silu_mul = cuda_silu_mul,
    .gated_matmul = cuda_gated_matmul,
    .ffn = cuda_ffn,
    .add = cuda_add,
    .logits_alloc = luma_cuda_logits_alloc,
    .logits_free = luma_cuda_logits_free,
    .logits_argmax = luma_cuda_logits_argmax,
    .logits_topk = luma_cuda_logits_topk,
    .logits_topk_rows = luma_cuda_logits_topk_rows,
    .logits_edit = luma_cuda_logits_edit,
    .logits_temperature = luma_cuda_logits_temperature,
    .logits_min_p = luma_cuda_logits_min_p,
    .logits_softmax = luma_cuda_logits_softmax,
    .logits_live_sums = luma_cuda_logits_live_sums,
    .logits_sample = luma_cuda_logits_sample,
    .chain_argmax = luma_cuda_chain_argmax,
    .chain_sample = luma_cuda_chain_sample,
    .chain_history = luma_cuda_chain_history,
    .chain_read = luma_cuda_chain_read,
    .sampler_draw_rows = luma_cuda_sampler_draw_rows,
    .sync = cuda_sync,
    .warmed = cuda_warmed,
    .set_batch_invariant = cuda_set_batch_invariant,
    .set_float_act = cuda_set_float_act,
    .copy_rate = cuda_copy_rate,
};

/* Device 0 exists and can run this build's sm_90 code. */
static bool device_usable(int device, int *major, int *minor)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || device < 0 || device >= n) return false;
    if (cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
        return false;
    return *major >= 9;
}

bool luma_backend_cuda_available(void)
{
    int major = 0, minor = 0;
    bool ok = device_usable(0, &major, &minor);
    cudaGetLastError();   /* a missing driver must not leave a sticky error behind */
    return ok;
}

luma_backend *luma_backend_cuda_new(int device, luma_err *err)
{
    int n = 0, major = 0, minor = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        cudaGetLastError();
        luma_errf(err, "no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
        return NULL;
    }
    if (!device_usable(device, &major, &minor)) {
        if (device < 0 || device >= n) luma_errf(err, "CUDA device %d does not exist (%d found)", device, n);
        else luma_errf(err, "CUDA device %d has compute capability %d.%d; luma's kernels need 9.0 or newer",
                       device, major, minor);
        return NULL;
    }
    cuda_backend *c = (cuda_backend *)calloc(1, sizeof *c);
    if (!c) {
        luma_errf(err, "out of memory for the CUDA backend");
        return NULL;
    }
    c->base.ops = &cuda_ops;
    c->device = device;
    warmup_steps(c);
    c->graphs_on = !env_off("LUMA_CUDA_GRAPHS");
    c->graph_slots = env_int("LUMA_CUDA_GRAPH_SLOTS", CUDA_GRAPHS, 1, CUDA_GRAPHS);
    c->graph_after = env_int("LUMA_CUDA_GRAPH_AFTER", 0, 0, 1000);
    c->prefill_min_rows = env_int("LUMA_CUDA_PREFILL_ROWS", LUMA_CUDA_PREFILL_MIN_ROWS, 1, 4096);
    c->topk_stream = env_int("LUMA_CUDA_TOPK", 1, 0, 1) != 0;
    c->pdl = !env_off("LUMA_CUDA_PDL");
    c->early = luma_cuda_env_digit("LUMA_CUDA_EARLY", 1);
    c->attn_early = luma_cuda_env_digit("LUMA_CUDA_ATTN_EARLY", 1);
    c->carveout = env_int("LUMA_CUDA_CARVEOUT", -1, -1, 100);
    c->zero_copy = !env_off("LUMA_CUDA_ZERO_COPY");
    /* programs are measured slower than the kernels at batch 1 (cuda/NOTES.md,
     * "Decode-step programs"): LUMA_CUDA_PROGRAM=1 turns them on */
    const char *prog = getenv("LUMA_CUDA_PROGRAM");
    c->prog_on = prog && strcmp(prog, "1") == 0;
    c->normq_on = !env_off("LUMA_CUDA_NORM_QUANT");
    c->gemm_batch = !env_off("LUMA_CUDA_GEMM_BATCH");
    c->attnq_on = !env_off("LUMA_CUDA_ATTN_QUANT");
    c->repack_q6k = !env_off("LUMA_CUDA_Q6K_MMV");
    c->repack_x4 = !env_off("LUMA_CUDA_X4_MMV");
    c->repack_tc = !env_off("LUMA_CUDA_TC_MMV");
    c->tc_q6k = c->repack_tc && !env_off("LUMA_CUDA_TC_Q6K");
    c->rs6 = !env_off("LUMA_CUDA_RS6");
    c->rs_pair = !env_off("LUMA_CUDA_RS_PAIR");
    luma_cuda_tall_init(c);
    const char *fork_min = getenv("LUMA_CUDA_FORK");
    c->fork_min = fork_min ? (int64_t)strtoll(fork_min, NULL, 10) : LUMA_FORK_MIN;
    c->mmv_on = true;
    const char *what = "selecting the device";
    e = cudaSetDevice(device);
    if (e == cudaSuccess) {
        what = "reading the device's properties";
        e = cudaDeviceGetAttribute(&c->n_sm, cudaDevAttrMultiProcessorCount, device);
    }
    if (e == cudaSuccess) {
        /* A blocking stream: work queued on the legacy default stream (a
         * test's events and copies) stays ordered with the backend's. */
        what = "creating a stream";
        e = cudaStreamCreate(&c->stream);
    }
    if (e == cudaSuccess) {
        what = "creating an event";
        e = cudaEventCreateWithFlags(&c->staged, cudaEventDisableTiming);
    }
    if (e == cudaSuccess) {
        /* blocking too, for the same reason */
        what = "creating matmul_many's second stream";
        e = cudaStreamCreate(&c->side);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->fork_ev, cudaEventDisableTiming);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->join_ev, cudaEventDisableTiming);
    }
    if (e != cudaSuccess) {
        luma_errf(err, "CUDA backend: %s: %s", what, cudaGetErrorString(e));
        cuda_free(&c->base);
        return NULL;
    }
#ifdef LUMA_CUDA_TRACE
    trace_start();
#endif
    c->wgmma = !env_off("LUMA_CUDA_WGMMA") && luma_cuda_wgmma_probe(c);
    if (cudaMalloc(&c->cublas_ws, CUBLAS_WORKSPACE) != cudaSuccess ||
        cudaMalloc(&c->side_ws, CUBLAS_WORKSPACE) != cudaSuccess ||
        cudaMalloc((void **)&c->prog_bar, 2 * sizeof(unsigned)) != cudaSuccess ||
        cudaMemset(c->prog_bar, 0, 2 * sizeof(unsigned)) != cudaSuccess ||
        cudaMalloc((void **)&c->chain_key, sizeof *c->chain_key) != cudaSuccess ||
        cudaMemset(c->chain_key, 0, sizeof *c->chain_key) != cudaSuccess ||
        cudaMalloc((void **)&c->angles, (size_t)LUMA_ANGLE_SLOTS * LUMA_ANGLE_SLOT_FLOATS * sizeof(float)) != cudaSuccess ||
        !(c->angle_args = (struct rope_args *)calloc(LUMA_ANGLE_SLOTS, sizeof *c->angle_args))) {
        cudaGetLastError();
        luma_errf(err, "CUDA backend: no memory for the cuBLAS workspace, the programs' barrier, "
                       "chained decoding's token and the rotations' angles");
        cuda_free(&c->base);
        return NULL;
    }
    if (cublasCreate(&c->cublas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(c->cublas, c->stream) != CUBLAS_STATUS_SUCCESS ||
        cublasSetWorkspace(c->cublas, c->cublas_ws, CUBLAS_WORKSPACE) != CUBLAS_STATUS_SUCCESS) {
        luma_errf(err, "CUDA backend: could not start cuBLAS");
        cuda_free(&c->base);
        return NULL;
    }
    if (!env_off("LUMA_CUDA_LT")) luma_cuda_lt_init(c);
    /* the batched GEMMs' pointer tables; without them each product is a
     * GEMM of its own */
    const size_t tab = (size_t)CUDA_GEMM_TAB_SLOTS * CUDA_GEMM_TAB_PTRS * sizeof(void *);
    if (c->gemm_batch && (cudaMalloc((void **)&c->tab_dev, tab) != cudaSuccess ||
                          cudaMallocHost((void **)&c->tab_host, tab) != cudaSuccess ||
                          !(c->tab_k = (uint8_t *)calloc(CUDA_GEMM_TAB_SLOTS, 1)))) {
        cudaGetLastError();
        c->gemm_batch = false;
    }
    return &c->base;
}
