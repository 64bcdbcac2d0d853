/* Whole-vocabulary arithmetic on a logits vector x[0..n), n = the vocabulary
 * size, done in place on the host. The Lua policies compose these: a chain of
 * transforms (temperature, top_k, top_p, ...) that mask entries or move
 * them, ended by a chooser (sample, argmax).
 *
 * An entry takes part when it is finite. -INFINITY marks a masked entry; NaN
 * and +INFINITY, which no function here produces, count as masked too. A
 * transform leaves masked entries masked and kept entries either unchanged
 * (the filters) or moved (temperature, penalize, bias); a filter applied to a
 * vector with nothing left to drop does nothing.
 *
 * Ties: whenever entries are ranked, equal values rank by lower id first.
 *
 * Functions that can fail return -1 (a count or an id otherwise) after
 * writing a message naming the argument into err; on failure x is left as it
 * was. n must be at least 1. */
#ifndef LUMA_SAMPLE_H
#define LUMA_SAMPLE_H

#include <stdbool.h>
#include <stdint.h>

#include "err.h"
#include "rng.h"

/* The ranking of entries (top-k, argmax, the backends' too): a comes before
 * b when larger, or equal with a lower id. */
static inline bool luma_rank_before(float va, int32_t ia, float vb, int32_t ib)
{
    return va > vb || (va == vb && ia < ib);
}

/* A vector of more than 4 * LUMA_SPARSE_MAX entries with at most
 * LUMA_SPARSE_MAX live ones (after a top_k, say) is worked on through a
 * compact copy of its live entries in id order: the filters, the choosers and
 * the reductions give the same results on that copy (n = its length) as on
 * the whole vector, which lets a caller that holds only the live entries (the
 * Lua binding after a top-k on the GPU) call these functions on them. */
#define LUMA_SPARSE_MAX 2048

/* The id of the largest entry; -1 when every entry is masked. */
int32_t luma_logits_argmax(const float *x, int32_t n, luma_err *err);
/* The k (>= 1) largest unmasked entries, largest first, into ids[0..k) and
 * vals[0..k); returns how many were written: k, or fewer when fewer entries
 * are unmasked. */
int32_t luma_logits_topk(const float *x, int32_t n, int32_t k, int32_t *ids, float *vals,
                         luma_err *err);

/* t > 0 divides every entry by t (a result too large for a float becomes
 * FLT_MAX); t == 0 is greedy: only the argmax stays unmasked. */
int luma_logits_temperature(float *x, int32_t n, float t, luma_err *err);
/* Masks all but the k (>= 1) largest entries. */
int luma_logits_top_k(float *x, int32_t n, int32_t k, luma_err *err);
/* Nucleus: keeps the smallest set of largest entries whose probability sums
 * to at least p, and at least min_keep (>= 0) entries; p in (0, 1]. */
int luma_logits_top_p(float *x, int32_t n, float p, int32_t min_keep, luma_err *err);
/* The same, where order[0..n) (a permutation of 0..n-1) lists the entries
 * largest first, ties by index, as a top-k found them before later edits:
 * a hint, checked in one pass (the entries are sorted where it no longer
 * holds), which spares the few entries a top-k leaves their sort. */
int luma_logits_top_p_ordered(float *x, int32_t n, const int32_t *order, float p, int32_t min_keep,
                              luma_err *err);
/* Masks entries whose probability is below p times the largest probability,
 * keeping at least min_keep entries (the largest); p in (0, 1]. */
int luma_logits_min_p(float *x, int32_t n, float p, int32_t min_keep, luma_err *err);
/* Locally typical sampling (Meister et al. 2022, as llama.cpp does it): ranks
 * entries by |-log p_i - H|, H the entropy, and keeps the smallest prefix of
 * that ranking whose probability exceeds p, and at least min_keep entries;
 * p in (0, 1]. */
int luma_logits_typical(float *x, int32_t n, float p, int32_t min_keep, luma_err *err);
/* Penalties over the last last_n ids of hist[0..n_hist) (the whole history
 * when last_n <= 0), as llama.cpp applies them: for each distinct id seen c
 * times, its entry is divided by repeat when positive and multiplied by
 * repeat otherwise, then lowered by c * frequency + presence. repeat > 0;
 * 1, 0, 0 change nothing. Every id of hist must be in [0, n). */
int luma_logits_penalize(float *x, int32_t n, const int32_t *hist, int32_t n_hist,
                         int32_t last_n, float repeat, float frequency, float presence,
                         luma_err *err);
/* luma_logits_penalize in two halves, for a caller whose logits are
 * elsewhere (on a GPU, or compact). The first checks the arguments as
 * luma_logits_penalize does and counts the window: its distinct ids in
 * increasing order into ids, how often each appears into counts (both with
 * room for n_hist entries); returns how many, 0 when the penalties change
 * nothing, -1 on a bad argument. The second applies counted penalties to x
 * (ids distinct and in range of x). */
int32_t luma_logits_penalty_counts(int32_t n, const int32_t *hist, int32_t n_hist, int32_t last_n,
                                   float repeat, float frequency, float presence, int32_t *ids,
                                   int32_t *counts, luma_err *err);
void luma_logits_penalize_counted(float *x, const int32_t *ids, const int32_t *counts, int32_t k,
                                  float repeat, float frequency, float presence);
/* x[ids[i]] += values[i] for i in [0, count). A value may be -INFINITY (which
 * masks) but not NaN or +INFINITY. */
int luma_logits_bias(float *x, int32_t n, const int32_t *ids, const float *values,
                     int32_t count, luma_err *err);
/* Masks the count entries named by ids. */
int luma_logits_mask(float *x, int32_t n, const int32_t *ids, int32_t count, luma_err *err);
/* Masks every entry except the count named by ids. */
int luma_logits_allow(float *x, int32_t n, const int32_t *ids, int32_t count, luma_err *err);

/* Probabilities in place (masked entries become 0). Fails when every entry
 * is masked. */
int luma_logits_softmax(float *x, int32_t n, luma_err *err);
/* Log-probabilities in place (masked entries stay -INFINITY). Fails when
 * every entry is masked. */
int luma_logits_log_softmax(float *x, int32_t n, luma_err *err);
/* *h = the entropy of softmax(x) in nats; x is not changed. Fails when every
 * entry is masked. */
int luma_logits_entropy(const float *x, int32_t n, double *h, luma_err *err);
/* The entropy of a distribution from its sums over the live entries (m
 * the largest): z = sum exp(x_i - m), s = sum exp(x_i - m)(x_i - m). */
double luma_entropy_of_sums(double z, double s);
/* Draws an id from the categorical distribution softmax(x). Every call takes
 * exactly one luma_rng_uniform from rng, also a call that fails, so that a
 * seed fixes the whole sequence of draws. -1 when every entry is masked. */
int32_t luma_logits_sample(const float *x, int32_t n, luma_rng *rng, luma_err *err);

/* A top-k's n entries (ids and vals, largest first, as luma_logits_topk
 * gives them) put in id order, the compact form the functions above work
 * on for a vector with few live entries; order[r] = the new place of the
 * entry ranked r (the hint of luma_logits_top_p_ordered). n <=
 * LUMA_SPARSE_MAX. */
void luma_logits_compact(int32_t *ids, float *vals, int32_t *order, int32_t n);

/* The sampling chain that luma.policy's P.from_options builds, in its
 * order: the penalties (luma_logits_penalize over the last last_n ids of
 * the history; last_n 0: none), then the top_k best entries, then top_p
 * (1: none), then min_p (0: none), then the temperature temp, then a draw.
 * Decoding runs it without Lua (luma_model_decode; on a GPU on the
 * device, next to the step). luma_sampler_draw and _draw_top take no
 * penalties: their caller applies them (or has none). */
#define LUMA_SAMPLER_K_MAX 64
#define LUMA_SAMPLER_WINDOW_MAX 256
typedef struct luma_sampler {
    int32_t top_k;   /* [1, LUMA_SAMPLER_K_MAX] */
    float top_p;     /* (0, 1] */
    float min_p;     /* [0, 1] */
    float temp;      /* finite, > 0 */
    float repeat, frequency, presence;   /* with last_n > 0: repeat finite > 0, the others finite */
    int32_t last_n;  /* [0, LUMA_SAMPLER_WINDOW_MAX] */
} luma_sampler;

/* Checks the fields' ranges. */
int luma_sampler_check(const luma_sampler *s, luma_err *err);
/* Whether s penalizes: a window and a penalty that changes something. */
bool luma_sampler_penalizes(const luma_sampler *s);
/* The id s draws for the uniform u in [0, 1) from a top-k's count entries
 * (ids and vals, largest first, at most s->top_k; both arrays reused): the
 * functions above applied in s's order to their compact form. -1 with err
 * set when count is 0. */
int32_t luma_sampler_draw_top(const luma_sampler *s, int32_t *ids, float *vals, int32_t count, double u,
                              luma_err *err);
/* The id s draws from x[0..n) for the uniform u in [0, 1): what the
 * functions above give, applied in s's order to the compact form of x's
 * top_k best (as the Lua methods logits:top_k(k):top_p(p):min_p(q)
 * :temperature(t):sample(rng) apply them). -1 with err set when every
 * entry is masked. */
int32_t luma_sampler_draw(const luma_sampler *s, const float *x, int32_t n, double u, luma_err *err);

#endif
