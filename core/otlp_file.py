"""OTLP/JSON span files: what an OpenTelemetry Collector's `file` exporter writes, written
by kvmesh's own processes, so a trace can be read without running a collector.

    observability:
      tracing_exporter: otlp
      otlp_endpoint: file:///var/log/kvmesh/spans.jsonl   # a file:// endpoint = this exporter

Each export batch is one line: an ExportTraceServiceRequest in the OTLP/JSON encoding
(camelCase fields, trace and span ids as lowercase hex, as the OTLP spec requires, not the
protobuf JSON default base64). Every process of the cluster appends its own lines to the
path on its node; a line goes out in one `write` on an O_APPEND descriptor, so lines of
concurrent processes do not interleave on a local filesystem.

`kvmesh trace REQUEST_ID --file spans.jsonl` (deploy/cmd_trace.py) reads these lines (and
the collector's, which are the same format).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)

FILE_SCHEME = "file://"
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def path_of_endpoint(endpoint: str | None) -> str | None:
    """The file path of a `file://` OTLP endpoint, else None (a network collector)."""
    if endpoint and endpoint.startswith(FILE_SCHEME):
        return endpoint[len(FILE_SCHEME):]
    return None


def _ids_to_hex(span: dict) -> None:
    for key in _ID_FIELDS:
        if span.get(key):
            span[key] = base64.b64decode(span[key]).hex()
    for link in span.get("links", []):
        for key in ("traceId", "spanId"):
            if link.get(key):
                link[key] = base64.b64decode(link[key]).hex()


def encode_json_line(spans: Sequence[ReadableSpan]) -> str:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return request_to_json_line(encode_spans(spans))


def request_to_json_line(request) -> str:
    """An ExportTraceServiceRequest protobuf as one OTLP/JSON line (hex ids)."""
    from google.protobuf import json_format

    body = json_format.MessageToDict(request)
    for resource_spans in body.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                _ids_to_hex(span)
    return json.dumps(body, separators=(",", ":")) + "\n"


class OtlpJsonFileExporter(SpanExporter):
    def __init__(self, path: str):
        self.path = path
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            data = encode_json_line(spans).encode()
            with self._lock:
                os.write(self._fd, data)
        except OSError:
            logger.exception("writing %d spans to %s failed", len(spans), self.path)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# ---- reading --------------------------------------------------------------------------------

def _attribute_value(value: dict):
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return value[kind]
    if "intValue" in value:
        return int(value["intValue"])  # OTLP/JSON carries int64 as a string
    if "arrayValue" in value:
        return [_attribute_value(v) for v in value["arrayValue"].get("values", [])]
    return None


def attributes(items: Iterable[dict]) -> dict:
    return {a["key"]: _attribute_value(a.get("value", {})) for a in items}


def _hex_id(value: str) -> str:
    """Ids as the collector (hex) or protobuf's default JSON (base64) wrote them -> hex."""
    if not value:
        return ""
    try:
        int(value, 16)
        if len(value) in (16, 32):
            return value.lower()
    except ValueError:
        pass
    return base64.b64decode(value).hex()


def read_spans(lines: Iterable[str]) -> Iterator[dict]:
    """Flat span dicts from OTLP/JSON lines: trace_id, span_id, parent_id (hex), name, service,
    start_ns, end_ns, attributes, events [(name, time_ns, attributes)]. Blank lines are skipped;
    a line that is not JSON raises ValueError with its number."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number} is not OTLP/JSON: {exc}") from None
        for resource_spans in body.get("resourceSpans", []):
            service = attributes(resource_spans.get("resource", {}).get("attributes", [])).get("service.name", "")
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    yield {"trace_id": _hex_id(span.get("traceId", "")), "span_id": _hex_id(span.get("spanId", "")),
                           "parent_id": _hex_id(span.get("parentSpanId", "")), "name": span.get("name", ""),
                           "service": service, "start_ns": int(span.get("startTimeUnixNano", 0)),
                           "end_ns": int(span.get("endTimeUnixNano", 0)),
                           "attributes": attributes(span.get("attributes", [])),
                           "events": [(e.get("name", ""), int(e.get("timeUnixNano", 0)),
                                       attributes(e.get("attributes", []))) for e in span.get("events", [])]}
