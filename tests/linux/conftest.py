"""Fixtures shared by the privileged test modules."""

from __future__ import annotations

import pytest

from tests.helpers import host_pair


@pytest.fixture(scope="module")
def fabric_prog(bpf_xdp):
    """The testbed fabric program compiled once per module, for ``Testbed(prog=...)`` (each
    testbed otherwise compiles its own)."""
    from pydblp import bpf
    from pydblp.testbed import fabric

    b, fn = bpf.compile_xdp(fabric.SOURCE, "fabric")
    yield b, fn
    b.cleanup()


@pytest.fixture(scope="module")
def pair(root, bpf_xdp):
    """Two namespaces joined by a veth pair, the host program native on each end
    (:func:`tests.helpers.host_pair`); one per module that asks for it."""
    with host_pair() as p:
        yield p
