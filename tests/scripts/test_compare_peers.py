"""scripts/compare_peers.py: llmc engines timed on the peers' prompt ids in child processes, medians over rounds
and ratios to the first engine; one-line errors for what is missing (the peers themselves are not installed in CI:
their scripts live in ../shared/peers and run in their own venvs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import Built

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_peers.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_two_llmc_engines_side_by_side(tiny_llama: Built, tmp_path: Path) -> None:
    prompts = tmp_path / "ids.json"
    prompts.write_text(json.dumps({"prompt_len": 12, "rows": [list(range(3, 15)), list(range(20, 32))]}))
    out = tmp_path / "rows.jsonl"
    done = _run(str(tiny_llama.engine_dir), str(tiny_llama.engine_dir), "--batches", "1,2", "--new", "4", "--reps",
                "1", "--rounds", "2", "--prompts", str(prompts), "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["batch"], r["rounds"]) for r in rows} == {(1, 4), (2, 4)}  # one tool name, both passes, 2 rounds
    assert all(r["decode_vs_llmc"] == 1.0 and r["ttft_ms"] > 0 and r["decode_tok_s_aggregate"] > 0 for r in rows)
    assert "x llmc" in done.stdout


def test_what_is_missing_is_one_line(tiny_llama: Built, tmp_path: Path) -> None:
    prompts = tmp_path / "ids.json"
    done = _run(str(tiny_llama.engine_dir), "--prompts", str(prompts))
    assert done.returncode != 0 and f"{prompts} is missing" in done.stderr and "Traceback" not in done.stderr
    prompts.write_text(json.dumps({"prompt_len": 1, "rows": [[3]]}))
    done = _run(str(tmp_path), "--prompts", str(prompts))
    assert done.returncode != 0 and "is not an llmc engine folder" in done.stderr
    done = _run(str(tiny_llama.engine_dir), "--prompts", str(prompts), "--peer", "vllm:fp16")
    assert done.returncode != 0 and "the peers are ortgenai, openvino, llamacpp" in done.stderr
