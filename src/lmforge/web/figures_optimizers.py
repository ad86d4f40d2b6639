"""The optimizer-comparison page's figures: lmforge's own optimizers (``optim/build.py::optimizer_factory``:
torch's SGD / Adam / AdamW, lmforge's Lion and Adafactor) moving one 2-D point ``p = (x, y)`` down a test
function for a number of steps at a constant learning rate, in FP32 on the CPU (deterministic).

One step is what the trainer does for one parameter tensor: ``zero_grad; f(p).backward(); step()``. The
point is a single group ``{"params": [p], "weight_decay": wd}`` as ``param_groups`` gives a decayed matrix.

Test functions (pure torch, elementwise in ``x`` and ``y``; global minimum value ``f*``):

* ``rosenbrock``: ``(1 - x)^2 + 100 (y - x^2)^2``, ``f* = 0`` at (1, 1): a curved narrow valley
* ``rastrigin``: ``20 + x^2 + y^2 - 10 (cos 2 pi x + cos 2 pi y)``, ``f* = 0`` at (0, 0): many local minima
* ``himmelblau``: ``(x^2 + y - 11)^2 + (x + y^2 - 7)^2``, ``f* = 0`` at four points
* ``beale``: ``(1.5 - x + xy)^2 + (2.25 - x + xy^2)^2 + (2.625 - x + xy^3)^2``, ``f* = 0`` at (3, 0.5)
* ``saddle``: ``x^2 - y^2 + y^4 / 4``, a saddle at the origin between two minima ``f* = -1`` at (0, +-sqrt 2)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmforge.config import OptimConfig, SGDConfig
from lmforge.optim.build import optimizer_factory
from lmforge.optim.state_size import state_bytes
from lmforge.plan.memory import optimizer_key, optimizer_state_bytes, state_bytes_per_param

Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def rosenbrock(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(1 - x)^2 + 100 (y - x^2)^2``."""
    return (1 - x) ** 2 + 100 * (y - x**2) ** 2


def rastrigin(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``20 + x^2 + y^2 - 10 (cos 2 pi x + cos 2 pi y)``."""
    return 20 + x**2 + y**2 - 10 * (torch.cos(2 * math.pi * x) + torch.cos(2 * math.pi * y))


def himmelblau(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(x^2 + y - 11)^2 + (x + y^2 - 7)^2``."""
    return (x**2 + y - 11) ** 2 + (x + y**2 - 7) ** 2


def beale(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(1.5 - x + xy)^2 + (2.25 - x + xy^2)^2 + (2.625 - x + xy^3)^2``."""
    return (1.5 - x + x * y) ** 2 + (2.25 - x + x * y**2) ** 2 + (2.625 - x + x * y**3) ** 2


def saddle(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x^2 - y^2 + y^4 / 4``."""
    return x**2 - y**2 + y**4 / 4


@dataclass(frozen=True)
class TestFunction:
    """A landscape: the function, its global minimum value and points, the drawn domain, the default start
    and the default learning rate of each optimizer on it."""

    fn: Fn
    f_min: float
    minima: tuple[tuple[float, float], ...]
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    start: tuple[float, float]
    lr: dict[str, float]


FUNCTIONS: dict[str, TestFunction] = {
    "rosenbrock": TestFunction(
        rosenbrock,
        0.0,
        ((1.0, 1.0),),
        (-2.0, 2.0),
        (-1.0, 3.0),
        (-1.2, 1.0),
        {"sgd": 2e-3, "sgd_momentum": 1e-3, "adam": 0.1, "adamw": 0.1, "adafactor": 0.1, "lion": 0.02},
    ),
    "rastrigin": TestFunction(
        rastrigin,
        0.0,
        ((0.0, 0.0),),
        (-5.12, 5.12),
        (-5.12, 5.12),
        (3.6, -2.3),
        {"sgd": 2e-3, "sgd_momentum": 1e-3, "adam": 0.3, "adamw": 0.3, "adafactor": 0.3, "lion": 0.1},
    ),
    "himmelblau": TestFunction(
        himmelblau,
        0.0,
        ((3.0, 2.0), (-2.805118, 3.131312), (-3.779310, -3.283186), (3.584428, -1.848126)),
        (-5.0, 5.0),
        (-5.0, 5.0),
        (0.0, -4.5),
        {"sgd": 5e-3, "sgd_momentum": 2e-3, "adam": 0.3, "adamw": 0.3, "adafactor": 0.3, "lion": 0.1},
    ),
    "beale": TestFunction(
        beale,
        0.0,
        ((3.0, 0.5),),
        (-4.5, 4.5),
        (-4.5, 4.5),
        (1.0, 1.5),
        {"sgd": 1e-2, "sgd_momentum": 2e-3, "adam": 0.1, "adamw": 0.1, "adafactor": 0.1, "lion": 0.05},
    ),
    "saddle": TestFunction(
        saddle,
        -1.0,
        ((0.0, math.sqrt(2.0)), (0.0, -math.sqrt(2.0))),
        (-2.0, 2.0),
        (-2.5, 2.5),
        (1.5, 0.01),
        {"sgd": 0.05, "sgd_momentum": 0.02, "adam": 0.05, "adamw": 0.05, "adafactor": 0.05, "lion": 0.02},
    ),
}


@dataclass(frozen=True)
class OptimizerChoice:
    """A curve of the page: its key, label, lmforge ``optim.name`` and ``optim.sgd.momentum``."""

    key: str
    label: str
    name: str
    momentum: float = 0.9


OPTIMIZERS: tuple[OptimizerChoice, ...] = (
    OptimizerChoice("sgd", "SGD", "sgd", 0.0),
    OptimizerChoice("sgd_momentum", "SGD + momentum (0.9)", "sgd", 0.9),
    OptimizerChoice("adam", "Adam", "adam"),
    OptimizerChoice("adamw", "AdamW", "adamw"),
    OptimizerChoice("adafactor", "Adafactor", "adafactor"),
    OptimizerChoice("lion", "Lion", "lion"),
)
OPTIMIZER_BY_KEY = {o.key: o for o in OPTIMIZERS}


def optim_config(choice: OptimizerChoice, lr: float, weight_decay: float) -> OptimConfig:
    """The ``[optim]`` table of ``choice`` at ``lr`` (other keys: lmforge's defaults, betas (0.9, 0.95))."""
    return OptimConfig(
        name=choice.name, lr=lr, weight_decay=weight_decay, sgd=SGDConfig(momentum=choice.momentum)
    )


def make_optimizer(cfg: OptimConfig, point: torch.Tensor) -> torch.optim.Optimizer:
    """lmforge's optimizer for ``cfg`` (``optimizer_factory`` on the CPU) over the one-parameter group."""
    make = optimizer_factory(cfg, torch.device("cpu"), compile=False)
    return make([{"params": [point], "weight_decay": cfg.weight_decay}])


def trajectory(fn: Fn, cfg: OptimConfig, start: tuple[float, float], steps: int) -> dict[str, Any]:
    """``steps`` optimizer steps from ``start``: the points ``p_0 .. p_n`` and losses ``f(p_k)`` (cut at the
    first non-finite value: ``diverged_at``), and the optimizer's state bytes after the run."""
    p = torch.tensor(start, dtype=torch.float32, requires_grad=True)
    opt = make_optimizer(cfg, p)
    xs, ys, losses = [start[0]], [start[1]], []
    diverged = None
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = fn(p[0], p[1])
        losses.append(loss.item())
        loss.backward()
        opt.step()
        x, y = p.detach().tolist()
        if not (math.isfinite(x) and math.isfinite(y)):
            diverged = k + 1
            break
        xs.append(x)
        ys.append(y)
    if diverged is None:
        with torch.no_grad():
            losses.append(fn(p[0], p[1]).item())
    return {"x": xs, "y": ys, "loss": losses, "diverged_at": diverged, "state_bytes": state_bytes(opt)}


MATRIX = (4096, 4096)  # the planner's per-parameter bytes are shown for a matrix of this shape


def memory_row(choice: OptimizerChoice, measured_bytes: int, n_params: int = 2) -> dict[str, float]:
    """Optimizer-state bytes per parameter: ``K`` of ``plan.memory.state_bytes_per_param`` (the ZeRO-paper
    convention), the planner's ``optimizer_state_bytes`` for one ``4096 x 4096`` matrix divided by its
    size (with step counters; Adafactor's row + column means), and what this run's optimizer holds
    (``optim.state_size.state_bytes``) per value of the 2-D point (a vector: Adafactor keeps it unfactored)."""
    key = optimizer_key(choice.name, choice.momentum)
    n = math.prod(MATRIX)
    return {
        "k": state_bytes_per_param(key),
        "matrix": optimizer_state_bytes(key, MATRIX, MATRIX, muon=False) / n,
        "measured": measured_bytes / n_params,
        "measured_bytes": measured_bytes,
    }


def landscape(t: TestFunction, n: int = 121) -> dict[str, Any]:
    """The function on an ``n x n`` grid of its domain: ``z[i][j] = f(x_j, y_i)`` and, for the contour,
    ``log10(1 + z - f*)``."""
    x = torch.linspace(*t.x_range, n, dtype=torch.float32)
    y = torch.linspace(*t.y_range, n, dtype=torch.float32)
    yy, xx = torch.meshgrid(y, x, indexing="ij")
    z = t.fn(xx, yy)
    return {"x": x.tolist(), "y": y.tolist(), "z_log": torch.log10(1 + z - t.f_min).tolist()}


def optimizers_figures(
    function: str, start: tuple[float, float], steps: int, lrs: dict[str, float], weight_decay: float
) -> dict[str, Any]:
    """Each optimizer of ``lrs`` (key -> lr) run from ``start`` on ``function``: its trajectory, losses,
    final point and loss, and memory row; and the landscape."""
    t = FUNCTIONS[function]
    runs = []
    for key, lr in lrs.items():
        choice = OPTIMIZER_BY_KEY[key]
        run = trajectory(t.fn, optim_config(choice, lr, weight_decay), start, steps)
        runs.append(
            {
                "key": key,
                "label": choice.label,
                "lr": lr,
                **run,
                "final_x": run["x"][-1],
                "final_y": run["y"][-1],
                "final_loss": run["loss"][-1],
                "memory": memory_row(choice, run["state_bytes"]),
            }
        )
    return {
        "function": function,
        "f_min": t.f_min,
        "minima": [list(m) for m in t.minima],
        "start": list(start),
        "steps": steps,
        "landscape": landscape(t),
        "runs": runs,
    }
