"""The ``ascent`` command: ``serve``, ``generate``, ``chat`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ascent import __version__
from ascent.args import EngineArgs


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace, **overrides: Any):
    from ascent.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sampling_seed, stop=args.stop,
        **overrides)


def _make_llm(args: argparse.Namespace):
    from ascent.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    fields = {k: v for k, v in vars(engine_args).items() if k != "model"}
    return LLM(model=engine_args.model, **fields)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _sampling_params(args)
    prompts = args.prompt or ["Hello, my name is"]
    if args.chat_format:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f"Prompt: {prompt!r}")
        print(f"Generated: {out.outputs[0].text!r}  [{out.outputs[0].finish_reason}]")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat: streams each reply token by token using the engine's step loop."""
    from ascent.outputs import RequestOutputKind
    from ascent.tokenizer import apply_chat_template

    llm = _make_llm(args)
    engine = llm.llm_engine
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    print("ascent chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            print()  # end the prompt line
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        prompt = apply_chat_template(engine.tokenizer, messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        params = _sampling_params(args, output_kind=RequestOutputKind.DELTA)
        req_id = engine.add_request(None, {"prompt": prompt, "prompt_token_ids": ids}, params)
        reply = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == req_id and out.outputs:
                    delta = out.outputs[0].text
                    reply.append(delta)
                    print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ascent", description="Portable LLM inference engine")
    parser.add_argument("-v", "--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompt", nargs="*", help="prompt text(s)")
    gen.add_argument("--chat-format", action="store_true", help="wrap each prompt as a user chat message")
    EngineArgs.add_cli_args(gen)
    _sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with streaming output")
    chat.add_argument("--system-prompt", default=None)
    EngineArgs.add_cli_args(chat)
    _sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)

    from ascent.entrypoints.openai.api_server import add_serve_args, run_server

    srv = sub.add_parser("serve", help="OpenAI-compatible API server (the default model when MODEL is omitted)")
    add_serve_args(srv)
    srv.set_defaults(func=run_server)

    from ascent.benchmarks.cli import register_bench_parser

    register_bench_parser(sub)
    from ascent.quantization.export.cli import register_quantize_parser

    register_quantize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        rc = args.func(args)
        return rc if isinstance(rc, int) else 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
