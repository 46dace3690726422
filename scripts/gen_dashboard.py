"""Build docker/grafana/opendiloco-stream.json, the Grafana dashboard of a standing run, with Grafana's
own Python SDK (grafana-foundation-sdk, in the test extra). A test rebuilds it and checks the file
is up to date and that every query names a metric the peers export.

    python scripts/gen_dashboard.py            # rewrite the JSON
    python scripts/gen_dashboard.py --check    # exit 1 if the file differs from what this builds
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = Path(__file__).resolve().parent.parent / "docker" / "grafana" / "opendiloco-stream.json"
SEL = 'run=~"$run", peer=~"$peer"'

# (title, unit, [(PromQL, legend)], description): one panel each, two per row
PANELS = [
    ("Training loss", "none", [(f"ods_loss{{{SEL}}}", "{{peer}}")], "Last training loss of each peer."),
    ("Eval loss", "none", [(f"ods_eval_loss{{{SEL}}}", "{{peer}}")], "Last evaluation loss of each peer."),
    ("Tokens per second", "short", [(f"ods_tokens_per_second{{{SEL}}}", "{{peer}}")],
     "Tokens over wall time since the peer started."),
    ("Compute utilization", "percentunit", [(f"ods_compute_utilization{{{SEL}}}", "{{peer}}")],
     "Compute time over wall time; the rest waits for rounds or input."),
    ("Group size", "none", [(f"ods_group_size{{{SEL}}}", "{{peer}} f{{fragment}}")],
     "Peers in each fragment's last completed round: 1 means the peer averaged alone."),
    ("Rounds per minute", "none",
     [(f'sum by (peer, result) (rate(ods_rounds_total{{{SEL}}}[5m])) * 60', "{{peer}} {{result}}")],
     "Completed (ok) and failed fragment rounds."),
    ("Landing delay (inner steps)", "none", [(f"ods_round_land_steps{{{SEL}}}", "{{peer}} f{{fragment}}")],
     "Inner steps from a round's launch to the landing of its average; eager hides up to H."),
    ("Sync wait (s per minute)", "s",
     [(f"sum by (peer) (rate(ods_sync_wait_seconds_total{{{SEL}}}[5m])) * 60", "{{peer}}")],
     "Seconds per minute the training loop waited for rounds."),
    ("Bytes sent per second", "Bps",
     [(f"sum by (peer) (rate(ods_bytes_sent_total{{{SEL}}}[5m]))", "{{peer}} sent"),
      (f"sum by (peer) (rate(ods_bytes_received_total{{{SEL}}}[5m]))", "{{peer}} received")],
     "All-reduce traffic of each peer."),
    ("Inner step", "none", [(f"ods_step{{{SEL}}}", "{{peer}}")], "Inner steps done (the swarm's step after a join)."),
]


def build() -> dict:
    """The dashboard as Grafana's JSON model."""
    board = (dashboard.Dashboard("opendiloco-stream")
             .uid("opendiloco-stream")
             .description("A standing Streaming DiLoCo run: one series per peer (docker/prometheus.yml scrapes them)")
             .tags(["opendiloco-stream", "diloco"])
             .refresh("30s")
             .time("now-6h", "now")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
             .with_variable(dashboard.QueryVariable("run").label("run")
                            .query("label_values(ods_step, run)").include_all(True).multi(True)
                            .all_value(".*"))
             .with_variable(dashboard.QueryVariable("peer").label("peer")
                            .query('label_values(ods_step{run=~"$run"}, peer)').include_all(True).multi(True)
                            .all_value(".*")))
    for title, unit, queries, description in PANELS:
        panel = (timeseries.Panel().title(title).unit(unit).description(description).height(8).span(12)
                 .datasource(DataSourceRef(type_val="prometheus", uid="${datasource}")))
        for i, (expr, legend) in enumerate(queries):
            panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("ABCD"[i]))
        board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/gen_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
