"""The runner: same start for every mode, frozen BatchNorm, skipped-step counts, errors."""

import dataclasses
import functools
import json
import math
import sys
import threading
import types

import pytest
import torch
from torch import nn

import mixprec.bench.runner as runner_module
from mixprec.bench.models import build_workload
from mixprec.bench.runner import (
    MODES,
    ModeResult,
    _CpuPeakMemory,
    mode_label,
    run_mode,
    run_modes,
)

FAST = {"iters": 2, "warmup": 1}


def _capturing(workload):
    """Keep every model the runner builds, to inspect it after the run."""
    built = []
    build = workload.build_model

    def build_model():
        built.append(build())
        return built[-1]

    return dataclasses.replace(workload, build_model=build_model), built


@pytest.fixture(scope="module")
def cnn():
    return build_workload("cnn", batch_size=4, num_batches=2)


def test_o0_matches_plain_fp32_exactly(cnn):
    fp32, o0 = run_modes(cnn, ["fp32", "O0"], iters=3, warmup=0)
    assert fp32.ok and o0.ok
    # Same weights, same data, O0 is fp32: the first loss is bitwise the same.
    assert fp32.losses[0] == o0.losses[0]
    assert o0.dtype == fp32.dtype == "fp32"


@pytest.mark.parametrize("mode", ["fp32", "O2", "half", "autocast"])
def test_frozen_bn_keeps_running_stats_and_trains_the_rest(cnn, mode):
    wl, built = _capturing(cnn)
    result = run_mode(wl, mode, frozen_bn=True, **FAST)
    assert result.ok
    model = built[-1]
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(not bn.training for bn in bns)
    assert model.training  # the rest trains
    for bn in bns:  # eval mode: the running statistics never moved from their init
        torch.testing.assert_close(
            bn.running_mean.float(),
            torch.zeros_like(bn.running_mean, dtype=torch.float32),
            rtol=0,
            atol=0,
        )
        assert int(bn.num_batches_tracked) == 0
    torch.manual_seed(0)
    fresh = cnn.build_model()
    w0 = fresh.features[0].weight
    assert not torch.allclose(model.features[0].weight.float(), w0)


def test_batchnorm_trains_without_frozen_bn(cnn):
    wl, built = _capturing(cnn)
    assert run_mode(wl, "O2", **FAST).ok
    bn = next(m for m in built[-1].modules() if isinstance(m, nn.BatchNorm2d))
    assert bn.training and int(bn.num_batches_tracked) == 3


def _overflowing(workload, factor=100.0):
    # A loss this large, times the initial fp16 loss scale 2**16, overflows fp16 gradients
    # until the dynamic scale has backed off several times.
    loss_fn = workload.loss_fn
    return dataclasses.replace(workload, loss_fn=lambda out, y: factor * loss_fn(out, y))


OVERFLOW_RUN = {"dtype": torch.float16, "iters": 8, "warmup": 1}


def test_skipped_steps_are_counted_under_fp16(cnn):
    wl = _overflowing(cnn)
    o1 = run_mode(wl, "O1", **OVERFLOW_RUN)
    native = run_mode(wl, "autocast", **OVERFLOW_RUN)
    assert o1.ok and native.ok, (o1.error, native.error)
    # Same back-off policy on the same gradients: the same steps are skipped.
    assert 3 <= o1.skipped_steps <= 9 and o1.skipped_steps == native.skipped_steps
    assert all(math.isfinite(v) for v in o1.losses)


@pytest.mark.parametrize("mode", ["O1", "O2"])
def test_every_step_skipped_past_the_loss_scale_floor_is_counted(mode):
    # An inf loss overflows at every step, whatever the scale: amp's dynamic scale bottoms out
    # at 2**-24 after 40 halvings from 2**16, and counting halvings showed 40 for 42 skips.
    wl = build_workload("cnn", batch_size=1, num_batches=1)
    wl = _overflowing(wl, factor=float("inf"))
    r = run_mode(wl, mode, dtype=torch.float16, iters=41, warmup=1)
    assert r.ok, r.error
    assert r.skipped_steps == 42


def test_grad_scaler_underflowed_to_zero_is_not_reported_as_no_skips():
    # GradScaler's scale underflows to 0 after ~165 halvings in a row; the halvings then read
    # 0 skipped steps. A fake scaler stands in for that long run.
    from mixprec.bench.runner import _AutocastRecipe

    recipe = _AutocastRecipe(nn.Linear(1, 1), None, None, torch.float16, "cpu")
    recipe.scaler = type("Scaler", (), {"get_scale": lambda self: 0.0})()
    recipe.steps = 170
    recipe.finish()
    assert not recipe.skips_known


def test_bf16_skips_nothing(cnn):
    r = run_mode(_overflowing(cnn), "O2", dtype=torch.bfloat16, **FAST)
    assert r.ok and r.skipped_steps == 0


def test_result_fields(cnn):
    r = run_mode(cnn, "half", **FAST)
    assert r.mode == "half" and r.label == ".bfloat16()" and r.dtype == "bf16"
    assert len(r.losses) == 3 and len(r.step_times_s) == 2
    assert r.time_per_iter_s > 0 and r.total_time_s >= 0.9 * sum(r.step_times_s)
    assert r.peak_memory_mb >= 0
    d = r.to_dict()
    assert d["mode"] == "half" and d["status"] == "ok"


def test_labels():
    assert mode_label("autocast", torch.float16) == "autocast+GradScaler"
    assert mode_label("autocast", torch.bfloat16) == "autocast"
    assert mode_label("half", torch.float16) == ".half()"
    assert mode_label("O2", torch.float16) == "O2"
    assert set(MODES) == {"fp32", "O0", "O1", "O2", "O3", "autocast", "half"}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "O4"}, "mode must be one of"),
        ({"mode": "O1", "dtype": torch.float32}, "dtype must be torch.float16"),
        ({"mode": "O1", "iters": 0}, "iters must be an int >= 1"),
        ({"mode": "O1", "warmup": -1}, "warmup must be an int >= 0"),
    ],
)
def test_run_mode_errors(cnn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_mode(cnn, **kwargs)


def test_run_modes_rejects_unknown_modes(cnn):
    with pytest.raises(ValueError, match="unknown"):
        run_modes(cnn, ["O1", "fp8"])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"iters": 0}, ValueError, r"run_modes\(iters=0\): iters must be an int >= 1; pass e.g."),
        ({"warmup": 1.5}, TypeError, r"run_modes\(warmup=1.5\): warmup must be an int >= 0, not"),
        ({"dtype": torch.float32}, ValueError, r"run_modes\(dtype=torch.float32\): dtype must be "
                                               r"torch.float16 or torch.bfloat16"),
        ({"dtype": "bf16"}, TypeError, r"dtype must be a torch.dtype"),
        ({"itters": 3}, TypeError, r"unexpected keyword argument 'itters'.*did you mean 'iters'"),
        ({"device": "tpu"}, ValueError, r"run_modes\(device='tpu'\): not a device"),
    ],
)
def test_run_modes_checks_its_arguments_before_running(cnn, monkeypatch, kwargs, error, match):
    import mixprec.bench.runner as runner

    def must_not_run(*args, **kw):
        raise AssertionError("ran before the arguments were checked")

    monkeypatch.setattr(runner, "warm_up_process", must_not_run)
    monkeypatch.setattr(runner, "run_mode", must_not_run)
    with pytest.raises(error, match=match):
        run_modes(cnn, ["O0", "O1"], **kwargs)


def test_run_modes_reports_each_row_as_it_finishes(cnn):
    seen = []
    rows = run_modes(cnn, ["fp32", "O1"], on_result=seen.append, process_warmup=False, **FAST)
    assert seen == rows and [r.mode for r in seen] == ["fp32", "O1"]


def test_step_time_spread(cnn):
    r = run_mode(cnn, "fp32", iters=5, warmup=0)
    times = r.step_times_s
    assert r.time_per_iter_mean_s == pytest.approx(sum(times) / len(times))  # not wall / iters
    assert r.time_per_iter_min_s == min(times) and r.time_per_iter_max_s == max(times)
    assert r.time_per_iter_min_s <= r.time_per_iter_s <= r.time_per_iter_max_s
    assert 0 <= r.time_per_iter_iqr_s <= r.time_per_iter_max_s - r.time_per_iter_min_s
    # One step has no spread: None ("unknown", null in the JSON), not a 0.0 that reads as a
    # perfectly steady timing.
    one = run_mode(cnn, "fp32", iters=1, warmup=0)
    assert one.time_per_iter_iqr_s is None
    assert one.time_per_iter_min_s == one.time_per_iter_s == one.time_per_iter_max_s


def test_cpu_peak_memory_sees_a_short_peak_without_sampling_fast():
    from mixprec.bench.runner import _CpuPeakMemory

    probe = _CpuPeakMemory()
    assert probe._interval >= 0.01  # a fallback thread, if any, samples at most at 100 Hz
    with probe:
        # 64 MiB, touched, then freed at once: above glibc's largest dynamic mmap threshold
        # (32 MiB), so it is fresh pages, not resident ones freed earlier (a 16 MiB block
        # reused those in a busy test worker and grew the RSS by 14.8 MiB).
        x = torch.ones(64 * 2**20 // 4)
        del x
    # Exact with the kernel's high-water mark; the fallback samples after the block as well.
    if probe._hwm:
        assert probe.peak_mb >= 60
    assert probe.peak_mb >= 0


def test_step_statistics_from_a_fake_clock(cnn, monkeypatch):
    # A clock that each step's loss advances by a known amount: the statistics are checked
    # exactly, with no real timing involved.
    import types

    import mixprec.bench.runner as runner

    clock = [0.0]
    durations = iter([100.0, 1.0, 2.0, 4.0, 9.0])  # one warm-up step, then four timed ones
    loss_fn = cnn.loss_fn

    def timed_loss(out, y):
        clock[0] += next(durations)
        return loss_fn(out, y)

    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    r = run_mode(dataclasses.replace(cnn, loss_fn=timed_loss), "fp32", iters=4, warmup=1)
    assert r.ok, r.error
    assert r.step_times_s == [1.0, 2.0, 4.0, 9.0]
    assert r.time_per_iter_s == 3.0  # the median, not the mean
    assert r.time_per_iter_mean_s == 4.0
    assert (r.time_per_iter_min_s, r.time_per_iter_max_s) == (1.0, 9.0)
    assert r.time_per_iter_iqr_s == pytest.approx(5.25 - 1.75)  # quantiles, "inclusive"
    assert r.total_time_s == 16.0  # the timed steps only: not the warm-up's 100 s


def test_final_loss_is_the_mean_over_the_last_pass_of_the_batch_pool():
    wl = build_workload("cnn", batch_size=4, num_batches=3)
    r = run_mode(wl, "fp32", iters=4, warmup=2)  # 6 steps over a pool of 3 batches
    assert len(r.losses) == 6
    assert r.final_loss == pytest.approx(sum(r.losses[-3:]) / 3, rel=1e-12)
    short = run_mode(wl, "fp32", iters=1, warmup=1)  # fewer steps than batches: every step
    assert short.final_loss == pytest.approx(sum(short.losses) / 2, rel=1e-12)


def test_one_overflowing_loss_in_the_last_pass_is_not_a_diverged_run():
    """(r99A B1) An fp16 forward that overflows once in the last pass (an inf loss, whose
    step dynamic loss scaling skips) made the mean over the pass inf: the table, JSON and CSV
    called the run diverged while its plot, judging the last loss, did not. The final loss is
    the mean over the pass's finite losses; a run whose last loss is not finite diverged."""
    wl = build_workload("cnn", batch_size=4, num_batches=4)
    calls = [0]

    def spiking(out, y, loss_fn=wl.loss_fn):
        calls[0] += 1
        loss = loss_fn(out, y)
        return loss * float("inf") if calls[0] == 9 else loss  # step 9 of 10

    r = run_mode(dataclasses.replace(wl, loss_fn=spiking), "O1", dtype=torch.float16,
                 iters=8, warmup=2)
    assert r.ok, r.error
    assert math.isinf(r.losses[8]) and r.skipped_steps >= 1
    want = (r.losses[6] + r.losses[7] + r.losses[9]) / 3
    assert r.final_loss == pytest.approx(want, rel=1e-12) and not r.diverged
    assert runner_module._final_loss([1.0, float("inf"), 2.0]) == 1.5
    assert math.isnan(runner_module._final_loss([1.0, 2.0, float("nan")]))
    assert math.isnan(runner_module._final_loss([float("inf")]))


def test_skipped_steps_are_unknown_once_the_grad_scalers_scale_underflowed(cnn, monkeypatch):
    # A run that overflows at every step halves GradScaler's scale down to 0, after which its
    # skips no longer show as halvings: the row says None (unknown), not 0 skipped steps.
    import mixprec.bench.runner as runner

    monkeypatch.setattr(runner, "_grad_scaler",
                        lambda device_type: torch.amp.GradScaler(device_type,
                                                                 init_scale=2.0**-145))
    r = run_mode(_overflowing(cnn, factor=float("inf")), "autocast", dtype=torch.float16,
                 iters=6, warmup=0)
    assert r.ok, r.error
    assert r.skipped_steps is None


def test_losses_match_a_plain_training_loop_over_the_batch_pool(cnn):
    # The seed's model, then the pool's batches in order from the first step (warm-up
    # included): the fp32 mode is exactly this loop.
    r = run_mode(cnn, "fp32", iters=3, warmup=1, seed=5)
    assert r.losses == pytest.approx(_plain_loop_losses(cnn, seed=5, steps=4), rel=1e-5)


def _plain_loop_losses(cnn, seed, steps, autocast_dtype=None):
    """The losses of a plain training loop over the pool's batches in order (under
    ``torch.autocast`` on the CPU with ``autocast_dtype``), from the seed's model."""
    torch.manual_seed(seed)
    model = cnn.build_model()
    opt = cnn.build_optimizer(model.parameters(), torch.device("cpu"))
    losses = []
    for i in range(steps):
        x, y = cnn.batches[i % len(cnn.batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            loss = cnn.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_an_infinite_final_loss_is_diverged_too():
    from mixprec.bench.runner import ModeResult

    for bad in (float("nan"), float("inf"), float("-inf")):
        r = ModeResult(mode="half", label=".half()", dtype="fp16", final_loss=bad)
        d = r.to_dict()
        assert r.diverged and d["diverged"] and d["final_loss"] is None, bad
    assert not ModeResult(mode="O0", label="O0", dtype="fp32", final_loss=1.0).diverged


def test_run_modes_refuses_one_mode_name_given_as_a_string(cnn):
    # "fp32" would otherwise be read as the modes "f", "p", "3", "2".
    with pytest.raises(TypeError, match=r"not one string; pass e.g. modes=\['fp32'\]"):
        run_modes(cnn, "fp32")


def test_skipped_steps_with_the_scale_on_the_device_count_the_last_step_too():
    # A fused AdamW has amp keep its dynamic scale on the device (CPU tensors here): each
    # step's overflow flag reaches the host later, the last one only when the count is read.
    wl = build_workload("gpt", batch_size=1, num_batches=1, fused_adamw=True)
    r = run_mode(_overflowing(wl, factor=float("inf")), "O1", dtype=torch.float16, iters=3,
                 warmup=1)
    assert r.ok, r.error
    assert r.skipped_steps == 4  # every step overflowed


def test_cpu_peak_memory_is_the_growth_over_the_start():
    from mixprec.bench.runner import _CpuPeakMemory

    probe = _CpuPeakMemory()
    with probe:
        pass  # nothing allocated
    # The growth the mode caused, not the process's whole resident memory (torch alone is
    # some hundreds of MiB).
    assert 0 <= probe.peak_mb < 32


def test_a_failed_row_is_never_diverged():
    """A failed mode has no loss to judge: reports must show it as failed, not also as
    diverged, whatever its final_loss field holds. (R05)"""
    r = ModeResult(mode="O2", label="O2", dtype="bf16", status="failed",
                   error="RuntimeError: x", final_loss=float("nan"))
    assert not r.diverged
    assert r.to_dict()["diverged"] is False


def test_to_dict_is_strict_json_with_nonfinite_losses_as_null():
    """to_dict is "JSON-ready": every non-finite loss (NaN, +-inf) of a diverged run becomes
    None, so json.dumps(allow_nan=False) (strict JSON readers) accepts the row. (R06)"""
    r = ModeResult(mode="half", label=".half()", dtype="fp16",
                   losses=[2.5, float("nan"), float("inf"), float("-inf")], final_loss=float("nan"))
    d = r.to_dict()
    assert d["losses"] == [2.5, None, None, None]
    assert d["final_loss"] is None and d["diverged"] is True
    json.dumps(d, allow_nan=False)  # raises ValueError on a NaN/inf left in the row


def test_cpu_peak_memory_is_reported_in_mib():
    """peak_mb is MiB: a touched 64 MiB block held inside the probe (and seen by one explicit
    sample, as the runner samples after every step) reads as about 64, on the kernel's
    high-water mark and on the sampling fallback alike. (R09)"""
    probe = _CpuPeakMemory()
    with probe:
        x = torch.ones(64 * 2**20 // 4)
        probe.sample()
        del x
    assert 60 <= probe.peak_mb < 1024  # in KiB it would read about 65536


def test_cpu_peak_memory_sampling_fallback_sees_a_held_block_and_stops(monkeypatch):
    """Where the kernel's peak cannot be reset (non-Linux, a /proc refusing clear_refs) the
    probe samples the RSS: a block alive at a sample counts, and leaving the probe stops the
    sampler thread (the run must not hang or leak a thread per mode). (R19)"""
    monkeypatch.setattr(runner_module, "_reset_hwm", lambda: False)
    probe = _CpuPeakMemory()
    if probe._read is None:
        pytest.skip("no RSS reader on this system")
    done = threading.Event()

    def measure():  # in a thread of its own: a sampler that never stops fails, not hangs
        with probe:
            x = torch.ones(64 * 2**20 // 4)
            probe.sample()
            del x
        done.set()

    worker = threading.Thread(target=measure, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert done.is_set(), "leaving the probe did not stop (or failed)"
    assert probe._thread is not None and not probe._thread.is_alive()
    assert 60 <= probe.peak_mb < 1024


def _kernel_resets_the_peak_rss():
    """Independently of the runner: does writing "5" to clear_refs reset VmHWM here?"""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    fields[key] = int(rest.split()[0])
    except (OSError, ValueError):
        return False
    return fields["VmHWM"] <= fields["VmRSS"] + 1024  # kB


def test_cpu_peak_memory_uses_the_kernels_peak_where_it_can_be_reset():
    """On Linux with a resettable VmHWM the peak is exact: a 64 MiB block allocated and freed
    between samples is still counted (the documented "exact, nothing runs beside the timed
    steps" measurement, not the 10 ms sampler). (R12)"""
    if not _kernel_resets_the_peak_rss():
        pytest.skip("this kernel does not reset VmHWM through /proc/self/clear_refs")
    probe = _CpuPeakMemory()
    with probe:
        x = torch.ones(64 * 2**20 // 4)
        del x
    assert probe._hwm and probe._thread is None
    assert probe.peak_mb >= 60


def test_the_peak_rss_reset_is_trusted_only_when_it_took_effect(monkeypatch):
    """An old kernel accepts the "5" written to clear_refs and ignores it: VmHWM then still
    holds a peak from before the mode, far above the current RSS, and the probe must not
    trust it (it falls back to sampling). (R13)"""
    if not _kernel_resets_the_peak_rss():
        pytest.skip("this kernel does not reset VmHWM through /proc/self/clear_refs")
    assert runner_module._reset_hwm() is True
    monkeypatch.setattr(runner_module, "_read_hwm_bytes", lambda: 2**50)  # reset ignored
    assert runner_module._reset_hwm() is False


def test_the_runner_trains_a_model_built_in_eval_mode(cnn):
    """run_mode trains the model whatever mode build_model left it in: a model handed back in
    eval mode is switched to train mode (its BatchNorm updates the running statistics at every
    step). (R55)"""
    build = cnn.build_model
    wl, built = _capturing(dataclasses.replace(cnn, build_model=lambda: build().eval()))
    assert run_mode(wl, "fp32", **FAST).ok
    model = built[-1]
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert model.training and bn.training and int(bn.num_batches_tracked) == 3


def test_peak_memory_of_a_mode_counts_what_its_steps_allocate(cnn):
    """A mode's peak_memory_mb is the memory its steps added, in MiB: a step that keeps a
    64 MiB block shows as at least 60 MiB (the tiny CNN itself adds a few MiB; the first run
    in a process also pays its one-time costs, over 100 MiB, hence the warm-up run). (R79, R09)"""
    kept = []
    loss_fn = cnn.loss_fn

    def hoarding_loss(out, y):
        if not kept:
            kept.append(torch.ones(64 * 2**20 // 4))
        return loss_fn(out, y)

    run_mode(cnn, "fp32", **FAST)  # the process's one-time costs (thread pools, lazy code)
    r = run_mode(dataclasses.replace(cnn, loss_fn=hoarding_loss), "fp32", **FAST)
    assert r.ok, r.error
    assert 60 <= r.peak_memory_mb < 1024  # MiB: in KiB the block alone would read 65536


def _seeing_inputs(workload):
    """The workload with every model it builds recording whether its input is NHWC."""
    seen = []
    build = workload.build_model

    def build_model():
        model = build()
        model.register_forward_pre_hook(
            lambda mod, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
        )
        return model

    return dataclasses.replace(workload, build_model=build_model), seen


def test_channels_last_converts_the_image_model_and_its_batches(cnn):
    """channels_last=True trains the image model in NHWC: every conv weight and every batch
    it sees is channels_last, and the losses are those of the NCHW run (to float
    rounding). (R31, R32, M34)"""
    wl, seen = _seeing_inputs(cnn)
    wl, built = _capturing(wl)
    nhwc = run_mode(wl, "fp32", channels_last=True, **FAST)
    assert nhwc.ok, nhwc.error
    assert seen == [True] * 3
    convs = [m for m in built[-1].modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    nchw = run_mode(cnn, "fp32", **FAST)
    assert nhwc.losses == pytest.approx(nchw.losses, rel=1e-4)


def test_channels_last_leaves_a_token_model_alone():
    """channels_last applies to image workloads only: the GPT's 2-D token batches pass
    through unchanged and it trains exactly as without the flag. (R30)"""
    gpt = build_workload("gpt", batch_size=1, num_batches=1)
    flagged = run_mode(gpt, "fp32", channels_last=True, iters=1, warmup=0)
    assert flagged.ok, flagged.error
    plain = run_mode(gpt, "fp32", iters=1, warmup=0)
    assert flagged.losses == plain.losses


def test_pure_half_gpt_keeps_its_tokens_integers():
    """The "half" recipe casts floating-point inputs only: the GPT's token ids stay integer
    indices into the embedding (casting them would fail or corrupt them). (R34)"""
    gpt = build_workload("gpt", batch_size=1, num_batches=1)
    r = run_mode(gpt, "half", iters=1, warmup=1)
    assert r.ok, r.error
    assert r.dtype == "bf16" and all(math.isfinite(v) for v in r.losses)


def test_pure_half_is_a_plain_loop_on_the_half_model(cnn):
    """The "half" mode is model.to(dtype), inputs cast to dtype, no loss scaling, fresh
    gradients every step: the same losses as that loop written out. (R51, R33)"""
    r = run_mode(cnn, "half", dtype=torch.bfloat16, iters=2, warmup=1, seed=4)
    assert r.ok, r.error
    torch.manual_seed(4)
    model = cnn.build_model().to(torch.bfloat16)
    opt = cnn.build_optimizer(model.parameters(), torch.device("cpu"))
    ref = []
    for i in range(3):
        x, y = cnn.batches[i % len(cnn.batches)]
        opt.zero_grad(set_to_none=True)
        loss = cnn.loss_fn(model(x.to(torch.bfloat16)), y)
        loss.backward()
        opt.step()
        ref.append(loss.item())
    assert r.losses == pytest.approx(ref, rel=1e-5)


def test_autocast_fp16_is_torch_autocast_with_a_grad_scaler(cnn):
    """The fp16 "autocast" mode is PyTorch's recipe: torch.autocast at float16 plus a
    default GradScaler, fresh gradients every step: the same losses as that loop. (R38)"""
    r = run_mode(cnn, "autocast", dtype=torch.float16, iters=2, warmup=1, seed=3)
    assert r.ok, r.error
    torch.manual_seed(3)
    model = cnn.build_model()
    opt = cnn.build_optimizer(model.parameters(), torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu")
    ref = []
    for i in range(3):
        x, y = cnn.batches[i % len(cnn.batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = cnn.loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        ref.append(loss.item())
    assert r.losses == pytest.approx(ref, rel=1e-5)


def test_bf16_autocast_has_no_loss_scaler(cnn):
    """bf16 has fp32's exponent range, so the bf16 "autocast" row uses no GradScaler: it is
    labelled plain "autocast" and never skips a step, even on non-finite gradients that a
    scaler would skip. (R37)"""
    r = run_mode(_overflowing(cnn, factor=float("inf")), "autocast", dtype=torch.bfloat16,
                 **FAST)
    assert r.ok, r.error
    assert r.label == "autocast" and r.skipped_steps == 0


def test_o0_matches_plain_fp32_at_every_step(cnn):
    """O0 is fp32 training through amp with a loss scale of 1: every step's loss, not only
    the first, is bitwise the plain fp32 mode's (amp must also clear the gradients between
    steps). (R53)"""
    fp32, o0 = run_modes(cnn, ["fp32", "O0"], iters=3, warmup=1, process_warmup=False)
    assert fp32.ok and o0.ok
    assert o0.losses == fp32.losses


def test_frozen_bn_freezes_mixprecs_fused_batchnorm_too():
    """frozen_bn puts every BatchNorm layer in eval mode, the BatchNorm base class included,
    so a workload built with fused_batchnorm=True (mixprec's FusedBatchNorm) keeps its running
    statistics too. (R54)"""
    wl, built = _capturing(build_workload("cnn", batch_size=4, num_batches=1,
                                          fused_batchnorm=True))
    r = run_mode(wl, "fp32", frozen_bn=True, **FAST)
    assert r.ok, r.error
    bns = [m for m in built[-1].modules()
           if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns and all(not bn.training for bn in bns)
    assert all(int(bn.num_batches_tracked) == 0 for bn in bns)


def test_cudnn_benchmark_is_set_while_the_mode_runs_and_restored_after(cnn):
    """cudnn_benchmark sets torch.backends.cudnn.benchmark for the mode's steps only: the
    user's global setting is back afterwards. (R61, R62)"""
    seen = []
    loss_fn = cnn.loss_fn

    def spying_loss(out, y):
        seen.append(torch.backends.cudnn.benchmark)
        return loss_fn(out, y)

    wl = dataclasses.replace(cnn, loss_fn=spying_loss)
    previous = torch.backends.cudnn.benchmark
    try:
        for flag in (True, False):
            torch.backends.cudnn.benchmark = not flag
            seen.clear()
            assert run_mode(wl, "fp32", cudnn_benchmark=flag, **FAST).ok
            assert seen == [flag] * 3
            assert torch.backends.cudnn.benchmark is (not flag)
    finally:
        torch.backends.cudnn.benchmark = previous


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"iters": True}, TypeError, r"run_mode\(iters=True\): iters must be an int >= 1, not bool"),
        ({"warmup": False}, TypeError, r"run_mode\(warmup=False\): warmup must be an int >= 0"),
        ({"dtype": torch.float64}, ValueError,
         r"run_mode\(dtype=torch.float64\): dtype must be torch.float16 or torch.bfloat16"),
    ],
)
def test_run_mode_refuses_bools_and_other_float_dtypes(cnn, kwargs, error, match):
    """iters/warmup are counts (True is not 1 step) and the half type is float16 or bfloat16
    only (float64 is no mixed-precision dtype). (R64, R90)"""
    with pytest.raises(error, match=match):
        run_mode(cnn, "O1", **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_run_modes_refuses_cuda_without_cuda_before_running(cnn, monkeypatch):
    """device='cuda' on a machine without CUDA is an argument error raised before anything
    runs, not a table of failed rows. (R70)"""
    def must_not_run(*args, **kw):
        raise AssertionError("ran before the arguments were checked")

    monkeypatch.setattr(runner_module, "warm_up_process", must_not_run)
    monkeypatch.setattr(runner_module, "run_mode", must_not_run)
    with pytest.raises(ValueError, match=r"run_modes\(device='cuda'\): CUDA is not available"):
        run_modes(cnn, ["O1"], device="cuda")


def test_run_modes_warms_up_the_process_once_at_the_half_dtype(cnn, monkeypatch):
    """By default run_modes first runs one process warm-up (fp32 and autocast at the run's
    half dtype, on the run's device) before the first mode; process_warmup=False skips
    it. (R71, R72)"""
    calls = []

    def warm_up(workload, device="cpu", dtype=None):
        calls.append(("warm-up", str(device), dtype))

    def fake_run_mode(workload, mode, **kwargs):
        calls.append(mode)
        return ModeResult(mode=mode, label=mode, dtype="fp16")

    monkeypatch.setattr(runner_module, "warm_up_process", warm_up)
    monkeypatch.setattr(runner_module, "run_mode", fake_run_mode)
    run_modes(cnn, ["fp32", "O1"], dtype=torch.float16)
    assert calls == [("warm-up", "cpu", torch.float16), "fp32", "O1"]
    calls.clear()
    run_modes(cnn, ["fp32"], dtype=torch.float16, process_warmup=False)
    assert calls == ["fp32"]


def _o2_fails(monkeypatch, message):
    """Make building the O2 recipe raise RuntimeError(message); the other modes run."""
    real = runner_module._build_recipe

    def build_recipe(workload, mode, *args):
        if mode == "O2":
            raise RuntimeError(message)
        return real(workload, mode, *args)

    monkeypatch.setattr(runner_module, "_build_recipe", build_recipe)


def test_a_failed_mode_is_a_complete_failed_row_reported_like_the_others(cnn, monkeypatch):
    """A mode that raises becomes a row with status "failed", "Type: message", its label,
    dtype, device and the run's iters/warmup, no measurements, and on_result sees it as it
    sees the ok rows; the rows record the timed steps, not warm-up + timed. (R73, R74, R75,
    R88, R89)"""
    _o2_fails(monkeypatch, "no half here (forced by the test)")
    seen = []
    rows = run_modes(cnn, ["O2", "fp32"], dtype=torch.float16, on_result=seen.append,
                     process_warmup=False, iters=2, warmup=1)
    assert seen == rows
    failed, ok = rows
    assert (failed.status, failed.error) == ("failed", "RuntimeError: no half here (forced "
                                                       "by the test)")
    assert (failed.label, failed.dtype, failed.device) == ("O2", "fp16", "cpu")
    assert (failed.iters, failed.warmup) == (2, 1)
    assert failed.time_per_iter_s is None and failed.losses == [] and not failed.diverged
    assert ok.ok and (ok.iters, ok.warmup) == (2, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
def test_a_failed_row_names_the_cuda_device_as_the_ok_rows_do(monkeypatch):
    # device="cuda": the ok rows say "cuda:0" (the current device); a failed row said "cuda".
    _o2_fails(monkeypatch, "forced by the test")
    workload = build_workload("cnn", device="cuda", batch_size=4, num_batches=2)
    rows = run_modes(workload, ["O2", "fp32"], device="cuda", process_warmup=False, **FAST)
    assert [r.status for r in rows] == ["failed", "ok"]
    assert rows[0].device == rows[1].device == f"cuda:{torch.cuda.current_device()}"


def test_progress_is_called_after_every_step_with_its_index(cnn):
    """progress(mode, step) runs after each step, warm-up included, with the 0-based step
    index: a progress bar of warmup + iters steps per mode ends full. (R77)"""
    calls = []
    r = run_mode(cnn, "O1", progress=lambda mode, i: calls.append((mode, i)), **FAST)
    assert r.ok, r.error
    assert calls == [("O1", 0), ("O1", 1), ("O1", 2)]


def test_grad_scaler_skips_are_unknown_once_growth_may_have_happened():
    """GradScaler doubles its scale after 2000 unskipped steps in a row, after which halvings
    no longer count the skipped steps (one skip, then 2000 good steps, reads 0 halvings): a
    shorter run is exact, a run past 2000 steps reports the count as unknown. (R41)"""
    from mixprec.bench.runner import _AutocastRecipe

    for steps, known in ((1999, True), (2001, False), (10_000, False)):
        recipe = _AutocastRecipe(nn.Linear(1, 1), None, None, torch.float16, "cpu")
        recipe.scaler = type("Scaler", (), {"get_scale": lambda self: 2.0**16})()
        recipe.steps = steps
        recipe.finish()
        assert recipe.skips_known is known and recipe.skipped == 0, steps


# -- mutation run r56B over the runner: what the tests above let through -------------------


def test_channels_last_leaves_the_workloads_own_batches_alone():
    """channels_last converts the copies of the batches one mode trains on, not the workload's
    list: the modes run after it (run_modes shares one workload among them) and the caller
    still get the batches in their own layout. (M03)"""
    wl = build_workload("cnn", batch_size=4, num_batches=2)
    before = list(wl.batches)
    assert run_mode(wl, "fp32", channels_last=True, iters=1, warmup=0).ok
    assert len(wl.batches) == len(before)
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(wl.batches, before))
    assert all(x.is_contiguous() for x, _ in wl.batches)
    seeing, seen = _seeing_inputs(wl)
    assert run_mode(seeing, "fp32", iters=1, warmup=0).ok
    assert seen == [False]  # the next mode, without the flag, trains on NCHW batches


def test_grad_scaler_skips_are_unknown_after_2000_steps_of_a_real_run(cnn):
    """Past 2000 steps GradScaler may have grown its scale, after which its halvings no longer
    count the skipped steps: a real fp16 autocast run of 2001 steps reports its count as
    unknown (None), not a number that may be short. The recipe counts the steps it ran,
    warm-up included (a one-layer model keeps the 2001 steps within a few seconds). (M11)"""
    tiny = dataclasses.replace(
        cnn, build_model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))
    )
    long = run_mode(tiny, "autocast", dtype=torch.float16, iters=1, warmup=2000)
    assert long.ok, long.error
    assert len(long.losses) == 2001 and long.skipped_steps is None
    short = run_mode(tiny, "autocast", dtype=torch.float16, iters=1, warmup=5)
    assert short.ok and isinstance(short.skipped_steps, int)


def _fake_clock(monkeypatch, workload, durations):
    """A clock that only each step's loss (and whoever calls `tick`) advances, by known
    amounts: the timing statistics are then checked exactly, with no real timing."""
    import types

    clock = [0.0]
    durations = iter(durations)
    loss_fn = workload.loss_fn

    def timed_loss(out, y):
        clock[0] += next(durations)
        return loss_fn(out, y)

    def tick(seconds):
        clock[0] += seconds

    monkeypatch.setattr(runner_module, "time",
                        types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return dataclasses.replace(workload, loss_fn=timed_loss), tick


def test_two_timed_steps_have_an_interquartile_range(cnn, monkeypatch):
    """The IQR is the inclusive-method quartiles' difference from two timed steps on (only
    one step gives 0.0): for steps of 1 s and 3 s, Q1 = 1.5 and Q3 = 2.5."""
    import statistics

    wl, _ = _fake_clock(monkeypatch, cnn, [1.0, 3.0])
    r = run_mode(wl, "fp32", iters=2, warmup=0)
    assert r.ok, r.error
    q1, _, q3 = statistics.quantiles([1.0, 3.0], n=4, method="inclusive")
    assert r.time_per_iter_iqr_s == pytest.approx(q3 - q1) == pytest.approx(1.0)


def test_total_time_counts_the_loops_work_between_the_timed_steps(cnn, monkeypatch):
    """total_time_s is the wall time of the timed part of the run, so it includes the work
    the loop does between steps (here a progress callback taking 0.5 s a call) that the
    per-step times leave out; the warm-up step and its callback are not counted."""
    wl, tick = _fake_clock(monkeypatch, cnn, [100.0, 1.0, 2.0, 4.0, 9.0])
    r = run_mode(wl, "fp32", iters=4, warmup=1, progress=lambda mode, step: tick(0.5))
    assert r.ok, r.error
    assert r.step_times_s == [1.0, 2.0, 4.0, 9.0]
    assert r.total_time_s == 16.0 + 4 * 0.5


# -- mutation run r64C over the runner: what the tests above let through -------------------


def test_a_mode_failing_with_any_exception_type_is_a_failed_row(cnn, monkeypatch):
    """A recipe can fail with any exception type (a TypeError from a model that does not take
    the half inputs, a ValueError from amp's argument checks): each becomes a failed row named
    by its type, and the modes after it still run, so one broken recipe never costs the
    benchmark the other rows. (N01)"""
    errors = {"O1": TypeError("no half inputs here (forced by the test)"),
              "O2": ValueError("bad opt level setting (forced by the test)")}
    real = runner_module._build_recipe

    def build_recipe(workload, mode, *args):
        if mode in errors:
            raise errors[mode]
        return real(workload, mode, *args)

    monkeypatch.setattr(runner_module, "_build_recipe", build_recipe)
    rows = run_modes(cnn, ["O1", "O2", "fp32"], process_warmup=False, **FAST)
    assert [(r.mode, r.status, r.error) for r in rows[:2]] == [
        ("O1", "failed", "TypeError: no half inputs here (forced by the test)"),
        ("O2", "failed", "ValueError: bad opt level setting (forced by the test)"),
    ]
    assert rows[2].ok, rows[2].error


def test_cpu_peak_memory_fallback_counts_a_block_still_held_when_left(monkeypatch):
    """The sampling fallback reads the RSS once more when the probe is left: memory the mode
    still holds at its end counts even when no sample fell after it was allocated (a sampler
    thread that never woke up here). (N02)"""
    monkeypatch.setattr(runner_module, "_reset_hwm", lambda: False)
    probe = _CpuPeakMemory(interval_s=3600.0)  # the thread never samples on its own
    if probe._read is None:
        pytest.skip("no RSS reader on this system")
    with probe:
        x = torch.ones(64 * 2**20 // 4)  # touched, alive when the probe is left
    del x
    assert not probe._hwm
    assert 60 <= probe.peak_mb < 1024


def test_cpu_peak_memory_resets_the_kernels_peak_after_a_larger_earlier_one():
    """Each probe starts the kernel's high-water mark afresh: after an earlier, larger peak
    (a previous mode's) the next mode still gets the exact measurement, not the sampling
    fallback, and its peak is its own growth, not the earlier mode's. (N03)"""
    if not _kernel_resets_the_peak_rss():
        pytest.skip("this kernel does not reset VmHWM through /proc/self/clear_refs")
    big = torch.ones(256 * 2**20 // 4)  # an earlier peak 256 MiB above what stays resident
    del big
    probe = _CpuPeakMemory()
    with probe:
        x = torch.ones(16 * 2**20 // 4)
        del x
    assert probe._hwm and probe._thread is None
    assert 12 <= probe.peak_mb < 128


def test_run_mode_samples_the_fallback_probe_after_every_step(cnn, monkeypatch):
    """Where the kernel's peak cannot be reset, run_mode reads the RSS after every step as
    well as in the 10 ms sampler: a 64 MiB block one step holds until the next step frees it
    counts in the mode's peak even when the sampler thread never wakes in between. (N05)"""
    monkeypatch.setattr(runner_module, "_reset_hwm", lambda: False)
    monkeypatch.setattr(runner_module, "_CpuPeakMemory",
                        functools.partial(_CpuPeakMemory, interval_s=3600.0))
    if _CpuPeakMemory()._read is None:
        pytest.skip("no RSS reader on this system")
    held, calls = [], []
    loss_fn = cnn.loss_fn

    def loss_holding_a_block_for_one_step(out, y):
        calls.append(None)
        if len(calls) == 1:
            held.append(torch.ones(64 * 2**20 // 4))  # step 1 allocates and keeps it
        else:
            held.clear()  # step 2 frees it: gone by the probe's end
        return loss_fn(out, y)

    run_mode(cnn, "fp32", **FAST)  # the process's one-time costs first
    r = run_mode(dataclasses.replace(cnn, loss_fn=loss_holding_a_block_for_one_step), "fp32",
                 **FAST)
    assert r.ok, r.error
    assert not held
    assert 60 <= r.peak_memory_mb < 1024


# -- the precision each recipe trains in, memory readings ---------------------------------------


def _recording_output_dtypes(workload):
    """Keep every model the runner builds, with the dtypes its conv and linear layers
    returned during training (forward hooks), to check the precision a recipe really ran."""
    built, seen = [], []

    def build_model():
        model = workload.build_model()
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
        built.append(model)
        return model

    return dataclasses.replace(workload, build_model=build_model), built, seen


#: Per mode, with H the half type: (conv/linear weights, BatchNorm weights, conv/linear
#: outputs). The documented recipes: fp32 and O0 are fp32 throughout; O1 and autocast keep
#: fp32 weights and compute in H; O2 casts the model to H but keeps BatchNorm in fp32; O3 and
#: pure half hold every weight in H.
_PRECISION = {
    "fp32": ("fp32", "fp32", "fp32"),
    "O0": ("fp32", "fp32", "fp32"),
    "O1": ("fp32", "fp32", "H"),
    "O2": ("H", "fp32", "H"),
    "O3": ("H", "H", "H"),
    "autocast": ("fp32", "fp32", "H"),
    "half": ("H", "H", "H"),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_trains_in_the_precision_its_row_names(cnn, mode, dtype):
    """Each row of the table is a claim about a recipe: a mode that silently trained in
    another precision (O3 run as O1, O2 as O1, bf16 autocast with autocast off) would still
    run, still converge and report plausible numbers, and users would compare the wrong
    recipes. The model the mode trained holds its weights, and its conv and linear layers
    compute, in the types that recipe documents. (R03, R04, R06)"""
    wl, built, seen = _recording_output_dtypes(cnn)
    r = run_mode(wl, mode, dtype=dtype, iters=1, warmup=0)
    assert r.ok, r.error
    names = {"fp32": torch.float32, "H": dtype}
    weights, bn_weights, outputs = (names[k] for k in _PRECISION[mode])
    model = built[-1]
    convs = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert convs and bns and seen
    assert {m.weight.dtype for m in convs} == {weights}
    assert {m.weight.dtype for m in bns} == {bn_weights}
    assert set(seen) == {outputs}


def test_bf16_autocast_is_torch_autocast_without_a_scaler_step_for_step(cnn):
    """The bf16 "autocast" row is PyTorch's bf16 recipe: torch.autocast at bfloat16, no
    GradScaler, fresh gradients every step: the same losses as that loop written out (a row
    that kept gradients across steps, or ran with autocast off, would still train and report
    plausible numbers). (R32, R06)"""
    r = run_mode(cnn, "autocast", dtype=torch.bfloat16, iters=2, warmup=1, seed=3)
    assert r.ok, r.error
    ref = _plain_loop_losses(cnn, seed=3, steps=3, autocast_dtype=torch.bfloat16)
    assert r.losses == pytest.approx(ref, rel=1e-5)


def test_cpu_peak_memory_is_mebibytes_of_rss_growth_exactly(monkeypatch):
    """peak_memory_mb is documented in MiB (2**20 bytes), as CUDA's rows are: a CPU row in
    decimal megabytes would read 4.9% high, and a report comparing CPU and CUDA runs would be
    off by that much. An RSS reader stepped by hand (fallback sampler) makes it exact: 64 MiB
    of growth over the start reads 64.0. (R20)"""
    rss = [300 * 2**20]
    monkeypatch.setattr(runner_module, "_reset_hwm", lambda: False)
    monkeypatch.setattr(runner_module, "_rss_reader", lambda: lambda: rss[0])
    probe = _CpuPeakMemory()
    with probe:
        rss[0] += 64 * 2**20
        probe.sample()
        rss[0] -= 64 * 2**20
    assert probe.peak_mb == 64.0


def test_an_ignored_peak_rss_reset_is_caught_with_an_earlier_mode_s_peak_left_in_it(monkeypatch):
    """The probe trusts the kernel's peak only when the reset took effect. A kernel that ignores
    the reset leaves the previous mode's peak in VmHWM, typically tens of MiB above the current
    RSS (not 2**50 bytes): that must be caught too, or the next mode is charged the previous
    mode's memory. Only a small slack (about 1 MiB, for pages touched meanwhile) is allowed.
    (R30)"""
    if not _kernel_resets_the_peak_rss():
        pytest.skip("this kernel does not reset VmHWM through /proc/self/clear_refs")
    read = runner_module._rss_reader()
    monkeypatch.setattr(runner_module, "_read_hwm_bytes", lambda: read() + 64 * 2**20)
    assert runner_module._reset_hwm() is False


class _FakeCudaAllocator:
    """torch.cuda's allocator statistics, driven by hand: ``allocated`` now, and the peak
    since the last reset. Lets the CUDA memory probe's arithmetic run on a CPU-only CI (the
    CUDA tests only check inequalities such as total >= peak > 0)."""

    def __init__(self, allocated):
        self.allocated = allocated
        self.peak = allocated

    def touch(self, nbytes):  # a step allocates nbytes on top, then frees them
        self.peak = max(self.peak, self.allocated + nbytes)

    def install(self, monkeypatch):
        cuda = runner_module.torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)

        def reset(device=None):
            self.peak = self.allocated

        monkeypatch.setattr(cuda, "reset_peak_memory_stats", reset)


def test_cuda_peak_memory_is_the_growth_over_the_start_and_keeps_the_warm_ups_peak(monkeypatch):
    """The GPU rows' peak memory (the README's tables): the allocator's peak minus what was
    allocated when the mode started (the shared data), over ALL steps, although the peak
    statistic is reset when the timed steps begin; the steady peak is the timed steps' alone
    and the total peak includes the data. With 100 MiB of data, a warm-up step reaching
    +400 MiB (cuDNN's search) and timed steps reaching +200 MiB: 400, 200 and 500 MiB."""
    mib = 2**20
    fake = _FakeCudaAllocator(100 * mib)
    fake.install(monkeypatch)
    probe = runner_module._CudaPeakMemory(torch.device("cuda", 0))
    with probe:
        fake.allocated += 50 * mib  # the model and optimizer: held to the end
        fake.touch(350 * mib)  # warm-up step: peak 500 MiB
        probe.start_steady()
        fake.touch(150 * mib)  # timed step: peak 300 MiB
        fake.allocated -= 50 * mib
    assert probe.peak_mb == 400.0
    assert probe.steady_peak_mb == 200.0
    assert probe.total_peak_mb == 500.0


def test_cuda_step_times_are_the_events_milliseconds_in_seconds(monkeypatch):
    """On CUDA each timed step is a pair of events; Event.elapsed_time is in milliseconds and
    the row's times are seconds (a /1000 lost, or the pair read backwards, would put the GPU
    tables 1000x off or negative: the CUDA tests only check > 0)."""
    clock = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t  # ms, as torch.cuda.Event's

    monkeypatch.setattr(runner_module.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(runner_module.torch.cuda, "synchronize", lambda device=None: None)
    timer = runner_module._StepTimer(torch.device("cuda", 0), 3)
    timer.start_all()
    for i, ms in enumerate((5.0, 7.0, 250.0)):
        timer.start(i)
        clock[0] += ms
        timer.stop(i)
        clock[0] += 1.0  # the loop's own work between steps
    timer.stop_all()
    assert timer.times_s() == pytest.approx([0.005, 0.007, 0.25], rel=1e-12)


# The probes and the timer, with stand-ins for the CUDA calls (r99A).

def test_no_cpu_peak_is_reported_where_the_rss_cannot_be_read(cnn, monkeypatch):
    """(r99A R2) With no /proc and no psutil the probe read ru_maxrss, the process's lifetime
    peak: a mode after a larger one read ~0 MiB (0.0 against O0's 1.7 in a run). No figure
    is better than that one: peak_mb is None, and the row's peak memory too."""
    monkeypatch.setattr(runner_module, "_rss_reader", lambda: None)
    probe = _CpuPeakMemory()
    with probe:
        probe.sample()
    assert probe.peak_mb is None and not runner_module.cpu_memory_readable()
    r = run_mode(cnn, "fp32", **FAST)
    assert r.ok, r.error
    assert r.peak_memory_mb is None and r.time_per_iter_s > 0


def test_cuda_peak_memory_does_not_inherit_an_earlier_modes_peak(monkeypatch):
    """(r99A) the allocator's peak statistic is process-wide; a previous mode (fp32, say)
    left it at +1000 MiB. The probe resets it on entry, so this mode's peak (warm-up +300 MiB
    over 100 MiB of data) is its own: 300, not 900."""
    mib = 2**20
    fake = _FakeCudaAllocator(100 * mib)
    fake.peak = 1100 * mib  # an earlier mode's peak, never reset since
    fake.install(monkeypatch)
    probe = runner_module._CudaPeakMemory(torch.device("cuda", 0))
    with probe:
        fake.touch(300 * mib)
        probe.start_steady()
        fake.touch(100 * mib)
    assert probe.peak_mb == 300.0
    assert probe.steady_peak_mb == 100.0


def _fake_cuda_sync(monkeypatch):
    """A CUDA stream stand-in: work queued by the host runs only when synchronize() waits for
    it; the clock (perf_counter) advances by the queued work's time at that moment."""
    state = {"clock": 0.0, "queued": 0.0}

    def synchronize(device=None):
        state["clock"] += state["queued"]
        state["queued"] = 0.0

    monkeypatch.setattr(runner_module.torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(runner_module, "time",
                        types.SimpleNamespace(perf_counter=lambda: state["clock"]))

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            pass

    monkeypatch.setattr(runner_module.torch.cuda, "Event", FakeEvent)
    return state


def test_cuda_wall_time_starts_after_the_warm_ups_queued_work(monkeypatch):
    """(r99A) on CUDA the warm-up's kernels may still be queued when the timed loop starts;
    start_all synchronizes before reading the clock, so total_time_s is the timed steps'
    (3 s), not the warm-up's 100 s on top."""
    state = _fake_cuda_sync(monkeypatch)
    timer = runner_module._StepTimer(torch.device("cuda", 0), 3)
    state["queued"] = 100.0  # the warm-up, not finished on the device
    timer.start_all()
    for i in range(3):
        timer.start(i)
        state["queued"] += 1.0  # a timed step's kernels
        timer.stop(i)
    timer.stop_all()
    assert timer.wall_s == 3.0


def test_cuda_wall_time_waits_for_the_last_timed_steps_work(monkeypatch):
    """(r99A) the host runs ahead of the GPU; stop_all synchronizes before reading the
    clock, so total_time_s includes the timed steps' kernels still queued (3 s), not only
    the host's enqueueing (0 s)."""
    state = _fake_cuda_sync(monkeypatch)
    timer = runner_module._StepTimer(torch.device("cuda", 0), 3)
    timer.start_all()
    for i in range(3):
        timer.start(i)
        state["queued"] += 1.0
        timer.stop(i)
    timer.stop_all()
    assert timer.wall_s == 3.0


def test_run_mode_starts_the_steady_peak_when_the_timed_steps_start(cnn, monkeypatch):
    """(r99A) run_mode starts the CUDA probe's steady peak at the first timed step (after the
    warm-up), and reports it in extra. A recording stand-in for the CUDA probe (a subclass,
    so run_mode treats it as the CUDA one) runs the CPU workload."""
    events = []

    class Recording(runner_module._CudaPeakMemory):
        def __init__(self):
            super().__init__(torch.device("cpu"))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.total_peak_mb = 0.0

        def start_steady(self):
            events.append(("steady", len(steps)))
            self._steady_peak = 0

    steps = []
    monkeypatch.setattr(runner_module, "_CpuPeakMemory", Recording)
    r = run_mode(cnn, "fp32", iters=2, warmup=3, progress=lambda m, i: steps.append(i))
    assert r.ok, r.error
    assert events == [("steady", 3)]  # after the 3 warm-up steps, before the first timed one
    assert r.extra["peak_memory_steady_mb"] == 0.0


def test_total_time_is_the_timed_loop_not_the_recipes_finish(cnn, monkeypatch):
    """(r99A) total_time_s is the wall time of the timed steps (and the loop's work between
    them); the recipe's finish() (amp's state_dict read, a host sync on CUDA) comes after
    the clock stops."""
    clock = [0.0]
    durations = iter([1.0, 2.0, 4.0])
    loss_fn = cnn.loss_fn

    def timed_loss(out, y):
        clock[0] += next(durations)
        return loss_fn(out, y)

    monkeypatch.setattr(runner_module, "time",
                        types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real_finish = runner_module._Fp32Recipe.finish

    def slow_finish(self):
        clock[0] += 50.0
        return real_finish(self)

    monkeypatch.setattr(runner_module._Fp32Recipe, "finish", slow_finish)
    r = run_mode(dataclasses.replace(cnn, loss_fn=timed_loss), "fp32", iters=2, warmup=1)
    assert r.ok, r.error
    assert r.total_time_s == 6.0
