"""Multi-rank peers (``peer --nproc-per-node 2``, gloo on CPU): two real peers of two ranks each train
together over hivemind; a SIGKILLed rank stops its own peer cleanly and the other peer goes on. A
sharded peer (``--sharding fsdp``) trains with a one-process peer and resumes from its shards.

Every process is started by PID in its own session and killed (whole tree) in a finally block.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict

import pytest

from opendiloco_stream.commands.local_hivemind import start_bootstrap, stop_processes
from opendiloco_stream.net.lifecycle import descendants, wait_gone
from opendiloco_stream.testing import faults
from opendiloco_stream.train.loop import read_metrics as records
from tests.support.peers import start_peer, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow]


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of rank ``rank`` among the launcher's children (from their environment)."""
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and env.get(b"MASTER_ADDR") == b"127.0.0.1":
            return pid
    raise AssertionError(f"no rank {rank} under {launcher}")


@pytest.mark.timeout(300)
def test_two_peers_of_two_ranks_train_together_and_a_killed_rank_stops_only_its_peer(tmp_path):
    boot, addrs = start_bootstrap(tmp_path, "ranks")
    procs = [boot]
    try:
        common = ["--run-id", "ranks", "--mode", "eager", "--codec", "fp32", "--fragments", "2",
                  "--inner-steps", "8", "--target-group-size", "2", "--no-join", "--nproc-per-node", "2",
                  "--sync-timeout", "30"]
        a = start_peer(tmp_path, "a", addrs, *common, "--steps", "40", "--shard", "0/2")
        b = start_peer(tmp_path, "b", addrs, *common, "--steps", "1000", "--shard", "1/2")
        procs += [a, b]

        def shared_rounds() -> int:
            return sum(r["event"] == "sync" and r["ok"] and r["group_size"] == 2 for r in records(tmp_path / "b.jsonl"))
        wait_for(lambda: shared_rounds() >= 2, 180, "two rounds of the two peers", [a, b])
        tree = descendants(b.pid)  # b's two ranks, rank 0's DHT and averager processes, p2pd
        victim = rank_pid(b.pid, 1)
        os.kill(victim, signal.SIGKILL)
        b.wait(timeout=60)
        assert b.returncode != 0
        orphans = wait_gone(tree, timeout=30)
        for p in orphans:  # clean up before failing
            os.kill(p, signal.SIGKILL)
        assert not orphans, "a peer whose rank was killed left processes behind"
        assert "rank 1 ended with signal SIGKILL" in (tmp_path / "b.log").read_text()

        a.wait(timeout=180)  # the other peer trains on alone
        assert a.returncode == 0, (tmp_path / "a.log").read_text()[-3000:]
        recs_a, recs_b = records(tmp_path / "a.jsonl"), records(tmp_path / "b.jsonl")
        summary = recs_a[-1]
        assert summary["event"] == "summary", summary
        assert max(r["step"] for r in recs_a if r["event"] == "step") == 40  # (catch-up jumps count as steps)
        assert summary["ranks"] == 2 and len(set(summary["rank_digests"])) == 1, summary  # bit-identical ranks
        assert summary["eval_loss"] < summary["eval_loss_initial"] - 0.3, summary
        step_a = [r for r in recs_a if r["event"] == "step"]
        assert step_a[0]["tokens"] == 2 * 4 * 64  # both ranks' batches count (batch 4, seq 64)
        rounds = defaultdict(list)
        for r in recs_a + recs_b:
            if r["event"] == "sync" and r["ok"] and r["group_size"] == 2:
                rounds[(r["fragment"], r["round"])].append(r["digest"])
        both = {k: v for k, v in rounds.items() if len(v) == 2}
        assert len(both) >= 2, rounds
        assert all(len(set(v)) == 1 for v in both.values()), both  # the same average on both peers
    finally:
        stop_processes(procs, grace=10)


@pytest.mark.timeout(600)
def test_a_sharded_peer_trains_with_a_single_process_peer_and_resumes_from_its_shards(tmp_path):
    """``--sharding fsdp``: peer a's model, gradients and AdamW state are split over its 2 ranks. Its
    fragments go on the wire whole, so it averages with a one-process peer (bit-identical
    averages); its checkpoint is rank 0's file plus one shard file per rank, and a restart resumes
    from them."""
    boot, addrs = start_bootstrap(tmp_path, "sharded")
    procs = [boot]
    try:
        common = ["--run-id", "sharded", "--mode", "eager", "--codec", "fp4-e3m0", "--fragments", "2",
                  "--inner-steps", "8", "--target-group-size", "2", "--no-join", "--sync-timeout", "30"]
        ckpt = tmp_path / "ckpt"
        # The step delays leave the averagers CPU on 2 cores. The sharded peer is the slower one:
        # b, ahead, waits in each round's matchmaking for it. (The other way round, b would reach
        # every round only by catching up, seconds late, and on a loaded box could miss them all.)
        sharded = ["--nproc-per-node", "2", "--sharding", "fsdp", "--outer-device", "cpu",
                   "--checkpoint-dir", str(ckpt), "--checkpoint-every", "16"]
        a = start_peer(tmp_path, "a", addrs, *common, *sharded, "--steps", "48", "--shard", "0/2",
                       env=faults.env(step_delay_s=0.3))
        procs.append(a)
        # b starts once a trains (a's two ranks start slower) and trains on past a's end
        wait_for(lambda: any(r["event"] == "step" for r in records(tmp_path / "a.jsonl")), 120, "a's first step", [a])
        b = start_peer(tmp_path, "b", addrs, *common, "--steps", "1000", "--shard", "1/2",
                       env=faults.env(step_delay_s=0.1))
        procs.append(b)
        a.wait(timeout=240)
        assert a.returncode == 0, (tmp_path / "a.log").read_text()[-8000:]
        recs_a, recs_b = records(tmp_path / "a.jsonl"), records(tmp_path / "b.jsonl")
        summary = recs_a[-1]
        assert summary["event"] == "summary" and summary["ranks"] == 2, summary
        assert len(set(summary["rank_digests"])) == 1, summary  # both ranks gather the same whole model
        assert summary["eval_loss"] < summary["eval_loss_initial"] - 0.3, summary
        rounds = defaultdict(list)
        for r in recs_a + recs_b:
            if r["event"] == "sync" and r["ok"] and r["group_size"] == 2:
                rounds[(r["fragment"], r["round"])].append(r["digest"])
        both = {k: v for k, v in rounds.items() if len(v) == 2}
        assert len(both) >= 2, rounds  # (on 2 busy cores some rounds miss their matchmaking)
        assert all(len(set(v)) == 1 for v in both.values()), both  # the same average on both peers
        files = sorted(p.name for p in ckpt.iterdir())
        assert files == ["worker-0.pt", "worker-0.rank-0.pt", "worker-0.rank-1.pt"], files

        # a restart resumes from rank 0's file and the shards (and trains on with b)
        from tests.support.models import assert_export_is_theta_bar

        assert_export_is_theta_bar(ckpt, tmp_path / "exported")  # theta_bar whole in rank 0's file
        a2 = start_peer(tmp_path, "a2", addrs, *common, *sharded, "--steps", "56", "--shard", "0/2", "--resume",
                        "--save-model", str(tmp_path / "end"))
        procs.append(a2)
        a2.wait(timeout=240)
        assert a2.returncode == 0, (tmp_path / "a2.log").read_text()[-3000:]
        recs = records(tmp_path / "a2.jsonl")
        assert [r["step"] for r in recs if r["event"] == "resumed"] == [48]
        steps = [r["step"] for r in recs if r["event"] == "step"]
        # (catch-up jumps count as steps; one may jump past the last step: b is far ahead)
        assert steps[0] > 48 and steps[-1] >= 56, steps
        assert recs[-1]["eval_loss_initial"] < summary["eval_loss_initial"] - 0.3, recs[-1]  # trained weights
        from transformers import AutoModelForCausalLM

        end = AutoModelForCausalLM.from_pretrained(tmp_path / "end")  # --save-model on a sharded peer
        final = [r for r in recs if r["event"] == "eval" and r.get("stage") == "global"]
        assert final and f"{final[-1]['eval_loss']:.4f}" in (tmp_path / "end" / "README.md").read_text()
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
        assert [n for n, _ in end.named_parameters()] == [n for n, _ in exported.named_parameters()]
    finally:
        stop_processes(procs, grace=10)
