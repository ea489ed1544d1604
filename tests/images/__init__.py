"""Stored kvfs stores of past on-disk formats (see make_image.py and tests/test_format_image.py)."""
