/* The Lua binding: one file per userdata type, each with its metatable name,
 * a check function, and the luaL_Reg table of its methods. */
#ifndef LUMA_BIND_H
#define LUMA_BIND_H

#include <lauxlib.h>
#include <lua.h>
#include <stdbool.h>

#include "err.h"
#include "model.h"
#include "rng.h"

#define LUMA_MODEL_MT "luma.Model"
#define LUMA_SEQ_MT "luma.Sequence"
#define LUMA_LOGITS_MT "luma.Logits"
#define LUMA_RNG_MT "luma.Rng"
#define LUMA_BATCH_MT "luma.Batch"

typedef struct lseq lseq;

/* A Model userdata. Sequences keep it alive (as their user value) and are
 * listed here so that closing the model closes them first. */
typedef struct lmodel {
    luma_model *m;
    lseq *seqs;
} lmodel;

struct lseq {
    luma_seq *s;
    lmodel *owner;
    lseq *prev, *next;
};

/* Logits of one position (n entries, a vocabulary), in one of three places:
 *   - a row of a logits set (set, row), where the step left it: device
 *     memory on a GPU (x NULL), or host memory on the CPU (x points into
 *     the set);
 *   - the whole row on the host, x malloc'd: a copy, or a set's row
 *     downloaded the first time a method without a device version needs it;
 *   - compact (after a top_k on the device): only the n_live entries
 *     ids[] (increasing) / vals[] are live, every other entry is masked;
 *     the functions of src/sample.h work on them as on the whole row.
 * A Logits holding a set is linked into the set's list of holders. */
typedef struct llogits {
    int32_t n;
    float *x;
    bool x_owned;              /* x was malloc'd (else it is the set's own row) */
    bool compact;
    bool edited;               /* the set's row was changed since the step */
    int32_t entry_ops;         /* logits[id] reads and stores on the device so far */
    int32_t *lowered_mem;      /* not NULL where the one change was this penalty, */
    luma_lowering lowered;     /* whose ids and counts it holds */
    luma_logits_set *set;      /* holds a reference, or NULL */
    int64_t row;
    int32_t n_live;
    int32_t *ids;              /* compact: [n_live] ids, increasing, then vals, */
    float *vals;
    int32_t *order;            /* then NULL or the entries' positions, largest first as the top-k
                                * found them (a hint for top_p, which checks it) */
    const char *lost;          /* why the row is gone, when a release could not save it */
    struct llogits *prev, *next;   /* the holders of set */
} llogits;

/* Raises the message of err as a Lua error. */
int luma_bind_error(lua_State *L, const luma_err *err);

lmodel *luma_bind_checkmodel(lua_State *L, int i);
luma_model *luma_bind_model(lua_State *L, int i);   /* open, or an error */
/* Raises an error when m's step is in flight (m->busy): what would reach its
 * backend, KV cache or logits sets calls this first. */
void luma_bind_idle(lua_State *L, const luma_model *m);
lseq *luma_bind_checkseq(lua_State *L, int i);
luma_seq *luma_bind_seq(lua_State *L, int i);       /* open, or an error */
llogits *luma_bind_checklogits(lua_State *L, int i);
luma_rng *luma_bind_checkrng(lua_State *L, int i);
/* The sampler in the options table at i (top_k, and top_p, min_p, temp
 * defaulting to 1, 0, 1; with penalties also repeat_, frequency, presence
 * and last_n, defaulting to 1, 0, 0 and 64, else an error where one is
 * given), or an error naming what. */
void luma_bind_checksampler(lua_State *L, int i, const char *what, bool penalties, luma_sampler *s);
/* The id s draws from the row lg stands for with the uniform u, as
 * lg:top_k(k):top_p(p):min_p(q):temperature(t):sample draws it (the same
 * functions on the same entries), lg left as it was; -1 with err set. */
int32_t luma_bind_logits_draw(lua_State *L, llogits *lg, const luma_sampler *s, double u, luma_err *err);
/* luma.draw(rows, opts, rngs [, how]): many rows' draws at once. */
int luma_bind_draw(lua_State *L);

/* A new Logits userdata of n entries, with no row yet (luma_bind_logits_hold
 * gives it one), left on the stack. */
llogits *luma_bind_newlogits(lua_State *L, int32_t n);
/* Gives lg row `row` of s (taking a reference). */
void luma_bind_logits_hold(llogits *lg, luma_logits_set *s, int64_t row);
/* Keeps a model's held logits sets within a budget before a run adds rows
 * more: runs a full garbage collection when they are many or large, and if
 * they still are, gives the holders of the oldest host copies of their rows
 * and releases those sets. */
void luma_bind_logits_budget(lua_State *L, luma_model *m, int64_t rows);
/* Gives every Logits of m's held sets a host copy of its row, releases the
 * sets and drains m's pool: called when m's last sequence closes, so that a
 * closed model leaves no device memory behind (and its Logits usable). */
void luma_bind_logits_release_model(luma_model *m);
/* Reads a Lua array of token ids at index i (ids checked against n_vocab
 * when n_vocab > 0) into a buffer that lives as a userdata on the stack top. */
int32_t *luma_bind_checkids(lua_State *L, int i, int32_t n_vocab, int32_t *count);
/* Argument i as one token id or a table of them (seq:eval, batch:add): at
 * least one id, each an integer in [0, n_vocab). One id is stored in *one
 * and nothing is pushed; a table's ids are luma_bind_checkids's copy, left
 * pushed. Returns the ids; *count is their number. */
const int32_t *luma_bind_checkidarg(lua_State *L, int i, int32_t n_vocab, int32_t *one, int32_t *count);
/* Frees a sequence's native state and unlinks it from its model. */
void luma_bind_seq_release(lseq *q);

/* Registers each type's metatable; called by luaopen_luma. */
void luma_bind_open_model(lua_State *L);
void luma_bind_open_seq(lua_State *L);
void luma_bind_open_logits(lua_State *L);
void luma_bind_open_rng(lua_State *L);
void luma_bind_open_batch(lua_State *L);
/* Lua files of lua/luma/ compiled into the binary: registers them in
 * package.preload (generated at build time). */
void luma_bind_preload_lua(lua_State *L);

/* Shared option readers: opts table at index i (may be nil). */
bool luma_bind_optbool(lua_State *L, int i, const char *key, bool def);
lua_Integer luma_bind_optint(lua_State *L, int i, const char *key, lua_Integer def);
lua_Number luma_bind_optnum(lua_State *L, int i, const char *key, lua_Number def);
const char *luma_bind_optstr(lua_State *L, int i, const char *key, const char *def);

/* Creates the metatable `name` with the meta functions; __index is the
 * methods table, or, when index is given, index as a closure whose upvalue
 * is the methods table (for types that also answer other keys). */
void luma_bind_newclass(lua_State *L, const char *name, const luaL_Reg *meta, const luaL_Reg *methods,
                        lua_CFunction index);
/* Functions of the module table: luma.load, luma.rng, luma.synth,
 * luma.synth_presets. */
int luma_bind_load(lua_State *L);
int luma_bind_rng(lua_State *L);
int luma_bind_synth(lua_State *L);
int luma_bind_synth_presets(lua_State *L);
/* model:sequence(): a new Sequence userdata on the stack. */
int luma_bind_newseq(lua_State *L);

#endif
