"""One of two gloo ranks reporting a metric: ``hypertune_rank.py RANK PORT DIR`` prints whether this rank's
report was written (to ``DIR/rank<RANK>/output.metrics``)."""

import os
import sys

import torch.distributed as dist
from rank_exit import exit_after

from vertexrt import hypertune


def main() -> None:
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
    os.environ["CLOUD_ML_HP_METRIC_FILE"] = os.path.join(sys.argv[3], f"rank{rank}", "output.metrics")
    print(hypertune.report("accuracy", 0.5 + rank, step=1))
    dist.barrier()
    dist.destroy_process_group()


exit_after(main)
