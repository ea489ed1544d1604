"""The layers call only downward: statically (imports) and at run time (every call).

    fuseops -> namespace -> blockcache -> blockindex -> store -> device

Ground-floor modules (aligned, crashpoints, devicecalls, errors, schema, sharedints) serve every layer. The
assemblers (stack, daemon, fsck, cli, torch) sit outside the stack: they may
import any layer, and no layer imports them.

The run-time check drives the real FUSE operations class in-process (no
kernel involved) over a real store file, with a profiler hook on every thread,
and asserts that whenever one data-path layer calls another, the callee is the
same layer or the one directly below it: a read, a write, an fsync, a
checkpoint and the flush workers each walk the stack downward, one layer at a time.
"""
import ast
import os
import stat
import sys
import threading
import types
from pathlib import Path

import pyfuse3
import trio

from kvfs.server.daemon import MountOptions
from kvfs.fuse.ops import KvfsOperations
from kvfs.namespace import ROOT_INO
from kvfs.server.stack import Filesystem
from kvfs.store.mkfs import make_filesystem

KVFS = Path(__file__).resolve().parent.parent / "kvfs"
LAYERS = ["device", "store", "blockindex", "blockcache", "namespace", "fuse"]   # lowest first
GROUND = {"base", "errors", "schema"}
ASSEMBLERS = {"server", "cli", "client", "torch"}


def top_package(module):
    """'kvfs.blockcache.reads' -> 'blockcache'; 'kvfs' itself -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def kvfs_imports():
    """{module: set of kvfs modules it imports}, resolved from every source file."""
    graph = {}
    for path in KVFS.rglob("*.py"):
        rel = path.relative_to(KVFS.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        module = ".".join(parts)
        package = parts if is_package else parts[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("kvfs"):
                    found.add(target)
                    found.update(f"{target}.{a.name}" for a in node.names
                                 if (KVFS.parent / f"{target}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                                 or (KVFS.parent / f"{target}.{a.name}".replace(".", "/")).is_dir())
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("kvfs"))
        graph[module] = found - {module}
    return graph


def test_imports_run_only_downward_and_have_no_cycle():
    graph = kvfs_imports()
    assert len(graph) > 20, "the walk found too few modules"
    upward = []
    for module, targets in graph.items():
        here = top_package(module)
        for target in targets:
            there = top_package(target)
            if there in ("", here) or there in GROUND:
                continue
            if here in GROUND:
                upward.append((module, target))          # the ground floor imports nothing above it
            elif there in ASSEMBLERS and here not in ASSEMBLERS:
                upward.append((module, target))
            elif here in LAYERS and there in LAYERS and LAYERS.index(there) != LAYERS.index(here) - 1:
                upward.append((module, target))          # upward, or skipping a layer
    assert not upward, f"imports that do not go one layer down: {sorted(upward)}"
    # No cycle among modules (a package importing its own submodules is fine;
    # a submodule importing its package's __init__ back would not be).
    state = {}

    def visit(module, trail):
        state[module] = "active"
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == "active":
                raise AssertionError(f"import cycle: {' -> '.join(trail + [target])}")
            if target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def layer_of(frame):
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("kvfs."):
        return None
    name = top_package(module)
    return LAYERS.index(name) if name in LAYERS else None


class CallWalk:
    """Records every call from one data-path layer into another, on every thread."""

    def __init__(self):
        self.bad = []
        self.edges = set()

    def __call__(self, frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = layer_of(frame), layer_of(frame.f_back)
        if callee is None or caller is None or callee == caller:
            return
        edge = (LAYERS[caller], LAYERS[callee])
        self.edges.add(edge)
        if callee != caller - 1:
            self.bad.append(f"{frame.f_back.f_globals['__name__']}.{frame.f_back.f_code.co_name} -> "
                            f"{frame.f_globals['__name__']}.{frame.f_code.co_name}")

    def __enter__(self):
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def ctx(uid=0, gid=0):
    return types.SimpleNamespace(uid=uid, gid=gid, pid=os.getpid(), umask=0o022)


async def test_every_call_between_layers_goes_one_layer_down(tmp_path):
    path = tmp_path / "store.kvfs"
    make_filesystem(str(path), 64 << 20, 64 << 10)
    options = MountOptions(cache_size=2 << 20, dirty_limit=1 << 20, read_depth=8, flush_workers=2)
    fs = Filesystem.open(str(path), options)
    ops = KvfsOperations(fs.ns, control=None)
    data = os.urandom(5 * (64 << 10) + 123)
    try:
        with CallWalk() as walk:
            async with trio.open_nursery() as nursery:
                await nursery.start(fs.cache.run)
                await nursery.start(fs.ns.run, 0.05)
                info, entry = await ops.create(ROOT_INO, b"f", stat.S_IFREG | 0o644,
                                               os.O_WRONLY | os.O_CREAT, ctx())
                assert await ops.write(info.fh, 0, data) == len(data)
                await ops.fsync(info.fh, False)
                await ops.release(info.fh)
                fs.ns.drop_caches()
                info = await ops.open(entry.st_ino, os.O_RDONLY, ctx())
                assert bytes(await ops.read(info.fh, 0, len(data) + 10)) == data
                await ops.release(info.fh)
                assert (await ops.statfs(ctx())).f_blocks > 0
                await ops.unlink(ROOT_INO, b"f", ctx())
                await fs.ns.flush_all()
                await fs.ns.checkpoint()
                nursery.cancel_scope.cancel()
    finally:
        fs.close()
    assert not walk.bad, "calls that skip a layer or run upward:\n" + "\n".join(sorted(set(walk.bad)))
    # And the walk really went all the way down, one layer at a time.
    assert {("fuse", "namespace"), ("namespace", "blockcache"), ("blockcache", "blockindex"),
            ("blockindex", "store"), ("store", "device")} <= walk.edges, walk.edges


def test_each_layer_object_holds_only_the_layer_below(tmp_path):
    path = tmp_path / "store.kvfs"
    make_filesystem(str(path), 64 << 20, 64 << 10)
    fs = Filesystem.open(str(path), MountOptions(cache_size=2 << 20, dirty_limit=1 << 20))
    try:
        ops = KvfsOperations(fs.ns, control=None)
        held = {}
        for obj in (ops, fs.ns, fs.ns.tree, fs.ns.view, fs.cache, fs.index, fs.store):
            here = LAYERS.index(top_package(type(obj).__module__))
            for name, value in vars(obj).items():
                module = type(value).__module__
                if module.startswith("kvfs.") and top_package(module) in LAYERS:
                    there = LAYERS.index(top_package(module))
                    held[(type(obj).__name__, name)] = (here, there)
        wrong = {k: v for k, v in held.items() if v[1] not in (v[0], v[0] - 1)}
        assert not wrong, f"layer objects holding other than the layer below: {wrong}"
        assert held[("Namespace", "cache")] == (4, 3) and held[("BlockIndex", "store")] == (2, 1)
    finally:
        fs.close()


def test_no_module_is_over_500_lines():
    sizes = {str(p.relative_to(KVFS.parent)): len(p.read_text().splitlines()) for p in KVFS.rglob("*.py")}
    assert max(sizes.values()) <= 500, {k: v for k, v in sizes.items() if v > 500}


assert pyfuse3.ROOT_INODE == ROOT_INO
