"""A standalone worker process for the fuzzer: the real Worker service, registered with no controller, printing
its address and secret so that the fuzzer can hold every worker credential (the execute token, capabilities)
and reach the decoders and handlers behind them, Execute included. It exits when its parent does."""

from __future__ import annotations

import json
import os
import sys
import threading

import torch

from dtorch_protocol.process import watch_parent
from dtorch_worker.server import start_worker

if __name__ == "__main__":
    torch.set_num_threads(1)
    worker = start_worker(max_put_bytes=256 << 20, input_timeout_s=0.2, pull_timeout_s=0.5)
    print(json.dumps({"address": worker.address, "secret": worker.credentials.secret, "pid": os.getpid()}),
          flush=True)
    done = threading.Event()
    watch_parent(int(sys.argv[1]), done.set)
    done.wait()
    os._exit(0)
