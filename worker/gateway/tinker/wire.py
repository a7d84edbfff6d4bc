"""The Tinker SDK's messages on the wire: its JSON requests as pydantic models, its
``SampleResponse`` as protobuf bytes.

Mirrors ``tinker`` 0.38.0: ``tinker/types/sample_request.py`` (``SampleRequest``, sent as JSON
by ``tinker/resources/sampling.py``), ``tinker/types/_pydantic_types/tensor_data.py``
(``TensorData``: dense, or sparse CSR with ``sparse_crow_indices``/``sparse_col_indices``), and
``tinker/proto/tinker_public_pb2.py`` read by ``tinker/proto/response_conv.py``
(``deserialize_sample_response``). The SDK asks ``retrieve_future`` for
``application/x-protobuf`` and refuses a JSON ``SampleResponse``.

``SampleResponse`` (field numbers of ``tinker_public.proto``)::

    1 sequences  repeated SampledSequence {1 stop_reason enum (0 STOP, 1 LENGTH), 2 tokens
                 bytes <i4, 3 logprobs bytes <f4, 4 topk_sampled_logprobs TopkLogprobs}
    2 prompt_logprobs  bytes <f4 [len(prompt)], NaN where unscored
    3 topk_prompt_logprobs  TopkLogprobs {1 token_ids bytes <i4, 2 logprobs bytes <f4,
                 3 k uint32, 4 length uint32}: [length, k], padded with id 0 / -99999
    4 prompt_cache_hit_tokens  int32
    5 target_prompt_logprobs  Tensor {oneof {1 dense bytes, 2 sparse_csr SparseCsr {1 values
                 bytes, 2 crow_indices bytes <i8, 3 col_indices bytes <i8}}, 3 dtype enum
                 (1 FLOAT32, 2 INT64, 3 INT32, 4 BFLOAT16), 4 shape packed int64}
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from worker.gateway.tinker import protobuf as pb

STOP_REASON_LENGTH = 1
DTYPE_FLOAT32 = 1
#: The top-k padding of a position with fewer (or no) entries (``tinker/types/topk_logprobs.py``).
TOPK_PAD_ID = 0
TOPK_PAD_LOGPROB = -99999.0


class TensorData(BaseModel):
    """``tinker.TensorData`` as JSON: ``data`` flat; sparse CSR when both index lists are set."""

    model_config = ConfigDict(extra="ignore")

    data: list[StrictInt] | list[float]
    dtype: StrictStr
    shape: list[StrictInt] | None = None
    sparse_crow_indices: list[StrictInt] | None = None
    sparse_col_indices: list[StrictInt] | None = None


class ModelInput(BaseModel):
    """``tinker.ModelInput``: typed chunks (``encoded_text`` carries ``tokens``); the chunks
    are read by ``tinker_plan.prompt_tokens``, which refuses every other type."""

    model_config = ConfigDict(extra="ignore")

    chunks: list[dict[str, Any]]


class SamplingParams(BaseModel):
    """``tinker.SamplingParams`` (only ``max_tokens`` bears on scoring)."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = None
    temperature: float = 1.0


class SampleRequest(BaseModel):
    """``tinker.types.SampleRequest``, field by field."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    base_model: StrictStr | None = None
    model_path: StrictStr | None = None
    sampling_session_id: StrictStr | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"


@dataclass(frozen=True)
class SampleAnswer:
    """What a ``SampleResponse`` carries: ``num_sequences`` sequences with no tokens (nothing
    is generated), and the prompt arrays that were asked for (None: not asked)."""

    num_sequences: int
    prompt_logprobs: np.ndarray | None = None  # [L] float32, NaN where unscored
    topk_ids: np.ndarray | None = None  # [L, k] int32, TOPK_PAD_ID where unscored
    topk_logprobs: np.ndarray | None = None  # [L, k] float32, TOPK_PAD_LOGPROB where unscored
    target: np.ndarray | None = None  # [L - 1, K] float32 dense (0.0 where the ids had -1)
    target_csr: tuple[list[int], list[int]] | None = None  # (crow, col): answer sparse


def csr_rows(crow: list[int]) -> np.ndarray:
    """The row of each stored value of a CSR matrix with row pointers ``crow``."""
    counts = [b - a for a, b in itertools.pairwise(crow)]
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


def _f32(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype="<f4").tobytes()


def _i32(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype="<i4").tobytes()


def _i64(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _tensor(answer: SampleAnswer) -> bytes:
    assert answer.target is not None
    dense = answer.target
    if answer.target_csr is not None:
        crow, col = answer.target_csr
        rows = csr_rows(crow)
        values = dense[rows, np.asarray(col, dtype=np.int64)] if col else np.zeros(0)
        csr = (
            pb.length_delimited(1, _f32(values))
            + pb.length_delimited(2, _i64(crow))
            + pb.length_delimited(3, _i64(col))
        )
        encoding = pb.length_delimited(2, csr)
    else:
        encoding = pb.length_delimited(1, _f32(dense))
    return encoding + pb.scalar(3, DTYPE_FLOAT32) + pb.packed(4, dense.shape)


def encode_sample_response(answer: SampleAnswer) -> bytes:
    """``answer`` as the protobuf bytes of ``SampleResponse``."""
    sequence = pb.scalar(1, STOP_REASON_LENGTH)  # no tokens, no log-probs
    out = [pb.length_delimited(1, sequence) for _ in range(answer.num_sequences)]
    if answer.prompt_logprobs is not None:
        out.append(pb.length_delimited(2, _f32(answer.prompt_logprobs)))
    if answer.topk_ids is not None and answer.topk_logprobs is not None:
        length, k = answer.topk_ids.shape
        topk = (
            pb.length_delimited(1, _i32(answer.topk_ids))
            + pb.length_delimited(2, _f32(answer.topk_logprobs))
            + pb.scalar(3, k)
            + pb.scalar(4, length)
        )
        out.append(pb.length_delimited(3, topk))
    if answer.target is not None:
        out.append(pb.length_delimited(5, _tensor(answer)))
    return b"".join(out)
