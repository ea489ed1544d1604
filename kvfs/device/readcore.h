/* The read core: batched device reads of kvfs blocks and their verification.
 *
 * Shared by the native read plane (kvfs/fuse/readplane.c) and the Python
 * module kvfs.device._readcore (the bypass client, the tests). Pure C: no
 * Python objects, no global state, no locks; every function is safe to call
 * from any number of threads at once (preadv on one descriptor is).
 *
 * A block is named by its content key: the xxh3-128 digest (canonical, big
 * endian: what Python's xxhash.xxh3_128(seed=hash_seed).digest() gives) of
 *     key_secret + salt + data
 * key_secret: the store's 32 secret bytes (superblock, format version 2), none
 * in a version 1 store; salt: the block's dedup domain as 8 little-endian bytes,
 * none for domain 0 (kvfs/blockindex/__init__.py, BlockIndex.key_of).
 * The functions that take a bare seed are the ones for a store without a
 * secret; a version 2 store needs the *_keyed forms with a kvfs_key_base.
 *
 * On the device a block starts at a multiple of KVFS_SECTOR and occupies
 * kvfs_span(length) bytes (kvfs/device/__init__.py, read_block_sync).
 */
#ifndef KVFS_READCORE_H
#define KVFS_READCORE_H

#include <stddef.h>
#include <stdint.h>

#define KVFS_SECTOR 4096
#define KVFS_KEY_BYTES 16
#define KVFS_SALT_BYTES 8
#define KVFS_SECRET_MAX 32          /* schema.KEY_SECRET_LEN */

struct kvfs_block_check {
    uint64_t dev_off;                 /* where the block starts on the device (multiple of 4096) */
    uint32_t length;                  /* stored bytes; it occupies kvfs_span(length) bytes on the device */
    uint8_t salted;                   /* 1: the 8 salt bytes go into the hash before the data */
    uint8_t key[KVFS_KEY_BYTES];      /* xxh3-128 canonical digest */
    uint8_t salt[KVFS_SALT_BYTES];
};

/* What every key of one store starts from: the seed and the secret prefix. */
struct kvfs_key_base {
    uint64_t seed;                    /* superblock hash_seed */
    uint32_t secret_len;              /* 0 (version 1 store) .. KVFS_SECRET_MAX */
    uint8_t secret[KVFS_SECRET_MAX];  /* superblock key_secret */
};

/* Bytes a block of `length` occupies on the device: whole sectors, at least one. */
static inline uint64_t kvfs_span(uint32_t length)
{
    uint64_t n = length ? length : 1;
    return (n + KVFS_SECTOR - 1) / KVFS_SECTOR * KVFS_SECTOR;
}

/* Fill *kb for `seed` and `secret` (secret_len <= KVFS_SECRET_MAX). 0, or -EINVAL. */
int kvfs_key_base_init(struct kvfs_key_base *kb, uint64_t seed, const uint8_t *secret, size_t secret_len);

/* 1 if data[0..b->length) hashes to b->key under seed (+salt), else 0. */
int kvfs_block_matches(uint64_t seed, const struct kvfs_block_check *b, const uint8_t *data);
int kvfs_block_matches_keyed(const struct kvfs_key_base *kb, const struct kvfs_block_check *b,
                             const uint8_t *data);

/* Read blocks[0..n) from fd, block i into bufs[i] (4096-aligned, at least kvfs_span(length) bytes),
   each maximal run of device-adjacent blocks (next dev_off == this dev_off + kvfs_span(length))
   with ONE preadv (iovecs of kvfs_span bytes; split into several preadv only if a run exceeds IOV_MAX);
   EINTR retried; a short transfer continued where it stopped; 0 bytes before `length` of a block = -EIO.
   A dev_off that is not a multiple of KVFS_SECTOR (or runs past the largest off_t) is -EINVAL,
   before anything is read. Returns 0, or -errno of the first failed read. */
int kvfs_read_blocks(int fd, const struct kvfs_block_check *blocks, size_t n, uint8_t *const *bufs);

/* kvfs_read_blocks, then verify each: ok[i] = 1 if it matches, 0 if not.
   Returns the number of blocks that failed verification (0 = all good), or -errno on a read error. */
int kvfs_read_verified(int fd, uint64_t seed, const struct kvfs_block_check *blocks, size_t n,
                       uint8_t *const *bufs, uint8_t *ok);
int kvfs_read_verified_keyed(int fd, const struct kvfs_key_base *kb, const struct kvfs_block_check *blocks,
                             size_t n, uint8_t *const *bufs, uint8_t *ok);

#endif
