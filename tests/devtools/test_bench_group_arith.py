"""``python -m worker.devtools.bench.group_arith``: the arithmetic of group scoring on GPU shapes,
checked against a case counted by hand, against the gpu check's own FLOP count, and against the
weights of a real (tiny) Llama built from the same shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.devtools.bench import group_arith as ga
from worker.devtools.gpu_check import shapes as gpu_shapes

# 2 layers, hidden 8, 2 heads of 4, 1 KV head, MLP 16, vocabulary 10; P = 4, G = 2, C = 2
TOY = ga.ModelShape("toy", layers=2, hidden=8, heads=2, kv_heads=1, ffn=16, vocab=10)
GROUP = ga.GroupShape(prompt=4, completions=2, completion=2)


def test_a_group_counted_by_hand() -> None:
    # per layer: q, o 8 * 8 = 64 each; k, v 8 * (1 * 4) = 32 each; MLP 3 * 8 * 16 = 384
    assert TOY.linear_params == 2 * (64 + 64 + 32 + 32 + 384) == 1152
    assert TOY.head_params == 80
    # K and V, 1 KV head of 4, 2 bytes, 2 layers
    assert TOY.kv_bytes_per_token() == 2 * 1 * 4 * 2 * 2 == 32
    r = ga.costs(TOY, GROUP)
    assert r["tokens"] == {"per_sequence": 2 * 6, "tree": 4 + 2 * 2}
    assert r["linear_flops"] == {"per_sequence": 2 * 1152 * 12, "tree": 2 * 1152 * 8}
    assert r["head_flops"] == 2 * 80 * 4  # the 4 completion tokens, on both sides
    # causal pairs: 2 * 6^2 / 2 = 36 against 4^2 / 2 + 2 * 2 * (4 + 1) = 28; 4 * 8 * 2 per pair
    assert r["attention_flops"] == {"per_sequence": 64 * 36, "tree": 64 * 28}
    assert r["total_flops"] == {"per_sequence": 27648 + 640 + 2304, "tree": 18432 + 640 + 1792}
    assert r["flop_ratio"] == pytest.approx(30592 / 20864)
    # K/V tokens read: 2 * 6 per sequence; 4 + 2 * 6 as implemented (x2: 2 heads over 1 KV
    # head); 4 + 2 * 2 with the prompt read once
    assert r["kv_bytes"] == {
        "per_sequence": 12 * 32,
        "tree": 16 * 32,
        "tree_expanded": 2 * 16 * 32,
        "cascade": 8 * 32,
    }
    assert r["kv_ratio"]["cascade"] == 1.5 and r["dominant_per_sequence"] == "linear"


@pytest.mark.parametrize("model", ga.MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("group", ga.GROUPS, ids=lambda g: g.label())
def test_per_sequence_flops_are_the_gpu_checks_useful_flops(
    model: ga.ModelShape, group: ga.GroupShape
) -> None:
    """Per sequence, the sum is ``gpu_check.shapes.useful_flops`` of the group's sequences; tree
    rows save exactly ``G - 1`` prompts' tokens and their ``P^2 / 2`` pairs."""
    p, n, c = group.prompt, group.completions, group.completion
    shape = gpu_shapes.Shape(model.hidden, model.layers, model.heads, model.kv_heads, model.ffn,
                             model.vocab, 8192, n, (p, p), (c, c))  # fmt: skip
    params = {"body": model.linear_params, "lm_head": model.head_params}
    counts = {"real_tokens": n * (p + c), "scored_tokens": n * c, "sum_sq_tokens": n * (p + c) ** 2}
    r = ga.costs(model, group)
    assert r["total_flops"]["per_sequence"] == gpu_shapes.useful_flops(params, shape, counts)
    saved = r["total_flops"]["per_sequence"] - r["total_flops"]["tree"]
    pairs = (n - 1) * p**2 / 2
    want = 2 * model.linear_params * (n - 1) * p + 4 * model.hidden * model.layers * pairs
    assert saved == pytest.approx(want, rel=1e-12)


def test_linear_params_are_a_real_llamas_layer_weights() -> None:
    from worker.demo.tiny import llama_config, random_model

    toy = ga.ModelShape("toy", layers=3, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=50)
    config = llama_config(50, 64, 96, 128, num_hidden_layers=3, num_attention_heads=8,
                          num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = random_model("LlamaForCausalLM", config, 0)
    linear = sum(
        m.weight.numel() for m in model.model.layers.modules() if type(m).__name__ == "Linear"
    )
    assert toy.linear_params == linear
    assert toy.head_params == model.lm_head.weight.numel()


def test_the_published_shapes_and_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3-8B: 8.03 billion parameters with the embedding and the untied head
    assert ga.LLAMA3_8B.linear_params + 2 * ga.LLAMA3_8B.head_params == 8_029_995_008
    assert ga.LLAMA3_70B.linear_params + 2 * ga.LLAMA3_70B.head_params == 70_552_387_584
    out = tmp_path / "arith.json"
    assert ga.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| Llama-3-8B-like | (1024, 8, 128) | 9,216 / 2,048 |" in text
    rows = json.loads(out.read_text())
    assert len(rows) == len(ga.MODELS) * len(ga.GROUPS)
    assert all(r["dominant_per_sequence"] == "linear" for r in rows)
