"""`kvmesh generate PROMPT`: stream a completion from an in-process engine to stdout.

Exactly the generated text goes to stdout (logs go to stderr), so scripts can capture it:

    kvmesh generate "The capital of France is" --max-tokens 8 --temperature 0
"""

from __future__ import annotations

import argparse
import sys

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt (in-process engine)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="prompt text ('-' reads it from stdin)")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--speculative", default=None, choices=["none", "ngram", "self_draft"],
                   help="in-process: the speculative decoding proposer (speculative.method, default none); "
                        "with --server the server's own method applies and 'none' opts this request out")
    p.add_argument("--server", default=None, metavar="ADDR",
                   help="generate on a running kvmesh server (gRPC host:port) instead of in-process")
    p.set_defaults(func=run)


def _sampling(args):
    from kvmesh.core.seams import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop),
                          speculative=getattr(args, "speculative", None) != "none")


def run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if getattr(args, "server", None):
        # A client of a running server: the gRPC client only, never torch or the engine
        # (tests/test_cli_client_imports.py).
        from kvmesh.deploy.cmd_chat import run_remote_generate

        return run_remote_generate(args.server, prompt, _sampling(args), args.chat, args.system)
    return _run_in_process(args, prompt)


def _run_in_process(args, prompt: str) -> int:
    from kvmesh.core.config import ConfigError, KvmeshConfig
    from kvmesh.core.errors import KvmeshError
    from kvmesh.core.seams import FinishReason, GenerateRequest
    from kvmesh.worker.engine_loop.engine import Engine
    from kvmesh.worker.model.tokenizer import render_chat

    try:
        config = KvmeshConfig.from_dict({"model": {"path": args.model, "dtype": args.dtype},
                                         "parallel": {"device": args.device},
                                         "speculative": {"method": args.speculative or "none"}})
        sampling = _sampling(args)
        sampling.validate()
        engine = Engine.from_config(config)
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                [{"role": "user", "content": prompt}]
            prompt = render_chat(engine.tokenizer, messages)
        engine.add_request(GenerateRequest("cli-0", prompt=prompt, sampling=sampling))
    except (ConfigError, KvmeshError) as exc:
        print(f"kvmesh generate: {exc}", file=sys.stderr)
        return 2
    interactive = sys.stdout.isatty()
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.text:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            if delta.finished and delta.finish_reason == FinishReason.ERROR:
                print(f"\nkvmesh generate: {delta.error}", file=sys.stderr)
                return 1
    if interactive:
        sys.stdout.write("\n")
    return 0
