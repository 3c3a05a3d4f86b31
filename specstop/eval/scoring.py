"""Apply a stopping predictor to every row of a replay split, in big batches.

For ``dist`` predictors each token row and rollout step is scored on its own distribution
features (topk, entropy, position). For ``hidden`` predictors each row is scored on its ``hidden``
(the draft state after that row's token is fed in), rollout steps on theirs, and each mismatch
additionally on ``mismatch_hidden`` (the state after d_m). Which score a policy step then uses is
replay's business (dist: token j; hidden: token j - 1; see docs/design.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specstop.errors import UserError
from specstop.eval.episodes import ReplayData
from specstop.models.checkpoint import load_predictor
from specstop.pair.identity import check_same_pair
from specstop.train.mapped import previous_row_index

BATCH = 65536


@torch.no_grad()
def predict(predictor, x: np.ndarray | torch.Tensor, batch: int = BATCH) -> np.ndarray:
    """``[B, input_dim]`` -> ``[B]`` float64 acceptance probabilities (sigmoid of the logit)."""
    predictor.eval()
    x = torch.as_tensor(x)
    out = np.empty(len(x), dtype=np.float64)
    for i in range(0, len(x), batch):
        out[i : i + batch] = torch.sigmoid(predictor(x[i : i + batch].float())).double().numpy()
    return out


def score_split(data: ReplayData, data_dir: str | Path, split: str, key: str, predictor) -> None:
    """Score every row of ``split`` with ``predictor`` and store it in ``data`` under ``key``.

    Raises:
        ValueError: a hidden-state predictor on a dataset without stored hidden states (regenerate
            with hidden states), or a width mismatch between predictor and dataset.
    """
    from specstop.data_gen.storage import load_arrays, read_manifest

    spec = predictor.feature_spec
    man = read_manifest(data_dir)
    order = getattr(data, "_order", None)
    if order is None:
        raise ValueError("score_split needs ReplayData from load_replay_data (it keeps the row order)")
    r_order = getattr(data, "_rollout_order", np.zeros(0, dtype=np.int64))
    r_steps = getattr(data, "_rollout_steps", np.zeros(0, dtype=np.int64))
    if spec.kind == "hidden":
        _check_hidden(man, data_dir, key, spec)
        tok = load_arrays(data_dir, "tokens", split, columns=["hidden"])
        row = predict(predictor, spec.build(hidden=torch.from_numpy(tok["hidden"][order])))
        rollout = mismatch = None
        if len(r_order):
            roll = load_arrays(data_dir, "rollouts", split, columns=["hidden", "mismatch_hidden"])
            flat, _ = roll["hidden"]
            h = spec.hidden_size
            rollout = predict(predictor, torch.from_numpy(flat.reshape(-1, h)[r_steps]))
            mismatch = predict(predictor, torch.from_numpy(roll["mismatch_hidden"][r_order]))
        data.add_scores(key, "hidden", row, rollout, mismatch)
        return
    k = spec.k
    if spec.reads_state:
        _check_hidden(man, data_dir, key, spec)
    tok = load_arrays(data_dir, "tokens", split,
                      columns=["topk", "entropy", "position"] + (["hidden"] if spec.reads_state else []))
    pos = tok["position"][order].astype(np.int64)
    state = None
    if spec.reads_state:
        # The state that produced q_i is the one after X_{i-1}: the previous row of the same response
        # (the one rule training uses, train.mapped.previous_row_index); position 0 gets zeros.
        hid = tok["hidden"][order]
        prev = previous_row_index(np.repeat(np.arange(data.num_prompts), data.lengths), pos)
        state = np.zeros_like(hid)
        state[prev >= 0] = hid[prev[prev >= 0]]
        state = torch.from_numpy(state)
    x = spec.build(
        topk=torch.from_numpy(tok["topk"][order]),
        entropy=torch.from_numpy(tok["entropy"][order]),
        position=torch.from_numpy(pos),
        hidden=state,
    )
    row = predict(predictor, x)
    rollout = None
    if len(r_order):
        roll = load_arrays(data_dir, "rollouts", split, columns=["topk", "entropy", "position"] + (
            ["hidden", "mismatch_hidden"] if spec.reads_state else []))
        topk_flat, _ = roll["topk"]
        ent_flat, ent_off = roll["entropy"]
        width = int(man["labels"]["topk_k"])
        topk = topk_flat.reshape(-1, width)[r_steps]
        ent = ent_flat[r_steps]
        # Rollout step t of mismatch m sits at response position m + t.
        lens = np.diff(ent_off)
        step_pos = np.repeat(roll["position"].astype(np.int64), lens) + (
            np.arange(len(ent_flat)) - np.repeat(ent_off[:-1], lens) + 1
        )
        r_state = None
        if spec.reads_state:
            # Step 1 of a rollout was drawn from q after d_m (state: mismatch_hidden); step t > 1
            # from q after rollout token t - 1 (that step's stored hidden).
            h_flat = roll["hidden"][0].reshape(-1, spec.hidden_size)
            first = np.zeros(len(ent_flat), dtype=bool)
            first[ent_off[:-1][lens > 0]] = True
            owner = np.repeat(np.arange(len(lens)), lens)
            st = np.empty_like(h_flat)
            st[~first] = h_flat[np.flatnonzero(~first) - 1]
            st[first] = roll["mismatch_hidden"][owner[first]]
            r_state = torch.from_numpy(st[r_steps])
        x = spec.build(
            topk=torch.from_numpy(topk[:, :k] if topk.shape[1] >= k else topk),
            entropy=torch.from_numpy(ent),
            position=torch.from_numpy(step_pos[r_steps]),
            hidden=r_state,
        )
        rollout = predict(predictor, x)
    data.add_scores(key, "dist", row, rollout, None)


def _check_hidden(man: dict, data_dir, key: str, spec) -> None:
    if not man["labels"].get("hidden_states"):
        raise UserError(
            f"predictor {key!r} reads draft hidden states but {data_dir} has none; regenerate with "
            "hidden states (labels.hidden_states: true) or use a dist predictor"
        )
    if int(man["labels"]["hidden_size"]) != spec.hidden_size:
        raise UserError(
            f"predictor {key!r} expects hidden size {spec.hidden_size} but {data_dir} stores "
            f"{man['labels']['hidden_size']}: it was trained on another draft model"
        )


# Default stopping rule per predictor family (docs/design.md "Policies").
FAMILY_RULES = {
    "disco_ffn": ("below", "dist"),
    "mcsd_topk_mlp": ("below", "dist"),
    "mcsd_hidden_mlp": ("below", "hidden"),
    "specdecpp_resnet": ("cumprod", "hidden"),
}


def family_rule(family: str, feature_kind: str) -> tuple[str, str]:
    """(rule, reads) for a family; unknown families: ``below`` on their feature kind."""
    return FAMILY_RULES.get(family, ("below", feature_kind))


def score_checkpoints(data: ReplayData, data_dir, split: str, checkpoints: dict, *,
                      recorded_in: str | None = None, recorded: frozenset | set = frozenset()) -> tuple[dict, dict]:
    """Score ``data`` with every ``{name: checkpoint path}``.

    A predictor the user named (``--checkpoint``, or a tuned file's ``checkpoints``) must load and
    score: a missing path, an export folder, a tuned.json or a bare ``.safetensors`` file is an
    error naming it, never a "skipped" line in a log that leaves it out of the results. A checkpoint
    whose path the tuned file ``recorded_in`` holds (its names in ``recorded``) is named as that
    file's entry, with the flag that replaces it.

    Returns:
        (info: {name: {"family", "rule", "reads", "path", "label"}}, skipped: {} - kept for callers).

    Raises:
        UserError: a checkpoint cannot be loaded or scored on this data.
    """
    from specstop.data_gen.storage import read_manifest

    data_pair = read_manifest(data_dir).get("pair")
    info, skipped = {}, {}
    for name, path in checkpoints.items():
        try:
            predictor, meta = load_predictor(path)
        except (FileNotFoundError, IsADirectoryError, ValueError, KeyError, ImportError) as err:
            raise _unusable(name, path, err, recorded_in if name in recorded else None) from None
        # Scores of a predictor on another pair's features would be meaningless, not just worse.
        check_same_pair(
            (meta.get("dataset") or {}).get("pair") if isinstance(meta.get("dataset"), dict) else None, data_pair,
            what=f"checkpoint {name}={path} was trained on data from another model pair than {data_dir} holds",
            fix="use data generated with the pair it was trained for, or retrain it on this pair's data",
        )
        try:
            score_split(data, data_dir, split, name, predictor)
        except UserError:
            raise  # the data does not fit the predictor (no hidden states, another width): it says so
        except (FileNotFoundError, IsADirectoryError, ValueError, KeyError, ImportError) as err:
            raise _unusable(name, path, err, recorded_in if name in recorded else None) from None
        family = meta.get("family") or predictor.family
        rule, reads = family_rule(family, predictor.feature_spec.kind)
        info[name] = {
            "family": family,
            "rule": rule,
            "reads": reads,
            "path": str(path),
            "label": meta.get("label"),
        }
    return info, skipped


def _unusable(name: str, path, err: BaseException, recorded_in: str | None = None) -> UserError:
    if recorded_in is not None:
        return UserError(
            f"{recorded_in} names checkpoint {name}={path}, which cannot be used: {err} (give the checkpoint that "
            f"was tuned with --checkpoint {name}=PATH, or re-run specstop tune)"
        )
    return UserError(
        f"checkpoint {name}={path} cannot be used: {err} (a predictor named explicitly must load; give the .ckpt "
        "that `specstop train` printed, or drop it)"
    )


def parse_checkpoint_args(items) -> dict:
    """``["name=PATH", "PATH"]`` -> ``{name: PATH}`` (a bare path is named after its file stem)."""
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        if not name or not path:
            raise UserError(f"--checkpoint {item!r}: use NAME=PATH")
        out[name] = path
    return out
