"""kvfs.base.gilpolicy: the switch interval is lowered inside loop_first sections and restored after the last."""
import sys
import threading

from kvfs.base.gilpolicy import LOOP_FIRST_INTERVAL, loop_first


def test_loop_first_lowers_the_switch_interval_and_restores_it():
    before = sys.getswitchinterval()
    assert before > LOOP_FIRST_INTERVAL              # the interpreter's 5 ms
    with loop_first():
        assert sys.getswitchinterval() == LOOP_FIRST_INTERVAL
        with loop_first():                           # nested (two checkpoints' threads)
            assert sys.getswitchinterval() == LOOP_FIRST_INTERVAL
        assert sys.getswitchinterval() == LOOP_FIRST_INTERVAL   # the outer section still runs
    assert sys.getswitchinterval() == before


def test_sections_in_threads_overlap_and_the_last_one_restores():
    before = sys.getswitchinterval()
    inside, release = threading.Event(), threading.Event()

    def other():
        with loop_first():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with loop_first():
        pass                                         # ends first: the other section still needs it
    assert sys.getswitchinterval() == LOOP_FIRST_INTERVAL
    release.set()
    t.join(10)
    assert sys.getswitchinterval() == before


def test_an_exception_inside_still_restores():
    before = sys.getswitchinterval()
    try:
        with loop_first():
            raise RuntimeError("checkpoint failed")
    except RuntimeError:
        pass
    assert sys.getswitchinterval() == before
