"""`kvmesh chat`: an interactive chat with a running kvmesh server, over gRPC.

    kvmesh chat                                   # 127.0.0.1:50051 (router defaults)
    kvmesh chat --server router:50051 --system "Answer briefly." --temperature 0.7
    echo "What is a KV cache?" | kvmesh chat      # one turn per input line, then exit

The conversation is kept client side and sent whole each turn (the server's prefix cache
makes the repeated history cheap: its blocks are already cached on the worker that served
the previous turn, and prefix-aware routing sends the next turn there). The API key comes
from `--api-key` or $KVMESH_API_KEY. Retries and cancellation (Ctrl-C stops the current
reply and aborts it on the server) are the client library's (router/client.py).

`run_remote_generate` is also what `kvmesh generate --server ADDR` calls.
"""

from __future__ import annotations

import argparse
import os
import sys

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

API_KEY_ENV = "KVMESH_API_KEY"
DEFAULT_SERVER = "127.0.0.1:50051"
EXIT_ERROR = 1


def register(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat with a running kvmesh server (gRPC)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"router gRPC address (default {DEFAULT_SERVER})")
    p.add_argument("--api-key", default=None, help=f"API key (default ${API_KEY_ENV})")
    p.add_argument("--system", default=None, help="system message that opens the conversation")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None, help="seconds per reply, retries included")
    p.set_defaults(func=run)


def _client(server: str, api_key: str | None):
    from kvmesh.router.client import KvmeshClient

    return KvmeshClient(server, api_key=api_key or os.environ.get(API_KEY_ENV))


def _stream_reply(client, out, **generate_kwargs) -> str:
    """Print one streamed reply; returns its text (restarted streams print from scratch)."""
    from kvmesh.router.client import StreamRestart

    parts: list[str] = []
    for item in client.generate(**generate_kwargs):
        if isinstance(item, StreamRestart):
            out.write("\n[connection lost; restarting the reply]\n")
            parts.clear()
            continue
        if item.text:
            parts.append(item.text)
            out.write(item.text)
            out.flush()
    return "".join(parts)


def run(args: argparse.Namespace) -> int:
    from kvmesh.core.seams import SamplingParams
    from kvmesh.core.errors import KvmeshError

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with _client(args.server, args.api_key) as client:
        while True:
            if interactive:
                sys.stdout.write("you> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            try:
                reply = _stream_reply(client, sys.stdout, messages=messages, sampling=sampling,
                                      timeout_s=args.timeout)
            except KeyboardInterrupt:  # stop this reply (the RPC is cancelled), keep chatting
                messages.pop()
                sys.stdout.write("\n[stopped]\n")
                continue
            except KvmeshError as exc:
                print(f"\nkvmesh chat: {type(exc).__name__}: {exc}", file=sys.stderr)
                return EXIT_ERROR
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": reply})


def run_remote_generate(server: str, prompt: str, sampling, chat: bool, system: str | None,
                        api_key: str | None = None) -> int:
    """`kvmesh generate --server ADDR`: the same output contract as the in-process command
    (exactly the generated text on stdout, errors on stderr, exit 2 for a bad request)."""
    from kvmesh.core.errors import InvalidRequestError, KvmeshError

    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        kwargs = {"messages": messages}
    else:
        kwargs = {"prompt": prompt}
    try:
        with _client(server, api_key) as client:
            _stream_reply(client, sys.stdout, sampling=sampling, **kwargs)
    except KvmeshError as exc:
        print(f"kvmesh generate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidRequestError) else EXIT_ERROR
    if sys.stdout.isatty():
        sys.stdout.write("\n")
    return 0
