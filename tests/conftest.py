"""Shared fixtures: a real GCS-compatible server on loopback, a storage root on local disk and on it, and
builders for simulated Vertex environments."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator

import pytest

# Must be set before anything imports gcsfs (its "extended" class stalls 60 s per call on emulators).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from bqemulator_launcher import BigQueryEmulator  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402

from vertexrt.emulator import GCSServer  # noqa: E402
from vertexrt.env import CONTRACT_VARIABLES  # noqa: E402

TEST_BUCKET = "vertexrt-test"


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    """fake-gcs-server for the whole session; STORAGE_EMULATOR_HOST points at it (subprocesses too)."""
    log = str(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log")
    server = GCSServer(buckets=[TEST_BUCKET], log_path=log).start()
    server.bucket = TEST_BUCKET  # type: ignore[attr-defined]
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
    try:
        yield server
    finally:
        server.stop()
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous


@pytest.fixture(scope="session")
def bq_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[bool], BigQueryEmulator]]:
    """``bq_emulator(honour_offset)``: a bqemulator (REST + gRPC Storage Read) for the session, one per mode,
    from its own venv (``make install`` makes ``.venv/bqemu``); reads of its table ``flaky`` break once, and
    each read session of its table ``resplit`` splits it into streams differently."""
    python = os.environ.get("VERTEXRT_BQEMU_PYTHON") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "bqemu", "bin", "python"
    )
    running: dict[bool, BigQueryEmulator] = {}

    def get(honour_offset: bool) -> BigQueryEmulator:
        if not os.path.exists(python):
            pytest.fail(f"no bqemulator venv at {python}: run `make install`")
        if honour_offset not in running:
            log = str(tmp_path_factory.mktemp("bq") / "bqemulator.log")
            running[honour_offset] = BigQueryEmulator(
                python, log, honour_offset, fail_table="flaky", resplit_table="resplit"
            ).start()
        return running[honour_offset]

    try:
        yield get
    finally:
        for emulator in running.values():
            emulator.stop()


@pytest.fixture
def fault_proxy(gcs_server: GCSServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the GCS server; STORAGE_EMULATOR_HOST points at it for the test.

    Example: ``fault_proxy.set("stall")`` and every Cloud Storage call from then on gets no answer.
    """
    with FaultProxy(("127.0.0.1", gcs_server.port)) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        yield proxy


@pytest.fixture(params=["local", "gcs"])
def storage_root(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty root: a local directory, or a prefix in a bucket on the GCS server."""
    if request.param == "local":
        root = tmp_path / "root"
        root.mkdir()
        return str(root)
    request.getfixturevalue("gcs_server")
    return f"gs://{TEST_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No platform contract variable is set; local outputs go under tmp_path; argv has no --job-dir."""
    for name in CONTRACT_VARIABLES:
        if name not in ("STORAGE_EMULATOR_HOST", "VERTEXRT_FUSE_ROOT"):
            monkeypatch.delenv(name, raising=False)
    for name in ("GOOGLE_CLOUD_REGION", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VERTEXRT_LOCAL_DIR", str(tmp_path / "vertexrt_output"))
    monkeypatch.setattr("sys.argv", ["train.py"])


@pytest.fixture
def vertex_env(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> Callable[..., dict[str, str]]:
    """Build a simulated Vertex job environment; returns the variables it set.

    Example: ``vertex_env(trial="3", base_output_dir="gs://b/base", workers=2, task=("workerpool1", 0))``
    """

    def build(
        *,
        job_id: str = "1234567890",
        project: str = "123456789012",
        region: str = "us-central1",
        trial: str | None = None,
        base_output_dir: str | None = None,
        workers: int = 0,
        evaluators: int = 0,
        task: tuple[str, int] = ("workerpool0", 0),
        extra: dict[str, str] | None = None,
    ) -> dict[str, str]:
        monkeypatch.delenv("VERTEXRT_LOCAL_DIR", raising=False)
        variables = {"CLOUD_ML_JOB_ID": job_id, "CLOUD_ML_PROJECT_ID": project, "CLOUD_ML_REGION": region}
        if trial:
            variables["CLOUD_ML_TRIAL_ID"] = trial
        if base_output_dir:
            base = base_output_dir.rstrip("/") + (f"/{trial}" if trial else "")
            variables["AIP_MODEL_DIR"] = f"{base}/model/"
            variables["AIP_CHECKPOINT_DIR"] = f"{base}/checkpoints/"
            variables["AIP_TENSORBOARD_LOG_DIR"] = f"{base}/logs/"
        cluster = {"workerpool0": ["cmle-training-workerpool0-ab12cd34ef-0:2222"]}
        if workers:
            cluster["workerpool1"] = [
                f"cmle-training-workerpool1-ab12cd34ef-{i}:2222" for i in range(workers)
            ]
        if evaluators:
            cluster["workerpool3"] = [
                f"cmle-training-workerpool3-ab12cd34ef-{i}:2222" for i in range(evaluators)
            ]
        task_entry = {"type": task[0], "index": task[1], "trial": trial or ""}
        variables["CLUSTER_SPEC"] = json.dumps(
            {"cluster": cluster, "environment": "cloud", "task": task_entry, "job": {}}
        )
        if workers:
            tf_names = {"workerpool0": "chief", "workerpool1": "worker", "workerpool3": "evaluator"}
            tf_cluster = {tf_names[pool]: hosts for pool, hosts in cluster.items() if pool != "workerpool3"}
            variables["TF_CONFIG"] = json.dumps(
                {
                    "cluster": tf_cluster,
                    "environment": "cloud",
                    "task": {"type": tf_names[task[0]], "index": task[1], "trial": trial or ""},
                    "job": {},
                }
            )
            variables.update(
                MASTER_ADDR=cluster["workerpool0"][0].split(":")[0],
                MASTER_PORT="2222",
                WORLD_SIZE=str(1 + workers),
            )
            if task[0] in ("workerpool0", "workerpool1"):
                variables["RANK"] = str(0 if task[0] == "workerpool0" else task[1] + 1)
        variables.update(extra or {})
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return variables

    return build
