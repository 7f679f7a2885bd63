"""A pretrained dense checkpoint -> a model folder the project's commands read (docs/PRETRAINED.md).

    python -m launch.convert SRC OUT [--attention dense|nsa] [--set KEY=VALUE ...] [--seed N]

SRC: a HF model folder (config.json + safetensors) or a GGUF file of a Llama-family model
(llama: Llama 2/3.x and SmolLM2, mistral, qwen2, qwen3). OUT, a new or empty folder, gets
config.yaml + params.safetensors (what `launch.generate --ckpt OUT` and `launch.evaluate --ckpt
OUT` read), tokenizer.json and special_tokens.json (the checkpoint's own tokenizer, BOS and
EOS; config.yaml's data.tokenizer names it). `--attention dense`: the model as it was;
`nsa` (default): NSA started from it (nsa_jax/pretrained/weights.py nsa_params), its NSA
hyper-parameters from `--set model.nsa.KEY=VALUE`. Bad input is one `error:` line, exit 2,
and nothing written: OUT is written under a temporary name and renamed when complete. Ctrl-C
(SIGINT) or SIGTERM while converting removes that temporary folder and says so in one line
(exit 130 / 143): nothing is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import sys
import threading
import time

from launch.cli import Parser, UsageError, add_overrides, run_main
from nsa_jax.config import Config, ConfigError, from_dict, load_config, replace, validate
from nsa_jax.config import to_dict as config_dict
from nsa_jax.data.tokenizers import SPECIALS_FILE
from nsa_jax.pretrained import PretrainedError

NSA_MODEL_TYPE = "nsa_jax"  # config.json's model_type of an NSA export (nsa_jax/pretrained/export.py)

# Host memory the conversion may take, per byte of the model's fp32 parameters (the parameters,
# the copy written out, and a tensor in flight).
HOST_BYTES_PER_PARAM_BYTE = 1.3
# The NSA model's gate start (sigmoid of the biases [cmp, slc, win]), unless --set says otherwise:
# docs/PRETRAINED.md "From dense to NSA" has the step-0 figures behind it.
NSA_GATE_BIAS = (-6.0, 6.0, -6.0)
# Its block scorer: cmp's best 4 n blocks re-ranked by their exact mass. At step 0 on SmolLM2-135M at
# 8k it brings positions 4k-8k to 0.6% above dense where cmp leaves them 5.3% above (docs/PRETRAINED.md
# "Where NSA loses past 2k"). Capped scores (Gemma 2) keep cmp: rescore's are raw.
NSA_SCORER = "rescore"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m launch.convert", description=__doc__.split("\n\n")[0], in_process=True)
    p.add_argument("src", help="a HF model folder (config.json + *.safetensors) or a .gguf file")
    p.add_argument("out", help="a new or empty folder for the converted model")
    p.add_argument("--attention", choices=("dense", "nsa"), default="nsa", help="dense: as it was; nsa: NSA from it")
    add_overrides(p, "model.nsa.w=1024")
    p.add_argument("--seed", type=int, default=0, help="seed of the NSA parts that start random (compressors, gates)")
    return p


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where it cannot be read."""
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_out(out: pathlib.Path) -> None:
    """OUT is new or an empty folder whose parent can be written: checked before any work."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"OUT {out} is not an empty folder; name a new folder (nothing was written)")
    check_parent(out)


def check_parent(out: pathlib.Path) -> None:
    """OUT's parent is a folder that can be written (a file or folder made there then renamed to OUT)."""
    parent = out.parent
    below = next((p for p in [parent, *parent.parents] if p.exists()), None)
    if below is not None and not below.is_dir():
        raise UsageError(f"OUT {out}: {below} is a file, not a folder; name a folder to write into")
    if not parent.is_dir():
        raise UsageError(f"OUT {out}: its parent folder {parent} does not exist")
    probe = parent / f".{out.name}.probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise UsageError(f"OUT {out}: its parent folder {parent} cannot be written ({e.strerror}); nothing was written")


def converted_config(ckpt, attention: str, overrides: list[str], out: pathlib.Path):
    """The run config of the converted model: its ModelConfig, its tokenizer, a seq_len it was trained to."""
    from nsa_jax.pretrained.families import model_config  # noqa: PLC0415 - jax loads after the flag checks

    hf = ckpt.hf_config
    exported_nsa = hf.get("model_type") == NSA_MODEL_TYPE
    if exported_nsa:  # launch.export of an NSA model: its family's keys, and its NSA settings to keep
        if attention != "nsa":
            raise UsageError(
                f"{ckpt.path} is an NSA model; --attention dense does not apply (launch.export --drop-nsa "
                "writes the approximate dense model)"
            )
        hf = hf | {"model_type": hf.get("base_model_type")}
    model = config_dict(model_config(hf))
    if attention == "nsa":
        model["attention"] = "nsa"
        if not model["global_every"]:  # NSA's own window is model.nsa.w; Gemma's local layers keep theirs
            model["dense_window"] = 0
        if exported_nsa:
            model["nsa"] = dict(ckpt.hf_config.get("nsa") or {})
        else:
            model["nsa"]["gate_bias_init"] = list(NSA_GATE_BIAS)
            model["nsa"]["scorer"] = "cmp" if model.get("attn_softcap") else NSA_SCORER
    # The length the model was trained to (what the notes of generate and evaluate measure against), at most 8k.
    seq_len = min(8192, int(ckpt.hf_config.get("max_position_embeddings") or 2048))
    base = config_dict(load_config(None))
    base["model"] = model
    base["train"]["seq_len"] = seq_len
    # Names relative to the folder only, so it loads from wherever it is moved (rundir/files.py
    # folder_tokenizer); a run started from it writes elsewhere by default, never into the folder.
    base["train"]["out_dir"] = f"artifacts/{out.name}-run"
    base["data"]["tokenizer"] = "tokenizer.json"
    base["data"]["dataset"] = "text"  # a pretrained model learnt text; data.path names the files to continue on
    cfg = validate(from_dict(Config, base))
    return replace(cfg, overrides) if overrides else cfg


def run(args) -> int:
    out = pathlib.Path(args.out)
    check_out(out)
    from nsa_jax.pretrained.checkpoints import open_checkpoint  # noqa: PLC0415 - jax loads after the flag checks

    t0 = time.monotonic()
    try:
        ckpt = open_checkpoint(args.src)
        cfg = converted_config(ckpt, args.attention, args.overrides, out)
    except (PretrainedError, ConfigError) as e:
        raise UsageError(str(e).removeprefix("config: ")) from None
    if ckpt.tokenizer_json is None:
        raise UsageError(f"{args.src} carries no tokenizer (tokenizer.json, or a GGUF vocabulary); nothing was written")
    need, have = HOST_BYTES_PER_PARAM_BYTE * ckpt.fp32_bytes, available_host_bytes()
    if have is not None and need > have:
        raise UsageError(
            f"{args.src}: converting needs about {need / 2**30:.1f} GiB of host memory "
            f"({ckpt.fp32_bytes / 2**30:.1f} GiB of fp32 parameters); {have / 2**30:.1f} GiB is available"
        )
    from nsa_jax.nsa.attention import local_layer  # noqa: PLC0415 - jax loads after the flag checks

    m = cfg.model
    pattern = ""
    if m.global_every:
        n_global = sum(not local_layer(m, i) for i in range(m.n_layers))
        pattern = (
            f" ({n_global} global, {m.n_layers - n_global} local over {m.dense_window} keys"
            f"{': their window branch alone' if args.attention == 'nsa' else ''})"
        )
    print(
        f"convert: {args.src}: {ckpt.hf_config.get('model_type')}, {m.n_layers} layers{pattern}, "
        f"d_model {m.d_model}, {m.n_heads} heads over {m.n_kv_heads}, vocab {m.vocab_size} -> {args.attention}",
        flush=True,
    )
    tmp = out.with_name(f".{out.name}.converting-{os.getpid()}")
    # SIGTERM as Ctrl-C: either unwinds through the cleanup below.
    previous = signal.signal(signal.SIGTERM, _terminated) if _main_thread() else None
    try:
        write_model(ckpt, cfg, args.attention, args.seed, tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except PretrainedError as e:
        raise UsageError(str(e)) from None
    except (KeyboardInterrupt, _Terminated) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        how = "SIGTERM" if isinstance(e, _Terminated) else "Ctrl-C"
        print(f"convert: stopped by {how}; nothing was written ({out} does not exist)", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"convert: wrote {out} (config.yaml, params.safetensors, tokenizer.json) in {time.monotonic() - t0:.0f}s")
    print(f"  try: python -m launch.generate --ckpt {out} --prompt 'def fibonacci(n):' --temperature 0")
    return 0


class _Terminated(BaseException):
    """SIGTERM while converting (a BaseException, as KeyboardInterrupt: no handler swallows it)."""


def _terminated(signum, frame):
    raise _Terminated()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def write_model(ckpt, cfg, attention: str, seed: int, folder: pathlib.Path) -> None:
    import jax  # noqa: PLC0415 - after the checks above, which need no backend

    from launch.generate import write_inference_dir  # noqa: PLC0415
    from nsa_jax.pretrained.export import SOURCE_CONFIG_FILE  # noqa: PLC0415
    from nsa_jax.pretrained.weights import dense_params, nsa_checkpoint_params, nsa_params  # noqa: PLC0415

    if ckpt.hf_config.get("model_type") == NSA_MODEL_TYPE:
        params = nsa_checkpoint_params(ckpt, cfg.model)
    else:
        dense_cfg = replace(cfg, ["model.attention=dense", "model.nsa.gate_bias_init=[]"])
        params = dense_params(ckpt, dense_cfg.model)
        if attention == "nsa":
            params = nsa_params(params, cfg.model, jax.random.PRNGKey(seed))
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(ckpt.tokenizer_json)
    (folder / SPECIALS_FILE).write_text(json.dumps(ckpt.special_ids) + "\n")
    # The checkpoint's own config (HF keys): what launch.export writes back beside the model's shape.
    (folder / SOURCE_CONFIG_FILE).write_text(json.dumps(ckpt.hf_config, indent=2) + "\n")
    write_inference_dir(folder, cfg, params)


def main(argv: list[str] | None = None) -> int:
    try:
        return run_main(build_parser, run, argv)
    except KeyboardInterrupt:  # before the write began (reading SRC, starting jax)
        print("convert: stopped by Ctrl-C before writing; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
