"""A task reads its environment in one place: :mod:`kubeps.runtime.settings` (``TaskSettings.from_env``), and hands
the settings to what it builds. This scan of runtime/'s syntax trees fails on any other read: ``os.environ`` or
``os.getenv`` anywhere, and ``.get(X)``/``[X]`` of any mapping where ``X`` is a pod-contract variable (a ``*_ENV``
constant, ``"KUBEPS_..."`` or ``"TF_CONFIG"``). The few reads that are not task settings are listed below, each with
the number of reads its file makes and why it is not a setting.

And it is read once, where a user's program starts: ``TaskSettings.from_env()`` or ``TFConfig.from_env()`` with
no argument (the process's environment) is called only by the entry points in ``ENTRY_POINTS``, at most
``MAX_FALLBACKS`` of them, each when it was given no settings; everything below them receives the settings object
from its caller."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "runtime"

#: the one module that reads task settings
SETTINGS = "runtime/settings.py"

#: file -> (reads, why they are not task settings)
ALLOWED = {
    "runtime/data/reader_processes.py": (
        5, "a reader child process is started with the whole environment and takes on its parent's (credentials for "
           "s3:// and gs://, malloc tuning): it passes the environment on, it reads no setting from it"),
    "runtime/cli.py": (
        1, "`kubeps local` is where a local job starts: it hands its environment to LocalJobSpec.from_arguments, "
           "which parses the task settings in it once (TaskSettings.from_env) and passes them down"),
    "runtime/local/launcher.py": (
        1, "kubeps local passes its whole environment on to the tasks it starts; the task settings in it are parsed "
           "by TaskSettings.from_env and rendered back by to_env, never read here"),
    "runtime/models/xla.py": (
        1, "XLA_PYTHON_CLIENT_MEM_FRACTION is XLA's own variable, which its GPU client reads when jax creates it: "
           "kubeps writes a GPU worker's memory share there (a write; nothing is read)"),
    "runtime/server/processes.py": (
        1, "a ps task of several processes starts the others with its whole environment, the task settings in it "
           "replaced by theirs (rendered by to_env), as kubeps local does; it reads no setting from it"),
    "runtime/__init__.py": (
        1, "GRPC_VERBOSITY is gRPC's own variable, which its C core reads at `import grpc`: the package sets its "
           "default (ERROR) before any of its modules imports grpc; nothing is read"),
    "runtime/models/keras_layers.py": (
        1, "KERAS_BACKEND is Keras's own variable, which Keras reads when imported: kubeps sets its default (jax)"),
}


#: the most places of runtime/ and operator/ that may read the task's settings from the environment themselves
MAX_FALLBACKS = 3
#: file -> the entry point a user's program calls that reads them when given none
ENTRY_POINTS = {
    "runtime/cluster.py": "TFConfigClusterResolver(): the first thing a task's program builds; it keeps the settings "
                          "it read (resolver.settings) for what the program builds next",
    "runtime/coordinator/strategy.py": "ParameterServerStrategy (the chief), when neither it nor its resolver was "
                                       "given settings",
    "runtime/server/service.py": "Server (a ps or a worker) built by a program without settings",
}
#: the classes whose ``from_env()`` reads the task's settings from the process's environment
_SETTINGS_READERS = ("TaskSettings", "TFConfig")


def settings_fallbacks(source: str) -> list[int]:
    """The lines of ``source`` that read the task's settings from the process's environment: a call of
    ``TaskSettings.from_env()`` or ``TFConfig.from_env()`` without arguments."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Call) and not node.args and not node.keywords
                  and isinstance(node.func, ast.Attribute) and node.func.attr == "from_env"
                  and isinstance(node.func.value, ast.Name) and node.func.value.id in _SETTINGS_READERS)


def _fallbacks() -> dict[str, list[int]]:
    found = {}
    for path in sorted([*RUNTIME.rglob("*.py"), *(REPO / "operator").rglob("*.py")]):
        lines = settings_fallbacks(path.read_text())
        if lines:
            found[path.relative_to(REPO).as_posix()] = lines
    return found


def test_only_the_entry_points_read_the_task_settings_from_the_environment():
    found = _fallbacks()
    assert len(ENTRY_POINTS) <= MAX_FALLBACKS
    assert set(found) <= set(ENTRY_POINTS), (
        f"TaskSettings.from_env() / TFConfig.from_env() outside the entry points (path: lines): "
        f"{ {p: lines for p, lines in found.items() if p not in ENTRY_POINTS} }; take `settings` from the caller")
    assert sum(len(lines) for lines in found.values()) <= MAX_FALLBACKS, found
    assert set(found) == set(ENTRY_POINTS), "an entry point listed here no longer reads them: drop it from the list"


@pytest.mark.parametrize("source,count", [
    ("s = TaskSettings.from_env() if settings is None else settings", 1),
    ("config = TFConfig.from_env()", 1),
    ("s = TaskSettings.from_env(environ)", 0),  # a given mapping: the caller chose the environment
    ("s = TaskSettings.from_env(environ=env)", 0),
    ("s = Settings.from_env()", 0),  # the operator's own settings, read by its entry point
    ("s = settings or strategy.settings", 0),
])
def test_the_fallback_scan(source, count):
    assert len(settings_fallbacks(source)) == count


def _contract_key(node: ast.AST) -> bool:
    """Whether ``node`` names a variable of the pod contract."""
    if isinstance(node, ast.Name):
        return node.id.endswith("_ENV")
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("_ENV")
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value.startswith("KUBEPS_") or node.value == "TF_CONFIG")


def environment_reads(source: str) -> list[int]:
    """The lines of ``source`` that read the environment (see the module docstring)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "environb", "getenv", "getenvb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and _contract_key(node.args[0]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _contract_key(node.slice):
            lines.append(node.lineno)
    return sorted(lines)


def _reads() -> dict[str, list[int]]:
    found = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        lines = environment_reads(path.read_text())
        if lines and relative != SETTINGS:
            found[relative] = lines
    return found


def test_only_the_settings_module_reads_task_settings():
    unexpected = {path: lines for path, lines in _reads().items() if path not in ALLOWED}
    assert not unexpected, (
        f"environment reads outside {SETTINGS} (path: lines): {unexpected}; add the variable to the pod contract "
        "and TaskSettings and pass the settings in")


def test_the_allowed_reads_are_exactly_those_listed():
    counts = {path: len(lines) for path, lines in _reads().items() if path in ALLOWED}
    assert counts == {path: count for path, (count, _) in ALLOWED.items()}


def test_the_settings_module_does_read_the_environment():
    assert environment_reads((REPO / SETTINGS).read_text())


@pytest.mark.parametrize("source", [
    "import os\nos.environ.get('HOME')",
    "import os\nos.getenv('X')",
    "from kubeps.runtime.contract import CPUS_ENV\ndef f(env):\n    return env.get(CPUS_ENV)",
    "from kubeps.runtime import contract\ndef f(env):\n    return env[contract.LOGDIR_ENV]",
    "def f(env):\n    return env.get('KUBEPS_LOGDIR')",
    "def f(env):\n    return env['TF_CONFIG']",
])
def test_the_scan_sees_each_kind_of_read(source):
    assert environment_reads(source)


@pytest.mark.parametrize("source", [
    "def f(env):\n    env['KUBEPS_LOGDIR'] = '/logs'",  # writing a child's environment is no read
    "def f(d):\n    return d.get('name')",
    "from kubeps.runtime.contract import CPUS_ENV\nMESSAGE = f'set {CPUS_ENV}'",
])
def test_the_scan_ignores_what_is_no_read(source):
    assert not environment_reads(source)
