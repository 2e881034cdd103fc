"""Chunk caches composed into one run (prefix and chunk reuse, docs/protocol.md).

A run of chunk caches (Client.get_chunks) composes: token positions follow chunk after chunk,
the kept tokens of a lossless run (ratio 0, raw keys, no value codec) are exactly the tokens of
the whole prompt, and the MomentKV summaries of a run are the sums of its chunks' (the moments
are sums over the evicted tokens). Lossy codecs hold within each codec's error per chunk; int8
key scales are fitted per chunk, so a run does not decode bit for bit as one cache stored
whole would.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple


def assemble(chunks: Sequence[Any], projection: Any = None) -> Tuple[Any, Any]:
    """The dense keys and values of a run of chunks that kept every token: float32 arrays
    [layers, kv_heads, tokens, head_dim], tokens the sum of the chunks'. ValueError when a chunk
    evicted tokens or the chunks' shapes differ."""
    import numpy as np

    from . import decompress

    if not chunks:
        raise ValueError("no chunks")
    first = chunks[0]
    shape = (first.num_layers, first.num_kv_heads, first.head_dim)
    ks, vs = [], []
    for i, c in enumerate(chunks):
        if (c.num_layers, c.num_kv_heads, c.head_dim) != shape:
            raise ValueError(f"chunk {i}: layout differs from chunk 0")
        if any(n != c.original_tokens for n in c.kept):
            raise ValueError(f"chunk {i} evicted tokens; only whole chunks assemble densely")
        k, v = decompress(c, projection)
        ks.append(k)
        vs.append(v)
    return np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)


def run_moments(chunks: Sequence[Any]) -> List[List[Tuple[int, Any, Any, Any]]]:
    """The MomentKV summaries of a run, [layer][kv_head] -> (count, key_sum, value_sum,
    vk_sum): each the sum of the chunks' (cache.moments(layer, head)); a chunk that evicted
    nothing stores none and adds nothing."""
    if not chunks:
        raise ValueError("no chunks")
    layers, heads = chunks[0].num_layers, chunks[0].num_kv_heads
    out = []
    for layer in range(layers):
        row = []
        for head in range(heads):
            n, ks, vs, vk = 0, None, None, None
            for c in chunks:
                if not c.has_moments:  # a chunk that evicted nothing stores no summaries
                    continue
                cn, cks, cvs, cvk = c.moments(layer, head)[:4]
                n += int(cn)
                ks = cks.astype("float64") if ks is None else ks + cks
                vs = cvs.astype("float64") if vs is None else vs + cvs
                vk = cvk.astype("float64") if vk is None else vk + cvk
            if ks is None:  # no chunk evicted anything: the summaries are zero
                import numpy as np
                d = chunks[0].head_dim
                ks, vs, vk = np.zeros(d), np.zeros(d), np.zeros((d, d))
            row.append((n, ks, vs, vk))
        out.append(row)
    return out
