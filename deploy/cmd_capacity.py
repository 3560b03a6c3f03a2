"""`kvmesh capacity`: KV tokens and concurrent requests a device holds, from a model's shape.

    kvmesh capacity --layers 32 --kv-heads 8 --head-dim 128 --device-gib 24 \\
        --weights-gib 13.04 --reserved-gib 2 --context 4096
    kvmesh capacity --model path/to/model.gguf --device-gib 8 --weight-dtype int4 --json

Exit codes: 0 plan printed, 2 bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

KV_DTYPES = ("fp16", "bf16", "fp32", "fp8", "int8", "int4")
WEIGHT_DTYPES = ("fp16", "bf16", "fp32", "int8", "int4", "gguf")  # gguf: a .gguf's own types (quant.weight gguf)

EXIT_BAD_INPUT = 2


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "capacity", help="KV cache capacity plan for a model on a device",
        description="KV bytes per token, KV budget, total KV tokens and concurrent requests. "
                    "KV budget = device-gib x utilization - weights - reserved-gib.")
    shape = p.add_argument_group("model shape (--model, or the flags)")
    shape.add_argument("--model", help="HF folder with config.json, a config.json, or a .gguf file")
    shape.add_argument("--layers", type=int, help="decoder layers (L)")
    shape.add_argument("--kv-heads", type=int, help="KV heads (h_kv; GQA: fewer than query heads)")
    shape.add_argument("--head-dim", type=int, help="head dimension (d)")
    shape.add_argument("--hidden", type=int, help="hidden size (approximates int8 per-channel scales)")
    shape.add_argument("--params", type=float, help="parameter count, e.g. 7e9 (sizes the weights)")
    dtypes = p.add_argument_group("precision")
    dtypes.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp16",
                        help="KV cache dtype; int8/fp8 add fp16 per-token per-head scales, int4 (two a byte) "
                             "an fp16 scale per token-head and group of up to 32 channels")
    dtypes.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, default="fp16")
    dtypes.add_argument("--group-size", type=int, default=128, help="int4 quantization group size")
    dev = p.add_argument_group("device budget")
    dev.add_argument("--device-gib", type=float, default=24.0, help="device memory, GiB (2**30 bytes)")
    dev.add_argument("--weights-gib", type=float, help="weights, GiB (overrides the estimate)")
    dev.add_argument("--reserved-gib", type=float, default=2.0,
                     help="activations, workspace, runtime and fragmentation margin, GiB")
    dev.add_argument("--utilization", type=float, default=1.0,
                     help="share of the device the plan may use (vLLM's gpu_memory_utilization). "
                          "1.0 = the articles' rough plan, margin in --reserved-gib only; "
                          "their production advice is <= 0.8")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", choices=("none", "self_draft"), default="none",
                      help="self_draft: the worker also holds an int8/int4 copy of the weights and a draft KV "
                           "pool of as many blocks as the target's (both counted in the device split)")
    spec.add_argument("--draft-weight-dtype", choices=("int8", "int4"), default="int8",
                      help="the self-draft's weights (speculative.draft_quant)")
    p.add_argument("--context", type=int, default=4096, help="context length per request, tokens")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.core.config import ConfigError
    from kvmesh.kv import capacity

    try:
        shape = _shape_from_args(args, capacity)
        budget = capacity.DeviceBudget(device_gib=args.device_gib, reserved_gib=args.reserved_gib,
                                       utilization=args.utilization, weights_gib=args.weights_gib)
        plan = capacity.plan_capacity(shape, budget, kv_dtype=args.kv_dtype, weight_dtype=args.weight_dtype,
                                      group_size=args.group_size, context_tokens=args.context,
                                      block_size=args.block_size)
        split = device_split(args, shape, plan, capacity)
    except ConfigError as exc:
        print(f"kvmesh capacity: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps({"model": _shape_dict(shape), "plan": plan.to_dict(), "device_split": split.split(),
                          "device_split_blocks": {"kv_pool": split.num_blocks,
                                                  "draft_kv_pool": split.num_draft_blocks}}, indent=2))
    else:
        print(format_plan(shape, plan, capacity.GIB))
        print(format_split(split, capacity.GIB))
    return 0


def device_split(args: argparse.Namespace, shape, plan, capacity):
    """The device plan by part, as a worker's kvmesh_memory_planned_bytes{part} shows it
    (kv/device_plan.py): --reserved-gib stands for runtime + activations + graphs + sampler,
    which only a running worker measures. With a self-draft both KV pools share the budget."""
    from kvmesh.kv.device_plan import DeviceParts, plan_device

    draft_weights, draft_per_block = 0, 0
    if args.speculative == "self_draft":
        draft_weights = capacity.estimate_weight_bytes(shape, args.draft_weight_dtype, args.group_size).total_bytes
        draft_per_block = args.block_size * capacity.kv_bytes_per_token(shape.num_layers, shape.num_kv_heads,
                                                                        shape.head_dim, "fp16")
    parts = DeviceParts(runtime_bytes=int(args.reserved_gib * capacity.GIB), weight_bytes=plan.weight_bytes,
                        draft_weight_bytes=draft_weights)
    return plan_device(int(args.device_gib * args.utilization * capacity.GIB), parts,
                       args.block_size * plan.kv_bytes_per_token, draft_kv_bytes_per_block=draft_per_block)


def format_split(split, gib: int) -> str:
    names = {"runtime": "reserved (runtime, activations, graphs, sampler)", "kv_pool": "KV pool",
             "draft_kv_pool": "draft KV pool", "draft_weights": "draft weights"}
    rows = [(names.get(part, part), f"{nbytes / gib:.3f} GiB") for part, nbytes in split.split().items() if nbytes]
    rows.append(("sum / budget", f"{split.total_bytes / gib:.3f} / {split.budget_bytes / gib:.3f} GiB"))
    width = max(len(k) for k, _ in rows)
    return "device split (a worker's kvmesh_memory_planned_bytes):\n" + "\n".join(
        f"  {k:<{width}}  {v}" for k, v in rows)


def _shape_from_args(args: argparse.Namespace, capacity):
    from kvmesh.core.config import ConfigError

    flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    if args.model:
        given = [name for name, value in flags.items() if value is not None]
        if given:
            raise ConfigError(f"--model and {', '.join(given)} are exclusive: the model file defines its shape")
        shape = capacity.load_model_shape(args.model)
        if args.params is not None:
            raise ConfigError("--params is read from the model; use --weights-gib to override the weights")
        return shape
    missing = [name for name, value in flags.items() if value is None]
    if missing:
        raise ConfigError(f"give --model, or all of --layers --kv-heads --head-dim (missing {' '.join(missing)})")
    if args.params is not None and (args.params < 1 or args.params != int(args.params)):
        raise ConfigError(f"--params must be a whole number >= 1, got {args.params}")
    return capacity.ModelShape(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                               hidden_size=args.hidden,
                               num_params=int(args.params) if args.params is not None else None).validate()


def _shape_dict(shape) -> dict:
    return {k: getattr(shape, k) for k in shape.__dataclass_fields__} | {"total_params": shape.total_params}


def format_plan(shape, plan, gib: int) -> str:
    rows = [
        ("model", f"{shape.source}: L={shape.num_layers} h_kv={shape.num_kv_heads} d={shape.head_dim}"
                  + (f" params={shape.total_params:,}" if shape.total_params else "")),
        ("KV dtype / weight dtype", f"{plan.kv_dtype} / {plan.weight_dtype}"),
        ("KV bytes/token", f"{plan.kv_bytes_per_token:,}"
                           + (f" (incl. {plan.kv_scale_bytes_per_token:,} of fp16 scales)"
                              if plan.kv_scale_bytes_per_token else "")),
        ("KV KiB/token", f"{plan.kv_bytes_per_token / 1024:.1f}"),
        (f"KV per request at {plan.context_tokens:,} tokens",
         f"{plan.kv_bytes_per_request / gib:.3f} GiB"
         f" ({plan.kv_bytes_per_request_blocks / gib:.3f} GiB in {plan.block_size}-token blocks)"),
        ("weights", f"{plan.weights_gib:.2f} GiB"
                    + (f" (incl. {plan.weight_metadata_bytes / gib:.3f} GiB quantization metadata)"
                       if plan.weight_metadata_bytes else "")),
        ("KV budget", f"{plan.device_gib:g} GiB x {plan.utilization:g} - {plan.weights_gib:.2f} GiB weights"
                      f" - {plan.reserved_gib:g} GiB reserved = {plan.kv_budget_gib:.2f} GiB"),
        ("total KV tokens", f"{plan.max_kv_tokens:,}"),
        ("KV blocks", f"{plan.num_blocks:,} x {plan.block_size} = {plan.max_kv_tokens_blocks:,} tokens"),
        (f"requests at {plan.context_tokens:,} tokens",
         f"{plan.max_requests_at_context} ({plan.max_requests_at_context_blocks} block-granular)"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if plan.utilization > 0.8:
        lines.append(f"note: utilization {plan.utilization:g} plans more than the ~80% of device memory "
                     f"the articles advise for production (--utilization 0.8)")
    return "\n".join(lines)
