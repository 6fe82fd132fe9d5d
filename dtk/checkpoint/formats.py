"""Writers of an exported model: one file in torch's or safetensors' format, or a Hugging
Face folder that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads.

    torch        FILE: torch.save of the state dict (dtk's default)
    safetensors  FILE: the same state dict as a safetensors file (no pickle; any framework)
    hf           DIR: config.json (the run's model config, dtype of the tensors) and
                 model.safetensors, for a run of model=hf; a tied output head is written
                 once, as transformers expects

Each writes to a temporary name beside the target and renames it into place, so an
interrupted export leaves nothing half-written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dtk.common.errors import UserError
from dtk.plan.plan import HF_TARGET

FORMATS = ("torch", "safetensors", "hf")


def _tmp(out: Path) -> Path:
    return out.with_name(f".{out.name}.tmp{os.getpid()}")


def write_file(tensors: dict[str, torch.Tensor], out: Path, *, fmt: str) -> None:
    tmp = _tmp(out)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(tensors, tmp)
    os.replace(tmp, out)


def write_hf(tensors: dict[str, torch.Tensor], out: Path, *, model_cfg: dict[str, Any] | None) -> None:
    """A transformers folder from the state dict of a model=hf run."""
    model = model_cfg or {}
    target = model.get("_target_")
    if target != HF_TARGET:
        raise UserError(
            f"--format hf: the run's model is {target}, not a Hugging Face model (model=hf); use --format"
            " safetensors or --format torch for a state dict"
        )
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from dtk.models.hf import SAFETENSORS, hf_config

    cfg = hf_config(config=model.get("config"), init_from=model.get("init_from"),
                    overrides=model.get("config_overrides"))
    cfg.use_cache = True  # what an inference user expects back
    dtypes = {t.dtype for t in tensors.values()}
    cfg.dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    # transformers annotates the lazy mapping's value as a pair; what it returns is the model class.
    model_class: Any = AutoModelForCausalLM._model_mapping[type(cfg)]
    cfg.architectures = [model_class.__name__]
    if getattr(cfg, "tie_word_embeddings", False):
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder; --format hf writes a folder")
    tmp = _tmp(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg.save_pretrained(str(tmp))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / SAFETENSORS), metadata={"format": "pt"})
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)


def size_of(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir() else out.stat().st_size
