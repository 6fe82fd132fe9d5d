"""python -m dtk.data {prepare,info,verify}: make and inspect dataset folders. No torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dtk.common.errors import ArgumentParser, run_cli

EPILOG = """examples:
  python -m dtk.data prepare --input corpus.txt --out data/corpus      byte-level tokens
  python -m dtk.data prepare --input tokens.npy --out data/tok --seq-len 128
  python -m dtk.data prepare --input corpus.txt --out data/chars --tokenizer chars --val-fraction 0.1
  python -m dtk.data prepare --input texts/ --out data/bpe --tokenizer tok/   a local tokenizer.json folder
  python -m dtk.submit data=hdf5 data.path=data/corpus                 train on it
"""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m dtk.data",
        description="Build and inspect token datasets: HDF5 shards plus a manifest whose version is a content hash.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="build a dataset folder from .npy token arrays or plain text; prints the version")
    prep.add_argument("--input", required=True, type=Path, help="a .npy file, a text file, or a folder of either kind")
    prep.add_argument("--out", required=True, type=Path, help="the dataset folder to create")
    prep.add_argument("--seq-len", type=int, default=None,
                      help="tokens per sample (each stores one more, the last target); default 64, or a 2-D .npy's row length - 1")
    prep.add_argument("--samples-per-shard", type=int, default=16384, help="samples per HDF5 shard (default 16384)")
    prep.add_argument("--tokenizer", metavar="bytes|chars|DIR", default=None,
                      help="how text becomes token ids: bytes (UTF-8 bytes, vocab 256; the default), chars (one id per"
                           " distinct character), or DIR, a local Hugging Face tokenizer folder (tokenizer.json)")
    prep.add_argument("--val-fraction", metavar="F", type=float, default=None,
                      help="write the last F (0 < F < 1) of the samples as validation shards, the split a job uses")
    prep.add_argument("--force", action="store_true", help="replace --out if it is a dataset folder made by this command (never a folder of other files)")
    info = sub.add_parser("info", help="print a dataset's manifest summary")
    info.add_argument("path", type=Path)
    verify = sub.add_parser("verify", help="check every shard's size and checksum against the manifest")
    verify.add_argument("path", type=Path)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "prepare":
        from dtk.data.prepare import prepare

        m = prepare(args.input, args.out, seq_len=args.seq_len, samples_per_shard=args.samples_per_shard,
                    force=args.force, tokenizer=args.tokenizer, val_fraction=args.val_fraction)
        val = f", {m['val_samples']} of them the validation split ({', '.join(m['val_shards'])})" if m.get("val_shards") else ""
        print(
            f"{args.out}: {m['num_samples']} samples of {m['seq_len']}+1 tokens in {len(m['shards'])} shard(s){val},"
            f" vocab {m['vocab_size']}, tokenizer {m['tokenizer']}; train with data=hdf5 data.path={args.out}"
            f" model.vocab_size={m['vocab_size']} model.seq_len={m['seq_len']}",
            file=sys.stderr,
        )
        print(m["version"])
        return 0
    from dtk.data.hdf5 import check_shards, read_manifest

    manifest = read_manifest(args.path, key="path")
    if args.command == "info":
        summary = {k: v for k, v in manifest.items() if k != "shards"}
        summary["shards"] = len(manifest["shards"])
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    check_shards(args.path, manifest, checksums=True, key="path")
    print(f"{args.path}: version {manifest['version']}, {len(manifest['shards'])} shard(s) verified")
    return 0


if __name__ == "__main__":
    run_cli(main)
