"""What the GPU check measures with, as data: model shapes, the bf16 peak of known devices, and
the FLOP count of a scoring pass. Standard library only (the dry run prints these under a
``python3`` without torch); the torch side is ``model``.

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
peak of the exact variant (``device_peak``: SXM, NVL and PCIe cards differ by up to 30%; ``None``
for a device not in the table, and on CPU), named with its datasheet in the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

SEED = 1234


@dataclass(frozen=True)
class DevicePeak:
    """The dense bf16 tensor-core peak of one device variant (no sparsity), and where it is from.

    ``words``: all of them must be words of ``torch.cuda.get_device_name()`` (case and ``-``
    ignored); ``variant``: the form factor the figure is for; ``source``: the vendor datasheet,
    whose headline figure is usually *with* sparsity (then halved here, as the note says).
    """

    words: tuple[str, ...]
    variant: str
    tflops: float
    source: str


_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_B200 = "4.5 PFLOPS per GPU with sparsity, halved"
_A10 = "250 with sparsity, halved"
#: Known devices, most specific first (the first whose words all appear wins). CUDA names seen:
#: "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 NVL", "NVIDIA H100 PCIe", "NVIDIA H200" (SXM),
#: "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA L40S",
#: "NVIDIA B200".
DEVICE_PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(("H100", "NVL"), "H100 NVL", 835.5, f"{_H100}: 1,671 with sparsity, halved"),
    DevicePeak(("H100", "PCIe"), "H100 PCIe", 756.5, f"{_H100}: 1,513 with sparsity, halved"),
    DevicePeak(("H100",), "H100 SXM", 989.4, f"{_H100}: 1,979 with sparsity, halved"),
    DevicePeak(("GH200",), "GH200", 989.4, "NVIDIA GH200 datasheet: 1,979 with sparsity, halved"),
    DevicePeak(("H200", "NVL"), "H200 NVL", 835.5, f"{_H200}: 1,671 with sparsity, halved"),
    DevicePeak(("H200",), "H200 SXM", 989.4, f"{_H200}: 1,979 with sparsity, halved"),
    DevicePeak(("B200",), "B200 (HGX)", 2250.0, f"NVIDIA HGX B200 datasheet: {_B200}"),
    DevicePeak(("A100",), "A100 (SXM4 and PCIe)", 312.0, "NVIDIA A100 datasheet: 312 dense"),
    DevicePeak(("L40S",), "L40S", 362.05, "NVIDIA L40S datasheet: 733 with sparsity, halved"),
    DevicePeak(("L4",), "L4", 121.0, "NVIDIA L4 datasheet: 242 with sparsity, halved"),
    DevicePeak(("A10G",), "A10G", 125.0, f"NVIDIA A10 datasheet (A10G taken as an A10): {_A10}"),
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

    def describe_model(self) -> str:
        """The model's configuration in one line."""
        return (
            f"LlamaConfig(hidden_size={self.hidden_size}, num_hidden_layers="
            f"{self.num_hidden_layers}, num_attention_heads={self.num_attention_heads}, "
            f"num_key_value_heads={self.num_key_value_heads}, intermediate_size="
            f"{self.intermediate_size}, vocab_size={self.vocab_size}, max_position_embeddings="
            f"{self.max_position_embeddings})"
        )

    def describe(self) -> str:
        """One line for the dry run and the report: the model and its ragged batch."""
        return (
            f"{self.describe_model()}; {self.sequences} sequences, prompts "
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


def tp_shape(tiny: bool) -> Shape:
    """The tensor-parallel step's model: the benchmark's shape with 2 layers at half its width
    (hidden 1,024, 16 heads / 4 KV heads, MLP 4,096; the vocabulary of 128,256 kept, so the
    vocabulary-parallel LM head folds a real one) and 32 sequences; ``TINY`` with 8."""
    if tiny:
        return replace(TINY, sequences=8)
    return replace(FULL, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                   num_key_value_heads=4, intermediate_size=4096, sequences=32)  # fmt: skip


def dtype_for(device: str) -> str:
    """bfloat16 on CUDA (what production runs), float32 on CPU."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def tolerance(dtype: str) -> float:
    """Largest log-prob difference accepted between two paths on the same weights."""
    return 1e-3 if dtype == "float32" else 0.1


@dataclass(frozen=True)
class GroupSet:
    """GRPO-shaped sequences for the tree step: ``groups`` groups of ``completions`` sequences,
    each a prompt of ``prompt_tokens`` and a completion of ``completion_tokens`` (scored). With
    ``shared`` the sequences of a group share their prompt; without it every prompt is its own
    (no shared prefix: the cost of looking for one)."""

    name: str
    prompt_tokens: int
    completions: int
    completion_tokens: int
    groups: int
    shared: bool = True

    @property
    def sequences(self) -> int:
        """Sequences in the set."""
        return self.groups * self.completions

    @property
    def tokens(self) -> int:
        """Tokens of every sequence counted in full: the backbone's tokens per sequence."""
        return self.sequences * (self.prompt_tokens + self.completion_tokens)

    @property
    def unique_tokens(self) -> int:
        """Tokens with each group's shared prompt counted once: the backbone's tokens in tree
        rows (``tokens`` without a shared prompt)."""
        if not self.shared:
            return self.tokens
        return self.groups * (self.prompt_tokens + self.completions * self.completion_tokens)

    @property
    def scored_tokens(self) -> int:
        """Completion tokens: the positions whose log-probs come back."""
        return self.sequences * self.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly fields and the token counts."""
        counts = {
            "sequences": self.sequences,
            "tokens": self.tokens,
            "unique_tokens": self.unique_tokens,
            "scored_tokens": self.scored_tokens,
        }
        return {**asdict(self), **counts}


#: The tree step's sets on the benchmark model: a long prompt with short completions, a short
#: prompt with long ones, and no shared prefix at the token count of the first.
TREE_SETS = (
    GroupSet("P1024xG8xC128", 1024, 8, 128, 2),
    GroupSet("P256xG8xC512", 256, 8, 512, 2),
    GroupSet("noshare", 1024, 8, 128, 2, shared=False),
)
#: The same three on ``TINY`` (each prompt at least ``ExecutorConfig.min_shared_tokens``, 32).
TREE_SETS_TINY = (
    GroupSet("P128xG8xC16", 128, 8, 16, 2),
    GroupSet("P32xG8xC64", 32, 8, 64, 2),
    GroupSet("noshare", 128, 8, 16, 2, shared=False),
)
#: Largest (max, largest per-sequence mean) |logp difference| between tree rows and per-sequence
#: rows, by dtype. float32: the two are the same math, so only summation order differs
#: (``tolerance``). bfloat16: the prefix's keys and values come from another forward, of another
#: shape, whose GEMM tiling and attention reduction order round differently, and every layer
#: passes that rounding on; the bounds are the ones the executor's own load check accepts for
#: tree rows (``worker/executor/tree/check.py``, 0.25) and the GPU tests accept for bfloat16
#: against float32 (``tests/support/models.py``: 0.25 and 0.05, measured 0.109 and 0.018 on the
#: CPU). The mean catches a small systematic error (a position off by one, a mask that lets a
#: few keys through) that the max alone would let pass.
TREE_TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-3, 1e-4),
    "bfloat16": (0.25, 0.05),
}


def tree_sets(tiny: bool) -> tuple[GroupSet, ...]:
    """``TREE_SETS_TINY`` or ``TREE_SETS``."""
    return TREE_SETS_TINY if tiny else TREE_SETS


def tree_rows(device: str) -> tuple[tuple[str, str], ...]:
    """``(attention backend, dtype)`` of each row of the tree step, the float32 reference first:
    on CUDA sdpa in float32 and bfloat16, then flash_attention_2 in bfloat16 (flash attention
    has no float32 kernels); on the CPU sdpa alone."""
    rows = (("sdpa", "float32"), ("sdpa", "bfloat16"))
    return (*rows, ("flash_attention_2", "bfloat16")) if device.startswith("cuda") else rows


def useful_flops(params: dict[str, int], shape: Shape, counts: dict[str, int]) -> float:
    """Model FLOPs the scoring pass needs (see the module docstring)."""
    dense = (
        2 * params["body"] * counts["real_tokens"] + 2 * params["lm_head"] * counts["scored_tokens"]
    )
    attention = 2 * shape.num_hidden_layers * shape.hidden_size * counts["sum_sq_tokens"]
    return float(dense + attention)


def device_peak(device_name: str) -> DevicePeak | None:
    """The ``DEVICE_PEAKS`` row of a CUDA device name, or ``None`` for a device not listed."""
    words = {w.lower() for w in device_name.replace("-", " ").split()}
    for peak in DEVICE_PEAKS:
        if all(w.lower() in words for w in peak.words):
            return peak
    return None


def bf16_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known device (``device_peak``), else ``None``."""
    peak = device_peak(device_name)
    return None if peak is None else peak.tflops


def mfu(flops: float, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOP utilisation in [0, 1], or ``None`` without a known peak."""
    if peak_tflops is None or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)
