"""What the GPU check measures with, as data: model shapes, the bf16 peak of known devices, and
the FLOP count of a scoring pass. Standard library only (the dry run prints these under a
``python3`` without torch); the torch side is ``gpu_model``.

``FULL`` is a 1B-class Llama (Llama-3.2-1B's shape: hidden 2,048, 16 layers, 32 heads / 8 KV,
MLP 8,192, vocab 128,256) with random weights; ``TINY`` is a 2-layer, 1,024-vocab stand-in that
runs the same code paths on a CPU in seconds. Inputs are RL-like: a prompt and a completion of
random lengths per sequence, fixed seed, only the completion scored.

Model FLOPs of a scoring pass (``useful_flops``), the work the job needs:
``2 * body_params * real_tokens`` (every non-embedding weight except the LM head, on every token)
``+ 2 * lm_head_params * scored_tokens`` (the LM head on completion tokens only)
``+ 2 * layers * hidden * sum(T**2)`` (causal attention: ``QK^T`` and ``AV``, each
``2 * T * T * hidden`` halved by the mask). Padding, and the naive loop's LM head on prompt
positions, are waste and are not counted. MFU = useful FLOPs / seconds / the device's dense bf16
peak (``bf16_peak_tflops``; ``None`` for a device not in the table, and on CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

SEED = 1234
#: Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by the words in the device name; first match.
BF16_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 989.4),
    (("H100", "PCIe"), 756.0),
    (("H100",), 989.4),
    (("A100",), 312.0),
    (("L40S",), 362.0),
    (("L4",), 121.0),
    (("A10G",), 125.0),
)


@dataclass(frozen=True)
class Shape:
    """A Llama configuration and the ragged batch scored on it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    sequences: int
    prompt_tokens: tuple[int, int]  # inclusive range
    completion_tokens: tuple[int, int]  # inclusive range
    naive_batch: int = 4

    def describe(self) -> str:
        """One line for the dry run and the report."""
        return (
            f"LlamaConfig(hidden_size={self.hidden_size}, num_hidden_layers="
            f"{self.num_hidden_layers}, num_attention_heads={self.num_attention_heads}, "
            f"num_key_value_heads={self.num_key_value_heads}, intermediate_size="
            f"{self.intermediate_size}, vocab_size={self.vocab_size}, max_position_embeddings="
            f"{self.max_position_embeddings}); {self.sequences} sequences, prompts "
            f"{self.prompt_tokens[0]}-{self.prompt_tokens[1]}, completions "
            f"{self.completion_tokens[0]}-{self.completion_tokens[1]} tokens, seed {SEED}"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly fields."""
        return asdict(self)


FULL = Shape(2048, 16, 32, 8, 8192, 128_256, 4096, 64, (64, 256), (16, 1024))
TINY = Shape(64, 2, 4, 2, 128, 1024, 512, 8, (8, 32), (4, 64))


def shape_for(tiny: bool) -> Shape:
    """``TINY`` or ``FULL``."""
    return TINY if tiny else FULL


def e2e_shape(tiny: bool) -> Shape:
    """The end-to-end model: the benchmark's shape with 2 layers (quick to save and load), and
    128 sequences (24 tiny) to submit as jobs."""
    shape = shape_for(tiny)
    return replace(shape, num_hidden_layers=2, sequences=24 if tiny else 128)


def dtype_for(device: str) -> str:
    """bfloat16 on CUDA (what production runs), float32 on CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def tolerance(dtype: str) -> float:
    """Largest log-prob difference accepted between two paths on the same weights."""
    return 1e-3 if dtype == "float32" else 0.1


def useful_flops(params: dict[str, int], shape: Shape, counts: dict[str, int]) -> float:
    """Model FLOPs the scoring pass needs (see the module docstring)."""
    dense = (
        2 * params["body"] * counts["real_tokens"] + 2 * params["lm_head"] * counts["scored_tokens"]
    )
    attention = 2 * shape.num_hidden_layers * shape.hidden_size * counts["sum_sq_tokens"]
    return float(dense + attention)


def bf16_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known device (``BF16_PEAK_TFLOPS``), else ``None``."""
    words = {w.lower() for w in device_name.replace("-", " ").split()}
    for pattern, tflops in BF16_PEAK_TFLOPS:
        if all(p.lower() in words for p in pattern):
            return tflops
    return None


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOP utilisation in [0, 1], or ``None`` without a known peak."""
    if peak_tflops is None or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)
