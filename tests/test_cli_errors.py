"""Every subcommand, fed bad input (issue 13): exit status 2, exactly one `error: ...` line
on stderr, no traceback, nothing on stdout; damaged and foreign files included."""

import json
import shutil
from pathlib import Path

import duckdb
import pytest
import torch

from rematlab.measurement.measure import failed_row
from rematlab.measurement.spec import Spec
from rematlab.study.store import Store, config_id
from tests import clirun

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.duckdb").write_bytes(b"")
    (d / "garbage.duckdb").write_bytes(b"\x00garbage" * 1000)
    con = duckdb.connect(str(d / "foreign.duckdb"))
    con.execute("CREATE TABLE invoices (id INTEGER)")
    con.close()
    (d / "empty.skops").write_bytes(b"")
    (d / "garbage.skops").write_bytes(b"PK\x03\x04" + b"x" * 100)
    (d / "plan.json").write_text('{"n_blocks": 3, "items": [0, 1]}')
    (d / "notjson.json").write_text("{{{")
    (d / "grid.toml").write_text("batches = [4, 4]\n[[models]]\nname = 'mlp3'\n")
    (d / "bad.toml").write_text("batches = [\n")
    (d / "afile").write_text("x")
    (d / "syntax_err.py").write_text("def broken(:\n")
    (d / "raises.py").write_text("def model():\n    raise RuntimeError('boom')\n")
    (d / "deep.json").write_text('{"a":' * 5000 + "1" + "}" * 5000)  # nested past any profile
    plan5 = {"n_blocks": 5, "items": [{"checkpoint": [0, 2], "inner": [0, 1]}, 2, 3, 4]}
    (d / "mlp5-plan.json").write_text(json.dumps(plan5))
    shutil.copy(HERE / "userzoo.py", d / "userzoo_copy.py")
    with Store(d / "oom_only.duckdb") as store:  # results, none of them usable
        for batch in (1, 2, 3):
            spec = Spec(model="mlp3", batch=batch)
            store.write_config(config_id(spec.to_dict()), "s", spec.to_dict(),
                               [failed_row(spec, "oom", "cap")], 0.0)
    return d


CASES = [
    # measure
    ("measure", ["--model", "resnet9"], "unknown model"),
    ("measure", ["--model", "mlp3", "--batch", "0"], "batch"),
    ("measure", ["--model", "mlp3", "--batch", "9223372036854775808"], "batch"),
    ("measure", ["--model", "mlp3", "--batch", "abc"], "--batch"),
    ("measure", ["--model", "mlp3", "--threads", "-1"], "threads"),
    ("measure", ["--model", "mlp3", "--strategy", "selective:nan"], "finite"),
    ("measure", ["--model", "mlp3", "--strategy", "selective:inf"], "finite"),
    ("measure", ["--model", "mlp3", "--strategy", "plan:{d}/missing.json"], "plan file"),
    ("measure", ["--model", "mlp3", "--strategy", "plan:{d}/notjson.json"], "not a rematlab plan"),
    ("measure", ["--model", "mlp3", "--strategy", "plan:{d}/plan.json"], "plan"),
    ("measure", ["--model", "mlp3", "--input-shape", "3,,32"], "input shape"),
    ("measure", ["--model", "mlp3", "--input-shape", "3,32,32"], "fails on the batch"),
    ("measure", ["--model", "mlp3", "--input-shape", "999999,999999,999999"], "batch"),
    ("measure", ["--model", "mlp3", "--device", "cuda:99"], "cuda"),
    ("measure", ["--model", "mlp3", "--device", "tpu"], "device"),
    ("measure", ["--model", "mlp3", "--max-memory", "1e999"], "memory size"),
    ("measure", ["--model", "os:system", "--input-shape", "3"], "model factory"),
    ("measure", ["--model", "syntax_err:broken", "--input-shape", "3"], "SyntaxError"),
    ("measure", ["--model", "raises:model", "--input-shape", "3"], "boom"),
    ("measure", [], "--model"),
    # plan
    ("plan", ["--model", "mlp3", "--budget", "1e999"], "memory size"),
    ("plan", ["--model", "mlp3", "--budget", "1KiB"], "infeasible"),
    # the user's step (issue 36)
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--precision", "int8"],
     "unknown precision"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--micro-batches", "0"], "micro_batches"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--clip", "-1"], "clip"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--clip", "nan"], "clip"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--step-fn", "nomodule:fn"],
     "step function"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--step-fn", "raises:model"],
     "the step function fails"),
    ("max-batch", ["--model", "mlp3", "--budget", "1GiB", "--precision", "fp8"],
     "unknown precision"),
    pytest.param("plan", ["--model", "mlp3", "--budget", "1GiB", "--device", "cuda"], "cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--compile", "--predict"], "--compile"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--out", "{d}/afile/plan.json"],
     "not a directory"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--optimizer", "lion"], "optimizer"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--batch", "9223372036854775808"],
     "batch must be between"),
    ("plan", ["--model", "userzoo_copy:decoder", "--example", "userzoo_copy:decoder_batch",
              "--budget", "1GiB", "--blocks", "tok"], "no floating tensor"),
    ("plan", ["--model", "userzoo_copy:decoder", "--example", "userzoo_copy:decoder_batch",
              "--budget", "1GiB", "--blocks", "tok,tok"], "overlap"),
    ("plan", ["--model", "mlp3", "--budgets", "1GiB,"], "empty entry"),
    ("plan", ["--model", "mlp3"], "--budget"),
    ("plan", ["--model", "mlp3", "--budgets", "1GiB,2GiB", "--out", "{d}/p.json"], "one plan"),
    ("plan", ["--model", "builtins:exit", "--input-shape", "3", "--budget", "1GiB"],
     "SystemExit"),
    ("measure", ["--model", "userzoo_copy:exits", "--input-shape", "3"], "exit(3)"),
    ("measure", ["--model", "sys:exit", "--input-shape", "3"], "model factory"),
    ("measure", ["--model", "userzoo_copy:decoder", "--example", "userzoo_copy:decoder_batch",
                 "--blocks", "layers,layers.0"], "overlap"),
    # sweep
    ("sweep", ["{d}/grid.toml", "--dry-run"], "twice"),
    ("sweep", ["{d}/bad.toml", "--dry-run"], "malformed TOML"),
    ("sweep", ["{d}/nope.toml", "--dry-run"], "not found"),
    ("sweep", ["quick", "--db", "{d}/foreign.duckdb"], "not a rematlab database"),
    ("sweep", ["quick", "--db", "{d}/garbage.duckdb"], "database"),
    ("sweep", ["quick", "--backend", "slurm"], "backend"),
    ("sweep", ["quick", "--dry-run", "--max-wait", "-1"], "max_wait_s"),
    ("sweep", ["quick", "--dry-run", "--max-wait-total", "inf"], "max_wait_total_s"),
    # export / stats / fit on damaged, foreign and missing databases
    ("export", ["--db", "{d}/garbage.duckdb", "--out", "{d}/x.parquet"], "database"),
    ("export", ["--db", "{d}/foreign.duckdb", "--out", "{d}/x.parquet"], "not a rematlab"),
    ("export", ["--db", "{d}/missing.duckdb", "--out", "{d}/x.parquet"], "does not exist"),
    ("stats", ["--db", "{d}/empty.duckdb"], "database"),
    ("stats", ["--db", "{d}/foreign.duckdb"], "not a rematlab"),
    ("stats", ["--db", "{d}/oom_only.duckdb"], "no ok configuration"),
    ("fit", ["--db", "{d}/oom_only.duckdb", "--out", "{d}/p.skops"], "at least 10"),
    ("fit", ["--db", "{d}/garbage.duckdb", "--out", "{d}/p.skops"], "database"),
    ("fit", ["--db", "{d}/foreign.duckdb", "--out", "{d}/foreign.duckdb"], "also an input"),
    # predict
    ("predict", ["--predictor", "{d}/empty.skops", "--model", "mlp3"], "not a rematlab"),
    ("predict", ["--predictor", "{d}/garbage.skops", "--model", "mlp3"], "not a rematlab"),
    ("predict", ["--predictor", "{d}/missing.skops", "--model", "mlp3"], "not found"),
    # max-batch
    ("max-batch", ["--model", "mlp3", "--budget", "lots"], "size"),
    ("max-batch", ["--model", "nope", "--budget", "1GiB"], "nope"),
    ("max-batch", ["--model", "mlp3", "--budget", "1GiB", "--limit", "0"], "limit"),
    ("max-batch", ["--model", "mlp3", "--budget", "1GiB", "--repeats", "1099511627776"],
     "repeats must be between"),
    ("max-batch", ["--model", "userzoo_copy:decoder", "--input-shape", "8", "--input-dtype",
                   "int64", "--vocab", "9223372036854775808", "--budget", "1GiB"],
     "vocab must be between"),
    ("measure", ["--model", "userzoo_copy:decoder", "--input-shape", "8", "--input-dtype",
                 "int64", "--vocab", "9223372036854775808"], "vocab must be between"),
    ("max-batch", ["--model", "mlp3", "--budget", "1GiB", "--device", "cuda:7"], "cuda"),
    # gradients / study
    ("gradients", ["--models", ""], "no model"),
    ("gradients", ["--batch", "0"], "batch must be between"),
    ("gradients", ["--seeds", "2147483648"], "seeds must be between"),
    ("gradients", ["--steps", "1099511627776"], "steps must be between"),
    ("gradients", ["--models", "userzoo_copy:tiny", "--steps", "2"], "fails on the batch"),
    ("gradients", ["--budgets", "a,b"], "budgets"),
    # issue 39's review: each was a traceback, or an error after progress lines
    ("gradients", ["--models", "mlp3", "--strategy", "plan:{d}/mlp5-plan.json", "--steps",
                   "2"], "is for 5 blocks"),
    ("plan", ["--model", "mlp3", "--budget", "1GiB", "--predict", "--target", "{d}/deep.json"],
     "cannot read the target profile"),
    ("plan", ["--model", "vgg16", "--input-shape", "100000,100000", "--batch", "2", "--budget",
              "1GiB", "--predict", "--target", "h100-80gb"], "fails on the batch"),
    ("plan", ["--model", "vgg16", "--input-shape", "3,224,224", "--batch", "2147483647",
              "--budget", "1GiB", "--predict", "--target", "h100-80gb"], "fails on the batch"),
    ("study", ["--device", "cuda:99"], "cuda"),
    ("study", ["--grid", "{d}/grid.toml"], "twice"),
    ("bogus", [], "No such command"),
]


@pytest.mark.parametrize(("command", "args", "needle"), CASES,
                         ids=[f"{c.values[0] if hasattr(c, 'values') else c[0]}-{i}"
                              for i, c in enumerate(CASES)])
def test_bad_input_is_one_error_line_and_exit_2(files, command, args, needle):
    args = [a.replace("{d}", str(files)) for a in args]
    proc = clirun.run([command, *args], cwd=files)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = clirun.said(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert needle.lower() in lines[0].lower(), lines[0]
    assert proc.stdout == ""


def test_a_plan_written_to_a_named_pipe_reaches_its_reader_and_the_pipe_stays(tmp_path):
    """`--out` onto a pipe (issue 64): written through once whole, never replaced by a file."""
    import os
    import stat
    import threading

    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    proc = clirun.run(["plan", "--model", "mlp3", "--budget", "1GiB", "--out", str(fifo)])
    reader.join(60)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and json.loads(got[0])


@pytest.mark.parametrize("out", ["x" * 341 + ".json", "/dev/full", "/proc/version"])
def test_an_output_path_the_system_refuses_is_one_clean_error(tmp_path, out):
    proc = clirun.run(["plan", "--model", "mlp3", "--budget", "1GiB",
                       "--out", out if out.startswith("/") else str(tmp_path / out)])
    assert proc.returncode == 2 and "cannot write" in proc.stderr
    assert len(clirun.said(proc.stderr)) == 1 and "Traceback" not in proc.stderr
