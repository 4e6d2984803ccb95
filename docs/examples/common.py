"""The model and data shared by the before/after migration examples."""
import torch
from torch import nn


def make_model_and_data(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    proj = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))

    def batches(steps):
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            x = torch.randn(64, 32, generator=g)
            yield x.to(device), (x @ proj).argmax(dim=1).to(device)

    return model, optimizer, batches
