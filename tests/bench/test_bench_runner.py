"""The runner: same start for every mode, frozen BatchNorm, skipped-step counts, errors."""

import dataclasses
import math

import pytest
import torch
from torch import nn

from mixprec.bench.models import build_workload
from mixprec.bench.runner import MODES, mode_label, run_mode, run_modes

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
    one = run_mode(cnn, "fp32", iters=1, warmup=0)
    assert one.time_per_iter_iqr_s == 0.0


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
    torch.manual_seed(5)
    model = cnn.build_model()
    opt = cnn.build_optimizer(model.parameters(), torch.device("cpu"))
    ref = []
    for i in range(4):
        x, y = cnn.batches[i % len(cnn.batches)]
        opt.zero_grad(set_to_none=True)
        loss = cnn.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        ref.append(loss.item())
    assert r.losses == pytest.approx(ref, rel=1e-5)


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
