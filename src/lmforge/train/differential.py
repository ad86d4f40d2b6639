"""Differential checkpoints (``train.checkpoint_full_every``): a checkpoint that stores only the tensors that
changed since the last full one, and reads the others from it.

With ``checkpoint_full_every = N`` (N > 1), every N-th checkpoint a process writes is full (the first one
always is) and the N - 1 after it are *differential* against it. At a full save each rank keeps the
SHA-256 of the bytes of every tensor it holds (its own shard of a sharded one: :func:`digests`); at a
differential save a tensor whose bytes hash the same on every rank that holds it is not written
(:func:`unchanged_keys`, agreed over all ranks), every other tensor is written whole, as a full save would
write it. ``differential.json`` names the base and the keys read from it (:class:`Differential`). Values
that are not tensors (the optimizer's hyperparameters) are always written: they are a few bytes.

Restoring reads the written tensors from the differential folder and the rest from its base, each with
DCP (``train/checkpoint.py::load_tensors``): every tensor comes back as the bytes a full save would have
held, so a differential checkpoint restores bitwise what a full one does (not an XOR or a difference of
values: an unchanged tensor is the base's bytes, a changed one is stored whole).

What it saves depends on what changes. Under AdamW every trained parameter and both of its moments change
at every step: a differential checkpoint is as large as a full one (plus a small JSON file). It saves
the frozen part of a model: a LoRA run's base weights (which have no optimizer state either), frozen
embeddings, QLoRA's quantised weights, and buffers that do not change (an MoE balancing bias at rate 0).
``benchmarks/differential_checkpoints.py`` measures both cases.

A differential checkpoint is valid only with its base: a resume checks both, retention never deletes
a full checkpoint that a kept differential one needs (``train/checkpoint.py::prune``), and a base is
never rewritten in place as a differential (a re-save of the base's step is full).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

DIFFERENTIAL = "differential.json"
FORMAT = 1


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
        {"format": FORMAT, "base": record.base, "from_base": sorted(record.from_base)}, indent=0
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
