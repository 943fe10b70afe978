"""`ds4station pull`: download a DS4-V4-Flash GGUF from the Hugging Face hub, resumably (ds4station/hub.py).

    ds4station pull [q2|q2-q4|q4|mtp|OWNER/REPO/FILE] [--dir DIR] [--token TOKEN] [--revision REV]
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ds4station.hub import KNOWN

    known = "; ".join(f"{k}: {v[1]}" for k, v in KNOWN.items())
    p.add_argument("what", nargs="?", default="q2", help=f"a published file ({known}) or OWNER/REPO/FILE "
                   "(default q2)")
    p.add_argument("--dir", default=None, help="where the file goes (default ~/.cache/ds4station/models)")
    p.add_argument("--token", default=None, help="a Hugging Face token (default: HF_TOKEN or `hf auth login`'s)")
    p.add_argument("--revision", default="main", help="branch, tag or commit of the repository (default main)")


def run(args: argparse.Namespace) -> int:
    from ds4station.hub import ProgressLine, PullError, pull, resolve

    try:
        name = resolve(args.what, args.revision).filename
        path = pull(args.what, args.dir, token=args.token, revision=args.revision, progress=ProgressLine(name))
    except PullError as e:
        print(f"\nds4station pull: {e}", file=sys.stderr)
        return 1
    print(f"{path}: checked; serve it with `ds4station serve --model {path}` or plan for it with "
          f"`ds4station plan --model {path}`")
    return 0
