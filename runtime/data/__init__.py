"""Distributed input: ``Dataset`` and its sources, transformations and file readers, ``InputContext`` and
auto-sharding across workers with TensorFlow's ``AutoShardPolicy``.

Rule: runs wherever a dataset function runs (a worker, or the chief for a local dataset); imports only
:mod:`kubeps.runtime.util` and :mod:`kubeps.runtime.errors`.
"""

from kubeps.runtime.data.dataset import *  # noqa: F403 - the package's names are the module's public ones
from kubeps.runtime.data.dataset import __all__  # noqa: F401
