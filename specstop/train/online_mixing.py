"""Online token mixing: SpecDec++ training with the frozen draft in the loop.

Instead of reading dumped hidden states, every step builds mixed responses Z from the stored
(prompt x, target response X, draft tokens Y, labels) - Z_i = Y_i with probability 1 - r, else
X_i (SpecDec++ 4.4, r = 15%) - and runs the frozen draft (``torch.no_grad``) over x + Z. The
final hidden state at response position i, ``e_i(x, Z_<i, Y_i)`` when Z_i = Y_i, is the head's
input; only those positions get a loss, labelled with the teacher-forced acceptance of Y_i. A new
mixing is drawn every epoch (validation keeps one fixed mixing so its metric is comparable).

The draft is a submodule of the LightningModule, so the configured strategy (``ddp``, ``fsdp``,
``deepspeed_stage_2/3``) places or shards it; its weights are never optimised nor checkpointed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from specstop.data_gen.storage import load_arrays, read_manifest
from specstop.data_gen.verify import verify_dataset
from specstop.errors import UserError
from specstop.train.data import SPLITS
from specstop.train.epochs import ShuffleEpochs
from specstop.train.module import PredictorModule

log = logging.getLogger(__name__)

MIX_LABELS = ("accept_prob", "accept_expected")


@dataclass
class SequenceSplit:
    """A split's responses, ragged, as flat tensors + offsets.

    Attributes:
        prompt: ``[sum P]`` prompt token ids; prompt_off ``[n + 1]``.
        response: ``[sum N]`` target tokens X; draft: ``[sum N]`` draft tokens Y; label: ``[sum N]``
            acceptance labels of Y (NaN where the tokens table has no row); resp_off ``[n + 1]``.
    """

    prompt: torch.Tensor
    prompt_off: np.ndarray
    response: torch.Tensor
    draft: torch.Tensor
    label: torch.Tensor
    resp_off: np.ndarray

    def __len__(self) -> int:
        return len(self.resp_off) - 1


def load_sequence_split(data_dir: str, split: str, label: str) -> SequenceSplit:
    """Join the ``sequences`` and ``tokens`` tables of ``split`` (vectorised, no per-row Python)."""
    seq = load_arrays(data_dir, "sequences", split, columns=["prompt_id", "prompt_ids", "response_ids"])
    tok = load_arrays(data_dir, "tokens", split, columns=["prompt_id", "position", "draft_token", label])
    p_flat, p_off = seq["prompt_ids"]
    r_flat, r_off = seq["response_ids"]
    ids = seq["prompt_id"].astype(str)
    order = np.argsort(ids)
    where = np.searchsorted(ids[order], tok["prompt_id"].astype(str))
    where = np.clip(where, 0, len(ids) - 1)
    seq_idx = order[where]
    if len(ids) and not np.all(ids[seq_idx] == tok["prompt_id"].astype(str)):
        raise UserError(f"{data_dir} split {split!r}: tokens rows refer to prompts missing from the sequences table")
    pos = tok["position"].astype(np.int64)
    flat = r_off[seq_idx].astype(np.int64) + pos
    if np.any(pos >= (r_off[seq_idx + 1] - r_off[seq_idx])):
        raise UserError(f"{data_dir} split {split!r}: a tokens row's position lies beyond its response")
    draft = np.array(r_flat, dtype=np.int64, copy=True)
    lab = np.full(len(r_flat), np.nan, dtype=np.float32)
    draft[flat] = tok["draft_token"]
    lab[flat] = tok[label].astype(np.float32)
    return SequenceSplit(
        prompt=torch.from_numpy(np.asarray(p_flat, dtype=np.int64)),
        prompt_off=np.asarray(p_off, dtype=np.int64),
        response=torch.from_numpy(np.asarray(r_flat, dtype=np.int64)),
        draft=torch.from_numpy(draft),
        label=torch.from_numpy(lab),
        resp_off=np.asarray(r_off, dtype=np.int64),
    )


class MixedBatches(IterableDataset):
    """Yields padded batches of mixed sequences.

    Each batch is ``{"input_ids" [B, T], "attention_mask" [B, T], "loss_mask" [B, T] (positions
    holding a draft token with a label), "labels" [B, T]}`` (right padding).
    """

    def __init__(self, data: SequenceSplit, batch_size: int, rate: float, seed: int, train: bool, pad_id: int, max_length: int | None,
                 epoch_fn=None):
        super().__init__()
        self.data, self.batch_size, self.rate = data, batch_size, rate
        self.seed, self.train, self.pad_id, self.max_length = seed, train, pad_id, max_length
        self.epoch_fn = epoch_fn  # see specstop.train.epochs: the epoch must survive a resume
        self.epoch = 0

    def _rank_world(self):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def __len__(self) -> int:
        rank, world = self._rank_world()
        total = -(-len(self.data) // self.batch_size)
        return total // world if self.train else len(range(rank, total, world))

    def __iter__(self):
        rank, world = self._rank_world()
        # Validation: one fixed mixing (seed only); training: a new one every epoch.
        epoch = self.epoch_fn() if (self.train and self.epoch_fn is not None) else self.epoch
        gen = torch.Generator().manual_seed(self.seed + (1000003 * (epoch + 1) if self.train else 0))
        order = torch.randperm(len(self.data), generator=gen) if self.train else torch.arange(len(self.data))
        self.epoch += 1
        for j in range(len(self)):
            b = rank + j * world
            idx = order[b * self.batch_size : (b + 1) * self.batch_size].tolist()
            yield self._collate(idx, gen)

    def _collate(self, idx: list[int], gen: torch.Generator) -> dict:
        d = self.data
        rows = []
        for i in idx:
            prompt = d.prompt[d.prompt_off[i] : d.prompt_off[i + 1]]
            lo, hi = d.resp_off[i], d.resp_off[i + 1]
            x, y, lab = d.response[lo:hi], d.draft[lo:hi], d.label[lo:hi]
            take_y = torch.rand(len(x), generator=gen) >= self.rate
            z = torch.where(take_y, y, x)
            ids = torch.cat([prompt, z])
            mask = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), take_y & ~torch.isnan(lab)])
            labels = torch.cat([torch.zeros(len(prompt)), torch.nan_to_num(lab)])
            if self.max_length:
                ids, mask, labels = ids[: self.max_length], mask[: self.max_length], labels[: self.max_length]
            rows.append((ids, mask, labels))
        t = max(len(r[0]) for r in rows)
        out = {
            "input_ids": torch.full((len(rows), t), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(rows), t), dtype=torch.long),
            "loss_mask": torch.zeros((len(rows), t), dtype=torch.bool),
            "labels": torch.zeros((len(rows), t)),
        }
        for r, (ids, mask, labels) in enumerate(rows):
            n = len(ids)
            out["input_ids"][r, :n] = ids
            out["attention_mask"][r, :n] = 1
            out["loss_mask"][r, :n] = mask
            out["labels"][r, :n] = labels
        return out


class OnlineMixingDataModule(ShuffleEpochs, L.LightningDataModule):
    """Stored (x, X, Y, labels) of a dataset, mixed anew each epoch for :class:`OnlineMixingModule`.

    Args:
        data_dir: a ``specstop generate`` folder (hidden states need not be stored).
        label: ``accept_prob`` (SpecDec++) or ``accept_expected``.
        batch_size: *sequences* per batch (SpecDec++: 32).
        mixing_rate: r, the fraction of target tokens in Z (default: the manifest's mixing rate,
            else 0.15 as in SpecDec++ D.1).
        max_length: truncate prompt + response to this many tokens (memory bound).
        seed: mixing and shuffling seed.

    Attributes: ``k`` (manifest top-k) and ``hidden_size`` (None: the module takes the draft's width).
    """

    def __init__(
        self,
        data_dir: str,
        label: str = "accept_prob",
        batch_size: int = 32,
        mixing_rate: float | None = None,
        max_length: int | None = 1024,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if label not in MIX_LABELS:
            raise UserError(f"online mixing trains on {MIX_LABELS}; got label {label!r}")
        self.data_dir, self.label, self.batch_size = str(data_dir), label, batch_size
        self.manifest = read_manifest(self.data_dir)
        verify_dataset(self.data_dir)  # always before training on it (see PredictorDataModule)
        labels = self.manifest.get("labels", {})
        rate = mixing_rate if mixing_rate is not None else (labels.get("mixing") or {}).get("rate") or 0.15
        if not 0.0 <= rate < 1.0:
            raise UserError(f"mixing_rate r must be in [0, 1) (fraction of target tokens), got {rate}")
        self.mixing_rate, self.max_length, self.seed = float(rate), max_length, seed
        self.k: int = int(labels.get("topk_k", 10))
        self.hidden_size: int | None = None
        eos = (self.manifest.get("generation") or {}).get("eos_token_id")
        self.pad_id = int(eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        self.splits: dict[str, SequenceSplit] = {}

    def setup(self, stage: str | None = None) -> None:
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if module is not None and getattr(module, "label", self.label) != self.label:
            raise UserError(f"data.label={self.label!r} but model.label={module.label!r}; make them equal")
        wanted = {"fit": ("train", "validation"), "validate": ("validation",), "test": ("test",)}.get(stage or "", SPLITS)
        for split in wanted:
            if split not in self.splits and (self.manifest.get("splits", {}).get(split, {}).get("prompts", 1) > 0):
                self.splits[split] = load_sequence_split(self.data_dir, split, self.label)
        ids = {s: set(load_arrays(self.data_dir, "sequences", s, columns=["prompt_id"])["prompt_id"]) for s in self.splits}
        names = list(ids)
        for a in range(len(names)):
            for b in range(a + 1, len(names)):
                both = ids[names[a]] & ids[names[b]]
                if both:
                    raise UserError(f"prompt {sorted(both)[0]!r} is in both {names[a]!r} and {names[b]!r}; regenerate the dataset")

    def _loader(self, split: str, train: bool) -> DataLoader:
        ds = MixedBatches(self.splits[split], self.batch_size, self.mixing_rate, self.seed, train, self.pad_id, self.max_length,
                          epoch_fn=self.next_shuffle_epoch if train else None)
        return DataLoader(ds, batch_size=None, num_workers=0)

    def train_dataloader(self):
        return self._loader("train", True)

    def val_dataloader(self):
        return self._loader("validation", False)

    def test_dataloader(self):
        return self._loader("test", False)

    def summary(self) -> dict:
        m = self.manifest
        pair = m.get("pair", {})
        return {
            "data_dir": self.data_dir,
            "pair": {k: pair.get(k) for k in ("name", "draft", "target", "tokenizer_hash")},
            "tokenizer_hash": pair.get("tokenizer_hash"),
            "generation": m.get("generation"),
            "temperature": (m.get("generation") or {}).get("temperature"),
            "labels": m.get("labels"),
            "online_mixing": {"rate": self.mixing_rate, "max_length": self.max_length},
        }


class OnlineMixingModule(PredictorModule):
    """A hidden-state predictor trained on hidden states computed by a frozen draft.

    Args:
        draft: the draft model (a local Hugging Face folder or hub id; e.g. ``save_tiny_pair``'s
            ``draft/``).
        draft_dtype: ``float32``/``bfloat16``/``float16``/``auto``.
        family, predictor_config, label, ...: as :class:`PredictorModule` (a hidden-state family;
            ``hidden_size`` is the draft's width).
    """

    def __init__(
        self,
        draft: str,
        family: str = "specdecpp_resnet",
        predictor_config: dict | None = None,
        label: str | None = None,
        w_acc: float = 1.0,
        w_rej: float = 1.0,
        lr: float = 5e-5,
        weight_decay: float = 0.0,
        schedule: str = "cosine",
        hidden_size: int | None = None,
        k: int | None = None,
        f1_threshold: float | None = None,
        draft_dtype: str = "float32",
    ) -> None:
        from transformers import AutoConfig

        from specstop.pair.preflight import loading_errors
        from specstop.pair.sources import locate_model

        source = locate_model(draft, "draft")  # a clear error for a missing/broken folder or an offline hub id
        with loading_errors(f"draft {draft!r}"):
            cfg = AutoConfig.from_pretrained(source)
        width = int((cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg).hidden_size)
        if hidden_size is not None and hidden_size != width:
            raise UserError(f"the dataset's hidden states are {hidden_size} wide but draft {draft!r} is {width} wide")
        super().__init__(
            family, predictor_config, label, w_acc, w_rej, lr, weight_decay, schedule, width, k, f1_threshold
        )
        if not self.predictor.feature_spec.reads_hidden:
            raise UserError(f"online mixing trains hidden-state predictors; {family!r} reads {self.predictor.feature_spec.kind!r}")
        from specstop.pair.loader import load_model

        with loading_errors(f"draft {draft!r}"):
            self.draft = load_model(source, dtype=draft_dtype, device="cpu")
        self.draft.requires_grad_(False)
        self.strict_loading = False  # checkpoints omit the frozen draft

    def train(self, mode: bool = True):
        super().train(mode)
        self.draft.eval()  # frozen: no dropout, whatever Lightning does to the module
        return self

    def _features_labels(self, batch):
        with torch.no_grad():
            base = getattr(self.draft, self.draft.base_model_prefix)
            # The decoder only (no LM head): e_i is the final, normed hidden state.
            h = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["loss_mask"]
        return h[mask].float(), batch["labels"][mask]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        sd = checkpoint.get("state_dict")
        if sd is not None:
            for key in [k for k in sd if k.startswith("draft.")]:
                del sd[key]
        super().on_save_checkpoint(checkpoint)
        checkpoint["specstop"]["online_mixing"] = {"draft": self.hparams.get("draft")}
