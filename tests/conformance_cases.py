#!/usr/bin/python3
"""Run POSIX conformance cases on one filesystem and print the outcome as JSON.

Standard library only: tests/test_conformance.py runs this file with the system
``/usr/bin/python3`` under ``setpriv`` as unprivileged uids, which cannot enter
the project's virtualenv. The same file runs as root, and on the reference
filesystem (tmpfs), so every side executes exactly the same syscalls.

Usage: conformance_cases.py SPEC.json
SPEC is ``{"mode": "setup" | "run" | "observe", "base": DIR, "root": MOUNT_ROOT, "cases": [...]}``.
Each case is ``{"id", "setup": [step...], "op": [name, args...], "observe": [path...]}``.
Paths are relative to the case's own directory ``BASE/<id>``; ``"@root"`` is the
mount root itself.

``setup`` (run as root) builds every case's directory tree. ``run`` executes each
case's operation with the caller's credentials and records, for each observed
path, an ``lstat`` (and a digest of small regular files) before and after it.
``observe`` only records the observed paths.
"""
import ctypes
import errno
import hashlib
import json
import os
import platform
import stat
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276}[platform.machine()]
AT_FDCWD = -100
RENAME_FLAGS = {"RENAME_NOREPLACE": 1, "RENAME_EXCHANGE": 2, "RENAME_WHITEOUT": 4}


def flags_of(names):
    value = 0
    for name in names:
        value |= getattr(os, name)
    return value


class Case:
    def __init__(self, spec, base, root):
        self.spec = spec
        self.dir = os.path.join(base, spec["id"])
        self.root = root

    def path(self, p):
        if p == "@root":
            return self.root
        if p.startswith("@root/"):                 # a path from the mount root ("@root/..")
            return self.root + p[5:]
        return os.path.join(self.dir, p)


# -- setup (as root) -----------------------------------------------------------
def setup_case(case):
    os.mkdir(case.dir, 0o755)
    for step in case.spec["setup"]:
        kind, args = step[0], step[1:]
        if kind == "dir":
            path, mode, uid, gid = args
            p = case.path(path)
            if path != ".":
                os.mkdir(p)
            os.chown(p, uid, gid)
            os.chmod(p, mode)              # after chown: chown clears set-id bits
        elif kind == "file":
            path, mode, uid, gid, content = args
            p = case.path(path)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, content.encode())
            os.close(fd)
            os.chown(p, uid, gid)
            os.chmod(p, mode)
        elif kind == "symlink":
            target, path, uid, gid = args
            os.symlink(target, case.path(path))
            os.lchown(case.path(path), uid, gid)
        elif kind == "link":
            src, dst = args
            os.link(case.path(src), case.path(dst))
        else:
            raise ValueError(f"unknown setup step {kind!r}")


# -- operations (as the caller) ------------------------------------------------
def op_open(case, path, flags, mode=0o666):
    os.close(os.open(case.path(path), flags_of(flags), mode))


def op_open_ftruncate(case, path, flags, length):
    fd = os.open(case.path(path), flags_of(flags))
    try:
        os.ftruncate(fd, length)
    finally:
        os.close(fd)


def op_write(case, path, data, flags=("O_WRONLY",)):
    fd = os.open(case.path(path), flags_of(flags))
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def op_renameat2(case, src, dst, flags):
    value = 0
    for name in flags:
        value |= RENAME_FLAGS[name]
    res = libc.syscall(SYS_RENAMEAT2, AT_FDCWD, os.fsencode(case.path(src)),
                       AT_FDCWD, os.fsencode(case.path(dst)), value)
    if res != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def op_utime(case, path, times_ns):
    if times_ns is None:
        os.utime(case.path(path))
    else:
        os.utime(case.path(path), ns=tuple(times_ns))


OPS = {
    "open": op_open,
    "open_ftruncate": op_open_ftruncate,
    "write": op_write,
    "open_write": lambda c, p, flags, data: op_write(c, p, data, flags),
    "renameat2": op_renameat2,
    "utime": op_utime,
    "unlink": lambda c, p: os.unlink(c.path(p)),
    "rmdir": lambda c, p: os.rmdir(c.path(p)),
    "mkdir": lambda c, p, mode: os.mkdir(c.path(p), mode),
    "rename": lambda c, a, b: os.rename(c.path(a), c.path(b)),
    "link": lambda c, a, b: os.link(c.path(a), c.path(b)),
    "symlink": lambda c, t, p: os.symlink(t, c.path(p)),
    "truncate": lambda c, p, n: os.truncate(c.path(p), n),
    "chmod": lambda c, p, mode: os.chmod(c.path(p), mode),
    "chown": lambda c, p, uid, gid: os.chown(c.path(p), uid, gid),
    "stat": lambda c, p: os.stat(c.path(p)),
    "setxattr": lambda c, p, name, size: os.setxattr(c.path(p), name, b"v" * size),
    "getxattr": lambda c, p, name: os.getxattr(c.path(p), name),
    "removexattr": lambda c, p, name: os.removexattr(c.path(p), name),
}


def observe(case, path):
    p = case.path(path)
    try:
        st = os.lstat(p)
    except OSError as exc:
        return {"errno": errno.errorcode.get(exc.errno, str(exc.errno))}
    facts = {"type": stat.S_IFMT(st.st_mode), "mode": stat.S_IMODE(st.st_mode),
             "nlink": st.st_nlink, "uid": st.st_uid, "gid": st.st_gid, "ino": st.st_ino,
             "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    if stat.S_ISREG(st.st_mode) and st.st_size <= 1 << 20:
        try:
            with open(p, "rb") as f:
                facts["sha256"] = hashlib.sha256(f.read()).hexdigest()
        except OSError as exc:
            facts["sha256"] = errno.errorcode.get(exc.errno, str(exc.errno))
    return facts


def run_case(case):
    spec = case.spec
    paths = spec.get("observe", [])
    before = {p: observe(case, p) for p in paths}
    if paths:
        time.sleep(0.02)           # so that a changed timestamp is a different one
    name, args = spec["op"][0], spec["op"][1:]
    try:
        OPS[name](case, *args)
        err = 0
    except OSError as exc:
        err = exc.errno
    after = {p: observe(case, p) for p in paths}
    return {"id": spec["id"], "errno": err, "errname": errno.errorcode.get(err, "OK"),
            "before": before, "after": after}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.umask(0o022)
    out = []
    for c in spec["cases"]:
        case = Case(c, spec["base"], spec["root"])
        if spec["mode"] == "setup":
            setup_case(case)
        elif spec["mode"] == "observe":
            out.append({"id": c["id"], "state": {p: observe(case, p) for p in c["observe"]}})
        else:
            out.append(run_case(case))
    json.dump({"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
               "results": out}, sys.stdout)


if __name__ == "__main__":
    main()
