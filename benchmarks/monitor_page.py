"""The ``monitor --html`` page of a real swarm, rendered by headless Chromium: a screenshot check.

    .venv/bin/python -m benchmarks.monitor_page [--peers 3] [--steps 100] [--out docs/img]

Starts a bootstrap node and N real peers on 127.0.0.1 (tiny model, eager, fp4), runs
``monitor --html`` beside them while they train, stops it when they finish, then screenshots the
page with headless Chromium (Debian package ``chromium``; offline: no network flags) and checks the
picture: the size is right, the page is not blank, and every peer's curve colour is drawn in both
charts. Writes ``<out>/monitor_page.png``, ``<out>/monitor_page.html``, prints a JSON verdict and writes
it in the result envelope (``--json``);
exit 0 when the check passes, 1 when it fails, 2 when Chromium is not installed
(``apt-get install chromium``). CI does not install Chromium; tests/test_monitor_page.py checks the
page's content there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.peers import TINY, PeerProcesses
from benchmarks.harness.results import REPO_ROOT as ROOT, RESULTS_DIR, write_result
from opendiloco_stream.commands.local_hivemind import stop_processes
from opendiloco_stream.commands.monitor_page import COLORS

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(chromium: str, page: Path, png: Path, size=(960, 900), timeout: float = 90.0) -> None:
    with tempfile.TemporaryDirectory(prefix="ods-chromium-") as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
               f"--screenshot={png}", page.resolve().as_uri()]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            stop_processes([proc], grace=2)
    if proc.returncode != 0 or not png.is_file():
        raise RuntimeError(f"chromium failed ({proc.returncode}): {out.decode(errors='replace')[-1500:]}")


def check_png(png: Path, n_peers: int, size=(960, 900)) -> dict:
    """What the picture shows: size, share of non-white pixels, pixels of each peer's colour per half."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    w, h = img.size
    px = img.load()
    non_white = sum(1 for x in range(0, w, 2) for y in range(0, h, 2) if sum(px[x, y]) < 720) / ((w // 2) * (h // 2))
    targets = [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in COLORS[:n_peers]]
    counts = [[0, 0] for _ in targets]  # [loss chart (upper part), utilization chart (lower part)]
    for y in range(h):
        for x in range(w):
            p = px[x, y]
            for k, t in enumerate(targets):
                if abs(p[0] - t[0]) + abs(p[1] - t[1]) + abs(p[2] - t[2]) < 40:
                    counts[k][0 if y < 390 else 1] += 1
    ok = (w, h) == size and 0.02 < non_white < 0.6 and all(a > 150 and b > 150 for a, b in counts)
    return {"size": [w, h], "non_white_share": round(non_white, 4), "curve_pixels": counts, "ok": ok}


def run_swarm(workdir: Path, peers: int, steps: int, page: Path) -> list[dict]:
    """Train ``peers`` real peers to the end with a monitor writing ``page``; return their summaries."""
    with PeerProcesses(workdir) as run:
        addrs = run.bootstrap("pagedemo")
        monitor = run.start("monitor", ["monitor", "--initial-peers", *addrs, "--run-id", "pagedemo",
                                        "--interval", "2", "--html", str(page)])
        workers = [run.peer(f"peer{r}", "--run-id", "pagedemo", *TINY, "--mode", "eager", "--codec", "fp4-e3m0",
                            "--fragments", "2", "--inner-steps", "10", "--steps", str(steps),
                            "--shard", f"{r}/{peers}", "--no-join") for r in range(peers)]
        run.wait(workers, timeout=60 + 4.0 * steps)
        time.sleep(4)  # one more monitor refresh with the final records
        run.stop([monitor], grace=20)  # SIGTERM: the monitor writes the page and exits
        return [run.records(f"peer{r}")[-1] for r in range(peers)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="where the PNG and HTML go")
    ap.add_argument("--json", type=Path, default=RESULTS_DIR / "monitor-page.json",
                    help="the verdict as JSON, one row per peer (default: %(default)s)")
    args = ap.parse_args()
    chromium = find_chromium()
    if chromium is None:
        print("chromium is not installed: apt-get install chromium (or keep to tests/test_monitor_page.py)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ods-page-") as tmp:
        workdir = Path(tmp)
        page = workdir / "swarm.html"
        t0 = time.perf_counter()
        summaries = run_swarm(workdir, args.peers, args.steps, page)
        shutil.copy(page, out / "monitor_page.html")
        png = out / "monitor_page.png"
        screenshot(chromium, page, png)
        verdict = check_png(png, args.peers)
        verdict.update(peers=args.peers, steps=args.steps, wall_s=round(time.perf_counter() - t0, 1),
                       eval_loss=[round(s.get("eval_loss", float("nan")), 4) for s in summaries],
                       png=str(png), chromium=subprocess.run([chromium, "--version"], capture_output=True,
                                                              text=True).stdout.strip())
    print(json.dumps(verdict, indent=1))
    rows = [{"peer": r, "eval_loss": loss} for r, loss in enumerate(verdict["eval_loss"])]
    write_result(args.json, settings=vars(args), rows=rows, benchmark="monitor_page", verdict=verdict)
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
