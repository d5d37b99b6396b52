"""TensorFlow bootstrapping: ``TF_CONFIG`` from the cluster, and the right ``tf.distribute`` strategy.

Call :func:`setup_tensorflow` first thing in ``main()``: multi-worker collectives must be configured before
TensorFlow runs its first op.

Keras on TF 2.21: Keras 3 ``model.fit`` fails under ``MultiWorkerMirroredStrategy`` (``ValueError: Attempt
to convert a value (PerReplica...) to a Tensor``). Two things work: tf-keras (``pip install --no-deps
tf-keras==2.21.0``) with ``setup_tensorflow(legacy_keras=True)`` (or ``TF_USE_LEGACY_KERAS=1``) and
``tf.keras`` models, or Keras 3 models trained by a custom loop (``strategy.run`` + ``GradientTape``).

Example:
    >>> from vertexrt.distributed import setup_tensorflow
    >>> strategy = setup_tensorflow(legacy_keras=True)   # before any other TensorFlow call
    >>> import tensorflow as tf
    >>> with strategy.scope():
    ...     model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from vertexrt.distributed import rendezvous
from vertexrt.distributed.cluster_model import Cluster
from vertexrt.distributed.detection import cluster as current_cluster
from vertexrt.errors import ClusterSpecError, ConfigError

logger = logging.getLogger(__name__)

STRATEGIES = ("auto", "multi_worker_mirrored", "parameter_server", "mirrored", "default")
#: What TensorFlow's ``TFConfigClusterResolver`` reads from TF_CONFIG beside cluster and task.
_RESOLVER_KEYS = ("rpc_layer", "session_master")
_TF_TASK_TYPES = {"chief": "chief", "worker": "worker", "ps": "ps", "evaluator": "evaluator"}

KERAS_ADVICE = (
    "Keras 3 (the tf.keras of TensorFlow >= 2.16) fails in model.fit/evaluate/predict under "
    "MultiWorkerMirroredStrategy on TF 2.21 (ValueError: Attempt to convert a value (PerReplica...) to a "
    "Tensor). Use tf-keras: `pip install --no-deps tf-keras==<your TF version>` and "
    "@vertexrt.main(framework='tf', legacy_keras=True) (or setup_tensorflow(legacy_keras=True), or "
    "TF_USE_LEGACY_KERAS=1 before the first use of tf.keras), then build models with tf.keras; or keep "
    "Keras 3 and train with a custom loop (strategy.run + tf.GradientTape). Pass legacy_keras=False (to "
    "@vertexrt.main or setup_tensorflow) to silence this warning."
)


def tf_config(cluster: Cluster | None = None, *, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``TF_CONFIG`` dict ``tf.distribute`` expects for this task; ``{}`` when there is no cluster.

    Pools map to TensorFlow task types: workerpool0 -> ``chief``, workerpool1 -> ``worker``, workerpool2 ->
    ``ps``; evaluators appear only as ``task.type`` and Reduction Server replicas not at all. ``rpc_layer``
    and ``session_master`` of the ``TF_CONFIG`` in ``environ`` are kept. Without ``cluster``, the cluster
    is read from ``environ`` (default ``os.environ``); a ``cluster`` built elsewhere (e.g.
    ``cluster(mapping)``) takes nothing from ``os.environ``: pass ``environ=mapping`` for its keys.

    Example:
        >>> tf_config()   # single process
        {}
    """
    if cluster is None:
        environ = os.environ if environ is None else environ
        c = current_cluster(environ)
    else:
        c = cluster
    if c.role == "reduction_server":
        raise ConfigError("this replica is a Reduction Server replica: it runs no TensorFlow program")
    pools = {p.role: list(p.addresses) for p in c.pools if p.role in ("chief", "worker", "ps")}
    if not pools:
        if c.num_nodes == 1:
            return {}
        raise ClusterSpecError(
            f"the cluster comes from {c.source}, which does not list every replica's address; TensorFlow "
            "needs them: run under CLUSTER_SPEC or TF_CONFIG (Vertex, `vertexrt local-run`)"
        )
    if c.num_nodes == 1 and "ps" not in pools and c.role != "evaluator":
        return {}  # Vertex sets no TF_CONFIG on single-replica jobs
    config: dict[str, Any] = {
        "cluster": pools,
        "task": {"type": _TF_TASK_TYPES[c.role], "index": c.task_index},
    }
    if c.trial_id is not None:
        config["task"]["trial"] = c.trial_id
    existing = _extra_keys((environ or {}).get("TF_CONFIG"))
    config.update({k: existing[k] for k in _RESOLVER_KEYS if isinstance(existing.get(k), str)})
    return config


def setup_tensorflow(
    strategy: str = "auto", *, cluster: Cluster | None = None, legacy_keras: bool | None = None
) -> Any:
    """Write ``TF_CONFIG`` for this task and return the ``tf.distribute.Strategy`` the cluster needs.

    ``auto``: the default strategy on evaluators; ``ParameterServerStrategy`` when a ``ps`` pool exists
    (on ``ps`` and ``worker`` tasks this call starts the TensorFlow server and never returns, as TF's
    parameter-server training requires); ``MultiWorkerMirroredStrategy`` for several training nodes;
    ``MirroredStrategy`` for several local GPUs; else the default strategy.

    Args:
        strategy: one of ``auto``, ``multi_worker_mirrored``, ``parameter_server``, ``mirrored``, ``default``.
        cluster: the cluster to use (default :func:`vertexrt.distributed.cluster`).
        legacy_keras: ``True`` routes ``tf.keras`` to tf-keras (``TF_USE_LEGACY_KERAS=1``), which
            ``model.fit`` under multi-worker strategies needs on TF 2.21; ``None`` warns when Keras 3 would
            meet a multi-worker strategy; ``False`` keeps Keras 3 silently.

    Raises:
        ConfigError: unknown strategy, TensorFlow already initialised, or tf-keras missing.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"setup_tensorflow(strategy={strategy!r}): expected one of {', '.join(STRATEGIES)}")
    c = current_cluster() if cluster is None else cluster
    config = tf_config(c)
    if strategy in ("multi_worker_mirrored", "parameter_server") and not config:
        raise ConfigError(
            f"setup_tensorflow(strategy={strategy!r}) needs a multi-replica cluster, but this process is a "
            f"single {c.source} replica; use strategy='auto' or run under `vertexrt local-run --workers N`"
        )
    if config:
        os.environ["TF_CONFIG"] = json.dumps({**_extra_keys(os.environ.get("TF_CONFIG")), **config})
    import tensorflow as tf

    chosen = _choose(strategy, c, config, tf)
    _steer_keras(tf, chosen, legacy_keras)
    logger.info("TensorFlow strategy %s for %s[%d] (cluster from %s)", chosen, c.role, c.task_index, c.source)
    if chosen == "multi_worker_mirrored":
        deadline = rendezvous.Deadline.from_environment()
        _wait_for_chief(c, deadline)
        return _multi_worker_mirrored(tf, c, deadline)
    if chosen == "parameter_server":
        return _parameter_server(tf, c)
    if chosen == "mirrored":
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def _wait_for_chief(c: Cluster, deadline: rendezvous.Deadline) -> None:
    """On a worker: wait until the chief's address resolves and its server listens (patient rendezvous,
    :mod:`vertexrt.distributed.rendezvous`), before TensorFlow's constructor starts its own, unbounded wait.
    The chief opens its port in that constructor, so it does not wait here."""
    chief_is_worker_0 = c.pool("chief") is None and (c.role, c.task_index) == ("worker", 0)
    if c.role == "chief" or chief_is_worker_0 or c.chief_address is None:
        return
    host, _, port = c.chief_address.rpartition(":")
    rendezvous.wait_for_address(host.strip("[]"), int(port), deadline)


def _extra_keys(existing: str | None) -> dict[str, Any]:
    """What an existing TF_CONFIG says beside cluster and task (``rpc_layer``, ``environment``...)."""
    try:
        doc = json.loads(existing or "{}")
    except ValueError:
        return {}
    return {k: v for k, v in doc.items() if k not in ("cluster", "task")} if isinstance(doc, dict) else {}


def _choose(strategy: str, c: Cluster, config: dict[str, Any], tf: Any) -> str:
    has_ps = "ps" in config.get("cluster", {})
    if strategy != "auto":
        return strategy
    if c.role == "evaluator":
        return "default"
    if has_ps:
        return "parameter_server"
    if c.num_nodes > 1:
        return "multi_worker_mirrored"
    if len(tf.config.list_physical_devices("GPU")) > 1:
        return "mirrored"
    return "default"


def _multi_worker_mirrored(tf: Any, c: Cluster, deadline: rendezvous.Deadline) -> Any:
    from tensorflow.python.eager import context

    ordering = (
        "setup_tensorflow() must run before TensorFlow executes its first op (a tensor, a model, a dataset "
        "iteration): multi-worker collectives are configured once, at TensorFlow's startup. Call it first "
        "thing in main(), before building models or data pipelines"
    )
    if context.context()._initialized:
        raise ConfigError(f"TensorFlow has already run ops in this process. {ordering}")
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    # The constructor waits, without a bound and holding the GIL, until every task of the cluster has
    # connected: a task that never starts would hang this replica for good. A C-level timer (no Python
    # thread can run meanwhile) dumps the stacks and exits 1: Vertex ends the job instead of billing a hang.
    remaining = max(deadline.remaining(), 1.0)
    tasks = sum(len(p.addresses) for p in c.pools if p.role in ("chief", "worker"))
    logger.info(
        "MultiWorkerMirroredStrategy: waiting for the cluster's %d tasks, at most %.0f s (%s); past that "
        "this replica exits with code 1 after a stack dump: a task did not start, see its log",
        tasks,
        remaining,
        rendezvous.VARIABLE,
    )
    faulthandler.dump_traceback_later(remaining, exit=True)
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    except RuntimeError as err:
        if "program startup" in str(err):
            raise ConfigError(f"TensorFlow refused the multi-worker setup ({err}). {ordering}") from None
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()


def _parameter_server(tf: Any, c: Cluster) -> Any:
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if c.role in ("ps", "worker"):
        server = tf.distribute.Server(
            resolver.cluster_spec(),
            job_name=resolver.task_type,
            task_index=resolver.task_id,
            protocol=resolver.rpc_layer or "grpc",
            start=True,
        )
        logger.info("serving as %s %d for the parameter-server coordinator", c.role, c.task_index)
        server.join()  # never returns: the chief drives training and the job ends when it exits
    return tf.distribute.experimental.ParameterServerStrategy(resolver)


def keras_flavour(tf: Any) -> str:
    """What ``tf.keras`` is: ``"tf_keras"``, ``"keras_3"``, or ``"unresolved"`` (not used yet)."""
    keras = tf.__dict__.get("keras")
    if keras is not None and not getattr(keras, "_tfll_initialized", True):
        return "unresolved"
    return "tf_keras" if tf.keras.__name__.startswith("tf_keras") else "keras_3"


def _legacy_requested() -> bool:
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


def _steer_keras(tf: Any, chosen: str, legacy_keras: bool | None) -> None:
    flavour = keras_flavour(tf)
    if legacy_keras:
        if flavour == "keras_3":
            raise ConfigError(
                "setup_tensorflow(legacy_keras=True): tf.keras was already used and resolved to Keras 3. "
                "Call setup_tensorflow() before the first use of tf.keras, or set "
                "TF_USE_LEGACY_KERAS=1 at start"
            )
        if importlib.util.find_spec("tf_keras") is None:
            raise ConfigError(
                "setup_tensorflow(legacy_keras=True) needs the tf-keras package: "
                f"`pip install --no-deps tf-keras=={tf.__version__}` (--no-deps keeps tensorflow-cpu as is)"
            )
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        return
    if legacy_keras is None and chosen == "multi_worker_mirrored":
        uses_keras_3 = flavour == "keras_3" or (
            flavour == "unresolved" and not (_legacy_requested() and importlib.util.find_spec("tf_keras"))
        )
        if uses_keras_3:
            logger.warning(KERAS_ADVICE)
