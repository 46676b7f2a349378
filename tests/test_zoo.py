import pytest
import torch

from rematlab.core.batch import make_example
from rematlab.exceptions import ConfigError
from rematlab.measurement import zoo
from rematlab.remat.tracing import meta_copy


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "scale", "expected"),
    [("vgg16", "imagenet", 138_357_544), ("alexnet", "imagenet", 61_100_840),
     ("lenet5", "mnist", 61_706)],
)
def test_parameter_counts_match_canonical_models(name, scale, expected):
    with torch.device("meta"):
        model, _, _ = zoo.resolve(name, scale)
    assert _count(model) == expected


@pytest.mark.parametrize("name", sorted(zoo.REGISTRY))
def test_every_zoo_model_runs_on_each_of_its_input_scales(name):
    info = zoo.REGISTRY[name]
    for scale, shape in info.scales.items():
        with torch.device("meta"):
            model, got_shape, _ = zoo.resolve(name, scale)
            out = model(torch.empty(2, *got_shape))
        assert got_shape == shape
        assert out.shape[0] == 2 and out.dim() == 2
        assert isinstance(model, torch.nn.Sequential) and len(model) >= 3


def test_mlp_depth_is_number_of_linear_layers():
    for depth in (3, 5, 7):
        model = zoo.mlp(depth, width=8)
        assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == depth


def test_user_factory_is_loaded_and_needs_a_shape_or_a_batch_factory():
    model, shape, _ = zoo.resolve("tests.userzoo:tiny", input_shape=(4,))
    assert shape == (4,) and isinstance(model, torch.nn.Module)
    assert zoo.resolve("tests.userzoo:tiny")[1] is None
    with pytest.raises(ConfigError, match="input shape"):
        make_example(8, None)
    assert make_example(8, (4,)).shape == (8, 4)
    ids = make_example(8, (16,), input_dtype="int64", vocab=50)
    assert ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < 50
    with pytest.raises(ConfigError, match="cannot load"):
        zoo.resolve("tests.userzoo:missing", input_shape=(4,))


@pytest.mark.parametrize("bad", ["", "a,b", "3,0,2", "-1"])
def test_bad_shapes_are_config_errors(bad):
    with pytest.raises(ConfigError):
        zoo.parse_shape(bad)


def test_meta_copy_shares_structure_not_data():
    model = zoo.lenet5()
    copy = meta_copy(model)
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert _count(copy) == _count(model)
    assert all(p.device.type == "cpu" for p in model.parameters())
