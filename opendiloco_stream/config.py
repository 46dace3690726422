"""One configuration tree (pydantic) reachable from a TOML file, CLI flags and environment variables.

Precedence, lowest to highest: defaults < TOML file (``--config``) < environment
(``ODS_<SECTION>__<FIELD>``, e.g. ``ODS_DILOCO__INNER_STEPS=50``) < command-line flags.
Unknown keys are errors everywhere.

Configuration guide for the knobs that matter (see docs/configuration.md for more):

* ``inner_steps`` (H): inner optimizer steps per outer round. Larger H means less communication
  (one full model exchange every H steps) and slightly worse quality; DiLoCo uses 500, the
  streaming paper 100. H need not be a multiple of P: offsets are ``floor((p+1)*H/P) mod H``.
* ``num_fragments`` (P): the model is split into P fragments that sync at staggered steps; peak
  bandwidth per sync drops by about P. P = 1 is vanilla DiLoCo.
* ``mode``: ``eager`` hides a whole outer round of communication behind compute (the default),
  ``overlap`` hides ``overlap_steps`` (tau) inner steps, ``blocking`` hides nothing,
  ``naive-delayed`` is the ablation, ``data-parallel`` the baseline.
* ``alpha``: in ``overlap`` mode, how much of the local parameters is kept when the global
  average lands (0.5 = the paper's merge; 0 = take the global parameters).
* ``codec``: what goes on the wire. ``fp4-e3m0`` is the streaming paper's 4-bit format.
* ``sync_timeout``: bound on any wait for a round (seconds); networked transports derive their
  own, tighter bounds from the schedule and the link.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MODES = ("blocking", "overlap", "eager", "naive-delayed", "data-parallel")
CODECS = ("fp32", "fp16", "bf16", "int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1")
ENV_PREFIX = "ODS_"


class ConfigError(ValueError):
    """A user configuration mistake: printed as one line, exit code 2."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DiLoCoConfig(_Strict):
    """The algorithm's knobs (DESIGN.md section 1)."""

    inner_steps: int = Field(100, ge=1, description="H: inner steps per outer round")
    num_fragments: int = Field(1, ge=1, description="P: fragments synced at staggered steps")
    fragment_pattern: Literal["strided", "sequential"] = "strided"
    mode: Literal["blocking", "overlap", "eager", "naive-delayed", "data-parallel"] = "eager"
    overlap_steps: int = Field(0, ge=0, description="tau: inner steps the overlap mode hides")
    alpha: float = Field(0.5, ge=0.0, le=1.0, description="overlap merge: alpha*local + (1-alpha)*global")
    outer_lr: float = Field(0.7, gt=0.0)
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    outer_nesterov: bool = True
    codec: Literal["fp32", "fp16", "bf16", "int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1"] = "fp32"
    codec_block_size: int = Field(64, ge=8, le=4096)
    codec_scale_dtype: Literal["fp16", "fp32"] = "fp16"
    stochastic_rounding: bool = False
    error_feedback: bool = False
    weighting: Literal["tokens", "equal"] = "tokens"
    sync_timeout: float = Field(300.0, gt=0.0, description="upper bound on any wait for a round (s)")
    record_digests: bool = Field(False, description="add a blake2b digest of every average to the sync "
                                 "records (to verify peers hold bit-identical results)")

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "DiLoCoConfig":
        H, P, tau = self.inner_steps, self.num_fragments, self.overlap_steps
        if P > H and self.mode != "data-parallel":
            raise ValueError(f"num_fragments ({P}) must be <= inner_steps ({H}): each fragment syncs once per H steps")
        if self.mode == "overlap":
            if tau < 1:
                raise ValueError("mode 'overlap' needs overlap_steps >= 1 (use mode 'blocking' for tau = 0)")
            if tau * P >= H:
                raise ValueError(
                    f"overlap_steps ({tau}) must be < inner_steps / num_fragments ({H}/{P}): "
                    "a fragment's result must land before the next fragment syncs"
                )
        elif self.mode == "blocking" and tau != 0:
            raise ValueError("mode 'blocking' has overlap_steps = 0; use mode 'overlap' for tau >= 1")
        return self


class ModelConfig(_Strict):
    name: str = Field("tiny", description="preset name (tiny, 35M, 100M, ...) or a local HF config/model path")
    seq_len: int = Field(128, ge=8)
    dtype: Literal["float32", "bfloat16"] = "float32"


class DataConfig(_Strict):
    dataset: str = Field("builtin", description="'builtin' (stdlib source), a hub name, or local files/dir")
    dataset_config: Optional[str] = None
    text_field: str = "text"
    tokenizer: Optional[str] = Field(None, description="local HF tokenizer path; byte-level when unset")
    streaming: Optional[bool] = Field(None, description="read the dataset on the fly (datasets streaming=True), "
                                      "position kept in checkpoints; default: on for hub names, off for local files")
    shard: str = Field("auto", description="this peer's data shard 'R/W' (e.g. '0/3'); 'auto' picks one of 64 "
                       "from the peer id")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    max_val_batches: int = Field(8, ge=1)


class TrainConfig(_Strict):
    steps: int = Field(300, ge=1, description="inner steps per worker")
    batch_size: int = Field(8, ge=1)
    lr: float = Field(4e-4, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.1, ge=0.0)
    warmup_steps: int = Field(20, ge=0)
    clip_grad_norm: float = Field(1.0, ge=0.0)
    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0: start and end only)")
    seed: int = 0
    device: str = "cpu"
    metrics_file: Optional[str] = None
    checkpoint_dir: Optional[str] = Field(None, description="where worker-<rank>.pt checkpoints go")
    checkpoint_every: int = Field(0, ge=0, description="save every N inner steps (0: only at the end)")
    resume: bool = Field(False, description="continue from checkpoint_dir if a checkpoint is there")
    tensorboard_dir: Optional[str] = Field(None, description="also log to TensorBoard here (needs the tensorboard package)")
    wandb_project: Optional[str] = Field(None, description="also log to this Weights & Biases project (needs wandb)")


class NetConfig(_Strict):
    """Networking (hivemind DHT and averagers)."""

    run_id: str = "opendiloco"
    initial_peers: list[str] = Field(default_factory=list)
    host_maddrs: list[str] = Field(default_factory=list)
    announce_maddrs: list[str] = Field(default_factory=list)
    port: Optional[int] = Field(None, ge=0, le=65535)
    public_ip: Optional[str] = None
    identity_path: Optional[str] = None
    client_mode: bool = False
    daemon_startup_timeout: float = Field(30.0, gt=0)
    secret: Optional[str] = Field(None, description="shared run secret; peers without it cannot join")
    link_mbit: float = Field(100.0, gt=0, description="expected per-peer link rate, used to derive timeouts")
    matchmaking_time: float = Field(5.0, gt=0)
    request_timeout: float = Field(3.0, gt=0)
    allreduce_timeout: Optional[float] = Field(None, gt=0, description="derived from link and schedule if unset")
    next_chunk_timeout: Optional[float] = Field(None, gt=0, description="derived from link if unset")
    window_s: Optional[float] = Field(None, gt=0, description="seconds a round may take before its result "
                                      "is needed (H x step time under eager, tau x step time under overlap); "
                                      "clips the derived all-reduce timeout")
    metrics_expiration: float = Field(60.0, gt=0)
    metrics_port: Optional[int] = Field(None, ge=0, le=65535, description="serve Prometheus metrics on "
                                        "http://0.0.0.0:PORT/metrics (0: a free port)")
    target_group_size: Optional[int] = Field(None, ge=1)


class RunConfig(_Strict):
    """The whole tree; a TOML file has one table per section."""

    diloco: DiLoCoConfig = Field(default_factory=DiLoCoConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    net: NetConfig = Field(default_factory=NetConfig)


def deep_update(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_update(out[key], value)
        else:
            out[key] = value
    return out


def env_overrides(environ: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """``ODS_SECTION__FIELD=value`` -> {"section": {"field": value}} (values parsed as TOML scalars)."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        if section not in RunConfig.model_fields:
            raise ConfigError(f"environment variable {name}: unknown section '{section}' "
                              f"(known: {', '.join(RunConfig.model_fields)})")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string
        out.setdefault(section, {})[key] = value
    return out


def load_config(path: Optional[str] = None, overrides: Optional[dict[str, Any]] = None,
                environ: Optional[dict[str, str]] = None) -> RunConfig:
    """Build the RunConfig from file < env < overrides; raise ConfigError with one readable line."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    data = deep_update(data, env_overrides(environ))
    data = deep_update(data, overrides or {})
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def format_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}")
    return "invalid configuration: " + "; ".join(parts)
