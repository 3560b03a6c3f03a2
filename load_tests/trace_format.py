"""A replayable traffic trace: JSON Lines, one request per line, in arrival order.

    {"arrival_s": 0.000, "tenant": "acme", "prompt_tokens": 213, "output_tokens": 388}
    {"arrival_s": 0.412, "tenant": "beta", "prompt": "Summarise ...", "output_tokens": 64}
    {"arrival_s": 0.950, "tenant": "acme", "prompt_token_ids": [504, 17, ...], "output_tokens": 12,
     "api_key": "sk-...", "cancel_after_tokens": 5, "family": 2}

Fields: `arrival_s` (seconds from the start of the run, non-decreasing), `output_tokens`
(exact; sent with ignore_eos), and one of `prompt` (text), `prompt_token_ids` or
`prompt_tokens` (a length: the prompt is cut from the corpus, seeded). Optional: `tenant`
(default "default"), `api_key`, `cancel_after_tokens`, `family`, `adapter` (a LoRA adapter's
name). Lines starting with '#'
and blank lines are skipped. Users export their own traffic into this shape to replay it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvmesh.core.errors import InvalidRequestError


@dataclass(frozen=True)
class TraceRecord:
    arrival_s: float
    output_tokens: int
    tenant: str = "default"
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_tokens: int | None = None
    api_key: str | None = None
    cancel_after_tokens: int | None = None
    family: int | None = None
    adapter: str | None = None


_FIELDS = set(TraceRecord.__dataclass_fields__)


def parse_trace_line(line: str, where: str) -> TraceRecord:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{where}: expected an object")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise InvalidRequestError(f"{where}: unknown field(s) {unknown}")
    for name in ("arrival_s", "output_tokens"):
        if name not in data:
            raise InvalidRequestError(f"{where}: missing {name!r}")
    prompt_fields = [k for k in ("prompt", "prompt_token_ids", "prompt_tokens") if data.get(k) is not None]
    if len(prompt_fields) != 1:
        raise InvalidRequestError(f"{where}: give exactly one of prompt, prompt_token_ids, prompt_tokens")
    if not isinstance(data["output_tokens"], int) or data["output_tokens"] < 1:
        raise InvalidRequestError(f"{where}: output_tokens must be an integer >= 1")
    if not isinstance(data["arrival_s"], (int, float)) or data["arrival_s"] < 0:
        raise InvalidRequestError(f"{where}: arrival_s must be a number >= 0")
    if data.get("prompt_tokens") is not None and (not isinstance(data["prompt_tokens"], int) or data["prompt_tokens"] < 1):
        raise InvalidRequestError(f"{where}: prompt_tokens must be an integer >= 1")
    if data.get("prompt_token_ids") is not None:
        data["prompt_token_ids"] = tuple(int(t) for t in data["prompt_token_ids"])
    data["arrival_s"] = float(data["arrival_s"])
    return TraceRecord(**data)


def read_trace(path: str | Path) -> list[TraceRecord]:
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            rec = parse_trace_line(line, f"{path}:{lineno}")
            if records and rec.arrival_s < records[-1].arrival_s:
                raise InvalidRequestError(f"{path}:{lineno}: arrival_s goes backwards")
            records.append(rec)
    if not records:
        raise InvalidRequestError(f"{path}: the trace has no requests")
    return records


def write_trace(path: str | Path, requests: list, arrivals_s: list[float],
                with_text: bool = True) -> None:
    """Write a workload (WorkloadRequests, and their arrival offsets) as a trace that replays it exactly."""
    if len(requests) != len(arrivals_s):
        raise InvalidRequestError("one arrival time per request is needed")
    with open(path, "w", encoding="utf-8") as fh:
        for req, at in zip(requests, arrivals_s):
            rec: dict = {"arrival_s": round(float(at), 6), "tenant": req.tenant_id, "output_tokens": req.output_tokens}
            if with_text:
                rec["prompt_token_ids"] = list(req.prompt_token_ids)
            else:
                rec["prompt_tokens"] = req.prompt_tokens
            for name in ("api_key", "cancel_after_tokens", "family", "adapter"):
                if getattr(req, name) is not None:
                    rec[name] = getattr(req, name)
            fh.write(json.dumps(rec) + "\n")
