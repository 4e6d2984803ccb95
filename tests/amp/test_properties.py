import pytest
import torch

from mixprec import amp
from mixprec.amp._properties import OPT_LEVELS, resolve_properties

from .helpers import batch, make_cnn


# (A longer string, "O12", is another mistake: the allowed levels only, no guess at the
# level meant; r65B's P02.)
@pytest.mark.parametrize("bad", ["02", "o2", "O4", "o0", "", "O12", "o01", "0123"])
def test_bad_opt_level_names_valid_levels(bad):
    with pytest.raises(ValueError) as info:
        resolve_properties(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    assert '"O0", "O1", "O2", "O3"' in msg
    if bad in ("02", "o2", "o0"):
        assert "letter O" in msg
    if len(bad) > 2:
        assert msg.endswith('unknown opt_level. Allowed: "O0", "O1", "O2", "O3".'), msg


@pytest.mark.parametrize("bad, meant", [("02", "O2"), ("o3", "O3"), ("00", "O0")])
def test_a_zero_or_lower_case_prefix_is_answered_with_the_level_meant(bad, meant):
    # The level meant, its digit kept, spelled out: the fix is a copy from the message.
    with pytest.raises(ValueError, match=rf'opt_level={bad!r}\): unknown opt_level.*'
                                         rf'Did you mean "{meant}"\? The prefix is the capital'):
        resolve_properties(bad)


def test_opt_level_must_be_str():
    with pytest.raises(TypeError, match="opt_level must be a string"):
        resolve_properties(2)


def test_apex_defaults_fp16():
    o0, o1, o2, o3 = (resolve_properties(k) for k in ("O0", "O1", "O2", "O3"))
    assert (o0.cast_model_type, o0.master_weights, o0.loss_scale) == (torch.float32, False, 1.0)
    assert (o1.cast_model_type, o1.patch_torch_functions, o1.loss_scale) == (None, True, "dynamic")
    assert (o2.cast_model_type, o2.keep_batchnorm_fp32, o2.master_weights, o2.loss_scale) == (
        torch.float16, True, True, "dynamic")
    assert (o3.cast_model_type, o3.keep_batchnorm_fp32, o3.loss_scale) == (torch.float16, False, 1.0)
    assert set(OPT_LEVELS) == {"O0", "O1", "O2", "O3"}


def test_bf16_defaults_to_static_scale_but_dynamic_allowed():
    p = resolve_properties("O2", dtype=torch.bfloat16)
    assert p.cast_model_type == torch.bfloat16 and p.loss_scale == 1.0
    assert resolve_properties("O2", dtype=torch.bfloat16, loss_scale="dynamic").dynamic_loss_scale
    # cast_model_type=bf16 selects bf16 too
    q = resolve_properties("O3", cast_model_type=torch.bfloat16)
    assert q.half_dtype == torch.bfloat16 and q.cast_model_type == torch.bfloat16


def test_dtype_and_cast_model_type_must_agree():
    with pytest.raises(ValueError, match="disagree"):
        resolve_properties("O2", dtype=torch.float16, cast_model_type=torch.bfloat16)


@pytest.mark.parametrize("value,expected", [("128.0", 128.0), (64, 64.0), ("dynamic", "dynamic")])
def test_loss_scale_forms(value, expected):
    assert resolve_properties("O1", loss_scale=value).loss_scale == expected


@pytest.mark.parametrize("value,exc", [("big", ValueError), (0, ValueError), (-1.0, ValueError),
                                       (float("inf"), ValueError), ([1], TypeError),
                                       ("nan", ValueError), (float("nan"), ValueError),
                                       # (r98D G1: integers past float's range: the same
                                       # ValueError, not float()'s OverflowError)
                                       (10**400, ValueError), (-(10**400), ValueError)],
                         ids=["big", "0", "-1", "inf", "list", "nan-str", "nan", "huge-int",
                              "huge-negative-int"])
def test_bad_loss_scale(value, exc):
    with pytest.raises(exc, match="loss_scale"):
        resolve_properties("O1", loss_scale=value)


def test_keep_batchnorm_fp32_strings_and_o1():
    assert resolve_properties("O2", keep_batchnorm_fp32="False").keep_batchnorm_fp32 is False
    # Apex raised here; mixprec accepts and honours it.
    assert resolve_properties("O1", keep_batchnorm_fp32=True).keep_batchnorm_fp32 is True
    with pytest.raises(TypeError, match="keep_batchnorm_fp32"):
        resolve_properties("O2", keep_batchnorm_fp32="yes")


@pytest.mark.parametrize("kwargs,match", [
    (dict(opt_level="O2", patch_torch_functions=True), "patch_torch_functions=True"),
    (dict(opt_level="O1", master_weights=True),
     r'master_weights=True keeps .* use opt_level="O2"; else drop master_weights=True\.'),
    # (at O2 the cast passed is what keeps the parameters fp32, not the level: r101A R3)
    (dict(opt_level="O2", cast_model_type=torch.float32, master_weights=True),
     r"with cast_model_type=torch.float32 the parameters stay fp32\. To train a half model "
     r"with fp32 masters, pass a half cast_model_type \(torch.float16 or torch.bfloat16, or "
     r"none: O2's own is half\); else drop master_weights=True\.$"),
    (dict(opt_level="O1", cast_model_type=torch.float32, master_weights=True),
     r"pass a half cast_model_type \(torch.float16 or torch.bfloat16\); else drop"),
    (dict(opt_level="O0", keep_batchnorm_fp32=False), "keep_batchnorm_fp32=False"),
    # (O3's own keep_batchnorm_fp32=False, not passed: the message blames what was)
    (dict(opt_level="O3", cast_model_type=torch.float32),
     r"cast_model_type=torch.float32 leaves the model fp32, and O3 is a model in half "
     r'.*use opt_level="O0"'),
    (dict(opt_level="O1", cast_model_type=torch.int8), "cast_model_type"),
    (dict(opt_level="O1", dtype=torch.float32), "dtype"),
])
def test_nonsensical_combinations(kwargs, match):
    opt_level = kwargs.pop("opt_level")
    with pytest.raises(ValueError, match=match):
        resolve_properties(opt_level, **kwargs)


def test_override_applies():
    p = resolve_properties("O2", master_weights=False, loss_scale=8.0)
    assert p.master_weights is False and p.loss_scale == 8.0 and p.model_is_half


def test_resolved_properties_cannot_be_changed_afterwards():
    """Resolved properties are frozen, as documented: initialize acts on them once (the
    model's cast, the masters, the scale policy), so a later write such as
    ``props.master_weights = False`` is refused instead of being taken and then ignored, and
    the value stays as resolved. (P02)"""
    import dataclasses

    p = resolve_properties("O2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.master_weights = False
    assert p.master_weights is True


@pytest.mark.parametrize("value", [True, False])
def test_bool_loss_scale_is_refused(value):
    # True/False are ints to Python, but not a loss scale (True is not "dynamic").
    with pytest.raises(TypeError, match="loss_scale"):
        resolve_properties("O1", loss_scale=value)


@pytest.mark.parametrize("opt_level,kw,dynamic", [
    ("O1", {}, True),
    ("O2", {}, True),
    ("O0", {}, False),
    ("O1", {"loss_scale": 128.0}, False),  # a static scale other than 1.0
    ("O2", {"loss_scale": "512"}, False),
    # bf16 needs no scaling whichever argument chose it; "dynamic" asked for is still kept
    ("O2", {"dtype": torch.bfloat16}, False),
    ("O2", {"cast_model_type": torch.bfloat16}, False),
    ("O2", {"cast_model_type": torch.bfloat16, "loss_scale": "dynamic"}, True),
])
def test_dynamic_loss_scale_property(opt_level, kw, dynamic):
    assert resolve_properties(opt_level, **kw).dynamic_loss_scale is dynamic


@pytest.mark.parametrize("bad", [torch.int8, torch.float64])
def test_cast_model_outputs_must_be_a_float_type_amp_knows(bad):
    with pytest.raises(ValueError, match=r"cast_model_outputs=.*allowed values are None"):
        resolve_properties("O2", cast_model_outputs=bad)


def test_cast_model_type_false_says_what_to_use_instead():
    # (Apex's unit tests pass False for "leave the model's dtypes as they are".)
    with pytest.raises(ValueError, match=r"cast_model_type=False\): allowed values are None, "
                       r".*False \(leave the model's dtypes as they are\) is not supported: .*"
                       r'opt_level="O1".*opt_level="O2"'):
        resolve_properties("O2", cast_model_type=False)


def test_master_weights_strings():
    # Apex's argparse strings: "False" turns the masters off (a non-empty string is truthy).
    assert resolve_properties("O2", master_weights="False").master_weights is False
    assert resolve_properties("O2", master_weights="True").master_weights is True
    with pytest.raises(TypeError, match="master_weights"):
        resolve_properties("O2", master_weights="no")


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_bf16_dtype_with_an_fp32_cast_model_type_is_not_a_disagreement(opt_level):
    """dtype picks the half type (O1's autocast dtype) and cast_model_type=torch.float32 the
    parameters' dtype: they do not disagree, and a config passing both (fp32 parameters, bf16
    autocast) resolves, keeping each. Only two different half types disagree. (P03)"""
    p = resolve_properties(opt_level, dtype=torch.bfloat16, cast_model_type=torch.float32)
    assert (p.half_dtype, p.cast_model_type) == (torch.bfloat16, torch.float32)
    assert p.patch_torch_functions is (opt_level == "O1")
    with pytest.raises(ValueError, match="disagree"):
        resolve_properties("O3", dtype=torch.bfloat16, cast_model_type=torch.float16)


@pytest.mark.parametrize("name", ["keep_batchnorm_fp32", "master_weights",
                                  "patch_torch_functions"])
@pytest.mark.parametrize("value", ["false", "TRUE", "1", 0, 1])
def test_only_apexs_exact_bool_strings_are_taken(name, value):
    """The string forms taken for a bool property are exactly Apex's argparse "True" and
    "False"; any other spelling is refused naming the accepted ones, so that a config's
    "false" is not read by a rule the user cannot see in the docs. Nor are the ints 0/1
    (kept as they were, keep_batchnorm_fp32=0 slipped past the checks comparing with False).
    (P06)"""
    with pytest.raises(TypeError, match=rf"{name}={value!r}\): expected True, False, None or "
                                        r'the strings "True"/"False"'):
        resolve_properties("O2", **{name: value})


@pytest.mark.parametrize("value", ["Dynamic", "DYNAMIC", " dynamic"])
def test_only_the_exact_string_dynamic_asks_for_dynamic_scaling(value):
    """loss_scale's one word is "dynamic", as Apex spells it and as LossScaler takes it (it
    refuses "Dynamic"): any other spelling is refused naming the accepted forms, rather than
    amp.initialize and LossScaler disagreeing on what a config means."""
    with pytest.raises(ValueError, match=rf'loss_scale={value!r}\): a string loss_scale must '
                                         r'be "dynamic" or a number'):
        resolve_properties("O1", loss_scale=value)


def test_a_dtype_refusal_lists_exactly_the_dtypes_its_argument_takes():
    """Each dtype argument's refusal lists the dtypes that argument takes: torch.float32 for
    cast_model_type and cast_model_outputs (an fp32 model or fp32 outputs are valid choices),
    only the two half types for dtype."""
    every = r"allowed values are None, torch\.float32, torch\.float16, torch\.bfloat16\.$"
    with pytest.raises(ValueError, match=r"cast_model_type=torch\.int8\): " + every):
        resolve_properties("O1", cast_model_type=torch.int8)
    with pytest.raises(ValueError, match=r"cast_model_outputs=torch\.float64\): " + every):
        resolve_properties("O1", cast_model_outputs=torch.float64)
    with pytest.raises(ValueError, match=r"dtype=torch\.float32\): allowed values are None, "
                                         r"torch\.float16, torch\.bfloat16\.$"):
        resolve_properties("O1", dtype=torch.float32)


@pytest.mark.parametrize("opt_level, kw", [
    ("O0", {}),
    ("O3", {"cast_model_type": torch.float32}),
])
def test_a_passed_keep_batchnorm_fp32_false_in_an_fp32_model_is_what_the_message_blames(
        opt_level, kw):
    """keep_batchnorm_fp32=False passed for an fp32 model is refused naming that argument and
    the fix (O3 for a half model, or drop it); the message about cast_model_type=torch.float32
    against O3's own half BatchNorm is for when the user did not pass keep_batchnorm_fp32."""
    with pytest.raises(ValueError, match=r"keep_batchnorm_fp32=False would cast BatchNorm to "
                                         r'half in an fp32 model\. Use opt_level="O3"'):
        resolve_properties(opt_level, keep_batchnorm_fp32=False, **kw)


@pytest.mark.parametrize("opt_level, kw", [
    ("O2", {"patch_torch_functions": True, "dtype": torch.bfloat16}),
    ("O3", {"patch_torch_functions": "True", "cast_model_type": torch.bfloat16}),
    ("O1", {"cast_model_type": torch.bfloat16}),
])
def test_per_op_casting_with_a_bf16_model_is_refused(opt_level, kw):
    """Per-op casting (O1's autocast) over a model cast to half is refused for bf16 as for
    fp16: the two are different ways to train, whichever half type is chosen."""
    with pytest.raises(ValueError, match=r"patch_torch_functions=True \(per-op casting, O1\) "
                                         r"cannot be combined with cast_model_type="
                                         r"torch\.bfloat16 \(a half model, O2/O3\)"):
        resolve_properties(opt_level, **kw)


def test_loss_scale_takes_numpy_numbers_as_the_bounds_do():
    # A config read through NumPy (np.float32, np.int64) gives its scale as a NumPy number:
    # taken as min_loss_scale/max_loss_scale and LossScaler take them; a tensor is refused as
    # the bounds refuse it.
    np = pytest.importorskip("numpy")
    assert resolve_properties("O1", loss_scale=np.float32(128.0)).loss_scale == 128.0
    assert resolve_properties("O1", loss_scale=np.int64(64)).loss_scale == 64.0
    assert type(resolve_properties("O1", loss_scale=np.float32(2.0)).loss_scale) is float
    with pytest.raises(TypeError, match=r"loss_scale=tensor\(2\.\)\): expected a positive number"):
        resolve_properties("O1", loss_scale=torch.tensor(2.0))


@pytest.mark.parametrize("value", [False, "False"], ids=["bool", "string"])
def test_o1_takes_keep_batchnorm_fp32_false_leaving_batchnorm_to_autocast(value):
    """keep_batchnorm_fp32=False at O1 (an Apex-style script passing its --keep-batchnorm-fp32
    flag through at every level) resolves: O1's model stays fp32 (cast_model_type None), so
    there is no fp32 model with half BatchNorm to refuse; BatchNorm is left to autocast, as
    with None. Only an explicit cast_model_type=torch.float32 with it is refused. Reference:
    amp.initialize on the same seeded CNN with keep_batchnorm_fp32=None gives the same
    output bit for bit. (P01)"""
    p = resolve_properties("O1", keep_batchnorm_fp32=value)
    assert (p.cast_model_type, p.keep_batchnorm_fp32, p.patch_torch_functions) == (
        None, False, True)
    x, _ = batch(n=2)
    out = {}
    for keep in (value, None):
        model = amp.initialize(make_cnn(), opt_level="O1", keep_batchnorm_fp32=keep,
                               dtype=torch.bfloat16, verbosity=0)
        out[keep] = model(x)
    torch.testing.assert_close(out[value], out[None], rtol=0, atol=0)
