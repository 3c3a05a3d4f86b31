"""`specstop generate`: label every draft position of a prompt set into a sharded dataset.

Examples::

    specstop generate --config configs/data/mbpp_greedy.yaml
    specstop generate --pair qwen2.5-coder-0.5b-1.5b --prompts my.jsonl --prompt-field question \\
        --max-new-tokens 128 --data data/mine
    torchrun --nproc-per-node 8 -m specstop.cli generate --config ...   # one worker per GPU (cuda:$LOCAL_RANK)
    specstop generate --config ... --merge       # only needed when workers ran on separate filesystems

Workers share nothing but the output folder: the last worker to finish writes the manifest and
the dataset card (``--merge`` does the same by hand).

Flags override the YAML config; a run resumes from finished shards when repeated.
"""

from __future__ import annotations

import argparse
import logging

from specstop.config_cli import TypedCommand
from specstop.data_gen.config import DataGenConfig, load_config
from specstop.errors import UserError

log = logging.getLogger(__name__)

DESCRIPTION = "label every draft position of a prompt set into a dataset"


def command() -> TypedCommand:
    """The parser: every :class:`DataGenConfig` setting, plus the flags that choose what to do."""
    cmd = TypedCommand(DataGenConfig, prog="specstop generate", description=DESCRIPTION,
                       load_file=load_config, config_help="YAML config (configs/data/*.yaml); flags override it")
    cmd.add_argument("--prompt-field", metavar="NAME",
                     help="record field holding the prompt (same as --template field:NAME)")
    cmd.add_argument("--merge", action="store_true", help="only write manifest.json from the finished shards")
    cmd.add_argument("--verify", action="store_true",
                     help="only check the finished dataset in --data: every shard present, intact (sha256) and from one pair")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")
    return cmd


def build_config(argv: list[str]) -> tuple[DataGenConfig, argparse.Namespace]:
    """The YAML config (if any) with flags applied on top, checked; and the command's own flags."""
    cfg, flags = command().parse(argv)
    if flags.prompt_field:
        if any(a.split("=")[0] in ("--template", "--prompts.template") for a in argv):
            raise UserError("give --prompt-field or --template, not both")
        cfg.prompts.template = f"field:{flags.prompt_field}"
    cfg.validate()
    return cfg, flags


def load_records(cfg: DataGenConfig) -> list:
    from specstop.prompts import load_prompt_set

    pc = cfg.prompts
    if not pc.source:
        raise UserError("no prompts given: pass --prompts FILE.jsonl (or set prompts.source in the config)")
    return load_prompt_set(pc)


def verify(out: str) -> int:
    """``--verify``: print what is wrong with a finished dataset (exit 2), or that it is intact."""
    from specstop.data_gen.verify import dataset_problems

    problems, n = dataset_problems(out)
    if problems:
        for p in problems:
            print(f"{out}: {p}")
        raise UserError(
            f"{out}: {len(problems)} problem(s) in {n} shard(s) (listed above); rerun the `specstop generate` command "
            "that made the dataset (same config and --data) to regenerate the damaged shards"
        )
    print(f"{out}: {n} shard(s) intact (every table present, sizes and sha256 match, one pair)")
    return 0


def main(argv: list[str]) -> int:
    from specstop.data_gen.runner import generate_dataset, plan_shards, worker_from_env, write_manifest
    from specstop.outputs import claim_output_dir

    cfg, args = build_config(argv)
    if args.verify:
        if not cfg.out:
            raise UserError("--verify needs the dataset folder: pass --data DIR")
        return verify(cfg.out)
    if not cfg.out:
        raise UserError("no output folder: pass --data DIR (or set out: in the config)")
    records = load_records(cfg)
    if not records:
        raise UserError(f"the prompt set {cfg.prompts.source!r} is empty (check --limit and the split scheme)")
    # Before the pair is loaded: a folder with the user's files, or one that cannot be written, is
    # refused in a second, not after minutes of loading.
    from specstop.data_gen.ownership import check_no_foreign_files

    check_no_foreign_files(cfg.out)
    if args.merge:
        with claim_output_dir(cfg.out, command=f"specstop generate --merge --data {cfg.out}"):
            path = write_manifest(cfg.out, cfg, plan_shards(records, cfg.prompts_per_shard))
        print(path)
        return 0
    num_shards, shard_index = worker_from_env(cfg.num_shards, cfg.shard_index)
    from specstop.distributed import rank_local_device
    from specstop.pair import load_named_pair

    role = "all" if num_shards == 1 else f"worker-{shard_index}-of-{num_shards}"
    # Claim the folder before loading the pair: a second run on it is refused in a second, not minutes.
    with claim_output_dir(cfg.out, role=role, command=f"specstop generate --data {cfg.out}"):
        pair = load_named_pair(
            cfg.pair, draft=cfg.draft, target=cfg.target, dtype=cfg.dtype, device=rank_local_device(cfg.device),
            target_device_map=cfg.target_device_map, dtype_workload="generate", draft_quant=cfg.draft_quant,
            draft_prefill_copy=False,  # labels score response rows in one block: the packed kernels' numerics
        )
        from specstop.memory import PeakRSS

        with PeakRSS() as mem:
            result = generate_dataset(
                pair, records, cfg, cfg.out, num_shards=num_shards, shard_index=shard_index,
                progress=not args.no_progress,
            )
    log.info("generated %d shard(s), kept %d finished one(s); peak memory %.1f GB (models included)",
             len(result["done"]), len(result["skipped"]), mem.peak / 1e9)
    if result["manifest"]:
        print(result["manifest"])
    return 0
