"""launch.export's folders and GGUF files through transformers + torch: the round trip's check by command.

Run with the reference venv tests/golden/make_pretrained.py describes (torch, transformers, gguf),
after the exports are written with the project's own venv (docs/PRETRAINED.md "Export" has the
commands). It imports nothing of this project.

    python tests/golden/check_export.py hf FOLDER --golden tests/golden/pretrained/llama2/golden.npz
    python tests/golden/check_export.py gguf FILE.gguf --against FOLDER     # logits against the HF export's
    python tests/golden/check_export.py text FOLDER --text FILE --len 2048 [--greedy 'def fibonacci(n):']
    python tests/golden/check_export.py real FOLDER --golden tests/golden/pretrained/smollm2_135m.npz

Each prints one JSON line: the max abs logit difference (hf, gguf), or the mean next-token loss of
the text's first LEN tokens with the 48 greedy tokens of a prompt (text), or against the real
model's golden (real: the mean loss of its 2,048 positions and its 48 greedy tokens, as
make_pretrained.py recorded them from the original GGUF through transformers; the tokenizer's
ids of the golden's text too).
"""

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers


def load(path: pathlib.Path):
    kw = {"dtype": torch.float32, "attn_implementation": "eager"}
    if path.suffix == ".gguf":
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


def load_tokenizer(path: pathlib.Path):
    if path.suffix == ".gguf":
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return transformers.AutoTokenizer.from_pretrained(str(path))


@torch.no_grad()
def logits(model, ids: np.ndarray) -> np.ndarray:
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("hf", "gguf", "text", "real"))
    p.add_argument("path", type=pathlib.Path)
    p.add_argument("--golden", type=pathlib.Path, help="golden.npz of make_pretrained.py (input_ids, logits)")
    p.add_argument("--against", type=pathlib.Path, help="a HF folder whose logits a GGUF file is compared with")
    p.add_argument("--ids", type=pathlib.Path, help="hf/gguf without --golden: an .npy of token ids [B, T]")
    p.add_argument("--text", type=pathlib.Path)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--greedy", default="def fibonacci(n):")
    a = p.parse_args()
    model = load(a.path)
    out = {"path": str(a.path), "transformers": transformers.__version__, "class": type(model).__name__}
    if a.what in ("hf", "gguf"):
        ids = np.load(a.golden)["input_ids"] if a.golden else np.load(a.ids)
        got = logits(model, ids)
        want = np.load(a.golden)["logits"] if a.golden else logits(load(a.against), ids)
        out["max_abs_diff"] = float(np.abs(got - want).max())
        out["max_abs_logit"] = float(np.abs(want).max())
        out["argmax_agree"] = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    elif a.what == "real":
        g = np.load(a.golden)
        lg = torch.as_tensor(logits(model, g["ids"][None, :-1]))
        nll = torch.nn.functional.cross_entropy(
            lg[0], torch.as_tensor(g["ids"][1:], dtype=torch.long), reduction="none"
        )
        out |= {"mean_loss": float(nll.mean()), "golden_mean_loss": float(g["nll"].mean())}
        out["max_abs_nll_diff"] = float(np.abs(nll.numpy() - g["nll"]).max())
        prompt = torch.as_tensor(g["prompt_ids"][None], dtype=torch.long)
        with torch.no_grad():
            gen = model.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
        out["greedy_identical"] = gen[0, prompt.shape[1] :].tolist() == g["greedy_ids"].tolist()
        meta = json.loads(a.golden.with_suffix(".json").read_text())
        text_meta = meta["text"]
        stdlib = pathlib.Path(json.__file__).parent.parent
        text = "".join((stdlib / f).read_text(encoding="utf-8") for f in text_meta["files"])
        tok = load_tokenizer(a.path)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        n = min(len(ids), len(g["ids"]))
        out["tokenizer_ids_identical"] = ids[:n] == g["ids"][:n].tolist()
    else:
        tok = load_tokenizer(a.path)
        ids = tok(a.text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][: a.len + 1]
        lg = torch.as_tensor(logits(model, np.asarray([ids])))
        nll = torch.nn.functional.cross_entropy(lg[0, :-1], torch.as_tensor(ids[1:]), reduction="mean")
        out |= {"tokens": len(ids) - 1, "mean_loss": float(nll)}
        prompt = tok(a.greedy, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            gen = model.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
        out["greedy_ids"] = gen[0, prompt.shape[1] :].tolist()
        out["greedy_text"] = tok.decode(out["greedy_ids"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
