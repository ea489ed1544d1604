"""Each layer boundary has a typed port, and the code keeps to it in both directions.

A port is a ``typing.Protocol`` in the lower layer's folder (``port.py``) naming
what the layer above may use. For each one this checks that the lower layer's
class has every member of the port, with the same parameters, and that the upper
layer's modules use no member of the lower object that the port does not name
(an AST walk over every ``<name>.member`` where the name is how the upper layer
holds the lower object). A port that drifts from the code fails here.
"""
import ast
import inspect
from pathlib import Path

import pytest

from kvfs.blockcache import BlockCache
from kvfs.blockcache.port import CachePort
from kvfs.blockindex import BlockIndex
from kvfs.blockindex.port import IndexPort
from kvfs.device import Device
from kvfs.device.port import DevicePort
from kvfs.namespace import Namespace
from kvfs.namespace.port import NamespacePort
from kvfs.schema.port import JournalPort
from kvfs.store import ExtentStore
from kvfs.store.port import StorePort

KVFS = Path(__file__).resolve().parent.parent / "kvfs"

# (port, the class that implements it, the upper layer's folder, the names it holds the lower object by)
BOUNDARIES = [
    (DevicePort, Device, "store", {"device"}),
    (StorePort, ExtentStore, "blockindex", {"store"}),
    (IndexPort, BlockIndex, "blockcache", {"index"}),
    (CachePort, BlockCache, "namespace", {"cache"}),
    (NamespacePort, Namespace, "fuse", {"ns", "namespace"}),
    (JournalPort, BlockIndex, "namespace", {"journal"}),       # a side port (kvfs/schema/port.py)
]


def port_members(port):
    names = {n for n in vars(port) if not n.startswith("_")}
    return names | set(getattr(port, "__annotations__", {}))


def members_used(sources, holders):
    """{member: [where]} for every ``holder.member`` / ``x.holder.member`` in ``sources``."""
    used = {}
    for where, text in sources:
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Attribute):
                continue
            held = node.value
            name = held.attr if isinstance(held, ast.Attribute) else held.id if isinstance(held, ast.Name) else None
            if name in holders:
                used.setdefault(node.attr, []).append(f"{where}:{node.lineno}")
    return used


def layer_sources(layer):
    return [(str(p.relative_to(KVFS.parent)), p.read_text()) for p in sorted((KVFS / layer).rglob("*.py"))]


def parameters(fn):
    fn = inspect.unwrap(fn.fget if isinstance(fn, property) else fn)
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()][1:]     # without self


@pytest.mark.parametrize("port, impl, upper, holders", BOUNDARIES, ids=lambda v: getattr(v, "__name__", None))
def test_the_lower_layer_implements_its_port(port, impl, upper, holders):
    missing, differ = [], []
    for name in sorted(port_members(port)):
        port_attr = inspect.getattr_static(port, name, None)
        impl_attr = inspect.getattr_static(impl, name, None)
        if impl_attr is None:
            if name in getattr(port, "__annotations__", {}):
                continue            # a plain attribute, set in __init__: checked by use below
            missing.append(name)
            continue
        if callable(port_attr) and not isinstance(port_attr, property):
            if parameters(port_attr) != parameters(impl_attr):
                differ.append(f"{name}: port {parameters(port_attr)} != {impl.__name__} {parameters(impl_attr)}")
    assert not missing, f"{impl.__name__} lacks members of {port.__name__}: {missing}"
    assert not differ, "\n".join(differ)


@pytest.mark.parametrize("port, impl, upper, holders", BOUNDARIES, ids=lambda v: getattr(v, "__name__", None))
def test_the_upper_layer_uses_only_the_port(port, impl, upper, holders):
    used = members_used(layer_sources(upper), holders)
    assert used, f"found no use of {holders} in kvfs/{upper}: the walk is broken"
    outside = {m: w for m, w in used.items() if m not in port_members(port)}
    assert not outside, f"kvfs/{upper} uses members of {impl.__name__} outside {port.__name__}: {outside}"


def test_the_checks_catch_a_member_outside_the_port():
    source = [("fake.py", "def f(self):\n    self.store.allocate(1)\n    self.store._allocator.steal()\n")]
    used = members_used(source, {"store"})
    assert set(used) == {"allocate", "_allocator"}
    assert {m for m in used if m not in port_members(StorePort)} == {"_allocator"}

    class Partial:
        def allocate(self, nbytes):       # lost its keyword arguments
            pass
    assert parameters(StorePort.allocate) != parameters(Partial.allocate)
