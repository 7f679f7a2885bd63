"""A model here -> a HF folder or a GGUF file the usual tools read (docs/EXPORT.md).

    python -m launch.export SRC OUT [--format hf|gguf] [--dtype float32|bfloat16|float16|q8_0]
                            [--drop-nsa [--heldout TEXT] [--heldout-len L]]

SRC: a model folder (launch.convert's, or a run's model written by launch.generate), a run's
out_dir, its checkpoints/ or one step. OUT: a new folder (hf) or a new file (gguf).
- A dense model (imported, or trained here in a Llama-family shape): `--format hf` writes
  config.json (the family's model_type and architectures), safetensors under HF's names
  (sharded with an index above 5 GB), and the tokenizer (tokenizer.json, tokenizer_config.json
  with BOS/EOS, special_tokens_map.json) that transformers loads with no custom code;
  `--format gguf` writes llama.cpp's layout (F32, F16, BF16 or Q8_0 by --dtype) with the
  vocabulary when the tokenizer is a byte-level BPE.
- An NSA model: `--format hf` writes its weights under HF-style names with the NSA settings
  in config.json's `nsa` block (launch.convert reads the folder back; stock transformers does
  not load it, and the command says so). `--drop-nsa` writes the approximate dense model instead
  (the selection branch's keys and values as the attention's; compression and gates dropped);
  with `--heldout TEXT` its loss on the text's first L tokens is measured against the NSA
  model's, printed and kept beside it (drop_nsa.json; for gguf, OUT.drop_nsa.json).
Bad input is one `error:` line, exit 2, nothing written: OUT is written under a temporary name
and renamed when complete; Ctrl-C or SIGTERM removes it and says so (exit 130 / 143).
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

from launch.cli import Parser, UsageError, run_main
from launch.convert import check_out, check_parent
from nsa_jax.pretrained import PretrainedError

DTYPES = ("float32", "bfloat16", "float16", "q8_0")
GGUF_KIND = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "q8_0": "Q8_0"}
DROP_NSA_FILE = "drop_nsa.json"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m launch.export", description=__doc__.split("\n\n")[0], in_process=True)
    p.add_argument("src", help="a model folder, a run's out_dir, its checkpoints/ or one step")
    p.add_argument("out", help="a new folder (hf) or a new file (gguf)")
    p.add_argument("--format", choices=("hf", "gguf"), default="hf", help="hf: a transformers folder; gguf: llama.cpp")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="tensor type written (q8_0: gguf only)")
    p.add_argument("--drop-nsa", action="store_true", help="an NSA model as the approximate dense model")
    p.add_argument(
        "--heldout", metavar="TEXT", help="with --drop-nsa: a text file whose loss both models are measured on"
    )
    p.add_argument(
        "--heldout-len", type=int, default=2048, metavar="L", help="tokens of --heldout scored (default 2048)"
    )
    return p


def check_args(args) -> None:
    if args.dtype == "q8_0" and args.format != "gguf":
        raise UsageError("--dtype q8_0 is a GGUF type; pass --format gguf, or a float dtype for hf")
    if args.heldout and not args.drop_nsa:
        raise UsageError("--heldout measures what --drop-nsa costs; pass --drop-nsa too, or drop --heldout")
    if args.heldout and not pathlib.Path(args.heldout).is_file():
        raise UsageError(f"--heldout {args.heldout} is not a file; name a UTF-8 text file")
    if args.heldout_len < 16:
        raise UsageError(f"--heldout-len must be >= 16 tokens, got {args.heldout_len}")
    src = pathlib.Path(args.src)
    if not src.exists():
        raise UsageError(f"SRC {src} does not exist; pass a model folder, a run's out_dir or a checkpoint step")
    out = pathlib.Path(args.out)
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise UsageError(f"OUT {out} is SRC or inside it; name a path outside the model being exported")
    if args.format == "gguf":
        if out.exists():
            raise UsageError(f"OUT {out} exists; name a new .gguf file (nothing was written)")
        if out.suffix != ".gguf":
            raise UsageError(f"OUT {out}: a GGUF export is one file; name it NAME.gguf")
        check_parent(out)
    else:
        check_out(out)


def load_source(src: str):
    """(Config, params, model folder or None) of SRC; UsageError when it is none of the three."""
    from nsa_jax.rundir.checkpoint import CheckpointError  # noqa: PLC0415 - jax loads after the flag checks
    from nsa_jax.rundir.model_dir import is_model_dir, load_model  # noqa: PLC0415

    path = pathlib.Path(src)
    try:
        cfg, params = load_model(path)
    except CheckpointError as e:
        raise UsageError(f"SRC {src} is not a model folder or a run's checkpoint ({e})") from None
    from nsa_jax.inference.decode import stack_layers  # noqa: PLC0415

    return cfg, stack_layers(cfg.model, params), (path if is_model_dir(path) else None)


def tokenizer_files(cfg) -> tuple[str | None, dict, str]:
    """(tokenizers JSON text or None, {bos, eos, pad, add_bos}, what it is) of the model's tokenizer."""
    from nsa_jax.data.tokenizers import SPECIALS_FILE, ByteTokenizer  # noqa: PLC0415
    from nsa_jax.pretrained.tokenizer import byte_tokenizer_json  # noqa: PLC0415

    name = cfg.data.tokenizer  # a model folder's: already its own file (model_dir.read_config)
    if name == "byte":
        b = ByteTokenizer()
        return byte_tokenizer_json(), {"eos": b.eos_id, "pad": b.pad_id, "add_bos": False}, "byte"
    path = pathlib.Path(name)
    if not path.is_file():
        return None, {}, f"{name} (not exported: no tokenizers JSON here)"
    specials_file = path.with_name(SPECIALS_FILE)
    specials = json.loads(specials_file.read_text()) if specials_file.is_file() else {}
    return path.read_text(), specials, str(path)


def dropped_nsa(cfg, params):
    """(dense Config, dense params) of an NSA model: the selection branch's keys and values as the
    attention's, q/o/norms as they are; compression, window branch and gates dropped. Local layers
    (model.global_every) keep their window branch's keys and values, which is all they attend with."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from nsa_jax.config import replace  # noqa: PLC0415
    from nsa_jax.nsa.attention import local_layer  # noqa: PLC0415

    window = cfg.model.dense_window if cfg.model.global_every else 0
    dense = replace(cfg, ["model.attention=dense", f"model.dense_window={window}", "model.nsa.gate_bias_init=[]"])
    attn = params["layers"]["attn"]
    keep = {n: attn[n] for n in ("q", "o", "q_norm", "k_norm") if n in attn}
    keep["k"], keep["v"] = attn["k_slc"], attn["v_slc"]
    if cfg.model.global_every:
        is_local = np.asarray([local_layer(cfg.model, i) for i in range(cfg.model.n_layers)])
        for name, branch in (("k", "k_win"), ("v", "v_win")):
            keep[name] = jax.tree.map(
                lambda s, w: np.where(is_local.reshape(-1, *[1] * (np.ndim(s) - 1)), w, s), keep[name], attn[branch]
            )
    layers = dict(params["layers"]) | {"attn": keep}
    return dense, dict(params) | {"layers": layers}


def heldout_loss(cfg, params, text_file: str, L: int) -> tuple[float, int]:
    """(mean next-token NLL, tokens scored) of the first L + 1 tokens of `text_file`."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from nsa_jax.data.tokenizers import make_tokenizer  # noqa: PLC0415
    from nsa_jax.evaluation.scorer import make_score_fn  # noqa: PLC0415

    ids = np.asarray(make_tokenizer(cfg.data).encode(pathlib.Path(text_file).read_text(encoding="utf-8")), np.int32)
    ids = ids[: L + 1]
    if len(ids) < 17:
        raise UsageError(f"--heldout {text_file} holds {len(ids)} tokens; give a text of at least {L + 1}")
    nll, _ = jax.jit(make_score_fn(cfg.model))(params, ids[None])
    return float(np.mean(np.asarray(nll))), len(ids) - 1


def run(args) -> int:
    check_args(args)
    t0 = time.monotonic()
    out = pathlib.Path(args.out)
    try:
        cfg, params, folder = load_source(args.src)
        nsa = cfg.model.attention == "nsa"
        if args.drop_nsa and not nsa:
            raise UsageError(f"--drop-nsa: SRC {args.src} is a dense model already; drop the flag")
        if nsa and args.format == "gguf" and not args.drop_nsa:
            raise UsageError("an NSA model has no GGUF layout; pass --drop-nsa for the approximate dense model")
        from nsa_jax.pretrained import export as ex  # noqa: PLC0415

        nsa_cfg, nsa_params = cfg, params
        if args.drop_nsa:
            cfg, params = dropped_nsa(cfg, params)
        if cfg.model.attention == "dense":
            ex.hf_family(cfg.model)  # what no family expresses, before any work
        tok_json, specials, tok_what = tokenizer_files(cfg)
    except PretrainedError as e:
        raise UsageError(str(e)) from None
    what = "nsa -> dense (--drop-nsa, approximate)" if args.drop_nsa else cfg.model.attention
    print(
        f"export: {args.src}: {what}, {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
        f"vocab {cfg.model.vocab_size} -> {args.format} ({args.dtype}) {out}",
        flush=True,
    )
    tmp = out.with_name(f".{out.name}.exporting-{os.getpid()}")
    previous = (
        signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        written = write_export(args, cfg, params, folder, tok_json, specials, tmp)
        if args.drop_nsa and args.heldout:
            report = drop_nsa_report(args, nsa_cfg, nsa_params, cfg, params)
            side = tmp / DROP_NSA_FILE if args.format == "hf" else tmp.with_name(tmp.name + ".drop_nsa.json")
            side.write_text(json.dumps(report, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        if args.drop_nsa and args.heldout and args.format == "gguf":
            tmp.with_name(tmp.name + ".drop_nsa.json").rename(out.with_name(out.name + ".drop_nsa.json"))
    except PretrainedError as e:
        raise UsageError(str(e)) from None
    except (KeyboardInterrupt, _Terminated) as e:
        how = "SIGTERM" if isinstance(e, _Terminated) else "Ctrl-C"
        print(f"export: stopped by {how}; nothing was written ({out} does not exist)", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        _remove(tmp)
        _remove(tmp.with_name(tmp.name + ".drop_nsa.json"))
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"export: wrote {out} ({', '.join(written)}) in {time.monotonic() - t0:.0f}s; tokenizer: {tok_what}")
    for line in usage_lines(args, out, nsa and not args.drop_nsa):
        print(line)
    return 0


def usage_lines(args, out: pathlib.Path, nsa: bool) -> list[str]:
    if nsa:
        return [
            "  an NSA model: stock transformers does not load it (no NSA attention there); "
            f"python -m launch.convert {out} FOLDER reads it back"
        ]
    where = f"'{out.parent}', gguf_file='{out.name}'" if args.format == "gguf" else f"'{out}'"
    return [f'  try: python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained({where})"']


def drop_nsa_report(args, nsa_cfg, nsa_params, cfg, params) -> dict:
    nsa_loss, n = heldout_loss(nsa_cfg, nsa_params, args.heldout, args.heldout_len)
    dense_loss, _ = heldout_loss(cfg, params, args.heldout, args.heldout_len)
    change = dense_loss / nsa_loss - 1
    print(
        f"export: --drop-nsa on {args.heldout} ({n:,} tokens): loss {nsa_loss:.4f} (NSA) -> {dense_loss:.4f} "
        f"(dense, approximate): {change:+.2%}"
    )
    return {"heldout": str(args.heldout), "tokens": n, "nsa_loss": nsa_loss, "dense_loss": dense_loss, "change": change}


def write_export(args, cfg, params, folder, tok_json, specials, tmp: pathlib.Path) -> list[str]:
    from nsa_jax.pretrained import export as ex  # noqa: PLC0415

    source = _source_config(folder)
    if args.format == "gguf":
        hf = ex.hf_config(cfg, specials, source)
        types = ex.write_gguf(
            tmp, hf, list(ex.hf_tensors(params, cfg.model)), GGUF_KIND[args.dtype], tok_json, specials
        )
        kinds = sorted(set(types.values()))
        return [f"{len(types)} tensors ({'/'.join(kinds)})"] + ([] if tok_json else ["no vocabulary"])
    tmp.mkdir(parents=True)
    if cfg.model.attention == "nsa":
        hf = ex.nsa_hf_config(cfg, specials, source, args.dtype)
        tensors = list(ex.nsa_hf_tensors(params, cfg.model))
    else:
        hf = ex.hf_config(cfg, specials, source, args.dtype)
        tensors = list(ex.hf_tensors(params, cfg.model))
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    files = ["config.json", *ex.write_safetensors(tmp, tensors, args.dtype)]
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    files.append("generation_config.json")
    if tok_json is not None:
        files += ex.write_hf_tokenizer(tmp, tok_json, specials)
    return files


def _source_config(folder) -> dict | None:
    from nsa_jax.pretrained.export import SOURCE_CONFIG_FILE  # noqa: PLC0415

    if folder is None or not (pathlib.Path(folder) / SOURCE_CONFIG_FILE).is_file():
        return None
    return json.loads((pathlib.Path(folder) / SOURCE_CONFIG_FILE).read_text())


def _remove(path: pathlib.Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


class _Terminated(BaseException):
    """SIGTERM while exporting (a BaseException, as KeyboardInterrupt)."""


def _terminated(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    try:
        return run_main(build_parser, run, argv)
    except KeyboardInterrupt:
        print("export: stopped by Ctrl-C before writing; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
