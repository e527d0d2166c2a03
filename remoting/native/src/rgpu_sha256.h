/* SHA-256 (FIPS 180-4), for naming module images in the GPU node's image cache. */
#ifndef RGPU_SHA256_H
#define RGPU_SHA256_H
#include <stddef.h>
#include <stdint.h>

void rgpu_sha256(const void *data, size_t size, uint8_t digest[32]);

#endif
