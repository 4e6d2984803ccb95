import pytest
import torch

from mixprec.amp.scaler import LossScaler, unscale_grads_


def test_dynamic_backoff_and_growth():
    s = LossScaler("dynamic", scale_window=3)
    assert s.loss_scale == 2.0**16
    assert s.update(found_inf=True) is True
    assert s.loss_scale == 2.0**15
    for _ in range(2):
        assert s.update(False) is False
    assert s.loss_scale == 2.0**15
    s.update(False)  # third clean step in a row
    assert s.loss_scale == 2.0**16
    assert s.state_dict() == {"loss_scale": 2.0**16, "unskipped": 0}


def test_bounds():
    s = LossScaler("dynamic", scale_window=1, min_loss_scale=2.0**15, max_loss_scale=2.0**17)
    for _ in range(5):
        s.update(True)
    assert s.loss_scale == 2.0**15
    for _ in range(5):
        s.update(False)
    assert s.loss_scale == 2.0**17
    with pytest.raises(ValueError, match="min_loss_scale"):
        LossScaler("dynamic", min_loss_scale=4.0, max_loss_scale=2.0)


def test_static_never_skips():
    s = LossScaler(128.0)
    assert s.update(True) is False and s.loss_scale == 128.0
    assert not s.found_overflow
    # Apex counted a static scale's steps as clean ones (its "unskipped").
    s.update(False)
    assert s.state_dict() == {"loss_scale": 128.0, "unskipped": 2}


def test_found_overflow_and_set_state_host_and_device():
    s = LossScaler("dynamic")
    s.update(True)
    assert s.found_overflow
    s.update(False)
    assert not s.found_overflow
    dev = s.device_state(torch.device("cpu"))
    s.update_on_device(torch.ones(()))
    assert s.found_overflow and s.loss_scale == 2.0**14
    s.set_state(loss_scale=2.0**20)  # in place on the device; the count stays
    assert float(dev.scale) == 2.0**20 and float(dev.inv) == 2.0**-20
    assert s.state_dict() == {"loss_scale": 2.0**20, "unskipped": 0}
    s.update_on_device(torch.zeros(()))
    s.set_state(unskipped=5)
    assert not s.found_overflow
    assert s.state_dict() == {"loss_scale": 2.0**20, "unskipped": 5}


def test_state_dict_roundtrip_and_errors():
    s = LossScaler("dynamic")
    s.load_state_dict({"loss_scale": 1024.0, "unskipped": 7})
    assert s.state_dict() == {"loss_scale": 1024.0, "unskipped": 7}
    with pytest.raises(ValueError, match="expected"):
        s.load_state_dict({"scale": 1.0})
    with pytest.raises(ValueError, match="> 0"):
        s.load_state_dict({"loss_scale": 0.0, "unskipped": 0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_matches_division_and_flags_inf(device, dtype):
    s = LossScaler(256.0)
    g = [torch.randn(37, device=device, dtype=dtype) * 256, torch.randn(5, 3, device=device)]
    ref = [t.double() / 256 for t in g]
    flags = unscale_grads_(g, s, check=True)
    assert not any(bool(f.item()) for f in flags)
    for t, r in zip(g, ref):
        # division by a power of two is exact
        torch.testing.assert_close(t.double(), r, rtol=0, atol=0)
    g[0][3] = float("nan")
    flags = unscale_grads_(g, s, check=True)
    assert any(bool(f.item()) for f in flags)
