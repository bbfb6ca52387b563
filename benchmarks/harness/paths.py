"""Paths as the harness records them: relative to the repository, never one machine's layout.

Why a module of its own: results folders are committed with the repository and read on other
machines, so the command a run records (``command.txt``, ``results.json``, ``results.md``) must
not carry the absolute paths of the machine that ran it. Traces live outside the repository
(``../shared/traces/`` next to it, or wherever ``$KV_PICKER_TRACES`` points), so ``--trace``
also takes a short name looked up there.

How a path is recorded:

- inside the repository or next to it (in its parent folder): relative to the repository root,
  e.g. ``../shared/traces/conversation_trace.jsonl``; recorded commands run from the root;
- a trace file in ``$KV_PICKER_TRACES`` elsewhere: its short name, e.g. ``conversation``;
- anything else (a peer router's binary in its own virtual environment, a scratch folder): its
  file name alone, e.g. ``vllm-router`` (which the harness finds on PATH).

Without a repository (the package installed from a wheel) the working directory stands in
for the repository root.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

TRACES_ENV: Final = "KV_PICKER_TRACES"
"""Environment variable naming the folder where ``--trace NAME`` is looked up."""

_TRACE_FILE_NAMES: Final = ("{name}", "{name}_trace.jsonl", "{name}.jsonl")
# Options whose values are paths; every other absolute path in a command is recorded too.
_PATH_OPTIONS: Final = ("--trace", "--policy", "--out", "--vllm-router-bin", "--sglang-router-bin")


def repository_root() -> Path | None:
    """The source checkout this package runs from, or ``None`` when installed from a wheel."""
    # benchmarks/harness/paths.py; the editable install links here, so resolve() finds the tree.
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def traces_dir(root: Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The folder where short trace names are looked up.

    Args:
        root: The repository root (default: :func:`repository_root`, else the working
            directory).
        environ: Environment (default: ``os.environ``).

    Returns:
        ``$KV_PICKER_TRACES`` if set, else ``shared/traces`` next to the repository.
    """
    configured = (os.environ if environ is None else environ).get(TRACES_ENV)
    if configured:
        return Path(configured).expanduser()
    return _root(root).parent / "shared" / "traces"


def is_trace_name(spec: str) -> bool:
    """Whether a ``--trace`` value can be a short name: one word, and not a file here."""
    return bool(spec) and not any(c in spec for c in ":/\\") and not Path(spec).exists()


def find_trace(name: str, directory: Path) -> Path | None:
    """The trace file a short name stands for.

    Args:
        name: e.g. ``conversation``.
        directory: Where traces live (see :func:`traces_dir`).

    Returns:
        The first of ``NAME``, ``NAME_trace.jsonl`` and ``NAME.jsonl`` in ``directory`` that is
        a file (Mooncake's traces are named ``<name>_trace.jsonl``), or ``None``.
    """
    if not is_trace_name(name):
        return None
    for pattern in _TRACE_FILE_NAMES:
        path = directory / pattern.format(name=name)
        if path.is_file():
            return path
    return None


def portable_path(path: str | Path, root: Path | None = None) -> str:
    """A path as the harness records it (see the module docstring).

    Args:
        path: Absolute, or relative to the working directory.
        root: The repository root (default: :func:`repository_root`, else the working
            directory).

    Returns:
        The path relative to ``root`` when inside ``root``'s parent folder, else its file name.
    """
    return _relative_to_repository(path, root) or Path(path).name


def portable_trace(spec: str, root: Path | None = None, traces: Path | None = None) -> str:
    """A ``--trace`` value as recorded: generators and short names stay, files become portable.

    Args:
        spec: The value given.
        root: The repository root (default: :func:`repository_root`, else the working
            directory).
        traces: Where short names are looked up (default: :func:`traces_dir`).

    Returns:
        A generator spec or short name unchanged; a file relative to the repository root when
        inside its parent folder, else its short name when ``traces`` finds it by one, else
        its file name.
    """
    # A generator spec may hold a slash (llm-d:stages=15x50/3x20), never a leading one.
    if not (os.path.isabs(spec) or Path(spec).is_file()):
        return spec
    relative = _relative_to_repository(spec, root)
    if relative is not None:
        return relative
    file = Path(os.path.abspath(spec))
    traces = traces_dir(root) if traces is None else traces
    if file.parent == Path(os.path.abspath(traces)):
        stems = {file.name.removesuffix("_trace.jsonl"), file.name.removesuffix(".jsonl")}
        for name in sorted(stems, key=len):
            found = find_trace(name, traces)
            if found is not None and found.name == file.name:
                return name
    return file.name


def portable_argv(
    argv: Sequence[str], root: Path | None = None, traces: Path | None = None
) -> list[str]:
    """Command-line arguments as recorded: every path made portable (see the module docstring).

    Args:
        argv: The arguments after the command name, as given.
        root: The repository root (default: :func:`repository_root`, else the working
            directory).
        traces: Where short trace names are looked up (default: :func:`traces_dir`).
    """
    recorded: list[str] = []
    option: str | None = None  # the option whose value comes next
    for token in argv:
        if token.startswith("-") and len(token) > 1:
            name, eq, value = token.partition("=")
            recorded.append(f"{name}={_portable_value(name, value, root, traces)}" if eq else token)
            option = None if eq else name
        else:
            recorded.append(_portable_value(option, token, root, traces))
            option = None
    return recorded


def _portable_value(option: str | None, value: str, root: Path | None, traces: Path | None) -> str:
    # argparse accepts unambiguous prefixes of long options (--tra for --trace).
    matches = [o for o in _PATH_OPTIONS if option and o.startswith(option)]
    full = matches[0] if len(matches) == 1 else None
    if full == "--trace":
        return portable_trace(value, root, traces)
    if full == "--policy":
        # NAME=FILE or FILE; a baseline's name is neither a path nor a file.
        name, eq, file = value.partition("=")
        if eq and _is_path(file):
            return f"{name}={portable_path(file, root)}"
        return portable_path(value, root) if _is_path(value) else value
    if full is not None or os.path.isabs(value):
        return portable_path(value, root) if _is_path(value) else value
    return value


def _is_path(value: str) -> bool:
    return os.sep in value or "/" in value or Path(value).exists()


def _relative_to_repository(path: str | Path, root: Path | None) -> str | None:
    root = _root(root)
    absolute = Path(os.path.abspath(path))
    # A repository at the top of the file system has no parent folder to share.
    scope = root if root.parent == Path(root.anchor) else root.parent
    return os.path.relpath(absolute, root) if absolute.is_relative_to(scope) else None


def _root(root: Path | None) -> Path:
    return root or repository_root() or Path.cwd()
