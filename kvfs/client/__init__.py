"""Clients: code an engine imports to use a kvfs mount. No layer imports it.

``torch``   load/save tensors in parallel ranges; public as :mod:`kvfs.torch`
"""
