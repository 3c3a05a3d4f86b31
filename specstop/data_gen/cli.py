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

from specstop.cli_flags import add_deprecated_alias
from specstop.data_gen.config import DataGenConfig, load_config, set_path
from specstop.errors import UserError

log = logging.getLogger(__name__)

# flag dest -> dotted config path
_FLAG_PATHS = {
    "pair": "pair",
    "draft": "draft",
    "target": "target",
    "dtype": "dtype",
    "device": "device",
    "target_device_map": "target_device_map",
    "out": "out",
    "prompts_per_shard": "prompts_per_shard",
    "num_shards": "num_shards",
    "shard_index": "shard_index",
    "prompts": "prompts.source",
    "template": "prompts.template",
    "chat_template": "prompts.chat_template",
    "system_prompt": "prompts.system_prompt",
    "split_scheme": "prompts.split_scheme",
    "limit": "prompts.limit",
    "max_new_tokens": "generation.max_new_tokens",
    "temperature": "generation.temperature",
    "top_k": "generation.top_k",
    "top_p": "generation.top_p",
    "batch_size": "generation.batch_size",
    "seed": "generation.seed",
    "max_prompt_tokens": "generation.max_prompt_tokens",
    "prompt_overflow": "generation.prompt_overflow",
    "topk": "labels.topk_k",
    "hidden_states": "labels.hidden_states",
    "rollout_length": "labels.rollouts.length",
    "rollout_batch_size": "labels.rollouts.batch_size",
    "mixing_draws": "labels.mixing.draws",
    "mixing_rate": "labels.mixing.rate",
}


def _splits(value: str) -> list[str]:
    return [] if value.strip().lower() in ("", "none") else [s.strip() for s in value.split(",") if s.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--config", help="YAML config (configs/data/*.yaml); flags below override it")
    g = parser.add_argument_group("models")
    g.add_argument("--pair", help="known pair name or a folder with draft/ and target/")
    g.add_argument("--draft", help="draft model folder or hub id (with --target)")
    g.add_argument("--target", help="target model folder or hub id (with --draft)")
    g.add_argument("--dtype", help="float32 | bfloat16 | float16 | auto (the pair's fastest for batched generation on this machine, timed once and cached)")
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    g.add_argument("--target-device-map", help="e.g. auto: spread a target larger than one GPU")
    g = parser.add_argument_group("prompts")
    g.add_argument("--prompts", help="prompt source: a JSON/JSONL file, hub id or a named source (humaneval)")
    g.add_argument("--prompt-field", help="record field holding the prompt (same as --template field:NAME)")
    g.add_argument("--template", help="prompt template name (mbpp, humaneval, alpaca, ...) or field:NAME")
    g.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="render prompts with the tokenizer's chat template (default on)")
    g.add_argument("--system-prompt")
    g.add_argument("--split-scheme", help="random | mbpp | all:SPLIT ... (see specstop.prompts)")
    g.add_argument("--limit", type=int, help="use only the first N prompts (quick runs)")
    g = parser.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--temperature", type=float, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, help="sampling: keep the k most likely tokens (0 disables)")
    g.add_argument("--top-p", type=float, help="1.0 disables")
    g.add_argument("--batch-size", type=int, help="prompts per batch")
    g.add_argument("--seed", type=int, help="seed of sampling, draft samples, verified outcomes and mixing")
    g.add_argument("--max-prompt-tokens", type=int, help="default: context window minus max-new-tokens")
    g.add_argument("--prompt-overflow", choices=["truncate", "skip"], help="longer prompts: cut from the left or skip")
    g = parser.add_argument_group("labels")
    g.add_argument("--feature-topk", dest="topk", type=int,
                   help="features: how many top draft probabilities each row stores (config default 10)")
    add_deprecated_alias(g, "--topk", "--feature-topk", "topk", type=int)
    g.add_argument("--hidden-states", action=argparse.BooleanOptionalAction, default=None,
                   help="store the draft's final hidden states (float16)")
    g.add_argument("--rollouts-on", type=_splits, help="comma-separated splits with rollouts ('none' for none)")
    g.add_argument("--rollout-length", type=int, help="rollout steps L (default 20)")
    g.add_argument("--rollout-batch-size", type=int, help="mismatch prefixes rolled out together")
    g.add_argument("--mixing-on", type=_splits, help="comma-separated splits with token mixing ('none' for none)")
    g.add_argument("--mixing-draws", type=int, help="mixed sequences per response (default 1)")
    g.add_argument("--mixing-rate", type=float, help="probability of keeping the target token (default 0.15)")
    g = parser.add_argument_group("output and workers")
    g.add_argument("--data", dest="out", metavar="DIR", help="dataset folder to write (the --data of train/tune/eval)")
    add_deprecated_alias(g, "--out", "--data", "out")
    g.add_argument("--prompts-per-shard", type=int)
    g.add_argument("--num-shards", type=int, help="number of workers (default: $WORLD_SIZE or 1)")
    g.add_argument("--shard-index", type=int, help="this worker (default: $RANK or 0)")
    g.add_argument("--merge", action="store_true", help="only write manifest.json from the finished shards")
    g.add_argument("--verify", action="store_true",
                   help="only check the finished dataset in --data: every shard present, intact (sha256) and from one pair")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_config(args: argparse.Namespace) -> DataGenConfig:
    """YAML config (if any) with flags applied on top."""
    cfg = load_config(args.config) if getattr(args, "config", None) else DataGenConfig()
    for dest, path in _FLAG_PATHS.items():
        v = getattr(args, dest, None)
        if v is not None:
            set_path(cfg, path, v)
    if getattr(args, "prompt_field", None):
        if getattr(args, "template", None):
            raise UserError("give --prompt-field or --template, not both")
        cfg.prompts.template = f"field:{args.prompt_field}"
    if getattr(args, "rollouts_on", None) is not None:
        cfg.labels.rollouts.splits = args.rollouts_on
    if getattr(args, "mixing_on", None) is not None:
        cfg.labels.mixing.splits = args.mixing_on
    cfg.validate()
    return cfg


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


def run(args: argparse.Namespace) -> int:
    from specstop.data_gen.runner import generate_dataset, plan_shards, worker_from_env, write_manifest
    from specstop.outputs import claim_output_dir

    if getattr(args, "verify", False):
        out = args.out or (load_config(args.config).out if args.config else None)
        if not out:
            raise UserError("--verify needs the dataset folder: pass --data DIR")
        return verify(out)
    cfg = build_config(args)
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
            target_device_map=cfg.target_device_map, dtype_workload="generate",
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
