"""A job's distinct images decoded and processed at once on the image threads
(``ExecutorConfig.image_threads``, ``serve --image-threads``): the same prepared plan and scores
as one at a time; two images really in flight together on the pool's threads; a file that does
not decode fails its job as soon as it fails (another image still in flight), naming it, and
the next job is served."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from tests.support.vision import image_file, image_tokens, placeholder
from worker.demo.tiny import tiny_vlm
from worker.errors import BadRequest, ConfigError
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.executor.vision.processor import ImageProcessing
from worker.request import Images, ScoreRequest, SequenceInput

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")
C = image_file(40, 40, seed=3, fmt="JPEG")


@pytest.fixture(scope="module")
def built() -> Any:
    return tiny_vlm("qwen2_vl", seed=4)


def _executor(built: Any, threads: int) -> StatelessExecutor:
    model, processor = built
    config = ExecutorConfig(dtype="float32", image_threads=threads, self_check=False)
    return StatelessExecutor(config, model, image_processor=processor)


def _request(built: Any, files: tuple[bytes, ...]) -> ScoreRequest:
    """One sequence per file, each showing it, and one showing the first file again."""
    _, processor = built
    seqs = []
    for i, data in enumerate((*files, files[0])):
        run = placeholder(image_tokens(processor, data))
        seqs.append(SequenceInput([1, 2, *run, 3, 4, 5], prompt_len=len(run) + 3,
                                  images=(i % len(files),)))  # fmt: skip
    return ScoreRequest(seqs, images=Images(files))


def test_results_equal_one_image_at_a_time(built: Any) -> None:
    serial, pooled = _executor(built, 1), _executor(built, 4)
    try:
        assert serial._vision is not None and serial._vision.processing.pool is None
        request = _request(built, (A, B, C))
        one, many = serial.prepare(request), pooled.prepare(request)
        for a, b in zip(one.plan[0].seqs, many.plan[0].seqs, strict=True):
            assert a.vision is not None and b.vision is not None
            np.testing.assert_array_equal(a.vision.positions, b.vision.positions)
            for x, y in zip(a.vision.images, b.vision.images, strict=True):
                assert (x.digest, x.grid, x.runs) == (y.digest, y.grid, y.runs)
                np.testing.assert_array_equal(x.pixel_values, y.pixel_values)
        assert many.plan[0].images_decoded == one.plan[0].images_decoded == 3
        for a, b in zip(serial.run([one]).scores, pooled.run([many]).scores, strict=True):
            np.testing.assert_array_equal(a.logps, b.logps)
        again = pooled.prepare(request)  # the processor cache, filled from the pool's threads
        assert again.plan[0].cache_hits == 3
    finally:
        serial.close()
        pooled.close()


def test_two_images_are_processed_at_once_on_the_pool(
    built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ``process`` waits for the other at a barrier: one at a time, it would time out."""
    process = ImageProcessing.process
    together = threading.Barrier(2, timeout=10)
    names: list[str] = []

    def meet(self: Any, image: Any, options: Any) -> Any:
        names.append(threading.current_thread().name)
        together.wait()
        return process(self, image, options)

    monkeypatch.setattr(ImageProcessing, "process", meet)
    ex = _executor(built, 2)
    try:
        ex.prepare(_request(built, (A, B)))
    finally:
        ex.close()
    assert len(set(names)) == 2 and all(n.startswith("scoring-image") for n in names), names


def test_a_bad_image_fails_its_job_at_once_and_the_next_job_is_served(
    built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Image 0 takes 3 s to process; image 1 does not decode: the job fails in under a second,
    naming images[1]."""
    process = ImageProcessing.process

    def slow(self: Any, image: Any, options: Any) -> Any:
        if image.digest == slow_digest:
            time.sleep(3)
        return process(self, image, options)

    from worker.executor.vision.decode import decode_image

    slow_digest = decode_image(C, 0, max_pixels=10**6).digest
    monkeypatch.setattr(ImageProcessing, "process", slow)
    ex = _executor(built, 4)
    try:
        good = _request(built, (C,)).seqs[0]
        bad = SequenceInput(good.tokens, prompt_len=good.prompt_len, images=(1,))
        request = ScoreRequest([good, bad], images=Images((C, b"not an image at all")))
        started = time.perf_counter()
        with pytest.raises(BadRequest, match=r"images\[1\] is not a PNG, JPEG or WebP image"):
            ex.prepare(request)
        assert time.perf_counter() - started < 1.0
        monkeypatch.undo()
        out = ex.run([ex.prepare(_request(built, (A, B)))])
        assert all(s.error is None and s.logps is not None for s in out.scores)
    finally:
        ex.close()


def test_image_threads_is_a_positive_integer_from_serve() -> None:
    from worker.cli import build_parser
    from worker.commands.serve import executor_config

    with pytest.raises(ConfigError, match="image_threads"):
        ExecutorConfig(image_threads=0)
    parser = build_parser("serve")
    args = parser.parse_args(["serve", "--reference-model", "m", "--image-threads", "2"])
    assert executor_config(args).image_threads == 2
    assert (
        executor_config(parser.parse_args(["serve", "--reference-model", "m"])).image_threads == 4
    )


def test_image_sharing_from_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.cli import build_parser
    from worker.commands.serve import executor_config

    parser = build_parser("serve")
    default = executor_config(parser.parse_args(["serve", "--reference-model", "m"]))
    assert default.image_sharing == "on"
    args = parser.parse_args(["serve", "--reference-model", "m", "--image-sharing", "off"])
    assert executor_config(args).image_sharing == "off"
    monkeypatch.setenv("SCORING_IMAGE_SHARING", "off")
    env = build_parser("serve").parse_args(["serve", "--reference-model", "m"])
    assert executor_config(env).image_sharing == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--reference-model", "m", "--image-sharing", "maybe"])
