"""`llmc run --json-schema / --regex / --grammar` and `llmc bench --json-schema` on a tiny engine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
from conftest import Built
from typer.testing import CliRunner

from llmc.cli.main import app

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["word", "n"], "additionalProperties": False}


def _run(*args: object) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def test_run_answers_under_the_schema_regex_or_grammar(tiny_llama: Built, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code, out, err = _run("run", tiny_llama.engine_dir, "hi", "--json-schema", schema, "--temperature", "1",
                          "--max-tokens", "60")
    assert code == 0, err
    jsonschema.validate(json.loads(out.strip()), SCHEMA)
    code, out, _ = _run("run", tiny_llama.engine_dir, "hi", "--regex", "[0-9]{3}", "--temperature", "1")
    assert code == 0 and re.fullmatch(r"[0-9]{3}", out.strip())
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "<" xy xy? xy? ">"\nxy: "x" | "y"\n')
    code, out, _ = _run("run", tiny_llama.engine_dir, "hi", "--grammar", grammar, "--max-tokens", "40")
    assert code == 0 and re.fullmatch(r"<[xy]{1,3}>", out.strip()), out


def test_bad_schema_files_and_constraints_are_one_line_errors(tiny_llama: Built, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"type": "strin"}')
    for args, words in [(["--json-schema", tmp_path / "missing.json"], "cannot read the JSON schema file"),
                        (["--json-schema", bad], "is not JSON"),
                        (["--json-schema", wrong], "Invalid type: strin"),
                        (["--regex", "a["], "regular expression does not compile")]:
        code, _, err = _run("run", tiny_llama.engine_dir, "hi", *args)
        assert code == 1 and words in err and "Traceback" not in err, err


def test_bench_reports_the_constrained_speed_against_the_plain_run(tiny_llama: Built, tmp_path: Path) -> None:
    schema = tmp_path / "records.json"
    schema.write_text(json.dumps({"type": "array", "items": SCHEMA, "minItems": 8, "maxItems": 8}))
    code, out, err = _run("bench", tiny_llama.engine_dir, "--batch-sizes", "1,2", "--prompt-len", "8",
                          "--new-tokens", "24", "--repeat", "1", "--threads", "1", "--json-schema", schema, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["json_schema_decode_tok_s_per_seq"] > 0 and r["json_schema_tokens"] == 24
        assert r["json_schema_vs_plain"] > 0 and r["json_schema_mask_wait_ms_per_step"] >= 0
        assert r["json_schema_mask_cpu_ms_per_step"] > 0 and r["json_schema_sampler_ms_per_step"] > 0
        assert "json_schema_cost_bound" in r
