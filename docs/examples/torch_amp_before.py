"""Before: PyTorch's native recipe, torch.autocast + torch.amp.GradScaler."""
import torch
import torch.nn.functional as F
from common import make_model_and_data


def train(steps=30, device="cpu", dtype=torch.bfloat16):
    model, optimizer, batches = make_model_and_data(device)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    for x, y in batches(steps):
        optimizer.zero_grad()
        with torch.autocast(device, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return loss.item()


if __name__ == "__main__":
    print(f"final loss {train():.6f}")
