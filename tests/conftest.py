"""Shared fixtures: a small real corpus (standard-library sources) and tiny configs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.config import Config, ModelConfig
from lmforge.corpus.pystdlib import stdlib_root
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.recipe import load_config
from lmforge.train.launch import train

CORPUS_MODULES = [
    "abc.py", "bisect.py", "calendar.py", "colorsys.py", "copy.py", "csv.py", "difflib.py", "fnmatch.py",
    "fractions.py", "functools.py", "glob.py", "heapq.py", "keyword.py", "linecache.py", "numbers.py",
    "operator.py", "queue.py", "random.py", "sched.py", "shlex.py", "statistics.py", "string.py",
    "textwrap.py", "timeit.py", "tokenize.py", "types.py", "uuid.py", "weakref.py",
]  # fmt: skip


def model_of(cfg: ModelConfig, vocab_size: int, seq_len: int, **kw) -> Transformer:
    """A model built and initialised (from the global RNG) on the CPU, as tests use it."""
    model = Transformer(cfg, vocab_size, seq_len, **kw)
    model.init_weights()
    return model


def loss_of(model: Transformer, *args, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, targets) of ``model`` on ``args = (inputs, targets[, doc_ids])``."""
    return NextTokenLoss(model, chunk)(*args)


def same_value(a, b) -> bool:
    """Bitwise equality of checkpoint values: tensors by ``torch.equal``, anything else by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.fixture(autouse=True)
def cli_logging():
    """The CLI points lmforge's logger at the (captured) stderr of the moment; give it back afterwards.
    For every test: a test that runs the CLI in this process would otherwise leave the logger writing to
    its own captured stream, closed once it ends, and the next test's logs would be logging errors."""
    logger = logging.getLogger("lmforge")
    handlers, level = logger.handlers[:], logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.fixture
def estimate_command(capsys, cli_logging):
    """``lmforge estimate ARGS`` in this process: ``(exit code, stdout, stderr)``."""
    from lmforge.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as done:
            main(["estimate", *args])
        out = capsys.readouterr()
        return done.value.code, out.out, out.err

    return run


def _workers() -> int:
    """Test processes sharing the machine: pytest-xdist's worker count (``-n N``), else 1."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def suite_threads() -> int:
    """Torch threads of the tests: ``LMFORGE_TEST_THREADS`` where set (a positive integer; every set is meant
    to pass at 1 and at 2), else 2, the cores of the CI machine, shared among pytest-xdist's workers (the
    README's ``-n 2``: one thread each, so that two workers do not oversubscribe two cores)."""
    value = os.environ.get("LMFORGE_TEST_THREADS", str(max(1, 2 // _workers())))
    if not value.isdigit() or int(value) < 1:
        raise pytest.UsageError(f"LMFORGE_TEST_THREADS={value!r}: set it to a positive integer, e.g. 1 or 2")
    return int(value)


# child processes (lmforge CLI runs, torchrun workers) follow the tests' threads where they were chosen
if "LMFORGE_TEST_THREADS" in os.environ or _workers() > 1:
    os.environ["OMP_NUM_THREADS"] = str(suite_threads())


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(suite_threads())


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A JSONL corpus of a few standard-library modules, one document per function-sized chunk."""
    root = tmp_path_factory.mktemp("corpus")
    lines = []
    for name in CORPUS_MODULES:
        text = (stdlib_root() / name).read_text(encoding="utf-8")
        for i, chunk in enumerate(text.split("\ndef ")):
            if len(chunk) > 40:
                lines.append(json.dumps({"id": f"{name}#{i}", "text": ("def " if i else "") + chunk}))
    (root / "stdlib.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The built-in default run (``lmforge train``, about 13 minutes on 2 cores), trained once per session
    for the slow tests that need it: ``(run folder, finished process)``."""
    root = tmp_path_factory.mktemp("default")
    run = root / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "lmforge", "train", "--run-dir", str(run)],
        cwd=root,
        capture_output=True,
        text=True,
    )
    return run, proc


def tiny_overrides(corpus_dir: Path, cache_dir: Path) -> dict:
    return {
        "data.sources": [{"path": str(corpus_dir / "stdlib.jsonl")}],
        "data.cache_dir": str(cache_dir),
        "data.vocab_size": 512,
        "data.seq_len": 32,
        "data.val_fraction": 0.1,
        "model.n_layers": 2,
        "model.d_model": 32,
        "model.n_heads": 4,
        "train.steps": 20,
        "train.micro_batch_size": 4,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": 10,
        "train.eval_tokens": 1024,
        "train.checkpoint_interval": 10,
        "train.log_interval": 5,
        "train.sample_tokens": 8,
        "schedule.warmup": 5,
        "optim.lr": 3e-3,
    }


def cli_args(over: dict) -> list[str]:
    """``--key=value`` command-line overrides for a dict of dotted overrides (as ``tiny_overrides``)."""
    args = []
    for k, v in over.items():
        if k == "data.sources":
            args.append(f"--{k}=[{{path='{v[0]['path']}'}}]")
        elif isinstance(v, str):
            args.append(f"--{k}={v}")
        else:
            args.append(f"--{k}={json.dumps(v)}")
    return args


@pytest.fixture
def tiny_config(corpus_dir: Path, tmp_path: Path) -> Config:
    return load_config(None, tiny_overrides(corpus_dir, tmp_path / "data"))


def train_tiny(root: Path) -> Path:
    """A tiny run that learns a small text (``bisect.py`` of the standard library, about 3 KB, cut at its
    functions) nearly by heart in 60 steps (seconds): checkpoints at steps 30 and 60. Returns the run."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "stdlib.jsonl").write_text(
        "".join(
            json.dumps({"id": f"bisect.py#{i}", "text": t}) + "\n" for i, t in enumerate(training_texts())
        )
    )
    over = tiny_overrides(corpus, root / "data") | {
        "data.vocab_size": 384,
        "model.d_model": 64,
        "train.micro_batch_size": 16,
        "train.steps": 60,
        "train.checkpoint_interval": 30,
        "train.eval_interval": 0,
        "train.sample_tokens": 0,
        "optim.lr": 1e-2,
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits on a shared machine
    try:
        train(load_config(None, over), root / "run", progress_bar=False)
    finally:
        torch.set_num_threads(threads)
    return root / "run"


def training_texts() -> list[str]:
    text = (stdlib_root() / "bisect.py").read_text(encoding="utf-8")
    return [("def " if i else "") + chunk for i, chunk in enumerate(text.split("\ndef ")) if len(chunk) > 40]


@pytest.fixture(scope="session")
def scorer_run(tmp_path_factory) -> Path:
    """The tiny run of :func:`train_tiny`, trained once for every test that scores with a model."""
    return train_tiny(tmp_path_factory.mktemp("scorer_run"))


def moe_overrides_tiny(corpus_dir: Path, cache_dir: Path) -> dict:
    """A tiny MoE recipe (4 experts, 2 per token, both blocks MoE, the Switch loss and the z-loss on,
    every step logged, a checkpoint at the end)."""
    return tiny_overrides(corpus_dir, cache_dir) | {
        "model.moe.experts": 4,
        "model.moe.top_k": 2,
        "model.moe.aux_loss": 0.01,
        "model.moe.z_loss": 0.001,
        "train.steps": 12,
        "train.log_interval": 1,
        "train.eval_interval": 6,
        "train.checkpoint_interval": 12,
        "train.sample_tokens": 0,
    }


@pytest.fixture(scope="session")
def moe_run(corpus_dir: Path, tmp_path_factory) -> Path:
    """A finished tiny MoE run (:func:`moe_overrides_tiny`), trained once per session (seconds):
    ``RUNS/moe``."""
    root = tmp_path_factory.mktemp("moe_runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(
            load_config(None, moe_overrides_tiny(corpus_dir, root / "data")),
            root / "runs" / "moe",
            progress_bar=False,
        )
    finally:
        torch.set_num_threads(threads)
    return root / "runs" / "moe"


# ---- the web app in a real browser (tests/test_web_*.py) ----------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package (`apt-get install chromium`), as .ci/run installs it
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium driven by Playwright; the tests skip when either is missing (README: browser
    tests)."""
    playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[dev]' installs it")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} missing: apt-get install chromium (what .ci/run does)")
    with playwright_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def serve():
    """``serve(runs_dir, poll_ms=300) -> base URL``: the web app on a free local port until the test ends."""
    from contextlib import ExitStack

    from lmforge.web.app import create_app
    from lmforge.web.server import running

    with ExitStack() as stack:

        def start(runs_dir: Path, poll_ms: int = 300) -> str:
            return stack.enter_context(running(create_app(Path(runs_dir), poll_ms)))

        yield start


@pytest.fixture
def page(browser):
    """A fresh browser page; at the end of the test, no console error and no uncaught page error may have
    happened on it."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    p = context.new_page()
    errors: list[str] = []
    p.on(
        "console",
        lambda msg: errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None,
    )
    p.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    p.errors = errors
    yield p
    context.close()
    assert not errors, f"errors in the browser: {errors}"


def renders(page) -> int:
    """How many renders the page finished (``<body data-renders>``, counted by static/common.js)."""
    return int(page.evaluate("document.body.dataset.renders"))


def wait_render(page, after: int = 0, timeout_ms: int = 20000) -> None:
    """Wait until the page finished more than ``after`` renders."""
    page.wait_for_function(f"Number(document.body.dataset.renders) > {after}", timeout=timeout_ms)


def figure(page, key: str) -> float:
    """The exact figure behind the element with ``data-key=key`` (its ``data-value``)."""
    return float(page.get_attribute(f"[data-key='{key}']", "data-value"))


def screenshot(page, name: str, tmp_path: Path) -> Path:
    """A full-page PNG of ``page``: into ``$LMFORGE_SCREENSHOTS/<name>.png`` when that is set (how
    docs/visual-tools/ is made), else into ``tmp_path``."""
    import os

    folder = Path(os.environ.get("LMFORGE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.png"
    page.screenshot(path=str(out), full_page=True)
    return out


def estimate_cli(capsys, *argv: str, part: str | None = "estimate"):
    """``lmforge estimate ARGV --json`` run in-process: its ``part`` (default the estimate), or the whole
    object with ``part=None``. What the planner pages are compared against."""
    from lmforge.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["estimate", *argv, "--json"])
    assert exc.value.code in (0, None)
    out = json.loads(capsys.readouterr().out)
    return out if part is None else out[part]


# ---- the fast set's time budget (tests/README.md) -----------------------------------------------------

FAST_SET = "not slow and not distributed"  # pyproject's addopts: the README's test command
FAST_TEST_LIMIT_S = 30.0
_test_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """Every test's setup + call + teardown, the shared fixtures it was the first to build included."""
    _test_seconds[report.nodeid] = _test_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """A warning line for each test of the fast set over its per-test limit (the other sets have none)."""
    if config.getoption("markexpr") != FAST_SET:
        return
    for nodeid, seconds in sorted(_test_seconds.items(), key=lambda x: -x[1]):
        if seconds > FAST_TEST_LIMIT_S:
            terminalreporter.write_line(
                f"WARNING: {nodeid} took {seconds:.0f} s, over the fast set's {FAST_TEST_LIMIT_S:.0f} s a "
                "test: make it smaller or mark it slow (tests/README.md)"
            )
