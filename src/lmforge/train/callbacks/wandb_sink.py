"""``metrics.wandb = true``: every metrics record also goes to Weights & Biases, offline.

The run is written under ``RUN/wandb/`` (``WANDB_MODE=offline``: nothing leaves the machine; ``wandb sync
RUN/wandb/offline-run-*`` uploads it later) in project ``metrics.wandb_project`` with the run's config.
Its id is kept in ``RUN/wandb/run_id``, so a resumed run appends to the same W&B run. Numbers are logged
under their key at the record's step; an event's numbers under ``EVENT/KEY`` (as in TensorBoard). W&B
drops records whose step is below one it has seen: after a resume, the lines an interrupted process logged
past its last checkpoint stay in W&B's history. Rank 0 only; needs the ``wandb`` extra.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.train.callbacks.base import Callback
from lmforge.train.trainer import Trainer


def require_wandb() -> None:
    """UserError unless ``wandb`` can be imported (checked before any work)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError('metrics.wandb: the wandb package is missing; pip install -e ".[wandb]"') from None


def wandb_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``record`` as W&B keys: ``KEY``, or ``EVENT/KEY`` for an event; no ``step``."""
    prefix = f"{record['event']}/" if "event" in record else ""
    return {
        prefix + k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class WandbSink(Callback):
    """Logs each record to an offline W&B run in ``RUN/wandb`` (resumed by the id stored there)."""

    def __init__(self, run_dir: Path, cfg: Config):
        require_wandb()
        self.dir = Path(run_dir) / "wandb"
        self.cfg = cfg
        self.run = None

    def run_id(self) -> str:
        """The stored id, or a new one stored for the next resume."""
        path = self.dir / "run_id"
        if path.is_file():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:12]
        path.write_text(run_id + "\n")
        return run_id

    def on_train_start(self, trainer: Trainer) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        os.environ["WANDB_MODE"] = "offline"
        self.run = wandb.init(
            mode="offline",
            dir=str(self.dir),
            project=self.cfg.metrics.wandb_project,
            id=self.run_id(),
            resume="allow",
            config=self.cfg.model_dump(mode="json", exclude_none=True),
        )

    def on_log(self, trainer: Trainer, record: dict) -> None:
        if self.run is not None:
            values = wandb_values(record)
            if values:
                self.run.log(values, step=record["step"])

    def on_close(self, trainer: Trainer) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
