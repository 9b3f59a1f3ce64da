"""Command line for the stages that need no base model: decomposition and file-to-file export.

    python -m prompt_transfer.cli decompose runs/src_sst2/adapter runs/src_bbc/adapter --names SST-2 bbc \\
        --out runs/pct/decomposition --explained-variance 0.95
    python -m prompt_transfer.cli export runs/pct_target/adapter runs/pct_target/prompt_tuning

Training (source prompts, the PCT target) goes through ``peftplug fit`` with the recipes in
``recipes/prompt_transfer/`` or through :func:`prompt_transfer.train_prompt` in Python.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).
    """
    import prompt_transfer as pt

    parser = argparse.ArgumentParser(prog="python -m prompt_transfer.cli", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decompose", help="SVD + contrastive decomposition of saved source prompt adapters")
    d.add_argument("adapters", nargs="+", help="PEFT prompt-tuning adapter directories, one per source task")
    d.add_argument("--names", nargs="+", help="source task names (default: the directory names)")
    d.add_argument("--out", required=True)
    group = d.add_mutually_exclusive_group()
    group.add_argument("--rank", type=int)
    group.add_argument("--explained-variance", type=float)
    d.add_argument("--contrastive-weight", type=float, default=0.1)
    d.add_argument("--contrastive-steps", type=int, default=200)
    e = sub.add_parser("export", help="collapse a saved PCT adapter into a plain PEFT prompt-tuning adapter")
    e.add_argument("pct_adapter")
    e.add_argument("out")
    args = parser.parse_args(argv)

    if args.command == "decompose":
        import os

        names = args.names or [os.path.basename(os.path.normpath(p)) for p in args.adapters]
        if len(names) != len(args.adapters):
            parser.error(f"--names has {len(names)} names for {len(args.adapters)} adapters")
        prompts = {n: pt.load_source_prompt(p) for n, p in zip(names, args.adapters)}
        dec = pt.decompose(prompts, rank=args.rank, explained_variance=args.explained_variance,
                           contrastive_weight=args.contrastive_weight, contrastive_steps=args.contrastive_steps)
        pt.save_decomposition(dec, args.out)
        print(json.dumps({"out": args.out, "rank": dec.rank, "sources": names,
                          "explained_variance_kept": dec.settings["explained_variance_kept"]}))
    else:
        print(pt.export_adapter_dir(args.pct_adapter, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
