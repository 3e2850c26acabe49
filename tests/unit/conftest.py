"""Fixtures of the unit tests."""

import pytest

from tests.helpers import Ranks


@pytest.fixture
def ranks():
    made = []

    def make(world, **cfg):
        r = Ranks(world, **cfg)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()
