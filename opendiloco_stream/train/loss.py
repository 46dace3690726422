"""The language-model loss the trainer, the export and every benchmark compute, and its evaluation.

``train.precision``: the forward passes run under bf16 autocast on CUDA by default (fp32 on CPU);
the loss itself is fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def use_bf16_autocast(precision: str, device: Any) -> bool:
    """``train.precision``: 'bf16' always, 'auto' on CUDA, 'fp32' never."""
    return precision == "bf16" or (precision == "auto" and torch.device(device).type == "cuda")


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Next-token cross-entropy of ``batch`` (fp32 loss; the forward pass under bf16 autocast if asked)."""
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, batch_size: int, max_batches: int, device: Any,
             bf16: bool = False) -> float:
    """Mean next-token cross-entropy over the first ``max_batches`` validation batches."""
    was_training = model.training
    model.eval()
    losses = []
    for i in range(0, min(len(val), batch_size * max_batches), batch_size):
        losses.append(lm_loss(model, val[i:i + batch_size].to(device), bf16).item())
    model.train(was_training)
    return float(sum(losses) / max(1, len(losses)))
