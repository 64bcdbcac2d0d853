/* SHA-256 (FIPS 180-4), for verifying downloaded model files. */
#ifndef LUMA_SHA256_H
#define LUMA_SHA256_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

typedef struct luma_sha256 {
    uint32_t h[8];
    uint64_t len;
    uint8_t buf[64];
    size_t n;
} luma_sha256;

void luma_sha256_init(luma_sha256 *c);
void luma_sha256_update(luma_sha256 *c, const void *data, size_t n);
void luma_sha256_final(luma_sha256 *c, uint8_t out[32]);
/* The lowercase hex digest of a file's contents into hex[65]. */
int luma_sha256_file(const char *path, char hex[65], luma_err *err);

#endif
