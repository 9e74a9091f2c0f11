"""Compression codecs: documented error bounds, exact sizes, determinism, hostile parts.

The bounds checked here are written out again from the module docstring's table (not taken from
`Codec.error_bound`), so a codec that drifts from its documentation fails.
"""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.collective import compression
from meshtrain.collective.compression import CODECS, CodecError, get_codec
from meshtrain.errors import ConfigError, MeshtrainError

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CONFIGS = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {}),
    ("int8", {"block_size": 3}),
    ("int4", {}),
    ("int4", {"block_size": 2}),
    ("fp4", {}),
    ("fp4", {"block_size": 6}),
    ("topk", {}),
    ("topk", {"ratio": 0.3}),
    ("topk", {"ratio": 1.0}),
]
CONFIG_IDS = [name + "".join(f"-{k}={v}" for k, v in opts.items()) for name, opts in CONFIGS]
BLOCKWISE = ("int8", "int4", "fp4")
OVERFLOWS_AT = {torch.float16: 65520.0, torch.bfloat16: 2.0**128 * (1 - 2.0**-9)}

property_settings = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- strategies -------------------------------------------------------------------------------

shapes = st.one_of(
    st.just(()),
    st.just((0,)),
    st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple),
    st.integers(1, 700).map(lambda n: (n,)),
)


@st.composite
def tensors(draw: st.DrawFn, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Finite tensors of every supported dtype: Gaussian at scales from subnormal to near the
    dtype's limit, raw adversarial floats (max, subnormals, -0.0), wide dynamic range, zeros."""
    dtype = draw(st.sampled_from(FLOATS)) if dtype is None else dtype
    shape = draw(shapes)
    numel = math.prod(shape)
    kind = draw(st.sampled_from(["gaussian", "raw", "wide", "zeros"]))
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "raw":
        # the whole finite range, except bf16's (fp32 values near fp32's max round to inf)
        width = 16 if dtype == torch.float16 else 32
        bound = float(np.float32(3.38e38)) if dtype == torch.bfloat16 else None
        elements = st.floats(
            None if bound is None else -bound,
            bound,
            width=width,
            allow_nan=False,
            allow_infinity=False,
        )
        array = draw(hnp.arrays(np.float16 if width == 16 else np.float32, shape, elements=elements))
        return torch.from_numpy(array.copy()).to(dtype)
    seed = draw(st.integers(0, 2**32 - 1))
    low, high = (-30, 12) if dtype == torch.float16 else (-140, 122)
    exponent = draw(st.integers(low, high))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen, dtype=torch.float64) * 2.0**exponent
    if kind == "wide":  # magnitudes spread over 2^±20 inside every block
        x = x * torch.exp2(torch.randint(-20, 21, (numel,), generator=gen).double())
        x = x.clamp(-(2.0**high), 2.0**high)
    return x.to(dtype).view(shape)


# --- the documented bounds, written out independently --------------------------------------


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    numel = x.numel()
    padded = torch.zeros(-(-numel // block) * block, dtype=torch.float64)
    padded[:numel] = x.abs()
    return padded.view(-1, block).amax(1).repeat_interleave(block)[:numel]


def documented_bound(name: str, opts: dict, t: torch.Tensor) -> torch.Tensor:
    """The docstring table: bound on |x - x̂| when decoding to float32."""
    x = t.double().reshape(-1)
    if name == "none":
        return torch.zeros_like(x)
    if name == "fp16":
        return x.abs() * 2.0**-11 + 2.0**-25
    if name == "bf16":
        return x.abs() * 2.0**-8 + 2.0**-134
    if name == "topk":
        return x.abs()  # kept exactly or zeroed; which ones is checked in its own test
    a = block_absmax(x, opts.get("block_size", 128 if name == "int8" else 64))
    slack = a * 2.0**-20 + 2.0**-149
    if name == "int8":
        return a / 254 + slack
    if name == "int4":
        return a / 14 + slack
    return torch.maximum(x.abs() / 3, a / 128) + slack


def max_abs(t: torch.Tensor) -> float:
    return float(t.double().abs().max()) if t.numel() else 0.0


def encode_or_expect_range_error(name: str, codec, t: torch.Tensor):
    """fp16/bf16 refuse values that would round to inf; everything else encodes."""
    limit = {"fp16": OVERFLOWS_AT[torch.float16], "bf16": OVERFLOWS_AT[torch.bfloat16]}.get(name)
    if limit is not None and max_abs(t) >= limit:
        with pytest.raises(CodecError):
            codec.encode(t)
        return None
    return codec.encode(t)


def nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in parts.values())


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "opts"), CONFIGS, ids=CONFIG_IDS)
@property_settings
@given(t=tensors())
def test_roundtrip_error_within_documented_bound(name: str, opts: dict, t: torch.Tensor) -> None:
    codec = get_codec(name, **opts)
    parts = encode_or_expect_range_error(name, codec, t)
    if parts is None:
        return
    as_f32 = codec.decode(parts, t.shape, torch.float32)
    assert as_f32.shape == t.shape and as_f32.dtype == torch.float32
    assert bool(torch.isfinite(as_f32).all())
    err = (as_f32.double() - t.double()).abs().reshape(-1)
    bound = documented_bound(name, opts, t)
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max())}"
    # error_bound says the same thing as the table (topk's is tighter: 0 where surely kept)
    assert bool((codec.error_bound(t, torch.float32).reshape(-1) <= bound).all())

    same = codec.decode(parts, t.shape, t.dtype)
    assert same.shape == t.shape and same.dtype == t.dtype
    assert bool(((same.double() - t.double()).abs() <= codec.error_bound(t)).all())


@pytest.mark.parametrize(("name", "opts"), CONFIGS, ids=CONFIG_IDS)
@property_settings
@given(t=tensors(dtype=torch.float32), out_dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_decode_to_narrower_dtype_is_bounded_or_refused(
    name: str, opts: dict, t: torch.Tensor, out_dtype: torch.dtype
) -> None:
    codec = get_codec(name, **opts)
    parts = encode_or_expect_range_error(name, codec, t)
    if parts is None:
        return
    try:
        out = codec.decode(parts, t.shape, out_dtype)
    except CodecError:
        assert max_abs(t) >= OVERFLOWS_AT[out_dtype] / 2  # refused only for values out of range
        return
    assert out.dtype == out_dtype and bool(torch.isfinite(out).all())
    assert bool(((out.double() - t.double()).abs() <= codec.error_bound(t, out_dtype)).all())


@pytest.mark.parametrize("ratio", [0.01, 0.3, 1.0])
@property_settings
@given(t=tensors())
def test_topk_keeps_the_largest_values_exactly_and_zeroes_the_rest(ratio: float, t: torch.Tensor) -> None:
    codec = get_codec("topk", ratio=ratio)
    out = codec.decode(codec.encode(t), t.shape, t.dtype).reshape(-1)
    x = t.reshape(-1)
    kept = codec.encode(t)["indices"].long()
    assert kept.numel() == (0 if x.numel() == 0 else min(x.numel(), max(1, round(ratio * x.numel()))))
    dropped = torch.ones(x.numel(), dtype=torch.bool)
    dropped[kept] = False
    assert torch.equal(out[kept], x[kept])
    assert bool((out[dropped] == 0).all())
    if kept.numel() and dropped.any():
        assert float(x[kept].double().abs().min()) >= float(x[dropped].double().abs().max())


def test_topk_breaks_ties_by_lower_index() -> None:
    codec = get_codec("topk", ratio=0.5)
    parts = codec.encode(torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0]))
    assert parts["indices"].tolist() == [1, 2, 4]
    assert parts["values"].tolist() == [-2.0, 2.0, -2.0]


@pytest.mark.parametrize("name", ["int8", "int4", "fp4", "fp16", "bf16"])
def test_bound_is_tight_on_gaussian_data(name: str) -> None:
    """The documented bound is nearly reached, so it says something about the codec."""
    t = torch.randn(64 * 512, generator=torch.Generator().manual_seed(1))
    codec = get_codec(name, **({"block_size": 64} if name in BLOCKWISE else {}))
    err = (codec.decode(codec.encode(t), t.shape) - t).abs().double()
    assert float((err / documented_bound(name, {"block_size": 64}, t)).max()) > 0.9


def test_all_zero_blocks_decode_to_zero_without_nan() -> None:
    t = torch.cat([torch.zeros(200), torch.tensor([3.0]), torch.zeros(55)])
    for name in CODECS:
        codec = get_codec(name)
        out = codec.decode(codec.encode(t), t.shape)
        assert bool(torch.isfinite(out).all())
        assert torch.equal(out[:200], torch.zeros(200)) and float(out[200]) == 3.0


def test_blockwise_largest_element_comes_back_exactly_even_at_float32_max() -> None:
    big = torch.finfo(torch.float32).max
    t = torch.tensor([big, -big / 3, 1.0, -big])
    for name in ("int8", "int4", "fp4"):
        codec = get_codec(name, block_size=2)
        out = codec.decode(codec.encode(t), t.shape)
        assert float(out[0]) == big and float(out[3]) == -big
        assert bool(torch.isfinite(out).all())


def test_residual_is_what_the_codec_dropped() -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for name in CODECS:
        codec = get_codec(name)
        parts = codec.encode(t)
        residual = codec.residual(t, parts)
        assert residual.dtype == torch.float32 and residual.shape == t.shape
        assert torch.equal(residual, t.float() - codec.decode(parts, t.shape, torch.float32))
    topk = get_codec("topk", ratio=0.1)
    parts = topk.encode(t)
    assert torch.equal(topk.decode(parts, t.shape) + topk.residual(t, parts), t.float())


# --- hand-checked encodings (also pin the wire format) -----------------------------------------


def test_int8_codes_round_half_to_even_against_block_absmax() -> None:
    parts = get_codec("int8", block_size=4).encode(torch.tensor([2.0, -1.0, 0.5, 0.0, 0.25]))
    # block 1: absmax 2 → 127·x/2 = 127, -63.5, 31.75, 0; block 2: absmax 0.25 → 127
    assert parts["codes"].tolist() == [127, -64, 32, 0, 127]
    assert parts["absmax"].tolist() == [2.0, 0.25]


def test_int4_packs_q_plus_8_low_nibble_first() -> None:
    parts = get_codec("int4", block_size=4).encode(torch.tensor([1.0, -1.0, 0.5, 0.0, 3.0]))
    # q = 7, -7, round(3.5)=4, 0 | 7 (+ padding 0) → nibbles 15, 1, 12, 8 | 15, 8
    assert parts["codes"].tolist() == [15 | 1 << 4, 12 | 8 << 4, 15 | 8 << 4]
    assert parts["absmax"].tolist() == [1.0, 3.0]


def test_fp4_e3m0_rounds_each_magnitude_to_the_nearest_power_of_two() -> None:
    x = torch.tensor([1.0, 0.75, 0.7, 0.01, -0.5, 0.004, 0.0, -(2.0**-7)])
    codec = get_codec("fp4", block_size=8)
    parts = codec.encode(x)
    # nibble = sign<<3 | e, value 2^(e-7): 1→7, 0.75 (tie)→7, 0.7→6, 0.01→1 (2^-6),
    # -0.5→8|6,
    # 0.004 (< 2^-7)→0, 0→0, -2^-7 (tie between 0 and 2^-6)→8|1
    assert parts["codes"].tolist() == [7 | 7 << 4, 6 | 1 << 4, 14 | 0 << 4, 0 | 9 << 4]
    assert codec.decode(parts, x.shape).tolist() == [1, 1, 0.5, 2**-6, -0.5, 0, 0, -(2**-6)]


# --- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "opts"), CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("numel", [0, 1, 2, 63, 64, 65, 127, 129, 1000])
def test_parts_match_layout_and_encoded_nbytes(name: str, opts: dict, numel: int) -> None:
    codec = get_codec(name, **opts)
    parts = codec.encode(torch.randn(numel))
    layout = codec.layout(numel)
    assert list(parts) == list(layout)
    for key, spec in layout.items():
        part = parts[key]
        assert part.dtype == spec.dtype and part.shape == (spec.numel,) and part.is_contiguous()
    assert nbytes(parts) == codec.encoded_nbytes(numel)


@pytest.mark.parametrize(
    ("name", "opts", "bytes_per_element"),
    [
        ("none", {}, 4.0),
        ("fp16", {}, 2.0),
        ("bf16", {}, 2.0),
        ("int8", {}, 1 + 4 / 128),
        ("int8", {"block_size": 64}, 1 + 4 / 64),
        ("int4", {}, 0.5 + 4 / 64),
        ("fp4", {}, 0.5 + 4 / 64),
        ("fp4", {"block_size": 128}, 0.5 + 4 / 128),
        ("topk", {"ratio": 0.01}, 0.01 * 8),
    ],
)
def test_bytes_per_element_are_as_documented(name: str, opts: dict, bytes_per_element: float) -> None:
    numel = 128 * 100
    parts = get_codec(name, **opts).encode(torch.randn(numel))
    assert nbytes(parts) / numel == pytest.approx(bytes_per_element)


def test_topk_indices_are_int64_only_beyond_int32_range() -> None:
    codec = get_codec("topk", ratio=1e-9)
    assert codec.layout(2**31 - 1)["indices"].dtype == torch.int32
    assert codec.layout(2**31)["indices"].dtype == torch.int64


# --- determinism --------------------------------------------------------------------------------


def assert_same_parts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype
        assert bytes(a[key].view(torch.uint8).numpy()) == bytes(b[key].view(torch.uint8).numpy())


@pytest.mark.parametrize(("name", "opts"), CONFIGS, ids=CONFIG_IDS)
def test_same_values_encode_to_same_bytes_whatever_dtype_layout_threads_or_chunking(
    name: str, opts: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(3)
    values = (torch.randn(300, 700, generator=gen) * torch.rand(300, 1, generator=gen)).to(torch.bfloat16)
    values[5, :] = 0  # ties and zero blocks
    codec = get_codec(name, **opts)
    reference = codec.encode(values.float())
    assert_same_parts(reference, codec.encode(values.float()))
    assert_same_parts(reference, codec.encode(values))  # bf16 copy of the same numbers
    assert_same_parts(reference, codec.encode(values.float().t().contiguous().t()))  # strided
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_same_parts(reference, codec.encode(values.float()))
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(compression, "_CHUNK_ELEMENTS", 2 * 3 * 64)  # many chunks, ragged ends
    assert_same_parts(reference, codec.encode(values.float()))
    assert torch.equal(
        codec.decode(reference, values.shape, torch.bfloat16),
        codec.decode(reference, values.shape, torch.float32).to(torch.bfloat16),
    )


def test_encode_does_not_alias_or_modify_its_input() -> None:
    t = torch.randn(300)
    before = t.clone()
    for name in CODECS:
        parts = get_codec(name).encode(t)
        assert torch.equal(t, before)
        for part in parts.values():
            assert part.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


# --- inputs the codecs refuse -------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", FLOATS)
def test_non_finite_input_raises_codec_error(name: str, bad: float, dtype: torch.dtype) -> None:
    t = torch.randn(200).to(dtype)
    t[150] = bad
    with pytest.raises(CodecError) as info:
        get_codec(name).encode(t)
    assert isinstance(info.value, MeshtrainError)


def test_fp16_and_bf16_refuse_values_that_would_become_inf() -> None:
    assert float(get_codec("fp16").encode(torch.tensor([65519.0]))["values"][0]) == 65504.0
    with pytest.raises(CodecError):
        get_codec("fp16").encode(torch.tensor([1.0, 65520.0]))
    with pytest.raises(CodecError):
        get_codec("bf16").encode(torch.tensor([-3.4e38]))


def test_only_float_tensors_are_encoded() -> None:
    with pytest.raises(CodecError):
        get_codec("int8").encode(torch.arange(10))
    with pytest.raises(CodecError):
        get_codec("int8").encode(torch.randn(10, dtype=torch.float64))
    with pytest.raises(CodecError):
        get_codec("int8").encode([1.0, 2.0])  # type: ignore[arg-type]


def test_registry_rejects_unknown_names_and_bad_options() -> None:
    assert CODECS == ("none", "fp16", "bf16", "int8", "int4", "fp4", "topk")
    assert all(get_codec(name).name == name for name in CODECS)
    with pytest.raises(CodecError):
        get_codec("zstd")
    for name, opts in [
        ("int8", {"block_size": 0}),
        ("int4", {"block_size": 63}),
        ("fp4", {"block_size": 2.0}),
        ("topk", {"ratio": 0}),
        ("topk", {"ratio": 1.5}),
        ("none", {"block_size": 64}),
    ]:
        with pytest.raises(ConfigError):
            get_codec(name, **opts)


# --- untrusted parts ----------------------------------------------------------------------------


SHAPE = (7, 19)


def codec_for_parts_tests(name: str):
    return get_codec(name, **({"ratio": 0.1} if name == "topk" else {}))


def malformed_variants(name: str, parts: dict[str, torch.Tensor]) -> list[tuple[str, object]]:
    key = next(iter(parts))
    first = parts[key]
    variants: list[tuple[str, object]] = [
        ("not a dict", list(parts.values())),
        ("missing key", {k: v for k, v in parts.items() if k != key}),
        ("extra key", {**parts, "extra": torch.zeros(1)}),
        ("not a tensor", {**parts, key: first.tolist()}),
        ("wrong dtype", {**parts, key: first.to(torch.float64)}),
        ("too short", {**parts, key: first[:-1]}),
        ("too long", {**parts, key: torch.cat([first, first[:1]])}),
        ("2-D", {**parts, key: first.view(1, -1)}),
    ]
    if "absmax" in parts:
        for label, value in [("negative", -1.0), ("nan", math.nan), ("inf", math.inf)]:
            absmax = parts["absmax"].clone()
            absmax[1] = value
            variants.append((f"{label} absmax", {**parts, "absmax": absmax}))
    if "values" in parts:
        for label, value in [("nan", math.nan), ("inf", -math.inf)]:
            values = parts["values"].clone()
            values[0] = value
            variants.append((f"{label} value", {**parts, "values": values}))
    if "indices" in parts:
        idx = parts["indices"]
        for label, bad in [
            (
                "out of range",
                torch.cat([idx[:-1], torch.tensor([math.prod(SHAPE)], dtype=idx.dtype)]),
            ),
            ("negative", torch.cat([torch.tensor([-1], dtype=idx.dtype), idx[1:]])),
            ("duplicate", torch.cat([idx[:1], idx[:1], idx[2:]])),
            ("unsorted", idx.flip(0)),
        ]:
            variants.append((f"index {label}", {**parts, "indices": bad}))
    return variants


@pytest.mark.parametrize("name", CODECS)
def test_malformed_parts_raise_codec_error(name: str) -> None:
    codec = codec_for_parts_tests(name)
    parts = codec.encode(torch.randn(SHAPE, generator=torch.Generator().manual_seed(4)))
    codec.decode(parts, SHAPE)  # the unmodified parts are fine
    for label, bad in malformed_variants(name, parts):
        with pytest.raises(CodecError):
            codec.decode(bad, SHAPE)  # type: ignore[arg-type]
            pytest.fail(f"accepted parts with {label}")
    for bad_shape in [(7, -19), (7, 19.0), None, (7, 18), (133, 1, 2)]:
        with pytest.raises(CodecError):
            codec.decode(parts, bad_shape)  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        codec.decode(parts, SHAPE, torch.int32)


def test_codes_never_sent_cannot_push_values_past_the_block_absmax() -> None:
    big = torch.finfo(torch.float32).max
    int8 = get_codec("int8", block_size=2)
    out = int8.decode({"codes": torch.tensor([-128, 127], dtype=torch.int8), "absmax": torch.tensor([big])}, (2,))
    assert out.tolist() == [-big, big]
    int4 = get_codec("int4", block_size=2)
    out = int4.decode(
        {"codes": torch.tensor([0], dtype=torch.uint8), "absmax": torch.tensor([65504.0])},
        (2,),
        torch.float16,
    )
    assert out.tolist() == [-65504.0, -65504.0]


def test_decoding_to_float16_refuses_values_beyond_its_range() -> None:
    codec = get_codec("int8")
    parts = codec.encode(torch.tensor([1e6, 1.0]))
    assert codec.decode(parts, (2,), torch.bfloat16).tolist()[0] == pytest.approx(1e6, rel=1e-2)
    with pytest.raises(CodecError):
        codec.decode(parts, (2,), torch.float16)


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_part_contents_decode_to_finite_values_or_codec_error(name: str, data: st.DataObject) -> None:
    codec = codec_for_parts_tests(name)
    shape = data.draw(shapes, label="shape")
    out_dtype = data.draw(st.sampled_from(FLOATS), label="dtype")
    parts = {}
    for key, spec in codec.layout(math.prod(shape)).items():
        raw = data.draw(st.binary(min_size=spec.nbytes, max_size=spec.nbytes), label=key)
        parts[key] = torch.tensor(list(raw), dtype=torch.uint8).view(spec.dtype)
    try:
        out = codec.decode(parts, shape, out_dtype)
    except CodecError:
        return
    assert out.shape == shape and out.dtype == out_dtype
    assert bool(torch.isfinite(out).all())
