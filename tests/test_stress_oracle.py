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


def test_an_o_direct_read_may_go_on_through_the_page_cache_where_a_prefix_ended(rewritten):
    # The direct part met the file while the new content's writes had reached
    # 5000 bytes; the rest came through the page cache after the old content
    # had been put back (here: any later state). Not at a page boundary.
    data = content(*NEW)[:5000] + content(*OLD)[5000:]
    check(rewritten, data, "O_DIRECT")
    with pytest.raises(Violation):                       # the direct part must be a prefix from offset 0
        check(rewritten, content(*OLD)[:100] + content(*NEW)[100:5000] + content(*OLD)[5000:], "O_DIRECT")


@pytest.mark.parametrize("kind", ["mmap", "buffered"])
def test_a_page_copy_may_switch_state_once_within_a_page(rewritten, kind):
    # The reader's copy of page 1 met the old bytes for 244 bytes, then the
    # writer's copy into that page overtook it (tests/test_stress.py, under load).
    data = content(*OLD)[:PAGE + 244] + content(*NEW)[PAGE + 244:]
    check(rewritten, data, kind)
    check(rewritten, content(*NEW)[:PAGE + 17] + content(*OLD)[PAGE + 17:], kind)   # or the other way
    with pytest.raises(Violation):                       # twice within one page: no
        check(rewritten, content(*OLD)[:PAGE + 100] + content(*NEW)[PAGE + 100:PAGE + 200]
              + content(*OLD)[PAGE + 200:], kind)
    with pytest.raises(Violation):                       # to zeros: no
        check(rewritten, content(*OLD)[:PAGE + 100] + bytes(PAGE - 100) + content(*OLD)[2 * PAGE:], kind)


def test_an_o_direct_read_switches_only_between_requests(rewritten):
    data = content(*OLD)[:PAGE + 244] + content(*NEW)[PAGE + 244:]
    with pytest.raises(Violation, match=r"the piece \[4096, 8192\) is from no state"):
        check(rewritten, data, "O_DIRECT")


@pytest.mark.parametrize("data", [
    content(*OLD)[:9000] + bytes(OLD[1] - 9000),         # the old content never ended at 9000
    content(*NEW)[:4200] + content(*OLD)[4200:4300] + bytes(OLD[1] - 4300),   # a mix within a page
    content(*NEW)[:PAGE + 100] + bytes(200) + content(*NEW)[PAGE + 300:],   # zeros inside a page
])
def test_a_mapping_gets_no_other_zeros(rewritten, data):
    with pytest.raises(Violation):
        check(rewritten, data, "mmap")
