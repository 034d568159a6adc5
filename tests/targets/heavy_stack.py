"""Stands in for a heavy stack (sglang's import is ~11 s of CPU per process): slow to import, and it
says where it was imported, so a test can count the processes that paid for it."""

from __future__ import annotations

import os
import time

IMPORT_SECONDS = 1.0
LOG_ENV = "PARITY_TEST_IMPORT_LOG"

time.sleep(IMPORT_SECONDS)
if os.environ.get(LOG_ENV):
    with open(os.environ[LOG_ENV], "a") as log:
        log.write(f"{os.getpid()}\n")
