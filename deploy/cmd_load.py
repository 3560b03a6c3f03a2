"""`kvmesh load ...`: run load-test campaigns and read their results.

  kvmesh load run CAMPAIGN.yaml [--out DIR] [--only RUN ...] [--allow-remote] [--no-progress]
  kvmesh load report RESULT_DIR        re-render summary.md and report.html, print the summary
  kvmesh load compare A_DIR B_DIR      per-run ratios B/A as a markdown table
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.


def register(subparsers) -> None:
    parser = subparsers.add_parser("load", help="load-test campaigns: run, report, compare")
    sub = parser.add_subparsers(dest="load_command", metavar="ACTION")
    sub.required = True

    run = sub.add_parser("run", help="run a campaign YAML and write results.json, summary.md, report.html")
    run.add_argument("campaign", help="campaign YAML (see load_tests/campaigns/)")
    run.add_argument("--out", help="result directory (default: load-results/<campaign>-<time>)")
    run.add_argument("--only", nargs="+", metavar="RUN", help="run only these runs (names or sweep labels)")
    run.add_argument("--allow-remote", action="store_true", help="allow non-loopback targets")
    run.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    run.set_defaults(func=_run)

    report = sub.add_parser("report", help="re-render the reports of a result directory")
    report.add_argument("result_dir")
    report.set_defaults(func=_report)

    compare = sub.add_parser("compare", help="compare two result directories (ratios B/A)")
    compare.add_argument("a")
    compare.add_argument("b")
    compare.add_argument("--out", help="also write the markdown table here")
    compare.set_defaults(func=_compare)


def _run(args: argparse.Namespace) -> int:
    from kvmesh.load_tests.campaign import load_campaign, run_campaign
    from kvmesh.load_tests.report import markdown_summary
    from kvmesh.core.errors import InvalidRequestError

    try:
        campaign = load_campaign(args.campaign)
        out = Path(args.out or f"load-results/{campaign.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        results = run_campaign(campaign, out, allow_remote=args.allow_remote, progress=not args.no_progress,
                               only=args.only)
    except InvalidRequestError as exc:
        print(f"kvmesh load run: {exc.message}", file=sys.stderr)
        return 2
    print(markdown_summary(results))
    print(f"results: {out}/results.json, {out}/report.html, {out}/summary.md")
    return 0


def _report(args: argparse.Namespace) -> int:
    from kvmesh.load_tests.report import load_results, markdown_summary, write_reports
    from kvmesh.core.errors import InvalidRequestError

    try:
        results = load_results(args.result_dir)
    except InvalidRequestError as exc:
        print(f"kvmesh load report: {exc.message}", file=sys.stderr)
        return 2
    write_reports(results, args.result_dir)
    print(markdown_summary(results))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from kvmesh.load_tests.report import load_results, markdown_compare
    from kvmesh.core.errors import InvalidRequestError

    try:
        text = markdown_compare(load_results(args.a), load_results(args.b), args.a, args.b)
    except InvalidRequestError as exc:
        print(f"kvmesh load compare: {exc.message}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0
