"""Gradients a backward inside another optimizer's scale_loss block brings an optimizer's
parameters (mixprec/amp/_state.py: ForeignBackwardWatch, check_foreign). The first tests
closed the gaps a hand mutation run over the sixty-second session's first two commits found
(s62 helper A); the last ones are s62 helper C's bugs B and D and its double back-off. The
unscale itself is tested in test_scale_loss.py (test_another_blocks_gradients_land_...)."""

import copy

import pytest
import torch
from torch import nn

from mixprec import amp

_INF = float("inf")


def _two_others_share_a_layer(loss_scale):
    """shared is held by oa and oc (neither given to the block), b by ob (the block's)."""
    torch.manual_seed(0)
    shared, head, other = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)
    ref = copy.deepcopy(nn.Sequential(shared, head)).double()
    oa = torch.optim.SGD(shared.parameters(), lr=0.1)
    oc = torch.optim.SGD(list(shared.parameters()) + list(other.parameters()), lr=0.1)
    ob = torch.optim.SGD(head.parameters(), lr=0.1)
    amp.initialize([shared, head, other], [oa, ob, oc], opt_level="O1", loss_scale=loss_scale,
                   patch_torch_functions=False, verbosity=0)
    return shared, head, ref, oa, ob, oc


@pytest.mark.parametrize("loss_scale", [512.0, "dynamic"])
def test_a_layer_two_other_optimizers_hold_is_unscaled_once(loss_scale):
    # (Kills M10/M11/M20: without the shared ``unscaled`` set both watches divide the
    # incoming share, and the shared layer's gradient comes out 1/scale of its value.)
    shared, head, ref, oa, ob, oc = _two_others_share_a_layer(loss_scale)
    _assert_the_shared_layers_gradient_is_float64s(shared, head, ref, ob)


def _assert_the_shared_layers_gradient_is_float64s(shared, head, ref, ob):
    """One block of ob through shared and head: shared's gradient equals the float64
    reference's (ref, a copy of both)."""
    x = torch.randn(8, 4)
    ref(x.double()).pow(2).mean().backward()
    with amp.scale_loss(head(shared(x)).pow(2).mean(), ob) as s:
        s.backward()
    for p, r in zip(shared.parameters(), ref[0].parameters()):
        torch.testing.assert_close(p.grad.double(), r.grad, rtol=1e-5, atol=1e-6)


def test_a_layer_shared_with_the_blocks_optimizer_is_not_also_unscaled_by_another():
    # A layer held by the block's optimizer (ob) and by one outside it (oa): ob's unscale
    # unscales it; oa's watch skips it. (Kills M09: ignoring ``skip`` divided it twice.)
    torch.manual_seed(0)
    shared, head = nn.Linear(4, 4), nn.Linear(4, 2)
    ref = copy.deepcopy(nn.Sequential(shared, head)).double()
    oa = torch.optim.SGD(shared.parameters(), lr=0.1)
    ob = torch.optim.SGD(list(shared.parameters()) + list(head.parameters()), lr=0.1)
    amp.initialize([shared, head], [oa, ob], opt_level="O1", loss_scale=512.0,
                   patch_torch_functions=False, verbosity=0)
    _assert_the_shared_layers_gradient_is_float64s(shared, head, ref, ob)


@pytest.mark.parametrize("loss_scale", [512.0, "dynamic"])
def test_a_frozen_parameter_of_another_optimizer_does_not_break_the_block(loss_scale):
    # oa holds a frozen bias (requires_grad=False, as in fine-tuning with some parameters
    # frozen but left in the optimizer). (Kills M15: a tensor hook on it raises.)
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    a.bias.requires_grad_(False)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O1", loss_scale=loss_scale,
                   patch_torch_functions=False, verbosity=0)
    x = torch.randn(8, 4)
    with amp.scale_loss(b(a(x)).pow(2).mean(), ob) as s:
        s.backward()
    ob.step()
    assert a.bias.grad is None and a.weight.grad is not None


def test_foreign_gradients_set_aside_and_given_back_unchanged_are_checked_by_the_own_block():
    # oa holds a1 and a2. A loss through a1 and b inside ob's block (dynamic) leaves a1's
    # gradients unchecked for oa; oa's own block reaches a2 only, so a1's gradients are set
    # aside and given back as the same tensors. The stash recheck checked them: oa.step()
    # runs, on the unscaled foreign share. (Kills M22: the marks stayed and the step was
    # refused.)
    torch.manual_seed(0)
    a1, a2, b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
    ref_a1, ref_b = copy.deepcopy(a1).double(), copy.deepcopy(b).double()
    oa = torch.optim.SGD(list(a1.parameters()) + list(a2.parameters()), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a1, a2, b], [oa, ob], opt_level="O1", loss_scale="dynamic",
                   patch_torch_functions=False, verbosity=0)
    x = torch.randn(8, 4)
    ref_b(ref_a1(x.double())).pow(2).mean().backward()
    with amp.scale_loss(b(a1(x)).pow(2).mean(), ob) as s:
        s.backward()
    ob.step()
    with amp.scale_loss(a2(x).pow(2).mean(), oa) as s:
        s.backward()
    torch.testing.assert_close(a1.weight.grad.double(), ref_a1.weight.grad, rtol=1e-5, atol=1e-6)
    before = a1.weight.detach().clone()
    oa.step()
    assert not amp.step_was_skipped(oa)
    torch.testing.assert_close(a1.weight.detach().double(),
                               before.double() - 0.1 * ref_a1.weight.grad, rtol=1e-5, atol=1e-6)


def test_a_foreign_gradient_replaced_by_a_new_tensor_is_not_refused():
    # After ob's block wrote a's gradients, the caller replaces them by new tensors (here:
    # zeros, as a hand-rolled zero_grad does): not what the foreign block left, so oa.step()
    # runs on them. (Kills M25: a new tensor's version, 0, matched the foreign gradient's.)
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O1", loss_scale="dynamic",
                   patch_torch_functions=False, verbosity=0)
    x = torch.randn(8, 4)
    with amp.scale_loss(b(a(x)).pow(2).mean(), ob) as s:
        s.backward()
    ob.step()
    versions = {p.grad._version for p in a.parameters()}
    for p in a.parameters():
        p.grad = torch.zeros_like(p)
    assert {p.grad._version for p in a.parameters()} == versions  # (the mutant's blind spot)
    want = [p.detach().clone() for p in a.parameters()]
    oa.step()
    for p, w in zip(a.parameters(), want):
        assert torch.equal(p, w)


def _sgd_models(level, fused=False):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = (torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.float16, verbosity=0)
    return model, opt, torch.randn(2, 4)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adamw"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_optimizer_checkpoint_loaded_after_a_delayed_overflow_lets_the_step_run(level, fused):
    """eb9767e, optimizer-load path: an overflowed delay_overflow_check=True block, then
    o.load_state_dict(saved) (a rollback), then o.step(): as after an undelayed block, the
    decision is taken at the load, the abandoned gradients dropped, and the step runs
    (amp.step_was_skipped is False, which keeps a scheduler stepping) on no gradient. (Kills
    N01/N06: the step took the delayed decision and was skipped; the repo's test compares
    weights only, which a plain SGD step on no gradient leaves as a skipped one does. The
    fused case, a device-side scale, kills N02: the pending flag read before the delayed
    decision left the gradients and the device flag to the step.)"""
    def run(delay):
        a, o, x = _sgd_models(level, fused)
        saved = copy.deepcopy(o.state_dict())
        with amp.scale_loss(a(x).float().pow(2).mean() * _INF, o,
                            delay_overflow_check=delay) as s:
            s.backward()
        o.load_state_dict(saved)
        o.step()
        return (amp.step_was_skipped(o), amp.state_dict(),
                [p.detach().clone() for p in amp.master_params(o)],
                [p.grad is None for p in amp.master_params(o)])

    want = run(False)
    got = run(True)
    assert got[0] == want[0]
    assert got[1] == want[1]
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert got[3] == want[3]


def test_a_layer_two_other_optimizers_hold_is_refused_for_both_under_a_dynamic_scale():
    # Unscaled once, but unchecked for either: both steps are refused. (Kills M31: the
    # second watch, unscaling nothing, took no mark either, and oc stepped it unchecked.)
    shared, head, ref, oa, ob, oc = _two_others_share_a_layer("dynamic")
    x = torch.randn(8, 4)
    with amp.scale_loss(head(shared(x)).pow(2).mean(), ob) as s:
        s.backward()
    ob.step()
    for opt in (oa, oc):
        w = shared.weight.detach().clone()
        with pytest.raises(RuntimeError, match=r"checked only those optimizers' gradients"):
            opt.step()
        assert torch.equal(shared.weight, w)


@pytest.mark.parametrize("order", ["e+pe", "pe+e"])
def test_a_foreign_share_aliasing_another_gradient_is_not_unscaled_in_place(order):
    # pe (oa's, a learned offset with the activation's shape) is added to e (ob's): autograd
    # hands the one incoming gradient tensor to both. pe's share is unscaled into a new
    # tensor; e's (the block's own) is left to ob's unscale. (Kills M32: an in-place mul_ on
    # the incoming gradient unscaled e's share as well, or failed.)
    torch.manual_seed(0)
    pe, e = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(8, 4))
    head = nn.Linear(4, 2)
    ref_pe, ref_e = pe.detach().double().requires_grad_(), e.detach().double().requires_grad_()
    ref_head = copy.deepcopy(head).double()
    holder_a, holder_b = nn.ParameterList([pe]), nn.ModuleList([head, nn.ParameterList([e])])
    oa = torch.optim.SGD(holder_a.parameters(), lr=0.1)
    ob = torch.optim.SGD(holder_b.parameters(), lr=0.1)
    amp.initialize([holder_a, holder_b], [oa, ob], opt_level="O1", loss_scale=512.0,
                   patch_torch_functions=False, verbosity=0)
    def add(u, v):
        return u + v if order == "e+pe" else v + u

    ref_head(add(ref_e, ref_pe)).pow(2).mean().backward()
    with amp.scale_loss(head(add(e, pe)).pow(2).mean(), ob) as s:
        s.backward()
    torch.testing.assert_close(pe.grad.double(), ref_pe.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e.grad.double(), ref_e.grad, rtol=1e-5, atol=1e-6)


def _encoder_and_two_heads(num_losses=2, delay=False):
    """E (held by oE) under two heads; loss 0 through E and H1 given [oE, oH1]; loss 1
    through E and H2 given oH2 only, its share on E made inf by a hook (H2's own gradients
    finite). Scales: loss 0 at 4096, loss 1 at 1024."""
    torch.manual_seed(0)
    e, h1, h2 = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)
    oe, oh1, oh2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (e, h1, h2))
    amp.initialize([e, h1, h2], [oe, oh1, oh2], opt_level="O1", dtype=torch.float16,
                   num_losses=num_losses, verbosity=0)
    amp.load_state_dict({f"loss_scaler{i}": {"loss_scale": 4096.0 / 4**i, "unskipped": 0}
                         for i in range(num_losses)})
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def own():
        with amp.scale_loss(h1(e(x)).float().pow(2).mean(), [oe, oh1],
                            delay_overflow_check=delay) as s:
            s.backward()

    def foreign(inf_in_h2=False):
        h = e(x)
        h.register_hook(lambda g: g * _INF)
        out = h2(h).float().pow(2).mean()
        with amp.scale_loss(out * (_INF if inf_in_h2 else 1.0), oh2, loss_id=num_losses - 1) as s:
            s.backward()

    return e, (oe, oh1, oh2), own, foreign


def _scales():
    return [v["loss_scale"] for v in amp.state_dict().values()]


def test_a_foreign_inf_set_aside_by_the_own_block_backs_off_the_foreign_loss():
    """(s62 helper C, bug B) The foreign block (loss 1) left an inf on E's gradients, then
    E's own block (loss 0) set them aside and checked them with its own gradients: loss 0
    backed off and E's step was skipped, every iteration, while loss 1's scale, the one that
    overflowed there, never moved. They are checked apart now: E's step is skipped, loss 1
    backs off, loss 0 does not, and the loop recovers."""
    e, (oe, oh1, oh2), own, foreign = _encoder_and_two_heads()
    w = e.weight.detach().clone()
    foreign()
    oh2.step()
    own()
    for opt in (oe, oh1):
        opt.step()
    assert amp.step_was_skipped(oe) and not amp.step_was_skipped(oh2)
    assert torch.equal(e.weight.detach(), w)
    assert _scales() == [4096.0, 512.0]


@pytest.mark.parametrize("delay", [False, True], ids=["undelayed", "delay_overflow_check"])
def test_a_foreign_inf_after_the_own_block_backs_off_the_foreign_loss_delayed_or_not(delay):
    """(s62 helper C, diff D) Own block, then the foreign block's inf on E, then the usual
    clip_grad_norm_, then the steps: with delay_overflow_check=True the step's deferred check
    read the foreign inf as the delayed loss's overflow (oH1 skipped too, loss 0 backed off).
    Both loops now end alike: E skipped, loss 1 backed off."""
    e, (oe, oh1, oh2), own, foreign = _encoder_and_two_heads(delay=delay)
    own()
    foreign()
    oh2.step()
    torch.nn.utils.clip_grad_norm_(e.parameters(), 1.0)
    for opt in (oe, oh1):
        opt.step()
    assert [amp.step_was_skipped(o) for o in (oe, oh1, oh2)] == [True, False, False]
    assert _scales() == [4096.0, 512.0]


def test_one_overflow_in_a_blocks_own_and_foreign_gradients_backs_off_once():
    """(s62 helper C) One backward overflowing both H2's own gradients and E's share: H2's
    block backs loss 1 off; the step-time check of E's share backed it off again for the
    same event. Once now, as with [oE, oH2] given to the block."""
    e, (oe, oh1, oh2), own, foreign = _encoder_and_two_heads(num_losses=1)
    foreign(inf_in_h2=True)
    oh2.step()
    assert amp.step_was_skipped(oh2)
    torch.nn.utils.clip_grad_norm_(e.parameters(), 1.0)
    oe.step()
    assert amp.step_was_skipped(oe)
    assert _scales() == [2048.0]


def test_a_foreign_gradient_replaced_by_a_new_tensor_is_checked():
    """(s62 helper C) p.grad = p.grad / 1.0 after the foreign block: a new tensor, taken for
    the caller's own and stepped unchecked, inf into E's weights. Checked now, as an edit in
    place is: skipped, E finite."""
    e, (oe, oh1, oh2), own, foreign = _encoder_and_two_heads()
    w = e.weight.detach().clone()
    foreign()
    for p in e.parameters():
        p.grad = p.grad / 1.0
    oe.step()
    assert amp.step_was_skipped(oe)
    assert torch.equal(e.weight.detach(), w)


def _encoder_and_heads(n_heads, num_losses, level="O1"):
    """E (held by oE) under ``n_heads`` heads with an optimizer each; fp16, every loss at 4096."""
    torch.manual_seed(0)
    e = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
    heads = [nn.Linear(16, 2) for _ in range(n_heads)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (e, *heads)]
    amp.initialize([e, *heads], opts, opt_level=level, dtype=torch.float16,
                   num_losses=num_losses, verbosity=0)
    amp.load_state_dict({f"loss_scaler{i}": {"loss_scale": 4096.0, "unskipped": 0}
                         for i in range(num_losses)})
    return e, heads, opts, torch.randn(8, 6, generator=torch.Generator().manual_seed(1))


def _inf_share(h):
    """h * 1.0 whose gradient into h (the encoder's share) is inf in one column."""
    h2 = h * 1.0
    h2.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), _INF))
    return h2


def test_the_loss_whose_share_overflowed_backs_off_not_every_loss_that_left_one():
    """(s62 helper D, bug 2) Loss 1's block leaves an inf in E's share, loss 2's block a clean
    one on the same parameters, then E's own block (loss 0): the check of the marked gradients
    backed off loss 2 (the last to mark them) or both. Flags taken as each share lands tell
    them apart: loss 1 backs off alone."""
    e, (h1, h2, h3), (oe, o1, o2, o3), x = _encoder_and_heads(3, 3)
    h = e(x)
    for head, opt, loss_id, hh in ((h2, o2, 1, _inf_share(h)), (h3, o3, 2, h)):
        with amp.scale_loss(head(hh).float().pow(2).mean(), opt, loss_id=loss_id) as s:
            s.backward(retain_graph=True)
    with amp.scale_loss(h1(h).float().pow(2).mean(), [oe, o1]) as s:
        s.backward()
    for opt in (oe, o1, o2, o3):
        opt.step()
    assert [amp.step_was_skipped(o) for o in (oe, o1, o2, o3)] == [True, False, False, False]
    assert [v["loss_scale"] for v in amp.state_dict().values()] == [4096.0, 2048.0, 4096.0]


def test_one_event_backs_off_once_with_a_clean_block_of_that_loss_in_between():
    """(s62 helper D, bug 1) One backward overflows H2's own gradients and E's share (loss 0
    backs off at H2's block); a clean block of the same loss (H3) follows; then E's step
    checks the share: the 'once per event' rule looked only at the scaler's latest update and
    backed off again. The decision of the block that left the share is remembered now."""
    e, (h1, h2, h3), (oe, o1, o2, o3), x = _encoder_and_heads(3, 1)
    h = e(x)
    with amp.scale_loss(h2(_inf_share(h)).float().pow(2).mean() * _INF, o2) as s:
        s.backward(retain_graph=True)
    with amp.scale_loss(h3(h.detach()).float().pow(2).mean(), o3) as s:
        s.backward()
    torch.nn.utils.clip_grad_norm_(e.parameters(), 1.0)
    oe.step()
    assert amp.step_was_skipped(oe)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2048.0


def test_a_foreign_inf_landing_in_a_window_backs_off_the_foreign_loss():
    """(s62 helper D, bug 4) E holds a delay_unscale window (loss 0) when loss 1's block lands
    an inf in E's share there; the window's closing block saw it with its own gradients and
    backed off loss 0, every iteration (loss 1, the one overflowing, never moved). The flag
    taken as the share landed attributes it: E skipped, loss 1 backs off, loss 0 keeps its
    scale, and the loop recovers once loss 1's scale is low enough."""
    e, (h1, h2), (oe, o1, o2), _ = _encoder_and_heads(2, 2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        for opt in (oe, o1, o2):
            opt.zero_grad()
        for micro in range(2):
            h = e(torch.randn(8, 6, generator=gen))
            overflow = amp.state_dict()["loss_scaler1"]["loss_scale"] >= 1024
            with amp.scale_loss(h1(h).float().pow(2).mean(), [oe, o1],
                                delay_unscale=micro == 0) as s:
                s.backward(retain_graph=True)
            hh = _inf_share(h) if overflow else h
            with amp.scale_loss(h2(hh).float().pow(2).mean(), o2, loss_id=1) as s:
                s.backward()
        for opt in (oe, o1, o2):
            try:
                opt.step()
            except RuntimeError:  # (the last share, unchecked: refused once, then checked)
                opt.step()
    assert [v["loss_scale"] for v in amp.state_dict().values()] == [4096.0, 512.0]
    assert not amp.step_was_skipped(oe)
    assert all(torch.isfinite(p).all() for p in e.parameters())


def test_an_own_block_at_a_static_one_still_checks_a_foreign_share():
    """(s62 helper D, bug 3) A's call at bf16's static 1.0, B's in fp16 with a dynamic scale:
    B's block left an inf in A's share, then A's own block (no set-aside at a static 1.0)
    forgot the marks unchecked, and A stepped the inf. Checked now: skipped, A finite."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize(a, oa, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    amp.initialize(b, ob, opt_level="O1", dtype=torch.float16, verbosity=0)
    x = torch.randn(8, 4)
    with amp.scale_loss(b(_inf_share(a(x))).float().pow(2).mean(), ob) as s:
        s.backward()
    ob.step()
    with amp.scale_loss(a(x).float().pow(2).mean(), oa) as s:
        s.backward()
    oa.step()
    assert amp.step_was_skipped(oa)
    assert all(torch.isfinite(p).all() for p in a.parameters())


def test_one_backward_through_two_blocks_at_different_scales_is_refused():
    """(s62 helper D, bug 5) Two blocks open over one backward, loss_ids 0 and 1 at different
    scales, a parameter both losses reach: the summed share was rescaled as one, wrong by a
    third, silently. Refused now (one loss_id works: test_scale_loss.py's "both" order)."""
    e, (h1, h2), (oe, o1, o2), x = _encoder_and_heads(2, 2)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4096.0, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 512.0, "unskipped": 0}})
    h = e(x)
    with pytest.raises(RuntimeError, match=r"two open scale_loss blocks of different loss "
                                           r"scalers.*one loss_id"):
        with amp.scale_loss(h2(h).float().pow(2).mean(), o2, loss_id=1) as s1, \
                amp.scale_loss(h1(h).float().pow(2).mean(), [oe, o1]) as s0:
            (s0 + s1).backward()


@pytest.mark.parametrize("what", ["inference_mode", "no_grad"])
def test_a_block_over_a_loss_without_gradient_opens_no_watch(what):
    """(s62 helper D, bug 7) scale_loss over a loss computed under torch.inference_mode()
    (an evaluation pass reusing the training code) failed finding the other optimizers'
    gradient accumulators, and a watch made before the failure stayed open, dividing a later
    share twice. A loss that needs no gradient has no backward: no watch."""
    e, (h1, h2), (oe, o1, o2), x = _encoder_and_heads(2, 1)
    with getattr(torch, what)():
        loss = h2(e(x)).float().pow(2).mean()
        with amp.scale_loss(loss, o2):
            pass
    assert all(not amp._state.optimizer_state(o).active_watches for o in (oe, o1, o2))


@pytest.mark.parametrize("drop", ["model.zero_grad", "grad=None"])
def test_a_foreign_inf_dropped_with_its_gradients_skips_no_later_step(drop):
    """(s62 helper E, a regression of the landing flags) PyTorch's DCGAN loop: G's block
    (loss 2) overflows, its share on D (inf) too; the next iteration drops D's gradients with
    netD.zero_grad() (the module's, not the optimizer's) before D's own blocks. The flag taken
    as the share landed outlived the gradients and skipped D's clean step. The gradients
    decide now, the flags only tell whose loss it was: D steps, only G's step was skipped."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    d = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    [g, d], [og, od] = amp.initialize([g, d], [og, od], opt_level="O1", dtype=torch.float16,
                                      num_losses=3, verbosity=0)
    bce, gen = nn.BCEWithLogitsLoss(), torch.Generator().manual_seed(1)
    skipped = []
    for it in range(3):
        real, z = torch.randn(16, 4, generator=gen), torch.randn(16, 8, generator=gen)
        if drop == "model.zero_grad":
            d.zero_grad()
        else:
            for p in d.parameters():
                p.grad = None
        with amp.scale_loss(bce(d(real).float(), torch.ones(16, 1)), od, loss_id=0) as s:
            s.backward()
        fake = g(z)
        with amp.scale_loss(bce(d(fake.detach()).float(), torch.zeros(16, 1)), od,
                            loss_id=1) as s:
            s.backward()
        od.step()
        g.zero_grad()
        err = bce(d(fake).float(), torch.ones(16, 1)) * (_INF if it == 1 else 1.0)
        with amp.scale_loss(err, og, loss_id=2) as s:
            s.backward()
        og.step()
        skipped.append((amp.step_was_skipped(od), amp.step_was_skipped(og)))
    assert skipped == [(False, False), (False, True), (False, False)]
    assert [v["loss_scale"] for v in amp.state_dict().values()] == [2.0**16, 2.0**16, 2.0**15]


@pytest.mark.parametrize("fused", ["oe", "o2"])
def test_one_backward_through_two_blocks_of_different_losses_is_refused_with_device_scales(
        fused):
    """(s62 helper E) The refusal compared the two blocks' scale values, so a fused
    optimizer's device scale (a tensor) slipped by: E's gradients 42% off, silently. It
    compares the loss scalers now."""
    torch.manual_seed(0)
    e, h1, h2 = nn.Linear(6, 16), nn.Linear(16, 2), nn.Linear(16, 2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=name == fused)
            for m, name in ((e, "oe"), (h1, "o1"), (h2, "o2"))]
    amp.initialize([e, h1, h2], opts, opt_level="O1", dtype=torch.float16, num_losses=2,
                   verbosity=0)
    oe, o1, o2 = opts
    h = e(torch.randn(8, 6))
    with pytest.raises(RuntimeError, match=r"two open scale_loss blocks of different loss "
                                           r"scalers"):
        with amp.scale_loss(h2(h).float().pow(2).mean(), o2, loss_id=1) as s1, \
                amp.scale_loss(h1(h).float().pow(2).mean(), [oe, o1]) as s0:
            (s0 + s1).backward()
