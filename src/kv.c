/* Paged KV cache bookkeeping: free lists, reference counts and block tables.
 *
 * Invariants, per pool:
 * - refs[b] is the number of table entries, over all sequences, naming block
 *   b; a block is on the free stack exactly when refs[b] == 0.
 * - A sequence's table has at least ceil(len / block_tokens) entries; the
 *   entries past that are blocks allocated by reserve, owned by this sequence
 *   alone (fork copies only the entries holding stored positions).
 * - Released entries (-1) form a prefix of the table of length n_dropped:
 *   only a windowed pool releases, always from the oldest block on.
 * - The only block a sequence writes that can be shared is the one holding
 *   position len when len is not a block boundary; reserve copies it. */
#include "kv.h"

#include <stdlib.h>
#include <string.h>

typedef struct kv_pool {
    int32_t *refs;      /* [n_blocks] */
    int32_t *free_ids;  /* stack of free block ids, [n_blocks] */
    int32_t n_free;
} kv_pool;

struct luma_kv {
    luma_kv_params p;
    kv_pool pools[LUMA_KV_MAX_POOLS];
};

typedef struct kv_table {
    int32_t *ids;       /* [cap], entry i holds positions [i * B, (i + 1) * B) */
    int32_t n, cap;
    int32_t n_dropped;  /* leading entries released by the window */
} kv_table;

struct luma_kv_seq {
    const luma_kv *owner;
    int32_t len;
    int32_t reserved;   /* end of the reserved positions: len <= reserved */
    kv_table tables[LUMA_KV_MAX_POOLS];
};

/* Entries holding positions [0, len). */
static int32_t blocks_for(const luma_kv *kv, int32_t len)
{
    int32_t b = kv->p.block_tokens;
    return len / b + (len % b != 0);
}

static int32_t pop_free(kv_pool *pool)
{
    int32_t b = pool->free_ids[--pool->n_free];
    pool->refs[b] = 1;
    return b;
}

static void unref(kv_pool *pool, int32_t b)
{
    if (--pool->refs[b] == 0) pool->free_ids[pool->n_free++] = b;
}

static int table_reserve(kv_table *t, int32_t need, luma_err *err)
{
    if (need <= t->cap) return 0;
    int32_t cap = t->cap > 0 ? t->cap : 8;
    while (cap < need) cap = cap > INT32_MAX / 2 ? need : cap * 2;
    size_t bytes;
    if (luma_mul_size((size_t)cap, sizeof *t->ids, &bytes) != 0)
        return luma_errf(err, "KV block table of %d entries is too large", (int)cap);
    int32_t *ids = realloc(t->ids, bytes);
    if (!ids) return luma_errf(err, "out of memory for a KV block table of %d entries", (int)cap);
    t->ids = ids;
    t->cap = cap;
    return 0;
}

static int check_seq(const luma_kv *kv, const luma_kv_seq *s, const char *what, luma_err *err)
{
    if (!kv) return luma_errf(err, "%s: no KV cache", what);
    if (!s) return luma_errf(err, "%s: no sequence", what);
    if (s->owner != kv) return luma_errf(err, "%s: sequence belongs to another KV cache", what);
    return 0;
}

int luma_kv_new(const luma_kv_params *p, luma_kv **out, luma_err *err)
{
    if (!out) return luma_errf(err, "luma_kv_new: no output pointer");
    *out = NULL;
    if (!p) return luma_errf(err, "luma_kv_new: no parameters");
    if (p->n_pools < 1 || p->n_pools > LUMA_KV_MAX_POOLS)
        return luma_errf(err, "KV cache: %d pools, expected 1 to %d", p->n_pools, LUMA_KV_MAX_POOLS);
    if (p->block_tokens <= 0 || (p->block_tokens & (p->block_tokens - 1)) != 0)
        return luma_errf(err, "KV cache: block of %d tokens is not a power of two",
                         (int)p->block_tokens);
    if (!p->copy) return luma_errf(err, "KV cache: no block copy callback");
    if (p->keep < 0) return luma_errf(err, "KV cache: keep of %d positions is negative", (int)p->keep);
    for (int i = 0; i < p->n_pools; i++) {
        if (p->n_blocks[i] <= 0)
            return luma_errf(err, "KV cache: pool %d has %d blocks", i, (int)p->n_blocks[i]);
        if (p->window[i] < 0)
            return luma_errf(err, "KV cache: pool %d has window %d", i, (int)p->window[i]);
    }

    luma_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return luma_errf(err, "out of memory for the KV cache");
    kv->p = *p;
    for (int i = p->n_pools; i < LUMA_KV_MAX_POOLS; i++) {
        kv->p.n_blocks[i] = 0;
        kv->p.window[i] = 0;
    }
    for (int i = 0; i < p->n_pools; i++) {
        kv_pool *pool = &kv->pools[i];
        int32_t n = p->n_blocks[i];
        size_t bytes;
        if (luma_mul_size((size_t)n, sizeof(int32_t), &bytes) != 0 ||
            !(pool->refs = calloc((size_t)n, sizeof(int32_t))) ||
            !(pool->free_ids = malloc(bytes))) {
            luma_kv_free(kv);
            return luma_errf(err, "out of memory for %d KV blocks in pool %d", (int)n, i);
        }
        /* Block 0 on top, so a fresh cache hands out 0, 1, 2, ... */
        for (int32_t j = 0; j < n; j++) pool->free_ids[j] = n - 1 - j;
        pool->n_free = n;
    }
    *out = kv;
    return 0;
}

void luma_kv_free(luma_kv *kv)
{
    if (!kv) return;
    for (int i = 0; i < LUMA_KV_MAX_POOLS; i++) {
        free(kv->pools[i].refs);
        free(kv->pools[i].free_ids);
    }
    free(kv);
}

luma_kv_seq *luma_kv_seq_new(luma_kv *kv)
{
    if (!kv) return NULL;
    luma_kv_seq *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->owner = kv;
    for (int i = 0; i < kv->p.n_pools; i++) {
        if (table_reserve(&s->tables[i], 1, NULL) != 0) {
            luma_kv_seq_free(kv, s);
            return NULL;
        }
    }
    return s;
}

luma_kv_seq *luma_kv_seq_fork(luma_kv *kv, const luma_kv_seq *src)
{
    if (check_seq(kv, src, "fork", NULL) != 0) return NULL;
    luma_kv_seq *s = luma_kv_seq_new(kv);
    if (!s) return NULL;
    int32_t n = blocks_for(kv, src->len);
    for (int i = 0; i < kv->p.n_pools; i++) {
        if (table_reserve(&s->tables[i], n, NULL) != 0) {
            luma_kv_seq_free(kv, s);
            return NULL;
        }
    }
    /* Only the stored positions are shared: src's reserved blocks stay its own. */
    for (int i = 0; i < kv->p.n_pools; i++) {
        const kv_table *from = &src->tables[i];
        kv_table *to = &s->tables[i];
        if (n > 0) memcpy(to->ids, from->ids, (size_t)n * sizeof *to->ids);
        to->n = n;
        to->n_dropped = from->n_dropped;
        for (int32_t j = to->n_dropped; j < n; j++) kv->pools[i].refs[to->ids[j]]++;
    }
    s->len = src->len;
    s->reserved = src->len;
    return s;
}

/* Drops the references of entries [from, n) and shortens the table to from. */
static void table_truncate(luma_kv *kv, int pool, kv_table *t, int32_t from)
{
    for (int32_t j = from > t->n_dropped ? from : t->n_dropped; j < t->n; j++)
        unref(&kv->pools[pool], t->ids[j]);
    if (from < t->n) t->n = from;
    if (t->n_dropped > t->n) t->n_dropped = t->n;
}

void luma_kv_seq_free(luma_kv *kv, luma_kv_seq *s)
{
    if (!kv || !s || s->owner != kv) return;
    for (int i = 0; i < kv->p.n_pools; i++) {
        table_truncate(kv, i, &s->tables[i], 0);
        free(s->tables[i].ids);
    }
    free(s);
}

int32_t luma_kv_seq_len(const luma_kv_seq *s)
{
    return s ? s->len : 0;
}

/* The block holding position len, when it is shared and already holds some
 * positions: writing into it needs a private copy first. */
static bool needs_copy(const luma_kv *kv, const luma_kv_seq *s, int pool)
{
    const kv_table *t = &s->tables[pool];
    int32_t i = s->len / kv->p.block_tokens;
    if (s->len % kv->p.block_tokens == 0 || i >= t->n || t->ids[i] < 0) return false;
    return kv->pools[pool].refs[t->ids[i]] > 1;
}

int luma_kv_reserve(luma_kv *kv, luma_kv_seq *s, int32_t n, luma_err *err)
{
    if (check_seq(kv, s, "KV reserve", err) != 0) return -1;
    if (n < 0) return luma_errf(err, "KV reserve: negative count %d", (int)n);
    if (n == 0) return 0;
    if (n > INT32_MAX - s->len)
        return luma_errf(err, "KV reserve: %d positions after %d overflow", (int)n, (int)s->len);
    int32_t want = blocks_for(kv, s->len + n);

    /* Every check and allocation first, so that a failure changes nothing
     * (a table's larger capacity is not a visible change). */
    int32_t need[LUMA_KV_MAX_POOLS];
    for (int i = 0; i < kv->p.n_pools; i++) {
        const kv_table *t = &s->tables[i];
        need[i] = (want > t->n ? want - t->n : 0) + needs_copy(kv, s, i);
        if (need[i] > kv->pools[i].n_free)
            return luma_errf(err, "KV cache full: pool %d needs %d blocks, %d free", i,
                             (int)need[i], (int)kv->pools[i].n_free);
        if (table_reserve(&s->tables[i], want, err) != 0) return -1;
    }

    for (int i = 0; i < kv->p.n_pools; i++) {
        kv_pool *pool = &kv->pools[i];
        kv_table *t = &s->tables[i];
        if (needs_copy(kv, s, i)) {
            int32_t j = s->len / kv->p.block_tokens;
            int32_t src = t->ids[j];
            int32_t dst = pop_free(pool);
            kv->p.copy(kv->p.copy_ctx, i, src, dst);
            unref(pool, src);
            t->ids[j] = dst;
        }
        while (t->n < want) t->ids[t->n++] = pop_free(pool);
    }
    s->reserved = s->len + n;
    return 0;
}

void luma_kv_commit(luma_kv *kv, luma_kv_seq *s, int32_t n)
{
    if (check_seq(kv, s, "KV commit", NULL) != 0) return;
    if (n < 0 || n > s->reserved - s->len) return;
    s->len += n;
    for (int i = 0; i < kv->p.n_pools; i++) {
        int32_t w = kv->p.window[i];
        /* The next query, at position len, sees keys from len - (w - 1) on;
         * blocks ending before that are out of every future window (and
         * of a rewind's by keep positions). */
        int32_t first_seen = s->len - (w - 1) - kv->p.keep;
        if (w == 0 || first_seen <= 0) continue;
        kv_table *t = &s->tables[i];
        int32_t end = first_seen / kv->p.block_tokens;
        if (end > t->n) end = t->n;
        for (int32_t j = t->n_dropped; j < end; j++) {
            unref(&kv->pools[i], t->ids[j]);
            t->ids[j] = -1;
        }
        if (end > t->n_dropped) t->n_dropped = end;
    }
}

int luma_kv_rewind(luma_kv *kv, luma_kv_seq *s, int32_t len, luma_err *err)
{
    if (check_seq(kv, s, "KV rewind", err) != 0) return -1;
    if (len < 0 || len > s->len)
        return luma_errf(err, "cannot rewind to %d: the sequence holds %d positions", (int)len,
                         (int)s->len);
    for (int i = 0; i < kv->p.n_pools; i++) {
        int32_t w = kv->p.window[i];
        if (w == 0 || len == 0) continue;
        int32_t first_seen = len - (w - 1);
        if (first_seen < 0) first_seen = 0;
        if (first_seen / kv->p.block_tokens < s->tables[i].n_dropped)
            return luma_errf(err, "cannot rewind to %d: sliding-window blocks already released%s", (int)len,
                             kv->p.keep > 0 ? " (they are kept for rewinds of fewer positions)" : "");
    }
    int32_t keep = blocks_for(kv, len);
    for (int i = 0; i < kv->p.n_pools; i++) table_truncate(kv, i, &s->tables[i], keep);
    s->len = len;
    s->reserved = len;
    return 0;
}

const int32_t *luma_kv_seq_blocks(const luma_kv_seq *s, int pool, int32_t *n)
{
    if (n) *n = 0;
    if (!s || !n || pool < 0 || pool >= s->owner->p.n_pools) return NULL;
    *n = s->tables[pool].n;
    return s->tables[pool].ids;
}

int32_t luma_kv_free_blocks(const luma_kv *kv, int pool)
{
    if (!kv || pool < 0 || pool >= kv->p.n_pools) return -1;
    return kv->pools[pool].n_free;
}

int32_t luma_kv_block_refs(const luma_kv *kv, int pool, int32_t block)
{
    if (!kv || pool < 0 || pool >= kv->p.n_pools || block < 0 || block >= kv->p.n_blocks[pool])
        return -1;
    return kv->pools[pool].refs[block];
}

const luma_kv_params *luma_kv_get_params(const luma_kv *kv)
{
    return kv ? &kv->p : NULL;
}
