/* Sequence userdata: a KV-cache sequence of a model. It keeps its model
 * alive (user value 1) and is linked into the model's list so that closing
 * the model closes it too. */
#include "bind/bind.h"

lseq *luma_bind_checkseq(lua_State *L, int i)
{
    return luaL_checkudata(L, i, LUMA_SEQ_MT);
}

luma_seq *luma_bind_seq(lua_State *L, int i)
{
    lseq *q = luma_bind_checkseq(L, i);
    if (!q->s) luaL_error(L, q->owner ? "sequence is closed" : "sequence is closed (its model was closed)");
    return q->s;
}

void luma_bind_seq_release(lseq *q)
{
    if (!q->s) return;
    luma_model *m = q->s->model;
    luma_seq_free(q->s);
    q->s = NULL;
    lmodel *lm = q->owner;
    if (q->prev) q->prev->next = q->next;
    else lm->seqs = q->next;
    if (q->next) q->next->prev = q->prev;
    q->prev = q->next = NULL;
    /* No run can make logits now: the model's sets are let go (its Logits
     * keep host copies), so closing the model leaves no memory behind. */
    if (!lm->seqs) luma_bind_logits_release_model(m);
}

/* Wraps s in a userdata owned by the model userdata at index mi. */
static void push_seq(lua_State *L, int mi, luma_seq *s)
{
    lmodel *lm = luma_bind_checkmodel(L, mi);
    lseq *q = lua_newuserdatauv(L, sizeof *q, 1);
    q->s = s;
    q->owner = lm;
    q->prev = NULL;
    q->next = lm->seqs;
    if (lm->seqs) lm->seqs->prev = q;
    lm->seqs = q;
    luaL_setmetatable(L, LUMA_SEQ_MT);
    lua_pushvalue(L, mi);
    lua_setiuservalue(L, -2, 1);
}

int luma_bind_newseq(lua_State *L)
{
    luma_model *m = luma_bind_model(L, 1);
    luma_bind_idle(L, m);
    luma_err err;
    luma_seq *s = luma_seq_new(m, &err);
    if (!s) return luma_bind_error(L, &err);
    push_seq(L, 1, s);
    return 1;
}

/* seq:eval(ids | id [, {all = true}]) -> Logits of the last token, or an
 * array of Logits, one per token, with all = true. */
static int seq_eval(lua_State *L)
{
    luma_seq *s = luma_bind_seq(L, 1);
    luma_model *m = s->model;
    luma_bind_idle(L, m);
    bool all = luma_bind_optbool(L, 3, "all", false);
    int32_t n, one;
    const int32_t *ids = luma_bind_checkidarg(L, 2, m->hp.n_vocab, &one, &n);
    luma_chunk c = { s, ids, n, all };
    int32_t rows = all ? n : 1;
    luma_bind_logits_budget(L, m, rows);
    /* The results exist before the run, so that nothing can fail between
     * the run and handing its rows out. */
    if (all) {
        lua_createtable(L, rows, 0);
        for (int32_t r = 0; r < rows; r++) {
            luma_bind_newlogits(L, m->hp.n_vocab);
            lua_rawseti(L, -2, r + 1);
        }
    } else {
        luma_bind_newlogits(L, m->hp.n_vocab);
    }
    int res = lua_gettop(L);
    luma_logits_set *set;
    luma_err err;
    if (luma_model_run_set(m, &c, 1, NULL, &set, &err)) return luma_bind_error(L, &err);
    for (int32_t r = 0; r < rows; r++) {
        if (all) lua_rawgeti(L, res, r + 1);
        luma_bind_logits_hold(lua_touserdata(L, -1), set, r);
        if (all) lua_pop(L, 1);
    }
    luma_logits_set_release(set);
    return 1;
}

/* on_token's context: the callback's stack index, and whether it raised
 * (its error object then left on the stack top). */
typedef struct decode_cb {
    lua_State *L;
    int fn;
    bool failed;
} decode_cb;

static int decode_token(void *ctx, int32_t id, bool *stop, luma_err *err)
{
    decode_cb *g = ctx;
    lua_State *L = g->L;
    lua_pushvalue(L, g->fn);
    lua_pushinteger(L, id);
    if (lua_pcall(L, 1, 1, 0) != LUA_OK) {
        g->failed = true;
        return luma_errf(err, "on_token raised an error");
    }
    *stop = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return 0;
}

/* seq:greedy and seq:sample: the options at index 4 (a table), smp the
 * sampler (NULL: greedy) and its generator at index 8 (a placeholder
 * there for greedy); a penalizing sampler's history as a table at index 6
 * and as history [n_history]. */
static int decode(lua_State *L, const char *what, const luma_sampler *smp, luma_rng *rng, const int32_t *history,
                  int32_t n_history)
{
    luma_seq *s = luma_bind_seq(L, 1);
    luma_model *m = s->model;
    int32_t n_stops = 0;
    const int32_t *stops = NULL;
    lua_getfield(L, 4, "stop");   /* 9 */
    if (!lua_isnil(L, 9)) {
        if (!lua_istable(L, 9)) return luaL_error(L, "%s: option 'stop' must be a list of token ids", what);
        stops = luma_bind_checkids(L, 9, m->hp.n_vocab, &n_stops);   /* 10 */
    } else {
        lua_pushnil(L);   /* 10 */
    }
    decode_cb cb = { L, 0, false };
    lua_getfield(L, 4, "on_token");   /* 11 */
    if (!lua_isnil(L, 11)) {
        if (!lua_isfunction(L, 11)) return luaL_error(L, "%s: option 'on_token' must be a function", what);
        cb.fn = 11;
    }
    /* the first id, as logits:argmax() or logits:draw() takes it (edits
     * included); none when nothing is asked (the generator untouched) */
    const lua_Integer n = lua_tointeger(L, 3);
    int32_t first = 0;
    luma_err err;
    if (n == 0) {
        /* nothing to draw */
    } else if (smp) {
        if (luma_sampler_penalizes(smp)) {
            /* logits:penalize(history, opts), as P.penalties does */
            lua_getfield(L, 2, "penalize");
            lua_pushvalue(L, 2);
            lua_pushvalue(L, 6);
            lua_pushvalue(L, 4);
            lua_call(L, 3, 0);
        }
        first = luma_bind_logits_draw(L, luma_bind_checklogits(L, 2), smp, luma_rng_uniform(rng), &err);
        if (first < 0) return luma_bind_error(L, &err);
    } else {
        lua_getfield(L, 2, "argmax");
        lua_pushvalue(L, 2);
        lua_call(L, 1, 1);
        first = (int32_t)lua_tointeger(L, -1);
        lua_pop(L, 1);
    }
    int32_t *ids = lua_newuserdatauv(L, (size_t)(n > 0 ? n : 1) * sizeof(int32_t), 0);   /* 12 */
    luma_bind_logits_budget(L, m, 2);
    llogits *out = luma_bind_newlogits(L, m->hp.n_vocab);   /* 13 */
    luaL_checkstack(L, 8, what);
    int32_t n_ids = 0;
    int64_t row = 0;
    luma_logits_set *set = NULL;
    m->busy = true;
    int rc = luma_model_decode(m, s, first, (int32_t)n, smp, rng, history, n_history, stops, n_stops,
                               cb.fn ? decode_token : NULL, &cb, ids, &n_ids, &set, &row, &err);
    m->busy = false;
    if (rc) {
        if (cb.failed) return lua_error(L);
        return luma_bind_error(L, &err);
    }
    if (set) {
        luma_bind_logits_hold(out, set, row);
        luma_logits_set_release(set);
    }
    lua_createtable(L, n_ids, 0);
    for (int32_t i = 0; i < n_ids; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushvalue(L, set ? 13 : 2);
    return 2;
}

static int seq_tokens(lua_State *L);

/* The arguments both take: (seq, logits, n [, opts]), opts at index 4. */
static void decode_args(lua_State *L)
{
    luma_seq *s = luma_bind_seq(L, 1);
    luma_model *m = s->model;
    luma_bind_idle(L, m);
    llogits *start = luma_bind_checklogits(L, 2);
    if (start->n != m->hp.n_vocab)
        luaL_argerror(L, 2, lua_pushfstring(L, "logits of %d entries, not the model's vocabulary of %d",
                                            (int)start->n, (int)m->hp.n_vocab));
    lua_Integer n = luaL_checkinteger(L, 3);
    if (n < 0 || n > m->n_ctx) luaL_argerror(L, 3, lua_pushfstring(L, "%I is outside [0, %d]", n, m->n_ctx));
    if (!lua_isnoneornil(L, 4)) luaL_checktype(L, 4, LUA_TTABLE);
    lua_settop(L, 4);
    if (lua_isnil(L, 4)) {
        lua_newtable(L);
        lua_replace(L, 4);
    }
}

/* seq:greedy(logits, n [, {stop = {ids}, on_token = function(id) ... end}])
 * -> ids, logits. Greedy decoding from logits (the sequence's last): up to
 * n ids, each the argmax of the logits before it, every one fed to the
 * sequence but one that stops (in stop, or on_token returned true), which
 * ends the list. logits: the Logits of the last id fed (the argument itself
 * when none was). On a GPU each step's token is taken on the device, so
 * the host queues the next step without waiting for it: on_token runs
 * while the device computes. An error (the context or the cache full, or
 * on_token's, raised again as it was) leaves the sequence as it was, but
 * for a run past a sliding window, whose released blocks cannot come back:
 * the sequence then keeps the tokens its cache holds (as seq:eval does). */
static int seq_greedy(lua_State *L)
{
    decode_args(L);
    lua_settop(L, 8);   /* 5 .. 8: unused */
    return decode(L, "greedy", NULL, NULL, NULL, 0);
}

/* seq:sample(logits, n, {rng = r, top_k = k [, top_p, min_p, temp,
 * repeat_, frequency, presence, last_n, history, stop, on_token]}) -> ids,
 * logits. The same with each id drawn as the chain P.from_options builds
 * draws it: where a penalty is set (repeat_ ~= 1, frequency or presence
 * ~= 0), logits:penalize(history, opts) over the last last_n (1 to 256,
 * default 64) ids of the history (default the sequence's tokens) and the
 * ids drawn since; then logits:top_k(k), :top_p(top_p) where top_p < 1
 * (default 1), :min_p(min_p) where min_p > 0 (default 0),
 * :temperature(temp) (default 1), :sample(r); k in [1, 64]. The first id
 * is drawn on the host (edits of logits included; the penalty edits
 * logits), the others by the same arithmetic in C, on a GPU on the
 * device (where its exp and log, a last bit off the host's, could move a
 * sum across a boundary: then, rarely, not the id the host would draw).
 * r gives one uniform a draw, in order. */
static int seq_sample(lua_State *L)
{
    decode_args(L);
    luma_sampler smp;
    lua_getfield(L, 4, "rng");   /* 5 */
    if (!luaL_testudata(L, 5, LUMA_RNG_MT)) return luaL_error(L, "sample: option 'rng' must be a luma.rng");
    luma_bind_checksampler(L, 4, "sample", true, &smp);
    const int32_t *history = NULL;
    int32_t n_history = 0;
    lua_getfield(L, 4, "history");   /* 6 */
    if (luma_sampler_penalizes(&smp)) {
        if (lua_isnil(L, 6)) {
            lua_pop(L, 1);
            lua_pushcfunction(L, seq_tokens);
            lua_pushvalue(L, 1);
            lua_call(L, 1, 1);   /* 6 */
        } else if (!lua_istable(L, 6)) {
            return luaL_error(L, "sample: option 'history' must be a list of token ids");
        }
        history = luma_bind_checkids(L, 6, luma_bind_seq(L, 1)->model->hp.n_vocab, &n_history);   /* 7 */
    } else {
        lua_pushnil(L);   /* 7 */
    }
    lua_pushvalue(L, 5);   /* 8 */
    return decode(L, "sample", &smp, lua_touserdata(L, 8), history, n_history);
}

static int seq_len(lua_State *L)
{
    lua_pushinteger(L, luma_bind_seq(L, 1)->n_tokens);
    return 1;
}

static int seq_tokens(lua_State *L)
{
    luma_seq *s = luma_bind_seq(L, 1);
    lua_createtable(L, s->n_tokens, 0);
    for (int32_t i = 0; i < s->n_tokens; i++) {
        lua_pushinteger(L, s->tokens[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int seq_fork(lua_State *L)
{
    luma_seq *s = luma_bind_seq(L, 1);
    luma_bind_idle(L, s->model);
    luma_err err;
    luma_seq *c = luma_seq_fork(s, &err);
    if (!c) return luma_bind_error(L, &err);
    lua_getiuservalue(L, 1, 1);
    push_seq(L, lua_gettop(L), c);
    return 1;
}

/* seq:rewind(n): keep the first n tokens */
static int seq_rewind(lua_State *L)
{
    luma_seq *s = luma_bind_seq(L, 1);
    luma_bind_idle(L, s->model);
    lua_Integer n = luaL_checkinteger(L, 2);
    if (n < 0 || n > s->n_tokens)
        return luaL_argerror(L, 2, lua_pushfstring(L, "%I is outside [0, %d]", n, (int)s->n_tokens));
    luma_err err;
    if (luma_seq_rewind(s, (int32_t)n, &err)) return luma_bind_error(L, &err);
    lua_settop(L, 1);
    return 1;
}

static int seq_close(lua_State *L)
{
    lseq *q = luma_bind_checkseq(L, 1);
    if (q->s) luma_bind_idle(L, q->s->model);
    luma_bind_seq_release(q);
    return 0;
}

/* The collector's close: never while its step is in flight (a run keeps its
 * sequences referenced), so never refused, even inside batch:run's during. */
static int seq_gc(lua_State *L)
{
    luma_bind_seq_release(luma_bind_checkseq(L, 1));
    return 0;
}

static int seq_tostring(lua_State *L)
{
    lseq *q = luma_bind_checkseq(L, 1);
    if (!q->s) lua_pushliteral(L, "luma.Sequence (closed)");
    else lua_pushfstring(L, "luma.Sequence (%d tokens)", q->s->n_tokens);
    return 1;
}

static const luaL_Reg meta[] = {
    { "__gc", seq_gc },
    { "__close", seq_close },
    { "__tostring", seq_tostring },
    { "__len", seq_len },
    { NULL, NULL },
};

static const luaL_Reg methods[] = {
    { "eval", seq_eval },
    { "greedy", seq_greedy },
    { "sample", seq_sample },
    { "len", seq_len },
    { "tokens", seq_tokens },
    { "fork", seq_fork },
    { "rewind", seq_rewind },
    { "close", seq_close },
    { NULL, NULL },
};

void luma_bind_open_seq(lua_State *L)
{
    luma_bind_newclass(L, LUMA_SEQ_MT, meta, methods, NULL);
}
