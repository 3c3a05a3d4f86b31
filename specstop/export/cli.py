"""``specstop export``: package a trained, tuned stopping policy for decoders and serving engines.

    specstop export --tuned tuned.json --out export/                       # the predictor package
    specstop export --tuned tuned.json --out engines/ --for llamacpp,vllm  # engine settings files
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specstop.cli_flags import split_checkpoint_arg
from specstop.config_cli import setting
from specstop.errors import UserError


def _engines(text: str) -> list[str]:
    from specstop.export.engines import ENGINES

    names = list(ENGINES) if text.strip() == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad:
        raise UserError(f"--for: unknown engine(s) {bad}; choose from {', '.join(ENGINES)} or all")
    return names


@dataclass
class ExportSettings:
    """What `specstop export` packages and where it writes."""

    tuned: str | None = setting(None, flags=("--tuned",), required=True)
    """Tuned-policy file written by `specstop tune` (tuned.json)."""
    checkpoint: str | None = setting(None, flags=("--checkpoint",), metavar="[NAME=]PATH")
    """The predictor's checkpoint; null = the tuned file's 'checkpoints' entry for the policy."""
    policy: str | None = setting(None, flags=("--policy",))
    """Which tuned policy to export; null = the tuned file's 'best' (with --for hf or all: its learned
    predictor of the lowest validation latency, else 'best'); tree_opt: the tuned token tree
    (tuned.json 'tree_policies')."""
    also_tuned: list[str] = setting(default_factory=list, flags=("--also-tuned",), repeatable=True, metavar="TUNED")
    """The same policy tuned on data at another decoding setting (repeatable: `specstop tune` on a dataset
    made at T = 0.7, 1.0, ...; a learned policy with the same --checkpoint). The export carries each
    setting's threshold, SL_max or K, and decoders use the one for the request's temperature, top-k and
    top-p (specstop.export.by_decoding)."""
    node_head: str | None = setting(None, flags=("--node-head",), metavar="CKPT")
    """Tree policies of the form tree:N only: export this tree_node_mlp checkpoint to steer the tree."""
    out: str | None = setting(None, flags=("--out",), required=True)
    """Folder to write (config.json, model.safetensors, README.md, custom_generate/; with --for also
    <engine>.json)."""
    dataset: str | None = setting(None, flags=("--data",), deprecated=("--dataset",), metavar="DIR")
    """Dataset folder whose manifest.json names the pair; null = from the checkpoint / tuned file."""
    engines: list[str] | None = setting(None, flags=("--for",), parse=_engines, metavar="ENGINES")
    """Also write the tuned settings for these engines: comma list of hf, vllm, llamacpp, sglang,
    trtllm, or all (hf also gets the custom_generate export of the learned predictor)."""
    draft_name: str | None = setting(None, flags=("--draft-name",))
    """Draft model (path, hub id or GGUF file) to write into engine commands."""
    target_name: str | None = setting(None, flags=("--target-name",))
    """Target model to write into engine commands."""
    overwrite: bool = setting(False, flags=("--overwrite",), negatable=False)
    """Replace an existing, non-empty --out folder (after the new export passed its check)."""
    draft_quant: str | None = setting(None, flags=("--draft-quant",), metavar="SCHEME")
    """vllm (CPU build): the draft's weights run quantized (int8 or int4, weight-only) in every option: the
    rules inside vLLM's batched draft runner, the heuristic in specstop's proposer; tune with the same draft's
    costs (`calibrate-cost --engine vllm --draft-quant`). The learned option is kept only where its export was
    trained on that draft's features (`specstop generate --draft-quant`)."""
    allow_missing_pair: bool = setting(False, flags=("--allow-missing-pair",), negatable=False)
    """Write an export without draft/target identities (decoders then cannot refuse a wrong draft)."""


def main(argv: list[str]) -> int:
    from specstop.config_cli import TypedCommand

    args, _ = TypedCommand(ExportSettings, prog="specstop export",
                           description="package a trained, tuned stopping policy for decoders and serving engines"
                           ).parse(argv)
    return run(args)


def _learned_policy(tuned_path: str, policy: str | None) -> str | None:
    """--policy, else the tuned learned predictor with the lowest validation latency, else None (tuned best).

    hf's rule options are in ``hf.json`` already; the package is what adds the learned predictor
    (``custom_generate``), so without --policy it packages that rather than 'best'. Said in one line
    when the two differ, so the choice is not a surprise.
    """
    if policy:
        return policy
    from specstop.export.export import read_tuned

    tuned = read_tuned(tuned_path)
    pols = tuned["policies"]
    learned = [n for n, e in pols.items() if e["spec"]["kind"] == "predictor"]
    if not learned:
        return None
    name = min(learned, key=lambda n: (pols[n].get("validation") or {}).get("latency_per_token", float("inf")))
    if tuned.get("best") and tuned["best"] != name:
        print(f"--for hf without --policy: packaging {name} (the learned predictor of the lowest validation latency; "
              f"{tuned['best']}, tuned best, is among hf.json's options); --policy {tuned['best']} packages it instead")
    return name


#: Options that shape only the predictor package: with --for engines that exclude hf, no package is written.
PACKAGE_OPTIONS = {"policy": "--policy", "checkpoint": "--checkpoint", "also_tuned": "--also-tuned",
                   "node_head": "--node-head", "dataset": "--data", "allow_missing_pair": "--allow-missing-pair"}


def check_package_options(args: ExportSettings, engines: list[str]) -> None:
    """Refuse package options given when only engine files are written: they would be ignored silently.

    Raises:
        UserError: naming the options, the engines and the two fixes.
    """
    if not engines or "hf" in engines:
        return
    named = [flag for field, flag in PACKAGE_OPTIONS.items() if getattr(args, field)]
    if named:
        raise UserError(f"{', '.join(named)} shape{'s' if len(named) == 1 else ''} the predictor package, which "
                        f"--for {','.join(engines)} does not write (engine files carry every tuned option): add hf "
                        f"to --for to write the package too, or drop {', '.join(named)}")


def _write_engines(args: ExportSettings, engines: list[str], hf_policy: str | None) -> None:
    from specstop.export.engines import summary_line, write_engine_settings

    paths = write_engine_settings(args.out, args.tuned, engines, draft=args.draft_name, target=args.target_name,
                                  hf_policy=hf_policy, draft_quant=args.draft_quant)
    for path in paths.values():
        print(summary_line(json.loads(path.read_text())))
        print(f"  wrote {path}")


def run(args: ExportSettings) -> int:
    from pathlib import Path

    from specstop.export.export import check_export_target
    from specstop.outputs import check_writable, claim_output_dir

    engines = args.engines or []
    check_package_options(args, engines)  # before anything is written
    if engines and "hf" not in engines:
        check_writable(args.out, "--out")
    else:
        check_export_target(Path(args.out), args.overwrite)  # before any loading: refuse a foreign or unwritable --out now
    # One writer at a time: a second export into the same folder stops in one line.
    with claim_output_dir(args.out, command=f"specstop export --out {args.out}"):
        return _run(args, engines)


def _run(args: ExportSettings, engines: list[str]) -> int:
    from specstop.export.export import export_from_files
    from specstop.pair.quantize import check_scheme

    args.draft_quant = check_scheme(args.draft_quant)
    if args.draft_quant and "vllm" not in engines:
        raise UserError("--draft-quant applies to --for vllm (specstop's proposer quantizes its draft there)")
    checkpoint = split_checkpoint_arg(args.checkpoint)[1] if args.checkpoint else None
    if engines and "hf" not in engines:
        _write_engines(args, engines, None)  # settings files only: no predictor package
        return 0
    policy = _learned_policy(args.tuned, args.policy) if "hf" in engines else args.policy
    # The package first: it is written elsewhere and moved into --out (replacing an earlier export),
    # so the engine files are added to the finished folder afterwards.
    config = export_from_files(
        args.out,
        tuned=args.tuned,
        checkpoint=checkpoint,
        policy=policy,
        dataset=args.dataset,
        allow_missing_pair=args.allow_missing_pair,
        overwrite=args.overwrite,
        node_head=args.node_head,
        also_tuned=args.also_tuned,
    )
    check = config.get("export_check")
    if check:
        print(f"export check: max abs diff {check['max_abs_diff']:.3g} on {check['batch']} inputs (limit 1e-6)")
    print(f"exported {config['name']} ({json.dumps(config['policy']['kind'])}) to {args.out}")
    if config.get("by_decoding"):
        from specstop.export.by_decoding import describe
        from specstop.policy import PolicySpec

        for entry in config["by_decoding"]:
            spec = PolicySpec.from_dict(entry["policy"])
            cap = "" if spec.kind in ("static", "predictor") else f" (SL_max {spec.sl_max})"
            print(f"  at {describe(entry['decoding'])}: {spec.label}{cap}")
    if config.get("tree"):
        print(f"  token tree {config['tree']['policy']}{' + node head' if config['tree'].get('node_head') else ''}: "
              f"specstop decode --policy {args.out} runs the tree decoder")
    if config.get("levels"):
        lv = config["levels"]
        print(f"  multi-level stack {' / '.join(lv['policies'])}: specstop decode --policy {args.out} runs it with the "
              f"pair and {', '.join(lv['models'])} between its draft and target")
    print(f"  HF: target.generate(..., assistant_model=draft, custom_generate={args.out!r}, trust_remote_code=True)")
    if engines:
        _write_engines(args, engines, policy)
    return 0
