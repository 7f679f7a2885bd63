"""A GGUF file's vocabulary as a `tokenizers` JSON, with the BOS/EOS ids the file defines.

GGUF's `gpt2` tokenizer model is a byte-level BPE: `tokenizer.ggml.tokens` spelled in GPT-2's
byte alphabet, `tokenizer.ggml.merges` as "a b" lines, token types (3: control, 4:
user-defined). It becomes a BPE model with GPT-2's byte-level pre-tokenizer and decoder; the
control tokens are special added tokens, so they stay whole in text. Other tokenizer models
(sentencepiece `llama`, ...) are refused with the supported one named.
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from nsa_jax.pretrained import PretrainedError

CONTROL, USER_DEFINED = 3, 4


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = dict(zip(keep, keep)), 0
    for b in range(256):
        if b not in chars:
            chars[b], n = 256 + n, n + 1
    return {b: chr(c) for b, c in chars.items()}


def gguf_tokenizer_json(metadata: dict) -> tuple[str | None, dict]:
    """(tokenizers JSON text or None when the file has no vocabulary, {"bos", "eos", ["pad",] "add_bos"})
    from a GGUF file's metadata (gguf_file.GGUFFile.metadata)."""

    def get(key, default=None):
        return metadata.get(f"tokenizer.ggml.{key}", default)

    special = {"bos": get("bos_token_id"), "eos": get("eos_token_id"), "add_bos": bool(get("add_bos_token", False))}
    if get("padding_token_id") is not None:
        special["pad"] = get("padding_token_id")
    kind = get("model")
    if kind is None:
        return None, special
    if kind != "gpt2":
        raise PretrainedError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', byte-level BPE); "
            "convert the HF folder with its tokenizer.json instead"
        )
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    tokens = list(get("tokens"))
    types = list(get("token_type", []))
    vocab = {}
    for i, token in enumerate(tokens):
        if not set(token) <= spelled:  # a token stored as raw text: spell its bytes
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = [tuple(m.split(" ", 1)) for m in get("merges", [])]
    tok = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(get("add_space_prefix", False)))
    tok.decoder = decoders.ByteLevel()
    if special["add_bos"] and special["bos"] is not None:
        bos = tokens[special["bos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, special["bos"])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, k in zip(tokens, types) if k == CONTROL and set(t) <= spelled]
    tok.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    tok.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False) for t in user])
    return tok.to_str(), special


BYTE_SPECIALS = ("<|endoftext|>", "<pad>")  # ids 256 and 257: ByteTokenizer's EOS and PAD


def byte_tokenizer_json() -> str:
    """The byte tokenizer (data.tokenizer: byte) as a tokenizers JSON: each UTF-8 byte b is id b (a
    byte-level BPE with no merges), EOS 256 and PAD 257 as special tokens; what an exported model of
    the project's byte vocabulary ships as tokenizer.json."""
    alphabet = _byte_alphabet()
    tok = tokenizers.Tokenizer(
        models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[], continuing_subword_prefix="", fuse_unk=False)
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True) for t in BYTE_SPECIALS])
    return tok.to_str()
