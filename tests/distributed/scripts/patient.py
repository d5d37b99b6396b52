"""A replica that logs at INFO and then runs a framework's multi-worker check: ``patient.py torch|tf``."""

import logging
import runpy
import sys
from pathlib import Path

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
here = Path(__file__).parent
if sys.argv[1] == "torch":
    runpy.run_path(str(here / "torch_allreduce.py"), run_name="__main__")
else:
    sys.argv = [str(here / "tf_train.py"), "ctl"]
    runpy.run_path(sys.argv[0], run_name="__main__")
