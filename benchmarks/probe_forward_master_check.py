"""Host time of amp O2's look for masters written in place, paid at every forward of the live
model (``_OptimizerState.push_written_masters``: one read of each master's version counter).

The GPU benchmark's GPT (218 M parameters, 150 tensors) at O2 with fused AdamW, after a step.
Rows, each the median over ``--n`` calls (host time; nothing is launched when nothing was
written):

* ``check, nothing written``: the look itself, the case of every training forward.
* ``check, one master written``: a master written in place since the step (``copy_`` under
  ``no_grad``): the full version comparison, then the cast of that master into its half
  parameter (a launch on the GPU).
* ``forward with / without the check``: a small batch's forward (batch 1, sequence 16; host
  time of the whole model call, synchronized), with the live model's check and with it
  removed: the check's share of a launch-bound forward.
* ``torch DDP no_sync look, no DDP``: the other look of every forward with grad enabled
  (``_model._follow_torch_ddp``: whether PyTorch's own DDP runs it inside ``no_sync()``), here
  outside any DDP, the case of every forward not wrapped in PyTorch's DDP (timed without
  synchronizing: it launches nothing).

    python benchmarks/probe_forward_master_check.py [--n 2000] [--smoke]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mixprec import amp  # noqa: E402
from mixprec.amp._model import _follow_torch_ddp, _push_live_masters  # noqa: E402
from mixprec.bench.models import GPT, gpt_config  # noqa: E402


def _median_us(fn, n: int, sync) -> float:
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--smoke", action="store_true", help="small model (the CPU's check)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cfg = gpt_config("small" if args.smoke or not cuda else "large")
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), device=device)
    loss = model(tokens).float().square().mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    masters = list(amp.master_params(opt))
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
          f"{len(masters)} masters, {sum(m.numel() for m in masters) / 1e6:.1f} M parameters")
    rows = {"check, nothing written": _median_us(lambda: _push_live_masters(model), args.n, sync)}

    def written():
        with torch.no_grad():
            masters[0][0, 0] += 0.0
        _push_live_masters(model)

    rows["check, one master written"] = _median_us(written, args.n, sync)
    # (Launches nothing: timed without the synchronizations around each call, whose own
    # cost, 4.4 us on an H100's host, would be most of the row.)
    rows["torch DDP no_sync look, no DDP"] = _median_us(lambda: _follow_torch_ddp(model),
                                                         args.n, lambda: None)
    with torch.no_grad():
        rows["forward with the check"] = _median_us(lambda: model(tokens), args.n // 4, sync)
        live = model.__dict__["_mixprec_live_masters"]
        model.__dict__["_mixprec_live_masters"] = ()
        rows["forward without the check"] = _median_us(lambda: model(tokens), args.n // 4, sync)
        model.__dict__["_mixprec_live_masters"] = live
        rows["forward with the check (again)"] = _median_us(lambda: model(tokens), args.n // 4,
                                                            sync)
    for name, us in rows.items():
        print(f"{name:34s} {us:9.1f} us")


if __name__ == "__main__":
    main()
