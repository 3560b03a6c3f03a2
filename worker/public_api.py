"""The worker as the router sees it: the one module of worker/ that router/ may import.

Starting, finding and stopping the worker actors, the records they report, and the model's
tokenizer (the router counts and renders prompts with the same tokenizer the engine uses), and
the structured-output check (the router refuses a constraint that does not compile before it
reserves anything).
Everything else the router shares with the worker (requests, deltas, stats, errors) lives in
the bottom layer, kvmesh.core. tests/test_layers.py enforces the rule.
"""

from kvmesh.worker.model.grammar import check_structured_output
from kvmesh.worker.model.tokenizer import load_tokenizer, render_chat
from kvmesh.worker.runtime.actor import WorkerInfo, WorkerPoll, drain_workers, find_workers, kill_workers, start_workers

__all__ = ["check_structured_output", "WorkerInfo", "WorkerPoll", "drain_workers", "find_workers", "kill_workers", "load_tokenizer", "render_chat", "start_workers"]
