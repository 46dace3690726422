"""Models: transformers ``LlamaForCausalLM`` presets, local HF models, blocks, parameters and FLOPs.

Presets (``PRESETS``) are ``LlamaConfig`` keyword arguments. The paper sizes take hidden size,
number of layers and number of heads from the architecture table of Streaming DiLoCo
(arXiv 2501.18512, Table 2, "35M" .. "4B", vocabulary 32k). The paper does not give an MLP width
for a SwiGLU Llama block, so we use Llama's rule: ``intermediate = 8/3 * hidden`` rounded up to a
multiple of 256, which keeps each block at ~12 * hidden^2 parameters like a 4x GELU MLP.
Caveat: the shapes were transcribed from the paper without an offline copy to re-check; with
this MLP rule the non-embedding counts are 42M, 116M, 244M, 425M, 925M, 1.23B, 4.08B, and the
"500M" row in particular is larger than its label: verify against the paper before citing.
``"tiny"`` (hidden 128, 4 layers, 4 heads, ~0.9 M parameters with the byte vocabulary) and
``"small"`` (hidden 256, 6 layers, 8 heads, ~4.9 M) are ours, for CPU runs, tests and the quality
benchmark's scale check.

``build_model`` accepts a preset name, a local path: a directory holding a HF model (its weights
are loaded) or a config (``config.json``; initialised from the seed), or a path to a JSON config
file, or a hub name ``org/name`` (through ``from_pretrained``: the hub's cache, ``HF_HUB_OFFLINE``
and ``HF_ENDPOINT`` apply). ``init_from_config`` (``--init-from-config``) takes only the config of a
model directory or hub name and initialises the weights from the seed. Initialisation runs under a forked RNG seeded with ``seed``, so the same seed gives
bit-identical weights and the caller's RNG streams are left untouched.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Union

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PretrainedConfig

from opendiloco_stream.config import ConfigError


def _llama_mlp_width(hidden: int, multiple: int = 256) -> int:
    return multiple * math.ceil(8 * hidden / 3 / multiple)


def _paper_preset(hidden: int, layers: int, heads: int) -> dict:
    return dict(
        vocab_size=32_000,
        hidden_size=hidden,
        intermediate_size=_llama_mlp_width(hidden),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )


#: name -> ``LlamaConfig`` kwargs. ``vocab_size`` and the context length are always overridden
#: by ``build_model``'s arguments; the vocabulary here is the paper's, for reference.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=32_000,
        hidden_size=128,
        intermediate_size=352,  # 8/3 * 128 rounded up to a multiple of 32
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    # ~5 M parameters with the byte vocabulary: the next step up from tiny that still trains on a CPU
    # (the quality benchmark's scale check)
    "small": dict(
        vocab_size=32_000,
        hidden_size=256,
        intermediate_size=704,  # 8/3 * 256 rounded up to a multiple of 32
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
    ),
    # Streaming DiLoCo (arXiv 2501.18512), Table 2: hidden, layers, heads.
    "35M": _paper_preset(768, 6, 8),
    "100M": _paper_preset(1024, 9, 8),
    "200M": _paper_preset(1280, 12, 16),
    "300M": _paper_preset(1536, 15, 16),
    "500M": _paper_preset(2048, 18, 16),
    "1B": _paper_preset(2048, 24, 16),
    "4B": _paper_preset(3072, 36, 24),
}

# Settings shared by every preset: untied embeddings (the paper's setting, and it keeps the head a
# separate tensor for fragment assignment), no KV cache (training only).
_PRESET_COMMON = dict(tie_word_embeddings=False, use_cache=False, rms_norm_eps=1e-5, initializer_range=0.02)

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def build_model(
    name: str,
    vocab_size: int,
    seq_len: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_from_config: bool = False,
) -> PreTrainedModel:
    """Build a causal LM from a preset name, a local HF model/config path or a hub name (module doc)."""
    if vocab_size < 1 or seq_len < 1:
        raise ConfigError(f"vocab_size and seq_len must be positive, got {vocab_size} and {seq_len}")
    if name in PRESETS:
        config = transformers.LlamaConfig(
            **{**PRESETS[name], **_PRESET_COMMON, "vocab_size": vocab_size, "max_position_embeddings": seq_len}
        )
        return _init_from_config(config, seed).to(dtype).train()
    path = Path(name).expanduser()
    if path.exists():
        has_weights = path.is_dir() and any((path / f).is_file() for f in _WEIGHT_FILES)
        source, local = str(path), True
    elif is_hub_name(name):
        has_weights, source, local = True, name, False
    else:
        raise ConfigError(
            f"unknown model '{name}': use a preset ({', '.join(PRESETS)}), "
            "a local path to a HF model directory or config.json, or a hub name org/name"
        )
    if has_weights and not init_from_config:
        model = _load_pretrained(source, vocab_size, seq_len, local)
    else:
        config = _load_config(path) if local else _hub_config(name)
        config.vocab_size = vocab_size
        # Learned-position models need a table at least this long; RoPE models just record it.
        current = getattr(config, "max_position_embeddings", None)
        if current is not None and current < seq_len:
            config.max_position_embeddings = seq_len
        model = _init_from_config(config, seed)
    return model.to(dtype).train()


def is_hub_name(name: str) -> bool:
    """Whether ``name`` has the shape of a hub repository id, ``org/name`` (a name that is not a path)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _hub_error(name: str, e: BaseException) -> ConfigError:
    return ConfigError(f"cannot load model '{name}' (not a preset or local path; from the hub: {_first_line(e)}): "
                       "check the name, or download it first (HF_HUB_OFFLINE=1 reads only the local cache)")


def _hub_config(name: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(name)
    except Exception as e:  # huggingface_hub raises OSError, ValueError, HTTP and offline errors
        raise _hub_error(name, e) from None


def _load_config(path: Path) -> PretrainedConfig:
    try:
        if path.is_dir():
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        raw = json.loads(path.read_text())
        model_type = raw.pop("model_type", None)
        if model_type is None:
            raise ConfigError(f"model config {path} has no 'model_type' field")
        return AutoConfig.for_model(model_type, **raw)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read a model config from {path}: {_first_line(e)}") from None


def _instantiate(config: PretrainedConfig) -> PreTrainedModel:
    # sdpa runs on CPU without extra packages; a few architectures only implement eager.
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _init_from_config(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    # A forked RNG: identical weights for the same seed, and the caller's RNG is not advanced.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _instantiate(config)


def _load_pretrained(path: str, vocab_size: int, seq_len: int, local: bool = True) -> PreTrainedModel:
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=local, attn_implementation="sdpa")
    except Exception as e:  # OSError, ValueError; from the hub also HTTP and offline errors
        if not local:
            raise _hub_error(path, e) from None
        raise ConfigError(f"cannot load the model in {path}: {_first_line(e)}") from None
    rows = model.get_input_embeddings().weight.shape[0]
    if vocab_size > rows:
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens but the model in {path} embeds only {rows}: "
            "use the model's own tokenizer"
        )
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"seq_len {seq_len} exceeds the model's max_position_embeddings ({limit}) in {path}")
    return model


# Attribute paths of the decoder-block list in common HF causal LMs, tried in order.
_BLOCK_PATHS = (
    "model.layers",  # Llama, Mistral, Qwen2, Gemma, Phi-3
    "transformer.h",  # GPT-2, GPT-J, GPT-Neo, Bloom, Falcon
    "gpt_neox.layers",  # GPT-NeoX, Pythia
    "model.decoder.layers",  # OPT
    "transformer.blocks",  # MPT
    "transformer.layers",
    "layers",
    "h",
)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of a HF decoder model, in depth order.

    Known attribute paths are tried first; otherwise the ``nn.ModuleList`` of same-class modules
    holding the most parameters is taken (that is the block stack in any standard decoder).
    """
    for dotted in _BLOCK_PATHS:
        obj = model
        for attr in dotted.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0 and _has_params(obj):
            return list(obj)
    best, best_size = None, 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            if len({type(m) for m in module}) == 1 and _has_params(module):
                size = sum(p.numel() for p in module.parameters())
                if size > best_size:
                    best, best_size = module, size
    if best is None:
        raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}: no list of decoder layers")
    return list(best)


def _has_params(modules: torch.nn.ModuleList) -> bool:
    return all(any(True for _ in m.parameters()) for m in modules)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of unique parameters: ``nn.Module.parameters()`` yields a tied tensor once."""
    return sum(p.numel() for p in model.parameters())


def model_flops_per_token(
    model_or_config: Union[torch.nn.Module, PretrainedConfig], seq_len: int | None = None
) -> float:
    """Training FLOPs per token (forward + backward): ``6 * N + 12 * L * d * T``.

    The PaLM estimate (arXiv 2204.02311, appendix B): ``N`` counts the parameters that take part in
    matmuls, i.e. all unique parameters minus the input token-embedding table (a lookup) unless it
    is tied to the output head; ``12 * L * d * T`` is attention's score and value products
    (``L`` layers, model width ``d``, context ``T``; causal masking not discounted). ``T`` defaults
    to the config's ``max_position_embeddings``, which ``build_model`` sets to ``seq_len``. A config
    is sized on the meta device, so no memory is allocated.
    """
    if isinstance(model_or_config, PretrainedConfig):
        config = model_or_config
        with torch.device("meta"):
            model = _instantiate(config)
    else:
        model = model_or_config
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("model_flops_per_token needs a HF model or config (it reads layers, width, context)")
    n = count_parameters(model)
    embed_in, embed_out = model.get_input_embeddings(), model.get_output_embeddings()
    if embed_out is None or embed_in.weight is not embed_out.weight:
        n -= embed_in.weight.numel()
    layers = config.num_hidden_layers
    width = config.hidden_size
    context = seq_len if seq_len is not None else getattr(config, "max_position_embeddings", 0)
    return float(6 * n + 12 * layers * width * context)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
