"""Nothing the README, the docs or the code cite may be missing from the repository (issue 14, point 3)."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a path into the repository, as the docs and docstrings write them: docs/..., scripts/..., llmc/..., tests/...
REPO_PATH = re.compile(r"(?<![\w/.-])((?:docs|scripts|llmc|tests)/[\w./*{},-]+)")
MD_LINK = re.compile(r"\]\(([^)#\s]+)[^)]*\)")
MD_NAME = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")


def _expand(path: str) -> list[str]:
    """docs/bench/{fp32,int8}.jsonl -> both paths (the docs' shorthand for a set of files)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return list(itertools.chain.from_iterable(_expand(path[:m.start()] + part + path[m.end():])
                                              for part in m.group(1).split(",")))


def _exists(path: str) -> bool:
    return bool(list(ROOT.glob(path))) if "*" in path else (ROOT / path).exists()


def _citing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("llmc", "scripts"):
        files += [p for p in sorted((ROOT / folder).rglob("*"))
                  if p.is_file() and p.suffix in {".py", ".c", ".h", ".sh", ""} and "__pycache__" not in p.parts]
    return files


def _missing_in(path: Path) -> list[str]:
    text = path.read_text(errors="ignore")
    missing = [p for m in REPO_PATH.finditer(text) for p in _expand(m.group(1).rstrip(".,):;"))
               if not _exists(p)]
    if path.suffix == ".md":
        missing += [m.group(1) for m in MD_LINK.finditer(text)
                    if not m.group(1).startswith(("http://", "https://", "mailto:"))
                    and not (path.parent / m.group(1)).exists()]
    return missing


def test_every_path_the_docs_and_code_cite_exists() -> None:
    missing = {str(p.relative_to(ROOT)): bad for p in _citing_files() if (bad := _missing_in(p))}
    assert not missing, f"cited but not in the repository: {missing}"


def test_every_markdown_page_named_exists() -> None:
    pages = {p.name for p in ROOT.glob("*.md")} | {p.name for p in (ROOT / "docs").rglob("*.md")}
    named = {(str(p.relative_to(ROOT)), m.group(1)) for p in _citing_files()
             for m in MD_NAME.finditer(p.read_text(errors="ignore"))}
    assert not [n for n in named if n[1] not in pages], [n for n in named if n[1] not in pages]


@pytest.mark.parametrize("cited, ok", [("docs/benchmarks.md", True), ("docs/no_such_page.md", False),
                                        ("docs/bench/{fp32,int8}.jsonl", True),
                                        ("docs/bench/{fp32,nothing}.jsonl", False)])
def test_the_check_itself_tells_a_missing_path(cited: str, ok: bool) -> None:
    assert all(_exists(p) for p in _expand(cited)) is ok
