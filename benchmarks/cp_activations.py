"""Activation memory per rank under context parallelism (scheme.cp), measured against the
planner's figure.

For cp in 1, 2, 4: `cp` gloo processes build the built-in transformer (fp32, CPU), each
takes its head-tail slice of the same batch and runs one training forward of the LM task
under torch's saved-tensor hooks; the figure is the bytes of every distinct tensor storage
autograd keeps for backward, parameters left out (the logits and loss included). The
planner's figure is `python -m dtk.plan`'s activations of the same job
(dtk.plan.cost.memory.rank_bytes, device cpu). Rank 0 is shown (every rank holds as many tokens).

    python benchmarks/cp_activations.py [--seq-len 4096] [--dim 256] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def saved_bytes(rank: int, cp: int, args: argparse.Namespace, folder: str) -> None:
    torch.set_num_threads(1)
    if cp > 1:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=cp)
    from dtk.models.transformer import build
    from dtk.parallel.cp import CpLayout, apply_cp
    from dtk.train.loss import TokenCrossEntropy
    from dtk.train.task import LmTask

    torch.manual_seed(0)
    model = build(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                  seq_len=args.seq_len)
    layout = CpLayout(rank=rank, size=cp, group=dist.group.WORLD) if cp > 1 else None
    if layout is not None:
        apply_cp(model, layout=layout)
    task = LmTask(TokenCrossEntropy(), cp=layout)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.device.type == "cpu":
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = task(model, tokens, torch.autocast("cpu", enabled=False))
    measured = sum(seen.values())
    loss.backward()
    if rank == 0:
        with open(f"{folder}/cp{cp}.json", "w") as f:
            json.dump({"measured": measured}, f)
    if cp > 1:
        dist.destroy_process_group()


def planned(cp: int, args: argparse.Namespace) -> int:
    import dataclasses

    from dtk.config.schema import SchemeConfig
    from dtk.plan.cost.memory import Job, precision_for, rank_bytes, scheme_config
    from dtk.plan.degrees import Degrees
    from dtk.plan.shape import whatif_shape

    shape = whatif_shape({"layers": args.layers, "hidden": args.dim, "heads": args.heads, "seq_len": args.seq_len,
                          "vocab_size": args.vocab})
    s = scheme_config(dict(dataclasses.asdict(SchemeConfig()), data_parallel="fsdp"))
    job = Job(s, Degrees(1, 1, 1, 1, cp=cp), micro_batch=args.batch, num_micro=1, device="cpu",
              precision=precision_for(s, "cpu"))
    return rank_bytes(shape, job, 0).activations


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    print("| cp | tokens per rank | measured saved for backward (MiB) | vs cp=1 | planned activations (MiB) | vs cp=1 |")
    print("| --- | --- | --- | --- | --- | --- |")
    base: dict[str, float] = {}
    for cp in (1, 2, 4):
        with tempfile.TemporaryDirectory() as folder:
            mp.start_processes(saved_bytes, args=(cp, args, folder), nprocs=cp, start_method="spawn")
            with open(os.path.join(folder, f"cp{cp}.json")) as f:
                measured = json.load(f)["measured"]
        plan = planned(cp, args)
        base.setdefault("m", measured)
        base.setdefault("p", plan)
        print(f"| {cp} | {args.seq_len // cp} | {measured / 2**20:.1f} | {measured / base['m']:.3f} |"
              f" {plan / 2**20:.1f} | {plan / base['p']:.3f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
