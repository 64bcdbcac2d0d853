/* Sequences: a KV-cache sequence and the tokens it holds. */
#include <stdlib.h>
#include <string.h>

#include "model.h"

luma_seq *luma_seq_new(luma_model *m, luma_err *err)
{
    if (m->vocab_only) {
        luma_errf(err, "model was loaded with vocab_only: it has no KV cache");
        return NULL;
    }
    luma_seq *s = calloc(1, sizeof *s);
    if (s) s->kv = luma_kv_seq_new(m->kv);
    if (!s || !s->kv) {
        free(s);
        luma_errf(err, "out of memory for a sequence");
        return NULL;
    }
    s->model = m;
    return s;
}

luma_seq *luma_seq_fork(luma_seq *src, luma_err *err)
{
    luma_seq *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->model = src->model;
    if (src->n_tokens) {
        s->tokens = malloc((size_t)src->n_tokens * sizeof(int32_t));
        if (!s->tokens) goto oom;
        memcpy(s->tokens, src->tokens, (size_t)src->n_tokens * sizeof(int32_t));
        s->n_tokens = s->cap = src->n_tokens;
    }
    s->kv = luma_kv_seq_fork(src->model->kv, src->kv);
    if (!s->kv) goto oom;
    return s;
oom:
    if (s) free(s->tokens);
    free(s);
    luma_errf(err, "out of memory for a forked sequence");
    return NULL;
}

void luma_seq_free(luma_seq *s)
{
    if (!s) return;
    luma_kv_seq_free(s->model->kv, s->kv);
    free(s->tokens);
    free(s);
}

int luma_seq_rewind(luma_seq *s, int32_t n, luma_err *err)
{
    if (n < 0 || n > s->n_tokens)
        return luma_errf(err, "cannot rewind to %d: the sequence holds %d tokens", n, s->n_tokens);
    if (luma_kv_rewind(s->model->kv, s->kv, n, err)) return -1;
    s->n_tokens = n;
    return 0;
}
