#include "rng.h"

static uint64_t rotl(uint64_t v, int k)
{
    return (v << k) | (v >> (64 - k));
}

/* splitmix64 spreads any seed, 0 included, into four words that are never
 * all zero, the one state xoshiro cannot leave. */
static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

void luma_rng_seed(luma_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

uint64_t luma_rng_next_u64(luma_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double luma_rng_uniform(luma_rng *r)
{
    return (double)(luma_rng_next_u64(r) >> 11) * 0x1.0p-53;
}
