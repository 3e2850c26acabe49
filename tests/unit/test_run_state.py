"""The run-state files under /run/dblp: job claims and the helper that prunes their directories."""

from __future__ import annotations

import pytest

from pydblp import host
from pydblp._libc import unlink_pruned


def test_unlink_pruned_removes_empty_parents_only(tmp_path):
    a = tmp_path / "ns" / "eth0"
    a.mkdir(parents=True)
    (a / "1").write_text("x")
    (a / "2").write_text("x")
    unlink_pruned(a / "1", 2)
    assert not (a / "1").exists() and a.is_dir()  # (another file is left: the directory stays)
    unlink_pruned(a / "2", 2)
    assert not (tmp_path / "ns").exists() and tmp_path.is_dir()  # two levels, no more
    unlink_pruned(a / "2", 2)  # gone already: no error


def test_unlink_pruned_stops_at_a_nonempty_level(tmp_path):
    a = tmp_path / "ns" / "eth0"
    a.mkdir(parents=True)
    (tmp_path / "ns" / "eth1").mkdir()
    (a / "7").write_text("x")
    unlink_pruned(a / "7", 2)
    assert not a.exists() and (tmp_path / "ns" / "eth1").is_dir()


@pytest.fixture
def claims(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "CLAIM_DIR", tmp_path / "jobs")
    return tmp_path / "jobs"


def test_claims_last_out_removes_the_directories(claims):
    a, b = host.JobClaim("eth0", "nsA", 7), host.JobClaim("eth0", "nsA", 8)
    assert not a.stale and (claims / "nsA" / "eth0" / "7").read_text() != ""
    with pytest.raises(host.HostError, match="job 7 is open on eth0 --netns nsA"):
        host.JobClaim("eth0", "nsA", 7)
    a.release()
    assert (claims / "nsA" / "eth0" / "8").exists()
    b.release()
    b.release()  # idempotent
    assert not (claims / "nsA").exists()


def test_a_dead_holders_claim_is_stale_and_forgotten(claims):
    d = claims / "-" / "eth0"
    d.mkdir(parents=True)
    (d / "5").write_text("999999")  # a holder killed without releasing: no lock on it
    held = host.JobClaim("eth0", None, 6)
    host._forget_claims("eth0", None)
    assert not (d / "5").exists() and (d / "6").exists()  # the live one's stays
    c = host.JobClaim("eth0", None, 5)
    assert not c.stale  # (forgotten: nothing left to call stale)
    c.release()
    held.release()
    assert not (claims / "-").exists()


def test_a_claim_found_unlocked_is_stale(claims):
    d = claims / "-" / "eth1"
    d.mkdir(parents=True)
    (d / "3").write_text("12345")
    c = host.JobClaim("eth1", None, 3)
    assert c.stale
    c.release()


def test_a_claim_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "jobs"
    blocker.write_text("a file where the directory should be")
    monkeypatch.setattr(host, "CLAIM_DIR", blocker)
    with pytest.raises(host.HostError, match="cannot claim job 4 on eth0: .*DBLP_JOBS_DIR"):
        host.JobClaim("eth0", None, 4)
