"""``enqueue`` lines with images: base64 files, shown in order by a one-sequence line, by index
in a ``seqs`` line; a line with bad base64 is that line's error only."""

from __future__ import annotations

import base64
import io
import json

from worker.commands.enqueue import _read_jobs

PNG = b"\x89PNG not decoded here"
B64 = base64.b64encode(PNG).decode()


def test_enqueue_lines_carry_their_images_as_base64() -> None:
    lines = [
        {"id": "one", "tokens": [1, 94, 2, 94, 3], "prompt_len": 4, "images": [B64, B64]},
        {
            "id": "many",
            "images": [B64],
            "processor": {"max_pixels": 3136},
            "seqs": [
                {"tokens": [1, 94, 2], "prompt_len": 2, "images": [0]},
                {"tokens": [3, 4], "prompt_len": 1},
            ],
        },
        {"id": "bad", "tokens": [1, 94, 2], "prompt_len": 2, "images": ["%%%"]},
    ]
    errors: list[dict] = []
    fh = io.StringIO("\n".join(json.dumps(x) for x in lines))
    jobs = {j.job_id: j for j in _read_jobs(fh, set(), errors)}
    assert jobs["one"].images == [PNG, PNG] and jobs["one"].seqs[0].images == (0, 1)
    assert jobs["many"].processor == {"max_pixels": 3136}
    assert [s.images for s in jobs["many"].seqs] == [(0,), None]
    assert sorted(jobs) == ["many", "one"]
    assert errors[0]["line"] == 3 and "base64" in errors[0]["message"]
