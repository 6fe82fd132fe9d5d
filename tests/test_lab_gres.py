"""The GPU-shaped lab's files (dtk.lab.gres): node lines with two sockets and GRES gpu:G,
and a gres.conf that puts half the GPUs on each socket's cores. The lab run itself is in
tests/test_gpu_lab.py."""

from __future__ import annotations

import stat

import pytest

from dtk.lab import files, gres


def test_a_gpu_lab_declares_gres_and_two_sockets(tmp_path):
    conf = files.render_slurm_conf(files.LabLayout(tmp_path), 2, gpus_per_node=8)
    assert "GresTypes=gpu" in conf
    assert ("NodeName=node[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001-17002 Sockets=2"
            " CoresPerSocket=4 ThreadsPerCore=1 Gres=gpu:8 RealMemory=") in conf
    plain = files.render_slurm_conf(files.LabLayout(tmp_path), 2)
    assert "GresTypes" not in plain.replace("# No GPUs", "") and " CPUs=2 " in plain and "$" not in plain


def test_gres_conf_puts_gpus_0_to_3_on_socket_0_and_4_to_7_on_socket_1(tmp_path):
    shape = gres.node_shape(8, files.CPUS_PER_NODE)
    text = gres.render_gres_conf(files.CONF_HEADER, lab_root=tmp_path, nodes="node[1-2]", shape=shape)
    assert text.splitlines()[0] == files.CONF_HEADER and "AutoDetect=off" in text
    assert f"NodeName=node[1-2] Name=gpu File={tmp_path}/dev/nvidia[0-3] Cores=0-3" in text
    assert f"NodeName=node[1-2] Name=gpu File={tmp_path}/dev/nvidia[4-7] Cores=4-7" in text
    made = gres.make_devices(tmp_path, 8)
    assert [p.name for p in made] == [f"nvidia{k}" for k in range(8)]
    mode = made[3].stat().st_mode
    assert stat.S_ISCHR(mode) or stat.S_ISREG(mode)  # a plain file where mknod is not allowed
    assert gres.make_devices(tmp_path, 0) == [] and not list((tmp_path / "dev").iterdir())


def test_odd_gpu_counts_are_refused():
    assert gres.node_shape(1, 2).sockets == 1
    with pytest.raises(ValueError, match="0, 1 or an even count"):
        gres.node_shape(3, 2)
