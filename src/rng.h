/* A seeded random number generator whose draws are the same on every run and
 * platform: xoshiro256** (Blackman and Vigna), its 256-bit state filled from
 * a 64-bit seed by splitmix64. The state is a plain struct so that a caller
 * (the Lua binding) can hold it by value. */
#ifndef LUMA_RNG_H
#define LUMA_RNG_H

#include <stdint.h>

typedef struct luma_rng {
    uint64_t s[4];
} luma_rng;

void luma_rng_seed(luma_rng *r, uint64_t seed);
uint64_t luma_rng_next_u64(luma_rng *r);
/* A double in [0, 1) made from the top 53 bits of one luma_rng_next_u64. */
double luma_rng_uniform(luma_rng *r);

#endif
