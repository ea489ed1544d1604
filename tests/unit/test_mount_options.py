"""mount.kvfs's option parsing: every value is checked before anything is created or mounted."""
import errno

import pytest

from kvfs.cli.mount import parse_options
from kvfs.errors import InvalidArgument, NotSupported


def test_read_only_mounts_are_refused_by_name():
    with pytest.raises(NotSupported, match="read-only mounts are not supported") as caught:
        parse_options("rw,ro")
    assert caught.value.errno == errno.EOPNOTSUPP


@pytest.mark.parametrize("text, message", [
    ("nosuch=1", "unknown mount option 'nosuch'"),
    ("dedup_groups=1000+x", "dedup_groups"),
    ("dedup_groups=1000:1000", "dedup_groups"),
    ("dedup_verify=maybe", "use off or bytes"),
    ("io_retry=", "needs a value"),
])
def test_bad_options_are_one_line_errors(text, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_options(text)


def test_tenant_options_parse():
    options, _ = parse_options("dedup_groups=1000+1001:2000,dedup_verify=bytes")
    assert options.dedup_groups == [frozenset({1000, 1001}), frozenset({2000})]
    assert options.dedup_verify is True
    assert parse_options("dedup_groups=all")[0].dedup_groups == "all"
    default, _ = parse_options("")
    assert default.dedup_groups is None and default.dedup_verify is False
