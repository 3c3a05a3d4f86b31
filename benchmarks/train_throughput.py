"""Training throughput per predictor family, and the data-loading overhead of PredictorDataModule.

For every family we time three loops over the same rows, batch size and optimiser:

Loader and memory loops are timed interleaved, best of ``--repeats``.

* ``memory``: the floor - features prebuilt as one tensor on the device, batches gathered with a
  random index (what any loader must at least do);
* ``loader``: the same step fed by ``PredictorDataModule.train_dataloader()``;
* ``lightning``: ``Trainer.fit`` for the same epochs (loader + Lightning's per-step overhead).

``overhead = loader time / memory time`` (goal <= 1.2). Usage::

    python benchmarks/train_throughput.py [--rows 100000] [--hidden-size 896] [--batch-size 4096]
        [--epochs 2] [--device cpu|cuda|all] [--data DIR] [--json out.json]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from specstop.script_args import ScriptParser, existing_dir, positive_int, result_file, write_result
from specstop.script_main import run_main

FAMILIES = {
    "disco_ffn": ({}, "accept_expected"),
    "mcsd_topk_mlp": ({}, "verified"),
    "mcsd_hidden_mlp": ({}, "accept_prob"),
    "specdecpp_resnet": ({"depth": 3}, "accept_prob"),
}


def _step(model, opt, loss_fn, x, y):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_family(family, cfg, label, data_dir, batch_size, epochs, device, repeats=3):
    import lightning as L

    from specstop.train.data import PredictorDataModule
    from specstop.train.loss import weighted_bce_with_logits
    from specstop.train.module import PredictorModule

    dm = PredictorDataModule(data_dir, batch_size=batch_size, table="tokens")
    module = PredictorModule(family, cfg, label=label, hidden_size=dm.hidden_size, k=dm.k)
    dm.configure(module.predictor.feature_spec, label)
    dm.setup("fit")
    train = dm.splits["train"]
    n = len(train)
    loss_fn = lambda z, y: weighted_bce_with_logits(z, y, 1.0, 1.0)  # noqa: E731

    def fresh():
        m = PredictorModule(family, cfg, label=label, hidden_size=dm.hidden_size, k=dm.k).predictor.to(device)
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    # memory floor: features prebuilt on the device
    x_all = train.features(module.predictor.feature_spec).to(device)
    y_all = train.labels.to(device)

    def memory_loop():
        model, opt = fresh()
        _sync(device)
        t = time.perf_counter()
        for _ in range(epochs):
            perm = torch.randperm(n, device=device)
            for lo in range(0, n, batch_size):
                idx = perm[lo : lo + batch_size]
                _step(model, opt, loss_fn, x_all[idx], y_all[idx])
        _sync(device)
        return time.perf_counter() - t, model

    def loader_loop():
        model, opt = fresh()
        loader = dm.train_dataloader()
        _sync(device)
        t = time.perf_counter()
        for _ in range(epochs):
            for x, y in loader:
                _step(model, opt, loss_fn, x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        _sync(device)
        return time.perf_counter() - t, model

    # Interleaved repeats, best of each: a shared machine's noise and first-run warm-up otherwise
    # dominate the ratio.
    t_mem, t_loader = float("inf"), float("inf")
    for _ in range(repeats):
        t_mem = min(t_mem, memory_loop()[0])
        dt, model = loader_loop()
        t_loader = min(t_loader, dt)

    # Lightning end to end (no validation, no logger, no checkpoint)
    module = PredictorModule(family, cfg, label=label, hidden_size=dm.hidden_size, k=dm.k)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator=device.type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    t = time.perf_counter()
    trainer.fit(module, dm)
    _sync(device)
    t_pl = time.perf_counter() - t
    rows = n * epochs
    return {
        "family": family,
        "device": str(device),
        "rows": n,
        "epochs": epochs,
        "batch_size": batch_size,
        "params": sum(p.numel() for p in model.parameters()),
        "samples_per_s_memory": rows / t_mem,
        "samples_per_s_loader": rows / t_loader,
        "samples_per_s_lightning": rows / t_pl,
        "loader_overhead": t_loader / t_mem,
        "lightning_overhead": t_pl / t_mem,
    }


def main(argv=None) -> int:
    ap = ScriptParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=positive_int, default=100_000, help="train rows of the synthetic dataset")
    ap.add_argument("--hidden-size", type=positive_int, default=896, help="hidden width of the synthetic dataset (Qwen2.5-0.5B: 896)")
    ap.add_argument("--batch-size", type=positive_int, default=4096)
    ap.add_argument("--epochs", type=positive_int, default=2)
    ap.add_argument("--device", default="all", choices=("cpu", "cuda", "all"),
                    help="cpu, cuda, or all (cpu + cuda when available)")
    ap.add_argument("--data", type=existing_dir, default=None, help="an existing dataset (default: write a synthetic one)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--repeats", type=positive_int, default=3, help="best of N interleaved timings")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", type=result_file(__file__), default=None)
    args = ap.parse_args(argv)
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:  # before the synthetic dataset is written, not after
        ap.error(f"argument --families: {unknown[0]!r} is not a family; choose from {', '.join(FAMILIES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    data_dir = args.data
    if data_dir is None:
        from specstop.testing import write_synthetic_dataset

        tpp = 256
        data_dir = str(Path(tempfile.mkdtemp(prefix="specstop-bench-")) / "data")
        t = time.perf_counter()
        write_synthetic_dataset(
            data_dir, {"train": max(1, args.rows // tpp), "validation": 4, "test": 1}, tpp, hidden_size=args.hidden_size
        )
        print(f"synthetic dataset: {args.rows} rows, H={args.hidden_size} in {time.perf_counter() - t:.1f}s at {data_dir}")
    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    results = []
    print(f"{'family':18} {'device':6} {'params':>9} {'mem/s':>10} {'loader/s':>10} {'lightning/s':>12} {'loader x':>9} {'PL x':>6}")
    for device in devices:
        for fam in args.families.split(","):
            cfg, label = FAMILIES[fam]
            r = bench_family(fam, cfg, label, data_dir, args.batch_size, args.epochs, device, args.repeats)
            results.append(r)
            print(
                f"{fam:18} {device.type:6} {r['params']:>9} {r['samples_per_s_memory']:>10.0f} {r['samples_per_s_loader']:>10.0f} "
                f"{r['samples_per_s_lightning']:>12.0f} {r['loader_overhead']:>9.2f} {r['lightning_overhead']:>6.2f}"
            )
    if args.json:
        write_result(args.json, {"args": vars(args), "results": results}, __file__)
    return 0


if __name__ == "__main__":
    run_main(main, __file__)
