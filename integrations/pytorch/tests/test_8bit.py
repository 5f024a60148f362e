"""8-bit optimizer states (issue 16 part 3): Adam8bit, AdamW8bit, Lion8bit and SGD8bit keep their
moments as fusedopt's blockwise 8-bit storage (uint8 tensors). The maps and the quantizer against
a reference written from the paper's definition and the documented layout; each optimizer against
its fp32 counterpart run on the dequantized states (teacher forcing: the same parameters, and
8-bit states that are the quantization of the fp32 states), over two parameter groups, float32
and bfloat16 parameters; state_dict round trips, torch.optim state_dicts quantized on loading,
states saved in the earlier [blocks, 260] records converted, min_8bit_size, non-finite gradients,
GradScaler's fused protocol, and the state memory."""

import copy
import io
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedopt_torch as ft  # noqa: E402
import test_amp  # noqa: E402  (its checks, run on 8-bit classes below; a module import is not collected)
from test_parity import DEVICES, need_device  # noqa: E402

BLOCK = 256


# ---- the layout of an 8-bit state, from its description (quantize_state's docstring) -------------


def layout(blocks):
    """(where the codes start, the state's bytes) for `blocks` blocks: the float32 scales
    reversed, padded to a multiple of 256 bytes, then 256 codes a block."""
    start = (4 * blocks + 255) // 256 * 256
    return start, start + BLOCK * blocks


def split_state(state):
    """(scales [blocks] float32, codes [blocks, 256] uint8 in element order) of a 1-D state."""
    blocks = next(b for b in range(state.numel() // 260, state.numel() // BLOCK + 1) if layout(b)[1] == state.numel())
    start = layout(blocks)[0]
    scales = state[start - 4 * blocks:start].reshape(blocks, 4).flip(0).contiguous().view(torch.float32).reshape(blocks)
    # byte 8 l + 4 g + k of a block holds element 128 g + 4 l + k
    codes = state[start:].reshape(blocks, 32, 2, 4).permute(0, 2, 1, 3).reshape(blocks, BLOCK)
    return scales, codes


def join_state(scales, codes):
    """The 1-D state of `scales` [blocks] (float32) and `codes` [blocks, 256] (element order)."""
    blocks = codes.shape[0]
    start, total = layout(blocks)
    state = torch.zeros(total, dtype=torch.uint8)
    state[start - 4 * blocks:start] = scales.float().contiguous().view(torch.uint8).reshape(blocks, 4).flip(0).reshape(-1)
    state[start:] = codes.reshape(blocks, 2, 32, 4).permute(0, 2, 1, 3).reshape(-1)
    return state


# ---- a reference of the maps and the quantizer, from the paper's definition --------------------


def reference_map(is_signed):
    """bitsandbytes' create_dynamic_map(signed, 7, 8): for decade i, the midpoints of
    linspace(0.1, 1, 2^i + 1) (2^(i+1) + 1 unsigned) times 10^(i-6), both signs when signed; 0 and 1."""
    values = [0.0, 1.0]
    for i in range(7):
        means = 2**i if is_signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1.0, means + 1, dtype=torch.float64)
        mids = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += mids + ([-m for m in mids] if is_signed else [])
    return torch.tensor(sorted(values), dtype=torch.float64).float()


def reference_quantize(values, is_signed):
    """The 8-bit state of `values` (float32): per block the largest magnitude, then the code of
    the map value nearest to x * (1 / absmax) (float reciprocal, then a float product, as the
    library normalises), the lower code at an exact tie."""
    table = reference_map(is_signed).double()
    midpoints = (table[:-1] + table[1:]) / 2
    flat = values.detach().float().cpu().reshape(-1)
    n = flat.numel()
    blocks = (n + BLOCK - 1) // BLOCK
    scales = torch.zeros(blocks, dtype=torch.float32)
    all_codes = torch.full((blocks, BLOCK), 127 if is_signed else 0, dtype=torch.uint8)  # a step leaves the tail at zero
    for b in range(blocks):
        x = flat[b * BLOCK:(b + 1) * BLOCK]
        absmax = x.abs().max()
        # float32 ops; a subnormal absmax (1 / absmax could overflow) stores zeros
        inverse = (1.0 / absmax) if absmax >= torch.finfo(torch.float32).tiny else torch.zeros_like(absmax)
        q = (x * inverse).double()
        codes = torch.searchsorted(midpoints, q, right=False)  # midpoints strictly below q
        scales[b] = absmax
        all_codes[b, :x.numel()] = codes.to(torch.uint8)
    return join_state(scales, all_codes)


def values_of_every_magnitude(n, seed):
    g = torch.Generator().manual_seed(seed)
    exponent = torch.rand(n, generator=g, dtype=torch.float64) * 12 - 9
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (sign * 10.0**exponent).float()


@pytest.mark.parametrize("is_signed", [True, False], ids=["signed", "unsigned"])
def test_the_maps_are_the_papers(is_signed):
    state = join_state(torch.tensor([1.0]), torch.arange(256, dtype=torch.uint8).reshape(1, 256))
    table = ft.dequantize_state(state, [256], is_signed)
    assert torch.equal(table, reference_map(is_signed))
    assert table[127 if is_signed else 0] == 0 and table[255] == 1


@pytest.mark.parametrize("is_signed", [True, False], ids=["signed", "unsigned"])
def test_the_quantizer_is_the_reference(is_signed):
    values = values_of_every_magnitude(1000, 1)
    if not is_signed:
        values = values.abs()
    values[256:512] = 0  # a block of zeros
    values[600] = 1e30  # a huge value: its block reads as zeros and that value
    # Exact ties: the midpoints that are floats, in a block of scale 1 (the lower code wins).
    table = reference_map(is_signed).double()
    ties = [m for m in ((table[:-1] + table[1:]) / 2).tolist() if float(torch.tensor(m).float()) == m]
    assert ties, "the maps have midpoints that are floats"
    values[768:768 + len(ties)] = torch.tensor(ties).float()
    values[999] = 1.0
    for n in (1, 255, 257, 1000):
        assert torch.equal(ft.quantize_state(values[:n], is_signed), reference_quantize(values[:n], is_signed)), n


def test_a_block_with_a_nonfinite_value_stays_as_it_was():
    p = torch.nn.Parameter(torch.randn(1000))
    opt = ft.AdamW8bit([p], min_8bit_size=0)
    p.grad = torch.randn(1000)
    opt.step()
    before = opt.state[p]["exp_avg"].clone()
    p.grad = torch.randn(1000)
    p.grad[300] = float("nan")
    opt.step()
    (scales_after, codes_after), (scales_before, codes_before) = split_state(opt.state[p]["exp_avg"]), split_state(before)

    def same_block(b):
        return torch.equal(scales_after[b], scales_before[b]) and torch.equal(codes_after[b], codes_before[b])

    assert same_block(1)  # block 1 (elements 256-511) keeps codes and scale
    assert not same_block(0) and not same_block(2)


# ---- the optimizers against their fp32 counterparts ---------------------------------------------

# (8-bit class, fp32 class, options): two groups, the second with its own lr and min_8bit_size
# (256: its parameter of 200 keeps full-precision states, as the first group's of 3 under 100).
CASES = {
    "AdamW8bit": (ft.AdamW8bit, ft.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam8bit": (ft.Adam8bit, ft.Adam, dict(lr=1e-2, weight_decay=0.01)),
    "Lion8bit": (ft.Lion8bit, ft.Lion, dict(lr=1e-3, weight_decay=0.5)),
    "SGD8bit": (ft.SGD8bit, ft.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    # A library rule with eight_bit (fusedopt_torch.rule): both schedulers running.
    "AdEMAMix8bit": (ft.AdEMAMix8bit, ft.AdEMAMix, dict(lr=1e-2, betas=(0.9, 0.999, 0.999), alpha=5.0, alpha_warmup=4,
                                                       beta3_warmup=3, weight_decay=0.01)),
}
SIZES = ([3, 256, 1000], [200, 5000])


def groups_of(params, lr):
    first, second = params[:len(SIZES[0])], params[len(SIZES[0]):]
    return [dict(params=first), dict(params=second, lr=lr * 0.5, min_8bit_size=256)]


def same(a, b, device):
    """Bit for bit on the host; on CUDA within a rounding (the extension's kernels are built
    with FMA contraction, so two instantiations of a rule may round differently)."""
    if device == "cpu" or a.dtype == torch.uint8 and torch.equal(a, b):
        return torch.equal(a, b)
    if a.dtype == torch.uint8:  # 8-bit states: codes one apart, scales within a rounding, rarely
        (sa, ca), (sb, cb) = split_state(a.cpu()), split_state(b.cpu())
        ca, cb = ca.int(), cb.int()
        scales = torch.allclose(sa, sb, rtol=1e-5, atol=0)
        return scales and (ca - cb).abs().max() <= 1 and (ca != cb).float().mean() < 1e-2
    rtol = 1e-5 if a.dtype == torch.float32 else 2.0**-7  # a rounding of the dtype
    return torch.allclose(a.float(), b.float(), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_is_the_fp32_step_on_its_dequantized_states(case, dtype, device):
    """Every step, the fp32 optimizer starts from the 8-bit one's dequantized states and fp32
    copies of its parameters: the new parameters are the fp32 ones rounded to the dtype, and the
    8-bit states are the quantization of the fp32 states."""
    need_device(device)
    eight_cls, fp32_cls, options = CASES[case]
    g = torch.Generator().manual_seed(2)
    sizes = SIZES[0] + SIZES[1]
    params = [torch.nn.Parameter((torch.randn(n, generator=g) * 0.1).to(device=device, dtype=dtype)) for n in sizes]
    shadows = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = eight_cls(groups_of(params, options["lr"]), min_8bit_size=100, **options)
    ref = fp32_cls(groups_of(shadows, options["lr"]), **options)
    for step in range(4):
        for p, s in zip(params, shadows):
            p.grad = (torch.randn(p.shape, generator=g)).to(device=device, dtype=dtype)
            s.grad = p.grad.float()
            with torch.no_grad():
                s.copy_(p.float())
            if s in ref.state and p in opt.state:  # states exist from the first step on
                for key, value in opt.dequantized_state(p).items():
                    if key != "step":
                        ref.state[s][key].copy_(value)
        opt.step()
        ref.step()
        for i, (p, s) in enumerate(zip(params, shadows)):
            assert same(p.detach(), s.detach().to(dtype), device), (step, i)
            for key, value in opt.state[p].items():
                if key == "step":
                    continue
                quantized = value.dtype == torch.uint8
                assert quantized == (p.numel() >= (100 if i < len(SIZES[0]) else 256)), (key, p.numel())
                expected = ref.state[s][key]
                if quantized:
                    expected = ft.quantize_state(expected, key != "exp_avg_sq")
                assert same(value, expected.to(value.dtype), device), (step, i, key)


def test_a_user_rule_with_eight_bit_steps_its_rule_on_the_dequantized_states():
    """fusedopt_torch.rule(..., eight_bit=True): the states of large parameters are 8-bit (a
    user slot signed, exp_avg_sq unsigned), each step the same rule's float step on them,
    requantized; small parameters keep float states (host: bit for bit)."""
    spec = dict(hypers=dict(lr=0.1, beta=0.9), states=dict(m=0.0, exp_avg_sq=0.0),
                body="m = beta * m + grad; exp_avg_sq = beta * exp_avg_sq + grad * grad; "
                     "param -= lr * m / (sqrt(exp_avg_sq) + T(1e-3));")
    Eight = ft.rule("EightBitMomentum", eight_bit=True, **spec)
    Plain = ft.rule("PlainMomentum", **spec)
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.1) for n in (50, 5000)]
    shadows = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = Eight(params, min_8bit_size=100), Plain(shadows)
    for step in range(3):
        for p, s in zip(params, shadows):
            p.grad = torch.randn(p.shape, generator=g)
            s.grad = p.grad.clone()
            with torch.no_grad():
                s.copy_(p)
            if p in opt.state:
                for key, value in opt.dequantized_state(p).items():
                    if key != "step":
                        ref.state[s][key].copy_(value)
        opt.step()
        ref.step()
        for p, s in zip(params, shadows):
            assert torch.equal(p, s)
            for key in ("m", "exp_avg_sq"):
                value, expected = opt.state[p][key], ref.state[s][key]
                assert (value.dtype == torch.uint8) == (p.numel() >= 100)
                if value.dtype == torch.uint8:
                    expected = ft.quantize_state(expected, key == "m")
                assert torch.equal(value, expected), (step, key)


def test_eight_bit_rules_refuse_states_they_cannot_keep_in_8_bits():
    with pytest.raises(ValueError, match="float32 or read-only"):
        ft.rule("Bad8", hypers=dict(lr=0.1), states=dict(m=ft.State(dtype="float32")), body="param -= lr * m;",
                eight_bit=True)
    with pytest.raises(ValueError, match="starts at 0"):
        ft.rule("Bad8", hypers=dict(lr=0.1), states=dict(m=1.0), body="param -= lr * m;", eight_bit=True)
    with pytest.raises(ValueError, match="needs states"):
        ft.rule("Bad8", hypers=dict(lr=0.1), body="param -= lr * grad;", eight_bit=True)


# ---- state_dict ------------------------------------------------------------------------------------


def make_params(device, dtype=torch.float32, sizes=(100, 5000, 4096), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(device=device, dtype=dtype)) for n in sizes]


def train(opt, params, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_round_trip_continues_bit_for_bit(case, device):
    need_device(device)
    cls, _, options = CASES[case]
    params = make_params(device, torch.bfloat16)
    opt = cls(params, **options)
    train(opt, params, 3, seed=1)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = cls(copies, **options)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    assert fresh.state[copies[1]]["exp_avg" if case != "SGD8bit" else "momentum_buffer"].dtype == torch.uint8
    train(opt, params, 3, seed=2)
    train(fresh, copies, 3, seed=2)
    for p, c in zip(params, copies):
        assert torch.equal(p, c)
    ours, theirs = opt.state_dict()["state"], fresh.state_dict()["state"]
    for i in ours:
        for key, value in ours[i].items():
            assert torch.equal(value, theirs[i][key]), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("torch_cls, eight_cls, options", [
    (torch.optim.AdamW, ft.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, ft.Adam8bit, dict(lr=1e-2)),
    (torch.optim.SGD, ft.SGD8bit, dict(lr=0.1, momentum=0.9)),
    (ft.Lion, ft.Lion8bit, dict(lr=1e-3)),
], ids=["AdamW", "Adam", "SGD", "Lion"])
def test_a_full_precision_state_dict_is_quantized_on_loading(torch_cls, eight_cls, options, device):
    need_device(device)
    params = make_params(device)
    source = torch_cls(params, **options)
    train(source, params, 3, seed=3)
    opt = eight_cls([torch.nn.Parameter(p.detach().clone()) for p in params], **options)
    opt.load_state_dict(source.state_dict())
    for p, q in zip(params, opt.param_groups[0]["params"]):
        for key, value in source.state[p].items():
            loaded = opt.state[q][key]
            if key == "step":
                assert float(loaded) == float(value)
            elif p.numel() >= 4096:
                is_signed = key != "exp_avg_sq"
                assert loaded.device == p.device
                assert torch.equal(loaded.cpu(), reference_quantize(value, is_signed)), key
            else:
                assert torch.equal(loaded, value), key  # under min_8bit_size: as torch keeps it
    # It continues from there close to the full-precision optimizer.
    train(source, params, 5, seed=4)
    train(opt, opt.param_groups[0]["params"], 5, seed=4)
    for p, q in zip(params, opt.param_groups[0]["params"]):
        assert (p - q).abs().max() < 1e-2 * (1 + p.abs().max()), p.numel()


def test_loading_8_bit_states_for_a_parameter_under_min_8bit_size_dequantizes_them():
    params = make_params("cpu")
    opt = ft.AdamW8bit(params, min_8bit_size=0)
    train(opt, params, 2, seed=5)
    saved = opt.state_dict()
    saved["param_groups"][0]["min_8bit_size"] = 5000  # a group option: it loads with the group
    bigger = ft.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params])
    bigger.load_state_dict(saved)
    for p, q in zip(params, bigger.param_groups[0]["params"]):
        quantized = bigger.state[q]["exp_avg"].dtype == torch.uint8
        assert quantized == (p.numel() >= 5000)
        assert torch.equal(bigger.dequantized_state(q)["exp_avg"], opt.dequantized_state(p)["exp_avg"])


def test_a_state_dict_of_records_saved_before_the_layout_changed_loads_as_the_same_values():
    """Until 2026-11-26 an 8-bit moment was a [blocks, 260] uint8 tensor, each row a float32
    scale then 256 codes in element order: load_state_dict converts it to today's layout, the
    same scales and codes, so the step reads the same values and continues as from today's."""
    params = make_params("cpu", sizes=(5000, 70000))
    opt = ft.AdamW8bit(params, lr=1e-2)
    train(opt, params, 2, seed=8)
    saved = copy.deepcopy(opt.state_dict())  # torch's state_dict shares the state's dicts
    for entries in saved["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            scales, codes = split_state(entries[key])
            records = torch.empty(codes.shape[0], 260, dtype=torch.uint8)
            records[:, :4] = scales.contiguous().view(torch.uint8).reshape(-1, 4)
            records[:, 4:] = codes
            entries[key] = records
    old = ft.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    old.load_state_dict(saved)
    for p, q in zip(params, old.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(old.state[q][key], opt.state[p][key]), key
    train(opt, params, 2, seed=9)
    train(old, old.param_groups[0]["params"], 2, seed=9)
    for p, q in zip(params, old.param_groups[0]["params"]):
        assert torch.equal(p, q)
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"][1:]
    with pytest.raises(ValueError, match="8-bit state of"):
        ft.AdamW8bit([torch.nn.Parameter(p.detach().clone()) for p in params]).load_state_dict(bad)


# ---- options ---------------------------------------------------------------------------------------


def test_min_8bit_size_and_dtypes_decide_which_moments_are_8_bit():
    sizes = (1, 4095, 4096, 70000)
    params = make_params("cpu", sizes=sizes) + [torch.nn.Parameter(torch.randn(5000, dtype=torch.float64))]
    opt = ft.AdamW8bit(params)  # default min_8bit_size 4096, as bitsandbytes
    train(opt, params, 1, seed=6)
    kinds = [opt.state[p]["exp_avg_sq"].dtype for p in params]
    assert kinds == [torch.float32, torch.float32, torch.uint8, torch.uint8, torch.float64]
    state = opt.state[params[3]]["exp_avg"]
    blocks = 70000 // 256 + 1
    assert state.shape == (1280 + 256 * blocks,)  # 274 scales padded to 1280 bytes: 1.016 bytes per element against 4
    every = ft.Lion8bit(params[:2], min_8bit_size=0)
    train(every, params[:2], 1, seed=6)
    assert all(every.state[p]["exp_avg"].dtype == torch.uint8 for p in params[:2])


def test_options_8_bit_states_do_not_take():
    p = [torch.nn.Parameter(torch.randn(10))]
    with pytest.raises(NotImplementedError):
        ft.AdamW8bit(p, amsgrad=True)
    with pytest.raises(NotImplementedError):
        ft.SGD8bit(p, lr=0.1)  # no momentum: nothing to keep in 8 bits
    with pytest.raises(ValueError):
        ft.Adam8bit(p, min_8bit_size=-1)


def test_kahan_with_8_bit_moments():
    """bfloat16 parameters, 8-bit moments and a bfloat16 compensation: the smallest AdamW state."""
    params = make_params("cpu", torch.bfloat16, sizes=(5000,))
    opt = ft.AdamW8bit(params, lr=1e-3, kahan=True)
    train(opt, params, 3, seed=7)
    state = opt.state[params[0]]
    assert state["exp_avg"].dtype == torch.uint8 and state["kahan_comp"].dtype == torch.bfloat16
    assert state["kahan_comp"].abs().max() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", [(ft.AdamW8bit, "AdamW", dict(lr=1e-2, min_8bit_size=0)),
                                    (ft.SGD8bit, "SGD", dict(lr=1e-2, momentum=0.9, min_8bit_size=0))],
                         ids=["AdamW8bit", "SGD8bit"])
def test_gradscaler_protocol_equals_unscaled_gradients_and_skips(family, device):
    """test_amp's check on 8-bit moments: a step skipped by found_inf leaves every 8-bit state's bits.
    On CUDA the kernels with and without the AMP blocks may contract differently into FMAs (see
    test_amp); with 8-bit moments one ulp can move a value across a code's midpoint, so there a
    moment may differ by one code: parameters within 1e-4, 8-bit states at most one code apart."""

    def params_close(x, y, t):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6, msg=lambda m: f"step {t}: {m}")

    def states_close(x, y):
        if x.dtype != torch.uint8:
            torch.testing.assert_close(x, y)
            return
        (scales_x, codes_x), (scales_y, codes_y) = split_state(x.cpu()), split_state(y.cpu())
        torch.testing.assert_close(scales_x, scales_y, rtol=1e-4, atol=0)
        codes = (codes_x.int() - codes_y.int()).abs()
        assert codes.max() <= 1 and (codes > 0).float().mean() < 0.01

    test_amp.check_fused_protocol(family, device, params_close, states_close)
