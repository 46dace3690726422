"""A late joiner's state download, for a real model preset: time, rate, the joiner's memory, and a
download cut mid-way that resumes from another donor.

    python -m benchmarks.join_state                 # the 100M preset (~2 min)
    python -m benchmarks.join_state --quick         # the tiny preset (a smoke run)
    python -m benchmarks.join_state --model 35M --out benchmarks/results/join-35M.json

Three loopback peers (benchmarks/harness/loopback.py: each its own DHT and p2p daemon, on 127.0.0.1).
Peers 0 and 1 are donors: each builds the preset, wraps it in ``StreamingDiLoCo`` (blocking,
P = H = ``--fragments``) and takes ``--steps`` steps on a 1-peer ``LocalSwarm``, so its state
holds real outer parameters and Nesterov momentum (2 x model fp32), then serves
``StreamingDiLoCo.state_dict()`` as a running peer does. Both donors are built from the same seed
and batches, so their states are bit-identical, as theta_bar and the momentum are on every peer of a
run. Peer 2 joins:

- ``whole``: one download from a donor.
- ``resumed``: the first donor asked dies (``os._exit``, 2 s after its first lane reached tensor
  ``n / 2``: ``testing/faults.py``) when about to send tensor ``n / 2``; the
  joiner keeps the tensors it has and gets the rest from the other donor (``state.py``, resuming).

Per download: seconds, MiB/s of state, bytes over the wire and reused, and the joiner's resident
memory: RSS before, and the peak (VmHWM, reset just before the download) above it, against the
state's size. The target is the state plus about one tensor's serialized parts (the largest tensor
is listed). Prints a table and writes JSON (``--out``, default benchmarks/results/join-state[-quick].json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.harness.results import RESULTS_DIR, markdown_table, write_result
from benchmarks.harness.loopback import LoopbackSwarm

MiB = 1 << 20


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def serve_model_state(peer, model: str, fragments: int, steps: int, seq_len: int, vocab: int,
                      claim_dir: str, die_at_half: bool) -> dict:
    """Inside a donor: build the preset, take a few StreamingDiLoCo steps, serve its state. With
    ``die_at_half`` the first donor asked (a claim file decides) dies half-way through the stream."""
    import torch

    from opendiloco_stream.algorithm import wrap
    from opendiloco_stream.config import DiLoCoConfig
    from opendiloco_stream.testing import faults
    from opendiloco_stream.train.models import build_model
    from opendiloco_stream.transport.local import LocalSwarm

    torch.manual_seed(0)
    net = build_model(model, vocab, seq_len, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    diloco = wrap(net, opt, transport=LocalSwarm(1, codec="fp32").transport(0),
                  config=DiLoCoConfig(mode="blocking", inner_steps=fragments, num_fragments=fragments, codec="fp32"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps or 2 * fragments):  # every fragment syncs: momentum exists
        x = torch.randint(vocab, (1, seq_len), generator=gen)
        net(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        diloco.step(tokens=seq_len)
    state = diloco.state_dict()

    def provider() -> dict:
        if die_at_half:
            try:
                fd = os.open(os.path.join(claim_dir, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                from opendiloco_stream.transport.hivemind.state import flatten_state

                faults.inject(die_after_tensors=len(flatten_state(state)[1]) // 2)  # test-only hook
        return state

    peer.transport.set_state_provider(provider)
    tensors = [t for f in state["fragments"] for t in f["outer_params"]]
    return {"params": sum(p.numel() for p in net.parameters()), "largest_tensor_mib": max(t.numel() for t in tensors) * 4 / MiB}


def join(peer, load_timeout: float) -> dict:
    """Inside the joiner: download the state; time, memory, what the download reported."""
    import gc

    gc.collect()
    rss_before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    records: list = []
    t0 = time.perf_counter()
    state = peer.transport.load_state_from_peers(load_timeout, progress=records.append)
    seconds = time.perf_counter() - t0
    peak = _kib("VmHWM")
    ok = state is not None
    state_bytes = records[-1]["total_bytes"] if records else 0
    del state
    return dict(ok=ok, seconds=seconds, rss_before_mib=rss_before / 1024, peak_above_mib=(peak - rss_before) / 1024,
                state_mib=state_bytes / MiB, progress=records, last_load=dict(peer.transport._sharing().last_load))


def run(kind: str, args: argparse.Namespace, claim_dir: Path) -> dict:
    swarm = LoopbackSwarm(3, run_id=f"joinbench{os.getpid()}{kind}",
                          transport_kwargs=dict(codec="fp32", state_timeout=args.chunk_timeout))
    try:
        swarm.start()
        info = {}
        for i in (0, 1):
            info = swarm.peers[i].call("call", "benchmarks.join_state:serve_model_state", model=args.model,
                                       fragments=args.fragments, steps=args.steps, seq_len=args.seq_len,
                                       vocab=args.vocab, claim_dir=str(claim_dir), die_at_half=kind == "resumed",
                                       timeout=900)
        out = swarm.peers[2].call("call", "benchmarks.join_state:join", load_timeout=args.timeout, timeout=args.timeout + 60)
        return dict(out, kind=kind, **info)
    finally:
        swarm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="100M")
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--steps", type=int, default=0, help="donor steps before serving (default 2 x P: every fragment syncs twice)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--timeout", type=float, default=600.0, help="the joiner's download budget (s)")
    ap.add_argument("--chunk-timeout", type=float, default=10.0, help="a silent donor is given up after this (s)")
    ap.add_argument("--quick", action="store_true", help="the tiny preset")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.vocab = "tiny", 1000
    out = args.out or RESULTS_DIR / ("join-state-quick.json" if args.quick else "join-state.json")
    rows = []
    for kind in ("whole", "resumed"):
        claim = RESULTS_DIR.parent / f".join-claim-{os.getpid()}-{kind}"
        claim.mkdir(parents=True, exist_ok=True)
        try:
            r = run(kind, args, claim)
        finally:
            for f in claim.iterdir():
                f.unlink()
            claim.rmdir()
        rows.append(r)
        print(f"{kind}: ok={r['ok']} {r['seconds']:.1f}s state {r['state_mib']:.0f} MiB, peak +{r['peak_above_mib']:.0f} MiB, "
              f"donors tried {len(r['last_load']['donors'])}, reused {r['last_load']['reused_bytes'] / MiB:.0f} MiB",
              flush=True)
    headers = ["download", "model", "state MiB", "seconds", "MiB/s", "received MiB", "reused MiB", "donors",
               "joiner peak above start MiB", "peak / state", "largest tensor MiB"]
    table = markdown_table(headers, [
        [r["kind"], f"{args.model} ({r['params'] / 1e6:.0f}M)", round(r["state_mib"]), f"{r['seconds']:.1f}",
         f"{r['state_mib'] / r['seconds']:.1f}", round(r["last_load"]["received_bytes"] / MiB),
         round(r["last_load"]["reused_bytes"] / MiB), len(r["last_load"]["donors"]), round(r["peak_above_mib"]),
         f"{r['peak_above_mib'] / r['state_mib']:.2f}" if r["state_mib"] else "-", round(r["largest_tensor_mib"])]
        for r in rows])
    print(table)
    write_result(out, settings=vars(args) | {"out": out}, rows=rows, argv=argv, benchmark="join_state", table=table)
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
