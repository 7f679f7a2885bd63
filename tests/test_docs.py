"""The README and the current docs against the tree: every module on the map, no path that is gone, short docs."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CURRENT_DOCS = sorted((ROOT / "docs").glob("*.md"))  # docs/lab/ is the archive: what was true then
PATH = re.compile(r"`((?:nsa_jax|launch|benchmarks|experiments|configs|docs|tests)/[\w/.*{},-]*)`")


def _modules() -> list[str]:
    """Every module of nsa_jax/ and launch/; a package's __init__ only where it holds more than imports."""
    out = []
    for path in sorted([*(ROOT / "nsa_jax").rglob("*.py"), *(ROOT / "launch").rglob("*.py")]):
        if path.name == "__init__.py":
            body = [line for line in path.read_text().splitlines() if re.match(r"(def|class) ", line)]
            if not body:
                continue
        out.append(str(path.relative_to(ROOT)))
    return out


def _start_here() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Start here") : text.index("\n## ", text.index("## Start here") + 1)]


def test_the_readme_map_names_every_module():
    named = set()
    for name in re.findall(r"`([\w/.]+\.py)`", _start_here()):
        named.add(name if name.startswith(("nsa_jax/", "launch/", "tests/")) else f"nsa_jax/{name}")
    missing = [m for m in _modules() if m not in named]
    assert not missing, f"README.md 'Start here' does not name {missing}"
    gone = sorted(n for n in named if not (ROOT / n).exists())
    assert not gone, f"README.md 'Start here' names modules that do not exist: {gone}"


@pytest.mark.parametrize("doc", [ROOT / "README.md", *CURRENT_DOCS], ids=lambda p: p.name)
def test_paths_named_in_the_docs_exist(doc):
    gone = []
    for path in PATH.findall(doc.read_text()):
        path = path.rstrip(".,")
        if any(c in path for c in "*{}") or path.endswith("/"):
            path = re.split(r"[*{}]", path)[0].rstrip("/") or path
        if not (ROOT / path).exists() and not list(ROOT.glob(path + "*")):
            gone.append(path)
    assert not gone, f"{doc.name} names paths that do not exist: {gone}"


def test_the_readme_stays_an_entry_point():
    # The README says how to run each thing; the details live in docs/ (it links them).
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 450, f"README.md has {n} lines; move reference material to docs/"


@pytest.mark.parametrize("doc", CURRENT_DOCS, ids=lambda p: p.name)
def test_current_docs_stay_short(doc):
    # A current doc says what holds now; history goes to docs/lab/ (docs/lab/README.md).
    n = len(doc.read_text().splitlines())
    assert n <= 300, f"{doc.name} has {n} lines; move what is history to docs/lab/"


def test_the_readme_says_which_checkpoints_a_run_deletes():
    """Where the README says when checkpoints are deleted, it names the pruning with the code's default."""
    from nsa_jax.config import CheckpointConfig

    text = " ".join((ROOT / "README.md").read_text().split())
    promise = text[text.index("checkpoints are deleted only by") :][:200]
    assert f"`checkpoint.max_to_keep` steps, default {CheckpointConfig().max_to_keep})" in promise, promise
    assert "--overwrite-checkpoints" in promise
