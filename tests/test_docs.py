"""The documents are tested: every code block of README.md and docs/*.md runs, every path, link and dotted name
they give exists, and every module of the package is named in its package's docstring (the design map).

[Note: how a block runs]
The fenced blocks are collected from the Markdown. A block runs by its language:

- ``python``: ``exec`` in a fresh namespace, in a temporary working directory, with the process's environment
  restored afterwards; a traceback names the Markdown file and line.
- ``bash``: line by line (``\\`` continuations joined, comments dropped). A ``python -m MODULE ARGS`` line runs in
  this interpreter (``runpy``, with ``sys.argv`` set; exit status 0 passes), any other line through ``bash``.
- ``yaml``: a LightningCLI configuration, parsed by the GPT example's CLI with ``--print_config``: every
  ``class_path`` resolves and its ``init_args`` match the class's signature.
- ``text``: not code (diagrams, output); any other language, or none, fails: name it.

HTML comments right above a fence (blank lines between them allowed) mark it, one ``key: value`` each:

- ``<!-- not-run: REASON -->``: not run; the reason is required (say where it is tested instead).
- ``<!-- ranks: 2 -->``: a ``python`` block run on that many processes, each with a gloo process group of its
  own unless the block starts one itself (``init_process_group``), as under torchrun. All blocks of one rank
  count run in one launch (``lightning_haiscale.testing.run_distributed``), one after another, each with a fresh
  group on a fresh port and a shared temporary folder; after a failure the later ones are reported as not run.
- ``<!-- setup: model, x -->``: the block starts with these names defined (tests/docs_setup.py).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch.distributed import TCPStore

import lightning_haiscale
from lightning_haiscale.hfreduce import abort_job
from tests.distributed import run_distributed
from tests.docs_setup import setup_names

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash", "yaml"}
NOT_CODE = {"text"}
MARKER = re.compile(r"^\s*<!--\s*([\w-]+)\s*:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass
class Block:
    path: Path
    line: int  # of the first line of code, 1-based
    lang: str
    code: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def ranks(self) -> int:
        return int(self.markers.get("ranks", "1"))

    @property
    def setup(self) -> list[str]:
        return [name.strip() for name in self.markers.get("setup", "").split(",") if name.strip()]


def _markers(lines: list[str], fence: int) -> dict[str, str]:
    """The ``<!-- key: value -->`` comments right above line ``fence`` (blank lines between allowed)."""
    found: dict[str, str] = {}
    i = fence - 1
    while i >= 0 and (not lines[i].strip() or MARKER.match(lines[i])):
        if match := MARKER.match(lines[i]):
            found[match[1]] = match[2].strip()
        i -= 1
    return found


def collect(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening[1], opening[2]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
        blocks.append(Block(path, i + 2, lang, code + "\n", _markers(lines, i)))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in collect(path)]
RUNNABLE = [b for b in BLOCKS if b.lang in RUN and "not-run" not in b.markers]


def _problems(block: Block) -> list[str]:
    found = []
    if block.lang not in RUN | NOT_CODE:
        found.append(f"language {block.lang!r}: name one of {sorted(RUN | NOT_CODE)}")
    for key, value in block.markers.items():
        if key not in ("not-run", "ranks", "setup"):
            found.append(f"unknown marker {key!r} (not-run, ranks, setup)")
        elif not value:
            found.append(f"marker {key!r} without a value (not-run needs its reason)")
    if "ranks" in block.markers and not (block.markers["ranks"].isdigit() and int(block.markers["ranks"]) >= 2):
        found.append(f"ranks: {block.markers['ranks']!r} is not a count of 2 or more processes")
    if block.ranks > 1 and block.lang != "python":
        found.append("ranks: only python blocks run on several processes")
    return [f"{block.label}: {problem}" for problem in found]


def test_every_block_is_marked_well() -> None:
    assert DOCUMENTS[1:], "docs/ holds no page"
    problems = [problem for block in BLOCKS for problem in _problems(block)]
    assert not problems, "\n".join(problems)


# ---- running the blocks -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _isolated(folder: Path) -> Iterator[None]:
    """The block's working directory and environment; both restored after (a Trainer sets MASTER_PORT)."""
    cwd, environ, argv = os.getcwd(), dict(os.environ), sys.argv
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv = argv


def _exec_python(code: str, line: int, filename: str, namespace: dict[str, Any]) -> None:
    """Runs ``code`` so that a traceback names the Markdown file and line."""
    exec(compile("\n" * (line - 1) + code, filename, "exec"), namespace)


def _commands(code: str) -> list[str]:
    lines = re.sub(r"\\\n\s*", " ", code).splitlines()  # continuations joined
    return [shlex.join(words) for words in (shlex.split(line, comments=True) for line in lines) if words]


def _run_module(module: str, args: list[str]) -> None:
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"python -m {module} {shlex.join(args)} exited with {exit_.code}"


def _run_bash(block: Block) -> None:
    for command in _commands(block.code):
        words = shlex.split(command)
        if words[:2] == ["python", "-m"]:
            with contextlib.redirect_stdout(io.StringIO()):
                _run_module(words[2], words[3:])
            continue
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(["bash", "-ec", command], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{block.label}: {command}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"


def _run_yaml(block: Block, folder: Path) -> None:
    config = folder / "config.yaml"
    config.write_text(block.code)
    with contextlib.redirect_stdout(io.StringIO()):
        _run_module("examples.gpt.train", ["--config", str(config), "--print_config"])


def _run_ranked(rank: int, world_size: int, blocks: list[tuple[str, str, int, list[str]]],
                folders: list[str]) -> list[tuple[str, str | None]]:  # fmt: skip
    """On each rank: the blocks in turn, each as a script under torchrun would run (see [Note: how a block runs]).

    A control store (rank 0's, its port sent over the launcher's group) carries each block's port, picked by rank 0
    when the block starts (other jobs on the machine take ports too), and each rank's outcome: after a failure on
    any rank, no rank starts another block. A failing rank aborts the engines its peers may be waiting in; a peer
    waiting in gloo gives up after ``BLOCK_TIMEOUT``.
    """
    control = _control_store(rank, world_size)
    outcomes: list[tuple[str, str | None]] = []
    failed = ""
    for i, ((label, code, line, setup), folder) in enumerate(zip(blocks, folders, strict=True)):
        if failed:
            outcomes.append((label, f"not run: {failed} failed first"))
            continue
        if dist.is_initialized():
            dist.destroy_process_group()
        if rank == 0:
            control.set(f"port/{i}", str(find_free_network_port()))
        os.environ["MASTER_PORT"] = control.get(f"port/{i}").decode()
        outcome = None
        try:
            with _isolated(Path(folder)):
                if "init_process_group(" not in code:
                    dist.init_process_group("gloo", timeout=BLOCK_TIMEOUT)
                _exec_python(code, line, label.rsplit(":", 1)[0], setup_names(setup))
        except BaseException as error:
            outcome = traceback.format_exc()
            abort_job(error)
        outcomes.append((label, outcome))
        control.set(f"outcome/{i}/{rank}", "ok" if outcome is None else "failed")
        try:
            control.wait([f"outcome/{i}/{r}" for r in range(world_size)])
            others = [control.get(f"outcome/{i}/{r}").decode() for r in range(world_size)]
        except RuntimeError:  # a peer still inside the block (its wait ends at BLOCK_TIMEOUT)
            others = ["failed"]
        failed = label if "failed" in others else ""
    return outcomes


BLOCK_TIMEOUT = timedelta(seconds=60)


def _control_store(rank: int, world_size: int) -> TCPStore:
    """Rank 0's store, its port (bound at once, so no other job takes it) sent over the launcher's group."""
    timeout = 2 * BLOCK_TIMEOUT
    store = None
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
    port = [store.port if store else 0]
    dist.broadcast_object_list(port, src=0)
    return store or TCPStore("127.0.0.1", port[0], world_size, is_master=False, timeout=timeout)


_LAUNCHES: dict[int, dict[str, str | None]] = {}


def _ranked_outcome(block: Block) -> str | None:
    """The outcome of ``block`` from the one launch of every block with its rank count (made on first need)."""
    if block.ranks not in _LAUNCHES:
        group = [b for b in RUNNABLE if b.ranks == block.ranks]
        folders = [tempfile.mkdtemp(prefix="docs-block-") for _ in group]
        work = [(b.label, b.code, b.line, b.setup) for b in group]
        try:
            results = run_distributed(_run_ranked, block.ranks, work, folders, timeout=300)
        except (AssertionError, RuntimeError, TimeoutError) as error:
            results = [[(b.label, f"the launch of {block.ranks} ranks failed: {error}") for b in group]]
        _LAUNCHES[block.ranks] = {}
        for per_rank in results:
            for label, outcome in per_rank:
                _LAUNCHES[block.ranks][label] = _LAUNCHES[block.ranks].get(label) or outcome
    return _LAUNCHES[block.ranks][block.label]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.label for b in RUNNABLE])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    if block.ranks > 1:
        failure = _ranked_outcome(block)
        if failure is not None:
            pytest.fail(f"{block.label} failed on some rank:\n{failure}", pytrace=False)
        return
    with _isolated(tmp_path):
        if block.lang == "python":
            _exec_python(block.code, block.line, str(block.path), setup_names(block.setup))
        elif block.lang == "bash":
            _run_bash(block)
        else:
            _run_yaml(block, tmp_path)


# ---- what the documents name exists ------------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w./-])((?:lightning_haiscale|tests|benchmarks|examples|csrc|docs|\.ci)/[\w./{},*-]*\w)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOTTED = re.compile(r"`(lightning_haiscale(?:\.\w+)+)")  # `lightning_haiscale.X`: X, one capital, a placeholder


def _prose(path: Path) -> str:
    """The document without its code blocks (they are run, not read)."""
    return re.sub(r"^\s*```\S*\n.*?^\s*```\s*$", "", path.read_text(), flags=re.M | re.S)


def _expand(pattern: str) -> list[str]:
    """``examples/plain/{ddp,fsdp}.py`` -> both paths."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [path for part in match[1].split(",") for path in _expand(head + part + tail)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(path).splitlines() if line.startswith("#")}


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_named_paths_exist(path: Path) -> None:
    missing = []
    for token in PATH.findall(_prose(path)):
        for candidate in _expand(token.split("::")[0]):
            if not list(ROOT.glob(candidate.rstrip("/"))) and not (ROOT / candidate).exists():
                missing.append(candidate)
    assert not missing, f"{path.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_links_resolve(path: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"\w+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{path.name} has links to nothing: {broken}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_dotted_names_resolve(path: Path) -> None:
    unresolved = []
    for name in DOTTED.findall(_prose(path)):
        parts = name.split(".")
        if re.fullmatch("[A-Z]", parts[-1]):
            continue
        for cut in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            unresolved.append(name)
    assert not unresolved, f"{path.name} names what does not exist: {unresolved}"


def test_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250, "README.md is the front page: move the detail to a page under docs/"
    assert "make test" in readme and "make demo" in readme


# ---- the design map: each package's docstring names its modules --------------------------------------------------

PACKAGE = Path(lightning_haiscale.__file__).parent
LISTED = re.compile(r"^\s*- ``(\w+)``", re.M)


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_package_docstring_names_every_module(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    modules |= {p.parent.name for p in package.glob("*/__init__.py")}
    listed = set(LISTED.findall(docstring))
    assert modules <= listed, f"{package.name}/__init__.py's docstring lacks a line for {sorted(modules - listed)}"
    assert listed <= modules, f"{package.name}/__init__.py's docstring lists what is gone: {sorted(listed - modules)}"
