import math

import pytest
import torch
from torch import nn

from mixprec import amp
from mixprec.amp.scaler import LossScaler, any_flag_set, unscale_grads_


def _trace(s, flags, on_device):
    """Update ``s`` with each overflow flag of ``flags`` (on its device scale with
    ``on_device``); the (scale, clean-step count) after each."""
    trace = []
    for flag in flags:
        if on_device:
            s.update_on_device(torch.tensor(float(flag)))
        else:
            s.update(flag)
        trace.append((s.state_dict()["loss_scale"], s.state_dict()["unskipped"]))
    return trace


def test_dynamic_backoff_and_growth():
    s = LossScaler("dynamic", scale_window=3)
    assert s.loss_scale == 2.0**16
    assert s.update(found_inf=True) is True
    assert s.loss_scale == 2.0**15
    for _ in range(2):
        assert s.update(False) is False
    assert s.loss_scale == 2.0**15
    s.update(False)  # third clean step in a row
    assert s.loss_scale == 2.0**16
    assert s.state_dict() == {"loss_scale": 2.0**16, "unskipped": 0}


@pytest.mark.parametrize("scale_one", ["initial", "backed_off"])
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_dynamic_scale_of_one_still_looks_for_overflows(scale_one, bad):
    # r98B: a dynamic scale at exactly 1.0 (init_scale=1, or backed off to a floor of 1) is
    # not a static 1.0 (nothing to unscale, nothing to check): an inf/NaN gradient is found,
    # the step skipped and the scale halved (to 0.5, or held at the floor of 1).
    if scale_one == "initial":
        s = LossScaler("dynamic", init_scale=1.0)
    else:
        s = LossScaler("dynamic", init_scale=4.0, min_loss_scale=1.0)
        for _ in range(3):
            s.update(True)
    assert s.loss_scale == 1.0
    flags = unscale_grads_([torch.tensor([1.0, bad, 3.0])], s, check=True)
    assert flags is not None and any_flag_set(flags)
    assert s.update(any_flag_set(flags)) is True
    assert s.loss_scale == (0.5 if scale_one == "initial" else 1.0)


def test_bounds():
    s = LossScaler("dynamic", scale_window=1, min_loss_scale=2.0**15, max_loss_scale=2.0**17)
    for _ in range(5):
        s.update(True)
    assert s.loss_scale == 2.0**15
    for _ in range(5):
        s.update(False)
    assert s.loss_scale == 2.0**17
    with pytest.raises(ValueError, match="min_loss_scale"):
        LossScaler("dynamic", min_loss_scale=4.0, max_loss_scale=2.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(scale_factor=0.5), r"scale_factor=0\.5\): must be a finite number > 1"),
    (dict(scale_factor=0), r"scale_factor=0\): must be a finite number > 1"),
    (dict(loss_scale=-1.0), r'loss_scale=-1\.0\): must be a finite number > 0, or "dynamic"'),
    (dict(loss_scale=float("nan")), r"loss_scale=nan\): must be a finite number > 0"),
    (dict(loss_scale="Dynamic"), r"loss_scale='Dynamic'\): must be a finite number > 0"),
    (dict(init_scale=0), r"init_scale=0\): must be a finite number > 0"),
    (dict(init_scale=float("nan")), r"init_scale=nan\): must be a finite number > 0"),
    (dict(scale_window=1.5), r"scale_window=1\.5\): must be a whole number >= 1"),
    (dict(scale_window="x"), r"scale_window='x'\): must be a whole number >= 1"),
    (dict(min_loss_scale=-1), r"min_loss_scale=-1\): must be a finite number > 0"),
    (dict(max_loss_scale=0), r"max_loss_scale=0\): must be a number > 0"),
    # A NaN ceiling (a config's missing value) made the scale NaN at the first update's
    # clamp; an infinite factor threw it to the floor or the ceiling at once. (r65B's S01, S03)
    (dict(max_loss_scale=float("nan")), r"max_loss_scale=nan\): must be a number > 0"),
    (dict(scale_factor=float("inf")), r"scale_factor=inf\): must be a finite number > 1"),
    (dict(min_loss_scale=8.0, max_loss_scale=2.0),
     r"LossScaler\(min_loss_scale=8\.0, max_loss_scale=2\.0\): min_loss_scale must not"),
    # The floor's refusal names the spelling for "the default floor" (None, 2**-24), and the
    # ceiling is shown as passed (a config's string), so the message repeats the user's call.
    (dict(min_loss_scale=0),
     r"^LossScaler\(min_loss_scale=0\): must be a finite number > 0, or None \(2\*\*-24\)\.$"),
    (dict(min_loss_scale=8.0, max_loss_scale="2"),
     r"^LossScaler\(min_loss_scale=8\.0, max_loss_scale='2'\): min_loss_scale must not exceed"),
    # A bool is not a scale, window or bound: LossScaler(True) (a flag meant for "dynamic")
    # became a static scale of 1.0 and scale_window=True a window of one step.
    *[(dict([(name, flag)]), rf"LossScaler\({name}={flag}\): must be")
      for name, flag in (("loss_scale", True), ("init_scale", True), ("scale_window", True),
                         ("min_loss_scale", True), ("max_loss_scale", True),
                         ("scale_factor", False))],
])
def test_bad_arguments_are_refused_naming_them(kwargs, match):
    # The public LossScaler took them all: a factor of 0.5 shrank the scale on clean steps, 0
    # divided by zero at the first overflow, init_scale=0 became 2**-24 silently, 1.5 clean
    # steps were truncated to 1, and a bad bound was reported as amp.initialize's.
    with pytest.raises(ValueError, match=match):
        LossScaler(**kwargs)


def test_numbers_of_other_types_are_taken():
    # (NumPy numbers, one-element tensors, a whole float, argparse's strings: as before.)
    import numpy as np

    s = LossScaler(init_scale=torch.tensor(1024.0), scale_window=np.int64(3), scale_factor="2")
    assert (s.loss_scale, s._window, s._factor) == (1024.0, 3, 2.0)
    assert LossScaler(np.float32(128.0)).loss_scale == 128.0
    assert LossScaler("dynamic", scale_window=2000.0)._window == 2000


def test_static_never_skips():
    s = LossScaler(128.0)
    assert s.update(True) is False and s.loss_scale == 128.0
    assert not s.found_overflow
    # Apex counted a static scale's steps as clean ones (its "unskipped").
    s.update(False)
    assert s.state_dict() == {"loss_scale": 128.0, "unskipped": 2}


def test_found_overflow_and_set_state_host_and_device():
    s = LossScaler("dynamic")
    s.update(True)
    assert s.found_overflow
    s.update(False)
    assert not s.found_overflow
    dev = s.device_state(torch.device("cpu"))
    s.update_on_device(torch.ones(()))
    assert s.found_overflow and s.loss_scale == 2.0**14
    s.set_state(loss_scale=2.0**20)  # in place on the device; the count stays
    assert float(dev.scale) == 2.0**20 and float(dev.inv) == 2.0**-20
    assert s.state_dict() == {"loss_scale": 2.0**20, "unskipped": 0}
    s.update_on_device(torch.zeros(()))
    s.set_state(unskipped=5)
    assert not s.found_overflow
    assert s.state_dict() == {"loss_scale": 2.0**20, "unskipped": 5}


def test_state_dict_roundtrip_and_errors():
    s = LossScaler("dynamic")
    s.load_state_dict({"loss_scale": 1024.0, "unskipped": 7})
    assert s.state_dict() == {"loss_scale": 1024.0, "unskipped": 7}
    with pytest.raises(ValueError, match="expected"):
        s.load_state_dict({"scale": 1.0})
    with pytest.raises(ValueError, match="> 0"):
        s.load_state_dict({"loss_scale": 0.0, "unskipped": 0})
    # A count past this run's window (saved under a longer scale_window) is saved again as it
    # was loaded while the host holds the scale (a save right after a resume writes the
    # checkpoint it read); the next clean step grows the scale and resets the count.
    s = LossScaler("dynamic", scale_window=4)
    s.load_state_dict({"loss_scale": 1024.0, "unskipped": 10})
    assert s.state_dict() == {"loss_scale": 1024.0, "unskipped": 10}
    s.update(False)
    assert s.state_dict() == {"loss_scale": 2048.0, "unskipped": 0}


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_state_dict_types_are_apexs_float_and_int(on_device):
    # Apex's format is {"loss_scale": float, "unskipped": int}; only a scale below 1 (0.5 in
    # an O3 test) caught a state_dict that wrote the scale as an int, e.g. 65536 for 65536.0.
    # Checked from a fresh scaler, a static one given an int, a load of ints, and after
    # updates (host, and with the scale on the device, read back through _pull).
    scalers = [LossScaler("dynamic"), LossScaler(128)]
    loaded = LossScaler("dynamic")
    loaded.load_state_dict({"loss_scale": 1024, "unskipped": 3})
    scalers.append(loaded)
    moved = LossScaler("dynamic", scale_window=2)
    if on_device:
        moved.device_state(torch.device("cpu"))
        for found in (0.0, 0.0, 1.0, 0.0):
            moved.update_on_device(torch.tensor(found))
    else:
        for found in (False, False, True, False):
            moved.update(found)
    scalers.append(moved)
    for s in scalers:
        sd = s.state_dict()
        assert set(sd) == {"loss_scale", "unskipped"}
        assert type(sd["loss_scale"]) is float and type(sd["unskipped"]) is int, (s, sd)
    assert moved.state_dict() == {"loss_scale": 65536.0, "unskipped": 1}


def test_repr_says_static_or_dynamic_and_shows_the_current_scale():
    """A scaler's repr (a log line, a debugger) says whether the scale is static or dynamic
    (a static 1.0 and a dynamic scale backed off to 1.0 differ at the next overflow) and shows
    the current scale and count, read from the device while it holds them (it showed the
    host's stale copy there)."""
    assert repr(LossScaler(128.0)) == "LossScaler(static, loss_scale=128.0, unskipped=0)"
    assert repr(LossScaler("dynamic", init_scale=1.0)) == (
        "LossScaler(dynamic, loss_scale=1.0, unskipped=0)")
    s = LossScaler("dynamic")
    s.device_state(torch.device("cpu"))
    s.update_on_device(torch.ones(()))
    assert repr(s) == "LossScaler(dynamic, on cpu, loss_scale=32768.0, unskipped=0)"
    s.update_on_device(torch.zeros(()))
    assert repr(s) == "LossScaler(dynamic, on cpu, loss_scale=32768.0, unskipped=1)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_matches_division_and_flags_inf(device, dtype):
    s = LossScaler(256.0)
    g = [torch.randn(37, device=device, dtype=dtype) * 256, torch.randn(5, 3, device=device)]
    ref = [t.double() / 256 for t in g]
    flags = unscale_grads_(g, s, check=True)
    assert not any(bool(f.item()) for f in flags)
    for t, r in zip(g, ref):
        # division by a power of two is exact
        torch.testing.assert_close(t.double(), r, rtol=0, atol=0)
    g[0][3] = float("nan")
    flags = unscale_grads_(g, s, check=True)
    assert any(bool(f.item()) for f in flags)


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_scale_sequence_within_bounds_host_and_device(on_device):
    # The dynamic policy with both bounds reached, on the host (update) and on the device
    # (update_on_device: PyTorch's update kernel, then a clamp): the same hand-computed
    # sequence of (scale, clean-step count), and 1/scale kept in step on the device.
    s = LossScaler("dynamic", scale_window=2, min_loss_scale=2.0**14, max_loss_scale=2.0**17)
    dev = s.device_state(torch.device("cpu")) if on_device else None
    flags = [True, True, True, False, False, False, False, False, False, False, False, True]
    want = [(2.0**15, 0), (2.0**14, 0), (2.0**14, 0),  # the floor holds
            (2.0**14, 1), (2.0**15, 0), (2.0**15, 1), (2.0**16, 0), (2.0**16, 1),
            (2.0**17, 0), (2.0**17, 1), (2.0**17, 0),  # the ceiling holds
            (2.0**16, 0)]
    got = []
    for flag in flags:
        if on_device:
            s.update_on_device(torch.tensor(float(flag)))
            assert float(dev.inv) == 1.0 / float(dev.scale)
        else:
            assert s.update(flag) is flag
        got.append((s.state_dict()["loss_scale"], s.state_dict()["unskipped"]))
        assert s.found_overflow is flag
    assert got == want


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("loaded, flags, want", [
    # A checkpoint saved under a higher max_loss_scale (or Apex's `_loss_scale` written by
    # hand): the first update brings the scale into [min, max], clean step or overflow.
    (2.0**16, [False, True, False], [(2.0**10, 1), (2.0**9, 0), (2.0**9, 1)]),
    (2.0**16, [True, False], [(2.0**10, 0), (2.0**10, 1)]),
    (2.0**-2, [False, True], [(2.0**3, 1), (2.0**3, 0)]),
])
def test_a_scale_set_outside_the_bounds_is_clamped_at_the_next_update(on_device, loaded,
                                                                       flags, want):
    # (The host's policy clamped only in the direction it moved: halving 2**16 stayed 16x
    # above the max, and a clean step did not clamp at all, where the device's kernels did.)
    s = LossScaler("dynamic", scale_window=1000, min_loss_scale=2.0**3,
                   max_loss_scale=2.0**10)
    s.load_state_dict({"loss_scale": loaded, "unskipped": 0})
    if on_device:
        s.device_state(torch.device("cpu"))
    assert _trace(s, flags, on_device) == want


@pytest.mark.parametrize("window, unskipped", [(4, 4), (4, 10), (1, 3), (1, 0)])
def test_a_count_at_or_past_the_window_grows_on_the_device_as_on_the_host(window, unskipped):
    # A count at or past the window (a checkpoint saved under a longer scale_window, a
    # GradScaler's growth tracker) grows the scale at the next clean step on the host.
    # PyTorch's device kernel grows only when the count *equals* the window: the device scale
    # never grew again (until an overflow) and its count kept climbing.
    got = {}
    for on_device in (False, True):
        s = LossScaler("dynamic", scale_window=window)
        s.load_state_dict({"loss_scale": 1024.0, "unskipped": unskipped})
        if on_device:
            s.device_state(torch.device("cpu"))
        got[on_device] = _trace(s, (False, False, True, False), on_device)
    assert got[True] == got[False]
    assert got[False][0] == (2048.0, 0)


def test_scale_window_below_one_is_refused():
    with pytest.raises(ValueError, match=r"scale_window=0.*>= 1"):
        LossScaler("dynamic", scale_window=0)


def test_default_floor_is_far_below_one():
    # With no min_loss_scale the floor is 2**-24: a run whose gradients keep overflowing
    # backs the scale off below 1.0 (skipping steps) instead of sticking at 1.0.
    s = LossScaler("dynamic", init_scale=2.0)
    for _ in range(4):
        assert s.update(True) is True
    assert s.loss_scale == 2.0**-3
    for _ in range(40):
        s.update(True)
    assert s.loss_scale == 2.0**-24


def test_min_equal_to_max_pins_a_dynamic_scale():
    # min_loss_scale == max_loss_scale is allowed: the scale cannot move, but overflowed
    # steps are still detected and skipped.
    s = LossScaler("dynamic", scale_window=1, min_loss_scale=2.0**10, max_loss_scale=2.0**10)
    assert s.loss_scale == 2.0**10
    assert s.update(True) is True and s.loss_scale == 2.0**10
    assert s.update(False) is False and s.loss_scale == 2.0**10


def test_a_static_scale_is_used_as_given_whatever_the_dynamic_bounds():
    """min_loss_scale and max_loss_scale bound the dynamic scale only: a static scale above
    the default ceiling (a model whose fp16 gradients are tiny) or above a ceiling passed along
    with it is used as passed, and stays there through clean and overflowed steps, as in Apex.
    Reference: the scale passed. (S01)"""
    assert LossScaler(2.0**30).loss_scale == 2.0**30
    s = LossScaler(2.0**12, min_loss_scale=1.0, max_loss_scale=2.0**10)
    assert s.loss_scale == 2.0**12
    assert s.update(False) is False and s.update(True) is False
    assert s.state_dict() == {"loss_scale": 2.0**12, "unskipped": 2}


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_scale_factor_other_than_two(on_device):
    # Back-off divides by scale_factor and growth multiplies by it, on the device as on the host.
    s = LossScaler("dynamic", scale_factor=4.0, scale_window=2)
    if on_device:
        s.device_state(torch.device("cpu"))
    got = [scale for scale, _ in _trace(s, (True, True, False, False), on_device)]
    assert got == [2.0**14, 2.0**12, 2.0**12, 2.0**14]


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -2.0])
def test_load_state_dict_refuses_a_non_finite_scale(bad):
    s = LossScaler("dynamic")
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        s.load_state_dict({"loss_scale": bad, "unskipped": 0})
    assert s.state_dict() == {"loss_scale": 2.0**16, "unskipped": 0}  # unchanged


@pytest.mark.parametrize("state", [
    {"loss_scale": True, "unskipped": 0},  # flags, refused as the constructor refuses them
    {"loss_scale": 1024.0, "unskipped": False},
    {"loss_scale": torch.empty((), device="meta"), "unskipped": 0},  # a tensor with no value
    {"loss_scale": 1024.0},
], ids=["bool-scale", "bool-count", "meta-scale", "no-count"])
def test_load_state_dict_refuses_a_malformed_state(state):
    s = LossScaler("dynamic")
    with pytest.raises(ValueError, match=r"load_state_dict: expected \{'loss_scale': float, "
                                         r"'unskipped': int\}, got"):
        s.load_state_dict(state)
    assert s.state_dict() == {"loss_scale": 2.0**16, "unskipped": 0}  # unchanged


def test_unscale_with_a_static_scale_below_one():
    # A static scale under 1.0 (allowed: any finite scale > 0) is unscaled too.
    s = LossScaler(0.25)
    g = [torch.randn(7), torch.randn(3, 2)]
    ref = [t * 4 for t in g]  # exact: a power of two
    assert unscale_grads_(g, s, check=False) is None
    for t, r in zip(g, ref):
        torch.testing.assert_close(t, r, rtol=0, atol=0)


@pytest.mark.parametrize("window, unskipped", [(4, 4), (4, 10)])
def test_set_state_with_a_count_past_the_window_grows_on_the_device_as_on_the_host(window,
                                                                                  unskipped):
    # set_state while the scale is on the device (Apex's `_unskipped` written by hand): a count
    # at or past the window grows at the next clean step, as on the host.
    got = {}
    for on_device in (False, True):
        s = LossScaler("dynamic", scale_window=window)
        if on_device:
            s.device_state(torch.device("cpu"))
        s.set_state(loss_scale=1024.0, unskipped=unskipped)
        got[on_device] = _trace(s, (False, False), on_device)
    assert got[True] == got[False] == [(2048.0, 0), (2048.0, 1)]


def test_host_update_brings_a_device_scale_back_to_the_host():
    # update() on a scaler whose scale lives on the device (device_state) applies the step
    # to the current scale and leaves it on the host.
    s = LossScaler("dynamic", scale_window=2)
    s.device_state(torch.device("cpu"))
    s.update_on_device(torch.zeros(()))  # one clean step on the device
    assert s.update(True) is True
    assert s.on_device is None
    assert s.state_dict() == {"loss_scale": 2.0**15, "unskipped": 0}
    s.update(False)
    s.update(False)
    assert s.state_dict() == {"loss_scale": 2.0**16, "unskipped": 0}


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_set_state_of_one_value_keeps_the_other(on_device):
    # set_state(loss_scale=...) keeps the clean-step count counted so far (on the device: the
    # tracker's, not the host's stale copy), and set_state(unskipped=...) the scale.
    s = LossScaler("dynamic", scale_window=4)
    if on_device:
        s.device_state(torch.device("cpu"))
    for _ in range(2):
        s.update_on_device(torch.zeros(())) if on_device else s.update(False)
    s.set_state(loss_scale=2.0**20)
    assert s.state_dict() == {"loss_scale": 2.0**20, "unskipped": 2}
    s.update_on_device(torch.ones(())) if on_device else s.update(True)
    s.set_state(unskipped=3)
    assert s.state_dict() == {"loss_scale": 2.0**19, "unskipped": 3}
    s.update_on_device(torch.zeros(())) if on_device else s.update(False)  # the 4th: growth
    assert s.state_dict() == {"loss_scale": 2.0**20, "unskipped": 0}


@pytest.mark.parametrize("kwargs", [dict(loss_scale=float("inf")), dict(init_scale=float("inf")),
                                    dict(min_loss_scale=float("inf"), max_loss_scale=float("inf"))])
def test_an_infinite_scale_is_refused(kwargs):
    # (a mutation of scaler.py: `number < math.inf` -> `<=`): a static scale of inf made every
    # gradient inf.
    with pytest.raises(ValueError, match=r"must be a finite number > 0"):
        LossScaler(**kwargs)


def test_default_ceiling_is_two_to_the_24():
    # (a mutation of scaler.py: default max_loss_scale 2.**24, as documented and as Apex's).
    s = LossScaler("dynamic", init_scale=2.0**22, scale_window=1)
    for _ in range(5):
        s.update(False)
    assert s.loss_scale == 2.0**24


def test_a_scale_factor_of_one_is_refused():
    # (a mutation of scaler.py: `1 < factor` -> `1 <=`): a factor of 1 never backs off, so a run
    # that overflows skips every step for ever.
    with pytest.raises(ValueError, match=r"scale_factor=1\): must be a finite number > 1"):
        LossScaler("dynamic", scale_factor=1)


def test_init_scale_below_the_floor_starts_at_the_floor():
    # (a mutation of scaler.py: init clamped to min_loss_scale): the first step used a scale below
    # the floor the user asked for.
    s = LossScaler("dynamic", init_scale=1.0, min_loss_scale=2.0**10, max_loss_scale=2.0**20)
    assert s.loss_scale == 2.0**10


def test_load_state_dict_refuses_a_count_of_minus_one():
    # (a mutation of scaler.py: `unskipped < 0` -> `< -1`): the boundary of the count check.
    s = LossScaler("dynamic")
    with pytest.raises(ValueError, match=r"unskipped=-1 must be an int >= 0"):
        s.load_state_dict({"loss_scale": 1024.0, "unskipped": -1})
    assert s.state_dict() == {"loss_scale": 2.0**16, "unskipped": 0}


class _WithOffset(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.offset = nn.Parameter(torch.zeros(4))


def _penalty_second(model, x, y, backward):
    # The offset enters the loss linearly: its gradient is a constant, without a graph, while
    # the weights' gradients carry one (one fp32 group, mixed requires_grad). The output is cast
    # to the target's dtype: O1's half output to fp32, the float64 reference's left as it is
    # (torch < 2.13 cannot take a create_graph backward through a float64 -> fp32 -> float64 chain).
    backward(nn.functional.mse_loss(model.net(x).to(y.dtype), y) + model.offset.sum())
    assert not model.offset.grad.requires_grad and model.net[0].weight.grad.requires_grad
    penalty = sum(p.grad.float().pow(2).sum() for p in model.parameters())
    second = torch.autograd.grad(penalty, model.net[0].weight)[0]
    model.zero_grad()
    return second


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_unscale_is_recorded_when_a_group_mixes_graph_and_constant_gradients():
    # (a mutation of scaler.py: `any(g.requires_grad ...)` -> `all(...)`): one gradient without a
    # graph in the (device, dtype) group sent the others through the fused kernel, which autograd
    # does not record: the penalty's second derivative came out loss-scale times too large.
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    ref = _WithOffset().double()
    want = _penalty_second(ref, x.double(), y.double(),
                           lambda loss: loss.backward(create_graph=True))
    model = _WithOffset()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.float16,
                                loss_scale="dynamic", verbosity=0)

    def scaled_backward(loss):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward(create_graph=True)

    got = _penalty_second(model, x, y, scaled_backward)
    assert (got.double() - want).norm() <= 0.02 * want.norm()


def test_a_backward_reaching_no_parameter_is_not_an_overflow():
    # (a mutation of scaler.py: any_flag_set([]) -> True): a backward that gives none of the
    # optimizer's parameters a gradient (a loss not depending on the model, a frozen branch) halved
    # the dynamic scale and skipped the step as if it had overflowed.
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=0)
    loss = (torch.randn(3, requires_grad=True) ** 2).sum()
    with pytest.warns(UserWarning, match="none of the optimizer's parameters"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.step()
    assert not amp.step_was_skipped(opt)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**16, "unskipped": 1}


def test_release_device_brings_the_device_scale_and_count_back():
    """Bringing a device-held scale back to the host keeps what the device kernels made of it
    (a backoff, clean steps counted): the next host step (an optimizer without a fused step on
    the same loss, a loss computed on another device) continues from there. Reference: the
    same steps taken on the host. (S05)"""
    want = LossScaler("dynamic", scale_window=3)
    for flag in (True, False, False):
        want.update(flag)
    s = LossScaler("dynamic", scale_window=3)
    s.device_state(torch.device("cpu"))
    for flag in (True, False, False):
        s.update_on_device(torch.tensor(float(flag)))
    s.release_device()
    assert s.on_device is None
    assert s.state_dict() == want.state_dict() == {"loss_scale": 2.0**15, "unskipped": 2}
    s.update(False)  # the third clean step in a row grows the scale on either side
    want.update(False)
    assert s.state_dict() == want.state_dict() == {"loss_scale": 2.0**16, "unskipped": 0}


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_unscale_survives_a_device_scale_update_before_the_second_derivative():
    """A gradient penalty computed after the step's scale update (update_on_device rewrites
    the device-held 1/scale in place) still differentiates through the unscaled gradients: the
    recorded multiply must hold its own copy of 1/scale, not the scaler's tensor, or autograd
    refuses the second backward (a tensor it saved was modified in place). Reference: the
    analytic second derivative of sum((d/dw sum(w**3))**2) = 36 w**3. (S19)"""
    s = LossScaler("dynamic")
    s.device_state(torch.device("cpu"))
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    g, = torch.autograd.grad((w**3).sum() * s.loss_scale, w, create_graph=True)
    flags = unscale_grads_([g], s, check=True)
    s.update_on_device(flags[0])
    second, = torch.autograd.grad(g.pow(2).sum(), w)
    torch.testing.assert_close(second, 36 * w.detach() ** 3, rtol=1e-6, atol=0)


def test_an_overflow_in_one_dtype_group_is_not_cleared_by_a_clean_group_with_a_graph():
    """One overflow flag per device serves every (device, dtype) group of a backward: a clean
    group unscaled after an overflowing one (here both carrying a graph, create_graph=True,
    fp32 and bf16 gradients on one device) must leave the flag set, or the overflowed step is
    taken with inf gradients. (S20)"""
    s = LossScaler("dynamic")
    w32 = torch.ones(2, requires_grad=True)
    w16 = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    g32 = w32 * torch.tensor([1.0, float("inf")])  # gradients carrying a graph
    g16 = w16 * 2.0
    flags = unscale_grads_([g32, g16], s, check=True)
    assert len(flags) == 1 and float(flags[0]) == 1.0
    flags = unscale_grads_([g16 * 1.0], s, check=True, found={torch.device("cpu"): flags[0]})
    assert float(flags[0]) == 1.0  # a flag set by an earlier pass stays set too


def test_any_flag_set_reads_every_devices_flag():
    """With gradients on several devices (one flag per device) an overflow on any of them
    skips the step: a clean first device must not hide an inf on the second. (S21)"""
    zero, one = torch.zeros(()), torch.ones(())
    assert any_flag_set([zero, one]) is True
    assert any_flag_set([one, zero, zero]) is True
    assert any_flag_set([zero, zero]) is False


def test_inv_scale_is_on_the_device_asked_for_while_another_holds_the_scale():
    """``inv_scale(device)`` gives 1/scale on ``device`` even while the dynamic scale lives on
    another device (gradients spread over devices, the scale kept with the fused optimizer's):
    the device-held tensor only for its own device. The meta device stands in for a second
    device here. Reference: the documented dtype and device, and 1/scale. (S08)"""
    s = LossScaler("dynamic")
    dev = s.device_state(torch.device("cpu"))
    assert s.inv_scale(torch.device("cpu")) is dev.inv
    other = s.inv_scale(torch.device("meta"))
    assert other.device.type == "meta" and other.dtype == torch.float32 and other.dim() == 0
    assert float(s.inv_scale(torch.device("cpu"))) == 2.0**-16


def test_large_finite_gradients_with_a_graph_are_not_an_overflow():
    """The inf/NaN check of gradients that carry a graph (backward(create_graph=True) for a
    gradient penalty) flags only an inf or NaN element. Scaled fp16 gradients are large but
    finite (here 1000 in each of 8000 elements, whose 2-norm is past fp16's range): a clean
    step, not a skipped one with a halved scale, and unscaled exactly. Reference: the float64
    division by the power-of-two scale."""
    s = LossScaler("dynamic")
    w = torch.ones(8000, dtype=torch.float16, requires_grad=True)
    g = w * 1000.0  # a gradient carrying a graph
    flags = unscale_grads_([g], s, check=True)
    assert len(flags) == 1 and float(flags[0]) == 0.0
    want = torch.full((8000,), 1000.0 / 2.0**16, dtype=torch.float64)
    torch.testing.assert_close(g.detach().double(), want, rtol=0, atol=0)
    g[7] = float("inf")  # (the check still sees a real overflow)
    assert float(unscale_grads_([g], s, check=True)[0]) == 1.0


def test_create_graph_unscale_checks_every_gradient_of_a_group():
    """With gradients that carry a graph (create_graph=True) an inf or NaN in any gradient of
    a (device, dtype) group is an overflow, wherever it stands in the group; gradients that are
    all finite are not."""
    s = LossScaler("dynamic")
    w = torch.ones(3, requires_grad=True)
    for bad in (float("inf"), float("nan")):
        grads = [w * 1.0, w * 2.0, w * torch.tensor([1.0, bad, 1.0])]
        assert float(unscale_grads_(grads, s, check=True)[0]) == 1.0, bad
    assert float(unscale_grads_([w * 1.0, w * 2.0], s, check=True)[0]) == 0.0


def test_create_graph_unscale_divides_out_a_static_scale():
    """A static loss scale other than 1 (O1 with loss_scale=128.0, fp16) is divided out of
    gradients that carry a graph (backward(create_graph=True) for a gradient penalty) as out
    of plain ones: the step and the penalty see the true gradient, and a second derivative
    through it is the true one, not 128 times too large. Reference: the analytic gradient
    3 w**2 (exact: w and the scale are powers of two or small integers) and second derivative
    36 w**3 of sum(w**3). (S02)"""
    s = LossScaler(128.0)
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    g, = torch.autograd.grad((w**3).sum() * s.loss_scale, w, create_graph=True)
    assert unscale_grads_([g], s, check=False) is None
    torch.testing.assert_close(g.detach(), 3 * w.detach() ** 2, rtol=0, atol=0)
    second, = torch.autograd.grad(g.pow(2).sum(), w)
    torch.testing.assert_close(second, 36 * w.detach() ** 3, rtol=1e-6, atol=0)


def test_numbers_too_large_for_a_float_get_the_documented_value_error():
    # An integer too large for a float (10**400) or an infinite step count in a checkpoint:
    # float() and int() raise OverflowError there, which reached the caller bare instead of
    # the ValueError each entry point documents (what was passed, what is allowed). (r70B)
    huge = 10**400
    with pytest.raises(ValueError, match=r"LossScaler\.load_state_dict: expected"):
        LossScaler().load_state_dict({"loss_scale": 1024.0, "unskipped": float("inf")})
    with pytest.raises(ValueError, match=r"LossScaler\.load_state_dict: expected"):
        LossScaler().load_state_dict({"loss_scale": huge, "unskipped": 3})
    with pytest.raises(ValueError, match=r"LossScaler\(init_scale="):
        LossScaler(init_scale=huge)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"amp\.initialize\(loss_scale=10+\): the loss scale "
                                         r"must be a finite number > 0"):
        amp.initialize(model, opt, opt_level="O1", loss_scale=huge, verbosity=0)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    with pytest.raises(ValueError, match=r"_loss_scale = 10+: expected a finite number > 0"):
        scaler._loss_scale = huge
    with pytest.raises(ValueError, match=r"LossScaler\.load_state_dict: expected"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": float("inf")}})
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 0}}
