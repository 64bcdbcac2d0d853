#define _GNU_SOURCE
#include "cpu/pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Spins before sleeping: long enough to cover the gap between two operations
 * of one forward pass, short enough not to burn a core when idle. */
#define SPIN_ROUNDS 20000

struct luma_pool {
    int n;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_uint generation;   /* bumped for each job */
    atomic_int pending;       /* workers still running the current job */
    atomic_int sleepers;
    atomic_bool stop;
    luma_pool_fn fn;
    void *ctx;
};

/* Pauses inside a spin; every 64 rounds gives the core away, so a waiter
 * does not starve the thread it waits for when cores are oversubscribed. */
static void relax(int round)
{
    if (round % 64 == 0) sched_yield();
    else cpu_relax();
}

typedef struct {
    luma_pool *pool;
    int ith;
} worker_arg;

static void *worker_main(void *argp)
{
    worker_arg *wa = argp;
    luma_pool *p = wa->pool;
    int ith = wa->ith;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen &&
               !atomic_load(&p->stop)) {
            if (++spins < SPIN_ROUNDS) {
                relax(spins);
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->wake, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
            spins = 0;
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = g;
        p->fn(p->ctx, ith, p->n);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
    }
}

luma_pool *luma_pool_new(int n_threads)
{
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)c : 1;
    }
    if (n_threads > 256) n_threads = 256;
    luma_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads;
    p->threads = calloc((size_t)n_threads, sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa || (wa->pool = p, wa->ith = i, pthread_create(&p->threads[i], NULL, worker_main, wa))) {
            free(wa);
            p->n = i;
            luma_pool_free(p);
            return NULL;
        }
    }
    return p;
}

void luma_pool_free(luma_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    free(p->threads);
    free(p);
}

int luma_pool_size(const luma_pool *p) { return p->n; }

void luma_pool_run(luma_pool *p, luma_pool_fn fn, void *ctx)
{
    if (p->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->pending, p->n - 1);
    atomic_fetch_add(&p->generation, 1);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    fn(ctx, 0, p->n);
    for (int round = 1; atomic_load_explicit(&p->pending, memory_order_acquire) > 0; round++) relax(round);
}
