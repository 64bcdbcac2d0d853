/* Paged KV cache bookkeeping. The cache is cut into fixed-size blocks of
 * block_tokens positions; a sequence owns a block table mapping its i-th
 * block of positions to a physical block. Blocks are reference counted, so a
 * forked sequence shares its parent's blocks; the first write into a shared,
 * partially filled block copies it (copy-on-write).
 *
 * This module owns indices only. The memory of the blocks belongs to the
 * backend (host arrays on the CPU, device arrays on a GPU), which lays out
 * K and V of every layer of a pool inside each block and copies a block when
 * asked through the copy callback.
 *
 * Pools: layers that attend over the whole context share pool 0; layers with
 * a sliding window (Gemma 3) use pool 1, where blocks that fell out of the
 * window are released as the sequence grows. */
#ifndef LUMA_KV_H
#define LUMA_KV_H

#include <stdbool.h>
#include <stdint.h>

#include "err.h"

#define LUMA_KV_MAX_POOLS 2

/* Copies the contents of physical block src to dst in pool `pool`. */
typedef void (*luma_kv_copy_fn)(void *ctx, int pool, int32_t src, int32_t dst);

typedef struct luma_kv_params {
    int n_pools;                          /* 1 or 2 */
    int32_t block_tokens;                 /* positions per block, a power of two */
    int32_t n_blocks[LUMA_KV_MAX_POOLS];  /* physical blocks in each pool */
    /* 0: the pool keeps every position; w > 0: a query at position p only
     * sees keys at positions > p - w, so older blocks may be released. */
    int32_t window[LUMA_KV_MAX_POOLS];
    /* Positions kept past the window before a block is released, so that
     * luma_kv_rewind by up to keep positions always finds its blocks. */
    int32_t keep;
    luma_kv_copy_fn copy;
    void *copy_ctx;
} luma_kv_params;

typedef struct luma_kv luma_kv;
typedef struct luma_kv_seq luma_kv_seq;

int luma_kv_new(const luma_kv_params *p, luma_kv **out, luma_err *err);
/* Frees the bookkeeping; sequences must have been freed first. */
void luma_kv_free(luma_kv *kv);

luma_kv_seq *luma_kv_seq_new(luma_kv *kv);
/* A new sequence sharing every block of src (reference counts go up) that
 * holds its stored positions; src's reserved, uncommitted blocks stay its own.
 * NULL on bad arguments or when out of memory. */
luma_kv_seq *luma_kv_seq_fork(luma_kv *kv, const luma_kv_seq *src);
/* Releases the sequence's references; blocks reaching zero return to the free list. */
void luma_kv_seq_free(luma_kv *kv, luma_kv_seq *s);

/* Positions stored so far. */
int32_t luma_kv_seq_len(const luma_kv_seq *s);

/* Makes room for n more positions [len, len + n): allocates blocks and
 * copies a shared partial last block. All or nothing: when a pool runs out of
 * free blocks, nothing changes and the error says how many blocks were
 * needed and free. A second reserve before commit covers [len, len + n)
 * again, reusing the blocks already reserved; reserving 0 does nothing. */
int luma_kv_reserve(luma_kv *kv, luma_kv_seq *s, int32_t n, luma_err *err);
/* Declares the n reserved positions written: len += n, and in windowed pools
 * releases the blocks no future query can see. An n that is negative or
 * beyond the reserved room is ignored. */
void luma_kv_commit(luma_kv *kv, luma_kv_seq *s, int32_t n);
/* Truncates to len positions (0 <= len <= current), dropping references to
 * blocks past it. Rewinding into a windowed pool's released blocks is an error. */
int luma_kv_rewind(luma_kv *kv, luma_kv_seq *s, int32_t len, luma_err *err);

/* The block table of a pool: entry i is the physical block holding positions
 * [i * block_tokens, (i + 1) * block_tokens), or -1 when released. Covers the
 * reserved positions too. *n gets the number of entries. */
const int32_t *luma_kv_seq_blocks(const luma_kv_seq *s, int pool, int32_t *n);

/* Counters, for tests and memory reports. */
int32_t luma_kv_free_blocks(const luma_kv *kv, int pool);
int32_t luma_kv_block_refs(const luma_kv *kv, int pool, int32_t block);
const luma_kv_params *luma_kv_get_params(const luma_kv *kv);

#endif
