"""What the training commands (``local``, ``peer``) share: their flags, the data, the summary table.

The flags come from the configuration tree (``config_cli.py``): every field of the training
sections is a flag that defaults to ``None``, so only flags given on the command line override the
TOML file (``--config``) and the environment (``ODS_SECTION__FIELD``).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from typing import Any, Iterable

from opendiloco_stream.config import BLOCKS_PER_FRAGMENT
from opendiloco_stream.config_cli import (  # noqa: F401 (re-exported for the commands)
    TRAINING_SECTIONS, UsageError, add_config_flags, config_from_args, overrides_from_args,
)


def add_training_flags(p: argparse.ArgumentParser, sections: Iterable[str] = TRAINING_SECTIONS,
                       exclude: Iterable[str] = ()) -> None:
    """``--config`` and one flag per field of ``sections`` (all optional overrides)."""
    if "--config" not in p._option_string_actions:
        p.add_argument("--config", metavar="TOML", help="a peer config file (see peers/*.toml)")
    add_config_flags(p, tuple(sections), exclude=exclude)


def model_blocks(cfg) -> int:
    """How many transformer blocks ``cfg.model`` has (built on the meta device: shapes only, no memory)."""
    import torch  # lazy: loads torch; --help stays light

    from opendiloco_stream.train.models import build_model, transformer_blocks  # lazy: loads torch; --help stays light

    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    with torch.device("meta"):
        model = build_model(cfg.model.name, vocab_size=256, seq_len=cfg.model.seq_len, dtype=dtype)
    return len(transformer_blocks(model))


def resolve_fragments(cfg):
    """``cfg`` with ``diloco.num_fragments = "auto"`` replaced by the count for its model's blocks
    (``DiLoCoConfig.fragments_for``), so every later step, summary and fingerprint sees a number."""
    if cfg.diloco.num_fragments != "auto":
        return cfg
    return cfg.model_copy(update={"diloco": cfg.diloco.resolved(model_blocks(cfg))})


def resolve_for_dry_run(cfg, sources):
    """:func:`resolve_fragments` for ``--dry-run``, whose table then says the count was derived."""
    resolved = resolve_fragments(cfg)
    if resolved is not cfg:
        sources = type(sources)(sources)
        sources["diloco.num_fragments"] = f"{sources.of('diloco.num_fragments')} 'auto' (1 per {BLOCKS_PER_FRAGMENT} blocks)"
    return resolved, sources


SHARDS_AUTO = 64  # --shard auto: one of 64 shards picked from the peer id


def parse_shard(value: str, peer_id: str) -> tuple[int, int]:
    """``data.shard`` ("R/W" or "auto") -> (rank, world); a bad value is a UsageError."""
    if value == "auto":
        h = int(hashlib.sha256(peer_id.encode()).hexdigest(), 16)
        return h % SHARDS_AUTO, SHARDS_AUTO
    try:
        rank, world = (int(x) for x in value.split("/"))
    except ValueError:
        raise UsageError(f"--shard {value!r}: use R/W with 0 <= R < W, e.g. --shard 0/3") from None
    if not 0 <= rank < world:
        raise UsageError(f"--shard {value!r}: use R/W with 0 <= R < W, e.g. --shard 0/3")
    return rank, world


def device_problem(device: str, ranks: int = 1) -> "tuple[bool, str] | None":
    """What keeps ``train.device`` from running on this machine, or None: ``(absent, message)``, where
    ``absent`` means the machine has no such device at all (no CUDA or MPS that torch can use),
    else too few GPUs (a ``cuda:N`` beyond them, or more ranks than GPUs: rank r trains on ``cuda:r``)."""
    import torch  # lazy: loads torch; --help stays light

    kind, _, index = device.partition(":")
    if kind == "mps" and not torch.backends.mps.is_available():
        return True, f"--device {device}: MPS is not available on this machine: use --device cpu"
    if kind != "cuda":
        return None
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return True, (f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}, {build}; "
                      f"check nvidia-smi and CUDA_VISIBLE_DEVICES): use --device cpu, or a CUDA build of torch")
    count = torch.cuda.device_count()
    if ranks > 1 and ranks > count:
        return False, (f"--nproc-per-node {ranks} --device cuda: rank r trains on cuda:r, and this machine has "
                       f"{count} CUDA device(s): use --nproc-per-node {count} or fewer")
    if ranks == 1 and index and int(index) >= count:
        return False, f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
    return None


def require_device(cfg):
    """``cfg`` with ``train.device`` resolved (``auto``: the first CUDA device torch sees, else the
    CPU; ``train/devices.py``). Fails with one line, before anything starts, when the device is not
    on this machine (:func:`device_problem`). ``--dry-run`` only warns for an absent device (its
    file may be meant for another machine); a run cannot go on."""
    from opendiloco_stream.train.devices import resolve_device  # lazy: loads torch; --help stays light

    device = resolve_device(cfg.train.device, cfg.train.nproc_per_node)
    problem = device_problem(device, cfg.train.nproc_per_node)
    if problem is not None:
        raise UsageError(problem[1])
    if cfg.diloco.outer_device == "cuda" and not device.startswith("cuda"):
        auto = " (auto: torch sees no CUDA device here)" if cfg.train.device == "auto" else ""
        raise UsageError(f"diloco.outer_device 'cuda' keeps the outer state on the model's GPU, but train.device "
                         f"is '{device}'{auto}: use outer_device 'auto' or 'cpu', or a CUDA device")
    if device == cfg.train.device:
        return cfg
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": device})})


def print_device(setting: str, cfg) -> None:
    """The start-up line ``device: ...`` on stderr (``setting``: ``train.device`` as given, before
    :func:`require_device` resolved it), and a one-line notice for an explicit ``cpu`` on a machine
    whose GPU torch sees."""
    from opendiloco_stream.train.devices import (  # lazy: loads torch; --help stays light
        describe_device, idle_gpu_notice)

    print(f"device: {describe_device(setting, cfg.train.device)}", file=sys.stderr, flush=True)
    notice = idle_gpu_notice(setting)
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)


def prepare_data(cfg):
    """(train source, validation tensor, vocab size) for a config; DataError -> UsageError."""
    from opendiloco_stream.train import data as data_mod  # lazy: loads torch; --help stays light

    try:
        return data_mod.load_run_data(cfg)
    except data_mod.DataError as e:
        raise UsageError(str(e)) from None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _land(s: dict[str, Any]) -> str:
    """How stale the rounds were: inner steps from launch to landing (mean, longest)."""
    mean = s.get("mean_land_steps", float("nan"))
    if mean != mean:
        return "-"
    return f"{mean:.1f} inner steps on average, {s.get('peak_land_steps', 0)} at most (H = {s['inner_steps']})"


def print_summary(s: dict[str, Any]) -> None:
    """A short human table of the summary record."""
    from opendiloco_stream.algorithm.sync_log import (  # lazy: algorithm/ loads torch; --help stays light
        ALONE_WARN_AFTER)

    before = s.get("eval_loss_before_finish", float("nan"))
    rows = [
        ("mode", f"{s['mode']} (P={s['fragments']}, H={s['inner_steps']}, tau={s['overlap_steps']}, codec {s['codec']})"),
        ("workers x steps", f"{s['workers']} x {s['steps']}  ({s['tokens']:,} tokens)"),
        ("eval loss", f"{s['eval_loss_initial']:.4f} -> {s['eval_loss']:.4f}"
                      + (f"  (before the in-flight rounds landed: {before:.4f})" if before == before else "")),
        ("eval loss, outer parameters", f"{s.get('eval_loss_global', float('nan')):.4f}  (theta_bar, the model "
                                        "every peer agrees on)"),
        ("train loss (last 20 steps)", f"{s['train_loss']:.4f}"),
        ("bytes sent per worker", _fmt_bytes(s["bytes_sent_per_worker"])),
        ("peak bytes per sync", f"{_fmt_bytes(s['peak_bytes_per_sync'])}  (whole outer gradient: "
                                f"{_fmt_bytes(s['model_outer_gradient_bytes'])})"),
        ("syncs / failed / local-only", f"{s['syncs']} / {s['failed_syncs']} / {s['local_only_steps']}"),
        ("rounds landed after", _land(s)),
        *([("theta_bar repaired / failed", f"{s['repairs']} / {s['failed_repairs']}  (fragments that had "
                                           "drifted from their group's: the metrics file's \"repair\" records)")]
          if s.get("repairs") or s.get("failed_repairs") else []),
        *([("groups formed ahead", s["prematch"])] if s.get("prematch") else []),
        ("device", f"{s.get('device', '-')}; outer state on {s.get('outer_device', '-')}"),
        ("compute utilization", f"{100 * s['compute_utilization']:.1f}%"),
        ("wall time", f"{s['wall_time_s']:.1f} s  ({s['tokens_per_s']:,.0f} tokens/s)"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    alone = s.get("alone_syncs", 0)
    if alone >= ALONE_WARN_AFTER:
        print(f"\n  WARNING: {alone} of {s['syncs']} syncs averaged with no other peer: for those rounds this run "
              f"trained alone, not with a swarm (the metrics file's \"warning\" records say why)")


def worker_config(cfg, rank: int):
    """Worker ``rank``'s config: only worker 0 writes ``train.save_model`` (every worker holds the same
    theta_bar; one directory)."""
    if rank == 0 or not cfg.train.save_model:
        return cfg
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"save_model": None})})
