"""Data flows one way: every import in ``src/lmforge`` goes down the layers of the house
(``docs/architecture.md``, "Layers"), never up or sideways into another package of the same layer.

Checked twice: statically (every import statement, also those inside functions and under
``TYPE_CHECKING``, against :data:`LAYERS`, with the short list of :data:`EXCEPTIONS`; and no import cycle
among the modules) and at run time (in a fresh interpreter, importing the modules layer by layer from the
bottom loads no module of a higher layer; importing every corpus module and every registered stage loads
nothing of ``data/`` or ``train/``). The engine names no objective: ``train/build.py`` and
``train/modules.py`` import nothing of ``posttrain/``; the post-training objectives sit above ``train/``
and are loaded by name from their entry points (:func:`test_the_build_imports_no_objective`).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import lmforge
from lmforge.corpus.stages import registry

SRC = Path(lmforge.__file__).parent

# The layers, lowest first. A module is placed by the longest name that matches it (``probes.auto_batch``
# before ``probes``). It may import any module of a lower layer and its own package's modules of its own
# layer; another package of its own layer (they are independent) or anything higher, never.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "progress"),  # the progress reporter: standard library only, so every phase may show it
    ("config",),
    ("recipe", "precision"),
    # the tokenizer: `lmforge data sweep` (corpus/) and training's data preparation (data/) count tokens with it
    ("tokenizer",),
    ("corpus",),  # `lmforge data`: never data/ or train/
    ("data",),
    ("model", "optim"),  # the model never imports optimizers, nor optimizers the model
    ("parallel",),
    ("plan",),  # pure formulas: nothing that allocates
    # what the loop uses and which imports nothing of train/: post-training's records, loaders, losses and
    # what its objectives share (posttrain/run.py); the validation loops; the measurements the build, its callbacks and
    # the planner call
    (
        "posttrain",
        "evaluate.validation",
        "evaluate.task_files",
        "evaluate.task_yaml",
        "evaluate.loglikelihood",
        "evaluate.scoring",
        "evaluate.task_scoring",
        "probes.auto_batch",
        "probes.peak_flops",
        "probes.activation_memory",
    ),
    ("train",),  # the loop; it names no objective (see test_the_build_imports_no_objective)
    # the post-training objectives: each registers itself for the build (the entry-point group
    # lmforge.objectives, train/modules.py::objective_for) with its training module; above the loop, below the
    # evaluation of finished runs (which builds their modules)
    (
        "posttrain.objective_sft",
        "posttrain.objective_dpo",
        "posttrain.objective_reward",
        "posttrain.objective_rl",
    ),
    ("evaluate", "report"),  # run folders read back: scored, loaded, drawn
    # short real runs through the one build path, runs started from runs, experiments (arms x seeds of
    # ordinary runs, read back), and the planner's request (which measures a CPU's peak FLOP/s as a run's
    # MFU does)
    ("probes", "posttrain.finetune", "hf", "experiment", "plan.request"),
    ("web",),
    ("cli",),
    ("__main__",),  # python -m lmforge
)

# (importing module, imported module): allowed although it goes up, each inside a function only (so that
# importing the first module never loads the second), each with its reason.
EXCEPTIONS = {
    # a `perplexity` stage scores with a trained run, loaded by `lmforge eval`'s loader (not a copy of it)
    ("lmforge.corpus.lm_scorer", "lmforge.evaluate.run_loading"),
    # rl.reward = "run:PATH" finds and reads the reward run's checkpoint with training's own checkpoint code
    # (evaluate/run_loading.py, the eval loader, would close a cycle: it builds RL objectives itself)
    ("lmforge.posttrain.reward_model_reward", "lmforge.train.checkpoint"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    base = SRC.parent / name.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> Iterator[tuple[int, str, bool]]:
    """``(line, module, at module level)`` for every lmforge import in ``path``; ``from P import n`` gives
    ``P.n`` when that is a module. At module level: run when the module is imported (not in a function)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    in_functions = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        for name in names:
            if name.startswith("lmforge.") or name == "lmforge":
                yield node.lineno, name, id(node) not in in_functions


def _type_checking_lines(path: Path) -> set[int]:
    """Lines of imports under ``if TYPE_CHECKING:`` (never run)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)}
    return lines


def _place(module: str) -> tuple[int, str]:
    """``(layer, the matching name)`` of a module, by the longest name of :data:`LAYERS` that matches. A
    package whose modules sit in several layers (``probes``) is itself in the lowest of them: importing
    any of its modules runs its ``__init__``."""
    rel = module.removeprefix("lmforge.")
    found = [
        (len(name), layer, name)
        for layer, names in enumerate(LAYERS)
        for name in names
        if rel == name or rel.startswith(name + ".")
    ]
    assert found, f"{module} is in no layer of LAYERS: add its package there"
    _, layer, name = max(found)
    inside = [i for i, names in enumerate(LAYERS) for n in names if n.startswith(rel + ".")]
    return min([layer, *inside]), name


def _package(module: str) -> str:
    return module.split(".")[1]


def _files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _all_imports() -> Iterator[tuple[Path, int, str, str, bool]]:
    for path in _files():
        me = _module_name(path)
        if me == "lmforge":
            continue
        for line, module, top in _imports(path):
            if module != "lmforge":
                yield path, line, me, module, top


def test_every_import_goes_down_the_layers():
    bad, used = [], set()
    for path, line, me, module, top in _all_imports():
        (mine, _), (theirs, _) = _place(me), _place(module)
        if theirs < mine or (theirs == mine and _package(module) == _package(me)):
            continue
        pair = next((p for p in EXCEPTIONS if me == p[0] and module.startswith(p[1])), None)
        if pair is not None and not top:
            used.add(pair)
            continue
        where = "up" if theirs > mine else "sideways"
        bad.append(f"{path.relative_to(SRC)}:{line}: {module} ({where}: layer {theirs} from layer {mine})")
    assert not bad, "imports against the layers (tests/test_import_direction.py::LAYERS):\n" + "\n".join(bad)
    assert used == EXCEPTIONS, f"exceptions no longer needed: {EXCEPTIONS - used}"


def test_layers_name_real_packages_and_cover_every_module():
    for names in LAYERS:
        for name in names:
            assert _is_module(f"lmforge.{name}"), f"LAYERS names {name}, which is no module of lmforge"
    for path in _files():
        if _module_name(path) != "lmforge":
            _place(_module_name(path))


def test_no_import_cycles():
    """No cycle among the modules, counting the imports inside functions (only ``TYPE_CHECKING`` imports,
    never run, are left out)."""
    graph: dict[str, set[str]] = {}
    for path in _files():
        me, hidden = _module_name(path), _type_checking_lines(path)
        graph.setdefault(me, set())
        for line, module, _ in _imports(path):
            if line not in hidden and module not in (me, "lmforge"):
                graph[me].add(module)
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
    assert order.index("lmforge.corpus.readers") < order.index("lmforge.data.sources")
    assert order.index("lmforge.train.build") < order.index("lmforge.probes.lr_find")


def test_importing_layer_by_layer_loads_nothing_above():
    """In a fresh interpreter, the modules of each layer are imported from the bottom up; after each
    layer, every lmforge module loaded belongs to that layer or a lower one."""
    plan = [[] for _ in LAYERS]
    for path in _files():
        name = _module_name(path)
        if name not in ("lmforge", "lmforge.__main__"):
            plan[_place(name)[0]].append(name)
    code = (
        "import importlib, json, sys\n"
        f"plan = {plan!r}\n"
        "seen = []\n"
        "for names in plan:\n"
        "    for name in names:\n"
        "        importlib.import_module(name)\n"
        "    seen.append(sorted(m for m in sys.modules if m.startswith('lmforge.')))\n"
        "print(json.dumps(seen))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.splitlines()[-1])
    above = [
        f"after layer {layer} {LAYERS[layer]}: {m} (layer {_place(m)[0]})"
        for layer, modules in enumerate(loaded)
        for m in modules
        if _place(m)[0] > layer
    ]
    assert not above, "\n".join(above)
    assert "lmforge.train.build" in loaded[LAYERS.index(("train",))]


def test_the_build_imports_no_objective():
    """The engine names no objective: ``train/build.py`` and ``train/modules.py`` import nothing of
    ``posttrain/`` (no statement, also none inside a function), no module of ``train/`` imports a
    post-training objective (:data:`LAYERS` puts them above it), and in a fresh interpreter importing every
    module of ``train/`` loads none; each is loaded by its name's first lookup, from its entry point."""
    for name in ("build", "modules"):
        found = [m for _, m, _ in _imports(SRC / "train" / f"{name}.py") if m.startswith("lmforge.posttrain")]
        assert found == [], f"train/{name}.py imports {found}"
    objectives = ("sft", "dpo", "reward", "rl")
    assert all(_place(f"lmforge.posttrain.objective_{o}")[0] > LAYERS.index(("train",)) for o in objectives)
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import lmforge.train\n"
        "for m in pkgutil.walk_packages(lmforge.train.__path__, 'lmforge.train.'):\n"
        "    importlib.import_module(m.name)\n"
        "before = sorted(m for m in sys.modules if m.startswith('lmforge.posttrain.objective_'))\n"
        "from lmforge.config import Config\n"
        "from lmforge.train.modules import objective_for\n"
        "objective = objective_for(Config.model_validate({'train': {'objective': 'dpo'}}))\n"
        "print(json.dumps([before, type(objective).__module__]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, module = json.loads(out.stdout.splitlines()[-1])
    assert before == [] and module == "lmforge.posttrain.objective_dpo"


def test_importing_corpus_loads_no_training_module():
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import lmforge.corpus\n"
        "from lmforge.corpus.stages import registry\n"
        "for m in pkgutil.walk_packages(lmforge.corpus.__path__, 'lmforge.corpus.'):\n"
        "    importlib.import_module(m.name)\n"
        "for name in registry.STAGES:\n"
        "    registry.stage_class(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "lmforge.corpus.pipeline" in loaded and "lmforge.corpus.stages.dedup_minhash" in loaded
    assert "lmforge.corpus.sweep" in loaded
    assert [m for m in loaded if m.startswith(("lmforge.data", "lmforge.train"))] == []
    outside = [t for t in registry.STAGES.values() if not t.startswith("lmforge.corpus.stages.")]
    assert not outside, f"registered stages outside lmforge.corpus.stages: {outside}"
