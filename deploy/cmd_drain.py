"""`kvmesh drain`: take workers out of a running cluster without losing a stream.

    kvmesh drain --address auto                      # every worker of app "kvmesh"
    kvmesh drain --address auto --node-local         # the workers on this Ray node (a pod's preStop)
    kvmesh drain --address auto --grace-s 60 --app-name kvmesh

Each worker drained leaves the routable set at once (it reports itself unhealthy, so every
router replica stops sending it work), lets its streams finish for up to --grace-s, then ends
the rest retryably, and the router resumes each on another worker from the tokens it streamed
(WorkerActor.drain). The command returns once every drain did: a Kubernetes preStop hook runs
it, and the pod stops only after (the chart sizes terminationGracePeriodSeconds above the
grace). The workers stay drained; a worker pod that is not going away after all needs a
restart of its actors (or `undrain` from Python).
Exit codes: 0 drained (or nothing to drain), 1 the cluster could not be reached.
"""

from __future__ import annotations

import argparse
import sys

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

EXIT_UNREACHABLE = 1
DEFAULT_GRACE_S = 30.0  # router.drain_grace_s's default


def register(subparsers) -> None:
    p = subparsers.add_parser("drain", help="drain workers (leave the routable set, finish or move their streams)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.add_argument("--app-name", default="kvmesh", help="Serve application name (default kvmesh)")
    p.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                   help=f"seconds each worker lets its streams finish before they move (default {DEFAULT_GRACE_S:g})")
    p.add_argument("--node-local", action="store_true", help="only the workers on the Ray node this runs on")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.grace_s < 0:
        print("kvmesh drain: --grace-s must be >= 0", file=sys.stderr)
        return 2
    import ray  # Ray: only when the command runs

    from kvmesh.router.degradation import fallback_app_name
    from kvmesh.worker.public_api import drain_workers  # Ray: as above

    try:
        ray.init(address=args.address, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        print(f"kvmesh drain: cannot reach the Ray cluster at {args.address}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        node_id = ray.get_runtime_context().get_node_id() if args.node_local else None
        moved = drain_workers((args.app_name, fallback_app_name(args.app_name)), args.grace_s, node_id)
    finally:
        ray.shutdown()
    for name, count in sorted(moved.items()):
        print(f"kvmesh drain: {name}: drained, {count} request(s) moved to other workers")
    if not moved:
        print("kvmesh drain: no worker to drain" + (" on this node" if args.node_local else ""))
    return 0
