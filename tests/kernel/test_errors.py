"""The error-code table (``worker.errors.ERROR_TABLE``) and everything derived from it stay in step:
the exception classes, ``ERROR_CODES``, the client's ``JobFailed`` tree, the metrics' outcomes and
the two documentation tables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker import client, errors, protocol
from worker.client import errors as client_errors
from worker.observability.metrics import JOB_OUTCOMES

DOCS = Path(__file__).resolve().parents[2] / "docs"
CODES = [kind.code for kind in errors.ERROR_TABLE]


def _doc_table_codes(path: Path, first_column_is_code: bool) -> list[str]:
    """The wire codes of the error table in a markdown doc, in order."""
    codes = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        cell = cells[0] if first_column_is_code else cells[1]
        m = re.fullmatch(r"`([a-z_]+)`", cell)
        if m and m.group(1) in set(CODES) | {"unknown"}:
            codes.append(m.group(1))
    return codes


def test_every_derived_list_is_the_table() -> None:
    assert tuple(CODES) == errors.ERROR_CODES
    assert len(set(CODES)) == len(CODES)
    assert protocol.ERROR_CODES == errors.ERROR_CODES
    assert ("ok", *CODES) == JOB_OUTCOMES
    assert list(errors._BY_CODE) == CODES
    assert list(client.FAILED_BY_CODE) == CODES


@pytest.mark.parametrize("kind", errors.ERROR_TABLE, ids=lambda k: k.code)
def test_each_row_has_its_classes(kind: errors.ErrorKind) -> None:
    assert kind.error.code == kind.code
    assert errors.error_for_code(kind.code, "m").code == kind.code
    failed = client.FAILED_BY_CODE[kind.code]
    assert failed.__name__ == kind.job_failed and getattr(client, kind.job_failed) is failed
    # the MRO that `except` clauses rely on: JobFailed first, then the kernel class
    assert failed.__mro__[1:3] == (client.JobFailed, kind.error)
    result = protocol.error_result("j", kind.code, "why")
    exc = client.job_failed(result)
    assert type(exc) is failed and exc.code == kind.code and exc.reason == "why"
    assert kind.meaning and kind.meaning.endswith(".")


def test_every_scoring_error_carries_a_table_code() -> None:
    def subclasses(cls: type) -> list[type]:
        return [s for c in cls.__subclasses__() for s in (c, *subclasses(c))]

    for cls in subclasses(errors.ScoringError):
        assert cls.code in errors.ERROR_CODES + errors.PRODUCER_CODES, cls
    assert {cls.__name__ for cls in subclasses(client.JobFailed)} == {
        kind.job_failed for kind in errors.ERROR_TABLE
    } | {"QueueFullError"}  # the one producer-side code (errors.PRODUCER_CODES)
    assert not set(errors.PRODUCER_CODES) & set(errors.ERROR_CODES)


def test_unknown_codes_become_internal() -> None:
    exc = client.job_failed(protocol.error_result("j", "brand_new", "x"))
    assert type(exc) is client.InternalJobError and "[brand_new] x" in str(exc)
    assert errors.error_for_code("brand_new", "x").code == "internal"


def test_a_table_row_without_a_client_class_fails_at_import() -> None:
    row = errors.ErrorKind(errors.TooLong, job_failed="NoSuchError")
    with pytest.raises(RuntimeError, match="NoSuchError"):
        client_errors._failed_class(row)
    wrong_base = errors.ErrorKind(errors.TooLong, job_failed="ExpiredError")
    with pytest.raises(RuntimeError, match="ExpiredError"):
        client_errors._failed_class(wrong_base)


def test_the_docs_list_the_codes_of_the_table() -> None:
    assert _doc_table_codes(DOCS / "protocol.md", first_column_is_code=True) == CODES
    client_doc = (DOCS / "client.md").read_text()
    assert _doc_table_codes(DOCS / "client.md", first_column_is_code=False) == CODES
    for kind in errors.ERROR_TABLE:
        assert f"| `{kind.job_failed}` | `{kind.code}` |" in client_doc
