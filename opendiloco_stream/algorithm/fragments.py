"""Fragments: which parameters sync together, and when (Streaming DiLoCo, arXiv 2501.18512).

Partition rule (every parameter in exactly one fragment, tied weights once):

* Transformer blocks go to fragments *strided* (block i -> fragment i mod P, the paper's best) or
  *sequential* (contiguous runs of near-equal length: block i -> floor(i * P / N)).
* Parameters outside the blocks (embeddings, final norm, LM head) are assigned one by one, in
  module order, to the fragment that is smallest (in elements) at that moment, lowest index on
  ties. This keeps the bytes of each sync close to 1/P of the model even when the embeddings are
  large, and is deterministic, so all peers build the same partition.

Schedule: fragment p has offset ``o_p = floor((p+1)*H/P) mod H`` and syncs at every inner step
``t >= 1`` with ``(t - o_p) mod H == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Fragment:
    """One fragment: its index, its parameters (in a fixed order) and their names."""

    index: int
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def fragment_offsets(inner_steps: int, num_fragments: int) -> list[int]:
    """``o_p = floor((p+1)*H/P) mod H`` for every fragment p."""
    H, P = inner_steps, num_fragments
    return [((p + 1) * H // P) % H for p in range(P)]


def syncs_at(step: int, offset: int, inner_steps: int) -> bool:
    """Whether a fragment with this offset syncs at inner step ``step`` (t >= 1)."""
    return step >= 1 and (step - offset) % inner_steps == 0


def next_sync(step: int, offset: int, inner_steps: int) -> int:
    """The first inner step after ``step`` at which a fragment with this offset syncs."""
    return step + (offset - step - 1) % inner_steps + 1


def round_index(step: int, offset: int, inner_steps: int) -> int:
    """0-based index of the fragment's sync at ``step`` (its first sync is round 0)."""
    first = offset if offset > 0 else inner_steps
    return (step - first) // inner_steps


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Auto-detect the transformer blocks: the largest ``nn.ModuleList`` in the model.

    Hugging Face decoder models keep their blocks in exactly one ModuleList (``model.layers``,
    ``transformer.h``, ``gpt_neox.layers``, ...), which holds most of the parameters.
    """
    best: list[nn.Module] = []
    best_numel = -1
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = list(module), numel
    if not best:
        raise ValueError(
            "could not find transformer blocks (no nn.ModuleList in the model); "
            "pass blocks=[...] to StreamingDiLoCo explicitly"
        )
    return best


def partition(model: nn.Module, blocks: list[nn.Module], num_fragments: int,
              pattern: str = "strided") -> list[Fragment]:
    """Split the model's trainable parameters into ``num_fragments`` fragments (see module doc)."""
    P, N = num_fragments, len(blocks)
    if P < 1:
        raise ValueError("num_fragments must be >= 1")
    if N < P:
        raise ValueError(f"num_fragments ({P}) exceeds the number of transformer blocks ({N}); "
                         f"use at most {N} fragments")
    if pattern not in ("strided", "sequential"):
        raise ValueError(f"fragment_pattern must be 'strided' or 'sequential', not {pattern!r}")

    owner: dict[int, int] = {}  # id(param) -> fragment
    for i, block in enumerate(blocks):
        frag = i % P if pattern == "strided" else i * P // N
        for p in block.parameters():
            if p.requires_grad and id(p) not in owner:
                owner[id(p)] = frag

    fragments = [Fragment(index=p) for p in range(P)]
    sizes = [0] * P
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied weights once
    block_ids = set(owner)
    model_ids = {id(p) for _, p in named}
    stray = block_ids - model_ids
    if stray:
        raise ValueError("some block parameters are not parameters of the model; pass blocks of this model")
    for _, p in named:
        if id(p) in owner:
            sizes[owner[id(p)]] += p.numel()
    for name, p in named:
        if id(p) not in owner:  # outside the blocks: smallest fragment so far
            smallest = min(range(P), key=lambda j: (sizes[j], j))
            owner[id(p)] = smallest
            sizes[smallest] += p.numel()
        fragments[owner[id(p)]].names.append(name)
        fragments[owner[id(p)]].params.append(p)
    for fragment in fragments:
        if not fragment.params:
            raise ValueError(f"fragment {fragment.index} is empty; use fewer fragments")
    return fragments


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one flat fp32 tensor."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like``."""
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset:offset + n].view_as(t))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat tensor has {flat.numel()} elements, expected {offset}")
    return out
