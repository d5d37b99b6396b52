"""DCP's storage plugin over a vertexrt step: a ``StorageWriter``, a ``StorageReader``, a safe load planner.

The writer puts each rank's items into the step's part files through the step writer and has rank 0 commit
the step with DCP's metadata in the manifest; the reader reads the located leaves of a verified step (CRC32C
checked) into DCP's load plan; the planner unpickles non-tensor values with ``weights_only=True``. The classes
are made on first use, so importing this module does not import torch::

    writer = writer_class()(site, step, write_dir, token, metrics, overwrite)
    torch.distributed.checkpoint.save(state_dict, storage_writer=writer)
    reader = reader_class()(site, step, manifest, metadata)
    torch.distributed.checkpoint.load(state_dict, storage_reader=reader, planner=safe_planner())
"""

from __future__ import annotations

import io
from typing import Any

from vertexrt.checkpoint import datafiles, step_writer, storage
from vertexrt.checkpoint.dcp_metadata import KEY, encode_metadata
from vertexrt.checkpoint.step_writer import Site
from vertexrt.distributed import collectives
from vertexrt.errors import CheckpointCorruptError


def _tensor_bytes(tensor: Any) -> Any:
    """The bytes of a tensor (any device, view or not, lazily conjugated or not) as a 1-D uint8 array."""
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(__import__("torch").uint8).numpy()


def writer_class() -> type:
    """DCP's ``StorageWriter`` over one step of a vertexrt strategy (defined when torch is imported)."""
    from torch.distributed.checkpoint import StorageWriter
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class Writer(StorageWriter):
        def __init__(
            self,
            site: Site,
            step: int,
            write_dir: str,
            token: str,
            metrics: dict[str, float],
            overwrite: bool,
        ) -> None:
            self.site, self.step, self.write_dir, self.token = site, step, write_dir, token
            self.metrics, self.overwrite = metrics, overwrite
            self.replaced: bytes | None = None
            self.manifest: dict[str, Any] = {}
            self.bodies: list[dict[str, Any]] | None = None  # rank 0: every rank's body, gathered
            self.rank = 0

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.rank = self.site.rank

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def write_data(self, plan: Any, planner: Any) -> Any:
            buffers: list[Any] = []
            nodes: list[dict[str, Any]] = []
            described: list[dict[str, Any]] = []
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buffers.append(__import__("numpy").frombuffer(data.getvalue(), dtype="uint8"))
                    described.append({"t": "bytes"})
                else:
                    buffers.append(_tensor_bytes(data))
                    described.append(
                        {
                            "t": "tensor",
                            "dtype": str(data.dtype).removeprefix("torch."),
                            "shape": list(data.shape),
                        }
                    )
                offset = item.index.offset
                nodes.append({"t": "bytes", "of": [item.index.fqn, None if offset is None else list(offset)]})
            body, error = None, None
            try:
                tree = {"t": "list", "v": nodes}
                body = step_writer.write_shard(
                    self.site, self.write_dir, self.token, self.rank, nodes, buffers, tree
                )
            except Exception as exc:  # still in the gather below: every rank reaches it
                error = exc
            self.bodies = step_writer.gather_shards(self.site, body, error, dist=collectives.torch_dist())
            if error is not None:
                raise error
            results = [
                WriteResult(
                    index=item.index,
                    size_in_bytes=len(buf),
                    storage_data={"shard": self.rank, "leaf": i, **d},
                )
                for i, (item, buf, d) in enumerate(zip(plan.items, buffers, described, strict=True))
            ]
            future: Future[list[WriteResult]] = Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            assert self.bodies is not None  # the coordinator is rank 0, which gathered every body
            metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
            self.manifest, self.replaced = step_writer.commit(
                self.site,
                self.step,
                self.write_dir,
                self.token,
                bodies=self.bodies,
                sharded=True,
                metrics=self.metrics,
                overwrite=self.overwrite,
                extra={KEY: encode_metadata(metadata)},
            )

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return Writer


def manifest_name(site: Site, step: int) -> str:
    return str(site.strategy.store.join(site.strategy.step_dir(step), storage.MANIFEST))


def safe_planner() -> Any:
    """DCP's default load planner, but non-tensor values are unpickled with ``weights_only=True``."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


def reader_class() -> type:
    """DCP's ``StorageReader`` over one verified step (defined when torch is imported)."""
    import torch
    from torch.distributed.checkpoint import StorageReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class Reader(StorageReader):
        def __init__(self, site: Site, step: int, manifest: dict[str, Any], metadata: Any) -> None:
            self.site, self.step, self.manifest, self.metadata = site, step, manifest, metadata

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.metadata

        def set_up_storage_reader(
            self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
        ) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def read_data(self, plan: Any, planner: Any) -> Any:
            strategy = self.site.strategy
            name = manifest_name(self.site, self.step)
            bodies = {b["shard"]: b for b in self.manifest["shards"]}
            wanted: dict[int, dict[int, Any]] = {}
            for req in plan.items:
                where = self.metadata.storage_data.get(req.storage_index)
                if where is None:
                    raise CheckpointCorruptError(
                        f"manifest {name} does not locate {req.storage_index.fqn}", file=name
                    )
                wanted.setdefault(where["shard"], {})[where["leaf"]] = None
            buffers: dict[tuple[int, int], Any] = {}
            for shard, leaves in wanted.items():
                body = bodies[shard]
                nodes = body["tree"]["v"]
                order = sorted(leaves)
                got = datafiles.read(
                    strategy.store,
                    strategy.step_dir(self.step),
                    body["prefix"],
                    body["files"],
                    [nodes[i] for i in order],
                    threads=strategy.io_threads,
                    use_mmap=strategy.mmap_reads,
                )
                buffers.update({(shard, i): buf for i, buf in zip(order, got, strict=True)})
            for req in plan.items:
                where = self.metadata.storage_data[req.storage_index]
                data = buffers[(where["shard"], where["leaf"])]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(bytes(data)))
                    continue
                stored = (
                    torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    if len(data)
                    else torch.empty(0, dtype=torch.uint8)
                )
                stored = stored.view(where["dtype"]).reshape(where["shape"])
                for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    stored = stored.narrow(dim, offset, length)
                dest = planner.resolve_tensor(req).detach()
                if dest.size() != stored.size():
                    raise CheckpointCorruptError(
                        f"manifest {name}: {req.storage_index.fqn} has shape {list(stored.size())}, "
                        f"the target expects {list(dest.size())}",
                        file=name,
                    )
                dest.copy_(stored)
                planner.commit_tensor(req, dest)
            future: Future[None] = Future()
            future.set_result(None)
            return future

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return Reader
