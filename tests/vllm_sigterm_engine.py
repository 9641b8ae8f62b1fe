"""An engine process for shutdown tests: vllm_engine's Engine (vLLM's real scheduler and the worker connector
over CPU KV) saves request A, prints "saved", then idles. SIGTERM is handled as vLLM's worker process handles
it (multiproc_executor.worker_main: SystemExit once), and the shutdown that follows calls what vLLM's worker
calls (gpu_worker.Worker.shutdown: vllm.distributed.kv_transfer.ensure_kv_transfer_shutdown).

    python vllm_sigterm_engine.py MODEL_DIR EXTRA_CONFIG_JSON
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402

from vllm_engine import Engine, save_a_then_drop_hbm, vllm_config  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model, extra = sys.argv[1], json.loads(sys.argv[2])
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:  # vLLM raises SystemExit once, so its own shutdown runs uninterrupted
            stopping = True
            raise SystemExit()

    signal.signal(signal.SIGTERM, on_signal)
    eng = Engine(vllm_config(model, extra))
    kv_transfer_state._KV_CONNECTOR_AGENT = eng.workers[0]  # as vLLM's worker holds its connector
    try:
        save_a_then_drop_hbm(eng)
        print("saved", flush=True)
        while True:
            time.sleep(0.05)
    finally:
        kv_transfer_state.ensure_kv_transfer_shutdown()
        eng.scheduler.connector.shutdown()


if __name__ == "__main__":
    main()
