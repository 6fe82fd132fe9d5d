"""The record a worker leaves when it dies of an exception (dtk/worker/failure.py): the
user's frame is the innermost outside dtk, torch, the standard library and installed
packages; a user data function's failure before the run's first step is a UserError."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.config.choices import DataKind
from dtk.worker.failure import data_function_errors, exception_record, record_exception

USER_PY = """\
import json

import torch


def bad_view():
    return torch.zeros(2, 3).t().view(-1)


def bad_json():
    return json.loads("{not json")


def calls(f):
    return f()
"""


def user_module(tmp_path: Path):
    path = tmp_path / "usercode.py"
    path.write_text(USER_PY)
    spec = importlib.util.spec_from_file_location("usercode", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(path)


def raised(f) -> BaseException:
    try:
        f()
    except Exception as exc:  # noqa: BLE001 - the exception is what is examined
        return exc
    raise AssertionError("did not raise")


def test_the_users_frame_is_the_innermost_outside_torch_and_the_standard_library(tmp_path):
    module, path = user_module(tmp_path)
    record = exception_record(raised(module.bad_view))  # raised by torch's C++ under the user's line
    assert record["type"] == "RuntimeError" and record["message"].startswith("view size is not compatible")
    assert (record["file"], record["line"]) == (path, 7)
    record = exception_record(raised(module.bad_json))  # raised inside json (the standard library)
    assert record["type"] == "json.decoder.JSONDecodeError" and (record["file"], record["line"]) == (path, 11)
    record = exception_record(raised(lambda: module.calls(lambda: dict()["k"])))  # the innermost user frame: here
    assert record["file"] == __file__


def test_an_error_with_no_frame_of_the_users_names_none(tmp_path):
    from dtk.plan.plan import make_plan

    record = exception_record(raised(lambda: make_plan(None)))  # type: ignore[arg-type]
    assert record["file"] == __file__  # this test's own lambda is the only frame outside dtk
    exc = raised(lambda: make_plan(None))  # type: ignore[arg-type]
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # drop this test's frames
        tb = tb.tb_next
    assert tb is not None
    exc.__traceback__ = tb  # dtk's frames alone, as an error inside dtk or torch has
    assert exception_record(exc)["file"] is None and exception_record(exc)["line"] is None


def test_the_record_is_written_to_the_starts_log_folder(tmp_path):
    run = RunDir(tmp_path / "run")
    run.log_dir(1).mkdir(parents=True)
    record_exception(run, start=1, rank=3, exc=raised(lambda: 1 / 0))
    written = json.loads((tmp_path / "run" / "logs" / "start_01" / "error_rank_3.json").read_text())
    assert written == {"rank": 3, "start": 1, "type": "ZeroDivisionError", "message": "division by zero",
                       "file": __file__, "line": written["line"]} and written["line"] > 0


def test_a_user_data_function_that_fails_before_the_first_step_is_a_configuration_error():
    user = SimpleNamespace(kind=DataKind.user, _target_="mydata.load")
    with pytest.raises(UserError, match=r"^data._target_=mydata.load failed before the run's first step:"
                                        r" FileNotFoundError: no such file: data.npy at "):
        with data_function_errors(user, first=True):
            raise FileNotFoundError("no such file: data.npy")
    with pytest.raises(FileNotFoundError):  # after the first step: a crash, for the driver to judge
        with data_function_errors(user, first=False):
            raise FileNotFoundError("no such file: data.npy")
    with pytest.raises(FileNotFoundError):  # dtk's own data: not the user's function
        with data_function_errors(SimpleNamespace(kind=DataKind.hdf5), first=True):
            raise FileNotFoundError("no such file")
