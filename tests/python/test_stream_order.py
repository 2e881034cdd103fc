"""Stream order of every CUDA entry point of the Python binding (kvcomp/__init__.py, "Streams").

The producer is torch. Its K/V (and queries, and calibration values) are handed over while they
are still being written: the memory holds NaN, then torch's current stream gets a long queue of
work (a spin of ~0.3 s and a chain of large matmuls), and the real values are written by the last
op. Each entry point (compress, compress with KVSplice codecs, score, attention with a CUDA `out`,
calibrate, decompress) must read the written values: its result is compared with the CPU path on
the same values. Variants: the call on torch's default stream, on a side stream that is torch's
current stream, on an explicit `stream=` other than the producer's (DLPack's stream argument does
the ordering), and through __cuda_array_interface__ with its "stream" field. A control shows the
queue is long enough to catch an unordered read: an array handed over without a stream to wait
for is read before it is written.

Then a ~2 s spin on an unrelated stream: every entry point must return while it still runs
(no device-wide synchronisation); the times are printed (-s), not asserted.

Skipped where kvcomp has no CUDA device or torch has none (CI).
"""

import time

import numpy as np
import pytest

import kvcomp

try:  # kvcomp loaded its CUDA libraries first; a torch built for others may not load
    import torch
    _TORCH_CUDA = torch.cuda.is_available()
    _TORCH_WHY = "torch has no CUDA device"
except Exception as e:  # noqa: BLE001 - ImportError, OSError (undefined symbols), ...
    torch = None
    _TORCH_CUDA = False
    _TORCH_WHY = "torch does not import here: %s" % e

pytestmark = [
    pytest.mark.skipif(not kvcomp.cuda_available(), reason="kvcomp has no CUDA device"),
    pytest.mark.skipif(not _TORCH_CUDA, reason=_TORCH_WHY),
]

LAYERS, HEADS, TOKENS, D = 2, 8, 2048, 128
Q_HEADS, N_QUERIES = 32, 4
QUEUE_S = 0.3   # spin ahead of the producer's last op
UNRELATED_S = 2.0  # spin on an unrelated stream


# --- the producer ---

_CYCLES = []


def _cycles_per_second():
    """Clock of torch.cuda._sleep, measured once."""
    if not _CYCLES:
        torch.cuda._sleep(1000)  # load the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 50_000_000
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        _CYCLES.append(n / (start.elapsed_time(end) / 1e3))
    return _CYCLES[0]


def _spin(seconds):
    torch.cuda._sleep(int(seconds * _cycles_per_second()))


def _pending(sources, dtype=torch.float32):
    """CUDA tensors holding `sources` (NumPy float32) only after a long queue of work on torch's
    current stream: NaN until then. The queue is still running when this returns."""
    out = [torch.full(s.shape, float("nan"), dtype=dtype, device="cuda") for s in sources]
    src = [torch.from_numpy(s).to("cuda").to(dtype) for s in sources]
    _spin(QUEUE_S)
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(16):
        m = torch.tanh(m @ m)
    for o, s in zip(out, src):
        o.copy_(s)  # the last op
    return out


def _host(t):
    """A finished tensor as kvcomp's CPU path reads it: float32, or bf16 bits with dtype="bf16"."""
    torch.cuda.synchronize()
    if t.dtype == torch.bfloat16:
        return t.cpu().view(torch.int16).numpy().view(np.uint16), "bf16"
    return t.cpu().numpy(), None


def _kv(seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((LAYERS, HEADS, TOKENS, D)).astype(np.float32)
    v = rng.standard_normal((LAYERS, HEADS, TOKENS, D)).astype(np.float32)
    return k, v


# --- comparisons ---

def _same_cache(ref, got):
    """A cache from the CUDA path against the CPU's, under the "random" scorer (kept positions are
    a formula of the position on both): positions and kept rows identical, moments to fp32
    rounding (test_cuda_roundtrip's tolerance)."""
    assert ref.kept == got.kept
    for l in range(LAYERS):
        for h in range(HEADS):
            assert np.array_equal(ref.kept_positions(l, h), got.kept_positions(l, h)), (l, h)
            if kvcomp.cache_codecs(ref)["key_codec"] == "raw":
                assert np.array_equal(np.asarray(ref.keys(l, h)).view(np.uint8),
                                      np.asarray(got.keys(l, h)).view(np.uint8)), (l, h)
                assert np.array_equal(np.asarray(ref.values(l, h)).view(np.uint8),
                                      np.asarray(got.values(l, h)).view(np.uint8)), (l, h)
            if ref.has_moments:
                rc, rk, rv, rs = ref.moments(l, h)
                gc, gk, gv, gs = got.moments(l, h)
                assert rc == gc
                for a, b in ((rk, gk), (rv, gv), (rs, gs)):
                    scale = max(1.0, float(np.abs(a).max()))
                    assert np.all(np.isfinite(b)) and np.abs(b - a).max() / scale < 2e-4


POLICY = dict(scorer="random", seed=5, ratio=0.5, moments=True)


def _check_compress(k_dev, v_dev, **call):
    got = kvcomp.compress(k_dev, v_dev, kvcomp.Policy(**POLICY), backend="cuda", **call)
    (k, hint), (v, _) = _host(k_dev), _host(v_dev)
    ref = kvcomp.compress(k, v, kvcomp.Policy(**POLICY), dtype=hint)
    _same_cache(ref, got)


# --- every entry point reads after the producer's stream ---

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("producer", ["default stream", "side stream"])
def test_compress_reads_after_the_producer(dtype, producer):
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    k, v = _kv(1)
    if producer == "default stream":
        kd, vd = _pending([k, v], tdt)
        _check_compress(kd, vd)
    else:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # torch's current stream: the call runs on it
            kd, vd = _pending([k, v], tdt)
            _check_compress(kd, vd)


def test_compress_with_codecs_reads_after_the_producer():
    k, v = _kv(2)
    proj = kvcomp.calibrate(v, model_id="stream-order")
    policy = kvcomp.Policy(value_codec="orthogonal_int8", key_codec="int8", **POLICY)
    kd, vd = _pending([k, v])
    got = kvcomp.compress(kd, vd, policy, backend="cuda", projection=proj)
    ref = kvcomp.compress(k, v, policy, projection=proj)
    _same_cache(ref, got)
    # The encoded bytes of the same kept rows agree as in the CUDA round trip.
    from test_cuda_roundtrip import _compare_encoded
    _compare_encoded(ref, got, "orthogonal_int8", "stream order")
    # decompress on the CUDA backend, on torch's current stream.
    dk, dv = kvcomp.decompress(got, proj, backend="cuda",
                               stream=torch.cuda.current_stream())
    rk, rv = kvcomp.decompress(got, proj)
    assert np.array_equal(dk, rk)
    assert np.abs(dv - rv).max() <= 3e-3 * np.sqrt(np.mean(rv.astype(np.float64) ** 2)) + 1e-4


@pytest.mark.parametrize("scorer", ["knorm", "manifold"])
def test_score_reads_after_the_producer(scorer):
    k, _ = _kv(3)
    (kd,) = _pending([k])
    got = kvcomp.score(kd, scorer, backend="cuda")
    ref = kvcomp.score(k, scorer)
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - ref) <= 1e-4 * np.maximum(1.0, np.abs(ref)))


def test_attention_reads_after_the_producer_and_orders_its_output():
    k, v = _kv(4)
    cache = kvcomp.compress(k, v, kvcomp.Policy(ratio=0.5), num_q_heads=Q_HEADS)
    q = np.random.default_rng(5).standard_normal((Q_HEADS, N_QUERIES, D)).astype(np.float32)
    ref = kvcomp.attention(q, cache, 1)
    (qd,) = _pending([q])
    out = torch.full((Q_HEADS, N_QUERIES, D), float("nan"), device="cuda")
    r = kvcomp.attention(qd, cache, 1, backend="cuda", out=out)
    assert r is out
    after = (out * 1.0).cpu().numpy()  # a torch op on the same stream, then a copy: no sync
    np.testing.assert_allclose(after, ref, rtol=1e-4, atol=1e-4)
    # Without `out`: a NumPy result.
    (qd,) = _pending([q])
    np.testing.assert_allclose(kvcomp.attention(qd, cache, 1, backend="cuda"), ref,
                               rtol=1e-4, atol=1e-4)


def test_calibrate_reads_after_the_producer():
    _, v = _kv(6)
    ref = kvcomp.calibrate(v, rank=D, backend="cuda")  # host input, same backend
    (vd,) = _pending([v])
    got = kvcomp.calibrate(vd, rank=D, backend="cuda")
    assert np.all(np.isfinite(got.eigenvalues))
    top = ref.eigenvalues[..., :1]
    assert np.all(np.abs(got.eigenvalues - ref.eigenvalues) <= 1e-4 * top + 1e-6)
    with pytest.raises(ValueError, match="error_budget"):
        kvcomp.calibrate(vd, error_budget=0.05, backend="cuda")


def test_explicit_stream_is_ordered_through_dlpack():
    """The producer writes on the default stream, the call runs on another stream: torch's
    __dlpack__(stream=...) makes the call's stream wait."""
    k, v = _kv(7)
    kd, vd = _pending([k, v])
    other = torch.cuda.Stream()
    _check_compress(kd, vd, stream=other)
    kd, vd = _pending([k, v])
    _check_compress(kd, vd, stream=other.cuda_stream)


class _CudaArray:
    """An array seen only through __cuda_array_interface__ (as CuPy or Numba hand one over)."""

    def __init__(self, t, stream):
        self._t = t
        self.__cuda_array_interface__ = dict(t.__cuda_array_interface__)
        self.__cuda_array_interface__["version"] = 3
        if stream is None:
            self.__cuda_array_interface__.pop("stream", None)
        else:
            self.__cuda_array_interface__["stream"] = stream


def test_cuda_array_interface_stream_is_waited_for():
    k, v = _kv(8)
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        kd, vd = _pending([k, v])
    got = kvcomp.compress(_CudaArray(kd, producer.cuda_stream), _CudaArray(vd, producer.cuda_stream),
                          kvcomp.Policy(**POLICY), backend="cuda")
    producer.synchronize()
    _same_cache(kvcomp.compress(k, v, kvcomp.Policy(**POLICY)), got)


def test_control_an_unordered_read_sees_the_pending_writes():
    """Handed over with no stream to wait for, the arrays are read while the queue still runs:
    the NaN they hold until the last op is seen. (Shows the queue is long enough for the tests
    above to catch a missing wait.)"""
    k, v = _kv(9)
    kd, vd = _pending([k, v])
    try:
        got = kvcomp.compress(_CudaArray(kd, None), _CudaArray(vd, None),
                              kvcomp.Policy(**POLICY), backend="cuda")
    except ValueError as e:  # the data check saw the NaN
        assert "NaN or Inf" in str(e)
        return
    finally:
        torch.cuda.synchronize()
    with pytest.raises(AssertionError):  # or the cache holds it
        _same_cache(kvcomp.compress(k, v, kvcomp.Policy(**POLICY)), got)


# --- no device-wide synchronisation ---

def test_a_kernel_on_an_unrelated_stream_does_not_delay_the_calls():
    k, v = _kv(10)
    proj = kvcomp.calibrate(v, model_id="stream-order")
    kd = torch.from_numpy(k).cuda()
    vd = torch.from_numpy(v).cuda()
    q = torch.randn(Q_HEADS, N_QUERIES, D, device="cuda")
    out = torch.empty_like(q)
    raw = kvcomp.Policy(**POLICY)
    coded = kvcomp.Policy(value_codec="orthogonal_int8", key_codec="int8", **POLICY)
    host_cache = kvcomp.compress(k, v, raw, num_q_heads=Q_HEADS)
    coded_cache = kvcomp.compress(k, v, coded, projection=proj)
    calls = {
        "compress": lambda: kvcomp.compress(kd, vd, raw, backend="cuda"),
        "compress+codecs": lambda: kvcomp.compress(kd, vd, coded, backend="cuda", projection=proj),
        "score": lambda: kvcomp.score(kd, "knorm", backend="cuda"),
        "attention": lambda: kvcomp.attention(q, host_cache, 0, backend="cuda", out=out),
        "calibrate": lambda: kvcomp.calibrate(vd, rank=D, backend="cuda"),
        "decompress": lambda: kvcomp.decompress(coded_cache, proj, backend="cuda"),
    }
    for f in calls.values():  # warm: backends, library handles, projection uploads
        f()
    torch.cuda.synchronize()
    unrelated = torch.cuda.Stream()
    times = {}
    for name, f in calls.items():
        with torch.cuda.stream(unrelated):
            _spin(UNRELATED_S)
        t0 = time.perf_counter()
        f()
        times[name] = time.perf_counter() - t0
        still_running = not unrelated.query()
        unrelated.synchronize()
        assert still_running, "%s waited for a kernel on an unrelated stream" % name
    print("\ncall times with a %.1f s kernel on an unrelated stream: %s" % (
        UNRELATED_S, ", ".join("%s %.1f ms" % (n, t * 1e3) for n, t in times.items())))
