"""The typer app and what every command shares: one-line errors with exit status 2, JSON
output, and the option types of model inputs and budgets."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from rematlab.core.files import jsonable
from rematlab.exceptions import ConfigError, RematlabError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure, model and optimize activation rematerialization in PyTorch.")
console = Console()


@app.callback()
def _root() -> None:
    """Measure, model and optimize activation rematerialization in PyTorch."""


# the `study` extra's packages (pyproject.toml), by import name
STUDY_EXTRA = frozenset(("duckdb", "pandas", "pyarrow", "sklearn", "scipy", "statsmodels",
                         "matplotlib", "jinja2", "skops"))


def _fail(message: str, code: int = 2) -> None:
    sys.stderr.write(f"error: {message}\n")
    raise typer.Exit(code)


def handles_errors(fn: Callable) -> Callable:
    """User errors become one line on stderr and exit status 2, never a traceback. Only
    rematlab's own errors and the OS refusing a path are user errors: anything else is a bug
    and keeps its traceback. Ctrl-C is exit 130 and the command to run again."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RematlabError, FileNotFoundError, PermissionError, IsADirectoryError,
                NotADirectoryError) as exc:
            _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        except ModuleNotFoundError as exc:  # the study's libraries are an extra
            if (exc.name or "").split(".")[0] not in STUDY_EXTRA:
                raise
            _fail(f"this command needs rematlab's study extra: pip install 'rematlab[study]' "
                  f"({exc.name} is not installed)")
        except RuntimeError as exc:  # DuckDB's word for a Ctrl-C that lands in a query
            if "duckdb" not in sys.modules or str(exc) != "Query interrupted":
                raise
            _interrupted()
        except KeyboardInterrupt:  # a sweep or a study says what it kept and exits 130 itself
            _interrupted()

    return wrapper


def _interrupted() -> NoReturn:
    sys.stderr.write("interrupted: nothing was written (an --out file is written only when "
                     "complete); run it again with: rematlab "
                     f"{shlex.join(sys.argv[1:])}\n")
    raise typer.Exit(130) from None


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=jsonable) + "\n")


Budget = Annotated[str, typer.Option(
    help="peak memory budget of the step, e.g. 6GiB, or auto: what this device has")]
IncludeUntrusted = Annotated[bool, typer.Option(
    help="also use configurations whose timings the interference guard did not trust")]
InputScale = Annotated[str | None, typer.Option(help="input scale: mnist, cifar, imagenet")]
InputShape = Annotated[str | None, typer.Option(help="per-sample shape: 3,224,224")]
InputDtype = Annotated[str, typer.Option(
    help="dtype of generated inputs: float32, ..., or int64 for token ids (with --vocab)")]
Vocab = Annotated[int | None, typer.Option(help="token ids are drawn below this")]
Example = Annotated[str | None, typer.Option(
    help="batch factory module:fn, fn(batch) -> tensor, tuple or dict (e.g. input_ids, "
         "attention_mask, labels); modules resolve from the current directory")]
Optimizer = Annotated[str, typer.Option(
    help="sgd, momentum, adam, adamw, mixed-adamw (AdamW state in fp32), none")]
Precision = Annotated[str, typer.Option(
    help="the step's autocast: fp32 (none), bf16, or fp16 (with a GradScaler), as the user's "
         "trainer runs it (HF bf16=True, Lightning bf16-mixed); bf16-true, 16-true: the "
         "weights in that dtype, no autocast (Lightning)")]
MicroBatches = Annotated[int, typer.Option(
    help="forwards per optimizer step (gradient accumulation): every gradient stays alive")]
Clip = Annotated[float | None, typer.Option(help="clip_grad_norm_ to this norm before the "
                                                 "optimizer step")]
GradsToZero = Annotated[bool, typer.Option(
    "--grads-to-zero", help="the loop calls zero_grad(set_to_none=False): gradients are "
    "alive (zeros) before the forward")]
StepFn = Annotated[str | None, typer.Option(
    help="the user's own step module:fn, fn(model, batch) -> loss, run under autocast as "
         "the loop runs it (it replaces the default loss)")]
Target = Annotated[str | None, typer.Option(
    help="with --predict: the device planned for: cpu (this machine, calibrated), cuda (the "
         "GPU here), a100-80gb, h100-80gb, h200, rtx4090, mi300x, or a profile.json")]
WeightDtype = Annotated[str, typer.Option(help="the model's weights: float32, bfloat16, ...")]
Lora = Annotated[int | None, typer.Option(
    help="freeze the model and train LoRA adapters of this rank (peft when installed)")]
Fsdp = Annotated[str | None, typer.Option(
    "--fsdp", metavar="[N]",
    help="plan one rank of FSDP2 over N ranks (with --predict: simulated here; alone, under "
         "torchrun: the job's ranks, measured)")]
Ddp = Annotated[str | None, typer.Option(
    "--ddp", metavar="[N]", help="plan one rank of DDP over N ranks (as --fsdp)")]
Blocks = Annotated[str | None, typer.Option(
    help="the layers the model's own loop runs, comma-separated names, e.g. transformer.h")]


def _step(optimizer: str, precision: str, micro_batches: int, clip: float | None,
          grads_to_zero: bool, step_fn: str | None) -> Any:
    """The user's training step from the command line's options (`rematlab.Step`)."""
    from rematlab.core.checks import load_object
    from rematlab.core.recipe import Step

    return Step(precision=precision, micro_batches=micro_batches, clip=clip,
                optimizer=None if optimizer == "none" else optimizer,
                set_to_none=not grads_to_zero,
                fn=load_object(step_fn, "step function") if step_fn else None)


def _layout(fsdp: str | None, ddp: str | None, predict: bool, device: str) -> Any:
    """The step's parallel layout from --fsdp / --ddp (N, or the job's ranks: then the
    process group torchrun describes is joined here)."""
    from rematlab.core.layout import DDP, FSDP
    from rematlab.distributed.group import join_job

    if fsdp is not None and ddp is not None:
        raise ConfigError("give one layout: --fsdp or --ddp")
    given = fsdp if fsdp is not None else ddp
    if given is None:
        return None
    size = None
    if given != "job":
        try:
            size = int(given)
        except ValueError:
            raise ConfigError(f"--{'fsdp' if fsdp is not None else 'ddp'} takes a world size, "
                              f"got {given!r}") from None
    layout = FSDP(size) if fsdp is not None else DDP(size)
    if not predict:
        join_job(device)
    return layout


def _shape(text: str | None) -> tuple[int, ...] | None:
    from rematlab.measurement.zoo import parse_shape

    return parse_shape(text) if text else None


