"""CheckpointManager: policy-driven, atomic, asynchronous, preemption-aware checkpoints of any state tree.

Example:
    >>> from vertexrt.checkpoint import CheckpointManager, EveryNSteps, KeepLast, rng_state
    >>> state = {"model": model, "opt": opt, "step": 0, "rng": rng_state()}
    >>> with CheckpointManager("gs://bucket/run/ckpt", save_policy=EveryNSteps(500),
    ...                        keep_policy=KeepLast(3)) as mgr:
    ...     restored = mgr.restore(target=state)          # None on a fresh start
    ...     start = restored["step"] + 1 if restored else 0
    ...     for step in range(start, total):
    ...         train_step()
    ...         state["step"] = step
    ...         mgr.save(step, state, metrics={"loss": loss})
"""

from __future__ import annotations

import logging
import operator
import sys
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from vertexrt.checkpoint import collective, datafiles, serialization, storage
from vertexrt.checkpoint.datafiles import CheckpointCorruptError
from vertexrt.checkpoint.policies import (
    AnySave,
    CheckpointInfo,
    EveryNSteps,
    KeepLast,
    KeepPolicy,
    LastSave,
    SavePolicy,
)
from vertexrt.checkpoint.preemption import PreemptionNotice
from vertexrt.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

FORMAT = "vertexrt.checkpoint"
FORMAT_VERSION = 1


class CheckpointManager:
    """Saves and restores training state under ``directory`` (local path, ``/gcs/...`` or ``gs://...``).

    Args:
        directory: where the ``step_<N>`` directories live; default ``environment().checkpoint_dir``.
        save_policy: when ``save()`` really saves (default ``EveryNSteps(1)``: every call).
        keep_policy: which committed steps survive (default ``KeepLast(3)``; the newest is always kept).
        async_save: snapshot on the caller's thread, write on a background thread (one save in flight).
        rank, world_size: this process's place; default torch.distributed, else ``vertexrt.distributed``.
        allow_pickle: pickle objects that are not tensors/arrays/JSON values (and unpickle them on restore).
        save_on_preemption: install the SIGTERM flag handler now (see :meth:`save_on_preemption`).
        stale_after: seconds after which another host's unfinished save counts as abandoned.
        commit_timeout: seconds the chief waits for every rank's shard before giving up a sharded save.
    """

    def __init__(
        self,
        directory: str | None = None,
        save_policy: SavePolicy | None = None,
        keep_policy: KeepPolicy | None = None,
        async_save: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        allow_pickle: bool = False,
        save_on_preemption: bool = False,
        stale_after: float = 600.0,
        commit_timeout: float = 1800.0,
    ) -> None:
        if directory is None:
            from vertexrt.env import environment

            directory = environment().checkpoint_dir
        self.directory = str(directory)
        self.save_policy: SavePolicy = save_policy if save_policy is not None else EveryNSteps(1)
        self.keep_policy: KeepPolicy = keep_policy if keep_policy is not None else KeepLast(3)
        for name, policy, method in (
            ("save_policy", self.save_policy, "should_save"),
            ("keep_policy", self.keep_policy, "keep"),
        ):
            if not callable(getattr(policy, method, None)):
                raise ConfigError(f"CheckpointManager({name}={policy!r}): it needs a {method}() method")
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.commit_timeout = commit_timeout
        self.rank, self.world_size = collective.resolve(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"CheckpointManager: rank {self.rank} is outside world_size {self.world_size}")
        self._strategy = storage.strategy_for(self.directory, stale_after)
        self._start = time.time()
        self._last: tuple[int | None, float | None] = (None, None)  # (step, time) of the previous save
        self._infos: dict[int, CheckpointInfo] = {}
        self._thread: threading.Thread | None = None
        self._deleter: threading.Thread | None = None  # retention runs after the commit, off the caller
        self._error: BaseException | None = None
        self._arena: Any = None
        self._notice: PreemptionNotice | None = None
        self._closed = False
        self.restored_step: int | None = None
        if self.rank == 0:
            removed = self._strategy.cleanup()
            if removed:
                log.info("removed unfinished checkpoint leftovers in %s: %s", self.directory, removed)
        if save_on_preemption:
            self.save_on_preemption()

    # -- reading -------------------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (not verified; see :meth:`latest_step`)."""
        self._join_deleter()
        return self._strategy.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step whose manifest reads and whose data files are all present, or None."""
        self._raise_finished_error()
        self._join_deleter()
        for step in reversed(self._strategy.committed_steps()):
            try:
                self._check_files(step, self._manifest(step))
                return step
            except CheckpointCorruptError as exc:
                log.warning("checkpoint step %d in %s is unusable: %s", step, self.directory, exc)
        return None

    def metadata(self, step: int) -> dict[str, Any]:
        """A committed step's manifest fields (``step``, ``time``, ``metrics``, ``frameworks``, ...)."""
        manifest = self._manifest(step)
        return {k: v for k, v in manifest.items() if k != "shards"}

    def restore(self, target: Any = None, step: int | None = None, shard: int | None = None) -> Any:
        """Load the newest valid checkpoint (or ``step``); returns None when there is none.

        With ``target`` (a state tree of live objects), modules, optimizers, tensors, arrays, TF variables,
        Keras models and ``state_dict`` objects are loaded in place and the returned tree holds them; other
        values are returned as read. All bytes are read and checksummed before anything is loaded. On local
        disk, returned tensors/arrays are views of a private copy-on-write memory map of the data files
        (writable; writes never reach the checkpoint; valid after the step is deleted).

        A corrupt or incomplete step is skipped with a warning naming the file, and the previous committed
        step is tried (not when ``step`` is given: then the error is raised). ``shard`` (default: this rank
        for sharded checkpoints) picks the per-rank shard.

        Raises:
            CheckpointError: no step could be read, a newer format, or the target does not match.
        """
        self.wait()
        candidates = [step] if step is not None else list(reversed(self._strategy.committed_steps()))
        failures = []
        for candidate in candidates:
            try:
                result = self._restore_step(candidate, target, shard)
            except CheckpointCorruptError as exc:
                if step is not None:
                    raise
                log.warning(
                    "skipping checkpoint step %d in %s and falling back to an earlier step: %s",
                    candidate,
                    self.directory,
                    exc,
                )
                failures.append(f"step {candidate}: {exc}")
                continue
            self.restored_step = candidate
            self._last = (candidate, None)
            return result
        if failures:
            raise CheckpointError(
                f"no usable checkpoint in {self.directory}: "
                + "; ".join(failures)
                + ". Delete the directory to start over, or restore(step=...) a specific step"
            )
        return None

    # -- writing -------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        force: bool = False,
        shard: int | None = None,
    ) -> bool:
        """Save ``state`` as ``step`` if the save policy (or ``force``) says so; returns whether it saves.

        Every rank calls it. Replicated state is written by rank 0 only; with ``shard=k`` every rank writes
        its own state as shard ``k`` and rank 0 commits once all shards are written. With ``async_save``
        the state is snapshotted before returning and written in the background; the next ``save``,
        ``wait`` or ``close`` re-raises a background failure. After a preemption notice saves are synchronous.
        """
        self._check_open()
        self._raise_finished_error()
        if isinstance(step, bool) or not hasattr(step, "__index__") or operator.index(step) < 0:
            raise ConfigError(f"save(step={step!r}): the step must be an integer >= 0")
        step = operator.index(step)
        if not self._decide(step, force):
            return False
        self.wait()
        dist = collective.torch_dist()
        if shard is not None and self.world_size > 1 and dist is None:
            raise ConfigError(
                "save(shard=...) across processes needs torch.distributed initialised (e.g. "
                "vertexrt.distributed.init_torch()) so the ranks agree on one commit"
            )
        token = storage.new_token()
        if shard is not None:
            token = collective.broadcast(token, dist)
        if shard is None and self.rank != 0:
            self._last = (step, time.time())
            return True
        tree, leaves = serialization.encode(state, allow_pickle=self.allow_pickle)
        nodes = [node for node, _ in leaves]
        clean_metrics = _metrics(metrics)
        self._last = (step, time.time())
        blocking = not self.async_save or (self._notice is not None and self._notice.requested)
        buffers = [enc.data for _, enc in leaves] if blocking else self._snapshot([enc for _, enc in leaves])
        args = (step, tree, nodes, buffers, clean_metrics, token, shard)
        if blocking:
            self._write(*args)
        else:
            self._thread = threading.Thread(
                target=self._background, args=args, name=f"vertexrt-checkpoint-{step}", daemon=False
            )
            self._thread.start()
        return True

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its error if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        self._join_deleter()
        self._raise_error()

    def close(self) -> None:
        """Finish the save in flight, remove the preemption handler and free the snapshot buffer."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._arena = None
            if self._notice is not None:
                self._notice.uninstall()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # do not hide the exception that is already propagating
            self.close()
        except Exception as error:
            log.error("the checkpoint save in flight failed too: %s", error)

    # -- preemption ----------------------------------------------------------------------------------------

    def save_on_preemption(self) -> None:
        """Install a SIGTERM handler that only sets a flag (chaining the previous handler).

        Poll :meth:`preemption_requested` at step boundaries; when True, ``save(step, state, force=True)``
        (synchronous from then on), ``close()`` and exit with status 143 (128 + SIGTERM).
        """
        if self._notice is None:
            self._notice = PreemptionNotice().install()

    def preemption_requested(self) -> bool:
        """True once SIGTERM arrived here or, with torch.distributed, on any rank (all ranks must call it)."""
        local = self._notice is not None and self._notice.requested
        agreed = collective.any_rank(local, collective.torch_dist())
        if agreed and self._notice is not None:
            self._notice.requested = True
        return agreed

    # -- internals -----------------------------------------------------------------------------------------

    def _decide(self, step: int, force: bool) -> bool:
        if force:
            return True
        last_step, last_time = self._last
        decision = bool(
            self.save_policy.should_save(
                step, LastSave(step=last_step, time=last_time, now=time.time(), start_time=self._start)
            )
        )
        if self.world_size > 1 and not _step_only(self.save_policy):
            decision = bool(collective.broadcast(decision, collective.torch_dist()))
        return decision

    def _snapshot(self, encoded: list[Any]) -> list[Any]:
        """Private copies of the leaves that still point at live memory, in one reused buffer."""
        import numpy as np

        need = sum(len(e.data) for e in encoded if not e.owned)
        if self._arena is None or len(self._arena) < need:
            self._arena = None
            self._arena = np.empty(need, dtype=np.uint8)
        out, cursor = [], 0
        for e in encoded:
            if e.owned:
                out.append(e.data)
                continue
            n = len(e.data)
            view = self._arena[cursor : cursor + n]
            np.copyto(view, e.data)
            out.append(view)
            cursor += n
        return out

    def _background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as exc:  # re-raised on the caller's thread
            self._error = exc

    def _write(
        self,
        step: int,
        tree: Any,
        nodes: list[dict[str, Any]],
        buffers: list[Any],
        metrics: dict[str, float],
        token: str,
        shard: int | None,
    ) -> None:
        strategy = self._strategy
        write_dir = strategy.begin(step, token)
        prefix = f"data.{token}.s{0 if shard is None else shard}"
        try:
            files = datafiles.write(
                strategy.store,
                write_dir,
                prefix,
                nodes,
                buffers,
                part_size=strategy.part_size_for(sum(len(b) for b in buffers)),
                threads=strategy.io_threads,
            )
            body = {"shard": shard or 0, "prefix": prefix, "files": files, "tree": tree}
            if shard is None:
                bodies = [body]
            else:
                name = f"shard.{shard:05d}.{token}.json"
                strategy.store.write_atomic(strategy.store.join(write_dir, name), _dumps(body))
                if self.rank != 0:
                    return
                bodies = self._gather_shards(write_dir, token)
            now = time.time()
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "vertexrt_version": _version(),
                "step": step,
                "time": now,
                "metrics": metrics,
                "frameworks": _frameworks(),
                "world_size": self.world_size,
                "sharded": shard is not None,
                "shards": bodies,
            }
            strategy.commit(step, write_dir, _dumps(manifest), token)
        except BaseException as exc:
            if self.rank == 0 or shard is None:
                _quietly(strategy.abort, write_dir, token)
            elif shard is not None:
                failed = strategy.store.join(write_dir, f"shard.{shard:05d}.{token}.failed")
                _quietly(strategy.store.write_atomic, failed, repr(exc).encode())
            if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
                raise
            raise CheckpointError(
                f"saving step {step} to {self.directory} failed: {exc}. Earlier checkpoints are untouched; "
                "check free space / permissions of the checkpoint directory"
            ) from exc
        self._infos[step] = CheckpointInfo(step, now, metrics)
        log.info("checkpoint step %d committed in %s", step, self.directory)
        if self.rank == 0:
            self._join_deleter()
            self._deleter = threading.Thread(
                target=self._retain_logged,
                args=(token, step),
                name="vertexrt-checkpoint-retention",
                daemon=False,
            )
            self._deleter.start()

    def _join_deleter(self) -> None:
        deleter = self._deleter
        if deleter is not None:
            deleter.join()
            if self._deleter is deleter:  # the writer thread may have started a newer one meanwhile
                self._deleter = None

    def _gather_shards(self, write_dir: str, token: str) -> list[dict[str, Any]]:
        import orjson

        store = self._strategy.store
        deadline = time.monotonic() + self.commit_timeout
        delay = 0.01
        while True:
            names = [e.name for e in store.listdir(write_dir) if token in e.name]
            failed = [n for n in names if n.endswith(".failed")]
            if failed:
                raise CheckpointError(f"a rank failed to write its shard in {write_dir}: {failed}")
            done = sorted(n for n in names if n.startswith("shard.") and n.endswith(".json"))
            if len(done) >= self.world_size:
                return [orjson.loads(store.read_bytes(store.join(write_dir, n))) for n in done]
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"only {len(done)} of {self.world_size} shards arrived in {write_dir} within "
                    f"{self.commit_timeout:.0f} s: did every rank call save(..., shard=rank)?"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _retain_logged(self, token: str, saved: int) -> None:
        try:
            self._retain(token, saved)
        except Exception as exc:  # retention must never fail a save that is already committed
            log.warning("applying the keep policy in %s failed: %s", self.directory, exc)

    def _retain(self, token: str, saved: int) -> None:
        """Apply the keep policy; the step just saved and the newest step are always kept."""
        steps = self._strategy.committed_steps()
        if steps and steps[-1] > saved:
            log.warning(
                "saved step %d in %s, but step %d is newer: restore() returns the newest step, so delete the "
                "newer steps if training was rolled back",
                saved,
                self.directory,
                steps[-1],
            )
        if len(steps) <= 1:
            return
        infos = []
        for step in steps:
            info = self._infos.get(step)
            if info is None:
                try:
                    manifest = self._manifest(step)
                    info = CheckpointInfo(step, float(manifest["time"]), manifest.get("metrics") or {})
                except CheckpointError:
                    info = CheckpointInfo(step, 0.0, {})
                self._infos[step] = info
            infos.append(info)
        keep = self.keep_policy.keep(infos)
        for info, kept in zip(infos[:-1], keep[:-1], strict=True):  # the newest is always kept
            if not kept and info.step != saved:
                try:
                    self._strategy.delete(info.step, token)
                    self._infos.pop(info.step, None)
                    log.info("deleted checkpoint step %d (keep policy)", info.step)
                except Exception as exc:
                    log.warning(
                        "could not delete checkpoint step %d in %s: %s", info.step, self.directory, exc
                    )

    def _manifest(self, step: int) -> dict[str, Any]:
        import orjson

        name = self._strategy.store.join(self._strategy.step_dir(step), storage.MANIFEST)
        try:
            manifest = orjson.loads(self._strategy.read_manifest(step))
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"manifest {name} disappeared (deleted by another writer?)", file=name
            )
        except orjson.JSONDecodeError as exc:
            raise CheckpointCorruptError(f"manifest {name} is not valid JSON: {exc}", file=name) from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointCorruptError(f"{name} is not a vertexrt checkpoint manifest", file=name)
        version = manifest.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(
                f"{name} has checkpoint format version {version!r}, written by vertexrt "
                f"{manifest.get('vertexrt_version')}; this vertexrt ({_version()}) reads up to version "
                f"{FORMAT_VERSION}: upgrade vertexrt to restore it"
            )
        return manifest  # type: ignore[no-any-return]

    def _check_files(self, step: int, manifest: dict[str, Any]) -> None:
        directory = self._strategy.step_dir(step)
        present = {e.name: e.size for e in self._strategy.store.listdir(directory)}
        for body in manifest["shards"]:
            for name, size in body["files"].items():
                if present.get(name) != size:
                    path = self._strategy.store.join(directory, name)
                    what = "is missing" if name not in present else f"has {present[name]} bytes, not {size}"
                    raise CheckpointCorruptError(f"data file {path} {what}", file=path)

    def _restore_step(self, step: int, target: Any, shard: int | None) -> Any:
        manifest = self._manifest(step)
        bodies = manifest["shards"]
        if manifest.get("sharded"):
            wanted = self.rank if shard is None else shard
            chosen = [b for b in bodies if b["shard"] == wanted]
            if not chosen:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} has shards "
                    f"{sorted(b['shard'] for b in bodies)}, not {wanted}: restore(shard=...) one of them"
                )
            body = chosen[0]
        else:
            body = bodies[0]
        from vertexrt.checkpoint import adapters

        nodes = serialization.leaf_nodes(body["tree"])
        for node in nodes:
            if node["t"] == "pickle" and not self.allow_pickle:
                raise CheckpointError(
                    f"checkpoint step {step} holds a pickled {node.get('type')}; pass allow_pickle=True to "
                    "the CheckpointManager if you trust this checkpoint"
                )
        buffers = datafiles.read(
            self._strategy.store,
            self._strategy.step_dir(step),
            body["prefix"],
            body["files"],
            nodes,
            threads=self._strategy.io_threads,
            use_mmap=self._strategy.mmap_reads,
        )
        by_node = {id(node): buffer for node, buffer in zip(nodes, buffers, strict=True)}
        values = lambda node: adapters.value(node["t"], node, by_node[id(node)])
        if target is None:
            return serialization.decode(body["tree"], values)
        return serialization.decode(body["tree"], values, target)

    def _raise_finished_error(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager for {self.directory} is closed")


def _step_only(policy: Any) -> bool:
    if isinstance(policy, AnySave):
        return all(_step_only(p) for p in policy.policies)
    return isinstance(policy, EveryNSteps)


def _metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    out = {}
    for key, value in (metrics or {}).items():
        try:
            out[str(key)] = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError):
            raise CheckpointError(f"metrics[{key!r}] = {value!r} is not a number") from None
    return out


def _frameworks() -> dict[str, str]:
    found = {}
    for name in ("torch", "tensorflow", "keras", "numpy"):
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None)
        if isinstance(version, str):
            found[name] = version
    return found


def _version() -> str:
    from vertexrt import __version__

    return __version__


def _dumps(value: Any) -> bytes:
    import orjson

    return bytes(orjson.dumps(value))


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:
        log.debug("cleanup after a failed save: %s", exc)
