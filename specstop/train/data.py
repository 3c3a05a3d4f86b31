"""``PredictorDataModule``: the data_gen output as large tensor batches.

Every column a predictor reads is loaded once per split with :func:`storage.load_arrays` (Arrow
-> numpy, no per-row Python) into tensors, except the hidden states: they stay in the
memory-mapped shard files (:class:`~specstop.train.mapped.MappedRows`), so data-parallel ranks
share one copy. A batch is one fancy-index gather,
so a step costs about as much as slicing a tensor (the benchmark measures the ratio). Features
are assembled with the predictor's own :class:`~specstop.models.FeatureSpec`, the same code replay
and export use.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from specstop.config_io import check_range
from specstop.data_gen.storage import load_arrays, load_column_chunks, read_manifest
from specstop.data_gen.verify import verify_dataset
from specstop.errors import UserError
from specstop.models.features import FeatureSpec
from specstop.train.epochs import ShuffleEpochs
from specstop.train.mapped import MappedRows, PreviousRows, previous_row_index

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
TOKEN_LABELS = ("accept_prob", "accept_expected", "greedy_match", "verified")
MIXED_LABELS = ("accept_prob", "accept_expected")
PREBUILT = "_features"  # SplitData.columns key of features assembled once at load time
STATE = "_state"  # SplitData.columns key of the producing draft states (dist predictors with_state)


@dataclass
class SplitData:
    """One split's rows as tensors.

    Attributes:
        table: the table the rows come from (``tokens`` or ``mixed``).
        columns: ``{"_features": [N, input_dim] float32}`` for distribution predictors (built once),
            or ``{"hidden": MappedRows [N, H] float16}`` (memory-mapped; gathered and cast per batch).
        labels: ``[N]`` float32 targets.
        prompt_ids: ``[N]`` object array. positions: ``[N]`` int64 response positions.
    """

    table: str
    columns: dict[str, torch.Tensor | MappedRows]
    labels: torch.Tensor
    prompt_ids: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def features(self, spec: FeatureSpec, index: torch.Tensor | slice | None = None) -> torch.Tensor:
        """``[n, input_dim]`` float32 features of rows ``index`` (all rows when None)."""
        if PREBUILT in self.columns:
            feats = self.columns[PREBUILT]
            feats = feats if index is None else feats[index]
            if STATE in self.columns:  # the producing states: gathered (mapped) and cast per batch
                feats = torch.cat([feats, self.columns[STATE][index].float()], dim=-1)
            return feats
        sel = {
            k: v[index] if isinstance(v, MappedRows) or index is not None else v for k, v in self.columns.items()
        }
        return spec.build(**sel)


class TensorBatches(IterableDataset):
    """Yields ``(features [B, D], labels [B])`` batches by gathering random index blocks.

    One epoch = one permutation (seeded by ``seed`` + epoch, the same on every rank); under data
    parallelism rank r takes batches r, r + W, ... and every rank gets the same number of batches
    (the remainder is dropped in training, so DDP never waits on a missing batch). ``epoch_fn``
    gives the epoch of each pass (``ShuffleEpochs.next_shuffle_epoch``: survives a resume); without
    it the dataset counts its own passes.
    """

    def __init__(self, data: SplitData, spec: FeatureSpec, batch_size: int, shuffle: bool, seed: int, drop_uneven: bool,
                 epoch_fn: Callable[[], int] | None = None):
        super().__init__()
        self.data, self.spec, self.batch_size = data, spec, batch_size
        self.shuffle, self.seed, self.drop_uneven = shuffle, seed, drop_uneven
        self.epoch_fn = epoch_fn
        self.epoch = 0

    @staticmethod
    def _rank_world() -> tuple[int, int]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def _batch_size(self, world: int) -> int:
        """Rows per batch: smaller than asked when the split has fewer batches than ranks, so no
        rank gets an empty loader (Lightning refuses one; small validation splits hit this)."""
        n = len(self.data)
        if -(-n // self.batch_size) >= world:
            return self.batch_size
        return max(1, n // world if self.drop_uneven else -(-n // world))

    def _num_batches(self) -> tuple[int, int, int]:
        rank, world = self._rank_world()
        total = -(-len(self.data) // self._batch_size(world))
        per_rank = total // world if self.drop_uneven else len(range(rank, total, world))
        return rank, world, per_rank

    def __len__(self) -> int:
        return self._num_batches()[2]

    def __iter__(self):
        rank, world, per_rank = self._num_batches()
        n = len(self.data)
        if self.shuffle:
            epoch = self.epoch_fn() if self.epoch_fn is not None else self.epoch
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=gen)
        else:
            order = None
        self.epoch += 1
        bs = self._batch_size(world)
        for j in range(per_rank):
            b = rank + j * world
            lo, hi = b * bs, min((b + 1) * bs, n)
            # Contiguous slices are views (no copy) when not shuffling.
            idx = order[lo:hi] if order is not None else slice(lo, hi)
            yield self.data.features(self.spec, idx), self.data.labels[idx]


class PredictorDataModule(ShuffleEpochs, L.LightningDataModule):
    """Rows of a specstop dataset for one predictor family.

    Args:
        data_dir: the folder ``specstop generate`` wrote (``manifest.json`` + ``shards/``).
        table: ``"tokens"``, ``"mixed"`` or ``"auto"``: hidden-state predictors (SpecDec++, MCSD
            hidden) read the token mixing rows, and ``auto`` raises when a split has none (the
            tokens table pairs the state after X_i with labels of Y_i); distribution predictors
            (DISCO, MCSD top-k) always read ``tokens``. An explicit ``tokens`` is obeyed.
        label: label column; None takes the model's (``PredictorModule.label``). Setting both to
            different values is an error.
        batch_size: rows per training batch (rows are tiny: use thousands).
        eval_batch_size: rows per validation/test batch (default 4 x batch_size).
        seed: shuffling seed (epoch e uses seed + e).
        max_rows: keep at most this many rows per split (first rows; quick experiments).

    Attributes (for ``link_arguments`` - input sizes come from the manifest, not the config):
        k: the dataset's top-k feature size. hidden_size: stored hidden width, or None.
        manifest: the parsed ``manifest.json``.
    """

    def __init__(
        self,
        data_dir: str,
        table: str = "auto",
        label: str | None = None,
        batch_size: int = 4096,
        eval_batch_size: int | None = None,
        seed: int = 0,
        max_rows: int | None = None,
    ) -> None:
        super().__init__()
        if table not in ("auto", "tokens", "mixed"):
            raise UserError(f"table must be 'auto', 'tokens' or 'mixed', got {table!r}")
        check_range("data.batch_size", batch_size, low=1)
        check_range("data.eval_batch_size", eval_batch_size, low=1)
        check_range("data.max_rows", max_rows, low=1)
        self.data_dir = str(data_dir)
        self.table = table
        self.label = label
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or 4 * batch_size
        self.seed = seed
        self.max_rows = max_rows
        self.manifest = read_manifest(self.data_dir)
        # Always before training on it: every shard present, intact (sha256) and from one pair.
        verify_dataset(self.data_dir)
        labels = self.manifest.get("labels", {})
        self.k: int = int(labels.get("topk_k", 10))
        hs = labels.get("hidden_size")
        self.hidden_size: int | None = int(hs) if hs else None
        self.spec: FeatureSpec | None = None
        self.splits: dict[str, SplitData] = {}

    # -- configuration ------------------------------------------------------------------------

    def configure(self, spec: FeatureSpec, label: str) -> None:
        """Set what to read (called from ``setup`` with the model's spec and label, or by hand)."""
        if self.label is not None and self.label != label:
            raise UserError(
                f"data.label={self.label!r} but model.label={label!r}; set the label once (model.label) "
                "or make them equal"
            )
        if self.spec is not None and (self.spec != spec or self.label != label):
            self.splits.clear()  # a different predictor: reload
        self.spec, self.label = spec, label

    def split_rows(self, split: str) -> dict:
        return self.manifest.get("splits", {}).get(split, {})

    def table_for(self, split: str) -> str:
        """Which table ``split`` is read from (see ``table`` in the class docstring)."""
        if self.table != "auto":
            return self.table
        assert self.spec is not None
        if not self.spec.reads_hidden:
            return "tokens"
        if self.split_rows(split).get("mixed", 0) > 0 and self.label in MIXED_LABELS:
            return "mixed"
        # The tokens table holds the draft's state after the *target's* token X_i, while every label
        # there describes the *draft's* token Y_i (and 1 - TV the next position's q): a hidden-state
        # head trained or scored on it learns from misaligned pairs. Never fall back silently.
        why = (f"label {self.label!r} is not in the mixed table (use one of {MIXED_LABELS})"
               if self.label not in MIXED_LABELS else f"split {split!r} has no token-mixing rows")
        raise UserError(
            f"{self.data_dir}: {why}. Hidden-state predictors read the draft's state after the draft token Y_i, "
            "which only the mixed table holds (the tokens table has the state after the target's token X_i, "
            f"misaligned with its labels). Regenerate with labels.mixing.splits including {split!r}, train "
            "with online mixing (configs/train/specdecpp_online_mixing.yaml), or set data.table: tokens to "
            "accept the misaligned pairs explicitly"
        )

    # -- loading ------------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        if self.spec is None:
            module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
            if module is None or not hasattr(module, "predictor"):
                raise RuntimeError(
                    "PredictorDataModule needs the predictor's FeatureSpec: use it with a PredictorModule "
                    "in a Trainer, or call datamodule.configure(spec, label) first"
                )
            self.configure(module.predictor.feature_spec, module.label)
        wanted = {"fit": ("train", "validation"), "validate": ("validation",), "test": ("test",)}.get(
            stage or "", SPLITS
        )
        for split in wanted:
            if split not in self.splits and self.split_rows(split).get("tokens", 1) > 0:
                self.splits[split] = self.load_split(split)
        self.check_disjoint_prompts()

    def load_split(self, split: str, table: str | None = None) -> SplitData:
        """Load one split's feature and label columns into tensors."""
        assert self.spec is not None and self.label is not None
        table = table or self.table_for(split)
        valid = TOKEN_LABELS if table == "tokens" else MIXED_LABELS
        if self.label not in valid:
            raise UserError(f"label {self.label!r} is not a column of the {table!r} table; choose one of {valid}")
        if self.spec.reads_hidden:
            self._check_hidden_states()
            feat_cols = ["hidden"]
        else:
            if self.spec.k > self.k:
                raise UserError(f"predictor reads top-{self.spec.k} but the dataset stores top-{self.k}; set k <= {self.k}")
            feat_cols = ["topk", "entropy"] + (["position"] if self.spec.use_position else [])
            if self.spec.reads_state:
                self._check_hidden_states()
                if table != "tokens":
                    raise UserError("with_state predictors read the tokens table (the state before each token)")
        mapped = [c for c in feat_cols if c == "hidden"]
        cols = list(dict.fromkeys([c for c in feat_cols if c not in mapped] + [self.label, "prompt_id", "position", "split"]))
        arr = load_arrays(self.data_dir, table, split, columns=cols)
        n = len(arr["prompt_id"])
        if n == 0:
            raise UserError(f"split {split!r} of {self.data_dir} has no {table!r} rows")
        bad = arr["split"] != split
        if bad.any():
            raise UserError(
                f"{int(bad.sum())} rows in {split!r} shards say they belong to split {arr['split'][bad][0]!r}; "
                "the dataset is inconsistent - regenerate it"
            )
        keep = slice(0, self.max_rows) if self.max_rows else slice(None)
        columns: dict[str, torch.Tensor | MappedRows] = {}
        for c in mapped:
            rows = MappedRows(load_column_chunks(self.data_dir, table, split, c))
            columns[c] = rows.head(self.max_rows) if self.max_rows else rows
        for c in feat_cols:
            if c in mapped:
                continue
            a = arr[c][keep]
            if c == "topk":
                a = a[:, : self.spec.k]
            columns[c] = torch.from_numpy(np.require(a, requirements=["C", "W"]))  # Arrow buffers are read-only
        if not self.spec.reads_hidden:
            # Distribution features are k + 2 floats a row: assemble them once, so a batch is a
            # single gather (hidden states stay float16 and are cast per batch to halve memory).
            dist_only = dataclasses.replace(self.spec, with_state=False, hidden_size=0)
            columns = {PREBUILT: dist_only.build(**columns)}
            if self.spec.reads_state:
                pos_all = np.asarray(arr["position"], dtype=np.int64)
                prev = previous_row_index(arr["prompt_id"], pos_all)
                hidden = MappedRows(load_column_chunks(self.data_dir, table, split, "hidden"))
                columns[STATE] = PreviousRows(hidden, prev[keep])
        labels = torch.from_numpy(np.asarray(arr[self.label][keep], dtype=np.float32).copy())
        log.info("%s: %d %s rows, label %s (mean %.3f)", split, len(labels), table, self.label, float(labels.mean()))
        return SplitData(
            table=table,
            columns=columns,
            labels=labels,
            prompt_ids=arr["prompt_id"][keep],
            positions=arr["position"][keep].astype(np.int64),
        )

    def _check_hidden_states(self) -> None:
        assert self.spec is not None
        if not self.manifest.get("labels", {}).get("hidden_states") or self.hidden_size is None:
            raise UserError(
                f"{self.data_dir} stores no hidden states, which this predictor reads; regenerate the "
                "dataset with hidden states enabled, or train with online mixing "
                "(configs/train/specdecpp_online_mixing.yaml) which computes them on the fly"
            )
        if self.spec.hidden_size != self.hidden_size:
            raise UserError(
                f"predictor hidden_size {self.spec.hidden_size} != dataset hidden_size {self.hidden_size}; "
                "leave hidden_size unset in the config (it is linked from the manifest)"
            )

    def check_disjoint_prompts(self) -> None:
        """Fail when one prompt id appears in two splits (data_gen assigns each prompt one split)."""
        seen: dict[str, str] = {}
        for split in SPLITS:
            ids = (
                set(self.splits[split].prompt_ids.tolist())
                if split in self.splits
                else set(load_arrays(self.data_dir, "sequences", split, columns=["prompt_id"])["prompt_id"].tolist())
            )
            for pid in ids:
                other = seen.setdefault(pid, split)
                if other != split:
                    raise UserError(
                        f"prompt {pid!r} is in both the {other!r} and {split!r} splits of {self.data_dir}; "
                        "training would leak into evaluation - regenerate the dataset"
                    )

    # -- loaders ------------------------------------------------------------------------------

    def _loader(self, split: str, train: bool) -> DataLoader:
        if split not in self.splits:
            self.splits[split] = self.load_split(split)
        ds = TensorBatches(
            self.splits[split],
            self.spec,
            self.batch_size if train else self.eval_batch_size,
            shuffle=train,
            seed=self.seed,
            drop_uneven=train,
            epoch_fn=self.next_shuffle_epoch if train else None,
        )
        # batch_size=None: the dataset already yields whole batches; workers would only add IPC.
        return DataLoader(ds, batch_size=None, num_workers=0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)

    def summary(self) -> dict:
        """Manifest facts recorded in checkpoints (pair identities, tokenizer, decoding, labels)."""
        m = self.manifest
        pair = m.get("pair", {})
        return {
            "data_dir": str(Path(self.data_dir).resolve()),
            "schema_version": m.get("schema_version"),
            "pair": {
                "name": pair.get("name"),
                "draft": pair.get("draft"),
                "target": pair.get("target"),
                "tokenizer_hash": pair.get("tokenizer_hash"),
            },
            "tokenizer_hash": pair.get("tokenizer_hash"),
            "generation": m.get("generation"),
            "temperature": (m.get("generation") or {}).get("temperature"),
            "labels": m.get("labels"),
            "tables": {s: d.table for s, d in self.splits.items()},
            "rows": {s: len(d) for s, d in self.splits.items()},
        }
