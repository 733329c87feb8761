import pytest

from tests.integrations.lmcache_gc import collect_lmcache_garbage, guard_lmcache_gc

guard_lmcache_gc()


@pytest.fixture
def engines():
    """The engines' objects a test built (it appends them), closed after it."""
    made = []
    yield made
    for e in made:
        e.close()
    made.clear()
    collect_lmcache_garbage()


@pytest.fixture
def backends(engines):
    """SGLang's tests' name for the same list."""
    return engines
