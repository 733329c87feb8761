import pytest


@pytest.fixture
def engines():
    """The engines' objects a test built (it appends them), closed after it."""
    made = []
    yield made
    for e in made:
        e.close()


@pytest.fixture
def backends(engines):
    """SGLang's tests' name for the same list."""
    return engines
