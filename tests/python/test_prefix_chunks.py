"""Prefix and chunk reuse through the Python SDK and the CLI against three real kvcompd
processes on loopback: lookup_prefix, put_chunks/get_chunks, composition of chunks (lossless
exactly, int8 keys and KVSplice values within the codecs' error, moments summed), tenants."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvcomp
from kvcomp.chunks import assemble, run_moments
from kvcompd_fixture import Kvcompd, built_kvcompd

KVCOMPD = built_kvcompd()
pytestmark = pytest.mark.skipif(KVCOMPD is None, reason="kvcompd not built")

MODEL = "test/prefix"
LAYERS, KV, Q, D, CHUNK, CHUNKS = 2, 2, 4, 64, 16, 6
LOSSLESS = dict(ratio=0.0, moments=False)


def endpoint(d):
    return f"{d.data_endpoint},127.0.0.1:{d.control_port}"


def chained(seed, n):
    """Chained block hashes: key i names the whole prefix up to chunk i."""
    out, h = [], hashlib.sha256(f"seed-{seed}".encode()).digest()
    for i in range(n):
        h = hashlib.sha256(h + f"block-{i}".encode()).digest()
        out.append(h)
    return out


def prompt(seed, tokens=CHUNK * CHUNKS, dtype=np.float16):
    rng = np.random.default_rng(seed)
    shape = (LAYERS, KV, tokens, D)
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    p.write_text("alpha: secret-a\nbeta: secret-b\n")
    return str(p)


@pytest.fixture(scope="module")
def pool(tokens_file):
    ds = [Kvcompd(KVCOMPD, token_file=tokens_file) for _ in range(3)]
    for d in ds:
        d.__enter__()
    yield ds
    for d in ds:
        d.__exit__(None, None, None)


def client_of(pool, tenant="alpha", token="secret-a"):
    return kvcomp.Client([endpoint(d) for d in pool], tenant=tenant, token=token, timeout=30.0)


def test_lookup_prefix_over_three_daemons(pool):
    c = client_of(pool)
    # Where a chunk lands depends on the daemons' ports: take the first chain whose stored
    # chunks land on at least two daemons, so lookups and gets cross the pool.
    keys = next(ks for ks in (chained(q, CHUNKS + 2) for q in range(1000, 1200))
                if len({c.ranking(MODEL, k)[0] for k in ks[:CHUNKS]}) >= 2)
    assert c.lookup_prefix(MODEL, keys) == 0
    assert c.lookup_prefix(MODEL, []) == 0
    k, v = prompt(1)
    res = c.put_chunks(MODEL, keys[:CHUNKS], k, v, CHUNK, policy=kvcomp.Policy(**LOSSLESS))
    assert len(res) == CHUNKS and len({e for r in res for e in r["endpoints"]}) >= 2
    assert c.lookup_prefix(MODEL, keys) == CHUNKS
    c.delete(MODEL, keys[3])
    assert c.lookup_prefix(MODEL, keys) == 3
    # Resume from the first missing chunk.
    c.put_chunks(MODEL, keys[:CHUNKS], k, v, CHUNK, first=3, policy=kvcomp.Policy(**LOSSLESS))
    assert c.lookup_prefix(MODEL, keys) == CHUNKS
    # Another tenant sees none of it.
    assert client_of(pool, "beta", "secret-b").lookup_prefix(MODEL, keys) == 0
    assert client_of(pool, "beta", "secret-b").get_chunks(MODEL, keys) == []
    with pytest.raises(PermissionError):
        client_of(pool, "beta", "wrong").lookup_prefix(MODEL, keys)
    with pytest.raises(ValueError):
        c.lookup_prefix(MODEL, [b""])
    with pytest.raises(ValueError):
        c.put_chunks(MODEL, keys[:2], k, v, CHUNK)  # 6 chunks of tokens, 2 keys


def test_lossless_chunks_decode_exactly_as_the_whole(pool):
    c = client_of(pool)
    keys = chained(2, CHUNKS)
    for dtype in (np.float16, np.float32):
        k, v = prompt(2, dtype=dtype)
        model = f"{MODEL}-{np.dtype(dtype).name}"
        c.put_chunks(model, keys, k, v, CHUNK, policy=kvcomp.Policy(**LOSSLESS))
        c.put(model, "whole", k, v, policy=kvcomp.Policy(**LOSSLESS))
        wk, wv = kvcomp.decompress(c.get(model, "whole"))
        for decoded in (False, True):
            chunks = c.get_chunks(model, keys, decoded=decoded)
            assert len(chunks) == CHUNKS
            ck, cv = assemble(chunks)
            np.testing.assert_array_equal(ck, wk)
            np.testing.assert_array_equal(cv, wv)
            np.testing.assert_array_equal(ck, k.astype(np.float32))
        raw = c.get_chunk_bytes(model, keys)
        assert [kvcomp.CompressedCache.from_bytes(b) for b in raw] == c.get_chunks(model, keys)


def test_chunk_puts_in_flight_store_the_same_chunks(pool):
    # Several chunk puts at once (over the pool's daemons): the same results, in order, and the
    # same chunks as one after another; a bad bound is refused before anything is sent.
    c = client_of(pool)
    keys = chained(4, CHUNKS)
    k, v = prompt(4)
    model = f"{MODEL}-in-flight"
    res = c.put_chunks(model, keys, k, v, CHUNK, policy=kvcomp.Policy(**LOSSLESS),
                       max_in_flight=4)
    assert len(res) == CHUNKS
    assert [r["original_bytes"] for r in res] == [res[0]["original_bytes"]] * CHUNKS
    assert c.lookup_prefix(model, keys) == CHUNKS
    ck, cv = assemble(c.get_chunks(model, keys))
    np.testing.assert_array_equal(ck, k.astype(np.float32))
    np.testing.assert_array_equal(cv, v.astype(np.float32))
    with pytest.raises(ValueError, match="max_in_flight"):
        c.put_chunks(model, keys, k, v, CHUNK, max_in_flight=0)
    # A failing chunk (another tenant's credentials) fails the call after every put has ended.
    with pytest.raises(PermissionError):
        client_of(pool, "alpha", "wrong").put_chunks(model, keys, k, v, CHUNK, max_in_flight=3)


def test_lossy_chunks_within_the_codec_error(pool):
    c = client_of(pool)
    model = f"{MODEL}-lossy"
    rng = np.random.default_rng(3)
    basis = [np.linalg.qr(rng.standard_normal((D, D)))[0][:, :12] for _ in range(LAYERS * KV)]

    def low_rank(seed, tokens):
        r = np.random.default_rng(seed)
        k = r.standard_normal((LAYERS, KV, tokens, D)).astype(np.float16)
        v = np.empty((LAYERS, KV, tokens, D), np.float32)
        for i in range(LAYERS * KV):
            v[i // KV, i % KV] = r.standard_normal((tokens, 12)) @ basis[i].T
        return k, (v + 0.01 * r.standard_normal(v.shape)).astype(np.float16)

    for i in range(2):  # raw-value caches the daemons calibrate on
        for d in pool:
            one = kvcomp.Client(endpoint(d), tenant="alpha", token="secret-a")
            one.put(model, f"cal{i}", *low_rank(30 + i, 256), policy=kvcomp.Policy(ratio=0.0))
    res = c.calibrate(model, error_budget=0.05)
    assert all(r["ok"] for r in res), res
    keys = chained(3, CHUNKS)
    k, v = low_rank(40, CHUNK * CHUNKS)
    enc = kvcomp.Policy(ratio=0.0, key_codec="int8", value_codec="orthogonal_int8",
                        moments=False)
    c.put_chunks(model, keys, k, v, CHUNK, policy=enc)
    stored = c.get_chunks(model, keys)
    assert all(kvcomp.cache_codecs(s)["value_codec"] == "orthogonal_int8" for s in stored)
    ck, cv = assemble(c.get_chunks(model, keys, decoded=True))
    kf, vf = k.astype(np.float32), v.astype(np.float32)
    # int8 keys: per-channel scales fitted per chunk; values: the calibrated budget.
    key_err = np.abs(ck - kf).max() / np.abs(kf).max()
    val_err = np.linalg.norm(cv - vf) / np.linalg.norm(vf)
    assert key_err < 1.0 / 127 + 1e-3, key_err
    assert val_err < 0.06, val_err


def test_moments_of_a_run_are_the_sum_of_its_chunks(pool):
    c = client_of(pool)
    keys = chained(4, CHUNKS)
    k, v = prompt(4)
    pol = kvcomp.Policy(scorer="knorm", ratio=0.5, n_sink=0, moments=True)
    c.put_chunks(MODEL, keys, k, v, CHUNK, policy=pol)
    chunks = c.get_chunks(MODEL, keys)
    mom = run_moments(chunks)
    kf, vf = k.astype(np.float64), v.astype(np.float64)
    for layer in range(LAYERS):
        for h in range(KV):
            kept = np.concatenate([ch.kept_positions(layer, h) + i * CHUNK
                                   for i, ch in enumerate(chunks)])
            ev = np.setdiff1d(np.arange(CHUNK * CHUNKS), kept)
            n, ks, vs, vk = mom[layer][h]
            assert n == len(ev) == CHUNK * CHUNKS // 2
            np.testing.assert_allclose(ks, kf[layer, h, ev].sum(0), atol=1e-3)
            np.testing.assert_allclose(vs, vf[layer, h, ev].sum(0), atol=1e-3)
            np.testing.assert_allclose(vk, vf[layer, h, ev].T @ kf[layer, h, ev], atol=1e-3)


def run_cli(args):
    env = dict(os.environ, KVCOMP_TENANT="alpha", KVCOMP_TOKEN="secret-a")
    return subprocess.run([sys.executable, "-m", "kvcomp", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_cli_prefix_put_and_get_chunks(pool, tmp_path):
    k, v = prompt(5)
    np.save(tmp_path / "k.npy", k)
    np.save(tmp_path / "v.npy", v)
    keys = [h.hex() for h in chained(5, CHUNKS)]
    (tmp_path / "keys.txt").write_text("\n".join(f"hex:{h}" for h in keys) + "\n")
    ep = [a for d in pool for a in ("-e", endpoint(d))]
    kf = ["--chunk-keys-file", str(tmp_path / "keys.txt")]
    r = run_cli(["prefix", *ep, "-m", MODEL, *kf])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"held": 0, "asked": CHUNKS}
    r = run_cli(["put-chunks", *ep, "-m", MODEL, *kf, "--chunk-tokens", str(CHUNK),
                 "--keys", str(tmp_path / "k.npy"), "--values", str(tmp_path / "v.npy"),
                 "--policy", "ratio=0,moments=false"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["chunks"] == CHUNKS
    r = run_cli(["prefix", *ep, "-m", MODEL, *kf])
    assert json.loads(r.stdout)["held"] == CHUNKS
    r = run_cli(["get-chunks", *ep, "-m", MODEL, *kf, "--npz", str(tmp_path / "run.npz")])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == CHUNK * CHUNKS
    np.testing.assert_array_equal(np.load(tmp_path / "run.npz")["keys"], k.astype(np.float32))
    r = run_cli(["prefix", *ep, "-m", MODEL, "--chunk-keys", ",".join(keys[:2]) + ",nope"])
    assert r.returncode == 0 and json.loads(r.stdout)["held"] == 0  # not the hex: keys
    r = run_cli(["prefix", *ep, "-m", MODEL])
    assert r.returncode != 0
