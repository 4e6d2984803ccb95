"""The docs, run: README.md's and docs/migrating.md's python blocks that run on a CPU (with the
names they leave to the reader filled in and ``.cuda()`` dropped), the doctests of a few
modules, the README's opt-level and ``mixprec bench`` flag tables against the code, and the
repository paths the docs name. The scripts in docs/examples run in tests/amp/test_migration.py;
the README's data-parallel example needs torchrun (tests/parallel run its pieces).
"""

import doctest
import importlib
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/migrating.md", "docs/amp.md", "docs/parallel.md"]
RUNNABLE_DOCS = ["README.md", "docs/migrating.md"]  # the docs with python blocks


def _python_blocks(md):
    text = (ROOT / md).read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _block(md, marker):
    found = [b for b in _python_blocks(md) if marker in b]
    assert len(found) == 1, f"{md}: {len(found)} python blocks contain {marker!r}"
    return found[0]


def _on_cpu(code):
    return re.sub(r"\.cuda\((?:non_blocking=True)?\)", "", code)


def _is_side_by_side(code):
    # "# before   # after" comparisons: two columns of code, not one program.
    return re.match(r"#\s*before\b.*#\s*after\b", code.splitlines()[0]) is not None


@pytest.mark.parametrize("md", RUNNABLE_DOCS)
def test_python_blocks_are_valid_python(md):
    blocks = _python_blocks(md)
    assert blocks
    for code in blocks:
        if not _is_side_by_side(code):
            compile(code, md, "exec")  # GPU-only blocks included: at least they parse


class _Net(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def test_readme_amp_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    loader = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
    ns = {"Net": _Net, "loader": loader}
    exec(_on_cpu(_block("README.md", '"checkpoint.pt")')), ns)
    model = ns["model"]
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    weight = ckpt["model"]["0.weight"]
    # "fp32: the master weights": true fp32 values, of which the model holds the bf16 cast.
    assert weight.dtype == torch.float32
    assert not torch.equal(weight, weight.bfloat16().float())
    assert torch.equal(model[0].weight, weight.bfloat16())
    _Net().load_state_dict(ckpt["model"])  # strict: a plain fp32 model takes it
    assert ckpt["amp"] == {"loss_scaler0": {"loss_scale": 1.0, "unskipped": len(loader)}}


def test_readme_opt_level_table_matches_the_properties():
    from mixprec.amp._properties import resolve_properties

    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (O[0-3]) \| ([^|]*) \| ([^|]*) \| (yes|no) \| (\S+) / (\S+) \|$",
                      text, flags=re.M)
    assert [r[0] for r in rows] == ["O0", "O1", "O2", "O3"]
    for level, params, casting, masters, fp16_scale, bf16_scale in rows:
        for dtype, scale in ((torch.float16, fp16_scale), (torch.bfloat16, bf16_scale)):
            p = resolve_properties(level, dtype=dtype)
            assert p.model_is_half == params.startswith("half"), (level, params)
            assert bool(p.keep_batchnorm_fp32) == ("BatchNorm fp32" in params), (level, params)
            assert p.patch_torch_functions == casting.startswith("`torch.autocast`"), level
            assert p.master_weights == (masters == "yes"), level
            assert p.loss_scale == (scale if scale == "dynamic" else float(scale)), (level, dtype)


def _bench_parser():
    from mixprec.bench.cli import build_parser

    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.choices and "bench" in a.choices]
    return commands.choices["bench"]


def test_readme_bench_flag_table_matches_the_cli():
    text = (ROOT / "README.md").read_text()
    section = text.split("## The main job")[1].split("\n## ")[0]
    first_cells = [line.split(" | ")[0] for line in section.splitlines()
                   if line.startswith("| `-")]
    documented = {}
    for cell in first_cells:
        for flag, choices in re.findall(r"`(--?[a-z][\w-]*)(?: \{([\w,]+)\})?", cell):
            documented[flag] = choices
        for flag in re.findall(r"/ `?(--[a-z][\w-]*)", cell):  # `--native / --no-native`
            documented.setdefault(flag, "")
    actions = [a for a in _bench_parser()._actions if "-h" not in a.option_strings]
    for action in actions:
        named = [s for s in action.option_strings if s in documented]
        assert named, f"README's flag table lacks {action.option_strings}"
        if action.choices and documented[named[0]]:
            assert documented[named[0]].split(",") == list(action.choices), named[0]
    known = {s for a in actions for s in a.option_strings}
    assert set(documented) <= known, set(documented) - known


def test_readme_normalization_example():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4096)
    ns = {"x": x}
    exec(_on_cpu(_block("README.md", "memory_efficient=True)")), ns)
    expected = F.layer_norm(x, (4096,), eps=1e-5)
    torch.testing.assert_close(ns["y"], expected)
    torch.testing.assert_close(ns["norm"](x), expected)  # the memory_efficient one


def test_readme_fused_adam_example():
    from mixprec import amp
    from mixprec.optimizers import FusedAdam

    torch.manual_seed(0)
    ns = {"model": _Net()}
    exec(_block("README.md", "FusedAdam(model.parameters()"), ns)
    model, optimizer = ns["model"], ns["optimizer"]
    assert isinstance(optimizer, FusedAdam) and model[0].weight.dtype == torch.bfloat16
    loss = F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    master = next(iter(amp.master_params(optimizer)))
    assert master.dtype == torch.float32 and torch.equal(model[0].weight, master.bfloat16())
    assert optimizer.param_groups[0]["weight_decay"] == 0.1


def test_migrating_alias_example(clean_apex):
    import mixprec.amp

    exec(_block("docs/migrating.md", "mixprec.install_apex_alias()"), {})
    apex_amp = importlib.import_module("apex.amp")
    assert apex_amp is mixprec.amp


def test_migrating_private_state_example():
    from mixprec import amp

    def make():
        torch.manual_seed(0)
        model = _Net()
        return amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              opt_level="O2", verbosity=0)  # fp16: a dynamic scale

    model, optimizer = make()
    for p in amp.master_params(optimizer):
        p.data.add_(0.5)
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "master params": [p.detach().clone() for p in amp.master_params(optimizer)]}
    model, optimizer = make()  # the most recent initialize: the one amp._amp_state shows
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    ns = {"amp": amp, "model": model, "optimizer": optimizer, "scheduler": scheduler,
          "global_step": 0, "checkpoint": checkpoint}
    exec(_block("docs/migrating.md", "_lazy_init_maybe_master_weights()"), ns)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**20, "unskipped": 0}
    assert scheduler.last_epoch == 0  # no step taken yet: _unskipped is 0
    assert ns["global_step"] == 1  # and none overflowed
    for param, saved in zip(amp.master_params(optimizer), checkpoint["master params"]):
        assert torch.equal(param, saved)
    # The restored masters hold through the first step (lr 0: the step changes nothing;
    # without the model's load the step replaced them by the model's values).
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    with amp.scale_loss(model(torch.randn(2, 16)).float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    for param, saved in zip(amp.master_params(optimizer), checkpoint["master params"]):
        assert torch.equal(param, saved)


# Docstring examples that run on a CPU in well under a second each. run_mode/run_modes of
# mixprec.bench.runner are left out for time (tests/bench runs them).
_DOCTEST_MODULES = ["mixprec.normalization.reference", "mixprec.amp.scaler",
                    "mixprec.bench.models", "mixprec.bench.cli", "mixprec.bench.runner"]
_SLOW_DOCTESTS = {"mixprec.bench.runner.run_mode", "mixprec.bench.runner.run_modes"}


def _doctests():
    tests = []
    for name in _DOCTEST_MODULES:
        module = importlib.import_module(name)
        for test in doctest.DocTestFinder().find(module, name):
            if test.examples and test.name not in _SLOW_DOCTESTS:
                tests.append(test)
    return tests


@pytest.mark.parametrize("test", _doctests(), ids=lambda t: t.name)
def test_docstring_examples(test):
    test.globs.setdefault("torch", torch)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test, out=lambda s: None)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{test.name}: {result.failed} of {result.attempted} failed " \
                               f"(run python -m doctest on {test.filename} to see them)"


def test_install_apex_alias_docstring(clean_apex):
    import mixprec._apex_alias as alias

    (test,) = [t for t in doctest.DocTestFinder().find(alias) if t.examples]
    runner = doctest.DocTestRunner()
    runner.run(test, out=lambda s: None)
    assert runner.summarize(verbose=False).failed == 0


def _anchors(text):
    """The anchors GitHub gives the markdown ``text``'s headings: lower case, punctuation but
    hyphens dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("md", DOCS)
def test_named_paths_exist(md):
    path = ROOT / md
    text = path.read_text()
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    for target in links:
        file, _, anchor = target.partition("#")
        linked = path.parent / file if file else path  # ("#heading": this file's)
        assert linked.exists(), f"{md}: broken link {target}"
        if anchor:
            assert anchor in _anchors(linked.read_text()), (
                f"{md}: link {target}: no heading of {linked.name} has the anchor {anchor!r}")
    named = re.findall(r"`((?:\.ci|benchmarks|tests|mixprec|docs)/[\w/.\-]+)`", text)
    for target in named:
        assert (ROOT / target).exists(), f"{md}: names {target}, which does not exist"


@pytest.mark.parametrize("md", DOCS + ["benchmarks/RESULTS.md"])
def test_headings_start_their_own_line(md):
    # (r99D U1) "takes it). ## What stays half, or is refused": a heading joined onto the
    # line before renders as text, so its section reads as part of the one above.
    text = re.sub(r"^```.*?^```", "", (ROOT / md).read_text(), flags=re.S | re.M)
    glued = [line for line in text.splitlines()
             if re.search(r"\S\s+#{2,6} [A-Z`]", line) and not line.lstrip().startswith("#")]
    assert not glued, f"{md}: a heading inside a line: {glued}"
