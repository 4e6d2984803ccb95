"""After: the same training with mixprec. O1 is the native recipe; O2 adds a half model with
fp32 master weights, which is where the speed is."""
import torch
import torch.nn.functional as F
from common import make_model_and_data

from mixprec import amp


def train(steps=30, device="cpu", dtype=torch.bfloat16, opt_level="O2"):
    model, optimizer, batches = make_model_and_data(device)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, dtype=dtype)
    for x, y in batches(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)  # no autocast block: the model carries it
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return loss.item()


if __name__ == "__main__":
    print(f"final loss {train():.6f}")
