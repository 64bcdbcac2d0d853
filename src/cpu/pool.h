/* A pool of persistent worker threads shared by every CPU operation. A job is
 * a function called once on each of n threads (the caller is thread 0) with
 * its index; luma_pool_run returns when all have finished. Workers spin
 * briefly between jobs (decode runs hundreds of small jobs per token) and
 * then sleep on a condition variable. */
#ifndef LUMA_CPU_POOL_H
#define LUMA_CPU_POOL_H

typedef void (*luma_pool_fn)(void *ctx, int ith, int nth);

typedef struct luma_pool luma_pool;

/* n_threads <= 0: one per online core. NULL when threads cannot be started. */
luma_pool *luma_pool_new(int n_threads);
void luma_pool_free(luma_pool *p);
int luma_pool_size(const luma_pool *p);
void luma_pool_run(luma_pool *p, luma_pool_fn fn, void *ctx);

/* The share [*lo, *hi) of n items for thread ith of nth. */
static inline void luma_pool_split(long n, int ith, int nth, long *lo, long *hi)
{
    long per = (n + nth - 1) / nth;
    *lo = per * ith < n ? per * ith : n;
    *hi = *lo + per < n ? *lo + per : n;
}

#endif
