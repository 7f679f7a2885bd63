"""Tokenizers: byte-level, a Hugging Face `tokenizers` JSON file, and tiktoken gpt2.

Owns `make_tokenizer(data_cfg)` and the common interface: `.encode(str) -> list[int]`,
`.encode_np(str) -> int32 array`, `.decode(list[int]) -> str`, `.vocab_size`, `.eos_id`,
`.pad_id`. Also `padded_vocab_size`, because the model's embedding table must cover the
tokenizer vocabulary and is faster at a multiple of 64.

`cfg.data.tokenizer` values: "byte"; "gpt2" (or "tiktoken:gpt2", "tiktoken:<name>");
or a path to a tokenizer.json file.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
from typing import Any, Sequence

import numpy as np
import tokenizers

# Special-token spellings looked up in a tokenizers JSON vocabulary, most common first.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|eos|>")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


def padded_vocab_size(n: int, multiple: int = 64) -> int:
    """Smallest multiple of `multiple` that is >= n (e.g. 258 -> 320)."""
    if n <= 0 or multiple <= 0:
        raise ValueError(f"padded_vocab_size needs positive n and multiple, got {n}, {multiple}")
    return -(-n // multiple) * multiple


def fitted_vocab_size(model_vocab: int, tokenizer_vocab: int) -> int:
    """The model vocabulary for a tokenizer: `model_vocab` when it already covers every
    tokenizer id, else the tokenizer's size rounded up to a multiple of 64 (258 -> 320)."""
    return model_vocab if model_vocab >= tokenizer_vocab else padded_vocab_size(tokenizer_vocab)


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; EOS = 256, PAD = 257; vocab_size = 258."""

    name = "byte"
    vocab_size = 258
    eos_id = 256
    pad_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_np(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        # Specials (and anything >= 256) are not bytes: dropped from the text.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# Beside a tokenizer.json: the ids a pretrained model defines as BOS/EOS (launch.convert writes it).
SPECIALS_FILE = "special_tokens.json"


class HFTokenizer:
    """A `tokenizers` JSON file. EOS/PAD: a pretrained model's own (SPECIALS_FILE beside the file), else
    from the vocabulary when present, else new ids."""

    def __init__(self, path: str):
        self.name = str(path)
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        base = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        extra = base
        specials = pathlib.Path(path).with_name(SPECIALS_FILE)
        own = json.loads(specials.read_text()) if specials.is_file() else {}
        self.bos_id = own.get("bos")
        self.eos_id = own.get("eos")
        if self.eos_id is None:
            self.eos_id = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
        if self.eos_id is None:
            # No EOS in the file: give it the first id past the vocabulary.
            self.eos_id, extra = extra, extra + 1
        self.pad_id = own.get("pad")
        if self.pad_id is None:
            self.pad_id = next((vocab[n] for n in PAD_NAMES if n in vocab), None)
        if self.pad_id is None:
            self.pad_id, extra = extra, extra + 1
        self.vocab_size = extra
        self._base = base

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def encode_batch_np(self, texts: Sequence[str]) -> list[np.ndarray]:
        # The Rust side tokenises a batch in parallel and without the GIL.
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self._base], skip_special_tokens=False)


class TiktokenTokenizer:
    """A tiktoken encoding (gpt2 by default), only from files already in the local cache."""

    def __init__(self, encoding: str = "gpt2"):
        try:
            import tiktoken  # noqa: PLC0415 - optional: the tiktoken extra
        except ImportError:
            raise ValueError("data.tokenizer=gpt2 needs the `tiktoken` package; pip install tiktoken") from None
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
        if not cache or not pathlib.Path(cache).is_dir() or not any(pathlib.Path(cache).iterdir()):
            # Without a populated cache tiktoken would try to download; there is no network here.
            raise ValueError(
                f"data.tokenizer={encoding}: tiktoken files are not available locally; set TIKTOKEN_CACHE_DIR "
                "to a directory holding the cached encoding files (copied from a machine with a network)"
            )
        try:
            self._enc = tiktoken.get_encoding(encoding)
        except Exception as e:  # noqa: BLE001 - any load failure gets the same fix
            raise ValueError(
                f"data.tokenizer={encoding}: could not load the tiktoken encoding from TIKTOKEN_CACHE_DIR={cache} "
                f"({type(e).__name__}); put the cached {encoding} files there"
            ) from None
        self.name = encoding
        self.eos_id = self._enc.eot_token
        self.pad_id = self._enc.n_vocab  # no pad token in gpt2: one id past the vocabulary
        self.vocab_size = self._enc.n_vocab + 1

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids if 0 <= int(i) < self._enc.n_vocab])


def make_tokenizer(data_cfg: Any) -> ByteTokenizer | HFTokenizer | TiktokenTokenizer:
    """The tokenizer named by `data_cfg.tokenizer` (a DataConfig or the string itself).

    Loaded once per process and spec: the launcher (to size the vocabulary) and the
    train and val streams all ask for it. Encoding is stateless, so sharing is safe.
    """
    spec = data_cfg if isinstance(data_cfg, str) else data_cfg.tokenizer
    return _load_tokenizer(spec.strip())


@functools.lru_cache(maxsize=8)
def _load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer | TiktokenTokenizer:
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2" or spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec.split(":", 1)[1] if ":" in spec else spec)
    path = pathlib.Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"data.tokenizer: {spec!r} is not 'byte', 'gpt2' or an existing tokenizer.json file; "
            "fix the path or pick a built-in tokenizer"
        )
    return HFTokenizer(str(path))
