"""Sharded, atomic checkpoints of everything a run needs to continue exactly, in any process layout.

A checkpoint is a folder ``checkpoints/step_00000120/`` holding

* the model and optimizer states written with ``torch.distributed.checkpoint`` (DCP): ``.metadata`` and
  one ``*.distcp`` file per writing rank, each rank writing the shards it holds. Keys are parameter
  names (``model.blocks.0.attn.q_proj.weight``, ``optimizer.state.blocks.0.attn.q_proj.weight.exp_avg``)
  and tensors are stored with their whole shapes, so DCP reshards on load: a checkpoint written by 4
  FSDP2 processes loads into 2, into a tensor-parallel layout, or into one plain process, and back;
* ``trainer.pt``: the rest of the training state from rank 0 (progress, loader position, schedule,
  clipping, precision, callbacks, the resolved config);
* ``rng/rank_00003.pt``: each rank's random-generator states; ``comm/rank_00003.pt``: each rank's state
  of DDP's gradient compression (PowerSGD's error feedback, ``parallel/comm_hooks.py``), when it has one;
  ``rollouts/rank_00003.pt``: an RL run's rollouts kept for the later updates of a cycle
  (``posttrain/rl.py``), when the checkpoint falls inside one;
* ``config.toml``: the resolved config as a recipe;
* ``differential.json`` in a differential checkpoint only (``train.checkpoint_full_every``,
  below): the full checkpoint it is relative to and the keys read from there; its DCP
  files hold only the tensors that changed since that full save;
* ``manifest.json``: every other file's size and SHA-256 (what ``sha256sum`` prints), written last by
  rank 0 once every rank's files are flushed, as ``manifest.json.tmp`` renamed: a checkpoint has a whole
  manifest or none (:func:`write_manifest`).

Rank 0 keeps the ``train.keep_checkpoints`` newest checkpoints, the ones ``RUN/best.json`` (the best
validation loss, written by early stopping) and ``RUN/best_task.json`` (the best score of the task
``eval.keep_best``) name, whatever their age, and the full checkpoint each kept differential one reads
from.

It is written under ``step_00000120.tmp/`` and renamed into place by rank 0 once every rank has written
its part (DCP writes the metadata last, after gathering all ranks' results): a crash mid-write leaves
only a ``.tmp`` folder, never taken for a checkpoint and removed on the next start. With
``train.async_checkpoint`` the tensors are staged to host memory, written by a background thread while
training goes on, and the rename happens at the first step end after the write finished
(:class:`PendingSave`).

A resume takes the newest *valid* checkpoint (:func:`newest_valid_checkpoint`, :func:`checkpoint_problem`):
one whose files match its manifest. A damaged or incomplete one (a torn write, a truncated or missing
shard, a changed byte; a differential one whose base is missing or damaged) is named in one log line,
with the file, and skipped; it stays on disk until the
run saves that step again. A checkpoint without a manifest, in a run whose older checkpoints have one, is
a write that did not finish. In a run where no older checkpoint has one it was written by an lmforge
before manifests (:data:`LEGACY`): it is checked as far as it can be without checksums (every file DCP's
``.metadata`` names is there and long enough for the bytes it indexes, ``trainer.pt`` is there), so a
changed byte inside it goes unseen.

DCP warns at every save and load without a process group; lmforge does that knowingly (one process, and
:func:`load_checkpoint` in any), so those calls ignore exactly that warning (:func:`_without_group`).

Model and optimizer states go through ``torch.distributed.checkpoint.state_dict`` (flattened optimizer
state keyed by parameter name), for one process as for many: one format everywhere. A tied embedding
(``model.tie_embeddings``) is saved as one process saves it: the model under both ``embed.weight`` and
``lm_head.weight``, the optimizer state under ``embed.weight`` only. A pipeline's last stage holds its
own copy of the matrix as ``lm_head.weight`` (``parallel/tied_embedding.py``): its model entry is that
key already, and its optimizer entries are written under (and read from) ``embed.weight``; the two
copies' states are equal, and DCP keeps one of identical entries written by several ranks.

torchao's 8-bit moments (``optim.name = "adamw8bit"``) are written dequantised, in FP32, and quantised
again on load; the block code book maps each dequantised value back to its code, so a resume is still
bitwise exact (``tests/test_optimizers.py``), at four times the moments' bytes on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from lmforge.errors import UserError
from lmforge.model.transformer import Transformer

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})$")
TENSOR_KEYS = ("model", "optimizer")  # the parts of a training state that DCP writes
PER_RANK_KEYS = ("rng", "comm", "rollouts")  # the parts each rank writes for itself, as KEY/rank_N.pt
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# what DCP warns at every save and load without a process group
_NO_GROUP = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) in a "
    r"single process"
)
_writer: ThreadPoolExecutor | None = None  # one process's background checkpoint writes


@contextmanager
def _without_group() -> Iterator[None]:
    """A DCP call lmforge makes knowingly without a process group: its warning saying so is ignored."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_GROUP, category=UserWarning)
        yield


# -- model and optimizer states in any layout ----------------------------------------------------------


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order of ``optimizer``'s own state-dict indices."""
    name = {id(p): n for n, p in model.named_parameters()}
    return [name[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _flatten(sd: dict, names: list[str]) -> dict:
    """An optimizer state dict (indices) -> ``state.NAME.KEY`` / ``param_groups.NAME.KEY`` entries."""
    out = {f"state.{names[i]}.{k}": v for i, st in sd["state"].items() for k, v in st.items()}
    for g in sd["param_groups"]:
        out.update(
            {f"param_groups.{names[i]}.{k}": v for i in g["params"] for k, v in g.items() if k != "params"}
        )
    return out


def _unflatten(flat: dict, names: list[str], param_groups: list[dict]) -> dict:
    """:func:`_flatten` backwards, for the parameters ``names`` (indices as in ``param_groups``)."""
    state: dict[int, dict] = {}
    for i, n in enumerate(names):
        prefix = f"state.{n}."
        found = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
        if found:
            state[i] = found
    return {"state": state, "param_groups": param_groups}


def _copies(model: nn.Module) -> dict[str, str]:
    """``{copy: original}`` names of parameters this model holds as a copy of a tied tensor held apart
    (``Transformer.tied_copies``: a pipeline's last stage's output head -> ``embed.weight``)."""
    return model.tied_copies() if isinstance(model, Transformer) else {}


def _renamed(key: str, old: str, new: str) -> str | None:
    """``state.OLD.K`` / ``param_groups.OLD.K`` -> the same entry of ``NEW``; None for other keys."""
    part, _, rest = key.partition(".")
    return f"{part}.{new}.{rest[len(old) + 1 :]}" if rest.startswith(old + ".") else None


def _as_saved(flat: dict, model: nn.Module) -> dict:
    """A flattened optimizer state in the one-process keys: a tied copy's entries under its original's
    name (dropped where this rank also holds the original: the two states are equal)."""
    copies = _copies(model)
    if not copies:
        return flat
    held = {n for n, _ in model.named_parameters()}
    out = {}
    for key, value in flat.items():
        for copy, original in copies.items():
            renamed = _renamed(key, copy, original)
            if renamed is not None:
                key = None if original in held else renamed
                break
        if key is not None:
            out[key] = value
    return out


def _as_held(flat: dict, model: nn.Module) -> dict:
    """:func:`_as_saved` backwards: each tied copy's entries from its original's (cloned where this rank
    also holds the original, so the two states never share storage)."""
    copies = _copies(model)
    if not copies:
        return flat
    held = {n for n, _ in model.named_parameters()}
    out = dict(flat)
    for copy, original in copies.items():
        for key, value in flat.items():
            renamed = _renamed(key, original, copy)
            if renamed is None:
                continue
            if original in held:
                out[renamed] = value.clone() if isinstance(value, torch.Tensor) else value
            else:
                out[renamed] = out.pop(key)
    return out


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name; sharded ones (FSDP2, tensor parallelism) as DTensors."""
    return get_model_state_dict(model, options=OPTIONS)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, template: bool = False) -> dict:
    """The optimizer's state keyed by parameter name (flattened: ``state.NAME.exp_avg``,
    ``param_groups.NAME.lr``). Empty before the first step unless ``template`` (then torch initialises
    the states with a zero-rate step, to be overwritten by a load).

    ZeRO-1: each rank gives the state of the whole parameters it owns, through its own optimizer's
    ``state_dict`` (so a checkpoint is sharded by rank, and in the same format as every other layout's).
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        local = optimizer.optim
        return _flatten(local.state_dict(), _names(model, local)) if local.state else {}
    if not optimizer.state and not template:
        return {}
    return _as_saved(get_optimizer_state_dict(model, optimizer, options=OPTIONS), model)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    set_model_state_dict(model, state, options=OPTIONS)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore :func:`optimizer_state`'s output (nothing to do for an empty one). Under ZeRO-1 each rank
    loads the entries of its own parameters through its optimizer's ``load_state_dict`` (hyperparameters
    stay the config's)."""
    if not state:
        return
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        local = optimizer.optim
        groups = local.state_dict()["param_groups"]
        local.load_state_dict(_unflatten(state, _names(model, local), groups))
        return
    set_optimizer_state_dict(model, optimizer, _as_held(state, model), options=OPTIONS)


def _metadata(path: Path) -> dict:
    """DCP's index of every stored entry, ``{flat key: metadata}``; a differential checkpoint's with those
    its base holds for it."""
    meta = dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    record = read_differential(path)
    if record is not None:
        below = dcp.FileSystemReader(str(Path(path).parent / record.base)).read_metadata().state_dict_metadata
        meta.update({k: v for k, v in below.items() if k in record.from_base})
    return meta


def _zero_template(path: Path, model: nn.Module, optimizer: ZeroRedundancyOptimizer) -> dict:
    """Buffers for the checkpoint's optimizer entries of this rank's ZeRO-1 parameters (shapes from the
    checkpoint's metadata: ZeRO-1 parameters are whole, so the stored tensors are what the rank holds)."""
    meta = _metadata(path)
    mine = tuple(f"optimizer.state.{n}." for n in _names(model, optimizer.optim))
    out = {}
    for key, md in meta.items():
        if key.startswith(mine) and isinstance(md, dcp.TensorStorageMetadata):
            out[key.removeprefix("optimizer.")] = torch.empty(md.size, dtype=md.properties.dtype)
    return out


# -- integrity: the manifest ------------------------------------------------------------------------

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 20
LEGACY = "written by an lmforge before checkpoint manifests: files checked against DCP's index, no checksums"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, MANIFEST + ".tmp"))


def write_manifest(folder: Path) -> Path:
    """Write ``folder/manifest.json`` (size and SHA-256 of every other file) atomically and flushed."""
    files = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(folder)
    }
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def has_manifest(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def _against_manifest(folder: Path) -> str | None:
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST}: unreadable"
    for rel, want in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{rel}: missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{rel}: {size} bytes, the manifest says {want['size']}"
        if _sha256(path) != want["sha256"]:
            return f"{rel}: its SHA-256 differs from the manifest's (a changed byte)"
    return None


def _against_index(folder: Path) -> str | None:
    """A checkpoint without manifest against DCP's own index: each data file there and long enough."""
    if not (folder / "trainer.pt").is_file():
        return "trainer.pt: missing"
    try:
        meta = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # any unreadable index: the folder cannot be loaded
        return f".metadata: unreadable ({type(exc).__name__})"
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        path = folder / rel
        if not path.is_file():
            return f"{rel}: missing"
        if path.stat().st_size < size:
            return f"{rel}: {path.stat().st_size} bytes, DCP's index needs {size}"
    return None


def checkpoint_problem(folder: Path, manifests_before: bool) -> str | None:
    """What is wrong with the checkpoint ``folder`` (None: nothing). ``manifests_before``: an older
    checkpoint of the same run has a manifest, so this one was written by an lmforge that writes them."""
    if has_manifest(folder):
        problem = _against_manifest(folder)
        base = base_folder(folder) if problem is None else None
        if base is not None:
            if not is_complete(base):
                return f"differential against {base.name}, which is missing or incomplete"
            below = checkpoint_problem(base, manifests_before=True)
            if below is not None:
                return f"differential against {base.name}, which is damaged ({below})"
        return problem
    if manifests_before:
        return f"{MANIFEST}: missing (the write did not finish)"
    return _against_index(folder)


# -- the folder ---------------------------------------------------------------------------------------


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return bool(_NAME.match(path.name)) and (path / ".metadata").is_file() and (path / "trainer.pt").is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _step_folders(run_dir: Path) -> list[Path]:
    """Every ``step_N`` folder, complete or not, oldest first."""
    root = checkpoint_dir(run_dir)
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def newest_valid_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose files match its manifest (:func:`checkpoint_problem`), logging one line for
    each newer one that does not; None when the run has none at all; a UserError when none is valid. Every
    rank checks (before the process group exists), rank 0 says so."""
    say = log.warning if os.environ.get("RANK", "0") in ("", "0") else log.debug
    folders = _step_folders(run_dir)
    first = next((i for i, p in enumerate(folders) if has_manifest(p)), len(folders))
    wrong = []
    for i in reversed(range(len(folders))):
        path = folders[i]
        why = checkpoint_problem(path, manifests_before=i > first)
        if why is None:
            if not has_manifest(path):
                say("checkpoint %s: %s", path.name, LEGACY)
            return path
        say("checkpoint %s is damaged or incomplete (%s): falling back to an older one", path, why)
        wrong.append(f"{path.name}: {why}")
    if not wrong:
        return None
    raise UserError(
        f"--resume: no valid checkpoint in {checkpoint_dir(run_dir)} ({'; '.join(wrong)}); restore the "
        "folder from a copy or start a new --run-dir"
    )


def best_path(run_dir: Path) -> Path:
    """``RUN/best.json``: the step, validation loss and checkpoint of the best evaluation (early stopping)."""
    return Path(run_dir) / "best.json"


def write_best(run_dir: Path, step: int, val_loss: float) -> Path:
    """Record ``step``'s checkpoint as the best (atomically); :func:`prune` never removes it."""
    path = best_path(run_dir)
    record = {"step": step, "val_loss": val_loss, "checkpoint": f"checkpoints/step_{step:08d}"}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path


def best_task_path(run_dir: Path) -> Path:
    """``RUN/best_task.json``: the task, metric, step, score and checkpoint of the best score of the task
    ``eval.keep_best``."""
    return Path(run_dir) / "best_task.json"


def write_best_task(run_dir: Path, task: str, metric: str, step: int, value: float) -> Path:
    """Record ``step``'s checkpoint as the one of ``task``'s best score (atomically); :func:`prune` never
    removes it."""
    path = best_task_path(run_dir)
    record = {
        "task": task, "metric": metric, "step": step, "value": value,
        "checkpoint": f"checkpoints/step_{step:08d}",
    }  # fmt: skip
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path


def protected(run_dir: Path) -> set[str]:
    """Names of checkpoints that rotation keeps whatever their age: the best ones of ``RUN/best.json``
    (validation loss) and ``RUN/best_task.json`` (a task's score)."""
    out = set()
    for path in (best_path(run_dir), best_task_path(run_dir)):
        if path.is_file():
            out.add(Path(json.loads(path.read_text())["checkpoint"]).name)
    return out


def prune(run_dir: Path, keep: int) -> None:
    """Remove all but the ``keep`` newest complete checkpoints, the :func:`protected` ones and the full
    checkpoints that the kept differential ones read from."""
    found = list_checkpoints(run_dir)
    keep_names = protected(run_dir) | {p.name for p in found[-keep:]}
    keep_names |= {base.name for p in found if p.name in keep_names and (base := base_folder(p)) is not None}
    for old in found[:-keep]:
        if old.name not in keep_names:
            shutil.rmtree(old, ignore_errors=True)


def remove_partial(run_dir: Path) -> None:
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for p in root.glob("*.tmp"):
            log.warning("checkpoint: removing incomplete %s", p)
            shutil.rmtree(p, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@dataclass
class PendingSave:
    """A checkpoint whose tensors are still being written (``train.async_checkpoint``)."""

    step: int
    tmp: Path
    final: Path
    keep: int
    future: Future | None  # None: written synchronously

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def finish(self) -> Path:
        """Wait for the write, then (rank 0) flush, rename into place and prune old checkpoints."""
        if self.future is not None:
            self.future.result()
        if _rank() == 0:
            for f in self.tmp.rglob("*"):
                if f.is_file():
                    _fsync(f)
            write_manifest(self.tmp)  # last: a checkpoint without one never finished its write
            if self.final.exists():  # re-saving the same step (e.g. the final one): replace it
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            _fsync(self.final.parent)
            prune(self.final.parent.parent, self.keep)
            log.info("checkpoint: saved %s", self.final)
        return self.final


def save_checkpoint(
    run_dir: Path,
    step: int,
    state: dict[str, Any],
    config_toml: str,
    keep: int,
    background: bool = False,
    group: dist.ProcessGroup | None = None,
    differential: Differential | None = None,
) -> PendingSave:
    """Write ``state`` for ``step`` (every rank calls this); with ``background`` the tensors are written by
    a thread, coordinating over ``group`` (a process group of its own, so that its collectives never
    interleave with training's), and the caller must :meth:`PendingSave.finish` later; else the
    checkpoint is complete on return. Rank 0 prunes to the ``keep`` newest checkpoints (:func:`prune`: and the
    best one). With ``differential`` the tensors of its ``from_base`` keys are not written: they are read
    from its base (below)."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for key in PER_RANK_KEYS:
            if state.get(key) or key == "rng":
                (tmp / key).mkdir()
    _barrier()
    rest = {k: v for k, v in state.items() if k not in TENSOR_KEYS and k not in PER_RANK_KEYS}
    for key in PER_RANK_KEYS:
        if state.get(key) or key == "rng":
            torch.save(state[key], tmp / key / f"rank_{rank:05d}.pt")
    if rank == 0:
        torch.save(rest, tmp / "trainer.pt")
        (tmp / "config.toml").write_text(config_toml)
        if differential is not None:
            write_differential(tmp, differential)
    tensors = {k: state[k] for k in TENSOR_KEYS}
    if differential is not None:
        tensors = written_part(tensors, differential.from_base)
    if background:
        if dist.is_initialized():
            future = dcp.async_save(tensors, checkpoint_id=tmp, process_group=group)
        else:
            future = _save_alone_in_background(tensors, tmp)
        pending = PendingSave(step, tmp, final, keep, future)
        log.info("checkpoint: writing step %d in the background", step)
        return pending
    with _without_group():
        dcp.save(tensors, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    pending = PendingSave(step, tmp, final, keep, None)
    pending.finish()
    _barrier()
    return pending


def _save_quietly(tensors: dict, tmp: Path) -> None:
    with _without_group():
        dcp.save(tensors, checkpoint_id=tmp, no_dist=True)


def _save_alone_in_background(tensors: dict, tmp: Path) -> Future:
    """One process's ``async_save``: the tensors copied to host memory here (DCP's own stager), written
    by lmforge's writer thread. DCP's ``async_save`` would warn of the missing process group from its own
    thread, out of reach of the warning filter of the call."""
    global _writer
    stager = DefaultStager(StagingOptions(False, False, False, False))  # as async_save stages by default
    try:
        staged = stager.stage(tensors)
    finally:
        stager.close()
    if _writer is None:
        _writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-checkpoint")
    return _writer.submit(_save_quietly, staged, tmp)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The checkpoint's non-tensor state (progress, loader, config, ...), this rank's RNG states (rank 0's
    when the checkpoint had fewer ranks) and this rank's gradient-compression state (``comm``: none when
    the checkpoint has none for this rank)."""
    path = Path(path)
    # weights_only=False: the state holds numpy / Python RNG states written by lmforge itself.
    state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    rng = path / "rng" / f"rank_{_rank():05d}.pt"
    state["rng"] = torch.load(rng if rng.is_file() else path / "rng" / "rank_00000.pt", weights_only=False)
    for key in ("comm", "rollouts"):
        mine = path / key / f"rank_{_rank():05d}.pt"
        state[key] = torch.load(mine, map_location="cpu", weights_only=False) if mine.is_file() else {}
    return state


def saved_keys(path: Path) -> set[str]:
    """Flat DCP keys of the checkpoint's state (``model.embed.weight``, ``optimizer.state....``); a
    differential checkpoint's include those it reads from its base."""
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    record = read_differential(path)
    return keys if record is None else keys | record.from_base


def _dcp_load(parts: dict[str, dict], path: Path) -> None:
    """``dcp.load`` of the non-empty ``parts`` from ``path``, in place (non-tensor values replaced in the
    part dicts)."""
    wanted = {k: v for k, v in parts.items() if v}
    if not wanted:
        return
    with _without_group():
        dcp.load(wanted, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_tensors(path: Path, template: dict[str, dict]) -> dict[str, dict]:
    """Fill ``template`` (``{"model": ..., "optimizer": ...}`` in the current layout, DTensors where
    sharded) from the checkpoint in place; DCP reads each rank's shards whatever layout wrote them. An
    empty optimizer state in the checkpoint leaves ``template["optimizer"]`` empty. A differential
    checkpoint's unchanged tensors are read from its base."""
    keys = saved_keys(path)
    if not any(k.startswith("optimizer.") for k in keys):
        template = {**template, "optimizer": {}}
    record = read_differential(path)
    if record is None:
        _dcp_load(template, path)
        return template
    own = written_part(template, record.from_base)
    below = {p: {k: v for k, v in e.items() if k not in own[p]} for p, e in template.items()}
    _dcp_load(own, path)
    _dcp_load(below, path.parent / record.base)
    for part in template:
        template[part].update({**below[part], **own[part]})
    return template


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The whole checkpoint in this process's memory, unsharded: ``model`` and ``optimizer`` (flattened,
    keyed by name) as full tensors, plus the trainer state. For inspection, evaluation and export."""
    path = Path(path)
    flat = _read_whole(path)
    record = read_differential(path)
    if record is not None:
        flat.update(_read_whole(path.parent / record.base, record.from_base))
    state: dict[str, Any] = {k: {} for k in TENSOR_KEYS}
    for key, value in flat.items():
        part, name = key.split(".", 1)
        state[part][name] = value
    return {**read_trainer_state(path), **state}


def _read_whole(path: Path, only: frozenset[str] | None = None) -> dict[str, Any]:
    """Every flat entry DCP stored at ``path`` (or those of ``only``), read whole into this process."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    flat: dict[str, Any] = {}
    for key, md in meta.items():
        if only is not None and key not in only:
            continue
        if isinstance(md, dcp.TensorStorageMetadata):
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            flat[key] = None
    if flat:
        with _without_group():
            dcp.load(flat, checkpoint_id=str(path), no_dist=True)
    return flat


def load_training_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole training state of the checkpoint at ``path`` for this process, in the current layout
    (model and optimizer resharded by DCP), ready for ``Trainer.load_state_dict``.

    A checkpoint without optimizer entries (a post-training run's step 0) builds no optimizer template:
    making one initialises the states with a zero-rate step, and Adam's first real update would then be
    bias-corrected as its second."""
    if not any(k.startswith("optimizer.") for k in saved_keys(path)):
        optim_template = {}
    elif isinstance(optimizer, ZeroRedundancyOptimizer):
        optim_template = _zero_template(path, model, optimizer)
    else:
        optim_template = optimizer_state(model, optimizer, template=True)
    template = {"model": model_state(model), "optimizer": optim_template}
    return {**read_trainer_state(path), **load_tensors(path, template)}


# -- differential checkpoints ------------------------------------------------------------------------
#
# Differential checkpoints (``train.checkpoint_full_every``): a checkpoint that stores only the tensors that
# changed since the last full one, and reads the others from it.
#
# With ``checkpoint_full_every = N`` (N > 1), every N-th checkpoint a process writes is full (the first one
# always is) and the N - 1 after it are *differential* against it. At a full save each rank keeps the
# SHA-256 of the bytes of every tensor it holds (its own shard of a sharded one: :func:`digests`); at a
# differential save a tensor whose bytes hash the same on every rank that holds it is not written
# (:func:`unchanged_keys`, agreed over all ranks), every other tensor is written whole, as a full save would
# write it. ``differential.json`` names the base and the keys read from it (:class:`Differential`). Values
# that are not tensors (the optimizer's hyperparameters) are always written: they are a few bytes.
#
# Restoring reads the written tensors from the differential folder and the rest from its base, each with
# DCP (:func:`load_tensors`): every tensor comes back as the bytes a full save would have
# held, so a differential checkpoint restores bitwise what a full one does (not an XOR or a difference of
# values: an unchanged tensor is the base's bytes, a changed one is stored whole).
#
# What it saves depends on what changes. Under AdamW every trained parameter and both of its moments change
# at every step: a differential checkpoint is as large as a full one (plus a small JSON file). It saves
# the frozen part of a model: a LoRA run's base weights (which have no optimizer state either), frozen
# embeddings, QLoRA's quantised weights, and buffers that do not change (an MoE balancing bias at rate 0).
# ``benchmarks/differential_checkpoints.py`` measures both cases.
#
# A differential checkpoint is valid only with its base: a resume checks both, retention never deletes
# a full checkpoint that a kept differential one needs (:func:`prune`), and a base is
# never rewritten in place as a differential (a re-save of the base's step is full).

DIFFERENTIAL = "differential.json"
DIFFERENTIAL_FORMAT = 1


@dataclass(frozen=True)
class Differential:
    """A differential checkpoint's record: its base (a full checkpoint's folder name, a sibling) and the flat
    keys (``model.NAME``, ``optimizer.state.NAME.exp_avg``) whose tensors are read from the base."""

    base: str
    from_base: frozenset[str]


def tensor_digest(value: object) -> str | None:
    """SHA-256 of a tensor's bytes on this rank (a DTensor's local shard), with its dtype and shape; None for
    anything else (non-tensors, tensor subclasses such as NF4 or float8 weights: always written)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, torch.nn.Parameter):
        return None
    data = value.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    h = hashlib.sha256(f"{value.dtype}{tuple(value.shape)}".encode())
    h.update(data)
    return h.hexdigest()


def digests(tensors: dict[str, dict]) -> dict[str, str]:
    """``{"model.NAME": digest, ...}`` of a state's DCP parts (``{"model": {...}, "optimizer": {...}}``),
    tensors only (:func:`tensor_digest`)."""
    out = {}
    for part, entries in tensors.items():
        for key, value in entries.items():
            digest = tensor_digest(value)
            if digest is not None:
                out[f"{part}.{key}"] = digest
    return out


def unchanged_keys(now: dict[str, str], base: dict[str, str]) -> frozenset[str]:
    """Keys whose digest is the base's on every rank that holds them (with a process group: agreed by all
    ranks, so a sharded tensor is written whole when any shard of it changed)."""
    changed = {key for key, digest in now.items() if base.get(key) != digest}
    same = set(now) - changed
    if dist.is_initialized() and dist.get_world_size() > 1:
        views: list = [None] * dist.get_world_size()
        dist.all_gather_object(views, (sorted(same), sorted(changed)))
        same = set().union(*(set(s) for s, _ in views)) - set().union(*(set(c) for _, c in views))
    return frozenset(same)


def written_part(tensors: dict[str, dict], from_base: frozenset[str]) -> dict[str, dict]:
    """The entries of ``tensors`` a differential checkpoint writes: all but ``from_base``."""
    return {p: {k: v for k, v in e.items() if f"{p}.{k}" not in from_base} for p, e in tensors.items()}


def write_differential(folder: Path, record: Differential) -> None:
    """``folder/differential.json`` (rank 0; the manifest then covers it)."""
    text = json.dumps(
        {"format": DIFFERENTIAL_FORMAT, "base": record.base, "from_base": sorted(record.from_base)}, indent=0
    )
    (folder / DIFFERENTIAL).write_text(text + "\n")


def read_differential(folder: Path) -> Differential | None:
    """The record of a differential checkpoint; None for a full one."""
    path = Path(folder) / DIFFERENTIAL
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Differential(data["base"], frozenset(data["from_base"]))


def base_folder(folder: Path) -> Path | None:
    """The full checkpoint a differential ``folder`` reads from (None: ``folder`` is full)."""
    record = read_differential(folder)
    return None if record is None else Path(folder).parent / record.base
