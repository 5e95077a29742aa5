"""`ascent generate` and `ascent chat` end to end on a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys

from ascent import LLM, SamplingParams
from ascent.entrypoints.cli import main


def test_generate_prints_the_greedy_completion(tiny_llama_dir, capsys):
    rc = main(["--log-level", "WARNING", "generate", "Hello world", "--model", tiny_llama_dir, "--dtype", "float32",
               "--max-model-len", "64", "--max-tokens", "6", "--disable-log-stats"])
    assert rc == 0
    out = capsys.readouterr().out
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, disable_log_stats=True)
    ref = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert f"Generated: {ref.text!r}" in out


def test_generate_reports_bad_flags_as_errors(tiny_llama_dir, capsys):
    rc = main(["--log-level", "ERROR", "generate", "x", "--model", tiny_llama_dir, "--max-model-len", "10000000"])
    assert rc == 2 and "max_model_len" in capsys.readouterr().err


def test_chat_streams_reply_with_the_chat_template(tiny_llama_dir):
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, "-m", "ascent.entrypoints.cli", "--log-level", "WARNING", "chat", "--model", tiny_llama_dir,
         "--dtype", "float32", "--max-model-len", "128", "--max-tokens", "5", "--disable-log-stats"],
        input="Hello there\n\n", capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, disable_log_stats=True)
    ref = llm.chat([{"role": "user", "content": "Hello there"}], SamplingParams(temperature=0, max_tokens=5),
                   use_tqdm=False)[0].outputs[0].text
    assert ref in proc.stdout
