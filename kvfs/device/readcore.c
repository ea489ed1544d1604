/* The read core: see readcore.h for the contract.
 *
 * Mirrors kvfs/device/__init__.py (read_blocks_sync: one preadv per run of
 * adjacent blocks) and kvfs/device/verified.py (matches), without Python, so
 * the native read plane can serve a READ from a FUSE worker thread and check
 * it with no GIL, no allocation and no shared state.
 */
#define _GNU_SOURCE                     /* preadv, IOV_MAX */
#include "readcore.h"

#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

/* The state's layout, so it can live on the stack: XXH3_createState would
   malloc (and free) per block, on the hot path of every READ. The layout is the
   one of the libxxhash headers we build against; Debian ships the library and
   the headers as one version (libxxhash0 / libxxhash-dev). */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>
/* Debian's libxxhash is built for baseline x86-64 (SSE2: 20 GB/s on this VM's
   cores); its *_dispatch entry points pick AVX2 or AVX-512 at run time (about
   3x faster). The header maps XXH3_128bits_update and friends onto them. */
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>
#endif

#ifndef IOV_MAX
#define IOV_MAX 1024                    /* Linux's UIO_MAXIOV */
#endif

int kvfs_key_base_init(struct kvfs_key_base *kb, uint64_t seed, const uint8_t *secret, size_t secret_len)
{
    if (secret_len > KVFS_SECRET_MAX || (secret_len && !secret))
        return -EINVAL;
    memset(kb, 0, sizeof *kb);
    kb->seed = seed;
    kb->secret_len = (uint32_t)secret_len;
    if (secret_len)
        memcpy(kb->secret, secret, secret_len);
    return 0;
}

int kvfs_block_matches_keyed(const struct kvfs_key_base *kb, const struct kvfs_block_check *b,
                             const uint8_t *data)
{
    XXH3_state_t state;
    XXH128_canonical_t digest;

    /* Streamed, not one-shot: the secret and the salt go in before the data,
       as BlockIndex.key_of feeds them; the result is the same as hashing the
       concatenation, without copying the block behind a prefix. */
    if (XXH3_128bits_reset_withSeed(&state, kb->seed) != XXH_OK)
        return 0;
    if (kb->secret_len)
        XXH3_128bits_update(&state, kb->secret, kb->secret_len);
    if (b->salted)
        XXH3_128bits_update(&state, b->salt, KVFS_SALT_BYTES);
    XXH3_128bits_update(&state, data, b->length);
    /* The canonical form is big endian: the bytes Python's .digest() returns. */
    XXH128_canonicalFromHash(&digest, XXH3_128bits_digest(&state));
    return memcmp(digest.digest, b->key, KVFS_KEY_BYTES) == 0;
}

int kvfs_block_matches(uint64_t seed, const struct kvfs_block_check *b, const uint8_t *data)
{
    struct kvfs_key_base kb = {.seed = seed};
    return kvfs_block_matches_keyed(&kb, b, data);
}

/* One run of `count` (<= IOV_MAX) device-adjacent blocks: one preadv, continued if short. */
static int read_run(int fd, const struct kvfs_block_check *blocks, uint8_t *const *bufs, size_t count)
{
    struct iovec iov[IOV_MAX];          /* 16 KiB of stack at most: no allocation per READ */
    const uint64_t off = blocks[0].dev_off;
    uint64_t total = 0, done = 0, pos = 0;
    size_t i, cur = 0;

    for (i = 0; i < count; i++) {
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = kvfs_span(blocks[i].length);
        total += iov[i].iov_len;
    }
    while (done < total) {
        ssize_t got = preadv(fd, iov + cur, (int)(count - cur), (off_t)(off + done));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            /* A short transfer that stopped mid-sector stopped at the end of the
               file. With O_DIRECT, ext4 then says 0, but a filesystem may check
               the alignment first and refuse the unaligned offset that continues
               it (EINVAL). Same meaning: there is no more. */
            if (errno == EINVAL && done % KVFS_SECTOR)
                break;
            return -errno;
        }
        if (got == 0)
            break;
        done += (uint64_t)got;
        /* Drop the iovecs filled; trim the one the transfer stopped in. */
        while (got > 0) {
            if ((size_t)got >= iov[cur].iov_len) {
                got -= (ssize_t)iov[cur].iov_len;
                cur++;
            } else {
                iov[cur].iov_base = (uint8_t *)iov[cur].iov_base + got;
                iov[cur].iov_len -= (size_t)got;
                got = 0;
            }
        }
    }
    /* Ended early (end of the file or device): every block needs its `length`
       bytes; only the zero padding after them may be missing (as in _read_span). */
    if (done < total)
        for (i = 0; i < count; pos += kvfs_span(blocks[i].length), i++)
            if (pos + blocks[i].length > done)
                return -EIO;
    return 0;
}

int kvfs_read_blocks(int fd, const struct kvfs_block_check *blocks, size_t n, uint8_t *const *bufs)
{
    size_t start, i;

    /* Checked up front so that a bad batch reads nothing rather than half. */
    for (i = 0; i < n; i++)
        if (blocks[i].dev_off % KVFS_SECTOR || blocks[i].dev_off > (uint64_t)INT64_MAX - kvfs_span(blocks[i].length))
            return -EINVAL;
    for (start = 0; start < n; start = i) {
        int rc;
        for (i = start + 1; i < n && i - start < IOV_MAX
                            && blocks[i].dev_off == blocks[i - 1].dev_off + kvfs_span(blocks[i - 1].length); i++)
            ;
        rc = read_run(fd, blocks + start, bufs + start, i - start);
        if (rc)
            return rc;
    }
    return 0;
}

int kvfs_read_verified_keyed(int fd, const struct kvfs_key_base *kb, const struct kvfs_block_check *blocks,
                             size_t n, uint8_t *const *bufs, uint8_t *ok)
{
    int rc, failed = 0;
    size_t i;

    if (n > INT_MAX)                    /* the count of failures must fit the return value */
        return -EINVAL;
    rc = kvfs_read_blocks(fd, blocks, n, bufs);
    if (rc)
        return rc;
    /* Each block on its own: one bad block fails alone, never its neighbours. */
    for (i = 0; i < n; i++) {
        ok[i] = (uint8_t)kvfs_block_matches_keyed(kb, &blocks[i], bufs[i]);
        failed += !ok[i];
    }
    return failed;
}

int kvfs_read_verified(int fd, uint64_t seed, const struct kvfs_block_check *blocks, size_t n,
                       uint8_t *const *bufs, uint8_t *ok)
{
    struct kvfs_key_base kb = {.seed = seed};
    return kvfs_read_verified_keyed(fd, &kb, blocks, n, bufs, ok);
}
