/* Logits userdata: one float per vocabulary entry, indexed by token id from
 * 0 (logits[model.eos]); #logits is the vocabulary size. Transforms edit in
 * place and return the object, so they chain:
 *   logits:penalize(hist, {repeat_ = 1.1}):top_k(40):top_p(0.95):temperature(0.8):sample(rng)
 *
 * Where the row lives (llogits, bind.h): a step leaves it in a logits set of
 * the backend. On a GPU, argmax, topk, top_k, penalize, bias, mask,
 * temperature, sample, softmax, log_softmax, entropy, min_p (min_keep 1),
 * top_p (where the nucleus is among the row's best 2048) and the first few
 * single entries (logits[id], logits[id] = v) run there and only their
 * small results come back; any other method downloads the row once and
 * goes on on the host. On the
 * CPU the set is host memory and every method works on it directly. On
 * both, top_k (k <= LUMA_SPARSE_MAX) leaves the compact form (the k
 * survivors on the host), on which the rest of a policy chain runs as the
 * host functions would on the whole row, without passes over it. draw runs
 * such a chain (top_k, top_p, min_p, temperature, sample) in one call on
 * the k best, leaving the row as it was.
 *
 * Lua's collector does not see the sets' memory, so a run first keeps the
 * held sets within a budget (luma_bind_logits_budget), and a model whose
 * last sequence closes hands its Logits host copies (the model may be
 * closed next; its Logits stay usable). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bind/bind.h"
#include "sample.h"

llogits *luma_bind_checklogits(lua_State *L, int i)
{
    return luaL_checkudata(L, i, LUMA_LOGITS_MT);
}

llogits *luma_bind_newlogits(lua_State *L, int32_t n)
{
    llogits *lg = lua_newuserdatauv(L, sizeof *lg, 0);
    memset(lg, 0, sizeof *lg);
    lg->n = n;
    luaL_setmetatable(L, LUMA_LOGITS_MT);
    return lg;
}

/* ---- where the row is ---------------------------------------------------- */

void luma_bind_logits_hold(llogits *lg, luma_logits_set *s, int64_t row)
{
    lg->set = s;
    lg->row = row;
    s->refs++;
    lg->prev = NULL;
    lg->next = s->holders;
    if (lg->next) lg->next->prev = lg;
    s->holders = lg;
    lg->x = luma_logits_set_host(s, row);
    lg->x_owned = false;
}

/* Forgets the penalty the row's one change was (lowered_mem). */
static void forget_lowered(llogits *lg)
{
    free(lg->lowered_mem);
    lg->lowered_mem = NULL;
}

/* Lets go of the set (x, if it pointed into it, goes too). */
static void unhold(llogits *lg)
{
    forget_lowered(lg);
    luma_logits_set *s = lg->set;
    if (!s) return;
    if (lg->prev) lg->prev->next = lg->next;
    else s->holders = lg->next;
    if (lg->next) lg->next->prev = lg->prev;
    lg->prev = lg->next = NULL;
    lg->set = NULL;
    if (!lg->x_owned) lg->x = NULL;
    luma_logits_set_release(s);
}

/* Whether the row is in device memory; raises when it is and its model's
 * step is in flight (the device's logits work waits for no step). */
static bool on_device(lua_State *L, const llogits *lg)
{
    if (!lg->set || lg->x) return false;
    luma_bind_idle(L, lg->set->model);
    return true;
}

static luma_backend *backend(const llogits *lg)
{
    return lg->set->model->be;
}

/* The backend of a row in device memory that is about to be changed there:
 * what the run found ahead of the unchanged row (its top-k, the lowering)
 * no longer holds. */
static luma_backend *edit_on_device(llogits *lg)
{
    lg->edited = true;
    forget_lowered(lg);
    return backend(lg);
}

/* Gives lg its own host copy of the row and lets go of the set; on failure
 * lg is left as it was. */
static int detach(llogits *lg, luma_err *err)
{
    if (!lg->set) return 0;
    float *x = malloc((size_t)lg->n * sizeof *x);
    if (!x) return luma_errf(err, "logits: out of memory for a copy of %d entries", (int)lg->n);
    if (lg->x) {
        memcpy(x, lg->x, (size_t)lg->n * sizeof *x);
    } else if (luma_logits_set_read(lg->set, lg->row, x, err)) {
        free(x);
        return -1;
    }
    lg->x = x;
    lg->x_owned = true;
    unhold(lg);
    return 0;
}

/* detach where no error can be raised: a failure loses the row, and a later
 * use of lg says why. */
static void save(llogits *lg)
{
    luma_err err;
    if (detach(lg, &err) == 0) return;
    lg->lost = "its row could not be copied out of its logits set when the set was released";
    unhold(lg);
}

/* Detaches every holder of s; s itself may be gone afterwards. */
static void save_holders(luma_logits_set *s)
{
    for (llogits *h = s->holders, *next; h; h = next) {
        next = h->next;
        save(h);
    }
}

void luma_bind_logits_budget(lua_State *L, luma_model *m, int64_t rows)
{
    int64_t add = rows * m->hp.n_vocab * (int64_t)sizeof(float);
    /* Room for the set a caller still holds from the last step and the new one. */
    int64_t limit = 2 * add > LUMA_SETS_BYTES ? 2 * add : LUMA_SETS_BYTES;
    if (m->n_sets < LUMA_SETS_MAX && m->set_bytes + add <= limit) return;
    lua_gc(L, LUA_GCCOLLECT);
    while (m->sets && m->sets->holders && (m->n_sets >= LUMA_SETS_MAX || m->set_bytes + add > limit))
        save_holders(m->sets);
}

void luma_bind_logits_release_model(luma_model *m)
{
    while (m->sets && m->sets->holders) save_holders(m->sets);
    luma_model_logits_drain(m);
}

/* The whole row on the host: downloaded, or expanded from the compact form,
 * the first time a method needs it. */
static float *host_row(lua_State *L, llogits *lg)
{
    if (lg->x) return lg->x;
    if (lg->lost) luaL_error(L, "logits: %s", lg->lost);
    luma_err err;
    if (lg->set) {
        luma_bind_idle(L, lg->set->model);
        if (detach(lg, &err)) luma_bind_error(L, &err);
    } else if (lg->compact) {
        float *x = malloc((size_t)lg->n * sizeof *x);
        if (!x) luaL_error(L, "logits: out of memory for %d entries", (int)lg->n);
        for (int32_t i = 0; i < lg->n; i++) x[i] = -INFINITY;
        for (int32_t j = 0; j < lg->n_live; j++) x[lg->ids[j]] = lg->vals[j];
        free(lg->ids);
        lg->ids = NULL;
        lg->vals = NULL;
        lg->order = NULL;
        lg->compact = false;
        lg->x = x;
        lg->x_owned = true;
    } else {
        luaL_error(L, "logits: no values (the run that was to make them failed)");
    }
    /* The copy is memory the collector does not see: it pays for it here. */
    lua_gc(L, LUA_GCSTEP, (int)(lg->n / 256));
    return lg->x;
}

/* Whether the compact form stands for the row in a src/sample.h function
 * (which needs at least one entry; a row with none goes the whole way). */
static bool use_compact(const llogits *lg)
{
    return lg->compact && lg->n_live > 0;
}

/* The place of id in the compact form, or -1 when it is masked there. */
static int32_t compact_find(const llogits *lg, int32_t id)
{
    int32_t lo = 0, hi = lg->n_live;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (lg->ids[mid] < id) lo = mid + 1;
        else hi = mid;
    }
    return lo < lg->n_live && lg->ids[lo] == id ? lo : -1;
}

/* Replaces the listed ids by their places in the compact form, dropping
 * those masked there (which no edit changes) with their counts or values;
 * returns how many stay. */
static int32_t to_compact(const llogits *lg, int32_t *ids, int32_t *counts, float *values, int32_t n)
{
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t j = compact_find(lg, ids[i]);
        if (j < 0) continue;
        ids[k] = j;
        if (counts) counts[k] = counts[i];
        if (values) values[k] = values[i];
        k++;
    }
    return k;
}

/* The k best entries of a row that is not compact (largest first, as
 * luma_logits_topk gives them), found on the device or on the host row;
 * their count, or -1 with err set. */
static int32_t top_entries(lua_State *L, llogits *lg, int32_t k, int32_t *ids, float *vals, luma_err *err)
{
    if (!on_device(L, lg)) return luma_logits_topk(host_row(L, lg), lg->n, k, ids, vals, err);
    int32_t got = lg->lowered_mem ? luma_logits_set_topk_lowered(lg->set, lg->row, k, &lg->lowered, ids, vals) : -1;
    return got >= 0 ? got : luma_logits_set_topk(lg->set, lg->row, k, !lg->edited, ids, vals, err);
}

/* lg becomes the compact form of the got entries ids [got] and vals [got],
 * largest first (ids, the start of one allocation holding vals and order,
 * room for got at least, is now lg's), and lets go of its row. */
static void become_compact(llogits *lg, int32_t *ids, float *vals, int32_t *order, int32_t got)
{
    luma_logits_compact(ids, vals, order, got);
    unhold(lg);
    if (lg->x_owned) free(lg->x);
    lg->x = NULL;
    lg->x_owned = false;
    lg->compact = true;
    lg->ids = ids;
    lg->vals = vals;
    lg->order = order;
    lg->n_live = got;
}

/* The k (<= LUMA_SPARSE_MAX) best entries become the compact form, found
 * on the device or on the host row, and the row is let go: what
 * luma_logits_top_k leaves of the row, held as its live entries. */
static void keep_top_compact(lua_State *L, llogits *lg, int32_t k)
{
    if (!on_device(L, lg)) host_row(L, lg);   /* any error before the allocation */
    int32_t *ids = malloc((size_t)k * (2 * sizeof(int32_t) + sizeof(float)));
    if (!ids) luaL_error(L, "top_k: out of memory for %d entries", (int)k);
    float *vals = (float *)(ids + k);
    int32_t *order = (int32_t *)(vals + k);
    luma_err err;
    int32_t got = top_entries(L, lg, k, ids, vals, &err);
    if (got < 0) {
        free(ids);
        luma_bind_error(L, &err);
    }
    become_compact(lg, ids, vals, order, got);
}

/* ---- indexing ------------------------------------------------------------ */

static int32_t check_index(lua_State *L, const llogits *lg, int i)
{
    lua_Integer id = luaL_checkinteger(L, i);
    if (id < 0 || id >= lg->n)
        luaL_error(L, "token id %I out of range [0, %d)", id, (int)lg->n);
    return (int32_t)id;
}

static int device_edit(lua_State *L, llogits *lg, const luma_logits_edit *e);

/* logits[id] and logits[id] = v on a row in device memory: the first few
 * move one entry (a policy's look at a token or two); past them the row
 * comes to the host, where a loop over many entries costs no round trips. */
#define ENTRY_OPS_MAX 16

static bool entry_on_device(lua_State *L, llogits *lg)
{
    return !lg->compact && on_device(L, lg) && ++lg->entry_ops <= ENTRY_OPS_MAX;
}

static int logits_index(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    if (lua_type(L, 2) == LUA_TNUMBER) {
        int32_t id = check_index(L, lg, 2);
        if (lg->compact) {
            int32_t j = compact_find(lg, id);
            lua_pushnumber(L, j < 0 ? -INFINITY : lg->vals[j]);
        } else if (entry_on_device(L, lg)) {
            /* one entry crosses, not the row */
            float v;
            luma_err err;
            if (luma_logits_set_read_at(lg->set, lg->row, id, &v, &err)) return luma_bind_error(L, &err);
            lua_pushnumber(L, v);
        } else {
            lua_pushnumber(L, host_row(L, lg)[id]);
        }
        return 1;
    }
    lua_pushvalue(L, 2);
    lua_gettable(L, lua_upvalueindex(1));
    return 1;
}

static int logits_newindex(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    int32_t id = check_index(L, lg, 2);
    float v = (float)luaL_checknumber(L, 3);
    if (entry_on_device(L, lg)) {
        luma_logits_edit e = { LUMA_EDIT_SET, 1, &id, &v, 1.0f, 0.0f, 0.0f };
        device_edit(L, lg, &e);
        return 0;
    }
    host_row(L, lg)[id] = v;
    return 0;
}

static int logits_len(lua_State *L)
{
    lua_pushinteger(L, luma_bind_checklogits(L, 1)->n);
    return 1;
}

static int logits_tostring(lua_State *L)
{
    lua_pushfstring(L, "luma.Logits (%d)", (int)luma_bind_checklogits(L, 1)->n);
    return 1;
}

static int logits_gc(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    unhold(lg);
    if (lg->x_owned) free(lg->x);
    lg->x = NULL;
    lg->x_owned = false;
    free(lg->ids);
    lg->ids = NULL;
    lg->vals = NULL;
    lg->order = NULL;
    lg->compact = false;
    lg->n_live = 0;
    return 0;
}

/* Returns self, for chaining, after a transform that returned rc. */
static int chain(lua_State *L, int rc, const luma_err *err)
{
    if (rc < 0) return luma_bind_error(L, err);
    lua_settop(L, 1);
    return 1;
}

/* ---- reductions ---------------------------------------------------------- */

static int logits_argmax(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    int32_t id;
    if (on_device(L, lg)) {
        id = luma_logits_set_argmax(lg->set, lg->row, !lg->edited, &err);
        if (id < 0) return luma_bind_error(L, &err);
    } else if (use_compact(lg)) {
        id = luma_logits_argmax(lg->vals, lg->n_live, &err);
        if (id >= 0) id = lg->ids[id];
    } else {
        id = luma_logits_argmax(host_row(L, lg), lg->n, &err);
    }
    if (id < 0) return luaL_error(L, "argmax: every entry is masked");
    lua_pushinteger(L, id);
    return 1;
}

/* logits:topk(k) -> ids, values (Lua arrays, largest first) */
static int logits_topk(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    lua_Integer k = luaL_checkinteger(L, 2);
    if (k < 1 || k > lg->n) return luaL_argerror(L, 2, "k must be in [1, vocabulary size]");
    int32_t *ids = lua_newuserdatauv(L, (size_t)k * sizeof(int32_t), 0);
    float *vals = lua_newuserdatauv(L, (size_t)k * sizeof(float), 0);
    luma_err err;
    int32_t got;
    if (on_device(L, lg) && k <= LUMA_TOPK_MAX) {
        got = luma_logits_set_topk(lg->set, lg->row, (int32_t)k, !lg->edited, ids, vals, &err);
    } else if (use_compact(lg)) {
        got = luma_logits_topk(lg->vals, lg->n_live, (int32_t)k, ids, vals, &err);
        for (int32_t i = 0; i < got; i++) ids[i] = lg->ids[ids[i]];
    } else {
        got = luma_logits_topk(host_row(L, lg), lg->n, (int32_t)k, ids, vals, &err);
    }
    if (got < 0) return luma_bind_error(L, &err);
    lua_createtable(L, got, 0);
    lua_createtable(L, got, 0);
    for (int32_t i = 0; i < got; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -3, i + 1);
        lua_pushnumber(L, vals[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 2;
}

static int logits_entropy(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    double h, z, s;
    int rc;
    if (use_compact(lg)) {
        rc = luma_logits_entropy(lg->vals, lg->n_live, &h, &err);
    } else if (on_device(L, lg) && backend(lg)->ops->logits_live_sums) {
        luma_backend *be = backend(lg);
        rc = be->ops->logits_live_sums(be, &lg->set->buf, lg->row, &z, &s, &err);
        if (rc == 0) h = luma_entropy_of_sums(z, s);
    } else {
        rc = luma_logits_entropy(host_row(L, lg), lg->n, &h, &err);
    }
    if (rc) return luma_bind_error(L, &err);
    lua_pushnumber(L, h);
    return 1;
}

static int logits_sample(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_rng *rng = luma_bind_checkrng(L, 2);
    luma_err err;
    int32_t id;
    if (on_device(L, lg)) {
        luma_backend *be = backend(lg);
        id = be->ops->logits_sample(be, &lg->set->buf, lg->row, luma_rng_uniform(rng), &err);
    } else if (use_compact(lg)) {
        id = luma_logits_sample(lg->vals, lg->n_live, rng, &err);
        if (id >= 0) id = lg->ids[id];
    } else {
        id = luma_logits_sample(host_row(L, lg), lg->n, rng, &err);
    }
    if (id < 0) return luma_bind_error(L, &err);
    lua_pushinteger(L, id);
    return 1;
}

/* ---- the sampling chain in one call ---------------------------------------- */

void luma_bind_checksampler(lua_State *L, int i, const char *what, bool penalties, luma_sampler *s)
{
    luaL_checktype(L, i, LUA_TTABLE);
    lua_getfield(L, i, "top_k");
    if (!lua_isinteger(L, -1)) luaL_error(L, "%s: option 'top_k' must be an integer", what);
    lua_Integer k = lua_tointeger(L, -1);
    lua_pop(L, 1);
    if (k < 1 || k > LUMA_SAMPLER_K_MAX)
        luaL_error(L, "%s: option 'top_k' must be in [1, %d] (got %I)", what, LUMA_SAMPLER_K_MAX, k);
    s->top_k = (int32_t)k;
    /* the penalties as P.penalties defaults them (last_n 64) */
    static const char *const keys[] = { "top_p", "min_p", "temp", "repeat_", "frequency", "presence" };
    static const double defs[] = { 1.0, 0.0, 1.0, 1.0, 0.0, 0.0 };
    float *fields[] = { &s->top_p, &s->min_p, &s->temp, &s->repeat, &s->frequency, &s->presence };
    for (int f = 0; f < 6; f++) {
        lua_getfield(L, i, keys[f]);
        double v = defs[f];
        if (!lua_isnil(L, -1)) {
            if (f >= 3 && !penalties)
                luaL_error(L, "%s: option '%s': penalties need the history (logits:penalize first)", what, keys[f]);
            if (!lua_isnumber(L, -1)) luaL_error(L, "%s: option '%s' must be a number", what, keys[f]);
            v = lua_tonumber(L, -1);
        }
        lua_pop(L, 1);
        *fields[f] = (float)v;
    }
    lua_getfield(L, i, "last_n");
    s->last_n = 64;
    if (!lua_isnil(L, -1)) {
        if (!penalties) luaL_error(L, "%s: option 'last_n': penalties need the history (logits:penalize first)", what);
        if (!lua_isinteger(L, -1)) luaL_error(L, "%s: option 'last_n' must be an integer", what);
        lua_Integer w = lua_tointeger(L, -1);
        if (w < 1 || w > LUMA_SAMPLER_WINDOW_MAX)
            luaL_error(L, "%s: option 'last_n' must be in [1, %d] (got %I)", what, LUMA_SAMPLER_WINDOW_MAX, w);
        s->last_n = (int32_t)w;
    }
    lua_pop(L, 1);
    luma_err err;
    if (luma_sampler_check(s, &err)) luaL_error(L, "%s: option %s", what, err.msg + strlen("sampler: "));
}

/* The entries s draws from: the k best of lg's row (k = s->top_k, at most
 * the row), largest first; their count, or -1 with err set. */
static int32_t draw_entries(lua_State *L, llogits *lg, const luma_sampler *s, int32_t *ids, float *vals,
                            luma_err *err)
{
    const int32_t k = s->top_k < lg->n ? s->top_k : lg->n;
    if (!lg->compact) return top_entries(L, lg, k, ids, vals, err);
    int32_t got = lg->n_live > 0 ? luma_logits_topk(lg->vals, lg->n_live, k, ids, vals, err) : 0;
    for (int32_t j = 0; j < got; j++) ids[j] = lg->ids[ids[j]];
    return got;
}

int32_t luma_bind_logits_draw(lua_State *L, llogits *lg, const luma_sampler *s, double u, luma_err *err)
{
    int32_t ids[LUMA_SAMPLER_K_MAX];
    float vals[LUMA_SAMPLER_K_MAX];
    int32_t got = draw_entries(L, lg, s, ids, vals, err);
    return got < 0 ? -1 : luma_sampler_draw_top(s, ids, vals, got, u, err);
}

/* logits:draw({top_k = k [, top_p, min_p, temp]}, rng) -> id */
static int logits_draw(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_sampler s;
    luma_bind_checksampler(L, 2, "draw", false, &s);
    luma_rng *rng = luma_bind_checkrng(L, 3);
    luma_err err;
    int32_t id = luma_bind_logits_draw(L, lg, &s, luma_rng_uniform(rng), &err);
    if (id < 0) return luma_bind_error(L, &err);
    lua_pushinteger(L, id);
    return 1;
}

/* luma.draw(rows, opts, rngs [, how]) -> ids: ids[i] = rows[i]:draw(opts_i,
 * rng_i) for i = 1 .. #rows, in order, where opts and rngs are each one
 * (for every row) or an array (a row each); how: { out = a table for the
 * ids, release = true to let go of the rows' logits sets once drawn (the
 * rows are then unusable), histories = a history a row }. With histories
 * the options may hold penalties (repeat_, frequency, presence, last_n, as
 * seq:sample's), applied first as rows[i]:penalize(histories[i], opts_i)
 * would (release must then be true: a row is penalized in place, or not
 * at all where its penalized best are found from the run's). The rows'
 * entries are found first (any error raised then leaves every generator
 * as it was, as does a row with no live entry), then each row takes its
 * uniform, then the draws run: on the device, all in one launch and one
 * wait, where a row's backend can and there are at least draw_rows_min()
 * rows (a device's exp or log may move a sum across a boundary, as for
 * seq:sample), else on the host. */
#define DRAW_ROWS_MIN 8

/* LUMA_DRAW_ROWS: the fewest rows drawn on the device (0: never). */
static int draw_rows_min(void)
{
    static int min = -1;
    if (min < 0) {
        const char *e = getenv("LUMA_DRAW_ROWS");
        min = e && *e ? atoi(e) : DRAW_ROWS_MIN;
        if (min < 0) min = 0;
    }
    return min;
}

/* Element i of the array at index t, or the value at t itself when it is
 * not an array of them (one for all); left on the stack. */
static void nth_or_all(lua_State *L, int t, bool all, lua_Integer i)
{
    if (all) lua_pushvalue(L, t);
    else lua_rawgeti(L, t, i);
}

/* A penalizing sampler's entries for rows[i + 1] (on the stack: its
 * options table on top, below it ... the histories at 5): the penalties
 * over the last last_n ids of histories[i + 1] applied to the k best the
 * run found ahead (luma_logits_set_topk_lowered: an unedited row, a
 * penalty that only lowers), their count; else the row is penalized in
 * place (logits:penalize(history, opts)) and -1 says to find its entries
 * as without penalties. */
static int32_t penalized_entries(lua_State *L, llogits *lg, int32_t i, const luma_sampler *s, int32_t *ids,
                                 float *vals, luma_err *err)
{
    const int opts = lua_gettop(L) - 1;   /* the rng above it */
    lua_rawgeti(L, 5, i + 1);
    const int hist = lua_gettop(L);
    if (!lua_istable(L, hist)) luaL_error(L, "draw: histories[%d] is not a list of token ids", (int)i + 1);
    const lua_Integer len = luaL_len(L, hist);
    const int32_t w = (int32_t)(len < s->last_n ? len : s->last_n);
    if (lg->set && !lg->x && !lg->edited && !lg->compact && s->repeat >= 1.0f && s->frequency >= 0.0f &&
        s->presence >= 0.0f) {
        int32_t win[LUMA_SAMPLER_WINDOW_MAX], pid[LUMA_SAMPLER_WINDOW_MAX], pcount[LUMA_SAMPLER_WINDOW_MAX];
        for (int32_t j = 0; j < w; j++) {
            lua_rawgeti(L, hist, len - w + 1 + j);
            int isint;
            lua_Integer id = lua_tointegerx(L, -1, &isint);
            lua_pop(L, 1);
            if (!isint || id < 0 || id >= lg->n)
                luaL_error(L, "draw: histories[%d]: an id out of range [0, %d)", (int)i + 1, (int)lg->n);
            win[j] = (int32_t)id;
        }
        int32_t k = luma_logits_penalty_counts(lg->n, win, w, w, s->repeat, s->frequency, s->presence, pid, pcount,
                                               err);
        if (k < 0) luma_bind_error(L, err);
        const luma_lowering low = { pid, pcount, k, s->repeat, s->frequency, s->presence };
        const int32_t top = s->top_k < lg->n ? s->top_k : lg->n;
        int32_t got = luma_logits_set_topk_lowered(lg->set, lg->row, top, &low, ids, vals);
        if (got >= 0) {
            lua_pop(L, 1);
            return got;
        }
    }
    /* rows[i + 1]:penalize(history, opts) */
    lua_rawgeti(L, 1, i + 1);
    lua_getfield(L, -1, "penalize");
    lua_insert(L, -2);
    lua_pushvalue(L, hist);
    lua_pushvalue(L, opts);
    lua_call(L, 3, 0);
    lua_pop(L, 1);
    return -1;
}

int luma_bind_draw(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checktype(L, 2, LUA_TTABLE);
    const lua_Integer n = luaL_len(L, 1);
    if (n > INT32_MAX / LUMA_SAMPLER_K_MAX) return luaL_error(L, "draw: %I rows is too many", n);
    /* one options table when it names top_k, else an array of them */
    lua_getfield(L, 2, "top_k");
    const bool one_opts = !lua_isnil(L, -1);
    lua_pop(L, 1);
    const bool one_rng = luaL_testudata(L, 3, LUMA_RNG_MT) != NULL;
    if (!one_rng && !lua_istable(L, 3)) return luaL_error(L, "draw: rngs must be an Rng or an array of them");
    if (!one_opts && luaL_len(L, 2) != n)
        return luaL_error(L, "draw: %I rows but %I option tables", n, luaL_len(L, 2));
    if (!one_rng && luaL_len(L, 3) != n) return luaL_error(L, "draw: %I rows but %I rngs", n, luaL_len(L, 3));
    bool release = false;
    if (!lua_isnoneornil(L, 4)) {
        luaL_checktype(L, 4, LUA_TTABLE);
        lua_getfield(L, 4, "release");
        release = lua_toboolean(L, -1);
        lua_getfield(L, 4, "histories");   /* 5 after the settop below */
        if (!lua_isnil(L, -1) && (!lua_istable(L, -1) || luaL_len(L, -1) != n))
            return luaL_error(L, "draw: option 'histories' must be a list of %I histories, one a row", n);
        lua_getfield(L, 4, "out");
        if (!lua_isnil(L, -1) && !lua_istable(L, -1)) return luaL_error(L, "draw: option 'out' must be a table");
    } else {
        lua_pushnil(L);
        lua_pushnil(L);
        lua_pushnil(L);
    }
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        lua_createtable(L, (int)n, 0);
    }
    lua_replace(L, 4);
    lua_replace(L, 5);   /* histories */
    lua_settop(L, 5);
    const bool histories = !lua_isnil(L, 5);
    if (n == 0) {
        lua_settop(L, 4);
        return 1;
    }
    const int32_t K = LUMA_SAMPLER_K_MAX, rows = (int32_t)n;
    /* the rows' entries and what draws from them, in memory the collector
     * frees whatever error comes */
    const size_t bytes = (size_t)rows * ((size_t)K * (sizeof(int32_t) + sizeof(float)) + 2 * sizeof(int32_t) +
                                         sizeof(luma_sampler) + sizeof(double) + sizeof(luma_rng *));
    double *u = lua_newuserdatauv(L, bytes, 0);
    luma_rng **rng = (luma_rng **)(u + rows);
    luma_sampler *smp = (luma_sampler *)(rng + rows);
    int32_t *ids = (int32_t *)(smp + rows), *counts = ids + (size_t)rows * K, *out = counts + rows;
    float *vals = (float *)(out + rows);
    luma_backend *be = NULL;
    const void *parsed = NULL;
    luma_err err;
    for (int32_t i = 0; i < rows; i++) {
        lua_rawgeti(L, 1, i + 1);
        llogits *lg = luaL_testudata(L, -1, LUMA_LOGITS_MT);
        if (!lg) return luaL_error(L, "draw: rows[%d] is not a Logits", (int)i + 1);
        nth_or_all(L, 2, one_opts, i + 1);
        if (!lua_istable(L, -1)) return luaL_error(L, "draw: opts[%d] is not a table", (int)i + 1);
        if (lua_topointer(L, -1) != parsed) {
            luma_bind_checksampler(L, lua_gettop(L), "draw", histories, &smp[i]);
            parsed = lua_topointer(L, -1);
        } else {
            smp[i] = smp[i - 1];
        }
        nth_or_all(L, 3, one_rng, i + 1);
        rng[i] = luaL_testudata(L, -1, LUMA_RNG_MT);
        if (!rng[i]) return luaL_error(L, "draw: rngs[%d] is not an Rng", (int)i + 1);
        if (lg->set && !be) be = lg->set->model->be;
        int32_t got = -1;
        if (luma_sampler_penalizes(&smp[i])) {
            if (!release) return luaL_error(L, "draw: penalties need release = true (the rows may be penalized in place)");
            got = penalized_entries(L, lg, i, &smp[i], ids + (size_t)i * K, vals + (size_t)i * K, &err);
        }
        lua_pop(L, 3);
        counts[i] = got >= 0 ? got : draw_entries(L, lg, &smp[i], ids + (size_t)i * K, vals + (size_t)i * K, &err);
        if (counts[i] < 0) return luma_bind_error(L, &err);
        if (counts[i] == 0) return luaL_error(L, "draw: rows[%d]: every logit is masked", (int)i + 1);
    }
    for (int32_t i = 0; i < rows; i++) u[i] = luma_rng_uniform(rng[i]);
    const int min = draw_rows_min();
    if (be && be->ops->sampler_draw_rows && min > 0 && rows >= min) {
        if (be->ops->sampler_draw_rows(be, rows, K, ids, vals, counts, smp, u, out, &err))
            return luma_bind_error(L, &err);
    } else {
        for (int32_t i = 0; i < rows; i++) {
            out[i] = luma_sampler_draw_top(&smp[i], ids + (size_t)i * K, vals + (size_t)i * K, counts[i], u[i], &err);
            if (out[i] < 0) return luma_bind_error(L, &err);
        }
    }
    for (int32_t i = 0; i < rows; i++) {
        lua_pushinteger(L, out[i]);
        lua_rawseti(L, 4, i + 1);
    }
    for (int32_t i = 0; release && i < rows; i++) {
        lua_rawgeti(L, 1, i + 1);
        llogits *lg = luaL_testudata(L, -1, LUMA_LOGITS_MT);
        lua_pop(L, 1);
        if (lg && lg->set) {
            unhold(lg);
            lg->lost = "it was released by luma.draw";
        }
    }
    lua_settop(L, 4);
    return 1;
}

/* ---- transforms ---------------------------------------------------------- */

static int logits_temperature(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    float t = (float)luaL_checknumber(L, 2);
    if (!(t >= 0.0f) || isinf(t))
        return luaL_error(L, "temperature: t must be finite and >= 0 (got %f)", (double)t);
    luma_err err;
    if (on_device(L, lg)) {
        /* Greedy keeps the argmax alone: the top 1. */
        if (t == 0.0f) {
            keep_top_compact(L, lg, 1);
            lua_settop(L, 1);
            return 1;
        }
        luma_backend *be = edit_on_device(lg);
        return chain(L, be->ops->logits_temperature(be, &lg->set->buf, lg->row, t, &err), &err);
    }
    if (use_compact(lg)) return chain(L, luma_logits_temperature(lg->vals, lg->n_live, t, &err), &err);
    return chain(L, luma_logits_temperature(host_row(L, lg), lg->n, t, &err), &err);
}

static int logits_top_k(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    lua_Integer k = luaL_checkinteger(L, 2);
    if (k < 1) return luaL_argerror(L, 2, "k must be at least 1");
    if (k > lg->n) k = lg->n;
    luma_err err;
    /* A few survivors are kept compact, wherever the row is. */
    if (!lg->compact && k <= LUMA_SPARSE_MAX && k <= LUMA_TOPK_MAX) {
        keep_top_compact(L, lg, (int32_t)k);
        lua_settop(L, 1);
        return 1;
    }
    if (use_compact(lg)) return chain(L, luma_logits_top_k(lg->vals, lg->n_live, (int32_t)k, &err), &err);
    return chain(L, luma_logits_top_k(host_row(L, lg), lg->n, (int32_t)k, &err), &err);
}

static int32_t check_min_keep(lua_State *L, int i)
{
    lua_Integer k = luaL_optinteger(L, i, 1);
    if (k < 0 || k > INT32_MAX) luaL_argerror(L, i, "min_keep must be a non-negative integer");
    return (int32_t)k;
}

typedef int (*mass_filter)(float *x, int32_t n, float p, int32_t min_keep, luma_err *err);

/* top_p, min_p, typical: on the compact form or the whole row. */
static int filter(lua_State *L, mass_filter f)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    float p = (float)luaL_checknumber(L, 2);
    int32_t min_keep = check_min_keep(L, 3);
    luma_err err;
    if (use_compact(lg)) return chain(L, f(lg->vals, lg->n_live, p, min_keep, &err), &err);
    return chain(L, f(host_row(L, lg), lg->n, p, min_keep, &err), &err);
}

/* top_p of a row in device memory, from its best entries: the normalizer
 * z from logits_live_sums, then the row's top 64 (the run's, found ahead,
 * where there) and where their mass falls short its top 2048, walked in
 * rank order, each weight exp(x - max) in double, as luma_logits_top_p
 * walks them (z added in another order: a row whose mass reaches p within
 * rounding of an entry may keep one entry more or less). Where the goal
 * is met among them, or they are every live entry, what it keeps becomes
 * the compact form; true then, else false (the caller goes the host's
 * way). */
static bool device_top_p(lua_State *L, llogits *lg, float p, int32_t min_keep)
{
    luma_backend *be = backend(lg);
    luma_err err;
    double z, s;
    if (!be->ops->logits_live_sums || be->ops->logits_live_sums(be, &lg->set->buf, lg->row, &z, &s, &err))
        return false;
    static const int32_t tries[] = { 64, LUMA_SPARSE_MAX };
    for (int t = 0; t < 2; t++) {
        const int32_t k = tries[t] < lg->n ? tries[t] : lg->n;
        int32_t *ids = malloc((size_t)k * (2 * sizeof(int32_t) + sizeof(float)));
        if (!ids) return false;
        float *vals = (float *)(ids + k);
        int32_t got = top_entries(L, lg, k, ids, vals, &err), keep = -1;
        double mass = 0.0;
        for (int32_t j = 0; j < got && keep < 0; j++) {
            mass += exp((double)vals[j] - (double)vals[0]);
            if (mass / z >= (double)p && j + 1 >= min_keep) keep = j + 1;
        }
        if (keep < 0 && got >= 0 && got < k) keep = got;   /* every live entry: the goal unmet keeps them all */
        if (keep > 0) {
            become_compact(lg, ids, vals, (int32_t *)(vals + k), keep);
            return true;
        }
        free(ids);
        if (got < 0 || k == lg->n) return false;
    }
    return false;
}

static int logits_top_p(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    if (!lg->compact && on_device(L, lg)) {
        float p = (float)luaL_checknumber(L, 2);
        int32_t min_keep = check_min_keep(L, 3);
        if (p > 0.0f && p < 1.0f && min_keep <= LUMA_SPARSE_MAX && device_top_p(L, lg, p, min_keep)) {
            lua_settop(L, 1);
            return 1;
        }
    }
    if (!use_compact(lg)) return filter(L, luma_logits_top_p);
    float p = (float)luaL_checknumber(L, 2);
    int32_t min_keep = check_min_keep(L, 3);
    luma_err err;
    return chain(L, luma_logits_top_p_ordered(lg->vals, lg->n_live, lg->order, p, min_keep, &err), &err);
}

static int logits_min_p(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    if (!use_compact(lg) && on_device(L, lg) && backend(lg)->ops->logits_min_p && check_min_keep(L, 3) == 1) {
        float p = (float)luaL_checknumber(L, 2);
        luma_err err;
        if (!(p > 0.0f && p <= 1.0f)) return luaL_error(L, "min_p: p must be in (0, 1] (got %g)", (double)p);
        luma_backend *be = edit_on_device(lg);
        return chain(L, be->ops->logits_min_p(be, &lg->set->buf, lg->row, log(p), &err), &err);
    }
    return filter(L, luma_logits_min_p);
}

static int logits_typical(lua_State *L)
{
    return filter(L, luma_logits_typical);
}

/* Applies an edit of listed entries on the device; lg stays there. */
static int device_edit(lua_State *L, llogits *lg, const luma_logits_edit *e)
{
    luma_backend *be = edit_on_device(lg);
    luma_err err;
    return chain(L, be->ops->logits_edit(be, &lg->set->buf, lg->row, e, &err), &err);
}

/* logits:penalize(history, {repeat_ =, frequency =, presence =, last_n =}) */
static int logits_penalize(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    float rep = (float)luma_bind_optnum(L, 3, "repeat_", 1.0);
    float freq = (float)luma_bind_optnum(L, 3, "frequency", 0.0);
    float pres = (float)luma_bind_optnum(L, 3, "presence", 0.0);
    lua_Integer last_n = luma_bind_optint(L, 3, "last_n", 64);
    int32_t n;
    int32_t *hist = luma_bind_checkids(L, 2, lg->n, &n);
    if (last_n > INT32_MAX || last_n < INT32_MIN) return luaL_error(L, "option 'last_n' out of range");
    /* ids, counts, and the counts as floats for the device */
    size_t room = (size_t)(n > 0 ? n : 1);
    int32_t *ids = lua_newuserdatauv(L, room * (2 * sizeof(int32_t) + sizeof(float)), 0);
    int32_t *counts = ids + room;
    luma_err err;
    int32_t k = luma_logits_penalty_counts(lg->n, hist, n, (int32_t)last_n, rep, freq, pres, ids, counts, &err);
    if (k <= 0) return chain(L, k, &err);
    if (on_device(L, lg)) {
        float *values = (float *)(counts + room);
        for (int32_t j = 0; j < k; j++) values[j] = (float)counts[j];
        luma_logits_edit e = { LUMA_EDIT_PENALIZE, k, ids, values, rep, freq, pres };
        const bool first = !lg->edited;
        int rc = device_edit(L, lg, &e);
        /* a first change that only lowers entries is kept, for top_k to
         * take from the k best found ahead (luma_logits_set_topk_lowered) */
        if (first && rep >= 1.0f && freq >= 0.0f && pres >= 0.0f &&
            (lg->lowered_mem = malloc(2 * (size_t)k * sizeof(int32_t))) != NULL) {
            memcpy(lg->lowered_mem, ids, (size_t)k * sizeof(int32_t));
            memcpy(lg->lowered_mem + k, counts, (size_t)k * sizeof(int32_t));
            lg->lowered = (luma_lowering){ lg->lowered_mem, lg->lowered_mem + k, k, rep, freq, pres };
        }
        return rc;
    }
    if (lg->compact) {
        k = to_compact(lg, ids, counts, NULL, k);
        luma_logits_penalize_counted(lg->vals, ids, counts, k, rep, freq, pres);
    } else {
        luma_logits_penalize_counted(host_row(L, lg), ids, counts, k, rep, freq, pres);
    }
    lua_settop(L, 1);
    return 1;
}

/* logits:bias({[id] = value, ...}) */
static int logits_bias(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    int32_t count = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        count++;
        lua_pop(L, 1);
    }
    size_t room = (size_t)(count > 0 ? count : 1);
    int32_t *ids = lua_newuserdatauv(L, room * (sizeof(int32_t) + sizeof(float)), 0);
    float *values = (float *)(ids + room);
    int32_t k = 0;
    lua_pushnil(L);
    while (lua_next(L, 2)) {
        int isint, isnum;
        lua_Integer id = lua_tointegerx(L, -2, &isint);
        lua_Number v = lua_tonumberx(L, -1, &isnum);
        if (!isint || !isnum) return luaL_argerror(L, 2, "expected {[token id] = number}");
        if (id < 0 || id >= lg->n)
            return luaL_argerror(L, 2, lua_pushfstring(L, "token id %I out of range [0, %d)", id, (int)lg->n));
        float f = (float)v;
        if (isnan(f) || f == INFINITY)
            return luaL_error(L, "bias: value %f for token id %I is NaN or +inf", (double)f, id);
        ids[k] = (int32_t)id;
        values[k++] = f;
        lua_pop(L, 1);
    }
    luma_err err;
    if (on_device(L, lg)) {
        luma_logits_edit e = { LUMA_EDIT_BIAS, k, ids, values, 1.0f, 0.0f, 0.0f };
        return device_edit(L, lg, &e);
    }
    if (lg->compact) {
        k = to_compact(lg, ids, NULL, values, k);
        if (k == 0) return chain(L, 0, &err);
        return chain(L, luma_logits_bias(lg->vals, lg->n_live, ids, values, k, &err), &err);
    }
    return chain(L, luma_logits_bias(host_row(L, lg), lg->n, ids, values, k, &err), &err);
}

/* Reads a set of ids: a Lua array {id, ...} or a set {[id] = true, ...}. */
static int32_t *check_idset(lua_State *L, int i, int32_t n_vocab, int32_t *count)
{
    luaL_checktype(L, i, LUA_TTABLE);
    if (luaL_len(L, i) > 0) return luma_bind_checkids(L, i, n_vocab, count);
    int32_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, i)) {
        n++;
        lua_pop(L, 1);
    }
    int32_t *ids = lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof(int32_t), 0);
    int32_t k = 0;
    lua_pushnil(L);
    while (lua_next(L, i)) {
        int isint;
        lua_Integer id = lua_tointegerx(L, -2, &isint);
        if (!isint || id < 0 || id >= n_vocab)
            luaL_argerror(L, i, lua_pushfstring(L, "expected token ids in [0, %d)", (int)n_vocab));
        if (lua_toboolean(L, -1) && k < n) ids[k++] = (int32_t)id;
        lua_pop(L, 1);
    }
    *count = k;
    return ids;
}

static int logits_mask(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    int32_t n;
    int32_t *ids = check_idset(L, 2, lg->n, &n);
    luma_err err;
    if (on_device(L, lg)) {
        luma_logits_edit e = { LUMA_EDIT_MASK, n, ids, NULL, 1.0f, 0.0f, 0.0f };
        return device_edit(L, lg, &e);
    }
    if (lg->compact) {
        n = to_compact(lg, ids, NULL, NULL, n);
        if (n == 0) return chain(L, 0, &err);
        return chain(L, luma_logits_mask(lg->vals, lg->n_live, ids, n, &err), &err);
    }
    return chain(L, luma_logits_mask(host_row(L, lg), lg->n, ids, n, &err), &err);
}

static int logits_allow(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    int32_t n;
    int32_t *ids = check_idset(L, 2, lg->n, &n);
    luma_err err;
    return chain(L, luma_logits_allow(host_row(L, lg), lg->n, ids, n, &err), &err);
}

/* softmax and log_softmax of a row on the device, in place. */
static int device_softmax(lua_State *L, llogits *lg, bool log)
{
    luma_backend *be = edit_on_device(lg);
    luma_err err;
    return chain(L, be->ops->logits_softmax(be, &lg->set->buf, lg->row, log, &err), &err);
}

static int logits_softmax(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    if (!lg->compact && on_device(L, lg) && backend(lg)->ops->logits_softmax) return device_softmax(L, lg, false);
    return chain(L, luma_logits_softmax(host_row(L, lg), lg->n, &err), &err);
}

static int logits_log_softmax(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    luma_err err;
    if (use_compact(lg)) return chain(L, luma_logits_log_softmax(lg->vals, lg->n_live, &err), &err);
    if (on_device(L, lg) && backend(lg)->ops->logits_softmax) return device_softmax(L, lg, true);
    return chain(L, luma_logits_log_softmax(host_row(L, lg), lg->n, &err), &err);
}

/* A copy on the host (compact when the source is); the source stays where
 * it is. */
static int logits_copy(lua_State *L)
{
    llogits *lg = luma_bind_checklogits(L, 1);
    const float *src = lg->compact || on_device(L, lg) ? NULL : host_row(L, lg);
    llogits *c = luma_bind_newlogits(L, lg->n);
    int32_t live = lg->n_live > 0 ? lg->n_live : 1;
    size_t bytes = lg->compact ? (size_t)live * (2 * sizeof(int32_t) + sizeof(float)) : (size_t)lg->n * sizeof(float);
    void *mem = malloc(bytes);
    if (!mem) return luaL_error(L, "logits: out of memory for a copy");
    if (lg->compact) {
        c->compact = true;
        c->n_live = lg->n_live;
        c->ids = mem;
        c->vals = (float *)(c->ids + live);
        memcpy(c->ids, lg->ids, (size_t)lg->n_live * sizeof(int32_t));
        memcpy(c->vals, lg->vals, (size_t)lg->n_live * sizeof(float));
        if (lg->order) {
            c->order = (int32_t *)(c->vals + live);
            memcpy(c->order, lg->order, (size_t)lg->n_live * sizeof(int32_t));
        }
        return 1;
    }
    luma_err err;
    if (src) {
        memcpy(mem, src, bytes);
    } else if (luma_logits_set_read(lg->set, lg->row, mem, &err)) {
        free(mem);
        return luma_bind_error(L, &err);
    }
    c->x = mem;
    c->x_owned = true;
    lua_gc(L, LUA_GCSTEP, (int)(lg->n / 256));
    return 1;
}

static const luaL_Reg meta[] = {
    { "__newindex", logits_newindex },
    { "__len", logits_len },
    { "__tostring", logits_tostring },
    { "__gc", logits_gc },
    { NULL, NULL },
};

static const luaL_Reg methods[] = {
    { "argmax", logits_argmax },
    { "topk", logits_topk },
    { "temperature", logits_temperature },
    { "top_k", logits_top_k },
    { "top_p", logits_top_p },
    { "min_p", logits_min_p },
    { "typical", logits_typical },
    { "penalize", logits_penalize },
    { "bias", logits_bias },
    { "mask", logits_mask },
    { "allow", logits_allow },
    { "softmax", logits_softmax },
    { "log_softmax", logits_log_softmax },
    { "entropy", logits_entropy },
    { "sample", logits_sample },
    { "draw", logits_draw },
    { "copy", logits_copy },
    { NULL, NULL },
};

void luma_bind_open_logits(lua_State *L)
{
    luma_bind_newclass(L, LUMA_LOGITS_MT, meta, methods, logits_index);
}
