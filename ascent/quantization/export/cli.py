"""``ascent quantize MODEL --scheme ... --format ... OUT``: argparse wiring of :func:`quantize_model`."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ascent.quantization.export.quantize import DEFAULT_CALIB_TOKENS, DEFAULT_GROUP_SIZE
from ascent.quantization.export.schemes import FORMATS, SCHEMES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _alpha(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"smoothquant alpha {text!r} must be in [0, 1]")
    return value


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ascent quantize``."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF model directory, .gguf file, or 'default' (the bundled SmolLM2-135M-Instruct); "
                             "omitted = default")
    parser.add_argument("out", help="output directory (a complete HF-format model directory)")
    parser.add_argument("--scheme", required=True, choices=sorted(SCHEMES), help="quantization scheme")
    parser.add_argument("--format", dest="fmt", default="compressed-tensors", choices=FORMATS,
                        help="checkpoint layout")
    parser.add_argument("--group-size", type=_positive_int, default=DEFAULT_GROUP_SIZE,
                        help="int4 group size along K (w4a16); every K must be divisible by it")
    parser.add_argument("--smoothquant", type=_alpha, default=None, metavar="ALPHA",
                        help="apply SmoothQuant with this migration strength before quantizing (e.g. 0.5)")
    parser.add_argument("--calib-tokens", type=_positive_int, default=DEFAULT_CALIB_TOKENS,
                        help="corpus tokens for activation calibration (w8a8 static scales, SmoothQuant)")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half"),
                        help="dtype of the exported float tensors and scales (auto = the model's; bf16 for GGUF)")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="also quantize lm_head with the same scheme (a tied model is untied: the input "
                             "embedding stays float, config.json gets tie_word_embeddings=false)")
    parser.add_argument("--asymmetric", action="store_true",
                        help="weight-only schemes, --format modelslim: min-max RTN with float offsets "
                             "(weight_offset) instead of symmetric scales")


def cmd_quantize(args: argparse.Namespace) -> int:
    """Run the export and print a one-line summary per output."""
    from ascent.quantization.export.quantize import quantize_model

    start = time.perf_counter()
    result = quantize_model(args.model, args.scheme, args.fmt, args.out, group_size=args.group_size,
                            smoothquant=args.smoothquant, calib_tokens=args.calib_tokens, dtype=args.dtype,
                            quantize_lm_head=args.quantize_lm_head, asymmetric=args.asymmetric)
    print(f"quantized {len(result.quantized_layers)} linears with {result.scheme} ({result.format}, "
          f"{str(result.dtype).removeprefix('torch.')}) in {time.perf_counter() - start:.1f} s (export "
          f"{result.seconds:.1f} s after loading) -> {result.out_dir}")
    print("  files: " + ", ".join(result.files))
    return 0


def register_quantize_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``quantize`` sub-command (sets ``func``)."""
    parser = subparsers.add_parser("quantize", help="quantize a model into a ModelSlim / compressed-tensors checkpoint",
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_quantize_args(parser)
    parser.set_defaults(func=cmd_quantize)
    return parser
