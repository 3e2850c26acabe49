"""Shared fixtures: capability probes, namespace ownership, leftover checks.

Tests that need root, BPF or netns skip with the name of the missing
capability.  Under ``DBLP_REQUIRE_PRIVILEGED=1`` (CI, the VM runs) every skip
is a failure, so a missing install step cannot hide behind a skip, except one
for a kernel feature the running kernel is too old to have
(:func:`tests.helpers.skip_without`, whose reason starts with
:data:`tests.helpers.KERNEL_FEATURE_SKIP`) and one of a compiled path that
``DBLP_NATIVE=0`` turned off (:func:`tests.helpers.require_native`).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import KERNEL_FEATURE_SKIP, NATIVE_OFF_SKIP, NS_PREFIX, unique_name

REQUIRE_PRIVILEGED = os.environ.get("DBLP_REQUIRE_PRIVILEGED") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if REQUIRE_PRIVILEGED and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if KERNEL_FEATURE_SKIP in reason or NATIVE_OFF_SKIP in reason:
            return  # the kernel predates the feature (skip_without), or DBLP_NATIVE=0 (require_native)
        rep.outcome = "failed"
        rep.longrepr = f"skipped under DBLP_REQUIRE_PRIVILEGED=1 (a missing install step?): {reason}"


@pytest.fixture(scope="session")
def root():
    if os.geteuid() != 0:
        pytest.skip("needs root: CAP_NET_ADMIN and CAP_BPF")


@pytest.fixture(scope="session")
def bpf_xdp(root):
    """Skip (naming the capability) if the kernel cannot load an XDP program via bcc."""
    try:
        from bcc import BPF
    except ImportError as e:  # pragma: no cover - setup installs it
        pytest.skip(f"bcc not importable ({e}); run tools/setup")
    try:
        b = BPF(text=b"int f(struct xdp_md *ctx) { return 2; }")
        b.load_func(b"f", BPF.XDP)
        b.cleanup()
    except Exception as e:
        pytest.skip(f"kernel cannot load XDP programs through bcc: {e}")


@pytest.fixture
def netns(root):
    """Factory for uniquely named namespaces, all removed at teardown."""
    from pydblp import net

    made: list[str] = []

    def make(tag: str = "n") -> str:
        name = unique_name(tag)
        net.netns_add(name)
        made.append(name)
        return name

    yield make
    for name in made:
        net.netns_del(name)
    left = [n for n in made if net.netns_exists(n)]
    assert not left, f"namespaces left behind: {left}"


@pytest.fixture(scope="session", autouse=True)
def no_leftovers():
    """After the session: no namespace this run created survives."""
    yield
    if os.geteuid() != 0:
        return
    from pydblp import net

    left = [n for n in net.netns_list() if n.startswith(NS_PREFIX)]
    for n in left:
        net.netns_del(n)
    assert not left, f"test namespaces left behind: {left}"


@pytest.fixture
def clean(tb):
    """The requesting module's testbed ``tb`` with no faults and zeroed counters, cleared again after."""
    tb.clear()
    tb.stats(reset=True)
    yield tb
    tb.clear()
