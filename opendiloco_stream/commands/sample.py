"""``opendiloco-stream sample``: text from a trained model, through ``model.generate``.

``--model`` is a directory written by ``export`` (or ``--save-model``), any transformers model
directory, or a run's checkpoint directory (its theta_bar is read as ``export`` would)::

    opendiloco-stream sample --model runs/local-model --prompt "def main(" --max-new-tokens 120
"""

from __future__ import annotations

import argparse
from pathlib import Path

from opendiloco_stream.config_cli import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from an exported model or a checkpoint directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR", help="an exported model directory or a checkpoint directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 picks the most likely token every time (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, metavar="K", help="sample among the K most likely tokens (default 50)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--rank", type=int, default=None, metavar="N", help="a checkpoint directory: read worker-N.pt")
    p.set_defaults(func=run)


def load_for_sampling(directory: str, rank=None):
    """(model, tokenizer) from an exported model directory or a run's checkpoint directory."""
    from opendiloco_stream.train.export import (  # lazy: loads torch; --help stays light
        checkpoint_model, find_checkpoint)

    path = Path(directory)
    if path.is_dir() and any(path.glob("worker-*.pt")):
        model, tokenizer, _, _ = checkpoint_model(find_checkpoint(path, rank))
        return model, tokenizer
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {directory}: neither a model directory (config.json) nor a checkpoint "
                         "directory (worker-<rank>.pt): give the --out of export or a run's --checkpoint-dir")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: loads transformers; --help stays light

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {directory}: cannot load it ({str(e).strip().splitlines()[0]})") from None
    return model.eval(), tokenizer


def generate(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
             seed: int) -> str:
    """The prompt's continuation (without the prompt)."""
    import torch  # lazy: loads torch; --help stays light

    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                             else tokenizer.eos_token_id, **sampling)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 1:
        raise UsageError("--max-new-tokens and --top-k must be >= 1, --temperature >= 0")
    import transformers  # lazy: loads transformers; --help stays light

    transformers.logging.set_verbosity_error()  # its load progress and length notices are not the output
    transformers.utils.logging.disable_progress_bar()
    model, tokenizer = load_for_sampling(args.model, args.rank)
    text = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + text)
    return 0
