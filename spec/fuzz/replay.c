/* Runs a libFuzzer target without libFuzzer, so that the ordinary and the
 * sanitizer builds check its invariants in ctest: every file named (or in a
 * directory named) is an input, and each input also gives -n variants made
 * by a deterministic mutator (bytes flipped, inserted, erased, repeated,
 * tokens of the dictionary below inserted, other inputs spliced in). The
 * target traps on a broken invariant; the sanitizers catch the rest.
 *
 *   replay_<target> [-n VARIANTS] [-s SEED] FILE_OR_DIR...
 *
 * Prints the inputs and variants run; exits 1 when it read no input. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* Defined by the targets that load something first (fuzz_tokenizer). */
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

typedef struct { uint8_t *p; size_t n; } input;

static input *inputs;
static size_t n_inputs, cap_inputs;

static void add_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return;
    input in = {NULL, 0};
    size_t cap = 0;
    for (;;) {
        if (in.n == cap) {
            cap = cap ? 2 * cap : 4096;
            in.p = realloc(in.p, cap);
            if (!in.p) abort();
        }
        size_t k = fread(in.p + in.n, 1, cap - in.n, f);
        if (k == 0) break;
        in.n += k;
    }
    fclose(f);
    if (n_inputs == cap_inputs) {
        cap_inputs = cap_inputs ? 2 * cap_inputs : 64;
        inputs = realloc(inputs, cap_inputs * sizeof *inputs);
        if (!inputs) abort();
    }
    inputs[n_inputs++] = in;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A directory's files in name order, so that runs are reproducible. */
static void add_path(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "replay: %s: no such file or directory\n", path);
        return;
    }
    if (!S_ISDIR(st.st_mode)) {
        add_file(path);
        return;
    }
    DIR *d = opendir(path);
    if (!d) return;
    char **names = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            names = realloc(names, cap * sizeof *names);
            if (!names) abort();
        }
        size_t len = strlen(path) + strlen(e->d_name) + 2;
        names[n] = malloc(len);
        if (!names[n]) abort();
        snprintf(names[n++], len, "%s/%s", path, e->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, by_name);
    for (size_t i = 0; i < n; i++) {
        add_file(names[i]);
        free(names[i]);
    }
    free(names);
}

static uint64_t rng;

static uint32_t next(uint32_t bound)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return bound ? (uint32_t)((rng >> 33) % bound) : 0;
}

/* Pieces that the tokenizers and the GGUF reader treat specially. */
static const char *const dict[] = {
    " ", "  ", "\n", "\r\n", "\t", "\xe2\x96\x81", "<", ">", "|", "<start_of_turn>", "<end_of_turn>",
    "<|endoftext|>", "<|im_start|>", "<s>", "</s>", "'s", "'LL", "123", "\xc2\xa0", "\xe4\xb8\xad",
    "\xf0\x9f\x98\x80", "\xff", "\xc3", "\xed\xa0\x80", "\x80", "\x00", "GGUF", "\xff\xff\xff\xff",
};

/* One variant of in (into out, at most cap bytes): 1 to 4 mutations. */
static size_t mutate(const input *in, uint8_t *out, size_t cap)
{
    size_t n = in->n < cap ? in->n : cap;
    memcpy(out, in->p, n);
    for (uint32_t k = 1 + next(4); k > 0; k--) {
        size_t at = next((uint32_t)n + 1), len;
        switch (next(6)) {
        case 0: /* flip a bit */
            if (n) out[at % n] ^= (uint8_t)(1u << next(8));
            break;
        case 1: /* set a byte */
            if (n) out[at % n] = (uint8_t)next(256);
            break;
        case 2: /* erase a run */
            len = next((uint32_t)(n - at) + 1);
            memmove(out + at, out + at + len, n - at - len);
            n -= len;
            break;
        case 3: { /* insert a dictionary piece */
            const char *p = dict[next(sizeof dict / sizeof dict[0])];
            len = strlen(p) ? strlen(p) : 1;
            if (n + len > cap) break;
            memmove(out + at + len, out + at, n - at);
            memcpy(out + at, p, len);
            n += len;
            break;
        }
        case 4: { /* repeat a run */
            size_t from = next((uint32_t)n + 1);
            len = next((uint32_t)(n - from) + 1);
            if (n + len > cap) break;
            memmove(out + at + len, out + at, n - at);
            memmove(out + at, out + (from < at ? from : from + len), len);
            n += len;
            break;
        }
        default: { /* splice in part of another input */
            const input *o = &inputs[next((uint32_t)n_inputs)];
            size_t from = next((uint32_t)o->n + 1);
            len = next((uint32_t)(o->n - from) + 1);
            if (n + len > cap) break;
            memmove(out + at + len, out + at, n - at);
            memcpy(out + at, o->p + from, len);
            n += len;
        }
        }
    }
    return n;
}

int main(int argc, char **argv)
{
    long variants = 0;
    rng = 0x9e3779b97f4a7c15ull;
    int i = 1;
    for (; i + 1 < argc && argv[i][0] == '-'; i += 2) {
        if (strcmp(argv[i], "-n") == 0) variants = strtol(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "-s") == 0) rng = strtoull(argv[i + 1], NULL, 0);
        else break;
    }
    if (i >= argc || argv[i][0] == '-') {
        fprintf(stderr, "usage: %s [-n VARIANTS] [-s SEED] FILE_OR_DIR...\n", argv[0]);
        return 2;
    }
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    for (; i < argc; i++) add_path(argv[i]);
    if (n_inputs == 0) {
        fprintf(stderr, "replay: no input read\n");
        return 1;
    }
    size_t cap = 0;
    for (size_t j = 0; j < n_inputs; j++) {
        LLVMFuzzerTestOneInput(inputs[j].p, inputs[j].n);
        if (inputs[j].n > cap) cap = inputs[j].n;
    }
    cap = 2 * cap + 64;
    uint8_t *buf = malloc(cap);
    if (!buf) abort();
    for (size_t j = 0; j < n_inputs; j++)
        for (long v = 0; v < variants; v++) {
            size_t n = mutate(&inputs[j], buf, cap);
            /* a copy of exactly n bytes, so that AddressSanitizer sees any read past the input */
            uint8_t *exact = malloc(n ? n : 1);
            if (!exact) abort();
            memcpy(exact, buf, n);
            LLVMFuzzerTestOneInput(exact, n);
            free(exact);
        }
    printf("%s: %zu inputs and %ld variants of each: every invariant held\n", argv[0], n_inputs, variants);
    free(buf);
    for (size_t j = 0; j < n_inputs; j++) free(inputs[j].p);
    free(inputs);
    return 0;
}
