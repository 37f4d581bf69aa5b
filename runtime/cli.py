"""The ``kubeps`` command.

- ``kubeps local SCRIPT [--ps N] [--workers M] [--evaluator] [--evaluator-grace S] [--restart] [--host H]
  [--port-base P] [--insecure-plaintext] [--no-metrics] [-- ARGS...]``: run a training program as a local cluster of processes (see :mod:`kubeps.runtime.local.launcher`).
- ``kubeps local scale --workers N [--pid PID] [--timeout S]``: change the worker count of a running
  ``kubeps local`` (see :mod:`kubeps.runtime.local.scaling`).
- ``kubeps export CHECKPOINT --model FILE.py:FUNCTION --output DIR [--format keras|onnx ...] [-- ARGS...]``: the
  latest checkpoint as a ``.keras`` file and an ONNX model for serving (see :mod:`kubeps.runtime.models.export`).
- ``kubeps operator [ARGS...]``: the Kubernetes operator (``kubeps.operator.main``; needs ``kubeps[operator]``).
- ``kubeps version``: the installed version.

Usage errors exit with status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Sequence

from kubeps.runtime.checks import NonNegativeSeconds, Port, PositiveInt, allowed_text, check
from kubeps.runtime.contract import VERSION
from kubeps.runtime.errors import RuntimeConfigError

__all__ = ["build_parser", "main"]

USAGE_ERROR = 2


def _version() -> str:
    """This kubeps's version and, when the installed distribution's metadata says another (an editable install
    whose source moved on), that one too."""
    try:
        installed = version("kubeps")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return f"{VERSION} (not installed)"
    return VERSION if installed == VERSION else f"{VERSION} (installed distribution: {installed})"


class _Parser(argparse.ArgumentParser):
    """argparse, but ``error()`` raises instead of exiting so :func:`main` can return the status."""

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]  # raises instead (NoReturn)
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


class _Exit(Exception):
    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def _flag(flag: str, type_: Any, parse: Callable[[str], Any], bounds: str | None = None) -> Callable[[str], Any]:
    """An argparse type for ``flag``: the text parsed with ``parse`` and checked as ``type_``, a type of the one
    validation dialect (:mod:`kubeps.runtime.checks`; :class:`~kubeps.runtime.local.spec.LocalJobSpec` checks the
    same value again, naming its field). Refused as ``FLAG must be ALLOWED, got TEXT``, where ALLOWED is what the
    type allows, or ``bounds`` for a value that parses but lies outside them."""
    allowed = allowed_text(type_)

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be {allowed}, got {text!r}") from None
        try:
            return check(flag, value, type_)
        except RuntimeConfigError:
            raise argparse.ArgumentTypeError(f"{flag} must be {bounds or allowed}, got {text}") from None

    return convert


def _count(flag: str) -> Callable[[str], int]:
    return _flag(flag, PositiveInt, int, bounds=">= 1")


def _seconds(flag: str) -> Callable[[str], float]:
    return _flag(flag, NonNegativeSeconds, float)


def _host(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--host must be an IP address to bind the tasks to (e.g. 127.0.0.1 or ::1), got {text!r}"
        ) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kubeps",
        description="TensorFlow-style parameter-server training: local clusters and the Kubernetes operator.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    local = sub.add_parser(
        "local",
        help="run a training script as a local cluster (chief, ps, workers[, evaluator])",
        description=(
            "Start the chief, parameter servers and workers (and the evaluator) of a job as local processes, each "
            "running 'python SCRIPT ARGS' with its own TF_CONFIG on free loopback ports, and stream their output "
            "prefixed with [type-index]. The exit status is the chief's; when the chief exits the other tasks are "
            "stopped. Arguments after '--' are passed to the script."
        ),
        usage=(
            "kubeps local SCRIPT [--ps N] [--workers M] [--evaluator] [--evaluator-grace S] [--restart] [--host H] "
            "[--port-base P] [--insecure-plaintext] [--no-metrics] [-- ARGS...]"
        ),
    )
    local.add_argument("script", help="the training program (the same file runs as every task)")
    local.add_argument("--ps", type=_count("--ps"), default=2, help="parameter servers (default 2)")
    local.add_argument("--workers", type=_count("--workers"), default=2, help="workers (default 2)")
    local.add_argument("--evaluator", action="store_true", help="also run a sidecar evaluator task")
    local.add_argument(
        "--ps-processes", type=_count("--ps-processes"), default=None,
        help=("server processes per ps task, each on its own port and core (default: KUBEPS_PS_PROCESSES, else the "
              "ps task's CPU share: the machine's CPUs divided by ps + workers)"),
    )
    local.add_argument("--host", type=_host, default="127.0.0.1", help="address the tasks listen on (default 127.0.0.1)")
    local.add_argument(
        "--port-base", type=_flag("--port-base", Port, int), default=None,
        help="use consecutive ports from this one (default: free ports)",
    )
    local.add_argument(
        "--grace-period",
        type=_seconds("--grace-period"),
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping tasks (default 5)",
    )
    local.add_argument(
        "--evaluator-grace",
        type=_seconds("--evaluator-grace"),
        default=60.0,
        help=(
            "after the chief succeeds, seconds the evaluator may take to evaluate the final checkpoint and exit "
            "before it is stopped (default 60; 0: stop it with the others)"
        ),
    )
    local.add_argument(
        "--insecure-plaintext",
        action="store_true",
        help=(
            "talk plaintext between the tasks (the job token still authenticates); by default they use mutual TLS "
            "with a throw-away CA made for this run"
        ),
    )
    local.add_argument(
        "--no-metrics",
        action="store_true",
        help=(
            "record and serve no Prometheus metrics; by default every task serves them on a free port of its own "
            "(the start lines name the URLs)"
        ),
    )
    local.add_argument("--python", default=sys.executable, help="interpreter for the tasks (default: this one)")
    local.add_argument(
        "--restart",
        action="store_true",
        help=(
            "behave like the operator: restart a failed worker or evaluator; a failed ps restarts the ps and the "
            "chief, which resumes from its latest checkpoint; a chief killed by a signal or exiting with a code "
            ">= 128 is restarted"
        ),
    )
    parser.set_defaults(_local_parser=local)

    export = sub.add_parser(
        "export",
        help="export the latest checkpoint for serving: a .keras file and an ONNX model",
        description=(
            "Read the latest checkpoint of CHECKPOINT (a directory of ckpt-N checkpoints, or one of them) from its "
            "files, all shards, and write the model with its trained weights for a serving system that has no "
            "kubeps: DIR/model.keras (a Keras model, KubepsEmbedding layers as plain Embedding layers) and "
            "DIR/model.onnx (run by onnxruntime). --model names a function that builds the model the way training "
            "built it, called with the arguments after '--': a Keras model (functional or Sequential) or a "
            "kubeps.runtime.models.export.ServingFunction (a model written with jax.numpy; ONNX only)."
        ),
        usage="kubeps export CHECKPOINT --model FILE.py:FUNCTION --output DIR [--format keras|onnx ...] [-- ARGS...]",
    )
    export.add_argument("checkpoint", help="a checkpoint directory (ckpt-N) or a directory of them (the latest is used)")
    export.add_argument("--model", required=True, metavar="FILE.py:FUNCTION",
                        help="the function that builds the model (e.g. examples/keras/train.py:serving_model), or "
                             "MODULE:FUNCTION")
    export.add_argument("--output", required=True, metavar="DIR", help="folder for model.keras and model.onnx")
    export.add_argument("--format", nargs="+", choices=("keras", "onnx"), default=None,
                        help="what to write (default: keras and onnx for a Keras model, onnx for a ServingFunction)")
    export.add_argument("--prefix", default="model/",
                        help="checkpoint name prefix of a Keras model's weights (default 'model/', as fit's callbacks)")
    parser.set_defaults(_export_parser=export)

    sub.add_parser(
        "operator",
        help="run the Kubernetes operator (needs kubeps[operator]); arguments go to the operator",
        add_help=False,
    )
    sub.add_parser("version", help="print the kubeps version")
    sub.add_parser("validate", help="check PSTrainingJob manifests before applying them (kubeps validate FILE...)")
    return parser


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _run_operator(argv: list[str]) -> int:
    try:
        from kubeps.operator.main import main as operator_main  # noqa: PLC0415 - kopf loads for `kubeps operator` alone
    except ImportError as err:
        sys.stderr.write(
            f"kubeps operator: the operator is not available ({err}); install kubeps[operator] "
            f"(pip install 'kubeps[operator]')\n"
        )
        return 1
    result = operator_main(argv)
    return int(result or 0)


VALIDATE_USAGE = (
    "usage: kubeps validate [--validate=strict|warn|ignore] FILE...\n\nCheck PSTrainingJob manifests as kubectl "
    "and the API server would (YAML as kubectl reads it, schema, unknown fields, the CRD's CEL rules) and print every "
    "error.\n--validate: what an unknown field is, as kubectl's flag says: strict (the default) an error, warn a "
    "warning, ignore nothing.\nExit status: 0 valid, 1 invalid, 2 usage error.\n"
)


def _run_validate(argv: list[str]) -> int:
    """``kubeps validate FILE...``: the checks are :mod:`kubeps.operator.api.validate`'s; this reads and prints."""
    if any(arg in ("-h", "--help") for arg in argv):
        sys.stdout.write(VALIDATE_USAGE)
        return 0
    parser = argparse.ArgumentParser(prog="kubeps validate", add_help=False)
    parser.add_argument("--validate", default="strict", choices=("strict", "warn", "ignore"))
    parser.add_argument("files", nargs="*")
    try:
        args = parser.parse_args(argv)
    except SystemExit:  # argparse said what is wrong on stderr
        return USAGE_ERROR
    mode, files = args.validate, args.files
    if not files:
        sys.stderr.write(VALIDATE_USAGE)
        return USAGE_ERROR
    try:
        from kubeps.operator.api import validate  # noqa: PLC0415 - loads the CRD models, only here
    except ImportError as err:
        sys.stderr.write(f"kubeps validate: not available ({err}); install kubeps[validate]\n")
        return USAGE_ERROR
    missing = validate.missing_dependency()
    if missing:
        sys.stderr.write(f"kubeps validate: not available ({missing})\n")
        return USAGE_ERROR
    texts = []
    for name in files:
        try:
            with open(name, encoding="utf-8") as f:
                texts.append((name, f.read()))
        except (OSError, UnicodeDecodeError) as err:
            sys.stderr.write(f"kubeps validate: cannot read {name}: {getattr(err, 'strerror', None) or err}\n")
            return USAGE_ERROR
    status, lines = validate.check_files(texts, mode.capitalize())
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return status


def _run_local(args: argparse.Namespace, script_args: list[str]) -> int:
    """``kubeps local``: the flags as a :class:`~kubeps.runtime.local.spec.LocalJobSpec` with the task settings of
    this environment, run by :func:`~kubeps.runtime.local.launcher.run_local` (``--restart``: by a
    :class:`~kubeps.runtime.local.restarting.RestartingLocalCluster`)."""
    from kubeps.runtime.local.errors import LauncherError, PortBaseError  # noqa: PLC0415 - only `kubeps local` needs it
    from kubeps.runtime.local.launcher import LocalCluster, run_local  # noqa: PLC0415
    from kubeps.runtime.local.restarting import RestartingLocalCluster  # noqa: PLC0415
    from kubeps.runtime.local.spec import LocalJobSpec  # noqa: PLC0415

    local_parser: argparse.ArgumentParser = args._local_parser
    if not os.path.exists(args.script):
        local_parser.error(f"script file not found: {args.script}")
    if not os.path.isfile(args.script):
        local_parser.error(f"script must be a file, got a directory: {args.script}")
    try:
        spec = LocalJobSpec.from_arguments(
            args.script, script_args, os.environ, num_ps=args.ps, num_workers=args.workers,
            evaluator=args.evaluator, host=args.host, port_base=args.port_base, python=args.python,
            grace_period=args.grace_period, evaluator_grace=args.evaluator_grace, tls=not args.insecure_plaintext,
            metrics=not args.no_metrics, ps_processes=args.ps_processes,
        )
        return run_local(spec, cluster_factory=RestartingLocalCluster if args.restart else LocalCluster)
    except PortBaseError as err:
        local_parser.error(f"--port-base must be in 1..{err.highest} for {err.ports} tasks, got {err.value}")
    except (LauncherError, RuntimeConfigError) as err:  # a bad task setting in the environment, ports in use, ...
        local_parser.error(str(err))
    return USAGE_ERROR  # pragma: no cover - error() raises


def _load_builder(spec: str, parser: argparse.ArgumentParser):
    import importlib  # noqa: PLC0415 - only `kubeps export` loads user code
    import importlib.util  # noqa: PLC0415

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        parser.error(f"--model must be FILE.py:FUNCTION or MODULE:FUNCTION, got {spec!r}")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                parser.error(f"--model {spec!r}: file not found: {where}")
            # as `python FILE.py` would: the file's folder first on sys.path, for the modules beside it
            sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
            module_spec = importlib.util.spec_from_file_location("kubeps_export_model", where)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)  # as a module, not __main__: a guarded program does not run
        else:
            module = importlib.import_module(where)
    except SystemExit as exit_:
        parser.error(f"--model {spec!r}: importing {where} ran the program (it exited with status {exit_.code}): "
                     "kubeps export imports the file as a module, so put what runs a task under "
                     "`if __name__ == \"__main__\":`")
    builder = getattr(module, name, None)
    if not callable(builder):
        parser.error(f"--model {spec!r}: {where} has no function {name!r}")
    return builder


def _call_builder(builder: Any, script_args: list[str], parser: argparse.ArgumentParser) -> Any:
    """The model: ``builder(script_args)`` (the arguments after ``--``), or ``builder()`` for a function that takes
    no argument (a ``build_model()`` written for the training program)."""
    import inspect  # noqa: PLC0415 - only `kubeps export` loads user code

    try:
        takes_none = not inspect.signature(builder).parameters
    except (TypeError, ValueError):  # a builtin or C callable: call it as documented
        takes_none = False
    if takes_none and script_args:
        parser.error(f"--model's function {builder.__name__}() takes no arguments; got {script_args} after --")
    return builder() if takes_none else builder(script_args)


def _run_export(args: argparse.Namespace, script_args: list[str]) -> int:
    from kubeps.runtime.checkpoint.format import CheckpointError  # noqa: PLC0415 - only `kubeps export` needs it
    from kubeps.runtime.models import export  # noqa: PLC0415

    parser: argparse.ArgumentParser = args._export_parser
    try:
        checkpoint = export.resolve_checkpoint(args.checkpoint)
        model = _call_builder(_load_builder(args.model, parser), script_args, parser)
        is_function = isinstance(model, export.ServingFunction)
        formats = args.format or (["onnx"] if is_function else ["keras", "onnx"])
        if is_function and "keras" in formats:
            parser.error(f"--format keras: {args.model} builds a ServingFunction (a jax.numpy model), which has no "
                         "Keras form; allowed: onnx")
        print(f"exporting {checkpoint}")
        tables = export.dynamic_tables(checkpoint)
        if tables:  # rows by key have no place in a fixed-shape serving model: said, not silently dropped
            print(f"skipping dynamic embedding table(s) {', '.join(tables)}: a serving model holds fixed-shape "
                  "weights only; CheckpointReader(path).table(name).export() gives a table's keys and rows")
        if "keras" in formats:
            print("wrote " + export.export_keras(model, checkpoint, os.path.join(args.output, "model.keras"),
                                                 prefix=args.prefix))
        if "onnx" in formats:
            print("wrote " + export.export_onnx(model, checkpoint, os.path.join(args.output, "model.onnx"),
                                                prefix=args.prefix))
    except (CheckpointError, RuntimeConfigError) as err:
        sys.stderr.write(f"kubeps export: {err}\n")
        return 1
    return 0


def _run_local_scale(argv: list[str]) -> int:
    """``kubeps local scale --workers N [--pid PID] [--timeout S]``: scale a running ``kubeps local``."""
    from kubeps.runtime.local.scaling import find_run_dir, request_scale  # noqa: PLC0415 - only this command needs it

    parser = _Parser(
        prog="kubeps local scale",
        description=("Change the worker count of a running 'kubeps local' (the only one running, or --pid): new "
                     "workers start and the chief dispatches to them, or the highest workers finish their last "
                     "function and stop; the chief is not restarted. Waits until it is done."),
    )
    parser.add_argument("--workers", type=_count("--workers"), required=True, help="workers from now on")
    parser.add_argument("--pid", type=_count("--pid"), default=None,
                        help="the launcher's pid (kubeps local's own), when several runs are going")
    parser.add_argument("--timeout", type=_seconds("--timeout"), default=120.0,
                        help="seconds to wait for the scaling to finish (default 120)")
    try:
        args = parser.parse_args(argv)
        try:
            run_dir = find_run_dir(args.pid)
        except LookupError as err:
            parser.error(str(err))
        try:
            result = request_scale(run_dir, args.workers, timeout=args.timeout)
        except TimeoutError as err:
            print(f"kubeps local scale: {err}", file=sys.stderr)
            return 1
        print(f"kubeps local scale: {result['message']} ({result['seconds']:.1f} s)")
        return 0 if result.get("generation") is not None else 1
    except _Exit as exit_:
        return exit_.status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kubeps`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["local", "scale"] and not os.path.isfile("scale"):  # a script named "scale" still runs
        return _run_local_scale(argv[2:])
    if argv and argv[0] == "operator":  # everything after it belongs to the operator, options included
        return _run_operator(argv[1:])
    if argv and argv[0] == "validate":
        return _run_validate(argv[1:])
    parser = build_parser()
    own, script_args = _split_script_args(argv)
    try:
        args, unknown = parser.parse_known_args(own)
        if unknown and args.command == "local":
            # the usual slip: `kubeps local x.py --steps 5`, the script's own flags without '--' before them
            args._local_parser.error(
                f"unrecognized arguments: {' '.join(unknown)}; arguments for the script go after '--': "
                f"kubeps local {args.script} [OPTIONS] -- {' '.join(unknown)}"
            )
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if script_args and args.command not in ("local", "export"):
            parser.error(f"'--' arguments are only for 'kubeps local' and 'kubeps export', got {script_args}")
        if args.command == "version":
            print(f"kubeps {_version()}")
            return 0
        if args.command == "export":
            return _run_export(args, script_args)
        return _run_local(args, script_args)
    except _Exit as exit_:
        return exit_.status


if __name__ == "__main__":
    sys.exit(main())
