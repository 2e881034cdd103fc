"""kvcomp's codecs as an LMCache serde (kvcomp.integrations.lmcache), against the lmcache
package's own classes on CPU: the serde built by name through LMCache's factory
(create_serde_processor on a SerdeConfig, as an L2 adapter's "serde" entry does), its
AsyncSerdeProcessor running kvcomp's serializer and deserializer, real TensorMemoryObj chunks
in LMCache's KV_2LTD format. Runs where lmcache is installed (scripts/test_lmcache.sh)."""

import time

import pytest

torch = pytest.importorskip("torch")


def _lmcache():
    try:
        import lmcache.v1.distributed.serde  # noqa: F401
        import lmcache.v1.memory_management  # noqa: F401
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _lmcache(), reason="lmcache not installed "
                                "(scripts/test_lmcache.sh)")

LAYERS, HEADS, D, TOKENS = 4, 2, 64, 256


def memobj(shape, dtype, data=None, fmt="KV_2LTD"):
    """A CPU TensorMemoryObj as LMCache's allocators make them (flat bytes + metadata)."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    shape = torch.Size(shape)
    nbytes = shape.numel() * dtype.itemsize
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    meta = MemoryObjMetadata(shape=shape, dtype=dtype, address=0, phy_size=nbytes,
                             ref_count=1, fmt=getattr(MemoryFormat, fmt), shapes=[shape],
                             dtypes=[dtype])
    obj = TensorMemoryObj(raw, meta, None)
    if data is not None:
        obj.tensor.copy_(data)
    return obj


def run(proc, submit, query, src, dst, key):
    tid = submit([src], [dst], [key])
    t0 = time.monotonic()
    while (res := query(tid)) is None:
        assert time.monotonic() - t0 < 60
        time.sleep(0.001)
    return res


def roundtrip(codec, dtype, seed=0):
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    import kvcomp.integrations.lmcache  # noqa: F401 - registers "kvcomp"

    proc = create_serde_processor(SerdeConfig(type="kvcomp",
                                              kwargs={"codec": codec, "head_dim": D}))
    shape = (2, LAYERS, TOKENS, HEADS * D)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    src = memobj(shape, dtype, x)
    est = proc.estimate_serialized_size(MemoryLayoutDesc([torch.Size(shape)], [dtype]))
    buf = memobj((est,), torch.uint8, fmt="BINARY")
    key = ObjectKey(chunk_hash=b"h" * 32, model_name="test/lmcache", kv_rank=0)
    assert run(proc, proc.submit_serialize, proc.query_serialize_result, src, buf, key)
    stored = buf.get_size()  # narrowed to the bytes written
    out = memobj(shape, dtype)
    assert run(proc, proc.submit_deserialize, proc.query_deserialize_result, buf, out, key)
    proc.close()
    return x, out.tensor, stored, buf


def test_lossless_is_bit_exact():
    from lmcache.v1.distributed.serde import get_registered_serde_types

    x, y, stored, _ = roundtrip("lossless", torch.bfloat16)
    assert "kvcomp" in get_registered_serde_types()
    assert torch.equal(x, y)
    assert stored >= x.numel() * 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_keys_within_the_codec_error(dtype):
    x, y, stored, _ = roundtrip("int8", dtype, seed=1)
    assert torch.equal(x[1], y[1])  # values as they were
    kx, ky = x[0].float(), y[0].float()
    err = (kx - ky).abs().max() / kx.abs().max()
    assert 0 < err < 0.5 / 127 + 8e-3, err
    assert stored < 0.8 * x.numel() * 2  # int8 keys: about 3/4 of the chunk's bytes


def test_corrupt_bytes_fail_the_task():
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    x, _, stored, buf = roundtrip("int8", torch.float16, seed=2)
    buf.tensor.view(torch.uint8)[stored // 2] ^= 4
    proc = create_serde_processor(SerdeConfig(type="kvcomp", kwargs={"head_dim": D}))
    out = memobj(x.shape, torch.float16)
    before = out.tensor.clone()
    key = ObjectKey(chunk_hash=b"h" * 32, model_name="test/lmcache", kv_rank=0)
    assert run(proc, proc.submit_deserialize, proc.query_deserialize_result, buf, out,
               key) is False
    assert torch.equal(out.tensor, before)  # nothing written from a corrupt chunk
    proc.close()


def test_bad_options_and_chunks_are_refused():
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    import kvcomp.integrations.lmcache as lm

    with pytest.raises(ValueError, match="codec"):
        create_serde_processor(SerdeConfig(type="kvcomp", kwargs={"codec": "zip"}))
    with pytest.raises(ValueError, match="unknown option"):
        create_serde_processor(SerdeConfig(type="kvcomp", kwargs={"level": 3}))
    with pytest.raises(ValueError, match="KV_2LTD"):
        lm._split(torch.zeros(3, 2, 16, 128, dtype=torch.float16), 64)


# --- kvcompd as an L2 adapter (LMCache's plugin adapter type) ------------------------------

@pytest.fixture(scope="module")
def daemon():
    from kvcompd_fixture import Kvcompd, built_kvcompd

    binary = built_kvcompd()
    if binary is None:
        pytest.skip("kvcompd not built")
    d = Kvcompd(binary)
    d.__enter__()
    yield d
    d.__exit__(None, None, None)


def adapter(d, **params):
    """The adapter as LMCache makes it from an L2 adapter entry of type "plugin"."""
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    cfg = get_l2_adapter_config_class("plugin").from_dict({
        "type": "plugin", "module_path": "kvcomp.integrations.lmcache",
        "class_name": "KvcompL2Adapter",
        "adapter_params": {"endpoints": [f"{d.data_endpoint},127.0.0.1:{d.control_port}"],
                           "head_dim": D, **params}})
    return create_l2_adapter_from_registry(cfg)


def wait_task(query, tid):
    t0 = time.monotonic()
    while (res := query(tid)) is None:
        assert time.monotonic() - t0 < 60
        time.sleep(0.002)
    return res


def key_of(i, model="test/lmcache-l2"):
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=f"chunk-{i}".encode().ljust(32, b"."), model_name=model,
                     kv_rank=0)


@pytest.mark.parametrize("codec,dtype", [("lossless", torch.bfloat16), ("int8", torch.float16)])
def test_l2_adapter_stores_looks_up_and_loads(daemon, codec, dtype):
    from kvcomp.integrations.lmcache import KvcompL2Adapter

    a = adapter(daemon, codec=codec)
    assert isinstance(a, KvcompL2Adapter)
    shape = (2, LAYERS, TOKENS, HEADS * D)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
    model = f"test/lmcache-l2-{codec}"
    keys = [key_of(i, model) for i in range(2)]
    res = None
    tid = a.submit_store_task(keys, [memobj(shape, dtype, x) for x in xs])
    t0 = time.monotonic()
    while tid not in (res := a.pop_completed_store_tasks()):
        assert time.monotonic() - t0 < 60
        time.sleep(0.002)
    assert res[tid].is_successful()
    found = wait_task(a.query_lookup_and_lock_result,
                      a.submit_lookup_and_lock_task(keys + [key_of(9, model)], {}))
    assert [found.test(i) for i in range(3)] == [True, True, False]
    outs = [memobj(shape, dtype) for _ in range(2)]
    loaded = wait_task(a.query_load_result, a.submit_load_task(keys, outs))
    assert [loaded.test(i) for i in range(2)] == [True, True]
    for x, o in zip(xs, outs):
        if codec == "lossless":
            assert torch.equal(o.tensor, x)
        else:
            assert torch.equal(o.tensor[1], x[1])
            err = (o.tensor[0].float() - x[0].float()).abs().max() / x[0].float().abs().max()
            assert 0 < err < 0.5 / 127 + 8e-3, err
    a.submit_unlock(keys)
    a.close()


def test_l2_adapter_refuses_bytes_and_misses(daemon):
    """A serde's output (bytes, not KV) fails its store task; a missing key fails its load
    and leaves the buffer as it was."""
    a = adapter(daemon)
    blob = torch.randint(0, 256, (12345,), dtype=torch.uint8)
    tid = a.submit_store_task([key_of(20)],
                              [memobj((blob.numel(),), torch.uint8, blob, fmt="BINARY")])
    t0 = time.monotonic()
    while tid not in (res := a.pop_completed_store_tasks()):
        assert time.monotonic() - t0 < 60
        time.sleep(0.002)
    assert not res[tid].is_successful()
    shape = (2, LAYERS, TOKENS, HEADS * D)
    miss = memobj(shape, torch.float16)
    loaded = wait_task(a.query_load_result, a.submit_load_task([key_of(21)], [miss]))
    assert not loaded.test(0) and not miss.tensor.any()
    a.close()
    with pytest.raises(ValueError, match="codec"):
        adapter(daemon, codec="zip")
