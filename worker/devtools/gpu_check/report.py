"""The GPU check's markdown report: one table of steps, then one table per measured step.

``render(doc)`` turns the ``gpu-check.json`` document (see ``gpu_check``) into
``gpu-check.md``. Standard library only; missing figures print as ``n/a``, so a partial document
(a step stopped at its time limit) still renders.
"""

from __future__ import annotations

import re
from typing import Any


def fmt_bytes(value: Any) -> str:
    """``1.23 GiB`` / ``456.7 MiB``, or ``n/a``."""
    if not isinstance(value, (int, float)):
        return "n/a"
    if abs(value) >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.1f} MiB"


def fmt_num(value: Any, digits: int = 0) -> str:
    """A number with thousands separators, or ``n/a``."""
    if not isinstance(value, (int, float)):
        return "n/a"
    return f"{value:,.{digits}f}"


def fmt_pct(value: Any) -> str:
    """A fraction as a percentage, or ``n/a``."""
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "n/a"


def fmt_diff(value: Any) -> str:
    """A log-prob difference, or ``n/a``."""
    return f"{value:.3g}" if isinstance(value, (int, float)) else "n/a"


def _cell(text: str) -> str:
    """Text safe inside a table cell: unescaped pipes escaped, newlines as spaces."""
    return re.sub(r"(?<!\\)\|", r"\\|", text).replace("\n", " ")


def _figures(doc: dict[str, Any], step: str) -> dict[str, Any]:
    return dict(doc.get("steps", {}).get(step, {}).get("figures") or {})


def summary(name: str, step: dict[str, Any]) -> str:
    """The figures column of the steps table for one step."""
    f = step.get("figures") or {}
    if step.get("status") == "skipped" and not f:
        return str(step.get("reason", ""))
    if name == "install":
        return "installed: " + (", ".join(f.get("installed", [])) or "nothing (all present)")
    if name == "env":
        return f"{f.get('device_name', 'n/a')}, torch {f.get('torch', 'n/a')}"
    if name == "pytest":
        counts = f.get("counts") or {}
        text = ", ".join(f"{n} {k}" for k, n in counts.items()) or str(f.get("summary", ""))
        return text + (f" ({f['note']})" if f.get("note") else "")
    if name == "bench":
        sides = f.get("sides") or {}
        ex, nv = sides.get("executor", {}), sides.get("naive", {})
        return (
            f"executor {fmt_num(ex.get('tokens_per_s'))} vs naive "
            f"{fmt_num(nv.get('tokens_per_s'))} tokens/s, MFU {fmt_pct(ex.get('mfu'))} vs "
            f"{fmt_pct(nv.get('mfu'))}, max |Δlogp| {fmt_diff(f.get('max_abs_logp_diff'))}"
        )
    if name == "oom":
        cap = (
            f"a simulated {f['cap_rows']}-row LM-head cap"
            if f.get("cap") == "simulated"
            else f"a {fmt_bytes(f.get('cap_bytes'))} cap"
        )
        return (
            f"{f.get('oom_splits', 'n/a')} splits under {cap}, "
            f"max |Δlogp| {fmt_diff(f.get('max_abs_logp_diff'))}"
        )
    if name == "e2e":
        return (
            f"{f.get('answered', 'n/a')}/{f.get('jobs', 'n/a')} jobs, "
            f"{fmt_num(f.get('jobs_per_s'), 1)} jobs/s, "
            f"max |Δlogp| {fmt_diff(f.get('max_abs_logp_diff'))}"
        )
    if name == "tp":
        group, one = f.get("group") or {}, f.get("one_device") or {}
        peaks = ", ".join(fmt_bytes(b) for b in group.get("rank_peak_allocated_bytes") or [])
        return (
            f"{f.get('ranks', 'n/a')} ranks over {f.get('backend', 'n/a')}: "
            f"{fmt_num(group.get('tokens_per_s'))} vs {fmt_num(one.get('tokens_per_s'))} "
            f"tokens/s on one device, peak per rank {peaks or 'n/a'} vs "
            f"{fmt_bytes(one.get('peak_allocated_bytes'))}, "
            f"max |Δlogp| {fmt_diff(f.get('max_abs_logp_diff'))}"
        )
    if name == "backends":
        rows = f.get("rows") or {}
        return ", ".join(f"{b}: {r.get('status', 'n/a')}" for b, r in rows.items())
    if name == "tree":
        return "; ".join(_tree_summary(k, r) for k, r in (f.get("rows") or {}).items())
    return ""


def _tree_summary(key: str, row: dict[str, Any]) -> str:
    """``sdpa/bfloat16: sharing on, P1024xG8xC128 4.10x, ..., max |Δlogp| 0.03``."""
    if row.get("status") != "ok":
        return f"{key}: {row.get('status', 'n/a')}"
    sets = row.get("sets") or {}
    sharing = "on" if row.get("sharing_enabled") else "OFF"
    speed = ", ".join(f"{n} {fmt_num(e['speedup'], 2)}x" for n, e in sets.items() if "speedup" in e)
    diffs = [e["max_abs_logp_diff"] for e in sets.values() if "max_abs_logp_diff" in e]
    worst = max(diffs) if diffs else None
    return f"{key}: sharing {sharing}, {speed + ', ' if speed else ''}max |Δlogp| {fmt_diff(worst)}"


def _steps_table(doc: dict[str, Any]) -> list[str]:
    lines = ["| step | status | seconds | budget s | figures |", "| --- | --- | --- | --- | --- |"]
    for name, step in doc.get("steps", {}).items():
        status = step.get("status", "n/a")
        if status == "failed":
            status = f"**failed**: {_cell(str(step.get('error', ''))[:120])}"
        lines.append(
            f"| {name} | {status} | {fmt_num(step.get('seconds'), 1)} | "
            f"{fmt_num(step.get('budget_s'))} | {_cell(summary(name, step))} |"
        )
    return lines


def _bench_table(doc: dict[str, Any]) -> list[str]:
    f = _figures(doc, "bench")
    if not f.get("sides"):
        return []
    lines = [
        "",
        f"## Benchmark: executor vs naive in-trainer loop ({f.get('dtype')}, "
        f"{f.get('sequences')} sequences, {fmt_num(f.get('real_tokens'))} tokens, "
        f"{fmt_num(f.get('scored_tokens'))} scored, executor backend "
        f"{f.get('attention_backend')})",
        "",
        "| side | tokens/s | seconds | peak allocated | over the weights | TFLOP/s | MFU |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, row in f["sides"].items():
        lines.append(
            f"| {side} | {fmt_num(row.get('tokens_per_s'))} | {fmt_num(row.get('seconds'), 3)} | "
            f"{fmt_bytes(row.get('peak_allocated_bytes'))} | "
            f"{fmt_bytes(row.get('peak_extra_bytes'))} | {fmt_num(row.get('tflops'), 1)} | "
            f"{fmt_pct(row.get('mfu'))} |"
        )
    lines += [
        "",
        f"Speed-up {fmt_num(f.get('speedup'), 2)}x; max |Δlogp| executor vs naive "
        f"{fmt_diff(f.get('max_abs_logp_diff'))} (tolerance {f.get('tolerance')}). MFU counts "
        "the useful FLOPs (body on every token, LM head on scored tokens, causal attention) "
        f"against the device's dense bf16 peak ({f.get('mfu_peak_tflops') or 'n/a'} TFLOP/s; "
        f"{f.get('mfu_peak_source') or 'no known peak: MFU n/a'}).",
    ]
    return lines


def _backends_table(doc: dict[str, Any]) -> list[str]:
    rows = _figures(doc, "backends").get("rows") or {}
    if not rows:
        return []
    lines = [
        "",
        "## Attention backends",
        "",
        "| backend | status | measured through | tokens/s | max \\|Δlogp\\| vs sdpa | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        note = r.get("reason") or r.get("executor_refused") or ""
        if "sdpa_tokens_per_s" in r:
            note = f"sdpa on the same loop: {fmt_num(r['sdpa_tokens_per_s'])} tokens/s. {note}"
        lines.append(
            f"| {name} | {r.get('status', 'n/a')} | {r.get('level', 'n/a')} | "
            f"{fmt_num(r.get('tokens_per_s'))} | {fmt_diff(r.get('max_abs_logp_diff_vs_sdpa'))} "
            f"| {_cell(str(note)[:200])} |"
        )
    return lines


def _pair(values: Any, digits: int = 0) -> str:
    """``off / auto`` of a ``{"off": x, "auto": y}`` figure."""
    v = values if isinstance(values, dict) else {}
    return f"{fmt_num(v.get('off'), digits)} / {fmt_num(v.get('auto'), digits)}"


def _tree_table(doc: dict[str, Any]) -> list[str]:
    f = _figures(doc, "tree")
    rows = f.get("rows") or {}
    if not rows:
        return []
    tol = f.get("tolerance") or {}
    limits = ", ".join(f"{d} {t.get('max')} / {t.get('mean')}" for d, t in tol.items())
    lines = [
        "",
        "## Prefix sharing: tree rows vs per sequence",
        "",
        "| row | set | sharing | backbone tokens off / auto | shared prefix tokens | "
        "seconds off / auto | speed-up | max \\|Δlogp\\| | largest mean | vs float32: tree / "
        "per sequence |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, row in rows.items():
        sets = row.get("sets") or {}
        if not sets:
            why = _cell(str(row.get("reason") or row.get("prefix_sharing") or ""))[:200]
            lines.append(f"| {key} | {row.get('status', 'n/a')}: {why} |" + " |" * 8)
            continue
        sharing = _cell(str((row.get("prefix_sharing") or {}).get("auto", "n/a")))
        for name, e in sets.items():
            ref = e.get("vs_float32") or {}
            vs = f"{fmt_diff(ref.get('tree_max'))} / {fmt_diff(ref.get('per_sequence_max'))}"
            shared = (e.get("shared_prefix_tokens") or {}).get("auto")
            lines.append(
                f"| {key} | {name} | {sharing} | {_pair(e.get('forward_tokens'))} | "
                f"{fmt_num(shared)} | {_pair(e.get('seconds'), 4)} | "
                f"{fmt_num(e.get('speedup'), 2)} | {fmt_diff(e.get('max_abs_logp_diff'))} | "
                f"{fmt_diff(e.get('mean_abs_logp_diff'))} | {vs if ref else 'n/a'} |"
            )
    effect = next((r["context_effect"] for r in rows.values() if "context_effect" in r), None)
    lines += [
        "",
        f"Tolerance tree vs per sequence, max / largest per-sequence mean: {limits or 'n/a'}. "
        f"Seconds: median of {f.get('max_repetitions', 'n/a')} interleaved runs at most "
        "(bfloat16 rows; float32 is the untimed reference). A new prompt moves the "
        f"completions' log-probs by up to {fmt_diff(effect)} on this model.",
        *[f"- note: {n}" for n in f.get("notes") or []],
    ]
    return lines


def _failures(doc: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for name, step in doc.get("steps", {}).items():
        if step.get("status") != "failed":
            continue
        lines += ["", f"### {name} failed", "", f"{step.get('error', '')}"]
        if step.get("traceback_tail"):
            lines += ["", "```", str(step["traceback_tail"]).strip(), "```"]
    return ["", "## Failures", *lines] if lines else []


def _peak_note(env: dict[str, Any]) -> str:
    if not env.get("bf16_peak_source"):
        return ""
    return f" as {env.get('bf16_peak_variant')}: {env['bf16_peak_source']}"


def render(doc: dict[str, Any]) -> str:
    """The whole markdown report."""
    env = _figures(doc, "env")
    mode = doc.get("mode", {})
    failed = doc.get("failed") or []
    result = "all steps passed" if doc.get("ok") else f"FAILED: {', '.join(failed)}"
    lines = [
        f"# GPU check, {doc.get('date', 'n/a')}",
        "",
        f"- device: {env.get('device_name', 'n/a')} (capability {env.get('capability', 'n/a')}, "
        f"{fmt_bytes(env.get('total_memory_bytes'))}, dense bf16 peak "
        f"{env.get('bf16_peak_tflops') or 'n/a'} TFLOP/s{_peak_note(env)})",
        f"- software: python {env.get('python', 'n/a')}, torch {env.get('torch', 'n/a')}, "
        f"transformers {env.get('transformers', 'n/a')}, CUDA {env.get('cuda_runtime', 'n/a')}",
        f"- mode: --device {mode.get('device')}{' --tiny' if mode.get('tiny') else ''}, "
        f"budget {mode.get('budget_s')} s, took {fmt_num(doc.get('elapsed_s'), 1)} s",
        f"- result: {result}",
        "",
        *_steps_table(doc),
        *_bench_table(doc),
        *_tree_table(doc),
        *_backends_table(doc),
        *_failures(doc),
    ]
    return "\n".join(lines) + "\n"
