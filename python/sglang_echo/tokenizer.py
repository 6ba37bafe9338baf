"""Byte-level tokenizer for the project's tiny checkpoints, built offline with ``tokenizers``.

Ids 0-2 are <|bos|>, <|eos|>, <|pad|>; ids 3-258 are the 256 bytes, so any text round-trips.
"""

from __future__ import annotations

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
    inverse = {chr(v): k for k, v in mapping.items()}
    return inverse[ch]


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
