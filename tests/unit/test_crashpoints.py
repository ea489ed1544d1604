"""kvfs/base/crashpoints.py: parsing $KVFS_TEST_CRASH, the Nth arrival, and the death itself.

The death is os._exit, so it is watched in a child process; everything else runs here.
"""
import subprocess
import sys

import pytest

from kvfs.base import crashpoints
from kvfs.errors import InvalidArgument


@pytest.fixture(autouse=True)
def disarmed():
    yield
    crashpoints.arm(None)


def test_parse_accepts_a_name_and_an_arrival():
    assert crashpoints.parse("torn-frame") == ("torn-frame", 1)
    assert crashpoints.parse("block-written@3") == ("block-written", 3)


@pytest.mark.parametrize("text", ["", "nope", "torn-frame@0", "torn-frame@-1", "torn-frame@x", "torn-frame@"])
def test_parse_refuses_unknown_names_and_bad_arrivals(text):
    with pytest.raises(InvalidArgument) as exc:
        crashpoints.parse(text)
    assert crashpoints.ENV in str(exc.value)


def test_every_point_is_described():
    assert len(crashpoints.CRASH_POINTS) >= 7
    for name, where in crashpoints.CRASH_POINTS.items():
        assert name == name.lower() and " " not in name and where.strip(), name


def test_unarmed_and_other_points_do_nothing():
    crashpoints.crashpoint("torn-frame")             # unarmed
    assert not crashpoints.reached("torn-frame")
    crashpoints.arm("block-written@2")
    crashpoints.crashpoint("torn-frame")             # armed, but another point
    assert not crashpoints.reached("torn-frame")
    assert not crashpoints.reached("block-written")  # first arrival of two


def child(script, env_value):
    code = "from kvfs.base import crashpoints\ncrashpoints.arm_from_environment()\n" + script
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", crashpoints.ENV: env_value})


def test_the_nth_arrival_dies_at_once_like_kill_9():
    proc = child("import atexit\natexit.register(print, 'atexit ran')\n"
                 "for i in range(5):\n"
                 "    print('arrival', i + 1, flush=True)\n"
                 "    crashpoints.crashpoint('dedup-unlink')\n"
                 "print('survived')\n", "dedup-unlink@3")
    assert proc.returncode == crashpoints.EXIT_CODE, proc
    assert proc.stdout.split("\n")[:3] == ["arrival 1", "arrival 2", "arrival 3"]
    assert "survived" not in proc.stdout and "atexit ran" not in proc.stdout
    assert "crash point 'dedup-unlink' reached" in proc.stderr


def test_a_bad_environment_value_is_refused_before_anything_runs():
    proc = child("print('started')\n", "dedup-unlnk")
    assert proc.returncode != 0 and "started" not in proc.stdout
    assert "unknown crash point 'dedup-unlnk'" in proc.stderr
