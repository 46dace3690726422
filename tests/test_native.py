"""The native CPU kernels (compression/_kernels.c) against the torch code they replace: same bytes,
same values, same errors. Both paths run in this process: ``torch_only`` turns the kernels off."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

from opendiloco_stream.compression import blockwise, get_codec, native
from opendiloco_stream.compression.wire import NonFiniteError


torch_only = native.disabled


def both(fn):
    """(native result, torch result) of ``fn()``."""
    assert native.available(), native.why_not()
    got = fn()
    with torch_only():
        assert not native.available()
        want = fn()
    return got, want


def test_the_kernels_build_where_a_compiler_is(tmp_path):
    # This machine (and CI) has a C compiler: the kernels must build and load, into the cache dir asked for.
    assert shutil.which("cc") or shutil.which("gcc")
    code = ("from opendiloco_stream.compression import native; import sys; "
            "sys.exit(0 if native.available() else 'not available: %s' % native.why_not())")
    env = dict(os.environ, ODS_CACHE_DIR=str(tmp_path), ODS_NATIVE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    assert len(list(tmp_path.glob("kernels-*.so"))) == 1
    assert not list(tmp_path.glob(".kernels-*"))  # no temporary left behind
    # ODS_NATIVE=0 turns them off and says so
    code = "from opendiloco_stream.compression import native; print(native.available(), native.why_not())"
    done = subprocess.run([sys.executable, "-c", code], env=dict(env, ODS_NATIVE="0"), capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "False disabled by ODS_NATIVE=0", done.stderr


def _inputs():
    g = torch.Generator().manual_seed(3)
    yield "normal", torch.randn(10_001, generator=g)
    yield "scaled", torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    yield "huge", torch.randn(777, generator=g) * 1e6  # beyond fp16 scales: clamped, saturates
    yield "tiny", torch.randn(640, generator=g) * 1e-30  # below fp16 scales' smallest
    zeros = torch.zeros(300)
    zeros[::3] = -0.0
    zeros[200:] = torch.randn(100, generator=g)
    yield "signed zeros", zeros
    # exact midpoints between levels (ties): each block's absmax is 1, so quotients are the values
    mids = torch.tensor([0.0078125, 0.01171875, 0.0234375, 0.046875, 0.09375, 0.1875, 0.375, 0.75,
                         0.25, 1.25, 1.75, 2.5, 3.5, 5.0])
    ties = torch.cat([mids, -mids, torch.tensor([1.0, -1.0, 6.0, -6.0]), mids / 6, -mids / 6, mids / 127])
    yield "ties", ties
    yield "one", torch.tensor([-2.5])
    yield "empty", torch.zeros(0)


@pytest.mark.parametrize("fmt", ["fp4-e3m0", "fp4-e2m1", "int8", "fp8-e4m3"])
@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("block_size", [64, 8, 33, 4096])
def test_native_encode_and_decode_are_the_torch_bytes_and_values(fmt, scale_dtype, block_size):
    codec = get_codec(fmt, block_size=block_size, scale_dtype=scale_dtype)
    for name, x in _inputs():
        got, want = both(lambda: codec.encode(x))
        assert got == want, f"{fmt} {name}: encoded bytes differ"
        dec, ref = both(lambda: codec.decode(want))
        assert torch.equal(dec, ref) and dec.dtype == torch.float32, f"{fmt} {name}: decoded values differ"
        assert torch.equal(torch.signbit(dec), torch.signbit(ref)), f"{fmt} {name}: signs of zeros differ"
        out, ref_out = torch.full((x.numel(),), 7.0), torch.full((x.numel(),), 7.0)
        codec.decode_into(want, out)
        with torch_only():
            codec.decode_into(want, ref_out)
        assert torch.equal(out, ref_out) and torch.equal(out, ref), f"{fmt} {name}: decode_into differs"


def test_an_odd_length_ending_a_block_and_a_view_of_a_bigger_tensor():
    codec = get_codec("fp4-e3m0", block_size=8)
    big = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    for x in (big[:17], big[3:20], big[10:10 + 24]):  # odd, offset views, whole blocks
        got, want = both(lambda: codec.encode(x))
        assert got == want


@pytest.mark.parametrize("fmt", ["fp4-e3m0", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_like_torch(fmt, bad):
    x = torch.randn(200)
    x[131] = bad
    codec = get_codec(fmt)
    for path in (contextlib.nullcontext, torch_only):
        with path(), pytest.raises(NonFiniteError, match="NaN or Inf"):
            codec.encode(x)


@pytest.mark.parametrize("fmt,code,message", [("int8", 0x80, "-128"), ("fp8-e4m3", 0x7F, "NaN code"),
                                              ("fp8-e4m3", 0xFF, "NaN code")])
def test_forbidden_codes_are_refused_with_the_same_error(fmt, code, message):
    codec = get_codec(fmt, block_size=16)
    data = bytearray(codec.encode(torch.randn(100)))
    data[-37] = code  # a code byte (the codes end the message)
    for path in (contextlib.nullcontext, torch_only):
        with path(), pytest.raises(ValueError, match=message):
            codec.decode(bytes(data))
        with path(), pytest.raises(ValueError, match=message):
            codec.decode_into(bytes(data), torch.empty(100))


def test_the_native_decoder_checks_sizes_before_reading():
    assert native.available()
    step = torch.ones(2)
    lut = torch.zeros(16)
    with pytest.raises(ValueError, match="do not fit"):
        native.dequantize(torch.zeros(3, dtype=torch.uint8), 100, 64, step, lut, torch.empty(100))
    with pytest.raises(ValueError, match="do not fit"):
        native.dequantize(torch.zeros(50, dtype=torch.uint8), 100, 64, torch.ones(1), lut, torch.empty(100))
    with pytest.raises(ValueError, match="do not fit"):
        native.dequantize(torch.zeros(50, dtype=torch.uint8), 100, 64, step, lut, torch.empty(99))


def test_stochastic_rounding_and_gpu_style_inputs_stay_in_torch():
    # stochastic rounding draws from a torch generator: the same draws with the kernels loaded or not
    x = torch.randn(1000)
    a, b = both(lambda: get_codec("fp4-e3m0", stochastic=True, seed=5).encode(x))
    assert a == b
    # a half-precision input is widened in torch first: same bytes as its fp32 copy
    h = x.to(torch.bfloat16)
    codec = get_codec("fp4-e2m1")
    assert codec.encode(h) == codec.encode(h.float())
    scales, codes = blockwise.quantize(h, "fp4-e2m1", 64, "fp16", None)
    assert codes.numel() == 500


def test_the_native_weighted_mean_is_the_torch_one_bit_for_bit():
    from opendiloco_stream.transport.reduce import weighted_mean
    g = torch.Generator().manual_seed(11)
    cases = [([1.0, 2.0, 3.0], 10_007), ([0.1, 0.7], 5000), ([3e5, 1.0, 1e-3, 7.25], 4097), ([1.0], 3), ([2.0, 1.0], 0)]
    for weights, n in cases:
        values = [torch.randn(n, generator=g) * 10 ** float(torch.randint(-20, 20, (1,), generator=g)) for _ in weights]
        got, want = both(lambda: weighted_mean(values, weights))
        assert torch.equal(got, want), (weights, n)


def test_empty_huge_gives_fp32_tensors_of_their_own():
    for n in (0, 100, 3_000_001):
        a, b = native.empty_huge(n), native.empty_huge(n)
        assert a.dtype == torch.float32 and a.shape == (n,) and a.device.type == "cpu"
        a.fill_(1.0)
        b.fill_(2.0)
        assert n == 0 or (a.data_ptr() != b.data_ptr() and bool((a == 1.0).all()))


@pytest.mark.parametrize("fmt", ["topk-int2", "topk-int4"])
@pytest.mark.parametrize("block_size,density", [(1024, 0.02), (64, 0.25), (33, 0.5), (16, 1.0), (4096, 0.01)])
def test_native_top_k_selects_what_the_stable_sort_selects(fmt, block_size, density):
    codec = get_codec(fmt, block_size=block_size, density=density)
    g = torch.Generator().manual_seed(7)
    ties = torch.randint(-3, 4, (5000,), generator=g).float()  # many equal magnitudes, zeros
    short = torch.randn(block_size * 3 + 5, generator=g)  # a last chunk shorter than most k
    zeros = torch.zeros(block_size * 2 + 1)
    zeros[-1] = -0.0
    for x in (torch.randn(20_011, generator=g), ties, short, zeros, torch.randn(3, generator=g)):
        got, want = both(lambda: codec.encode(x))
        assert got == want, f"{fmt} block {block_size}: bytes differ"


def test_a_compiler_that_fails_leaves_the_codecs_in_torch(tmp_path):
    # CC=false: a real compiler failure (no fake in the code path); the codec still encodes, in torch
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    expected = get_codec("fp4-e3m0").encode(x).hex()
    code = ("import sys, torch; from opendiloco_stream.compression import native, get_codec; "
            "x = torch.randn(1000, generator=torch.Generator().manual_seed(2)); "
            "print(native.available(), native.why_not() is not None and 'failed' in native.why_not()); "
            "print(get_codec('fp4-e3m0').encode(x).hex())")
    env = dict(os.environ, ODS_CACHE_DIR=str(tmp_path), ODS_NATIVE="1", CC=shutil.which("false"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stdout.split()
    assert lines[:2] == ["False", "True"], done.stdout + done.stderr
    assert lines[2] == expected  # the torch path's bytes are the kernels'
    assert "native codec kernels unavailable, using torch" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing half-built left in the cache
