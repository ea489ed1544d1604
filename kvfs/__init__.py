"""kvfs: a userspace filesystem for LLM KV-cache blocks.

Layers, each one module, each importing only the ones below it:

    fuseops    pyfuse3 handlers; the one place errors become errno
    namespace  inodes, names, lookup counts, per-file block lists, journal records
    blockcache RAM write-back cache, clean LRU, whole-file prefetch
    blockindex content key -> extent, reference counts, dedup, verified reads
    extents    allocator, journal, checkpoints (on-disk format lives in format.py)
    device     aligned O_DIRECT pread/pwrite on a file or block device, in threads
"""

__version__ = "0.1.0"
