"""`vertexrt doctor` and the startup preflight: simulated Vertex jobs on the GCS server and local disk."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys

import pytest

from vertexrt import cli, doctor, paths
from vertexrt.errors import ConfigError

BUCKET = "vertexrt-test"  # created by the gcs_server fixture


def _by_check(findings):
    out: dict[str, list[doctor.Finding]] = {}
    for finding in findings:
        out.setdefault(finding.check, []).append(finding)
    return out


def _severities(findings, check):
    return [f.severity for f in findings if f.check == check]


@pytest.fixture
def no_mount(monkeypatch, tmp_path):
    """VERTEXRT_FUSE_ROOT points at an empty directory: no bucket is mounted."""
    root = tmp_path / "fuse"
    root.mkdir()
    monkeypatch.setenv("VERTEXRT_FUSE_ROOT", str(root))
    return root


def test_simulated_vertex_job_with_one_broken_bucket(gcs_server, vertex_env, no_mount, capsys):
    (no_mount / BUCKET).mkdir()  # the good bucket is mounted, the broken one is not
    with paths.open(f"gs://{BUCKET}/doctor-data/part-0.jsonl", "w") as handle:
        handle.write('{"x": 1}\n')
    vertex_env(
        base_output_dir=f"gs://{BUCKET}/doctor-job",
        extra={
            "AIP_CHECKPOINT_DIR": "gs://no-such-bucket-7/doctor-job/checkpoints/",
            "AIP_TRAINING_DATA_URI": f"gs://{BUCKET}/doctor-data/part-*.jsonl",
        },
    )
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    print(out)
    assert out.startswith("vertexrt doctor: 1 fatal")
    lines = out.splitlines()
    fatal = [line for line in lines if line.startswith("FATAL")]
    assert len(fatal) == 1
    assert "AIP_CHECKPOINT_DIR=gs://no-such-bucket-7/doctor-job/checkpoints is not writable" in fatal[0]
    assert "the bucket does not exist" in fatal[0]
    assert "gs://no-such-bucket-7 exists" in lines[lines.index(fatal[0]) + 1]  # the fix follows
    assert any(line.startswith("OK") and "AIP_MODEL_DIR" in line and "is writable" in line for line in lines)
    assert any(line.startswith("OK") and "AIP_TRAINING_DATA_URI" in line for line in lines)
    assert any(line.startswith("WARNING") and "mount no-such-bucket-7" in line for line in lines)
    assert not any("mount vertexrt-test" in line and not line.startswith("OK") for line in lines)
    fs, root = paths.filesystem(f"gs://{BUCKET}/doctor-job")
    fs.invalidate_cache()
    assert not [p for p in fs.find(root) if ".vertexrt-doctor" in p]  # the probes were deleted


def test_doctor_json_and_exit_zero_when_healthy(gcs_server, vertex_env, no_mount, capsys):
    vertex_env(base_output_dir=f"gs://{BUCKET}/healthy")
    assert cli.main(["doctor", "--json", "--timeout", "30"]) == 0
    findings = json.loads(capsys.readouterr().out)
    assert {f["severity"] for f in findings} <= {"ok", "warning"}
    checks = {f["check"]: f for f in findings}
    assert checks["output AIP_MODEL_DIR"]["severity"] == "ok"
    assert checks["credentials"]["what"].startswith("STORAGE_EMULATOR_HOST is set")


def test_missing_mount_falls_back_but_warns(gcs_server, vertex_env, no_mount):
    vertex_env(
        extra={
            name: f"/gcs/{BUCKET}/fuse-job/{leaf}/"
            for name, leaf in (
                ("AIP_MODEL_DIR", "model"),
                ("AIP_CHECKPOINT_DIR", "checkpoints"),
                ("AIP_TENSORBOARD_LOG_DIR", "logs"),
            )
        }
    )
    findings = doctor.check(timeout=30)
    mount = _by_check(findings)[f"mount {BUCKET}"]
    assert [f.severity for f in mount] == ["warning"]
    assert "has no " + str(no_mount / BUCKET) in mount[0].what
    assert _severities(findings, "output AIP_MODEL_DIR") == ["ok"]  # written through the API instead


def test_mounted_bucket_answers(vertex_env, no_mount):
    (no_mount / "mounted-bkt").mkdir()
    vertex_env(extra={"AIP_MODEL_DIR": "/gcs/mounted-bkt/job/model/"})
    findings = doctor.check(timeout=30)
    assert _severities(findings, "mount mounted-bkt") == ["ok"]
    assert _severities(findings, "output AIP_MODEL_DIR") == ["ok"]
    assert not list((no_mount / "mounted-bkt" / "job" / "model").iterdir())  # probe deleted


def test_read_only_output_dir_is_fatal(clean_env, monkeypatch, tmp_path):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(stat.S_IRUSR | stat.S_IXUSR)
    # root ignores file modes: /sys is a filesystem nobody may create files in
    target = "/sys/vertexrt-doctor/model" if os.geteuid() == 0 else str(readonly / "model")
    monkeypatch.setenv("CLOUD_ML_JOB_ID", "1")
    monkeypatch.setenv("CLOUD_ML_PROJECT_ID", "123")
    monkeypatch.setenv("AIP_MODEL_DIR", target)
    findings = doctor.check(timeout=30)
    [finding] = [f for f in findings if f.check == "output AIP_MODEL_DIR"]
    assert finding.severity == "fatal"
    assert f"AIP_MODEL_DIR={target} is not writable" in finding.what
    assert "point AIP_MODEL_DIR" in finding.fix


def test_preflight_raises_one_clear_error_on_fatal_findings(gcs_server, vertex_env, no_mount):
    vertex_env(
        base_output_dir=f"gs://{BUCKET}/preflight",
        extra={"AIP_TRAINING_DATA_URI": f"gs://{BUCKET}/preflight-missing/*.csv"},
    )
    with pytest.raises(ConfigError, match="preflight found 1 problem") as info:
        doctor.preflight(timeout=30)
    assert "AIP_TRAINING_DATA_URI" in str(info.value) and "matches no file or object" in str(info.value)
    assert "vertexrt doctor" in str(info.value)


def test_preflight_logs_each_warning_once(clean_env, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("NCCL_DEBUG", "LOUD")
    caplog.set_level(logging.WARNING, logger="vertexrt.doctor")
    for _ in range(2):
        findings = doctor.preflight(timeout=30)
    assert any(f.check == "nccl" and f.severity == "warning" for f in findings)
    assert sum("NCCL_DEBUG='LOUD'" in r.getMessage() for r in caplog.records) == 1


def test_a_stalled_bucket_is_a_finding_not_a_hang(fault_proxy, vertex_env, no_mount):
    vertex_env(base_output_dir=f"gs://{BUCKET}/stalled")
    fault_proxy.set("stall")
    findings = doctor.check(timeout=1.0)
    stalled = _by_check(findings)["output AIP_MODEL_DIR"]
    assert [(f.severity, f.what) for f in stalled] == [("warning", "did not answer within 1 s")]
    assert _severities(findings, "nccl") == ["ok"]  # the other checks still answered


def test_data_uris_on_each_storage(storage_root, clean_env, monkeypatch):
    with paths.open(paths.join(storage_root, "train", "part-0.csv"), "w") as handle:
        handle.write("a\n1\n")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "p")
    cases = {
        "AIP_TRAINING_DATA_URI": (paths.join(storage_root, "train", "part-*.csv"), "ok"),
        "AIP_VALIDATION_DATA_URI": (paths.join(storage_root, "train"), "ok"),
        "AIP_TEST_DATA_URI": (paths.join(storage_root, "nothing-here", "*.csv"), "fatal"),
    }
    for name, (uri, _) in cases.items():
        monkeypatch.setenv(name, uri)
    findings = doctor.check(timeout=30)
    for name, (_, severity) in cases.items():
        assert _severities(findings, f"data {name}") == [severity]


def test_output_dirs_on_each_storage_are_probed_and_cleaned(storage_root, clean_env, monkeypatch):
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "p")
    for name, leaf in (("AIP_MODEL_DIR", "m"), ("AIP_CHECKPOINT_DIR", "c"), ("AIP_TENSORBOARD_LOG_DIR", "l")):
        monkeypatch.setenv(name, paths.join(storage_root, leaf))
    findings = doctor.check(timeout=30)
    for name in ("AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR"):
        assert _severities(findings, f"output {name}") == ["ok"]
    fs, root = paths.filesystem(storage_root)
    fs.invalidate_cache()
    assert not [p for p in fs.find(root) if ".vertexrt-doctor" in p]


# -- GPUs: a stand-in nvidia-smi on PATH --------------------------------------------------------------


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        "echo '0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559'\n"
        "echo '1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559'\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    # this machine's torch (CPU build, imported by earlier tests) sees no GPU: only nvidia-smi answers here
    monkeypatch.delitem(sys.modules, "torch", raising=False)


@pytest.mark.parametrize(
    ("visible", "processes", "expected"),
    [
        (None, 2, [("ok", "2 GPU(s) for 2 process(es)")]),
        (None, 4, [("fatal", "4 processes on this node but only 2 visible GPU(s)")]),
        (None, 1, [("warning", "2 GPUs are visible but this node runs 1 training process(es)")]),
        ("0,x,1", 1, [("warning", "CUDA stops at the invalid entry 'x'"), ("ok", "1 GPU(s) for 1")]),
        ("0,5", 1, [("warning", "lists 2 GPU(s) but only 1 of them exist"), ("ok", "1 GPU(s)")]),
        ("", 1, [("ok", "no GPU visible")]),
    ],
)
def test_gpus_visible_vs_expected(two_gpus, visible, processes, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    findings = doctor.gpus(environ, processes)
    assert [f.severity for f in findings] == [s for s, _ in expected]
    for finding, (_, text) in zip(findings, expected, strict=True):
        assert text in finding.what


def test_no_gpu_machine_is_fine(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert [(f.severity, f.what) for f in doctor.gpus({}, 1)] == [
        ("ok", "no GPU visible: training runs on the CPU")
    ]


# -- shared memory, disk, NCCL ------------------------------------------------------------------------


def test_small_shm_warns(tmp_path):
    [small] = doctor.shm(str(tmp_path), minimum=1 << 60)
    assert small.severity == "warning" and "bus error" in small.what and "--shm-size" in small.fix
    assert doctor.shm(str(tmp_path), minimum=1)[0].severity == "ok"
    assert doctor.shm(str(tmp_path / "absent"))[0].severity == "warning"


def test_disk_too_small_for_the_last_checkpoint(tmp_path):
    step = tmp_path / "ckpt" / "step_0000000002"
    step.mkdir(parents=True)
    (tmp_path / "ckpt" / "step_0000000001").mkdir()
    with open(step / "data.bin", "wb") as handle:  # a sparse file: 1 TiB by size, no disk used
        handle.truncate(1 << 40)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    [finding] = doctor.disk(str(tmp_path / "ckpt"))
    if free >= 1 << 40:
        pytest.skip("this disk has more than 1 TiB free")
    assert finding.severity == "fatal"
    assert "step_0000000002 is 1.0 TiB" in finding.what and "KeepLast" in finding.fix
    (step / "data.bin").unlink()
    assert doctor.disk(str(tmp_path / "ckpt"))[0].severity == "ok"
    assert doctor.disk(str(tmp_path / "not-yet"))[0].severity == "ok"
    assert doctor.disk("gs://b12/ckpt") == []


@pytest.mark.parametrize(
    ("environ", "text"),
    [
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_ASYNC_ERROR_HANDLING": "0"}, "disagree"),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "only one takes effect"),
        ({"NCCL_IB_DISABLE": "1", "NCCL_IB_HCA": "mlx5_0"}, "InfiniBand is off"),
        ({"NCCL_IB_DISABLE": "1", "NCCL_NET": "IB"}, "NCCL cannot initialise"),
        ({"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "NVL"}, "peer-to-peer is off"),
        ({"NCCL_DEBUG": "verbose"}, "not a level"),
        ({"NCCL_SOCKET_IFNAME": "ens9"}, "matches no network interface"),
        ({"NCCL_SOCKET_IFNAME": "=eth"}, "matches no network interface"),
    ],
)
def test_contradicting_nccl_variables(environ, text):
    [finding] = doctor.nccl(environ, ["lo", "eth0"])
    assert finding.severity == "warning" and text in finding.what


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"NCCL_SOCKET_IFNAME": "eth", "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        {"NCCL_SOCKET_IFNAME": "^docker,lo"},
        {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5"},
    ],
)
def test_consistent_nccl_variables(environ):
    assert [f.severity for f in doctor.nccl(environ, ["lo", "eth0"])] == ["ok"]


@pytest.fixture
def append_only_dir(tmp_path):
    """A directory where files can be created but not deleted (``chattr +a``), even by root."""
    import shutil
    import subprocess

    folder = tmp_path / "append-only"
    folder.mkdir()
    if not shutil.which("chattr") or subprocess.run(["chattr", "+a", str(folder)], check=False).returncode:
        pytest.skip("chattr +a is not available here")
    yield folder
    subprocess.run(["chattr", "-a", str(folder)], check=True)


def test_a_writable_dir_that_refuses_deletes_is_not_reported_unwritable(append_only_dir, clean_env):
    # Write allowed, delete refused (a create-only service account): the job can write its outputs, so the
    # preflight must not stop it as "not writable"; it says which probe was left and why.
    [finding] = doctor.writable("AIP_MODEL_DIR", str(append_only_dir))
    [probe] = list(append_only_dir.iterdir())
    assert finding.severity == "warning", finding
    assert "is writable" in finding.what and "could not be deleted" in finding.what
    assert probe.name in finding.what
    assert "delete" in finding.fix


@pytest.mark.parametrize("on_vertex", [False, True])
def test_missing_credentials_file_is_named_fatal_locally_and_a_warning_on_vertex(
    on_vertex, vertex_env, clean_env, monkeypatch, tmp_path
):
    missing = tmp_path / "no-such-key.json"
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(missing))
    if on_vertex:
        vertex_env(base_output_dir="gs://some-bucket/job")
    else:
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "my-project")
    from vertexrt.env import environment

    (finding,) = [
        f
        for f in doctor.credentials(environment(), ["gs://some-bucket/job/model"])
        if f.check == "credentials"
    ]
    assert finding.severity == ("warning" if on_vertex else "fatal")
    assert "no Google Cloud credentials" in finding.what and str(missing) in finding.what
    assert "GOOGLE_APPLICATION_CREDENTIALS" in finding.fix
