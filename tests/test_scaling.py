"""The scaling model (:mod:`largebatch.comm.scaling`) and ``largebatch scaling``: each formula
against hand arithmetic, the crossovers, monotonicity, the ring fit on synthetic timings,
validation, and the command's table, plot, JSON and one-line errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import user_error

from largebatch.cli import main as cli
from largebatch.cli import scaling as cli_scaling
from largebatch.comm import published
from largebatch.comm import scaling as sc

MB = 1e6
GB = 1e9


# ----------------------------------------------------------------------------- formulas


def test_ring_by_hand():
    # n = 4, S = 100 MB, B = 10 GB/s, a = 5 us: 2*3 latencies + 2*3/4 * 0.01 s
    assert sc.ring(100 * MB, 4, 5e-6, 10 * GB) == pytest.approx(6 * 5e-6 + 1.5 * 0.01)
    # 3 buckets: the latencies three times, the bytes once
    assert sc.ring(100 * MB, 4, 5e-6, 10 * GB, buckets=3) == pytest.approx(18 * 5e-6 + 0.015)
    assert sc.ring(100 * MB, 1, 5e-6, 10 * GB) == 0.0


def test_allgather_by_hand():
    # n = 4, c = 40: 3 * (5 us + 100 MB / 40 / 10 GB/s = 250 us)
    assert sc.allgather(100 * MB, 4, 40, 5e-6, 10 * GB) == pytest.approx(3 * (5e-6 + 250e-6))
    assert sc.allgather(100 * MB, 4, 40, 5e-6, 10 * GB, buckets=2) == pytest.approx(3 * 2 * 5e-6 + 3 * 250e-6)


def test_two_phase_by_hand():
    # n = 4, c = 40: all-to-all 3 * (5 us + 100 MB/(40*4)/10 GB/s = 62.5 us), then the
    # all-gather of the re-compressed shards, the same again
    assert sc.two_phase(100 * MB, 4, 40, 5e-6, 10 * GB) == pytest.approx(2 * 3 * (5e-6 + 62.5e-6))
    # 8 workers sharing the link in the all-to-all: its bytes take 8x as long
    assert sc.two_phase(100 * MB, 4, 40, 5e-6, 10 * GB, sharing=8) == pytest.approx(
        6 * 5e-6 + 3 * 8 * 62.5e-6 + 3 * 62.5e-6
    )


def test_hierarchical_by_hand():
    net = sc.Network(
        intra_latency=2e-6,
        intra_bandwidth=20 * GB,
        inter_latency=10e-6,
        inter_bandwidth=5 * GB,
        gpus_per_node=4,
    )
    # n = 16: g = 4, m = 4, S = 100 MB, k = 2
    intra = 2 * 3 * 2 * 2e-6 + 2 * 3 / 4 * 0.1 / 20  # reduce-scatter + all-gather in nodes
    inter = 2 * 3 * 2 * 10e-6 + 2 * 3 / 4 * 0.1 / 5  # 4 shard rings over 4 nodes
    assert sc.hierarchical(100 * MB, 16, net, buckets=2) == pytest.approx(intra + inter)
    # inside one node it is the intra-node ring
    assert sc.hierarchical(100 * MB, 4, net) == pytest.approx(sc.ring(100 * MB, 4, 2e-6, 20 * GB))
    assert sc.hierarchical(100 * MB, 1, net) == 0.0


def test_hierarchical_trades_bytes_for_latency():
    net = sc.Network(5e-6, 20 * GB, 10e-6, 12.5 * GB, 8)
    n, s = 1024, 102.4 * MB
    flat = sc.ring(s, n, *net.inter, buckets=4)
    hier = sc.hierarchical(s, n, net, buckets=4)
    assert hier < flat  # 2*7 + 2*127 latencies a bucket instead of 2*1023
    # with no latency the flat ring moves fewer bytes over the slower link in all
    zero = sc.Network(0.0, 20 * GB, 0.0, 12.5 * GB, 8)
    assert sc.hierarchical(s, n, zero) > sc.ring(s, n, *zero.inter)


def test_one_node_uses_the_intra_node_link():
    net = sc.Network(1e-6, 40 * GB, 10e-6, 5 * GB, 8)
    assert net.link(8) == (1e-6, 40 * GB) and net.sharing(8) == 1
    assert net.link(9) == (10e-6, 5 * GB) and net.sharing(16) == 8
    w = sc.Workload(100 * MB, 0.1)
    assert sc.predict(w, net, 8).forms["ring"].comm_time == pytest.approx(sc.ring(100 * MB, 8, 1e-6, 40 * GB))
    assert sc.predict(w, net, 16).forms["ring"].comm_time == pytest.approx(
        sc.ring(100 * MB, 16, 10e-6, 5 * GB)
    )


def test_a_flat_network_gives_every_form_the_same_link():
    net = sc.Network.flat(5e-6, 10 * GB)
    w = sc.Workload(100 * MB, 0.1, buckets=2, compression=20)
    p = sc.predict(w, net, 16)
    assert p.forms["ring"].comm_time == pytest.approx(sc.ring(100 * MB, 16, 5e-6, 10 * GB, buckets=2))
    assert p.forms["hierarchical"].comm_time == pytest.approx(p.forms["ring"].comm_time)
    assert p.forms["two_phase"].comm_time == pytest.approx(
        sc.two_phase(100 * MB, 16, 20, 5e-6, 10 * GB, buckets=2)
    )
    assert p.choice == sc.choose_form(16, 100 * MB, 20, 5e-6, 10 * GB, buckets=2)


def test_the_compressors_work_is_added_to_the_compressed_forms_beyond_one_worker():
    """``S * cost`` on each compressed form's exchange (its own cost each), nothing on the
    dense forms, nothing at one worker; the pick follows the totals, so a compressor that
    costs more on the two-phase form can hand the pick back to the all-gather."""
    net = sc.Network.flat(5e-6, 10 * GB)
    free = sc.Workload(100 * MB, 0.2, buckets=4, compression=40)
    paid = sc.Workload(100 * MB, 0.2, buckets=4, compression=40, compressor_cost=(0.3e-9, 0.6e-9))
    for n in (2, 64, 512):
        a, b = sc.predict(free, net, n).forms, sc.predict(paid, net, n).forms
        assert b["ring"] == a["ring"] and b["hierarchical"] == a["hierarchical"]
        assert b["allgather"].comm_time == pytest.approx(a["allgather"].comm_time + 100 * MB * 0.3e-9)
        assert b["two_phase"].comm_time == pytest.approx(a["two_phase"].comm_time + 100 * MB * 0.6e-9)
    assert sc.predict(paid, net, 1).forms == sc.predict(free, net, 1).forms
    assert sc.predict(free, net, 64).choice == "two_phase"
    assert sc.predict(paid, net, 64).choice == "allgather"  # 30 ms less compressing pays
    assert sc.predict(paid, net, 64).choice == sc.compressed_best(paid, net, 64)


def test_predict_step_and_efficiency():
    net = sc.Network.flat(5e-6, 10 * GB)
    w = sc.Workload(100 * MB, 0.1)
    comm = 6 * 5e-6 + 0.015
    p = sc.predict(w, net, 4)
    assert p.forms["ring"].step_time == pytest.approx(0.1 + comm)
    assert p.forms["ring"].efficiency == pytest.approx(0.1 / (0.1 + comm))
    assert all(e.efficiency == 1.0 for e in sc.predict(w, net, 1).forms.values())
    # half the exchange hidden behind backward
    half = sc.predict(sc.Workload(100 * MB, 0.1, overlap=0.5), net, 4)
    assert half.forms["ring"].step_time == pytest.approx(0.1 + comm / 2)
    # the hidden part is at most the compute
    tiny = sc.predict(sc.Workload(100 * MB, 1e-3, overlap=1.0), net, 4)
    assert tiny.forms["ring"].step_time == pytest.approx(comm)
    assert [q.workers for q in sc.predict_many(w, net, [1, 2, 8])] == [1, 2, 8]
    json.dumps(p.to_dict())


# ----------------------------------------------------------------------------- crossovers


def test_allgather_against_ring_crosses_at_2c_without_latency():
    # (n-1) S/c > 2(n-1)/n S  <=>  n > 2c
    c = 40.0
    assert sc.allgather_crossover(c) == 2 * c
    for n in range(2, 200):
        ag = sc.allgather(100 * MB, n, c, 0.0, 10 * GB)
        rg = sc.ring(100 * MB, n, 0.0, 10 * GB)
        if n < 2 * c:
            assert ag < rg, n
        elif n > 2 * c:
            assert ag > rg, n
        else:
            assert ag == pytest.approx(rg)


def test_allgather_crossover_with_latency():
    # n* = 2c / (1 - c k a B / S): c = 40, k = 1, a = 5 us, B = 10 GB/s, S = 40 MB:
    # c a B / S = 40 * 5e-6 * 1e10 / 4e7 = 0.05, so n* = 80 / 0.95
    kw = {"size_bytes": 40 * MB, "latency": 5e-6, "bandwidth": 10 * GB}
    n_star = sc.allgather_crossover(40, **kw)
    assert n_star == pytest.approx(80 / 0.95)
    rg = [sc.ring(40 * MB, n, 5e-6, 10 * GB) for n in (84, 85)]
    ag = [sc.allgather(40 * MB, n, 40, 5e-6, 10 * GB) for n in (84, 85)]
    assert ag[0] < rg[0] and ag[1] > rg[1]  # n* = 84.2
    # a message shorter than a latency: the all-gather never loses
    assert sc.allgather_crossover(40, size_bytes=1000, latency=5e-6, bandwidth=10 * GB) == math.inf


def test_choose_form_switches_at_the_predicted_point():
    s, c, a, b = 4 * MB, 40.0, 5e-6, 10 * GB
    # n* = 2 / (1 - c a B / S) = 2 / (1 - 0.5) = 4: the tie goes to the all-gather
    n_star = sc.allgather_crossover(c, against="two_phase", size_bytes=s, latency=a, bandwidth=b)
    assert n_star == pytest.approx(4.0)
    picks = [sc.choose_form(n, s, c, a, b) for n in range(1, 12)]
    assert picks[:4] == ["allgather"] * 4 and picks[4:] == ["two_phase"] * 7
    # the DDP hook's own cases (tests/test_comm.py): P = S/c = 100,000 bytes is the tie
    assert sc.choose_form(4, 4_000_000, 40.0, 5e-6, 10e9) == "allgather"
    assert sc.choose_form(4, 4_000_160, 40.0, 5e-6, 10e9) == "two_phase"
    assert sc.choose_form(2, 400_000_000, 40.0, 5e-6, 10e9) == "allgather"
    assert sc.choose_form(64, 4_000_000, 40.0, 5e-6, 10e9) == "two_phase"
    # more buckets: more latency per byte, the all-gather holds on longer
    assert sc.choose_form(8, s, c, a, b, buckets=4) == "allgather"


@pytest.mark.parametrize("sharing", [1, 8])
def test_choose_form_is_the_faster_form(sharing):
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 2000))
        s, c = float(10 ** rng.uniform(4, 9)), float(rng.uniform(1, 500))
        a, b, k = float(10 ** rng.uniform(-7, -4)), float(10 ** rng.uniform(8, 11)), 3
        ag = sc.allgather(s, n, c, a, b, buckets=k)
        tp = sc.two_phase(s, n, c, a, b, buckets=k, sharing=sharing)
        pick = sc.choose_form(n, s, c, a, b, buckets=k, sharing=sharing)
        assert pick == ("allgather" if ag <= tp else "two_phase")


def test_allgather_efficiency_falls_with_workers_and_two_phase_stays_ring_over_c():
    net = sc.Network.flat(5e-6, 10 * GB)
    w = sc.Workload(100 * MB, 0.2, buckets=4, compression=40)
    ns = [2**i for i in range(1, 12)]
    preds = sc.predict_many(w, net, ns)
    ag = [p.forms["allgather"].efficiency for p in preds]
    assert all(x > y for x, y in zip(ag, ag[1:]))
    for form in sc.FORMS:
        eff = [p.forms[form].efficiency for p in preds]
        assert all(x >= y for x, y in zip(eff, eff[1:])), form
    # no latency: two-phase is the ring divided by c, at every n
    for n in ns:
        assert sc.two_phase(100 * MB, n, 40, 0.0, 10 * GB) == pytest.approx(
            sc.ring(100 * MB, n, 0.0, 10 * GB) / 40
        )
    # with latency: the ring's latency plus the ring's bytes over c
    for n in ns:
        lat = 2 * (n - 1) * 4 * 5e-6
        assert sc.two_phase(100 * MB, n, 40, 5e-6, 10 * GB, buckets=4) - lat == pytest.approx(
            (sc.ring(100 * MB, n, 5e-6, 10 * GB, buckets=4) - lat) / 40
        )
    # g workers sharing the link in the all-to-all: (g+1)/2 times ring / c for large n
    n = 2**20
    assert sc.two_phase(100 * MB, n, 40, 0.0, 10 * GB, sharing=8) / sc.ring(
        100 * MB, n, 0.0, 10 * GB
    ) == pytest.approx(4.5 / 40, rel=1e-5)
    big = sc.predict(w, net, 2048)
    assert big.forms["two_phase"].comm_time < big.forms["allgather"].comm_time / 5
    assert big.choice == "two_phase"


# ----------------------------------------------------------------------------- the fit


def _synthetic(alpha: float, bandwidth: float, noise: float = 0.0) -> list[tuple]:
    rng = np.random.default_rng(1)
    rows = []
    for n in (2, 4, 8):
        for size in (4096 * 4**i for i in range(7)):
            t = sc.ring(size, n, alpha, bandwidth)
            rows.append((n, size, t * (1 + noise * rng.standard_normal())))
    return rows


def test_fit_ring_recovers_latency_and_bandwidth():
    fit = sc.fit_ring(_synthetic(50e-6, 2 * GB))
    assert fit.latency == pytest.approx(50e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(2 * GB, rel=1e-9)
    noisy = sc.fit_ring(_synthetic(50e-6, 2 * GB, noise=0.05))
    assert noisy.latency == pytest.approx(50e-6, rel=0.1)
    assert noisy.bandwidth == pytest.approx(2 * GB, rel=0.1)
    a, b = noisy  # a Link unpacks as (latency, bandwidth)
    assert (a, b) == (noisy.latency, noisy.bandwidth)


def test_fit_ring_weighs_small_and_large_sizes_alike():
    """5% errors on the large sizes, correlated with n: plain least squares would move the
    latency by 10% (the big timings' seconds dominate); relative residuals keep it."""
    rows = []
    for n, err in ((2, 0.95), (4, 1.0), (8, 1.05)):
        for size in (4096 * 4**i for i in range(7)):
            rows.append((n, size, sc.ring(size, n, 50e-6, 2 * GB) * (err if size >= MB else 1)))
    assert sc.fit_ring(rows).latency == pytest.approx(50e-6, rel=0.02)


def test_fit_ring_clips_a_negative_latency():
    rows = [(2, s, s / 1e9) for s in (1e3, 1e6, 1e7)] + [(2, 1e3, 0.5e-6)]
    fit = sc.fit_ring(rows)
    assert fit.latency == 0.0 and fit.bandwidth > 0


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([(2, 1e6, 1e-3)], "at least 2"),
        ([(1, 1e6, 1e-3), (2, 1e3, 1e-4)], "Invalid workers: 1"),
        ([(2, 1e6, 1e-3), (2, 1e6, 2e-3)], "proportional"),
        ([(2, 1e3, 1e-3), (2, 1e7, 1e-4)], "do not grow with size"),
        ([(2, 1e6, -1.0), (2, 1e3, 1e-4)], "Invalid seconds: -1.0"),
        ([(2, 1e6), (2, 1e3, 1e-4)], "Invalid sample"),
    ],
)
def test_fit_ring_refuses(rows, message):
    with pytest.raises(ValueError, match=message):
        sc.fit_ring(rows)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: sc.ring(1e6, 4, 5e-6, 0.0), "Invalid bandwidth: 0.0"),
        (lambda: sc.ring(1e6, 4, 5e-6, -1e9), "Invalid bandwidth: -1000000000.0"),
        (lambda: sc.ring(1e6, 0, 5e-6, 1e9), "Invalid workers: 0"),
        (lambda: sc.ring(1e6, True, 5e-6, 1e9), "Invalid workers: True"),
        (lambda: sc.ring(1e6, 4, -1e-6, 1e9), "Invalid latency: -1e-06"),
        (lambda: sc.ring(float("nan"), 4, 5e-6, 1e9), "Invalid size_bytes: nan"),
        (lambda: sc.ring(1e6, 4, 5e-6, 1e9, buckets=0), "Invalid buckets: 0"),
        (lambda: sc.allgather(1e6, 4, 0.5, 5e-6, 1e9), "Invalid compression: 0.5"),
        (lambda: sc.two_phase(1e6, 4, 40, 5e-6, 1e9, sharing=0), "Invalid sharing: 0"),
        (lambda: sc.Network(5e-6, 1e9, 5e-6, 1e9, 0), "Invalid gpus_per_node: 0"),
        (lambda: sc.Network(5e-6, 1e9, 5e-6, -2.0, 8), "Invalid inter_bandwidth: -2.0"),
        (
            lambda: sc.hierarchical(1e6, 12, sc.Network(5e-6, 1e9, 5e-6, 1e9, 8)),
            "Invalid workers: 12 .*multiple of gpus_per_node=8",
        ),
        (lambda: sc.Workload(1e6, 0.0), "Invalid compute_time: 0.0"),
        (lambda: sc.Workload(1e6, 0.1, overlap=1.5), "Invalid overlap: 1.5"),
        (lambda: sc.Workload(1e6, 0.1, compressor_cost=(1e-9, -1.0)), "Invalid compressor_cost: -1.0"),
        (lambda: sc.Workload(1e6, 0.1, compressor_cost=1e-9), "Invalid compressor_cost: 1e-09"),
        (lambda: sc.allgather_crossover(40, against="tree"), "Invalid against: 'tree'"),
    ],
)
def test_bad_values_name_the_parameter_and_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_numpy_numbers_are_accepted():
    assert sc.ring(np.float64(1e6), np.int64(4), 5e-6, np.float32(1e9)) == pytest.approx(
        sc.ring(1e6, 4, 5e-6, 1e9)
    )


def test_published_points_are_complete():
    rows = published.published_table()
    assert {r["name"] for r in rows} == {"ddl-256", "goyal-256", "jia-1024", "jia-2048"}
    for r in rows:
        assert "arXiv" in r["paper"] and r["assumptions"]
        assert all(0 < v <= 1 for v in r["model"].values())
    jia = [r for r in rows if r["name"].startswith("jia")]
    assert all(r["efficiency"] is None for r in jia)  # none is reported: none is invented
    goyal = next(p for p in published.PUBLISHED if p.name == "goyal-256")
    assert goyal.baseline == 8 and goyal.efficiency == 0.90
    # relative to 8 GPUs, as the paper's number is
    pred = goyal.prediction().forms["ring"].efficiency
    base = sc.predict(goyal.workload, goyal.network, 8).forms["ring"].efficiency
    assert goyal.model_efficiency("ring") == pytest.approx(pred / base)


# ----------------------------------------------------------------------------- the command


def test_cli_prints_a_table(capsys):
    assert cli(["scaling", "--workers", "1", "8", "64", "--compute-ms", "100"]) == 0
    out = capsys.readouterr().out
    assert "model resnet50: 2.56e+07 params, 102.4 MB" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("1 ", "8 ", "64")]
    assert [r[0] for r in rows] == ["1", "8", "64"]
    assert rows[0][1:3] == ["100.0", "100.0"]
    # 64 workers: 8 nodes of 8; ring on the inter-node link, 12.5 GB/s, 10 us, 4 buckets
    ring = sc.ring(102.4 * MB, 64, 10e-6, 12.5 * GB, buckets=4)
    assert float(rows[2][1]) == pytest.approx(1e3 * (0.1 + ring), abs=0.05)
    assert rows[2][-1] in ("all-gather", "two-phase")
    # The compressor's measured work by default, in the compressed columns only.
    ag_ns, tp_ns = cli_scaling.COMPRESSOR_NS_PER_BYTE
    assert f"compressor: {ag_ns:g} / {tp_ns:g} ns a gradient byte" in out
    allgather = sc.allgather(102.4 * MB, 64, 40, 10e-6, 12.5 * GB, buckets=4) + 102.4 * MB * ag_ns * 1e-9
    assert float(rows[2][5]) == pytest.approx(1e3 * (0.1 + allgather), abs=0.05)


@pytest.mark.parametrize(("flag", "ag_ns", "tp_ns"), [("0", 0, 0), ("0.5", 0.5, 0.5), ("0.25,1", 0.25, 1)])
def test_cli_compressor_cost_flag(capsys, flag, ag_ns, tp_ns):
    """One value for both compressed forms or one each; the JSON carries the seconds a byte."""
    assert cli(["scaling", "--workers", "16", "--compressor-ns-per-byte", flag, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["compressor_cost"] == [pytest.approx(ag_ns * 1e-9), pytest.approx(tp_ns * 1e-9)]
    free = json.loads(_cli_json(capsys, ["scaling", "--workers", "16", "--compressor-ns-per-byte", "0"]))
    for form, ns in (("allgather", ag_ns), ("two_phase", tp_ns)):
        extra = doc["rows"][0]["forms"][form]["comm_time"] - free["rows"][0]["forms"][form]["comm_time"]
        assert extra == pytest.approx(102.4 * MB * ns * 1e-9)


def _cli_json(capsys, argv):
    assert cli([*argv, "--json"]) == 0
    return capsys.readouterr().out


def test_cli_writes_plot_and_json(tmp_path, capsys):
    plot, data = tmp_path / "eff.png", tmp_path / "sub" / "scaling.json"
    assert (
        cli(
            [
                "scaling",
                "--model",
                "bert-large",
                "--compute-ms",
                "300",
                "--workers",
                "1",
                "2",
                "16",
                "--plot",
                str(plot),
                "--json",
                str(data),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "model bert-large" in out
    assert out.splitlines()[-1] == f"wrote {plot}, {data}", out  # where each file went
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(data.read_text())
    assert doc["params"] == 340e6 and [r["workers"] for r in doc["rows"]] == [1, 2, 16]
    assert doc["crossovers"]["allgather_vs_ring_no_latency"] == 80
    assert set(doc["rows"][2]["forms"]) == set(sc.FORMS)


def test_cli_json_on_stdout_and_calibration(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"fit": {"latency_s": 1e-4, "bandwidth_Bps": 1e9}}))
    assert (
        cli(
            [
                "scaling",
                "--params",
                "1e6",
                "--workers",
                "2",
                "--gpus-per-node",
                "2",
                "--calibration",
                str(cal),
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    ring = doc["rows"][0]["forms"]["ring"]["comm_time"]
    assert ring == pytest.approx(sc.ring(4e6, 2, 1e-4, 1e9, buckets=1))
    # With --plot, stdout still holds the JSON alone; the plot's path goes to stderr.
    plot = tmp_path / "eff.png"
    assert cli(["scaling", "--params", "1e6", "--workers", "1", "2", "--plot", str(plot), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["params"] == 1e6
    assert captured.err == f"largebatch scaling: wrote {plot}\n" and plot.is_file()


def test_cli_calibration_help_states_the_file_it_reads(capsys):
    """The wheel ships no benchmarks/: the help says what the file holds."""
    with pytest.raises(SystemExit):
        cli(["scaling", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.rindex("--calibration FILE")  # its entry, after the usage line
    assert '{"fit": {"latency_s": S, "bandwidth_Bps": B}}' in text[start : start + 400], text[start:]


def test_cli_published(capsys):
    assert cli(["scaling", "--published"]) == 0
    out = capsys.readouterr().out
    for name in ("ddl-256", "goyal-256", "jia-1024", "jia-2048", "arXiv 1807.11205"):
        assert name in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "invalid --workers 0 (must be >= 1)"),
        (["--inter-gbps", "-1"], "invalid --inter-gbps -1.0 (must be a finite number > 0)"),
        (["--compute-ms", "nan"], "invalid --compute-ms nan (must be a finite number > 0)"),
        (["--compression", "0.5"], "invalid --compression 0.5 (must be a finite number >= 1)"),
        (["--overlap", "2"], "invalid --overlap 2.0 (must be between 0 and 1)"),
        *[
            (
                ["--compressor-ns-per-byte", bad],
                f"invalid --compressor-ns-per-byte {bad} (one or two comma-separated finite numbers >= 0)",
            )
            for bad in ("x", "-1", "1,2,3", "nan", "0.3,")
        ],
        (["--gpus-per-node", "0"], "invalid --gpus-per-node 0 (must be >= 1)"),
        (
            ["--workers", "12"],
            "invalid --workers 12: beyond one node the hierarchical all-reduce "
            "needs a multiple of --gpus-per-node 8",
        ),
        (["--model", "alexnet", "--params", "1e6"], "give --model or --params, not both"),
        (
            ["--params", "1e308"],
            "invalid --params 1e+308 (its fp32 gradients, 4 bytes each, overflow a float)",
        ),
    ],
)
def test_cli_bad_values(capsys, flags, message):
    assert user_error(["scaling", *flags], capsys) == f"largebatch scaling: {message}"


def test_cli_bad_calibration(tmp_path, capsys):
    missing = tmp_path / "absent.json"
    line = user_error(["scaling", "--calibration", str(missing)], capsys)
    assert line == f"largebatch scaling: cannot read --calibration {missing}: No such file or directory"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"fit": {"latency_s": 1e-4, "bandwidth_Bps": -1}}))
    line = user_error(["scaling", "--calibration", str(bad)], capsys)
    assert line.startswith(f"largebatch scaling: --calibration {bad} has no valid fit")
    line = user_error(["scaling", "--calibration", str(bad), "--inter-gbps", "10"], capsys)
    assert line == "largebatch scaling: --calibration sets the links: drop --inter-gbps"


def test_cli_plot_without_matplotlib_is_named(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as with largebatch[torch] only
    line = user_error(["scaling", "--workers", "1", "2", "--plot", str(tmp_path / "p.png")], capsys)
    assert line == ("largebatch scaling: needs matplotlib, not installed: pip install 'largebatch[recipes]'")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_command_loads_no_framework_and_exits_2_in_a_subprocess():
    import subprocess
    import sys

    code = (
        "import sys; from largebatch.cli import main; "
        "main(['scaling', '--workers', '1', '16']); "
        "assert not [m for m in ('torch', 'jax') if m in sys.modules]; "
        "main(['scaling', '--inter-gbps', '-1'])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2, proc
    assert proc.stderr == "largebatch scaling: invalid --inter-gbps -1.0 (must be a finite number > 0)\n"
    assert "compressed pick" in proc.stdout
