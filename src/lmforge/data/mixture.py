"""Weighted data mixtures and curriculum phases: which domain each training sequence comes from.

Each domain's training shards are packed on their own (a window never spans two domains): domain ``d``
has ``n_d`` windows, and its ``i``-th sequence lies in the domain's epoch ``e = i // n_d`` and is
window ``perm_{d,e}[i % n_d]``, a permutation drawn from ``(seed, crc32(d), e)``. A small domain is
therefore upsampled by repetition, reshuffled every epoch, and a large one may never finish an epoch.

The domain of global sequence number ``k`` follows a deterministic largest-deficit schedule (the
sequence form of smooth weighted round-robin). In the phase that started at sequence ``s``, with
weights ``w`` normalised to sum 1 and ``c_d`` sequences of domain ``d`` among the phase's first
``j = k - s``:

    domain(k) = argmax_d ( w_d * (j + 1) - c_d )        (ties: the first domain in sorted order)

that is, the domain furthest behind its target share. ``w_d * j - c_d`` always stays above -1 (a domain
is only picked while it is behind), so every domain stays within a sequence or so of its target at every
point of the run, and a batch's mix is exact to about one sequence, without randomness; the seed orders
the windows inside each domain. Seeded multinomial draws would be looser: at ``w = 0.5`` the share over
10,000 sequences has a standard deviation of 0.5 points, so a 1-point target fails for some seeds.

Distributed: global sequence numbers are consumed as by :class:`~lmforge.data.loader.PackedLoader`
(``world * micro_batch_size`` per micro-step, rank ``r`` reading the ``r``-th block). Every rank walks
the whole schedule, so the per-domain cursors agree on all ranks while each reads only its own rows.

State: the position, each domain's cursor (the index of its next sequence) and the counts of the current
phase; together with the configuration they fix every later sequence.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass

import numpy as np

from lmforge.config import Config, DataConfig
from lmforge.data.loader import Batch, PackedLoader, TokenStream, stack, window
from lmforge.data.prepare import PreparedData
from lmforge.data.sources import source_domains
from lmforge.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phase:
    """A resolved curriculum phase: weights over the loader's domains (sum 1) and its last step."""

    name: str
    end_step: int | None  # the phase covers steps up to this one; None: to the end of the run
    weights: tuple[float, ...]


def _check_known(table: dict[str, float], key: str, available: list[str]) -> None:
    for domain in table:
        if domain not in available:
            raise ConfigError(
                f"{key}: unknown domain {domain!r}; available domains: {', '.join(available) or 'none'}"
            )


def _weight_tables(cfg: DataConfig) -> list[tuple[str, dict[str, float]]]:
    tables = [("data.weights", cfg.weights)]
    tables += [(f"data.phases[{i}].weights", p.weights) for i, p in enumerate(cfg.phases)]
    return tables


def check_domains(cfg: DataConfig) -> None:
    """Fail before any data work when a weight names a domain that no configured source produces."""
    available = sorted({d for source in cfg.sources for d in source_domains(source)})
    for key, table in _weight_tables(cfg):
        _check_known(table, key, available)


def resolve_phases(cfg: DataConfig, windows: dict[str, int], tokens_per_step: int, steps: int) -> list[Phase]:
    """The configured phases (or one phase when there are none) as step boundaries and weight vectors.

    A phase's weights are its own table, else ``data.weights``, else each domain's window count (every
    sequence equally likely, as without a mixture). ``until_tokens = T`` ends the phase after step
    ``ceil(T / tokens_per_step)``. The last phase runs to the end of the run.
    """
    domains = list(windows)
    for key, table in _weight_tables(cfg):
        _check_known(table, key, domains)
    specs = cfg.phases or [None]
    out: list[Phase] = []
    for i, spec in enumerate(specs):
        key = f"data.phases[{i}]"
        if spec is not None and spec.weights:
            table, table_key = spec.weights, f"{key}.weights"
        else:
            table, table_key = cfg.weights, "data.weights"
        raw = [float(table.get(d, 0.0)) for d in domains] if table else [float(windows[d]) for d in domains]
        total = sum(raw)
        if total <= 0:
            raise DataError(
                f"{table_key}: every weighted domain has fewer than seq_len + 1 training tokens; "
                "weight another domain or lower data.seq_len"
            )
        end: int | None = None
        if spec is not None and i < len(specs) - 1:
            if spec.until_step is not None:
                end = spec.until_step
            else:
                assert spec.until_tokens is not None
                end = math.ceil(spec.until_tokens / tokens_per_step)
            prev = out[-1].end_step or 0 if out else 0
            if end <= prev:
                kind = "until_step" if spec.until_step is not None else "until_tokens"
                raise ConfigError(
                    f"{key}.{kind}: ends at step {end}, not after the previous phase (step {prev}); "
                    "phases must be increasing"
                )
            if end >= steps:
                log.warning(
                    "%s: ends at step %d, at or after train.steps = %d; later phases never run",
                    key,
                    end,
                    steps,
                )
        name = (spec.name if spec is not None else None) or f"phase{i}"
        out.append(Phase(name, end, tuple(w / total for w in raw)))
    return out


def planned_epochs(
    phases: list[Phase], windows: dict[str, int], seqs_per_step: int, steps: int
) -> dict[str, float]:
    """Expected epochs per domain over ``steps``: ``sum_p (sequences of phase p) * w_{p,d} / n_d``."""
    seqs = dict.fromkeys(windows, 0.0)
    start = 0
    for p in phases:
        end = steps if p.end_step is None else min(p.end_step, steps)
        for d, w in zip(windows, p.weights, strict=True):
            seqs[d] += max(0, end - start) * seqs_per_step * w
        start = max(start, end)
    return {d: seqs[d] / windows[d] if windows[d] else 0.0 for d in windows}


class MixtureLoader:
    """Packed sequences drawn from several domains by weight, phase by phase; resumable via ``state_dict``."""

    def __init__(
        self,
        streams: dict[str, TokenStream],
        phases: list[Phase],
        seqs_per_step: int,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ):
        self.domains = list(streams)
        self.streams = [streams[d] for d in self.domains]
        self.phases = phases
        self.seq_len, self.mbs, self.seed, self.rank, self.world = (
            seq_len,
            micro_batch_size,
            seed,
            rank,
            world,
        )
        # phase p covers global sequence numbers [ends[p-1], ends[p])
        self.ends = [None if p.end_step is None else p.end_step * seqs_per_step for p in phases]
        self.weights = np.array([p.weights for p in phases], dtype=np.float64)
        self.n_windows = np.array([(len(s) - 1) // seq_len for s in self.streams], dtype=np.int64)
        for d, n, used in zip(self.domains, self.n_windows, (self.weights > 0).any(axis=0), strict=True):
            if used and n < 1:
                raise DataError(
                    f"data.weights: domain {d!r} has fewer than seq_len + 1 = {seq_len + 1} training "
                    "tokens; give it weight 0 or lower data.seq_len"
                )
        self._keys = [zlib.crc32(d.encode()) for d in self.domains]
        self._perms: dict[int, tuple[int, np.ndarray]] = {}
        self.position = 0
        self.cursor = np.zeros(len(self.domains), dtype=np.int64)  # next sequence index per domain
        self.phase, self.phase_start = 0, 0
        self.phase_counts = np.zeros(len(self.domains), dtype=np.int64)
        self._reported = self.cursor.copy()

    def _draw(self, k: int) -> tuple[int, int]:
        """Domain of global sequence ``k`` (the next one) and its index within that domain."""
        while (
            self.ends[self.phase] is not None
            and k >= self.ends[self.phase]
            and self.phase < len(self.phases) - 1
        ):
            self.phase_start = self.ends[self.phase]
            self.phase += 1
            self.phase_counts[:] = 0
        w = self.weights[self.phase]
        deficit = np.where(w > 0, w * (k - self.phase_start + 1) - self.phase_counts, -np.inf)
        d = int(np.argmax(deficit))
        i = int(self.cursor[d])
        self.cursor[d] += 1
        self.phase_counts[d] += 1
        return d, i

    def _window_of(self, d: int, i: int) -> int:
        epoch, j = divmod(i, int(self.n_windows[d]))
        cached = self._perms.get(d)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, self._keys[d], epoch])
            cached = (epoch, rng.permutation(int(self.n_windows[d])))
            self._perms[d] = cached
        return int(cached[1][j])

    def next_batch(self) -> Batch:
        first = self.position + self.rank * self.mbs
        rows = []
        for k in range(self.position, self.position + self.world * self.mbs):
            d, i = self._draw(k)
            if first <= k < first + self.mbs:
                rows.append(window(self.streams[d], self._window_of(d, i), self.seq_len))
        self.position += self.world * self.mbs
        return stack(rows)

    @property
    def epoch(self) -> float:
        """Sequences drawn over all windows of all domains (each domain's own count: ``domain_epochs``)."""
        return self.position / int(self.n_windows.sum())

    def domain_epochs(self) -> dict[str, float]:
        return {
            d: int(c) / int(n) if n else 0.0
            for d, c, n in zip(self.domains, self.cursor, self.n_windows, strict=True)
        }

    def report(self) -> dict[str, float | int | str]:
        """Metrics: current phase, each domain's share of the sequences since the last report, its epochs."""
        delta = self.cursor - self._reported
        self._reported = self.cursor.copy()
        total = max(1, int(delta.sum()))
        out: dict[str, float | int | str] = {"phase": self.phase, "phase_name": self.phases[self.phase].name}
        out.update({f"mix/{d}": int(n) / total for d, n in zip(self.domains, delta, strict=True)})
        out.update({f"epochs/{d}": e for d, e in self.domain_epochs().items()})
        return out

    def summary(self) -> dict[str, dict[str, float | int]]:
        """Per domain: sequences drawn (all ranks), epochs, windows per epoch."""
        epochs = self.domain_epochs()
        return {
            d: {"sequences": int(c), "epochs": epochs[d], "windows": int(n)}
            for d, c, n in zip(self.domains, self.cursor, self.n_windows, strict=True)
        }

    def state_dict(self) -> dict:
        return {
            "kind": "mixture",
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "world": self.world,
            "cursor": {d: int(c) for d, c in zip(self.domains, self.cursor, strict=True)},
            "phase": self.phase,
            "phase_start": self.phase_start,
            "phase_counts": {d: int(c) for d, c in zip(self.domains, self.phase_counts, strict=True)},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "mixture":
            raise DataError(
                "data.weights: the checkpoint was trained without a mixture (no data.weights / data.phases); "
                "resume with the same data settings"
            )
        if state["seq_len"] != self.seq_len:
            raise DataError(f"data.seq_len: checkpoint used {state['seq_len']}, config has {self.seq_len}")
        gone = sorted(set(state["cursor"]) - set(self.domains))
        if gone:
            raise DataError(
                f"data.sources: the checkpoint drew from domain {gone[0]!r}, which the data lacks now"
            )
        self.seed = state["seed"]
        self.position = int(state["position"])
        self.cursor = np.array([state["cursor"].get(d, 0) for d in self.domains], dtype=np.int64)
        self._reported = self.cursor.copy()
        phase, start = self._phase_at(self.position)
        if (phase, start) == (state["phase"], state["phase_start"]):
            self.phase, self.phase_start = phase, start
            self.phase_counts = np.array(
                [state["phase_counts"].get(d, 0) for d in self.domains], dtype=np.int64
            )
        else:  # the phases were edited: the current one restarts its mix here
            log.warning(
                "data.phases: changed since the checkpoint; phase %d's mix restarts at this step", phase
            )
            self.phase, self.phase_start = phase, self.position
            self.phase_counts = np.zeros(len(self.domains), dtype=np.int64)

    def _phase_at(self, k: int) -> tuple[int, int]:
        phase, start = 0, 0
        while phase < len(self.phases) - 1 and self.ends[phase] is not None and k >= self.ends[phase]:
            start = self.ends[phase]
            phase += 1
        return phase, start


def build_train_loader(
    cfg: Config, data: PreparedData, accum: int, rank: int = 0, world: int = 1
) -> PackedLoader | MixtureLoader:
    """The training loader: without ``data.weights`` / ``data.phases`` the plain packed stream of all
    domains (every window equally likely), else a :class:`MixtureLoader`; logs the plan."""
    seq_len, mbs, seed = cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.seed
    if not cfg.data.weights and not cfg.data.phases:
        return PackedLoader(TokenStream(data.train), seq_len, mbs, seed, rank, world)
    streams = {d: TokenStream(shards) for d, shards in data.train_by_domain().items()}
    windows = {d: (len(s) - 1) // seq_len for d, s in streams.items()}
    seqs_per_step = accum * mbs * world
    phases = resolve_phases(cfg.data, windows, seqs_per_step * seq_len, cfg.train.steps)
    loader = MixtureLoader(streams, phases, seqs_per_step, seq_len, mbs, seed, rank, world)
    start = 0
    for p in phases:
        end = cfg.train.steps if p.end_step is None else p.end_step
        mix = ", ".join(f"{d} {w:.1%}" for d, w in zip(windows, p.weights, strict=True))
        log.info("data: %s, steps %d-%d: %s", p.name, start + 1, end, mix)
        start = end
    plan = planned_epochs(phases, windows, seqs_per_step, cfg.train.steps)
    log.info(
        "data: planned epochs over %d steps: %s",
        cfg.train.steps,
        ", ".join(f"{d} {e:.2f} (of {windows[d]} windows)" for d, e in plan.items()),
    )
    return loader
