"""A training script written for NVIDIA Apex, in the style of Apex's documentation.

It runs unmodified on mixprec once `mixprec.install_apex_alias()` has been called (or with
its import changed to `from mixprec import amp`). It exercises what Apex users relied on:
two losses with their own loss scales, gradient accumulation with `delay_unscale`, gradient
clipping on `amp.master_params`, and checkpoint/resume with `amp.state_dict()`. From this
folder:

    python -c "import mixprec, runpy, sys; mixprec.install_apex_alias(); \
        sys.argv = ['apex_style_train.py', '--opt-level', 'O2', '--steps', '20', \
        '--checkpoint', 'ckpt.pt']; runpy.run_path('apex_style_train.py', run_name='__main__')"

(with the alias installed in a ``sitecustomize.py``: ``python apex_style_train.py --opt-level
O2 --steps 20 --checkpoint ckpt.pt``).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from apex import amp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 1)

    def forward(self, x):
        h = F.adaptive_avg_pool2d(F.relu(self.bn(self.conv(x))), 1).flatten(1)
        return self.fc(h), self.aux(h)


def get_batch(step, device):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 3, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0].mean(dim=(1, 2)) > 0).long()
    return x.to(device), y.to(device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # As in Apex's ImageNet example: strings, handed to amp.initialize as they are.
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Net().to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, num_losses=2,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                                      loss_scale=args.loss_scale, verbosity=0)
    start = 0
    if args.resume:
        checkpoint = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        start = checkpoint["step"]

    losses = []
    for step in range(start, start + args.steps):
        optimizer.zero_grad()
        for micro in range(args.accumulate):
            x, y = get_batch(step * args.accumulate + micro, args.device)
            logits, aux = model(x)
            loss_cls = F.cross_entropy(logits, y) / args.accumulate
            loss_aux = aux.float().pow(2).mean() / args.accumulate
            last = micro == args.accumulate - 1
            with amp.scale_loss(loss_cls, optimizer, loss_id=0, delay_unscale=not last) as s:
                s.backward(retain_graph=True)
            with amp.scale_loss(loss_aux, optimizer, loss_id=1, delay_unscale=not last) as s:
                s.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
        optimizer.step()
        losses.append(float(loss_cls.item()) * args.accumulate)

    if args.checkpoint and not args.resume:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict(), "step": start + args.steps}, args.checkpoint)
    print(f"final loss {losses[-1]:.6f}")
    return losses


if __name__ == "__main__":
    main()
