"""`sluice sim`: run the vLLM-compatible simulator as a server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from sluice.sim.model_registry import parse_lora_modules
from sluice.sim.profiles import DEFAULT_PROFILE, PROFILES, Profile, get_profile
from sluice.sim.surfaces import SURFACES, get_surface

_DEFAULT_MODEL = "sluice-sim"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind (8000; 0 picks a free one)"
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        choices=sorted(PROFILES),
        help=f"engine profile ({DEFAULT_PROFILE})",
    )
    parser.add_argument("--kv-blocks", type=int, help="number of KV-cache blocks (profile's)")
    parser.add_argument("--block-size", type=int, help="tokens per KV block (profile's)")
    parser.add_argument("--max-num-seqs", type=int, help="max running requests (profile's)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="token budget per step (profile's)"
    )
    parser.add_argument(
        "--max-model-len", type=int, help="max prompt + output tokens per request (profile's)"
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="run X times faster than the profile (1.0)"
    )
    parser.add_argument(
        "--engine",
        default="vllm",
        choices=sorted(SURFACES),
        help="whose surface to present: metric names and routes, health and models answers, "
        "admission and refusals (vllm)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for output lengths (0)")
    parser.add_argument(
        "--model", default=_DEFAULT_MODEL, help=f"served model name ({_DEFAULT_MODEL})"
    )
    parser.add_argument(
        "--enable-responses-store",
        action="store_true",
        default=None,
        help="store Responses API answers (GET, cancel, background), like vLLM's "
        "VLLM_ENABLE_RESPONSES_API_STORE=1 (which also turns it on)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters loaded at start, listed by /v1/models and served by name",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=None,
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter, like vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (which also turns it on)",
    )


def build_profile(args: argparse.Namespace) -> Profile:
    """The named profile with the command line's overrides; ValueError if inconsistent."""
    base = get_profile(args.profile)
    overrides: dict[str, int] = {}
    for arg, field in (
        ("kv_blocks", "num_gpu_blocks"),
        ("block_size", "block_size"),
        ("max_num_seqs", "max_num_seqs"),
        ("max_num_batched_tokens", "max_num_batched_tokens"),
        ("max_model_len", "max_model_len"),
    ):
        value = getattr(args, arg, None)
        if value is not None:
            overrides[field] = value
    if "max_model_len" not in overrides:
        # a smaller KV cache than the profile's shrinks the context to fit, instead of
        # refusing to start (vLLM would ask for --max-model-len)
        blocks = overrides.get("num_gpu_blocks", base.num_gpu_blocks)
        size = overrides.get("block_size", base.block_size)
        overrides["max_model_len"] = min(base.max_model_len, blocks * size)
    profile = dataclasses.replace(base, **overrides)  # type: ignore[arg-type]  # int fields
    if args.speed <= 0:
        raise ValueError("--speed must be positive")
    parse_lora_modules(getattr(args, "lora_modules", []))  # refuse a bad one before starting
    return profile


def run(args: argparse.Namespace) -> int:
    try:
        profile = build_profile(args)
    except ValueError as exc:
        print(f"sluice sim: {exc}", file=sys.stderr)
        return 2
    import uvloop

    try:
        return uvloop.run(_serve(args, profile))
    except OSError as exc:
        print(f"sluice sim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


async def _serve(args: argparse.Namespace, profile: Profile) -> int:
    from aiohttp import web

    from sluice.sim.server import create_sim_app

    app = create_sim_app(
        profile,
        seed=args.seed,
        speed=args.speed,
        model_name=args.model,
        engine=args.engine,
        responses_store=args.enable_responses_store,
        lora_modules=parse_lora_modules(args.lora_modules),
        allow_lora_updating=args.allow_runtime_lora_updating,
    )
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else args.port

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    profile = get_surface(args.engine).profile(profile)
    print(
        f"sluice sim: {args.engine} surface, serving model {args.model!r} on "
        f"http://{args.host}:{port} "
        f"(profile {profile.name}: {profile.num_gpu_blocks} KV blocks x {profile.block_size} "
        f"tokens, max_num_seqs {profile.max_num_seqs}, max_model_len {profile.max_model_len}, "
        f"speed x{args.speed:g}, seed {args.seed})",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
