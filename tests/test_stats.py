"""One stats record: the summary, the multi-peer combine and the live monitor all count with SyncStats;
one JSON-lines reader."""

from __future__ import annotations


import pytest

from opendiloco_stream.commands.local_hivemind import combine
from opendiloco_stream.config import load_config
from opendiloco_stream.net.metrics import live_values, to_record
from opendiloco_stream.stats import SyncStats
from opendiloco_stream.train.loop import WorkerReport, summarize
from opendiloco_stream.train.metrics_file import MetricsTail, MetricsWriter, read_metrics

A = SyncStats(bytes_sent=100, bytes_received=90, peak_bytes_per_sync=60, syncs=3, failed_syncs=1,
              local_only_steps=2, wait_s=0.5, rejected=1)
B = SyncStats(bytes_sent=40, bytes_received=50, peak_bytes_per_sync=70, syncs=2, failed_syncs=0,
              local_only_steps=0, wait_s=0.25, rejected=0)


def test_merge_sums_counters_and_keeps_the_larger_peak():
    total = SyncStats.total([A, B])
    assert total == SyncStats(bytes_sent=140, bytes_received=140, peak_bytes_per_sync=70, syncs=5, failed_syncs=1,
                              local_only_steps=2, wait_s=0.75, rejected=1)
    assert SyncStats.total([]) == SyncStats()
    assert SyncStats.from_record({**A.to_record(), "mode": "eager"}) == A  # other keys of a record are ignored
    copy = SyncStats.of(A)
    copy.syncs += 1
    assert A.syncs == 3 and SyncStats.of(A.to_record()) == A  # a copy, from a record or a dict


def test_summary_and_multi_peer_combine_agree_on_the_counters():
    cfg = load_config(environ={})
    reports = [WorkerReport(rank=r, steps=10, tokens=100, eval_loss_initial=5.0, eval_loss=4.0, train_loss=4.5,
                            compute_s=1.0, wall_s=2.0, stats=s) for r, s in enumerate((A, B))]
    together = summarize(cfg, reports, 2.0, lambda n: n)
    per_peer = [summarize(cfg, [r], 2.0, lambda n: n) for r in reports]
    combined = combine([{**s, "peer_id": f"p{i}"} for i, s in enumerate(per_peer)], 2.0)
    for key in (*A.to_record(), "bytes_sent_per_worker"):
        assert together[key] == combined[key] == SyncStats.total([A, B]).summary_fields(2)[key], key
    assert together["bytes_sent_per_worker"] == 70 and together["peak_bytes_per_sync"] == 70
    per_peer[0]["eval_loss_global"], per_peer[1]["eval_loss_global"] = 3.0, 3.5
    assert combine(per_peer, 2.0)["eval_loss_global"] == 3.25  # the mean of the peers' theta_bar evals


def test_the_live_monitor_publishes_the_same_record():
    values = live_values(A, step=7, loss=2.5, tokens_per_s=10.0, compute_utilization=0.5, mode="eager")
    record = to_record(values, name="a", peer_id="b", time=1.0)
    assert (record["bytes_sent"], record["bytes_received"]) == (A.bytes_sent, A.bytes_received)
    assert (record["rounds"], record["failed_rounds"]) == (A.syncs - A.failed_syncs, A.failed_syncs)
    assert (record["step"], record["loss"], record["mode"]) == (7, 2.5, "eager")
    landed = SyncStats(syncs=4, failed_syncs=1, land_steps=15, peak_land_steps=6)
    assert to_record(live_values(landed, step=1), name="a", peer_id="b", time=1.0)["land_steps"] == 5.0


def test_one_reader_for_whole_files_and_files_still_being_written(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path))
    writer.write({"event": "step", "step": 1})
    tail = MetricsTail(path)
    assert tail.read() == [{"event": "step", "step": 1}]
    with open(path, "a") as fh:
        fh.write('{"event": "step", "st')  # a writer mid-line
    assert tail.read() == []  # not yet complete
    with open(path, "a") as fh:
        fh.write('ep": 2}\nnot json\n{"event": "summary"}')  # the last line without its newline
    assert tail.read() == [{"event": "step", "step": 2}]  # the garbled line is skipped
    assert tail.read(final=True) == [{"event": "summary"}]
    writer.close()
    assert [r["event"] for r in read_metrics(path)] == ["step", "step", "summary"]
    assert read_metrics(tmp_path / "missing.jsonl") == []


@pytest.mark.parametrize("stats", [A, A.to_record()])
def test_worker_reports_accept_the_record_or_the_old_dict(stats):
    assert SyncStats.of(stats) == A


def test_a_failed_round_s_record_carries_the_transport_s_message_and_a_good_one_none():
    """``SyncLog``: the sync record of a failed round has its reason and the transport's message
    (where the round stood), taken once; a successful round's record has neither."""
    import torch

    from opendiloco_stream.algorithm.sync_log import SyncLog
    from opendiloco_stream.transport.base import SyncFailed, SyncHandle, SyncResult

    class Handle(SyncHandle):  # what a transport hands back: done, with a result or a failure
        def __init__(self, key, outcome):
            self.key, self._outcome = key, outcome

        def done(self) -> bool:
            return True

        def wait(self, timeout=None):
            if isinstance(self._outcome, Exception):
                raise self._outcome
            return self._outcome

    log = SyncLog()
    why = "round (1, 0): not finished within 19.0s (contributions 2/3, verdicts 0/2, results 0/2)"
    result, reason, _ = log.wait(Handle((1, 0), SyncFailed(why, key=(1, 0), reason="timeout")), timeout=1.0)
    assert result is None and reason == "timeout"
    log.record(1, 0, 10, result, reason, 0.5, "local-only")
    ok = SyncResult(average=torch.zeros(3), sent=torch.zeros(3), group_size=2, weight_share=0.5,
                    bytes_sent=12, bytes_received=12)
    result, reason, _ = log.wait(Handle((0, 1), ok), timeout=1.0)
    log.record(0, 1, 15, result, reason, 0.0, "average")
    failed, good = log.events
    assert failed["ok"] is False and failed["reason"] == "timeout" and failed["message"] == why
    assert good["ok"] is True and "message" not in good and "reason" not in good
    assert log._messages == {}  # taken with its record
