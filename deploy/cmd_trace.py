"""`kvmesh trace REQUEST_ID`: one request's trace as a tree, from OTLP/JSON span files.

    kvmesh trace 3f2a... --file /var/log/kvmesh/spans.jsonl            # kvmesh's file exporter
    kvmesh trace acme/3f2a... --file node1.jsonl --file node2.jsonl    # a file per node
    kvmesh trace 0af7651916cd43dd8448eb211c80319c --file spans.jsonl   # a trace id works too

The files are what `observability.otlp_endpoint: file:///path` makes every kvmesh process
write (core/otlp_file.py), or an OpenTelemetry Collector's `file` exporter: no collector
or tracing backend is needed. REQUEST_ID is the id the client sent or got back (the
router's `kvmesh.request_id` attribute is `<tenant>/<id>`; either form matches).

Output: one line per span, indented under its parent, with its start offset from the trace's
first span, its duration, the process (service.name) and its kvmesh.* attributes, e.g.

    kvmesh.request  +0.0 ms  41.3 ms  [kvmesh-router]  tenant=acme request_id=acme/r1
      kvmesh.admission  +1.2 ms  0.4 ms  [kvmesh-router]  admission.wait_s=0.0004
      kvmesh.route  ...  route.worker=worker-0 route.candidates=['worker-0 matched=2 load=40']
      kvmesh.stream  ...  route.predicted_prefix_blocks=2 prefix.hit_blocks=2
        kvmesh.worker.generate  ...
          kvmesh.worker.prefill  ...  prefill.chunks=1
            kvmesh.worker.prefill_chunk  ...  prefill.chunk_tokens=8

Exit codes: 0 printed, 1 no span of that request, 2 a file could not be read.
"""

from __future__ import annotations

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

import argparse
import sys

EXIT_NOT_FOUND = 1
EXIT_UNREADABLE = 2


def register(subparsers) -> None:
    p = subparsers.add_parser("trace", help="one request's trace as a tree, from OTLP/JSON span files",
                              description="Print the spans of one request (router, worker, prefill chunks, "
                                          "decode summary) from OTLP/JSON files; no collector needed.")
    p.add_argument("request_id", help="the request id (with or without the '<tenant>/' prefix) or a trace id")
    p.add_argument("--file", action="append", required=True, metavar="PATH",
                   help="OTLP/JSON span file (repeatable: one per node)")
    p.set_defaults(func=run)


def load_spans(paths: list[str]) -> list[dict]:
    from kvmesh.core.otlp_file import read_spans

    spans: list[dict] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            spans.extend(read_spans(f))
    return spans


def trace_ids_of(spans: list[dict], request_id: str) -> list[str]:
    """Trace ids whose spans name this request (a retry is a new trace: all are returned, in
    start order), or the id itself when it is a trace id present in the spans."""
    wanted = request_id.lower()
    if any(s["trace_id"] == wanted for s in spans):
        return [wanted]
    found: dict[str, int] = {}
    for s in spans:
        rid = str(s["attributes"].get("kvmesh.request_id", ""))
        if rid == request_id or rid.endswith("/" + request_id):
            found[s["trace_id"]] = min(found.get(s["trace_id"], s["start_ns"]), s["start_ns"])
    return sorted(found, key=found.get)


def _format_attrs(attrs: dict) -> str:
    return " ".join(f"{k.removeprefix('kvmesh.')}={v}" for k, v in sorted(attrs.items()) if k.startswith("kvmesh."))


def format_tree(spans: list[dict], trace_id: str) -> str:
    mine = [s for s in spans if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in mine}
    children: dict[str, list[dict]] = {}
    for s in mine:
        # A parent outside the files (the client's own span) makes the span a root here.
        children.setdefault(s["parent_id"] if s["parent_id"] in ids else "", []).append(s)
    t0 = min(s["start_ns"] for s in mine)
    lines = [f"trace {trace_id}"]

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s["start_ns"], s["name"])):
            lines.append(f"{'  ' * depth}{s['name']}  +{(s['start_ns'] - t0) / 1e6:.1f} ms  "
                         f"{(s['end_ns'] - s['start_ns']) / 1e6:.1f} ms  [{s['service']}]  "
                         f"{_format_attrs(s['attributes'])}".rstrip())
            walk(s["span_id"], depth + 1)
            for name, time_ns, attrs in s["events"]:  # after the children: a finish event reads last
                lines.append(f"{'  ' * (depth + 1)}@ {name}  +{(time_ns - t0) / 1e6:.1f} ms  "
                             f"{_format_attrs(attrs)}".rstrip())

    walk("", 1)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        spans = load_spans(args.file)
    except (OSError, ValueError) as exc:
        print(f"kvmesh trace: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    trace_ids = trace_ids_of(spans, args.request_id)
    if not trace_ids:
        print(f"kvmesh trace: no span of request {args.request_id!r} in {', '.join(args.file)} "
              f"({len(spans)} spans read)", file=sys.stderr)
        return EXIT_NOT_FOUND
    print("\n\n".join(format_tree(spans, t) for t in trace_ids))
    return 0
