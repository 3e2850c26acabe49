"""Testbed pieces that need no root: parsing, config packing, naming, CLI parser."""

from __future__ import annotations

import ipaddress

import pytest

from pydblp import cli
from pydblp.testbed import Testbed, TestbedError, worker_addr, worker_mac
from pydblp.testbed import fabric as fb


@pytest.mark.parametrize("text,bits", [("1gbit", 10**9), ("100mbit", 10**8), ("2.5gbit", 2_500_000_000),
                                       ("500kbit", 500_000), ("none", 0), (0, 0), ("1mbps", 8 * 10**6),
                                       ("12345", 12345)])
def test_parse_rate(text, bits):
    assert fb.parse_rate(text) == bits


def test_parse_size_duration_and_errors():
    assert fb.parse_size("256k") == 262144 and fb.parse_size("1m") == 1 << 20 and fb.parse_size(1500) == 1500
    assert fb.parse_size("64KiB") == 65536
    assert fb.parse_duration("50ms") == pytest.approx(0.05)
    assert fb.parse_duration("2s") == 2 and fb.parse_duration("500us") == pytest.approx(5e-4)
    assert fb.parse_duration(0.1) == 0.1
    for bad in (lambda: fb.parse_rate("fast"), lambda: fb.parse_size("big"),
                lambda: fb.parse_duration("soon"), lambda: fb.prob(-0.1)):
        with pytest.raises(fb.FabricError):
            bad()


@pytest.mark.parametrize("text", ["-5", -5, "-1gbit", "nan", float("inf"), "1e30", 2**70])
def test_parse_rate_refuses_what_no_queue_can_drain_at(text):
    """A negative, non-finite or wider-than-the-map's-field rate is a FabricError (it was a
    struct.error traceback from ``dblp fault queue --rate -5``)."""
    with pytest.raises(fb.FabricError, match="bad rate"):
        fb.parse_rate(text)


def test_prob_fixed_point():
    assert fb.prob(0) == 0 and fb.prob(1) == fb.P_ONE and fb.prob(0.5) == fb.P_ONE // 2


def test_port_config_round_trip_and_describe():
    c = fb.PortConfig(loss=fb.prob(0.25), ge_p=fb.prob(0.01), ge_r=fb.prob(0.5), ge_loss_bad=fb.P_ONE,
                      flags=fb.F_GE | fb.F_QUEUE, rate=125_000_000, buffer=65536,
                      thresh=fb.default_thresholds(65536), burst_dur_ns=50_000_000,
                      burst_ratio=fb.prob(0.8), burst_start_ns=10**9, dscp_prio=tuple(range(64)))
    raw = c.pack()
    assert len(raw) == fb.CFG.size == 200
    assert fb.PortConfig.unpack(raw) == c
    d = c.describe()
    assert d["loss"] == 0.25 and d["ge"]["r"] == 0.5 and d["queue"]["rate_bps"] == 10**9
    assert d["burst"]["duration"] == 0.05 and d["burst"]["every"] is None
    assert d["queue"]["classify"] == "header"
    assert fb.PortConfig().describe() == {}


def test_default_thresholds_order():
    t = fb.default_thresholds(80_000)
    assert t[0] == 0, "prio 0 is never early-dropped"
    assert list(t[1:]) == sorted(t[1:], reverse=True) and t[1] < 80_000 and t[7] == 10_000


def test_addresses_stay_in_benchmark_range():
    net15 = ipaddress.ip_network("198.18.0.0/15")
    addrs = {worker_addr(i) for i in range(250)}
    assert len(addrs) == 250 and all(ipaddress.ip_address(a) in net15 for a in addrs)
    assert worker_addr(0) == "198.18.0.1" and worker_mac(0) == "02:db:00:00:00:01"


def test_testbed_arguments_checked_before_anything_is_built():
    with pytest.raises(TestbedError):
        Testbed(workers=0)
    with pytest.raises(TestbedError):
        Testbed(name="no/slash")
    with pytest.raises(TestbedError):
        Testbed(name="x" * 40)
    with pytest.raises(TestbedError):
        Testbed(rate="warp")
    tb = Testbed(workers=3, name="abc", mtu=9000)
    assert tb.ns("w2") == "abc-w2" and tb.ns(1) == "abc-w1" and tb.addr("w2") == "198.18.0.3"
    assert tb.rate_bps == 10**9 and Testbed(rate="none").rate_bps == 0
    with pytest.raises(TestbedError):
        tb.addr("w3")
    assert tb.argv("w0", ["true"])[-1] == "true"


def test_cli_parser_has_testbed_and_fault():
    p = cli.build_parser()
    a = p.parse_args(["testbed", "up", "--name", "t", "--workers", "3", "--rate", "10gbit"])
    assert (a.action, a.name, a.workers, a.rate) == ("up", "t", 3, "10gbit")
    a = p.parse_args(["testbed", "exec", "w1", "--", "ip", "-br", "addr"])
    assert a.worker == "w1" and [x for x in a.cmd if x != "--"] == ["ip", "-br", "addr"]
    a = p.parse_args(["fault", "burst", "--ratio", "0.9", "--duration", "100ms", "--every", "1s",
                      "--testbed", "t", "--port", "w0", "--port", "w2"])
    assert a.ratio == 0.9 and a.every == "1s" and a.port == ["w0", "w2"] and a.testbed == "t"
    a = p.parse_args(["fault", "ge", "--p", "0.01", "--r", "0.25"])
    assert a.p == 0.01 and a.r == 0.25 and a.loss_bad == 1.0
    with pytest.raises(SystemExit):
        p.parse_args(["testbed", "down", "--name", "a", "--all"])


def test_jumbo_mtu_fabric_mode_follows_multibuffer_xdp(monkeypatch):
    """Above veth's single-buffer limit the fabric is native only with multi-buffer XDP (5.18+)."""
    from pydblp import bpf

    monkeypatch.setattr(bpf, "xdp_frags_supported", lambda: True)
    assert Testbed(mtu=9000).mode == "native" and Testbed(mtu=9000, mode="native").mode == "native"
    monkeypatch.setattr(bpf, "xdp_frags_supported", lambda: False)
    assert Testbed(mtu=9000).mode == "skb" and Testbed(mtu=3506).mode == "native"
    with pytest.raises(TestbedError, match="multi-buffer"):
        Testbed(mtu=9000, mode="native")
    assert Testbed(mtu=9000, mode="skb").mode == "skb"


def test_queue_mark_parsed_and_checked_against_the_buffer():
    assert fb.parse_mark(None, 65536) == 0 and fb.parse_mark(0, 65536) == 0 and fb.parse_mark("0", 1) == 0
    assert fb.parse_mark("32k", 65536) == 32768 and fb.parse_mark(1500, 1500) == 1500
    for mark, buffer, msg in (("65537", 65536, "above the buffer (65536 bytes)"), ("big", 65536, "bad size"),
                              ("-1k", 65536, "negative"), ("inf", 65536, "out of range")):
        with pytest.raises(fb.FabricError) as e:
            fb.parse_mark(mark, buffer)
        assert msg in str(e.value) and "\n" not in str(e.value)
    c = fb.PortConfig(flags=fb.F_QUEUE, rate=125_000, buffer=65536, mark=32768)
    assert fb.PortConfig.unpack(c.pack()) == c and c.describe()["queue"]["mark"] == 32768
    assert c.describe()["queue"]["delay"] is False
    assert fb.PortConfig(flags=fb.F_QUEUE | fb.F_DELAY).describe()["queue"]["delay"] is True
    assert fb.CAUSES[fb.C_MARK] == "mark" and "mark" not in fb.DROP_CAUSES  # a mark forwards the frame
    assert fb.CAUSES[fb.C_MARK_DROP] == "mark_drop" and "mark_drop" in fb.DROP_CAUSES
    assert fb.PortConfig(flags=fb.F_QUEUE | fb.F_MARK_DROP, mark=1).describe()["queue"]["mark_drop"] is True
    assert c.describe()["queue"]["mark_drop"] is False
    assert len(fb.CAUSES) == fb.NCAUSES  # every counter cause the program has is named


@pytest.mark.parametrize("argv,msg", [
    (["--mark", "lots"], "queue mark: bad size 'lots'"),
    (["--mark", "-5"], "queue mark -5 bytes is negative"),
    (["--buffer", "64k", "--mark", "128k"], "queue mark 131072 bytes is above the buffer (65536 bytes)"),
    (["--mark", "300k"], "is above the buffer (262144 bytes)"),  # the default buffer
    (["--mark-drop"], "--mark-drop drops what cannot be marked past the mark: give --mark too"),
])
def test_cli_fault_queue_refuses_a_bad_mark_in_one_line(argv, msg, capsys, tmp_path, monkeypatch):
    """Refused before any testbed is looked for (none is up here: that would be another error)."""
    monkeypatch.setenv("DBLP_TESTBED_DIR", str(tmp_path))
    assert cli.main(["fault", "queue", "--rate", "1mbit", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("dblp fault: ") and msg in err, err
    a = cli.build_parser().parse_args(["fault", "queue", "--rate", "1mbit", "--mark", "32k"])
    assert a.mark == "32k"


def test_a_worker_is_w1_or_1_everywhere():
    """`fault --port`, `experiment --burst-port/--queue-port` and `testbed exec` name a worker
    the same ways: w1 or 1."""
    from pydblp import cli
    from pydblp.testbed.fabric import Fabric, FabricError

    assert cli._ports("w0,w2", 4) == cli._ports("0,2", 4) == (0, 2)
    assert cli._ports("all", 4) == "all"
    f = Fabric.__new__(Fabric)
    f.ports = {"w0": 5, "w1": 6}
    assert f._ifindexes("1") == f._ifindexes("w1") == f._ifindexes(1) == [6]
    with pytest.raises(FabricError, match="no port 'w2'"):
        f._ifindexes("w2")
