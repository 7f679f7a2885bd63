"""`python -m launch.generate`: sample text from a checkpoint with NSA prefill + cached decode.

    python -m launch.generate --ckpt OUT [--config NAME] [--set KEY=VALUE ...]
        (--prompt TEXT | --prompt-file F) [--max-new-tokens N] [--temperature T]
        [--top-k K] [--top-p P] [--seed S] [--batch-size B]
    python -m launch.generate --random-init --config cpu_tiny --prompt "Hello"

Weights: a training checkpoint (`nsa_jax.rundir.checkpoint.load_for_inference(path)
-> (Config, params)`); a model folder (`config.yaml` + `params.safetensors`,
nsa_jax/rundir/model_dir.py) is read directly; `--random-init` uses freshly initialised
params of `--config` (smoke tests). `--config`/`--set` give the config when the
checkpoint carries none, or with `--random-init`.

`--prompt` streams the completion to stdout as it is sampled. `--prompt-file`
reads one prompt per line (blank lines skipped) and generates them in batches
of `--batch-size`: the prompts of a batch are left-aligned, each row prefilled
to its own length and decoded at its own position; one JSON line
{"prompt", "completion"} per prompt is printed in file order.

Temperature 0 is greedy decoding. Text goes through `cfg.data.tokenizer`
(the byte tokenizer by default); generation of a row stops at its EOS id.
Bad input prints one line `error: ...` on stderr and exits with status 2.

On stderr, before generating: one `note:` line when the checkpoint was trained on
synthetic data (its output is noise, not text), and one when a prompt (or prompt +
--max-new-tokens) goes beyond the training length. While it works, after 10 s of
silence a line says what it is doing, and again every 10 s while that lasts (a long
prompt's prefill is one compiled call and takes minutes on a CPU); a phase so reported
ends with its time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

from launch.cli import Parser, UsageError, add_overrides, run_main
from nsa_jax.config import ConfigError, load_config, replace
from nsa_jax.data.tokenizers import make_tokenizer
from nsa_jax.inference import generate, stack_layers
from nsa_jax.inference.decode import inference_config
from nsa_jax.inference.notes import TEXT_DATASETS, synthetic_note, times, trained_positions
from nsa_jax.inference.progress import Progress
from nsa_jax.info import param_shapes
from nsa_jax.model import init_params
from nsa_jax.rundir.checkpoint import load_for_inference
from nsa_jax.rundir.model_dir import (
    CONFIG_FILE,
    is_model_dir,
    mismatched_leaf,
    read_config,
    read_params,
    write_model_dir,
)
from nsa_jax.words import count


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m launch.generate",
        description="Sample text with NSA prefill and cached decode.",
        in_process=True,
    )
    p.add_argument("--ckpt", help="checkpoint path (see module docstring for the formats)")
    p.add_argument("--random-init", action="store_true", help="random params of --config instead of a checkpoint")
    p.add_argument("--config", default=None, help="config name in configs/ or a YAML path")
    add_overrides(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (streamed completion)")
    src.add_argument("--prompt-file", default=None, help="file with one prompt per line (batched)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch with --prompt-file")
    return p


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        if args.prompt == "":
            raise UsageError("--prompt is empty; pass some text")
        return [args.prompt]
    if args.prompt_file is None:
        raise UsageError("pass --prompt TEXT or --prompt-file FILE")
    path = pathlib.Path(args.prompt_file)
    if not path.is_file():
        raise UsageError(f"--prompt-file {path} not found")
    prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"--prompt-file {path} holds no non-blank line")
    return prompts


def _check_sampling(args) -> None:
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")


def write_inference_dir(path, cfg, params) -> None:
    """Writes `config.yaml` + `params.safetensors`: the model folder this command reads (rundir/model_dir.py)."""
    write_model_dir(path, cfg, params)


def _load_dir(path: pathlib.Path, args):
    if (path / CONFIG_FILE).is_file():
        cfg = read_config(path, args.overrides)
    elif args.config is not None:
        cfg = load_config(args.config, args.overrides)
    else:
        raise UsageError(f"--ckpt {path} has no {CONFIG_FILE}; pass --config NAME")
    return cfg, read_params(path)


def load_model(args):
    """(Config, params) from --random-init, a model folder, or nsa_jax.rundir.checkpoint."""
    if args.random_init:
        if args.config is None:
            raise UsageError("--random-init needs --config NAME")
        cfg = load_config(args.config, args.overrides)
        return cfg, jax.jit(lambda k: init_params(cfg.model, k))(jax.random.PRNGKey(args.seed))
    if not args.ckpt:
        raise UsageError("pass --ckpt PATH (or --random-init --config NAME)")
    path = pathlib.Path(args.ckpt)
    if not path.exists():
        raise UsageError(f"--ckpt {path} does not exist")
    if path.is_dir() and is_model_dir(path):
        return _load_dir(path, args)
    cfg, params = load_for_inference(str(path))
    if args.overrides:
        cfg = replace(cfg, args.overrides)
    return cfg, params


def check_params(cfg, params) -> dict:
    """Scanned params whose shapes match cfg.model, or a UsageError naming the first mismatch."""
    try:
        params = stack_layers(cfg.model, params)
    except ValueError as e:
        raise UsageError(f"checkpoint params: {e}") from None
    problem = mismatched_leaf(params, param_shapes(inference_config(cfg.model)))
    if problem:
        raise UsageError(f"checkpoint params do not match the config: {problem}")
    return params


class _Streamer:
    """Prints a single row's text as it grows; holds back an incomplete UTF-8 sequence.

    `prefix` (the prompt) is written with the first token, after the prefill, so progress
    lines on stderr come before the text rather than inside it.
    """

    def __init__(self, tok, out, prefix: str = ""):
        self.tok, self.out, self.ids, self.printed, self.prefix = tok, out, [], "", prefix

    def _prefix(self):
        if self.prefix:
            self.out.write(self.prefix)
            self.prefix = ""

    def __call__(self, step, ids, active):
        self._prefix()
        if not active[0]:
            self.out.flush()
            return
        self.ids.append(int(ids[0]))
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            self.out.flush()
            return
        self.out.write(text[len(self.printed) :])
        self.out.flush()
        self.printed = text

    def finish(self):
        self._prefix()
        text = self.tok.decode(self.ids)
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed) :])
        self.out.write("\n")
        self.out.flush()


class _Phases:
    """`on_token` of one `generate` call: the prefill ends at the first token, then decoded tokens are counted.

    Tells `progress` what is under way (its lines name the phase and, while decoding,
    the tokens so far), and passes each token on to `inner` (the streamer).
    """

    def __init__(self, progress: Progress, label: str, prompt_tokens: int, max_new: int, inner=None):
        self.progress, self.label, self.max_new, self.inner, self.tokens = progress, label, max_new, inner, 0
        progress.doing(f"{label}prefill of {count(prompt_tokens, 'prompt token')}", count=(prompt_tokens, "tokens"))

    def __call__(self, step, ids, active):
        if step == 0:
            self.progress.doing(lambda: f"{self.label}decoding: {self.tokens} of {count(self.max_new, 'token')}")
        self.tokens = step + 1
        if self.inner is not None:
            self.inner(step, ids, active)
            self.progress.touch()


def notes(args, cfg, encoded: list[list[int]]) -> list[str]:
    """The `note:` lines to print before generating (none for --random-init: nothing was trained)."""
    if args.random_init:
        return []
    out = []
    synthetic = synthetic_note(cfg, f"expect noise, not text; a language model trains on text ({TEXT_DATASETS})")
    if synthetic:
        out.append(synthetic)
    T = cfg.train.seq_len
    longest = max(len(e) for e in encoded)
    expect = "so expect the completion to degrade (docs/LONG_CONTEXT.md)"
    if longest > T:
        n_over = sum(len(e) > T for e in encoded)
        if len(encoded) == 1:
            subject = f"the prompt is {longest:,} tokens"
        else:
            subject = f"the longest prompt is {longest:,} tokens ({n_over} of {len(encoded)} go beyond)"
        out.append(f"note: {subject}, {times(longest, cfg)} {trained_positions(cfg)}, {expect}")
    elif longest + args.max_new_tokens > T:
        total = longest + args.max_new_tokens
        subject = f"the prompt{'s' if len(encoded) > 1 else ''} and --max-new-tokens {args.max_new_tokens}"
        out.append(
            f"note: {subject} reach {total:,} tokens, {times(total, cfg)} {trained_positions(cfg)}, "
            f"so expect the text to degrade from there (docs/LONG_CONTEXT.md)"
        )
    return out


def run(args, out=None) -> int:
    out = sys.stdout if out is None else out  # the stream of the call, not of the import
    _check_sampling(args)
    prompts = _read_prompts(args)
    with Progress() as progress:
        progress.doing("initialising parameters" if args.random_init else f"loading the checkpoint {args.ckpt}")
        try:
            cfg, params = load_model(args)
            tok = make_tokenizer(cfg.data)
        except (ConfigError, ValueError, OSError) as e:
            raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        params = check_params(cfg, params)
        progress.done()
        V = cfg.model.vocab_size
        encoded = [tok.encode(p) for p in prompts]
        for p, ids in zip(prompts, encoded):
            if not ids:
                raise UsageError(f"prompt {p!r} encodes to no tokens")
            if max(ids) >= V:
                raise UsageError(f"prompt token id {max(ids)} is outside the model vocabulary ({V})")
        for line in notes(args, cfg, encoded):
            progress.emit(line)
        # Only ids the tokenizer can emit, never its padding id.
        allowed = np.arange(V) < min(V, tok.vocab_size)
        if 0 <= tok.pad_id < V:
            allowed[tok.pad_id] = False
        eos = tok.eos_id if 0 <= tok.eos_id < V else None
        kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_id=eos, allowed_V=allowed)
        if args.prompt is not None:
            streamer = _Streamer(tok, out, prefix=prompts[0])
            phases = _Phases(progress, "", len(encoded[0]), args.max_new_tokens, streamer)
            generate(cfg.model, params, encoded, args.max_new_tokens, seed=args.seed, on_token=phases, **kw)
            streamer.finish()
            progress.done()
            return 0
        n_batches = -(-len(prompts) // args.batch_size)
        for i, start in enumerate(range(0, len(prompts), args.batch_size)):
            batch = encoded[start : start + args.batch_size]
            label = f"batch {i + 1}/{n_batches}: " if n_batches > 1 else ""
            phases = _Phases(progress, label, sum(map(len, batch)), args.max_new_tokens)
            seed = args.seed + start
            outs = generate(cfg.model, params, batch, args.max_new_tokens, seed=seed, on_token=phases, **kw)
            progress.done()
            for text, ids in zip(prompts[start : start + args.batch_size], outs):
                out.write(json.dumps({"prompt": text, "completion": tok.decode(ids)}, ensure_ascii=False) + "\n")
            out.flush()
            progress.touch()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
