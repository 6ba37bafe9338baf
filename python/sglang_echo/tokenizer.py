"""Byte-level tokenizer for the project's tiny checkpoints, built offline with ``tokenizers``.

Ids 0-2 are <|bos|>, <|eos|>, <|pad|>; ids 3-258 are the 256 bytes, so any text round-trips.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256


def build_byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i, ch in enumerate(alphabet):
        vocab[ch] = len(SPECIAL_TOKENS) + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _byte_of(ch: str) -> int:
    """Inverse of the GPT-2 byte->printable map that ByteLevel uses."""
    return _printable_to_byte()[ch]


@functools.cache
def _printable_to_byte() -> dict[str, int]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + extra
            extra += 1
    return {chr(v): k for k, v in mapping.items()}


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The raw bytes one token stands for (a byte-level token may be part of a character).

    Log-probability answers name each token; decoding a lone byte of a multi-byte
    character gives U+FFFD, which would make different tokens look alike.
    """
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    table = _printable_to_byte()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.encode("utf-8")


def token_label(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as OpenAI writes it: its text, or ``bytes:\\xNN...`` when it is no whole
    UTF-8 text on its own. Special tokens keep their name."""
    if token_id in _special_ids(tokenizer):
        return tokenizer.id_to_token(token_id)
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _special_ids(tokenizer: Tokenizer) -> set[int]:
    return {
        i for i, t in tokenizer.get_added_tokens_decoder().items() if getattr(t, "special", False)
    }


def load_tokenizer(model_path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer.json, or None when it ships none."""
    file = Path(model_path) / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else None


def save_byte_tokenizer(out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json, as transformers' AutoTokenizer loads them."""
    build_byte_tokenizer().save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
