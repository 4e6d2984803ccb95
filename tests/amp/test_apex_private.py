"""Apex's private names that training scripts of its era reach into: ``amp._amp_state`` (the
loss scalers and opt properties), ``optimizer._amp_stash`` and
``optimizer._lazy_init_maybe_master_weights()``, served as views over mixprec's state."""

import copy
import math
import pickle

import pytest
import torch
from torch import nn

import mixprec
from mixprec import amp
from mixprec.amp import frontend
from mixprec.amp._state import optimizer_state

from .helpers import batch, make_cnn, train_step

# SGD steps with the scale on the host (one sync per step); fused AdamW with the dynamic
# scale on the device (CPU tensors here), updated by kernels.
LR = {"host": 0.05, "device": 1e-3}
OPTIMIZERS = {
    "host": lambda params: torch.optim.SGD(params, lr=LR["host"], momentum=0.9),
    "device": lambda params: torch.optim.AdamW(params, lr=LR["device"], fused=True),
}


def _setup(where="host", opt_level="O2", **kw):
    model = make_cnn()
    opt = OPTIMIZERS[where](model.parameters())
    kw.setdefault("verbosity", 0)
    return (*amp.initialize(model, opt, opt_level=opt_level, **kw), amp._amp_state)


def _scaled_step(model, opt, x, y, poison=False, loss_id=0):
    """One step; ``poison`` puts an inf into the loss (an overflow). Returns the loss and
    the scaled loss the context manager yielded."""
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    if poison:
        loss = loss * torch.tensor(math.inf)
    with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
        yielded = scaled.detach().clone()
    opt.step()
    return loss.detach(), yielded


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_initial_scale_set_through_amp_state(where):
    # `amp._amp_state.loss_scalers[0]._loss_scale = 2**20` right after initialize (NVIDIA's
    # BERT, ViT and their forks): the first backward runs at that scale.
    model, opt, state = _setup(where)
    state.loss_scalers[0]._loss_scale = 2.0**12
    assert state.loss_scalers[0].loss_scale() == 2.0**12  # Apex's method, not a property
    assert state.loss_scalers[0]._loss_scale == 2.0**12
    x, y = batch()
    loss, yielded = _scaled_step(model, opt, x, y)
    assert float(yielded) == pytest.approx(float(loss) * 2.0**12, rel=1e-6)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**12, "unskipped": 1}}
    on_device = optimizer_state(opt).amp_state.scalers[0].on_device
    assert on_device == (torch.device("cpu") if where == "device" else None)
    # Set again once the scale is in use (on the device with the fused optimizer).
    state.loss_scalers[0]._loss_scale = 2.0**9
    loss, yielded = _scaled_step(model, opt, x, y)
    assert float(yielded) == pytest.approx(float(loss) * 2.0**9, rel=1e-6)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**9


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_unskipped_and_has_overflow_tell_skipped_steps(where):
    # `if amp._amp_state.loss_scalers[0]._unskipped != 0: scheduler.step()` and
    # `global_step += 0 if ..._has_overflow else 1`: the scheduler and the step count follow
    # the steps actually taken. (As in Apex, `_unskipped` is also 0 on the clean step where a
    # dynamic scale grows, every 2000th by default; `_has_overflow` is exact.)
    model, opt, state = _setup(where)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batch()
    poison = [False, True, False, False, True]
    taken, unskipped, overflowed = 0, [], []
    for bad in poison:
        before = [m.detach().clone() for m in amp.master_params(opt)]
        _scaled_step(model, opt, x, y, poison=bad)
        scaler = state.loss_scalers[0]
        unskipped.append(scaler._unskipped)
        overflowed.append(scaler._has_overflow)
        if scaler._unskipped != 0:
            sched.step()
            taken += 1
        moved = any(not torch.equal(b, m) for b, m in zip(before, amp.master_params(opt)))
        assert moved == (not bad)
    assert unskipped == [1, 0, 1, 2, 0]
    assert overflowed == poison
    assert taken == 3 and opt.param_groups[0]["lr"] == pytest.approx(LR[where] / 8)
    assert state.loss_scalers[0].loss_scale() == 2.0**14  # halved twice from 2**16


@pytest.mark.parametrize("opt_level,kw", [
    ("O2", {"dtype": torch.bfloat16}),  # bf16's static 1.0
    ("O0", {}),
    ("O1", {"loss_scale": 128.0}),
], ids=["O2-bf16", "O0", "O1-static"])
def test_a_static_scale_counts_its_steps_as_apex_did(opt_level, kw):
    # Apex counted every step of a static scale in `_unskipped` (and in amp.state_dict()), so
    # the `_unskipped != 0` scheduler recipe also steps the scheduler under bf16 or O0.
    model, opt, state = _setup("host", opt_level, **kw)
    x, y = batch()
    for step in range(1, 4):
        _scaled_step(model, opt, x, y)
        assert state.loss_scalers[0]._unskipped == step
        assert not state.loss_scalers[0]._has_overflow
    scale = kw.get("loss_scale", 1.0)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": scale, "unskipped": 3}}
    assert not state.loss_scalers[0].dynamic


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_scale_seq_len_sets_the_growth_window(where):
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    assert scaler._scale_seq_len == 2000  # Apex's default window
    scaler._scale_seq_len = 2
    scaler._loss_scale = 2.0**10
    x, y = batch()
    scales = []
    for _ in range(5):
        _scaled_step(model, opt, x, y)
        scales.append(scaler.loss_scale())
    assert scales == [2.0**10, 2.0**11, 2.0**11, 2.0**12, 2.0**12]


@pytest.mark.parametrize("clean,window,want", [(5, 3, [2.0, 2.0, 2.0, 4.0]),
                                               (3, 4, [2.0, 2.0, 2.0, 2.0, 4.0])],
                         ids=["shortened", "lengthened"])
@pytest.mark.parametrize("where", OPTIMIZERS)
def test_a_window_set_after_clean_steps_counts_them(where, clean, window, want):
    # Clean steps taken before _scale_seq_len is set count toward the new window, wherever the
    # scale lives. Shortened below them (five, then 3): the next clean step grows the scale,
    # then every third; on the device (a fused optimizer) the kernel grows only when its count
    # reaches the window exactly, and the count was left at 5: it never grew again.
    # Lengthened (three, then 4): the fourth clean step grows it, as Apex counted; setting the
    # window reads the device's count first, not the host's stale one.
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    start = scaler.loss_scale()  # (read before the steps: a read brings the device's count)
    x, y = batch()
    for _ in range(clean):
        _scaled_step(model, opt, x, y)
    scaler._scale_seq_len = window
    if clean < window:
        assert scaler._unskipped == clean
    scales = []
    for _ in range(len(want)):
        _scaled_step(model, opt, x, y)
        scales.append(scaler.loss_scale() / start)
    assert scales == want


def test_loss_scalers_of_several_losses_are_separate():
    # GAN-style `num_losses=2` scripts set each loss's scale by index.
    model, opt, state = _setup("host", num_losses=2)
    state.loss_scalers[0]._loss_scale = 4.0
    state.loss_scalers[1]._loss_scale = 1.0
    x, y = batch()
    loss, yielded = _scaled_step(model, opt, x, y, loss_id=1)
    assert float(yielded) == pytest.approx(float(loss))
    loss, yielded = _scaled_step(model, opt, x, y, loss_id=0)
    assert float(yielded) == pytest.approx(4.0 * float(loss))
    assert [s.loss_scale() for s in state.loss_scalers] == [4.0, 1.0]
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 1},
                                "loss_scaler1": {"loss_scale": 1.0, "unskipped": 1}}


@pytest.mark.parametrize("opt_level,dtype,cast,master", [
    ("O1", torch.float16, None, False),
    ("O2", torch.float16, torch.float16, True),
    ("O2", torch.bfloat16, torch.bfloat16, True),
    ("O3", torch.float16, torch.float16, False),
])
def test_opt_properties_read_like_apex(opt_level, dtype, cast, master):
    _, _, state = _setup("host", opt_level, dtype=dtype)
    props = state.opt_properties
    assert props.options["opt_level"] == props.opt_level == opt_level
    assert props.options["cast_model_type"] is cast
    assert props.master_weights is master and props.enabled is True
    with pytest.raises(AttributeError, match="pass cast_model_type=... to amp.initialize"):
        props.cast_model_type = torch.float32
    with pytest.raises(AttributeError, match="not an amp property"):
        props.nonsense  # noqa: B018


def test_initialize_disabled_has_apex_state_too():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, enabled=False, verbosity=0)
    assert amp._amp_state.opt_properties.enabled is False
    assert amp._amp_state.loss_scalers[0].loss_scale() == 1.0
    opt._lazy_init_maybe_master_weights()
    assert opt._amp_stash.lazy_init_called is True


def test_a_disabled_call_has_one_apex_loss_scaler_per_loss():
    """A GAN-style script logs ``amp._amp_state.loss_scalers[i].loss_scale()`` for each of its
    ``num_losses`` losses; with amp switched off (``enabled=False``) the same loop runs, each
    scaler at 1.0, rather than failing with an IndexError past the first."""
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, enabled=False, num_losses=3, verbosity=0)
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [1.0, 1.0, 1.0]
    assert amp.state_dict() == {}  # (disabled: nothing to save, as before)


# A pickled _amp_stash (inside a wrapper pickled whole) keeps lazy_init_called.
def test_a_pickled_amp_stash_keeps_lazy_init_called():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    opt._amp_stash.lazy_init_called = False
    assert pickle.loads(pickle.dumps(opt._amp_stash)).lazy_init_called is False


def test_state_follows_the_most_recent_initialize_with_optimizers():
    # (Both calls' optimizers kept alive: a call whose optimizers are gone does not count, so
    # with theirs freed the view would show any earlier test's call still awaiting the
    # garbage collector.)
    first = _setup("host", "O1", loss_scale=8.0)
    second = _setup("host", "O2", loss_scale=64.0)
    state = first[2]
    assert second[1] is not None
    assert state.loss_scalers[0].loss_scale() == 64.0
    assert state.opt_properties.opt_level == "O2"


def test_apex_state_skips_a_later_call_whose_optimizers_are_gone():
    """``amp._amp_state`` views the call that module-level ``amp.state_dict()`` saves: a trial
    (an LR finder) initialized after the real run and then freed does not hide the run's
    scale and opt level from a script that reads or sets them there (its write went to the
    dead trial's scaler, and the run kept its scale). Reference: the run's own state, through
    ``amp.state_dict(optimizer=...)``. (A06)"""
    import gc

    model, opt, state = _setup("host", "O2")
    trial = make_cnn(seed=1)
    trial_opt = torch.optim.SGD(trial.parameters(), lr=0.1)
    amp.initialize(trial, trial_opt, opt_level="O1", loss_scale=512.0, verbosity=0)
    assert state.loss_scalers[0].loss_scale() == 512.0  # (the trial's, alive)
    del trial, trial_opt
    gc.collect()
    assert state.opt_properties.opt_level == "O2"
    assert state.loss_scalers[0].loss_scale() == 2.0**16
    state.loss_scalers[0]._loss_scale = 2.0**10
    assert amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"] == 2.0**10


def test_clear_errors(monkeypatch):
    _, _, state = _setup("host")
    scaler = state.loss_scalers[0]
    with pytest.raises(AttributeError, match="amp.step_was_skipped"):
        scaler.update_scale()
    with pytest.raises(AttributeError, match="settable names are"):
        scaler.dynamic = False
    for bad in (0, -1.0, math.inf, math.nan, "big", 10**400):  # (r98D G4: an int past float)
        for field in ("_loss_scale", "_min_loss_scale", "_max_loss_scale"):
            with pytest.raises(ValueError, match="expected a finite number > 0"):
                setattr(scaler, field, bad)
    with pytest.raises(ValueError, match="expected an int >= 1"):
        scaler._scale_seq_len = 0
    with pytest.raises(ValueError, match="expected an int >= 0"):
        scaler._unskipped = -1
    for above in (2.0**30, 2.0**24 * 1.5):  # (far above the maximum, and just: r98D G2)
        with pytest.raises(ValueError, match="above the maximum"):
            scaler._min_loss_scale = above
    assert scaler.loss_scale() == 2.0**16  # nothing changed by the refused writes
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (2.0**-24, 2.0**24)
    with pytest.raises(AttributeError, match="public API"):
        state.handle  # noqa: B018
    with pytest.raises(AttributeError, match="no process-wide amp state"):
        state.loss_scalers = []
    monkeypatch.setattr(frontend, "_latest", None)
    with pytest.raises(AttributeError, match=r"before amp.initialize\(\)"):
        amp._amp_state.loss_scalers  # noqa: B018
    # As in Apex, where the names did not exist yet: scripts test for initialize this way.
    assert not hasattr(amp._amp_state, "opt_properties")
    assert getattr(amp._amp_state, "loss_scalers", None) is None


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_amp_stash_reports_a_pending_skip(where):
    # Apex's `optimizer._amp_stash.already_patched`: set by an overflowed backward until the
    # step it skips.
    model, opt, _ = _setup(where)
    stash = opt._amp_stash
    x, y = batch()
    loss = nn.functional.cross_entropy(model(x), y) * torch.tensor(math.inf)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert stash.already_patched is True
    opt.step()
    assert stash.already_patched is False
    # (Zeroed, as a loop does: a fused optimizer's step skipped on the device leaves the
    # inf gradients, which a block adding onto them looks at again, flagging a skip anew.)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert stash.already_patched is False
    opt.step()
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt,
                        delay_unscale=True) as scaled:
        scaled.backward()
    assert stash.params_have_scaled_gradients is True
    opt.zero_grad()


def test_amp_stash_lists_the_half_params_and_their_masters():
    model, opt, _ = _setup("host")
    stash = opt._amp_stash
    masters = stash.all_fp32_from_fp16_params
    halves = stash.all_fp16_params
    assert len(masters) == len(halves) > 0
    assert all(m.dtype == torch.float32 and h.dtype == torch.float16
               for m, h in zip(masters, halves))
    assert all(torch.equal(m.half(), h) for m, h in zip(masters, halves))
    # Together with the parameters stepped as they are (BatchNorm's fp32 ones), they are
    # what the optimizer steps.
    stepped = {id(p) for p in amp.master_params(opt)}
    assert stepped == {id(p) for p in masters + stash.all_fp32_from_fp32_params}
    with pytest.raises(AttributeError, match="amp.master_params"):
        stash.dls_update_manager  # noqa: B018
    copied = copy.deepcopy(opt)  # torch copies an optimizer without its extra names
    assert not hasattr(copied, "_amp_stash")


def _fresh_o2_adam():
    """The seeded small CNN with Adam through amp.initialize at O2 (fp16)."""
    model = make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return amp.initialize(model, opt, opt_level="O2", verbosity=0)


def _checkpointed_run(tmp_path, resume_at, steps=6):
    """O2 fp16 training with Adam; with ``resume_at`` a fresh model and optimizer restore a
    checkpoint taken there the way NVIDIA's BERT scripts did. The losses and final masters."""
    x, y = batch()

    model, opt = _fresh_o2_adam()
    losses = []
    for step in range(steps):
        if step == resume_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "amp": amp.state_dict(),
                        "master params": list(amp.master_params(opt))}, tmp_path / "ck.pt")
            model, opt = _fresh_o2_adam()
            _bert_style_load(model, opt, torch.load(tmp_path / "ck.pt", weights_only=False))
        losses.append(float(train_step(model, opt, x, y, amp)))
    return losses, [m.detach().clone() for m in amp.master_params(opt)]


def _bert_style_load(model, opt, ck):
    """NVIDIA BERT's resume: the model, Apex's private master-weight init, the optimizer, the
    masters copied in through .data in the optimizer's order, then amp's scaler."""
    model.load_state_dict(ck["model"])
    opt._lazy_init_maybe_master_weights()
    opt._amp_stash.lazy_init_called = True
    opt.load_state_dict(ck["optimizer"])
    for param, saved in zip(amp.master_params(opt), ck["master params"]):
        param.data.copy_(saved.data)
    amp.load_state_dict(ck["amp"])


def test_bert_style_resume_continues_bit_for_bit(tmp_path):
    losses, masters = _checkpointed_run(tmp_path, resume_at=None)
    resumed_losses, resumed = _checkpointed_run(tmp_path, resume_at=3)
    assert resumed_losses == losses
    for a, b in zip(masters, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert losses[-1] < losses[0]


def test_bert_style_resume_from_apexs_upcast_model_dict_continues_bit_for_bit(tmp_path):
    # The checkpoint as Apex's O2 wrote it: "model" held the half weights upcast
    # (BatchNorm's fp32 weights as they were), the exact fp32 weights only in the optimizer's
    # order under "master params". NVIDIA BERT's resume (load the model, the optimizer, copy
    # the masters through .data, then amp's scaler) continues bit for bit as the run that
    # never stopped, losses and masters, and takes the scale the checkpoint holds.
    x, y = batch()

    model, opt = _fresh_o2_adam()
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0 ** 13
    losses = [float(train_step(model, opt, x, y, amp)) for _ in range(3)]
    half = {n for n, p in model.named_parameters() if p.dtype == torch.float16}
    upcast = {k: v.half().float() if k in half else v for k, v in model.state_dict().items()}
    torch.save({"model": upcast, "optimizer": opt.state_dict(), "amp": amp.state_dict(),
                "master params": list(amp.master_params(opt))}, tmp_path / "apex.pt")
    losses += [float(train_step(model, opt, x, y, amp)) for _ in range(3)]
    want_masters = [m.detach().clone() for m in amp.master_params(opt)]
    want_amp = amp.state_dict()

    resumed, ropt = _fresh_o2_adam()
    _bert_style_load(resumed, ropt, torch.load(tmp_path / "apex.pt", weights_only=False))
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0 ** 13
    got = [float(train_step(resumed, ropt, x, y, amp)) for _ in range(3)]
    assert got == losses[3:]
    for a, b in zip(want_masters, amp.master_params(ropt)):
        torch.testing.assert_close(b.detach(), a, rtol=0, atol=0)
    assert amp.state_dict() == want_amp


def test_apex_module_path_serves_the_same_object(clean_apex):
    mixprec.install_apex_alias()
    import apex
    from apex.amp._amp_state import _amp_state, master_params

    assert _amp_state is amp._amp_state is apex.amp._amp_state
    model, opt, _ = _setup("host")
    assert list(master_params(opt)) == list(amp.master_params(opt))


def test_unskipped_refuses_a_bool():
    # `_unskipped = True` is a bool, not a count of clean steps (Python's bool is an int).
    _, _, state = _setup("host")
    scaler = state.loss_scalers[0]
    with pytest.raises(ValueError, match="expected an int >= 0"):
        scaler._unskipped = True
    assert scaler._unskipped == 0
    scaler._unskipped = 7
    assert scaler._unskipped == 7


def test_counters_take_numpy_and_tensor_integers_and_refuse_floats():
    # A count computed with numpy or torch (np.int64, a 0-dim int tensor) is an integer;
    # 2.0 or 2.5 is not (Apex's counters are compared with == to whole numbers).
    np = pytest.importorskip("numpy")
    _, _, state = _setup("host")
    scaler = state.loss_scalers[0]
    scaler._unskipped = np.int64(5)
    assert scaler._unskipped == 5 and type(scaler._unskipped) is int
    scaler._scale_seq_len = torch.tensor(3)
    assert scaler._scale_seq_len == 3 and type(scaler._scale_seq_len) is int
    for bad in (2.0, 2.5, "3", torch.tensor(3.0), np.int64(0)):
        with pytest.raises(ValueError, match=r"_scale_seq_len = .*expected an int >= 1"):
            scaler._scale_seq_len = bad
    assert scaler._scale_seq_len == 3
    with pytest.raises(ValueError, match=r"_unskipped = .*-1\)?: expected an int >= 0"):
        scaler._unskipped = np.int32(-1)
    assert scaler._unskipped == 5


def test_unskipped_can_be_reset_to_zero():
    # `amp._amp_state.loss_scalers[0]._unskipped = 0` (restart the growth count, as Apex
    # scripts did after changing the scale by hand).
    model, opt, state = _setup("host")
    x, y = batch()
    for _ in range(2):
        _scaled_step(model, opt, x, y)
    scaler = state.loss_scalers[0]
    assert scaler._unskipped == 2
    scaler._unskipped = 0
    assert scaler._unskipped == 0
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**16, "unskipped": 0}


def test_max_loss_scale_below_the_minimum_is_refused():
    _, _, state = _setup("host", min_loss_scale=2.0**4)
    scaler = state.loss_scalers[0]
    for below in (2.0**3, 2.0**4 * 0.75):  # (far below, and just)
        with pytest.raises(ValueError, match="below the minimum"):
            scaler._max_loss_scale = below
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (2.0**4, 2.0**24)


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_max_loss_scale_set_through_amp_state_caps_the_scale(where):
    # `_max_loss_scale` lowered below the current scale: read back as set (the minimum left
    # as it was), and the next update brings the scale down to it.
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    scaler._max_loss_scale = 2.0**10
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (2.0**-24, 2.0**10)
    x, y = batch()
    _scaled_step(model, opt, x, y)
    assert scaler.loss_scale() == 2.0**10


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_a_lowered_max_loss_scale_applies_from_the_next_update(where):
    """Lowering ``_max_loss_scale`` below the current scale changes no scale by itself, as in
    Apex, where the bounds were read only when the scale was updated: the scale reads as it
    was and the next backward still runs at it; that step's update brings it down to the new
    ceiling. The same with the scale on the host and on the device. Reference: the scaled
    loss the block yields, and the policy by hand. (A10)"""
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    scaler._max_loss_scale = 2.0**10
    assert scaler._loss_scale == 2.0**16
    x, y = batch()
    loss, yielded = _scaled_step(model, opt, x, y)
    assert float(yielded) == pytest.approx(float(loss) * 2.0**16, rel=1e-6)
    assert scaler._loss_scale == 2.0**10


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_min_loss_scale_may_be_raised_above_the_current_scale(where):
    """Raising ``_min_loss_scale`` above the current scale (a run whose scale backed off so far
    that fp16 gradients underflow) is accepted as long as it is not above the maximum: it
    reads back as set, and the next update lifts the scale to it, on the host and on the
    device. Reference: the policy by hand (a clean step at 2**4, then the floor 2**8). (B04)"""
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    scaler._loss_scale = 2.0**4
    scaler._min_loss_scale = 2.0**8
    assert (scaler._min_loss_scale, scaler._loss_scale) == (2.0**8, 2.0**4)
    x, y = batch()
    _scaled_step(model, opt, x, y)
    assert scaler.loss_scale() == 2.0**8


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_setting_loss_scale_keeps_the_clean_step_count(where):
    # As in Apex, where `_loss_scale` was a plain attribute: writing it leaves `_unskipped`
    # alone, so the scale still grows after `_scale_seq_len` clean steps in a row.
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    scaler._scale_seq_len = 3
    x, y = batch()
    for _ in range(2):
        _scaled_step(model, opt, x, y)
    scaler._loss_scale = 2.0**12
    assert scaler._unskipped == 2
    _scaled_step(model, opt, x, y)  # the third clean step: growth
    assert scaler.loss_scale() == 2.0**13 and scaler._unskipped == 0


def test_initialize_disabled_opt_properties_are_apex_defaults():
    model = make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, enabled=False, verbosity=0)
    props = amp._amp_state.opt_properties
    assert props.options == {"enabled": False, "opt_level": None, "cast_model_type": None,
                             "patch_torch_functions": False, "keep_batchnorm_fp32": None,
                             "master_weights": False, "loss_scale": 1.0}
    assert props.loss_scale == 1.0  # a static scale of 1: nothing is scaled


@pytest.mark.parametrize("opt_level,patch,keep_bn,loss_scale", [
    ("O1", True, None, "dynamic"),
    ("O2", False, True, "dynamic"),
    ("O3", False, False, 1.0),
])
def test_opt_properties_options_match_the_opt_level(opt_level, patch, keep_bn, loss_scale):
    _, _, state = _setup("host", opt_level)
    props = state.opt_properties
    assert props.patch_torch_functions is patch
    assert props.keep_batchnorm_fp32 is keep_bn
    assert props.loss_scale == loss_scale
    assert props.options["patch_torch_functions"] is patch


def test_apex_lazy_init_names_are_no_ops():
    # Both of Apex's lazy-init entry points exist on an initialized optimizer and change
    # nothing (mixprec made the masters in initialize).
    model, opt, _ = _setup("host")
    before = [m.detach().clone() for m in amp.master_params(opt)]
    assert opt._amp_lazy_init() is None
    assert opt._lazy_init_maybe_master_weights() is None
    for b, m in zip(before, amp.master_params(opt)):
        assert torch.equal(b, m)


@pytest.mark.parametrize("verbosity", [0, 1])
def test_verbosity_reads_initialize_s(verbosity):
    _, _, state = _setup("host", verbosity=verbosity)
    assert state.verbosity == verbosity


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_min_and_max_loss_scale_may_be_set_equal_to_pin_the_scale(where):
    """Apex scripts pin a dynamic scale by setting ``_min_loss_scale`` and ``_max_loss_scale``
    to the same value: both writes are accepted (in either order), read back as written, and
    the scale then stays at that value through clean and overflowed steps alike."""
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    scaler._min_loss_scale = 2.0**10
    scaler._max_loss_scale = 2.0**10  # equal to the minimum
    scaler._min_loss_scale = 2.0**10  # equal to the maximum
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (2.0**10, 2.0**10)
    x, y = batch()
    _scaled_step(model, opt, x, y)  # clean: 2**16 capped to the maximum
    assert scaler.loss_scale() == 2.0**10
    _scaled_step(model, opt, x, y, poison=True)  # overflow: halving floored at the minimum
    assert scaler._has_overflow is True
    assert scaler.loss_scale() == 2.0**10


@pytest.mark.parametrize("name", ["_min_loss_scale", "_max_loss_scale"])
def test_loss_scale_bounds_refuse_what_is_not_a_finite_positive_number(name):
    """A scale bound of 0, below 0, inf, NaN or a non-number would let the dynamic scale reach
    0 (every gradient zero) or inf (every step skipped): both bounds refuse them with the same
    message as ``_loss_scale``, and keep the values they had."""
    _, _, state = _setup("host")
    scaler = state.loss_scalers[0]
    for bad in (0, -1.0, -math.inf, math.inf, math.nan, "big"):
        with pytest.raises(ValueError, match="expected a finite number > 0"):
            setattr(scaler, name, bad)
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (2.0**-24, 2.0**24)


def test_scale_seq_len_refuses_a_bool():
    """``_scale_seq_len = True`` is a flag, not a window of clean steps (Python's bool is an
    int, and True would make the scale double after every step): refused like other
    non-counts, the window left as it was."""
    _, _, state = _setup("host")
    scaler = state.loss_scalers[0]
    for bad in (True, False):
        with pytest.raises(ValueError, match="expected an int >= 1"):
            scaler._scale_seq_len = bad
    assert scaler._scale_seq_len == 2000


def test_unskipped_and_scale_seq_len_refuse_a_fraction_or_a_string():
    """``_unskipped`` counts clean steps and ``_scale_seq_len`` is a number of them: 2.5, or a
    string read off a config, is refused with the message saying what is expected, not
    truncated to 2 (a window of 2 grows the scale at a different step than the script
    meant), and both values stay as they were. (A01, A02)"""
    _, _, state = _setup("host")
    scaler = state.loss_scalers[0]
    for bad in (2.5, "3"):
        with pytest.raises(ValueError, match="_unskipped = .*expected an int >= 0"):
            scaler._unskipped = bad
        with pytest.raises(ValueError, match="_scale_seq_len = .*expected an int >= 1"):
            scaler._scale_seq_len = bad
    assert (scaler._unskipped, scaler._scale_seq_len) == (0, 2000)


def test_every_served_name_read_before_initialize_says_to_call_it(monkeypatch):
    """Each of the three names ``amp._amp_state`` serves, read before any ``initialize``,
    raises an AttributeError (so ``hasattr`` answers False, as in Apex) whose message says to
    call ``amp.initialize`` first, not that the name is unknown."""
    monkeypatch.setattr(frontend, "_latest", None)
    for name in ("loss_scalers", "opt_properties", "verbosity"):
        with pytest.raises(AttributeError, match=r"before amp.initialize\(\)"):
            getattr(amp._amp_state, name)
        assert not hasattr(amp._amp_state, name)


@pytest.mark.parametrize("name", ["already_patched", "params_have_scaled_gradients",
                                  "all_fp16_params", "all_fp32_from_fp16_params",
                                  "all_fp32_from_fp32_params"])
def test_a_copied_amp_stash_says_its_amp_state_is_gone(name):
    """A stash that travelled in a pickle (or a deep copy) has no optimizer behind it: its
    views raise a RuntimeError saying the optimizer's amp state is gone, rather than a
    TypeError from inside mixprec."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    copied = pickle.loads(pickle.dumps(opt._amp_stash))
    with pytest.raises(RuntimeError, match="amp state is gone"):
        getattr(copied, name)


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_has_overflow_is_false_before_any_step_and_after_a_step_that_grew_the_scale(where):
    """``_has_overflow`` tells whether the latest step overflowed (scripts skip their LR
    scheduler on it), not whether the clean-step count is 0: it is False before the first
    step and after a clean step that doubled the scale and restarted the count."""
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    assert scaler._has_overflow is False
    scaler._scale_seq_len = 2
    x, y = batch()
    for _ in range(2):
        _scaled_step(model, opt, x, y)
    assert scaler.loss_scale() == 2.0**17 and scaler._unskipped == 0
    assert scaler._has_overflow is False


def test_loss_scale_bounds_are_stored_as_python_floats():
    """A bound given as an int or a 0-d tensor (read off a config or another scaler) is stored
    as a Python float, as ``_loss_scale`` is: the scaler compares and saves plain numbers, not
    a tensor that would pull every comparison onto it."""
    _, _, state = _setup("host")
    scaler = state.loss_scalers[0]
    scaler._max_loss_scale = torch.tensor(2.0**20)
    scaler._min_loss_scale = 16
    assert type(scaler._min_loss_scale) is float and scaler._min_loss_scale == 16.0
    assert type(scaler._max_loss_scale) is float and scaler._max_loss_scale == 2.0**20


def test_reprs_of_the_apex_views_show_their_values():
    """A script that prints ``amp._amp_state.loss_scalers[0]`` or ``opt_properties`` (a log
    line, a debugger) sees the scaler's kind, scale and count and every property, not a bare
    class name. Reference: the values initialize was given. (A03, A04)"""
    _, _, state = _setup("host", "O2", loss_scale=128.0)
    assert repr(state.loss_scalers[0]) == (
        "<Apex view of LossScaler(static, loss_scale=128.0, unskipped=0)>")
    assert repr(state.opt_properties) == (
        "<amp opt_properties {'enabled': True, 'opt_level': 'O2', "
        "'cast_model_type': torch.float16, 'patch_torch_functions': False, "
        "'keep_batchnorm_fp32': True, 'master_weights': True, 'loss_scale': 128.0}>")


@pytest.mark.parametrize("where", OPTIMIZERS)
def test_loss_scale_attribute_reads_the_scale_the_last_step_left(where):
    """Apex scripts log ``amp._amp_state.loss_scalers[0]._loss_scale`` after each step; with
    the dynamic scale kept on the device (a fused optimizer's step, updated by kernels) the
    attribute reads the device's current scale, not the host's copy from before the step.
    Reference: the policy by hand (an overflow halves 2**16, a clean step keeps it). (A08)"""
    model, opt, state = _setup(where)
    scaler = state.loss_scalers[0]
    x, y = batch()
    _scaled_step(model, opt, x, y, poison=True)
    assert scaler._loss_scale == 2.0**15
    _scaled_step(model, opt, x, y, poison=True)
    assert scaler._loss_scale == 2.0**14
