"""Recipe files of `launch.stages`: configs/recipes/FILE.yaml read, its layout checked, its stages loaded.

A recipe file (paths in it are relative to the repository root, where every process runs):
  requires:  [PATH ...]: files the recipe's set-up makes (its header says how); missing: one line
  env:       {VARIABLE: value} for every process started, unless the environment sets it
  train:     config, dataset, data_path, set: [KEY=VALUE ...]: launch.train's flags, every stage
  variants:  {NAME: [KEY=VALUE ...]}: model variants, run side by side
  evaluate:  suites, lengths, samples, rows, text: launch.evaluate's flags after the last stage
  recipes:   {NAME: [{steps: N, set: [KEY=VALUE ...]}, ...]}: `steps` is train.steps at the
             stage's end (it counts on over the stages), `set` the stage's --set items
`load_recipe_file` checks the layout; `stages` loads every stage's whole configuration, so
a bad key or value is one UsageError naming the recipe and stage before anything starts.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from pathlib import Path

import yaml

from launch.cli import UsageError
from nsa_jax.config import CONFIG_DIR, ConfigError, load_config
from nsa_jax.evaluation.suites import SUITES
from nsa_jax.runbook_env import env_overrides

ROOT = CONFIG_DIR.parent
RECIPE_DIR = CONFIG_DIR / "recipes"

_FILE_KEYS = {"env", "train", "variants", "evaluate", "recipes", "requires"}
_TRAIN_KEYS = {"config", "dataset", "data_path", "set"}
_EVAL_KEYS = {"suites", "lengths", "samples", "rows", "text"}
_STAGE_KEYS = {"steps", "set"}


@dataclasses.dataclass(frozen=True)
class Stage:
    steps: int  # train.steps at the stage's end
    overrides: tuple[str, ...]  # the stage's --set items
    seq_len: int  # train.seq_len of the stage's whole configuration


@dataclasses.dataclass(frozen=True)
class RecipeFile:
    path: Path
    env: dict[str, str]
    config: str  # launch.train's --config
    data: dict[str, str]  # {"--dataset": ..., "--data-path": ...}, those the file gives
    overrides: tuple[str, ...]  # the --set items of every stage
    variants: dict[str, tuple[str, ...]]
    evaluate: dict  # suites, lengths, samples, rows, text
    recipes: dict[str, list]  # as read; `stages` checks them

    def child_env(self) -> dict[str, str]:
        """The environment of the stages' processes: the file's `env` only where the environment has none."""
        return {**self.env, **os.environ}

    def train_args(self) -> list[str]:
        """launch.train's flags for every stage of every recipe."""
        return ["--config", self.config, *(a for kv in self.data.items() for a in kv), *set_flags(self.overrides)]


def recipe_path(name: str) -> Path:
    """`needle` -> configs/recipes/needle.yaml; a YAML path is taken as is (relative to the working directory)."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise UsageError(f"--recipe: file {name} not found")
        return p
    candidate = RECIPE_DIR / f"{name}.yaml"
    if not candidate.is_file():
        names = ", ".join(sorted(q.stem for q in RECIPE_DIR.glob("*.yaml"))) or "none"
        raise UsageError(f"--recipe: no recipe file '{name}' in {RECIPE_DIR} (there: {names}); or pass a YAML path")
    return candidate


def _str_list(value, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{where} must be a list of KEY=VALUE strings, got {value!r}")
    bad = [v for v in value if "=" not in v]
    if bad:
        raise UsageError(f"{where}: {bad[0]!r} must look like section.key=value")
    return tuple(value)


def _mapping(value, where: str, keys: set[str] | None = None) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{where} must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(map(str, value)) - keys) if keys is not None else []
    if unknown:
        raise UsageError(f"{where}: unknown key '{unknown[0]}' (it holds {', '.join(sorted(keys))})")
    return value


def _comma_list(value, where: str) -> list[str]:
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else None
    if items is None:
        raise UsageError(f"{where} must be a list or a comma-separated string, got {value!r}")
    return [str(x).strip() for x in items if str(x).strip()]


def check_evaluate(ev: dict, where: str) -> dict:
    """{suites, lengths, samples, rows, text} with their types checked; UsageError naming `where`."""
    suites = _comma_list(ev.get("suites", ["needle"]), f"{where}: suites")
    bad = [s for s in suites if s not in SUITES]
    if bad or not suites:
        raise UsageError(f"{where}: unknown suite {bad[0] if bad else '(none)'!r}; choose from {', '.join(SUITES)}")
    try:
        lengths = [int(x) for x in _comma_list(ev.get("lengths", []), f"{where}: lengths")]
    except ValueError:
        raise UsageError(f"{where}: lengths must be positive integers, got {ev.get('lengths')!r}") from None
    if not lengths or min(lengths) < 1:
        raise UsageError(f"{where}: lengths must be positive integers, got {ev.get('lengths')!r}")
    samples, rows = ev.get("samples", 16), ev.get("rows", 4)
    for name, value in (("samples", samples), ("rows", rows)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{where}: {name} must be a positive integer, got {value!r}")
    text = ev.get("text", [])
    if isinstance(text, str):
        text = [text]
    if not isinstance(text, list) or not all(isinstance(t, str) for t in text):
        raise UsageError(f"{where}: text must be a list of files, got {text!r}")
    missing = [t for t in text if not (ROOT / t).is_file()]
    if missing:
        raise UsageError(f"{where}: text file {missing[0]} not found (paths are relative to {ROOT})")
    return {"suites": suites, "lengths": lengths, "samples": samples, "rows": rows, "text": text}


class MissingSetup(UsageError):
    """A recipe file's `requires` path is missing: its set-up commands have not been run."""


def load_recipe_file(name: str) -> RecipeFile:
    """The recipe file `name` read and its layout checked (the stages: `stages`); UsageError when it is bad."""
    path = recipe_path(name)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"--recipe: cannot read {path}: {str(e).splitlines()[0]}") from None
    where = str(path)
    data = _mapping(data, where, _FILE_KEYS)
    # Files the recipe's set-up makes (a converted model, prepared data): checked before anything else.
    requires = data.get("requires") or []
    if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
        raise UsageError(f"{where}: requires must be a list of paths, got {requires!r}")
    missing = [r for r in requires if not (ROOT / r).exists()]
    if missing:
        raise MissingSetup(f"{where}: needs {missing[0]}, which its set-up makes: run the commands at its top")
    env = {str(k): str(v) for k, v in _mapping(data.get("env"), f"{where}: env").items()}
    train = _mapping(data.get("train"), f"{where}: train", _TRAIN_KEYS)
    if not isinstance(train.get("config"), str):
        raise UsageError(f"{where}: train.config must name a config (configs/ or a YAML path)")
    data_flags = {}
    if train.get("dataset") is not None:
        data_flags["--dataset"] = str(train["dataset"])
    if train.get("data_path") is not None:
        pattern = str(train["data_path"])
        if not glob.glob(pattern if os.path.isabs(pattern) else str(ROOT / pattern)):
            raise UsageError(f"{where}: train.data_path {pattern} matches nothing (paths are relative to {ROOT})")
        data_flags["--data-path"] = pattern
    overrides = _str_list(train.get("set"), f"{where}: train.set")
    variants = {
        str(k): _str_list(v, f"{where}: variant {k}")
        for k, v in _mapping(data.get("variants") or {"default": []}, f"{where}: variants").items()
    }
    bad = [v for v in variants if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v)]
    if bad:
        raise UsageError(
            f"{where}: variant name {bad[0]!r} must be a word of letters, digits, _ . - (it names folders)"
        )
    evaluate = check_evaluate(_mapping(data.get("evaluate"), f"{where}: evaluate", _EVAL_KEYS), f"{where}: evaluate")
    recipes = _mapping(data.get("recipes"), f"{where}: recipes")
    if not recipes:
        raise UsageError(f"{where}: no recipes (a `recipes:` mapping of NAME: [stages])")
    recipes = {str(k): v for k, v in recipes.items()}
    return RecipeFile(path, env, train["config"], data_flags, overrides, variants, evaluate, recipes)


def set_flags(overrides) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def _config_overrides(rf: RecipeFile) -> tuple[str, list[str]]:
    """(config name or path, the overrides launch.train makes of the file's --dataset, --data-path and --set)."""
    config = rf.config
    if config.endswith((".yaml", ".yml")) and not os.path.isabs(config):
        config = str(ROOT / config)
    keys = {"--dataset": "data.dataset", "--data-path": "data.path"}
    return config, [*(f"{keys[flag]}={value}" for flag, value in rf.data.items()), *rf.overrides]


def stages(rf: RecipeFile, recipe: str, variant: str) -> list[Stage]:
    """The recipe's stages for `variant`, every one's whole configuration loaded; UsageError naming the stage."""
    where = f"{rf.path}: recipe {recipe}"
    raw = rf.recipes[recipe]
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"{where} must be a non-empty list of stages ({{steps: N, set: [KEY=VALUE ...]}})")
    config, base = _config_overrides(rf)
    try:  # the runbook variables every stage's launch.train will read (launch.train's order: flags win)
        env_sets, _ = env_overrides(rf.child_env())
    except ConfigError as e:
        raise UsageError(f"the environment the stages run in: {e}") from None
    out, last = [], 0
    for i, st in enumerate(raw, 1):
        at = f"{where} stage {i}"
        st = _mapping(st, at, _STAGE_KEYS)
        steps = st.get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps <= last:
            raise UsageError(f"{at}: steps must be an integer above the previous stage's ({last}), got {steps!r}")
        overrides = _str_list(st.get("set"), f"{at}: set")
        try:
            cfg = load_config(config, [*env_sets, *base, *rf.variants[variant], *overrides, f"train.steps={steps}"])
        except ConfigError as e:
            raise UsageError(f"{at} (variant {variant}): {e}") from None
        out.append(Stage(steps, overrides, cfg.train.seq_len))
        last = steps
    return out
