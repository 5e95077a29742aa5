"""Generate the golden quantized checkpoints under ``tests/fixtures/quant/`` with the formats' OWN tools.

Run with the tool venv's python (see ``build_venv.sh`` and ``README.md``)::

    .tool-venvs/quant/bin/python tools/quant_fixtures/make_fixtures.py [--out tests/fixtures/quant] [--only NAME ...]

Every fixture starts from the same tiny random Qwen3 (seeded), saved locally first (llmcompressor needs a local
``name_or_path``). ModelSlim fixtures come from msmodelslim's legacy PTQ API (``QuantConfig`` + ``Calibrator``),
compressed-tensors fixtures from llmcompressor's ``oneshot`` + ``save_pretrained(save_compressed=True)``. Nothing in
the outputs is computed by ascent: the tests derive their references from the checkpoints with compressed-tensors'
own decompression or the published ModelSlim dequant formulas.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "quant"

SEED = 0
CALIB_SEED = 1234
QWEN3 = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
QWEN3_MOE = dict(  # smaller than the dense model so the whole fixture set stays under 6 MB
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


# ------------------------------------------------------------------------------------------------------------------
# float source models
# ------------------------------------------------------------------------------------------------------------------
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-default random weights (so logits are not near-tied) and non-trivial norm weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.06)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def build_float_model(path: Path, moe: bool = False) -> Path:
    """Save the float32 tiny random model (config + safetensors + generation_config) to ``path``."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    if moe:
        config = Qwen3MoeConfig(**QWEN3_MOE)
        model = Qwen3MoeForCausalLM(config)
    else:
        config = Qwen3Config(**QWEN3)
        model = Qwen3ForCausalLM(config)
    _randomize(model, SEED + (17 if moe else 0))
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(path))
    GenerationConfig(bos_token_id=1, eos_token_id=[2], pad_token_id=0).save_pretrained(str(path))
    return path


def load_float_model(path: Path, dtype: torch.dtype, moe_linearized: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    if moe_linearized:
        # transformers 5 fuses the experts into 3-D parameters (not nn.Linear); llmcompressor's linearize_moe turns
        # them into per-expert nn.Linear modules so "Linear" targets reach them. (`load_quantizable_moe` would do it
        # at load time but its monkey-patching imports every transformers model module, which needs torchvision.)
        from llmcompressor.modeling.moe.linearize import linearize_moe

        linearize_moe(model)
    model.config.dtype = dtype  # msmodelslim decides deq_scale int64 (fp16) vs fp32 (bf16) from config dtype
    model.config.architectures = [type(model).__name__]
    return model.eval()


def calib_token_ids(n: int = 8, length: int = 32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(CALIB_SEED)
    return [torch.randint(3, QWEN3["vocab_size"], (1, length), generator=gen) for _ in range(n)]


def _copy_model_files(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """config.json (with the dtype the fixture was made in) and generation_config.json."""
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    cfg.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")


# ------------------------------------------------------------------------------------------------------------------
# msmodelslim (legacy PTQ API, CPU)
# ------------------------------------------------------------------------------------------------------------------
MODELSLIM = {
    # name: (dtype, QuantConfig kwargs, anti-outlier method or None)
    "modelslim_w8a8_fp16": (torch.float16, dict(w_bit=8, a_bit=8, is_dynamic=False), None),
    "modelslim_w8a8_bf16": (torch.bfloat16, dict(w_bit=8, a_bit=8, is_dynamic=False), None),
    "modelslim_w8a8_dynamic": (torch.float16, dict(w_bit=8, a_bit=8, is_dynamic=True), None),
    "modelslim_w8a16": (torch.bfloat16, dict(w_bit=8, a_bit=16), None),
    "modelslim_w8a8_smooth": (torch.float16, dict(w_bit=8, a_bit=8, is_dynamic=False), "m4"),
}


def make_modelslim(name: str, float_dir: Path, out_root: Path) -> None:
    from msmodelslim.pytorch.llm_ptq.llm_ptq_tools import Calibrator, QuantConfig

    dtype, qkw, anti = MODELSLIM[name]
    model = load_float_model(float_dir, dtype)
    calib = [[ids] for ids in calib_token_ids()]
    if anti is not None:
        from msmodelslim.pytorch.llm_ptq.anti_outlier import AntiOutlier, AntiOutlierConfig

        acfg = AntiOutlierConfig(w_bit=qkw["w_bit"], a_bit=qkw["a_bit"], anti_method=anti, dev_type="cpu")
        AntiOutlier(model, calib_data=calib, cfg=acfg).process()
    cfg = QuantConfig(disable_names=["lm_head"], dev_type="cpu", mm_tensor=False, **qkw)
    calibrator = Calibrator(model, cfg, calib_data=calib, disable_level="L0")
    calibrator.run()
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    calibrator.save(str(out), save_type=["safe_tensor"], json_name="quant_model_description.json")
    _copy_model_files(float_dir, out, dtype)


# ------------------------------------------------------------------------------------------------------------------
# llmcompressor (compressed-tensors checkpoints)
# ------------------------------------------------------------------------------------------------------------------
def _args(**kw):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**kw)


def _scheme(weights, input_activations=None):
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=input_activations)


def ct_recipe(name: str):
    """(QuantizationModifier kwargs, needs calibration data)."""
    int8_channel = dict(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False)
    if name in ("ct_w8a8", "ct_moe_w8a8"):
        return dict(scheme="W8A8"), False
    if name == "ct_w8a8_static":
        return dict(config_groups={"group_0": _scheme(
            _args(**int8_channel),
            _args(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False))}), True
    if name in ("ct_w4a16_g32", "ct_moe_w4a16"):
        return dict(config_groups={"group_0": _scheme(
            _args(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32, dynamic=False))}), False
    if name == "ct_w4a16_g128":
        return dict(scheme="W4A16"), False
    if name == "ct_w4a16_asym":
        return dict(scheme="W4A16_ASYM"), False
    if name == "ct_w4a8":
        return dict(scheme="W4A8"), False
    if name == "ct_w4a8_channel":
        return dict(config_groups={"group_0": _scheme(
            _args(num_bits=4, type="int", symmetric=True, strategy="channel", dynamic=False),
            _args(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True))}), False
    if name == "ct_fp8_dynamic":
        return dict(scheme="FP8_DYNAMIC"), False
    if name == "ct_fp8_block":
        return dict(scheme="FP8_BLOCK"), False
    raise KeyError(name)


COMPRESSED_TENSORS = {
    # name: model dtype
    "ct_w8a8": torch.bfloat16,
    "ct_w8a8_static": torch.bfloat16,
    "ct_w4a16_g32": torch.bfloat16,
    "ct_w4a16_g128": torch.float16,
    "ct_w4a16_asym": torch.bfloat16,
    "ct_w4a8": torch.bfloat16,
    "ct_w4a8_channel": torch.bfloat16,
    "ct_fp8_dynamic": torch.float16,
    "ct_fp8_block": torch.bfloat16,
}
CT_MOE = {
    "ct_moe_w4a16": torch.bfloat16,
    "ct_moe_w8a8": torch.bfloat16,
}


def calib_dataset():
    from datasets import Dataset

    ids = [t[0].tolist() for t in calib_token_ids(n=16, length=32)]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})


def make_compressed_tensors(name: str, float_dir: Path, out_root: Path, moe: bool = False) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    dtype = (CT_MOE if moe else COMPRESSED_TENSORS)[name]
    kwargs, needs_data = ct_recipe(name)
    ignore = ["lm_head"] + (["re:.*mlp.gate$"] if moe else [])
    recipe = QuantizationModifier(targets="Linear", ignore=ignore, **kwargs)
    model = load_float_model(float_dir, dtype, moe_linearized=moe)
    extra = {}
    if needs_data:
        extra = dict(dataset=calib_dataset(), num_calibration_samples=16, max_seq_length=32)
    model = oneshot(model=model, recipe=recipe, **extra)
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out), save_compressed=True)
    # save_pretrained writes config.json; keep generation_config from the float model for a loadable HF dir.
    shutil.copy(float_dir / "generation_config.json", out / "generation_config.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", nargs="*", default=None, help="fixture names to (re)build (default: all)")
    parser.add_argument("--no-moe", action="store_true", help="skip the Qwen3-MoE fixtures")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.only) if args.only else None
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="ascent_quant_fixtures_") as tmp:
        os.chdir(tmp)  # msmodelslim writes scratch files (features.npy) into the working directory
        float_dir = build_float_model(Path(tmp) / "qwen3_float")
        for name in MODELSLIM:
            if wanted is None or name in wanted:
                print(f"[make_fixtures] {name}", flush=True)
                make_modelslim(name, float_dir, args.out)
        for name in COMPRESSED_TENSORS:
            if wanted is None or name in wanted:
                print(f"[make_fixtures] {name}", flush=True)
                make_compressed_tensors(name, float_dir, args.out)
        if not args.no_moe:
            moe_dir = None
            for name in CT_MOE:
                if wanted is None or name in wanted:
                    moe_dir = moe_dir or build_float_model(Path(tmp) / "qwen3_moe_float", moe=True)
                    print(f"[make_fixtures] {name}", flush=True)
                    make_compressed_tensors(name, moe_dir, args.out, moe=True)
        os.chdir(cwd)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"[make_fixtures] total size of {args.out}: {total / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
