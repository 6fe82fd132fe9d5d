"""Text to token ids for `python -m dtk.data prepare --tokenizer bytes|chars|DIR`.

- `bytes`: UTF-8 bytes, ids 0..255 (vocabulary 256, whatever the text).
- `chars`: one id per distinct character of the corpus, in code point order (vocabulary:
  the number of distinct characters). The characters are recorded in the manifest
  (`vocabulary`), so ids can be turned back into text.
- DIR: a Hugging Face tokenizer folder on this machine (its `tokenizer.json`), read with
  the `tokenizers` package; nothing is downloaded. The vocabulary size is the
  tokenizer's; the manifest records the folder and a hash of its tokenizer.json.

No torch: prepare runs on a login node.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dtk.common.errors import UserError

BUILT_IN = ("bytes", "chars")
TOKENIZER_JSON = "tokenizer.json"
LINES_PER_BATCH = 4096


@dataclass
class Tokenized:
    """A token stream and what the manifest says about how it was made."""

    ids: np.ndarray
    name: str
    vocab_size: int
    header: dict[str, Any] = field(default_factory=dict)
    """Fields that describe the tokenizer; part of the dataset's version."""
    about: dict[str, Any] = field(default_factory=dict)
    """Fields the manifest records that are not part of the version (where the tokenizer was)."""


def check_tokenizer(spec: str) -> None:
    """Refuse an unknown tokenizer before anything is read or written."""
    if spec in BUILT_IN:
        return
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise UserError(f"--tokenizer {spec}: not bytes, chars, or an existing folder; give bytes, chars, or a local"
                        f" Hugging Face tokenizer folder (holding {TOKENIZER_JSON})")
    if not (folder / TOKENIZER_JSON).is_file():
        raise UserError(f"--tokenizer {spec}: the folder holds no {TOKENIZER_JSON}; save a tokenizer there with"
                        " tokenizer.save_pretrained(DIR) (transformers) or Tokenizer.save(DIR/tokenizer.json)")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise UserError(f"--tokenizer {spec}: reading a Hugging Face tokenizer needs the tokenizers package;"
                        " pip install tokenizers (or dtk-train[text])") from None


def read_text(files: list[Path]) -> str:
    parts = []
    for p in files:
        try:
            parts.append(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise UserError(f"--input {p}: not UTF-8 text at byte {exc.start}; --tokenizer chars and DIR read UTF-8"
                            " (--tokenizer bytes takes any bytes)") from None
    return "".join(parts)


def tokenize(files: list[Path], spec: str) -> Tokenized:
    if spec == "bytes":
        stream = np.concatenate([np.frombuffer(p.read_bytes(), dtype=np.uint8) for p in files])
        return Tokenized(stream, "bytes", 256)
    text = read_text(files)
    if spec == "chars":
        return _chars(text)
    return _hf(text, Path(spec).expanduser())


def _chars(text: str) -> Tokenized:
    vocabulary = sorted(set(text))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.array([ord(c) for c in vocabulary], dtype=np.uint32)
    ids = np.searchsorted(table, codes).astype(np.uint32)
    return Tokenized(ids, "chars", len(vocabulary), {"vocabulary": "".join(vocabulary)})


def _hf(text: str, folder: Path) -> Tokenized:
    from tokenizers import Tokenizer

    file = folder / TOKENIZER_JSON
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own Exception type for a bad file
        raise UserError(f"--tokenizer {folder}: {TOKENIZER_JSON} does not load ({' '.join(str(exc).split())[:160]})") from None
    # Line by line in batches: the library's batch encoder runs in parallel, and a
    # tokenizer's pre-tokenizer splits at whitespace anyway.
    lines = text.splitlines(keepends=True)
    chunks = []
    for start in range(0, len(lines), LINES_PER_BATCH):
        for enc in tok.encode_batch(lines[start : start + LINES_PER_BATCH], add_special_tokens=False):
            chunks.append(np.asarray(enc.ids, dtype=np.uint32))
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint32)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]
    return Tokenized(ids, "hf", tok.get_vocab_size(with_added_tokens=True),
                     {"tokenizer_sha256": digest}, {"tokenizer_path": str(folder.resolve())})
