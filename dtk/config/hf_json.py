"""What a Hugging Face model's config.json says about the data it takes, read without torch
or transformers on the login node (`model=hf`, conf/model/hf.yaml): its vocabulary and the
longest sample its position embeddings allow. The worker builds the model from the same file
(dtk.models.hf)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError

HF_TARGET = "dtk.models.hf.build"


def config_json(kwargs: dict[str, Any]) -> dict[str, Any]:
    """config.json of `model.config` (else `model.init_from`), with `model.config_overrides`
    applied; a UserError naming the key when there is none."""
    folder = kwargs.get("config") or kwargs.get("init_from")
    key = "model.config" if kwargs.get("config") else "model.init_from"
    if not folder:
        raise UserError("model=hf needs model.config=DIR (a config.json) or model.init_from=DIR (config.json + safetensors)")
    path = Path(str(folder)).expanduser() / "config.json"
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{key}={folder}: no config.json in that folder; give a local folder holding a model's"
                        " config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{key}={folder}: config.json does not read as JSON ({' '.join(str(exc).split())[:120]})") from None
    if not isinstance(loaded, dict):
        raise UserError(f"{key}={folder}: config.json holds no object of keys")
    return {**loaded, **(kwargs.get("config_overrides") or {})}


def fill_vocab_size(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`model.vocab_size` from config.json where the yaml leaves it null, for generated data
    (which has no token ids of its own). Where config.json cannot be read the key stays null
    and the plan's check names the problem."""
    if kwargs.get("vocab_size") is not None:
        return kwargs
    try:
        vocab = config_json(kwargs).get("vocab_size")
    except UserError:
        return kwargs
    return {**kwargs, "vocab_size": vocab} if isinstance(vocab, int) else kwargs


def check_hf_model(kwargs: dict[str, Any]) -> None:
    """At submission, what the workers would find when they build the model: the data's
    token ids within its vocabulary, its samples within its position embeddings."""
    cfg = config_json(kwargs)
    vocab, seq_len = kwargs.get("vocab_size"), kwargs.get("seq_len")
    model_vocab, longest = cfg.get("vocab_size"), cfg.get("max_position_embeddings")
    if isinstance(model_vocab, int) and vocab is not None and vocab > model_vocab:
        raise UserError(f"model.vocab_size={vocab}: the data's token ids must fit the model's vocabulary of"
                        f" {model_vocab} (config.json); use model.vocab_size <= {model_vocab}")
    if isinstance(longest, int) and seq_len is not None and seq_len > longest:
        raise UserError(f"model.seq_len={seq_len} is longer than the model's max_position_embeddings={longest}"
                        f" (config.json); use model.seq_len <= {longest}")
