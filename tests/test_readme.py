"""README.md's commands, run top to bottom as a new user runs them: each one as written succeeds.

The commands are read from the README's fenced bash blocks, so this test follows the README
as it changes. They run in an empty folder (a fresh clone's artifacts/, corpus/, prepared/)
with the repository importable, as `pip install -e .` makes it. What is not run is listed in
SKIPPED with the reason; training runs are shortened (SHORTEN).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from helpers import cpu_env

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Parts of a `&&` chain that set up the environment this test already runs in (a venv with the
# project installed): not run.
SETUP = ("python3 -m venv ", ". .venv/bin/activate", "pip install ")
# Commands not run, by a piece of their text, and why. Each must still match a README command.
SKIPPED = {
    "python -m pytest": "the test suite itself (this test is part of it; minutes)",
    "--config a100_pcie": "the production model: a GPU, or many minutes of compiling on a CPU",
    "--dataset fineweb_edu": "a FineWeb-Edu sample under /data that a fresh clone does not have",
    "--tokenizer tokenizer.json": "a tokenizers JSON file of the user's own",
    "--tokenizer gpt2": "tiktoken's gpt2 files, a download",
    "python -m launch.spawn": "two processes under jax.distributed: tests/test_spawn.py runs this command (2 minutes)",
}
# Training runs take --steps 3 (appended: the last --steps wins), so the whole README runs in
# minutes; the README's own runs are full length.
SHORTEN = ("python -m launch.train", "--steps 3")
# The corpus the README's prepare_data command reads (`--input corpus/`): a few small files.
CORPUS = {
    "a.txt": "The quick brown fox jumps over the lazy dog. " * 300,
    "b.txt": "Native sparse attention compresses, selects and slides. " * 300,
    "more/c.jsonl": "".join(
        '{"text": "document %d: a line of text for the prepared shards"}\n' % i for i in range(400)
    ),
}


def readme_commands(text: str) -> list[str]:
    """Every command of the fenced bash blocks, in order: comments dropped, `&&` chains split."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def test_the_commands_are_read_from_the_readme():
    commands = readme_commands((ROOT / "README.md").read_text())
    assert commands[0] == "python3 -m venv .venv"
    assert "python -m launch.train --config cpu_tiny" in commands
    assert not [c for c in commands if "#" in c or c.startswith("```")]


@pytest.mark.slow
def test_the_readme_commands_run_in_order(tmp_path):
    work = tmp_path / "clone"
    for name, text in CORPUS.items():
        (work / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (work / "corpus" / name).write_text(text)
    env = cpu_env(1, cache=tmp_path / "compile_cache")
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}:{env.get('PATH', '')}"  # `python` is this venv's
    ran, skipped = [], set()
    for command in readme_commands((ROOT / "README.md").read_text()):
        if command.startswith(SETUP):
            continue
        why = [key for key in SKIPPED if key in command]
        if why:
            skipped.update(why)
            continue
        if SHORTEN[0] in command:
            command = f"{command} {SHORTEN[1]}"
        r = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (
            f"README command failed ({r.returncode}): {command}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        )
        ran.append(command)
    assert skipped == set(SKIPPED), f"SKIPPED names what the README no longer has: {set(SKIPPED) - skipped}"
    assert len(ran) >= 6, ran
    # The quick start trained; the same command again reports it finished; the others trained in their own folders.
    for out in ("cpu_tiny", "cpu_tiny_2dev", "kv_recall", "prepared"):  # cpu_tiny_2proc: SKIPPED
        assert (work / "artifacts" / out / "checkpoints" / "3").is_dir(), out
    assert (work / "prepared" / "manifest.json").is_file()
