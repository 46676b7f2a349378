"""The README is executable (issue 39): every Python block in it and in its long form,
`docs/guide.md`, runs, so a moved module or a renamed argument breaks a test, not a
newcomer. Names a block says are the user's (`model`, `batch`, a dataset, a Lightning module,
an `Accelerator`, a `config`) are given small ones, by the section the block is in (`GIVEN`).
Every block compiles and its imports resolve in `make test`; each runs whole in
`make test-slow`."""

import ast
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.realzoo import gpt2

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"  # the README's long form: its blocks run too


def _blocks(path: Path) -> list[tuple[str, str, str]]:
    """(section heading, where, code) of every ```python block of `path`, in order."""
    found, heading = [], ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("#"):
            heading = lines[i].lstrip("#").strip()
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            found.append((heading, f"{path.name}:{i + 2}", "\n".join(lines[i + 1:end])))
            i = end
        i += 1
    return found


BLOCKS = _blocks(README) + _blocks(GUIDE)
IDS = [where.replace(".md:", "-line") for _, where, _ in BLOCKS]


def _your_model() -> dict:
    torch.manual_seed(0)
    model, batch = gpt2(batch=4, seq=32, layers=2)
    return {"model": model.train(), "batch": batch}


def _your_trainers() -> dict:
    """A small GPT-2 with what each trainer takes: a dataset (HF Trainer), a LightningModule
    holding it at `.model` and a loader, an optimizer and an `Accelerator`."""
    import lightning.pytorch as pl
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    given = _your_model()
    ids = torch.randint(0, 97, (16, 32), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r} for r in ids]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _your_model()["model"]

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    AcceleratorState._reset_state(reset_partial_state=True)
    return {**given, "ds": rows, "module": Module(), "loader": DataLoader(rows, batch_size=4),
            "opt": torch.optim.AdamW(given["model"].parameters(), lr=1e-4),
            "accelerator": Accelerator(cpu=True, mixed_precision="bf16",
                                       gradient_accumulation_steps=2)}


def _your_config() -> dict:
    from transformers import LlamaConfig

    return {"config": LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  vocab_size=1000, max_position_embeddings=4096)}


GIVEN = {"Your step: mixed precision, accumulation, clipping, your optimizer": _your_model,
         "With your trainer": _your_trainers,
         "Before you rent the GPU: pre-flight": _your_config,
         "Many GPUs: one rank of FSDP2 or DDP": _your_config}


def test_the_readme_has_python_blocks_and_each_section_with_given_names_is_known():
    assert len(_blocks(README)) >= 5
    for path in (README, GUIDE):
        sections = {heading for heading, _, _ in _blocks(path)}
        assert set(GIVEN) <= sections, (path.name, set(GIVEN) - sections)


def test_the_readme_is_a_five_minute_read():
    assert len(README.read_text().splitlines()) <= 220


@pytest.mark.parametrize(("heading", "where", "code"), BLOCKS, ids=IDS)
def test_every_block_compiles_and_its_imports_resolve(heading, where, code):
    tree = ast.parse(code, filename=where)
    imports = ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                         type_ignores=[])
    exec(compile(imports, where, "exec"), {})
    # every rematlab.<name> the block calls exists
    import rematlab

    for name in set(re.findall(r"\brematlab\.([A-Za-z_]\w*)\b", code)):
        assert hasattr(rematlab, name), f"{where}: rematlab.{name}"


@pytest.mark.slow
@pytest.mark.parametrize(("heading", "where", "code"), BLOCKS, ids=IDS)
def test_every_block_runs(heading, where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what trainers write (checkpoints, logs) stays in the test's
    namespace = GIVEN.get(heading, dict)()
    exec(compile(code, where, "exec"), namespace)
