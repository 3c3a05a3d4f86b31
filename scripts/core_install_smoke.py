"""Smoke check of the core install (driven by scripts/check_core_install.sh).

Two halves, run by two interpreters:

    python scripts/core_install_smoke.py make-export WORK
        (the project venv, every extra) saves a tiny random draft/target pair to WORK/pair and
        exports a random-init learned stopping policy for it to WORK/export with `specstop export`.

    python scripts/core_install_smoke.py check --export DIR --pair DIR
        (a venv with `pip install specstop` and no extra) decodes with that export three ways -
        `specstop decode`, the public Python API and transformers' `generate(custom_generate=...)` -
        and checks each output is token for token the target's own greedy output.

`check` prints one line per check and exits 1 if any failed. It uses only the public API
(`from specstop import ...`), the `specstop` command and transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

# Tiny models, several prompts: one thread is faster than many, and CI machines are shared.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Everything is local: never wait on the hub (CI reaches package registries only).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ("hello world", "def f(x):")
MAX_NEW_TOKENS = 24


def specstop_command() -> str:
    """The `specstop` console script of the interpreter running this file (its venv's bin/)."""
    return str(Path(sys.executable).parent / "specstop")


# ------------------------------------------------------------------------------------- make-export
def make_export(work: Path) -> None:
    """Tiny pair + random-init disco_ffn predictor + tuned file -> `specstop export`.

    Mirrors what `specstop generate/train/tune` would leave behind, minus the training: a dataset
    manifest naming the pair (the export records the draft it is for), a checkpoint in the
    Lightning layout, and a tuned.json whose threshold makes the policy both stop and continue.
    """
    import torch

    from specstop import load_pair
    from specstop.models import build_predictor
    from specstop.policy import PolicySpec
    from specstop.testing import save_tiny_pair

    work.mkdir(parents=True, exist_ok=True)
    pair_dir = save_tiny_pair(work / "pair")
    # Loaded from the saved folders, so the export records the same file fingerprints that the
    # core venv computes when it loads them.
    pair = load_pair(str(pair_dir / "draft"), str(pair_dir / "target"), dtype="float32", device="cpu")

    data = work / "data"
    data.mkdir()
    manifest = {
        "schema_version": 1,
        "pair": pair.to_dict(),
        "generation": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 64},
    }
    (data / "manifest.json").write_text(json.dumps(manifest))

    torch.manual_seed(1)
    predictor = build_predictor("disco_ffn")
    ckpt = work / "disco.ckpt"
    torch.save(
        {
            "hyper_parameters": {"family": "disco_ffn", "predictor_config": predictor.config_dict(), "label": "accept_expected"},
            "state_dict": {"predictor." + k: v for k, v in predictor.state_dict().items()},
        },
        ckpt,
    )

    # Threshold between the two middle scores on real draft distributions: a random predictor
    # with a median threshold stops in some rounds and drafts on in others, and no score sits
    # exactly on it (a tie would make the decision depend on float noise).
    with torch.no_grad():
        ids = pair.tokenizer("Threshold calibration text, long enough.")["input_ids"]
        logits = pair.draft(torch.tensor([ids])).logits[0, :, : pair.vocab_size].float()
        x = predictor.feature_spec.build_from_probs(torch.softmax(logits, -1), torch.arange(len(ids)))
        scores = torch.sigmoid(predictor(x)).flatten().sort().values
        mid = len(scores) // 2
        threshold = float((scores[mid - 1] + scores[mid]) / 2)
    spec = PolicySpec(kind="predictor", family="disco_ffn", threshold=threshold, sl_max=6, reads="dist")
    tuned = {
        "schema_version": 1,
        "policies": {"disco": {"spec": spec.to_dict(), "validation": {"latency_per_token": 0.01, "speedup": 1.5}}},
        "best": "disco",
        "cost_model": {"t_draft": 0.01, "t_target": 0.03, "verify_per_token": 0.0, "predictor_per_step": 0.0, "kind": "specdecpp"},
        "dataset": str(data),
        "checkpoints": {"disco": str(ckpt)},
    }
    (work / "tuned.json").write_text(json.dumps(tuned))

    subprocess.run([specstop_command(), "export", "--tuned", str(work / "tuned.json"), "--out", str(work / "export")],
                   check=True)
    print(f"[make-export] pair {pair_dir}, export {work / 'export'} (disco_ffn, threshold {threshold:.4f})")


# ------------------------------------------------------------------------------------------- check
class Checks:
    """Runs named checks, prints one line each, remembers failures."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def run(self, name: str, fn) -> None:
        try:
            detail = fn()
        except Exception as err:  # noqa: BLE001 - every failure becomes one FAIL line (traceback below it)
            self.failed.append(name)
            print(f"FAIL {name}: {type(err).__name__}: {err}")
            traceback.print_exc(file=sys.stdout)
        else:
            print(f"ok   {name}" + (f": {detail}" if detail else ""))


def greedy_reference(target, prompt_ids: list[int], vocab_size: int | None = None) -> list[int]:
    """The target's own greedy continuation (prompt excluded).

    ``vocab_size``: suppress the padded logit rows past the tokenizer (Qwen-style models have
    them). Our decoders compare draft and target on the shared tokenizer vocabulary by design,
    so their reference is greedy over real tokens; HF assisted generation verifies with the
    target's full logits, so its reference is plain ``generate``.
    """
    import torch

    kwargs = {}
    if vocab_size is not None and vocab_size < target.config.vocab_size:
        kwargs["suppress_tokens"] = list(range(vocab_size, target.config.vocab_size))
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def check(export: Path, pair_dir: Path) -> int:
    import torch

    torch.set_num_threads(1)
    checks = Checks()

    def installed_copy():
        import specstop

        where = Path(specstop.__file__).resolve()
        if "site-packages" not in where.parts:
            raise AssertionError(f"specstop imported from {where}, not from an installed copy")
        return f"specstop {specstop.__version__} from {where.parent}"

    def cli_decode():
        """(a) `specstop decode --policy EXPORT` against the target's greedy output."""
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
        lines = []
        for text in PROMPTS:
            cmd = [specstop_command(), "decode", "--pair", str(pair_dir), "--policy", str(export), "--prompt", text,
                   "--max-new-tokens", str(MAX_NEW_TOKENS), "--device", "cpu", "--dtype", "float32", "--json"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise AssertionError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr[-3000:]}")
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            ref = greedy_reference(target, out["prompt_ids"], vocab_size=len(_tokenizer(pair_dir)))
            if out["token_ids"] != ref:
                raise AssertionError(f"prompt {text!r}: decode gave {out['token_ids']}, target greedy {ref}")
            if not out["counters"]["N_draft"]:
                raise AssertionError(f"prompt {text!r}: nothing was drafted ({out['counters']})")
            lines.append(f"{text!r} {len(ref)} tokens, rounds K={out['round_lengths']}")
        return "identical to target greedy; " + "; ".join(lines)

    def public_api():
        """(b) `from specstop import StoppingPolicy, SpeculativeDecoder, load_pair`."""
        from specstop import SpeculativeDecoder, StoppingPolicy, load_pair

        pair = load_pair(str(pair_dir / "draft"), str(pair_dir / "target"), dtype="float32", device="cpu")
        policy = StoppingPolicy.load(str(export), draft_identity=pair.draft_identity, tokenizer_hash=pair.tokenizer_hash)
        prompts = [_chat_ids(pair.tokenizer, text) for text in PROMPTS]
        lines = []
        for text, ids in zip(PROMPTS, prompts):
            res = SpeculativeDecoder(pair, policy).generate(ids, MAX_NEW_TOKENS)
            ref = greedy_reference(pair.target, ids, vocab_size=pair.vocab_size)
            if res.token_ids != ref:
                raise AssertionError(f"prompt {text!r}: SpeculativeDecoder gave {res.token_ids}, target greedy {ref}")
            if not res.counters["N_draft"]:
                raise AssertionError(f"prompt {text!r}: nothing was drafted ({res.counters})")
            lines.append(f"{text!r} {len(ref)} tokens, rounds K={res.round_lengths}")
        return f"policy {res.counters.get('policy')}; identical to target greedy; " + "; ".join(lines)

    def hf_custom_generate():
        """(c) `target.generate(custom_generate=EXPORT, assistant_model=draft, trust_remote_code=True)`."""
        from transformers import AutoModelForCausalLM

        import specstop

        draft = AutoModelForCausalLM.from_pretrained(pair_dir / "draft", dtype=torch.float32).eval()
        target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=torch.float32).eval()
        tok = _tokenizer(pair_dir)
        # The export's custom_generate/generate.py calls specstop.generate_with_policy(policy=...):
        # record the folder it was given (the moved one), and count draft forwards (plain greedy
        # would make none), so a silent fallback to target-only decoding cannot pass.
        original = specstop.generate_with_policy
        seen: list[str] = []

        def spy(model, *args, policy, **kwargs):
            seen.append(str(policy))
            return original(model, *args, policy=policy, **kwargs)

        draft_calls = [0]
        hook = draft.register_forward_hook(lambda *_: draft_calls.__setitem__(0, draft_calls[0] + 1))
        specstop.generate_with_policy = spy
        try:
            lines = []
            for text in PROMPTS:
                ids = _chat_ids(tok, text)
                ref = greedy_reference(target, ids)
                with torch.no_grad():
                    out = target.generate(
                        torch.tensor([ids]), assistant_model=draft, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                        custom_generate=str(export), trust_remote_code=True,
                    )
                got = out[0, len(ids):].tolist()
                if got != ref:
                    raise AssertionError(f"prompt {text!r}: custom_generate gave {got}, target greedy {ref}")
                lines.append(f"{text!r} {len(ref)} tokens")
        finally:
            specstop.generate_with_policy = original
            hook.remove()
        if seen != [str(export)] * len(PROMPTS):
            raise AssertionError(f"generate.py passed policy={seen}, expected the moved export {export}")
        if not draft_calls[0]:
            raise AssertionError("the draft never ran: custom_generate did not do assisted generation")
        return f"identical to plain greedy, policy read from the moved folder, {draft_calls[0]} draft forwards; " + "; ".join(lines)

    def no_lightning():
        loaded = sorted(m for m in ("lightning", "pytorch_lightning", "datasets", "matplotlib", "sklearn") if m in sys.modules)
        if loaded:
            raise AssertionError(f"imported during the checks: {loaded}")
        return "lightning, datasets, matplotlib, sklearn never imported"

    checks.run("specstop is the installed (non-editable) copy", installed_copy)
    checks.run("specstop decode --policy EXPORT", cli_decode)
    checks.run("public API: load_pair + StoppingPolicy + SpeculativeDecoder", public_api)
    checks.run("HF generate(custom_generate=EXPORT)", hf_custom_generate)
    checks.run("no extra imported", no_lightning)
    if checks.failed:
        print(f"[check] {len(checks.failed)} failed: {', '.join(checks.failed)}")
        return 1
    print("[check] all passed")
    return 0


def _tokenizer(pair_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair_dir / "target")


def _chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt as `specstop decode` feeds it: one user turn in the chat template."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make-export", help="save a tiny pair and export a random-init policy for it")
    p.add_argument("work", type=Path)
    p = sub.add_parser("check", help="decode with an export in this (core) install")
    p.add_argument("--export", type=Path, required=True)
    p.add_argument("--pair", type=Path, required=True, help="folder with draft/ and target/")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per model load is noise in a CI log
    if args.command == "make-export":
        make_export(args.work)
        return 0
    return check(args.export.resolve(), args.pair.resolve())


if __name__ == "__main__":
    sys.exit(main())
