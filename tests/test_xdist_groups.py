"""The README's test command keeps the lab's tests in one xdist worker (tests/conftest.py):
the groups, and a real `-n 2 --dist loadgroup` run of a small suite with this conftest."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, group_of

LAB = {"tests/test_a.py::test_1", "tests/test_b.py::test_3[x]"}


def test_lab_tests_share_one_group_and_other_tests_their_files():
    assert group_of("tests/test_a.py::test_1", LAB) == "lab"
    assert group_of("tests/test_b.py::test_3[x]", LAB) == "lab"
    assert group_of("tests/test_a.py::test_2", LAB) == "tests/test_a.py"
    assert group_of("tests/test_b.py::K::test_4[a@b]", LAB) == "tests/test_b.py"  # an @ inside a parameter
    assert group_of("tests/test_b.py::test_5@mine", LAB) == "mine"  # xdist's own ID@GROUP form


@pytest.mark.slow
def test_a_loadgroup_run_puts_every_lab_test_in_one_worker(tmp_path):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: the lab\n")
    for name in "abc":
        (tmp_path / f"test_{name}.py").write_text(
            "import pytest\n\n@pytest.mark.slurm\ndef test_lab(): pass\n\n"
            + "".join(f"def test_{i}(): pass\n\n" for i in range(3)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                           "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    workers: dict[str, set[str]] = {}
    for worker, test in re.findall(r"\[(gw\d)\].*PASSED (\S+)", proc.stdout):
        workers.setdefault(test.split("::")[1] if test.endswith("test_lab") else test.split("::")[0], set()).add(worker)
    assert sorted(workers) == ["test_a.py", "test_b.py", "test_c.py", "test_lab"], proc.stdout
    assert all(len(found) == 1 for found in workers.values()), workers
