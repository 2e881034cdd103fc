"""The RULER-style suite's parts (bench/quality/ruler.py, codecs_ref.py, suite.py) on synthetic
text and a random-weight Llama: exact sample lengths, item scoring, codec bytes and error
ordering, and that the full-cache configuration reproduces a plain forward pass."""

import os
import sys

import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench", "quality"))
sys.path.insert(0, os.path.join(REPO, "bench", "quality", "lm"))

import codecs_ref  # noqa: E402
import ruler  # noqa: E402

torch = pytest.importorskip("torch")


def _text(n=200_000, seed=0):
    rng = np.random.default_rng(seed)
    words = [b"alpha", b"bravo", b"charlie", b"delta", b"echo", b"foxtrot", b"golf", b"hotel"]
    out, size = [], 0
    while size < n:
        line = b" ".join(words[i] for i in rng.integers(0, len(words), 9)) + b"\n"
        out.append(line)
        size += len(line)
    return np.frombuffer(b"".join(out), np.uint8)


@pytest.mark.parametrize("length", [1025, 4096])
def test_every_task_fills_its_length_and_scores_its_items(length):
    text = _text()
    words = ruler.word_list(text)
    rng = np.random.default_rng(1)
    for task in ruler.TASKS:
        s = ruler.make(task, text, rng, length, words=words)
        assert len(s.context) + len(s.question) + len(s.answer) == length, task
        a = np.frombuffer(s.answer, np.uint8)
        assert ruler.score(a.copy(), s) == 1.0
        wrong = a.copy()
        i, j = s.item_spans()[0]
        wrong[i] ^= 1
        assert ruler.score(wrong, s) == pytest.approx(1 - 1 / len(s.items))
    s = ruler.make("niah_multivalue", text, rng, length)
    assert all(it in s.context for it in s.items)
    assert [s.context.index(it) for it in s.items] == sorted(s.context.index(it)
                                                             for it in s.items)


def test_codec_bytes_and_error_order():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 2, 256, 128, generator=g)
    X[..., 3] *= 20  # an outlier channel
    y, b, _ = codecs_ref.encode("bf16", X, True)
    assert torch.equal(y, X) and b == 2 * X.numel()
    assert codecs_ref.encode("fp8", X, True)[1] == X.numel()

    def err(spec):
        y, b, e = codecs_ref.encode(spec, X, True)
        assert e is None or e <= b * 1.001
        return float(((y - X) ** 2).mean() / (X ** 2).mean()), b / X.numel() * 8

    e2, b2 = err("hq2")
    e3, b3 = err("hq3")
    e4, b4 = err("hq4")
    assert e4 < e3 < e2 and b2 < b3 < b4
    assert b4 == pytest.approx(4 + 32 / 128)  # codes + fp16 scale and minimum per 128 values
    assert err("tq4")[0] < err("tq2")[0]
    assert err("kivi4")[0] < err("kivi2")[0]


def test_full_configuration_reproduces_the_plain_forward():
    transformers = pytest.importorskip("transformers")
    import suite
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(list(bytes(_text(400)[:300])), dtype=torch.long)
    ctx, tail = ids[:250], ids[250:]
    K, V, _ = suite.prefill(model, ctx)
    built = suite.build(["full", "hq k4v3", "manifold_r50 0.5 + hq k4v3"], K, V)
    assert built["full"][2] == pytest.approx(2 * 2 * 2 * 2 * 32)  # bf16 bytes per token
    assert built["manifold_r50 0.5 + hq k4v3"][0].shape[2] == 125
    lg = suite.run_configs(model, built, len(ctx), tail, torch.float32)
    with torch.no_grad():
        ref = model(ids[None]).logits[0, 250:].float()
    assert torch.allclose(lg["full"], ref, atol=2e-4)
    assert not torch.allclose(lg["hq k4v3"], ref, atol=1e-6)


def test_shards_merge_into_the_single_process_result(tmp_path, monkeypatch):
    """suite.py --shard I/K: each round draws from its own generator, so two shards merged
    (--merge) give the same samples, scores and losses as one process over every round; the
    scorer table (--scorers) renders from the merged result."""
    transformers = pytest.importorskip("transformers")
    import json
    import suite
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "held_en.bin").write_bytes(bytes(_text(60_000, seed=1)))
    (corpus / "held_code.bin").write_bytes(bytes(_text(60_000, seed=2)))
    (corpus / "manifest.json").write_text(json.dumps(
        {"en": {"held_sha256": "e"}, "code": {"held_sha256": "c"}}))
    configs = ["full", "kvhq k4v3", "manifold 0.5", "manifold_r50 0.5", "streaming 0.5"]
    monkeypatch.setenv("KVCOMP_COMMIT", "test")

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["suite.py", *args])
        suite.main()

    common = ["--model", str(tmp_path / "model"), "--corpus", str(corpus), "--lengths", "256",
              "--n", "3", "--n-loss", "3", "--device", "cpu", "--configs", *configs]
    run(*common, "--out", str(tmp_path / "one"))
    for i in range(2):
        run(*common, "--shard", f"{i}/2", "--out", str(tmp_path / f"part{i}"))
    run("--merge", str(tmp_path / "part0.json"), str(tmp_path / "part1.json"),
        "--out", str(tmp_path / "merged"))
    one = json.loads((tmp_path / "one.json").read_text())["per_length"]["256"]
    merged = json.loads((tmp_path / "merged.json").read_text())["per_length"]["256"]
    assert merged["rounds"] == one["rounds"] == 3
    meta = json.loads((tmp_path / "merged.json").read_text())["meta"]
    assert [x["rounds"] for x in meta["merged_from"]] == [{"256": 2}, {"256": 1}]
    # shard 0 holds rounds 0 and 2, shard 1 round 1: the same per-round values, reordered
    order = [0, 2, 1]
    for c in configs:
        assert merged["loss"][c] == pytest.approx([one["loss"][c][j] for j in order],
                                                  rel=1e-5)
        for t in ruler.TASKS:
            assert merged["scores"][c][t] == [one["scores"][c][t][j] for j in order]
    run("--scorers", str(tmp_path / "merged.json"), "--out", str(tmp_path / "scorers"))
    table = (tmp_path / "scorers.md").read_text()
    assert "| 256 | 0.5 | manifold_r50 |" in table and "| 256 | 0.5 | streaming |" in table
    with pytest.raises(SystemExit):
        run(*common, "--shard", "2/2", "--out", str(tmp_path / "bad"))


def test_default_policy_criterion_against_the_best_single_scorer():
    """suite.criterion: a candidate meets it where its loss is within 0.3 point of the lowest
    single-scorer loss and the paired interval of its needles against the best single scorer's
    reaches 0; every configuration set names known configurations."""
    import suite

    n = 50

    def hits(k):  # k of n samples found
        return [1] * k + [0] * (n - k)

    scores, rows = {}, []
    for c, loss, single, mkey in (("manifold 0.5", 8.7, 50, 50), ("streaming 0.5", 2.9, 14, 30),
                                  ("knorm 0.5", 15.8, 0, 0), ("keydiff 0.5", 9.0, 41, 37),
                                  ("manifold_r50 0.5", 3.1, 50, 49),
                                  ("manifold_r90 0.5", 3.0, 30, 30)):
        scores[c] = {"niah_single": hits(single), "niah_multikey": hits(mkey)}
        rows.append({"config": c, "length": 4096, "loss_pct": loss})
    best, need, v = suite.criterion(rows, scores, "4096", "0.5",
                                    ["manifold 0.5", "manifold_r50 0.5", "manifold_r90 0.5"])
    assert best == 2.9 and need == {"niah_single": 1.0, "niah_multikey": 1.0}
    assert v["manifold 0.5"] == (pytest.approx(5.8), True, False)  # needles kept, loss behind
    assert v["manifold_r50 0.5"] == (pytest.approx(0.2), True, True)  # one miss: within
    assert v["manifold_r90 0.5"] == (pytest.approx(0.1), False, False)  # 20 needles lost
    assert all(c in suite.CONFIGS for s in suite.CONFIG_SETS.values() for c in s)
