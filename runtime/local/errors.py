"""The errors of ``kubeps local``: a cluster that cannot be set up, and a bad argument of one."""

from __future__ import annotations

from kubeps.runtime.errors import RuntimeConfigError

__all__ = ["LauncherArgumentError", "LauncherError", "PortBaseError"]


class LauncherError(RuntimeError):
    """The local cluster could not be set up (bad arguments, ports in use, a script that cannot start)."""


class LauncherArgumentError(RuntimeConfigError, LauncherError):
    """A bad argument of :class:`~kubeps.runtime.local.launcher.LocalCluster` (a field of its
    :class:`~kubeps.runtime.local.spec.LocalJobSpec`): the message names the parameter, its value and what is allowed
    (``kubeps local`` checks its own flags before, and words its errors with them)."""


class PortBaseError(LauncherArgumentError):
    """``port_base`` leaves too few ports above it for the job's ``tasks`` ports: allowed is ``1..highest``."""

    def __init__(self, value: int, highest: int, tasks: int):
        self.highest = highest
        self.tasks = tasks
        super().__init__("port_base", value, f"allowed is a port in 1..{highest}: {tasks} tasks take consecutive ports")

    @property
    def ports(self) -> int:
        """The consecutive ports the job takes (a ps task of several server processes takes one per process)."""
        return 65536 - self.highest

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.value, self.highest, self.tasks))
