"""The Python SDK, CLI and examples against real kvcompd processes on loopback."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvcomp  # noqa: E402
from kvcompd_fixture import Kvcompd, built_kvcompd, sigstop  # noqa: E402

KVCOMPD = built_kvcompd()
pytestmark = pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")

MODEL = "test/model"
LAYERS, KV, Q, D, N = 2, 2, 4, 64, 300


def endpoint(d):
    return f"{d.data_endpoint},127.0.0.1:{d.control_port}"


def cache(seed=0, dtype=np.float16, tokens=N):
    rng = np.random.default_rng(seed)
    shape = (LAYERS, KV, tokens, D)
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


@pytest.fixture(scope="module")
def daemon():
    with Kvcompd(KVCOMPD) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon):
    return kvcomp.Client(endpoint(daemon), timeout=30.0)


def test_put_with_a_recent_fraction_keeps_what_the_engine_keeps(client):
    k, v = cache(7)
    policy = kvcomp.Policy(ratio=0.75, recent_fraction=0.5, moments=False)
    client.put(MODEL, "recent", k, v, policy=policy, num_q_heads=Q)
    c = client.get(MODEL, "recent")
    assert c.policy == policy
    local = kvcomp.compress(k, v, policy, num_q_heads=Q)
    window = policy.effective_recent(policy.kept_per_head(N))
    assert window > 0
    for layer in range(LAYERS):
        for h in range(KV):
            pos = c.kept_positions(layer, h)
            np.testing.assert_array_equal(pos, local.kept_positions(layer, h))
            assert set(range(N - window, N)) <= set(pos.tolist())
    client.delete(MODEL, "recent")


def test_put_get_lookup_delete(client):
    k, v = cache(1)
    policy = kvcomp.Policy(scorer="knorm", ratio=0.5, moments=True)
    r = client.put(MODEL, "k1", k, v, policy=policy, num_q_heads=Q)
    assert r["original_bytes"] == k.nbytes + v.nbytes
    assert 0 < r["stored_bytes"] < r["original_bytes"]
    c = client.get(MODEL, "k1")
    assert isinstance(c, kvcomp.CompressedCache)
    assert c.original_nbytes == r["original_bytes"] and c.nbytes == r["stored_bytes"]
    # What the daemon kept is what the engine keeps on the same input and policy.
    local = kvcomp.compress(k, v, policy, num_q_heads=Q)
    for layer in range(LAYERS):
        for h in range(KV):
            np.testing.assert_array_equal(c.kept_positions(layer, h),
                                          local.kept_positions(layer, h))
            pos = c.kept_positions(layer, h)
            np.testing.assert_array_equal(np.asarray(c.keys(layer, h)).astype(np.float16),
                                          k[layer, h, pos])
    assert client.get_bytes(MODEL, "k1") == c.to_bytes()
    info = client.lookup(MODEL, "k1")
    assert info["original_tokens"] == N and info["q_heads"] == Q and info["dtype"] == "f16"
    assert info["stored_bytes"] == r["stored_bytes"]
    client.delete(MODEL, "k1")
    with pytest.raises(KeyError):
        client.get(MODEL, "k1")
    with pytest.raises(KeyError):
        client.delete(MODEL, "k1")


def test_put_stream_in_token_blocks_and_block_wise(client):
    k, v = cache(2)
    for block_wise in (False, True):
        key = f"stream-{block_wise}"
        policy = kvcomp.Policy(scorer="keydiff", ratio=0.5, block_size=128)
        with client.put_stream(MODEL, key, layers=LAYERS, kv_heads=KV, head_dim=D, tokens=N,
                               dtype="f16", policy=policy, block_wise=block_wise) as s:
            for b0 in range(0, N, 128):
                for layer in range(LAYERS):
                    s.append(layer, np.ascontiguousarray(k[layer, :, b0:b0 + 128]),
                             np.ascontiguousarray(v[layer, :, b0:b0 + 128]), token_begin=b0)
        assert s.result["total_kept"] == LAYERS * KV * (N // 2)
        got = client.get(MODEL, key)
        assert got.original_nbytes == k.nbytes + v.nbytes


def test_stream_aborted_on_error_leaves_nothing(client):
    k, v = cache(3)
    with pytest.raises(RuntimeError):
        with client.put_stream(MODEL, "aborted", layers=LAYERS, kv_heads=KV, head_dim=D,
                               tokens=N, dtype="f16") as s:
            s.append(0, k[0], v[0])
            raise RuntimeError("prefill failed")
    with pytest.raises(KeyError):
        client.lookup(MODEL, "aborted")


def test_bf16_and_f32_inputs(client):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    k, v = cache(4, np.float32)
    r = client.put(MODEL, "f32", k, v)
    assert r["original_bytes"] == k.nbytes * 2
    kb, vb = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    r = client.put(MODEL, "bf16", kb, vb)
    assert client.lookup(MODEL, "bf16")["dtype"] == "bf16"
    r2 = client.put(MODEL, "bf16-raw", kb.view(np.uint16), vb.view(np.uint16))
    assert r2["stored_bytes"] == r["stored_bytes"]


def test_bad_arguments_raise_clear_exceptions(client):
    k, v = cache(5)
    with pytest.raises(ValueError, match="contiguous"):
        client.put(MODEL, "bad", k[:, :, ::2], v[:, :, ::2])
    with pytest.raises(ValueError, match="dtype"):
        client.put(MODEL, "bad", k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(ValueError, match="shape"):
        client.put(MODEL, "bad", k, v[:, :, :10].copy())
    with pytest.raises(ValueError, match="dtype"):
        client.put(MODEL, "bad", k, v.astype(np.float32))
    with pytest.raises(ValueError):
        client.put(MODEL, "bad", k[..., :48].copy(), v[..., :48].copy())  # head_dim 48
    with pytest.raises(ValueError):
        client.put(MODEL, "", k, v)  # empty key
    with pytest.raises(TypeError):
        client.put(MODEL, 17, k, v)
    with pytest.raises(ValueError):
        client.put(MODEL, "bad", k, v, policy=kvcomp.Policy(ratio=0.5, rank=8))
    s = client.put_stream(MODEL, "bad-stream", layers=LAYERS, kv_heads=KV, head_dim=D, tokens=N,
                          dtype="f16")
    with pytest.raises(ValueError):
        s.append(LAYERS, k[0], v[0])  # layer out of range
    with pytest.raises(ValueError):
        s.append(0, k[0][:1], v[0][:1])  # wrong kv heads
    s.abort()


def test_stats_and_ranking(client, daemon):
    k, v = cache(6)
    client.put(MODEL, "stats", k, v)
    st = client.stats()
    assert len(st) == 1 and st[0]["ok"], st
    assert st[0]["caches"] >= 1 and st[0]["stored_bytes"] > 0
    assert client.ranking(MODEL, "stats") == [daemon.data_endpoint]


def test_calibrate_then_put_with_kvsplice(client):
    # Low-rank values: the daemon's projection (fitted from stored raw caches) keeps them.
    model = "test/kvsplice"
    rng = np.random.default_rng(7)
    basis = [np.linalg.qr(rng.standard_normal((D, D)))[0][:, :12] for _ in range(LAYERS * KV)]

    def low_rank(seed):
        r = np.random.default_rng(seed)
        k = r.standard_normal((LAYERS, KV, N, D)).astype(np.float16)
        v = np.empty((LAYERS, KV, N, D), np.float32)
        for i in range(LAYERS * KV):
            v[i // KV, i % KV] = r.standard_normal((N, 12)) @ basis[i].T
        return k, (v + 0.01 * r.standard_normal(v.shape)).astype(np.float16)

    raw = kvcomp.Policy(ratio=0.5)
    for i in range(2):
        client.put(model, f"raw{i}", *low_rank(10 + i), policy=raw, num_q_heads=Q)
    with pytest.raises(ValueError):
        client.calibrate(model)  # neither rank nor error budget
    with pytest.raises(ValueError):
        client.calibrate(model, rank=8, error_budget=0.1)
    res = client.calibrate(model, error_budget=0.05)
    assert len(res) == 1 and res[0]["ok"], res
    assert res[0]["caches_used"] == 2 and res[0]["projection_version"] != 0
    assert 12 <= res[0]["rank"] < D and res[0]["achieved_error"] <= 0.05
    assert len(res[0]["layer_ranks"]) == LAYERS and max(res[0]["layer_ranks"]) == res[0]["rank"]
    assert not client.calibrate("test/nothing-stored", rank=8)[0]["ok"]

    k, v = low_rank(20)
    enc = kvcomp.Policy(ratio=0.5, key_codec="int8", value_codec="orthogonal_int8")
    r_enc = client.put(model, "enc", k, v, policy=enc, num_q_heads=Q)
    r_raw = client.put(model, "raw", k, v, policy=raw, num_q_heads=Q)
    assert r_enc["stored_bytes"] < 0.6 * r_raw["stored_bytes"]  # moments are the same in both
    c = client.get(model, "enc")
    info = kvcomp.cache_codecs(c)
    assert info["value_codec"] == "orthogonal_int8"
    assert info["projection_version"] == res[0]["projection_version"]
    d = client.get(model, "enc", decoded=True)
    for layer in range(LAYERS):
        for h in range(KV):
            pos = d.kept_positions(layer, h)
            got = np.asarray(d.values(layer, h)).astype(np.float32)
            want = v[layer, h, pos].astype(np.float32)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.06
    for key in ("raw0", "raw1", "enc", "raw"):
        client.delete(model, key)


def test_wrong_token_is_permission_error():
    tokens = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvcomp-tokens-{os.getpid()}")
    with open(tokens, "w") as f:
        f.write("team-a: secret-a\n")
    try:
        with Kvcompd(KVCOMPD, token_file=tokens) as d:
            ok = kvcomp.Client(d.data_endpoint, tenant="team-a", token="secret-a")
            k, v = cache(7)
            ok.put(MODEL, "x", k, v)
            with pytest.raises(PermissionError):
                kvcomp.Client(d.data_endpoint, tenant="team-a", token="wrong")
            other = None
            try:
                other = kvcomp.Client(d.data_endpoint, tenant="team-b", token="secret-a")
            except PermissionError:
                pass
            if other is not None:
                with pytest.raises((KeyError, PermissionError)):
                    other.get(MODEL, "x")
    finally:
        os.remove(tokens)


def test_timeout_on_a_stalled_daemon():
    with Kvcompd(KVCOMPD) as d:
        c = kvcomp.Client(d.data_endpoint, timeout=1.0, connect_timeout=1.0)
        k, v = cache(8)
        c.put(MODEL, "t", k, v)
        sigstop(d.proc)
        try:
            t0 = time.time()
            with pytest.raises((TimeoutError, ConnectionError)):
                c.lookup(MODEL, "t")
            assert time.time() - t0 < 15
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)


def test_three_daemons_failover():
    ds = [Kvcompd(KVCOMPD).start() for _ in range(3)]
    try:
        eps = [endpoint(d) for d in ds]
        c = kvcomp.Client(eps, replicas=2, timeout=5.0, connect_timeout=2.0)
        k, v = cache(9)
        keys = [f"f{i}" for i in range(12)]
        for key in keys:
            r = c.put(MODEL, key, k, v)
            assert len(r["endpoints"]) == 2
            assert r["endpoints"] == [e.split(",")[0] for e in c.ranking(MODEL, key)[:2]]
        # Kill the first-ranked endpoint of the first key mid-run.
        victim_ep = c.ranking(MODEL, keys[0])[0]
        victim = next(d for d in ds if d.data_endpoint == victim_ep.split(",")[0])
        victim.stop(signal.SIGKILL)
        for key in keys:  # every cache still readable from its other replica
            got = c.get(MODEL, key)
            assert got.original_nbytes == k.nbytes + v.nbytes
        r = c.put(MODEL, "after-kill", k, v)  # writes go to the survivors
        assert victim.data_endpoint not in r["endpoints"] and len(r["endpoints"]) == 2
        assert c.get(MODEL, "after-kill").nbytes == r["stored_bytes"]
        st = c.stats()
        assert sum(1 for s in st if s["ok"]) == 2
    finally:
        for d in ds:
            d.close()


def run_py(args, **kw):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "client", "python"))
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env,
                          timeout=120, **kw)


def test_cli_put_get_lookup_delete_stats_loadgen(daemon, tmp_path):
    k, v = cache(10)
    np.save(tmp_path / "k.npy", k)
    np.save(tmp_path / "v.npy", v)
    ep = ["-e", endpoint(daemon)]
    r = run_py(["-m", "kvcomp", "put", *ep, "-m", MODEL, "-k", "cli", "--keys",
                str(tmp_path / "k.npy"), "--values", str(tmp_path / "v.npy"), "--policy",
                "scorer=knorm,ratio=0.75"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["total_kept"] == LAYERS * KV * int(N * 0.25)
    from safetensors.numpy import save_file
    save_file({"keys": k, "values": v}, str(tmp_path / "c.safetensors"))
    r = run_py(["-m", "kvcomp", "put", *ep, "-m", MODEL, "-k", "cli-st", "--safetensors",
                str(tmp_path / "c.safetensors")])
    assert r.returncode == 0, r.stderr
    r = run_py(["-m", "kvcomp", "get", *ep, "-m", MODEL, "-k", "cli", "--out",
                str(tmp_path / "c.kvc"), "--npz", str(tmp_path / "c.npz")])
    assert r.returncode == 0, r.stderr
    got = kvcomp.CompressedCache.from_bytes((tmp_path / "c.kvc").read_bytes())
    assert got.original_nbytes == k.nbytes * 2
    npz = np.load(tmp_path / "c.npz")
    np.testing.assert_array_equal(npz["layer1.head1.positions"], got.kept_positions(1, 1))
    r = run_py(["-m", "kvcomp", "lookup", *ep, "-m", MODEL, "-k", "cli"])
    assert r.returncode == 0 and json.loads(r.stdout)["original_tokens"] == N
    r = run_py(["-m", "kvcomp", "stats", *ep])
    assert r.returncode == 0 and json.loads(r.stdout)[0]["ok"]
    r = run_py(["-m", "kvcomp", "calibrate", *ep, "-m", MODEL, "--rank", "16"])
    assert r.returncode == 0, r.stderr
    cal = json.loads(r.stdout)[0]
    assert cal["ok"] and cal["rank"] == 16 and cal["layer_ranks"] == [16] * LAYERS
    r = run_py(["-m", "kvcomp", "calibrate", *ep, "-m", "test/none-stored", "--rank", "16"])
    assert r.returncode == 1 and not json.loads(r.stdout)[0]["ok"]
    r = run_py(["-m", "kvcomp", "calibrate", *ep, "-m", MODEL])  # neither rank nor budget
    assert r.returncode == 2
    # the pq calibration needs neither (the bases are fitted at --key-bits / --value-bits)
    r = run_py(["-m", "kvcomp", "calibrate", *ep, "-m", MODEL, "--value-codec", "pq"])
    assert r.returncode == 0, r.stderr
    cal = json.loads(r.stdout)[0]
    assert cal["ok"] and cal["projection_version"] != 0, cal
    r = run_py(["-m", "kvcomp", "delete", *ep, "-m", MODEL, "-k", "cli"])
    assert r.returncode == 0
    r = run_py(["-m", "kvcomp", "lookup", *ep, "-m", MODEL, "-k", "cli"])
    assert r.returncode == 1 and "KeyError" in r.stderr
    r = run_py(["-m", "kvcomp", "loadgen", *ep, "--requests", "6", "--concurrency", "2",
                "--layers", "2", "--tokens", "256", "--get"])
    assert r.returncode == 0, r.stderr
    lg = json.loads(r.stdout)
    assert lg["errors"] == 0 and lg["put_ms_p50"] > 0 and lg["get_ms_p99"] > 0


def test_examples_run(daemon):
    ep = ["--endpoint", daemon.data_endpoint]
    r = run_py([os.path.join(REPO, "examples", "prefill_push.py"), *ep, "--key", "ex",
                "--layers", "2", "--tokens", "512"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ratio"] > 1.2  # 512 tokens: the d x d moment sums weigh in
    r = run_py([os.path.join(REPO, "examples", "decode_pull.py"), *ep, "--key", "ex"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["attention_shape"] == [32, 1, 128]
    assert out["correction_changed_output"] > 0
    build = os.environ.get("KVCOMP_BUILD_DIR") or os.path.dirname(os.path.dirname(KVCOMPD))
    exe = os.path.join(build, "examples", "kvcomp_example_put_get")
    if not os.path.exists(exe):
        pytest.fail(f"C++ example not built at {exe}")
    r = subprocess.run([exe, daemon.data_endpoint, "512"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "stored" in r.stdout
