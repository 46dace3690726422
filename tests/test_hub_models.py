"""``--model org/name`` / ``--tokenizer org/name`` go through ``from_pretrained``: from a local
``save_pretrained`` directory and through the hub's code path reading its cache offline
(``HF_HUB_OFFLINE=1``, a cache laid out as ``huggingface_hub`` lays it out): no test reaches the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from opendiloco_stream.train.data import BYTE_VOCAB_SIZE
from opendiloco_stream.train.export import byte_tokenizer
from opendiloco_stream.train.models import build_model

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(tmp_path: Path, repo: str) -> Path:
    """A hub cache holding ``repo`` (a tiny model with the byte tokenizer) at revision main."""
    cache = tmp_path / "hub"
    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    build_model("tiny", BYTE_VOCAB_SIZE, 32, seed=11).save_pretrained(snapshot)
    byte_tokenizer().save_pretrained(snapshot)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(COMMIT)
    return cache


def _offline(cache: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_local_save_pretrained_dir_loads_weights_or_only_its_config(tmp_path):
    saved = build_model("tiny", BYTE_VOCAB_SIZE, 32, seed=11)
    saved.save_pretrained(tmp_path)
    loaded = build_model(str(tmp_path), BYTE_VOCAB_SIZE, 32, seed=5)
    fresh = build_model(str(tmp_path), BYTE_VOCAB_SIZE, 32, seed=5, init_from_config=True)
    preset = build_model("tiny", BYTE_VOCAB_SIZE, 32, seed=5)
    for (name, a), b, c, d in zip(saved.state_dict().items(), loaded.state_dict().values(),
                                  fresh.state_dict().values(), preset.state_dict().values()):
        assert torch.equal(a, b), name  # the directory's weights
        assert torch.equal(c, d), name  # its config, initialised from the seed like the preset it was


def test_hub_names_resolve_through_from_pretrained_from_the_offline_cache(tmp_path):
    cache = _hub_cache(tmp_path, "someorg/tiny-byte")
    code = """
import json, torch
from opendiloco_stream.train.models import build_model
from opendiloco_stream.train.data import load_tokenizer
tok = load_tokenizer("someorg/tiny-byte")
m = build_model("someorg/tiny-byte", tok.vocab_size, 32, seed=5)
c = build_model("someorg/tiny-byte", tok.vocab_size, 32, seed=5, init_from_config=True)
p = build_model("tiny", tok.vocab_size, 32, seed=11)
print(json.dumps({"vocab": tok.vocab_size, "ids": tok.encode("hé"),
    "weights": all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), p.state_dict().values())),
    "config_only_differs": not all(torch.equal(a, b) for a, b in zip(c.state_dict().values(), p.state_dict().values()))}))
"""
    proc = _offline(cache, code)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"vocab": BYTE_VOCAB_SIZE, "ids": list("hé".encode()), "weights": True, "config_only_differs": True}


def test_unresolvable_hub_names_fail_with_one_line_and_exit_2(tmp_path):
    cache = _hub_cache(tmp_path, "someorg/tiny-byte")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    for flag, expected in (("--model", "cannot load model 'nobody/missing'"),
                           ("--tokenizer", "cannot load tokenizer 'nobody/missing'")):
        proc = subprocess.run([sys.executable, "-m", "opendiloco_stream", "local", "--workers", "1", "--steps", "1",
                               "--seq-len", "16", flag, "nobody/missing", "--no-progress"],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
