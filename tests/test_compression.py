"""Wire codecs and error feedback: error bounds, exact sizes, code tables, determinism, rejection."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from opendiloco_stream.compression import (
    CODEC_NAMES,
    HEADER_SIZE,
    Codec,
    ErrorFeedback,
    NonFiniteError,
    decode,
    get_codec,
    read_header,
)
from opendiloco_stream.compression.blockwise import levels, top

BLOCK_CODECS = ("int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1")
CAST_CODECS = ("fp32", "fp16", "bf16")
MX_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _randn(numel: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Heavy-tailed per-block magnitudes, like outer gradients: exercises scales across blocks.
    return torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(4).add(1e-3)


def _stored_scales(codec: Codec, data: bytes) -> torch.Tensor:
    header = read_header(data)
    dtype = np.float16 if codec.scale_dtype == "fp16" else np.float32
    scales = np.frombuffer(data, dtype=dtype, count=header.n_blocks, offset=HEADER_SIZE)
    return torch.from_numpy(scales.astype(np.float32))


def _per_block(t: torch.Tensor, block: int) -> torch.Tensor:
    """Pad a flat tensor with zeros to whole blocks and view it as (n_blocks, block)."""
    n_blocks = -(-t.numel() // block)
    out = torch.zeros(n_blocks * block)
    out[: t.numel()] = t
    return out.view(n_blocks, block)


# ---- construction -----------------------------------------------------------------------------


def test_codec_names_are_the_documented_ones():
    assert CODEC_NAMES == ("fp32", "fp16", "bf16", "int8", "fp8-e4m3", "fp4-e3m0", "fp4-e2m1", "topk-int2", "topk-int4")
    for name in CODEC_NAMES:
        assert get_codec(name).name == name


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "fp3"}, "unknown codec"),
        ({"name": "int8", "block_size": 4}, "block_size"),
        ({"name": "int8", "block_size": 8192}, "block_size"),
        ({"name": "int8", "block_size": 64.0}, "block_size"),
        ({"name": "fp4-e2m1", "scale_dtype": "bf16"}, "scale_dtype"),
    ],
)
def test_bad_codec_parameters_are_rejected_with_a_clear_message(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_codec(**kwargs)


def test_encode_rejects_non_float_input():
    with pytest.raises(TypeError, match="floating-point"):
        get_codec("int8").encode(torch.arange(10))


# ---- error bounds -----------------------------------------------------------------------------


def test_fp32_roundtrip_is_exact_for_fp32_and_narrower_inputs():
    x = _randn(1001)
    codec = get_codec("fp32")
    assert torch.equal(codec.roundtrip(x), x)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert torch.equal(codec.roundtrip(x.to(dtype)), x.to(dtype).float())


@pytest.mark.parametrize("name, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_casts_round_to_nearest_like_torch(name, dtype):
    x = _randn(4099)
    out = get_codec(name).roundtrip(x)
    assert torch.equal(out, x.to(dtype).float())
    rel = 2.0**-11 if dtype == torch.float16 else 2.0**-8  # half an ulp, relative
    normal = x.abs() > 1e-4  # fp16 subnormals have a fixed absolute ulp instead
    assert ((out - x).abs() <= rel * x.abs())[normal].all()


def test_half_casts_saturate_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 3.4e38, 1.0])  # 3.4e38 > bf16 max, < fp32 max
    assert get_codec("fp16").roundtrip(x).tolist() == [65504.0, -65504.0, 65504.0, 1.0]
    bf = get_codec("bf16").roundtrip(x)
    assert torch.isfinite(bf).all() and bf[2] == torch.finfo(torch.bfloat16).max


@pytest.mark.parametrize("name", BLOCK_CODECS)
@pytest.mark.parametrize("block_size, scale_dtype", [(64, "fp16"), (8, "fp32"), (100, "fp16"), (4096, "fp32")])
def test_block_error_is_at_most_half_the_largest_gap_times_step(name, block_size, scale_dtype):
    codec = get_codec(name, block_size=block_size, scale_dtype=scale_dtype)
    x = _randn(5003)  # 5003 is prime: every block size leaves a short last block
    out = codec.roundtrip(x)
    lv = levels(name)
    half_gap = float((lv[1:] - lv[:-1]).max()) / 2
    amax = _per_block(x, block_size).abs().amax(dim=1)
    err = _per_block(out - x, block_size).abs().amax(dim=1)
    # fp16 scales round the absmax up by at most 2^-10 relative.
    bound = half_gap * amax / top(name) * (1 + 2.0**-10) + 1e-12
    assert (err <= bound).all()
    assert err.max() > 0  # the bound is not vacuous: these formats are lossy


def test_fp8_error_is_relative_for_values_in_the_normal_range():
    codec = get_codec("fp8-e4m3", scale_dtype="fp32")
    x = _randn(4096, seed=3)
    out = codec.roundtrip(x)
    step = _per_block(x, 64).abs().amax(dim=1, keepdim=True) / 448
    normal = (_per_block(x, 64).abs() / step >= 2.0**-6).view(-1)
    assert ((out - x).abs() <= 2.0**-4 * x.abs())[normal].all()


def test_int8_codes_are_symmetric_and_error_at_most_half_a_step():
    codec = get_codec("int8", block_size=32, scale_dtype="fp32")
    x = _randn(640, seed=4)
    data = codec.encode(x)
    codes = np.frombuffer(data, dtype=np.int8, offset=HEADER_SIZE + 20 * 4)
    assert codes.min() >= -127 and codes.max() <= 127
    assert np.abs(codes.astype(np.int32)).max() == 127  # each block's absmax lands on the top code
    step = _per_block(x, 32).abs().amax(dim=1) / 127
    assert torch.equal(codec.decode(data), torch.from_numpy(codes.astype(np.float32)) * step.repeat_interleave(32))


# ---- code tables ------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype, stochastic", [("fp16", False), ("fp32", False), ("fp16", True)])
def test_fp4_e2m1_decodes_only_to_mx_values_times_scale(scale_dtype, stochastic):
    codec = get_codec("fp4-e2m1", block_size=32, scale_dtype=scale_dtype, stochastic=stochastic, seed=0)
    x = _randn(3001, seed=5)
    data = codec.encode(x)
    out = _per_block(codec.decode(data), 32)
    step = (_stored_scales(codec, data) / 6).unsqueeze(1)
    table = torch.tensor(MX_VALUES)
    candidates = torch.cat([table, -table]).view(1, 1, -1) * step.unsqueeze(2)
    assert (out.unsqueeze(2) == candidates).any(dim=2).all()
    used = (out.abs() / step).unique()
    assert len(used) == len(MX_VALUES)  # randn data reaches every level


@pytest.mark.parametrize("scale_dtype, stochastic", [("fp16", False), ("fp32", False), ("fp16", True)])
def test_fp4_e3m0_decodes_only_to_signed_powers_of_two_times_scale(scale_dtype, stochastic):
    codec = get_codec("fp4-e3m0", block_size=64, scale_dtype=scale_dtype, stochastic=stochastic, seed=0)
    x = _randn(4000, seed=6)
    data = codec.encode(x)
    out = _per_block(codec.decode(data), 64)
    scale = _stored_scales(codec, data).unsqueeze(1)
    table = torch.tensor([0.0] + [2.0**k for k in range(-6, 1)])
    candidates = torch.cat([table, -table]).view(1, 1, -1) * scale.unsqueeze(2)
    assert (out.unsqueeze(2) == candidates).any(dim=2).all()


def test_fp4_tie_rule_and_nibble_order_are_pinned():
    # Wire compatibility: changing these changes the bytes peers exchange.
    e2m1 = get_codec("fp4-e2m1", block_size=8, scale_dtype="fp32")
    x = torch.tensor([6.0, -0.5, 0.25, 0.75, 5.0, 2.5, -6.0, 0.0])  # absmax 6: step 1
    assert e2m1.roundtrip(x).tolist() == [6.0, -0.5, 0.0, 0.5, 4.0, 2.0, -6.0, 0.0]
    codes = e2m1.encode(x)[HEADER_SIZE + 4 :]
    assert codes[0] == 0x97  # 6.0 -> 0b0111 low nibble, -0.5 -> 0b1001 high nibble
    e3m0 = get_codec("fp4-e3m0", block_size=8, scale_dtype="fp32")
    y = torch.tensor([1.0, 2.0**-6, 2.0**-7, 0.75, 0.76, -0.3, 0.01, 0.0])
    assert e3m0.roundtrip(y).tolist() == [1.0, 2.0**-6, 0.0, 0.5, 1.0, -0.25, 2.0**-6, 0.0]


# ---- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("block_size, scale_dtype", [(64, "fp16"), (8, "fp32"), (100, "fp16")])
def test_encoded_size_is_exact(name, block_size, scale_dtype):
    codec = get_codec(name, block_size=block_size, scale_dtype=scale_dtype)
    for numel in (0, 1, 2, 7, 63, 64, 65, 100, 101, 127, 1000, 4097):
        data = codec.encode(_randn(numel, seed=numel))
        assert len(data) == codec.encoded_size(numel), (name, numel)
        assert codec.decode(data).shape == (numel,)


def test_bits_per_value_match_the_format_costs():
    numel = 1 << 20
    for name in ("fp4-e3m0", "fp4-e2m1"):
        bits = get_codec(name).bits_per_value(numel)
        assert 4.0 < bits < 4.6
        assert bits == pytest.approx(4.25, abs=1e-3)
    assert get_codec("int8").bits_per_value(numel) == pytest.approx(8.25, abs=1e-3)
    fp32_scales = get_codec("fp4-e2m1", block_size=32, scale_dtype="fp32")
    assert fp32_scales.bits_per_value(numel) == pytest.approx(5.0, abs=1e-3)
    assert get_codec("fp32").bits_per_value(numel) == pytest.approx(32.0, abs=1e-3)
    assert get_codec("fp32").encoded_size(10) == HEADER_SIZE + 40
    with pytest.raises(ValueError):
        get_codec("fp16").bits_per_value(0)


# ---- special values ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_rejected(name, bad):
    x = _randn(300)
    x[137] = bad
    with pytest.raises(NonFiniteError):
        get_codec(name).encode(x)
    assert issubclass(NonFiniteError, ValueError)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zeros_roundtrip_to_zeros_also_next_to_nonzero_blocks(name):
    codec = get_codec(name, block_size=16)
    assert torch.equal(codec.roundtrip(torch.zeros(100)), torch.zeros(100))
    x = _randn(64)
    x[16:32] = 0.0  # one all-zero block between non-zero ones
    out = codec.roundtrip(x)
    assert torch.isfinite(out).all() and torch.equal(out[16:32], torch.zeros(16))


@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_fp16_scale_rounding_never_clips_the_block_absmax(name):
    # fp16 scales round the absmax up, so each block's largest value decodes at least as large.
    codec = get_codec(name, block_size=16, scale_dtype="fp16")
    x = _randn(16 * 500, seed=11)
    amax = _per_block(x, 16).abs().amax(dim=1)
    decoded_max = _per_block(codec.roundtrip(x), 16).abs().amax(dim=1)
    assert (decoded_max >= amax * (1 - 2.0**-20)).all()
    assert (decoded_max <= amax * (1 + 2.0**-10)).all()


def test_fp16_scales_are_clamped_into_fp16_range():
    codec = get_codec("int8", block_size=8, scale_dtype="fp16")
    x = torch.tensor([1e6, -5e5] + [1.0] * 6 + [1e-9, -3e-10] + [0.0] * 6)
    out = codec.roundtrip(x)
    assert torch.isfinite(out).all()
    assert out[0] == pytest.approx(65504.0) and out[1] == pytest.approx(-65504.0)  # saturated
    assert (out[8:] - x[8:]).abs().max() <= 2.0**-24  # tiny block: scale 2^-24, error below it
    exact = get_codec("int8", block_size=8, scale_dtype="fp32").roundtrip(x)
    assert exact[0] == pytest.approx(1e6, rel=1e-6)  # fp32 scales have no such limit


# ---- determinism and stochastic rounding ------------------------------------------------------


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encoding_is_deterministic_and_layout_independent(name):
    x = _randn(64 * 33, seed=7).view(33, 64)
    first = get_codec(name).encode(x)
    assert get_codec(name).encode(x.clone()) == first
    assert get_codec(name).encode(x.t().contiguous().t()) == first  # non-contiguous, same values


@pytest.mark.parametrize("name", [n for n in CODEC_NAMES if n != "fp32" and not n.startswith("topk-")])
def test_stochastic_rounding_is_unbiased_and_seeded(name):
    block, copies = 64, 3000
    x = _randn(block * 4, seed=8)
    # Each copy sits in its own blocks with the same absmax, so one call rounds x `copies` times.
    codec = get_codec(name, block_size=block, stochastic=True, seed=123)
    mean = codec.roundtrip(x.repeat(copies)).view(copies, -1).mean(dim=0)
    nearest = get_codec(name, block_size=block).roundtrip(x)
    amax = _per_block(x, block).abs().amax(dim=1).repeat_interleave(block)
    bias_sr = ((mean - x).abs() / amax).max()
    bias_rn = ((nearest - x).abs() / amax).max()
    assert bias_sr < bias_rn / 5
    assert get_codec(name, block_size=block, stochastic=True, seed=123).encode(x) == get_codec(
        name, block_size=block, stochastic=True, seed=123
    ).encode(x)
    again = get_codec(name, block_size=block, stochastic=True, seed=123)
    first, second = again.encode(x), again.encode(x)
    assert first != second  # the generator advances between calls
    assert get_codec(name, block_size=block, stochastic=True, seed=124).encode(x) != first


# ---- malformed input --------------------------------------------------------------------------


def _patched(data: bytes, offset: int, raw: bytes) -> bytes:
    return data[:offset] + raw + data[offset + len(raw) :]


def test_malformed_bytes_are_rejected_with_value_errors():
    codec = get_codec("fp4-e2m1", block_size=64)
    good = codec.encode(_randn(1001))
    cases = {
        "empty": b"",
        "short header": good[: HEADER_SIZE - 1],
        "truncated payload": good[:-1],
        "trailing byte": good + b"\x00",
        "bad magic": _patched(good, 0, b"XXXX"),
        "bad version": _patched(good, 4, b"\x09"),
        "unknown codec id": _patched(good, 5, b"\x63"),
        "bad scale dtype": _patched(good, 6, b"\x07"),
        "reserved byte": _patched(good, 7, b"\x01"),
        "block size 0": _patched(good, 8, struct.pack("<I", 0)),
        "huge numel": _patched(good, 12, struct.pack("<Q", 1 << 62)),
        "numel changed": _patched(good, 12, struct.pack("<Q", 1003)),
        "NaN scale": _patched(good, HEADER_SIZE, np.float16(np.nan).tobytes()),
        "Inf scale": _patched(good, HEADER_SIZE, np.float16(np.inf).tobytes()),
        "negative scale": _patched(good, HEADER_SIZE, np.float16(-1.0).tobytes()),
        "padding nibble": good[:-1] + bytes([good[-1] | 0x50]),
        "other codec": get_codec("fp4-e3m0").encode(_randn(1001)),
        "other block size": get_codec("fp4-e2m1", block_size=32).encode(_randn(1001)),
        "other scale dtype": get_codec("fp4-e2m1", scale_dtype="fp32").encode(_randn(1001)),
    }
    for what, data in cases.items():
        with pytest.raises(ValueError):
            codec.decode(data)
            pytest.fail(f"accepted malformed bytes: {what}")
    with pytest.raises(ValueError, match="expected 1000"):
        codec.decode(good, numel=1000)
    assert codec.decode(good, numel=1001).shape == (1001,)


def test_invalid_codes_are_rejected():
    x = _randn(64)
    int8 = get_codec("int8", scale_dtype="fp32")
    with pytest.raises(ValueError, match="-128"):
        int8.decode(_patched(int8.encode(x), HEADER_SIZE + 4 + 5, b"\x80"))
    fp8 = get_codec("fp8-e4m3", scale_dtype="fp32")
    with pytest.raises(ValueError, match="NaN"):
        fp8.decode(_patched(fp8.encode(x), HEADER_SIZE + 4 + 5, b"\xff"))
    fp16 = get_codec("fp16")
    with pytest.raises(NonFiniteError):
        fp16.decode(_patched(fp16.encode(x), HEADER_SIZE + 2 * 5, np.float16(np.inf).tobytes()))


def test_bytes_are_self_describing():
    x = _randn(777, seed=9)
    for name in CODEC_NAMES:
        codec = get_codec(name, block_size=32, scale_dtype="fp32")
        data = codec.encode(x)
        header = read_header(data)
        assert header.codec == name and header.numel == 777
        assert torch.equal(decode(data), codec.decode(data))
        assert torch.equal(decode(memoryview(data)), decode(bytearray(data)))  # any bytes-like input


def test_roundtrip_keeps_shape_and_decode_does_not_alias_input():
    codec = get_codec("fp32")
    x = _randn(60).view(3, 4, 5)
    out = codec.roundtrip(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    out.add_(1.0)
    assert torch.equal(codec.roundtrip(x), x)


# ---- error feedback ---------------------------------------------------------------------------


def test_error_feedback_residual_is_what_was_not_sent():
    ef = ErrorFeedback()
    d = _randn(100)
    compensated = ef.compensate("frag0", d)
    assert torch.equal(compensated, d) and compensated.data_ptr() != d.data_ptr()
    sent = get_codec("fp4-e3m0").decode(get_codec("fp4-e3m0").encode(compensated))  # flat, CPU
    ef.update("frag0", compensated, sent)
    assert torch.equal(ef.residual("frag0"), compensated - sent)
    assert torch.equal(ef.compensate("frag0", d), d + (compensated - sent))
    assert ef.residual("frag1") is None and torch.equal(ef.compensate("frag1", d), d)
    with pytest.raises(ValueError, match="reset"):
        ef.compensate("frag0", d[:50])
    ef.reset("frag0")
    assert "frag0" not in ef and torch.equal(ef.compensate("frag0", d), d)


def test_error_feedback_keeps_the_sum_of_sent_values_on_track():
    codec = get_codec("fp4-e3m0", block_size=64)
    gen = torch.Generator().manual_seed(10)
    # A persistent component that fp4 rounds the same wrong way every round, plus noise.
    base = torch.rand(512, generator=gen) * 0.7 + 0.15
    base[::64] = 1.0  # fixes each block's absmax so the bias is systematic
    ef = ErrorFeedback()
    true_sum = torch.zeros(512)
    sent_ef = torch.zeros(512)
    sent_plain = torch.zeros(512)
    drift_ef = []
    for _ in range(60):
        d = base + 0.01 * torch.randn(512, generator=gen)
        true_sum += d
        sent_plain += codec.roundtrip(d)
        compensated = ef.compensate(0, d)
        sent = codec.roundtrip(compensated)
        ef.update(0, compensated, sent)
        sent_ef += sent
        drift_ef.append(float((sent_ef - true_sum).abs().max()))
    drift_plain = float((sent_plain - true_sum).abs().max())
    # With EF the gap is exactly the current residual: bounded, it never accumulates.
    assert torch.allclose(true_sum - sent_ef, ef.residual(0), atol=1e-4)
    assert max(drift_ef) < 1.0
    assert drift_plain > 5.0 and drift_plain > 10 * max(drift_ef)


def test_error_feedback_state_dict_roundtrip():
    ef = ErrorFeedback()
    codec = get_codec("int8")
    for key in [(0, "a"), (1, "b")]:
        c = ef.compensate(key, _randn(70, seed=key[0]))
        ef.update(key, c, codec.roundtrip(c))
    state = ef.state_dict()
    restored = ErrorFeedback()
    restored.load_state_dict(state)
    for key in [(0, "a"), (1, "b")]:
        assert torch.equal(restored.residual(key), ef.residual(key))
    state["residuals"][(0, "a")].add_(1.0)  # the state is a copy, not a view of live residuals
    assert not torch.equal(ef.residual((0, "a")), state["residuals"][(0, "a")])
    with pytest.raises(ValueError):
        restored.load_state_dict({"residuals": {0: [1, 2]}})


@pytest.mark.parametrize("name", ["fp32", "fp16", "fp4-e3m0"])
def test_encode_parts_are_the_encoding_and_fp32_parts_view_the_tensor(name):
    codec = get_codec(name)
    x = _randn(1000)
    parts = codec.encode_parts(x)
    assert b"".join(bytes(p) for p in parts) == codec.encode(x)
    if name == "fp32":  # header, then the tensor's own memory
        assert len(parts) == 2
        x[0] = 7.0
        assert np.frombuffer(parts[1], dtype=np.float32)[0] == 7.0
    else:
        assert len(parts) == 1
    with pytest.raises(NonFiniteError):
        codec.encode_parts(torch.tensor([1.0, float("nan")]))


def test_shared_fp32_decode_views_a_writable_buffer_and_copies_otherwise():
    codec = get_codec("fp32")
    x = _randn(100)
    data = bytearray(codec.encode(x))
    shared = codec.decode(data, numel=100, share=True)
    assert torch.equal(shared, x)
    data[HEADER_SIZE:HEADER_SIZE + 4] = np.float32(3.5).tobytes()
    assert shared[0] == 3.5  # a view: no copy
    assert torch.equal(codec.decode(bytes(data), numel=100, share=True), shared)  # read-only bytes: copied
    owned = codec.decode(data, numel=100)
    data[HEADER_SIZE:HEADER_SIZE + 4] = np.float32(-1.0).tobytes()
    assert owned[0] == 3.5  # share=False never aliases
    data[HEADER_SIZE:HEADER_SIZE + 4] = np.float32("nan").tobytes()
    with pytest.raises(NonFiniteError):
        codec.decode(data, numel=100, share=True)


def test_a_codec_spec_builds_the_codec_the_config_names_and_says_whether_it_is_lossless():
    from opendiloco_stream.compression import Codec
    from opendiloco_stream.compression.sparse import k_for
    from opendiloco_stream.compression.spec import CodecSpec
    from opendiloco_stream.config import DiLoCoConfig

    assert [n for n in CODEC_NAMES if CodecSpec(n).lossless] == ["fp32"]
    assert [n for n in CODEC_NAMES if Codec.from_spec(CodecSpec(n)).lossless] == ["fp32"]
    sparse = DiLoCoConfig(codec="topk-int2", sparse_chunk=256, density=0.05).codec_spec()
    codec = Codec.from_spec(sparse)
    assert (codec.name, codec.block_size, codec.k) == ("topk-int2", 256, k_for(0.05, 256))  # the chunk, not the block
    dense = DiLoCoConfig(codec="int8", codec_block_size=32, codec_scale_dtype="fp32", stochastic_rounding=True)
    assert dense.codec_spec() == CodecSpec("int8", block_size=32, scale_dtype="fp32", stochastic=True, density=0.02)
    codec = Codec.from_spec(dense.codec_spec(), seed=3)
    assert (codec.block_size, codec.scale_dtype, codec.stochastic, codec.seed) == (32, "fp32", True, 3)
    with pytest.raises(ValueError, match="unknown codec 'fp5'"):
        CodecSpec("fp5")
