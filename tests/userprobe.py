"""Syscalls as another uid, through a real mount: a probe script run by the system Python.

This machine's venv Python lives where only root may enter, so the unprivileged
side runs ``/usr/bin/python3`` under ``setpriv`` with a small script: the caller's
``ops_source`` defines a dict ``OPS`` of name -> function, and each op runs as
``[name, *args]`` (all arguments as strings), giving ``{"ok": value}`` or
``{"errno": n}``.
"""
import json
import subprocess

SYSTEM_PYTHON = "/usr/bin/python3"

_RUNNER = r"""
out = []
for op, *args in json.loads(sys.argv[1]):
    try:
        out.append({"ok": OPS[op](*args)})
    except OSError as exc:
        out.append({"errno": exc.errno})
print(json.dumps(out))
"""


def run_probe(uid, ops_source, ops, timeout=120):
    """Run ``ops`` as ``uid`` (its own group, no supplementary groups); their results, in order."""
    script = "import json, sys\n" + ops_source + _RUNNER
    proc = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
         SYSTEM_PYTHON, "-c", script, json.dumps([[str(a) for a in op] for op in ops])],
        capture_output=True, text=True, timeout=timeout, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
