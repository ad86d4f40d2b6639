"""The process layout of a run: which processes exist, how ``parallel.*`` arranges them, and the mesh.

``torchrun`` starts the processes and tells each its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``. The
degrees of ``parallel.*`` form one DeviceMesh with the dimensions ``(pp, dp_replicate, dp_shard, tp)``
(outermost first, so tensor-parallel ranks are neighbours: on a node they share the fastest links);
their product must be the world size. Data parallelism spans ``dp = dp_replicate * dp_shard`` ranks:
every rank of a data-parallel group reads different sequences, while the tensor- and pipeline-parallel
ranks of one data-parallel position read the same ones.

:func:`check_layout` is pure (no process group): it refuses a wrong layout with one line naming the key
before any work. :func:`init_layout` starts the process group (NCCL on CUDA, gloo on CPU) and builds the
mesh. A single process without ``torchrun`` gets :data:`SINGLE`, with no process group at all.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.config import Config
from lmforge.errors import ConfigError, UserError

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

# Environment variables other launchers set for every process they start (Slurm's srun, Open MPI, MPICH/PMI).
FOREIGN_LAUNCHERS = {"SLURM_NTASKS": "srun", "OMPI_COMM_WORLD_SIZE": "mpirun", "PMI_SIZE": "mpirun"}


def launch_env(env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """``(rank, local_rank, world)`` as ``torchrun`` set them; ``(0, 0, 1)`` for a plain process."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return 0, 0, 1
    return int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])), int(env["WORLD_SIZE"])


def degrees(cfg: Config) -> dict[str, int]:
    p = cfg.parallel
    return {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp}


def data_parallel_kind(cfg: Config) -> str:
    """``none``, ``ddp`` (replicas only), ``zero1`` (DDP + sharded optimizer states) or ``fsdp``."""
    p = cfg.parallel
    if p.dp_shard > 1:
        return "zero1" if p.zero == 1 else "fsdp"
    return "ddp" if p.dp_replicate > 1 else "none"


def check_layout(cfg: Config, world: int, env: dict[str, str] | None = None) -> None:
    """Refuse a layout that cannot run on ``world`` processes (one line naming the key and the fix)."""
    env = os.environ if env is None else env
    p = cfg.parallel
    product = p.pp * p.dp_replicate * p.dp_shard * p.tp
    if world == 1 and "WORLD_SIZE" not in env:
        for var, launcher in FOREIGN_LAUNCHERS.items():
            if int(env.get(var, "1") or 1) > 1:
                raise UserError(
                    f"lmforge train: started as {env[var]} processes by {launcher} without torchrun; start one "
                    "torchrun per node instead: torchrun --nnodes=N --nproc-per-node=G -m lmforge train ... "
                    "(README: multi-node)"
                )
        if product > 1:
            raise ConfigError(
                f"parallel: the layout needs {product} processes (pp x dp_replicate x dp_shard x tp); launch "
                f"with torchrun --nproc-per-node={product} -m lmforge train ..."
            )
    if product != world:
        described = " x ".join(f"{k}={v}" for k, v in degrees(cfg).items())
        hint = f"--parallel.dp_shard={world}" if product == 1 else "degrees whose product is the world size"
        raise ConfigError(
            f"parallel: torchrun started {world} processes but the layout {described} uses {product}; "
            f"set {hint}"
        )
    kind = data_parallel_kind(cfg)
    if p.ep > 1 and p.pp > 1 and (p.dp_replicate * p.dp_shard) % p.ep:
        raise ConfigError(
            f"parallel.ep: an expert group of {p.ep} ranks would span pipeline stages (each of the "
            f"parallel.pp = {p.pp} stages has dp_replicate x dp_shard = {p.dp_replicate * p.dp_shard} ranks); "
            f"set --parallel.dp_shard to a multiple of {p.ep} so every expert group sits inside one stage"
        )
    if p.ep > 1 and (p.dp_replicate * p.dp_shard) % p.ep:
        raise ConfigError(
            f"parallel.ep: {p.ep} expert-parallel ranks are drawn from the data-parallel ranks, and "
            f"dp_replicate x dp_shard = {p.dp_replicate * p.dp_shard} is not a multiple of it; set "
            f"--parallel.dp_shard (or dp_replicate) to a multiple of {p.ep}"
        )
    if p.ep > 1 and (kind == "zero1" or p.offload):
        key = "parallel.zero" if kind == "zero1" else "parallel.offload"
        raise ConfigError(
            f"{key}: expert parallelism composes with DDP (dp_replicate) and FSDP2 (dp_shard, zero 2 or 3) "
            "without offload; use --parallel.zero=2 or 3 and no offload with parallel.ep"
        )
    if kind in ("ddp", "zero1") and p.tp > 1:
        raise ConfigError(
            "parallel.tp: tensor parallelism composes with FSDP2 only; use --parallel.dp_shard for the data-"
            "parallel degree with --parallel.zero=2 or 3"
        )
    if p.offload and kind != "fsdp":
        raise ConfigError(
            "parallel.offload: CPU offload is FSDP2's; it needs --parallel.dp_shard above 1 with "
            "--parallel.zero=2 or 3"
        )
    if p.defer_grad_sync and (kind != "fsdp" or p.pp > 1):
        raise ConfigError(
            "parallel.defer_grad_sync: defers FSDP2's reduce-scatters over a step's micro-batches, so it needs "
            "--parallel.dp_shard above 1 with --parallel.zero=2 or 3 and no pipeline (DDP and ZeRO-1 already "
            "reduce once per step, a pipeline's schedule once per micro-batch); remove the key"
        )
    if p.ddp_comm_hook != "none" and kind not in ("ddp", "zero1"):
        where = "FSDP2 reduce-scatters without DDP's hooks" if kind == "fsdp" else "one replica sends nothing"
        raise ConfigError(
            f"parallel.ddp_comm_hook: {p.ddp_comm_hook!r} compresses DDP's gradient all-reduce, and this layout "
            f"has no DDP ({where}); use --parallel.dp_replicate above 1 (or --parallel.zero=1) or remove the key"
        )
    if kind in ("ddp", "zero1") and p.pp > 1:  # DDP's reducer fails on a stage's per-microbatch backwards
        key = "parallel.zero" if kind == "zero1" else "parallel.dp_replicate"
        raise ConfigError(
            f"{key}: DDP and ZeRO-1 do not compose with pipeline stages here; use --parallel.dp_shard (FSDP2, "
            "--parallel.zero=2 or 3) for the data-parallel degree with --parallel.pp"
        )


@dataclass(eq=False)
class Layout:
    """This process's place in the run: degrees, rank, the mesh and its groups (no mesh: one process)."""

    degrees: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIMS, 1))
    kind: str = "none"  # data_parallel_kind
    zero: int = 3
    offload: bool = False
    rank: int = 0
    world: int = 1
    mesh: DeviceMesh | None = None
    dp_mesh: DeviceMesh | None = None  # (dp_replicate, dp_shard) flattened into one dimension
    checkpoint_group: dist.ProcessGroup | None = None  # gloo, all ranks: background checkpoint writes
    ep: int = 1  # parallel.ep: ranks among which each MoE layer's experts are split
    ep_mesh: DeviceMesh | None = None  # (pp, edp, ep, tp): the data-parallel ranks as edp x ep (ep > 1)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes run files, logs metrics and prints."""
        return self.rank == 0

    @property
    def dp(self) -> int:
        return self.degrees["dp_replicate"] * self.degrees["dp_shard"]

    @property
    def dp_rank(self) -> int:
        """Position among the data-parallel ranks (which sequences this process reads)."""
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of mesh dimension ``dim`` (``pp``, ``dp``, ``dp_shard``, ``tp``, ...)."""
        if self.mesh is None:
            return None
        return self.dp_mesh.get_group() if dim == "dp" else self.mesh[dim].get_group()

    def submesh(self, *dims: str) -> DeviceMesh:
        assert self.mesh is not None
        return self.mesh[dims if len(dims) > 1 else dims[0]]

    def describe(self) -> str:
        used = ", ".join(f"{k}={v}" for k, v in {**self.degrees, "ep": self.ep}.items() if v > 1)
        used = used or "one process"
        dp = {"none": "", "ddp": " (DDP)", "zero1": " (ZeRO-1)", "fsdp": f" (FSDP2, ZeRO-{self.zero})"}
        return f"{self.world} processes: {used}{dp[self.kind]}"


SINGLE = Layout()


def init_layout(cfg: Config, device_type: str) -> Layout:
    """Check the layout against ``torchrun``'s environment; for several processes start the process group
    (NCCL on CUDA, gloo on CPU) and build the mesh ``(pp, dp_replicate, dp_shard, tp)``."""
    rank, local_rank, world = launch_env()
    check_layout(cfg, world)
    if world == 1:
        return SINGLE
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        start_process_group("nccl" if device_type == "cuda" else "gloo", rank, world)
    sizes = degrees(cfg)
    mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=DIMS)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    kind = data_parallel_kind(cfg)
    # A background checkpoint write gathers its plan over a group of its own: collectives of the
    # training steps on the default group must never interleave with those of the writer thread.
    ckpt_group = dist.new_group(backend="gloo") if cfg.train.async_checkpoint else None
    ep, ep_mesh = cfg.parallel.ep, None
    if ep > 1:  # the same ranks, the data-parallel dimensions re-cut as (edp, ep) in row-major order
        dp = sizes["dp_replicate"] * sizes["dp_shard"]
        shape = (sizes["pp"], dp // ep, ep, sizes["tp"])
        ep_mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "edp", "ep", "tp"))
    return Layout(
        dict(sizes), kind, cfg.parallel.zero, cfg.parallel.offload, rank, world, mesh, dp_mesh, ckpt_group,
        ep, ep_mesh,
    )  # fmt: skip


def start_process_group(backend: str, rank: int, world: int) -> None:
    """``init_process_group`` over the store of torchrun's agent, under a prefix of this attempt.

    After a restart (``torchrun --max-restarts``) the new workers meet in the same agent store as the
    failed ones; with the default ``env://`` set-up in torch 2.13 they read the addresses the previous
    attempt published and gloo fails to connect ("connectFullMesh ... Connection refused", reproduced
    with a bare all-reduce script). Keys under ``lmforge/attempt_<TORCHELASTIC_RESTART_COUNT>`` are
    fresh for every attempt. Outside torchrun's agent store the default set-up is used.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=timedelta(minutes=10),
    )
    store = dist.PrefixStore(f"lmforge/attempt_{attempt}", agent)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def close_layout(layout: Layout, finished: bool = True) -> None:
    """End the process group of a run (:func:`end_process_group`). After a run that ended normally every
    rank first waits for the others to be past their last message, so none tears its connections down
    while a peer still uses them; after an error it does not wait (the peers may never arrive)."""
    if layout.distributed and dist.is_initialized():
        end_process_group(wait=finished)


# seconds the main thread sleeps (the GIL released) after ending its groups, before the interpreter shuts down
GLOO_SETTLE_S = 0.2


def end_process_group(wait: bool = True) -> None:
    """``destroy_process_group`` after a garbage collection (and, with ``wait``, a barrier), then a short
    sleep that releases the GIL.

    What used the groups (DDP's reducer, FSDP2's state, a pipeline's stages, pending works) is often held
    in reference cycles; collected first, it is destroyed while its groups still exist.

    The sleep is for gloo's worker threads. A thread that ran a collective frees the finished work after
    the caller has been woken, and freeing the work's tensors takes the GIL. DTensor's caches keep device
    meshes, and through them the group, alive past ``destroy_process_group``, so the group's destructor
    (which would join those threads) does not run before the interpreter shuts down; a worker thread that
    asks for the GIL once shutdown has begun is ended mid-destructor, and the rank aborts ("terminate
    called without an active exception", SIGABRT) after its work has finished. Seen under gdb: the
    thread was freeing an all-gather's work while the main thread was in ``Py_FinalizeEx``, in 5 of 30
    launches of a worker that went straight from its last ``all_gather_object`` to shutdown. The thread
    needs the GIL for microseconds; the sleep gives it the GIL."""
    gc.collect()
    if wait:
        dist.barrier()
    dist.destroy_process_group()
    time.sleep(GLOO_SETTLE_S)


@contextlib.contextmanager
def process_group_scope() -> Iterator[None]:
    """Ends the default process group when the block exits (:func:`end_process_group`): after a barrier
    when the block finished, at once when it raised (a failed rank does not wait at a barrier its peers
    may never reach)."""
    try:
        yield
    except BaseException:
        end_process_group(wait=False)
        raise
    end_process_group()
