"""``specstop export``: package a trained, tuned stopping policy for decoders."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tuned", required=True, help="tuned-policy file written by `specstop tune` (tuned.json)")
    parser.add_argument(
        "--checkpoint",
        help="the predictor's Lightning checkpoint (default: the tuned file's 'checkpoints' entry for the policy)",
    )
    parser.add_argument("--policy", help="which tuned policy to export (default: the tuned file's 'best')")
    parser.add_argument("--out", required=True, help="export folder to write (config.json, model.safetensors, README.md)")
    parser.add_argument(
        "--dataset", help="dataset folder whose manifest.json names the pair (default: from the checkpoint / tuned file)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing, non-empty --out folder (after the new export passed its check)"
    )
    parser.add_argument(
        "--allow-missing-pair",
        action="store_true",
        help="write an export without draft/target identities (decoders then cannot refuse a wrong draft)",
    )


def run(args: argparse.Namespace) -> int:
    from specstop.export.export import export_from_files

    config = export_from_files(
        args.out,
        tuned=args.tuned,
        checkpoint=args.checkpoint,
        policy=args.policy,
        dataset=args.dataset,
        allow_missing_pair=args.allow_missing_pair,
        overwrite=args.overwrite,
    )
    check = config.get("export_check")
    if check:
        print(f"export check: max abs diff {check['max_abs_diff']:.3g} on {check['batch']} inputs (limit 1e-6)")
    print(f"exported {config['name']} ({json.dumps(config['policy']['kind'])}) to {args.out}")
    return 0
