"""Rebuilding an optimizer or a learning-rate schedule from its JSON config: each refusal names the class, the
config and what is allowed. (Their hyperparameters are checked by :func:`kubeps.runtime.checks.check`.)"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from kubeps.runtime.errors import RuntimeConfigError

__all__ = ["build"]


def build(kind: str, registry: Mapping[str, type], config: Any) -> Any:
    """Shared body of ``optimizer_from_config`` and ``schedule_from_config``."""
    if not isinstance(config, Mapping) or "class_name" not in config:
        raise RuntimeConfigError(f"{kind} config", config, "a mapping {'class_name': ..., 'config': {...}}")
    name = config["class_name"]
    if name not in registry:
        raise RuntimeConfigError(f"{kind} class_name", name, f"one of {sorted(registry)}")
    cls = registry[name]
    args = config.get("config", {}) or {}
    if not isinstance(args, Mapping):
        raise RuntimeConfigError(f"{name} config", args, "a mapping of arguments")
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]  # cls is a class: its own __init__
    accepted = [p for p in params if p != "self"]
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise RuntimeConfigError(f"{name} config", unknown, f"the arguments of {name}: {accepted}")
    missing = [p for p, spec in params.items()
               if p != "self" and spec.default is inspect.Parameter.empty and p not in args]
    if missing:
        raise RuntimeConfigError(f"{name} config", dict(args), f"all of the required arguments {missing}")
    return cls(**args)
