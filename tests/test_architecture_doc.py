"""docs/architecture.md and the code agree: every name it gives exists, every layer has its section.

The page names code two ways, always in backticks:

- a path, ``kvfs/blockcache/reads.py`` or ``kvfs/blockcache/``: the file or folder exists;
- a dotted name, ``kvfs.blockcache.reads.ReadSide.read``: the longest importable prefix
  is a module, and the rest are attributes found on it one after another.

Every package directly under kvfs/ (a folder with an __init__.py) is a layer, a
ground floor or an application, and must have a ``### `` heading naming its
folder. A rename or a removal in the code then fails here until the page follows.
"""
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"

PATH = re.compile(r"`(kvfs/[\w/.]*)`")
DOTTED = re.compile(r"`(kvfs(?:\.\w+)+)`")


def packages():
    """The folders directly under kvfs/ that are packages."""
    return sorted(p.name for p in (REPO / "kvfs").iterdir() if (p / "__init__.py").is_file())


def missing_paths(text):
    return sorted({p for p in PATH.findall(text) if not (REPO / p).exists()})


def resolve(dotted):
    """The object ``dotted`` names, or raise LookupError saying which part is missing."""
    parts = dotted.split(".")
    module, rest = None, []
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise                       # the module exists, but something it imports does not
            continue
        rest = parts[end:]
        break
    if module is None:
        raise LookupError(f"{dotted}: no module")
    obj = module
    for i, attr in enumerate(rest):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise LookupError(f"{dotted}: {'.'.join(parts[:len(parts) - len(rest) + i])} "
                              f"has no {attr}") from None
    return obj


def missing_names(text):
    problems = []
    for dotted in sorted(set(DOTTED.findall(text))):
        try:
            resolve(dotted)
        except LookupError as exc:
            problems.append(str(exc))
    return problems


def undescribed_packages(text, names):
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    return [name for name in names if not any(f"`kvfs/{name}/`" in h for h in headings)]


def problems(text, names):
    return (missing_paths(text) + missing_names(text) + undescribed_packages(text, names))


# -- the page ---------------------------------------------------------------------

def test_every_path_on_the_page_exists():
    text = DOC.read_text()
    assert len(PATH.findall(text)) > 30, "the page names few paths: has its notation changed?"
    assert missing_paths(text) == []


def test_every_dotted_name_on_the_page_exists():
    text = DOC.read_text()
    assert len(DOTTED.findall(text)) > 30, "the page names few functions: has its notation changed?"
    assert missing_names(text) == []


def test_every_package_under_kvfs_has_a_section():
    names = packages()
    assert {"fuse", "namespace", "blockcache", "blockindex", "store", "device"} <= set(names)
    assert undescribed_packages(DOC.read_text(), names) == []


def test_the_read_and_write_walks_are_there():
    text = DOC.read_text()
    for heading in ("## A cold read, through the layers", "## A buffered write, through the layers"):
        assert f"\n{heading}\n" in text


# -- the checks themselves ----------------------------------------------------------

def test_the_checks_report_what_is_missing():
    snippet = """
### `kvfs/fuse/`
`kvfs/fuse/ops.py` and `kvfs/fuse/nosuch.py`, `kvfs/nofolder/`;
`kvfs.fuse.ops.KvfsOperations.read`, `kvfs.fuse.ops.KvfsOperations.no_handler`,
`kvfs.nomodule.Thing`, `kvfs.blockcache.reads.NoClass.read`.
"""
    found = problems(snippet, ["fuse", "namespace"])
    assert "kvfs/fuse/nosuch.py" in found and "kvfs/nofolder/" in found
    assert "kvfs/fuse/ops.py" not in found
    assert any("KvfsOperations has no no_handler" in p for p in found), found
    assert any(p.startswith("kvfs.nomodule.Thing") for p in found), found
    assert any("reads has no NoClass" in p for p in found), found
    assert not any(p.startswith("kvfs.fuse.ops.KvfsOperations.read:") for p in found), found
    assert "namespace" in found and "fuse" not in found
    assert len(found) == 6, found


def test_a_section_must_be_a_heading_not_a_mention():
    assert undescribed_packages("see `kvfs/store/` below\n### `kvfs/device/`\n", ["store", "device"]) == ["store"]
