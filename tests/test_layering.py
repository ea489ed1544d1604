"""The package tree is the layer map, and the layers call only downward.

    fuse -> namespace -> blockcache -> blockindex -> store -> device

Where a module sits says what it is: the first folder under kvfs/ is its
layer (one of the six above), the ground floor (``base``, ``schema``) or an
application (``server``, ``cli``, ``client``). In the kvfs/ root itself only
``__init__`` (the version), ``errors`` (ground floor) and ``torch`` (the public
name of kvfs/client/torch.py, an application) may sit; a module anywhere else,
or in a folder that is none of these, fails the test. There is no exception
list: to move a module between layers, move its file.

The rules, checked statically over every import:

- a layer imports itself, the layer directly below it and the ground floor;
- the ground floor (and kvfs/__init__, which every import runs) imports only
  the ground floor;
- applications import anything, and nothing else imports an application;
- no import cycle among modules.

And at run time: the real FUSE operations class, driven in-process (no kernel)
over a real store file, opens, creates, writes, fsyncs, reads, unlinks and
checkpoints, with a profiler hook on every thread. Whenever code of one layer
calls code of another, the callee is the layer directly below; a ground-floor
function in between does not hide the call (the caller is the nearest frame
that is not ground floor). Worker threads are traced too: trio gets a fresh
thread cache for the walk, so no worker started before the hook slips through,
and the walk must have seen device calls on worker threads. A layer that hands
a function to ``trio.to_thread.run_sync`` is checked as if it called it, and
what that function calls in its thread is checked like any call: so a device
worker that calls back up into the block index (the round trip issue 33
removed) fails. Each layer object holds only objects of its own layer or the
one below, and no module is over 500 lines.

One way down skips layers, and it is typed, not listed: a side port, a Protocol
on the ground floor that the assembler wires from a layer to an object further
down (``SIDE_PORTS``; kvfs/schema/port.py, through which the namespace journals
to the block index). A layer object may hold such an object only by an
attribute annotated with the port, and a call may skip layers only when it is a
call of one of the port's members, on the class that implements it, downward.

The tests at the end test these checks: over a copy of the package tree with
one module added or one import changed, and over modules made up on the spot
whose ``__name__`` puts them in a layer, they must report what is wrong.
"""
import ast
import functools
import os
import shutil
import stat
import sys
import inspect
import threading
import time
import types
from pathlib import Path

import pyfuse3
import pytest
import trio
from trio._core import _thread_cache   # trio's worker-thread cache: see CallWalk.__enter__

from kvfs.blockindex import BlockIndex
from kvfs.fuse.ops import KvfsOperations
from kvfs.namespace import ROOT_INO
from kvfs.schema.port import JournalPort
from kvfs.server.daemon import MountOptions
from kvfs.server.stack import Filesystem
from kvfs.store.mkfs import make_filesystem

KVFS = Path(__file__).resolve().parent.parent / "kvfs"
LAYERS = ["device", "store", "blockindex", "blockcache", "namespace", "fuse"]   # lowest first
GROUND, APPLICATION = "ground floor", "application"
FOLDERS = {**{layer: layer for layer in LAYERS},
           "base": GROUND, "schema": GROUND,
           "server": APPLICATION, "cli": APPLICATION, "client": APPLICATION, "tier": APPLICATION}
ROOT_MODULES = {"__init__": GROUND, "errors": GROUND, "torch": APPLICATION}


# -- Where a module sits ---------------------------------------------------------------------------

def place_of_file(path, root=KVFS):
    """A layer's name, GROUND or APPLICATION for a source file under ``root``; None: misplaced."""
    parts = path.relative_to(root).parts
    if len(parts) == 1:
        return ROOT_MODULES.get(path.stem)
    return FOLDERS.get(parts[0])


@functools.lru_cache(maxsize=None)
def place(module):
    """The same for a dotted module name ('kvfs.blockcache.reads' -> 'blockcache'); None for a
    module outside kvfs or not in the layer map."""
    parts = module.split(".")
    if parts[0] != "kvfs":
        return None
    if len(parts) == 1:
        return GROUND                   # kvfs/__init__: every import of a kvfs module runs it
    if len(parts) == 2 and parts[1] in ROOT_MODULES:
        return ROOT_MODULES[parts[1]]
    return FOLDERS.get(parts[1])


def misplaced_modules(root=KVFS):
    """Source files that sit where no layer, ground-floor or application folder is, and
    folders of the map that are missing from the tree."""
    wrong = [f"{path.relative_to(root.parent)}: " +
             ("a module in the kvfs/ root" if path.parent == root else
              f"{path.relative_to(root).parts[0]}/ is not a layer, ground-floor or application folder")
             for path in sorted(root.rglob("*.py")) if place_of_file(path, root) is None]
    wrong += [f"{root.name}/{folder}/: in the layer map but not a package in the tree"
              for folder in FOLDERS if not (root / folder / "__init__.py").is_file()]
    return wrong


def test_every_module_sits_in_a_layer_the_ground_floor_or_an_application():
    assert len(list(KVFS.rglob("*.py"))) > 20, "the walk found too few modules"
    assert not misplaced_modules(), "\n".join(misplaced_modules())


# -- Imports ---------------------------------------------------------------------------------------

def kvfs_imports(root=KVFS):
    """{module: set of kvfs modules it imports}, resolved from every source file under ``root``."""
    def exists(dotted):
        path = root.parent / dotted.replace(".", "/")
        return path.with_suffix(".py").exists() or path.is_dir()

    graph = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
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
                if target.split(".")[0] == root.name:
                    found.add(target)
                    found.update(f"{target}.{a.name}" for a in node.names if exists(f"{target}.{a.name}"))
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == root.name)
        graph[module] = found - {module}
    return graph


def may_import(here, there):
    """Whether a module placed ``here`` may import one placed ``there``."""
    if there == GROUND or here == APPLICATION:
        return True
    if here == GROUND or there == APPLICATION:
        return False
    return LAYERS.index(there) in (LAYERS.index(here), LAYERS.index(here) - 1)


def bad_imports(graph):
    """(module, target) pairs that go upward, skip a layer, leave the ground floor or reach an
    application. Modules outside the map are misplaced_modules' to report."""
    return sorted((module, target) for module, targets in graph.items() for target in targets
                  if place(module) is not None and place(target) is not None
                  and not may_import(place(module), place(target)))


def import_cycle(graph):
    """One import cycle as a list of modules, or None. A package importing its own submodules is
    fine; a submodule importing its package's __init__ back would not be."""
    state = {}

    def visit(module, trail):
        state[module] = "active"
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == "active":
                return trail + [target]
            if target not in state:
                cycle = visit(target, trail + [target])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_imports_run_only_downward_and_have_no_cycle():
    graph = kvfs_imports()
    assert len(graph) > 20, "the walk found too few modules"
    assert sum(len(targets) for targets in graph.values()) > 50, "the walk found too few imports"
    upward = bad_imports(graph)
    assert not upward, f"imports that do not go one layer down: {upward}"
    cycle = import_cycle(graph)
    assert not cycle, f"import cycle: {' -> '.join(cycle)}"


# -- Calls, on every thread ------------------------------------------------------------------------

TO_THREAD = trio.to_thread.run_sync.__code__


def layer_index(module):
    name = place(module) if module else None
    return LAYERS.index(name) if name in LAYERS else None


def caller_frame(frame):
    """The frame that called ``frame``, looking through ground-floor frames: a layer's call that
    goes through a ground-floor helper is still that layer's call."""
    caller = frame.f_back
    while caller is not None and place(caller.f_globals.get("__name__", "")) == GROUND:
        caller = caller.f_back
    return caller


def describe(frame):
    return f"{frame.f_globals.get('__name__')}.{frame.f_code.co_name}"


SIDE_PORTS = {JournalPort: BlockIndex}        # ground-floor port -> the class that implements it


def port_of(cls, name):
    """The side port that ``cls`` (or a class it inherits from) annotates attribute ``name`` with, or None."""
    for klass in cls.__mro__:
        hint = vars(klass).get("__annotations__", {}).get(name)
        if hint in SIDE_PORTS:
            return hint
    return None


def port_entries(ports=SIDE_PORTS):
    """The code of every side port member as its implementing class defines it: what a call that
    skips layers may run."""
    codes = set()
    for port, impl in ports.items():
        assert place(port.__module__) == GROUND, f"{port.__name__} is not on the ground floor"
        for name in (n for n in vars(port) if not n.startswith("_")):
            member = inspect.getattr_static(impl, name)
            codes.add(inspect.unwrap(member.fget if isinstance(member, property) else member).__code__)
    return codes


class CallWalk:
    """Records every call from one data-path layer into another, on every thread.

    ``edges``: (caller layer, callee layer) of every call between two layers; ``handoffs``: the
    same for functions a layer passes to trio.to_thread.run_sync; ``bad``: those that do not go
    one layer down; ``threads``: {thread name: layers whose code ran there}, worker threads only;
    ``ported``: (caller layer, callee layer) of calls that went further down through a side port
    (``ports``: the code objects of the side ports' members, see port_entries).
    """

    def __init__(self, ports=None):
        self.ports = port_entries() if ports is None else ports
        self.ported = set()
        self.bad = []
        self.edges = set()
        self.handoffs = set()
        self.threads = {}
        self._main = threading.get_ident()
        self._active = False

    def __call__(self, frame, event, arg):
        if event != "call" or not self._active:
            return
        callee = layer_index(frame.f_globals.get("__name__"))
        if callee is not None and threading.get_ident() != self._main:
            self.threads.setdefault(threading.current_thread().name, set()).add(LAYERS[callee])
        if frame.f_code is TO_THREAD:
            self._handoff(frame)
            return
        if callee is None:
            return
        caller = caller_frame(frame)
        here = layer_index(caller.f_globals.get("__name__")) if caller is not None else None
        if here is None or here == callee:
            return
        if callee < here - 1 and frame.f_code in self.ports:
            self.ported.add((LAYERS[here], LAYERS[callee]))
            return
        self.edges.add((LAYERS[here], LAYERS[callee]))
        if callee != here - 1:
            self.bad.append(f"{describe(caller)} -> {describe(frame)}")

    def _handoff(self, frame):
        """``frame`` runs trio.to_thread.run_sync: its function will run on a worker thread on
        behalf of the layer that called it, so that counts as a call from that layer."""
        fn = frame.f_locals.get("sync_fn")
        while isinstance(fn, functools.partial):
            fn = fn.func
        callee = layer_index(getattr(fn, "__module__", None))
        caller = caller_frame(frame)
        here = layer_index(caller.f_globals.get("__name__")) if caller is not None else None
        if callee is None or here is None:
            return
        self.handoffs.add((LAYERS[here], LAYERS[callee]))
        message = f"{describe(caller)} hands {fn.__module__}.{fn.__qualname__} to a worker thread"
        if callee not in (here, here - 1) and message not in self.bad:     # once: a resumed
            self.bad.append(message)                                        # coroutine calls again

    def __enter__(self):
        threading.setprofile(self)      # threads started from now on
        sys.setprofile(self)            # this one
        # trio reuses idle worker threads, and one started before the hook went in runs
        # untraced (threading.setprofile_all_threads is Python 3.12): give trio an empty thread
        # cache for the walk, so every worker thread it uses is started, traced, from now on.
        self._cache, _thread_cache.THREAD_CACHE = _thread_cache.THREAD_CACHE, _thread_cache.ThreadCache()
        self._active = True
        return self

    def __exit__(self, *exc):
        self._active = False            # worker threads of the walk's cache keep the hook until they exit
        _thread_cache.THREAD_CACHE = self._cache
        sys.setprofile(None)
        threading.setprofile(None)


def ctx(uid=0, gid=0):
    return types.SimpleNamespace(uid=uid, gid=gid, pid=os.getpid(), umask=0o022)


async def test_every_call_between_layers_goes_one_layer_down(tmp_path):
    path = tmp_path / "store.kvfs"
    make_filesystem(str(path), 64 << 20, 64 << 10)
    options = MountOptions(cache_size=2 << 20, dirty_limit=1 << 20, read_depth=8, flush_workers=2)
    data = os.urandom(5 * (64 << 10) + 123)
    with CallWalk() as walk:
        fs = Filesystem.open(str(path), options)
        try:
            ops = KvfsOperations(fs.ns, control=None)
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
    # The namespace journals through its side port, the block index (kvfs/schema/port.py).
    assert walk.ported == {("namespace", "blockindex")}, walk.ported
    # ... on the worker threads too: the device's reads and writes run there.
    assert any("device" in layers for layers in walk.threads.values()), \
        f"the walk saw no device code on a worker thread; worker threads seen: {walk.threads}"


def test_each_layer_object_holds_only_the_layer_below(tmp_path):
    path = tmp_path / "store.kvfs"
    make_filesystem(str(path), 64 << 20, 64 << 10)
    fs = Filesystem.open(str(path), MountOptions(cache_size=2 << 20, dirty_limit=1 << 20))
    try:
        ops = KvfsOperations(fs.ns, control=None)
        held, ported = {}, {}
        for obj in (ops, fs.ns, fs.ns.tree, fs.ns.view, fs.cache, fs.index, fs.store):
            here = layer_index(type(obj).__module__)
            assert here is not None, f"{type(obj).__module__}.{type(obj).__name__} is in no layer"
            for name, value in vars(obj).items():
                there = layer_index(type(value).__module__)
                port = port_of(type(obj), name)
                if there is not None and port is not None and there < here:
                    assert isinstance(value, SIDE_PORTS[port]), (type(obj).__name__, name, type(value))
                    ported[(type(obj).__name__, name)] = (here, there)
                elif there is not None:
                    held[(type(obj).__name__, name)] = (here, there)
        wrong = {k: v for k, v in held.items() if v[1] not in (v[0], v[0] - 1)}
        assert not wrong, f"layer objects holding other than the layer below: {wrong}"
        assert held[("Namespace", "cache")] == (4, 3) and held[("BlockIndex", "store")] == (2, 1)
        assert ported == {("Namespace", "journal"): (4, 2), ("Tree", "journal"): (4, 2),
                          ("ByHashView", "journal"): (4, 2)}, ported
    finally:
        fs.close()


def test_no_module_is_over_500_lines():
    sizes = {str(p.relative_to(KVFS.parent)): len(p.read_text().splitlines()) for p in KVFS.rglob("*.py")}
    assert max(sizes.values()) <= 500, {k: v for k, v in sizes.items() if v > 500}


# -- Tests of the tests ----------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    """A copy of the kvfs package tree to break. The tests below look only at what their change
    adds to what the checks report, so a fault of the real tree fails the tests above, not these."""
    root = tmp_path / "kvfs"
    shutil.copytree(KVFS, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("added, why", [
    ("helpers.py", "kvfs/helpers.py: a module in the kvfs/ root"),
    ("util/__init__.py", "kvfs/util/__init__.py: util/ is not a layer"),
    ("util/strings.py", "kvfs/util/strings.py: util/ is not a layer"),
])
def test_a_module_outside_the_layer_map_fails(tree, added, why):
    before = misplaced_modules(tree)
    (tree / added).parent.mkdir(exist_ok=True)
    (tree / added).write_text('"""Where does this go?"""\n')
    new = [line for line in misplaced_modules(tree) if line not in before]
    assert len(new) == 1 and new[0].startswith(why), new


def test_a_layer_missing_from_the_tree_fails(tree):
    before = misplaced_modules(tree)
    shutil.rmtree(tree / "blockcache")
    assert [line for line in misplaced_modules(tree) if line not in before] == \
        ["kvfs/blockcache/: in the layer map but not a package in the tree"]


@pytest.mark.parametrize("module, line, expected", [
    ("device/verified.py", "from ..blockindex import runs", ("kvfs.device.verified", "kvfs.blockindex.runs")),
    ("device/verified.py", "import kvfs.store", ("kvfs.device.verified", "kvfs.store")),
    ("namespace/tree.py", "from kvfs.blockindex import BlockIndex", ("kvfs.namespace.tree", "kvfs.blockindex")),
    ("store/loader.py", "from ..server import stack", ("kvfs.store.loader", "kvfs.server.stack")),
    ("base/aligned.py", "from ..device import calls", ("kvfs.base.aligned", "kvfs.device.calls")),
    ("errors.py", "from .store import port", ("kvfs.errors", "kvfs.store.port")),
    ("__init__.py", "from . import fuse", ("kvfs", "kvfs.fuse")),
])
def test_an_import_that_does_not_go_one_layer_down_fails(tree, module, line, expected):
    assert expected not in bad_imports(kvfs_imports(tree))
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}\n")
    assert expected in bad_imports(kvfs_imports(tree))


def test_an_import_cycle_fails(tree):
    (tree / "base" / "one.py").write_text("from . import two\n")
    (tree / "base" / "two.py").write_text("from .one import x\n")
    assert not [pair for pair in bad_imports(kvfs_imports(tree)) if "one" in pair[0] or "two" in pair[0]]
    assert import_cycle(kvfs_imports(tree)) in (["kvfs.base.one", "kvfs.base.two", "kvfs.base.one"],
                                                ["kvfs.base.two", "kvfs.base.one", "kvfs.base.two"])


def fake_module(name, source):
    """A module whose code runs with ``__name__`` = ``name``: the walk places it by that name."""
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


DEVICE = fake_module("kvfs.device.fake", """
import trio
async def read(fn):                     # the device reads in a worker thread, then calls fn there
    return await trio.to_thread.run_sync(_work, fn)
def _work(fn):
    return fn()
def check():
    return "device"
""")
STORE = fake_module("kvfs.store.fake", """
import trio
async def hand(fn):                     # the store runs fn in a worker thread
    return await trio.to_thread.run_sync(fn)
def call(fn):
    return fn()
""")
BASE = fake_module("kvfs.base.fake", "def through(fn):\n    return fn()\n")
INDEX = fake_module("kvfs.blockindex.fake", "def verify():\n    return 'blockindex'\n"
                                             "def other():\n    return 'other'\n")
NAMESPACE = fake_module("kvfs.namespace.fake", "def touch():\n    return 'namespace'\n"
                                               "def call(fn):\n    return fn()\n")


async def fill_thread_cache():
    """Leave trio idle worker threads started before any hook went in (as earlier tests do)."""
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(trio.to_thread.run_sync, time.sleep, 0.02)


async def test_an_upward_call_from_a_worker_thread_fails():
    await fill_thread_cache()
    with CallWalk() as walk:
        assert await DEVICE.read(INDEX.verify) == "blockindex"
    assert walk.bad == ["kvfs.device.fake._work -> kvfs.blockindex.fake.verify"]
    assert walk.edges == {("device", "blockindex")}
    [(name, layers)] = walk.threads.items()
    assert name.startswith("_work from ") and layers == {"device", "blockindex"}


async def test_a_call_down_from_a_worker_thread_passes():
    await fill_thread_cache()
    with CallWalk() as walk:
        assert await DEVICE.read(DEVICE.check) == "device"
        assert await STORE.hand(DEVICE.check) == "device"
    assert not walk.bad and not walk.edges and walk.handoffs == {("store", "device"), ("device", "device")}
    assert set().union(*walk.threads.values()) == {"device"}


async def test_handing_an_upper_layer_function_to_a_worker_thread_fails():
    with CallWalk() as walk:
        assert await STORE.hand(INDEX.verify) == "blockindex"
        assert await STORE.hand(functools.partial(NAMESPACE.touch)) == "namespace"
    assert sorted(walk.bad) == ["kvfs.store.fake.hand hands kvfs.blockindex.fake.verify to a worker thread",
                                "kvfs.store.fake.hand hands kvfs.namespace.fake.touch to a worker thread"]
    assert walk.handoffs == {("store", "blockindex"), ("store", "namespace")}


def test_a_call_that_skips_a_layer_or_goes_through_the_ground_floor_fails():
    with CallWalk() as walk:
        STORE.call(NAMESPACE.touch)
        DEVICE._work(functools.partial(BASE.through, INDEX.verify))
    assert walk.bad == ["kvfs.store.fake.call -> kvfs.namespace.fake.touch",
                        "kvfs.device.fake._work -> kvfs.blockindex.fake.verify"]
    assert not walk.threads


def test_only_a_side_port_member_may_skip_layers_and_only_downward():
    with CallWalk(ports={INDEX.verify.__code__}) as walk:
        assert NAMESPACE.call(INDEX.verify) == "blockindex"         # a member of the port: passes
        assert NAMESPACE.call(INDEX.other) == "other"               # not a member: skips a layer
        DEVICE._work(INDEX.verify)                                  # a member, but upward
    assert walk.ported == {("namespace", "blockindex")}
    assert walk.bad == ["kvfs.namespace.fake.call -> kvfs.blockindex.fake.other",
                        "kvfs.device.fake._work -> kvfs.blockindex.fake.verify"]


def test_only_an_attribute_annotated_with_a_side_port_holds_it():
    class Holder:
        journal: JournalPort
        cache: object

    class Inherits(Holder):
        pass
    assert port_of(Inherits, "journal") is JournalPort
    assert port_of(Holder, "cache") is None and port_of(Holder, "index") is None
    assert port_entries() and BlockIndex.commit.__code__ in port_entries()


assert pyfuse3.ROOT_INODE == ROOT_INO
