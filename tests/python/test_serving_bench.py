"""The serving benchmark (bench/serving/) on the CPU: the trained byte model, a short trace, a
real kvcompd per arm. Checks the harness's logic, not speed: the workload is deterministic and
its prefixes chain, every store arm finds the hits a store that keeps everything finds (the same
for all arms), recompute finds none, the virtual-clock replay's SLO counts add up, and the
report is written."""

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
sys.path.insert(0, os.path.join(REPO, "bench", "serving"))

from kvcompd_fixture import built_kvcompd  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
KVCOMPD = built_kvcompd()

import workload  # noqa: E402


def test_workload_is_seeded_and_prefixes_chain(tmp_path):
    a = workload.write_trace(str(tmp_path / "a.jsonl"), 3, workload.PRESETS["cpu"])
    b = workload.write_trace(str(tmp_path / "b.jsonl"), 3, workload.PRESETS["cpu"])
    assert a == b
    meta, reqs = workload.read_trace(str(tmp_path / "a.jsonl"))
    assert meta["seed"] == 3 and reqs == a
    p = workload.PRESETS["cpu"]
    assert len(reqs) == p["requests"]
    assert all(p["min_tokens"] <= r["tokens"] <= p["max_tokens"] for r in reqs)
    assert all(r["tokens"] == sum(n for _, n in r["segments"]) for r in reqs)
    # a conversation's later turn extends its earlier prompt: its chunk keys start with those of
    # the earlier one
    by_conversation = {}
    for r in reqs:
        by_conversation.setdefault(r["conversation"], []).append(r)
    chained = 0
    for turns in by_conversation.values():
        for x, y in zip(turns, turns[1:]):
            tx = workload.prompt_tokens(x["segments"], p["vocab"])
            ty = workload.prompt_tokens(y["segments"], p["vocab"])
            assert np.array_equal(ty[: len(tx)], tx)
            kx = workload.chunk_keys(tx, 32, "m")
            assert workload.chunk_keys(ty, 32, "m")[: len(kx)] == kx
            chained += 1
    assert chained > 0
    # arrivals: same order at every rate, scaled
    r1, r2 = workload.arrivals(reqs, 1.0), workload.arrivals(reqs, 4.0)
    assert np.all(np.diff(r1) >= 0) and np.allclose(r1, 4 * r2)
    with pytest.raises(ValueError):
        workload.arrivals(reqs, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"i": 0}\n')
    with pytest.raises(ValueError, match="not a trace"):
        workload.read_trace(str(bad))


def test_replay_counts_add_up():
    import serve
    reqs = [dict(gap=g) for g in (0.5, 0.1, 2.0, 0.2)]
    svc = [dict(tokens=100, ttft_s=0.3, busy_s=0.4), dict(tokens=200, ttft_s=0.5, busy_s=0.5),
           dict(tokens=100, ttft_s=0.1, busy_s=0.2), dict(tokens=300, ttft_s=0.2, busy_s=1.0)]
    # at 1 req/s: arrivals 0.5, 0.6, 2.6, 2.8; starts 0.5, 0.9, 2.6, 2.8
    rp = serve.replay(svc, reqs, 1.0)
    assert np.allclose(rp["ttft"], [0.3, 0.3 + 0.5, 0.1, 0.2])
    rows = serve.slo_table(svc, reqs, [1.0, 100.0], lambda n: n / 400)
    for row in rows:
        assert row["within"] + row["outside"] == row["total"] == 4
    assert rows[0]["within"] == 2  # 0.3 <= 0.25? no; 0.8 <= 0.5 no; 0.1 <= .25; 0.2 <= .75
    assert rows[1]["within"] <= rows[0]["within"]


@pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")
def test_serving_replay_cpu(tmp_path):
    import serve
    N = 8
    trace = tmp_path / "trace.jsonl"
    params = dict(workload.PRESETS["cpu"], requests=N, max_tokens=512)
    workload.write_trace(str(trace), 5, params)
    out = tmp_path / "serving"
    d = serve.main(["--trace", str(trace), "--model", "trained", "--device", "cpu",
                    "--kvcompd", KVCOMPD, "--chunk", "64", "--capacity-frac", "0",
                    "--rates", "0.5,5,50", "--slo-lengths", "128,512", "--threads", "1",
                    "--decode-every", "4", "--probe-lengths", "300",
                    "--quality", "1,1,320", "--out", str(out)])
    arms = d["arms"]
    for arm in serve.ARMS:
        assert "error" not in arms[arm], arms[arm].get("error")
        assert len(arms[arm]["service"]) == N
    expect = d["expected_held"]
    assert any(expect), "the trace has no reuse"
    # recompute never looks up; every store arm finds exactly what a keep-everything store holds
    assert all(s["held"] == 0 and s["hit"] == "miss" for s in arms["recompute"]["service"])
    for arm in ("raw", "codec", "evict"):
        svc = arms[arm]["service"]
        assert [s["held"] for s in svc] == expect, arm
        assert [s["fetched"] for s in svc] == expect, arm
        for s in svc:
            assert s["prefill_tokens"] == s["tokens"] - s["fetched"] * 64
            assert s["ttft_s"] <= s["busy_s"]
            if s["fetched"]:
                assert s["device_cache_bytes"] > 0
        # the full-hit probe: every chunk fetched the second time
        (p,) = arms[arm]["probes"]
        assert p["miss"]["fetched"] == 0 and p["hit"]["hit"] == "full"
    # eviction keeps about half of each fetched chunk's tokens; the others keep them all
    for s in arms["evict"]["service"]:
        if s["fetched"]:
            assert s["past_tokens"] < s["fetched"] * 64
    for s in arms["raw"]["service"]:
        assert s["past_tokens"] == s["fetched"] * 64
    # stored bytes (the same chunks put by every store arm): the codecs store less than raw;
    # eviction's MomentKV summaries (d x d per kv head and chunk) can outweigh what it evicts at
    # this model's 64-token chunks, so the eviction arm is compared with nothing here
    stored = {a: sum(s["stored_bytes"] for s in arms[a]["service"]) for a in serve.ARMS}
    assert stored["recompute"] == 0
    assert 0 < stored["codec"] < stored["raw"] and stored["evict"] > 0
    # the SLO counts add up at every rate, and within-SLO is what the TTFTs say
    slo = d["meta"]["slo_factor"]
    grid, pre = d["meta"]["slo_grid"], d["meta"]["unloaded_prefill_s"]
    for arm, table in [(x, t) for x in serve.ARMS for t in ("rates", "rates_overlapped")]:
        for row in arms[arm][table]:
            assert row["within"] + row["outside"] == row["total"] == N
            bounds = [slo * float(np.interp(s["tokens"], grid, pre))
                      for s in arms[arm]["service"]]
            assert row["within"] == sum(t <= b for t, b in zip(row["ttft"], bounds))
            assert all(t >= s["ttft_s"] - 1e-12 for t, s in zip(row["ttft"],
                                                                arms[arm]["service"]))
        w = [r["within"] for r in arms[arm][table]]
        assert w == sorted(w, reverse=True)  # more load never puts more within the SLO
    q = d["quality"]
    assert set(q) == set(serve.ARMS)
    assert q["raw"]["loss"] == pytest.approx(q["recompute"]["loss"])
    assert q["codec"]["bytes_per_token"] < q["raw"]["bytes_per_token"]
    for ext in (".json", ".md", ".png"):
        assert (tmp_path / ("serving" + ext)).stat().st_size > 0
    md = (tmp_path / "serving.md").read_text()
    assert "within SLO" in md and "Full-hit probes" in md
    assert json.loads((tmp_path / "serving.json").read_text())["meta"]["requests"] == N


@pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")
def test_serving_replay_deadline_still_writes_the_tables(tmp_path):
    import serve
    trace = tmp_path / "trace.jsonl"
    workload.write_trace(str(trace), 5, dict(workload.PRESETS["cpu"], requests=3,
                                              max_tokens=256))
    d = serve.main(["--trace", str(trace), "--model", "trained", "--device", "cpu",
                    "--kvcompd", KVCOMPD or "kvcompd", "--chunk", "64", "--arms", "recompute,raw",
                    "--rates", "1", "--slo-lengths", "128,256", "--threads", "1",
                    "--quality", "1,1,256", "--deadline-s", "0.001",
                    "--out", str(tmp_path / "s")])
    for arm in ("recompute", "raw"):
        assert d["arms"][arm]["error"].startswith("not run: past --deadline-s")
    assert d["quality"] == {} and d["meta"]["requests"] == 0
    assert "not run" in (tmp_path / "s.md").read_text()


def test_serving_replay_leaves_a_partial_record_when_cut_short(tmp_path, monkeypatch):
    # A run killed during an arm (its time limit) keeps the tables of the arms before it.
    import serve

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    trace = tmp_path / "trace.jsonl"
    workload.write_trace(str(trace), 5, dict(workload.PRESETS["cpu"], requests=3,
                                              max_tokens=256))
    monkeypatch.setattr(serve, "start_daemon", killed)
    with pytest.raises(KeyboardInterrupt):
        serve.main(["--trace", str(trace), "--model", "trained", "--device", "cpu",
                    "--kvcompd", KVCOMPD or "kvcompd", "--chunk", "64", "--arms", "recompute,raw",
                    "--rates", "1", "--slo-lengths", "128,256", "--threads", "1",
                    "--quality", "1,1,256", "--out", str(tmp_path / "s")])
    rec = json.loads((tmp_path / "s.json").read_text())
    assert "raw" in rec["meta"]["partial"] and rec["quality"] == {}
    assert len(rec["arms"]["recompute"]["service"]) == 3
    assert "Partial record" in (tmp_path / "s.md").read_text()
