"""``ascent bench {throughput,latency}``: argparse wiring with vLLM's flag names."""

from __future__ import annotations

import argparse
from typing import Any


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def size_arg(text: str) -> int:
    """``--kv-cache-memory-bytes`` (512M, 2GiB, 1.5g), with the engine's parsing and message."""
    from ascent.args import cli_int_arg

    return cli_int_arg("kv_cache_memory_bytes")(text)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags every engine-running bench shares."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--hardware-profile", default="auto", choices=("auto", "cpu", "cuda", "a2", "a3", "310p", "a5"),
                       help="hardware family profile of the engine")
    group.add_argument("--dtype", default="auto",
                       choices=("auto", "float32", "float", "fp32", "bfloat16", "bf16", "float16", "half", "fp16"),
                       help="serving dtype (also used by the HF peer and the roofline calibration)")
    group.add_argument("--max-num-seqs", type=positive_int, default=None, help="engine max running sequences")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="engine token budget")
    group.add_argument("--kv-cache-memory-bytes", type=size_arg, default=None, help="KV cache bytes (512M, 2GiB)")
    group.add_argument("--num-threads", type=positive_int, default=None,
                       help="torch threads for the engine, the peer and the calibration (pinned and reported)")
    group.add_argument("--seed", type=int, default=0, help="seed of the random prompts and of the engine")
    group.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                       help="engine worker processes (tensor parallel size)")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="shard MoE experts across the ranks instead of slicing each expert")
    from ascent.args import EngineArgs

    EngineArgs.add_cli_args(parser, skip=BENCH_OWN_ENGINE_FLAGS)  # the rest of the engine's flags, as vLLM's benches


# Engine options the benches define themselves (their own defaults and help); every other EngineArgs field is added
# with its engine flag and passed through by ``build_llm``.
BENCH_OWN_ENGINE_FLAGS = ("model", "hardware_profile", "dtype", "max_num_seqs", "max_num_batched_tokens",
                          "kv_cache_memory_bytes", "num_threads", "seed", "tensor_parallel_size",
                          "enable_expert_parallel", "disable_log_stats")


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--output-json", default=None, help="write the result JSON to this path")
    parser.add_argument("--no-peer", action="store_true", help="skip the HF transformers peer")
    roof = parser.add_argument_group("roofline calibration (B0)")
    roof.add_argument("--roofline-stream-mib", type=float, default=1024.0, help="stream-read buffer size in MiB")
    roof.add_argument("--roofline-gemv-mib", type=float, default=256.0, help="GEMV weight size in MiB")
    roof.add_argument("--roofline-gemm-shape", default="512,2048,2048", help="GEMM M,N,K")
    roof.add_argument("--roofline-repeats", type=positive_int, default=5, help="timed repeats per measurement")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ascent bench throughput`` (B1)."""
    _add_common_args(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=64, help="number of requests")
    parser.add_argument("--compare-profile", default=None, choices=("cpu", "cuda", "a2", "a3", "310p", "a5"),
                        help="also run the same workload under this hardware profile (its default dtype when "
                             "--dtype is not allowed there) and report the ratio")
    parser.add_argument("--input-len", type=positive_int, default=None, help="fixed prompt length")
    parser.add_argument("--output-len", type=positive_int, default=None, help="fixed output length")
    parser.add_argument("--random-input-len-range", default=None,
                        help="prompt length drawn uniformly from LO,HI (default 16,256)")
    parser.add_argument("--random-output-len-range", default=None,
                        help="output length drawn uniformly from LO,HI (default 16,128)")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of both engines")
    parser.add_argument("--peer-batch-size", type=positive_int, default=16, help="HF generate batch size")
    parser.add_argument("--disable-detokenize", action="store_true", help="skip detokenizing engine outputs")


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ascent bench latency`` (B2)."""
    _add_common_args(parser)
    parser.add_argument("--batch-size", type=positive_int, default=1, help="prompts per generate")
    parser.add_argument("--input-len", type=positive_int, default=8, help="prompt length")
    parser.add_argument("--output-len", type=positive_int, default=128, help="generated tokens (greedy)")
    parser.add_argument("--num-iters", type=positive_int, default=3, help="timed iterations")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed warmup iterations")


def _run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from ascent.benchmarks.throughput import run_throughput

    return run_throughput(args)


def _run_latency(args: argparse.Namespace) -> dict[str, Any]:
    from ascent.benchmarks.latency import run_latency

    return run_latency(args)


def register_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` with the ``throughput``, ``latency``, ``serve``, ``startup``, ``spec``, ``eplb``, ``quant``,
    ``sched`` and ``prefix`` sub-commands (each sets ``func``)."""
    bench = subparsers.add_parser("bench", help="benchmarks (JSON with vLLM's key names)")
    commands = bench.add_subparsers(dest="bench_command", metavar="{throughput,latency,serve,startup,spec,eplb,quant,sched,prefix}",
                                    required=True)
    throughput = commands.add_parser("throughput", help="B1 offline throughput vs the HF peer",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_throughput_args(throughput)
    throughput.set_defaults(func=_run_throughput)
    latency = commands.add_parser("latency", help="B2 batch latency / single-stream decode vs the HF peer",
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_latency_args(latency)
    latency.set_defaults(func=_run_latency)
    from ascent.benchmarks.serve_cli import register_serve_bench_parsers

    register_serve_bench_parsers(commands)
    from ascent.benchmarks.spec import register_spec_bench_parser

    register_spec_bench_parser(commands)
    from ascent.benchmarks.eplb import register_eplb_bench_parser

    register_eplb_bench_parser(commands)
    from ascent.benchmarks.quant import register_quant_bench_parser

    register_quant_bench_parser(commands)
    from ascent.benchmarks.sched import register_sched_bench_parser

    register_sched_bench_parser(commands)
    from ascent.benchmarks.prefix import register_prefix_bench_parser

    register_prefix_bench_parser(commands)
    return bench
