"""Tables, plots and the printed report of ``benchmarks/quality.py``: the results of one benchmark, rendered.

Works on the result JSON's structures: ``rows`` (one dict per trained run, with ``variant``,
``seed``, ``summary``, ``eval_curve``) and the variant list of ``quality.variants()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from benchmarks.harness.results import markdown_table, mean_spread, plot_bars, plot_lines, relative, write_payload

#: the outer-optimizer checks: suffix -> (DiLoCoConfig overrides, words). Defaults: lr 0.7, momentum 0.9.
#: lr 0.4 is the Streaming DiLoCo paper's value; momentum 0 removes the outer momentum entirely.
OUTER_CHECKS: dict[str, tuple[dict[str, float], str]] = {
    "olr0.4": ({"outer_lr": 0.4}, "outer lr 0.4"),
    "mom0": ({"outer_momentum": 0.0}, "outer momentum 0"),
}
OUTER_MODES = ("streaming", "eager", "naive-delayed")


# ---------------------------------------------------------------------------------------- tables
def _runs_of(runs: list[dict], name: str) -> list[dict]:
    return [r for r in runs if r["variant"] == name]


def _paired_delta(runs: list[dict], name: str, ref: str) -> Optional[float]:
    """Mean over shared seeds of eval_loss(name) - eval_loss(ref): same init and data, less noise."""
    if name == ref:
        return 0.0
    ref_by_seed = {r["seed"]: r["summary"]["eval_loss"] for r in _runs_of(runs, ref)}
    deltas = [r["summary"]["eval_loss"] - ref_by_seed[r["seed"]] for r in _runs_of(runs, name) if r["seed"] in ref_by_seed]
    return sum(deltas) / len(deltas) if deltas else None


def aggregate(runs: list[dict], variant_list: list) -> dict[str, dict[str, Any]]:
    """Per variant: eval-loss statistics over seeds, deltas against the reference, bytes per token."""
    out = {}
    for v in variant_list:
        rs = _runs_of(runs, v.name)
        if not rs:
            continue
        s0 = rs[0]["summary"]
        ref = v.reference
        out[v.name] = {
            "label": v.label, "group": v.group, "seeds": [r["seed"] for r in rs],
            "eval_loss": mean_spread([r["summary"]["eval_loss"] for r in rs]),
            "eval_loss_before_finish": mean_spread([r["summary"].get("eval_loss_before_finish", float("nan"))
                                                    for r in rs]),
            "relative_vs_ref": _paired_relative(runs, v.name, ref),
            "train_loss": mean_spread([r["summary"]["train_loss"] for r in rs]),
            "delta_vs_ref": _paired_delta(runs, v.name, ref), "reference": ref,
            "bytes_per_token": s0["bytes_sent_launched"] / max(1, s0["tokens"]),
            "bytes_sent_per_worker": s0["bytes_sent_per_worker"], "peak_bytes_per_sync": s0["peak_bytes_per_sync"],
            "bits_per_value": s0["bits_per_value"], "codec": s0["codec"], "mode": s0["mode"],
            "fragments": s0["fragments"], "inner_steps": s0["inner_steps"], "overlap_steps": s0["overlap_steps"],
            "local_only_steps": s0["local_only_steps"], "tokens": s0["tokens"],
            "wall_time_s": mean_spread([r["summary"]["wall_time_s"] for r in rs])["mean"],
        }
    return out


def _paired_relative(runs: list[dict], name: str, ref: str) -> Optional[float]:
    """Mean over shared seeds of eval_loss(name) / eval_loss(ref) - 1 (the eager issue's bar is 2%)."""
    ref_by_seed = {r["seed"]: r["summary"]["eval_loss"] for r in _runs_of(runs, ref)}
    xs = [r["summary"]["eval_loss"] / ref_by_seed[r["seed"]] - 1 for r in _runs_of(runs, name) if r["seed"] in ref_by_seed]
    return sum(xs) / len(xs) if xs else None


def _before(a: dict) -> str:
    x = a["eval_loss_before_finish"]["mean"]
    return "—" if x != x else f"{x:.4f}"


def _spread(st: dict[str, float]) -> str:
    if st["n"] <= 1:
        return "— (1 seed)"
    return f"{st['min']:.4f}–{st['max']:.4f} (sd {st['std']:.4f}, n={st['n']})"


def _delta(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:+.4f}"


def mode_table(agg: dict[str, dict]) -> str:
    rows = []
    for name, a in agg.items():
        if a["group"] != "mode":
            continue
        H = "1" if a["mode"] == "data-parallel" else str(a["inner_steps"])
        rel = a.get("relative_vs_ref")
        rows.append([a["label"], H, a["fragments"], a["overlap_steps"], f"{a['eval_loss']['mean']:.4f}",
                     _spread(a["eval_loss"]), _delta(a["delta_vs_ref"]), "—" if rel is None else f"{100 * rel:+.1f}%",
                     _before(a), f"{a['train_loss']['mean']:.4f}",
                     f"{a['bytes_per_token']:,.1f}", f"{a['peak_bytes_per_sync'] / 1e6:.2f}"])
    return markdown_table(["variant", "H", "P", "tau", "eval loss (mean)", "spread over seeds",
                           "Δ vs streaming (paired)", "vs streaming (paired, relative)",
                           "eval loss before in-flight rounds landed", "train loss", "bytes sent / token / worker",
                           "peak MB sent / sync / worker"], rows, align="lrrrrlrrrrrr")


def codec_table(agg: dict[str, dict], runs: list[dict]) -> str:
    """Codec rows grouped by mode, each group led by its fp32 run (the mode comparison's), all
    restricted to the codec grid's seeds so that the rows compare like for like."""
    rows = []
    for ref in ("eager", "streaming"):
        names = [n for n, a in agg.items() if a["group"] == "codec" and a["reference"] == ref]
        seeds = {s for n in names for s in agg[n]["seeds"]}
        for name in ([ref] if ref in agg and names else []) + names:
            a = agg[name]
            loss = mean_spread([r["summary"]["eval_loss"] for r in _runs_of(runs, name) if r["seed"] in seeds])
            rows.append(["streaming (blocking)" if a["mode"] == "blocking" else a["mode"], a["codec"],
                         "yes" if name.endswith("-ef") else "no", f"{a['bits_per_value']:.2f}",
                         f"{loss['mean']:.4f}", _spread(loss), _delta(_paired_delta(runs, name, ref)),
                         f"{a['bytes_per_token']:,.2f}", a["local_only_steps"]])
    return markdown_table(["mode", "codec", "error feedback", "bits / value", "eval loss", "spread over seeds",
                           "Δ vs fp32, same mode (paired)", "bytes sent / token / worker", "local-only outer steps"],
                          rows, align="lllrrlrrr")


def outer_table(agg: dict[str, dict], runs: list[dict]) -> str:
    """streaming / eager / naive-delayed at the default outer optimizer and under each check, on
    the checks' seeds, each with its delta against streaming under the same setting."""
    checks = [c for c in OUTER_CHECKS if f"streaming-{c}" in agg]
    seeds = {s for c in checks for m in OUTER_MODES for s in agg.get(f"{m}-{c}", {}).get("seeds", [])}

    def loss(name: str) -> Optional[float]:
        xs = [r["summary"]["eval_loss"] for r in _runs_of(runs, name) if r["seed"] in seeds]
        return sum(xs) / len(xs) if xs else None

    rows = []
    for mode in OUTER_MODES:
        row = [mode]
        for suffix in [""] + [f"-{c}" for c in checks]:
            x, ref = loss(mode + suffix), loss("streaming" + suffix)
            row += ["—" if x is None else f"{x:.4f}", _delta(None if x is None or ref is None else x - ref)]
        rows.append(row)
    headers = ["mode (P=2, fp32)", "default: lr 0.7, momentum 0.9", "Δ vs streaming"]
    for c in checks:
        headers += [OUTER_CHECKS[c][1], "Δ vs streaming"]
    return markdown_table(headers, rows, align="l" + "r" * (len(headers) - 1)) + \
        f"\n\nSeeds: {', '.join(map(str, sorted(seeds)))}."


def _delay_rows(runs: list[dict]) -> tuple[list[int], dict[str, dict[int, dict[int, float]]]]:
    """The "delay" group's runs as family -> D -> seed -> eval loss (blocking: the same at every D)."""
    delays = sorted({r.get("link_delay", 1) for r in runs if r["group"] == "delay" and r["variant"] != "streaming"})
    table: dict[str, dict[int, dict[int, float]]] = {}
    for r in runs:
        if r["group"] != "delay":
            continue
        loss = r["summary"]["eval_loss"]
        if r["variant"] == "streaming":
            for D in delays:
                table.setdefault("streaming", {}).setdefault(D, {})[r["seed"]] = loss
        else:
            family, D = r["variant"].rsplit("-D", 1)
            table.setdefault(family, {}).setdefault(int(D), {})[r["seed"]] = loss
    return delays, table


def delay_table(runs: list[dict], inner_steps: int) -> str:
    """Eval loss per rule and link delay D (mean over seeds), each against the best of blocking and
    overlap with tau = D, seed by seed (the eager issue's bar: at most +1%, fp4 +2%)."""
    delays, table = _delay_rows(runs)
    best = {D: {s: min(table[f][D][s] for f in ("streaming", "overlap") if D in table.get(f, {}) and s in table[f][D])
                for s in table.get("streaming", {}).get(D, {})} for D in delays}
    rows = []
    for family, by_d in table.items():
        row = [family]
        for D in delays:
            xs = by_d.get(D, {})
            if not xs:
                row.append("—")
                continue
            rel = [xs[s] / best[D][s] - 1 for s in xs if s in best[D]]
            mean = sum(xs.values()) / len(xs)
            row.append(f"{mean:.4f}" + (f" ({100 * sum(rel) / len(rel):+.1f}%)" if rel else ""))
        rows.append(row)
    return markdown_table(["rule"] + [f"D = {D} (D/H {D / inner_steps:.2f})" for D in delays], rows,
                          align="l" + "r" * len(delays))


# ---------------------------------------------------------------------------------------- plots
def _curves(runs: list[dict], names: list[str], labels: dict[str, str], seeds: Optional[set[int]] = None):
    series, bands = {}, {}
    for name in names:
        rs = [r for r in _runs_of(runs, name) if seeds is None or r["seed"] in seeds]
        if not rs:
            continue
        steps = [s for s, _ in rs[0]["eval_curve"] if s > 0]  # step 0 (init) squashes the y axis
        ys = [[dict(map(tuple, r["eval_curve"]))[s] for s in steps] for r in rs]
        mean = [sum(col) / len(col) for col in zip(*ys)]
        series[labels[name]] = (steps, mean)
        if len(rs) > 1:
            bands[labels[name]] = ([min(col) for col in zip(*ys)], [max(col) for col in zip(*ys)])
    return series, bands


def make_plots(runs: list[dict], agg: dict[str, dict], variant_list: list, preset: Any,
               img_dir: Path, command: str) -> list[str]:
    labels = {v.name: v.label for v in variant_list}
    tokens_per_step = preset.batch_size * preset.seq_len
    note = f"{command}  ({preset.workers} workers x {preset.steps} steps x {tokens_per_step} tokens)"
    paths = []
    delays, table = _delay_rows(runs)
    if delays:
        series = {family: ([D / preset.inner_steps for D in sorted(by_d)],
                           [sum(by_d[D].values()) / len(by_d[D]) for D in sorted(by_d)]) for family, by_d in table.items()}
        paths.append(plot_lines(img_dir / "quality-delays-eval-loss.png", series, note=note,
                                title=f"Eval loss at equal tokens against the link delay ({preset.model})",
                                xlabel="D / H (inner steps from a round's launch to its landing, per round)",
                                ylabel="final eval loss (mean over seeds)"))
        return [relative(p) for p in paths]
    modes = [v.name for v in variant_list if v.group == "mode"]
    series, bands = _curves(runs, modes, labels)
    if series:
        paths.append(plot_lines(img_dir / "quality-modes-eval-loss.png", series, bands=bands, note=note,
                                title="Eval loss at equal tokens: synchronization modes (fp32 on the wire)",
                                xlabel="inner step (per worker)", ylabel="eval loss (mean over workers; band: seeds)"))
    codecs = ["eager"] + [v.name for v in variant_list if v.group == "codec" and v.reference == "eager"]
    labels["eager"] = "eager fp32"
    seeds = {s for n in codecs[1:] if n in agg for s in agg[n]["seeds"]}
    series, bands = _curves(runs, codecs, labels, seeds)
    if len(series) > 1:
        paths.append(plot_lines(img_dir / "quality-codecs-eval-loss.png", series, bands=bands, note=note,
                                title=f"Eval loss at equal tokens: wire codecs under eager (seed "
                                      f"{','.join(map(str, sorted(seeds)))})",
                                xlabel="inner step (per worker)", ylabel="eval loss (mean over workers)"))
    for check, (_, words) in OUTER_CHECKS.items():
        names = [f"{m}-{check}" for m in OUTER_MODES if f"{m}-{check}" in agg]
        if not names:
            continue
        seeds = set.intersection(*[set(agg[n]["seeds"]) for n in names])
        check_labels = {**{m: f"{m}, default" for m in OUTER_MODES}, **{f"{m}-{check}": f"{m}, {words}" for m in OUTER_MODES}}
        series, _ = _curves(runs, list(OUTER_MODES) + names, check_labels, seeds)
        paths.append(plot_lines(img_dir / f"quality-outer-{check}-eval-loss.png", series, note=note,
                                title=f"Default outer step (lr 0.7, momentum 0.9) vs {words}, seed "
                                      f"{','.join(map(str, sorted(seeds)))}",
                                xlabel="inner step (per worker)", ylabel="eval loss (mean over workers)"))
    names = [n for n, a in agg.items() if a["group"] == "mode" or (a["group"] == "codec" and a["reference"] == "eager")]
    paths.append(plot_bars(img_dir / "quality-bytes-per-token.png", [agg[n]["label"] for n in names],
                           [agg[n]["bytes_per_token"] for n in names], log=True, annotate="{:,.1f}", note=note,
                           title="Bytes each worker sends per training token",
                           ylabel="bytes / token / worker (log)"))
    return [relative(p) for p in paths]


def report(payload: dict[str, Any], preset: Any, variant_list: list, out: Path, img_dir: Path,
           no_plots: bool) -> int:
    """Aggregate the runs, print the tables, write the JSON and the plots."""
    command = payload["command"]
    agg = aggregate(payload["rows"], variant_list)
    payload["aggregate"] = agg
    groups = {a["group"] for a in agg.values()}
    tables = {"modes": mode_table(agg)} if "delay" not in groups else {
        "delays": delay_table(payload["rows"], preset.inner_steps)}
    if "codec" in groups:  # presets such as 'eager' run the mode table only
        tables["codecs"] = codec_table(agg, payload["rows"])
    if "outer" in groups:
        tables["outer"] = outer_table(agg, payload["rows"])
    payload["tables_markdown"] = tables
    if not no_plots:
        payload["plots"] = make_plots(payload["rows"], agg, variant_list, preset, img_dir, command)
    write_payload(out, payload)
    tokens = preset.workers * preset.steps * preset.batch_size * preset.seq_len
    print("\n" + "\n".join(payload.get("commands", [command])) + "\n")
    print(f"{preset.workers} workers x {preset.steps} steps x batch {preset.batch_size} x seq "
          f"{preset.seq_len} = {tokens:,} tokens per run; mode seeds {list(preset.mode_seeds)}, codec seeds "
          f"{list(preset.codec_seeds)}; wall {payload['wall_time_s'] / 60:.1f} min\n")
    print("\n\n".join(tables.values()) + "\n")
    print(f"results: {relative(out)}" + ("" if no_plots else f"\nplots: {', '.join(payload['plots'])}"))
    return 0
