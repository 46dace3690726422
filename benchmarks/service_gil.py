"""What the averaging service's thread costs the trainer it shares a process (and a GIL) with.

    python -m benchmarks.service_gil                  # tiny model, 10M-element fp4 rounds, 3 x 20 s per condition
    python -m benchmarks.service_gil --seconds 5 --repeats 1 --numel 1000000   # a smoke run

Three real peers on 127.0.0.1 (``LoopbackSwarm``: one process each, with its DHT and p2pd). Peer 0
trains a model (one torch thread, random tokens, AdamW) for ``--seconds`` and counts its steps,
under three conditions, taken in turn within each repeat so that the machine's load falls on all
three alike:

- ``alone``: nothing else runs;
- ``rounds elsewhere``: peers 1 and 2 average a ``--numel`` fragment back to back meanwhile (the
  same work on the machine's other cores, in other processes);
- ``rounds in the trainer``: peer 0's own averaging service averages that fragment with peer 1
  back to back while it trains (the service's loop and codec threads in the trainer's process).

The two round conditions do not fit the same number of rounds in the same time, so the cost is
taken per round: the share of the trainer's tokens/s (against ``alone``) lost per round averaged
meanwhile, in each condition; the difference, at as many rounds as elsewhere, is what sharing the
process (and its GIL) adds. Rounds run back to back here; a run averages far less often (a round
of each fragment every H inner steps), and the cost scales with the rounds per second. The issue's
bound: if it exceeded 1% the service would move to a process of its own. Prints a table and
writes JSON (``--out``, default ``benchmarks/results/service-gil.json``).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.loopback import LoopbackSwarm, make_tensor
from benchmarks.harness.results import RESULTS_DIR, markdown_table, write_result

CONDITIONS = ("alone", "rounds elsewhere", "rounds in the trainer")
START_AHEAD_S = 2.0  # every peer of a condition starts at the same wall-clock moment


# ---------------------------------------------------------------------------------------- inside peers
def _wait_until(start_at: float) -> None:
    time.sleep(max(0.0, start_at - time.time()))


def average_for(peer, *, start_at: float, seconds: float, numel: int, key_base: int) -> dict:
    """Inside a peer: average fragment 0 back to back from ``start_at`` for ``seconds``."""
    from opendiloco_stream.transport.base import SyncFailed

    tensor = make_tensor(key_base, numel)
    _wait_until(start_at)
    ok = failed = 0
    r = 0
    while time.time() < start_at + seconds:
        try:
            peer.transport.all_reduce((0, key_base + r), tensor, 1.0).wait()
            ok += 1
        except SyncFailed:
            failed += 1
        r += 1
    return dict(rounds_ok=ok, rounds_failed=failed)


def train_for(peer, *, start_at: float, seconds: float, model: str, batch: int, seq_len: int,
              rounds: bool = False, numel: int = 0, key_base: int = 0) -> dict:
    """Inside peer 0: train ``model`` for ``seconds`` from ``start_at`` (after 3 warm-up steps);
    with ``rounds``, average a fragment back to back on its own service meanwhile."""
    from opendiloco_stream.train.models import build_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_model(model, vocab_size=259, seq_len=seq_len)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    tokens = torch.randint(0, 259, (batch, seq_len + 1))

    def step() -> None:
        logits = net(tokens[:, :-1])
        logits = getattr(logits, "logits", logits)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    background, out = None, {}
    if rounds:
        background = threading.Thread(target=lambda: out.update(average_for(
            peer, start_at=start_at, seconds=seconds, numel=numel, key_base=key_base)))
        background.start()
    _wait_until(start_at)
    steps, t0 = 0, time.perf_counter()
    while time.time() < start_at + seconds:
        step()
        steps += 1
    elapsed = time.perf_counter() - t0
    if background is not None:
        background.join()
    return dict(steps=steps, seconds=elapsed, tokens_per_s=steps * batch * seq_len / elapsed, **out)


# ---------------------------------------------------------------------------------------- driver
def run_condition(swarm: LoopbackSwarm, condition: str, args: argparse.Namespace, key_base: int) -> dict:
    start_at = time.time() + START_AHEAD_S
    common = dict(start_at=start_at, seconds=args.seconds)
    trainer = dict(common, model=args.model, batch=args.batch, seq_len=args.seq_len)
    fragment = dict(common, numel=args.numel, key_base=key_base)
    helpers = {"alone": [], "rounds elsewhere": [1, 2], "rounds in the trainer": [1]}[condition]
    swarm.peers[0].send("call", function="benchmarks.service_gil:train_for",
                        **trainer, rounds=condition == "rounds in the trainer",
                        numel=args.numel, key_base=key_base)
    for i in helpers:
        swarm.peers[i].send("call", function="benchmarks.service_gil:average_for", **fragment)
    timeout = args.seconds + 120
    row = dict(condition=condition, **swarm.peers[0].recv(timeout))
    others = [swarm.peers[i].recv(timeout) for i in helpers]
    if condition == "rounds elsewhere":
        row.update(rounds_ok=others[0]["rounds_ok"], rounds_failed=others[0]["rounds_failed"])
    return row


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Medians, and the cost of a round to the trainer: per repeat, the share of its tokens/s lost
    against ``alone``, per round averaged meanwhile (the two round conditions do not average the
    same number of rounds in the same time, so the raw tokens/s are not comparable). ``extra_at_
    equal_rounds``: what the trainer loses with the rounds in its own process beyond what it loses
    with as many rounds elsewhere (a share of its tokens/s alone, rounds back to back)."""
    by = {c: [r for r in rows if r["condition"] == c] for c in CONDITIONS}
    med = {c: statistics.median(r["tokens_per_s"] for r in rs) for c, rs in by.items()}
    per_round, extra = {c: [] for c in CONDITIONS[1:]}, []
    for alone, elsewhere, inside in zip(*(by[c] for c in CONDITIONS)):
        if alone["tokens_per_s"] <= 0:
            raise SystemExit("service_gil: the trainer took no step in an 'alone' window (it was not ready "
                             "in time): nothing to compare against; give it more --seconds")
        loss = {c: (alone["tokens_per_s"] - r["tokens_per_s"]) / alone["tokens_per_s"] / max(1, r.get("rounds_ok", 0))
                for c, r in (("rounds elsewhere", elsewhere), ("rounds in the trainer", inside))}
        for c, x in loss.items():
            per_round[c].append(x)
        extra.append((loss["rounds in the trainer"] - loss["rounds elsewhere"]) * elsewhere.get("rounds_ok", 0))
    return dict(tokens_per_s_median=med, loss_per_round=per_round,
                extra_at_equal_rounds=extra, extra_at_equal_rounds_median=statistics.median(extra),
                rounds_per_condition={c: [r.get("rounds_ok", 0) for r in rs] for c, rs in by.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--numel", type=int, default=10_000_000, help="fragment size averaged in the background")
    p.add_argument("--codec", default="fp4-e3m0")
    p.add_argument("--seconds", type=float, default=20.0, help="length of one condition")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "service-gil.json")
    args = p.parse_args()
    kwargs = dict(codec=args.codec, target_group_size=2, matchmaking_time=3.0, request_timeout=1.0)
    rows = []
    with LoopbackSwarm(3, run_id="servicegil", transport_kwargs=kwargs) as swarm:
        swarm.start()
        swarm.call_all("prepare", {0: args.numel}, timeout=120)
        # an unrecorded first window: peer 0's first model build imports transformers, which on a
        # loaded machine took longer than START_AHEAD_S + a short --seconds and left the first
        # recorded window ('alone') without a single step
        run_condition(swarm, "alone", args, key_base=0)
        for rep in range(args.repeats):
            for c, condition in enumerate(CONDITIONS):
                row = run_condition(swarm, condition, args, key_base=(rep * 3 + c) * 10_000)
                rows.append(dict(row, repeat=rep))
                print(f"repeat {rep} {condition}: {row['tokens_per_s']:.0f} tokens/s, "
                      f"{row.get('rounds_ok', 0)} rounds", flush=True)
    summary = summarize(rows)
    table = [[c, f"{summary['tokens_per_s_median'][c]:.0f}", " ".join(map(str, summary["rounds_per_condition"][c]))]
             for c in CONDITIONS]
    print(markdown_table(["condition", "trainer tokens/s (median)", "rounds averaged per repeat"], table))
    for c, xs in summary["loss_per_round"].items():
        print(f"{c}: tokens/s lost per round averaged, per repeat: {', '.join(f'{100 * x:.2f}%' for x in xs)}")
    print(f"extra loss with the rounds in the trainer, at as many rounds as elsewhere (rounds back to back): "
          f"{', '.join(f'{100 * x:.1f}%' for x in summary['extra_at_equal_rounds'])} "
          f"(median {100 * summary['extra_at_equal_rounds_median']:.1f}%)")
    write_result(args.out, settings=vars(args), rows=rows, benchmark="service_gil", **summary)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
