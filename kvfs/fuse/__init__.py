"""The FUSE layer: the top of the stack, and the only one that talks to the kernel.

``ops``        the pyfuse3 handlers; the one place a kvfs error becomes an errno
``loop``       pyfuse3's wait for the next request, without blocking the trio loop
``pagefill``   pushing a file's verified bytes into the kernel's page cache
``pagedrops``  dropping a file's pages from the kernel's page cache
"""
