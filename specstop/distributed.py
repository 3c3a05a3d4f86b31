"""Where this process sits in a multi-process launch (torchrun, SLURM via torchrun, Lightning).

Only environment variables are read (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), so data
generation can shard work without a process group, and nothing here imports Lightning.
"""

from __future__ import annotations

import os

from specstop.errors import UserError


def local_rank() -> int | None:
    """``$LOCAL_RANK`` (this process's index on its node), or None outside a launcher."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value not in (None, "") else None


def rank_local_device(device: str | None) -> str | None:
    """The device this rank should use: ``cuda`` without an index becomes ``cuda:$LOCAL_RANK``.

    ``torchrun --nproc-per-node N`` starts N processes on one node; without this every one of
    them would load its models onto ``cuda:0``. An explicit index (``cuda:1``), ``cpu``, or no
    launcher leaves ``device`` as given; ``None`` (auto) becomes the rank's GPU when CUDA is
    available.

    Raises:
        UserError: ``LOCAL_RANK`` names a GPU this node does not have.
    """
    rank = local_rank()
    if rank is None:
        return device
    if device is None:
        import torch

        if not torch.cuda.is_available():
            return device
        device = "cuda"
    if device != "cuda":
        return device
    import torch

    count = torch.cuda.device_count()
    if rank >= count:
        raise UserError(
            f"LOCAL_RANK={rank} but this node has {count} CUDA device(s); start at most {count} processes "
            "per node (torchrun --nproc-per-node) or pass --device cpu"
        )
    torch.cuda.set_device(rank)
    return f"cuda:{rank}"


def device_count(devices, accelerator: str | None = None) -> int:
    """How many processes a Lightning ``trainer.devices`` value starts on one node.

    Args:
        devices: an int, a list of indices, a string (``"2"``, ``"0,1"``, ``"auto"``, ``"-1"``) or None.
        accelerator: ``trainer.accelerator`` (``"cpu"`` makes ``auto``/``-1`` one device).
    """
    if devices is None or devices == "auto" or str(devices) == "-1":
        if (accelerator or "auto") == "cpu":
            return 1
        import torch

        return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text)
