/* The logits math (src/sample.c) and the rng (src/rng.c) against plain
 * double-precision references written here: full sorts, explicit softmax,
 * the llama.cpp algorithms step by step. Random logits of n = 1000 and
 * n = 262144 (the Gemma 3 vocabulary) with masked (-inf) entries, fixed
 * seeds. luma_sampler_draw (a top-k's compact form) against the same
 * chain applied to the whole vector. Ends with the time per call on n =
 * 262144 (informative only). */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rng.h"
#include "sample.h"

#define BIG 262144

static int checks, fails;
static int group_checks, group_fails;

static void check(int ok, const char *fmt, ...)
{
    checks++;
    group_checks++;
    if (ok) return;
    fails++;
    group_fails++;
    if (group_fails > 10) return;
    va_list ap;
    va_start(ap, fmt);
    printf("  FAIL: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

static void group_end(const char *name)
{
    printf("%-14s %4d checks, %d failed\n", name, group_checks, group_fails);
    group_checks = 0;
    group_fails = 0;
}

static double now(void)
{
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- a second xoshiro256** / splitmix64, written from the papers ---------- */

typedef struct { uint64_t a, b, c, d; } ref_rng;

static uint64_t ref_splitmix(uint64_t *state)
{
    *state += UINT64_C(0x9E3779B97F4A7C15);
    uint64_t z = *state;
    z ^= z >> 30;
    z *= UINT64_C(0xBF58476D1CE4E5B9);
    z ^= z >> 27;
    z *= UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

static void ref_seed(ref_rng *r, uint64_t seed)
{
    r->a = ref_splitmix(&seed);
    r->b = ref_splitmix(&seed);
    r->c = ref_splitmix(&seed);
    r->d = ref_splitmix(&seed);
}

static uint64_t ref_next(ref_rng *r)
{
    uint64_t m = r->b * 5;
    uint64_t out = ((m << 7) | (m >> 57)) * 9;
    uint64_t t = r->b << 17;
    r->c ^= r->a;
    r->d ^= r->b;
    r->b ^= r->c;
    r->a ^= r->d;
    r->c ^= t;
    r->d = (r->d << 45) | (r->d >> 19);
    return out;
}

static double ref_uniform(ref_rng *r)
{
    return ldexp((double)(ref_next(r) >> 11), -53);
}

/* Seed 42, computed once with an independent Python implementation. */
static const uint64_t seed42_u64[6] = {
    UINT64_C(0x15780b2e0c2ec716), UINT64_C(0x6104d9866d113a7e), UINT64_C(0xae17533239e499a1),
    UINT64_C(0xecb8ad4703b360a1), UINT64_C(0xfde6dc7fe2ec5e64), UINT64_C(0xc50da53101795238),
};
static const double seed42_uniform[6] = {
    0.08386297105988216, 0.3789802506626686, 0.6800434110281394,
    0.9246929453253876, 0.9918039142821028, 0.7697394604342425,
};

static void test_rng(void)
{
    luma_rng r;
    luma_rng_seed(&r, 42);
    for (int i = 0; i < 6; i++) {
        uint64_t v = luma_rng_next_u64(&r);
        check(v == seed42_u64[i], "seed 42 draw %d: %016llx", i, (unsigned long long)v);
    }
    luma_rng_seed(&r, 42);
    for (int i = 0; i < 6; i++) {
        double u = luma_rng_uniform(&r);
        check(u == seed42_uniform[i], "seed 42 uniform %d: %.17g", i, u);
    }
    const uint64_t seeds[] = { 0, 1, 42, 7, UINT64_MAX };
    for (size_t s = 0; s < sizeof seeds / sizeof *seeds; s++) {
        ref_rng q;
        luma_rng_seed(&r, seeds[s]);
        ref_seed(&q, seeds[s]);
        int same = 1, in_range = 1;
        for (int i = 0; i < 10000; i++) {
            same &= luma_rng_next_u64(&r) == ref_next(&q);
            double u = luma_rng_uniform(&r), v = ref_uniform(&q);
            same &= u == v;
            in_range &= u >= 0.0 && u < 1.0;
        }
        check(same, "seed %llu: luma_rng differs from the reference", (unsigned long long)seeds[s]);
        check(in_range, "seed %llu: uniform outside [0, 1)", (unsigned long long)seeds[s]);
    }
    luma_rng a, b;
    luma_rng_seed(&a, 123);
    luma_rng_seed(&b, 124);
    check(luma_rng_next_u64(&a) != luma_rng_next_u64(&b), "seeds 123 and 124 start alike");
    group_end("rng");
}

/* ---- data and references -------------------------------------------------- */

static double normal(ref_rng *r)
{
    double u = ref_uniform(r), v = ref_uniform(r);
    return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}

/* kind 0: N(0, 3); kind 1: N(0, 2) with a few entries 8 to 15 higher, like a
 * language model's logits. A fraction `masked` of entries is -inf. */
static void make_logits(float *x, int32_t n, uint64_t seed, double masked, int kind)
{
    ref_rng r;
    ref_seed(&r, seed);
    for (int32_t i = 0; i < n; i++) x[i] = (float)((kind == 0 ? 3.0 : 2.0) * normal(&r));
    if (kind == 1)
        for (int j = 0; j < 20; j++) {
            int32_t i = (int32_t)(ref_next(&r) % (uint64_t)n);
            x[i] += (float)(8.0 + 7.0 * ref_uniform(&r));
        }
    for (int32_t i = 0; i < n; i++)
        if (ref_uniform(&r) < masked) x[i] = -INFINITY;
}

typedef struct { double key; int32_t id; } ent;

static int ent_cmp(const void *pa, const void *pb)
{
    const ent *a = pa, *b = pb;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* The live entries by value descending, ties by lower id (key = -value). */
static int32_t ref_order(const float *x, int32_t n, ent *out)
{
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++)
        if (x[i] != -INFINITY) out[m++] = (ent){ -(double)x[i], i };
    qsort(out, (size_t)m, sizeof *out, ent_cmp);
    return m;
}

/* Softmax in double; returns the number of live entries. */
static int32_t ref_probs(const float *x, int32_t n, double *p)
{
    double m = -INFINITY, z = 0.0;
    int32_t live = 0;
    for (int32_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    for (int32_t i = 0; i < n; i++) {
        p[i] = x[i] == -INFINITY ? 0.0 : exp((double)x[i] - m);
        z += p[i];
        live += x[i] != -INFINITY;
    }
    for (int32_t i = 0; i < n; i++) p[i] /= z;
    return live;
}

/* The references' view of one vector, made once by ref_prepare: its
 * probabilities, its live entries by value and in typical sampling's order
 * (llama.cpp's, in double), and the entries the last reference kept. */
static double *g_p;
static ent *g_by_value, *g_typical;
static int32_t g_live;
static unsigned char *g_keep;

static void ref_prepare(const float *x, int32_t n)
{
    g_live = ref_order(x, n, g_by_value);
    ref_probs(x, n, g_p);
    double h = 0.0;
    for (int32_t i = 0; i < n; i++)
        if (g_p[i] > 0.0) h -= g_p[i] * log(g_p[i]);
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++)
        if (x[i] != -INFINITY) g_typical[m++] = (ent){ fabs(-log(g_p[i]) - h), i };
    qsort(g_typical, (size_t)m, sizeof *g_typical, ent_cmp);
}

static void keep_prefix(const ent *order, int32_t count)
{
    memset(g_keep, 0, BIG);
    for (int32_t j = 0; j < count; j++) g_keep[order[j].id] = 1;
}

/* The length of the shortest prefix of order whose mass reaches p and that
 * holds at least min_keep entries (all of them when none does). */
static int32_t mass_prefix(const ent *order, double p, int32_t min_keep, int strict)
{
    double cum = 0.0;
    for (int32_t j = 0; j < g_live; j++) {
        cum += g_p[order[j].id];
        if ((strict ? cum > p : cum >= p) && j + 1 >= min_keep) return j + 1;
    }
    return g_live;
}

static void ref_top_k(int32_t k)
{
    keep_prefix(g_by_value, k < g_live ? k : g_live);
}

static void ref_top_p(float p, int32_t min_keep)
{
    keep_prefix(g_by_value, p >= 1.0f ? g_live : mass_prefix(g_by_value, p, min_keep, 0));
}

static void ref_typical(float p, int32_t min_keep)
{
    keep_prefix(g_typical, p >= 1.0f ? g_live : mass_prefix(g_typical, p, min_keep, 1));
}

static void ref_min_p(float p, int32_t min_keep)
{
    double pmax = g_p[g_by_value[0].id];
    int32_t count = 0;
    for (int32_t j = 0; j < g_live; j++) count += g_p[g_by_value[j].id] >= p * pmax;
    if (count < min_keep) count = min_keep < g_live ? min_keep : g_live;
    keep_prefix(g_by_value, count);
}

/* A filter keeps g_keep's entries unchanged and masks the others. */
static int32_t filter_mismatches(const float *orig, const float *got, int32_t n)
{
    int32_t bad = 0;
    for (int32_t i = 0; i < n; i++) {
        float want = g_keep[i] ? orig[i] : -INFINITY;
        bad += !(got[i] == want);
    }
    return bad;
}

static int32_t count_masked(const float *x, int32_t n)
{
    int32_t c = 0;
    for (int32_t i = 0; i < n; i++) c += x[i] == -INFINITY;
    return c;
}

/* ---- checks ------------------------------------------------------------------ */

static float *g_orig, *g_x;

static void test_argmax_topk(int32_t n)
{
    luma_err err;
    for (int kind = 0; kind < 2; kind++) {
        make_logits(g_orig, n, 100 + kind, 0.1, kind);
        int32_t m = ref_order(g_orig, n, g_by_value);
        int32_t a = luma_logits_argmax(g_orig, n, &err);
        check(a == g_by_value[0].id, "argmax n=%d: %d, want %d", n, a, g_by_value[0].id);
        const int32_t ks[] = { 1, 5, 40, 1000, n + 7 };
        int32_t *ids = malloc((size_t)(n + 7) * sizeof *ids);
        float *vals = malloc((size_t)(n + 7) * sizeof *vals);
        for (size_t t = 0; t < sizeof ks / sizeof *ks; t++) {
            int32_t k = ks[t], want = k < m ? k : m;
            int32_t got = luma_logits_topk(g_orig, n, k, ids, vals, &err);
            int bad = got != want;
            for (int32_t j = 0; j < want && !bad; j++)
                bad = ids[j] != g_by_value[j].id || vals[j] != g_orig[g_by_value[j].id];
            check(!bad, "topk n=%d k=%d: count %d want %d", n, k, got, want);
        }
        free(ids);
        free(vals);
    }
    /* Ties: the lowest id wins, and so do the lowest ids at topk's boundary. */
    float t[8] = { 1, 3, 2, 3, -INFINITY, 3, 0, 2 };
    check(luma_logits_argmax(t, 8, &err) == 1, "argmax tie");
    int32_t ids[4];
    float vals[4];
    int32_t got = luma_logits_topk(t, 8, 4, ids, vals, &err);
    check(got == 4 && ids[0] == 1 && ids[1] == 3 && ids[2] == 5 && ids[3] == 2 && vals[3] == 2,
          "topk ties");
    char name[32];
    snprintf(name, sizeof name, "argmax/topk %d", n);
    group_end(name);
}

static void test_filters(int32_t n)
{
    luma_err err;
    char name[32];
    /* kind 2 leaves about 0.4% of the entries live (as after a top_k): the
     * large vector then goes through the compact path of sample.c. */
    for (int kind = 0; kind < 3; kind++) {
        make_logits(g_orig, n, 200 + kind, kind == 2 ? 0.996 : 0.1, kind % 2);
        ref_prepare(g_orig, n);

        const int32_t ks[] = { 1, 40, 500, n };
        for (size_t t = 0; t < sizeof ks / sizeof *ks; t++) {
            memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
            int rc = luma_logits_top_k(g_x, n, ks[t], &err);
            ref_top_k(ks[t]);
            int32_t bad = filter_mismatches(g_orig, g_x, n);
            check(rc == 0 && bad == 0, "top_k n=%d kind=%d k=%d: %d wrong", n, kind, ks[t], bad);
        }

        const float ps[] = { 0.1f, 0.5f, 0.9f, 0.95f, 0.99f, 1.0f };
        const int32_t keeps[] = { 0, 1, 50 };
        for (size_t t = 0; t < sizeof ps / sizeof *ps; t++)
            for (size_t u = 0; u < sizeof keeps / sizeof *keeps; u++) {
                memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
                int rc = luma_logits_top_p(g_x, n, ps[t], keeps[u], &err);
                ref_top_p(ps[t], keeps[u]);
                int32_t bad = filter_mismatches(g_orig, g_x, n);
                check(rc == 0 && bad == 0, "top_p n=%d kind=%d p=%g min_keep=%d: %d wrong", n,
                      kind, ps[t], keeps[u], bad);

                memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
                rc = luma_logits_typical(g_x, n, ps[t], keeps[u], &err);
                ref_typical(ps[t], keeps[u]);
                bad = filter_mismatches(g_orig, g_x, n);
                check(rc == 0 && bad == 0, "typical n=%d kind=%d p=%g min_keep=%d: %d wrong", n,
                      kind, ps[t], keeps[u], bad);
            }

        const float mps[] = { 0.001f, 0.05f, 0.3f, 1.0f };
        const int32_t mkeeps[] = { 0, 3, 200 };
        for (size_t t = 0; t < sizeof mps / sizeof *mps; t++)
            for (size_t u = 0; u < sizeof mkeeps / sizeof *mkeeps; u++) {
                memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
                int rc = luma_logits_min_p(g_x, n, mps[t], mkeeps[u], &err);
                ref_min_p(mps[t], mkeeps[u]);
                int32_t bad = filter_mismatches(g_orig, g_x, n);
                check(rc == 0 && bad == 0, "min_p n=%d kind=%d p=%g min_keep=%d: %d wrong", n,
                      kind, mps[t], mkeeps[u], bad);
            }
    }

    /* Far outliers put nearly everything into one bin; equal logits tie by id. */
    for (int32_t i = 0; i < n; i++) g_orig[i] = i % 3 == 0 ? 1.0f : i % 3 == 1 ? -1e30f : 0.5f;
    g_orig[n / 2] = 40.0f;
    g_orig[n / 3] = 39.5f;
    ref_prepare(g_orig, n);
    const float ops[] = { 0.3f, 0.7f, 0.9999f };
    for (size_t t = 0; t < sizeof ops / sizeof *ops; t++) {
        memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
        luma_logits_top_p(g_x, n, ops[t], 0, &err);
        ref_top_p(ops[t], 0);
        check(filter_mismatches(g_orig, g_x, n) == 0, "top_p outliers p=%g", ops[t]);
        memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
        luma_logits_typical(g_x, n, ops[t], 0, &err);
        ref_typical(ops[t], 0);
        check(filter_mismatches(g_orig, g_x, n) == 0, "typical outliers p=%g", ops[t]);
    }
    for (int32_t i = 0; i < n; i++) g_orig[i] = 2.0f;
    ref_prepare(g_orig, n);
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    luma_logits_top_p(g_x, n, 0.3051f, 0, &err);
    ref_top_p(0.3051f, 0);
    check(filter_mismatches(g_orig, g_x, n) == 0, "top_p all equal");
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    luma_logits_top_k(g_x, n, 7, &err);
    ref_top_k(7);
    check(filter_mismatches(g_orig, g_x, n) == 0 && g_x[6] == 2.0f && g_x[7] == -INFINITY,
          "top_k all equal keeps ids 0..6");
    snprintf(name, sizeof name, "filters %d", n);
    group_end(name);
}

/* top_p with an order hint (luma_logits_top_p_ordered, as a compact
 * row's top-k leaves it): the same bits as without it when the hint holds,
 * when edits made it stale, and when it is any permutation; and it is
 * timed against the sort it spares. */
static void test_top_p_ordered(int32_t n)
{
    luma_err err;
    int32_t *order = malloc((size_t)n * sizeof *order), *ids = malloc((size_t)n * sizeof *ids);
    float *vals = malloc((size_t)n * sizeof *vals), *y = malloc((size_t)n * sizeof *y);
    ref_rng r;
    ref_seed(&r, 900 + (uint64_t)n);
    const float ps[] = { 0.1f, 0.5f, 0.9f, 0.95f, 1.0f };
    const int32_t keeps[] = { 0, 1, 50 };
    for (int kind = 0; kind < 3; kind++) {
        make_logits(g_orig, n, 910 + kind, kind == 2 ? 0.3 : 0.0, kind % 2);
        if (kind == 2)   /* ties */
            for (int32_t i = 0; i < n; i += 3) g_orig[i] = g_orig[0];
        for (int hint = 0; hint < 3; hint++) {
            /* 0: the top-k's order; 1: that order, then the values edited;
             * 2: a shuffle */
            int32_t got = luma_logits_topk(g_orig, n, n, ids, vals, &err), k = got;
            for (int32_t i = 0; i < n; i++)
                if (!(g_orig[i] > -INFINITY)) ids[k++] = i;   /* the masked ones last */
            memcpy(order, ids, (size_t)n * sizeof *order);
            memcpy(y, g_orig, (size_t)n * sizeof *y);
            if (hint == 1)
                for (int32_t i = 0; i < n; i += 7) y[i] = y[i] > -INFINITY ? y[i] * 0.5f + 1.0f : y[i];
            if (hint == 2)
                for (int32_t i = n - 1; i > 0; i--) {
                    int32_t j = (int32_t)(ref_next(&r) % (uint64_t)(i + 1)), t = order[i];
                    order[i] = order[j];
                    order[j] = t;
                }
            for (size_t t = 0; t < sizeof ps / sizeof *ps; t++)
                for (size_t u = 0; u < sizeof keeps / sizeof *keeps; u++) {
                    memcpy(g_x, y, (size_t)n * sizeof *g_x);
                    int rc = luma_logits_top_p(g_x, n, ps[t], keeps[u], &err);
                    memcpy(vals, y, (size_t)n * sizeof *vals);
                    int rc2 = luma_logits_top_p_ordered(vals, n, order, ps[t], keeps[u], &err);
                    check(rc == 0 && rc2 == 0 && memcmp(g_x, vals, (size_t)n * sizeof *vals) == 0,
                          "top_p ordered n=%d kind=%d hint=%d p=%g min_keep=%d: not the unordered result", n,
                          kind, hint, ps[t], keeps[u]);
                }
        }
    }
    /* timing: a top-k's 40 in id order (as the compact form keeps them) */
    make_logits(g_orig, n, 990, 0.0, 0);
    int32_t got = luma_logits_topk(g_orig, n, n, ids, vals, &err);
    memcpy(order, ids, (size_t)got * sizeof *order);
    const int reps = 20000;
    double t0 = now();
    for (int i = 0; i < reps; i++) {
        memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
        luma_logits_top_p(g_x, n, 0.95f, 1, &err);
    }
    double t1 = now();
    for (int i = 0; i < reps; i++) {
        memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
        luma_logits_top_p_ordered(g_x, n, order, 0.95f, 1, &err);
    }
    double t2 = now();
    printf("  top_p 0.95 of %d entries: %.2f us sorted, %.2f us in the top-k's order (informative)\n", n,
           1e6 * (t1 - t0) / reps, 1e6 * (t2 - t1) / reps);
    free(order);
    free(ids);
    free(vals);
    free(y);
    char name[40];
    snprintf(name, sizeof name, "top_p ordered %d", n);
    group_end(name);
}

/* luma_sampler_draw (the compact form of a top-k, as seq:sample draws on
 * the host) against the same chain on the whole vector: top_k, top_p,
 * min_p, temperature, then luma_logits_sample with the same uniform. */
static void test_sampler(int32_t n)
{
    luma_err err;
    /* top_k, top_p, min_p, temp, and no penalties (repeat, frequency,
     * presence, last_n: luma_model_decode applies them, not the draw) */
    const luma_sampler chains[] = {
        { 40, 0.95f, 0.0f, 0.8f, 1.0f, 0.0f, 0.0f, 0 },  { 64, 1.0f, 0.05f, 1.3f, 1.0f, 0.0f, 0.0f, 0 },
        { 8, 0.9f, 0.1f, 0.5f, 1.0f, 0.0f, 0.0f, 0 },    { 1, 1.0f, 0.0f, 2.0f, 1.0f, 0.0f, 0.0f, 0 },
        { 64, 0.5f, 0.0f, 0.01f, 1.0f, 0.0f, 0.0f, 0 },  { 3, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0 },
    };
    luma_rng rng;
    luma_rng_seed(&rng, 4242);
    for (int kind = 0; kind < 3; kind++) {
        make_logits(g_orig, n, 950 + kind, kind == 2 ? 0.5 : 0.0, kind % 2);
        if (kind == 2)   /* ties */
            for (int32_t i = 0; i < n; i += 5) g_orig[i] = g_orig[1];
        for (size_t c = 0; c < sizeof chains / sizeof *chains; c++)
            for (int d = 0; d < 20; d++) {
                const luma_sampler *s = &chains[c];
                luma_rng peek = rng;
                const double u = luma_rng_uniform(&peek);
                memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
                int rc = luma_logits_top_k(g_x, n, s->top_k, &err);
                if (rc == 0 && s->top_p < 1.0f) rc = luma_logits_top_p(g_x, n, s->top_p, 1, &err);
                if (rc == 0 && s->min_p > 0.0f) rc = luma_logits_min_p(g_x, n, s->min_p, 1, &err);
                if (rc == 0) rc = luma_logits_temperature(g_x, n, s->temp, &err);
                int32_t want = rc == 0 ? luma_logits_sample(g_x, n, &rng, &err) : -2;
                int32_t got = luma_sampler_draw(s, g_orig, n, u, &err);
                check(want >= 0 && got == want, "sampler n=%d kind=%d chain=%zu u=%.17g: %d, the chain %d", n, kind,
                      c, u, got, want);
            }
    }
    /* bad fields, and nothing live */
    luma_sampler bad[] = {
        { 0, 1.0f, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0 },      { 65, 1.0f, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0 },
        { 4, 0.0f, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0 },      { 4, 1.5f, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0 },
        { 4, 1.0f, -0.1f, 1.0f, 1.0f, 0.0f, 0.0f, 0 },     { 4, 1.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0 },
        { 4, 1.0f, 0.0f, INFINITY, 1.0f, 0.0f, 0.0f, 0 },  { 4, NAN, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f, 0 },
        { 4, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0.0f, 64 },     { 4, 1.0f, 0.0f, 1.0f, 1.1f, NAN, 0.0f, 64 },
        { 4, 1.0f, 0.0f, 1.0f, 1.1f, 0.0f, 0.0f, 257 },    { 4, 1.0f, 0.0f, 1.0f, 1.1f, 0.0f, 0.0f, -1 },
    };
    for (size_t b = 0; b < sizeof bad / sizeof *bad; b++)
        check(luma_sampler_draw(&bad[b], g_orig, n, 0.5, &err) == -1 && strstr(err.msg, "sampler:"),
              "sampler n=%d: bad fields %zu accepted", n, b);
    for (int32_t i = 0; i < n; i++) g_x[i] = -INFINITY;
    check(luma_sampler_draw(&chains[0], g_x, n, 0.5, &err) == -1 && strstr(err.msg, "masked"),
          "sampler n=%d: a vector with nothing live drew", n);
    char name[40];
    snprintf(name, sizeof name, "sampler %d", n);
    group_end(name);
}

static void test_moves(int32_t n)
{
    luma_err err;
    char name[32];
    make_logits(g_orig, n, 300, 0.1, 0);

    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    int rc = luma_logits_temperature(g_x, n, 0.7f, &err);
    int32_t bad = 0;
    for (int32_t i = 0; i < n; i++) bad += !(g_x[i] == g_orig[i] / 0.7f);
    check(rc == 0 && bad == 0, "temperature 0.7: %d wrong", bad);
    /* The same on a vector with few live entries (the compact path). */
    make_logits(g_orig, n, 301, 0.996, 0);
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    rc = luma_logits_temperature(g_x, n, 0.7f, &err);
    bad = 0;
    for (int32_t i = 0; i < n; i++) bad += !(g_x[i] == g_orig[i] / 0.7f);
    check(rc == 0 && bad == 0, "temperature 0.7, few live entries: %d wrong", bad);
    make_logits(g_orig, n, 300, 0.1, 0);
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    rc = luma_logits_temperature(g_x, n, 0.0f, &err);
    ref_prepare(g_orig, n);
    ref_top_k(1);
    check(rc == 0 && filter_mismatches(g_orig, g_x, n) == 0, "temperature 0 keeps the argmax");
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    luma_logits_temperature(g_x, n, 1e-45f, &err);
    bad = 0;
    for (int32_t i = 0; i < n; i++)
        bad += g_orig[i] == -INFINITY ? g_x[i] != -INFINITY : !isfinite(g_x[i]);
    check(bad == 0, "a tiny temperature keeps live entries finite: %d wrong", bad);

    /* A history drawn from a few hundred ids, so ids repeat. */
    int32_t hist[700];
    ref_rng r;
    ref_seed(&r, 301);
    for (int i = 0; i < 700; i++) hist[i] = (int32_t)(ref_next(&r) % 300u) * (n / 300);
    const int32_t last_ns[] = { 0, -1, 64, 699, 5000 };
    int *count = calloc((size_t)n, sizeof *count);
    for (size_t t = 0; t < sizeof last_ns / sizeof *last_ns; t++) {
        const float rep = 1.3f, freq = 0.2f, pres = 0.5f;
        memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
        rc = luma_logits_penalize(g_x, n, hist, 700, last_ns[t], rep, freq, pres, &err);
        int32_t w = last_ns[t] > 0 && last_ns[t] < 700 ? last_ns[t] : 700;
        memset(count, 0, (size_t)n * sizeof *count);
        for (int32_t j = 700 - w; j < 700; j++) count[hist[j]]++;
        bad = 0;
        for (int32_t i = 0; i < n; i++) {
            double v = g_orig[i];
            if (count[i] > 0 && v != -INFINITY) {
                v = v <= 0.0 ? v * rep : v / rep;
                v -= count[i] * (double)freq + pres;
            }
            bad += !(fabs(g_x[i] - v) <= 1e-5 * (1.0 + fabs(v)) || (v == -INFINITY && g_x[i] == v));
        }
        check(rc == 0 && bad == 0, "penalize last_n=%d: %d wrong", last_ns[t], bad);
    }
    free(count);
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    rc = luma_logits_penalize(g_x, n, hist, 700, 0, 1.0f, 0.0f, 0.0f, &err);
    check(rc == 0 && memcmp(g_x, g_orig, (size_t)n * sizeof *g_x) == 0, "neutral penalties");

    int32_t ids[5] = { 0, 1, n - 1, 1, n / 2 };
    float bias[5] = { 2.5f, -1.0f, -INFINITY, 0.25f, 1e38f };
    g_orig[0] = 1.0f;
    g_orig[1] = 3.0f;
    g_orig[n - 1] = 0.0f;
    g_orig[n / 2] = 3e38f;
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    rc = luma_logits_bias(g_x, n, ids, bias, 5, &err);
    check(rc == 0 && g_x[0] == 3.5f && g_x[1] == 2.25f && g_x[n - 1] == -INFINITY &&
              g_x[n / 2] == 3.4028234663852886e38f,
          "bias adds, repeats add up, -inf masks, overflow stops at FLT_MAX");

    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    rc = luma_logits_mask(g_x, n, ids, 5, &err);
    bad = 0;
    for (int32_t i = 0; i < n; i++) {
        int named = i == 0 || i == 1 || i == n - 1 || i == n / 2;
        bad += !(g_x[i] == (named ? -INFINITY : g_orig[i]));
    }
    check(rc == 0 && bad == 0, "mask: %d wrong", bad);
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    rc = luma_logits_allow(g_x, n, ids, 5, &err);
    bad = 0;
    for (int32_t i = 0; i < n; i++) {
        int named = i == 0 || i == 1 || i == n - 1 || i == n / 2;
        bad += !(g_x[i] == (named ? g_orig[i] : -INFINITY));
    }
    check(rc == 0 && bad == 0, "allow: %d wrong", bad);
    memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
    rc = luma_logits_allow(g_x, n, NULL, 0, &err);
    check(rc == 0 && count_masked(g_x, n) == n, "allow of nothing masks all");
    snprintf(name, sizeof name, "moves %d", n);
    group_end(name);
}

static void test_distributions(int32_t n)
{
    luma_err err;
    char name[32];
    for (int kind = 0; kind < 3; kind++) {
        make_logits(g_orig, n, 400 + kind, kind == 2 ? 0.996 : 0.1, kind % 2);
        ref_probs(g_orig, n, g_p);

        memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
        int rc = luma_logits_softmax(g_x, n, &err);
        int32_t bad = 0;
        double sum = 0.0;
        for (int32_t i = 0; i < n; i++) {
            bad += !(fabs(g_x[i] - g_p[i]) <= 1e-6 * g_p[i] + 1e-38);
            sum += g_x[i];
        }
        check(rc == 0 && bad == 0 && fabs(sum - 1.0) < 1e-5, "softmax kind=%d: %d wrong, sum %g",
              kind, bad, sum);

        memcpy(g_x, g_orig, (size_t)n * sizeof *g_x);
        rc = luma_logits_log_softmax(g_x, n, &err);
        bad = 0;
        for (int32_t i = 0; i < n; i++) {
            double want = g_p[i] > 0.0 ? log(g_p[i]) : -INFINITY;
            bad += !(g_x[i] == want || fabs(g_x[i] - want) <= 2e-6 * (1.0 + fabs(want)));
        }
        check(rc == 0 && bad == 0, "log_softmax kind=%d: %d wrong", kind, bad);

        double h = -1.0, want = 0.0;
        for (int32_t i = 0; i < n; i++)
            if (g_p[i] > 0.0) want -= g_p[i] * log(g_p[i]);
        rc = luma_logits_entropy(g_orig, n, &h, &err);
        check(rc == 0 && fabs(h - want) <= 1e-9 * (1.0 + want), "entropy kind=%d: %.12g want %.12g",
              kind, h, want);

        /* With the uniform the call will draw, the reference picks the id. */
        luma_rng rng, peek;
        luma_rng_seed(&rng, 500 + (uint64_t)kind);
        bad = 0;
        for (int d = 0; d < 200; d++) {
            peek = rng;
            double u = luma_rng_uniform(&peek), cum = 0.0;
            int32_t expect = -1;
            for (int32_t i = 0; i < n && expect < 0; i++) {
                cum += g_p[i];
                if (g_p[i] > 0.0 && u < cum) expect = i;
            }
            int32_t got = luma_logits_sample(g_orig, n, &rng, &err);
            bad += got != expect;
            bad += memcmp(&rng, &peek, sizeof rng) != 0;
        }
        check(bad == 0, "sample kind=%d against the reference: %d wrong", kind, bad);
    }
    float one[3] = { -INFINITY, 5.0f, -INFINITY };
    double h = -1.0;
    check(luma_logits_entropy(one, 3, &h, &err) == 0 && h == 0.0, "entropy of one entry is 0");
    check(luma_logits_softmax(one, 3, &err) == 0 && one[0] == 0.0f && one[1] == 1.0f,
          "softmax of one entry");
    snprintf(name, sizeof name, "distributions %d", n);
    group_end(name);
}

static void test_frequencies(void)
{
    luma_err err;
    const double probs[6] = { 0.1, 0.2, 0.3, 0.0, 0.25, 0.15 };
    float x[6];
    for (int i = 0; i < 6; i++) x[i] = probs[i] > 0.0 ? (float)(log(probs[i]) + 1.7) : -INFINITY;
    enum { DRAWS = 200000 };
    int hits[6] = { 0 }, bad_id = 0;
    luma_rng rng;
    luma_rng_seed(&rng, 2024);
    for (int d = 0; d < DRAWS; d++) {
        int32_t id = luma_logits_sample(x, 6, &rng, &err);
        if (id < 0 || id >= 6) bad_id++;
        else hits[id]++;
    }
    check(bad_id == 0, "%d draws out of range", bad_id);
    for (int i = 0; i < 6; i++) {
        double mean = DRAWS * probs[i], sigma = sqrt(DRAWS * probs[i] * (1.0 - probs[i]));
        check(fabs(hits[i] - mean) <= 4.0 * sigma, "id %d drawn %d times, expected %.0f +- %.0f", i,
              hits[i], mean, 4.0 * sigma);
    }

    /* The same seed gives the same draws; the rng moves one uniform per call. */
    make_logits(g_orig, 1000, 600, 0.1, 1);
    luma_logits_temperature(g_orig, 1000, 3.0f, &err);
    luma_rng a, b;
    luma_rng_seed(&a, 77);
    luma_rng_seed(&b, 77);
    int same = 1, distinct = 0;
    int32_t first = luma_logits_sample(g_orig, 1000, &a, &err);
    luma_rng_seed(&a, 77);
    for (int d = 0; d < 1000; d++) {
        int32_t ia = luma_logits_sample(g_orig, 1000, &a, &err);
        int32_t ib = luma_logits_sample(g_orig, 1000, &b, &err);
        same &= ia == ib;
        distinct += ia != first;
    }
    check(same, "same seed, different draws");
    check(distinct > 100, "draws do not vary (%d differ from the first)", distinct);
    float masked[4] = { -INFINITY, -INFINITY, -INFINITY, -INFINITY };
    luma_rng_seed(&a, 9);
    luma_rng_seed(&b, 9);
    luma_rng_uniform(&b);
    check(luma_logits_sample(masked, 4, &a, &err) == -1 && memcmp(&a, &b, sizeof a) == 0,
          "a failed sample still takes one uniform");
    group_end("sample freq");
}

static int fails_with(int rc, const luma_err *err, const char *words)
{
    return rc == -1 && strstr(err->msg, words) != NULL;
}

static void test_errors(void)
{
    enum { N = 16 };
    float x[N], keep[N], vals[4];
    int32_t ids[4];
    double h;
    luma_rng rng;
    luma_rng_seed(&rng, 1);
    for (int i = 0; i < N; i++) x[i] = (float)(i % 5) - 2.0f;
    memcpy(keep, x, sizeof x);
    int32_t bad_ids[3] = { 1, N, 2 }, neg_ids[2] = { 3, -1 };
    int32_t good_ids[2] = { 1, 2 };
    float good_vals[2] = { 1.0f, 2.0f }, nan_vals[2] = { 1.0f, NAN }, inf_vals[2] = { INFINITY, 0 };
    luma_err e;
#define EXPECT(call, words)                                                           \
    do {                                                                              \
        memset(&e, 0, sizeof e);                                                      \
        int rc_ = (int)(call);                                                        \
        check(fails_with(rc_, &e, words) && memcmp(x, keep, sizeof x) == 0,           \
              "%s: rc %d, message \"%s\", want \"%s\"", #call, rc_, e.msg, words);     \
    } while (0)
    EXPECT(luma_logits_argmax(x, 0, &e), "argmax: n must be at least 1");
    EXPECT(luma_logits_topk(x, N, 0, ids, vals, &e), "topk: k must be at least 1");
    EXPECT(luma_logits_temperature(x, N, -0.5f, &e), "temperature: t must");
    EXPECT(luma_logits_temperature(x, N, NAN, &e), "temperature: t must");
    EXPECT(luma_logits_temperature(x, N, INFINITY, &e), "temperature: t must");
    EXPECT(luma_logits_temperature(x, -3, 1.0f, &e), "temperature: n must");
    EXPECT(luma_logits_top_k(x, N, 0, &e), "top_k: k must be at least 1");
    EXPECT(luma_logits_top_k(x, N, -4, &e), "top_k: k must be at least 1");
    EXPECT(luma_logits_top_p(x, N, 0.0f, 1, &e), "top_p: p must be in (0, 1]");
    EXPECT(luma_logits_top_p(x, N, 1.5f, 1, &e), "top_p: p must be in (0, 1]");
    EXPECT(luma_logits_top_p(x, N, NAN, 1, &e), "top_p: p must be in (0, 1]");
    EXPECT(luma_logits_top_p(x, N, 0.5f, -1, &e), "top_p: min_keep must be >= 0");
    EXPECT(luma_logits_min_p(x, N, -0.1f, 1, &e), "min_p: p must be in (0, 1]");
    EXPECT(luma_logits_min_p(x, N, 0.0f, 1, &e), "min_p: p must be in (0, 1]");
    EXPECT(luma_logits_typical(x, N, 1.01f, 1, &e), "typical: p must be in (0, 1]");
    EXPECT(luma_logits_typical(x, N, 0.5f, -2, &e), "typical: min_keep must be >= 0");
    EXPECT(luma_logits_penalize(x, N, bad_ids, 3, 0, 1.1f, 0, 0, &e), "penalize: history id 16");
    EXPECT(luma_logits_penalize(x, N, neg_ids, 2, 1, 1.1f, 0, 0, &e), "penalize: history id -1");
    EXPECT(luma_logits_penalize(x, N, good_ids, 2, 0, 0.0f, 0, 0, &e), "penalize: repeat must");
    EXPECT(luma_logits_penalize(x, N, good_ids, 2, 0, NAN, 0, 0, &e), "penalize: repeat must");
    EXPECT(luma_logits_penalize(x, N, good_ids, 2, 0, 1.0f, NAN, 0, &e),
           "penalize: frequency must");
    EXPECT(luma_logits_penalize(x, N, good_ids, 2, 0, 1.0f, 0, INFINITY, &e),
           "penalize: presence must");
    EXPECT(luma_logits_penalize(x, N, good_ids, -1, 0, 1.0f, 0, 0, &e), "penalize: n_hist must");
    EXPECT(luma_logits_bias(x, N, bad_ids, vals, 3, &e), "bias: id 16 (at index 1)");
    EXPECT(luma_logits_bias(x, N, good_ids, nan_vals, 2, &e), "bias: value nan");
    EXPECT(luma_logits_bias(x, N, good_ids, inf_vals, 2, &e), "bias: value inf");
    EXPECT(luma_logits_bias(x, N, good_ids, good_vals, -1, &e), "bias: count must");
    EXPECT(luma_logits_mask(x, N, neg_ids, 2, &e), "mask: id -1");
    EXPECT(luma_logits_allow(x, N, bad_ids, 3, &e), "allow: id 16");
    EXPECT(luma_logits_softmax(x, 0, &e), "softmax: n must");
    EXPECT(luma_logits_entropy(x, 0, &h, &e), "entropy: n must");
    EXPECT(luma_logits_sample(x, 0, &rng, &e), "sample: n must");

    /* Every entry masked: the choosers fail, the filters do nothing. */
    for (int i = 0; i < N; i++) x[i] = -INFINITY;
    memcpy(keep, x, sizeof x);
    EXPECT(luma_logits_argmax(x, N, &e), "argmax: every logit is masked");
    EXPECT(luma_logits_sample(x, N, &rng, &e), "sample: every logit is masked");
    EXPECT(luma_logits_softmax(x, N, &e), "softmax: every logit is masked");
    EXPECT(luma_logits_log_softmax(x, N, &e), "log_softmax: every logit is masked");
    EXPECT(luma_logits_entropy(x, N, &h, &e), "entropy: every logit is masked");
#undef EXPECT
    int ok = luma_logits_temperature(x, N, 0.0f, &e) == 0 &&
             luma_logits_temperature(x, N, 2.0f, &e) == 0 &&
             luma_logits_top_k(x, N, 3, &e) == 0 &&
             luma_logits_top_p(x, N, 0.5f, 2, &e) == 0 &&
             luma_logits_min_p(x, N, 0.5f, 2, &e) == 0 &&
             luma_logits_typical(x, N, 0.5f, 2, &e) == 0 &&
             luma_logits_penalize(x, N, good_ids, 2, 0, 1.5f, 1.0f, 1.0f, &e) == 0 &&
             luma_logits_bias(x, N, good_ids, good_vals, 2, &e) == 0 &&
             luma_logits_topk(x, N, 3, ids, vals, &e) == 0;
    check(ok && memcmp(x, keep, sizeof x) == 0, "transforms of an all-masked vector do nothing");

    /* NaN and +inf count as masked. */
    float odd[4] = { NAN, INFINITY, 1.0f, 0.5f };
    check(luma_logits_argmax(odd, 4, &e) == 2, "argmax skips NaN and +inf");
    check(luma_logits_top_p(odd, 4, 0.5f, 0, &e) == 0 && odd[2] == 1.0f && odd[3] == -INFINITY,
          "top_p with NaN and +inf");
    group_end("errors");
}

/* ---- time per call on the Gemma 3 vocabulary ------------------------------------ */

typedef int (*transform_fn)(float *x, int32_t n, luma_err *err);

static int t_argmax(float *x, int32_t n, luma_err *err)
{
    return luma_logits_argmax(x, n, err) < 0;
}
static int t_temperature(float *x, int32_t n, luma_err *err)
{
    return luma_logits_temperature(x, n, 0.8f, err);
}
static int t_softmax(float *x, int32_t n, luma_err *err)
{
    return luma_logits_softmax(x, n, err);
}
static int t_sample(float *x, int32_t n, luma_err *err)
{
    static luma_rng rng;
    return luma_logits_sample(x, n, &rng, err) < 0;
}
static int t_top_k(float *x, int32_t n, luma_err *err)
{
    return luma_logits_top_k(x, n, 40, err);
}
static int t_min_p(float *x, int32_t n, luma_err *err)
{
    return luma_logits_min_p(x, n, 0.05f, 1, err);
}
static int t_top_p(float *x, int32_t n, luma_err *err)
{
    return luma_logits_top_p(x, n, 0.95f, 1, err);
}
static int t_typical(float *x, int32_t n, luma_err *err)
{
    return luma_logits_typical(x, n, 0.95f, 1, err);
}
static int t_top_k_top_p(float *x, int32_t n, luma_err *err)
{
    return luma_logits_top_k(x, n, 40, err) || luma_logits_top_p(x, n, 0.95f, 1, err);
}

static void timings(void)
{
    static const struct { const char *name; transform_fn fn; } cases[] = {
        { "argmax", t_argmax }, { "temperature", t_temperature }, { "softmax", t_softmax },
        { "sample", t_sample }, { "top_k 40", t_top_k }, { "min_p 0.05", t_min_p },
        { "top_p 0.95", t_top_p }, { "typical 0.95", t_typical },
        { "top_k+top_p", t_top_k_top_p },
    };
    luma_err err;
    printf("time per call, n = %d (informative):\n", BIG);
    for (int kind = 0; kind < 2; kind++) {
        make_logits(g_orig, BIG, 700 + kind, 0.0, kind);
        printf("  %s logits:", kind == 0 ? "flat N(0,3)" : "peaked");
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            int reps = 5, rc = 0;
            double t = 0.0;
            for (int r = 0; r < reps; r++) {
                memcpy(g_x, g_orig, (size_t)BIG * sizeof *g_x);
                double t0 = now();
                rc |= cases[c].fn(g_x, BIG, &err);
                t += now() - t0;
            }
            check(rc == 0, "%s failed while timed", cases[c].name);
            printf(" %s %.2f ms%s", cases[c].name, 1e3 * t / reps,
                   c + 1 < sizeof cases / sizeof *cases ? "," : "\n");
        }
    }
    group_end("timings");
}

int main(void)
{
    g_orig = malloc(BIG * sizeof *g_orig);
    g_x = malloc(BIG * sizeof *g_x);
    g_by_value = malloc(BIG * sizeof *g_by_value);
    g_typical = malloc(BIG * sizeof *g_typical);
    g_p = malloc(BIG * sizeof *g_p);
    g_keep = malloc(BIG);
    if (!g_orig || !g_x || !g_by_value || !g_typical || !g_p || !g_keep) {
        printf("out of memory\n");
        return 1;
    }
    test_rng();
    const int32_t sizes[2] = { 1000, BIG };
    for (int s = 0; s < 2; s++) {
        test_argmax_topk(sizes[s]);
        test_filters(sizes[s]);
        test_moves(sizes[s]);
        test_distributions(sizes[s]);
    }
    /* a compact form's few entries: sorted whole by sample.c (insertion up
     * to 64, qsort past it) instead of counted into bins */
    test_filters(40);
    test_filters(200);
    test_top_p_ordered(40);
    test_top_p_ordered(200);
    test_sampler(1000);
    test_sampler(BIG);
    test_frequencies();
    test_errors();
    timings();
    printf("%d checks, %d failed\n", checks, fails);
    free(g_orig);
    free(g_x);
    free(g_by_value);
    free(g_typical);
    free(g_p);
    free(g_keep);
    return fails != 0;
}
