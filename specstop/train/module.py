"""``PredictorModule``: any registered stopping predictor as a LightningModule.

The weights live under ``self.predictor`` (a plain ``nn.Module`` from ``specstop.models``), so a
checkpoint's ``state_dict`` keys are ``predictor.*`` and ``specstop.models.checkpoint`` can rebuild
the predictor with torch alone.
"""

from __future__ import annotations

import math
from dataclasses import fields

import lightning as L
import torch

from specstop.config_io import check_range
from specstop.errors import UserError
from specstop.models.registry import build_predictor, get_predictor_class
from specstop.train.loss import weighted_bce_with_logits
from specstop.train.metrics import AcceptanceMetrics, binary_kl_from_logits

SCHEDULES = ("cosine", "step_halving", "constant")
CHECKPOINT_FORMAT = 1


class PredictorModule(L.LightningModule):
    """Train a stopping predictor with weighted BCE.

    Args:
        family: registry name (``disco_ffn``, ``specdecpp_resnet``, ``mcsd_hidden_mlp``, ``mcsd_topk_mlp``,
            ``tree_node_mlp``).
        predictor_config: the family's dataclass config as a dict (missing keys take defaults).
        label: label column; None takes the family's ``default_label``.
        w_acc: weight of the loss's accept term, y * log sigmoid(z) (SpecDec++: 1).
        w_rej: weight of the loss's reject term, (1 - y) * log sigmoid(-z) (SpecDec++ sweeps 1, 3, 6, 12).
        lr: Adam learning rate.
        weight_decay: Adam weight decay.
        schedule: ``"cosine"`` (per step, from lr to 0 over the run: SpecDec++), ``"step_halving"``
            (x0.5 after every epoch: MCSD) or ``"constant"``.
        hidden_size: the dataset's hidden width, linked from ``data.hidden_size``; fills
            ``predictor_config.hidden_size`` for hidden-state families (ignored by the others).
        k: the dataset's top-k size, linked from ``data.k``; fills ``predictor_config.k`` unless
            the config asks for a smaller k.
        f1_threshold: a tuned probability threshold; also log F1 at it (``val_f1_tau``).
    """

    def __init__(
        self,
        family: str,
        predictor_config: dict | None = None,
        label: str | None = None,
        w_acc: float = 1.0,
        w_rej: float = 1.0,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        schedule: str = "constant",
        hidden_size: int | None = None,
        k: int | None = None,
        f1_threshold: float | None = None,
    ) -> None:
        super().__init__()
        if schedule not in SCHEDULES:
            raise UserError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        check_range("model.w_acc", w_acc, low=0.0)
        check_range("model.w_rej", w_rej, low=0.0)
        check_range("model.lr", lr, low=0.0, low_open=True)
        check_range("model.weight_decay", weight_decay, low=0.0)
        check_range("model.f1_threshold", f1_threshold, low=0.0, high=1.0)
        cls = get_predictor_class(family)
        label = label or cls.default_label
        if label not in cls.labels:
            raise UserError(f"family {family!r} is trained on one of {cls.labels}; got label {label!r}")
        config = resolve_predictor_config(family, predictor_config or {}, hidden_size=hidden_size, k=k)
        self.predictor = build_predictor(family, **config)
        self.family, self.label = family, label
        self.w_acc, self.w_rej = float(w_acc), float(w_rej)
        self.save_hyperparameters()
        # Store the *resolved* config: load_predictor rebuilds the predictor from it alone.
        self.hparams["predictor_config"] = self.predictor.config_dict()
        self.hparams["label"] = label
        self.val_metrics = AcceptanceMetrics(f1_threshold)
        self.extra_meta: dict = {}  # filled by the CLI/trainer code (dataset summary, metrics)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, input_dim]`` -> ``[B]`` logits."""
        return self.predictor(x)

    def loss(self, logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return weighted_bce_with_logits(logits, target, self.w_acc, self.w_rej, mask)

    # -- steps --------------------------------------------------------------------------------

    def _features_labels(self, batch):
        """Batch -> (``[B, D]`` features, ``[B]`` labels). Subclasses (online mixing) override."""
        x, y = batch
        return x, y

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = self._features_labels(batch)
        logits = self(x)
        loss = self.loss(logits, y)
        with torch.no_grad():
            kl = binary_kl_from_logits(logits, y).mean().float() if y.numel() else loss.detach() * 0
        bs = int(y.numel())
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=bs)
        # Epoch mean of the per-batch KL while the weights move: a cheap proxy for the train KL.
        self.log("train_kl", kl, on_step=False, on_epoch=True, batch_size=bs, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = self._features_labels(batch)
        logits = self(x)
        self.log("val_loss", self.loss(logits, y), on_epoch=True, prog_bar=True, batch_size=int(y.numel()), sync_dist=True)
        self.val_metrics.update(logits, y)

    def on_validation_epoch_end(self) -> None:
        # Every rank must join the metric sync under data parallelism, even with no local rows.
        if int(self.val_metrics.kl.count) == 0 and self.trainer.world_size == 1:
            return
        out = self.val_metrics.compute()
        self.val_metrics.reset()
        for name, value in out.items():
            self.log(f"val_{name}", value, prog_bar=name in ("auroc", "f1"), sync_dist=False)

    def test_step(self, batch, batch_idx: int) -> None:
        x, y = self._features_labels(batch)
        self.log("test_loss", self.loss(self(x), y), on_epoch=True, batch_size=int(y.numel()), sync_dist=True)

    # -- optimisation -------------------------------------------------------------------------

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.predictor.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=hp.lr, weight_decay=hp.weight_decay)
        if hp.schedule == "constant":
            return opt
        if hp.schedule == "step_halving":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        total = self.trainer.estimated_stepping_batches
        total = int(total) if total and math.isfinite(total) else 1000
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- checkpoint metadata ------------------------------------------------------------------

    def specstop_meta(self) -> dict:
        """JSON-able facts stored under ``checkpoint["specstop"]``."""
        meta = {
            "format": CHECKPOINT_FORMAT,
            "family": self.family,
            "predictor_config": self.predictor.config_dict(),
            "feature_spec": self.predictor.feature_spec.to_dict(),
            "label": self.label,
            "w_acc": self.w_acc,
            "w_rej": self.w_rej,
        }
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "summary"):
            meta["dataset"] = dm.summary()
        if self._trainer is not None:
            metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val_")}
            if metrics:
                meta["val_metrics"] = metrics
        meta.update(self.extra_meta)
        return meta

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # A plain dict (not Lightning's AttributeDict) so torch.load(weights_only=True) can read it
        # without importing Lightning.
        if "hyper_parameters" in checkpoint:
            checkpoint["hyper_parameters"] = _plain(dict(checkpoint["hyper_parameters"]))
        checkpoint["specstop"] = _plain(self.specstop_meta())


def resolve_predictor_config(family: str, config: dict, *, hidden_size: int | None, k: int | None) -> dict:
    """Fill dataset-linked sizes into a family config dict and check them.

    ``hidden_size`` (from the manifest) always wins for hidden-state families; a different value
    written in the config is an error rather than silently replaced. ``k`` fills the config's k
    when unset; a config k larger than the dataset's is an error.
    """
    cls = get_predictor_class(family)
    names = {f.name for f in fields(cls.config_cls)}
    unknown = set(config) - names
    if unknown:
        raise UserError(f"unknown predictor_config keys {sorted(unknown)} for {family!r}; valid keys: {sorted(names)}")
    config = dict(config)
    if "hidden_size" in names and hidden_size is not None:
        if config.get("hidden_size") not in (None, hidden_size):
            raise UserError(
                f"predictor_config.hidden_size={config['hidden_size']} but the dataset's hidden states are "
                f"{hidden_size} wide; remove hidden_size from the config (it is linked from the manifest)"
            )
        config["hidden_size"] = hidden_size
    if "k" in names and k is not None:
        if config.get("k") is None:
            config["k"] = k
        elif config["k"] > k:
            raise UserError(f"predictor_config.k={config['k']} exceeds the dataset's top-{k} features; set k <= {k}")
    return config


def _plain(obj):
    """Recursively turn mappings/sequences/tensors/numpy scalars into JSON-like Python values."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)
