import pytest

from kvblock import create_file


@pytest.fixture
def path(tmp_path):
    """A 256 MiB store file."""
    p = tmp_path / "kv.img"
    create_file(p, 256 << 20)
    return p
