import copy
import functools
import gc
import io
import logging
import os
import pickle
import re
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from mixprec import amp
from mixprec.amp._state import optimizer_state

from .helpers import (
    HALF_DTYPES,
    OPT_LEVELS,
    EmbeddingHead,
    backward_and_step,
    batch,
    make_cnn,
    make_mlp,
    saved_whole,
    train_step,
)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_returns_same_objects_in_given_shape():
    m1, m2 = make_cnn(), make_cnn(seed=1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    keys = list(m1.state_dict())
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    assert isinstance(models, list) and models[0] is m1 and models[1] is m2
    assert opts[0] is o1 and opts[1] is o2
    assert list(m1.state_dict()) == keys
    m3 = make_cnn()
    assert amp.initialize(m3, opt_level="O3", verbosity=0) is m3  # no optimizers: models only
    assert isinstance(m1, type(make_cnn()))  # still an instance of the user's class


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_parameter_dtypes(opt_level, dtype, device):
    model = make_cnn(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0)
    conv_w = model.features[0].weight
    bn_w = model.features[1].weight
    expect_conv = dtype if opt_level in ("O2", "O3") else torch.float32
    expect_bn = dtype if opt_level == "O3" else torch.float32
    assert conv_w.dtype == expect_conv and bn_w.dtype == expect_bn
    masters = list(amp.master_params(opt))
    assert all(p.dtype == torch.float32 for p in masters) == (opt_level != "O3")
    x, _ = batch(device)
    out = model(x)  # fp32 input: cast on entry at O2/O3
    assert out.dtype == torch.float32  # outputs cast to fp32 at every level (O1 too)


def test_o2_leaves_an_integer_parameter_to_the_optimizer_as_it_is():
    """An integer nn.Parameter (a step counter kept in the model, requires_grad=False) that
    the optimizer holds is not cast at O2, so it gets no fp32 master: the optimizer keeps the
    parameter object itself and master_params yields it as int64, because users read and
    update such counters through the model and expect the optimizer to see the same tensor.
    (E05)"""
    model = make_mlp()
    model.count = nn.Parameter(torch.tensor([3]), requires_grad=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert model.count.dtype == torch.int64
    held = [p for g in opt.param_groups for p in g["params"]]
    assert any(p is model.count for p in held)
    assert [p.dtype for p in amp.master_params(opt)].count(torch.int64) == 1
    assert any(p is model.count for p in amp.master_params(opt))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o1_loss_after_the_model_is_fp32_as_under_autocast(dtype):
    # The loss is computed after the model, outside its autocast region: from fp32 outputs it
    # is the same fp32 quantity torch.autocast gives (cross_entropy is on its fp32 list), and
    # an fp16 loss's gradient at the 2**16 starting scale no longer overflows (it did: the
    # first step was always skipped). cast_model_outputs=half keeps the half outputs.
    model = make_cnn()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=dtype, verbosity=0,
                                loss_scale="dynamic")
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y)
    with torch.autocast("cpu", dtype=dtype):
        want = nn.functional.cross_entropy(ref(x), y)
    assert loss.dtype == torch.float32 and want.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert not amp.step_was_skipped(opt)
    half = make_cnn()
    amp.initialize(half, opt_level="O1", dtype=dtype, cast_model_outputs=dtype, verbosity=0)
    assert half(x).dtype == dtype

    class TwoOutputs(nn.Module):  # only autocast's half results are cast: float64 stays
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return {"half": self.lin(x), "double": x.double().sum(), "ids": x.argmax(1)}

    out = amp.initialize(TwoOutputs(), opt_level="O1", dtype=dtype, verbosity=0)(
        torch.randn(2, 4))
    assert (out["half"].dtype, out["double"].dtype, out["ids"].dtype) == (
        torch.float32, torch.float64, torch.int64)


def test_cast_model_outputs():
    model = make_cnn()
    amp.initialize(model, opt_level="O2", cast_model_outputs=torch.float16, verbosity=0)
    assert model(batch()[0]).dtype == torch.float16


def test_enabled_false_is_noop():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = copy.deepcopy(model)
    model, opt = amp.initialize(model, opt, opt_level="O2", enabled=False)
    assert type(model) is type(ref) and model.features[0].weight.dtype == torch.float32
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
        scaled.backward()
    # Disabled, scale_loss passes any loss through untouched, as Apex did (no checks).
    per_sample = nn.functional.cross_entropy(model(x), y, reduction="none")
    with amp.scale_loss(per_sample, opt) as scaled:
        assert scaled is per_sample


def test_master_params_of_a_disabled_call_are_the_params_after_a_new_group():
    """With amp disabled (enabled=False) master_params is the optimizer's own parameters, the
    groups added after initialize included, in their fp32 as they are: clipping code written
    for amp runs unchanged in the disabled run. (F92)"""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", enabled=False)
    opt.add_param_group({"params": list(model[1].parameters())})
    got = list(amp.master_params(opt))
    want = list(model.parameters())
    assert len(got) == len(want) and all(p is q for p, q in zip(got, want))
    assert all(p.dtype == torch.float32 for p in got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_enabled_false_passes_a_loss_of_any_dtype_through_as_it_is(dtype):
    """Disabled amp (enabled=False, a flag to compare runs with and without it) hands the very
    loss object to the block, whatever its dtype: a bf16, fp16 or float64 loss is not copied
    to fp32, so the disabled run is the plain run. (F50)"""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", enabled=False)
    loss = model(torch.randn(3, 4)).square().mean().to(dtype)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss and scaled.dtype == dtype
        scaled.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for p in model.parameters())


@pytest.mark.parametrize("enabled,expected", [("False", torch.float32), ("True", torch.float16),
                                              (0, torch.float32),
                                              (np.bool_(False), torch.float32)])
def test_enabled_takes_apexs_strings_as_its_properties_do(enabled, expected):
    # A config or argparse string: "False" was truthy and turned amp on (the weights half),
    # while keep_batchnorm_fp32="False" in the same call read as False.
    model = make_cnn()
    amp.initialize(model, opt_level="O2", enabled=enabled, verbosity=0)
    assert model.features[0].weight.dtype == expected


@pytest.mark.parametrize("enabled", ["false", "no", "", b"False"])
def test_enabled_other_values_are_refused(enabled):
    model = make_cnn()
    with pytest.raises(TypeError, match=rf"amp\.initialize\(enabled={re.escape(repr(enabled))}"
                       r'\): expected True or False \(or the strings "True"/"False"\)'):
        amp.initialize(model, opt_level="O2", enabled=enabled, verbosity=0)
    assert model.features[0].weight.dtype == torch.float32


@pytest.mark.parametrize("given", ["O2", "02", " o2 ", "o1"])
def test_an_opt_level_passed_as_the_optimizer_is_named(given):
    # Also in the spellings users type: zero for the letter O, lower case, stray spaces.
    hint = re.escape(f"It looks like an opt level: pass it by name, amp.initialize(model, "
                     f"optimizer, opt_level={given!r})")
    with pytest.raises(TypeError, match=re.escape(f"optimizers={given!r})") + ".*" + hint):
        amp.initialize(make_cnn(), given)


def test_initialize_twice_for_other_models_is_independent(monkeypatch):
    from mixprec.amp import frontend

    monkeypatch.setattr(frontend, "_WARNED_SEVERAL_CALLS", [False])
    a, b = make_cnn(), make_cnn()
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize(a, oa, opt_level="O2", loss_scale=128.0, verbosity=0)
    amp.initialize(b, ob, opt_level="O1", loss_scale=8.0, verbosity=0)
    assert optimizer_state(oa).amp_state.scalers[0].loss_scale == 128.0
    assert optimizer_state(ob).amp_state.scalers[0].loss_scale == 8.0
    x, y = batch()
    train_step(a, oa, x, y, amp)  # a's state is still found through its optimizer
    # (Module-level state_dict() saves the latest call's, and says that a's, training beside
    # it, is not in it.)
    with pytest.warns(UserWarning, match="acts on the most recent call's only"):
        assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}}


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_deepcopy_and_pickle(opt_level):
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    x, y = batch()
    train_step(model, opt, x, y, amp)
    model.eval()
    ref = model(x)
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(x), ref, rtol=0, atol=0)
    loaded = saved_whole(model)
    torch.testing.assert_close(loaded(x), ref, rtol=0, atol=0)
    assert pickle.loads(pickle.dumps(model)).state_dict().keys() == model.state_dict().keys()


def test_restore_model_undoes_the_swap():
    model = make_cnn()
    cls = type(model)
    amp.initialize(model, opt_level="O1", verbosity=0)
    assert amp.is_amp_model(model) and type(model) is not cls
    amp.restore_model(model)
    assert type(model) is cls and not amp.is_amp_model(model)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.hidden_dtype = None

    def forward(self, x, scale=1.0):
        h = self.fc1(x)
        self.hidden_dtype = h.dtype
        return self.fc2(torch.relu(h)) * scale


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_forward_set_on_the_instance_before_initialize_runs_inside_amps_casts(opt_level):
    # model.forward = functools.partial(model.forward, ...) (or a library's output wrapper)
    # before initialize hid the class's forward that amp wraps: O1 ran silently in fp32, O2/O3
    # failed on a dtype mismatch. amp now runs the instance's forward inside its casts.
    import functools

    model = _Scaled()
    model.forward = functools.partial(model.forward, scale=2.0)
    reference = _Scaled()
    amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    amp.initialize(reference, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 4)
    out = model(x)
    assert model.hidden_dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x, scale=2.0), rtol=0, atol=0)
    # Copies re-bind the wrapper to their own (amp's) forward: still one set of casts.
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        torch.testing.assert_close(clone(x), out, rtol=0, atol=0)
        assert clone.hidden_dtype == torch.bfloat16
    amp.restore_model(model)
    assert type(model) is _Scaled and isinstance(model.__dict__["forward"], functools.partial)


def test_restore_and_initialize_again_keeps_one_set_of_hooks():
    # Each restore_model + initialize cycle (trials over one model) added a state-dict
    # pre-hook and a load pre-hook; the checkpoint still holds the newest call's masters.
    from mixprec.amp._state import SyncParamGroupsOnLoad

    def ours(table):
        return sum(isinstance(getattr(h, "hook", h), SyncParamGroupsOnLoad)
                   for h in table.values())

    model = make_cnn()
    for trial in range(3):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        train_step(model, opt, *batch(seed=trial), amp)
        assert (ours(model._load_state_dict_pre_hooks), ours(model._state_dict_pre_hooks)) \
            == (1, 1)
        state = model.state_dict()  # (the newest call's masters)
        assert torch.equal(state["features.0.weight"], next(amp.master_params(opt)))
        amp.restore_model(model).float()


def test_new_instances_of_an_amp_class_run_the_users_forward():
    # nn.Sequential's slicing builds self.__class__(...): amp's class, which amp did not
    # prepare; calling it failed (AttributeError '_mixprec_forward') at every opt level. It is
    # a plain part of the model now, as a slice of a .bfloat16() model is.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    features = model[:-1]
    assert isinstance(features, nn.Sequential) and not amp.is_amp_model(features)
    x = torch.randn(3, 4)
    want = torch.relu(model[0](x.bfloat16()))
    torch.testing.assert_close(features(x.bfloat16()), want, rtol=0, atol=0)
    assert len(type(model)()) == 0 and torch.equal(type(model)()(x), x)
    assert type(amp.restore_model(features)) is nn.Sequential


# -- bad input ---------------------------------------------------------------------------------
def test_rejects_data_parallel_wrapped_model():
    # The message names the wrapper and shows the order that works (initialize the bare
    # model, then wrap the returned one), so the script can be fixed from it alone.
    model = nn.DataParallel(make_cnn())
    with pytest.raises(ValueError, match=r"models=DataParallel\(\.\.\.\)\): the model is already "
                                         r"wrapped.*amp.initialize on the bare model.*"
                                         r"`model, opt = amp\.initialize\(model, opt, \.\.\.\); "
                                         r"model = DistributedDataParallel\(model\)`"):
        amp.initialize(model, opt_level="O1")


def test_the_already_half_warning_points_at_the_callers_line():
    """The warning about a model made half before initialize names the user's own call
    (the file and line of amp.initialize in their script), not a line inside mixprec, so that
    the user can find which initialize it is about. (F18)"""
    model = make_cnn().half()
    with pytest.warns(UserWarning, match="already torch.float16") as record:
        amp.initialize(model, opt_level="O2", verbosity=0)
    ours = [w for w in record if "already torch.float16" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].filename == __file__, ours[0].filename


def test_the_already_half_warning_of_a_shipped_o2_model_points_at_its_fp32_weights():
    # A model shipped whole (torch.save of an O2 model), restored and given to initialize
    # again for fine-tuning: the masters would start from its rounded half values, while the
    # model's own state_dict() still holds the fp32 weights. The warning says so, and the
    # route it names (load that state dict into a model built in fp32) gives exact masters.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    train_step(model, opt, *batch(), amp)
    want = model.state_dict()
    shipped = amp.restore_model(saved_whole(model))
    with pytest.warns(UserWarning, match=r"already torch\.bfloat16.*still holds its fp32 "
                                         r"weights: load its state_dict\(\) into the model "
                                         r"built in fp32"):
        again = copy.deepcopy(shipped)
        amp.initialize(again, torch.optim.SGD(again.parameters(), lr=0.1), opt_level="O2",
                       dtype=torch.bfloat16, verbosity=0)
    fresh = make_cnn(seed=1)
    fresh.load_state_dict(shipped.state_dict())
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh, opt2 = amp.initialize(fresh, opt2, opt_level="O2", dtype=torch.bfloat16,
                                     verbosity=0)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    # Without the copy's masters (a model made half by hand) the warning stays as it was.
    with pytest.warns(UserWarning) as record:
        amp.initialize(make_cnn().half(), opt_level="O2", verbosity=0)
    assert not any("still holds" in str(w.message) for w in record)


def test_the_already_half_warning_of_the_same_model_restored_does_not_call_it_a_copy():
    # r83A R3. The model itself, trained at O2, its optimizer deleted, restored with
    # amp.restore_model and given to initialize again: the warning called it "a copy of an
    # amp O2 model". It names the case as it is, and points at the fp32 weights as before.
    import gc

    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    train_step(model, opt, *batch(), amp)
    del opt
    gc.collect()
    amp.restore_model(model)
    with pytest.warns(UserWarning, match=r"prepared at O2 before \(restored, or a copy of such "
                                         r"a model\), still holds its fp32 weights") as record:
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                       dtype=torch.bfloat16, verbosity=0)
    assert not any("a copy of an amp O2 model" in str(w.message) for w in record)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o1_warns_about_a_model_made_half_before_initialize(dtype):
    """O1 keeps the parameters as they are given and casts per op: a model .half()-ed before
    initialize (a ported script's leftover line) would train at O1 as pure half, without fp32
    weights, and save half checkpoints, while initialize's summary says "parameters fp32"
    (the same model converted after initialize is refused for that reason). initialize
    warns, as at O2, so that the user passes the fp32 model. O3 (pure half) takes a half
    model as it is: no warning there. (r68C's replay found O1 silent.)"""
    model = make_cnn().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=rf"already {dtype}.*pass the fp32 model, or O1, "
                                         r"which keeps the parameters as they are given, "
                                         r"trains them in half precision"):
        amp.initialize(model, opt, opt_level="O1", dtype=dtype, verbosity=0)
    for with_optimizer in (True, False):
        model = make_cnn().to(dtype)
        opts = [torch.optim.SGD(model.parameters(), lr=0.1)] if with_optimizer else []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            amp.initialize(model, opts, opt_level="O3", dtype=dtype, verbosity=0)


def _fused_adam(ps, **kw):
    from mixprec.optimizers import FusedAdam

    return FusedAdam(ps, lr=1e-3, **kw)


_ADAPTIVE = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "Adam-eps1e-4": lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-4),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "FusedAdam": _fused_adam,
    "FusedAdam-eps1e-4": lambda ps: _fused_adam(ps, eps=1e-4),
}


@pytest.mark.parametrize("name", sorted(_ADAPTIVE))
@pytest.mark.parametrize("opt_level, kw", [("O3", {}), ("O2", dict(master_weights=False))],
                         ids=["O3", "O2-no-masters"])
def test_fp16_without_masters_warns_that_an_adaptive_optimizers_fp16_state_diverges(
        name, opt_level, kw):
    """O3 in fp16 steps the fp16 parameters with fp16 optimizer state: Adam's second moment
    underflows to 0 for small gradients, and where the update is computed in fp16 eps=1e-8 is
    0 too, so the first step writes inf/NaN weights; a fused kernel (fp32 arithmetic) makes
    updates far too large instead (r94B B2). initialize says so at the user's line, naming the
    optimizer, its eps as fp16 holds it (unfused) and the level that trains."""
    model = make_cnn()
    opt = _ADAPTIVE[name](model.parameters())
    eps = opt.param_groups[0]["eps"]
    with pytest.warns(UserWarning, match="steps float16 parameters with float16 state") as rec:
        amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **kw)
    ours = [w for w in rec if "float16 state" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__, [str(w.message) for w in rec]
    text = str(ours[0].message)
    as_fp16 = float(torch.tensor(eps, dtype=torch.float16))
    assert f"amp.initialize(opt_level='{opt_level}'): {type(opt).__name__} " in text
    fused = name in ("AdamW-fused", "FusedAdam", "FusedAdam-eps1e-4")
    # The consequence said: inf/NaN where eps rounds to 0 in fp16 (unfused), a climbing loss
    # (fused, eps under 1e-4), larger steps than Adam's where eps keeps it finite (r105C B2).
    said = {"zero": f"eps={eps!r} is 0.0 in float16, so where the estimate underflowed the "
                    "update divides by zero: inf/NaN weights",
            "climbs": "(a fused kernel), the update divided by its square root comes out far "
                      "too large: the loss climbs",
            "finite": f"eps={eps!r} keeps the update finite, but where the estimate "
                      "underflowed the update is the first moment over eps alone: larger steps"}
    want = ("climbs" if fused and eps < 1e-4 else "zero" if as_fp16 == 0.0 and not fused
            else "finite")
    assert [k for k, v in said.items() if v in text] == [want], text
    assert name.endswith("eps1e-4") == (want == "finite")
    if name in ("RMSprop", "Adagrad"):
        assert "for small gradients. " in text  # (no betas: no threshold named)
    else:
        assert "gradients below ~0.005 at beta2=0.999)" in text, text
    assert "use opt_level='O2' (fp32 master weights, in float16 or bfloat16)" in text


@pytest.mark.parametrize("beta2, below", [(0.99, "0.002"), (0.95, "0.0008"), (0.9999, "0.02")])
def test_the_fp16_state_warning_names_the_underflow_of_the_groups_own_beta2(beta2, below):
    """The gradient under which (1 - beta2) * grad**2 rounds to 0 in fp16 (below 2**-25) is
    worked out from the group's beta2: sqrt(2**-25 / (1 - beta2)), one significant digit
    (1.73e-3, 7.7e-4, 1.73e-2 for the three);
    an eps under 1e-4 that fp16 holds gives steps far larger than Adam's, not inf/NaN."""
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), betas=(0.9, beta2), eps=1e-6)
    with pytest.warns(UserWarning, match="float16 state") as rec:
        amp.initialize(model, opt, opt_level="O3", verbosity=0)
    text = next(str(w.message) for w in rec if "float16 state" in str(w.message))
    assert f"gradients below ~{below} at beta2={beta2:g})" in text, text
    assert "eps=1e-06 keeps the update finite" in text and "steps far larger" in text, text


def test_the_fp16_state_warning_names_no_threshold_for_three_betas():
    """An optimizer with three betas (Adan's (0.98, 0.92, 0.99), whose second moment decays
    with the last): which beta is Adam's beta2 cannot be told, so no threshold is named (it
    named one for betas[1], 0.92 here); the warning itself stays."""
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    opt.param_groups[0]["betas"] = (0.98, 0.92, 0.99)
    with pytest.warns(UserWarning, match="float16 state") as rec:
        amp.initialize(model, opt, opt_level="O3", verbosity=0)
    text = next(str(w.message) for w in rec if "float16 state" in str(w.message))
    assert "underflows to 0 in float16 for small gradients. " in text, text
    assert "beta2=" not in text, text


def test_the_fp16_state_warning_takes_one_beta_set_after_construction():
    """betas=(0.9,) set on a group after construction (torch checks them only there): no
    threshold named, and no IndexError out of amp.initialize (r107B G4)."""
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    opt.param_groups[0]["betas"] = (0.9,)
    with pytest.warns(UserWarning, match="float16 state") as rec:
        amp.initialize(model, opt, opt_level="O3", verbosity=0)
    text = next(str(w.message) for w in rec if "float16 state" in str(w.message))
    assert "gradients below" not in text and "for small gradients. " in text, text


def test_the_fp16_state_warning_takes_a_beta2_of_one_set_after_construction():
    """A group's betas set after construction (torch checks them only there) to beta2=1.0:
    no threshold to name (1 - beta2 is 0), and no ZeroDivisionError out of initialize."""
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters())
    opt.param_groups[0]["betas"] = (0.9, 1.0)
    with pytest.warns(UserWarning, match="float16 state") as rec:
        amp.initialize(model, opt, opt_level="O3", verbosity=0)
    text = next(str(w.message) for w in rec if "float16 state" in str(w.message))
    assert "gradients below" not in text and "for small gradients. " in text, text


@pytest.mark.parametrize("case", ["bf16", "O2", "SGD", "only-fp32-batchnorm", "O1", pytest.param(
    "Adafactor", marks=pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"),
                                          reason="torch.optim.Adafactor is new in torch 2.5"))])
def test_no_fp16_state_warning_where_the_optimizer_state_is_not_fp16(case):
    """No warning where the optimizer does not keep fp16 state for an adaptive update: bf16
    (fp32's range), O2 (fp32 masters), O1 (fp32 parameters), SGD (no eps), O3 with
    keep_batchnorm_fp32=True whose Adam holds only the fp32 BatchNorm parameters; and no error
    for an eps that is no number (Adafactor's pair, (None, 1e-3)). (r96D S1)"""
    model = make_cnn()
    kw = dict(opt_level="O3", verbosity=0)
    params = model.parameters()
    make = torch.optim.AdamW
    if case == "bf16":
        kw["dtype"] = torch.bfloat16
    elif case in ("O2", "O1"):
        kw["opt_level"] = case
    elif case == "SGD":
        make = functools.partial(torch.optim.SGD, momentum=0.9)
    elif case == "Adafactor":
        make = torch.optim.Adafactor
    else:
        kw["keep_batchnorm_fp32"] = True
        params = [p for m in model.modules() if isinstance(m, nn.BatchNorm2d)
                  for p in m.parameters()]
        assert params
    opt = make(params, lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.initialize(model, opt, **kw)


@pytest.mark.parametrize("split", ["two_optimizers", "two_groups"])
def test_the_fp16_state_warning_comes_once_per_initialize(split):
    """One warning per initialize call, however many adaptive optimizers or groups step fp16
    state: it names the first; a second says nothing new. (r96D S2, S3)"""
    model = make_mlp()
    first, second = model[0].parameters(), model[2].parameters()
    opts = ([torch.optim.AdamW(first), torch.optim.Adam(second)] if split == "two_optimizers"
            else torch.optim.AdamW([{"params": first}, {"params": second, "eps": 1e-4}]))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        amp.initialize(model, opts, opt_level="O3", verbosity=0)
    ours = [str(w.message) for w in rec if "float16 state" in str(w.message)]
    assert len(ours) == 1 and "): AdamW " in ours[0], ours


def test_the_fp16_state_warning_tells_the_truth():
    """What the warning above says, on a small MLP with small gradients: one AdamW step at O3
    fp16 leaves non-finite weights, while O2 fp16's saved fp32 weights match the float64 step
    (1e-5; the step moves each weight by lr=1e-3) and O3 bf16 stays finite within bf16's
    rounding of the weights (4e-3)."""
    def run(dtype, **kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        if dtype is torch.float64:
            model.double()
            x = x.double()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, opt = amp.initialize(model, opt, dtype=dtype, verbosity=0, **kw)
        loss = model(x).float().pow(2).mean()
        backward_and_step(loss, opt, amp, dtype is not torch.float64)
        return {k: v.double() for k, v in model.state_dict().items()}

    want = run(torch.float64)
    assert all(torch.isfinite(v).all() for v in want.values())
    assert not all(torch.isfinite(v).all() for v in run(torch.float16, opt_level="O3").values())
    for dtype, level, atol in ((torch.float16, "O2", 1e-5), (torch.bfloat16, "O3", 4e-3)):
        got = run(dtype, opt_level=level)
        for k, v in got.items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=atol, msg=f"{dtype} {level} {k}")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="requires CUDA"))])
@pytest.mark.parametrize("optimizer", ["AdamW(fused=True)", "FusedAdam"])
def test_the_fused_fp16_state_warning_tells_the_truth(device, optimizer):
    """The fused variant of the warning: AdamW(fused=True) and mixprec's FusedAdam compute in
    fp32 from their fp16 state, so no NaN, but the second moment stored in fp16 underflows and
    20 steps at O3 fp16 on the small MLP drive the loss up by more than 10x, where O2 fp16
    (fp32 masters and state) brings it down; on CPU and with CUDA's fused kernels alike."""
    from mixprec.optimizers import FusedAdam

    def losses(opt_level):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
               if optimizer == "AdamW(fused=True)" else
               FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale=1.0,
                                        verbosity=0)
        out = []
        for step in range(20):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(device)
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            backward_and_step(loss, opt, amp)
            out.append(loss.item())
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return out

    o3, o2 = losses("O3"), losses("O2")
    assert o3[0] == pytest.approx(o2[0], rel=1e-2)
    assert o3[-1] > 10 * o3[0], o3
    assert o2[-1] < o2[0], o2


def test_rejects_a_model_inside_a_non_torch_distributed_data_parallel():
    """A model already inside a data-parallel wrapper that is not torch's DDP class but carries
    its name (Apex's apex.parallel.DistributedDataParallel, which migrating scripts still wrap
    with before initialize) is refused as torch's is: amp's casts must run on the bare model
    before the wrapper takes its parameters. (F06)"""

    class DistributedDataParallel(nn.Module):  # (Apex's wrapper: a plain nn.Module)
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args):
            return self.module(*args)

    model = make_mlp()
    wrapped = DistributedDataParallel(model)
    with pytest.raises(ValueError, match=r"models=DistributedDataParallel\(\.\.\.\)\): the "
                                         r"model is already wrapped for data parallelism"):
        amp.initialize(wrapped, opt_level="O1", verbosity=0)
    assert not amp.is_amp_model(model)


def test_tuples_of_models_and_optimizers_come_back_as_the_same_tuples():
    """amp.initialize takes tuples as it takes lists (``models, opts = amp.initialize((m1, m2),
    (o1, o2))`` is common in ported scripts) and returns each in the shape it was given: the
    very tuple objects, holding the same, prepared, models and optimizers. (F01)"""
    from mixprec.amp._state import optimizer_state

    m1, m2 = make_mlp(), make_mlp(seed=1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    models, opts = (m1, m2), (o1, o2)
    got_models, got_opts = amp.initialize(models, opts, opt_level="O2", dtype=torch.bfloat16,
                                          verbosity=0)
    assert got_models is models and got_opts is opts
    assert amp.is_amp_model(m1) and amp.is_amp_model(m2)
    assert optimizer_state(o1) is not None and optimizer_state(o2) is not None
    assert m1[0].weight.dtype == torch.bfloat16 and m2[0].weight.dtype == torch.bfloat16


def test_rejects_same_optimizer_twice():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match="already went through amp.initialize"):
        amp.initialize(make_cnn(), opt, opt_level="O1")


def test_o3_lets_two_optimizers_share_a_parameter():
    """Two optimizers holding one parameter are refused only where each would keep an fp32
    master of its own (O2). O3 makes no masters: both step the one half parameter, as two
    optimizers of a plain half model do, so initialize accepts them and both hold the model's
    own (half) parameter. (E28)"""
    model = make_mlp()
    params = list(model.parameters())
    opt_all = torch.optim.SGD(params, lr=0.1)
    opt_first = torch.optim.SGD(params[:1], lr=0.1)
    amp.initialize(model, [opt_all, opt_first], opt_level="O3", dtype=torch.bfloat16,
                   verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16
    assert opt_first.param_groups[0]["params"][0] is model[0].weight
    assert opt_all.param_groups[0]["params"][0] is model[0].weight


def test_a_disabled_call_refuses_an_optimizer_an_enabled_call_prepared():
    """An optimizer that an enabled initialize prepared cannot go through a second,
    disabled call (a script that calls initialize again with enabled=False to switch amp
    off): the refusal is the same ValueError, and the optimizer keeps the first call's
    loss scale, because the model is still the first call's half model and a disabled state
    would let scaled gradients reach it unscaled. (E20)"""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, loss_scale=64.0,
                   verbosity=0)
    state = optimizer_state(opt)
    with pytest.raises(ValueError, match=r"the optimizer SGD already went through "
                                         r"amp\.initialize"):
        amp.initialize(make_cnn(), opt, enabled=False, verbosity=0)
    # The same model and optimizer again at another level (a notebook cell run again): the
    # optimizer's refusal comes first and says what to do for another opt level (r104B R3).
    with pytest.raises(ValueError, match=r"already went through amp\.initialize\..* To try "
                                         r"another opt level or dtype .* build a new model "
                                         r"and optimizer"):
        amp.initialize(model, opt, opt_level="O1", verbosity=0)
    assert optimizer_state(opt) is state and state.amp_state.enabled
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        torch.testing.assert_close(scaled, loss.float() * 64.0, rtol=0, atol=0)
        scaled.backward()
    assert all(m.grad is not None and m.grad.dtype == torch.float32
               for m in amp.master_params(opt))


def test_rejects_the_same_optimizer_or_model_twice_in_one_call():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="same SGD appears twice"):
        amp.initialize(model, [opt, opt], opt_level="O2")
    with pytest.raises(ValueError, match="same SmallCNN appears twice"):
        amp.initialize([model, model], opt_level="O1")
    assert optimizer_state(opt) is None and not amp.is_amp_model(model)  # nothing half-done


def test_fp32_batchnorm_parameters_may_sit_in_two_optimizers_at_o2():
    """Only parameters that get fp32 masters must be in one optimizer: O2 keeps BatchNorm in
    fp32 without masters, so its parameters in a second optimizer (a separate schedule for the
    normalization layers) are stepped in place as in plain PyTorch and accepted, while a cast
    weight in two optimizers is still refused. (F88)"""
    model = make_cnn()
    bn = model.features[1]
    opt_all = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_bn = torch.optim.SGD(bn.parameters(), lr=0.01)
    amp.initialize(model, [opt_all, opt_bn], opt_level="O2", verbosity=0)
    assert bn.weight.dtype == torch.float32
    assert model.features[0].weight.dtype == torch.float16
    other = make_cnn(seed=1)
    with pytest.raises(ValueError, match=r"the parameter 'features\.0\.weight' is in two "
                                         r"optimizers \(SGD and SGD\)"):
        amp.initialize(other, [torch.optim.SGD(other.parameters(), lr=0.1),
                               torch.optim.SGD(other.features[0].parameters(), lr=0.1)],
                       opt_level="O2", verbosity=0)


def test_import_does_not_load_the_compiler():
    # Dynamo takes over a second to import: mixprec must not pull it in (every DDP worker
    # imports mixprec).
    code = "import sys, mixprec, mixprec.amp; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONPATH=_ROOT))
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_rejects_a_model_compiled_before_initialize():
    model = torch.compile(make_cnn())
    with pytest.raises(ValueError, match=r"compiled with torch.compile before amp.initialize.*"
                                         r"then compile the returned one"):
        amp.initialize(model, opt_level="O2")


def test_o2_with_fp32_cast_model_type_names_the_preset_not_the_user():
    with pytest.raises(ValueError, match=r'cast_model_type=torch.float32\): O2 keeps fp32 '
                                         r"master weights.*pass master_weights=False too"):
        amp.initialize(make_cnn(), opt_level="O2", cast_model_type=torch.float32)
    model = make_cnn()
    amp.initialize(model, opt_level="O2", cast_model_type=torch.float32, master_weights=False,
                   verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_o0_casts_inputs_and_outputs_to_fp32():
    # Apex's O0: a float64 batch (NumPy's default) reaches the fp32 model as fp32.
    model = make_cnn()
    amp.initialize(model, opt_level="O0", verbosity=0)
    x, _ = batch()
    out = model(x.double())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o2_casts_a_float_timestep_input_to_half_and_leaves_an_integer_one(dtype):
    # A diffusion UNet's forward(x, t): O2 casts every floating input to half, so a timestep
    # passed as float arrives rounded (bf16 holds integers exactly only up to 256: 999 -> 1000),
    # and its sinusoidal embedding moves by O(1); an integer timestep arrives untouched.
    seen = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, t):
            seen.append(t)
            return self.lin(x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
    t = torch.tensor([999, 997, 301, 5])
    model(torch.randn(4, 4), t)
    model(torch.randn(4, 4), t=t.float())
    assert seen[0].dtype == torch.int64 and torch.equal(seen[0], t)
    assert seen[1].dtype == dtype
    assert torch.equal(seen[1], t.float().to(dtype))
    if dtype == torch.bfloat16:
        assert seen[1][0].item() == 1000.0


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_o0_with_patch_torch_functions_casts_per_op(dtype):
    model = make_cnn()
    seen = []
    model.head.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    amp.initialize(model, opt_level="O0", patch_torch_functions=True, dtype=dtype, verbosity=0)
    out = model(batch()[0])
    assert seen == [dtype]  # the linear layer ran in half under per-op casting
    assert out.dtype == torch.float32 and all(p.dtype == torch.float32
                                              for p in model.parameters())


class _Unpicklable(nn.Module):
    """A model that drops a member pickle cannot handle (a lock), as users' models do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lock = __import__("threading").Lock()

    def forward(self, x):
        return self.lin(x)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("lock")
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.lock = __import__("threading").Lock()


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_pickling_honours_the_models_own_getstate(opt_level):
    model = _Unpicklable()
    amp.initialize(model, opt_level=opt_level, verbosity=0)
    x = torch.randn(2, 4)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert amp.is_amp_model(clone) and clone.lock is not model.lock
        torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
def test_recasting_an_amp_model_is_refused_before_it_changes(opt_level):
    # model.float() after O2 used to fail later, in the forward, with "Input type
    # (c10::BFloat16) and bias type (float) should be the same" from inside the model.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    before = {k: (v.dtype, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    other = torch.float16 if opt_level == "O0" else torch.float32
    for convert in (lambda m: m.double(), lambda m: m.to(other), lambda m: m.type(other)):
        with pytest.raises(RuntimeError, match=r"converting a model prepared by amp\.initialize "
                                               r"from .* to .*casts floating inputs to .*"
                                               r"load model\.state_dict\(\)"):
            convert(model)
    for k, v in model.state_dict(keep_vars=True).items():
        assert v.dtype == before[k][0] and torch.equal(v, before[k][1]), k
    # Device moves, memory formats and the forward's own dtype still go through (at O2 not
    # the latter: it would cast the BatchNorm layers amp keeps fp32).
    x, y = batch()
    model.to("cpu").to(memory_format=torch.channels_last).train()
    if opt_level == "O2":
        with pytest.raises(RuntimeError, match="BatchNorm layers amp keeps in fp32"):
            model.to(torch.bfloat16)
    else:
        model.to(torch.float32 if opt_level == "O0" else torch.bfloat16)
    train_step(model, opt, x, y, amp)
    # restore_model lifts it, as the message says.
    amp.restore_model(model).double()
    assert model.head.weight.dtype == torch.float64


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_for_deployment_is_refused_with_the_routes_that_work(dtype):
    # A user shipping an O2 model calls model.half() (or .bfloat16()) to make it all half,
    # BatchNorm too; the refusal must name the routes that work, and following either gives
    # an all-half model whose eval output matches the amp model's to half precision, while
    # the amp model is left as it was.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
    x, y = batch()
    train_step(model, opt, x, y, amp)
    with pytest.raises(RuntimeError, match=r"amp\.restore_model\(copy\.deepcopy\(model\)\)"
                                           r"\.half\(\), or a new model loaded from "
                                           r"model\.state_dict\(\)"):
        model.to(dtype)
    model.eval()
    with torch.no_grad():
        want = model(x)
    copied = amp.restore_model(copy.deepcopy(model)).to(dtype)
    loaded = make_cnn()
    loaded.load_state_dict(model.state_dict())
    loaded = loaded.to(dtype).eval()
    tol = 2e-2 if dtype == torch.float16 else 1e-1
    for deployed in (copied, loaded):
        tensors = [*deployed.parameters(), *deployed.buffers()]
        assert {t.dtype for t in tensors if t.is_floating_point()} == {dtype}
        with torch.no_grad():
            got = deployed(x.to(dtype))
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert model.features[1].weight.dtype == torch.float32  # (the amp model's BatchNorm)
    train_step(model.train(), opt, x, y, amp)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_a_layer_cast_to_half_after_initialize_is_refused_before_it_trains(opt_level, dtype):
    """The old hand-made workaround for frozen BatchNorm under Apex, ``model.apply(fix_bn)``
    casting each BatchNorm layer to half, left in a ported script after ``initialize``: at O1
    those layers would train in half with no fp32 weights and be saved half, at O2 the
    BatchNorm layers amp keeps fp32 (stepped without masters) would be stepped in half. The
    whole model's conversion is refused where it is made; a layer's is refused at the end of
    the first scale_loss block after initialize (or, at O1, after an add_param_group: a
    fine-tuning phase that unfreezes the backbone), before anything is stepped, naming its
    parameters and the way out (drop the cast). A layer made half while frozen (a memory
    saving at O1) trains nothing and is left alone. (r70C F2: accepted silently.)"""
    x, y = batch()

    def fix_bn(module):
        if isinstance(module, nn.BatchNorm2d):
            module.to(dtype)

    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0)
    model.apply(fix_bn)
    stepped = [p.detach().clone() for p in amp.master_params(opt)]
    with pytest.raises(RuntimeError, match=(
            rf"^amp: features\.1\.weight, features\.1\.bias, features\.4\.weight, "
            rf"features\.4\.bias are {dtype} now, but amp\.initialize left them fp32 .*"
            r"not needed: drop the cast")):
        train_step(model, opt, x, y, amp)
    for before, after in zip(stepped, amp.master_params(opt)):
        assert torch.equal(before, after)
    if opt_level == "O2":
        return
    model = make_cnn()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(model, opt, opt_level="O1", dtype=dtype, verbosity=0)
    # (The backbone's gradients no optimizer holds yet: scaled in fp16, which amp warns of.)
    with (pytest.warns(UserWarning, match=r"8 parameter\(s\) of the model got gradients in "
                                          r"this backward that no optimizer")
          if dtype == torch.float16 else warnings.catch_warnings()):
        train_step(model, opt, x, y, amp)  # (the head alone: checked, nothing half)
    model.features[4].to(dtype)
    opt.add_param_group({"params": list(model.features.parameters()), "lr": 0.01})
    with pytest.raises(RuntimeError, match=r"^amp: features\.4\.weight, features\.4\.bias "):
        train_step(model, opt, x, y, amp)
    frozen = make_cnn()
    opt = torch.optim.SGD(frozen.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(frozen, opt, opt_level="O1", dtype=dtype, verbosity=0)
    frozen.features[1].requires_grad_(False).to(dtype)
    head = frozen.head.weight.detach().clone()
    train_step(frozen, opt, x, y, amp)
    assert frozen.features[1].weight.dtype == dtype
    assert frozen.head.weight.dtype == torch.float32
    assert not torch.equal(frozen.head.weight, head)


def test_rejects_model_initialized_twice():
    model = make_cnn()
    amp.initialize(model, opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match="already went through amp.initialize"):
        amp.initialize(model, opt_level="O2")


def test_an_unpickled_amp_model_is_refused_with_the_way_to_another_precision():
    """WaveGlow's inference scripts unpickle the whole trained model (torch.save(model)) and
    call amp.initialize(model, [], opt_level="O3") on it: that model is an amp model already,
    and the message says what works instead, its state_dict() (the fp32 masters, exactly)
    loaded into a fresh model. (r96A R6)"""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    unpickled = torch.load(buf, weights_only=False)
    with pytest.raises(ValueError, match=r"already went through amp\.initialize.*inference at "
                                         r"another precision.*state_dict\(\) holds the fp32"):
        amp.initialize(unpickled, [], opt_level="O3", verbosity=0)
    fresh = make_cnn(seed=1)
    fresh.load_state_dict(unpickled.state_dict())
    expected = model.state_dict()
    for name, value in fresh.state_dict().items():
        assert value.dtype == expected[name].dtype and torch.equal(value, expected[name]), name
    assert fresh.features[0].weight.dtype == torch.float32
    assert torch.equal(fresh.features[0].weight, opt.param_groups[0]["params"][0])


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("order", ["outer_first", "part_first"])
def test_a_model_and_its_own_part_in_one_call(opt_level, order, device, monkeypatch):
    # initialize([outer, outer.features]) to call the part on its own too (a feature
    # extractor, say). Apex, and amp before, cast the part's outputs to fp32 inside the half
    # outer model at O2/O3, whose next layer then failed on the dtype. Inside the outer it is
    # now a half layer; on its own it casts like any amp model. Training through the outer is
    # bit-identical to initializing the outer alone.
    # (On CUDA, cuDNN's deterministic convolutions: its default fp32 backward may differ by an
    # ulp between two runs.)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    ref, model = make_cnn(device), make_cnn(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kw = dict(opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    amp.initialize(ref, ref_opt, **kw)
    models = [model, model.features] if order == "outer_first" else [model.features, model]
    assert amp.initialize(models, opt, **kw)[0] == models
    x, y = batch(device)
    for _ in range(3):
        torch.testing.assert_close(train_step(model, opt, x, y, amp),
                                   train_step(ref, ref_opt, x, y, amp), rtol=0, atol=0)
    model.eval(), ref.eval()
    out = model(x)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    assert out.dtype == torch.float32
    part = model.features(x)
    assert part.dtype == torch.float32  # called on its own: outputs cast as usual
    with torch.autocast(device.type, torch.bfloat16, enabled=opt_level == "O1"):
        expected = ref.features(x.to(torch.bfloat16) if opt_level in ("O2", "O3") else x)
    torch.testing.assert_close(part, expected.float(), rtol=0, atol=0)
    for (k, v), (k_ref, v_ref) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert k == k_ref and v.dtype == v_ref.dtype and torch.equal(v, v_ref), k
    # An error inside the outer's forward leaves no count behind.
    with pytest.raises(RuntimeError, match="channels"):
        model(torch.randn(2, 5, 8, 8, device=device))
    assert model.features(x).dtype == torch.float32


def test_a_model_and_its_own_part_compile_together():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize([model, model.features], opt, opt_level="O2", dtype=torch.bfloat16,
                   verbosity=0)
    x, _ = batch()
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        pytest.skip("PyTorch 2.4's Dynamo leaves a part that is a built-in container "
                    "(nn.Sequential) as one module call run outside the trace, where the "
                    "enclosing forward's count is not seen (2.5 traces into it)")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    part = torch.compile(model.features, backend="eager", fullgraph=True)
    assert part(x).dtype == torch.float32


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_rejects_a_part_of_a_model_initialized_before(opt_level):
    # Initialized one after the other, the part's casts would run inside the half outer.
    model = make_cnn()
    amp.initialize(model, opt_level=opt_level, verbosity=0)
    with pytest.raises(ValueError, match=r"models=Sequential\(\.\.\.\)\): this model is inside "
                                         r"a model that an earlier amp.initialize cast to half "
                                         r"\(SmallCNN\).*amp.initialize\(\[outer, outer.part\]"):
        amp.initialize(model.features, opt_level=opt_level, verbosity=0)
    # restore_model gives the parts back.
    amp.restore_model(model).float()
    amp.initialize(model.features, opt_level=opt_level, verbosity=0)
    assert model.features(batch()[0]).dtype == torch.float32


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x).relu()


class _Middle(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.lin = _Inner(), nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(self.inner(x))


class _Top(nn.Module):
    def __init__(self):
        super().__init__()
        self.middle, self.side, self.head = _Middle(), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.middle(x) + self.side(x))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_nested_and_sibling_parts_cast_when_called_alone(opt_level):
    # [top, top.middle, top.middle.inner, top.side]: top.middle is a part and holds one. Called
    # on its own it counted its own forward as an enclosing one and returned half outputs.
    # Each model gives, bit for bit, what the same module initialized alone gives.
    torch.manual_seed(0)
    model = _Top()
    names = ["", "middle", "middle.inner", "side"]
    refs = {n: copy.deepcopy(model.get_submodule(n)) for n in names}
    kw = dict(opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    amp.initialize([model.get_submodule(n) for n in names], **kw)
    x = torch.randn(5, 6)
    for name in names:
        out, ref = model.get_submodule(name)(x), amp.initialize(refs[name], **kw)(x)
        assert out.dtype == torch.float32, name
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=name)
    compiled = torch.compile(model.middle, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), refs["middle"](x), rtol=0, atol=0)
    torch.testing.assert_close(model(x), refs[""](x), rtol=0, atol=0)


def test_a_part_called_alone_while_the_outer_runs_in_another_thread():
    # The count of enclosing forwards is per thread: a part called on its own in one thread
    # while its outer model's forward runs in another kept its outputs half.
    model = make_cnn()
    ref = copy.deepcopy(model.features)
    amp.initialize([model, model.features], opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    amp.initialize(ref, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    entered, release = threading.Event(), threading.Event()

    def wait(module, args):
        entered.set()
        release.wait(timeout=30)

    handle = model.head.register_forward_pre_hook(wait)
    x, _ = batch()
    outer = threading.Thread(target=model, args=(x,))
    outer.start()
    try:
        assert entered.wait(timeout=30)
        part = model.features(x)
    finally:
        release.set()
        outer.join()
        handle.remove()
    assert part.dtype == torch.float32
    torch.testing.assert_close(part, ref(x), rtol=0, atol=0)


def test_a_separate_model_called_inside_an_enclosing_forward_casts_its_outputs():
    """Only the enclosed models of one initialize call keep their outputs half inside the
    enclosing model's forward. Another O2 model (a frozen teacher initialized on its own)
    called from that forward is a whole model and gives fp32 outputs, bit for bit what it
    gives when called outside. (A06)"""
    torch.manual_seed(0)
    teacher = nn.Linear(6, 6)
    amp.initialize(teacher, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    seen = {}

    class Student(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(6, 6), nn.Linear(6, 3)
            self.teachers = [teacher]  # (a plain list: not a submodule)

        def forward(self, x):
            seen["teacher"] = self.teachers[0](x)
            return self.head(self.body(x))

    model = Student()
    amp.initialize([model, model.body], opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(4, 6)
    model(x)
    assert seen["teacher"].dtype == torch.float32
    torch.testing.assert_close(seen["teacher"], teacher(x), rtol=0, atol=0)


@pytest.mark.parametrize("order", ["outer_first", "part_first"])
def test_an_embedding_with_max_norm_as_the_part(order):
    # The outer model's conversion gave its max_norm embedding a layer's forward (renorm the
    # master, no casts), which replaced the part's own when the part came first in the list:
    # called on its own it then returned half outputs.
    torch.manual_seed(0)
    model = EmbeddingHead(20, 6, 20)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    kw = dict(opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    models = [model, model.embed] if order == "outer_first" else [model.embed, model]
    amp.initialize(models, opt, **kw)
    amp.initialize(ref, ref_opt, **kw)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        tokens, y = torch.randint(0, 20, (8,), generator=g), torch.randint(0, 20, (8,), generator=g)
        torch.testing.assert_close(train_step(model, opt, tokens, y, amp),
                                   train_step(ref, ref_opt, tokens, y, amp), rtol=0, atol=0)
    out = model.embed(tokens)  # (its rows renormalised in the master, as ref.embed's)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.embed(tokens).float(), rtol=0, atol=0)
    assert torch.equal(model.embed.state_dict()["weight"], ref.embed.state_dict()["weight"])


def test_the_part_refusal_spares_models_that_are_not_inside_a_half_one():
    # Two models sharing a (frozen) module, each initialized on its own, and an O1 model
    # around an O2 one: neither is inside a half model, and both were refused as if they were.
    x = torch.randn(4, 6)
    torch.manual_seed(0)
    shared = nn.Linear(6, 6).requires_grad_(False)
    first, second = nn.Sequential(shared, nn.Linear(6, 2)), nn.Sequential(shared, nn.Linear(6, 3))
    ref = copy.deepcopy(second)
    kw = dict(opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    amp.initialize(first, torch.optim.SGD(first[1].parameters(), lr=0.1), **kw)
    with pytest.warns(UserWarning, match="already torch.bfloat16"):  # (the shared weight)
        amp.initialize(second, torch.optim.SGD(second[1].parameters(), lr=0.1), **kw)
    amp.initialize(ref, torch.optim.SGD(ref[1].parameters(), lr=0.1), **kw)
    torch.testing.assert_close(second(x), ref(x), rtol=0, atol=0)
    outer = nn.Sequential(first, nn.Linear(2, 2))
    with warnings.catch_warnings():  # (first's half parameters are O2's own: no warning)
        warnings.filterwarnings("error", message=".*already")
        amp.initialize(outer, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    with torch.autocast("cpu", torch.bfloat16):
        expected = outer[1](first(x)).float()
    torch.testing.assert_close(outer(x), expected, rtol=0, atol=0)
    # The shared module itself is inside a half model.
    with pytest.raises(ValueError, match="this model is inside a model"):
        amp.initialize(shared, **kw)


@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_rejects_a_part_of_a_copy_or_of_a_model_whose_part_was_restored(copy_of):
    # A deep copy (an EMA model) or an unpickled copy of a half model is one too; restoring
    # a part alone leaves its outer model half.
    model = make_cnn()
    amp.initialize([model, model.features], opt_level="O2", verbosity=0)
    dup = copy.deepcopy(model) if copy_of == "deepcopy" else pickle.loads(pickle.dumps(model))
    for inner in (dup.features[0], dup.head):
        with pytest.raises(ValueError, match=r"inside a model .* cast to half \(SmallCNN\)"):
            amp.initialize(inner, opt_level="O2", verbosity=0)
    amp.restore_model(model.features)
    for inner in (model.features, model.features[0]):
        with pytest.raises(ValueError, match=r"inside a model .* cast to half \(SmallCNN\)"):
            amp.initialize(inner, opt_level="O2", verbosity=0)
    amp.restore_model(model).float()
    amp.initialize(model.features[0], opt_level="O2", verbosity=0)  # (no error)


@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_a_part_of_a_copy_of_an_o1_model_can_be_prepared(copy_of):
    """Only a half (O2/O3) model's parts are refused by a later initialize: a copy of an O1
    model (fp32 parameters) is no half model, so a layer of the copy may be prepared on its own,
    and then gives what the same layer prepared alone gives. (A11)"""
    model = make_mlp()
    amp.initialize(model, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    dup = copy.deepcopy(model) if copy_of == "deepcopy" else pickle.loads(pickle.dumps(model))
    ref = copy.deepcopy(amp.restore_model(copy.deepcopy(dup))[2])
    kw = dict(opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    amp.initialize(dup[2], **kw)  # (no error)
    amp.initialize(ref, **kw)
    x = torch.randn(3, 8)
    torch.testing.assert_close(dup[2](x), ref(x), rtol=0, atol=0)


def test_an_optimizer_built_after_initialize_is_told_the_order():
    # `model = amp.initialize(model)`, then an optimizer: scale_loss said to call initialize
    # with the optimizer, and that call said only "initialize each model once; build a new
    # model": each message sent the user to the other. Both now give the order that works.
    model = amp.initialize(make_cnn(), opt_level="O2", verbosity=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(batch()[0]).sum()
    with pytest.raises(RuntimeError, match="build the optimizer first, then initialize both"):
        with amp.scale_loss(loss, opt):
            pass
    with pytest.raises(ValueError, match="already went through.*build the optimizer before "
                                         "amp.initialize and pass both in one call"):
        amp.initialize(model, opt, opt_level="O2")


@pytest.mark.parametrize("group", ["first", "later"])
def test_rejects_optimizer_with_foreign_params(group):
    # Wherever the optimizer holds it (a later group: a learnable loss weight added as its own
    # group), before anything of the model changes: it would be stepped without a master.
    model, other = make_cnn(), nn.Linear(3, 3)
    if group == "first":
        opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.add_param_group({"params": [other.weight], "lr": 0.01})
    with pytest.raises(ValueError, match=r"SGD holds a parameter of shape \(3, 3\) that belongs "
                                         r"to none of the models passed.*"
                                         r"optimizer.add_param_group"):
        amp.initialize(model, opt, opt_level="O2")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_frozen_foreign_parameter_is_refused_too():
    """A frozen parameter in the optimizer that belongs to none of the models (a second model
    left out of the list, its layers frozen for the first epochs) is refused as any other:
    once unfrozen it would be stepped with no amp preparation (no half copy, no master), so
    the forgotten model is caught at initialize, not epochs later."""
    model, other = make_cnn(), nn.Linear(3, 3).requires_grad_(False)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"SGD holds a parameter of shape \(3, 3\) that belongs "
                                         r"to none of the models passed"):
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O3"])
def test_foreign_optimizer_parameters_are_refused_at_every_level(opt_level):
    """The optimizer's parameters must all belong to the models passed at every opt level,
    not only where masters are made: a script that runs at O1 keeps running when switched to
    O2, and the error shows on the first try. Refused before anything changes."""
    model, other = make_cnn(), nn.Linear(3, 3)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"SGD holds a parameter of shape \(3, 3\) that belongs "
                                         r"to none of the models passed"):
        amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert optimizer_state(opt) is None


def _shared_layer_models():
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 3))
    return a, b, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)


@pytest.mark.parametrize("calls", ["one call", "two calls"])
def test_o2_refuses_a_parameter_in_two_optimizers(calls):
    # Each optimizer would keep an fp32 master of its own: each step wrote the half weight from
    # its master, the other took that write in at half precision, and the masters drifted.
    a, b, oa, ob = _shared_layer_models()
    match = (r"the parameter '0\.weight' is in two optimizers \(SGD and SGD\).*fp32 master of "
             r"its own.*Put each parameter in one optimizer.*O1")
    if calls == "one call":
        with pytest.raises(ValueError, match=match):
            amp.initialize([a, b], [oa, ob], opt_level="O2", verbosity=0)
        assert a[0].weight.dtype == torch.float32  # (refused before anything changed)
        assert oa.param_groups[0]["params"][0] is a[0].weight
    else:
        amp.initialize(a, oa, opt_level="O2", verbosity=0)
        with pytest.raises(ValueError, match=match):
            amp.initialize(b, ob, opt_level="O2", verbosity=0)
        assert b[1].weight.dtype == torch.float32


def test_o2_shared_master_refusal_names_a_parameter_of_a_later_model():
    """The refusal of a parameter held by two optimizers names it by its name in whichever
    model passed holds it, the second one too, so the user finds the layer: here the head of
    ``b`` that ``oa`` was also given."""
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    oa = torch.optim.SGD([*a.parameters(), b[1].weight], lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"the parameter '1\.weight' is in two optimizers "
                                         r"\(SGD and SGD\)"):
        amp.initialize([a, b], [oa, ob], opt_level="O2", verbosity=0)
    assert b[1].weight.dtype == torch.float32


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(30, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 30, bias=False)
        self.head.weight = self.emb.weight  # weight tying

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _tied_lm_backward(model, opt, i):
    """One ``zero_grad`` and ``scale_loss`` backward of a :class:`_TiedLM` on batch ``i``."""
    x = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(i))
    opt.zero_grad()
    out = model(x).float().reshape(-1, 30)
    loss = nn.functional.cross_entropy(out, torch.roll(x, 1, 1).reshape(-1))
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("when", ["initialize", "add_param_group"])
def test_a_tied_parameter_listed_twice_in_one_group_trains_as_in_fp32(opt_level, dtype, when):
    """B1 (r82C). An optimizer built as ``list(emb.parameters()) + ... +
    list(head.parameters())`` holds the tied weight twice in one group (PyTorch warns, and
    steps it twice). At O2 each entry got an fp32 master of its own: the two stepped apart and
    the model trained 1.6e-2 away from the same script at O0 in 3 steps; at O1 fp16 its
    gradient was unscaled twice in place. Now one master stands in both places (stepped twice,
    as fp32's one tensor) and the gradient is unscaled once. Reference: the same script at O0
    (the tied weight within 2e-3, half rounding is ~1e-4 here); also when the embedding and
    its head are unfrozen together through ``add_param_group`` (at O2 against O0 from the
    weight rounded to half, as initialize cast it outside the optimizer)."""
    def train(level):
        torch.manual_seed(0)
        model = _TiedLM()
        if level == "O0" and when == "add_param_group" and opt_level == "O2":
            with torch.no_grad():  # (outside the optimizer at initialize: cast to half there)
                model.emb.weight.copy_(model.emb.weight.to(dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (PyTorch: "... duplicate parameters ...")
            if when == "initialize":
                opt = torch.optim.SGD([*model.emb.parameters(), *model.mid.parameters(),
                                       *model.head.parameters()], lr=0.05)
            else:
                opt = torch.optim.SGD(model.mid.parameters(), lr=0.05)
            kwargs = {} if level == "O0" else {"dtype": dtype}
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
            if when == "add_param_group":
                opt.add_param_group({"params": [*model.emb.parameters(),
                                                *model.head.parameters()]})
        for i in range(3):
            _tied_lm_backward(model, opt, i)
            opt.step()
        return model, opt

    ref, _ = train("O0")
    model, opt = train(opt_level)
    if opt_level == "O2":
        masters = list(amp.master_params(opt))
        assert len({id(m) for m in masters}) == 3  # (emb/head weight, mid weight, mid bias)
        group = opt.param_groups[-1]["params"]
        assert sum(p is group[0] for p in group) == 2  # (the one master, in both places)
    got, want = model.state_dict(), ref.state_dict()
    for key in ("emb.weight", "head.weight", "mid.weight"):
        torch.testing.assert_close(got[key].float(), want[key], rtol=0, atol=2e-3, msg=key)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_master_params_yield_a_tied_parameter_listed_twice_once(opt_level):
    """R1 (r83A). With the tied weight listed twice in its group, amp.master_params gave it
    twice, so README's clip_grad_norm_(amp.master_params(opt)) counted its gradient twice in
    the norm (and scaled it twice): 2e-3 off the fp32 script clipping model.parameters() in 4
    steps. Each is yielded once now. Reference: fp32 clipping over model.parameters() (the
    clipped gradients within half rounding)."""
    def clipped(level):
        torch.manual_seed(0)
        model = _TiedLM()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (PyTorch: "... duplicate parameters ...")
            opt = torch.optim.SGD([*model.emb.parameters(), *model.mid.parameters(),
                                   *model.head.parameters()], lr=0.05)
        if level != "O0":
            model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16,
                                        verbosity=0)
        x = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(0))
        loss = nn.functional.cross_entropy(model(x).float().reshape(-1, 30),
                                           torch.roll(x, 1, 1).reshape(-1))
        if level == "O0":
            loss.backward()
            params = list(model.parameters())
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            params = list(amp.master_params(opt))
        assert len(params) == len({id(p) for p in params}) == 3
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.1)
        return norm, [p.grad.float() for p in params]

    want_norm, want = clipped("O0")
    norm, got = clipped(opt_level)
    torch.testing.assert_close(norm, want_norm, rtol=2e-2, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-3)


def _tied_twice_one_step(level, dtype, fused):
    torch.manual_seed(0)
    model = _TiedLM()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch: "... duplicate parameters ...")
        opt = torch.optim.SGD([*model.emb.parameters(), *model.mid.parameters(),
                               *model.head.parameters()], lr=0.05, momentum=0.9, fused=fused)
    kwargs = {} if level == "O0" else {"dtype": dtype}
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
    x = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(0))
    out = model(x).float().reshape(-1, 30)
    loss = nn.functional.cross_entropy(out, torch.roll(x, 1, 1).reshape(-1))
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return model.state_dict()["emb.weight"].float()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_tied_parameter_listed_twice_with_fused_sgd_momentum_trains_as_in_fp32(opt_level):
    """B3 (r83A). The f6d6696 construction with torch.optim.SGD(fused=True, momentum=0.9) at
    fp16 (dynamic loss scale: the on-device skip path). amp's _prime_fused_momentum gives the
    parameter (at O2 its one master) a zero momentum buffer before the first step, which both
    entries share: the first step moves it by g + (0.9 g + g), where fp32's fused and
    for-loop SGD make a fresh buffer per entry (g + g): 3.8e-3 off after one step, 300x the
    half rounding (fused=False: 1.3e-5). Reference: the same script at O0, and the same
    script with fused=False at the same level."""
    want = _tied_twice_one_step("O0", None, fused=True)
    unfused = _tied_twice_one_step(opt_level, torch.float16, fused=False)
    torch.testing.assert_close(unfused, want, rtol=0, atol=1e-4)  # (the rounding here)
    got = _tied_twice_one_step(opt_level, torch.float16, fused=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dampening", [0.0, 0.1])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_tied_parameter_listed_twice_with_fused_sgd_momentum_after_skipped_steps(
        opt_level, dampening):
    """G2 (r84A). a8706bd primes no zero momentum buffer in a fused SGD group holding a
    parameter twice (and reads the overflow flag on the host instead). The f6d6696 construction
    at fp16 with SGD(fused=True, momentum=0.9, dampening) whose steps 0 and 2 overflow (an inf
    loss): those steps are skipped, and the others step as with fused=False, bit for bit.
    Reference: the same run with the for-loop SGD (fused=False, foreach=False: like the fused
    kernel it updates each entry's buffer and weight in turn; foreach=True updates every buffer
    first and differs for duplicates in plain PyTorch too), same level, same skips."""
    def run(fused):
        torch.manual_seed(0)
        model = _TiedLM()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = torch.optim.SGD([*model.emb.parameters(), *model.mid.parameters(),
                                   *model.head.parameters()], lr=0.05, momentum=0.9,
                                  dampening=dampening, fused=fused,
                                  foreach=None if fused else False)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=torch.float16,
                                    verbosity=0)
        skipped = []
        for i in range(5):
            x = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            out = model(x).float().reshape(-1, 30)
            loss = nn.functional.cross_entropy(out, torch.roll(x, 1, 1).reshape(-1))
            if i in (0, 2):
                loss = loss * float("inf")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            skipped.append(amp.step_was_skipped(opt))
        return model.state_dict()["emb.weight"].float(), skipped

    got, got_skipped = run(fused=True)
    want, want_skipped = run(fused=False)
    assert got_skipped == want_skipped == [True, False, True, False, False]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fused_sgd_with_a_duplicate_and_an_unused_parameter_reads_no_flag_after_its_first_step(
        monkeypatch):
    """r84A R1. A fused SGD momentum group holding a tied weight twice and a layer that never
    gets a gradient: the duplicate check counted the unused layer as still to take its first
    step, so the overflow flag was read on the host at every step (a device sync per step on
    CUDA). Reference: once a step was taken, no read, as without the unused layer."""
    from mixprec.amp import _state

    reads = []
    prime = _state._prime_fused_momentum

    class _Flag:
        is_cuda = False

        def __init__(self, flag):
            self.flag = flag

        def item(self):
            reads.append(1)
            return self.flag.item()

    monkeypatch.setattr(_state, "_prime_fused_momentum",
                        lambda opt, found_inf: prime(opt, _Flag(found_inf)))
    torch.manual_seed(0)
    model = _TiedLM()
    model.unused = nn.Linear(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch: "... duplicate parameters ...")
        opt = torch.optim.SGD([*model.emb.parameters(), *model.mid.parameters(),
                               *model.head.parameters(), *model.unused.parameters()],
                              lr=0.05, momentum=0.9, fused=True)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0 ** 8  # (dynamic; no overflow here)
    taken = []
    for i in range(4):
        _tied_lm_backward(model, opt, i)
        before = len(reads)
        opt.step()
        taken.append((amp.step_was_skipped(opt), len(reads) - before))
    assert taken[0] == (False, 1)  # (the first step: read once, as for dampening)
    assert all(n == 0 for _, n in taken[1:]), taken


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
], ids=["Adam-foreach", "Adam-forloop", "Adam-fused", "AdamW-fused", "SGD-foreach"])
@pytest.mark.parametrize("opt_level, dtype", [("O2", torch.bfloat16), ("O2", torch.float16),
                                              ("O1", torch.float16), ("O3", torch.float16)])
def test_a_tied_parameter_listed_twice_steps_as_plain_pytorch_given_the_same_gradients(
        make_opt, opt_level, dtype):
    """G2 (r83A). The f6d6696 construction with the other optimizers: each step amp hands the
    optimizer is replayed by plain PyTorch on fp32 clones in the same duplicate layout (the
    values, unscaled gradients and optimizer state right before the step), and the result
    agrees bit for bit, so the one master is stepped twice with its one state, as fp32's one
    tensor, and its gradient is unscaled once. Reference: that replay."""
    torch.manual_seed(0)
    model = _TiedLM()
    x0 = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(0))
    fp32 = copy.deepcopy(model)
    nn.functional.cross_entropy(fp32(x0).reshape(-1, 30), torch.roll(x0, 1, 1).reshape(-1)).backward()
    want_grad = fp32.emb.weight.grad  # (the tied weight's: both uses summed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = make_opt([*model.emb.parameters(), *model.mid.parameters(),
                        *model.head.parameters()])
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=dtype, verbosity=0)
    group = opt.param_groups[0]["params"]
    assert len(group) == 4 and group[0] is group[3]  # (one tensor in both places)
    replayed = 0
    for i in range(3):
        _tied_lm_backward(model, opt, i)
        snap = {}

        def before(o, args, kwargs, snap=snap):
            params = [p for g in o.param_groups for p in g["params"]]
            snap["clones"] = clones = {}
            for p in params:
                if id(p) not in clones:
                    c = p.detach().clone().requires_grad_()
                    c.grad = None if p.grad is None else p.grad.detach().clone()
                    clones[id(p)] = c
            snap["layout"] = [[clones[id(p)] for p in g["params"]] for g in o.param_groups]
            snap["state"] = copy.deepcopy(o.state_dict())

        handle = opt.register_step_pre_hook(before)
        opt.step()
        handle.remove()
        if amp.step_was_skipped(opt):
            continue
        if i == 0:  # (unscaled once: the fp32 gradient, to half rounding)
            got = snap["clones"][id(group[0])].grad.float()
            assert float((got - want_grad).norm() / want_grad.norm()) < 2e-2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = make_opt(snap["layout"][0])
        plain.load_state_dict(snap["state"])
        plain.step()
        for p in (p for g in opt.param_groups for p in g["params"]):
            # (equal_nan: pure-fp16 Adam at O3 makes NaNs where eps underflows, as in PyTorch)
            torch.testing.assert_close(p.detach(), snap["clones"][id(p)].detach(), rtol=0,
                                       atol=0, equal_nan=True, msg=f"{i} {tuple(p.shape)}")
        replayed += 1
    assert replayed >= 2


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_lazy_layers_that_have_not_seen_an_input_are_refused_clearly(opt_level):
    # The lazy hook gives a layer its plain class at its first forward, dropping the class amp
    # gives it: a lazy root model failed at its first forward at every level ("object has no
    # attribute '_mixprec_cast_forward'"), as did a lazy BatchNorm kept fp32 at O1; O2's
    # masters cannot be made from parameters without a shape. Refused before anything changes.
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"lazy layers that have not seen an input yet \(0\)"
                       r".*Run one forward pass on a dummy batch before amp.initialize"):
        amp.initialize(model, opt_level=opt_level, verbosity=0)
    bn = nn.Sequential(nn.Conv2d(3, 4, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"\(1\)"):
        amp.initialize(bn, opt_level=opt_level, verbosity=0)
    with pytest.raises(ValueError, match=r"\(LazyLinear\)"):
        amp.initialize(nn.LazyLinear(4), opt_level=opt_level, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model[2].parameters())  # (nothing changed)
    # Shapes from load_state_dict do not run the first forward: the layer is still lazy, and
    # O1's fp32 BatchNorm failed at that forward with the error above.
    loaded = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d())
    loaded.load_state_dict(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).state_dict())
    with pytest.raises(ValueError, match=r"lazy layers that have not seen an input yet \(1\)"):
        amp.initialize(loaded, opt_level=opt_level, keep_batchnorm_fp32=opt_level != "O0" or None,
                       verbosity=0)
    loaded(torch.randn(2, 3))  # the first forward: a BatchNorm1d now
    amp.initialize(loaded, opt_level=opt_level, verbosity=0)

    # Materialized by a forward first, they go through, as any layer.
    x = torch.randn(3, 5)
    model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    bn(torch.randn(2, 3, 5, 5))
    amp.initialize(bn, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    assert bn(torch.randn(2, 3, 5, 5)).shape == (2, 4, 5, 5)


def test_lazy_refusal_lists_five_layers_and_shortens_only_more():
    # r98A G2: up to five unready lazy layers are named in full; ", ..." only past five.
    model = nn.Sequential(*[nn.LazyLinear(2) for _ in range(5)])
    with pytest.raises(ValueError, match=r"yet \(0, 1, 2, 3, 4\)"):
        amp.initialize(model, opt_level="O1", verbosity=0)
    model = nn.Sequential(*[nn.LazyLinear(2) for _ in range(6)])
    with pytest.raises(ValueError, match=r"yet \(0, 1, 2, 3, 4, \.\.\.\)"):
        amp.initialize(model, opt_level="O1", verbosity=0)


@pytest.mark.parametrize("opt_level, extra", [("O0", {}),
                                              ("O1", {"patch_torch_functions": False})])
def test_batchnorm_cast_to_half_by_a_level_that_leaves_it_unset_gets_masters(opt_level, extra):
    # r98A G1: a level that leaves keep_batchnorm_fp32 unset (O0, O1 without the patching),
    # given cast_model_type=float16 and master_weights=True, casts BatchNorm to half with the
    # rest, so its parameters need fp32 masters like the others: every parameter the
    # optimizer steps is an fp32 master, none the model's own.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, cast_model_type=torch.float16,
                                master_weights=True, verbosity=0, **extra)
    assert model[1].weight.dtype == torch.float16
    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert [p.dtype for p in stepped] == [torch.float32] * 4
    assert not any(p is q for p in stepped for q in model.parameters())


def test_o2_refuses_a_late_group_holding_another_optimizers_mastered_parameter():
    a, b, _, _ = _shared_layer_models()
    # (another class for the optimizer keeping the master: the message names that one, M37)
    oa = torch.optim.Adam(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b[1].parameters(), lr=0.1)  # (b's own layer only)
    amp.initialize([a, b], [oa, ob], opt_level="O2", loss_scale=1.0, verbosity=0)
    ob.add_param_group({"params": [b[0].weight]})
    with pytest.raises(ValueError, match=r"^SGD\.add_param_group: a parameter of shape "
                       r"\(4, 4\) in the new group already has an fp32 master in another "
                       r"optimizer \(Adam\).*taken back out of param_groups.*Put each "
                       r"parameter in one optimizer"):
        amp.master_params(ob)
    # Taken back out, as add_param_group refuses a bad group: before, it stayed, and every
    # later step was refused. The optimizer trains on as it did before the call.
    assert len(ob.param_groups) == 1
    assert [p.dtype for p in ob.param_groups[0]["params"]] == [torch.float32] * 2
    before = [p.detach().clone() for p in amp.master_params(ob)]
    loss = (a(torch.randn(3, 4)).float().sum() + b(torch.randn(3, 4)).float().sum())
    with amp.scale_loss(loss, [oa, ob]) as scaled:
        scaled.backward()
    oa.step()
    ob.step()
    assert all(not torch.equal(p, q) for p, q in zip(amp.master_params(ob), before))


# G2: kills M40 (_refuse_mastered_elsewhere looking at a new group's first parameter only).
def test_o2_refuses_a_late_group_whose_later_parameter_another_optimizer_masters():
    # As test_o2_refuses_a_late_group_holding_another_optimizers_mastered_parameter, with the
    # shared weight after a parameter of the optimizer's own model in the new group: every
    # parameter of the group is looked at, not the first only (two masters of the shared
    # weight would drift apart).
    a, b, _, _ = _shared_layer_models()
    oa = torch.optim.Adam(a.parameters(), lr=0.1)
    ob = torch.optim.SGD([b[1].weight], lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O2", loss_scale=1.0, verbosity=0)
    ob.add_param_group({"params": [b[1].bias, b[0].weight]})
    with pytest.raises(ValueError, match=r"^SGD\.add_param_group: a parameter of shape "
                       r"\(4, 4\) in the new group already has an fp32 master in another "
                       r"optimizer \(Adam\)"):
        amp.master_params(ob)
    assert len(ob.param_groups) == 1
    assert len(list(amp.master_params(ob))) == 1


def test_o1_keeps_a_parameter_in_two_optimizers():
    # (No masters at O1: both optimizers step the one fp32 parameter, as in fp32 training.)
    a, b, oa, ob = _shared_layer_models()
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    ref_b[0] = ref_a[0]
    ref_oa = torch.optim.SGD(ref_a.parameters(), lr=0.1)
    ref_ob = torch.optim.SGD(ref_b.parameters(), lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(5, 4)
    with amp.scale_loss(a(x).sum() + b(x).sum(), [oa, ob]) as s:
        s.backward()
    oa.step()
    ob.step()
    (ref_a(x).sum() + ref_b(x).sum()).backward()
    ref_oa.step()
    ref_ob.step()
    assert a[0].weight.dtype == torch.float32
    torch.testing.assert_close(a[0].weight, ref_a[0].weight, rtol=0, atol=2e-2)  # (bf16)
    assert not torch.equal(a[0].weight, _shared_layer_models()[0][0].weight)


def test_bare_parameter_added_after_initialize_steps_in_fp32():
    # The error's second remedy for a bare nn.Parameter (a learnable loss weight): added with
    # add_param_group after initialize it stays fp32 and is stepped as it is, at O2 too.
    model, weight = make_cnn(), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    opt.add_param_group({"params": [weight], "lr": 0.5})
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y) * weight.sum() / 2
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert weight.dtype == torch.float32 and weight in opt.param_groups[1]["params"]
    # d loss / d weight_i = cross_entropy / 2 = loss / 2 at weight = 1.
    expected = torch.full((2,), 1.0 - 0.5 * loss.item() / 2)
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=1e-6)


def _o2_model(optimizer):
    from mixprec.optimizers import FusedAdam

    model = make_cnn()
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else FusedAdam(model.parameters(), lr=1e-2))
    return amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)


@pytest.mark.parametrize("steps_before", [0, 2], ids=["before-first-step", "after-two-steps"])
@pytest.mark.parametrize("optimizer", ["sgd", "fused_adam"])
def test_o2_in_place_write_to_the_half_model_holds(optimizer, steps_before, caplog):
    # A half parameter written in place after initialize (reset_parameters here; nn.init, an
    # update under no_grad, PyTorch DDP broadcasting rank 0's weights alike) is taken into its
    # fp32 master before the next step, instead of being overwritten by the post-step copy.
    # (FusedAdam writes the half copies itself, without a version change.) A step at lr 0
    # changes nothing else: every other master keeps its fp32 value bit for bit.
    model, opt = _o2_model(optimizer)
    x, y = batch()
    for _ in range(steps_before):
        train_step(model, opt, x, y, amp)
    masters = {id(p): m for p, m in optimizer_state(opt).pairs}
    others = {name: masters[id(p)].detach().clone() for name, p in model.named_parameters()
              if id(p) in masters and not name.startswith("head.")}
    torch.manual_seed(5)
    model.head.reset_parameters()
    written = model.head.weight.detach().clone()
    for group in opt.param_groups:
        group["lr"] = 0.0
    with caplog.at_level("INFO", logger="mixprec.amp"):
        train_step(model, opt, x, y, amp)
    assert torch.equal(model.head.weight, written)  # not overwritten by the old master
    assert torch.equal(masters[id(model.head.weight)], written.float())
    assert torch.equal(model.state_dict()["head.weight"], written.float())
    for name, p in model.named_parameters():
        if name in others:
            assert torch.equal(masters[id(p)], others[name]), name
    assert "2 of the half model's 6 master-weighted parameters were written in place" in (
        caplog.text)


@pytest.mark.parametrize("verbosity", [1, 0])
def test_o2_in_place_writes_are_logged_at_info_once(caplog, verbosity):
    """The note that half parameters written in place were taken into their masters is
    logged at INFO the first time only, later ones at DEBUG: a loop that writes the half
    model at every step (a clamp or projection under no_grad) is not flooded with it (C55).
    verbosity=0 silences it at every level (M46)."""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=verbosity)
    x, y = batch()
    with caplog.at_level(logging.DEBUG, logger="mixprec.amp"):
        for _ in range(3):
            with torch.no_grad():
                model.head.weight.clamp_(-0.1, 0.1)
            train_step(model, opt, x, y, amp)
    notes = [r for r in caplog.records if "were written in place" in r.getMessage()]
    assert [r.levelno for r in notes] == (
        [logging.INFO, logging.DEBUG, logging.DEBUG] if verbosity else [])


@pytest.mark.skipif(not hasattr(torch.__future__, "set_swap_module_params_on_conversion"),
                    reason="PyTorch without swap_module_params_on_conversion")
def test_o2_conversion_that_swaps_tensors_is_no_write():
    # Under PyTorch's swap_module_params_on_conversion a model.to(...) swaps each parameter's
    # tensor for a new one, whose version counter differs: a move, not an in-place write, so
    # the fp32 masters keep their exact values (a step at lr 0 leaves them bit for bit).
    model, opt = _o2_model("sgd")
    before = [m.detach().clone() for _, m in optimizer_state(opt).pairs]
    ids = [id(p) for p in model.parameters()]
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = model.to(memory_format=torch.channels_last)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert [id(p) for p in model.parameters()] == ids  # (swapped in place: the same objects)
    assert model.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    for group in opt.param_groups:
        group["lr"] = 0.0
    x, y = batch()
    train_step(model, opt, x, y, amp)
    for old, (_, master) in zip(before, optimizer_state(opt).pairs):
        assert torch.equal(old, master)


def test_o2_conversion_that_would_replace_parameters_is_refused():
    # Under PyTorch's overwrite_module_params_on_conversion a model.to(...) gives every
    # parameter a new object: the optimizer's masters would pair with the old ones and the
    # model would silently stop training. Refused before anything changes.
    model, opt = _o2_model("sgd")
    ids = [id(p) for p in model.parameters()]
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="overwrite_module_params_on_conversion.*would "
                                               "replace its Parameter objects.*before amp"):
            model.to(memory_format=torch.channels_last)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    assert [id(p) for p in model.parameters()] == ids
    x, y = batch()
    before = model.head.weight.detach().clone()
    train_step(model, opt, x, y, amp)
    assert not torch.equal(before, model.head.weight)  # (still training)
    # Without masters (O1) there is nothing of amp's to lose: the conversion goes through.
    o1 = amp.initialize(make_cnn(), opt_level="O1", verbosity=0)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        o1.to(memory_format=torch.channels_last)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)


def test_o2_move_from_the_meta_device_is_refused():
    # A model built on the meta device, initialized at O2 there, then given real memory with
    # model.to_empty(): PyTorch makes new Parameter objects for a move to or from meta, the
    # masters stayed on meta, and the model silently never trained (its state_dict() even
    # came back on meta). Refused before anything changes, saying to move first.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    ids = [id(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="from meta to cpu after amp.initialize.*Move the "
                                           "model first"):
        model.to_empty(device="cpu")
    assert [id(p) for p in model.parameters()] == ids
    assert all(p.is_meta for p in model.parameters())
    # Without masters (O1) there is nothing of amp's to lose: the move goes through.
    with torch.device("meta"):
        o1 = nn.Linear(4, 2)
    amp.initialize(o1, opt_level="O1", verbosity=0).to_empty(device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_o2_masters_follow_a_device_move_after_initialize(monkeypatch):
    # initialize on the CPU, then model.cuda() (the docs/amp.md: device moves work after
    # initialize). The masters stayed on the CPU: the first backward failed assigning a CUDA
    # gradient to a CPU master.
    # The reference: the same recipe initialized on the GPU, which it must equal exactly
    # (cuDNN's deterministic algorithms: its others may sum in another order per run).
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model = make_cnn()
    ref = copy.deepcopy(model).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    amp.initialize(ref, ref_opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    model.cuda()
    assert all(m.is_cuda for m in amp.master_params(opt))
    x, y = batch("cuda")
    for _ in range(3):
        loss = train_step(model, opt, x, y, amp)
        ref_loss = train_step(ref, ref_opt, x, y, amp)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    ref_sd = ref.state_dict()
    for k, v in model.state_dict().items():
        assert v.is_cuda and v.dtype == ref_sd[k].dtype, k
        torch.testing.assert_close(v, ref_sd[k], rtol=0, atol=0, msg=k)


def test_o2_load_state_dict_after_initialize_keeps_exact_masters():
    # model.load_state_dict writes the half parameters and the masters: the masters win (an
    # fp32 checkpoint is not rounded to half by the next step's check for in-place writes).
    model, opt = _o2_model("sgd")
    fresh = make_cnn(seed=7).state_dict()
    model.load_state_dict(fresh)
    for group in opt.param_groups:
        group["lr"] = 0.0
    x, y = batch()
    train_step(model, opt, x, y, amp)
    masters = {id(p): m for p, m in optimizer_state(opt).pairs}
    checked = 0
    for name, p in model.named_parameters():
        if id(p) in masters:  # (BatchNorm's fp32 parameters have none)
            assert torch.equal(masters[id(p)], fresh[name]), f"{name}: master rounded"
            assert not torch.equal(fresh[name], fresh[name].bfloat16().float())  # (could fail)
            checked += 1
    assert checked == 6


@pytest.mark.parametrize("bad,got", [("model", "str"), (3, "int"), ([nn.Linear(2, 2), 3], "int")])
def test_rejects_non_modules(bad, got):
    # The type passed (the offending item of a list) and what is allowed.
    with pytest.raises(TypeError, match=rf"amp\.initialize\(models=\.\.\.\): got {got}; expected "
                                        r"a torch\.nn\.Module or a list of them\."):
        amp.initialize(bad)


def test_rejects_non_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        amp.initialize(make_cnn(), object(), opt_level="O1")


def test_an_empty_optimizer_list_comes_back_as_an_empty_list():
    """``optimizers=[]`` (a script that builds its optimizers in a list, none for an
    evaluation run) is a list of optimizers, not None: initialize returns ``(models, [])``,
    the very list given, so ``model, opts = amp.initialize(model, opts)`` unpacks as it does
    with optimizers."""
    model = make_cnn()
    opts = []
    got = amp.initialize(model, opts, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert isinstance(got, tuple) and len(got) == 2
    assert got[0] is model and got[1] is opts
    assert model.head.weight.dtype == torch.bfloat16  # (the model itself was prepared)


def test_every_optimizer_of_a_list_is_checked_before_anything_changes():
    """A non-optimizer anywhere in the list (not only first) is refused with initialize's
    TypeError naming its type, before the model is cast and before the real optimizer is
    taken over: the user fixes the call and runs it again on the same objects."""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"amp\.initialize\(optimizers=\.\.\.\): got dict; "
                                        r"expected a torch\.optim\.Optimizer"):
        amp.initialize(model, [opt, {"lr": 0.1}], opt_level="O2", dtype=torch.bfloat16,
                       verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert optimizer_state(opt) is None and not amp.is_amp_model(model)


def test_the_default_opt_level_is_o1(caplog):
    """``amp.initialize(model, optimizer)`` with no opt_level is Apex's default, O1: the
    parameters stay fp32, fp16 gets the dynamic loss scale (starting at 2**16, where O0 would
    have a static 1.0), and the summary line names O1."""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        model, opt = amp.initialize(model, opt)
    assert "amp: opt_level O1" in caplog.text
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert amp.state_dict(optimizer=opt) == {"loss_scaler0": {"loss_scale": 2.0**16,
                                                              "unskipped": 0}}


def test_a_disabled_call_accepts_any_opt_level():
    """With ``enabled=False`` initialize returns at once, as Apex's did: a script that reads
    its opt level from a config still runs with amp switched off whatever the config holds (a
    level this version does not know, a dtype for another GPU); nothing of the model
    changes."""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = amp.initialize(model, opt, enabled=False, opt_level="O4", dtype=torch.float64)
    assert got[0] is model and got[1] is opt
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not amp.is_amp_model(model)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_loss_scale=None), r"amp\.initialize\(max_loss_scale=None\): must be a positive "
                                r"number \(the dynamic loss scale's ceiling\); the default is "
                                r"2\.\*\*24\."),
    (dict(min_loss_scale=True), r"amp\.initialize\(min_loss_scale=True\): must be a positive "
                                r"number \(the dynamic loss scale's floor\)"),
    (dict(max_loss_scale=True), r"amp\.initialize\(max_loss_scale=True\): must be a positive"),
])
def test_rejects_a_none_ceiling_and_bool_scale_bounds(kwargs, match):
    """None means "the default" only for the floor: ``max_loss_scale=None`` (a config's empty
    field) is refused by initialize itself, naming the argument and the default, not deeper
    down by the scaler; a bool bound (a flag given to the wrong keyword) is not taken as 1.0,
    as with num_losses and verbosity. Refused before the model changes."""
    model = make_cnn()
    with pytest.raises(ValueError, match=match):
        amp.initialize(model, opt_level="O2", verbosity=0, **kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_rejects_a_wrapper_without_param_groups():
    """An object holding an optimizer as ``.optim`` but without ``param_groups`` of its own
    is not an optimizer amp can manage (it could neither see nor replace the parameters it
    steps): ``initialize`` refuses it with its TypeError naming the type, before anything of
    the model changes (C07)."""
    class Holder:
        def __init__(self, optim):
            self.optim = optim

        def step(self):
            self.optim.step()

    model = make_cnn()
    holder = Holder(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"amp\.initialize\(optimizers=\.\.\.\): got Holder; "
                                        r"expected a torch\.optim\.Optimizer"):
        amp.initialize(model, holder, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_rejects_a_wrapper_whose_slots_leave_no_room_for_amps_step_hook():
    """A LARC-style wrapper whose class defines ``__slots__`` without ``__dict__`` cannot take
    the step hook amp puts on the wrapper: refused with a TypeError naming it and the fix,
    before the model changes (it was a raw AttributeError from inside amp, after the cast)."""
    class Slotted:
        __slots__ = ("optim", "__weakref__")

        def __init__(self, optim):
            self.optim = optim

        @property
        def param_groups(self):
            return self.optim.param_groups

        def step(self, closure=None):
            return self.optim.step(closure)

    model = make_cnn()
    slotted = Slotted(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"amp\.initialize\(optimizers=\.\.\.\): Slotted wraps a "
                                        r"SGD but has no instance __dict__ .*Add '__dict__' to "
                                        r"its __slots__, or pass the wrapped optimizer itself"):
        amp.initialize(model, slotted, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not amp.is_amp_model(model)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("has", [(), ("zero_grad",), ("state",), ("step", "zero_grad"),
                                 ("step", "state"), ("zero_grad", "state"),
                                 ("step", "zero_grad", "state")])
def test_a_wrapper_without_an_optimizers_methods_is_refused_naming_them(has, opt_level):
    """amp treats a LARC-style wrapper (``.optim`` and ``param_groups``) as the optimizer it
    stands for: it hooks the wrapper's ``step`` and ``zero_grad`` and reads its ``state``. A
    wrapper lacking any of them is refused with a TypeError naming what is missing and the
    fix, before the model changes (it was a raw AttributeError from inside amp, after the
    cast). One with all three trains as its wrapped optimizer does."""
    class Wrapper:
        def __init__(self, optim):
            self.optim = optim

        @property
        def param_groups(self):
            return self.optim.param_groups

    if "step" in has:
        Wrapper.step = lambda self, closure=None: self.optim.step(closure)
    if "zero_grad" in has:
        Wrapper.zero_grad = lambda self, set_to_none=True: self.optim.zero_grad(set_to_none)
    if "state" in has:
        Wrapper.state = property(lambda self: self.optim.state)
    model = make_cnn()
    wrapper = Wrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    missing = [name for name in ("step", "zero_grad", "state") if name not in has]
    if missing:
        with pytest.raises(TypeError, match=(
                r"amp\.initialize\(optimizers=\.\.\.\): Wrapper wraps a SGD but has no "
                + re.escape(", ".join(missing)) + r"\. amp uses a wrapper as the optimizer "
                r"it stands for.*Define the missing ones on Wrapper, delegating to its "
                r"\.optim, or pass the wrapped optimizer itself")):
            amp.initialize(model, wrapper, opt_level=opt_level, dtype=torch.bfloat16,
                           verbosity=0)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert not amp.is_amp_model(model)
        return
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model, wrapper = amp.initialize(model, wrapper, opt_level=opt_level, dtype=torch.bfloat16,
                                    verbosity=0)
    reference, ref_opt = amp.initialize(reference, ref_opt, opt_level=opt_level,
                                        dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    for net, opt in ((model, wrapper), (reference, ref_opt)):
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(net(x).float().square().mean(), opt) as scaled:
                scaled.backward()
            opt.step()
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)


def test_rejects_bad_num_losses():
    with pytest.raises(ValueError, match="num_losses"):
        amp.initialize(make_cnn(), opt_level="O1", num_losses=0)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(verbosity="loud"), TypeError, r"verbosity='loud'\): must be an int >= 0, 0 to"),
    (dict(verbosity=-1), ValueError, r"verbosity=-1\): must be an int >= 0"),
    (dict(min_loss_scale=2.0**10, max_loss_scale=2.0**8), ValueError,
     r"min_loss_scale=1024.0, max_loss_scale=256.0\): min_loss_scale must not exceed"),
    (dict(min_loss_scale=-1.0), ValueError,
     r"min_loss_scale=-1.0\): must be a positive number .*floor.*or None"),
    (dict(min_loss_scale=float("nan")), ValueError, r"min_loss_scale=nan\): must be a positive"),
    (dict(min_loss_scale=float("inf")), ValueError, r"min_loss_scale=inf\): must be a positive"),
    (dict(max_loss_scale=0), ValueError, r"max_loss_scale=0\): must be a positive .*ceiling"),
    (dict(max_loss_scale="65536"), ValueError, r"max_loss_scale='65536'\): must be a positive"),
    # verbosity is an int: True (a flag in the wrong keyword) is not 1, as a bool num_losses
    (dict(verbosity=True), TypeError, r"verbosity=True\): must be an int >= 0"),
    # a bad ceiling's message gives the default to go back to
    (dict(max_loss_scale=-1.0), ValueError, r"max_loss_scale=-1\.0\): must be a positive number "
                                            r"\(the dynamic loss scale's ceiling\); the default "
                                            r"is 2\.\*\*24\."),
])
def test_rejects_bad_verbosity_and_scale_bounds(kwargs, exc, match):
    # (Before: a comparison's raw TypeError at the first log message, and a negative floor
    # accepted.) Checked before anything changes, enabled or not.
    model = make_cnn()
    with pytest.raises(exc, match=match):
        amp.initialize(model, opt_level="O2", **kwargs)
    assert model.features[0].weight.dtype == torch.float32


def test_accepts_scale_bounds_as_ints_and_an_infinite_ceiling():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (bf16 with a dynamic scale: its range takes scales past 2**24 without overflowing.)
    amp.initialize(model, opt, opt_level="O1", min_loss_scale=1, max_loss_scale=float("inf"),
                   dtype=torch.bfloat16, loss_scale="dynamic", verbosity=0)
    x, _ = batch()

    def step(overflow):
        opt.zero_grad()
        loss = model(x).float().mean()
        with amp.scale_loss(loss * float("inf") if overflow else loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return amp.state_dict()["loss_scaler0"]["loss_scale"]

    # The floor holds: 4 -> 2 -> 1 -> 1 on overflows.
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}})
    assert [step(True) for _ in range(4)] == [2.0, 1.0, 1.0, 1.0]
    # No ceiling: past the default 2**24 after a clean window.
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**30, "unskipped": 1999}})
    assert step(False) == 2.0**31


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_bf16_on_gpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(RuntimeError, match="does not support bfloat16.*dtype=torch.float16"):
        amp.initialize(make_cnn("cuda"), opt_level="O2", dtype=torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_bf16_checked_on_every_model(monkeypatch):
    # (The check once stopped at the first parameter of the first model: a CPU model listed
    # first let a CUDA model through.)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(RuntimeError, match="does not support bfloat16"):
        amp.initialize([make_cnn(), make_cnn("cuda")], opt_level="O2", dtype=torch.bfloat16)


def test_initialize_logs_opt_level(caplog):
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        amp.initialize(make_cnn(), opt_level="O2", verbosity=1)
    assert "opt_level O2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        amp.initialize(make_cnn(), opt_level="O2", verbosity=0)
    assert caplog.text == ""


def test_latest_state_does_not_keep_models_alive():
    import gc
    import weakref

    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(next(amp.master_params(opt)))]
    del model, opt
    gc.collect()
    assert all(r() is None for r in refs)
    assert amp.state_dict()  # the scalers themselves are still there


def test_states_holding_finds_a_call_by_any_one_of_its_models():
    """DistributedDataParallel's join() broadcasts the loss scales of every initialize call
    that prepared its module: a call given several models (a GAN's generator and
    discriminator, one of them wrapped) is found through any one of them, and one that did not
    prepare the module is not. (F78)"""
    from mixprec.amp._state import optimizer_state
    from mixprec.amp.frontend import states_holding

    gen, disc, other = make_mlp(), make_mlp(seed=1), make_mlp(seed=2)
    opt = torch.optim.SGD(list(gen.parameters()) + list(disc.parameters()), lr=0.1)
    amp.initialize([gen, disc], opt, opt_level="O1", verbosity=0)
    opt_other = torch.optim.SGD(other.parameters(), lr=0.1)
    amp.initialize(other, opt_other, opt_level="O1", verbosity=0)
    state = optimizer_state(opt).amp_state
    assert states_holding(gen) == [state]
    assert states_holding(disc) == [state]
    assert states_holding(nn.Sequential(gen)) == [state]  # (a wrapper module around the model)
    assert states_holding(other) == [optimizer_state(opt_other).amp_state]
    assert states_holding(make_mlp(seed=3)) == []


def test_module_level_state_dict_skips_a_later_call_whose_optimizers_are_gone():
    # A trial (an LR finder) initialized after the real run and then freed: amp.state_dict()
    # and amp.load_state_dict() acted on its dead scalers, so a resume silently left the live
    # run's scale alone. They act on the most recent call with live optimizers now.
    import gc

    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 3}})
    trial = make_cnn(seed=1)
    trial_opt = torch.optim.SGD(trial.parameters(), lr=0.1)
    amp.initialize(trial, trial_opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0  # (the trial's, alive)
    del trial, trial_opt
    gc.collect()
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 3}}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 5}})
    assert amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"] == 128.0


def test_module_level_state_dict_takes_the_newest_live_call_when_the_latest_is_gone():
    """Two runs alive (a model and its fine-tuned copy, say) and a trial initialized after
    both and then freed: amp.state_dict() and amp.load_state_dict() act on the newest call
    whose optimizers are alive, the second run, not on the first. (F80)"""
    import gc

    kw = dict(opt_level="O2", dtype=torch.float16, verbosity=0)
    first, second = make_cnn(), make_cnn(seed=1)
    opt1 = torch.optim.SGD(first.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.1)
    amp.initialize(first, opt1, loss_scale=128.0, **kw)
    amp.initialize(second, opt2, loss_scale=256.0, **kw)
    trial = make_cnn(seed=2)
    trial_opt = torch.optim.SGD(trial.parameters(), lr=0.1)
    amp.initialize(trial, trial_opt, loss_scale=512.0, **kw)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 512.0  # (the trial's, alive)
    del trial, trial_opt
    gc.collect()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 256.0
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 7}})
    assert amp.state_dict(optimizer=opt2)["loss_scaler0"] == {"loss_scale": 256.0,
                                                              "unskipped": 7}
    assert amp.state_dict(optimizer=opt1)["loss_scaler0"] == {"loss_scale": 128.0,
                                                              "unskipped": 0}


def test_a_call_without_optimizers_is_the_module_level_state_when_alone():
    """An evaluation or export script initializes its model without an optimizer: with no
    other call made, module-level ``amp.state_dict()`` and Apex's ``amp._amp_state`` read
    that call (its scaler, its opt level) instead of saying initialize was never called."""
    model = make_cnn()
    amp.initialize(model, opt_level="O2", dtype=torch.float16, verbosity=0)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 0}}
    assert amp._amp_state.opt_properties.opt_level == "O2"


def test_a_model_class_is_not_kept_alive_by_amp():
    # amp's swapped class for each model class was cached for good: a class defined per trial
    # (a notebook cell run again, a factory; torch.fx's class per GraphModule) stayed alive.
    import gc
    import weakref

    def trial():
        class Net(nn.Sequential):
            pass

        model = Net(nn.Linear(4, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        model(torch.randn(2, 4))
        return weakref.ref(Net), weakref.ref(type(model))

    refs = [trial() for _ in range(3)]
    gc.collect()
    assert all(original() is None and swapped() is None for original, swapped in refs)


def test_o2_masters_of_frozen_parameters_stay_frozen():
    # A layer frozen before initialize (requires_grad=False) but left in the optimizer: its
    # fp32 master does not require a gradient either, as the parameter it stands for.
    model = make_mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert [m.requires_grad for m in amp.master_params(opt)] == [False, False, True, True]
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]


def test_optimizer_state_from_before_initialize_moves_to_the_masters():
    # An optimizer that already stepped (or loaded a state dict) before initialize: its
    # per-parameter state (SGD momentum here) follows the parameters to their fp32 masters,
    # unchanged, and nothing stays keyed by the half parameters.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(2):
        x, y = batch(seed=i)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    momenta = {id(p): opt.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    halves = {id(p): p for p in model.parameters()}
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    state = optimizer_state(opt)
    assert state.pairs
    for p, master in state.pairs:
        assert p not in opt.state
        moved = opt.state[master]["momentum_buffer"]
        assert moved.dtype == torch.float32
        torch.testing.assert_close(moved, momenta[id(p)], rtol=0, atol=0)
        assert halves[id(p)] is p
    # and training goes on from there
    before = [m.detach().clone() for m in amp.master_params(opt)]
    train_step(model, opt, *batch(seed=5), amp)
    assert any(not torch.equal(m, b) for m, b in zip(amp.master_params(opt), before))


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    lambda ps: __import__("mixprec.optimizers", fromlist=["FusedAdam"]).FusedAdam(ps, lr=1e-3),
])
def test_o2_parameter_gradient_and_adam_state_bytes_are_18_per_parameter(make_opt):
    # docs/migrating.md ("When O2 is faster") sizes parameters + gradients + optimizer state
    # at O2 against fp32/autocast. Counted after the scale_loss block, before step(): the half
    # model (2 bytes per parameter), the fp32 masters (4) and their gradients (4), AdamW's two
    # fp32 moments (8); the half parameters hold no gradient. 18 bytes against fp32's 16:
    # 12.5% more.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = make_opt(model.parameters())
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(4, 32)
    for step in range(2):  # a first step allocates the moments; count after the second backward
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        if step == 0:
            opt.step()

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    half = list(model.parameters())
    masters = list(amp.master_params(opt))
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    n = sum(p.numel() for p in half)
    assert all(p.grad is None for p in half)
    assert nbytes(half) == 2 * n and nbytes(masters) == 4 * n
    assert nbytes([m.grad for m in masters]) == 4 * n and nbytes(state) == 8 * n


class _Bag(nn.Module):
    """An EmbeddingBag with max_norm as a child, a linear head after it."""

    def __init__(self, max_norm):
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 16, max_norm=max_norm, mode="mean")
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.bag(ids))


def _embedding_model(kind, max_norm, device):
    torch.manual_seed(0)
    if kind == "Embedding":  # the embedding is the model itself
        return nn.Embedding(40, 16, max_norm=max_norm).to(device)
    return _Bag(max_norm).to(device)


def _train_embedding(model, opt, ids, steps, use_amp):
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        backward_and_step(model(ids[step]).float().pow(2).mean(), opt, amp, use_amp)


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_o2_embedding_max_norm_keeps_fp32_masters(kind, device):
    # nn.Embedding(max_norm=...) renormalises the looked-up rows of its weight in place at
    # every forward. At O2 that write used to bump the half weight's version counter each
    # step, and amp took the whole half weight into the master: the embedding's master was
    # rounded to half every step (its updates below half an ulp were lost). amp now applies
    # max_norm to the fp32 master's rows, as fp32 training applies it to the weight.
    ids = torch.randint(0, 30, (6, 8, 5), generator=torch.Generator().manual_seed(3)).to(device)
    lr = 1e-3
    # 1. A max_norm no row reaches changes nothing: masters equal those without max_norm,
    #    bit for bit.
    masters = {}
    for max_norm in (None, 1e6):
        model = _embedding_model(kind, max_norm, device)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        _train_embedding(model, opt, ids, 6, True)
        masters[max_norm] = [m.detach().clone() for m in amp.master_params(opt)]
    for a, b in zip(masters[None], masters[1e6]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # 2. A max_norm every looked-up row exceeds (rows of 16 N(0, 1) entries have norms near
    #    4): the masters follow fp32 training with the same max_norm, far closer than the
    #    half rounding the old behaviour left (bf16's half ulp at these values, ~4e-3), and
    #    the rows never looked up keep their exact fp32 initial values.
    ref = _embedding_model(kind, 1.0, device).double()
    model = _embedding_model(kind, 1.0, device)
    initial = model.weight.detach().clone() if kind == "Embedding" else (
        model.bag.weight.detach().clone())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    _train_embedding(model, opt, ids, 6, True)
    _train_embedding(ref, ref_opt, ids, 6, False)
    master = next(iter(amp.master_params(opt)))
    ref_weight = next(ref.parameters())
    assert master.shape == (40, 16) and master.dtype == torch.float32
    torch.testing.assert_close(master.double(), ref_weight.detach(), rtol=0, atol=1e-5)
    # Every row 0..29 was looked up and renormalised (from norms near 4) before its last
    # small update.
    assert initial[:30].norm(dim=1).min() > 2 and master[:30].norm(dim=1).max() < 1.01
    torch.testing.assert_close(master[30:], initial[30:], rtol=0, atol=0)
    assert not torch.equal(master[:30], master[:30].bfloat16().float())  # (fp32 values)


def test_o2_embedding_max_norm_takes_writes_and_compiles():
    # The renorm of the master must not lose a write to the half weight made since amp's last
    # copy (nn.init here; PyTorch's DDP broadcasting rank 0's weights alike): the write is
    # taken first, as at a step. int32 indices work, max_norm may be switched off after
    # initialize, and a compiled model (fullgraph) trains as the eager one, bit for bit.
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20, 8, max_norm=1.0), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        return model, opt

    def train(model, opt, steps, dtype=torch.int64):
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = torch.randint(0, 20, (4, 3), generator=g).to(dtype)
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).sum(), opt) as scaled:
                scaled.backward()
            opt.step()

    model, opt = build()
    train(model, opt, 1)
    with torch.no_grad():
        nn.init.constant_(model[0].weight, 0.125)  # (norm 0.35: under max_norm)
    for group in opt.param_groups:
        group["lr"] = 0.0
    train(model, opt, 2, dtype=torch.int32)
    master = next(iter(amp.master_params(opt)))
    assert torch.equal(master, torch.full_like(master, 0.125))
    model[0].max_norm = None
    train(model, opt, 1)
    eager_model, eager_opt = build()
    train(eager_model, eager_opt, 3)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5):
        pytest.skip("PyTorch 2.4's functionalization asserts when compiling the renorm of the "
                    "master (fixed in 2.5); the eager part above passed")
    compiled_model, compiled_opt = build()
    train(torch.compile(compiled_model, backend="aot_eager", fullgraph=True), compiled_opt, 3)
    for a, b in zip(amp.master_params(eager_opt), amp.master_params(compiled_opt)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_o2_half_conversion_of_the_fp32_batchnorm_is_refused():
    # model.half() after O2 in fp16: the rest of the model is fp16 already, and the call used
    # to cast the BatchNorm layers amp keeps fp32 (stepped without masters), so Adam failed at
    # its next step with a dtype error from inside torch and SGD went on with BatchNorm in
    # fp16. Refused before anything changes; without fp32 BatchNorm the call passes.
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    before = {k: v.dtype for k, v in model.state_dict(keep_vars=True).items()}
    for convert in (lambda m: m.half(), lambda m: m.to(torch.float16)):
        with pytest.raises(RuntimeError, match=r"from torch\.float32 to torch\.float16.*"
                                               r"BatchNorm layers amp keeps in fp32.*"
                                               r"keep_batchnorm_fp32=False"):
            convert(model)
    assert {k: v.dtype for k, v in model.state_dict(keep_vars=True).items()} == before
    train_step(model, opt, *batch(), amp)
    plain = make_cnn()
    amp.initialize(plain, opt_level="O2", dtype=torch.float16, keep_batchnorm_fp32=False,
                   verbosity=0)
    plain.half()  # (nothing fp32 left to cast)


@pytest.mark.parametrize("opt_level,extra", [("O3", {}), ("O2", {"master_weights": False})])
def test_optimizer_state_made_before_initialize_follows_a_half_parameter(opt_level, extra):
    # Adagrad makes its state ("sum") in its constructor. Where a parameter becomes half with
    # no master (O3, O2 without masters), that state used to stay fp32: fused Adagrad failed at
    # its first step, and a checkpoint round trip (load_state_dict casts state to the
    # parameter's dtype) resumed from other values. It is cast with its parameter, so the
    # step equals that of a plain .bfloat16() model whose Adagrad was made after the cast.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model).bfloat16()
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-2, initial_accumulator_value=0.1)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=1e-2, initial_accumulator_value=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, loss_scale=1.0,
                   verbosity=0, **extra)
    for p in model.parameters():
        assert opt.state[p]["sum"].dtype == torch.bfloat16
        assert opt.state[p]["step"].dtype == torch.float32  # (the count stays as it is)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x.bfloat16()).float().pow(2).mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_o3_casts_optimizer_state_kept_in_lists_as_load_state_dict_does():
    # LBFGS keeps its history in lists (old_dirs, old_stps, ro, al). Only top-level state
    # tensors were cast: a warm-started LBFGS failed at its first O3 step ("dot : expected both
    # vectors to have same dtype"). Reference: a .bfloat16() model whose LBFGS loaded the same
    # state (Optimizer.load_state_dict casts inside the lists), stepped the same way.
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    model = nn.Linear(8, 4)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)

    def closure_of(net, optimizer, scaled_backward):
        def closure():
            optimizer.zero_grad()
            loss = (net(x.to(next(net.parameters()).dtype)).float() - y).square().mean()
            scaled_backward(loss, optimizer)
            return loss
        return closure

    def plain_backward(loss, _optimizer):
        loss.backward()

    def amp_backward(loss, optimizer):
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()

    for _ in range(2):  # (fp32 steps before: the history lists fill)
        opt.step(closure_of(model, opt, plain_backward))
    ref = copy.deepcopy(model).bfloat16()
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.5, max_iter=3)
    ref_opt.load_state_dict(opt.state_dict())
    amp.initialize(model, opt, opt_level="O3", dtype=torch.bfloat16, loss_scale=1.0,
                   verbosity=0)
    state = opt.state[next(model.parameters())]
    assert state["old_dirs"] and all(t.dtype == torch.bfloat16 for t in state["old_dirs"])
    for _ in range(2):
        opt.step(closure_of(model, opt, amp_backward))
        ref_opt.step(closure_of(ref, ref_opt, plain_backward))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_optimizer_state_holding_a_named_tuple_goes_through_initialize():
    """An optimizer whose per-parameter state holds a named tuple (a custom optimizer's
    record made in its constructor) goes through O3's cast of the state it already holds:
    lists and tuples are rebuilt with their tensors cast, but a named tuple cannot be built
    from one list of items, so it is left as it is (its own type and values), and training
    runs (M26)."""
    import collections

    record = collections.namedtuple("Record", ["last", "count"])

    class RecordingSGD(torch.optim.SGD):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["record"] = record(torch.zeros_like(p), 0)

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = RecordingSGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O3", dtype=torch.bfloat16, loss_scale=1.0,
                   verbosity=0)
    for p in model.parameters():
        kept = opt.state[p]["record"]
        assert type(kept) is record and kept.count == 0
        assert torch.equal(kept.last, torch.zeros(p.shape))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_o3_casts_optimizer_state_kept_in_tuples_as_load_state_dict_does():
    """State an optimizer keeps in tuples (a custom optimizer's pair of moments) follows a
    parameter made half at O3 as Optimizer.load_state_dict casts it (inside tuples too), and
    stays a tuple: left fp32, its first step mixes dtypes. Reference: a .bfloat16() copy's
    optimizer that loaded the same state. (M06)"""
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        opt.state[p]["moments"] = (torch.randn(p.shape, generator=g),
                                   torch.rand(p.shape, generator=g))
    ref = copy.deepcopy(model).bfloat16()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    amp.initialize(model, opt, opt_level="O3", dtype=torch.bfloat16, verbosity=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        got, want = opt.state[p]["moments"], ref_opt.state[q]["moments"]
        assert type(got) is tuple and type(want) is tuple
        assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.bfloat16] * 2
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


class _ShardedLike(torch.optim.Optimizer):
    """Shaped like ZeroRedundancyOptimizer: steps an inner optimizer (``.optim``) that holds
    the parameters in param_groups of its own."""

    def __init__(self, params):
        params = list(params)
        super().__init__(params, {"lr": 0.1})
        self.optim = torch.optim.SGD(params, lr=0.1)

    def step(self, closure=None):
        return self.optim.step(closure)


def test_o2_refuses_an_optimizer_stepping_an_inner_optimizer_of_its_own():
    # ZeroRedundancyOptimizer steps its inner optimizer, built over the half parameters; O2's
    # masters go into the outer param_groups only, so the model silently never trained.
    # Refused before anything changes; O1 and LARC (whose param_groups are its inner
    # optimizer's) go through.
    from mixprec.parallel import LARC

    model = make_cnn()
    opt = _ShardedLike(model.parameters())
    with pytest.raises(ValueError, match=r"_ShardedLike steps an inner SGD \(its `\.optim`\).*"
                                         r"would not train.*opt_level='O1'"):
        amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p is q for p, q in zip(model.parameters(), opt.param_groups[0]["params"]))
    amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    larc_model = make_cnn()
    larc = LARC(torch.optim.SGD(larc_model.parameters(), lr=0.1))
    amp.initialize(larc_model, larc, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    before = [m.detach().clone() for m in amp.master_params(larc)]
    train_step(larc_model, larc, *batch(), amp)
    assert all(not torch.equal(m, b) for m, b in zip(amp.master_params(larc), before))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_o2_refuses_zero_redundancy_optimizer():
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = make_cnn()
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                      lr=0.1)
        with pytest.raises(ValueError, match="ZeroRedundancyOptimizer steps an inner SGD"):
            amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_o2_refuses_a_model_already_inside_a_subclass_of_torchs_ddp():
    """A model held (through a wrapper module) by a subclass of torch's
    DistributedDataParallel built before initialize (Lightning 1.x wraps its module in its
    own DDP subclass before its Apex plugin calls initialize) is refused at O2 as for torch's
    own class: the cast would drop DDP's gradient hooks and the ranks would silently stop
    averaging. Nothing is changed by the refusal. (E02)"""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")

    class LightningStyleDDP(nn.parallel.DistributedDataParallel):
        pass

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = make_mlp()
        ddp = LightningStyleDDP(nn.ModuleDict({"inner": model}))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"the Sequential passed is inside a "
                                             r"LightningStyleDDP built before initialize"):
            amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert not amp.is_amp_model(model)
        del ddp
    finally:
        dist.destroy_process_group()


# A group added after initialize to an optimizer that steps an inner optimizer of its own
# (ZeroRedundancyOptimizer's add_param_group adds it to its local optimizer too) is refused
# for half parameters too, not only for those initialize cast.
def test_o2_refuses_a_late_half_group_that_an_inner_optimizer_of_its_own_steps():
    class Sharded(torch.optim.Optimizer):
        """Steps an inner SGD holding its own copy of each group added after construction."""

        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})
            self.optim = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

        def add_param_group(self, group):
            super().add_param_group(group)
            if hasattr(self, "optim"):
                self.optim.add_param_group({"params": list(self.param_groups[-1]["params"])})

        def step(self, closure=None):
            return self.optim.step(closure)

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = Sharded(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    head = nn.Linear(4, 2).bfloat16()
    opt.add_param_group({"params": list(head.parameters())})
    x = torch.randn(3, 4).bfloat16()
    with pytest.raises(ValueError, match=r"Sharded steps an inner SGD \(its `\.optim`\)"):
        with amp.scale_loss(head(model(x).bfloat16()).float().sum(), opt) as s:
            s.backward()


# O3 casts optimizer state kept in nested dicts (a third-party optimizer's) to the
# parameter's dtype, as Optimizer.load_state_dict casts it.
def test_o3_casts_optimizer_state_kept_in_dicts_as_load_state_dict_does():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["extra"] = {"sums": torch.ones(2, 3), "count": 3}
    ref = copy.deepcopy(model).bfloat16()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.load_state_dict(opt.state_dict())
    amp.initialize(model, opt, opt_level="O3", dtype=torch.bfloat16, verbosity=0)
    got, want = opt.state[model.weight]["extra"], ref_opt.state[ref.weight]["extra"]
    assert got["sums"].dtype == want["sums"].dtype == torch.bfloat16
    assert got["count"] == want["count"] == 3


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_o1_autocast_follows_a_device_move_after_initialize(target):
    # initialize on one device, then move (`model.cuda()` after initialize, which docs/amp.md
    # allows): O1's autocast must run for the new device type. It stayed the old one, so on
    # CUDA nothing was cast (silently fp32). On CPU the move shown is meta -> cpu.
    if target == "cuda" and not torch.cuda.is_available():
        pytest.skip("requires CUDA")
    source = "meta" if target == "cpu" else "cpu"
    with torch.device(source):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = amp.initialize(model, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    model = model.to_empty(device=target) if source == "meta" else model.to(target)
    torch.manual_seed(0)
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    out = model(torch.randn(3, 4, device=target))
    assert seen == [torch.bfloat16]
    assert out.dtype == torch.float32  # (O1 hands fp32 outputs back)
    config = model._mixprec_forward
    model.to(target)  # a move to where it already is keeps the same config
    assert model._mixprec_forward is config


def test_a_tensorless_batchnorm_follows_its_model_across_moves():
    # O1 with keep_batchnorm_fp32: a BatchNorm that holds no tensor (affine=False,
    # track_running_stats=False) has no device of its own; its fp32 guard must follow the
    # model's device type, not fall back to "cpu" on any .to() (on a GPU model that left
    # CUDA autocast on inside it). Shown with the meta device, this machine's second one.
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3),
                              nn.BatchNorm2d(4, affine=False, track_running_stats=False))
    model = amp.initialize(model, opt_level="O1", keep_batchnorm_fp32=True, verbosity=0)
    guard = model[1]._mixprec_forward
    assert guard.fp32_compute and guard.device_type == "meta"
    model.to(memory_format=torch.channels_last)  # a move within the device
    assert model[1]._mixprec_forward.device_type == "meta"
    model.to_empty(device="cpu")
    assert model[1]._mixprec_forward.device_type == "cpu"
    assert model._mixprec_forward.device_type == "cpu"


class _NamedInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

    def forward(self, x, extra=None, *, scale=1.0):
        """Scores from x, plus scale times those from extra."""
        out = self.a(x)
        return out if extra is None else out + scale * self.b(extra)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_the_forward_shows_the_models_signature(opt_level):
    # Tools bind arguments by the forward's parameter names (torch.export's dynamic_shapes,
    # transformers' Trainer picking the dataset columns the model takes); amp's forward
    # showed (*args, **kwargs).
    import inspect

    model = _NamedInputs()
    want = inspect.signature(model.forward)
    amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    assert inspect.signature(model.forward) == want
    assert list(inspect.signature(model.forward).parameters) == ["x", "extra", "scale"]
    # and its docstring (help(model), an IDE's tooltip, documentation built from it). (A16)
    assert model.forward.__doc__ == "Scores from x, plus scale times those from extra."
    x, e = torch.randn(2, 4), torch.randn(2, 2)
    plain = amp.restore_model(copy.deepcopy(model))
    cast = torch.bfloat16 if opt_level == "O2" else torch.float32
    got = model(x, extra=e, scale=2.0)
    assert got.dtype == torch.float32
    tol = {} if opt_level == "O2" else {"rtol": 2e-2, "atol": 2e-2}  # (O1: bf16 ops vs fp32)
    torch.testing.assert_close(got, plain(x.to(cast), extra=e.to(cast), scale=2.0).float(),
                               **({"rtol": 0, "atol": 0} if not tol else tol))


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("source", ["model", "deepcopy", "torch.load"])
def test_torch_export_of_an_o2_model_and_of_its_copies(source, strict):
    # A copy (an EMA, a model saved whole with torch.save) keeps its own masters: exporting it
    # recursed without end (non-strict) or met a disabled function (strict), from the push of
    # written masters in its forward. dynamic_shapes go by the forward's parameter names.
    if strict and source != "model" and not hasattr(torch.compiler, "_is_exporting_flag"):
        pytest.skip("strict export of a copy needs torch.compiler.is_exporting (PyTorch 2.7): "
                    "before, Dynamo refuses the disabled master push in the copy's forward")
    model = _NamedInputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 4)
    with amp.scale_loss(nn.functional.mse_loss(model(x), torch.zeros(3, 3)), opt) as loss:
        loss.backward()
    opt.step()
    if source == "deepcopy":
        model = copy.deepcopy(model)
    elif source == "torch.load":
        model = saved_whole(model)
    batch_dim = torch.export.Dim("batch", max=64)
    program = torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch_dim}},
                                  strict=strict)
    exported = program.module()
    for rows in (3, 7):
        xr = torch.randn(rows, 4)
        out = exported(xr)
        assert out.dtype == torch.float32  # (amp's casts are in the program)
        torch.testing.assert_close(out, model(xr), rtol=0, atol=0)


@pytest.mark.parametrize("then", ["export", "forward_then_export", "state_dict_then_export"])
@pytest.mark.parametrize("source", ["model", "deepcopy", "optimizer_deleted",
                                    "weights_optimizer_deleted"])
def test_a_non_strict_export_warns_of_masters_written_since_the_last_cast(source, then):
    # A write into the masters (dcp.load into model.state_dict(), an EMA update of a copy's
    # state dict) reaches the half parameters at the next eager forward or state_dict(); a
    # non-strict torch.export (torch.onnx.export's default exporter too) traces on fake
    # parameters and took the old half weights silently. It warns now; after a forward or a
    # state_dict() it neither warns nor differs. Reference: the model's eager forward, exact.
    # (weights_optimizer_deleted: weights and biases in two optimizers, the weights' deleted,
    # the biases' alive; its masters are looked at as a copy's.)
    if not hasattr(torch.compiler, "_is_exporting_flag"):
        pytest.skip("needs torch.compiler's export flag (PyTorch 2.7)")
    model = _NamedInputs()
    if source == "weights_optimizer_deleted":
        opts = [torch.optim.SGD([p for n, p in model.named_parameters() if n.endswith(k)],
                                lr=0.1) for k in ("weight", "bias")]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    amp.initialize(model, opts, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 4)
    for _ in range(2):
        with amp.scale_loss(nn.functional.mse_loss(model(x), torch.zeros(3, 3)), opts) as loss:
            loss.backward()
        for opt in opts:
            opt.step()
    if source == "deepcopy":
        model = copy.deepcopy(model)
    elif source.endswith("optimizer_deleted"):
        del opt, opts[0], loss
        gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (after training: nothing written, no warning)
        torch.export.export(model, (x,), strict=False)
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if source != "weights_optimizer_deleted" or k.endswith("weight"):
                v.mul_(0.5)
    if then == "forward_then_export":
        with torch.no_grad():
            model(x)
    elif then == "state_dict_then_export":
        model.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = torch.export.export(model, (x,), strict=False)
    ours = [w for w in caught if "master weights written in place" in str(w.message)]
    exported = program.module()(x)
    if then == "export":
        assert len(ours) >= 1 and "Call model.state_dict() or run one eager forward" in str(ours[0].message)
        assert not torch.equal(exported, model(x))  # (the warning's reason; the forward pushes)
    else:
        assert not ours
        torch.testing.assert_close(exported, model(x), rtol=0, atol=0)


def test_a_compiled_copy_runs_on_the_masters_written_into_its_state_dict():
    # An EMA copy (timm's ModelEmaV2 writes its state dict in place) under torch.compile: the
    # push of written masters into the half parameters runs eagerly (a graph break), and
    # must still run (the guard against export's re-entry must not stop it).
    model = _NamedInputs()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                   dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 4)
    # The model compiled first, the usual order: Dynamo (2.13) guarded no value read from a
    # module's __dict__, so the copy's compiled forward reused the model's graph, which has
    # no push (the EMA's writes never reached its outputs).
    torch.compile(model, backend="eager")(x)
    ema = copy.deepcopy(model)
    compiled = torch.compile(ema, backend="eager")
    compiled(x)
    with torch.no_grad():
        for v in ema.state_dict().values():
            v.mul_(0.5)
    got = compiled(x)
    assert torch.equal(ema.a.weight, (model.a.weight.float() * 0.5).bfloat16())
    torch.testing.assert_close(got, ema(x), rtol=0, atol=0)
    torch.testing.assert_close(got, model(x) * 0.5, rtol=0, atol=0)


def test_a_compiled_model_with_an_instance_forward_runs_its_own_graph():
    # Two models of one class, one with a forward set on the instance before initialize:
    # compiled after the other, it ran the other's graph (the class's forward).
    class Net(nn.Linear):
        def forward(self, x, scale=1.0):
            return super().forward(x) * scale

    x = torch.randn(3, 4)
    plain = amp.initialize(Net(4, 2), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    scaled = Net(4, 2)
    scaled.forward = functools.partial(scaled.forward, scale=2.0)
    amp.initialize(scaled, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    torch.compile(plain, backend="eager")(x)
    got = torch.compile(scaled, backend="eager")(x)
    torch.testing.assert_close(got, scaled(x), rtol=0, atol=0)
    torch.testing.assert_close(got, amp.restore_model(copy.deepcopy(scaled))(x.bfloat16())
                               .float(), rtol=0, atol=0)


def test_a_staticmethod_forward_keeps_amps_signature_and_exports():
    class Static(nn.Module):
        @staticmethod
        def forward(x):
            return x * 2

    model = amp.initialize(Static(), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3)
    program = torch.export.export(model, (x,), strict=False)
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=0)


def test_a_module_answering_unknown_names_keeps_amps_forward():
    # A wrapper whose __getattr__ forwards unknown names to an inner module (PEFT-, FSDP1-,
    # checkpoint-wrapper style): amp's per-instance reads fell through to it for an instance
    # whose dict lacks them (pickled by an earlier mixprec, or not prepared by amp), and ran
    # the inner module's instance forward in place of the wrapper's.
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name == "inner":
                    raise
                return getattr(self.inner, name)

    inner = nn.Linear(4, 2)
    inner.forward = functools.partial(inner.forward)  # (an instance forward)
    model = Wrapper(inner)
    amp.initialize([model, model.inner], opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 4)
    want = model(x)
    torch.testing.assert_close(want, model.inner(x) * 2, rtol=0, atol=0)
    for key in ("_mixprec_instance_forward", "_mixprec_in_instance_forward",
                "_mixprec_own_masters"):
        del model.__dict__[key]  # (as in a model pickled before these keys)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    unprepared = copy.copy(model)  # (an instance of the swapped class amp did not prepare)
    del unprepared.__dict__["_mixprec_forward"]
    torch.testing.assert_close(unprepared(x.bfloat16()).float(), want, rtol=0, atol=0)


def test_a_partialmethod_forward_shows_its_signature():
    import inspect

    class Net(nn.Linear):
        def _forward(self, x, mask=None, *, k=2):
            return super().forward(x) * k

        forward = functools.partialmethod(_forward, k=3)

    want = inspect.signature(Net(4, 2).forward)
    model = amp.initialize(Net(4, 2), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    assert inspect.signature(model.forward) == want
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), amp.restore_model(copy.deepcopy(model))(
        x.bfloat16()).float(), rtol=0, atol=0)


def test_fx_symbolic_trace_says_what_works_and_the_restored_copy_traces():
    model = make_mlp()
    amp.initialize(model, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(RuntimeError, match=r"torch\.fx\.symbolic_trace of a model prepared by "
                                           r"amp\.initialize \(Sequential\).*restore_model"):
        torch.fx.symbolic_trace(model)
    graph = torch.fx.Graph()  # (a Proxy made by hand: fx's retracing pattern)
    tracer = torch.fx.proxy.GraphAppendingTracer(graph)
    with pytest.raises(RuntimeError, match=r"torch\.fx\.symbolic_trace of a model prepared"):
        model(torch.fx.Proxy(graph.placeholder("x"), tracer))
    outer = nn.Sequential(nn.Identity(), model)  # (amp's model inside a traced one)
    with pytest.raises(RuntimeError, match=r"torch\.fx\.symbolic_trace of a model prepared"):
        torch.fx.symbolic_trace(outer)

    class ByKeyword(nn.Module):  # (the input by keyword, HF-style)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(input=x)

    with pytest.raises(RuntimeError, match=r"torch\.fx\.symbolic_trace of a model prepared"):
        torch.fx.symbolic_trace(ByKeyword(model))
    # A slice of an amp Sequential is no amp model (a plain part of the half model): traced
    # inside another module as any module is.
    part = nn.Sequential(nn.Identity(), model[:2])
    half_x = torch.randn(3, 4).bfloat16()
    traced_part = torch.fx.symbolic_trace(part)(half_x)
    assert traced_part.dtype == torch.bfloat16  # (no amp casts: the part's own dtype)
    torch.testing.assert_close(traced_part, part(half_x), rtol=0, atol=0)
    traced = torch.fx.symbolic_trace(amp.restore_model(copy.deepcopy(model)))
    x = torch.randn(3, 4)
    torch.testing.assert_close(traced(x.bfloat16()).float(), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("convert", ["half", "bfloat16", "to"])
def test_o1_conversion_to_half_is_refused(convert):
    # An fp16 O1 model .half()-ed trained as pure half with half checkpoints; .bfloat16()-ed
    # it failed inside BatchNorm at the next forward. Refused before anything changes.
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", dtype=torch.float16, verbosity=0)
    calls = {"half": lambda m: m.half(), "bfloat16": lambda m: m.bfloat16(),
             "to": lambda m: m.to(torch.float16)}
    with pytest.raises(RuntimeError, match=r"at O1 from torch\.float32 to torch\.(float16|"
                                           r"bfloat16).*opt_level='O2'"):
        calls[convert](model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model.float()  # (no change: passes)
    model.to("cpu")
    train_step(model, opt, *batch(), amp)
    amp.restore_model(model).half()  # (the way round the message names)
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_o1_model_double_runs_as_a_float64_reference():
    """``.double()`` of an O1 model is allowed (only a cast of its fp32 tensors to a half type
    is refused): a float64 reference copy of the model runs as such, autocast leaving float64
    ops alone, and matches the same float64 model without amp. (A09)"""
    model = make_mlp()
    ref = copy.deepcopy(model).double()
    amp.initialize(model, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    model.double()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    x = torch.randn(3, 4, dtype=torch.float64)
    out = model(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_torch_jit_script_says_what_works_and_the_restored_copy_scripts(opt_level):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script of a model prepared by amp\."
                       r"initialize \(Sequential\).*torch\.jit\.trace and torch\.export work"):
        torch.jit.script(model)
    x = torch.randn(3, 4)
    scripted = torch.jit.script(amp.restore_model(copy.deepcopy(model)))
    want = model(x)
    if opt_level == "O2":  # (the caller casts the inputs; the outputs stay half)
        torch.testing.assert_close(scripted(x.bfloat16()).float(), want, rtol=0, atol=0)
    else:  # (an fp32 model without autocast: fp32 compute, near O1's bf16)
        torch.testing.assert_close(scripted(x), want, rtol=2e-2, atol=2e-2)
    traced = torch.jit.trace(model, (x,))  # (as it is)
    torch.testing.assert_close(traced(x), want, rtol=0, atol=0)
    # The original keeps amp's forward (at O2 an fp32 input would fail without it).
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_initialize_in_other_threads_does_not_break_training_in_one():
    # Trials initialized in two threads (a hyper-parameter search) while a third trains: amp's
    # registry of optimizer states was walked through WeakKeyDictionary.values(), a generator
    # (an insertion from another thread: "dictionary changed size during iteration" in
    # model.zero_grad()), then through list(d.items()), during which the garbage collector
    # ran a dead optimizer's removal callback (the same error, in initialize); the deque of
    # recent parameter registrations was walked while another thread built a model ("deque
    # mutated during iteration" in optimizer.step()).
    import gc
    import sys
    import threading

    def make(level, seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        return amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level=level,
                              dtype=torch.bfloat16, verbosity=0)

    live = [make("O1", 1000 + i) for i in range(150)]  # (other jobs alive in the process)
    model, opt = make("O2", 0)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    errors, done = [], threading.Event()

    def training():
        try:
            while not done.is_set():
                model.zero_grad()
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
        except RuntimeError as e:
            errors.append(e)

    def initializing(offset):
        try:
            for i in range(250):
                m, o = make(("O1", "O2", "O3")[i % 3], offset + i)
                m.zero_grad()
                del m, o
                if i % 50 == 0:
                    gc.collect()
        except RuntimeError as e:
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        trainer = threading.Thread(target=training)
        trainer.start()
        trials = [threading.Thread(target=initializing, args=(k * 1000,)) for k in (1, 2)]
        for t in trials:
            t.start()
        for t in trials:
            t.join(timeout=120)
    finally:
        done.set()
        trainer.join(timeout=60)
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert len(live) == 150


@pytest.mark.parametrize("threshold", range(1, 6))
def test_recent_registrations_are_read_whole_while_another_thread_appends(monkeypatch,
                                                                           threshold):
    """The walk over the recent parameter registrations (a step looking for renamed
    parameters) completes while another thread appends to them: the garbage collector,
    run by the allocation of the walk's tuple, calls finalizers in Python, where another
    thread building a model may append, and ``tuple(deque)`` then raised "deque mutated
    during iteration" inside optimizer.step() (the thread test above, once in CI). Here the
    append comes from a collection's start callback, the collector made to run at one of
    the first allocations (on CPython 3.11 one of these thresholds lands mid-walk; where none
    does, the test passes without the race); the result is the registrations after the count
    asked for, with the appended one or without it, never an error. Reference: the entries
    put in."""
    import collections
    import gc

    from mixprec.amp import _model

    recent = collections.deque(((n, 10_000 + n) for n in range(1, 3001)), maxlen=4096)
    monkeypatch.setattr(_model, "_recent_registrations", recent)
    monkeypatch.setattr(_model, "_parameter_registrations", 3001)
    appended = []

    def append_at_start(phase, info):
        if phase == "start" and not appended:
            appended.append(True)
            recent.append((3001, 99_999))

    previous = gc.get_threshold()
    gc.collect()
    gc.callbacks.append(append_at_start)
    gc.set_threshold(threshold)
    try:
        got = _model.registered_since(2995)
    finally:
        gc.set_threshold(*previous)
        gc.callbacks.remove(append_at_start)
    want = {10_000 + n for n in range(2996, 3001)}
    assert got in (want, want | {99_999}), sorted(got)


class _GatedNet(nn.Module):
    """``fc(x) * scale``; given ``gate`` (two events), it says it is inside and waits."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, scale=1.0, gate=None):
        if gate is not None:
            gate[0].set()
            gate[1].wait(timeout=60)
        return self.fc(x) * scale


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_model_with_an_instance_forward_called_from_two_threads_at_once(opt_level):
    # A forward set on the instance before initialize (functools.partial) runs inside amp's
    # casts; the mark that it was running was one per model, so another thread calling the
    # model meanwhile (an inference server) skipped amp and the partial: O1 gave a result
    # without its scale, O2 failed on the dtypes. Thread a is held inside the forward while
    # thread b calls.
    torch.manual_seed(0)
    model = _GatedNet()
    model.forward = functools.partial(model.forward, scale=2.0)
    model = amp.initialize(model, opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
    entered, release, got = threading.Event(), threading.Event(), []

    def a():
        with torch.no_grad():
            got.append(("a", model(x, gate=(entered, release))))

    def b():
        entered.wait(timeout=60)
        try:
            with torch.no_grad():
                got.append(("b", model(x)))
        except RuntimeError as e:
            got.append(("b", e))
        finally:
            release.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(name for name, _ in got) == ["a", "b"]
    for name, out in got:
        assert isinstance(out, torch.Tensor), (name, out)
        torch.testing.assert_close(out, want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("opt_level,with_optimizer,warns", [
    ("O2", True, True), ("O1", True, False), ("O3", True, False), ("O2", False, False)])
def test_share_memory_of_a_model_with_masters_warns(opt_level, with_optimizer, warns):
    # Hogwild (torch.multiprocessing) of an O2 model: the half parameters are shared, the
    # fp32 masters (this process's optimizer) are not, so the other processes' updates never
    # reached them and this process's next step overwrote them, silently.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    kw = dict(opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    if with_optimizer:
        model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    else:
        model = amp.initialize(model, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert model.share_memory() is model
    assert model.weight.is_shared()
    messages = [str(w.message) for w in caught if "share_memory" in str(w.message)]
    assert len(messages) == (1 if warns else 0), messages
    if warns:
        assert "fp32 master weights" in messages[0] and "opt_level='O1'" in messages[0]


def test_compiled_models_with_instance_forwards_share_their_graph():
    # Four blocks of one class, each with a forward set on the instance, compiled one by one
    # (eager backend): the instance forward's per-thread bookkeeping, traced, keyed on id()
    # and tied each graph to one block (a recompile per block, up to Dynamo's limit, after
    # which amp models ran eagerly). Outputs checked against eager.
    from torch._dynamo.utils import counters

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, scale=1.0):
            return self.fc(x) * scale

    torch.manual_seed(0)
    blocks = []
    for _ in range(4):
        block = Block()
        block.forward = functools.partial(block.forward, scale=2.0)
        blocks.append(amp.initialize(block, opt_level="O1", dtype=torch.bfloat16,
                                     verbosity=0))
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = [b(x) for b in blocks]
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        got = [torch.compile(b, backend="eager", fullgraph=True)(x)
               for b in blocks for _ in range(2)]
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 10):
        # (Dynamo before 2.10 compiles a graph per module object here, with or without this
        # bookkeeping. Before 2.7 it could not trace the mark's store into the module's
        # __dict__ either: fullgraph=True raised, and each call broke its graph there.)
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    for i, out in enumerate(got):
        torch.testing.assert_close(out, want[i // 2], rtol=0, atol=0)


def test_a_copy_or_compiled_call_made_while_a_thread_is_inside_the_instance_forward():
    # The instance forward's flag counts the eager calls inside: a deep copy taken while one
    # was (an EMA, a checkpoint thread's torch.save) carried the count, and compiled, the
    # copy skipped amp's casts and the instance forward; so did a compiled call of the model
    # itself made meanwhile (O1: 1.7 and 0.9 off; O2: dtype errors).
    torch.manual_seed(0)
    model = _GatedNet()
    model.forward = functools.partial(model.forward, scale=2.0)
    model = amp.initialize(model, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
    entered, release, got = threading.Event(), threading.Event(), {}

    def inside():
        with torch.no_grad():
            model(x, gate=(entered, release))

    thread = threading.Thread(target=inside)
    thread.start()
    try:
        assert entered.wait(timeout=60)
        copies = {"deepcopy": copy.deepcopy(model), "pickle": pickle.loads(pickle.dumps(model))}
        torch._dynamo.reset()
        with torch.no_grad():
            got["compiled during"] = torch.compile(model, backend="eager")(x)
    finally:
        release.set()
        thread.join(timeout=60)
    with torch.no_grad():
        for name, c in copies.items():
            got[name] = torch.compile(c, backend="eager")(x)
    torch._dynamo.reset()
    for name, out in got.items():
        torch.testing.assert_close(out, want, rtol=0, atol=0, msg=name)


def test_initialize_refuses_a_bool_num_losses():
    # (a mutation of frontend.py: the bool test removed): num_losses=True is an int to isinstance
    # and was taken as 1; the check names it as not an int >= 1.
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"num_losses=True\): must be an int >= 1"):
        amp.initialize(model, opt, opt_level="O1", num_losses=True, verbosity=0)


def test_scale_bounds_out_of_order_are_named_as_initializes_before_any_change():
    # (a mutation of frontend.py: check_scale_order("amp.initialize", ...) deleted): the order was
    # then refused only by LossScaler, late: the message named a class the user never called, and a
    # model .half()-ed by the user had its BatchNorm cast back to fp32 before the error.
    model = make_cnn().half()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"^amp\.initialize\(min_loss_scale=1024\.0, "
                                             r"max_loss_scale=256\.0\): min_loss_scale must"):
            amp.initialize(model, opt_level="O2", min_loss_scale=2.0**10,
                           max_loss_scale=2.0**8, verbosity=0)
    assert model.features[1].weight.dtype == torch.float16


def test_an_already_half_model_gets_its_batchnorm_back_in_fp32_at_o2():
    # (O2's keep_batchnorm_fp32: a model .half()-ed before initialize has its BatchNorm cast
    # back to fp32, parameters and running statistics.)
    model = make_cnn().half()
    with pytest.warns(UserWarning, match="already torch.float16"):
        amp.initialize(model, opt_level="O2", verbosity=0)
    bn = model.features[1]
    assert isinstance(bn, nn.BatchNorm2d)
    for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var):
        assert t.dtype == torch.float32
    assert model.features[0].weight.dtype == torch.float16


def test_an_already_half_model_gets_its_batchnorm_back_in_fp32_at_o3_with_keep_batchnorm():
    """O3 with keep_batchnorm_fp32=True (Apex's recipe for a half model whose BatchNorm stays
    fp32) casts the BatchNorm of a model .half()-ed before initialize back to fp32, parameters
    and running statistics, as at O2; the optimizer steps those fp32 parameters themselves
    (O3 makes no masters), and the rest of the model stays half. (E22)"""
    model = make_cnn().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O3", keep_batchnorm_fp32=True, verbosity=0)
    bn = model.features[1]
    for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var):
        assert t.dtype == torch.float32
    assert model.features[0].weight.dtype == torch.float16
    held = [p for g in opt.param_groups for p in g["params"]]
    assert any(p is bn.weight for p in held) and any(p is bn.bias for p in held)
    x, y = batch()
    train_step(model, opt, x, y, amp)
    assert bn.weight.dtype == torch.float32 and torch.isfinite(bn.weight).all()


# -- mutation run r50A over mixprec/amp/_model.py: what the tests above let through --------

@pytest.mark.parametrize("convert", ["double", "bfloat16"])
def test_o0_makes_a_model_of_another_dtype_fp32(convert):
    # O0 is Apex's fp32 baseline: cast_model_type=torch.float32 casts the model's floating
    # parameters and buffers to fp32 (as the forward casts floating inputs to fp32). A model
    # built in float64 or in bf16 runs as the same model in fp32. (Mutant CV10: the model was
    # left as it was, and the fp32 inputs met float64 / bf16 weights.)
    model = getattr(make_mlp(), convert)()
    ref = copy.deepcopy(model).float()
    amp.initialize(model, opt_level="O0", verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randn(3, 4, dtype=torch.float64)
    out = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref(x.float()), rtol=0, atol=0)


def test_a_part_taken_out_of_a_model_later_restored_can_be_prepared_on_its_own():
    # initialize refuses a part of a live O2 model (its casts would run inside the half
    # model). Once that model is restored (amp.restore_model) it is no amp model any more,
    # and a layer taken out of it before may be prepared on its own. (Mutant CP01: the
    # lookup answered the restored model, and initialize refused the layer.)
    torch.manual_seed(0)
    outer = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    amp.initialize(outer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    part = outer[2]
    outer[2] = nn.Identity()
    amp.restore_model(outer)
    part.float()
    amp.initialize(part, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    out = part(torch.randn(3, 4))
    assert part.weight.dtype == torch.bfloat16 and out.dtype == torch.float32


def test_a_verbosity_above_one_is_accepted_and_logs(caplog):
    """``verbosity`` is an int >= 0 (Apex's scripts pass 2 and more): any positive value
    keeps amp's log messages on. (M08)"""
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        amp.initialize(make_cnn(), opt_level="O2", verbosity=2)
    assert "opt_level O2" in caplog.text


def test_only_rank_zero_warns_and_logs_in_initialize(monkeypatch, caplog):
    """``initialize`` runs on every rank of a job: the already-half warning and the opt-level
    summary come from rank 0 alone, or an 8-rank job prints each eight times. Here the process
    is made a non-zero rank. (M27; M25 too)"""
    monkeypatch.setattr("mixprec.amp.frontend.is_rank_zero", lambda: False)
    monkeypatch.setattr("mixprec.amp._logging.is_rank_zero", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.INFO, logger="mixprec.amp"):
            amp.initialize(make_cnn().half(), opt_level="O2", verbosity=1)
            model = make_cnn()
            amp.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O3",
                           verbosity=1)
    assert caplog.text == ""


@pytest.mark.parametrize("opt_level, kw, want", [
    ("O2", dict(master_weights=False, loss_scale=128.0),
     "amp: opt_level O2 (half model (BatchNorm fp32), fp32 master weights): opt_level=O2, "
     "half_dtype=torch.float16, cast_model_type=torch.float16, patch_torch_functions=False, "
     "keep_batchnorm_fp32=True, master_weights=False, loss_scale=128.0, cast_model_outputs=None"),
    ("O3", dict(dtype=torch.bfloat16, cast_model_outputs=torch.float32),
     "amp: opt_level O3 (pure half training): opt_level=O3, half_dtype=torch.bfloat16, "
     "cast_model_type=torch.bfloat16, patch_torch_functions=False, keep_batchnorm_fp32=False, "
     "master_weights=False, loss_scale=1.0, cast_model_outputs=torch.float32"),
], ids=["O2-overrides", "O3-bf16"])
def test_initialize_logs_the_levels_description_and_every_resolved_property(opt_level, kw, want,
                                                                            caplog):
    """initialize's log line (Apex printed the properties in effect) names the level with its
    own description and every property as resolved, overrides included: the user reads it to
    check that a config's master_weights=False or loss_scale=128.0 was applied, so it must
    show the values in effect, not the level's defaults. (P11, P12)"""
    with caplog.at_level(logging.INFO, logger="mixprec.amp"):
        amp.initialize(make_cnn(), opt_level=opt_level, verbosity=1, **kw)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("amp: opt_level")
            ] == [want]


def _o2_initialize_then_backward(model, loss, loss_scale):
    """SGD over ``model``, O2 fp16 ``initialize`` (the already-half warning let pass), then
    ``loss``, computed before it, backpropagated through ``scale_loss``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the already-half warning)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                                    loss_scale=loss_scale, verbosity=0)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    return model, opt


@pytest.mark.parametrize("half_before", [False, True])
def test_o2_initialize_between_a_forward_and_its_backward_gives_the_fp32_gradients(half_before):
    """B4 (r88A; b504f9a). A loss computed before amp.initialize and backpropagated after
    (through amp.scale_loss): b504f9a~1 gave the masters the gradients of that forward; since
    b504f9a moves every half parameter's version counter at O2 initialize, the backward
    raises "one of the variables needed for gradient computation has been modified by an
    inplace operation", though the user wrote nothing. Reference: plain PyTorch fp32 (the
    same forward, to 1e-2 where the model was half)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    if half_before:
        model.half()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    loss = model(x.to(model[0].weight.dtype)).float().pow(2).mean()
    model, opt = _o2_initialize_then_backward(model, loss, loss_scale=128.0)
    ref(x).pow(2).mean().backward()
    for master, p in zip(amp.master_params(opt), ref.parameters()):
        torch.testing.assert_close(master.grad, p.grad, rtol=0,
                                   atol=1e-2 if half_before else 1e-6)


def test_o2_initialize_between_a_forward_and_its_backward_with_sliced_siblings_not_in_the_graph():
    """B3 (r89A; 5efd1fc, r88A B4 fixed only where the graph holds every sibling). A model
    .half()-ed before initialize whose q, k, v, u are slices of one tensor (one version
    counter); a loss computed before initialize through q and k alone (v and u belong to
    another branch), backpropagated after it: the shared-counter pass leaves out q and k (the
    graph holds them) but moves v's and u's counters, which are q's and k's, and the backward
    raises "one of the variables needed for gradient computation has been modified by an
    inplace operation". Reference: plain PyTorch (the same half forward and backward), the
    gradients of q and k to 1e-2 (the masters' fp32 gradients of the half forward)."""
    torch.manual_seed(0)
    w = torch.randn(16, 4) * 0.3
    model = nn.Module()
    model.q, model.k, model.v, model.u = (nn.Parameter(w[i * 4:(i + 1) * 4]) for i in range(4))
    model.half()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).half()

    def loss_of(m, inp):
        return ((inp @ m.q.t()) * (inp @ m.k.t())).float().sum()

    ref_x = x.clone().requires_grad_()
    loss_of(ref, ref_x).backward()
    x.requires_grad_()  # (an input that needs its gradient: the mm saves q.t() and k.t())
    loss = loss_of(model, x)
    model, opt = _o2_initialize_then_backward(model, loss, loss_scale=1.0)
    masters = dict(zip(["q", "k", "v", "u"], amp.master_params(opt)))
    for name in ("q", "k"):
        torch.testing.assert_close(masters[name].grad, getattr(ref, name).grad.float(),
                                   rtol=0, atol=1e-2, msg=name)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=1e-2)


def test_opt_levels_table_is_read_only_and_apexs():
    """amp.OPT_LEVELS, exported for reading the presets, was the live table: a script that
    set an entry (OPT_LEVELS["O2"]["master_weights"] = False) silently ran every later O2
    without masters. It is read-only at both levels; the presets are Apex's (its
    documentation's table), and a fresh O2 still gets its masters. (r105C R4)"""
    with pytest.raises(TypeError):
        amp.OPT_LEVELS["O2"]["master_weights"] = False
    with pytest.raises(TypeError):
        amp.OPT_LEVELS["O4"] = {}
    want = {"O0": (torch.float32, False, None, False, 1.0),
            "O1": (None, True, None, False, "dynamic"),
            "O2": ("half", False, True, True, "dynamic"),
            "O3": ("half", False, False, False, 1.0)}
    names = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
             "master_weights", "loss_scale")
    assert {k: tuple(v[n] for n in names) for k, v in amp.OPT_LEVELS.items()} == want
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert all(m.dtype == torch.float32 for m in amp.master_params(opt))
    assert all(p.dtype == torch.float16 for p in model.parameters())
