"""Clients: code an engine imports to use a kvfs mount. No layer imports it.

``bypass``  ``read_into(path, buffer)`` and ``read_many([(path, buffer), ...])``: whole files
            into caller buffers (bytearray, mmap, CPU torch tensor)
``torch``   load/save tensors in parallel ranges; public as :mod:`kvfs.torch`
"""
from kvfs.client.bypass import read_into, read_many

__all__ = ["read_into", "read_many"]
