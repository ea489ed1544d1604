"""The oracle of the stress test (tests/stress_oracle.py) on hand-made histories: it
accepts what the kernel may legitimately return and nothing more."""
import pytest

from stress_oracle import PAGE, History, Violation, content

OLD, NEW = (6, 12245), (9734, 8273)     # a rewrite that shrinks the file within its last page


@pytest.fixture
def rewritten():
    """A name holding OLD, rewritten in place (O_TRUNC) to NEW during [1, 2]."""
    h = History()
    obj = h.new_object(OLD, 0.0)
    h.end(h.begin([("name", "n", obj)], 0.0), 0.1)
    h.end(h.begin([("obj", obj, NEW)], 1.0), 2.0)
    return h


def check(h, data, kind):
    h.check_read("n", 1.5, 1.5, 1.6, data, kind)


@pytest.mark.parametrize("data", [
    content(*NEW) + bytes(OLD[1] - NEW[1]),              # the new end, then zeros to the old length
    content(*NEW)[:5000] + bytes(OLD[1] - 5000),         # a prefix of the new content, then zeros
    bytes(OLD[1]),                                       # faulted while the file was empty
    content(*OLD)[:2 * PAGE] + content(*NEW)[2 * PAGE:],  # pages from both, as for every reader
])
def test_a_mapping_may_read_zeros_past_the_end_of_a_state(rewritten, data):
    check(rewritten, data, "mmap")


@pytest.mark.parametrize("kind", ["buffered", "O_DIRECT"])
def test_read_never_returns_zeros_past_the_end(rewritten, kind):
    with pytest.raises(Violation, match=r"the piece \[8273, 12245\) is from no state: got zeros"):
        check(rewritten, content(*NEW) + bytes(OLD[1] - NEW[1]), kind)
    check(rewritten, content(*NEW), kind)


@pytest.mark.parametrize("data", [
    content(*OLD)[:9000] + bytes(OLD[1] - 9000),         # the old content never ended at 9000
    content(*NEW)[:4200] + content(*OLD)[4200:4300] + bytes(OLD[1] - 4300),   # a mix within a page
    content(*NEW)[:PAGE + 100] + bytes(200) + content(*NEW)[PAGE + 300:],   # zeros inside a page
])
def test_a_mapping_gets_no_other_zeros(rewritten, data):
    with pytest.raises(Violation):
        check(rewritten, data, "mmap")
