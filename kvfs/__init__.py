"""kvfs: a userspace filesystem for LLM KV-cache blocks.

The package tree is the layer map. Each layer is one folder and imports only
the layer directly below it (tests/test_layering.py checks this, statically and
at run time):

    fuse        pyfuse3 handlers; the one place errors become errno
    namespace   inodes, names, lookup counts, per-file block lists, journal records
    blockcache  RAM write-back cache, clean LRU, whole-file prefetch
    blockindex  content key -> extent, reference counts, dedup, verified reads
    store       allocator, journal, checkpoints, the store's header and slots
    device      aligned O_DIRECT reads and writes on a file or block device, in threads

Beside them: ``base`` and ``schema`` (the on-disk format) are the ground floor,
which every layer may use; ``errors`` holds the error types, each with its errno;
``server`` (stack, daemon, fsck, metrics), ``cli`` and ``client`` are
applications that assemble or use the layers, and no layer imports them.
docs/architecture.md walks a read and a write through the layers.
"""

__version__ = "0.1.0"
