/* SHA-256 (FIPS 180-4): the digest of a saved cache's bytes and of a model's weight files. */
#ifndef KVC_SHA256_H
#define KVC_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvc_sha256 {
    uint32_t h[8];
    uint64_t bytes;     /* message length so far */
    uint8_t block[64];  /* a partial block */
    size_t fill;
} kvc_sha256;

void kvc_sha256_init(kvc_sha256 *c);
void kvc_sha256_update(kvc_sha256 *c, const void *data, size_t n);
/* The digest as 64 lowercase hex digits and a NUL. */
void kvc_sha256_hex(kvc_sha256 *c, char out[65]);

#endif
