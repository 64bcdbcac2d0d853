#include "sample.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

static bool live(float v)
{
    return isfinite(v);
}

/* Clamps into the finite floats, so that moving a live entry (a tiny
 * temperature, a huge bias) never masks it or makes it +inf. */
static float finite(float v)
{
    return v > FLT_MAX ? FLT_MAX : v < -FLT_MAX ? -FLT_MAX : v;
}

static int check_n(const char *fn, int32_t n, luma_err *err)
{
    if (n < 1) return luma_errf(err, "%s: n must be at least 1 (got %d)", fn, (int)n);
    return 0;
}

static int check_p(const char *fn, float p, int32_t min_keep, luma_err *err)
{
    if (!(p > 0.0f && p <= 1.0f))
        return luma_errf(err, "%s: p must be in (0, 1] (got %g)", fn, (double)p);
    if (min_keep < 0)
        return luma_errf(err, "%s: min_keep must be >= 0 (got %d)", fn, (int)min_keep);
    return 0;
}

static int check_ids(const char *fn, int32_t n, const int32_t *ids, int32_t count,
                     luma_err *err)
{
    if (count < 0) return luma_errf(err, "%s: count must be >= 0 (got %d)", fn, (int)count);
    for (int32_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n)
            return luma_errf(err, "%s: id %d (at index %d) is not in [0, %d)", fn, (int)ids[i],
                             (int)i, (int)n);
    return 0;
}

static int32_t count_live(const float *x, int32_t n)
{
    int32_t c = 0;
    for (int32_t i = 0; i < n; i++) c += live(x[i]);
    return c;
}

/* The largest live entry; -INFINITY when none is live. */
static float live_max(const float *x, int32_t n)
{
    /* -inf never exceeds m, NaN compares false, +inf is kept out. */
    float m = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (x[i] > m && x[i] < INFINITY) m = x[i];
    return m;
}

/* A vector with few live entries (after top_k, say) is worked on through a
 * compact copy of them, in id order, so that the filters and the sampler
 * make one pass over the vocabulary instead of several. The compact copy
 * gives the same results: entries keep their order, so ties still rank by
 * id and sums add up in the same order. */
#define SPARSE_MAX LUMA_SPARSE_MAX

typedef struct sparse {
    int32_t n;
    int32_t ids[SPARSE_MAX];
    float vals[SPARSE_MAX];
} sparse;

/* Gathers the live entries of a large vector; false when it is small or has
 * more than SPARSE_MAX live entries (then the caller works in place). */
static bool gather(const float *x, int32_t n, sparse *s)
{
    if (n <= 4 * SPARSE_MAX) return false;
    s->n = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!live(x[i])) continue;
        if (s->n == SPARSE_MAX) return false;
        s->ids[s->n] = i;
        s->vals[s->n++] = x[i];
    }
    return s->n > 0;
}

/* Writes the compact entries back (the others are masked already). */
static int scatter(float *x, const sparse *s, int rc)
{
    if (rc == 0)
        for (int32_t j = 0; j < s->n; j++) x[s->ids[j]] = s->vals[j];
    return rc;
}

/* Over the live entries, in double: the normalizer *z = sum exp(x_i - m)
 * and *s = sum exp(x_i - m) (x_i - m), for m = live_max(x). */
static void live_sums(const float *x, int32_t n, double m, double *z, double *s)
{
    double sz = 0.0, ss = 0.0;
    for (int32_t i = 0; i < n; i++) {
        if (!live(x[i])) continue;
        double d = x[i] - m, e = exp(d);
        sz += e;
        ss += e * d;
    }
    *z = sz;
    *s = ss;
}

/* ---- the k best entries: a heap whose root is the worst of them ---------- */

static void heap_swap(int32_t *ids, float *vals, int32_t a, int32_t b)
{
    int32_t ti = ids[a];
    float tv = vals[a];
    ids[a] = ids[b];
    vals[a] = vals[b];
    ids[b] = ti;
    vals[b] = tv;
}

static void sift_up(int32_t *ids, float *vals, int32_t i)
{
    while (i > 0) {
        int32_t parent = (i - 1) / 2;
        if (!luma_rank_before(vals[parent], ids[parent], vals[i], ids[i])) return;
        heap_swap(ids, vals, parent, i);
        i = parent;
    }
}

static void sift_down(int32_t *ids, float *vals, int32_t size, int32_t i)
{
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, worst = i;
        if (l < size && luma_rank_before(vals[worst], ids[worst], vals[l], ids[l])) worst = l;
        if (r < size && luma_rank_before(vals[worst], ids[worst], vals[r], ids[r])) worst = r;
        if (worst == i) return;
        heap_swap(ids, vals, i, worst);
        i = worst;
    }
}

/* Leaves the k best live entries of x in ids/vals as a heap with the worst
 * at index 0, in O(n log k); returns how many (fewer than k when fewer are
 * live). Ids arrive in increasing order, so a newcomer equal to the root
 * ranks after it and stays out. */
static int32_t heap_select(const float *x, int32_t n, int32_t k, int32_t *ids, float *vals)
{
    int32_t size = 0;
    for (int32_t i = 0; i < n; i++) {
        float v = x[i];
        if (!live(v)) continue;
        if (size < k) {
            ids[size] = i;
            vals[size] = v;
            sift_up(ids, vals, size);
            size++;
        } else if (v > vals[0]) {
            ids[0] = i;
            vals[0] = v;
            sift_down(ids, vals, size, 0);
        }
    }
    return size;
}

/* Masks all but the k best live entries. */
static int keep_top(float *x, int32_t n, int32_t k, luma_err *err)
{
    if (count_live(x, n) <= k) return 0;
    /* k < n here, and x already holds n floats: the sizes cannot overflow. */
    int32_t *ids = malloc((size_t)k * sizeof *ids);
    float *vals = malloc((size_t)k * sizeof *vals);
    if (!ids || !vals) {
        free(ids);
        free(vals);
        return luma_errf(err, "logits: out of memory for %d candidates", (int)k);
    }
    heap_select(x, n, k, ids, vals);
    float wv = vals[0];
    int32_t wi = ids[0];
    for (int32_t i = 0; i < n; i++)
        if (live(x[i]) && luma_rank_before(wv, wi, x[i], i)) x[i] = -INFINITY;
    free(ids);
    free(vals);
    return 0;
}

int32_t luma_logits_argmax(const float *x, int32_t n, luma_err *err)
{
    if (check_n("argmax", n, err)) return -1;
    int32_t best = -1;
    float bv = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (x[i] > bv && x[i] < INFINITY) {
            best = i;
            bv = x[i];
        }
    if (best < 0) return luma_errf(err, "argmax: every logit is masked");
    return best;
}

int32_t luma_logits_topk(const float *x, int32_t n, int32_t k, int32_t *ids, float *vals,
                         luma_err *err)
{
    if (check_n("topk", n, err)) return -1;
    if (k < 1) return luma_errf(err, "topk: k must be at least 1 (got %d)", (int)k);
    int32_t size = heap_select(x, n, k, ids, vals);
    /* Heap sort: the worst goes to the end, leaving the best first. */
    for (int32_t end = size - 1; end > 0; end--) {
        heap_swap(ids, vals, 0, end);
        sift_down(ids, vals, end, 0);
    }
    return size;
}

int luma_logits_temperature(float *x, int32_t n, float t, luma_err *err)
{
    if (check_n("temperature", n, err)) return -1;
    if (!(t >= 0.0f) || isinf(t))
        return luma_errf(err, "temperature: t must be finite and >= 0 (got %g)", (double)t);
    if (t == 0.0f) {
        int32_t best = luma_logits_argmax(x, n, NULL);
        if (best < 0) return 0;
        for (int32_t i = 0; i < n; i++)
            if (i != best) x[i] = -INFINITY;
        return 0;
    }
    sparse sp;
    if (gather(x, n, &sp)) {
        for (int32_t j = 0; j < sp.n; j++) sp.vals[j] = finite(sp.vals[j] / t);
        return scatter(x, &sp, 0);
    }
    for (int32_t i = 0; i < n; i++)
        if (live(x[i])) x[i] = finite(x[i] / t);
    return 0;
}

int luma_logits_top_k(float *x, int32_t n, int32_t k, luma_err *err)
{
    if (check_n("top_k", n, err)) return -1;
    if (k < 1) return luma_errf(err, "top_k: k must be at least 1 (got %d)", (int)k);
    return keep_top(x, n, k, err);
}

/* ---- keeping a prefix of a ranking by probability mass ------------------ */

/* top_p and typical both rank the live entries by key_i = |x_i - c| (top_p:
 * c = max, so largest first; typical: see luma_logits_typical), ties by
 * lower id, and keep the shortest prefix whose mass passes p with at least
 * min_keep entries. Sorting the whole vocabulary for that is wasteful: the
 * entries are first counted into NBINS bins of equal key width (bin order
 * agrees with key order), which finds the one bin where the prefix ends;
 * only that bin's entries are sorted. The bin width comes from the entries
 * within RANGE nats of the max (each of the others weighs less than e^-RANGE
 * of the max, too little to move a sum of doubles); those share the last bin. */
#define NBINS 1024
#define RANGE 64.0

typedef struct cand {
    double key;
    int32_t id;
} cand;

static int cand_cmp(const void *pa, const void *pb)
{
    const cand *a = pa, *b = pb;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

static int bin_of(double key, double scale)
{
    double t = key * scale;
    return t >= NBINS - 1 ? NBINS - 1 : (int)t;
}

typedef struct mass_goal {
    double p;
    int32_t min_keep;
    bool strict;     /* mass > p (typical) rather than >= p (top_p) */
    double z;        /* normalizer: probability = exp(x_i - max) / z */
} mass_goal;

static bool reached(const mass_goal *g, double mass, int32_t kept)
{
    double q = mass / g->z;
    return (g->strict ? q > g->p : q >= g->p) && kept >= g->min_keep;
}

/* Sorts the entries of bin b and walks them on from (*mass, *kept). Returns
 * 1 with *last set when the goal is reached inside the bin, 0 when not, -1
 * when out of memory. */
static int walk_bin(const float *x, int32_t n, double c, double m, double scale, int b,
                    int32_t size, const mass_goal *g, double *mass, int32_t *kept, cand *last,
                    luma_err *err)
{
    cand *cs = malloc((size_t)size * sizeof *cs);
    if (!cs) return luma_errf(err, "logits: out of memory for %d candidates", (int)size);
    int32_t nc = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!live(x[i])) continue;
        double key = fabs(x[i] - c);
        if (bin_of(key, scale) == b && nc < size) cs[nc++] = (cand){ key, i };
    }
    qsort(cs, (size_t)nc, sizeof *cs, cand_cmp);
    int found = 0;
    for (int32_t j = 0; j < nc && !found; j++) {
        *mass += exp(x[cs[j].id] - m);
        ++*kept;
        if (reached(g, *mass, *kept)) {
            *last = cs[j];
            found = 1;
        }
    }
    free(cs);
    return found;
}

/* Few entries (a compact form after top_k, say): the bins' 12 KB of counts
 * cost more than sorting every live entry. Each entry's weight exp(x_i - m)
 * is taken once; z sums them in id order, the walk in rank order. */
#define FEW_MAX 256
#define FEW_INSERT 64

typedef struct few {
    double key, e;
    int32_t id;
} few;

static int few_cmp(const void *pa, const void *pb)
{
    const few *a = pa, *b = pb;
    return cand_cmp(&(cand){ a->key, a->id }, &(cand){ b->key, b->id });
}

/* order (or NULL): the entries' indices in g's order as the caller last
 * knew it (a top-k's, largest first), a hint: the entries are gathered in
 * that order, and sorted only where it no longer holds. The sums are the
 * same either way (z in index order, the mass in g's order). */
static void keep_mass_few(float *x, int32_t n, double c, double m, mass_goal *g, const int32_t *order)
{
    few fs[FEW_MAX];
    double es[FEW_MAX];
    int32_t nf = 0;
    g->z = 0.0;
    for (int32_t i = 0; i < n; i++) {
        if (!live(x[i])) continue;
        es[i] = exp(x[i] - m);
        g->z += es[i];
    }
    for (int32_t j = 0; j < n; j++) {
        int32_t i = order ? order[j] : j;
        if (live(x[i])) fs[nf++] = (few){ fabs(x[i] - c), es[i], i };
    }
    bool sorted = order != NULL;
    for (int32_t j = 1; j < nf && sorted; j++) sorted = few_cmp(&fs[j - 1], &fs[j]) <= 0;
    if (sorted) {
        /* the hint held */
    } else if (nf <= FEW_INSERT) {
        for (int32_t j = 1; j < nf; j++) {
            few t = fs[j];
            int32_t i = j;
            for (; i > 0 && few_cmp(&fs[i - 1], &t) > 0; i--) fs[i] = fs[i - 1];
            fs[i] = t;
        }
    } else {
        qsort(fs, (size_t)nf, sizeof *fs, few_cmp);
    }
    double mass = 0.0;
    for (int32_t j = 0; j < nf; j++) {
        mass += fs[j].e;
        if (reached(g, mass, j + 1)) {
            for (int32_t i = j + 1; i < nf; i++) x[fs[i].id] = -INFINITY;
            return;
        }
    }
}

/* Keeps the shortest prefix in g's order whose mass reaches g, filling in
 * g->z on the way (from the bins, saving top_p a pass of exp): few entries
 * by keep_mass_few (with order, or NULL, its hint), others through the
 * bins. */
static int keep_mass(float *x, int32_t n, double c, double m, mass_goal *g, const int32_t *order, luma_err *err)
{
    if (n <= FEW_MAX) {
        keep_mass_few(x, n, c, m, g, order);
        return 0;
    }
    double kmax = 0.0;
    for (int32_t i = 0; i < n; i++) {
        if (!live(x[i]) || x[i] - m < -RANGE) continue;
        double key = fabs(x[i] - c);
        if (key > kmax) kmax = key;
    }
    double scale = kmax > 0.0 ? NBINS / kmax : 0.0;

    double bin_mass[NBINS] = {0};
    int32_t bin_count[NBINS] = {0};
    for (int32_t i = 0; i < n; i++) {
        if (!live(x[i])) continue;
        int b = bin_of(fabs(x[i] - c), scale);
        bin_mass[b] += exp(x[i] - m);
        bin_count[b]++;
    }
    g->z = 0.0;
    for (int j = 0; j < NBINS; j++) g->z += bin_mass[j];

    double mass = 0.0;
    int32_t kept = 0;
    int b = 0;
    while (b < NBINS && !reached(g, mass + bin_mass[b], kept + bin_count[b])) {
        mass += bin_mass[b];
        kept += bin_count[b];
        b++;
    }
    /* Rounding can leave the goal unmet where the bin sums said it was met;
     * the walk then goes on into the next bins. */
    cand last = { 0.0, -1 };
    for (;; b++) {
        if (b == NBINS) return 0;
        if (bin_count[b] == 0) continue;
        int found = walk_bin(x, n, c, m, scale, b, bin_count[b], g, &mass, &kept, &last, err);
        if (found < 0) return -1;
        if (found) break;
    }
    for (int32_t i = 0; i < n; i++) {
        if (!live(x[i])) continue;
        double key = fabs(x[i] - c);
        int bi = bin_of(key, scale);
        if (bi > b || (bi == b && cand_cmp(&(cand){ key, i }, &last) > 0)) x[i] = -INFINITY;
    }
    return 0;
}

int luma_logits_top_p(float *x, int32_t n, float p, int32_t min_keep, luma_err *err)
{
    return luma_logits_top_p_ordered(x, n, NULL, p, min_keep, err);
}

int luma_logits_top_p_ordered(float *x, int32_t n, const int32_t *order, float p, int32_t min_keep, luma_err *err)
{
    if (check_n("top_p", n, err) || check_p("top_p", p, min_keep, err)) return -1;
    sparse sp;
    if (!order && gather(x, n, &sp)) return scatter(x, &sp, luma_logits_top_p(sp.vals, sp.n, p, min_keep, err));
    float m = live_max(x, n);
    if (p == 1.0f || m == -INFINITY) return 0;
    /* the top-p order is the entries' own, largest first, ties by index:
     * keys |x - max| increasing */
    mass_goal g = { p, min_keep, false, 0.0 };
    return keep_mass(x, n, m, m, &g, order, err);
}

int luma_logits_min_p(float *x, int32_t n, float p, int32_t min_keep, luma_err *err)
{
    if (check_n("min_p", n, err) || check_p("min_p", p, min_keep, err)) return -1;
    sparse sp;
    if (gather(x, n, &sp)) return scatter(x, &sp, luma_logits_min_p(sp.vals, sp.n, p, min_keep, err));
    float m = live_max(x, n);
    if (m == -INFINITY) return 0;
    /* p_i >= p * p_max  <=>  x_i - max >= log p */
    double lp = log(p);
    int32_t above = 0;
    for (int32_t i = 0; i < n; i++) above += live(x[i]) && (double)x[i] - m >= lp;
    if (above < min_keep) return keep_top(x, n, min_keep, err);
    for (int32_t i = 0; i < n; i++)
        if (live(x[i]) && (double)x[i] - m < lp) x[i] = -INFINITY;
    return 0;
}

int luma_logits_typical(float *x, int32_t n, float p, int32_t min_keep, luma_err *err)
{
    if (check_n("typical", n, err) || check_p("typical", p, min_keep, err)) return -1;
    sparse sp;
    if (gather(x, n, &sp)) return scatter(x, &sp, luma_logits_typical(sp.vals, sp.n, p, min_keep, err));
    float m = live_max(x, n);
    if (p == 1.0f || m == -INFINITY) return 0;
    double z, s;
    live_sums(x, n, m, &z, &s);
    /* With log p_i = x_i - max - log z and H = log z - s / z, the score
     * |-log p_i - H| is |x_i - c| for c = max + s / z, the mean logit. */
    mass_goal g = { p, min_keep, true, 0.0 };
    return keep_mass(x, n, m + s / z, m, &g, NULL, err);
}

/* ---- moving entries ------------------------------------------------------ */

static int id_cmp(const void *pa, const void *pb)
{
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return (a > b) - (a < b);
}

int32_t luma_logits_penalty_counts(int32_t n, const int32_t *hist, int32_t n_hist, int32_t last_n,
                                   float repeat, float frequency, float presence, int32_t *ids,
                                   int32_t *counts, luma_err *err)
{
    if (check_n("penalize", n, err)) return -1;
    if (n_hist < 0) return luma_errf(err, "penalize: n_hist must be >= 0 (got %d)", (int)n_hist);
    if (!(repeat > 0.0f) || isinf(repeat))
        return luma_errf(err, "penalize: repeat must be finite and > 0 (got %g)", (double)repeat);
    if (!isfinite(frequency))
        return luma_errf(err, "penalize: frequency must be finite (got %g)", (double)frequency);
    if (!isfinite(presence))
        return luma_errf(err, "penalize: presence must be finite (got %g)", (double)presence);
    for (int32_t i = 0; i < n_hist; i++)
        if (hist[i] < 0 || hist[i] >= n)
            return luma_errf(err, "penalize: history id %d (at index %d) is not in [0, %d)",
                             (int)hist[i], (int)i, (int)n);
    int32_t w = last_n > 0 && last_n < n_hist ? last_n : n_hist;
    if (w == 0 || (repeat == 1.0f && frequency == 0.0f && presence == 0.0f)) return 0;
    /* Sorted, the window's ids form one run per distinct id (a policy's
     * window of 64 by insertion, in half qsort's time). */
    memcpy(ids, hist + (n_hist - w), (size_t)w * sizeof *ids);
    if (w <= FEW_INSERT) {
        for (int32_t j = 1; j < w; j++) {
            int32_t t = ids[j], i = j;
            for (; i > 0 && ids[i - 1] > t; i--) ids[i] = ids[i - 1];
            ids[i] = t;
        }
    } else {
        qsort(ids, (size_t)w, sizeof *ids, id_cmp);
    }
    int32_t k = 0;
    for (int32_t j = 0; j < w;) {
        int32_t id = ids[j], count = 0;
        while (j < w && ids[j] == id) {
            j++;
            count++;
        }
        ids[k] = id;
        counts[k++] = count;
    }
    return k;
}

void luma_logits_penalize_counted(float *x, const int32_t *ids, const int32_t *counts, int32_t k,
                                  float repeat, float frequency, float presence)
{
    for (int32_t j = 0; j < k; j++) {
        float v = x[ids[j]];
        if (!live(v)) continue;
        v = v <= 0.0f ? v * repeat : v / repeat;
        x[ids[j]] = finite(v - ((float)counts[j] * frequency + presence));
    }
}

int luma_logits_penalize(float *x, int32_t n, const int32_t *hist, int32_t n_hist,
                         int32_t last_n, float repeat, float frequency, float presence,
                         luma_err *err)
{
    size_t room = (size_t)(n_hist > 0 ? n_hist : 1);
    int32_t *ids = malloc(2 * room * sizeof *ids);
    if (!ids) return luma_errf(err, "penalize: out of memory for a window of %d ids", (int)n_hist);
    int32_t k = luma_logits_penalty_counts(n, hist, n_hist, last_n, repeat, frequency, presence, ids,
                                           ids + room, err);
    if (k > 0) luma_logits_penalize_counted(x, ids, ids + room, k, repeat, frequency, presence);
    free(ids);
    return k < 0 ? -1 : 0;
}

int luma_logits_bias(float *x, int32_t n, const int32_t *ids, const float *values,
                     int32_t count, luma_err *err)
{
    if (check_n("bias", n, err) || check_ids("bias", n, ids, count, err)) return -1;
    for (int32_t i = 0; i < count; i++)
        if (isnan(values[i]) || values[i] == INFINITY)
            return luma_errf(err, "bias: value %g (at index %d) is NaN or +inf",
                             (double)values[i], (int)i);
    for (int32_t i = 0; i < count; i++) {
        float v = x[ids[i]];
        if (!live(v)) continue;
        x[ids[i]] = values[i] == -INFINITY ? -INFINITY : finite(v + values[i]);
    }
    return 0;
}

int luma_logits_mask(float *x, int32_t n, const int32_t *ids, int32_t count, luma_err *err)
{
    if (check_n("mask", n, err) || check_ids("mask", n, ids, count, err)) return -1;
    for (int32_t i = 0; i < count; i++) x[ids[i]] = -INFINITY;
    return 0;
}

int luma_logits_allow(float *x, int32_t n, const int32_t *ids, int32_t count, luma_err *err)
{
    if (check_n("allow", n, err) || check_ids("allow", n, ids, count, err)) return -1;
    /* Saved, masked all, restored: repeated ids need no care. */
    float *saved = malloc((size_t)(count > 0 ? count : 1) * sizeof *saved);
    if (!saved) return luma_errf(err, "allow: out of memory for %d ids", (int)count);
    for (int32_t i = 0; i < count; i++) saved[i] = x[ids[i]];
    for (int32_t i = 0; i < n; i++) x[i] = -INFINITY;
    for (int32_t i = 0; i < count; i++) x[ids[i]] = saved[i];
    free(saved);
    return 0;
}

/* ---- distributions ------------------------------------------------------- */

int luma_logits_softmax(float *x, int32_t n, luma_err *err)
{
    if (check_n("softmax", n, err)) return -1;
    float m = live_max(x, n);
    if (m == -INFINITY) return luma_errf(err, "softmax: every logit is masked");
    /* The exponentials wait in x for the normalizer. */
    double z = 0.0;
    for (int32_t i = 0; i < n; i++) {
        double e = live(x[i]) ? exp((double)x[i] - m) : 0.0;
        x[i] = (float)e;
        z += e;
    }
    float inv = (float)(1.0 / z);
    for (int32_t i = 0; i < n; i++) x[i] *= inv;
    return 0;
}

int luma_logits_log_softmax(float *x, int32_t n, luma_err *err)
{
    if (check_n("log_softmax", n, err)) return -1;
    float m = live_max(x, n);
    if (m == -INFINITY) return luma_errf(err, "log_softmax: every logit is masked");
    double z, s;
    live_sums(x, n, m, &z, &s);
    double lse = m + log(z);
    for (int32_t i = 0; i < n; i++) x[i] = live(x[i]) ? (float)(x[i] - lse) : -INFINITY;
    return 0;
}

int luma_logits_entropy(const float *x, int32_t n, double *h, luma_err *err)
{
    if (check_n("entropy", n, err)) return -1;
    float m = live_max(x, n);
    if (m == -INFINITY) return luma_errf(err, "entropy: every logit is masked");
    double z, s;
    live_sums(x, n, m, &z, &s);
    *h = luma_entropy_of_sums(z, s);
    return 0;
}

double luma_entropy_of_sums(double z, double s)
{
    /* H = -sum p_i log p_i = log z - s / z; rounding may dip below 0 when one
     * entry holds all the mass. */
    double e = log(z) - s / z;
    return e > 0.0 ? e : 0.0;
}

/* The draw for a uniform u in [0, 1). */
static int32_t sample_at(const float *x, int32_t n, double u, luma_err *err)
{
    float m = live_max(x, n);
    if (m == -INFINITY) return luma_errf(err, "sample: every logit is masked");
    double z = 0.0, s;
    /* A few entries (a top-k's) keep their exponentials for the walk: the
     * same values, summed in the same order, as computing them again. */
    double es[FEW_MAX];
    const bool cached = n <= FEW_MAX;
    if (cached) {
        for (int32_t i = 0; i < n; i++)
            if (live(x[i])) {
                es[i] = exp((double)x[i] - m);
                z += es[i];
            }
    } else {
        live_sums(x, n, m, &z, &s);
    }
    double target = u * z, mass = 0.0;
    int32_t last = -1;
    for (int32_t i = 0; i < n; i++) {
        if (!live(x[i])) continue;
        mass += cached ? es[i] : exp((double)x[i] - m);
        last = i;
        if (target < mass) return i;
    }
    /* Rounding left the summed mass a hair below target: the last entry. */
    return last;
}

int32_t luma_logits_sample(const float *x, int32_t n, luma_rng *rng, luma_err *err)
{
    double u = luma_rng_uniform(rng);
    if (check_n("sample", n, err)) return -1;
    sparse sp;
    if (gather(x, n, &sp)) return sp.ids[sample_at(sp.vals, sp.n, u, err)];
    return sample_at(x, n, u, err);
}

/* ---- the compact form, and the sampling chain on it ---------------------- */

typedef struct entry {
    int32_t id;
    float v;
    int32_t rank;              /* its place in the top-k's order */
} entry;

static int entry_cmp(const void *pa, const void *pb)
{
    const entry *a = pa, *b = pb;
    return (a->id > b->id) - (a->id < b->id);
}

void luma_logits_compact(int32_t *ids, float *vals, int32_t *order, int32_t n)
{
    entry e[LUMA_SPARSE_MAX];
    for (int32_t j = 0; j < n; j++) e[j] = (entry){ ids[j], vals[j], j };
    /* a policy's few (top_k 40, say) by insertion, more by qsort */
    if (n > 64) {
        qsort(e, (size_t)n, sizeof *e, entry_cmp);
    } else {
        for (int32_t j = 1; j < n; j++) {
            entry t = e[j];
            int32_t i = j;
            for (; i > 0 && e[i - 1].id > t.id; i--) e[i] = e[i - 1];
            e[i] = t;
        }
    }
    for (int32_t j = 0; j < n; j++) {
        ids[j] = e[j].id;
        vals[j] = e[j].v;
        order[e[j].rank] = j;
    }
}

int luma_sampler_check(const luma_sampler *s, luma_err *err)
{
    if (s->top_k < 1 || s->top_k > LUMA_SAMPLER_K_MAX)
        return luma_errf(err, "sampler: top_k must be in [1, %d] (got %d)", LUMA_SAMPLER_K_MAX, (int)s->top_k);
    if (!(s->top_p > 0.0f && s->top_p <= 1.0f))
        return luma_errf(err, "sampler: top_p must be in (0, 1] (got %g)", (double)s->top_p);
    if (!(s->min_p >= 0.0f && s->min_p <= 1.0f))
        return luma_errf(err, "sampler: min_p must be in [0, 1] (got %g)", (double)s->min_p);
    if (!(s->temp > 0.0f) || isinf(s->temp))
        return luma_errf(err, "sampler: temp must be finite and > 0 (got %g)", (double)s->temp);
    if (s->last_n < 0 || s->last_n > LUMA_SAMPLER_WINDOW_MAX)
        return luma_errf(err, "sampler: last_n must be in [0, %d] (got %d)", LUMA_SAMPLER_WINDOW_MAX, (int)s->last_n);
    if (s->last_n > 0 && (!(s->repeat > 0.0f) || isinf(s->repeat)))
        return luma_errf(err, "sampler: repeat_ must be finite and > 0 (got %g)", (double)s->repeat);
    if (s->last_n > 0 && (!isfinite(s->frequency) || !isfinite(s->presence)))
        return luma_errf(err, "sampler: frequency and presence must be finite (got %g, %g)", (double)s->frequency,
                         (double)s->presence);
    return 0;
}

bool luma_sampler_penalizes(const luma_sampler *s)
{
    return s->last_n > 0 && (s->repeat != 1.0f || s->frequency != 0.0f || s->presence != 0.0f);
}

int32_t luma_sampler_draw_top(const luma_sampler *s, int32_t *ids, float *vals, int32_t count, double u,
                              luma_err *err)
{
    if (count < 1) return luma_errf(err, "sample: every logit is masked");
    int32_t order[LUMA_SAMPLER_K_MAX];
    luma_logits_compact(ids, vals, order, count);
    if (luma_logits_top_p_ordered(vals, count, order, s->top_p, 1, err) ||
        (s->min_p > 0.0f && luma_logits_min_p(vals, count, s->min_p, 1, err)) ||
        luma_logits_temperature(vals, count, s->temp, err))
        return -1;
    int32_t i = sample_at(vals, count, u, err);
    return i < 0 ? -1 : ids[i];
}

int32_t luma_sampler_draw(const luma_sampler *s, const float *x, int32_t n, double u, luma_err *err)
{
    if (luma_sampler_check(s, err) || check_n("sample", n, err)) return -1;
    int32_t ids[LUMA_SAMPLER_K_MAX];
    float vals[LUMA_SAMPLER_K_MAX];
    int32_t count = luma_logits_topk(x, n, s->top_k < n ? s->top_k : n, ids, vals, err);
    if (count < 0) return -1;
    return luma_sampler_draw_top(s, ids, vals, count, u, err);
}
