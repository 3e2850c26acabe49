"""Bench and example mistakes: one line on stderr naming the option, its bad value and the fix,
exit status 2, before any testbed, namespace, process or rendezvous (as tests/unit/test_cli_usage.py
holds ``dblp`` to).  Here a check that let a mistake through would meet a stand-in: a run as
a user without root (the scripts stop there, saying so) and no testbed or benchmark to start."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(rel: str):
    spec = importlib.util.spec_from_file_location(f"usage_{Path(rel).stem}", ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


allreduce, congestion, auth_cost, soak = (_load(f"bench/{n}.py") for n in ("allreduce", "congestion", "auth_cost",
                                                                          "soak"))


class _NoSetUp:
    def __init__(self, *a, **k):
        raise AssertionError("got past the argument checks to the set-up")


@pytest.fixture(autouse=True)
def _no_set_up(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # (allreduce.py's SIGTERM handler: not pytest's)
    for mod in (allreduce, congestion, soak):
        monkeypatch.setattr(mod, "Testbed", _NoSetUp)
    monkeypatch.setattr(auth_cost, "per_packet", _NoSetUp)


def _refused(run, argv, says, prog, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [prog])  # (argparse's prog: the script's name, as when it is run)
    with pytest.raises(SystemExit) as e:
        run(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: ") and says in lines[0], err


@pytest.mark.parametrize("argv,says", [
    (["--sizes", "0"], "--sizes 0: use sizes in MiB above 0"),
    (["--sizes=-1,8"], "--sizes -1,8: use sizes in MiB above 0"),
    (["--sizes", "x"], "--sizes x: use sizes in MiB above 0"),
    (["--sizes", ","], "--sizes ,: use sizes in MiB above 0"),
    (["--sizes", "nan"], "--sizes nan: use sizes in MiB above 0"),
    (["--sizes", "10000000"], "outgrow this machine's"),
    (["--rounds", "0"], "--rounds 0: use 1 or more"),
    (["--rounds", "1"], "--rounds 1: a burst block needs 2 or more"),
    (["--rounds", "x"], "argument --rounds: invalid int value: 'x'"),
    (["--chunk-bytes", "0"], "--chunk-bytes 0: use a multiple of 4 in 64..1408 (what MTU 1500 carries)"),
    (["--chunk-bytes", "1402"], "--chunk-bytes 1402: use a multiple of 4"),
    (["--chunk-bytes", "4000"], "--chunk-bytes 4000: use a multiple of 4 in 64..1408"),
    (["--chunk-bytes", "8004", "--mtu", "9000"], "in 64..8000 (what MTU 9000 carries)"),
    (["--mtu", "1000"], "--mtu 1000: 1408-byte chunks need MTU 1488 or more: give --chunk-bytes 896 too"),
    (["--mtu", "100"], "--mtu 100: pydblp's least chunk (64 bytes) needs an MTU of 144"),
    (["--mtu", "0", "--transports", "gloo"], "--mtu 0: use 68..65535"),
    (["--transports", ""], "--transports '': use some of xsk,"),
    (["--conditions", ""], "--conditions '': use some of clean,loss,burst"),
    (["--tol", "1"], "--tol 1.0: use a tolerance in [0, 1)"),
    (["--loss", "2"], "--loss 2.0: use a probability in [0, 1]"),
    (["--burst-ratio", "0"], "--burst-ratio 0.0: use a loss ratio in (0, 1]"),
    (["--burst-every", "0"], "--burst-every 0: use 1 or more"),
    (["--burst-len", "nan"], "--burst-len nan: use milliseconds above 0"),
    (["--peer-timeout", "0"], "--peer-timeout 0.0: use seconds in (0, 86400]"),
    (["--spin", "-1"], "--spin -1.0: use busy-poll seconds >= 0"),
    (["--send-burst", "0"], "--send-burst 0: use 1 or more packets"),
    (["--spread", "-1"], "--spread -1: use 0 (off) or a number of packets"),
    (["--switch-buffer", "128", "--rate", "0"], "--switch-buffer 128: use KiB >= 0 with a link rate"),
    (["--switch-mark", "32"], "--switch-mark 32: use KiB up to --switch-buffer's"),
    (["--block-timeout", "0"], "--block-timeout 0.0: use seconds above 0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_allreduce_refuses_a_mistake_in_one_line(argv, says, capsys, monkeypatch):
    _refused(allreduce.main, argv, says, "allreduce.py", capsys, monkeypatch)


@pytest.mark.parametrize("argv,says", [
    (["--seconds", "0", "--scenario", "tcp"], "--seconds 0: use seconds above 0"),
    (["--seconds", "nan"], "--seconds nan: use seconds above 0"),
    (["--alone", "-1"], "--alone -1: use seconds >= 0"),
    (["--size", "0"], "--size 0: use MiB above 0"),
    (["--incast-size", "-2"], "--incast-size -2: use MiB above 0"),
    (["--rounds", "0"], "--rounds 0: use 1 or more"),
    (["--senders", ""], "--senders '': give sender counts for the incast"),
    (["--buffer", "100000000"], "--buffer 100000000: use at most 4194303 KiB"),
    (["--queue-rate", "0"], "--queue-rate 0: use Mbit/s in (0, 34000]"),
    (["--tol", "1"], "--tol 1: use a tolerance in [0, 1)"),
    (["--window", "0"], "--window 0: use seconds above 0"),
    (["--sample", "0"], "--sample 0: use seconds above 0"),
    (["--peer-timeout", "0"], "--peer-timeout 0: use seconds in (0, 86400]"),
    (["--cc-knobs", "cc_gain"], "--cc-knobs 'cc_gain': each knob needs a value"),
    (["--cc-knobs", "bogus=1"], "'bogus' is not a Config cc_* knob"),
    (["--cc-knobs", "cc_gain=x"], "could not convert string to float: 'x'"),
    (["--cc-knobs", "cc_gain=2"], "cc_gain 2.0: use a weight in (0, 1]"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_congestion_refuses_a_mistake_in_one_line(argv, says, capsys, monkeypatch):
    _refused(congestion.main, argv, says, "congestion.py", capsys, monkeypatch)


@pytest.mark.parametrize("argv,says", [
    (["--mib", "0"], "--mib 0: use MiB above 0"),
    (["--mib", "nan"], "--mib nan: use MiB above 0"),
    (["--world", "1"], "--world 1: use 2 or more ranks"),
    (["--rounds", "-1"], "--rounds -1: use 1 or more"),
    (["--repeats", "0"], "--repeats 0: use 1 or more"),
    (["--batch", "0"], "--batch 0: use 1 or more packets"),
    (["--chunk", "0"], "--chunk 0: use payload bytes in 1..8000"),
    (["--chunk", "70000"], "--chunk 70000: use payload bytes in 1..8000"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_auth_cost_refuses_a_mistake_in_one_line(argv, says, capsys, monkeypatch):
    _refused(auth_cost.main, argv, says, "auth_cost.py", capsys, monkeypatch)


@pytest.mark.parametrize("argv,says", [
    (["--workers", "1"], "--workers 1: use 2..249"),
    (["--pps", "inf"], "--pps inf: use frames a second above 0"),
    (["--minutes", "nan"], "--minutes nan: use minutes above 0"),
    (["--steps", "5"], "--steps 5: use 30 or more"),
    (["--pool", "1"], "--pool 1: use 30 or more (every category"),
    (["--seed", "-1"], "--seed -1: use 0 or more"),
    (["--sample", "0"], "--sample 0: use seconds above 0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_soak_refuses_a_mistake_in_one_line(argv, says, capsys, monkeypatch):
    _refused(soak.main, argv, says, "soak.py", capsys, monkeypatch)


@pytest.mark.parametrize("argv,says", [
    (["--port", "70000"], "--port 70000: use 1..65535, or 0"),
    (["--job", "0"], "--job 0: use 1..4294967295"),
    (["--chunk-bytes", "1402"], "--chunk-bytes 1402: use a multiple of 4 in 64..8000, or link"),
    (["--chunk-bytes", "big"], "--chunk-bytes big: use a multiple of 4"),
    (["--peer-timeout", "inf"], "--peer-timeout inf: use seconds in (0, 86400]"),
    (["--epochs", "0"], "--epochs 0: use 1 or more"),
    (["--batch", "0"], "--batch 0: use 1 or more samples"),
    (["--lr", "0"], "--lr 0: use a learning rate above 0"),
    (["--phase", "static:2"], "--phase static:2: tolerance 2.0 must be in [0, 1)"),
    (["--iface", "nosuch0"], "--iface nosuch0: no such interface here"),
    (["--key-file", "/nonexistent/job.key"], "--key-file /nonexistent/job.key: No such file or directory"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_train_ddp_refuses_a_mistake_before_the_rendezvous(argv, says, capsys, monkeypatch):
    pytest.importorskip("torch")
    _refused(_load("examples/train_ddp.py").parse, argv, says, "train_ddp.py", capsys, monkeypatch)


def test_good_arguments_get_past_the_checks(capsys, monkeypatch):
    """The defaults and a few good values pass (to the root check, or the stand-ins)."""
    assert allreduce.main(["--mtu", "1000", "--chunk-bytes", "896", "--rounds", "2"]) == 2
    assert congestion.main(["--cc-knobs", "cc_gain=0.5,cc_increase=20e6"]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(auth_cost.mac, "native_available", lambda: True)
    with pytest.raises(AssertionError, match="set-up"):
        auth_cost.main(["--mib", "1", "--world", "2"])
    assert soak.parse(["--steps", "30", "--pool", "30"]).steps == 30
