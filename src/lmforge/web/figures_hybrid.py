"""The hybrid-parallelism planner's figures: ``lmforge estimate --json`` for a DP x TP x PP layout on
``nodes x GPUS_PER_NODE`` devices (``plan/request.py::estimate_json``, the same code and flags as the command), and
where every GPU sits in the device mesh.

The mesh is the one ``parallel/layout.py`` builds: ``init_device_mesh`` lays the ranks ``0 .. world - 1``
row-major into the shape ``(pp, dp_replicate, dp_shard, tp)``, tp innermost, so

    rank = ((pp_i * dp_replicate + rep_i) * dp_shard + shard_i) * tp + tp_i

and with ``torchrun --nproc-per-node=G`` rank ``r`` runs on node ``r // G``. A group of one dimension is
the ranks that differ only in that coordinate (data parallelism: ``dp_replicate x dp_shard`` flattened,
as ``layout.dp_mesh``); it crosses nodes when its ranks live on more than one node.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.parallel.layout import DIMS
from lmforge.plan.estimate import GPUS_PER_NODE
from lmforge.plan.request import EstimateRequest, estimate_json
from lmforge.web.accuracy import planner_accuracy

GROUP_DIMS = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp_replicate", "dp_shard")}


@dataclass(frozen=True)
class HybridInputs:
    """The page's controls; ``flags()`` turns them into ``lmforge estimate`` arguments."""

    model: str = "llama-65b"
    gpu: str = "h100-80gb"
    nodes: int = 4
    tp: int = 8
    pp: int = 2
    dp_replicate: int = 1
    dp_shard: int = 2
    zero: int = 3
    micro_batch: int = 8
    pp_microbatches: int = 8
    pp_schedule: str = "1f1b"
    checkpointing: str = "none"
    precision: str = "bf16"

    @property
    def gpus(self) -> int:
        """``nodes * GPUS_PER_NODE`` (the planner's node size)."""
        return self.nodes * GPUS_PER_NODE

    @property
    def degrees(self) -> dict[str, int]:
        """The mesh degrees in ``parallel/layout.py``'s order ``(pp, dp_replicate, dp_shard, tp)``."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    def check(self) -> None:
        """ValueError (one line) unless ``tp * pp * dp_replicate * dp_shard == nodes * GPUS_PER_NODE``."""
        product = self.tp * self.pp * self.dp_replicate * self.dp_shard
        if product != self.gpus:
            raise ValueError(
                f"tp x pp x dp_replicate x dp_shard = {self.tp} x {self.pp} x {self.dp_replicate} x "
                f"{self.dp_shard} = {product}, but nodes x {GPUS_PER_NODE} GPUs = {self.gpus}; make them agree"
            )

    def overrides(self) -> list[str]:
        """The ``--SECTION.KEY=VALUE`` overrides of ``lmforge estimate`` for these controls."""
        return [
            f"--parallel.tp={self.tp}",
            f"--parallel.pp={self.pp}",
            f"--parallel.dp_replicate={self.dp_replicate}",
            f"--parallel.dp_shard={self.dp_shard}",
            f"--parallel.zero={self.zero}",
            f"--parallel.pp_schedule={self.pp_schedule}",
            f"--parallel.pp_microbatches={self.pp_microbatches}",
            f"--train.micro_batch_size={self.micro_batch}",
            f"--train.activation_checkpointing={self.checkpointing}",
            f"--train.precision={self.precision}",
        ]

    def flags(self) -> list[str]:
        """The whole ``lmforge estimate`` argument list (without ``--json`` / ``--search``)."""
        return ["--model", self.model, "--gpu", self.gpu, "--gpus", str(self.gpus), *self.overrides()]


def mesh_coords(degrees: dict[str, int]) -> list[dict[str, int]]:
    """Every rank's coordinate along each dimension of ``DIMS`` (row-major, last dimension innermost)."""
    world = 1
    for d in DIMS:
        world *= degrees[d]
    out = []
    for rank in range(world):
        coord, rest = {}, rank
        for d in reversed(DIMS):
            rest, coord[d] = divmod(rest, degrees[d])
        out.append({d: coord[d] for d in DIMS})
    return out


def mesh_groups(degrees: dict[str, int], gpus_per_node: int) -> dict[str, list[dict]]:
    """For ``tp``, ``pp`` and ``dp``: each group's ranks, index and whether it crosses nodes (its ranks on
    more than one node ``rank // gpus_per_node``)."""
    coords = mesh_coords(degrees)
    out: dict[str, list[dict]] = {}
    for name, dims in GROUP_DIMS.items():
        keyed: dict[tuple, list[int]] = {}
        for rank, c in enumerate(coords):
            keyed.setdefault(tuple(c[d] for d in DIMS if d not in dims), []).append(rank)
        out[name] = [
            {
                "index": i,
                "ranks": ranks,
                "nodes": sorted({r // gpus_per_node for r in ranks}),
                "crosses_nodes": len({r // gpus_per_node for r in ranks}) > 1,
            }
            for i, ranks in enumerate(keyed.values())
        ]
    return out


def gpu_grid(degrees: dict[str, int], gpus_per_node: int) -> list[dict]:
    """One entry per GPU: rank, node, local index, mesh coordinates and its tp / pp / dp group index."""
    coords = mesh_coords(degrees)
    groups = mesh_groups(degrees, gpus_per_node)
    member = {name: {r: g["index"] for g in gs for r in g["ranks"]} for name, gs in groups.items()}
    return [
        {
            "rank": r,
            "node": r // gpus_per_node,
            "local": r % gpus_per_node,
            **c,
            "dp": c["dp_replicate"] * degrees["dp_shard"] + c["dp_shard"],
            "groups": {name: member[name][r] for name in groups},
        }
        for r, c in enumerate(coords)
    ]


def hybrid_figures(inputs: HybridInputs, search: bool = False) -> dict:
    """What the hybrid page shows: the flags, ``lmforge estimate --json``'s object for them (with the
    search's layouts when ``search``), the GPU grid, each dimension's groups and the planner's measured
    accuracy (``web/accuracy.py``)."""
    inputs.check()
    flags = inputs.flags()
    req = EstimateRequest(
        model=inputs.model,
        gpu=inputs.gpu,
        gpus=inputs.gpus,
        search=search,
        overrides=tuple(inputs.overrides()),
    )
    result = estimate_json(req)
    groups = mesh_groups(inputs.degrees, GPUS_PER_NODE)
    return {
        "flags": flags + (["--search"] if search else []),
        "gpus_per_node": GPUS_PER_NODE,
        "nodes": inputs.nodes,
        "degrees": inputs.degrees,
        "result": result,
        "accuracy": planner_accuracy(),
        "grid": gpu_grid(inputs.degrees, GPUS_PER_NODE),
        "groups": {
            name: {
                "size": len(gs[0]["ranks"]),
                "count": len(gs),
                "crossing": sum(g["crosses_nodes"] for g in gs),
                "members": gs,
            }
            for name, gs in groups.items()
        },
    }
