"""Label statistics of a specstop dataset: the figures the data_gen closing notes quote.

Prints JSON with the split sizes, bytes per token (with and without hidden states), the greedy
acceptance rate (mean of ``greedy_match``), mean TV(p, q), mean min(1, p/q) of the draft samples,
and the oracle speculation length per split with rollouts (mean and std over rounds of the oracle
policy, which drafts exactly up to the first mismatch: DISCO's SL_oracle).

    python benchmarks/dataset_stats.py runs/data/mbpp_reference_60
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from specstop.script_args import ScriptParser, existing_dir
from specstop.script_main import run_main


def dataset_stats(data_dir: str) -> dict:
    from specstop.data_gen.storage import load_arrays, read_manifest
    from specstop.eval.episodes import load_replay_data
    from specstop.eval.replay import oracle_lengths

    man = read_manifest(data_dir)
    out: dict = {"splits": man["splits"], "bytes_per_token": man["bytes_per_token"]}
    cols = load_arrays(data_dir, "tokens", None, ["greedy_match", "tv", "accept_prob"])
    out["tokens"] = int(len(cols["tv"]))
    out["greedy_acceptance_rate"] = float(cols["greedy_match"].mean())
    out["mean_tv"] = float(cols["tv"].mean())
    out["mean_accept_prob"] = float(cols["accept_prob"].mean())
    for split in ("validation", "test"):
        if not man["splits"].get(split):
            continue
        lengths = oracle_lengths(load_replay_data(data_dir, split))
        out[f"oracle_sl_{split}"] = {
            "mean": float(np.mean(lengths)),
            "std": float(np.std(lengths)),
            "rounds": int(len(lengths)),
        }
    return out


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data_dir", type=existing_dir, help="a folder written by `specstop generate`")
    args = ap.parse_args(argv)
    print(json.dumps(dataset_stats(args.data_dir), indent=1))
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
