"""The trained model out: ``export`` / ``--save-model`` write theta_bar as a transformers model
directory that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load bit for bit and generate from;
``sample`` generates from it or straight from the checkpoint.

Commands that should succeed run as ``main`` in this process (``_run``: no new process importing
torch and transformers each time); the errors run as real processes (``cli``), whose exit code and
whole stderr (one line) are what they pin.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from opendiloco_stream.cli import main
from opendiloco_stream.config import RunConfig
from opendiloco_stream.train.data import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer
from opendiloco_stream.train.export import byte_tokenizer
from opendiloco_stream.train.loop import read_metrics
from tests.support.models import cli, theta_bar_by_name

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--workers", "2", "--fragments", "2", "--inner-steps", "5", "--steps", "12", "--model", "tiny",
         "--seq-len", "32", "--batch-size", "2", "--max-val-batches", "2", "--no-progress", "--threads", "1"]


def _run(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """``opendiloco-stream ARGS`` through ``main`` in this process: its exit code and output, as ``cli`` gives them."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["opendiloco-stream", *args], code, out, err)


def test_byte_tokenizer_has_the_projects_ids_and_survives_save_pretrained(tmp_path):
    ours, fast = ByteTokenizer(), byte_tokenizer()
    rng = random.Random(0)
    texts = ["def f(x):\n    return 'héllo ✓'\n", "<|eos|> is text here, not a token", "\x00\x7f tabs\t",
             "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(200))]
    fast.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for tok in (fast, loaded):
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (BOS_ID, EOS_ID, PAD_ID, 259)
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False)
            assert ids == ours.encode(text), text
            assert tok.decode(ids + [EOS_ID], skip_special_tokens=True) == ours.decode(ids + [EOS_ID]) == text


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    """README's first command, small: an eager fp4 local run with checkpoints and --save-model."""
    d = tmp_path_factory.mktemp("run")
    code = main(["local", *SMALL, "--mode", "eager", "--codec", "fp4-e3m0", "--checkpoint-dir", str(d / "ck"),
                 "--save-model", str(d / "end"), "--metrics-file", str(d / "m.jsonl")])
    assert code == 0
    return d


def test_export_of_a_checkpoint_loads_bit_exact_in_transformers_and_generates(eager_run, tmp_path, capsys):
    out = tmp_path / "model"
    proc = _run(capsys, "export", "--checkpoint-dir", str(eager_run / "ck"), "--out", str(out), "--max-shard-size", "500KB",
               "--license", "apache-2.0")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded above --max-shard-size
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ckpt = torch.load(eager_run / "ck" / "worker-0.pt", weights_only=False)
    expected = theta_bar_by_name(ckpt, model)
    params = dict(model.named_parameters())
    assert set(expected) == set(params)
    for name, value in expected.items():
        assert params[name].dtype == torch.float32 and torch.equal(params[name], value), name
    # theta_bar is the same on every worker: worker 1's checkpoint holds the same bits
    other = theta_bar_by_name(torch.load(eager_run / "ck" / "worker-1.pt", weights_only=False), model)
    assert all(torch.equal(other[n], v) for n, v in expected.items())
    ids = tokenizer("def main(", return_tensors="pt", add_special_tokens=False)["input_ids"]
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > ids.shape[1] and isinstance(tokenizer.decode(generated[0]), str)
    card = (out / "README.md").read_text()
    assert "eager" in card and "fp4-e3m0" in card and "Eval loss" in card and "inner step 12" in card
    # a Hub model card: YAML front matter, the load line names this directory, no placeholder
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "transformers" and front["license"] == "apache-2.0"
    assert {"opendiloco-stream", "diloco", "eager", "fp4-e3m0"} <= set(front["tags"])
    assert f'from_pretrained("{out}")' in card and '"DIR"' not in card
    # every file is readable by others (safetensors' own temp file is 0600)
    assert {oct(f.stat().st_mode & 0o777) for f in out.iterdir() if f.is_file()} == {"0o644"}


def test_save_model_at_the_end_holds_the_runs_final_theta_bar(eager_run):
    """--save-model writes theta_bar after the last rounds landed: its loss on the run's validation
    data is the run's 'global' eval (the loop evaluates theta_bar the same way)."""
    from opendiloco_stream.commands._common import prepare_data
    from opendiloco_stream.train.loss import evaluate

    model = AutoModelForCausalLM.from_pretrained(eager_run / "end")
    AutoTokenizer.from_pretrained(eager_run / "end")
    cfg = RunConfig.model_validate(torch.load(eager_run / "ck" / "worker-0.pt", weights_only=False)["config"])
    _, val, _ = prepare_data(cfg)
    recs = read_metrics(eager_run / "m.jsonl")
    final = [r for r in recs if r["event"] == "eval" and r.get("stage") == "global" and r["rank"] == 0]
    assert len(final) == 1
    loss = evaluate(model, val, cfg.train.batch_size, cfg.data.max_val_batches, "cpu")
    assert loss == pytest.approx(final[0]["eval_loss"], abs=1e-5)
    assert f"{final[0]['eval_loss']:.4f}" in (eager_run / "end" / "README.md").read_text()


def test_sample_generates_the_same_text_from_the_export_and_from_the_checkpoint(eager_run, tmp_path, capsys):
    _run(capsys, "export", "--checkpoint-dir", str(eager_run / "ck"), "--out", str(tmp_path / "m"), "--no-eval")
    outs = [_run(capsys, "sample", "--model", str(src), "--prompt", "import ", "--max-new-tokens", "24", "--seed", "3")
            for src in (tmp_path / "m", eager_run / "ck")]
    assert all(p.returncode == 0 for p in outs), [p.stderr for p in outs]
    assert outs[0].stdout.startswith("import ") and len(outs[0].stdout) > len("import ") + 1
    assert outs[0].stdout == outs[1].stdout  # the same weights, the same seed


def test_data_parallel_exports_the_model_itself(tmp_path, capsys):
    assert main(["local", *SMALL, "--mode", "data-parallel", "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    assert _run(capsys, "export", "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "m"),
                "--no-eval").returncode == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    saved = torch.load(tmp_path / "ck" / "worker-0.pt", weights_only=False)["model"]
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name


def test_export_errors_are_one_line_with_exit_2(eager_run, tmp_path, capsys):
    old = torch.load(eager_run / "ck" / "worker-0.pt", weights_only=False)
    config = old.pop("config")
    (tmp_path / "old").mkdir()
    torch.save(old, tmp_path / "old" / "worker-0.pt")  # a checkpoint written before export existed
    cases = [(["--checkpoint-dir", str(tmp_path / "nothing")], "no checkpoint directory"),
             (["--checkpoint-dir", str(tmp_path / "old")], "pass --config with the run's settings"),
             (["--checkpoint-dir", str(eager_run / "ck"), "--rank", "7"], "no checkpoint")]
    for args, expected in cases:
        proc = cli("export", *args, "--out", str(tmp_path / "m"), "--no-eval")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    # --config supplies the settings of such a checkpoint
    from opendiloco_stream.commands.local_hivemind import to_toml

    (tmp_path / "run.toml").write_text(to_toml(RunConfig.model_validate(config)))
    proc = _run(capsys, "export", "--checkpoint-dir", str(tmp_path / "old"), "--out", str(tmp_path / "m"), "--no-eval",
                "--config", str(tmp_path / "run.toml"))
    assert proc.returncode == 0, proc.stderr
    bad = cli("sample", "--model", str(tmp_path), "--prompt", "x")
    assert bad.returncode == 2 and "neither a model directory" in bad.stderr, bad.stderr
