"""The way over from Apex and torch.amp: the alias, and the documented example scripts."""

import copy
import json
import re
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mixprec
from mixprec import amp

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_alias_resolves_apex_imports(clean_apex):
    served = mixprec.install_apex_alias()
    assert mixprec.install_apex_alias() == served  # idempotent
    assert served == ("apex", "apex.amp", "apex.optimizers", "apex.parallel",
                      "apex.normalization", "apex.normalization.fused_layer_norm",
                      "apex.fp16_utils", "apex.multi_tensor_apply")
    from apex import amp as apex_amp
    from apex.normalization import FusedLayerNorm
    from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

    assert apex_amp is amp
    assert DistributedDataParallel is mixprec.parallel.DistributedDataParallel
    assert SyncBatchNorm is mixprec.parallel.SyncBatchNorm
    assert convert_syncbn_model is mixprec.parallel.convert_syncbn_model
    assert FusedLayerNorm is mixprec.normalization.FusedLayerNorm
    # Where Apex defined its norms (Megatron-style imports).
    from apex.normalization.fused_layer_norm import FusedLayerNorm as Deep
    from apex.normalization.fused_layer_norm import MixedFusedRMSNorm

    assert Deep is FusedLayerNorm
    assert MixedFusedRMSNorm is mixprec.normalization.MixedFusedRMSNorm


def test_alias_answers_libraries_that_check_for_apex(clean_apex):
    # transformers (at import time) and Lightning ask importlib whether Apex is installed;
    # find_spec raised ValueError on the stand-in module (no __spec__), which broke
    # `import transformers` wherever the alias was installed first, and transformers' Trainer
    # also reads Apex's version from the installed-package metadata.
    import importlib.metadata
    import importlib.util

    mixprec.install_apex_alias()
    mixprec.install_apex_alias()
    for name in ("apex", "apex.amp", "apex.parallel", "apex.normalization",
                 "apex.normalization.fused_layer_norm", "apex.optimizers"):
        assert importlib.util.find_spec(name) is not None, name
    assert importlib.metadata.version("apex") == f"0.1+mixprec.{mixprec.__version__}"
    assert importlib.metadata.metadata("apex")["Name"] == "apex"
    # METADATA and nothing else: tools walking every distribution (plugin entry points,
    # files()) see an empty package, not METADATA's text read as another file. (A01)
    dist = importlib.metadata.distribution("apex")
    assert dist.files is None and dist.requires is None and list(dist.entry_points) == []
    finders = [f for f in sys.meta_path if type(f).__name__ == "_AliasDistributionFinder"]
    assert len(finders) == 1  # once, however often the alias is installed
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("surely-not-installed-package")


def test_alias_serves_apex_submodule_paths_as_the_same_objects(clean_apex):
    # Apex's own module paths (SwAV/DINO-style `from apex.parallel.LARC import LARC`), and
    # mixprec's submodules under the apex name, give the very classes of the package: before,
    # apex.parallel.LARC did not exist and apex.parallel.sync_batchnorm ran mixprec's file a
    # second time, so a layer from convert_syncbn_model failed isinstance against its class.
    import torch

    mixprec.install_apex_alias()
    import apex.parallel
    from apex.amp.frontend import initialize
    from apex.amp.handle import disable_casts, scale_loss
    from apex.optimizers.fused_adam import FusedAdam
    from apex.parallel import ReduceOp
    from apex.parallel.distributed import (
        DistributedDataParallel,
        Reducer,
        flat_dist_call,
        flatten,
    )
    from apex.parallel.LARC import LARC
    from apex.parallel.optimized_sync_batchnorm import SyncBatchNorm as Optimized
    from apex.parallel.sync_batchnorm import SyncBatchNorm

    assert LARC is mixprec.parallel.LARC
    assert SyncBatchNorm is Optimized is mixprec.parallel.SyncBatchNorm
    assert DistributedDataParallel is mixprec.parallel.DistributedDataParallel
    assert flat_dist_call is mixprec.parallel.distributed.flat_dist_call
    assert Reducer is mixprec.parallel.Reducer and ReduceOp is torch.distributed.ReduceOp
    assert torch.equal(flatten([torch.ones(2), torch.zeros(1)]), torch.tensor([1.0, 1.0, 0.0]))
    assert FusedAdam is mixprec.optimizers.FusedAdam
    assert (initialize, scale_loss, disable_casts) == (
        amp.initialize, amp.scale_loss, amp.disable_casts)
    converted = apex.parallel.convert_syncbn_model(torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
    assert isinstance(converted[0], SyncBatchNorm)
    # No file of mixprec's was loaded twice under the apex name (the stand-in packages
    # `apex` and `apex.normalization` have no file).
    for name, module in list(sys.modules.items()):
        if name.startswith("apex.") and getattr(module, "__file__", None) is not None:
            assert module.__name__.startswith("mixprec."), name


# The renamed imports docs/migrating.md says fail under the mixprec name (Apex's own paths
# exist under the apex name only).
_RENAMED_IMPORTS_THAT_FAIL = (
    "from mixprec.parallel.LARC import LARC",
    "from mixprec.parallel.optimized_sync_batchnorm import SyncBatchNorm",
    "from mixprec.normalization.fused_layer_norm import FusedLayerNorm",
    "from mixprec.amp.handle import scale_loss",
    "from mixprec.amp import __version__",
    "from mixprec.fp16_utils import *",
    "from mixprec.multi_tensor_apply import multi_tensor_applier",
    "from mixprec.optimizers import FusedSGD",
)


def test_renamed_apex_only_imports_fail_as_the_migration_guide_says():
    # A user who renames apex to mixprec in every import reads in the guide which lines then
    # fail, and that `from mixprec.amp import __version__` imports once the alias is installed
    # (apex.amp is mixprec.amp); a fresh interpreter checks both, with and without the alias.
    guide = " ".join((EXAMPLES.parent / "migrating.md").read_text().split())
    for line in _RENAMED_IMPORTS_THAT_FAIL:
        assert f"`{line}`" in guide, line
    script = textwrap.dedent("""
        import json, sys
        lines = json.loads(sys.argv[1])
        def outcome():
            result = {}
            for line in lines:
                try:
                    exec(line, {})
                    result[line] = "ok"
                except ImportError as error:
                    result[line] = type(error).__name__
            return result
        before = outcome()
        import mixprec
        mixprec.install_apex_alias()
        print(json.dumps([before, outcome()]))
    """)
    done = subprocess.run([sys.executable, "-c", script, json.dumps(_RENAMED_IMPORTS_THAT_FAIL)],
                          capture_output=True, text=True, timeout=120, check=True)
    before, after = json.loads(done.stdout.splitlines()[-1])
    assert all(before[line] != "ok" for line in _RENAMED_IMPORTS_THAT_FAIL), before
    version = "from mixprec.amp import __version__"
    assert after == {**before, version: "ok"}, after


def _fake_apex(root, *submodules, init=""):
    """An installed ``apex`` package under ``root`` with the given submodules."""
    package = root / "apex"
    package.mkdir()
    (package / "__init__.py").write_text(init)
    for name in submodules:
        (package / name).mkdir()
        (package / name / "__init__.py").write_text(
            f"WHO = 'apex.{name} itself'\n"
            # What Apex's own amp and parallel held (the alias checks for them).
            + {"amp": "def initialize(*args, **kwargs): pass\n",
               "parallel": "class DistributedDataParallel: pass\n"}.get(name, ""))
    return package


def test_alias_fills_in_what_a_current_apex_lacks(clean_apex, tmp_path, monkeypatch):
    # Apex from 2025 on: optimizers, normalization and multi_tensor_apply kept; amp, parallel
    # and fp16_utils removed.
    _fake_apex(tmp_path, "optimizers", "normalization", "multi_tensor_apply",
               init="from . import optimizers, normalization\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    served = mixprec.install_apex_alias()
    assert served == ("apex.amp", "apex.parallel", "apex.fp16_utils")
    assert mixprec.install_apex_alias() == served  # idempotent

    import apex
    from apex import amp as apex_amp
    from apex.normalization import WHO as norm_who
    from apex.optimizers import WHO as opt_who
    from apex.parallel import DistributedDataParallel

    assert apex.__file__.startswith(str(tmp_path))  # the real package, not a stand-in
    assert apex_amp is amp and sys.modules["apex.amp"] is amp
    assert DistributedDataParallel is mixprec.parallel.DistributedDataParallel
    assert (opt_who, norm_who) == ("apex.optimizers itself", "apex.normalization itself")


def test_alias_fills_in_around_an_apex_imported_first(clean_apex, tmp_path, monkeypatch):
    _fake_apex(tmp_path, "optimizers", "parallel")
    monkeypatch.syspath_prepend(str(tmp_path))
    import apex

    assert mixprec.install_apex_alias() == (
        "apex.amp", "apex.normalization", "apex.normalization.fused_layer_norm",
        "apex.fp16_utils", "apex.multi_tensor_apply")
    assert apex.amp is amp
    from apex.parallel import WHO

    assert WHO == "apex.parallel itself"
    from apex.normalization.fused_layer_norm import FusedLayerNorm

    assert FusedLayerNorm is mixprec.normalization.FusedLayerNorm


def test_alias_adds_each_served_module_to_an_apex_all_once(clean_apex, tmp_path, monkeypatch):
    # r98A G5: beside an installed Apex whose __all__ lacks normalization, each module served
    # at the top level goes into apex.__all__ once (apex.normalization.fused_layer_norm, a
    # submodule, is not a second "normalization").
    _fake_apex(tmp_path, "optimizers", init="from . import optimizers\n__all__ = ['optimizers']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "apex.normalization.fused_layer_norm" in mixprec.install_apex_alias()
    import apex

    assert apex.__all__ == ["optimizers", "amp", "parallel", "normalization", "fp16_utils",
                            "multi_tensor_apply"]


def test_alias_leaves_an_apex_with_its_own_amp_alone(clean_apex, tmp_path, monkeypatch):
    _fake_apex(tmp_path, *mixprec._apex_alias._SUBMODULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="nothing was aliased.*uninstall that Apex"):
        assert mixprec.install_apex_alias() == ()
    from apex import amp as apex_amp

    assert apex_amp.WHO == "apex.amp itself"


def test_alias_replaces_a_broken_or_partial_apex_submodule(clean_apex, tmp_path, monkeypatch):
    # An old apex.amp that no longer imports, and an apex.parallel without its DDP.
    package = _fake_apex(tmp_path, "optimizers", "normalization")
    (package / "amp").mkdir()
    (package / "amp" / "__init__.py").write_text("from torch._six import string_classes\n")
    (package / "parallel").mkdir()
    (package / "parallel" / "__init__.py").write_text("class SyncBatchNorm: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning) as record:
        served = mixprec.install_apex_alias()
    messages = [str(w.message) for w in record]
    assert any(re.search(r"apex\.amp fails to import.*torch\._six.*mixprec\.amp", m)
               for m in messages), messages
    assert any(re.search(r"apex\.parallel has no DistributedDataParallel; mixprec\.parallel "
                         r"serves", m) for m in messages), messages
    assert served == ("apex.amp", "apex.parallel", "apex.fp16_utils", "apex.multi_tensor_apply")
    from apex import amp as apex_amp
    from apex.optimizers import WHO
    from apex.parallel import DistributedDataParallel

    assert apex_amp is amp and WHO == "apex.optimizers itself"
    assert DistributedDataParallel is mixprec.parallel.DistributedDataParallel


def _alias_over_an_apex_amp_failing_after(submodule, source, tmp_path, monkeypatch):
    """Install the alias over a fake Apex whose apex.amp imports ``submodule`` (with
    ``source``) and then fails, as Apex's did on a newer PyTorch; it warns."""
    package = _fake_apex(tmp_path, "optimizers")
    (package / "amp").mkdir()
    (package / "amp" / f"{submodule}.py").write_text(source)
    (package / "amp" / "__init__.py").write_text(
        f"from . import {submodule}\nfrom torch._six import string_classes\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="apex.amp fails to import"):
        mixprec.install_apex_alias()


def test_alias_drops_what_a_failed_apex_amp_left_behind(clean_apex, tmp_path, monkeypatch):
    # Apex's amp imports its submodules (handle, scaler) before the one that fails on a newer
    # PyTorch: those half-imported modules must not stand for apex.amp.handle afterwards.
    _alias_over_an_apex_amp_failing_after("handle", "def scale_loss(*a, **k): pass\n",
                                          tmp_path, monkeypatch)
    from apex.amp.handle import scale_loss

    assert scale_loss is amp.scale_loss


def test_alias_takes_a_stray_apex_directory_for_no_apex(clean_apex, tmp_path, monkeypatch):
    # The root of an Apex source checkout (its package is apex/apex/) beside a script is found
    # as a namespace package `apex`. It was taken for an installed Apex and filled in, without
    # the metadata: importlib.metadata.version("apex") raised, so libraries that check Apex's
    # version (transformers' Trainer) said Apex was missing.
    import importlib.metadata

    (tmp_path / "apex" / "csrc").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    served = mixprec.install_apex_alias()
    assert served[0] == "apex" and "apex.amp" in served
    assert importlib.metadata.version("apex") == f"0.1+mixprec.{mixprec.__version__}"
    from apex import amp as apex_amp

    assert apex_amp is amp


def test_alias_star_import_beside_an_apex_with_all(clean_apex, tmp_path, monkeypatch):
    # Apex's own __all__ listed amp, so `from apex import *` gave it; Apex's 2025 __all__
    # names only what it kept, and the served modules were left out of the star import.
    _fake_apex(tmp_path, "optimizers", "normalization", "multi_tensor_apply",
               init="from . import optimizers, normalization\n"
                    "__all__ = ['optimizers', 'normalization']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mixprec.install_apex_alias()
    namespace = {}
    exec("from apex import *", namespace)  # noqa: S102  (a star import needs a namespace)
    assert namespace["amp"] is amp and namespace["parallel"] is mixprec.parallel
    assert namespace["optimizers"].WHO == "apex.optimizers itself"
    assert "multi_tensor_apply" not in namespace  # (not in that Apex's __all__; not served)


def test_alias_reports_a_broken_apex(clean_apex, tmp_path, monkeypatch):
    _fake_apex(tmp_path, init="import fused_adam_cuda_missing_extension\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="fails to import.*ModuleNotFoundError.*"
                                           "fused_adam_cuda_missing_extension.*uninstall"):
        mixprec.install_apex_alias()


def _run_apex_script(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["apex_style_train.py", *argv])
    module = runpy.run_path(str(EXAMPLES / "apex_style_train.py"), run_name="apex_example")
    return module["main"]()


@pytest.mark.parametrize("args", [
    ["--opt-level", "O1"],
    ["--opt-level", "O2"],
    # Apex's ImageNet example passes these as argparse strings.
    ["--opt-level", "O2", "--keep-batchnorm-fp32", "True", "--loss-scale", "128.0"],
    ["--opt-level", "O1", "--loss-scale", "dynamic"],
], ids=["O1", "O2", "O2-strings", "O1-dynamic-string"])
def test_unmodified_apex_script_runs_and_resumes(args, clean_apex, monkeypatch, tmp_path):
    # The script calls amp.initialize with Apex's keywords only (fp16, Apex's one half type).
    mixprec.install_apex_alias()
    ckpt = str(tmp_path / "ckpt.pt")
    common = [*args, "--device", "cpu"]
    full = _run_apex_script(monkeypatch, *common, "--steps", "8")
    first = _run_apex_script(monkeypatch, *common, "--steps", "4", "--checkpoint", ckpt)
    second = _run_apex_script(monkeypatch, *common, "--steps", "4", "--checkpoint", ckpt,
                              "--resume")
    assert first + second == full  # checkpoint/resume continues bit for bit
    assert sum(full[-3:]) < sum(full[:3])  # and it learns


def test_torch_amp_before_and_mixprec_after_agree(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    before = runpy.run_path(str(EXAMPLES / "torch_amp_before.py"), run_name="before")
    after = runpy.run_path(str(EXAMPLES / "mixprec_after.py"), run_name="after")
    native = before["train"]()
    # O1 is the native recipe, loss included (the model's outputs leave it in fp32, as the
    # loss inside the autocast block sees them): the same run, bit for bit.
    assert after["train"](opt_level="O1") == native
    ours = after["train"](opt_level="O2")
    assert abs(ours - native) <= 0.05 * native + 1e-3, (ours, native)


@pytest.mark.parametrize("optimizer", ["fusedadam", "adamw_foreach"])
def test_o1_gpt_loop_with_accumulation_and_clipping_is_autocast_bit_for_bit(optimizer):
    # The migration guide's claim for a pretraining loop: bf16 O1 with delay_unscale
    # accumulation and clipping on amp.master_params equals torch.autocast with plain
    # accumulation and clipping on the same parameters (in the optimizer's group order, which
    # amp.master_params follows: clip_grad_norm_ sums the norms in its argument's order),
    # losses and weights bit for bit, dropout included.
    import torch
    from torch import nn

    from mixprec import amp
    from mixprec.normalization import FusedRMSNorm
    from mixprec.optimizers import FusedAdam

    from .helpers import TinyDecoder, decay_groups, token_batch

    def run(use_amp):
        torch.manual_seed(0)
        model = TinyDecoder(FusedRMSNorm)
        groups = decay_groups(model)
        opt = (FusedAdam(groups, lr=1e-2) if optimizer == "fusedadam"
               else torch.optim.AdamW(groups, lr=1e-2, foreach=True))
        if use_amp:
            amp.initialize(model, opt, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
        losses = []
        for step in range(3):
            opt.zero_grad()
            for micro in range(2):
                x, y = token_batch(seed=10 * step + micro)
                if use_amp:
                    logits = model(x)
                else:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        logits = model(x)
                loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / 2
                if use_amp:
                    with amp.scale_loss(loss, opt, delay_unscale=micro == 0) as scaled:
                        scaled.backward()
                else:
                    loss.backward()
                losses.append(loss.detach())
            params = (amp.master_params(opt) if use_amp
                      else [p for g in opt.param_groups for p in g["params"]])
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        return torch.stack(losses), [p.detach().clone() for p in model.parameters()]

    want_losses, want = run(False)
    got_losses, got = run(True)
    torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_o1_fp16_lora_accumulation_with_an_overflow_is_autocast_and_gradscaler_bit_for_bit():
    # LoRA fine-tuning (r74B): a frozen base, AdamW over the adapters only, two micro-batches a
    # step (a scale_loss block each), clipping on amp.master_params. fp16 O1 equals
    # torch.autocast + GradScaler (unscale_, clip, step, update) bit for bit, losses, clipped
    # norms and adapters, also through a step whose first micro-batch overflows (skipped by
    # both, the scale halved by both).
    import torch
    from torch import nn

    from mixprec import amp

    class LoRA(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base.requires_grad_(False)
            self.lora_A = nn.Parameter(torch.randn(2, base.in_features) * 0.3)
            self.lora_B = nn.Parameter(torch.zeros(base.out_features, 2))

        def forward(self, x):
            return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * 2.0

    def run(use_amp):
        torch.manual_seed(0)
        model = nn.Sequential(LoRA(nn.Linear(8, 16)), nn.GELU(), LoRA(nn.Linear(16, 4)))
        adapters = [p for n, p in model.named_parameters() if "lora_" in n]
        opt = torch.optim.AdamW(adapters, lr=1e-2, weight_decay=0.01)
        if use_amp:
            amp.initialize(model, opt, opt_level="O1", dtype=torch.float16, verbosity=0)
        else:
            scaler = torch.amp.GradScaler("cpu")
        losses, norms, scales = [], [], []
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                g = torch.Generator().manual_seed(10 * step + micro)
                x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
                if use_amp:
                    logits = model(x)
                else:
                    with torch.autocast("cpu", dtype=torch.float16):
                        logits = model(x)
                loss = nn.functional.cross_entropy(logits.float(), y) / 2
                if step == 2 and micro == 0:
                    loss = loss * float("inf")
                if use_amp:
                    with amp.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                else:
                    scaler.scale(loss).backward()
                losses.append(loss.detach())
            if use_amp:
                norms.append(torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.05))
                opt.step()
                scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
            else:
                scaler.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(adapters, 0.05))
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
        return losses, norms, scales, [p.detach().clone() for p in model.parameters()]

    want_losses, want_norms, want_scales, want = run(False)
    got_losses, got_norms, got_scales, got = run(True)
    assert got_scales == want_scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    torch.testing.assert_close(torch.stack(got_losses), torch.stack(want_losses), rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(got_norms), torch.stack(want_norms), rtol=0, atol=0,
                               equal_nan=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _hf_loop(backend, steps, start=0, checkpoint=None):
    """An HF-Trainer-like loop (r78C): AdamW, a LambdaLR warm-up built before
    amp.initialize, 4 micro-batches a step with a scale_loss block each (no delay_unscale),
    clip_grad_norm_ on amp.master_params, scheduler.step() after every optimizer.step()
    (skipped or not), zero_grad. Micro-batch 8 (the first of step 2) overflows. backend:
    "O2" (mixprec, fp16) or "native" (torch.autocast + GradScaler)."""
    import warnings

    import torch
    from torch import nn

    from mixprec import amp

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)
            self.ln, self.out = nn.LayerNorm(16), nn.Linear(16, 32)

        def forward(self, ids, labels):
            h = self.emb(ids)
            h = self.ln(h + self.l2(nn.functional.gelu(self.l1(h))))
            return nn.functional.cross_entropy(self.out(h).float().reshape(-1, 32),
                                               labels.reshape(-1))

    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    scaler = None
    if backend == "O2":
        amp.initialize(model, opt, opt_level="O2", dtype=torch.float16, verbosity=0)
    else:
        scaler = torch.amp.GradScaler("cpu")
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        sched.load_state_dict(checkpoint["scheduler"])
        amp.load_state_dict(checkpoint["amp"])
    losses, skipped = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start, start + steps):
            before = [p.detach().clone() for p in (amp.master_params(opt) if scaler is None
                                                   else model.parameters())]
            for micro in range(4):
                ids = torch.randint(0, 32, (4, 9),
                                    generator=torch.Generator().manual_seed(4 * step + micro))
                with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                    loss = model(ids[:, :-1], ids[:, 1:]) / 4
                if 4 * step + micro == 8:
                    loss = loss * float("inf")
                losses.append(loss.detach())
                if scaler is None:
                    with amp.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                else:
                    scaler.scale(loss).backward()
            if scaler is None:
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
                opt.step()
                skipped.append(amp.step_was_skipped(opt))
                after = list(amp.master_params(opt))
            else:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                s0 = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped.append(scaler.get_scale() < s0)
                after = list(model.parameters())
            assert all(torch.equal(b, a) for b, a in zip(before, after)) == skipped[-1]
            sched.step()
            opt.zero_grad()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], \
        [str(w.message) for w in caught]
    return model, opt, sched, torch.stack(losses), skipped


def test_hf_style_o2_fp16_accumulation_matches_gradscaler_and_resumes_bit_for_bit():
    import io

    import torch

    from mixprec import amp

    model, _, sched, full, skipped = _hf_loop("O2", 6)
    assert skipped == [False, False, True, False, False, False]
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 15}}
    _, _, ref_sched, ref, ref_skipped = _hf_loop("native", 6)
    assert ref_skipped == skipped and sched.get_last_lr() == ref_sched.get_last_lr()
    # fp32 masters against autocast: same trajectory within fp16 rounding.
    finite = torch.isfinite(ref)
    torch.testing.assert_close(full[finite], ref[finite], rtol=1e-3, atol=1e-5)

    m1, o1, s1, first, _ = _hf_loop("O2", 3)  # saved right after the skipped step
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "optimizer": o1.state_dict(),
                "scheduler": s1.state_dict(), "amp": amp.state_dict()}, buf)
    buf.seek(0)
    m2, _, s2, second, _ = _hf_loop("O2", 3, start=3, checkpoint=torch.load(buf))
    torch.testing.assert_close(torch.cat([first, second]), full, rtol=0, atol=0,
                               equal_nan=True)
    assert s2.get_last_lr() == sched.get_last_lr()
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 15}}
    for (k, v), v2 in zip(model.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(v2, v, rtol=0, atol=0, msg=k)


def test_o1_fp16_gru_seq2seq_with_loss_spikes_is_autocast_and_gradscaler_bit_for_bit():
    # A GRU encoder-decoder with attention (bidirectional encoder over an unsorted packed
    # batch, teacher forcing by fixed flags, clipping on amp.master_params): fp16 O1 equals
    # torch.autocast + GradScaler (unscale_, clip, step, update) bit for bit, through two
    # loss spikes that overflow (both skip them and halve the scale twice).
    import torch
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from mixprec import amp

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.src = nn.Embedding(12, 8, padding_idx=0)
            self.enc = nn.GRU(8, 8, batch_first=True, bidirectional=True)
            self.tgt = nn.Embedding(12, 8, padding_idx=0)
            self.dec = nn.GRUCell(8 + 16, 16)
            self.query = nn.Linear(16, 16, bias=False)
            self.out = nn.Linear(32, 12)

        def forward(self, src, lengths, tgt, teacher):
            enc, h = self.enc(pack_padded_sequence(self.src(src), lengths, batch_first=True,
                                                   enforce_sorted=False))
            enc, _ = pad_packed_sequence(enc, batch_first=True, total_length=src.shape[1])
            h, ctx = torch.cat([h[0], h[1]], -1), enc.new_zeros(len(src), 16)
            mask = torch.arange(src.shape[1]) < lengths[:, None]
            tok, logits = torch.ones(len(src), dtype=torch.long), []
            for t in range(tgt.shape[1]):
                h = self.dec(torch.cat([self.tgt(tok), ctx], -1), h)
                scores = torch.bmm(enc, self.query(h)[:, :, None])[:, :, 0]
                ctx = (scores.masked_fill(~mask, float("-inf")).softmax(-1)[:, :, None]
                       * enc).sum(1)
                logits.append(self.out(torch.cat([h, ctx], -1)))
                tok = tgt[:, t] if teacher[t] else logits[-1].argmax(-1)
            return torch.stack(logits, 1)

    def run(use_amp):
        torch.manual_seed(0)
        model = Seq2Seq()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
        if use_amp:
            amp.initialize(model, opt, opt_level="O1", dtype=torch.float16, verbosity=0)
        else:
            scaler = torch.amp.GradScaler("cpu")
        losses, scales = [], []
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            lengths = torch.tensor([5, 3, 4, 2])
            src = torch.randint(1, 12, (4, 5), generator=g)
            src[torch.arange(5) >= lengths[:, None]] = 0
            tgt = torch.randint(1, 12, (4, 3), generator=g)
            teacher = [True, step % 2 == 0, False]
            opt.zero_grad()
            if use_amp:
                logits = model(src, lengths, tgt, teacher)
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(src, lengths, tgt, teacher)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 12), tgt.reshape(-1))
            if step in (1, 2):
                loss = loss * 1e5  # a spike: the scaled fp16 gradients overflow
            if use_amp:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
                opt.step()
                scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            losses.append(loss.detach())
        return torch.stack(losses), scales, [p.detach().clone() for p in model.parameters()]

    want_losses, want_scales, want = run(False)
    losses, scales, got = run(True)
    assert want_scales == scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 2.0 ** 14]
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=0)
    for p, q in zip(got, want):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_apex_imagenet_example_import_block_and_fp16_utils(clean_apex):
    # The import block of Apex's examples/imagenet/main_amp.py, copied into many scripts.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    namespace = {}
    exec(  # noqa: S102  (the star import needs a module-level namespace)
        "from apex.parallel import DistributedDataParallel as DDP\n"
        "from apex.fp16_utils import *\n"
        "from apex import amp, optimizers\n"
        "from apex.multi_tensor_apply import multi_tensor_applier\n", namespace)
    assert namespace["amp"] is amp
    assert namespace["to_python_float"](torch.tensor([2.5])) == 2.5
    applier = namespace["multi_tensor_applier"]
    assert applier.available is False
    with pytest.raises(RuntimeError, match="amp_C.*_foreach"):
        applier(None, torch.zeros(1), [[torch.ones(2)]])
    with pytest.raises(NotImplementedError, match="FP16_Optimizer.*opt_level=\"O2\""):
        namespace["FP16_Optimizer"](torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
    ref = [p.detach().clone() for p in net.parameters()]
    half = namespace["network_to_half"](net)
    assert [p.dtype for p in net.parameters()] == [torch.float16, torch.float16,
                                                  torch.float32, torch.float32]
    assert half(torch.randn(2, 3, 5, 5)).dtype == torch.float16
    # Hand-made master weights: fp32 copies, gradients in, values out; flat and not.
    for flat in (False, True):
        model_params, masters = namespace["prep_param_lists"](net, flat_master=flat)
        for p in model_params:
            p.grad = torch.full_like(p, 0.5)
        namespace["model_grads_to_master_grads"](model_params, masters, flat_master=flat)
        grads = torch.cat([m.grad.flatten() for m in masters])
        assert grads.dtype == torch.float32 and bool((grads == 0.5).all())
        for m in masters:
            m.data.sub_(m.grad)  # an SGD step with lr 1 on the masters
        namespace["master_params_to_model_params"](model_params, masters, flat_master=flat)
        for p, r in zip(model_params, ref):
            torch.testing.assert_close(p.float(), (r.to(p.dtype).float() - 0.5).to(p.dtype)
                                       .float(), rtol=0, atol=0)
            with torch.no_grad():
                p.copy_(r)
    fp16_model = namespace["FP16Model"](nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    assert fp16_model(torch.randn(4, 3)).dtype == torch.float16
    assert fp16_model.network[1].weight.dtype == torch.float32


def test_fp16_optimizer_refusal_names_what_replaces_each_of_its_calls(clean_apex):
    # An FP16_Optimizer script also calls optimizer.backward(loss),
    # optimizer.clip_master_grads(max_norm), passes static_loss_scale=/dynamic_loss_args= and
    # saves optimizer.state_dict() (which held the scaler): the refusal names what replaces
    # each, and that amp's dynamic scale starts and grows otherwise.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import FP16_Optimizer

    with pytest.raises(NotImplementedError) as info:
        FP16_Optimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1),
                       static_loss_scale=128.0)
    message = str(info.value)
    for fragment in ("amp.initialize", "scale_loss", "clip_grad_norm_(amp.master_params(",
                     "loss_scale=S", "amp.state_dict()", "2**16", "2000", "min_loss_scale=1"):
        assert fragment in message, fragment


def test_an_unpickled_apex_loss_scaler_gives_its_loss_scale(clean_apex, tmp_path):
    # FP16_Optimizer-era code read the scale of a checkpoint's scaler as
    # `checkpoint["optimizer"]["loss_scaler"].loss_scale` (Apex's property over cur_scale):
    # the unpickled stand-in gives it (it was a bare AttributeError).
    _save_an_apex_pickled_scaler(tmp_path / "old.pt", {}, cur_scale=512.0, cur_iter=6,
                                 last_overflow_iter=2, scale_factor=2.0, scale_window=4)
    mixprec.install_apex_alias()
    loaded = _load(tmp_path / "old.pt")["optimizer"]["loss_scaler"]
    assert loaded.loss_scale == 512.0


def _unpickled_apex_scaler(tmp_path, cls_name, **attrs):
    """An object of Apex's loss scaler class ``cls_name`` with ``attrs``, pickled where Apex
    is importable and loaded back through mixprec's alias."""
    _save_an_apex_pickled_scaler(tmp_path / "old.pt", {}, cls_name=cls_name, **attrs)
    mixprec.install_apex_alias()
    return _load(tmp_path / "old.pt")["optimizer"]["loss_scaler"]


def test_an_unpickled_static_apex_loss_scaler_gives_its_loss_scale(clean_apex, tmp_path):
    """FP16_Optimizer(static_loss_scale=S) pickled Apex's static LossScaler, which has the
    same loss_scale property as the dynamic one: a script reading the scale of such a
    checkpoint gets S. (m34)"""
    loaded = _unpickled_apex_scaler(tmp_path, "LossScaler", cur_scale=128.0)
    assert loaded.loss_scale == 128.0


def test_an_unpickled_apex_loss_scaler_without_cur_scale_says_what_it_holds(clean_apex,
                                                                             tmp_path):
    """A pickled scaler without cur_scale (another Apex version's attributes) has no scale
    to give: reading loss_scale raises AttributeError naming the attributes it has, so that
    getattr(scaler, "loss_scale", default) and hasattr work, and never returns None as a
    scale. (m33)"""
    loaded = _unpickled_apex_scaler(tmp_path, "DynamicLossScaler", scale=8.0, cur_iter=3)
    with pytest.raises(AttributeError, match=r"holds no cur_scale; it has \['cur_iter', "
                                             r"'scale'\]"):
        _ = loaded.loss_scale
    assert getattr(loaded, "loss_scale", 1.0) == 1.0


def test_fp16_optimizer_refusal_says_how_its_dynamic_scale_differed(clean_apex):
    """A user moving a dynamic-scale FP16_Optimizer run needs Apex's own schedule to compare
    with amp's (start 2**32, doubled after 1000 clean steps) as well as amp's. (m35)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import FP16_Optimizer

    with pytest.raises(NotImplementedError, match=r"2\*\*16 and doubles after 2000 clean "
                                                  r"steps, where FP16_Optimizer's started "
                                                  r"at 2\*\*32 and doubled after 1000"):
        FP16_Optimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1),
                       dynamic_loss_scale=True)


def test_apex_legacy_module_paths_and_helpers_as_apex_had_them(clean_apex):
    # BERT-era scripts import Apex's legacy classes from their own files, inside a try whose
    # except says "install apex" (they were "not a package": the NotImplementedError that
    # names amp.initialize never showed).
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    import apex.fp16_utils.fp16_optimizer as fp16_optimizer
    from apex.fp16_utils.fp16util import network_to_half
    from apex.fp16_utils.loss_scaler import DynamicLossScaler
    from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply

    legacy = sys.modules["apex.fp16_utils"]
    assert fp16_optimizer is legacy and network_to_half is legacy.network_to_half
    with pytest.raises(NotImplementedError, match="amp.initialize"):
        fp16_optimizer.FP16_Optimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1))
    with pytest.raises(NotImplementedError, match="loss_scale"):
        DynamicLossScaler()
    from apex.fp16_utils.loss_scaler import LossScaler

    with pytest.raises(NotImplementedError, match=r"apex\.fp16_utils\.LossScaler \(Apex's "
                                                  r"legacy.*loss_scale=<number> to "
                                                  r"amp\.initialize"):
        LossScaler(128.0)  # (a static scale: the argument that replaces it, F12)
    with pytest.raises(RuntimeError, match="amp_C"):
        MultiTensorApply(2048).check_avail()
    # Master gradients are copies, also of fp32 gradients (a BatchNorm after network_to_half):
    # zeroing the model's gradients before the masters' step left those masters at zero.
    net = network_to_half(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    model_params, masters = legacy.prep_param_lists(net)
    for p in model_params:
        p.grad = torch.ones_like(p)
    legacy.model_grads_to_master_grads(model_params, masters)
    net.zero_grad(set_to_none=False)
    for m in masters:
        assert m.grad is not None and bool((m.grad == 1).all()), m.grad
    # A buffer shared by two modules stays shared when converted (cast in place, as Apex).
    shared = nn.Sequential(nn.BatchNorm1d(2, affine=False), nn.BatchNorm1d(2, affine=False))
    shared[1].running_mean = shared[0].running_mean
    legacy.convert_network(shared, torch.float16)
    assert shared[1].running_mean is shared[0].running_mean
    assert shared[0].running_mean.dtype == torch.float16
    # RNNs re-pack their cast weights for cuDNN (flatten_parameters), as Apex's did.
    lstm = nn.LSTM(3, 4)
    calls = []
    lstm.flatten_parameters = lambda: calls.append(lstm.weight_ih_l0.dtype)
    legacy.convert_network(nn.Sequential(lstm), torch.float16)
    assert calls == [torch.float16]
    # A dtype that is not a floating torch.dtype is refused before anything is cast.
    net = nn.Linear(2, 2)
    for convert in (legacy.convert_network, legacy.convert_module):
        with pytest.raises(TypeError, match=r"\(dtype='half'\).*torch\.half"):
            convert(net, "half")
        with pytest.raises(ValueError, match=r"torch\.int8.*floating dtype"):
            convert(net, torch.int8)
    assert net.weight.dtype == torch.float32
    # clip_grad_norm is PyTorch's clip_grad_norm_ itself (its keyword arguments too).
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        legacy.clip_grad_norm([p], 1.0, error_if_nonfinite=True)


def _save_an_apex_pickled_scaler(path, optimizer_entries, cls_name="DynamicLossScaler",
                                 module="apex.fp16_utils.loss_scaler", **attributes):
    """Write an FP16_Optimizer-era checkpoint to ``path``: an object of Apex's loss scaler
    class ``cls_name`` (under Apex's module path, from stand-in modules removed afterwards)
    with ``attributes``, under ``optimizer["loss_scaler"]`` beside ``optimizer_entries``."""
    import types

    import torch

    parts = module.split(".")
    fakes = {name: types.ModuleType(name)
             for name in (".".join(parts[:i]) for i in range(1, len(parts) + 1))}
    scaler_cls = type(cls_name, (), {"__module__": module})
    setattr(fakes[module], cls_name, scaler_cls)
    scaler = scaler_cls()
    scaler.__dict__.update(attributes)
    sys.modules.update(fakes)
    try:
        torch.save({"optimizer": {"loss_scaler": scaler, **optimizer_entries}}, path)
    finally:
        for name in fakes:
            sys.modules.pop(name, None)


def _load(path):
    import torch

    return torch.load(path, weights_only=False)


def test_a_pickled_fp16_optimizer_loss_scaler_unpickles_through_the_alias(clean_apex, tmp_path):
    # FP16_Optimizer-era checkpoints (NVIDIA BERT, Megatron-LM of 2019-2020) pickled
    # Apex's loss scaler object itself under optimizer["loss_scaler"]. With the alias
    # installed, torch.load(weights_only=False) of such a file finds the class at Apex's path
    # and gives its attributes back (cur_scale seeds amp's scale); constructing the class is
    # still refused. Written here with stand-in apex modules, as Apex's own class pickled.
    _save_an_apex_pickled_scaler(tmp_path / "old.pt", {"dynamic_loss_scale": True},
                                 cur_scale=4096.0, cur_iter=1234, last_overflow_iter=-1,
                                 scale_factor=2.0, scale_window=1000)
    mixprec.install_apex_alias()
    loaded = _load(tmp_path / "old.pt")["optimizer"]["loss_scaler"]
    assert type(loaded).__module__ == "mixprec._apex_legacy.fp16_utils"
    assert (loaded.cur_scale, loaded.cur_iter, loaded.scale_window) == (4096.0, 1234, 1000)


def _fp16_optimizer_reference(model, batches, blow, init_scale, window, clip, state=None,
                              steps=None, layout="2019"):
    """Apex's FP16_Optimizer (2018-19), written out by hand: a half model (BatchNorm fp32),
    fp32 masters (from the fp32 weights, as amp makes them), the loss times the scale, skip
    and halve on a non-finite gradient, double on the window-th clean step since the last
    overflow (DynamicLossScaler's (cur_iter - last_overflow_iter) % scale_window == 0), unscale,
    clip on the master gradients, step, copy back. Returns (log, masters, state).
    ``layout``: the inner optimizer's parameters in the model's order (2019 and later, each
    master in its half parameter's slot) or, as 2018's FP16_Optimizer rebuilt the group, the
    half parameters' masters first and the fp32 ones (BatchNorm) after them; the arithmetic is
    the same, the optimizer's state_dict slots differ."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if state is None:
        masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
        half = copy.deepcopy(model)
        for m in half.modules():
            if not isinstance(m, nn.modules.batchnorm._BatchNorm):
                for p in m.parameters(recurse=False):
                    p.data = p.data.half()
        is_half = [p.dtype == torch.float16 for p in half.parameters()]
        if layout == "2018":
            order = [m for m, h in zip(masters, is_half) if h]
            order += [m for m, h in zip(masters, is_half) if not h]
        else:
            order = masters
        opt = torch.optim.SGD(order, lr=0.1, momentum=0.9)
        state = {"half": half, "masters": masters, "opt": opt, "cur_scale": init_scale,
                 "cur_iter": 0, "last_overflow_iter": -1}
    half, masters, opt = state["half"], state["masters"], state["opt"]
    params = list(half.parameters())
    log = []
    for x, y in batches:
        step = state["cur_iter"]
        for p in params:
            p.grad = None
        loss = F.cross_entropy(half(x.half()).float(), y) * (1e6 if step in blow else 1.0)
        scale = state["cur_scale"]
        (loss * scale).backward()
        overflow = any(not torch.isfinite(p.grad).all() for p in params)
        if overflow:
            state["cur_scale"] = scale / 2
            state["last_overflow_iter"] = step
        elif (step - state["last_overflow_iter"]) % window == 0:
            state["cur_scale"] = scale * 2
        state["cur_iter"] += 1
        log.append((scale, overflow, None if overflow else loss.item()))
        if overflow:
            continue
        for p, m in zip(params, masters):
            m.grad = p.grad.float() / scale
        torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return log, masters, state


def _legacy_o2_run(model, opt, batches, blow, clip, start=0):
    import torch
    import torch.nn.functional as F

    log = []
    for i, (x, y) in enumerate(batches, start=start):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) * (1e6 if i in blow else 1.0)
        scale = amp._amp_state.loss_scalers[0].loss_scale()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
        skipped = amp.step_was_skipped(opt)
        log.append((scale, skipped, None if skipped else loss.item()))
    return log


def _legacy_model_and_batches():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g))
               for _ in range(10)]
    return model, batches


def test_o2_steps_as_fp16_optimizer_did_bit_for_bit(clean_apex):
    # The FP16_Optimizer refusal says amp O2 gives "fp32 master weights and dynamic loss
    # scaling, as FP16_Optimizer gave". Checked step by step in fp16 on the CPU against that
    # optimizer written out by hand: the scale sequence (back-off at each overflow, growth on
    # the window-th clean step, window set through Apex's _scale_seq_len), the skipped steps,
    # the losses and the masters (clipped on their fp32 gradients) agree bit for bit.
    import torch

    mixprec.install_apex_alias()
    from apex import amp as apex_amp

    model, batches = _legacy_model_and_batches()
    blow = {2, 6, 7}
    ref_log, ref_masters, _ = _fp16_optimizer_reference(model, batches, blow, 2.0**10, 2, 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = apex_amp.initialize(model, opt, opt_level="O2", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**10
    amp._amp_state.loss_scalers[0]._scale_seq_len = 2
    log = _legacy_o2_run(model, opt, batches, blow, 0.5)
    assert [s for s, _, _ in log] == [s for s, _, _ in ref_log]
    assert [i for i, (_, k, _) in enumerate(log) if k] == sorted(blow)
    assert log == ref_log
    for got, want in zip(amp.master_params(opt), ref_masters):
        assert torch.equal(got, want.detach())


@pytest.mark.parametrize("layout", ["2018", "2019"])
def test_an_fp16_optimizer_checkpoint_resumes_under_o2_bit_for_bit(clean_apex, tmp_path,
                                                                    layout):
    """An FP16_Optimizer checkpoint mid-window resumed by the ported O2 script: the model's
    own checkpoint (half weights, BatchNorm fp32, buffers) through model.load_state_dict,
    then FP16_Optimizer.state_dict() through amp.load_fp16_optimizer_state_dict: the masters
    of fp32_from_fp16 exactly, the inner optimizer's state and the scale with the clean steps
    counted toward the next growth and the window, from either of Apex's layouts (2018's
    pickled DynamicLossScaler, its groups rebuilt with the half parameters' masters first and
    BatchNorm's fp32 parameters after them; 2019's apex.amp.scaler.LossScaler, masters in
    place). It continues as FP16_Optimizer would have, bit for bit, growth step included.
    (docs/migrating.md's recipe loaded 2018's state in the model's order: BatchNorm's momentum
    landed on the last Linear, r107D R1.)"""
    import torch

    model, batches = _legacy_model_and_batches()
    blow = {2, 8}
    straight, ref_masters, _ = _fp16_optimizer_reference(model, batches, blow, 2.0**10, 4, 0.5,
                                                         layout=layout)
    first, _, state = _fp16_optimizer_reference(model, batches[:6], blow, 2.0**10, 4, 0.5,
                                                layout=layout)
    assert (state["cur_iter"], state["last_overflow_iter"]) == (6, 2)  # growth due at step 6
    half_masters = [m for m, p in zip(state["masters"], state["half"].parameters())
                    if p.dtype == torch.float16]
    if layout == "2018":
        scaler = dict(cls_name="DynamicLossScaler", cur_scale=state["cur_scale"],
                      cur_iter=state["cur_iter"], last_overflow_iter=state["last_overflow_iter"],
                      scale_factor=2.0, scale_window=4)
    else:
        scaler = dict(cls_name="LossScaler", module="apex.amp.scaler", dynamic=True,
                      _loss_scale=state["cur_scale"], _max_loss_scale=2.0**24,
                      _min_loss_scale=None, _scale_seq_len=4, _has_overflow=False,
                      _unskipped=state["cur_iter"] - state["last_overflow_iter"] - 1)
    _save_an_apex_pickled_scaler(
        tmp_path / "old.pt", {"optimizer_state_dict": state["opt"].state_dict(),
                              "fp32_from_fp16": [[m.detach().clone() for m in half_masters]],
                              "dynamic_loss_scale": True, "overflow": False,
                              "first_closure_call_this_step": True}, **scaler)
    mixprec.install_apex_alias()  # (after the stand-in Apex that pickled the scaler is gone)
    from apex import amp as apex_amp

    saved = {"model": state["half"].state_dict(),
             "optimizer": _load(tmp_path / "old.pt")["optimizer"]}
    new = copy.deepcopy(model)
    opt = torch.optim.SGD(new.parameters(), lr=0.1, momentum=0.9)
    new, opt = apex_amp.initialize(new, opt, opt_level="O2", verbosity=0)
    new.load_state_dict(saved["model"])
    amp.load_fp16_optimizer_state_dict(opt, saved["optimizer"])
    rest = _legacy_o2_run(new, opt, batches[6:], blow, 0.5, start=6)
    assert first + rest == straight
    assert rest[0][0] * 2 == rest[1][0]  # the growth FP16_Optimizer had due at step 6
    for got, want in zip(amp.master_params(opt), ref_masters):
        assert torch.equal(got, want.detach())


def test_loading_an_fp16_optimizer_state_dict_refuses_what_does_not_match(clean_apex, tmp_path):
    """Each refusal names what was passed and what is needed, and none loads anything: an
    O1 optimizer (no masters), a model checkpoint passed for the optimizer's, another number
    of groups, masters for other parameters, a static checkpoint scale under amp's dynamic
    one."""
    import torch
    from torch import nn

    model, _ = _legacy_model_and_batches()
    half = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    opt_sd = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    _save_an_apex_pickled_scaler(tmp_path / "old.pt", {}, cls_name="LossScaler",
                                 cur_scale=128.0)
    mixprec.install_apex_alias()
    static = _load(tmp_path / "old.pt")["optimizer"]["loss_scaler"]
    good = {"optimizer_state_dict": opt_sd, "loss_scaler": static,
            "fp32_from_fp16": [[p.detach().clone() for p in half]]}

    o1_model = copy.deepcopy(model)
    o1 = torch.optim.SGD(o1_model.parameters(), lr=0.1)
    amp.initialize(o1_model, o1, opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match="has no master weights"):
        amp.load_fp16_optimizer_state_dict(o1, good)
    net = copy.deepcopy(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    amp.initialize(net, opt, opt_level="O2", verbosity=0)
    before = [m.detach().clone() for m in amp.master_params(opt)]
    cases = [
        (model.state_dict(), r"missing \['optimizer_state_dict', 'fp32_from_fp16', "
                             r"'loss_scaler'\]. Pass checkpoint\['optimizer'\]"),
        ({**good, "fp32_from_fp16": good["fp32_from_fp16"] * 2},
         "holds 1 parameter groups \\(2 of masters\\), the optimizer 1"),
        ({**good, "fp32_from_fp16": [good["fp32_from_fp16"][0][:3]]},
         "group 0 of the checkpoint holds 3 fp32 masters, but the optimizer's group 0 has 4"),
        ({**good, "fp32_from_fp16": [good["fp32_from_fp16"][0][::-1]]},
         r"a saved master of shape \(4,\) falls on a parameter of shape \(8, 6\)"),
        (good, r"loss scale is static \(128\), amp's dynamic: pass loss_scale=128"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            amp.load_fp16_optimizer_state_dict(opt, bad)
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
    assert not opt.state  # (nothing loaded)


def _fp16_optimizer_groups_run(model, make_opt, layout, batches, blow, scaler, freeze=(),
                               state=None, start=0):
    """Apex's FP16_Optimizer over several parameter groups, written out by hand (see
    _fp16_optimizer_reference for one group): the half model (BatchNorm fp32), parameters named
    in ``freeze`` frozen; 2018's layout rebuilds each group as its trainable half parameters'
    masters then its trainable fp32 ones, in a new inner optimizer; 2019's puts each master in
    its half parameter's slot (frozen ones stay). ``scaler``: {"scale", "window"} (2018's
    DynamicLossScaler growth rule, cur_iter/last_overflow_iter, as 2019's _unskipped counts).
    Returns (log, state)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if state is None:
        half = copy.deepcopy(model)
        for name, p in half.named_parameters():
            p.requires_grad_(name not in freeze)
        for m in half.modules():
            if not isinstance(m, nn.modules.batchnorm._BatchNorm):
                for p in m.parameters(recurse=False):
                    p.data = p.data.half()
        opt = make_opt(half)
        pairs = []  # (half, master) per group
        for group in opt.param_groups:
            halves = [p for p in group["params"]
                      if p.requires_grad and p.dtype == torch.float16]
            masters = [p.detach().clone().float().requires_grad_() for p in halves]
            pairs.append(list(zip(halves, masters)))
            if layout == "2018":
                group["params"] = masters + [p for p in group["params"]
                                             if p.requires_grad and p.dtype == torch.float32]
            else:
                of = {id(h): m for h, m in zip(halves, masters)}
                group["params"] = [of.get(id(p), p) for p in group["params"]]
        if layout == "2018":
            opt = opt.__class__(opt.param_groups)
        state = {"half": half, "opt": opt, "pairs": pairs, "scale": scaler["scale"],
                 "window": scaler["window"], "cur_iter": 0, "last_overflow_iter": -1}
    half, opt = state["half"], state["opt"]
    log = []
    for i, (x, y) in enumerate(batches, start=start):
        for p in half.parameters():
            p.grad = None
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = None
        loss = F.cross_entropy(half(x.half()).float(), y) * (1e6 if i in blow else 1.0)
        scale = state["scale"]
        (loss * scale).backward()
        trainable = [p for p in half.parameters() if p.requires_grad]
        overflow = any(not torch.isfinite(p.grad).all() for p in trainable)
        step = state["cur_iter"]
        if overflow:
            state["scale"] = scale / 2
            state["last_overflow_iter"] = step
        elif (step - state["last_overflow_iter"]) % state["window"] == 0:
            state["scale"] = scale * 2
        state["cur_iter"] += 1
        log.append((scale, overflow, None if overflow else loss.item()))
        if overflow:
            continue
        for group in state["pairs"]:
            for h, m in group:
                m.grad = h.grad.float()
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / scale)
        opt.step()
        with torch.no_grad():
            for group in state["pairs"]:
                for h, m in group:
                    h.copy_(m)
    return log, state


def _decay_and_no_decay(model, **kw):
    # BERT's split; each group mixes half parameters (Linear) and fp32 ones (BatchNorm).
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.01,
             "lr": kw.get("lr", 0.1)},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0,
             "lr": kw.get("lr", 0.1) / 2}]


def _two_linear_model_and_batches():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                          nn.ReLU(), nn.Linear(8, 4))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 6, generator=g), torch.randint(0, 4, (16,), generator=g))
               for _ in range(12)]
    return model, batches


def _save_fp16_optimizer_checkpoint(path, state, layout, extra_scaler=None):
    scaler_state = {"cur_iter": state["cur_iter"], "last_overflow_iter":
                    state["last_overflow_iter"]}
    if layout == "2018":
        scaler = dict(cls_name="DynamicLossScaler", cur_scale=state["scale"],
                      scale_factor=2.0, scale_window=state["window"], **scaler_state)
    else:
        scaler = dict(cls_name="LossScaler", module="apex.amp.scaler", dynamic=True,
                      _loss_scale=state["scale"], _max_loss_scale=2.0**24,
                      _min_loss_scale=None, _scale_seq_len=state["window"],
                      _has_overflow=False,
                      _unskipped=(state["cur_iter"] - state["last_overflow_iter"] - 1)
                      % state["window"])
    scaler.update(extra_scaler or {})
    _save_an_apex_pickled_scaler(
        path, {"optimizer_state_dict": state["opt"].state_dict(),
               "fp32_from_fp16": [[m.detach().clone() for _, m in g] for g in state["pairs"]],
               "dynamic_loss_scale": True, "overflow": False,
               "first_closure_call_this_step": True}, **scaler)


@pytest.mark.parametrize("layout", ["2018", "2019"])
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_an_fp16_optimizer_checkpoint_of_several_groups_with_frozen_parameters_resumes(
        clean_apex, tmp_path, layout, optimizer):
    """Decay/no-decay groups with their own lr and weight decay, each mixing half Linear
    parameters and fp32 BatchNorm ones, a frozen half bias and a frozen fp32 BatchNorm bias
    (2018's FP16_Optimizer left them out of its groups, 2019's kept them in their slots), SGD
    with momentum or AdamW (exp_avg, exp_avg_sq, step): resumed under O2 it goes on as the
    FP16_Optimizer would have, losses, skipped steps, scales, weights and optimizer state bit
    for bit."""
    import torch

    model, batches = _two_linear_model_and_batches()
    freeze = ("3.bias", "1.bias")
    kw = ({"momentum": 0.9} if optimizer == "SGD" else {"lr": 1e-2})

    def make_opt(m):
        return getattr(torch.optim, optimizer)(_decay_and_no_decay(m, **kw), **kw)

    blow, scaler = {2, 8}, {"scale": 2.0**10, "window": 3}
    straight, end = _fp16_optimizer_groups_run(model, make_opt, layout, batches, blow, scaler,
                                               freeze)
    first, state = _fp16_optimizer_groups_run(model, make_opt, layout, batches[:6], blow,
                                              scaler, freeze)
    _save_fp16_optimizer_checkpoint(tmp_path / "old.pt", state, layout)
    mixprec.install_apex_alias()
    saved = {"model": state["half"].state_dict(),
             "optimizer": _load(tmp_path / "old.pt")["optimizer"]}
    new = copy.deepcopy(model)
    for name, p in new.named_parameters():
        p.requires_grad_(name not in freeze)
    opt = make_opt(new)
    new, opt = amp.initialize(new, opt, opt_level="O2", verbosity=0)
    new.load_state_dict(saved["model"])
    amp.load_fp16_optimizer_state_dict(opt, saved["optimizer"])
    rest = _legacy_o2_run(new, opt, batches[6:], blow, 1e9, start=6)
    assert first + rest == straight
    want_master = {id(h): m for g in end["pairs"] for h, m in g}
    from mixprec.amp._state import optimizer_state

    master_of = {id(h): m for h, m in optimizer_state(opt).pairs}
    for (name, got), want in zip(new.named_parameters(), end["half"].parameters()):
        assert torch.equal(got.detach(), want.detach()), name
        if id(want) in want_master:
            got_m, want_m = master_of[id(got)], want_master[id(want)]
            assert torch.equal(got_m.detach(), want_m.detach()), name
        else:
            got_m, want_m = got, want
        got_s, want_s = opt.state.get(got_m, {}), end["opt"].state.get(want_m, {})
        assert sorted(got_s) == sorted(want_s), name
        for key in want_s:
            assert torch.equal(torch.as_tensor(got_s[key]), torch.as_tensor(want_s[key])), \
                (name, key)


@pytest.mark.parametrize("layout", ["2018", "2019"])
def test_fp16_optimizer_masters_that_do_not_round_to_the_model_are_refused(clean_apex,
                                                                           tmp_path, layout):
    """Two misuses the group and shape checks let through, each leaving a weight wrong:
    another same-shaped half parameter frozen than in the checkpoint's run (0.bias's master
    was 3.bias's values), and the FP16_Optimizer state loaded before the model's checkpoint
    (model.load_state_dict then rounded every master to half). FP16_Optimizer copied every
    master into its half parameter after each step, so its masters round to the saved model's
    half weights: one that does not is refused, before anything loads."""
    import torch

    model, batches = _two_linear_model_and_batches()

    def make_opt(m):
        return torch.optim.SGD(_decay_and_no_decay(m), lr=0.1, momentum=0.9)

    _, state = _fp16_optimizer_groups_run(model, make_opt, layout, batches[:6], {2}, {
        "scale": 2.0**10, "window": 3}, freeze=("0.bias",))
    _save_fp16_optimizer_checkpoint(tmp_path / "old.pt", state, layout)
    mixprec.install_apex_alias()
    saved = {"model": state["half"].state_dict(),
             "optimizer": _load(tmp_path / "old.pt")["optimizer"]}

    def resumed(frozen):
        new = copy.deepcopy(model)
        for name, p in new.named_parameters():
            p.requires_grad_(name not in frozen)
        new, opt = amp.initialize(new, make_opt(new), opt_level="O2", verbosity=0)
        return new, opt

    new, opt = resumed(("3.bias",))  # (the checkpoint's run froze 0.bias: same shape)
    new.load_state_dict(saved["model"])
    with pytest.raises(ValueError, match="load the model's checkpoint first"):
        amp.load_fp16_optimizer_state_dict(opt, saved["optimizer"])
    assert torch.equal(dict(new.named_parameters())["0.bias"].detach(), saved["model"]["0.bias"])
    assert not opt.state

    new, opt = resumed(("0.bias",))
    with pytest.raises(ValueError, match="load the model's checkpoint first"):
        amp.load_fp16_optimizer_state_dict(opt, saved["optimizer"])  # before the model's
    new.load_state_dict(saved["model"])
    amp.load_fp16_optimizer_state_dict(opt, saved["optimizer"])  # in the documented order
    amp.load_fp16_optimizer_state_dict(opt, saved["optimizer"])  # (and again: idempotent)
    from mixprec.amp._state import optimizer_state

    master_of = {id(h): m for h, m in optimizer_state(opt).pairs}
    want = {id(h): m for g in state["pairs"] for h, m in g}
    for got, ref in zip(new.parameters(), state["half"].parameters()):
        if id(ref) in want:
            assert torch.equal(master_of[id(got)].detach(), want[id(ref)].detach())


@pytest.mark.parametrize("layout", ["2018", "2019"])
def test_an_fp16_optimizer_checkpoint_keeps_its_scale_bounds(clean_apex, tmp_path, layout,
                                                              device):
    """The dynamic scale's floor and ceiling come with the checkpoint, as its window does:
    2018's DynamicLossScaler never went below 1 and had no ceiling (its default init_scale of
    2**32 leaves scales above amp's 2**24 after a few overflows), 2019's LossScaler kept
    min_loss_scale/max_loss_scale (dynamic_loss_args). Left at amp's defaults, the resumed
    scale was clamped to 2**24 at the first step, or halved below the run's floor and a step
    FP16_Optimizer skipped was taken."""
    import torch

    model, batches = _two_linear_model_and_batches()
    if layout == "2018":
        high = dict(cls_name="DynamicLossScaler", cur_scale=2.0**28, cur_iter=4,
                    last_overflow_iter=3, scale_factor=2.0, scale_window=1000)
        low = dict(high, cur_scale=1.0)
        floor = 1.0
    else:
        high = dict(cls_name="LossScaler", module="apex.amp.scaler", dynamic=True,
                    _loss_scale=2.0**28, _max_loss_scale=2.0**30, _min_loss_scale=None,
                    _scale_seq_len=1000, _has_overflow=False, _unskipped=0)
        low = dict(high, _loss_scale=4.0, _min_loss_scale=4.0)
        floor = 4.0
    for scaler, want in ((high, [2.0**28, 2.0**27]), (low, [floor, floor])):
        new = copy.deepcopy(model).to(device)  # (on CUDA the scale lives on the device)
        opt = torch.optim.SGD(new.parameters(), lr=0.1)
        new, opt = amp.initialize(new, opt, opt_level="O2", verbosity=0)
        half = [p for m in new.modules() if isinstance(m, torch.nn.Linear)
                for p in m.parameters()]
        _save_an_apex_pickled_scaler(tmp_path / "old.pt", {
            "optimizer_state_dict": torch.optim.SGD(new.parameters(), lr=0.1).state_dict(),
            "fp32_from_fp16": [[p.detach().float() for p in half]]}, **scaler)
        mixprec.install_apex_alias()
        amp.load_fp16_optimizer_state_dict(opt, _load(tmp_path / "old.pt")["optimizer"])
        scales = []
        for x, y in batches[:2]:  # an overflowed step, then one more
            opt.zero_grad()
            scales.append(amp._amp_state.loss_scalers[0].loss_scale())
            loss = torch.nn.functional.cross_entropy(new(x.to(device)), y.to(device))
            loss = loss * float("inf")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            assert amp.step_was_skipped(opt)
        assert scales == want


def test_an_fp16_optimizer_checkpoint_scale_meets_amps_own(clean_apex, tmp_path):
    """A dynamic checkpoint under bf16 O2 (static 1.0 by default) is refused naming
    loss_scale='dynamic' (not as "the default": under bf16 it is not); a static checkpoint's
    scale replacing another static one set for this run warns, as amp.load_state_dict does,
    and is the scale used from then on."""
    import torch
    from torch import nn

    model, _ = _legacy_model_and_batches()
    half = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    entries = {"optimizer_state_dict": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(),
               "fp32_from_fp16": [[p.detach().clone() for p in half]]}
    _save_an_apex_pickled_scaler(tmp_path / "dyn.pt", entries, cur_scale=1024.0, cur_iter=3,
                                 last_overflow_iter=-1, scale_factor=2.0, scale_window=1000)
    _save_an_apex_pickled_scaler(tmp_path / "static.pt", entries, cls_name="LossScaler",
                                 cur_scale=128.0)
    mixprec.install_apex_alias()
    for dtype, loss_scale, path in ((torch.bfloat16, None, "dyn.pt"),
                                    (torch.float16, 64.0, "static.pt")):
        net = copy.deepcopy(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        amp.initialize(net, opt, opt_level="O2", dtype=dtype, loss_scale=loss_scale,
                       verbosity=0)
        # (The model's checkpoint beside it: FP16_Optimizer's half weights, BatchNorm fp32.)
        net.load_state_dict({k: v.half() if k[0] in "03" else v
                             for k, v in model.state_dict().items()})
        saved = _load(tmp_path / path)["optimizer"]
        if path == "dyn.pt":
            with pytest.raises(ValueError, match=r"loss scale is dynamic, amp's static: pass "
                                                 r"loss_scale='dynamic' to amp.initialize\.$"):
                amp.load_fp16_optimizer_state_dict(opt, saved)
        else:
            with pytest.warns(UserWarning, match="static loss scale 128 replaces this run's 64"):
                amp.load_fp16_optimizer_state_dict(opt, saved)
            assert amp.state_dict(optimizer=opt)["loss_scaler0"]["loss_scale"] == 128.0


# (r108B's kill tests of amp.load_fp16_optimizer_state_dict)

def _apex_scaler(tmp_path, **attributes):
    """An object of Apex's scaler class as Apex pickled it, unpickled through the alias
    (installed here, after the stand-in Apex that pickled it is gone)."""
    _save_an_apex_pickled_scaler(tmp_path / "scaler.pt", {}, **attributes)
    mixprec.install_apex_alias()
    return _load(tmp_path / "scaler.pt")["optimizer"]["loss_scaler"]


def _dyn2018(tmp_path, **kw):
    attrs = dict(cur_scale=1024.0, cur_iter=6, last_overflow_iter=2, scale_factor=2.0,
                 scale_window=4)
    attrs.update(kw)
    return _apex_scaler(tmp_path, **attrs)


def _dyn2019(tmp_path, **kw):
    attrs = dict(dynamic=True, _loss_scale=1024.0, _max_loss_scale=2.0**24,
                 _min_loss_scale=None, _scale_seq_len=4, _has_overflow=False, _unskipped=3)
    attrs.update(kw)
    return _apex_scaler(tmp_path, cls_name="LossScaler", module="apex.amp.scaler", **attrs)


def _model(frozen=()):
    """Linear, BatchNorm1d, ReLU, Linear with weights fp16 holds exactly (as a checkpoint of
    FP16_Optimizer's half model loaded into it), ``frozen`` parameters frozen."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return model


def _is_half(name):  # (Linear's parameters go half at O2, BatchNorm's stay fp32)
    return not name.startswith("1.")


def _checkpoint(model, layout, scaler):
    import torch

    """FP16_Optimizer.state_dict() of ``model`` (its requires_grad flags as they are), with a
    distinct SGD momentum buffer per trainable parameter (filled with its model index + 1)
    and masters just off the weights, in Apex's 2018 or 2019 layout."""
    named = list(model.named_parameters())
    clones = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in named}
    trainable = [n for n, p in named if p.requires_grad]
    if layout == "2018":
        order = ([n for n in trainable if _is_half(n)] + [n for n in trainable if not _is_half(n)])
    else:
        order = [n for n, _ in named]
    inner = torch.optim.SGD([clones[n] for n in order], lr=0.1, momentum=0.9)
    index = {n: i for i, (n, _) in enumerate(named)}
    for n in trainable:
        inner.state[clones[n]] = {"momentum_buffer": torch.full_like(clones[n], index[n] + 1.0)}
    # (Masters a quarter of fp16's rounding step off the half weights: they round to them,
    # as FP16_Optimizer's did, and differ from amp's own masters, the weights themselves.)
    masters = [[clones[n].detach() * (1 + 2.0**-13) for n in trainable if _is_half(n)]]
    return {"optimizer_state_dict": inner.state_dict(), "fp32_from_fp16": masters,
            "loss_scaler": scaler}


def _o2(model, **kw):
    import torch

    new = copy.deepcopy(model)
    opt = torch.optim.SGD(new.parameters(), lr=0.1, momentum=0.9)
    new, opt = amp.initialize(new, opt, opt_level="O2", verbosity=0, **kw)
    return new, opt


# --- F3, F4, F15 (and F5 shown equivalent): frozen parameters in both layouts ----------------

@pytest.mark.parametrize("layout", ["2018", "2019"])
@pytest.mark.parametrize("frozen", [("3.bias",), ("1.weight", "3.bias"), ("0.bias",)])
def test_frozen_parameters_get_no_state_and_the_others_their_own(clean_apex, tmp_path, layout,
                                                                  frozen):
    """The docstring: 2018's FP16_Optimizer left frozen parameters out of its rebuilt groups,
    2019's kept them in place; fp32_from_fp16 holds the trainable half parameters' masters
    only. Each trainable parameter gets its own momentum buffer (its model index + 1), each
    frozen one none, and each trainable half parameter its saved master."""
    import torch

    model = _model(frozen)
    scaler = _dyn2018(tmp_path) if layout == "2018" else _dyn2019(tmp_path)
    ckpt = _checkpoint(model, layout, scaler)
    new, opt = _o2(model)
    amp.load_fp16_optimizer_state_dict(opt, ckpt)
    names = [n for n, _ in model.named_parameters()]
    slots = opt.param_groups[0]["params"]
    masters = iter(ckpt["fp32_from_fp16"][0])
    for i, (name, slot) in enumerate(zip(names, slots)):
        if name in frozen:
            assert slot not in opt.state or not opt.state[slot], name
            continue
        buf = opt.state[slot]["momentum_buffer"]
        assert buf.shape == slot.shape and torch.all(buf == i + 1), (name, buf)
        if _is_half(name):
            assert torch.equal(slot.detach(), next(masters)), name


# --- F6: the clean-step count is taken modulo the window ---------------------------------

def test_2018_count_since_the_last_overflow_is_taken_modulo_the_window(clean_apex, tmp_path):
    """DynamicLossScaler grew at (cur_iter - last_overflow_iter) % scale_window == 0: with no
    overflow ever (-1) and cur_iter=1234, window 1000, it grew at step 999 and grows next at
    step 1999: 234 clean steps counted toward the next growth, not 1234 (which amp grows at
    the very next clean step)."""
    model = _model()
    scaler = _dyn2018(tmp_path, cur_iter=1234, last_overflow_iter=-1, scale_window=1000)
    ckpt = _checkpoint(model, "2018", scaler)
    new, opt = _o2(model)
    amp.load_fp16_optimizer_state_dict(opt, ckpt)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 234}


# --- F9: a dynamic checkpoint scale under amp's static one -------------------------------

@pytest.mark.parametrize("layout", ["2018", "2019"])
def test_a_dynamic_checkpoint_scale_under_a_static_amp_scale_is_refused(clean_apex, tmp_path,
                                                                         layout):
    model = _model()
    scaler = _dyn2018(tmp_path) if layout == "2018" else _dyn2019(tmp_path)
    ckpt = _checkpoint(model, layout, scaler)
    new, opt = _o2(model, loss_scale=128.0)
    with pytest.raises(ValueError, match=r"loss scale is dynamic, amp's static: pass "
                                         r"loss_scale='dynamic'"):
        amp.load_fp16_optimizer_state_dict(opt, ckpt)
    assert not opt.state


# --- F12: every check runs before anything is loaded -------------------------------------

def test_a_refused_scale_loads_neither_state_nor_masters(clean_apex, tmp_path):
    """The static-vs-dynamic refusal comes before the optimizer's state and the masters are
    written (the suite's own check used an SGD without state and masters equal to amp's)."""
    import torch

    model = _model()
    static = _apex_scaler(tmp_path, cls_name="LossScaler", cur_scale=128.0)
    ckpt = _checkpoint(model, "2018", static)
    new, opt = _o2(model)  # (dynamic)
    before = [m.detach().clone() for m in amp.master_params(opt)]
    with pytest.raises(ValueError, match="loss scale is static"):
        amp.load_fp16_optimizer_state_dict(opt, ckpt)
    assert not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))


# --- F14: the scale factor warning -------------------------------------------------------

def test_a_scale_factor_other_than_two_is_warned_about(clean_apex, tmp_path):
    model = _model()
    scaler = _dyn2018(tmp_path, scale_factor=4.0)
    ckpt = _checkpoint(model, "2018", scaler)
    new, opt = _o2(model)
    with pytest.warns(UserWarning, match="grew and backed off by 4; amp's dynamic scale uses 2"):
        amp.load_fp16_optimizer_state_dict(opt, ckpt)
    import warnings

    two = copy.copy(scaler)
    two.__dict__["scale_factor"] = 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.load_fp16_optimizer_state_dict(opt, _checkpoint(model, "2018", two))


# --- F16: another number of parameters in a group of the inner optimizer's state -----------

def test_a_group_listing_more_parameters_than_the_layout_gives_is_refused(clean_apex, tmp_path):
    """The checkpoint's run trained BatchNorm's weight; this run froze it: the masters match
    (the Linear ones), the inner state's group lists 6 trainable parameters, the 2018 layout
    here 5. Refused, naming both counts, nothing loaded (else zip dropped the last and shifted
    the state silently)."""
    model = _model()
    ckpt = _checkpoint(model, "2018", _dyn2018(tmp_path))
    frozen = _model(("1.weight",))
    new, opt = _o2(frozen)
    with pytest.raises(ValueError, match="lists 6 parameters, where this optimizer's layout "
                                         "for it has 5"):
        amp.load_fp16_optimizer_state_dict(opt, ckpt)
    assert not opt.state


# --- F18: shapes, not sizes ----------------------------------------------------------------

def test_a_master_of_the_same_size_but_another_shape_is_refused(clean_apex, tmp_path):
    model = _model()
    ckpt = _checkpoint(model, "2019", _dyn2019(tmp_path))
    ckpt["fp32_from_fp16"][0][0] = ckpt["fp32_from_fp16"][0][0].t().contiguous()  # (6, 8)
    new, opt = _o2(model)
    with pytest.raises(ValueError, match=r"a saved master of shape \(6, 8\) falls on a "
                                         r"parameter of shape \(8, 6\)"):
        amp.load_fp16_optimizer_state_dict(opt, ckpt)
    assert not opt.state


# --- A3: an Apex-pickled scaler's overflow flag ------------------------------------------

def test_an_apex_pickled_overflow_flag_survives_unpickling(clean_apex, tmp_path):
    """A scaler Apex pickled after an overflowed step (before clear_overflow_state) reads
    _has_overflow True, and update_scale() then skips and halves, as Apex's did."""
    loaded = _dyn2019(tmp_path, _has_overflow=True, _unskipped=1)
    assert loaded._has_overflow is True
    assert loaded.update_scale() is True and loaded.loss_scale() == 512.0


def test_an_apex_pickled_scaler_lacking_attributes_takes_the_class_defaults(clean_apex,
                                                                           tmp_path):
    """An object holding only the scale and the overflow flag: the window, the bounds, the
    dynamic flag and the step count read as a fresh LossScaler("dynamic")'s (Apex amp's
    defaults: window 2000, ceiling 2**24, dynamic), and it steps so (r110A G5)."""
    loaded = _apex_scaler(tmp_path, cls_name="LossScaler", module="apex.amp.scaler",
                          _loss_scale=2.0**24, _has_overflow=False)
    import torch
    from apex.amp.scaler import LossScaler

    fresh = LossScaler("dynamic")
    for name in ("_scale_seq_len", "_max_loss_scale", "_min_loss_scale", "dynamic",
                 "_scale_factor", "_unskipped"):
        assert getattr(loaded, name) == getattr(fresh, name), name
    for _ in range(2000):  # (at the ceiling: clean steps leave it there)
        loaded.clear_overflow_state()
        assert loaded.update_scale() is False
    assert loaded.loss_scale() == 2.0**24
    loaded.clear_overflow_state()
    loaded.unscale([torch.tensor([float("inf")])], [torch.empty(1)], None)
    assert loaded.update_scale() is True and loaded.loss_scale() == 2.0**23


# --- F21: the checkpoint's hyperparameters (a decayed lr) are the ones loaded --------------

@pytest.mark.parametrize("layout", ["2018", "2019"])
def test_the_checkpoints_learning_rate_and_momentum_are_loaded(clean_apex, tmp_path, layout):
    """FP16_Optimizer.load_state_dict loaded the inner optimizer's state_dict, its groups'
    hyperparameters too (an lr a scheduler had decayed): so does the loader, as torch's
    Optimizer.load_state_dict does."""
    model = _model()
    scaler = _dyn2018(tmp_path) if layout == "2018" else _dyn2019(tmp_path)
    ckpt = _checkpoint(model, layout, scaler)
    ckpt["optimizer_state_dict"]["param_groups"][0].update(lr=0.0125, momentum=0.5)
    new, opt = _o2(model)
    amp.load_fp16_optimizer_state_dict(opt, ckpt)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.0125, 0.5)


# --- F23: a static scale of Apex 2019's scaler -------------------------------------------

def test_a_static_2019_scale_loads_under_a_static_amp_scale_and_not_under_a_dynamic_one(
        clean_apex, tmp_path):
    model = _model()
    static = _dyn2019(tmp_path, dynamic=False, _loss_scale=128.0, _unskipped=0)
    ckpt = _checkpoint(model, "2019", static)
    new, opt = _o2(model)  # (dynamic)
    with pytest.raises(ValueError, match=r"loss scale is static \(128\), amp's dynamic"):
        amp.load_fp16_optimizer_state_dict(opt, ckpt)
    new, opt = _o2(model, loss_scale=128.0)
    amp.load_fp16_optimizer_state_dict(opt, ckpt)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0


@pytest.mark.parametrize("layout", ["2018", "2019"])
def test_a_half_parameter_frozen_after_initialize_counts_as_frozen(clean_apex, tmp_path,
                                                                   layout):
    """A half parameter frozen after amp.initialize (its master keeps requires_grad=True, as
    initialize found it): the loader takes the half parameter's flag, as amp's step does, so a
    checkpoint whose run froze the same parameter loads (it was refused as holding one master
    too few, the misleading "build the model as the checkpoint's run did": r108B R1)."""
    import torch

    frozen = _model(("3.bias",))
    ckpt = _checkpoint(frozen, layout, _dyn2018(tmp_path) if layout == "2018"
                       else _dyn2019(tmp_path))
    new, opt = _o2(_model())
    new[3].bias.requires_grad_(False)
    amp.load_fp16_optimizer_state_dict(opt, ckpt)
    slots = opt.param_groups[0]["params"]
    assert not opt.state.get(slots[-1])  # (3.bias: no state)
    assert torch.equal(slots[0].detach(), ckpt["fp32_from_fp16"][0][0])


def test_apex_amp_version_module_imports(clean_apex):
    # torchcule's import block: `from apex.amp import __version__` inside a try whose except
    # says "install apex" (the script stopped there).
    mixprec.install_apex_alias()
    from apex.amp import __version__

    assert __version__.__version__ == "0.1.0" and __version__.VERSION == (0, 1, 0)


def _apex_scaler_step(scaler, model, masters, x, accumulate=False):
    """One step of a hand-made fp16 master-weight stepper as Apex-era GPT trainers wrote it
    around apex.amp.scaler.LossScaler; returns should_skip."""
    import torch

    if not accumulate:
        scaler.clear_overflow_state()
    (model(x).float().pow(2).mean() * scaler.loss_scale()).backward()
    halves = [p.grad for p in model.parameters()]
    if accumulate:
        stashed = [m.grad for m in masters]
        scaler.unscale_with_stashed(halves, stashed, stashed)
    else:
        for m in masters:
            m.grad = torch.empty_like(m)
        scaler.unscale(halves, [m.grad for m in masters], scaler.loss_scale())
    model.zero_grad(set_to_none=True)
    return scaler.update_scale() if accumulate else None


def test_apex_amp_scaler_loss_scaler_has_apexs_interface(clean_apex):
    # `from apex.amp.scaler import LossScaler` (custom fp16 optimizer wrappers of GPT trainers)
    # gave mixprec's class, whose loss_scale is a property: `loss_scale()` failed, and
    # `_loss_scale`, `unscale`, `update_scale`, `clear_overflow_state` were missing.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    scaler = LossScaler("dynamic", min_loss_scale=1.0)
    assert scaler.loss_scale() == scaler._loss_scale == 2.0**16 and scaler.dynamic
    assert not scaler.has_fused_kernel
    x1, x2 = torch.randn(3, 4).half(), torch.randn(3, 4).half()

    # Two micro-batches: unscale into fresh masters' grads, then onto them with the stash.
    _apex_scaler_step(scaler, model, masters, x1)
    first = [m.grad.clone() for m in masters]
    (model(x1).float().pow(2).mean() * 2.0**16).backward()
    want_first = [p.grad.float() * 2.0**-16 for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for got, want in zip(first, want_first):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (model(x2).float().pow(2).mean() * 2.0**16).backward()
    want_sum = [w + p.grad.float() * 2.0**-16 for w, p in zip(want_first, model.parameters())]
    model.zero_grad(set_to_none=True)
    assert _apex_scaler_step(scaler, model, masters, x2, accumulate=True) is False
    for m, want in zip(masters, want_sum):
        torch.testing.assert_close(m.grad, want, rtol=0, atol=0)
    assert scaler._unskipped == 1 and scaler._has_overflow is False

    # An inf in the last gradient: skipped, the scale halves, the clean count restarts, and
    # later unscales of the same step do nothing (Apex's order).
    scaler.clear_overflow_state()
    grads = [torch.ones(3).half(), torch.tensor([1.0, float("inf")]).half()]
    outs = [torch.zeros(3), torch.zeros(2)]
    scaler.unscale(grads, outs, None)
    assert scaler._has_overflow is True
    untouched = torch.full((3,), 7.0)
    scaler.unscale([torch.ones(3).half()], [untouched], None)
    assert bool((untouched == 7).all())
    assert scaler.update_scale() is True
    assert scaler._loss_scale == 2.0**15 and scaler._unskipped == 0
    # Growth after _scale_seq_len clean steps (set by hand, as scripts did), bounded above;
    # back-off bounded below by min_loss_scale.
    scaler._scale_seq_len, scaler._max_loss_scale = 2, 2.0**15
    for _ in range(2):
        scaler.clear_overflow_state()
        assert scaler.update_scale() is False
    assert scaler._loss_scale == 2.0**15
    scaler._loss_scale = 1.5
    scaler._has_overflow = True  # (an all-reduced flag written back, as multi-rank code did)
    assert scaler.update_scale() is True and scaler._loss_scale == 1.0

    # In place on the masters' own gradients, a scale override; a static scale never moves
    # and never looks for inf/NaN (Apex's static path).
    g = torch.full((2,), 8.0)
    scaler.clear_overflow_state()
    scaler.unscale([g], [g], None, models_are_masters=True, scale_override=4.0)
    assert g.tolist() == [2.0, 2.0]
    static = LossScaler(128.0)
    h = torch.tensor([256.0, float("inf")])
    static.unscale([h], [h], None, models_are_masters=True)
    assert h[0].item() == 2.0 and static.update_scale() is False
    assert static.loss_scale() == 128.0 and static._unskipped == 1
    out = torch.zeros(1)
    static.unscale_with_stashed([torch.tensor([8.0]).half()], [torch.tensor([1.0])], [out],
                                scale_override=(4.0, 0.5, 2.0))
    assert out.tolist() == [8.0 * 2.0 / 4.0 + 1.0 * 2.0 / 0.5]
    # The model's gradients are only read, also when they have the masters' dtype already.
    model_grad, stash, out = torch.tensor([8.0]), torch.tensor([1.0]), torch.zeros(1)
    static.unscale_with_stashed([model_grad], [stash], [out])
    assert model_grad.tolist() == [8.0] and stash.tolist() == [1.0]
    assert out.tolist() == [8.0 / 128.0 + 1.0]

    # Bad input: what was passed and what is allowed.
    with pytest.raises(ValueError, match=r"loss_scale='dyanmic'.*dynamic"):
        LossScaler("dyanmic")
    with pytest.raises(ValueError, match=r"model_grads=2, master_grads=1"):
        scaler.unscale([g, g], [g], None)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_hand_made_master_weight_stepper_on_apexs_loss_scaler_trains_as_amp_o2(
        clean_apex, accumulate):
    # The pattern of Apex-era GPT trainers' own fp16 optimizer wrappers: masters kept by hand,
    # the loss scaled by loss_scale(), unscale() into fresh master gradients and
    # unscale_with_stashed() onto the kept ones, update_scale() deciding the skip. Checked
    # against amp O2 (bf16 on the CPU, a dynamic scale, two steps poisoned with an inf): the
    # same skips and bit-identical masters.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    def batch(i, poison):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        if poison:
            x[0, 0] = float("inf")
        return x, y

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))

    def poisoned(step, micro):
        return step in (2, 5) and micro == accumulate - 1

    model = make()
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    half = model.to(torch.bfloat16)
    params = list(half.parameters())
    opt = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    scaler = LossScaler("dynamic", init_scale=2.0**8, scale_window=3, min_loss_scale=1.0)
    skipped = []
    for step in range(8):
        scaler.clear_overflow_state()
        for m in masters:
            m.grad = None
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro, poisoned(step, micro))
            loss = ((half(x.bfloat16()).float() - y) ** 2).mean()
            (loss * scaler.loss_scale()).backward()
            grads = [p.grad for p in params]
            if masters[0].grad is None:
                for m in masters:
                    m.grad = torch.empty_like(m)
                scaler.unscale(grads, [m.grad for m in masters], scaler.loss_scale())
            else:
                kept = [m.grad for m in masters]
                scaler.unscale_with_stashed(grads, kept, kept)
            for p in params:
                p.grad = None
        skipped.append(scaler.update_scale())
        if not skipped[-1]:
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)

    ref = make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref, ref_opt = amp.initialize(ref, ref_opt, opt_level="O2", dtype=torch.bfloat16,
                                  loss_scale="dynamic", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**8
    amp._amp_state.loss_scalers[0]._scale_seq_len = 3
    ref_skipped = []
    for step in range(8):
        ref_opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro, poisoned(step, micro))
            with amp.scale_loss(((ref(x).float() - y) ** 2).mean(), ref_opt) as scaled:
                scaled.backward()
        ref_opt.step()
        ref_skipped.append(amp.step_was_skipped(ref_opt))
    assert skipped == ref_skipped and skipped.count(True) == 2
    for got, want in zip(masters, amp.master_params(ref_opt)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp16_utils_master_weights_on_random_models(clean_apex):
    # Seeded random models (nested, BatchNorm affine or not, RNNs, frozen and fp64 parameters)
    # through Apex's hand-made master-weight loop, flat and not, with PyTorch's
    # zero_grad(), which sets gradients to None since 2.0 (Apex's era zeroed them): the flat
    # master lost the gradient prep_param_lists gave it, and the next
    # model_grads_to_master_grads failed with "'NoneType' object has no attribute 'data'".
    import random

    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import (
        master_params_to_model_params,
        model_grads_to_master_grads,
        network_to_half,
        prep_param_lists,
    )

    def layer(rng):
        return rng.choice([
            lambda: nn.Linear(3, 3, bias=rng.random() < 0.5),
            lambda: nn.BatchNorm1d(3, affine=rng.random() < 0.5),
            lambda: nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)),
            lambda: nn.GRU(3, 3),
        ])()

    for seed in range(8):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        model = nn.Sequential(*[layer(rng) for _ in range(rng.randint(1, 4))], nn.Linear(3, 3))
        model = network_to_half(model)
        for p in model.parameters():
            if rng.random() < 0.2:
                p.requires_grad_(False)
            elif rng.random() < 0.1:
                p.data = p.data.double()
        for flat in (False, True):
            model_params, masters = prep_param_lists(model, flat_master=flat)
            assert [m.dtype for m in masters] == [torch.float32] * len(masters)
            assert len(masters) == (1 if flat else len(model_params))
            opt = torch.optim.SGD(masters, lr=0.5)
            for _ in range(2):
                model.zero_grad()
                opt.zero_grad()  # set_to_none=True
                grads = [torch.randn_like(p) for p in model_params]
                for p, g in zip(model_params, grads):
                    p.grad = g.clone()
                model_grads_to_master_grads(model_params, masters, flat_master=flat)
                got = torch.cat([m.grad.flatten() for m in masters])
                assert torch.equal(got, torch.cat([g.float().flatten() for g in grads]))
                before = torch.cat([m.detach().flatten() for m in masters])
                opt.step()
                master_params_to_model_params(model_params, masters, flat_master=flat)
                after = torch.cat([m.detach().flatten() for m in masters])
                torch.testing.assert_close(after, before - 0.5 * got, rtol=0, atol=0)
                values = torch.cat([p.detach().float().flatten() for p in model_params])
                expect = torch.cat([a.to(p.dtype).float().flatten() for a, p in zip(
                    after.split([p.numel() for p in model_params]), model_params)])
                assert torch.equal(values, expect)  # each cast once to its own dtype


def test_fp16_utils_masters_are_copies_with_their_own_gradients(clean_apex):
    # A missing master gradient is made like the master (Apex: master.data.new(...)), not
    # like the model's gradient in fp32: fp64 masters got "attempting to assign a gradient
    # with dtype 'float' to a tensor with grad_dtype 'Double'". And one contiguous fp32
    # parameter flattened to a view of itself: the flat "copy" shared the model's memory.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import model_grads_to_master_grads, prep_param_lists

    model = nn.Linear(3, 2).half()
    model_params = list(model.parameters())
    masters = [nn.Parameter(p.detach().double()) for p in model_params]  # the user's own
    for p in model_params:
        p.grad = torch.randn_like(p)
    model_grads_to_master_grads(model_params, masters)
    for p, m in zip(model_params, masters):
        assert m.grad.dtype == torch.float64 and torch.equal(m.grad, p.grad.double())
    single = nn.Linear(4, 2, bias=False)
    (param,), (flat,) = prep_param_lists(single, flat_master=True)
    assert flat.data_ptr() != param.data_ptr()
    with torch.no_grad():
        flat.add_(1.0)
    assert torch.equal(param.detach().flatten() + 1.0, flat.detach())


def test_fp16_utils_refuse_master_lists_that_do_not_match(clean_apex):
    # Apex zipped the lists (a shorter one silently left parameters out) and failed deep in
    # copy_ or on None for the rest: each now says what was passed and what was expected.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import (
        master_params_to_model_params,
        model_grads_to_master_grads,
        prep_param_lists,
    )

    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 3), nn.Linear(3, 2))
    model_params, flat = prep_param_lists(model, flat_master=True)
    _, masters = prep_param_lists(model)
    for p in model_params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"master_params\[0\] has shape \(15,\), "
                                         r"model_params\[0\] \(1, 1\).*need flat_master=True"):
        model_grads_to_master_grads(model_params, flat)
    with pytest.raises(ValueError, match="flat_master=True.*one-tensor list.*15 elements of "
                                         "the 5 model_params in one 1-D tensor; got 5 tensor"):
        model_grads_to_master_grads(model_params, masters, flat_master=True)
    # One parameter: a list master has as many elements as the flat one would; its shape
    # tells them apart (raw "size of tensor a (3) must match" / "exceeds dimension size" errors).
    single = nn.Linear(3, 2, bias=False)
    single_params, single_masters = prep_param_lists(single)
    single.weight.grad = torch.ones_like(single.weight)
    for fn in (model_grads_to_master_grads, master_params_to_model_params):
        with pytest.raises(ValueError, match=r"in one 1-D tensor; got 1 tensor\(s\) of "
                                             r"shape\(s\) \[\(2, 3\)\]"):
            fn(single_params, single_masters, flat_master=True)
    with pytest.raises(ValueError, match="got 4 master_params for 5 model_params"):
        master_params_to_model_params(model_params, masters[:4])
    model_params[-1].grad = None  # (a parameter the backward did not reach)
    with pytest.raises(ValueError, match=r"model_params \[4\] \(2,\) have no gradient.*"
                                         "flat_master=False"):
        model_grads_to_master_grads(model_params, flat, flat_master=True)
    model_grads_to_master_grads(model_params, masters)  # (not flat: that master's is None)
    assert masters[-1].grad is None and masters[0].grad is not None
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        prep_param_lists(nn.Linear(2, 2).requires_grad_(False), flat_master=True)


def test_apexs_first_amp_api_says_what_replaced_it():
    with pytest.raises(AttributeError, match=r"amp.init.*replaced it with amp.initialize.*"
                                             r"allow_banned=True.*delete the call"):
        amp.init(enabled=True)
    with pytest.raises(AttributeError, match=r"amp.init.*replaced it with amp.initialize"):
        amp.init(allow_banned=True)
    with pytest.raises(AttributeError, match=r"AmpHandle.*replaced it with amp.initialize"):
        amp.AmpHandle  # noqa: B018
    with pytest.raises(AttributeError, match=r"amp._initialize.*runs under "
                                             r"torch\.nn\.DataParallel as it is"):
        amp._initialize  # noqa: B018
    with pytest.raises(TypeError, match=r"amp\.init\(enabled='False'\)"):
        amp.init(enabled="False")
    assert not hasattr(amp, "no_such_name")


def test_apexs_first_amp_api_disabled_is_a_no_op(clean_apex):
    # maskrcnn-benchmark and its forks call `amp.init(enabled=<fp16 in config>)` in every run,
    # fp32 by default: Apex returned a handle that does nothing, mixprec refused the call, so
    # the default fp32 evaluation died on its first lines.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex import amp as apex_amp

    handle = apex_amp.init(enabled=False, verbose=False)
    assert isinstance(handle, apex_amp.NoOpHandle) and not handle.is_active()
    assert not handle.has_cache and not handle.verbose
    torch.manual_seed(0)
    model, ref = nn.Linear(3, 2), nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        with handle.scale_loss(loss, opt) as scaled:
            assert scaled is loss
            scaled.backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    with opt.scale_loss(model(x).sum()) as scaled:  # (the wrapper's own form)
        scaled.backward()
    with handle._disable_casts():
        pass
    assert opt.param_groups[0]["lr"] == 0.1  # (the optimizer's attributes through it)
    assert copy.deepcopy(opt).param_groups[0]["lr"] == 0.1  # (copies: Apex's recursed)
    # Logs print the handle and the optimizer (H01, H04).
    assert repr(handle) == "NoOpHandle()"
    inner = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    assert repr(handle.wrap_optimizer(inner)) == f"NoOpHandle-wrapped {inner!r}"
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_apexs_other_optimizers_import_and_name_their_replacement(clean_apex):
    # Scripts import several of Apex's optimizers in one line and build the one asked for
    # (`from apex.optimizers import FusedAdam, FusedSGD, FusedNovoGrad, FusedLAMB`; BERT's
    # FusedLAMB; pytorch-pretrained-BERT's apex.optimizers.FP16_Optimizer). Before, the import
    # failed with "cannot import name 'FusedSGD' from 'mixprec.optimizers'", which such scripts
    # turn into "please install apex", and a FusedAdam run could not start at all.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    import apex
    from apex.optimizers import (
        FP16_Optimizer,
        FusedAdam,
        FusedLAMB,
        FusedLANS,
        FusedMixedPrecisionLamb,
        FusedNovoGrad,
        FusedSGD,
    )
    from apex.optimizers.fused_adam import FusedAdam as from_its_file
    from apex.optimizers.fused_lamb import FusedLAMB as lamb_from_its_file

    assert FusedAdam is from_its_file is mixprec.optimizers.FusedAdam
    assert lamb_from_its_file is FusedLAMB is apex.optimizers.FusedLAMB
    assert issubclass(FusedSGD, torch.optim.SGD)  # (built: test_apexs_fused_sgd_is_...)
    assert not hasattr(mixprec.optimizers, "FusedLAMB")  # mixprec's own package is untouched
    params = [nn.Parameter(torch.ones(2))]
    FusedAdam(params, lr=1e-3)
    # Each names the algorithm asked for (LANS is not LAMB). (O05)
    # Apex's LAMB clipped the global norm itself (BERT clips nothing else): the LAMBs say so.
    for cls, use in ((FusedLAMB, "no LAMB.*FusedAdam.*max_grad_norm.*clip_grad_norm_"),
                     (FusedNovoGrad, "no NovoGrad"),
                     (FusedLANS, "no LANS optimizer"),
                     (FusedMixedPrecisionLamb, "no LAMB optimizer.*max_grad_norm"),
                     (FP16_Optimizer, r"amp.initialize\(.*O2")):
        with pytest.raises(NotImplementedError, match=f"apex.optimizers.{cls.__name__}.*{use}"):
            cls(params, lr=1e-3)


def test_apexs_fused_sgd_is_pytorchs_sgd(clean_apex):
    # Apex's FusedSGD (ImageNet-style scripts) builds and steps as torch.optim.SGD with the
    # same arguments, bit for bit, with Apex's signature: lr required, set_grad_none=False
    # zeroing the gradients, wd_after_momentum=True refused.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.optimizers import FusedSGD

    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedSGD(ours, 0.1, 0.9, 0.1, 1e-2, False)  # Apex's positional order
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2)
    assert isinstance(opt, torch.optim.SGD)
    for _ in range(4):
        g = [torch.randn_like(p) for p in ours]
        for p, q, gi in zip(ours, ref, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        assert all(p.grad is not None and not p.grad.any() for p in ours)  # zeroed, kept
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    opt = FusedSGD(ours, lr=0.1, nesterov=True, momentum=0.9, set_grad_none=True)
    opt.zero_grad()
    assert all(p.grad is None for p in ours)
    # Copies keep Apex's attributes (PyTorch's __getstate__ dropped them, and the copy's
    # zero_grad() raised AttributeError: 'FusedSGD' object has no attribute 'set_grad_none').
    import copy
    import pickle

    for p in ours:
        p.grad = torch.ones_like(p)
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert copied.set_grad_none is True and copied.materialize_master_grads is True
        copied.zero_grad()
        assert all(p.grad is None for p in copied.param_groups[0]["params"])
    state = FusedSGD(ours, lr=0.1).__getstate__()
    del state["set_grad_none"], state["materialize_master_grads"]  # (pickled without them)
    bare = FusedSGD.__new__(FusedSGD)
    bare.__setstate__(state)
    assert bare.set_grad_none is False and bare.materialize_master_grads is True
    kept = FusedSGD(ours, lr=0.1, materialize_master_grads=False)  # (kept as passed, O03)
    assert kept.materialize_master_grads is False
    assert copy.deepcopy(kept).materialize_master_grads is False
    with pytest.raises(TypeError, match="lr is required"):
        FusedSGD(ours)
    with pytest.raises(TypeError, match="lr is required"):
        FusedSGD([])  # (no group to read one from: not an IndexError, O01)
    # Apex's lr=required is met by an lr in every group (Apex's own FusedSGD test builds it
    # so): it was refused. A group added later without one is refused, as in Apex.
    groups = FusedSGD([{"params": ours[:1], "lr": 0.25}, {"params": ours[1:], "lr": 0.5}],
                      momentum=0.125)
    ref_groups = torch.optim.SGD([{"params": ref[:1], "lr": 0.25},
                                  {"params": ref[1:], "lr": 0.5}], momentum=0.125)
    for p, q in zip(ours, ref):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    groups.step()
    ref_groups.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        groups.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    with pytest.raises(TypeError, match="lr is required.*give every parameter group its own"):
        FusedSGD([{"params": ours[:1], "lr": 0.25}, {"params": ours[1:]}])
    with pytest.raises(ValueError, match="wd_after_momentum=True.*not provided"):
        FusedSGD(ours, lr=0.1, weight_decay=1e-4, wd_after_momentum=True)


def test_to_python_float_returns_a_python_number_for_any_one_element_tensor(clean_apex):
    # Apex's to_python_float is t.item() for every tensor: a 1-D or 2-D one-element tensor
    # (a reduced loss kept as shape (1,), a metric of shape (1, 1)) gives a float, not a tensor.
    import torch

    mixprec.install_apex_alias()
    from apex.fp16_utils import to_python_float

    for t in (torch.tensor(2.5), torch.tensor([2.5]), torch.tensor([[2.5]], dtype=torch.half)):
        value = to_python_float(t)
        assert type(value) is float and value == 2.5, (t, value)
    assert to_python_float([3.0, 4.0]) == 3.0  # (a sequence: its first item)


def test_network_to_half_keeps_only_affine_batchnorm_in_fp32(clean_apex):
    # Apex's BN_convert_float casts back the BatchNorm layers with affine=True only; a
    # non-affine one (running statistics, no weights) stays half like the rest of the network.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import network_to_half

    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.BatchNorm1d(2, affine=False))
    network_to_half(net)
    assert net[0].weight.dtype == torch.float16
    assert net[1].weight.dtype == net[1].running_mean.dtype == torch.float32
    assert net[2].running_mean.dtype == net[2].running_var.dtype == torch.float16


def test_convert_module_casts_existing_gradients_too(clean_apex):
    # A parameter converted after a backward keeps a gradient of its own dtype (a gradient of
    # another dtype makes the next backward's accumulation or the optimizer step fail).
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import convert_module, convert_network

    for convert, dtype in ((convert_module, torch.float32), (convert_network, torch.float32),
                           (convert_module, torch.float64), (convert_network, torch.float64)):
        lin = nn.Linear(3, 2).to(dtype)  # (an fp64 model's gradients too, F13)
        lin(torch.randn(4, 3, dtype=dtype)).sum().backward()
        ref = lin.weight.grad.clone()
        convert(lin, torch.float16)
        assert lin.weight.dtype == lin.weight.grad.dtype == torch.float16
        assert lin.bias.grad.dtype == torch.float16
        torch.testing.assert_close(lin.weight.grad, ref.half(), rtol=0, atol=0)


def test_fp16_model_leaves_integer_and_non_tensor_inputs_alone(clean_apex):
    # FP16Model casts floating inputs to fp16; token ids (int64) must stay integers, or an
    # embedding (a language model) fails on half indices.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import FP16Model

    torch.manual_seed(0)
    emb = nn.Embedding(5, 3)
    ref = emb.weight.detach().clone()
    model = FP16Model(emb)
    tokens = torch.tensor([[0, 4, 2]])
    out = model(tokens)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out[0], ref[[0, 4, 2]].half(), rtol=0, atol=0)
    # Other positional arguments (a count, None for an optional mask) reach the network as
    # they are. (F01)
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, times, mask):
            assert mask is None and times == 3
            return self.lin(x) * times

    net = Scaled()
    ref_lin = nn.Linear(3, 2)
    ref_lin.load_state_dict(net.lin.state_dict())
    x = torch.randn(4, 3)
    out = FP16Model(net)(x, 3, None)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref_lin.half()(x.half()) * 3, rtol=0, atol=0)


def test_flat_master_comes_with_a_zero_gradient(clean_apex):
    # Apex's prep_param_lists(flat_master=True) gives the flat master a zero gradient of its
    # size (scripts accumulate into master.grad, or clip it, before the first copy).
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import prep_param_lists

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).half()
    _, (flat,) = prep_param_lists(model, flat_master=True)
    assert flat.grad is not None and flat.grad.shape == flat.shape == (11,)
    assert flat.grad.dtype == torch.float32 and not flat.grad.any()


def test_list_masters_of_fp32_parameters_are_copies(clean_apex):
    # One master per parameter, also for the fp32 ones (a BatchNorm after network_to_half):
    # a master sharing the parameter's memory would change the model at the master's step,
    # before master_params_to_model_params.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import network_to_half, prep_param_lists

    net = network_to_half(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    model_params, masters = prep_param_lists(net)
    assert [p.dtype for p in model_params] == [torch.float16] * 2 + [torch.float32] * 2
    for p, m in zip(model_params, masters):
        assert m.data_ptr() != p.data_ptr()
        before = p.detach().clone()
        with torch.no_grad():
            m.add_(1.0)
        assert torch.equal(p.detach(), before)


def test_a_parameter_without_gradient_clears_its_masters_stale_gradient(clean_apex):
    # A parameter the backward did not reach this step: its master's gradient becomes None
    # (the optimizer then skips it), not the previous step's gradient applied again.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import model_grads_to_master_grads, prep_param_lists

    model = nn.Linear(3, 2).half()
    model_params, masters = prep_param_lists(model)
    for p in model_params:
        p.grad = torch.ones_like(p)
    model_grads_to_master_grads(model_params, masters)
    assert all(m.grad is not None for m in masters)
    model_params[1].grad = None  # the next backward did not reach the bias
    model_grads_to_master_grads(model_params, masters)
    assert masters[0].grad is not None and masters[1].grad is None


def test_fused_sgd_zero_grad_follows_its_set_to_none_argument(clean_apex):
    # set_grad_none is only the default: zero_grad(set_to_none=...) as PyTorch's decides.
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.optimizers import FusedSGD

    p = nn.Parameter(torch.ones(2))
    for default, set_to_none in ((False, True), (True, False)):
        opt = FusedSGD([p], lr=0.1, set_grad_none=default)
        p.grad = torch.ones_like(p)
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()


def test_alias_metadata_answers_other_spellings_of_apex(clean_apex):
    # importlib.metadata passes the name as asked; distribution names compare normalised.
    import importlib.metadata

    mixprec.install_apex_alias()
    version = importlib.metadata.version("apex")
    assert version.startswith("0.1+mixprec.")
    assert importlib.metadata.version("Apex") == importlib.metadata.version("APEX") == version


def test_alias_drops_every_half_imported_apex_amp_submodule(clean_apex, tmp_path, monkeypatch):
    # Apex's own apex.amp.wrap (no mixprec module of that name) imported before the failing
    # line of its apex.amp: it must not stay in sys.modules under mixprec's apex.amp.
    _alias_over_an_apex_amp_failing_after("wrap", "WHO = 'apex.amp.wrap itself'\n",
                                          tmp_path, monkeypatch)
    import apex

    assert apex.amp is amp
    assert "apex.amp.wrap" not in sys.modules


def test_alias_reports_a_broken_apex_whatever_it_raises(clean_apex, tmp_path, monkeypatch):
    """A broken Apex build often fails with something other than an ImportError (a compiled
    extension that raises OSError on a missing libcudart, a RuntimeError from a CUDA check at
    import time): install_apex_alias still says what happened and what to do, as documented
    (RuntimeError carrying the error), rather than letting the raw error out of the launcher.
    (A04)"""
    _fake_apex(tmp_path, init="raise OSError('libcudart.so.11.0: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"fails to import \(OSError: libcudart.*uninstall"):
        mixprec.install_apex_alias()


def test_alias_replaces_an_apex_amp_failing_with_any_error(clean_apex, tmp_path, monkeypatch):
    """An old apex.amp on a newer PyTorch fails in more ways than a missing module (an
    attribute PyTorch removed, read at import time): whatever it raises, mixprec's amp serves
    as apex.amp, with a warning naming the error, as docs/migrating.md promises. (A23)"""
    package = _fake_apex(tmp_path, "optimizers", "parallel")
    (package / "amp").mkdir()
    (package / "amp" / "__init__.py").write_text(
        "import torch\nstring_classes = torch.no_such_attribute_removed_by_pytorch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"apex\.amp fails to import \(AttributeError.*"
                                         r"mixprec\.amp serves"):
        served = mixprec.install_apex_alias()
    assert "apex.amp" in served
    from apex import amp as apex_amp

    assert apex_amp is amp


def test_alias_installed_again_after_a_purge_keeps_one_metadata_finder(clean_apex):
    """A launcher and a sitecustomize.py may both install the alias, with the apex modules
    dropped from sys.modules in between (test harnesses, reloaders): importlib.metadata must
    still see one stand-in distribution, not one per install. (A07)"""
    import importlib.metadata

    mixprec.install_apex_alias()
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        del sys.modules[name]
    mixprec.install_apex_alias()
    finders = [f for f in sys.meta_path if type(f).__name__ == "_AliasDistributionFinder"]
    assert len(finders) == 1
    found = [d for d in importlib.metadata.distributions(name="apex")]
    assert len(found) == 1, found


def test_alias_stand_in_is_a_package_that_does_not_have_apex_contrib(clean_apex):
    """Libraries probe Apex's optional parts with importlib.util.find_spec("apex.contrib...")
    and take their fallback on None: under the stand-in (a package, as Apex is) such a probe
    answers None rather than raising "'apex' is not a package". (A09, A10)"""
    import importlib.util

    mixprec.install_apex_alias()
    assert importlib.util.find_spec("apex.contrib") is None
    assert importlib.util.find_spec("apex").submodule_search_locations is not None
    with pytest.raises(ModuleNotFoundError, match="apex.contrib"):
        __import__("apex.contrib")


def test_alias_serves_every_submodule_beside_an_apex_that_is_a_plain_module(
        clean_apex, tmp_path, monkeypatch):
    """An importable `apex` that is a single module, not a package (another project's apex.py
    on the path), has no submodules: the alias serves every one of them beside it, so
    `from apex.optimizers import FusedSGD` and `from apex import amp` work. (A27)"""
    (tmp_path / "apex.py").write_text("WHO = 'apex.py itself'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    served = mixprec.install_apex_alias()
    assert served == ("apex.amp", "apex.optimizers", "apex.parallel", "apex.normalization",
                      "apex.normalization.fused_layer_norm", "apex.fp16_utils",
                      "apex.multi_tensor_apply")
    import apex
    from apex.optimizers import FusedSGD

    assert apex.WHO == "apex.py itself" and apex.amp is amp
    assert FusedSGD is sys.modules["apex.optimizers"].FusedSGD


def test_alias_stand_in_is_listed_among_installed_distributions(clean_apex):
    """Tools that list what is installed (importlib.metadata.distributions(), which
    packages_distributions() and environment reports walk) see the stand-in Apex with the
    version that importlib.metadata.version("apex") reports. (A14)"""
    import importlib.metadata

    mixprec.install_apex_alias()
    versions = [d.version for d in importlib.metadata.distributions()
                if d.metadata["Name"] == "apex"]
    assert versions == [f"0.1+mixprec.{mixprec.__version__}"]


def test_every_apex_optimizer_module_path_imports_its_stand_in(clean_apex):
    """docs/migrating.md: Apex's optimizer names import from their own module paths too
    (`from apex.optimizers.fused_novograd import FusedNovoGrad`, ...), and each stand-in,
    built, raises NotImplementedError naming its replacement; FusedSGD is PyTorch's SGD.
    (A39, O12)"""
    import importlib

    import torch
    from torch import nn

    mixprec.install_apex_alias()
    import apex.optimizers

    paths = {"fused_sgd": "FusedSGD", "fused_lamb": "FusedLAMB",
             "fused_mixed_precision_lamb": "FusedMixedPrecisionLamb", "fused_lans": "FusedLANS",
             "fused_novograd": "FusedNovoGrad", "fused_adagrad": "FusedAdagrad",
             "fp16_optimizer": "FP16_Optimizer", "fused_adam": "FusedAdam"}
    params = [nn.Parameter(torch.ones(2))]
    for path, name in paths.items():
        module = importlib.import_module(f"apex.optimizers.{path}")
        cls = getattr(module, name)
        assert cls is getattr(apex.optimizers, name), path
        if name in ("FusedSGD", "FusedAdam"):
            continue
        with pytest.raises(NotImplementedError, match=rf"apex\.optimizers\.{name} \(of "
                                                      r"Apex's optimizers.*is not provided"):
            cls(params, lr=1e-3)
    with pytest.raises(NotImplementedError, match=r"torch\.optim\.Adagrad"):
        apex.optimizers.FusedAdagrad(params, lr=1e-3)


def test_apex_optimizers_star_import_gives_every_name(clean_apex):
    """`from apex.optimizers import *` (Apex-era trainers) gives FusedAdam, FusedSGD and the
    stand-ins. (O10)"""
    mixprec.install_apex_alias()
    namespace = {}
    exec("from apex.optimizers import *", namespace)  # noqa: S102
    for name in ("FusedAdam", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedAdagrad",
                 "FusedLANS", "FusedMixedPrecisionLamb", "FP16_Optimizer"):
        assert name in namespace, name


def _three_steps_alike(opt, ref_opt, ours, ref):
    """Three steps of ``opt`` over ``ours`` and ``ref_opt`` over ``ref`` on the same random
    gradients: the parameters must match bit for bit."""
    import torch

    for _ in range(3):
        for p, q in zip(ours, ref):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _fused_sgd_steps_as_pytorchs(**kwargs):
    """Three steps of apex.optimizers.FusedSGD and of torch.optim.SGD built with the same
    arguments, on the same gradients: the parameters must match bit for bit. Returns the
    FusedSGD."""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.optimizers import FusedSGD

    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedSGD(ours, lr=0.1, **kwargs)
    ref_opt = torch.optim.SGD(ref, lr=0.1, **kwargs)
    _three_steps_alike(opt, ref_opt, ours, ref)
    return opt


def test_fused_sgd_nesterov_steps_as_pytorchs(clean_apex):
    """FusedSGD(nesterov=True) is PyTorch's Nesterov SGD, bit for bit (ImageNet recipes pass
    it). (O04)"""
    _fused_sgd_steps_as_pytorchs(momentum=0.9, weight_decay=1e-2, nesterov=True)


def test_fused_sgd_defaults_are_plain_sgd(clean_apex):
    """FusedSGD(params, lr) with Apex's defaults is plain SGD: no momentum, dampening, weight
    decay or Nesterov, so a script passing only lr steps as torch.optim.SGD(params, lr), bit
    for bit. (O01)"""
    group = _fused_sgd_steps_as_pytorchs().param_groups[0]
    assert (group["momentum"], group["dampening"], group["weight_decay"],
            group["nesterov"]) == (0.0, 0.0, 0.0, False)


def test_fused_sgd_without_lr_takes_a_generator_of_groups(clean_apex):
    """FusedSGD's lr=required reads the groups to check each carries an lr; the groups may come
    as a generator (`FusedSGD(({"params": m.parameters(), "lr": lr} for m, lr in ...),
    momentum=0.9)`), which that check consumes: the optimizer must still get every group and
    step as torch.optim.SGD does on the same groups, bit for bit. (kills: the checked list not
    passed on, 'optimizer got an empty parameter list')"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.optimizers import FusedSGD

    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    lrs = (0.25, 0.5)
    opt = FusedSGD(({"params": [p], "lr": lr} for p, lr in zip(ours, lrs)), momentum=0.5)
    ref_opt = torch.optim.SGD([{"params": [q], "lr": lr} for q, lr in zip(ref, lrs)],
                              momentum=0.5)
    assert [g["lr"] for g in opt.param_groups] == list(lrs)
    _three_steps_alike(opt, ref_opt, ours, ref)


def test_noop_handle_wrapped_optimizer_steps_with_a_closure(clean_apex):
    """The optimizer returned by NoOpHandle.wrap_optimizer is the optimizer: step(closure)
    runs the closure and returns its loss (LBFGS-style loops, and scripts that log the value
    step returns), and attribute writes reach the optimizer. (H03, H04, H05)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex import amp as apex_amp

    torch.manual_seed(0)
    model, ref = nn.Linear(3, 1), nn.Linear(3, 1)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = apex_amp.init(enabled=False).wrap_optimizer(inner)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def closure_for(m, o):
        def closure():
            o.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            return loss
        return closure

    got = opt.step(closure_for(model, opt))
    want = ref_opt.step(closure_for(ref, ref_opt))
    assert got is not None and torch.equal(got, want)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    opt.custom_counter = 3
    assert inner.custom_counter == 3


def test_noop_handle_wrapped_optimizer_steps_one_whose_step_takes_no_closure(clean_apex):
    """The NoOpHandle wrapper's step() without a closure calls the optimizer's step() with no
    argument, so a hand-written optimizer whose `def step(self)` takes none still steps (the
    wrapper deliberately forwards a closure only when one is given). Checked against the plain update
    p -= lr * grad. (kills: step() always forwarding closure=None)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex import amp as apex_amp

    class PlainSGD(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self):  # (no closure argument)
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"])

    p = nn.Parameter(torch.ones(2))
    opt = apex_amp.init(enabled=False).wrap_optimizer(PlainSGD([p], lr=0.5))
    p.grad = torch.tensor([1.0, 2.0])
    assert opt.step() is None
    torch.testing.assert_close(p.detach(), torch.tensor([0.5, 0.0]), rtol=0, atol=0)


def test_noop_handle_wrapped_optimizer_scale_loss_yields_the_loss_itself(clean_apex):
    """The wrapped optimizer's own scale_loss (Apex's `with optimizer.scale_loss(loss) as
    scaled`) yields the loss as it is, so gradients are those of the plain loss. (H10)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex import amp as apex_amp

    model = nn.Linear(3, 1)
    opt = apex_amp.init(enabled=False).wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1))
    loss = model(torch.ones(2, 3)).sum()
    with opt.scale_loss(loss) as scaled:
        assert scaled is loss


def test_apex_loss_scaler_starts_at_init_scale_and_grows_after_scale_window(clean_apex):
    """The constructor's init_scale is the first dynamic scale, and scale_window clean steps
    (not one more or fewer) grow it by scale_factor, as Apex's constructor arguments say.
    (S01, S02)"""
    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0**8, scale_window=3)
    assert scaler.loss_scale() == 2.0**8 and scaler._scale_seq_len == 3
    scales = []
    for _ in range(6):
        scaler.clear_overflow_state()
        assert scaler.update_scale() is False
        scales.append(scaler.loss_scale())
    assert scales == [2.0**8, 2.0**8, 2.0**9, 2.0**9, 2.0**9, 2.0**10]


def test_apex_loss_scaler_starts_at_most_at_max_loss_scale(clean_apex):
    """Apex's dynamic scale started at min(max_loss_scale, init_scale): FP16_Optimizer-era
    configs passed init_scale=2**32, which skipped 8 more steps than Apex before the first
    update (r107D B1). mixprec's own LossScaler clamps the same way."""
    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    assert LossScaler("dynamic", init_scale=2.0**32).loss_scale() == 2.0**24
    assert LossScaler("dynamic", max_loss_scale=2.0**10).loss_scale() == 2.0**10
    assert LossScaler(2.0**30, max_loss_scale=2.0**10).loss_scale() == 2.0**30  # (static)
    assert mixprec.amp.LossScaler("dynamic", init_scale=2.0**32).loss_scale == 2.0**24


def test_an_apex_amp_scaler_pickled_by_apex_steps_after_loading(clean_apex, tmp_path):
    """Apex 2019+'s FP16_Optimizer put its apex.amp.scaler.LossScaler in checkpoints; through
    the alias it unpickles as mixprec's class without __init__, holding Apex's attributes
    only (_has_overflow a plain value, where a property reads the device flags here; no
    _scale_factor): reading _has_overflow, update_scale() and an overflowed step raised
    AttributeError (r107D B2). It now steps with Apex's policy from the saved state; a
    scaler mixprec pickled keeps its unread inf flag through the round trip."""
    import pickle

    import torch

    _save_an_apex_pickled_scaler(
        tmp_path / "old.pt", {}, cls_name="LossScaler", module="apex.amp.scaler", dynamic=True,
        _loss_scale=1024.0, _max_loss_scale=2.0**24, _min_loss_scale=None, _scale_seq_len=2,
        _unskipped=1, _has_overflow=False, _overflow_buf=torch.IntTensor([0]))
    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    loaded = _load(tmp_path / "old.pt")["optimizer"]["loss_scaler"]
    assert type(loaded) is LossScaler and loaded._has_overflow is False
    seen = []
    for grad in (1.0, float("inf"), 1.0, 1.0):
        loaded.clear_overflow_state()
        master = torch.empty(1)
        loaded.unscale([torch.tensor([grad])], [master], None)
        seen.append((loaded.update_scale(), loaded.loss_scale(), loaded._unskipped))
    # (The saved window's second clean step grows the scale; the inf halves it and restarts
    # the count, which two clean steps complete again.)
    assert seen == [(False, 2048.0, 0), (True, 1024.0, 0), (False, 1024.0, 1),
                    (False, 2048.0, 0)], seen

    ours = LossScaler("dynamic", init_scale=8.0)
    ours.clear_overflow_state()
    ours.unscale([torch.tensor([float("inf")])], [torch.empty(1)], None)  # (flag unread)
    again = pickle.loads(pickle.dumps(ours))
    assert again.update_scale() is True and again.loss_scale() == 4.0


def test_apex_loss_scaler_forgets_an_unread_overflow_when_cleared(clean_apex):
    """clear_overflow_state() starts a step afresh: an inf seen by an abandoned step (unscaled,
    then the step dropped before update_scale) must not skip the next, clean step. (S05, S06)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0**4)
    scaler.clear_overflow_state()
    scaler.unscale([torch.tensor([float("inf")])], [torch.zeros(1)], None)
    scaler.clear_overflow_state()  # the step is abandoned
    out = torch.zeros(1)
    scaler.unscale([torch.tensor([32.0])], [out], None)
    assert scaler._has_overflow is False
    assert scaler.update_scale() is False and scaler.loss_scale() == 2.0**4
    assert out.tolist() == [2.0]
    # Writing the flag (an all-reduced value written back) also replaces unread checks.
    scaler.clear_overflow_state()
    scaler.unscale([torch.tensor([float("nan")])], [torch.zeros(1)], None)
    scaler._has_overflow = False
    assert scaler._has_overflow is False and scaler.update_scale() is False


def test_apex_loss_scaler_stashed_unscale_does_nothing_after_an_overflow(clean_apex):
    """Once a step has overflowed, unscale_with_stashed leaves the masters' gradients alone,
    like unscale (Apex's order): later micro-batches of a skipped step do not pile onto the
    kept gradients. (S34)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0)
    scaler.clear_overflow_state()
    scaler.unscale([torch.tensor([float("inf")])], [torch.zeros(1)], None)
    assert scaler._has_overflow is True
    kept = torch.full((1,), 3.0)
    scaler.unscale_with_stashed([torch.tensor([4.0])], [kept], [kept])
    assert kept.tolist() == [3.0]
    assert scaler.update_scale() is True


def test_apex_loss_scaler_at_scale_one_still_finds_overflows_in_place(clean_apex):
    """A dynamic scale backed off to 1 (min_loss_scale=1.0) keeps looking for inf/NaN, also
    when it unscales the masters' own gradients in place: only a static scale of 1 may skip
    the pass. (S09)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=1.0, min_loss_scale=1.0)
    scaler.clear_overflow_state()
    g = torch.tensor([1.0, float("inf")])
    scaler.unscale([g], [g], None, models_are_masters=True)
    assert scaler._has_overflow is True
    assert scaler.update_scale() is True and scaler.loss_scale() == 1.0


def test_apex_loss_scaler_static_scale_never_overflows(clean_apex):
    """A static scale neither looks for inf/NaN nor moves, as in Apex: _has_overflow stays
    False after unscaling an inf (Apex-era scripts branch on it), and an overflow written into
    it by hand does not make update_scale skip or back off. (S12, S16, S21)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    static = LossScaler(4.0)
    static.clear_overflow_state()
    static.unscale([torch.tensor([float("inf")])], [torch.zeros(1)], None)
    assert static._has_overflow is False
    out = torch.zeros(1)
    static.unscale_with_stashed([torch.tensor([float("inf")])], [torch.zeros(1)], [out])
    assert static._has_overflow is False and out.tolist() == [float("inf")]
    static._has_overflow = True
    assert static.update_scale() is False and static.loss_scale() == 4.0
    # Nor does it grow, however many clean steps pass (scale_window of them and more). (A06)
    static = LossScaler(4.0, scale_window=2)
    for _ in range(5):
        static.clear_overflow_state()
        assert static.update_scale() is False and static.loss_scale() == 4.0


def test_apex_loss_scaler_moves_by_its_scale_factor(clean_apex):
    """scale_factor sets both the back-off and the growth of the dynamic scale. (S28, S29)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0**10, scale_factor=4.0, scale_window=1)
    scaler.clear_overflow_state()
    scaler.unscale([torch.tensor([float("inf")])], [torch.zeros(1)], None)
    assert scaler.update_scale() is True and scaler.loss_scale() == 2.0**8
    scaler.clear_overflow_state()
    assert scaler.update_scale() is False and scaler.loss_scale() == 2.0**10


@pytest.mark.parametrize("bad", [0.0, float("nan")])
def test_apex_loss_scaler_refuses_scales_that_are_not_positive(clean_apex, bad):
    """A scale of 0 or NaN (a _loss_scale or scale_override set wrong, or computed from a
    NaN) would fill the masters with inf or NaN, which a dynamic scale then halves into NaN
    for good: unscale and unscale_with_stashed refuse it, naming the value, and leave the
    masters alone. (S07, S19, A01, A02)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic")
    g, m = torch.ones(2), torch.zeros(2)
    shown = re.escape(str(bad))
    with pytest.raises(ValueError, match=rf"scale to unscale by is {shown}; it must be > 0"):
        scaler.unscale([g], [m], None, scale_override=bad)
    for override in ((1.0, bad, 1.0), (bad, 1.0, 1.0)):  # (S03)
        with pytest.raises(ValueError, match=re.escape(f"scale_override={override}")
                           + r".*must be > 0"):
            scaler.unscale_with_stashed([g], [g], [m], scale_override=override)
    scaler._loss_scale = bad
    with pytest.raises(ValueError, match=rf"scale to unscale by is {shown}"):
        scaler.unscale([g], [m], None)
    with pytest.raises(ValueError, match=rf"scale to unscale by is {shown}"):
        scaler.unscale_with_stashed([g], [g], [m])
    assert m.tolist() == [0.0, 0.0]


def test_apex_loss_scaler_says_which_gradient_is_missing(clean_apex):
    """None entries: a parameter without a gradient in every list is skipped (its master is
    left alone); a master gradient missing where the model's is present, or one of the model
    and stashed gradients missing, is refused with a ValueError saying what to pass, not an
    error from deep inside a foreach kernel. (S10, S13, S14)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler(2.0)
    kept = torch.full((1,), 5.0)
    out = torch.zeros(1)
    scaler.unscale_with_stashed([None, torch.tensor([4.0])], [None, torch.tensor([1.0])],
                                [kept, out])
    assert kept.tolist() == [5.0] and out.tolist() == [3.0]
    with pytest.raises(ValueError, match="master gradient is None.*allocate it first"):
        scaler.unscale([torch.ones(1)], [None], None)
    for model_grad, stashed in ((torch.ones(1), None), (None, torch.ones(1))):
        with pytest.raises(ValueError, match="each entry needs its model, stashed and master"):
            scaler.unscale_with_stashed([model_grad], [stashed], [torch.zeros(1)])


def test_apex_loss_scaler_unscales_a_step_without_gradients(clean_apex):
    """A micro-batch that reached no parameter (all gradients None, or empty lists from a
    frozen model part) unscales nothing and raises nothing, in both unscale forms; the step
    then counts as clean. (S20)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic")
    kept = torch.full((2,), 3.0)
    scaler.clear_overflow_state()
    scaler.unscale([None], [kept], None)
    scaler.unscale_with_stashed([None], [None], [kept])
    scaler.unscale_with_stashed([], [], [])
    assert kept.tolist() == [3.0, 3.0]
    assert scaler.update_scale() is False


def test_convert_network_leaves_integer_parameters_and_buffers_alone(clean_apex):
    """convert_network / convert_module cast only floating tensors, as module.half() does: a
    BatchNorm's num_batches_tracked stays int64 (a half counter stops at 2048) and integer
    parameters or buffers (position ids, index tables) keep their values. (F08, F09)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import convert_module, convert_network

    def make():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False))
        net[0].register_buffer("ids", torch.arange(3000))
        net[0].table = nn.Parameter(torch.arange(3000), requires_grad=False)
        return net

    ref = make().half()
    for convert, net in ((convert_network, make()), (convert_module, make()[0])):
        convert(net, torch.float16)
        got = dict(net.named_parameters()) | dict(net.named_buffers())
        for name, t in got.items():
            want = (dict(ref.named_parameters()) | dict(ref.named_buffers()))[
                name if convert is convert_network else f"0.{name}"]
            assert t.dtype == want.dtype and torch.equal(t, want), name


def test_model_grads_into_existing_master_grads_are_copies(clean_apex):
    """Where the masters already have gradients (zero_grad(set_to_none=False), Apex's era's
    default), model_grads_to_master_grads copies into them: the master gradient stays the same
    tensor (scripts hold it, e.g. for clipping) and, for an fp32 parameter, does not become the
    model's gradient, which zeroing the model's gradients before the master step would wipe.
    (F21)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import model_grads_to_master_grads, network_to_half, prep_param_lists

    net = network_to_half(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)))
    model_params, masters = prep_param_lists(net)
    for m in masters:
        m.grad = torch.zeros_like(m)
    held = [m.grad for m in masters]
    for p in model_params:
        p.grad = torch.full_like(p, 0.5)
    model_grads_to_master_grads(model_params, masters)
    net.zero_grad(set_to_none=False)
    for m, h in zip(masters, held):
        assert m.grad is h and bool((m.grad == 0.5).all()), m.grad


def test_master_params_to_model_params_writes_into_the_models_tensors(clean_apex):
    """The masters' values are copied into the model's existing storage (cuDNN's flattened RNN
    weights and any view of a parameter see them), flat or not. (F22)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import master_params_to_model_params, prep_param_lists

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)).half()
    view = model[0].weight.detach()[0]  # a view of the model's storage
    for flat in (False, True):
        model_params, masters = prep_param_lists(model, flat_master=flat)
        ptrs = [p.data_ptr() for p in model_params]
        with torch.no_grad():
            for m in masters:
                m.add_(1.0)
        master_params_to_model_params(model_params, masters, flat_master=flat)
        assert [p.data_ptr() for p in model_params] == ptrs
        assert torch.equal(view, model[0].weight.detach()[0])


def test_fp16_utils_master_helpers_take_generators(clean_apex):
    """The helpers take any iterables of parameters, as Apex's did (a generator such as
    model.parameters() was zipped directly): a generator is neither refused nor consumed
    before the copy. (F27, F28)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import (
        master_params_to_model_params,
        model_grads_to_master_grads,
        prep_param_lists,
    )

    model = nn.Linear(3, 2).half()
    model_params, masters = prep_param_lists(model)
    for p in model_params:
        p.grad = torch.full_like(p, 0.25)
    model_grads_to_master_grads(model.parameters(), iter(masters))
    for m in masters:
        assert m.grad is not None and bool((m.grad == 0.25).all())
    with torch.no_grad():
        for m in masters:
            m.fill_(2.0)
    master_params_to_model_params(model.parameters(), iter(masters))
    assert all(bool((p == 2.0).all()) for p in model.parameters())


@pytest.mark.parametrize("bias", [True, False])
def test_fp16_utils_hint_flat_masters_for_a_two_parameter_model(clean_apex, bias):
    """Flat masters passed without flat_master=True are recognised for any model (a single
    Linear with its bias, or one weight alone), and the error says to pass flat_master=True.
    (F26, F14)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import model_grads_to_master_grads, prep_param_lists

    model_params, flat = prep_param_lists(nn.Linear(3, 2, bias=bias), flat_master=True)
    for p in model_params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="need flat_master=True here too"):
        model_grads_to_master_grads(model_params, flat)


def test_multi_tensor_applier_keeps_apexs_chunk_size(clean_apex):
    """Apex-era code reads the chunk size off the applier (multi_tensor_applier.chunk_size,
    2048 * 32 in Apex) when it builds its own launches. (M03)"""
    mixprec.install_apex_alias()
    from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

    assert multi_tensor_applier.chunk_size == 2048 * 32
    assert MultiTensorApply(1024).chunk_size == 1024


def test_apex_loss_scaler_window_shortened_below_the_clean_steps_grows_next(clean_apex):
    """A script that shortens _scale_seq_len below the clean steps already counted gets a
    scale that grows at the next clean step, then every window, as mixprec.amp's own scaler
    (test_apex_private); with Apex's exact-count test it never grew again until an
    overflow."""
    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=4.0)
    for _ in range(5):
        scaler.clear_overflow_state()
        scaler.update_scale()
    scaler._scale_seq_len = 3
    scales = []
    for _ in range(4):
        scaler.clear_overflow_state()
        assert scaler.update_scale() is False
        scales.append(scaler.loss_scale())
    assert scales == [8.0, 8.0, 8.0, 16.0]


def test_fp16_utils_masters_are_trainable_leaf_parameters(clean_apex):
    """prep_param_lists gives masters that are leaf nn.Parameters with requires_grad=True, flat
    or not, as Apex's were: scripts hand them to any optimizer and build terms on them (a
    penalty on the fp32 weights) whose backward must reach the masters. (F05, F06)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import prep_param_lists

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).half()
    for flat in (False, True):
        _, masters = prep_param_lists(model, flat_master=flat)
        for m in masters:
            assert isinstance(m, nn.Parameter) and m.is_leaf and m.requires_grad, flat
        grads = torch.autograd.grad(sum(m.pow(2).sum() for m in masters), masters)
        for g, m in zip(grads, masters):
            torch.testing.assert_close(g, 2 * m.detach(), rtol=0, atol=0)


def test_fp16_utils_refusals_shorten_long_lists(clean_apex):
    """The refusals of model_grads_to_master_grads show at most four entries and say how many
    more there are (and that the master list goes on), so a user with a large model learns how
    many parameters lack a gradient and that more masters were passed than shown. (F07, F08)"""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import model_grads_to_master_grads, prep_param_lists

    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])  # 6 parameters
    model_params, flat = prep_param_lists(model, flat_master=True)
    _, masters = prep_param_lists(model)
    with pytest.raises(ValueError, match=r"model_params \[0\] \(2, 2\), \[1\] \(2,\), "
                                         r"\[2\] \(2, 2\), \[3\] \(2,\) and 2 more have no "
                                         r"gradient"):
        model_grads_to_master_grads(model_params, flat, flat_master=True)
    for p in model_params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"got 6 tensor\(s\) of shape\(s\) \[\(2, 2\), "
                                         r"\(2,\), \(2, 2\), \(2,\)\] \.\.\. with 18 elements"):
        model_grads_to_master_grads(model_params, masters, flat_master=True)
    with pytest.raises(ValueError, match=r"got 4 tensor\(s\) of shape\(s\) \[\(2, 2\), "
                                         r"\(2,\), \(2, 2\), \(2,\)\] with 12 elements"):
        model_grads_to_master_grads(model_params, masters[:4], flat_master=True)
    with pytest.raises(ValueError, match=r"got 5 tensor\(s\) of shape\(s\) \[\(2, 2\), "
                                         r"\(2,\), \(2, 2\), \(2,\)\] \.\.\. with 16 "
                                         r"elements"):
        model_grads_to_master_grads(model_params, masters[:5], flat_master=True)


def test_apex_loss_scaler_keeps_an_overflow_seen_by_an_earlier_micro_batch(clean_apex):
    """An inf/NaN found by any unscale of the step (unscale or unscale_with_stashed), read
    or not, skips the step, even when later micro-batches of the same step are clean: the
    overflow is the union of the step's checks, as Apex's sticky flag was. (S02, S05, S06)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    for first in ("unscale", "stashed"):
        scaler = LossScaler("dynamic", init_scale=2.0**4)
        scaler.clear_overflow_state()
        master = torch.zeros(2)
        bad = [torch.tensor([1.0, float("inf")])]
        if first == "unscale":
            scaler.unscale(bad, [master], None)
        else:
            scaler.unscale_with_stashed(bad, [torch.zeros(2)], [master])
        # The flag is not read yet: the next micro-batches still run their checks.
        scaler.unscale([torch.ones(2)], [torch.zeros(2)], None)
        scaler.unscale_with_stashed([torch.ones(2)], [torch.zeros(2)], [torch.zeros(2)])
        assert scaler._has_overflow is True, first
        assert scaler.update_scale() is True and scaler.loss_scale() == 2.0**3, first


def test_apex_loss_scaler_honours_its_bounds_from_the_constructor(clean_apex):
    """min_loss_scale and max_loss_scale passed to the constructor bound the dynamic scale,
    whatever their size (a floor of 2**10 kept by long fp16 runs, a ceiling below the
    start). (S04, S07)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0**11, min_loss_scale=2.0**10,
                        max_loss_scale=2.0**12, scale_window=1)
    assert scaler._min_loss_scale == 2.0**10 and scaler._max_loss_scale == 2.0**12
    scales = []
    for overflow in (True, True, False, False, False):
        scaler.clear_overflow_state()
        value = float("inf") if overflow else 1.0
        scaler.unscale([torch.tensor([value])], [torch.zeros(1)], None)
        assert scaler.update_scale() is overflow
        scales.append(scaler.loss_scale())
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**12, 2.0**12]


def test_apex_loss_scaler_overflow_restarts_the_growth_window(clean_apex):
    """An overflow starts the clean-step count over: after clean steps and an overflow, the
    scale grows only after a full scale_window of new clean steps. (S11)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0**8, scale_window=3)
    scales = []
    for overflow in (False, False, True, False, False, False):
        scaler.clear_overflow_state()
        value = float("nan") if overflow else 1.0
        scaler.unscale([torch.tensor([value])], [torch.zeros(1)], None)
        scaler.update_scale()
        scales.append((scaler.loss_scale(), scaler._unskipped))
    assert scales == [(2.0**8, 1), (2.0**8, 2), (2.0**7, 0), (2.0**7, 1), (2.0**7, 2),
                      (2.0**8, 0)]


def test_apex_loss_scaler_static_scale_of_one_still_fills_separate_masters(clean_apex):
    """A static scale of 1 (a bf16 or fp32 run kept on Apex's scaler) has nothing to divide,
    but unscale still copies the model's gradients into separate master gradients, fp16 into
    fp32, exactly: only the masters' own gradients, unscaled in place, may be left as they
    are. (A03)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler(1.0)
    half = [torch.tensor([0.5, -3.0]).half(), torch.tensor([2.0**-20]).half()]
    masters = [torch.zeros(2), torch.zeros(1)]
    scaler.unscale(half, masters, None)
    for got, want in zip(masters, half):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    own = torch.tensor([4.0, float("inf")])
    scaler.unscale([own], [own], None, models_are_masters=True)
    assert own.tolist() == [4.0, float("inf")]
    assert scaler.update_scale() is False and scaler.loss_scale() == 1.0


def test_apex_loss_scaler_stashed_unscale_refuses_lists_of_other_lengths(clean_apex):
    """unscale_with_stashed takes one entry per parameter in each of its three lists; lists of
    other lengths (a parameter group left out of one) are refused, naming each length, and
    nothing is written, where zipping them would leave some masters' gradients stale.
    (A05)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0)
    kept = [torch.ones(2), torch.ones(2)]
    with pytest.raises(ValueError, match=r"unscale_with_stashed: the gradient lists differ in "
                                         r"length \(model_grads=2, stashed_master_grads=2, "
                                         r"master_grads=1\)"):
        scaler.unscale_with_stashed([torch.ones(2), torch.ones(2)], kept, kept[:1])
    with pytest.raises(ValueError, match=r"model_grads=1, stashed_master_grads=2, "
                                         r"master_grads=2"):
        scaler.unscale_with_stashed([torch.ones(2)], kept, kept)
    assert [k.tolist() for k in kept] == [[1.0, 1.0], [1.0, 1.0]]


def test_apex_loss_scaler_overflow_written_back_reads_as_a_bool(clean_apex):
    """Multi-rank scripts write the all-reduced overflow back as their reduction gave it (an
    int from .item(), a 0-dim tensor): _has_overflow reads back True or False, and
    update_scale returns True or False, as documented. (A10)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=2.0**4)
    for written, want in ((1, True), (torch.tensor(1.0), True), (0, False),
                          (torch.tensor(0), False)):
        scaler.clear_overflow_state()
        scaler._has_overflow = written
        assert scaler._has_overflow is want
        assert scaler.update_scale() is want
    assert scaler.loss_scale() == 2.0**2


def test_apex_loss_scaler_unscale_ignores_its_third_argument(clean_apex):
    """unscale's third argument is ignored, as in Apex (Apex-era wrappers pass a scale there,
    at times a stale one): the gradients are divided by scale_override where given, else by
    the current loss_scale(). (A11)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=8.0)
    out = torch.zeros(1)
    scaler.unscale([torch.tensor([16.0])], [out], 1.0)
    assert out.tolist() == [2.0]
    scaler.unscale([torch.tensor([16.0])], [out], 2.0, scale_override=4.0)
    assert out.tolist() == [4.0]


def test_apex_loss_scaler_writes_into_the_master_gradients_passed(clean_apex):
    """Both unscale forms write into the master gradients passed, in place: Apex-era fp16
    optimizers keep their master gradients as views of one flat fp32 buffer (all-reduced or
    clipped as one tensor afterwards), which must hold the result. (A15)"""
    import torch

    mixprec.install_apex_alias()
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic", init_scale=4.0)
    flat = torch.zeros(5)
    views = [flat[:2], flat[2:]]
    scaler.unscale([torch.tensor([4.0, 8.0]).half(), torch.tensor([12.0, -4.0, 0.0]).half()],
                   views, None)
    assert flat.tolist() == [1.0, 2.0, 3.0, -1.0, 0.0]
    scaler.unscale_with_stashed([torch.full((2,), 4.0).half(), torch.full((3,), 4.0).half()],
                                views, views)
    assert flat.tolist() == [2.0, 3.0, 4.0, 0.0, 1.0]
    assert scaler.update_scale() is False


def test_alias_drops_nested_modules_a_failed_apex_amp_left_behind(clean_apex, tmp_path,
                                                                  monkeypatch):
    """Apex's amp imported its subpackage apex.amp.lists (its override tables) before the line
    that fails on a newer PyTorch: every module under apex.amp, nested ones too, is dropped
    when mixprec's amp replaces it. (A06)"""
    package = _fake_apex(tmp_path, "optimizers")
    (package / "amp" / "lists").mkdir(parents=True)
    (package / "amp" / "lists" / "__init__.py").write_text("")
    (package / "amp" / "lists" / "torch_overrides.py").write_text("FP16_FUNCS = []\n")
    (package / "amp" / "__init__.py").write_text(
        "from .lists import torch_overrides\nfrom torch._six import string_classes\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="apex.amp fails to import"):
        mixprec.install_apex_alias()
    import apex

    assert apex.amp is amp
    assert not [name for name in sys.modules if name.startswith("apex.amp.lists")]


def test_fp16_utils_refuse_a_flat_master_of_another_size(clean_apex):
    """A flat master made for another model (one 1-D tensor, but not holding exactly the
    model's elements) is refused with flat_master=True by both copies, saying how many
    elements were expected and passed, instead of copying part of it or failing in copy_.
    Without flat_master=True the error does not suggest passing it, since that would not
    help."""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import (
        master_params_to_model_params,
        model_grads_to_master_grads,
        prep_param_lists,
    )

    model_params, _ = prep_param_lists(nn.Linear(3, 2))  # 8 elements
    _, other = prep_param_lists(nn.Linear(3, 3), flat_master=True)  # 12 elements
    for p in model_params:
        p.grad = torch.ones_like(p)
    for fn in (model_grads_to_master_grads, master_params_to_model_params):
        with pytest.raises(ValueError, match=r"holding all 8 elements of the 2 model_params "
                                             r"in one 1-D tensor; got 1 tensor\(s\) of "
                                             r"shape\(s\) \[\(12,\)\] with 12 elements"):
            fn(model_params, other, flat_master=True)
        with pytest.raises(ValueError, match=r"master_params\[0\] has shape \(12,\), "
                                             r"model_params\[0\] \(2, 3\)") as err:
            fn(model_params, other)
        assert "flat_master=True" not in str(err.value)


def test_fp16_utils_refuse_masters_of_the_same_size_but_another_shape(clean_apex):
    """Masters are matched by shape, not by element count: a transposed master, or a (1, n)
    one for an (n,) bias that copy_ would broadcast silently, is refused, and the message
    names the first mismatching pair."""
    import torch
    from torch import nn

    mixprec.install_apex_alias()
    from apex.fp16_utils import (
        master_params_to_model_params,
        model_grads_to_master_grads,
        prep_param_lists,
    )

    model_params, masters = prep_param_lists(nn.Linear(3, 2))  # (2, 3) weight, (2,) bias
    for p in model_params:
        p.grad = torch.ones_like(p)
    bias_row = [masters[0], nn.Parameter(masters[1].detach().reshape(1, 2))]
    transposed = [nn.Parameter(m.detach().t().clone()) for m in masters]
    for fn in (model_grads_to_master_grads, master_params_to_model_params):
        with pytest.raises(ValueError, match=r"master_params\[1\] has shape \(1, 2\), "
                                             r"model_params\[1\] \(2,\)"):
            fn(model_params, bias_row)
        with pytest.raises(ValueError, match=r"master_params\[0\] has shape \(3, 2\), "
                                             r"model_params\[0\] \(2, 3\)"):
            fn(model_params, [transposed[0], bias_row[1]])


def test_fp16_utils_clip_grad_norm_is_pytorchs_current_clipper(clean_apex):
    """``clip_grad_norm`` (Apex's name) clips as ``torch.nn.utils.clip_grad_norm_`` does,
    returning the same total norm, and warns about nothing: Apex-era scripts call it every
    step, so a deprecation warning would repeat throughout training."""
    import warnings

    import torch

    mixprec.install_apex_alias()
    from apex.fp16_utils import clip_grad_norm

    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]])]
    ours = [torch.zeros(2, requires_grad=True), torch.zeros(1, 1, requires_grad=True)]
    ref = [torch.zeros(2, requires_grad=True), torch.zeros(1, 1, requires_grad=True)]
    for params in (ours, ref):
        for p, g in zip(params, grads):
            p.grad = g.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm = clip_grad_norm(ours, max_norm=1.0)
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
    assert float(norm) == float(want) == 13.0
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_gradscaler_kept_around_scale_loss_is_refused(fused):
    """A script ported from torch.amp that keeps its GradScaler around amp.scale_loss
    (`scale_loss(scaler.scale(loss), opt)`, then `scaler.step(opt)`) scaled twice: in fp16 the
    steps overflowed more and were lost, and both scales settled lower, silently (r104B R1: 7
    of 30 steps lost, both scales at 512); with a fused optimizer the two handed it conflicting
    flags ("'Adam' object has no attribute 'grad_scale'"). The first step the GradScaler runs
    is refused, naming the fix (GradScaler.step calls a fused optimizer's step itself, a
    foreach one's through _maybe_opt_step: both are seen). A plain optimizer.step() after the
    block, and a disabled GradScaler (GradScaler(enabled=use_amp) left off), run as before."""
    import torch
    from torch import nn

    def run(scaler):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)
        model, opt = amp.initialize(model, opt, opt_level="O1", dtype=torch.float16,
                                    verbosity=0)
        for _ in range(30):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
            with amp.scale_loss(scaler.scale(loss) if scaler else loss, opt) as scaled:
                scaled.backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
        return model

    with pytest.raises(RuntimeError, match=r"GradScaler\.step\(\) was called on the Adam that "
                                           r"amp\.initialize prepared: .* Drop scaler\.scale\(\), "
                                           r"scaler\.step\(\) and scaler\.update\(\)"):
        run(torch.amp.GradScaler("cpu"))
    plain = run(None)
    off = run(torch.amp.GradScaler("cpu", enabled=False))
    for p, q in zip(plain.parameters(), off.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
