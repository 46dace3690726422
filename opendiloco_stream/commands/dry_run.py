"""``--dry-run`` for ``peer`` and ``local``: show the resolved configuration and check it, start nothing.

Prints every value with where it came from (``default``, ``file``, ``env``, ``flag``), then runs
the checks a real start would fail on, each as one ``[ok]`` / ``[warn]`` / ``[FAIL]`` line:

* ``model``: the model builds (on PyTorch's ``meta`` device: no memory, no weights) and its size;
* ``data``: the dataset opens and this peer's shard yields a batch (a streamed hub dataset is
  opened and its first documents read, so a dry run needs the same network access as training);
* ``device``: the training device exists here, ``auto`` resolved as a run would (the first CUDA
  device torch sees, else the CPU); a ``[warn]`` for an absent one (you may check a GPU peer's file
  on a laptop) or for ``cpu`` while torch sees a GPU;
* ``addresses`` (peer): the initial peers and the listen/announce addresses parse;
* ``identity`` (peer): the key file loads (its peer id is shown) or can be created;
* ``ports`` (peer): the p2p port (TCP and UDP) and the Prometheus port are free.

Exit 0 when nothing failed; else exit 2 with the first failure as one line on stderr.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from opendiloco_stream.commands import simulator
from opendiloco_stream.commands._common import device_problem, parse_shard, prepare_data
from opendiloco_stream.commands.link_fit import round_fit
from opendiloco_stream.config import ConfigError, ConfigSources, RunConfig
from opendiloco_stream.config_cli import UsageError
from opendiloco_stream.net.tcp import restarts_after_idle


def format_config(cfg: RunConfig, sources: ConfigSources) -> list[str]:
    """One line per value: ``section.field = value  (origin)``, the non-default origins marked."""
    rows = []
    for section, model in cfg:
        for field, value in model:
            key = f"{section}.{field}"
            shown = "-" if value is None else (", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))
            rows.append((key, shown if shown else '""', sources.get(key, "default")))
    width = max(len(k) for k, _, _ in rows)
    vwidth = min(48, max(len(v) for _, v, _ in rows))
    return [f"  {k:<{width}}  {v:<{vwidth}}  {origin}" for k, v, origin in rows]


class Checks:
    """Runs named checks, prints each result at once, remembers the first failure.

    ``out`` defaults to ``sys.stdout`` as it is when the checks are made (not when this module was
    imported), so a redirected stdout gets the lines."""

    def __init__(self, out: Optional[TextIO] = None):
        self.out, self.failure = out if out is not None else sys.stdout, None

    def run(self, name: str, fn: Callable[[], "str | tuple[str, str]"]) -> Any:
        t0 = time.perf_counter()
        try:
            result = fn()
        except (ConfigError, UsageError, OSError, ValueError) as e:
            line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.failure = self.failure or f"{name}: {line}"
            print(f"  [FAIL] {name:<10} {line}", file=self.out, flush=True)
            return None
        level, text = result if isinstance(result, tuple) else ("ok", result)
        print(f"  [{level}]{' ' * (5 - len(level))}{name:<10} {text}  ({time.perf_counter() - t0:.1f} s)",
              file=self.out, flush=True)
        return result


def _port_free(port: int, kind: int) -> Optional[str]:
    """None if ``port`` can be bound on all interfaces for ``kind`` (TCP/UDP), else why not."""
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    return None


def check_model(cfg: RunConfig, vocab_size: int) -> str:
    import torch  # lazy: loads torch; --help stays light

    from opendiloco_stream.train.models import build_model, transformer_blocks  # lazy: loads torch; --help stays light

    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    with torch.device("meta"):  # shapes only: a 4B model checks in seconds on a laptop
        model = build_model(cfg.model.name, vocab_size=vocab_size, seq_len=cfg.model.seq_len, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    blocks = len(transformer_blocks(model))
    if cfg.diloco.num_fragments > blocks:
        raise ValueError(f"num_fragments ({cfg.diloco.num_fragments}) exceeds the model's {blocks} transformer "
                         "blocks: use at most one fragment per block")
    return f"{cfg.model.name}: {params / 1e6:.1f} M parameters, {blocks} blocks, {cfg.model.dtype}"


def measure_step_s(cfg: RunConfig, vocab_size: int) -> tuple[float, str]:
    """Seconds of one inner step of this model: timed (the second of two steps at the configured
    batch on the configured device) for a model of at most ``TIMED_STEP_MAX_PARAMS``, else estimated
    from its FLOPs (60% of an H100's bf16 peak, ``simulator.step_time_from_flops``)."""
    import torch  # lazy: loads torch; --help stays light

    from opendiloco_stream.train.models import build_model  # lazy: loads torch; --help stays light

    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(cfg.model.name, vocab_size=vocab_size,
                                                     seq_len=cfg.model.seq_len).parameters())
    device = cfg.train.device if cfg.train.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if params > TIMED_STEP_MAX_PARAMS:
        tokens = cfg.train.batch_size * cfg.model.seq_len
        return simulator.step_time_from_flops(params, tokens), "estimated from FLOPs"
    model = build_model(cfg.model.name, vocab_size=vocab_size, seq_len=cfg.model.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1), device=device)
    elapsed = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        out = model(input_ids=batch[:, :-1], labels=batch[:, 1:])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    return elapsed, f"timed on {device}"


TIMED_STEP_MAX_PARAMS = 50_000_000


def check_link(cfg: RunConfig, vocab_size: int) -> "str | tuple[str, str]":
    """RTT to each initial peer (TCP handshakes) and whether a round of this H, P and codec lands
    within its window at that RTT and ``net.link_mbit`` (``net/distance.py``, ``commands/link_fit.py``)."""
    import torch  # lazy: loads torch; --help stays light

    from opendiloco_stream.algorithm.prematch import (  # lazy: algorithm/ loads torch; --help stays light
        PrematchChoice, auto_steps)
    from opendiloco_stream.net.distance import probe_peers  # lazy: loads hivemind; --help stays light
    from opendiloco_stream.train.models import build_model, transformer_blocks  # lazy: loads torch; --help stays light
    from opendiloco_stream.transport.factory import (  # lazy: transport/ loads torch; --help stays light
        codec_from_config)

    rtts = probe_peers(cfg.net.initial_peers, samples=3, timeout=3.0)
    known = [r for r in rtts.values() if r is not None]
    peers = "; ".join(f"{m.split('/p2p/')[0]} {'unreachable' if r is None else f'{r * 1e3:.0f} ms'}"
                      for m, r in rtts.items())
    if not known:
        return "warn", f"RTT to the initial peers: none answered a TCP handshake ({peers})"
    rtt = max(known)
    with torch.device("meta"):
        model = build_model(cfg.model.name, vocab_size=vocab_size, seq_len=cfg.model.seq_len)
    params, layers = sum(p.numel() for p in model.parameters()), len(transformer_blocks(model))
    codec = codec_from_config(cfg)
    bits = 8.0 * codec.encoded_size(1 << 20) / (1 << 20)
    step_s, how = measure_step_s(cfg, vocab_size)
    d = cfg.diloco
    ahead = auto_steps(rtt, step_s, d.inner_steps) if d.prematch_steps == "auto" else d.prematch_steps
    fit = round_fit(mode=d.mode, inner_steps=d.inner_steps, fragments=d.num_fragments, overlap_steps=d.overlap_steps,
                    params=params, layers=layers, codec_bits=bits, step_time_s=step_s, link_mbit=cfg.net.link_mbit,
                    rtt_s=rtt, prematch=ahead > 0, slow_start_after_idle=restarts_after_idle())
    text = (f"RTT {peers} (rate: --link-mbit {cfg.net.link_mbit:g} Mbit/s; rounds measure it); a step "
            f"~{step_s:.3f} s ({how}); groups formed ahead: "
            f"{PrematchChoice(ahead, d.prematch_steps == 'auto', rtt, step_s).describe()}; {fit.line()}")
    if fit.fits:
        return text
    return "warn", text + "; to fit: " + "; ".join(fit.advice)


def check_data(cfg: RunConfig, shard: tuple[int, int]) -> str:
    train_source, val, vocab = prepare_data(cfg)
    rank, world = shard
    batch = next(train_source.batches(rank, world, cfg.train.batch_size))
    if int(batch.max()) >= vocab:
        raise ValueError(f"token id {int(batch.max())} is outside the vocabulary ({vocab}): use the model's tokenizer")
    what = ("streamed" if getattr(train_source, "streaming", False)
            else f"{train_source.num_windows * (train_source.seq_len + 1) / 1e6:.1f} M training tokens")
    return (f"{cfg.data.dataset}: {what}, {len(val)} validation windows; shard {rank}/{world} "
            f"gives batches of {tuple(batch.shape)}, vocabulary {vocab}")


def check_device(device: str, ranks: int = 1) -> "str | tuple[str, str]":
    """``train.device`` as a run here would resolve it (``auto``: the first CUDA device torch sees,
    else the CPU), with a ``[warn]`` for an explicit ``cpu`` while torch sees a GPU."""
    from opendiloco_stream.train.devices import (  # lazy: loads torch; --help stays light
        describe_device, idle_gpu_notice, resolve_device)

    resolved = resolve_device(device, ranks)
    problem = device_problem(resolved, ranks)
    if problem is not None:
        absent, message = problem
        if not absent:
            raise ValueError(message)
        return "warn", f"{message} (fine if you are checking another machine's file)"
    notice = idle_gpu_notice(device)
    if notice is not None:
        return "warn", f"{describe_device(device, resolved)}; {notice}"
    return describe_device(device, resolved)


def check_addresses(cfg: RunConfig) -> str:
    from opendiloco_stream.net.dht import check_run_id, listen_maddrs  # lazy: loads hivemind; --help stays light

    if not cfg.net.initial_peers:
        raise UsageError("no initial peers: set net.initial_peers (or --initial-peers) to the line the bootstrap printed")
    check_run_id(cfg.net.run_id)
    host, announce = listen_maddrs(cfg.net)
    if cfg.net.client_mode:
        return f"{len(cfg.net.initial_peers)} initial peer(s); client mode: connects out only, listens nowhere"
    return (f"{len(cfg.net.initial_peers)} initial peer(s); listens on {' '.join(host)}; "
            f"announces {' '.join(announce) or 'its interface addresses'}")


def check_identity(path: Optional[str]) -> str:
    from opendiloco_stream.net.dht import NetError, ensure_identity  # lazy: loads hivemind; --help stays light

    if not path:
        return "warn", "no identity_path: the peer id changes at every start (set net.identity_path)"
    p = Path(path).expanduser()
    if p.exists():
        return f"{path}: peer id {ensure_identity(str(p))}"
    parent = next((d for d in [p.parent, *p.parent.parents] if d.exists()), Path("/"))
    if not os.access(parent, os.W_OK):
        raise NetError(f"identity file {path} does not exist and {parent} is not writable: create it elsewhere")
    return f"{path}: does not exist yet; created at the first start (a new peer id)"


def check_run_key(cfg: RunConfig) -> str:
    from opendiloco_stream.net.auth import RunAuth  # lazy: loads hivemind; --help stays light

    auth = RunAuth.from_config(cfg.net)  # raises ConfigError: missing, unreadable, too short
    where = cfg.net.run_key_file or "net.run_key (ODS_NET__RUN_KEY)"
    return f"{where}: readable, key id {auth.key_id} (peers of the run must show the same id)"


def check_ports(cfg: RunConfig) -> str:
    done = []
    if cfg.net.port and not cfg.net.client_mode:
        for kind, label in ((socket.SOCK_STREAM, "tcp"), (socket.SOCK_DGRAM, "udp")):
            why = _port_free(cfg.net.port, kind)
            if why:
                raise UsageError(f"p2p port {cfg.net.port}/{label} is {why}: pick another net.port (--port) or stop "
                                 f"the process holding it (ss -ltnup | grep :{cfg.net.port})")
        done.append(f"p2p {cfg.net.port} tcp+udp free")
    elif not cfg.net.client_mode:
        done.append("p2p port: a random free one")
    if cfg.net.data_port and cfg.net.direct and not cfg.net.client_mode:
        first, last = cfg.net.data_port, cfg.net.data_port + cfg.diloco.num_fragments - 1
        if last > 65535:
            raise UsageError(f"data ports {first}-{last} (net.data_port + one per fragment) go past 65535: "
                             f"pick a lower --data-port")
        taken = {cfg.net.port: "the p2p port", cfg.net.metrics_port: "the metrics port"}
        for port in range(first, last + 1):
            why = f"{taken[port]} too" if port in taken else _port_free(port, socket.SOCK_STREAM)
            if why:
                raise UsageError(f"data port {port}/tcp (net.data_port + fragment) is {why}: pick another "
                                 f"--data-port, stop the process holding it (ss -ltnp | grep :{port}), or --no-direct")
        done.append(f"data {first}-{last} tcp free" if last > first else f"data {first} tcp free")
    elif not cfg.net.client_mode:
        done.append("data ports: random free ones" if cfg.net.direct else "data path: p2p daemon only (--no-direct)")
    if cfg.net.direct and cfg.net.direct_plaintext:
        done.append("data path NOT sealed (--direct-plaintext: for measuring only)")
    if cfg.net.metrics_port:
        why = _port_free(cfg.net.metrics_port, socket.SOCK_STREAM)
        if why:
            raise UsageError(f"metrics port {cfg.net.metrics_port}/tcp is {why}: pick another net.metrics_port "
                             f"(--metrics-port)")
        done.append(f"metrics {cfg.net.metrics_port} free")
    return "; ".join(done) or "no port to listen on (client mode)"


def dry_run(cfg: RunConfig, sources: ConfigSources, *, command: str, config_path: Optional[str],
            workers: Optional[int] = None) -> int:
    """Print and check ``cfg`` for ``command`` (``peer`` or ``local``); raise UsageError on a failure."""
    from opendiloco_stream.train.data import load_tokenizer  # lazy: loads torch; --help stays light

    origins = "default < file < env (ODS_SECTION__FIELD) < flag"
    print(f"{command} configuration ({config_path or 'no --config file'}; origin: {origins}):")
    print("\n".join(format_config(cfg, sources)))
    print("checks:")
    checks = Checks()
    peer_id = None
    if command == "peer":
        checks.run("addresses", lambda: check_addresses(cfg))
        ident = checks.run("identity", lambda: check_identity(cfg.net.identity_path))
        if ident and cfg.net.identity_path and Path(cfg.net.identity_path).expanduser().is_file():
            from opendiloco_stream.net.dht import ensure_identity  # lazy: loads hivemind; --help stays light

            peer_id = ensure_identity(cfg.net.identity_path)  # exists: only read
        checks.run("ports", lambda: check_ports(cfg))
        if cfg.net.run_key_file or cfg.net.run_key is not None:
            checks.run("run key", lambda: check_run_key(cfg))
        shard, shard_note = (0, 1), ""
        if cfg.data.shard == "auto" and peer_id is None:
            shard, shard_note = parse_shard("auto", "dry-run"), " (auto: the shard is picked from the peer id at start)"
        else:
            picked: list = []
            checks.run("shard", lambda: picked.append(parse_shard(cfg.data.shard, peer_id or "")) or
                       f"{cfg.data.shard} -> {picked[0][0]}/{picked[0][1]}")
            shard = picked[0] if picked else shard
    else:
        shard, shard_note = (0, workers or 1), ""
    tokenizer = checks.run("tokenizer", lambda: _tokenizer_line(load_tokenizer(cfg.data.tokenizer)))
    if tokenizer is not None:
        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
        checks.run("model", lambda: check_model(cfg, vocab))
        checks.run("data", lambda: check_data(cfg, shard) + shard_note)
        if command == "peer" and cfg.net.initial_peers and not checks.failure:
            checks.run("link", lambda: check_link(cfg, vocab))
    checks.run("device", lambda: check_device(cfg.train.device, cfg.train.nproc_per_node))
    if checks.failure:
        raise UsageError(f"dry run failed: {checks.failure}")
    print("dry run passed: nothing was started; run the same command without --dry-run")
    return 0


def _tokenizer_line(tok) -> str:
    return f"{getattr(tok, 'name', 'byte-level')}: {tok.vocab_size} tokens"
