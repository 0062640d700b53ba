import pytest

from flashboot import FlashBootError
from flashboot.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), (4096, 4096), ("217e9", 217_000_000_000), ("217GB", 217_000_000_000),
    ("256MiB", 256 << 20), ("256M", 256 << 20), ("1.5 GB", 1_500_000_000), ("1KiB", 1024),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-5", "0", "1.5B", "GB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(FlashBootError):
        parse_bytes(bad)


def test_format_bytes_speaks_the_binary_units_the_options_take():
    assert format_bytes(13_760_000_000) == "12.81 GiB"
    assert format_bytes(12) == "12 B"
    for text in ("64MiB", "256MiB", "4KiB", "2GiB"):  # an option's value prints as it was written
        assert format_bytes(parse_bytes(text)).replace(" ", "") == text
    assert format_bytes(126_976) == "124 KiB"
