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
