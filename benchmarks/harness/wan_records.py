"""One benchmark run's record: peers' JSON-lines metrics + interface counters -> the figures wan.py reports.

Byte accounting, two ways, per peer:

* **ours**: the ``bytes_sent`` the transport reports for every successful round. Rounds launched
  in the last H steps (eager: one per fragment) or due after the end (tau) are not consumed by
  the trainer, so they are not in the summary; the peer's final checkpoint (``--checkpoint-dir``)
  waits for them and stores their results, byte counts included, and ``tail_rounds`` adds them.
* **interface**: ``tx_bytes`` of the peer's ``wan0`` over the run (Ethernet frames as the kernel
  counts them, a GSO super-frame once). ``tcp_payload`` removes one 66-byte Ethernet + IPv4 +
  TCP header per counted frame; ``sync_payload`` further removes the traffic a peer sends when it
  never syncs (DHT upkeep, metrics records), measured by the no-sync run, per second of run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

#: the benchmark's modes, in the order every table lists them
LABELS = ["data-parallel", "diloco", "streaming", "streaming-tau1", "streaming-eager"]
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 32 (timestamps on), once per frame the veth counts


def mean(xs: list[Optional[float]]) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else math.nan


def tail_rounds(ckpt_dir: Path) -> dict[str, int]:
    """Rounds in flight at the last step, from the peer's final checkpoint (which waited for them)."""
    import torch

    out = {"rounds": 0, "failed": 0, "bytes_sent": 0, "bytes_received": 0}
    files = sorted(ckpt_dir.glob("*.pt"))
    if not files:
        return out
    state = torch.load(files[0], map_location="cpu", weights_only=False)["diloco"]
    for pend in state.get("pending") or []:
        if pend is None:
            continue
        out["rounds"] += 1
        res = pend.get("result")
        if res is None:
            out["failed"] += 1  # the transport reports no byte counts for a failed round
        else:
            out["bytes_sent"] += int(res["bytes_sent"])
            out["bytes_received"] += int(res["bytes_received"])
    for f in files:  # ~20 MB each: only the counts were needed
        f.unlink()
    return out


def peer_figures(recs: list[dict[str, Any]], mode: str, iface: dict[str, int], tail: dict[str, int],
                 other_bps: float, elapsed: float) -> dict[str, Any]:
    """One peer's figures from its metrics records (``summary`` missing if it did not finish)."""
    steps = [x for x in recs if x.get("event") == "step"]
    syncs = [x for x in recs if x.get("event") == "sync"]
    summary = next((x for x in recs if x.get("event") == "summary"), None)
    compute = sum(x["compute_s"] for x in steps)
    p: dict[str, Any] = {"steps": len(steps), "tokens": sum(x["tokens"] for x in steps),
                         "step_time_s": compute / len(steps) if steps else math.nan,
                         "bytes_sent": sum(x.get("bytes_sent", 0) for x in syncs if x.get("ok")),
                         "bytes_received": sum(x.get("bytes_received", 0) for x in syncs if x.get("ok")),
                         "syncs_ok": sum(1 for x in syncs if x.get("ok")),
                         "syncs_failed": sum(1 for x in syncs if not x.get("ok")),
                         "failure_reasons": sorted({x.get("reason", "?") for x in syncs if not x.get("ok")}),
                         "wait_s": sum(x.get("wait_s", 0.0) for x in syncs), "iface": dict(iface), "tail": tail,
                         # per successful round: [fragment, round, wait_s, bytes_sent] (for the latency estimate)
                         "round_waits": [[x["fragment"], x["round"], x["wait_s"], x["bytes_sent"]]
                                         for x in syncs if x.get("ok")]}
    if summary is not None:
        # the trainer's utilization is compute / training-loop wall time (evals excluded); data-parallel's
        # all-reduce runs inside opt.step, so its wait is moved from compute to communication
        adj = compute - (summary["wait_s"] if mode == "data-parallel" else 0.0)
        util = summary["compute_utilization"]
        train_wall = adj / util if util > 0 else math.nan
        p.update(compute_utilization=util, wait_s=summary["wait_s"], eval_loss=summary["eval_loss"],
                 eval_loss_initial=summary["eval_loss_initial"], bytes_sent=summary["bytes_sent"],
                 bytes_received=summary["bytes_received"], peak_bytes_per_sync=summary["peak_bytes_per_sync"],
                 train_wall_s=train_wall, tokens_per_s=p["tokens"] / train_wall if train_wall > 0 else math.nan,
                 local_only_steps=summary["local_only_steps"], params=summary["params"],
                 stopped_early=summary.get("stopped_early", False))
        if mode == "data-parallel" and steps:
            p["step_time_s"] = adj / len(steps)
    p["bytes_sent_all_rounds"] = p["bytes_sent"] + tail["bytes_sent"]
    if iface:
        p["iface"]["tcp_payload_bytes"] = iface["tx_bytes"] - HEADER_BYTES * iface["tx_packets"]
        p["iface"]["other_traffic_bytes"] = round(other_bps * elapsed)
        p["iface"]["sync_payload_bytes"] = p["iface"]["tcp_payload_bytes"] - p["iface"]["other_traffic_bytes"]
    return p


def aggregate(per_peer: list[dict[str, Any]]) -> dict[str, Any]:
    """Run-level figures: means over peers of per-peer amounts, sums of rates and counts."""
    tokens = [p["tokens"] for p in per_peer]
    out = {
        "steps_done": min((p["steps"] for p in per_peer), default=0),
        "tokens": sum(tokens),
        "compute_utilization": mean([p.get("compute_utilization") for p in per_peer]),
        "tokens_per_s": sum(p.get("tokens_per_s", math.nan) for p in per_peer) if per_peer else math.nan,
        "step_time_s": mean([p["step_time_s"] for p in per_peer]),
        # what went on the wire by our accounting: every round launched (tail included)
        "bytes_per_peer": mean([p["bytes_sent_all_rounds"] for p in per_peer]),
        "bytes_all_rounds_per_peer": mean([p["bytes_sent_all_rounds"] for p in per_peer]),
        # the trainer summary's figure: consumed rounds only
        "bytes_consumed_per_peer": mean([p["bytes_sent"] for p in per_peer]),
        "bytes_received_per_peer": mean([p["bytes_received"] for p in per_peer]),
        "peak_bytes_per_sync": max((p.get("peak_bytes_per_sync", 0) for p in per_peer), default=0),
        "wait_s": mean([p["wait_s"] for p in per_peer]),
        "eval_loss": mean([p.get("eval_loss") for p in per_peer]),
        "eval_loss_initial": mean([p.get("eval_loss_initial") for p in per_peer]),
        "syncs_ok": sum(p["syncs_ok"] for p in per_peer),
        "syncs_failed": sum(p["syncs_failed"] for p in per_peer),
        "tail_rounds": sum(p["tail"]["rounds"] for p in per_peer),
        "tail_rounds_failed": sum(p["tail"]["failed"] for p in per_peer),
        "iface_tx_bytes_per_peer": mean([p["iface"].get("tx_bytes") for p in per_peer]),
        "iface_rx_bytes_per_peer": mean([p["iface"].get("rx_bytes") for p in per_peer]),
        "iface_tx_packets_per_peer": mean([p["iface"].get("tx_packets") for p in per_peer]),
        "iface_sync_payload_per_peer": mean([p["iface"].get("sync_payload_bytes") for p in per_peer]),
    }
    ours = out["bytes_all_rounds_per_peer"]
    out["wire_agreement"] = out["iface_sync_payload_per_peer"] / ours if ours else math.nan
    tok_peer = mean(tokens)
    # every round the schedule launched (tail included): what the method costs per token
    out["bytes_per_token"] = ours / tok_peer if tok_peer else math.nan
    out["iface_bytes_per_token"] = out["iface_tx_bytes_per_peer"] / tok_peer if tok_peer else math.nan
    return out


def clean(rec: dict[str, Any]) -> bool:
    """Every round of the run succeeded, so our accounting covers every byte the peers sent
    (the transport reports no byte counts for a failed round)."""
    return (rec["status"] == "ok" and rec["bytes_all_rounds_per_peer"] > 0 and rec["syncs_failed"] == 0
            and rec["tail_rounds_failed"] == 0)


def rounds_per_peer(rec: dict[str, Any]) -> float:
    """Successful rounds per peer, tail rounds included."""
    return mean([p["syncs_ok"] + p["tail"]["rounds"] - p["tail"]["failed"] for p in rec["per_peer"]])


#: how the transport's round phases (``SyncResult.phases``) are grouped in the distance tables
PHASE_GROUPS = {"matchmaking": ("matchmaking",), "exchange": ("contributions", "verdicts", "reduce", "results"),
                "host": ("prepare", "drain", "finish")}


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x is not None and x == x)
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def distance_figures(recs: list[dict[str, Any]], group: int) -> dict[str, Any]:
    """One peer's rounds at distance: how many averaged with the whole group (``group`` peers),
    the failed ones by reason, and the median seconds per phase group of its successful rounds
    (from the sync records' ``phases``, where the transport reports them)."""
    syncs = [x for x in recs if x.get("event") == "sync"]
    full = [x for x in syncs if x.get("ok") and x.get("group_size") == group]
    first = {}
    for x in syncs:
        first.setdefault(x["fragment"], x["round"])
    reasons: dict[str, int] = {}
    for x in syncs:
        if not x.get("ok"):
            reasons[x.get("reason", "?")] = reasons.get(x.get("reason", "?"), 0) + 1
    phased = [x["phases"] for x in syncs if x.get("ok") and x.get("phases")]
    split = {name: _median([sum(p.get(k, 0.0) for k in keys) for p in phased]) for name, keys in PHASE_GROUPS.items()}
    return {"rounds": len(syncs), "rounds_with_all": len(full),
            # from each fragment's second round: the first one may meet a peer still starting
            "rounds_after_first": sum(1 for x in syncs if x["round"] != first[x["fragment"]]),
            "rounds_with_all_after_first": sum(1 for x in full if x["round"] != first[x["fragment"]]),
            "failure_counts": reasons, "round_s": _median([sum(p.values()) for p in phased]),
            **{f"phase_{name}_s": v for name, v in split.items()}}


def aggregate_distance(per_peer: list[dict[str, Any]]) -> dict[str, Any]:
    """Run-level distance figures: the worst peer's rounds with everyone, failures summed over
    peers, phase medians averaged over peers."""
    reasons: dict[str, int] = {}
    for p in per_peer:
        for k, n in p.get("failure_counts", {}).items():
            reasons[k] = reasons.get(k, 0) + n
    out: dict[str, Any] = {
        "rounds_per_peer": max((p.get("rounds", 0) for p in per_peer), default=0),
        "rounds_with_all_min": min((p.get("rounds_with_all", 0) for p in per_peer), default=0),
        "rounds_with_all_after_first_min": min((p.get("rounds_with_all_after_first", 0) for p in per_peer), default=0),
        "rounds_after_first": max((p.get("rounds_after_first", 0) for p in per_peer), default=0),
        "failure_counts": reasons}
    for key in ("round_s", *(f"phase_{name}_s" for name in PHASE_GROUPS)):
        out[key] = mean([p.get(key) for p in per_peer])
    return out
