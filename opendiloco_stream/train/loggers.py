"""Optional experiment loggers fed with the metrics records: TensorBoard and Weights & Biases.

Neither is a dependency. ``train.tensorboard_dir = "runs/tb"`` (``ODS_TRAIN__TENSORBOARD_DIR``)
writes event files with ``torch.utils.tensorboard`` (needs ``pip install tensorboard``);
``train.wandb_project = "diloco"`` logs to W&B (needs ``pip install wandb`` and a login). Asking
for one that is not installed is a configuration error (one line, exit 2), before training starts.

Scalars (the x axis is the inner step): ``train/loss``, ``train/lr``, ``eval/loss``,
``sync/wait_s``, ``sync/group_size``, ``sync/bytes_sent``, ``sync/ok`` (1 or 0), and the summary's
``summary/*`` numbers at the end. The run's configuration goes with them: TensorBoard text
``config`` (JSON), the W&B run config. A sync record's step is its round's launch step, which can be
earlier than the last step logged: W&B, whose own step must only grow, plots against an
``inner_step`` metric instead (``define_metric``).
"""

from __future__ import annotations

import importlib.util
import json
import threading
from typing import Any, Optional, Union

from opendiloco_stream.config import ConfigError, RunConfig

STEP_METRIC = "inner_step"  # W&B's x axis (its own step counts log calls)


def scalars(rec: dict[str, Any]) -> list[tuple[str, float, int]]:
    """``(tag, value, step)`` of one metrics record."""
    event, step = rec.get("event"), int(rec.get("step", 0) or 0)
    if event == "step":
        return [("train/loss", rec["loss"], step), ("train/lr", rec.get("lr", 0.0), step)]
    if event == "eval":
        return [("eval/loss", rec["eval_loss"], step)]
    if event == "sync":
        out = [("sync/ok", 1.0 if rec.get("ok") else 0.0, step), ("sync/wait_s", rec.get("wait_s", 0.0), step)]
        if rec.get("ok"):
            out += [("sync/group_size", rec.get("group_size", 0), step), ("sync/bytes_sent", rec.get("bytes_sent", 0), step)]
        return out
    if event == "summary":
        return [(f"summary/{k}", v, int(rec.get("steps", 0))) for k, v in rec.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return []


class TensorBoardLogger:
    """Writes the scalars to TensorBoard event files: one directory per peer (``peer`` command:
    ``DIR/<peer id>``) or per worker (``local``: ``DIR/worker-<rank>``), so a shared directory holds
    the whole run and TensorBoard overlays its peers."""

    def __init__(self, log_dir: str, config: Optional[dict[str, Any]] = None):
        from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency (tensorboard, the loggers extra)

        self._factory, self._dir, self._writers, self._config = SummaryWriter, log_dir, {}, config
        self._peer: Optional[str] = None

    def set_peer(self, peer: str) -> None:
        """This process is the peer ``peer``: its events go to ``DIR/<peer>`` (before the first record)."""
        self._peer = peer

    def observe(self, rec: dict[str, Any]) -> None:
        items = scalars(rec)
        if not items:
            return
        rank = rec.get("rank", 0)
        if rank not in self._writers:
            sub = self._peer if self._peer is not None and rank == 0 else (
                f"{self._peer}-rank-{rank}" if self._peer is not None else f"worker-{rank}")
            self._writers[rank] = self._factory(log_dir=f"{self._dir}/{sub}")
            if self._config is not None:
                self._writers[rank].add_text("config", json.dumps(self._config), 0)
        for tag, value, step in items:
            self._writers[rank].add_scalar(tag, float(value), step)

    def close(self) -> None:
        for w in self._writers.values():
            w.close()


class WandbLogger:
    """Logs the scalars of rank 0 to Weights & Biases: one W&B run per peer, named after it, in one
    group per run id (``net.run_id``), so the project page shows a run's peers together. The W&B run
    starts at the first record, once the peer knows its id (``set_peer``); ``local`` names it
    ``local``."""

    def __init__(self, project: str, config: dict[str, Any], group: str, name: str = "local"):
        self._project, self._config, self._group, self._name = project, config, group, name
        self._run = None

    def set_peer(self, peer: str) -> None:
        self._name = peer

    def _start(self):
        import wandb  # lazy: optional dependency (wandb, the loggers extra)

        self._run = wandb.init(project=self._project, config=self._config, group=self._group, name=self._name,
                               job_type="peer")
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC)
        return self._run

    def observe(self, rec: dict[str, Any]) -> None:
        if rec.get("rank", 0) != 0:
            return
        items = scalars(rec)
        if items:
            run = self._run or self._start()
            run.log({STEP_METRIC: items[0][2], **{tag: float(v) for tag, v, _ in items}})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


RunLogger = Union[TensorBoardLogger, WandbLogger]


def build_loggers(cfg: RunConfig) -> list[RunLogger]:
    """The loggers the configuration asks for; ConfigError if one is not installed."""
    out: list[RunLogger] = []
    if cfg.train.tensorboard_dir:
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("train.tensorboard_dir is set but tensorboard is not installed: "
                              "pip install tensorboard (or unset it)")
        out.append(TensorBoardLogger(cfg.train.tensorboard_dir, cfg.model_dump(mode="json")))
    if cfg.train.wandb_project:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("train.wandb_project is set but wandb is not installed: pip install wandb (or unset it)")
        out.append(WandbLogger(cfg.train.wandb_project, cfg.model_dump(mode="json"), group=cfg.net.run_id))
    return out


class Fanout:
    """One ``emit`` callable over the JSON-lines writer and any number of sinks with ``observe``."""

    def __init__(self, write, sinks: Optional[list] = None):
        self.write, self.sinks = write, list(sinks or [])
        self._lock = threading.Lock()  # workers of a local run emit from several threads

    def __call__(self, rec: dict[str, Any]) -> None:
        self.write(rec)
        if self.sinks:
            with self._lock:
                for sink in self.sinks:
                    sink.observe(rec)

    def close(self) -> None:
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
