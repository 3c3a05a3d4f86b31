#!/usr/bin/env python3
"""Every CUDA path of specstop, end to end at small scale, in one table: ``make gpu-check``.

Each row runs one path the way a user would (the CLI for generate / train / calibrate-cost / tune /
export, the public classes for the decoders) and prints its seconds, pass/fail and the figure it
measured. Correctness runs on tiny random pairs: every decoder's greedy output must equal the
target's own ``generate``, and sampled output must follow the target's distribution (a pooled
chi-square over the first two tokens). Costs are timed on random-init models of the reference
pair's shapes (Qwen2.5-Coder 0.5B / 1.5B), built on the GPU: nothing is downloaded.

``--device cpu`` runs the same script on the tiny pair (CI does, so it cannot rot); rows that need
CUDA say so and are skipped. The whole run stops cleanly when ``--budget`` seconds are spent: rows
not started by then are reported as skipped, never silently dropped.

Usage::

    python scripts/gpu_check.py --device cuda                 # on a GPU machine (make gpu-check)
    python scripts/gpu_check.py --device cpu --budget 600     # CI (make gpu-check DEVICE=cpu)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Qwen2.5-Coder-0.5B / 1.5B-Instruct's shapes (their config.json), for cost rows on random weights.
REFERENCE_SHAPES = {
    "draft": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "tie_word_embeddings": True},
    "target": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
               "num_key_value_heads": 2, "tie_word_embeddings": True},
}
REFERENCE_VOCAB = 151936
GREEDY_NEW = 24  # tokens per prompt in the greedy equality rows
SAMPLED_RUNS = 400  # draws per chi-square row
CHI2_MIN_P = 1e-3
SAMPLED_PROMPTS = [[1, 3, 2], [4, 0], [2], [0, 1, 1]]  # the batched row decodes these side by side


class Skip(Exception):
    """A row that cannot run here (the reason is printed in the table)."""


@dataclass
class Row:
    name: str
    seconds: float
    status: str  # pass | FAIL | skip
    figure: str


class GpuCheck:
    """Runs the rows in order; later rows reuse what earlier ones made (data, checkpoint, export)."""

    def __init__(self, device: str, work: Path, budget: float, log_path: Path) -> None:
        self.device = device
        self.cuda = device.startswith("cuda")
        self.work = work
        self.deadline = time.monotonic() + budget
        self.log = log_path.open("a", encoding="utf-8")
        self.rows: list[Row] = []
        self.made: dict[str, Path] = {}
        self._pair = None
        self._small = None
        self._references: list[list[int]] | None = None

    # ------------------------------------------------------------------ plumbing
    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cli(self, *args: str, timeout: float = 240.0) -> str:
        """Run ``python -m specstop ARGS`` (the user's command); its output goes to the log."""
        cmd = [sys.executable, "-m", "specstop", *map(str, args)]
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        limit = max(5.0, min(timeout, self.left()))
        try:
            proc = subprocess.run(cmd, cwd=self.work, capture_output=True, text=True, timeout=limit,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`specstop {args[0]}` ran past {limit:.0f} s") from None
        self.log.write(proc.stdout + proc.stderr + f"[exit {proc.returncode}]\n")
        self.log.flush()
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
            errors = [ln for ln in lines if "error" in ln.lower()]
            raise RuntimeError(f"`specstop {args[0]}` exit {proc.returncode}: " + (errors or lines or [""])[-1])
        return proc.stdout + proc.stderr

    def run(self, name: str, fn: Callable[[], str], *, needs_cuda: bool = False, needs: tuple[str, ...] = ()) -> None:
        t0 = time.monotonic()
        try:
            if needs_cuda and not self.cuda:
                raise Skip("needs CUDA")
            missing = [n for n in needs if n not in self.made]
            if missing:
                raise Skip(f"no {', '.join(missing)} (an earlier row failed)")
            if self.left() < 5:
                raise Skip("time budget spent")
            figure, status = fn(), "pass"
        except Skip as why:
            figure, status = str(why), "skip"
        except Exception as exc:  # a failing row is reported; the rows after it still run
            self.log.write(traceback.format_exc())
            figure, status = f"{type(exc).__name__}: {exc}"[:300], "FAIL"
        row = Row(name, time.monotonic() - t0, status, figure)
        self.rows.append(row)
        self.say(f"[{row.status:>4}] {row.name:<28} {row.seconds:6.1f} s  {row.figure}")
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ shared fixtures
    def pair(self):
        """The tiny pair (float32, on the device) loaded from the folder generate used."""
        if self._pair is None:
            from specstop.pair.loader import load_pair

            d = self.made["pair"]
            self._pair = load_pair(str(d / "draft"), str(d / "target"), dtype="float32", device=self.device, name="tiny")
        return self._pair

    def prompts(self) -> list[list[int]]:
        from specstop.decode.cli import render

        texts = ("hello world", "def f(x):", "zz", "a prompt a good deal longer than the other three")
        return [render(t, self.pair().tokenizer, True) for t in texts]

    def references(self) -> list[list[int]]:
        """The target's own greedy ``generate`` per prompt (padded logit rows suppressed)."""
        if self._references is None:
            import torch

            pair = self.pair()
            padded = list(range(pair.vocab_size, pair.target.config.vocab_size))
            refs = []
            for ids in self.prompts():
                x = torch.tensor([ids], device=self.device)
                out = pair.target.generate(x, max_new_tokens=GREEDY_NEW, do_sample=False, suppress_tokens=padded)
                refs.append(out[0, len(ids):].tolist())
            self._references = refs
        return self._references

    def small(self):
        from specstop.testing import small_vocab_pair

        if self._small is None:
            self._small = small_vocab_pair(device=self.device)
        return self._small

    def policies(self) -> dict:
        """Rules, plus the exported learned policy when the export row made one."""
        from specstop.export.runtime import StoppingPolicy

        out = {p: StoppingPolicy.from_string(p) for p in ("static:3", "confidence:0.4")}
        if "export" in self.made:
            pair = self.pair()
            out["export"] = StoppingPolicy.from_pretrained(self.made["export"], draft_identity=pair.draft_identity,
                                                           tokenizer_hash=pair.tokenizer_hash)
        return out

    def greedy_rows(self, decode: Callable[[list[int]], object], label: str) -> str:
        """Decode every prompt; all must equal the target's greedy output. Figure: tokens per round."""
        t0, tokens, rounds = time.perf_counter(), 0, 0
        for ids, ref in zip(self.prompts(), self.references()):
            res = decode(ids)
            if res.token_ids != ref:
                raise AssertionError(f"{label}: output differs from the target's greedy output "
                                     f"(first 8: {res.token_ids[:8]} vs {ref[:8]})")
            tokens += len(res.token_ids)
            rounds += res.counters["rounds"]
        return f"{tokens / max(rounds, 1):.2f} tok/round, {tokens / (time.perf_counter() - t0):.0f} tok/s"

    # ------------------------------------------------------------------ rows
    def versions(self) -> str:
        import torch
        import transformers

        from specstop.pair.compat import check_supported_versions

        check_supported_versions()
        where = torch.cuda.get_device_name(0) if self.cuda else "CPU"
        return f"{where}; torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}"

    def generate(self) -> str:
        from specstop.testing import save_tiny_pair

        self.made["pair"] = save_tiny_pair(self.work / "tiny_pair")
        data = self.work / "data"
        # CUDA: dtype auto, the CUDA rule (bf16 where the GPU has bf16 units). CPU: float32, since
        # auto would time the pair first, which the unit tests already cover.
        dtype = "auto" if self.cuda else "float32"
        self.cli("generate", "--pair", self.made["pair"], "--device", self.device, "--dtype", dtype,
                 "--data", data, "--prompts", "builtin:mbpp", "--prompts.template", "mbpp",
                 "--prompts.split_scheme", "mbpp", "--prompts.limit", "64", "--max-new-tokens", "32",
                 "--batch-size", "64", "--hidden-states", "--mixing-on", "train,validation",
                 "--prompts-per-shard", "64")
        self.cli("generate", "--verify", "--data", data)
        manifest = json.loads((data / "manifest.json").read_text())
        self.made["data"] = data
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        return f"{tokens} labelled tokens, batch 64, dtype {dtype} -> {manifest['pair']['target'].get('dtype')}, verified"

    def train(self, strategy: str, family: str = "disco_ffn") -> Callable[[], str]:
        def row() -> str:
            if strategy.startswith("deepspeed"):
                try:
                    import deepspeed  # noqa: F401
                except Exception as exc:
                    raise Skip(f"deepspeed does not import here ({type(exc).__name__})") from None
            root = self.work / f"train_{strategy}"
            self.cli("train", "--config", REPO / "configs" / "train" / f"{family}.yaml", "--data", self.made["data"],
                     "--trainer.accelerator", "gpu" if self.cuda else "cpu", "--trainer.devices", "1",
                     "--trainer.strategy", strategy, "--trainer.max_epochs", "2", "--trainer.default_root_dir", root,
                     *(["--trainer.precision", "bf16-mixed"] if strategy.startswith("deepspeed") else []),
                     timeout=240)
            best = sorted(root.rglob("best-*.ckpt"))
            if not best:
                raise AssertionError(f"no best checkpoint under {root}")
            metrics = json.loads(next(root.rglob("metrics.json")).read_text())
            if strategy == "ddp":
                self.made["checkpoint"] = best[-1]
            return f"{family}: 2 epochs, best {metrics['monitor']} {metrics['best_score']:.3f}"

        return row

    def ranks(self) -> str:
        """Two real processes under torchrun (gloo): each rank's device by specstop's rank-to-device rule
        (scripts/rank_device_check.py): ``cuda:r`` for rank r where the node has that GPU, a one-line
        refusal naming LOCAL_RANK where it has not; a tensor made there lands there."""
        script = REPO / "scripts" / "rank_device_check.py"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", "29541", str(script)], cwd=self.work, capture_output=True, text=True,
                              timeout=max(5.0, min(180.0, self.left())))
        self.log.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
        ranks = sorted(json.loads(proc.stdout.strip().splitlines()[-1]), key=lambda r: r["local_rank"])
        figures = []
        for r in ranks:
            lr, gpus = r["local_rank"], r["visible_gpus"]
            if lr < gpus and (r["cuda"] != f"cuda:{lr}" or r.get("allocated_on") != r["cuda"]):
                raise AssertionError(f"rank {lr}: {r['cuda']} (allocated on {r.get('allocated_on')}), not cuda:{lr}")
            if lr >= gpus and not str(r["cuda"]).startswith(f"refused: LOCAL_RANK={lr}"):
                raise AssertionError(f"rank {lr} of a node with {gpus} GPU(s) got {r['cuda']}")
            figures.append(f"rank {lr}: {r.get('allocated_on') or 'refused (' + str(gpus) + ' GPU)'}")
        return "2 processes (torchrun, gloo): " + ", ".join(figures)

    def calibrate(self) -> str:
        """CUDA: the reference shapes, dtype auto, batch grid; the table's check must pass. (PEARL's
        core split is timed on CPUs only: on a GPU its two streams share one device.)

        CPU: the tiny pair. The check compares each decoder round with the forwards timed beside it, so it
        holds on millisecond steps too and is required on both (differences under its noise floor of
        5 ms never fail it).
        """
        out = self.work / "cost.json"
        if self.cuda:
            args = ["--pair", self.reference_shapes(), "--dtype", "auto", "--budget", "20", "--batch-grid", "1,8"]
        else:
            args = ["--pair", self.made["pair"], "--dtype", "float32", "--budget", "4", "--no-pearl-split"]
        log = self.cli("calibrate-cost", *args, "--device", self.device, "--context-tokens", "128",
                       "--k-grid", "0,1,2,4,8", "--no-plot", "--out", out, timeout=300)
        cost = json.loads(out.read_text())
        self.made["cost"] = out
        problems = cost["fit"]["check"]["problems"]
        if problems:
            raise AssertionError("cost table check failed: " + "; ".join(problems))
        t1 = cost["target_by_k"]["1"]
        what = "reference shapes" if self.cuda else "tiny pair"
        agree = ", ".join(f"{n} {r['ratio']:.2f}x" for n, r in cost["fit"].get("decoder_check", {}).items())
        check = f"check passed (decoder / table: {agree})"
        pearl = ("PEARL split measured" if "PEARL split" in log
                 else "no PEARL split (a CPU measurement)" if self.cuda else "no PEARL split")
        if "own cost on this device" in log:
            pearl += "; tree costs differ from the K table in both measurements (kept as measured)"
        return (f"{what}: draft {1e3 * cost['t_draft']:.2f} ms, target(K=1) {1e3 * t1:.2f} ms "
                f"(ratio {cost['t_draft'] / t1:.2f}); {check}; {pearl}")

    def reference_shapes(self) -> Path:
        """Random-init models of the reference pair's shapes, built on the GPU, saved in bf16."""
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from specstop.testing import tiny_tokenizer

        folder = self.work / "reference_shapes"
        tok = tiny_tokenizer()
        for role, shape in REFERENCE_SHAPES.items():
            cfg = Qwen2Config(vocab_size=REFERENCE_VOCAB, max_position_embeddings=32768, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id, bos_token_id=None, **shape)
            cfg.architectures = ["Qwen2ForCausalLM"]
            torch.manual_seed(0)
            with torch.device(self.device):
                model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
            model.save_pretrained(folder / role)
            tok.save_pretrained(folder / role)
            del model
        torch.cuda.empty_cache()
        return folder

    def tune_export(self) -> str:
        tuned = self.work / "tuned.json"
        force = ["--force-cost"]  # the table is the reference shapes' (CUDA) or the tiny pair's timer noise (CPU)
        self.cli("tune", "--data", self.made["data"], "--checkpoint", f"disco_ffn={self.made['checkpoint']}",
                 "--cost-model", self.made["cost"], "--sl-max-grid", "4,8", "--out", tuned, *force)
        export = self.work / "export"
        self.cli("export", "--checkpoint", self.made["checkpoint"], "--tuned", tuned, "--out", export,
                 "--for", "hf,vllm")
        self.made["export"] = export
        best = json.loads(tuned.read_text())["best"]
        return f"tuned best: {best}; export + hf/vllm settings written"

    def chain(self, mode: str) -> Callable[[], str]:
        def row() -> str:
            from specstop.decode.chain import SpeculativeDecoder

            pair, figures = self.pair(), []
            policies = self.policies() if mode == "eager" else {"static:3": self.policies()["static:3"]}
            for name, policy in policies.items():
                dec = SpeculativeDecoder(pair, policy, static_cache=mode != "eager", compile=mode == "compiled",
                                         max_cache_len=256)
                if mode == "compiled":  # a first pass compiles; the figure is the second's
                    self.greedy_rows(lambda ids, d=dec: d.generate(ids, GREEDY_NEW), name)
                figures.append(f"{name} " + self.greedy_rows(lambda ids, d=dec: d.generate(ids, GREEDY_NEW), name))
            return "; ".join(figures)

        return row

    def tree(self, attn: str) -> Callable[[], str]:
        def row() -> str:
            from specstop.decode import TreeDecoder, parse_tree_policy

            pair = self.pair()
            before = pair.target.config._attn_implementation
            for m in (pair.draft, pair.target):
                m.set_attn_implementation(attn)
            try:
                dec = TreeDecoder(pair, parse_tree_policy("mcsd:4,2,2,1"))
                return "mcsd:4,2,2,1 " + self.greedy_rows(lambda ids: dec.generate(ids, GREEDY_NEW), f"tree {attn}")
            finally:
                for m in (pair.draft, pair.target):
                    m.set_attn_implementation(before)

        return row

    def pearl(self) -> str:
        from specstop.decode.pearl import PearlDecoder
        from specstop.decode.pearl_spec import PearlSpec

        with PearlDecoder(self.pair(), PearlSpec(3), backend="threads") as dec:
            dec.workers.busy(clear=True)
            fig = self.greedy_rows(lambda ids: dec.generate(ids, GREEDY_NEW), "pearl")
            busy = dec.workers.busy()  # CUDA events on each stream: the seconds both had work in flight
            if busy["both_s"] <= 0:
                raise AssertionError(f"the two streams never overlapped (draft {busy['draft_s']:.3f} s, "
                                     f"target {busy['target_s']:.3f} s busy, each alone)")
            return (f"backend {dec.workers.backend}, gamma 3: {fig}; streams busy together "
                    f"{1e3 * busy['both_s']:.0f} ms of draft {1e3 * busy['draft_s']:.0f} ms / target "
                    f"{1e3 * busy['target_s']:.0f} ms")

    def batched(self) -> str:
        from specstop.decode import BatchedSpeculativeDecoder

        figures = []
        for name, policy in self.policies().items():
            res = BatchedSpeculativeDecoder(self.pair(), policy).generate(self.prompts(), GREEDY_NEW)
            if res.token_ids != self.references():
                raise AssertionError(f"batched {name}: a row differs from the target's greedy output")
            figures.append(f"{name} {res.batch['rounds']} rounds")
        return f"B = {len(self.prompts())}: " + ", ".join(figures)

    def hf_custom_generate(self) -> str:
        import torch

        pair, rounds = self.pair(), 0
        for ids, ref in zip(self.prompts(), self.references()):
            x = torch.tensor([ids], device=self.device)
            padded = list(range(pair.vocab_size, pair.target.config.vocab_size))
            out = pair.target.generate(x, assistant_model=pair.draft, max_new_tokens=GREEDY_NEW, do_sample=False,
                                       suppress_tokens=padded, custom_generate=str(self.made["export"]),
                                       trust_remote_code=True)
            if out[0, len(ids):].tolist() != ref:
                raise AssertionError("generate(custom_generate=EXPORT) differs from the target's greedy output")
            rounds += 1
        return f"{rounds} prompts identical to target.generate"

    def sampled(self, decoder: str) -> Callable[[], str]:
        def row() -> str:
            from specstop.testing import pooled_chi_square, two_token_distribution

            small = self.small()
            prompts = SAMPLED_PROMPTS if decoder == "batched" else [small.prompt]
            runs = SAMPLED_RUNS // len(prompts)
            stat = df = 0.0
            for ids, draws in zip(prompts, self.draws(decoder, prompts, runs)):
                exact = two_token_distribution(small.pair.target, ids, small.decoding, small.vocab)
                counts: dict[tuple[int, int], int] = {}
                for first_two in draws:
                    counts[first_two] = counts.get(first_two, 0) + 1
                s, d, _ = pooled_chi_square(counts, exact, runs)
                stat, df = stat + s, df + d  # independent prompts: statistics and freedoms add
            from scipy.stats import chi2

            p = float(chi2.sf(stat, df))
            if p < CHI2_MIN_P:
                raise AssertionError(f"chi-square {stat:.1f} on {df:.0f} df, p = {p:.2g}: not the target's distribution")
            return f"T = 1, {runs * len(prompts)} draws: chi-square {stat:.1f} on {df:.0f} df, p = {p:.2f}"

        return row

    def draws(self, decoder: str, prompts: list[list[int]], runs: int) -> list[list[tuple[int, int]]]:
        """Per prompt, the first two sampled tokens of ``runs`` independent decodes on the small pair."""
        from specstop.decode import BatchedSpeculativeDecoder, TreeDecoder, parse_tree_policy
        from specstop.decode.chain import SpeculativeDecoder
        from specstop.decode.pearl import PearlDecoder
        from specstop.decode.pearl_spec import PearlSpec
        from specstop.export.runtime import StoppingPolicy

        small = self.small()
        out: list[list[tuple[int, int]]] = [[] for _ in prompts]
        if decoder == "batched":  # one row per prompt: rows of one batch are different prompts
            dec = BatchedSpeculativeDecoder(small.pair, "static:4", small.decoding)
            for seed in range(runs):
                for b, ids in enumerate(dec.generate(prompts, 4, seed=seed).token_ids):
                    out[b].append(tuple(ids[:2]))
            return out
        if decoder == "pearl":
            with PearlDecoder(small.pair, PearlSpec(2), small.decoding, backend="threads") as dec:
                out[0] = [tuple(dec.generate(prompts[0], 4, seed=seed).token_ids[:2]) for seed in range(runs)]
            return out
        if decoder == "tree":
            dec = TreeDecoder(small.pair, parse_tree_policy("mcsd:3,2"), small.decoding)
        else:
            dec = SpeculativeDecoder(small.pair, StoppingPolicy.from_string("static:4"), small.decoding)
        out[0] = [tuple(dec.generate(prompts[0], 4, seed=seed).token_ids[:2]) for seed in range(runs)]
        return out

    # ------------------------------------------------------------------ the run
    def all_rows(self) -> None:
        self.run("versions", self.versions)
        self.run("generate (batch 64)", self.generate)
        self.run("train ddp", self.train("ddp"), needs=("data",))
        self.run("train fsdp", self.train("fsdp", "specdecpp_resnet"), needs_cuda=True, needs=("data",))
        self.run("train deepspeed", self.train("deepspeed_stage_2", "specdecpp_resnet"), needs_cuda=True,
                 needs=("data",))
        self.run("ranks to devices", self.ranks)
        self.run("calibrate-cost", self.calibrate, needs=("pair",))
        self.run("tune + export", self.tune_export, needs=("data", "checkpoint", "cost"))
        self.run("chain eager", self.chain("eager"), needs=("pair",))
        self.run("chain static cache", self.chain("static"), needs=("pair",))
        self.run("tree sdpa", self.tree("sdpa"), needs=("pair",))
        self.run("tree eager", self.tree("eager"), needs=("pair",))
        self.run("pearl two streams", self.pearl, needs_cuda=True, needs=("pair",))
        self.run("batched", self.batched, needs=("pair",))
        self.run("hf custom_generate", self.hf_custom_generate, needs=("pair", "export"))
        for decoder in ("chain", "tree", "batched"):
            self.run(f"sampled {decoder}", self.sampled(decoder))
        self.run("sampled pearl", self.sampled("pearl"), needs_cuda=True)
        # Last: its compile time is the least predictable, and the budget check skips nothing else.
        self.run("chain compiled", self.chain("compiled"), needs_cuda=True, needs=("pair",))

    def table(self) -> str:
        lines = ["| path | seconds | result | figure |", "|---|---:|---|---|"]
        lines += [f"| {r.name} | {r.seconds:.1f} | {r.status} | {r.figure.replace('|', '/')} |" for r in self.rows]
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds; rows not started by then are skipped")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed after)")
    ap.add_argument("--out", default=None, help="write the table (table.md), rows (rows.json) and log here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"gpu-check: --device {args.device} but torch {torch.__version__} sees no CUDA device; "
                  "run `make gpu-check DEVICE=cpu` here, or run it on a GPU machine", file=sys.stderr)
            return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out) if args.out else None
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="specstop-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
    log_path = (out or work) / "gpu_check.log"
    check = GpuCheck(args.device, work, args.budget, log_path)
    check.say(f"gpu-check on {args.device}: budget {args.budget:.0f} s; log {log_path}")
    try:
        check.all_rows()
    finally:
        table = check.table()
        print("\n" + table, flush=True)
        if out:
            (out / "table.md").write_text(table + "\n")
            (out / "rows.json").write_text(json.dumps([r.__dict__ for r in check.rows], indent=1) + "\n")
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    failed = [r.name for r in check.rows if r.status == "FAIL"]
    print(f"\n{sum(r.status == 'pass' for r in check.rows)} passed, {len(failed)} failed, "
          f"{sum(r.status == 'skip' for r in check.rows)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
