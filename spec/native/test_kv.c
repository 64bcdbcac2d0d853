/* The paged KV cache bookkeeping against a simulated backend: each pool's
 * storage is a host array of n_blocks * block_tokens values, the copy
 * callback is a memcpy, and every stored position holds a value derived from
 * (sequence id, position). After every operation, reading each sequence's
 * positions back through its block tables must give exactly its own values;
 * that is what proves sharing and copy-on-write right. */
#include "kv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
static int checks;

#define CHECK(cond)                                                                 \
    do {                                                                            \
        checks++;                                                                   \
        if (!(cond)) {                                                              \
            if (failures++ < 20)                                                    \
                fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                           \
    } while (0)

/* Host storage of the simulated backend: [n_blocks][block_tokens] per pool. */
typedef struct store {
    uint32_t *data[LUMA_KV_MAX_POOLS];
    int32_t block_tokens;
    int copies;
} store;

static void store_copy(void *ctx, int pool, int32_t src, int32_t dst)
{
    store *st = ctx;
    size_t b = (size_t)st->block_tokens;
    memcpy(st->data[pool] + (size_t)dst * b, st->data[pool] + (size_t)src * b,
           b * sizeof *st->data[pool]);
    st->copies++;
}

typedef struct cache {
    luma_kv *kv;
    store st;
    luma_kv_params p;
} cache;

static int32_t open_keep;   /* cache_open's luma_kv_params.keep */

static void cache_open(cache *c, int n_pools, int32_t block_tokens, int32_t blocks0,
                       int32_t window0, int32_t blocks1, int32_t window1)
{
    memset(c, 0, sizeof *c);
    c->p.n_pools = n_pools;
    c->p.block_tokens = block_tokens;
    c->p.n_blocks[0] = blocks0;
    c->p.window[0] = window0;
    c->p.n_blocks[1] = blocks1;
    c->p.window[1] = window1;
    c->p.keep = open_keep;
    c->p.copy = store_copy;
    c->p.copy_ctx = &c->st;
    c->st.block_tokens = block_tokens;
    for (int i = 0; i < n_pools; i++) {
        /* Filled with a value no sequence writes, so reading an unwritten
         * slot is caught. */
        size_t n = (size_t)c->p.n_blocks[i] * (size_t)block_tokens;
        c->st.data[i] = malloc(n * sizeof(uint32_t));
        for (size_t j = 0; j < n; j++) c->st.data[i][j] = 0xFFFFFFFFu;
    }
    luma_err err = { { 0 } };
    if (luma_kv_new(&c->p, &c->kv, &err) != 0) {
        fprintf(stderr, "luma_kv_new: %s\n", err.msg);
        exit(1);
    }
}

static void cache_close(cache *c)
{
    for (int i = 0; i < c->p.n_pools; i++) {
        CHECK(luma_kv_free_blocks(c->kv, i) == c->p.n_blocks[i]);
        free(c->st.data[i]);
    }
    luma_kv_free(c->kv);
}

/* A sequence and the values its stored positions must hold. */
typedef struct tseq {
    luma_kv_seq *s;
    uint32_t id;
    uint32_t *vals;
    int32_t cap;
} tseq;

static uint32_t value(uint32_t id, int32_t pos, int pool)
{
    return (id << 16 ^ (uint32_t)pos) ^ (uint32_t)pool << 31;
}

static uint32_t next_id = 1;
static luma_err last_err;
/* Most blocks in use in each pool between a reserve and its commit. */
static int32_t peak_used[LUMA_KV_MAX_POOLS];

static void tseq_adopt(tseq *t, luma_kv_seq *s, const tseq *parent)
{
    t->s = s;
    t->id = next_id++;
    t->cap = 64;
    int32_t len = luma_kv_seq_len(s);
    while (t->cap < len) t->cap *= 2;
    t->vals = malloc((size_t)t->cap * sizeof *t->vals);
    if (parent) memcpy(t->vals, parent->vals, (size_t)len * sizeof *t->vals);
}

static void tseq_new(cache *c, tseq *t)
{
    luma_kv_seq *s = luma_kv_seq_new(c->kv);
    CHECK(s != NULL);
    tseq_adopt(t, s, NULL);
}

static void tseq_fork(cache *c, tseq *t, const tseq *parent)
{
    luma_kv_seq *s = luma_kv_seq_fork(c->kv, parent->s);
    CHECK(s != NULL);
    CHECK(luma_kv_seq_len(s) == luma_kv_seq_len(parent->s));
    tseq_adopt(t, s, parent);
}

static void tseq_free(cache *c, tseq *t)
{
    luma_kv_seq_free(c->kv, t->s);
    free(t->vals);
    memset(t, 0, sizeof *t);
}

/* Where position pos of pool lives in the store, or NULL when released. */
static uint32_t *slot(cache *c, const tseq *t, int pool, int32_t pos)
{
    int32_t n;
    const int32_t *tab = luma_kv_seq_blocks(t->s, pool, &n);
    int32_t i = pos / c->p.block_tokens;
    if (!tab || i >= n || tab[i] < 0) return NULL;
    return c->st.data[pool] + (size_t)tab[i] * (size_t)c->p.block_tokens +
           (size_t)(pos % c->p.block_tokens);
}

/* Writes vals over the reserved positions [len, len + n) of every pool, as
 * the forward pass would. */
static void write_positions(cache *c, const tseq *t, int32_t n, uint32_t tag)
{
    int32_t len = luma_kv_seq_len(t->s);
    for (int k = 0; k < c->p.n_pools; k++)
        for (int32_t p = len; p < len + n; p++) {
            uint32_t *v = slot(c, t, k, p);
            CHECK(v != NULL);
            if (v) *v = value(tag, p, k);
        }
}

/* Reserves, writes and commits n positions; returns the reserve's result. */
static int append(cache *c, tseq *t, int32_t n)
{
    if (luma_kv_reserve(c->kv, t->s, n, &last_err) != 0) return -1;
    write_positions(c, t, n, t->id);
    for (int k = 0; k < c->p.n_pools; k++) {
        int32_t used = c->p.n_blocks[k] - luma_kv_free_blocks(c->kv, k);
        if (used > peak_used[k]) peak_used[k] = used;
    }
    int32_t len = luma_kv_seq_len(t->s);
    while (t->cap < len + n) {
        t->cap *= 2;
        t->vals = realloc(t->vals, (size_t)t->cap * sizeof *t->vals);
    }
    for (int32_t p = len; p < len + n; p++) t->vals[p] = value(t->id, p, 0);
    luma_kv_commit(c->kv, t->s, n);
    CHECK(luma_kv_seq_len(t->s) == len + n);
    return 0;
}

/* Reserves n positions and fills them with junk that is never committed. */
static int scribble(cache *c, tseq *t, int32_t n)
{
    if (luma_kv_reserve(c->kv, t->s, n, &last_err) != 0) return -1;
    write_positions(c, t, n, 0xDEADu);
    return 0;
}

/* Every position a future query can see holds the sequence's own value;
 * released entries are only those out of every future window. */
static void check_seq(cache *c, const tseq *t)
{
    int32_t len = luma_kv_seq_len(t->s);
    int32_t b = c->p.block_tokens;
    for (int k = 0; k < c->p.n_pools; k++) {
        int32_t n;
        const int32_t *tab = luma_kv_seq_blocks(t->s, k, &n);
        CHECK(tab != NULL && n >= (len + b - 1) / b);
        int32_t w = c->p.window[k];
        int bad = 0;
        for (int32_t i = 0; i < n; i++) {
            if (tab[i] == -1) {
                if (w == 0 || (i + 1) * b - 1 >= len - (w - 1)) bad++;
            } else if (tab[i] < 0 || tab[i] >= c->p.n_blocks[k]) {
                bad++;
            }
        }
        for (int32_t p = 0; p < len; p++) {
            const uint32_t *v = slot(c, t, k, p);
            uint32_t want = t->vals[p] ^ (uint32_t)k << 31;
            if (v ? *v != want : (w == 0 || p >= len - (w - 1))) bad++;
        }
        CHECK(bad == 0);
    }
}

/* Reference counts equal the number of table entries naming each block;
 * free + used = total. */
static void check_refs(cache *c, tseq *ts, int n_ts)
{
    for (int k = 0; k < c->p.n_pools; k++) {
        int32_t total = c->p.n_blocks[k];
        int32_t *count = calloc((size_t)total, sizeof *count);
        int64_t live = 0, refsum = 0;
        for (int j = 0; j < n_ts; j++) {
            if (!ts[j].s) continue;
            int32_t n;
            const int32_t *tab = luma_kv_seq_blocks(ts[j].s, k, &n);
            for (int32_t i = 0; i < n; i++)
                if (tab[i] >= 0 && tab[i] < total) {
                    count[tab[i]]++;
                    live++;
                }
        }
        int32_t used = 0, mismatched = 0;
        for (int32_t bl = 0; bl < total; bl++) {
            int32_t r = luma_kv_block_refs(c->kv, k, bl);
            refsum += r;
            used += r > 0;
            mismatched += r != count[bl];
        }
        CHECK(mismatched == 0);
        CHECK(refsum == live);
        CHECK(used + luma_kv_free_blocks(c->kv, k) == total);
        free(count);
    }
}

static void check_all(cache *c, tseq *ts, int n_ts)
{
    for (int j = 0; j < n_ts; j++)
        if (ts[j].s) check_seq(c, &ts[j]);
    check_refs(c, ts, n_ts);
}

/* A snapshot of the visible state, to prove that a failed call changed nothing. */
typedef struct snapshot {
    int32_t len;
    int32_t n[LUMA_KV_MAX_POOLS];
    int32_t tab[LUMA_KV_MAX_POOLS][512];
    int32_t free[LUMA_KV_MAX_POOLS];
} snapshot;

static void snap(cache *c, const tseq *t, snapshot *sn)
{
    memset(sn, 0, sizeof *sn);
    sn->len = luma_kv_seq_len(t->s);
    for (int k = 0; k < c->p.n_pools; k++) {
        const int32_t *tab = luma_kv_seq_blocks(t->s, k, &sn->n[k]);
        if (sn->n[k] > 512) sn->n[k] = 512;
        memcpy(sn->tab[k], tab, (size_t)sn->n[k] * sizeof *tab);
        sn->free[k] = luma_kv_free_blocks(c->kv, k);
    }
}

static int same(cache *c, const tseq *t, const snapshot *a)
{
    snapshot b;
    snap(c, t, &b);
    return memcmp(a, &b, sizeof b) == 0;
}

static void test_arguments(void)
{
    luma_err err = { { 0 } };
    luma_kv *kv = NULL;
    luma_kv_params p = { .n_pools = 1, .block_tokens = 16, .n_blocks = { 8, 0 }, .copy = store_copy };
    luma_kv_params bad;
    bad = p;
    bad.keep = -1;
    CHECK(luma_kv_new(&bad, &kv, &err) == -1 && kv == NULL && strstr(err.msg, "keep of -1 positions"));
    bad = p;
    bad.n_pools = 0;
    CHECK(luma_kv_new(&bad, &kv, &err) == -1 && kv == NULL && err.msg[0]);
    bad = p;
    bad.n_pools = 3;
    CHECK(luma_kv_new(&bad, &kv, &err) == -1 && kv == NULL);
    bad = p;
    bad.block_tokens = 12;
    CHECK(luma_kv_new(&bad, &kv, &err) == -1 && strstr(err.msg, "power of two"));
    bad = p;
    bad.block_tokens = 0;
    CHECK(luma_kv_new(&bad, &kv, &err) == -1);
    bad = p;
    bad.n_blocks[0] = 0;
    CHECK(luma_kv_new(&bad, &kv, &err) == -1);
    bad = p;
    bad.window[0] = -1;
    CHECK(luma_kv_new(&bad, &kv, &err) == -1);
    bad = p;
    bad.copy = NULL;
    CHECK(luma_kv_new(&bad, &kv, &err) == -1);
    CHECK(luma_kv_new(NULL, &kv, &err) == -1);
    CHECK(luma_kv_new(&p, NULL, &err) == -1);
    CHECK(luma_kv_new(&p, &kv, NULL) == 0 && kv != NULL);

    const luma_kv_params *got = luma_kv_get_params(kv);
    CHECK(got && got->block_tokens == 16 && got->n_blocks[0] == 8 && got->n_pools == 1);
    CHECK(luma_kv_get_params(NULL) == NULL);
    CHECK(luma_kv_free_blocks(kv, 0) == 8);
    CHECK(luma_kv_free_blocks(kv, 1) == -1 && luma_kv_free_blocks(kv, -1) == -1);
    CHECK(luma_kv_free_blocks(NULL, 0) == -1);
    CHECK(luma_kv_block_refs(kv, 0, 8) == -1 && luma_kv_block_refs(kv, 0, -1) == -1);
    CHECK(luma_kv_block_refs(kv, 1, 0) == -1 && luma_kv_block_refs(NULL, 0, 0) == -1);
    CHECK(luma_kv_block_refs(kv, 0, 0) == 0);

    luma_kv_seq *s = luma_kv_seq_new(kv);
    int32_t n = 99;
    CHECK(s && luma_kv_seq_blocks(s, 0, &n) != NULL && n == 0);
    CHECK(luma_kv_seq_blocks(s, 1, &n) == NULL && n == 0);
    CHECK(luma_kv_seq_blocks(s, -1, &n) == NULL && luma_kv_seq_blocks(s, 0, NULL) == NULL);
    CHECK(luma_kv_seq_blocks(NULL, 0, &n) == NULL && n == 0);
    CHECK(luma_kv_seq_len(NULL) == 0);
    CHECK(luma_kv_seq_new(NULL) == NULL && luma_kv_seq_fork(kv, NULL) == NULL);
    CHECK(luma_kv_seq_fork(NULL, s) == NULL);

    CHECK(luma_kv_reserve(kv, NULL, 1, &err) == -1 && strstr(err.msg, "no sequence"));
    CHECK(luma_kv_reserve(NULL, s, 1, &err) == -1);
    CHECK(luma_kv_reserve(kv, s, -1, &err) == -1 && strstr(err.msg, "negative"));
    CHECK(luma_kv_reserve(kv, s, 0, &err) == 0 && luma_kv_free_blocks(kv, 0) == 8);
    CHECK(luma_kv_rewind(kv, s, 1, &err) == -1 && strstr(err.msg, "cannot rewind to 1"));
    CHECK(luma_kv_rewind(kv, s, -1, &err) == -1);
    CHECK(luma_kv_rewind(kv, NULL, 0, &err) == -1);

    /* Commit beyond the reserved room, or negative, is ignored. */
    CHECK(luma_kv_reserve(kv, s, 3, &err) == 0);
    luma_kv_commit(kv, s, 4);
    luma_kv_commit(kv, s, -1);
    luma_kv_commit(kv, NULL, 1);
    luma_kv_commit(NULL, s, 1);
    CHECK(luma_kv_seq_len(s) == 0);
    luma_kv_commit(kv, s, 2);
    luma_kv_commit(kv, s, 2);
    CHECK(luma_kv_seq_len(s) == 2);
    luma_kv_commit(kv, s, 1);
    CHECK(luma_kv_seq_len(s) == 3);
    CHECK(luma_kv_reserve(kv, s, INT32_MAX, &err) == -1 && luma_kv_seq_len(s) == 3);

    /* A sequence of another cache is refused, not corrupted. */
    luma_kv *other = NULL;
    CHECK(luma_kv_new(&p, &other, &err) == 0);
    CHECK(luma_kv_reserve(other, s, 1, &err) == -1 && strstr(err.msg, "another"));
    CHECK(luma_kv_rewind(other, s, 0, &err) == -1);
    CHECK(luma_kv_seq_fork(other, s) == NULL);
    luma_kv_seq_free(other, s);
    CHECK(luma_kv_free_blocks(other, 0) == 8 && luma_kv_block_refs(kv, 0, 0) == 1);
    luma_kv_free(other);

    luma_kv_seq_free(kv, s);
    luma_kv_seq_free(kv, NULL);
    CHECK(luma_kv_free_blocks(kv, 0) == 8);
    luma_kv_free(kv);
    luma_kv_free(NULL);
}

static void test_growth(void)
{
    cache c;
    cache_open(&c, 1, 4, 16, 0, 0, 0);
    tseq t;
    tseq_new(&c, &t);
    int32_t steps[] = { 1, 3, 5, 7, 4, 1 };
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++) {
        CHECK(append(&c, &t, steps[i]) == 0);
        int32_t n, len = luma_kv_seq_len(t.s);
        luma_kv_seq_blocks(t.s, 0, &n);
        CHECK(n == (len + 3) / 4);
        CHECK(luma_kv_free_blocks(c.kv, 0) == 16 - n);
        check_all(&c, &t, 1);
    }
    CHECK(luma_kv_seq_len(t.s) == 21);

    /* Reserving twice without commit covers the same positions again. */
    luma_err err;
    CHECK(luma_kv_reserve(c.kv, t.s, 3, &err) == 0);
    int32_t free1 = luma_kv_free_blocks(c.kv, 0);
    CHECK(luma_kv_reserve(c.kv, t.s, 3, &err) == 0);
    CHECK(luma_kv_free_blocks(c.kv, 0) == free1);
    CHECK(luma_kv_reserve(c.kv, t.s, 11, &err) == 0);
    CHECK(luma_kv_free_blocks(c.kv, 0) == free1 - 2);
    CHECK(append(&c, &t, 2) == 0);
    CHECK(luma_kv_free_blocks(c.kv, 0) == free1 - 2);
    CHECK(c.st.copies == 0);
    check_all(&c, &t, 1);
    tseq_free(&c, &t);
    cache_close(&c);
}

static void test_fork(void)
{
    cache c;
    cache_open(&c, 2, 4, 32, 0, 32, 0);
    tseq t[4] = { { 0 } };

    /* Parent writes first into the shared partial block, then the child. */
    tseq_new(&c, &t[0]);
    CHECK(append(&c, &t[0], 6) == 0);
    tseq_fork(&c, &t[1], &t[0]);
    int32_t n;
    const int32_t *tab = luma_kv_seq_blocks(t[0].s, 0, &n);
    CHECK(n == 2 && luma_kv_block_refs(c.kv, 0, tab[0]) == 2 &&
          luma_kv_block_refs(c.kv, 0, tab[1]) == 2);
    check_all(&c, t, 2);
    CHECK(append(&c, &t[0], 1) == 0);
    CHECK(c.st.copies == 2);  /* one block per pool */
    check_all(&c, t, 2);
    CHECK(append(&c, &t[1], 1) == 0);
    CHECK(c.st.copies == 2);  /* the old block is the child's alone now */
    check_all(&c, t, 2);
    CHECK(append(&c, &t[0], 5) == 0 && append(&c, &t[1], 8) == 0);
    check_all(&c, t, 2);

    /* The child writes first; a fork at a block boundary copies nothing. */
    tseq_fork(&c, &t[2], &t[1]);
    CHECK(append(&c, &t[2], 3) == 0);
    CHECK(c.st.copies == 4);
    check_all(&c, t, 3);
    CHECK(append(&c, &t[1], 2) == 0);
    CHECK(c.st.copies == 4);
    check_all(&c, t, 3);
    CHECK(luma_kv_seq_len(t[0].s) == 12);
    tseq_fork(&c, &t[3], &t[0]);
    CHECK(append(&c, &t[3], 4) == 0 && append(&c, &t[0], 4) == 0);
    CHECK(c.st.copies == 4);
    check_all(&c, t, 4);
    tseq_free(&c, &t[3]);

    /* Fork of a fork, all three diverging inside the same shared block. */
    tseq_fork(&c, &t[3], &t[2]);
    tseq_free(&c, &t[0]);
    tseq_fork(&c, &t[0], &t[3]);
    check_all(&c, t, 4);
    for (int round = 0; round < 3; round++)
        for (int j = 0; j < 4; j++) {
            CHECK(append(&c, &t[j], 1 + (j + round) % 3) == 0);
            check_all(&c, t, 4);
        }

    /* A fork does not share the parent's reserved, uncommitted blocks. */
    CHECK(scribble(&c, &t[1], 9) == 0);
    tseq_free(&c, &t[2]);
    tseq_fork(&c, &t[2], &t[1]);
    CHECK(append(&c, &t[2], 6) == 0);
    check_all(&c, t, 4);
    CHECK(append(&c, &t[1], 9) == 0);
    check_all(&c, t, 4);

    /* Freeing the parent while the child lives. */
    tseq_free(&c, &t[1]);
    check_all(&c, t, 4);
    CHECK(append(&c, &t[2], 5) == 0);
    check_all(&c, t, 4);
    for (int j = 0; j < 4; j++)
        if (t[j].s) tseq_free(&c, &t[j]);
    cache_close(&c);
}

static void test_rewind(void)
{
    cache c;
    cache_open(&c, 1, 4, 16, 0, 0, 0);
    tseq t[2] = { { 0 } };
    luma_err err;
    tseq_new(&c, &t[0]);
    CHECK(append(&c, &t[0], 10) == 0);
    CHECK(luma_kv_rewind(c.kv, t[0].s, 5, &err) == 0);
    int32_t n;
    luma_kv_seq_blocks(t[0].s, 0, &n);
    CHECK(luma_kv_seq_len(t[0].s) == 5 && n == 2 && luma_kv_free_blocks(c.kv, 0) == 14);
    check_all(&c, t, 1);
    t[0].id = next_id++;  /* regrown positions get new values */
    CHECK(append(&c, &t[0], 7) == 0);
    check_all(&c, t, 1);

    /* Rewinding a fork into the shared prefix, then regrowing, copies. */
    tseq_fork(&c, &t[1], &t[0]);
    CHECK(luma_kv_rewind(c.kv, t[1].s, 3, &err) == 0);
    check_all(&c, t, 2);
    CHECK(append(&c, &t[1], 6) == 0);
    CHECK(c.st.copies == 1);
    check_all(&c, t, 2);

    /* Rewind drops a reservation; rewinding to 0 empties. */
    CHECK(luma_kv_reserve(c.kv, t[0].s, 9, &err) == 0);
    CHECK(luma_kv_rewind(c.kv, t[0].s, luma_kv_seq_len(t[0].s), &err) == 0);
    luma_kv_seq_blocks(t[0].s, 0, &n);
    CHECK(n == 3);
    check_all(&c, t, 2);
    CHECK(luma_kv_rewind(c.kv, t[0].s, 0, &err) == 0);
    luma_kv_seq_blocks(t[0].s, 0, &n);
    CHECK(n == 0 && luma_kv_seq_len(t[0].s) == 0);
    check_all(&c, t, 2);
    CHECK(append(&c, &t[0], 4) == 0);
    check_all(&c, t, 2);
    tseq_free(&c, &t[0]);
    tseq_free(&c, &t[1]);
    cache_close(&c);
}

static void test_exhaustion(void)
{
    cache c;
    snapshot a;
    tseq t[3] = { { 0 } };
    cache_open(&c, 2, 4, 4, 0, 8, 0);
    tseq_new(&c, &t[0]);
    CHECK(append(&c, &t[0], 12) == 0);
    snap(&c, &t[0], &a);
    CHECK(append(&c, &t[0], 8) == -1);
    CHECK(strcmp(last_err.msg, "KV cache full: pool 0 needs 2 blocks, 1 free") == 0);
    CHECK(same(&c, &t[0], &a));
    CHECK(append(&c, &t[0], 4) == 0);
    snap(&c, &t[0], &a);
    CHECK(append(&c, &t[0], 1) == -1 && same(&c, &t[0], &a));
    check_all(&c, t, 1);
    tseq_free(&c, &t[0]);

    /* The copy of a shared partial block counts among the blocks needed. */
    tseq_new(&c, &t[0]);
    CHECK(append(&c, &t[0], 6) == 0);
    tseq_fork(&c, &t[1], &t[0]);
    tseq_fork(&c, &t[2], &t[0]);
    CHECK(append(&c, &t[0], 2) == 0);
    snap(&c, &t[1], &a);
    CHECK(append(&c, &t[1], 3) == -1);
    CHECK(strcmp(last_err.msg, "KV cache full: pool 0 needs 2 blocks, 1 free") == 0);
    CHECK(same(&c, &t[1], &a));
    CHECK(append(&c, &t[1], 2) == 0 && luma_kv_free_blocks(c.kv, 0) == 0);
    check_all(&c, t, 3);
    for (int j = 0; j < 3; j++) tseq_free(&c, &t[j]);
    cache_close(&c);

    /* Pool 1 short while pool 0 has room: neither changes. */
    cache_open(&c, 2, 4, 8, 0, 4, 0);
    tseq_new(&c, &t[0]);
    tseq_new(&c, &t[1]);
    CHECK(append(&c, &t[1], 12) == 0);
    snap(&c, &t[0], &a);
    CHECK(append(&c, &t[0], 5) == -1);
    CHECK(strcmp(last_err.msg, "KV cache full: pool 1 needs 2 blocks, 1 free") == 0);
    CHECK(same(&c, &t[0], &a) && luma_kv_free_blocks(c.kv, 0) == 5);
    check_all(&c, t, 2);
    tseq_free(&c, &t[1]);
    tseq_free(&c, &t[0]);
    cache_close(&c);
}

static void test_window(void)
{
    const int32_t w = 10, bt = 4;
    const int32_t bound = (w + bt - 1) / bt + 1;
    cache c;
    luma_err err = { { 0 } };
    cache_open(&c, 2, bt, 200, 0, 8, w);
    tseq t[2] = { { 0 } };
    tseq_new(&c, &t[0]);
    int32_t bad = 0;
    peak_used[1] = 0;
    for (int32_t i = 0; i < 600; i++) {
        if (append(&c, &t[0], 1) != 0) bad++;
        /* Released entries are exactly the blocks out of every future window. */
        int32_t n, len = luma_kv_seq_len(t[0].s);
        const int32_t *tab = luma_kv_seq_blocks(t[0].s, 1, &n);
        for (int32_t j = 0; j < n; j++)
            if ((tab[j] == -1) != ((j + 1) * bt - 1 < len - (w - 1))) bad++;
        if (i % 16 == 0) check_all(&c, t, 1);
    }
    CHECK(bad == 0);
    CHECK(peak_used[1] <= bound && luma_kv_free_blocks(c.kv, 1) >= 8 - bound);
    printf("  window %d, block %d: at most %d blocks in use over 600 positions (bound %d)\n",
           (int)w, (int)bt, (int)peak_used[1], (int)bound);
    check_all(&c, t, 1);

    /* At len 600 keys from 591 on are seen; blocks 0..146 (positions < 588)
     * are released, so len 595 would need position 586 again. */
    snapshot a;
    snap(&c, &t[0], &a);
    CHECK(luma_kv_rewind(c.kv, t[0].s, 595, &err) == -1);
    CHECK(strcmp(err.msg, "cannot rewind to 595: sliding-window blocks already released") == 0);
    CHECK(same(&c, &t[0], &a));
    CHECK(luma_kv_rewind(c.kv, t[0].s, 598, &err) == 0);
    check_all(&c, t, 1);
    t[0].id = next_id++;
    CHECK(append(&c, &t[0], 3) == 0);
    check_all(&c, t, 1);

    /* A fork keeps released entries released and shares the live ones. */
    tseq_fork(&c, &t[1], &t[0]);
    check_all(&c, t, 2);
    for (int i = 0; i < 20; i++) {
        CHECK(append(&c, &t[i % 2], 1 + i % 3) == 0);
        check_all(&c, t, 2);
    }
    tseq_free(&c, &t[0]);
    check_all(&c, &t[1], 1);

    /* Chunks of n positions keep at most ceil((w + n - 1) / bt) + 1 blocks. */
    CHECK(luma_kv_rewind(c.kv, t[1].s, 0, &err) == 0);
    CHECK(luma_kv_free_blocks(c.kv, 1) == 8 && luma_kv_free_blocks(c.kv, 0) == 200);
    peak_used[1] = 0;
    for (int i = 0; i < 80; i++) CHECK(append(&c, &t[1], 7) == 0);
    CHECK(peak_used[1] <= (w + 7 - 1 + bt - 1) / bt + 1);
    check_all(&c, &t[1], 1);
    tseq_free(&c, &t[1]);
    cache_close(&c);
}

/* With keep, blocks are released keep positions past the window, and a
 * rewind by up to keep positions always finds its blocks: speculative
 * decoding rewinds the guesses the model turned down. */
static void test_keep(void)
{
    const int32_t w = 10, bt = 4, keep = 6;
    cache c;
    luma_err err = { { 0 } };
    open_keep = keep;
    cache_open(&c, 2, bt, 1000, 0, 12, w);
    open_keep = 0;
    tseq t = { 0 };
    tseq_new(&c, &t);
    int32_t bad = 0, refused = 0, longer = 0, top = 0;
    for (int32_t i = 0; i < 300; i++) {
        int32_t n = 1 + i % 9;   /* a step of a token and up to 8 guesses */
        if (append(&c, &t, n) != 0) bad++;
        int32_t len = luma_kv_seq_len(t.s), nb;
        /* released: the blocks out of the window and keep of the longest
         * the sequence has been (a rewind releases nothing again) */
        if (len > top) top = len;
        const int32_t *tab = luma_kv_seq_blocks(t.s, 1, &nb);
        for (int32_t j = 0; j < nb; j++)
            if ((tab[j] == -1) != ((j + 1) * bt - 1 < top - (w - 1) - keep)) bad++;
        /* the guesses turned down: up to keep positions */
        int32_t r = (i * 7) % (keep + 1);
        if (r > n) r = n;
        if (luma_kv_rewind(c.kv, t.s, len - r, &err) != 0) {
            bad++;
            continue;
        }
        t.id = next_id++;
        if (i % 10 == 0) check_all(&c, &t, 1);
        /* further back than keep and a block: refused, and nothing changes */
        len = luma_kv_seq_len(t.s);
        if (len > w + keep + bt) {
            snapshot a;
            snap(&c, &t, &a);
            if (luma_kv_rewind(c.kv, t.s, len - keep - bt, &err) == 0) {
                longer++;
                t.id = next_id++;
            } else {
                refused++;
                if (!same(&c, &t, &a) || !strstr(err.msg, "kept for rewinds of fewer positions")) bad++;
            }
        }
    }
    CHECK(bad == 0);
    CHECK(refused > 0);
    printf("  window %d, block %d, keep %d: every rewind of up to %d positions kept its blocks; %d of %d longer "
           "ones refused\n", (int)w, (int)bt, (int)keep, (int)keep, (int)refused, (int)(refused + longer));
    check_all(&c, &t, 1);
    tseq_free(&c, &t);
    cache_close(&c);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t rnd(uint32_t n)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33) % n;
}

static void test_stress(void)
{
    enum { N_SEQ = 8, N_OPS = 4000 };
    cache c;
    luma_err err = { { 0 } };
    cache_open(&c, 2, 4, 32, 0, 16, 9);
    tseq t[N_SEQ] = { { 0 } };
    int done[7] = { 0 }, refused[7] = { 0 };
    for (int op = 0; op < N_OPS; op++) {
        int j = (int)rnd(N_SEQ);
        int kind = (int)rnd(7);
        if (!t[j].s) kind = rnd(2) ? 0 : 1;
        int ok = 1;
        snapshot a;
        switch (kind) {
        case 0:
            if (t[j].s) tseq_free(&c, &t[j]);
            tseq_new(&c, &t[j]);
            break;
        case 1: {
            int from = (int)rnd(N_SEQ);
            if (!t[from].s || from == j) {
                ok = 0;
                break;
            }
            if (t[j].s) tseq_free(&c, &t[j]);
            tseq_fork(&c, &t[j], &t[from]);
            break;
        }
        case 2:
        case 3: {
            snap(&c, &t[j], &a);
            ok = append(&c, &t[j], 1 + (int32_t)rnd(12)) == 0;
            if (!ok) CHECK(same(&c, &t[j], &a) && strstr(last_err.msg, "KV cache full"));
            break;
        }
        case 4:
            snap(&c, &t[j], &a);
            ok = scribble(&c, &t[j], 1 + (int32_t)rnd(12)) == 0;
            if (!ok) CHECK(same(&c, &t[j], &a) && strstr(last_err.msg, "KV cache full"));
            break;
        case 5: {
            int32_t len = luma_kv_seq_len(t[j].s);
            snap(&c, &t[j], &a);
            ok = luma_kv_rewind(c.kv, t[j].s, (int32_t)rnd((uint32_t)len + 1), &err) == 0;
            if (!ok) CHECK(same(&c, &t[j], &a) && strstr(err.msg, "already released"));
            else t[j].id = next_id++;
            break;
        }
        case 6: tseq_free(&c, &t[j]); break;
        }
        if (ok) done[kind]++;
        else refused[kind]++;
        check_all(&c, t, N_SEQ);
    }
    printf("  %d ops: new %d, fork %d (%d skipped), append %d (%d full), scribble %d (%d full), "
           "rewind %d (%d refused), free %d; %d copies\n",
           N_OPS, done[0], done[1], refused[1], done[2] + done[3], refused[2] + refused[3],
           done[4], refused[4], done[5], refused[5], done[6], c.st.copies);
    CHECK(refused[2] + refused[3] > 0 && refused[5] > 0 && c.st.copies > 0);
    for (int j = 0; j < N_SEQ; j++)
        if (t[j].s) tseq_free(&c, &t[j]);
    cache_close(&c);
}

static void run(const char *name, void (*fn)(void))
{
    int f0 = failures, c0 = checks;
    fn();
    printf("kv %-10s %s: %d checks, %d failed\n", name, failures == f0 ? "ok" : "FAIL",
           checks - c0, failures - f0);
}

int main(void)
{
    run("arguments", test_arguments);
    run("growth", test_growth);
    run("fork", test_fork);
    run("rewind", test_rewind);
    run("exhaustion", test_exhaustion);
    run("window", test_window);
    run("keep", test_keep);
    run("stress", test_stress);
    printf("kv: %d checks, %d failed\n", checks, failures);
    return failures != 0;
}
