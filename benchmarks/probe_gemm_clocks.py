"""Why amp O2's GEMMs run longer than pure ``.half()``'s: extra memory traffic, or O2 itself?

A diagnostic for issue 2's "O2 <= 1.05x pure half" miss on the GPT-style fp16 step, where the
profiler showed the same cuBLAS kernels taking ~5% longer under O2. Three recipes, alternating
in rounds in one process, on the same model and data:

* ``half``: pure ``.half()`` with fused AdamW (eps 1e-4, so that it trains instead of going NaN;
  a GEMM on NaN data runs faster than on real data);
* ``half+traffic``: the same, plus, after every optimizer step, as many extra bytes of plain
  copies as O2 moves beyond ``.half()`` (``--extra-bytes-per-param``, default 26: O2's
  2 + 4 (cast and unscale into the fp32 grads) + 28 (fp32 AdamW) + 6 (master -> half copy)
  = 40 bytes per parameter against ``.half()``'s 14);
* ``O2``: mixprec amp O2, fp16, dynamic loss scale;
* ``O2, scale 1``: the same with a static loss scale of 1 (O2's machinery, unscaled gradients);
* ``O3, dynamic``: mixprec amp O3 (the whole model in fp16, as ``.half()``) with a dynamic loss
  scale (``.half()``'s gradients, scaled).

Per recipe also the share of exact zeros among the half-precision parameter gradients of one
backward pass at the recipe's loss scale (fp16 gradients of an unscaled loss underflow).

For each: the median step time (CUDA events), the summed time of the GEMM kernels per step
(PyTorch profiler), and the SM clock and board power sampled by ``nvidia-smi`` while the timed
steps run. If ``half+traffic``'s GEMMs slow down like O2's, the slowdown comes with the bytes
(power or clock management), not from anything O2 does to the GEMMs.

    python benchmarks/probe_gemm_clocks.py [--rounds 2] [--steps 20]
"""

import argparse
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec import amp  # noqa: E402
from mixprec.bench.models import build_workload  # noqa: E402

# Kernel-name fragments of cuBLAS/CUTLASS GEMMs on sm_90 (nvjet is cuBLAS's Hopper family).
_GEMM_NAMES = ("gemm", "xmma", "cutlass", "nvjet")


_GPU = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
# Why the clock is below its maximum, as a bit mask (names changed across drivers).
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _reason_field():
    for field in _REASON_FIELDS:
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader",
                                   "-i", _GPU], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode == 0 and done.stdout.strip():
            return field
    return None


def _sampler(reason_field):
    """Start nvidia-smi sampling SM clock (MHz), power (W) and the clock-event reasons every
    50 ms; None if there is no nvidia-smi."""
    fields = "clocks.sm,power.draw" + (f",{reason_field}" if reason_field else "")
    try:
        return subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
             "-i", _GPU, "-lms", "50"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def _read(proc):
    """Median clock and power of the samples, and the clock-event masks seen (with counts)."""
    if proc is None:
        return None, None, {}
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    clocks, power, reasons = [], [], {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            clocks.append(float(parts[0]))
            power.append(float(parts[1]))
        except (IndexError, ValueError):
            continue
        if len(parts) > 2:
            reasons[parts[2]] = reasons.get(parts[2], 0) + 1
    if not clocks:
        return None, None, reasons
    return statistics.median(clocks), statistics.median(power), reasons


class Recipe:
    def __init__(self, name, workload, extra_bytes_per_param):
        self.name = name
        self.w = workload
        torch.manual_seed(0)
        model = workload.build_model().cuda()
        self.extra = None
        self.amp = name.startswith(("O2", "O3"))
        if self.amp:
            opt = workload.build_optimizer(model.parameters(), torch.device("cuda"))
            level = name[:2]
            scale = 1.0 if "scale 1" in name else "dynamic"
            model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.float16,
                                        loss_scale=scale, verbosity=0)
            if level == "O3":  # fp16 AdamW states: the eps that keeps .half() training too
                for group in opt.param_groups:
                    group["eps"] = 1e-4
        else:
            model = model.half()
            opt = workload.build_optimizer(model.parameters(), torch.device("cuda"))
            for group in opt.param_groups:
                group["eps"] = 1e-4
            if name == "half+traffic":
                # fp32 copies move 8 bytes per element; spread them over the parameters' shapes.
                passes = extra_bytes_per_param / 8.0
                n = sum(p.numel() for p in model.parameters())
                total = int(passes * n)
                chunk = 8 * 1024 * 1024
                src = [torch.randn(min(chunk, total - i), device="cuda")
                       for i in range(0, total, chunk)]
                self.extra = (src, [torch.empty_like(t) for t in src])
        self.model, self.opt = model, opt
        self.i = 0

    def step(self):
        x, y = self.w.batches[self.i % len(self.w.batches)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        loss = self.w.loss_fn(self.model(x), y)
        if self.amp:
            with amp.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        self.opt.step()
        if self.extra is not None:
            torch._foreach_copy_(self.extra[1], self.extra[0])
        return loss

    def time(self, steps, reason_field):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        torch.cuda.synchronize()
        proc = _sampler(reason_field)
        for start, end in events:
            start.record()
            loss = self.step()
            end.record()
        torch.cuda.synchronize()
        clock, power, reasons = _read(proc)
        self.last_loss = float(loss.detach())
        return statistics.median(s.elapsed_time(e) for s, e in events), clock, power, reasons

    def zero_fraction(self):
        """Share of exact zeros in the half parameter gradients of one backward pass of the
        loss times the recipe's current loss scale (no optimizer step)."""
        scale = 1.0
        if self.amp:
            scale = float(amp.state_dict()["loss_scaler0"]["loss_scale"])
        self.model.zero_grad(set_to_none=True)
        x, y = self.w.batches[0]
        (self.w.loss_fn(self.model(x), y) * scale).backward()
        zeros = total = 0
        for p in self.model.parameters():
            if p.grad is not None and p.grad.dtype == torch.float16:
                zeros += int((p.grad == 0).sum())
                total += p.grad.numel()
        self.model.zero_grad(set_to_none=True)
        return zeros / max(total, 1), scale

    def gemm_ms(self, steps=3):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                self.step()
            torch.cuda.synchronize()
        gemm = total = 0.0
        for evt in prof.key_averages():
            t = getattr(evt, "device_time_total", None)
            if t is None:
                t = evt.cuda_time_total
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            total += t
            if any(k in evt.key.lower() for k in _GEMM_NAMES):
                gemm += t
        return gemm / steps / 1e3, total / steps / 1e3


def _fmt(v):
    return "-" if v is None else f"{v:.0f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--extra-bytes-per-param", type=float, default=26.0)
    args = p.parse_args(argv)
    w = build_workload("gpt", device="cuda", size="large")
    names = ("half", "half+traffic", "O2", "O2, scale 1", "O3, dynamic")
    reason_field = _reason_field()
    limit = subprocess.run(["nvidia-smi", "--query-gpu=power.limit,clocks.max.sm",
                            "--format=csv,noheader", "-i", _GPU],
                           capture_output=True, text=True).stdout.strip()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; GPT fp16; "
          f"{args.steps} timed steps per recipe and round; power limit, max SM clock: "
          f"{limit}; clock-event reasons from {reason_field} (0x4: software power cap)",
          flush=True)
    print("| round | recipe | step ms | GEMM ms/step | all kernels ms/step | SM MHz | W | "
          "zero grads | loss scale | last loss | clock-event masks (samples) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for rnd in range(args.rounds):
        for name in names:
            recipe = Recipe(name, w, args.extra_bytes_per_param)
            for _ in range(args.warmup):
                recipe.step()
            ms, clock, power, reasons = recipe.time(args.steps, reason_field)
            gemm, busy = recipe.gemm_ms()
            zeros, scale = recipe.zero_fraction()
            masks = " ".join(f"{k}:{v}" for k, v in sorted(reasons.items()))
            print(f"| {rnd} | {name} | {ms:.2f} | {gemm:.2f} | {busy:.2f} | {_fmt(clock)} | "
                  f"{_fmt(power)} | {zeros:.3f} | {scale:g} | {recipe.last_loss:.3f} | {masks} |",
                  flush=True)
            del recipe
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
