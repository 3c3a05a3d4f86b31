#!/usr/bin/env python3
"""Each rank's device under a real launcher: what ``specstop.distributed.rank_local_device`` gives every rank.

Run under torchrun (real processes, a gloo process group, no mocks)::

    python -m torch.distributed.run --nproc-per-node 2 scripts/rank_device_check.py

Every rank asks for ``cuda`` (and, to show the rule leaves them, ``cpu`` and ``None``); the answers are
gathered over gloo and rank 0 prints them as one JSON line: ``[{"rank", "local_rank", "cuda": device or
the refusal, "cpu", "auto", "visible_gpus", "allocated_on"}, ...]``. ``allocated_on`` is where a tensor
made on the rank's device landed (CUDA only). ``tests/test_scale_out.py`` runs it on CPUs and
``make gpu-check`` on a GPU machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def main() -> int:
    import torch
    import torch.distributed as dist

    from specstop.distributed import rank_local_device
    from specstop.errors import UserError

    def ask(device):
        try:
            return rank_local_device(device)
        except UserError as err:
            return f"refused: {err}"

    dist.init_process_group("gloo")
    try:
        rec = {"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]),
               "visible_gpus": torch.cuda.device_count(), "cpu": ask("cpu"), "auto": ask(None), "cuda": ask("cuda")}
        if str(rec["cuda"]).startswith("cuda:"):
            rec["allocated_on"] = str(torch.ones(1, device=rec["cuda"]).device)
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, rec)
        if dist.get_rank() == 0:
            print(json.dumps(out))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
