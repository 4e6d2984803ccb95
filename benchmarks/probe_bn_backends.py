"""Probe: can a bf16 BatchNorm with fp32 parameters run on cuDNN, as fp16 does?

PyTorch runs BatchNorm on cuDNN for fp16 input with fp32 parameters, but takes its own CUDA
kernels for bf16 (``_select_batch_norm_backend``). This calls ``torch.cudnn_batch_norm``
directly on ResNet-50's BatchNorm shapes (batch 128, channels_last) and times forward +
backward of each backend against PyTorch's choice, with errors against an fp32 reference.

    python benchmarks/probe_bn_backends.py
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from _cuda_timing import median_ms

SHAPES = [(128, 64, 112, 112), (128, 256, 56, 56), (128, 512, 28, 28), (128, 1024, 14, 14),
          (128, 2048, 7, 7)]


def _probe(n, c, h, w, dtype, totals):
    x = torch.randn(n, c, h, w, device="cuda").to(memory_format=torch.channels_last)
    x = x.to(dtype).requires_grad_()
    weight = torch.rand(c, device="cuda", requires_grad=True)
    bias = torch.randn(c, device="cuda", requires_grad=True)
    mean, var = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    grad_out = torch.randn_like(x)

    def pytorch():
        y = F.batch_norm(x, mean, var, weight, bias, True, 0.1, 1e-5)
        y.backward(grad_out)
        return y

    def cudnn():
        y = torch.cudnn_batch_norm(x, weight, bias, mean, var, True, 0.1, 1e-5)[0]
        y.backward(grad_out)
        return y

    backend = torch._C._select_batch_norm_backend(x, weight, bias, mean, var, True, 1e-5)
    xr = x.detach().float().requires_grad_()
    yr = F.batch_norm(xr, None, None, weight.detach(), bias.detach(), True, 0.1, 1e-5)
    yr.backward(grad_out.float())
    for name, fn in (("pytorch", pytorch), ("cudnn", cudnn)):
        label = f"{str(dtype):14s} {n}x{c}x{h}x{w} {name:7s}"
        try:
            x.grad = None
            y = fn()
            err_y = (y.float() - yr).abs().max().item()
            err_gx = ((x.grad.float() - xr.grad).abs().max() / xr.grad.abs().max()).item()
            ms = median_ms(fn, warmup=3)
        except RuntimeError as exc:
            print(f"{label} FAILED: {str(exc)[:160]}")
            continue
        totals[(str(dtype), name)] = totals.get((str(dtype), name), 0.0) + ms
        print(f"{label} (PyTorch picks {backend.name}) fwd+bwd {ms:.3f} ms, max error "
              f"y {err_y:.1e}, grad_x {err_gx:.1e} relative")


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("probe_bn_backends.py needs a CUDA GPU")
    torch.backends.cudnn.benchmark = False
    print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    totals = {}
    for n, c, h, w in SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            _probe(n, c, h, w, dtype, totals)
    for (dtype, name), ms in totals.items():
        print(f"sum over the shapes: {dtype} {name} {ms:.3f} ms")


if __name__ == "__main__":
    main()
