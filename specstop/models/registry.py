"""One registry mapping predictor family names to classes.

Data loading, training, replay, export and the runtime all look families up here, and every
family declares its features and default label on the class, so there is one source of truth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specstop.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from specstop.models.base import StoppingPredictor

_REGISTRY: dict[str, type[StoppingPredictor]] = {}


def register_predictor(name: str):
    """Class decorator: register a :class:`StoppingPredictor` subclass under ``name``."""

    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"predictor name {name!r} is already registered to {_REGISTRY[name].__name__}")
        cls.family = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _ensure_builtin() -> None:
    # Importing the family modules runs their @register_predictor decorators.
    from specstop.models import disco, mcsd, specdecpp, tree_node  # noqa: F401


def predictor_names() -> list[str]:
    _ensure_builtin()
    return sorted(_REGISTRY)


def get_predictor_class(name: str) -> type[StoppingPredictor]:
    _ensure_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown predictor family {name!r}; valid names: {', '.join(sorted(_REGISTRY))}") from None


def build_predictor(name: str, **config) -> StoppingPredictor:
    """Instantiate family ``name`` from keyword config (see each family's dataclass config)."""
    cls = get_predictor_class(name)
    return cls(predictor_config(cls.config_cls, config, family=name))


def predictor_config(config_cls: type, config: dict, *, family: str):
    """``config_cls`` from a dict, every value type-checked (one line naming the key otherwise).

    Values given as text on a command line (``--model.init_args.predictor_config.with_state true``
    arrives as the string ``"true"``) are read as YAML scalars first, so they become the bool or
    number the field wants instead of a truthy string."""
    import dataclasses
    import typing

    import yaml

    from specstop.config_io import dataclass_from_dict

    hints = typing.get_type_hints(config_cls)
    fixed = {}
    for key, value in config.items():
        if isinstance(value, str) and hints.get(key) is not str and key in hints:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                pass
        fixed[key] = value
    if not dataclasses.is_dataclass(config_cls):  # pragma: no cover - every family has a dataclass
        return config_cls(**fixed)
    return dataclass_from_dict(config_cls, fixed, where="predictor_config.", source=f"family {family}")
