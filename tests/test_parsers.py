"""Property-based tests over every parser of user input (issue 13): whatever the text, a
parser returns a valid value or raises `ConfigError` — never another exception."""

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rematlab.core.units import parse_bytes
from rematlab.exceptions import ConfigError
from rematlab.measurement.spec import parse_device
from rematlab.measurement.zoo import parse_shape
from rematlab.plans.plan import Plan
from rematlab.remat.strategies import parse
from rematlab.study.grid import load_grid

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
TEXT = st.text(alphabet=string.printable + "∞µ\u00a0", max_size=40)


def _only_config_errors(fn, value):
    try:
        return fn(value)
    except ConfigError:
        return None


@SETTINGS
@given(st.one_of(TEXT, st.from_regex(r"\s*-?[0-9.e+]{1,12}\s*[kKmMgGtT]?i?[bB]?\s*",
                                     fullmatch=True), st.floats(), st.integers()))
def test_byte_sizes_are_positive_ints_or_config_errors(value):
    out = _only_config_errors(parse_bytes, value)
    assert out is None or (isinstance(out, int) and out > 0)


@SETTINGS
@given(st.one_of(TEXT, st.from_regex(r"[0-9,x ]{0,20}", fullmatch=True)))
def test_shapes_are_positive_tuples_or_config_errors(text):
    out = _only_config_errors(parse_shape, text)
    assert out is None or (out and all(isinstance(d, int) and d > 0 for d in out))


@SETTINGS
@given(st.one_of(TEXT, st.from_regex(
    r"(none|sqrt|selective|uniform|every|plan|zig)(:[-0-9.einfa]{0,10})?", fullmatch=True)))
def test_strategies_parse_or_raise_config_errors(text):
    out = _only_config_errors(parse, text)
    if out is not None and out.arg is not None:
        assert out.arg > 0 and out.arg == out.arg and out.arg != float("inf")


@SETTINGS
@given(st.one_of(TEXT, st.from_regex(r"(cpu|cuda|mps|tpu)(:[0-9-]{0,4})?", fullmatch=True)))
def test_devices_parse_or_raise_config_errors(text):
    out = _only_config_errors(parse_device, text)
    assert out is None or out.type in ("cpu", "cuda")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["n_blocks", "items", "checkpoint",
                                                       "inner", "name", "compiled"]),
                                      inner, max_size=4), max_leaves=12)


@SETTINGS
@given(st.one_of(TEXT, JSON.map(json.dumps)))
def test_plan_json_loads_a_valid_plan_or_raises_config_errors(text):
    out = _only_config_errors(Plan.from_json, text)
    assert out is None or out.n_blocks >= 0


def test_deeply_nested_and_non_finite_plan_json_is_refused():
    deep = '{"checkpoint": [0, 1], "inner": [' * 2000 + "0" + "]}" * 2000
    with pytest.raises(ConfigError):
        Plan.from_json('{"n_blocks": 1, "items": [' + deep + "]}")
    with pytest.raises(ConfigError):
        Plan.from_json('{"n_blocks": Infinity, "items": []}')


GRID_VALUES = st.one_of(st.integers(min_value=-2**64, max_value=2**64), st.floats(),
                        st.booleans(), TEXT, st.lists(st.integers(-5, 2**40), max_size=3),
                        st.lists(TEXT, max_size=3))
GRID_KEYS = ["batches", "strategies", "dtypes", "devices", "optimizers", "warmup", "repeats",
             "timeout", "max_memory", "threads", "max_configs", "name", "bogus"]


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(str(value), repr(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


@SETTINGS
@given(st.dictionaries(st.sampled_from(GRID_KEYS), GRID_VALUES, max_size=4),
       st.sampled_from(["mlp3", "lenet5", "nope", "tests.userzoo:tiny"]))
def test_grid_files_load_or_raise_config_errors(tmp_path_factory, fields, model):
    text = "\n".join(f"{k} = {_toml(v)}" for k, v in fields.items())
    text += f'\n[[models]]\nname = "{model}"\n'
    path = tmp_path_factory.mktemp("g") / "grid.toml"
    path.write_text(text)
    grid = _only_config_errors(load_grid, path)
    if grid is not None:  # what loads can be stored and run
        for spec in grid.expand():
            assert 0 < spec.batch < 2**31 and spec.repeats >= 1
            assert spec.threads is None or 1 <= spec.threads <= 4096
            assert spec.max_memory is None or 0 < spec.max_memory < 2**63
        assert 0 < grid.timeout < float("inf")


@pytest.mark.parametrize("text", [
    "batches = [4, 4]\n[[models]]\nname = 'mlp3'",
    "strategies = ['none', 'none']\n[[models]]\nname = 'mlp3'",
    "[[models]]\nname = 'mlp3'\n[[models]]\nname = 'mlp3'",
    "batches = []\n[[models]]\nname = 'mlp3'",
    "threads = 3000000000\n[[models]]\nname = 'mlp3'",
    "batches = [3000000000]\n[[models]]\nname = 'mlp3'",
    "timeout = inf\n[[models]]\nname = 'mlp3'",
    "timeout = 1e308\n[[models]]\nname = 'mlp3'",
    "max_memory = true\n[[models]]\nname = 'mlp3'",
    "max_memory = '1e999GiB'\n[[models]]\nname = 'mlp3'",
    "batches = " + str(list(range(1, 1001))) + "\nstrategies = " + json.dumps(
        [f"uniform:{k}" for k in range(1, 101)]) + "\n[[models]]\nname = 'mlp3'",
])
def test_grids_no_run_could_store_are_refused_with_one_message(tmp_path, text):
    path = tmp_path / "grid.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_grid(path)
    assert "\n" not in str(err.value)
